//! The native out-of-band protocol between two `ibvx-pingpong` processes.
//!
//! Over the TCP connection each side first writes the 16-byte [`MAGIC`]
//! (which also carries the protocol version), then frames: one byte of
//! kind, a big-endian `u32` payload length (at most [`MAX_PAYLOAD`]), and the
//! payload. Integers are big-endian, floats are IEEE-754 bits big-endian.
//!
//! | kind | frame | payload |
//! |------|-------|---------|
//! | 1 | [`Hello`] | test, flags, size, iterations, MTU, window, then the endpoint: LID, QPN, PSN, GID, rkey, address and length of the region peers write |
//! | 2 | `Reject` | UTF-8 reason (why the server refuses the run) |
//! | 3 | `Sync` | `u32` tag: both sides reached the same point |
//! | 4 | [`BwReport`] | the client's bandwidth result for one size |
//! | 5 | `Bye` | empty: orderly end |
//!
//! The client writes first: magic and `Hello`. The server compares the
//! client's `Hello` with its own options and answers with a `Reject` naming
//! every difference, or with its magic and `Hello`. Then both connect their
//! QPs and exchange `Sync` frames (client first) before each size; the
//! bandwidth client sends a `BwReport` after each size; both end with `Bye`.
//! Decoding checks every length and value and never panics.

use std::fmt;

use super::options::TestKind;

/// The first 16 bytes each side sends: name and protocol version 1.
pub const MAGIC: [u8; 16] = *b"ibvx-pingpong/1\0";

/// Largest payload a frame may carry.
pub const MAX_PAYLOAD: u32 = 4096;

/// Size of a frame header (kind + length).
pub const HEADER_LEN: usize = 5;

/// The region a peer RDMA-writes into, and where this side's QP is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Endpoint {
    /// LID (0 on RoCE).
    pub lid: u16,
    /// QP number.
    pub qpn: u32,
    /// First send PSN.
    pub psn: u32,
    /// GID (all zeros when no GRH is used).
    pub gid: [u8; 16],
    /// Remote key of the writable region (0 if none).
    pub rkey: u32,
    /// Address of the writable region.
    pub addr: u64,
    /// Length of the writable region.
    pub len: u64,
}

/// One side's test parameters and endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// The test.
    pub test: TestKind,
    /// `--all`.
    pub all: bool,
    /// `--check`.
    pub check: bool,
    /// Message size (0 with `all`).
    pub size: u64,
    /// Iterations per size.
    pub iters: u64,
    /// Requested MTU in bytes, 0 = the port's active MTU.
    pub mtu_requested: u16,
    /// The port's active MTU in bytes.
    pub mtu_active: u16,
    /// Outstanding writes (bandwidth test).
    pub window: u32,
    /// Where this side is.
    pub endpoint: Endpoint,
}

/// A bandwidth result, sent by the client to the server after each size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BwReport {
    /// Message size.
    pub size: u64,
    /// Iterations.
    pub iters: u64,
    /// Peak bandwidth, MiB/s.
    pub peak: f64,
    /// Average bandwidth, MiB/s.
    pub avg: f64,
    /// Message rate, millions per second.
    pub msg_rate: f64,
}

/// A frame.
#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    /// Parameters and endpoint.
    Hello(Hello),
    /// The server refuses the run.
    Reject(String),
    /// Synchronization point.
    Sync(u32),
    /// Bandwidth result.
    BwReport(BwReport),
    /// End.
    Bye,
}

const HELLO: u8 = 1;
const REJECT: u8 = 2;
const SYNC: u8 = 3;
const BW_REPORT: u8 = 4;
const BYE: u8 = 5;

const HELLO_LEN: usize = 1 + 1 + 8 + 8 + 2 + 2 + 4 + 2 + 4 + 4 + 16 + 4 + 8 + 8;
const BW_REPORT_LEN: usize = 5 * 8;
const MAX_REASON: usize = 1024;

/// Why bytes are not a valid frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireError {
    /// More bytes are needed (the frame is cut short).
    Incomplete,
    /// Unknown frame kind.
    Kind(u8),
    /// Payload length not allowed for the kind (or above [`MAX_PAYLOAD`]).
    Length {
        /// Frame kind.
        kind: u8,
        /// Announced length.
        len: u32,
    },
    /// A field holds an invalid value.
    Field(&'static str),
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::Incomplete => f.write_str("truncated frame"),
            WireError::Kind(k) => write!(f, "unknown frame kind {k}"),
            WireError::Length { kind, len } => write!(f, "frame kind {kind} with bad length {len}"),
            WireError::Field(name) => write!(f, "invalid {name}"),
        }
    }
}

impl std::error::Error for WireError {}

impl Message {
    /// Short name, for error messages.
    pub fn name(&self) -> &'static str {
        match self {
            Message::Hello(_) => "Hello",
            Message::Reject(_) => "Reject",
            Message::Sync(_) => "Sync",
            Message::BwReport(_) => "BwReport",
            Message::Bye => "Bye",
        }
    }

    /// The frame bytes (header and payload).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_LEN + HELLO_LEN);
        self.encode_into(&mut out);
        out
    }

    /// Appends the frame bytes to `out` (the payload is written in place,
    /// then its length into the header).
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        let start = out.len();
        out.extend_from_slice(&[0; HEADER_LEN]);
        let kind = match self {
            Message::Hello(h) => {
                let e = &h.endpoint;
                out.push(h.test.code());
                out.push(u8::from(h.all) | u8::from(h.check) << 1);
                out.extend_from_slice(&h.size.to_be_bytes());
                out.extend_from_slice(&h.iters.to_be_bytes());
                out.extend_from_slice(&h.mtu_requested.to_be_bytes());
                out.extend_from_slice(&h.mtu_active.to_be_bytes());
                out.extend_from_slice(&h.window.to_be_bytes());
                out.extend_from_slice(&e.lid.to_be_bytes());
                out.extend_from_slice(&e.qpn.to_be_bytes());
                out.extend_from_slice(&e.psn.to_be_bytes());
                out.extend_from_slice(&e.gid);
                out.extend_from_slice(&e.rkey.to_be_bytes());
                out.extend_from_slice(&e.addr.to_be_bytes());
                out.extend_from_slice(&e.len.to_be_bytes());
                HELLO
            }
            Message::Reject(reason) => {
                let mut end = reason.len().min(MAX_REASON);
                while !reason.is_char_boundary(end) {
                    end -= 1;
                }
                out.extend_from_slice(&reason.as_bytes()[..end]);
                REJECT
            }
            Message::Sync(tag) => {
                out.extend_from_slice(&tag.to_be_bytes());
                SYNC
            }
            Message::BwReport(r) => {
                out.extend_from_slice(&r.size.to_be_bytes());
                out.extend_from_slice(&r.iters.to_be_bytes());
                out.extend_from_slice(&r.peak.to_bits().to_be_bytes());
                out.extend_from_slice(&r.avg.to_bits().to_be_bytes());
                out.extend_from_slice(&r.msg_rate.to_bits().to_be_bytes());
                BW_REPORT
            }
            Message::Bye => BYE,
        };
        let len = (out.len() - start - HEADER_LEN) as u32;
        out[start] = kind;
        out[start + 1..start + HEADER_LEN].copy_from_slice(&len.to_be_bytes());
    }

    /// Decodes a frame header: kind and payload length, checked against the
    /// kind's allowed lengths.
    pub fn decode_header(h: &[u8]) -> Result<(u8, u32), WireError> {
        let h: &[u8; HEADER_LEN] = h
            .get(..HEADER_LEN)
            .and_then(|s| s.try_into().ok())
            .ok_or(WireError::Incomplete)?;
        let kind = h[0];
        let len = u32::from_be_bytes([h[1], h[2], h[3], h[4]]);
        let ok = match kind {
            HELLO => len as usize == HELLO_LEN,
            REJECT => len as usize <= MAX_REASON,
            SYNC => len == 4,
            BW_REPORT => len as usize == BW_REPORT_LEN,
            BYE => len == 0,
            k => return Err(WireError::Kind(k)),
        };
        if !ok || len > MAX_PAYLOAD {
            return Err(WireError::Length { kind, len });
        }
        Ok((kind, len))
    }

    /// Decodes the payload of a frame of `kind`.
    pub fn decode_payload(kind: u8, p: &[u8]) -> Result<Message, WireError> {
        let mut r = Reader(p);
        let m = match kind {
            HELLO => {
                let test = TestKind::from_code(r.u8()?).ok_or(WireError::Field("test"))?;
                let flags = r.u8()?;
                if flags & !3 != 0 {
                    return Err(WireError::Field("flags"));
                }
                let h = Hello {
                    test,
                    all: flags & 1 != 0,
                    check: flags & 2 != 0,
                    size: r.u64()?,
                    iters: r.u64()?,
                    mtu_requested: r.u16()?,
                    mtu_active: r.u16()?,
                    window: r.u32()?,
                    endpoint: Endpoint {
                        lid: r.u16()?,
                        qpn: r.u32()?,
                        psn: r.u32()?,
                        gid: r.array()?,
                        rkey: r.u32()?,
                        addr: r.u64()?,
                        len: r.u64()?,
                    },
                };
                if h.endpoint.qpn > 0xff_ffff || h.endpoint.psn > 0xff_ffff {
                    return Err(WireError::Field("QPN or PSN (24 bits)"));
                }
                Message::Hello(h)
            }
            REJECT => Message::Reject(
                String::from_utf8(r.rest().to_vec()).map_err(|_| WireError::Field("reason"))?,
            ),
            SYNC => Message::Sync(r.u32()?),
            BW_REPORT => Message::BwReport(BwReport {
                size: r.u64()?,
                iters: r.u64()?,
                peak: f64::from_bits(r.u64()?),
                avg: f64::from_bits(r.u64()?),
                msg_rate: f64::from_bits(r.u64()?),
            }),
            BYE => Message::Bye,
            k => return Err(WireError::Kind(k)),
        };
        if !r.0.is_empty() {
            return Err(WireError::Length {
                kind,
                len: p.len() as u32,
            });
        }
        Ok(m)
    }

    /// Decodes one frame from the start of `buf`; returns it and the number
    /// of bytes used.
    pub fn decode(buf: &[u8]) -> Result<(Message, usize), WireError> {
        let (kind, len) = Self::decode_header(buf)?;
        let end = HEADER_LEN + len as usize;
        let payload = buf.get(HEADER_LEN..end).ok_or(WireError::Incomplete)?;
        Ok((Self::decode_payload(kind, payload)?, end))
    }
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        if self.0.len() < N {
            return Err(WireError::Incomplete);
        }
        let (a, b) = self.0.split_at(N);
        self.0 = b;
        Ok(a.try_into().expect("split at N"))
    }
    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, WireError> {
        Ok(u16::from_be_bytes(self.take()?))
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_be_bytes(self.take()?))
    }
    fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_be_bytes(self.take()?))
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        self.take()
    }
    fn rest(&mut self) -> &[u8] {
        std::mem::take(&mut self.0)
    }
}

/// The differences between the server's and the client's parameters that
/// make a run impossible, as one line (`None` when they agree).
pub fn mismatch(server: &Hello, client: &Hello) -> Option<String> {
    fn size(h: &Hello) -> String {
        if h.all {
            "--all".into()
        } else {
            h.size.to_string()
        }
    }
    fn mtu(m: u16) -> String {
        if m == 0 {
            "port default".into()
        } else {
            m.to_string()
        }
    }
    let mut diffs = Vec::new();
    let mut diff = |what: &str, s: String, c: String| {
        if s != c {
            diffs.push(format!("{what}: server {s}, client {c}"));
        }
    };
    diff("test", server.test.to_string(), client.test.to_string());
    diff("size", size(server), size(client));
    diff(
        "iterations",
        server.iters.to_string(),
        client.iters.to_string(),
    );
    diff("mtu", mtu(server.mtu_requested), mtu(client.mtu_requested));
    let check = |h: &Hello| if h.check { "on" } else { "off" }.to_string();
    diff("data check (-c)", check(server), check(client));
    (!diffs.is_empty()).then(|| {
        format!(
            "options differ between server and client: {}",
            diffs.join("; ")
        )
    })
}

#[cfg(test)]
mod tests;
