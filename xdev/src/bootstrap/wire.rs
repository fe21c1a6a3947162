//! The bootstrap wire format: length-prefixed frames and their strict,
//! bounded decoder.
//!
//! This module is what travels on a bootstrap TCP connection and nothing else:
//! it knows no sockets beyond `Read`/`Write`, holds no state and makes no
//! policy decisions (those live in the server and the client). It is public so
//! that tools and tests can speak or check the protocol; the format is
//! versioned by [`PROTOCOL_VERSION`].
//!
//! # Frames
//!
//! ```text
//! frame   = len:u32le body            (1 <= len <= the reader's limit)
//! body    = opcode:u8 fields...       (fields in the order of the Message variant)
//! u16/u32 = little endian
//! str     = len:u16le bytes           (UTF-8; keys <= MAX_KEY_LEN, job <= MAX_JOB_LEN,
//!                                      texts <= MAX_TEXT_LEN)
//! bytes   = len:u32le bytes           (<= MAX_VALUE_LEN)
//! bool    = u8, 0 or 1
//! nonce/mac = 32 raw bytes
//! ```
//!
//! Decoding is strict: an unknown opcode, a field running past the frame, bytes
//! left over after the last field, a length above its limit, invalid UTF-8 or a
//! boolean other than 0/1 is a protocol violation. So a decoded message always
//! re-encodes to exactly the bytes it came from. The length prefix is checked
//! against the limit *before* anything is allocated, so a hostile length costs
//! nothing; a frame body is allocated only once its length is known to be
//! within the limit ([`MAX_FRAME_LEN`] for an authenticated peer,
//! [`MAX_HANDSHAKE_FRAME_LEN`] before authentication), and grows with the
//! bytes actually received (from 64 KiB, doubling), never beyond the
//! announced length.

use std::io::{self, Read, Write};

use crate::{Error, Rank, Result};

/// Version of the protocol, exchanged in the handshake; peers of different
/// versions refuse each other.
pub const PROTOCOL_VERSION: u16 = 1;
/// Longest key accepted by [`put`](super::Bootstrap::put) and
/// [`get`](super::Bootstrap::get), in bytes of UTF-8.
pub const MAX_KEY_LEN: usize = 256;
/// Longest job identity, in bytes of UTF-8.
pub const MAX_JOB_LEN: usize = 256;
/// Longest value (a `put` value or an `allgather` contribution): 1 MiB.
pub const MAX_VALUE_LEN: usize = 1 << 20;
/// Longest human-readable text (refusal and failure reasons); longer texts
/// are cut at a character boundary when encoded.
pub const MAX_TEXT_LEN: usize = 1024;
/// Largest frame body accepted from an authenticated peer: the largest value
/// plus room for the opcode, ids, a key and the length fields.
pub const MAX_FRAME_LEN: usize = MAX_VALUE_LEN + 1024;
/// Largest frame body accepted before authentication completes (the
/// handshake messages are a few hundred bytes at most).
pub const MAX_HANDSHAKE_FRAME_LEN: usize = 2048;
/// First allocation for a frame body being read; larger bodies grow as their
/// bytes arrive.
const INITIAL_BODY: usize = 64 * 1024;
/// Length of handshake nonces.
pub const NONCE_LEN: usize = 32;
/// Length of an HMAC-SHA256 tag.
pub const MAC_LEN: usize = 32;

/// What a failed request failed with, as carried by [`Message::Failed`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureKind {
    /// Maps to [`Error::ResourceExhausted`].
    ResourceExhausted,
    /// Maps to [`Error::PeerLost`] (the failure's rank is the lost one).
    PeerLost,
    /// Maps to [`Error::Protocol`] (the failure's rank is the offender).
    Protocol,
    /// Maps to [`Error::Config`].
    Config,
}

impl FailureKind {
    fn code(self) -> u8 {
        match self {
            FailureKind::ResourceExhausted => 1,
            FailureKind::PeerLost => 2,
            FailureKind::Protocol => 3,
            FailureKind::Config => 4,
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => FailureKind::ResourceExhausted,
            2 => FailureKind::PeerLost,
            3 => FailureKind::Protocol,
            4 => FailureKind::Config,
            _ => return None,
        })
    }
}

/// Why the service failed a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    /// Which error it maps to.
    pub kind: FailureKind,
    /// The rank concerned (the lost or offending rank), if any.
    pub rank: u32,
    /// Human-readable detail.
    pub text: String,
}

impl Failure {
    /// The [`Error`] this failure stands for.
    pub fn into_error(self) -> Error {
        match self.kind {
            FailureKind::ResourceExhausted => Error::ResourceExhausted(self.text),
            FailureKind::PeerLost => Error::PeerLost {
                rank: self.rank as Rank,
                reason: self.text,
            },
            FailureKind::Protocol => Error::Protocol {
                rank: self.rank as Rank,
                what: self.text,
            },
            FailureKind::Config => Error::Config(self.text),
        }
    }
}

/// One protocol message. Handshake messages come first on a connection
/// (`Challenge`, `Auth`, then `Welcome` or `Refused`); afterwards the client
/// sends requests carrying an id of its choosing and the service answers each
/// with `Done`, `Value`, `Gathered` frames or `Failed` under the same id, and
/// sends `Departed` notices at any time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// Service → client, first frame: protocol version and a fresh nonce.
    Challenge {
        /// The service's protocol version.
        version: u16,
        /// Fresh random nonce the client must MAC.
        nonce: [u8; NONCE_LEN],
    },
    /// Client → service: the claimed identity and its proof of the secret.
    Auth {
        /// The client's protocol version.
        version: u16,
        /// Claimed rank.
        rank: u32,
        /// The job size the client believes in.
        size: u32,
        /// Fresh random client nonce (the service MACs it back).
        nonce: [u8; NONCE_LEN],
        /// HMAC-SHA256 under the job secret, see `super::auth`.
        mac: [u8; MAC_LEN],
        /// The job identity the client believes in.
        job: String,
    },
    /// Service → client: accepted; the MAC proves the service knows the
    /// secret too.
    Welcome {
        /// HMAC-SHA256 under the job secret over both nonces and the identity.
        mac: [u8; MAC_LEN],
    },
    /// Service → client: not accepted; the connection closes.
    Refused {
        /// Why.
        reason: String,
    },
    /// Store `value` under `key` (replacing any earlier value); answered by `Done`.
    Put {
        /// Request id.
        id: u32,
        /// Key.
        key: String,
        /// Value.
        value: Vec<u8>,
    },
    /// Fetch `key`, waiting until some rank puts it; answered by `Value`.
    Get {
        /// Request id.
        id: u32,
        /// Key.
        key: String,
    },
    /// Withdraw a waiting `Get` (the client gave up); never answered.
    Cancel {
        /// Id of the `Get` to withdraw.
        id: u32,
    },
    /// Enter a barrier; answered by `Done` once every rank has entered.
    Barrier {
        /// Request id.
        id: u32,
    },
    /// Contribute to an allgather; answered by one `Gathered` per rank.
    Allgather {
        /// Request id.
        id: u32,
        /// This rank's contribution.
        value: Vec<u8>,
    },
    /// The client is leaving on purpose (a clean departure).
    Goodbye,
    /// A `Put` or `Barrier` completed.
    Done {
        /// Request id.
        id: u32,
    },
    /// The answer to a `Get`.
    Value {
        /// Request id.
        id: u32,
        /// The stored value.
        value: Vec<u8>,
    },
    /// One rank's contribution to a completed allgather.
    Gathered {
        /// Request id.
        id: u32,
        /// Whose contribution this is.
        index: u32,
        /// How many contributions there are (the job size).
        count: u32,
        /// The contribution.
        value: Vec<u8>,
    },
    /// A request failed.
    Failed {
        /// Request id.
        id: u32,
        /// Why.
        failure: Failure,
    },
    /// Notice: a rank's bootstrap connection closed.
    Departed {
        /// The rank.
        rank: u32,
        /// Whether it said `Goodbye` first (a clean exit rather than a death
        /// or a dropped connection).
        clean: bool,
    },
}

mod op {
    pub const CHALLENGE: u8 = 0x01;
    pub const AUTH: u8 = 0x02;
    pub const WELCOME: u8 = 0x03;
    pub const REFUSED: u8 = 0x04;
    pub const PUT: u8 = 0x10;
    pub const GET: u8 = 0x11;
    pub const CANCEL: u8 = 0x12;
    pub const BARRIER: u8 = 0x13;
    pub const ALLGATHER: u8 = 0x14;
    pub const GOODBYE: u8 = 0x15;
    pub const DONE: u8 = 0x20;
    pub const VALUE: u8 = 0x21;
    pub const GATHERED: u8 = 0x22;
    pub const FAILED: u8 = 0x23;
    pub const DEPARTED: u8 = 0x30;
}

impl Message {
    /// A short name for error messages.
    pub fn name(&self) -> &'static str {
        match self {
            Message::Challenge { .. } => "Challenge",
            Message::Auth { .. } => "Auth",
            Message::Welcome { .. } => "Welcome",
            Message::Refused { .. } => "Refused",
            Message::Put { .. } => "Put",
            Message::Get { .. } => "Get",
            Message::Cancel { .. } => "Cancel",
            Message::Barrier { .. } => "Barrier",
            Message::Allgather { .. } => "Allgather",
            Message::Goodbye => "Goodbye",
            Message::Done { .. } => "Done",
            Message::Value { .. } => "Value",
            Message::Gathered { .. } => "Gathered",
            Message::Failed { .. } => "Failed",
            Message::Departed { .. } => "Departed",
        }
    }
}

/// Builds one frame: reserves the length prefix, lets the caller append the
/// body, then fills the prefix in.
struct FrameBuf(Vec<u8>);

impl FrameBuf {
    fn new(opcode: u8, capacity: usize) -> Self {
        let mut v = Vec::with_capacity(5 + capacity);
        v.extend_from_slice(&[0; 4]);
        v.push(opcode);
        FrameBuf(v)
    }
    fn u8(&mut self, x: u8) -> &mut Self {
        self.0.push(x);
        self
    }
    fn u16(&mut self, x: u16) -> &mut Self {
        self.0.extend_from_slice(&x.to_le_bytes());
        self
    }
    fn u32(&mut self, x: u32) -> &mut Self {
        self.0.extend_from_slice(&x.to_le_bytes());
        self
    }
    fn raw(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
    fn str(&mut self, s: &str) -> &mut Self {
        // Callers have checked the length against a limit below u16::MAX.
        self.u16(s.len() as u16).raw(s.as_bytes())
    }
    fn bytes(&mut self, b: &[u8]) -> &mut Self {
        // Callers have checked the length against MAX_VALUE_LEN.
        self.u32(b.len() as u32).raw(b)
    }
    fn finish(self) -> Vec<u8> {
        self.finish_with_payload(0)
    }
    /// Fills in the length prefix for a frame whose last `payload` bytes
    /// will be written separately.
    fn finish_with_payload(mut self, payload: usize) -> Vec<u8> {
        let len = (self.0.len() - 4 + payload) as u32;
        self.0[..4].copy_from_slice(&len.to_le_bytes());
        self.0
    }
}

fn check_key(key: &str) -> Result<()> {
    if key.len() > MAX_KEY_LEN {
        return Err(Error::Config(format!(
            "bootstrap key of {} bytes is longer than the limit of {MAX_KEY_LEN}",
            key.len()
        )));
    }
    Ok(())
}

fn check_len(len: usize) -> Result<()> {
    if len > MAX_VALUE_LEN {
        return Err(Error::ResourceExhausted(format!(
            "bootstrap value of {len} bytes is larger than the limit of {MAX_VALUE_LEN}"
        )));
    }
    Ok(())
}

fn check_value(value: &[u8]) -> Result<()> {
    check_len(value.len())
}

fn check_job(job: &str) -> Result<()> {
    if job.len() > MAX_JOB_LEN {
        return Err(Error::Config(format!(
            "job identity of {} bytes is longer than the limit of {MAX_JOB_LEN}",
            job.len()
        )));
    }
    Ok(())
}

/// Cuts `text` to at most [`MAX_TEXT_LEN`] bytes at a character boundary.
fn clip(text: &str) -> &str {
    if text.len() <= MAX_TEXT_LEN {
        return text;
    }
    let mut end = MAX_TEXT_LEN;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// The start of a `Value` frame for a value of `len` bytes: everything but
/// the value itself, which follows it on the wire. Lets the service send a
/// stored value without copying it into a frame.
pub fn value_head(id: u32, len: usize) -> Result<Vec<u8>> {
    check_len(len)?;
    let mut f = FrameBuf::new(op::VALUE, 8);
    f.u32(id).u32(len as u32);
    Ok(f.finish_with_payload(len))
}

/// The start of a `Gathered` frame for a contribution of `len` bytes (see
/// [`value_head`]).
pub fn gathered_head(id: u32, index: u32, count: u32, len: usize) -> Result<Vec<u8>> {
    check_len(len)?;
    let mut f = FrameBuf::new(op::GATHERED, 16);
    f.u32(id).u32(index).u32(count).u32(len as u32);
    Ok(f.finish_with_payload(len))
}

/// Encodes `msg` as one complete frame (length prefix included).
///
/// Fails with [`Error::Config`] for a key or job identity over its limit and
/// with [`Error::ResourceExhausted`] for a value over [`MAX_VALUE_LEN`];
/// reason texts over [`MAX_TEXT_LEN`] are cut.
pub fn encode(msg: &Message) -> Result<Vec<u8>> {
    match msg {
        Message::Challenge { .. }
        | Message::Auth { .. }
        | Message::Welcome { .. }
        | Message::Refused { .. } => encode_handshake(msg),
        Message::Put { .. }
        | Message::Get { .. }
        | Message::Cancel { .. }
        | Message::Barrier { .. }
        | Message::Allgather { .. }
        | Message::Goodbye => encode_request(msg),
        Message::Done { .. }
        | Message::Value { .. }
        | Message::Gathered { .. }
        | Message::Failed { .. }
        | Message::Departed { .. } => encode_reply(msg),
    }
}

/// Encodes a handshake message (`Challenge`, `Auth`, `Welcome`, `Refused`).
fn encode_handshake(msg: &Message) -> Result<Vec<u8>> {
    Ok(match msg {
        Message::Challenge { version, nonce } => {
            let mut f = FrameBuf::new(op::CHALLENGE, 2 + NONCE_LEN);
            f.u16(*version).raw(nonce);
            f.finish()
        }
        Message::Auth {
            version,
            rank,
            size,
            nonce,
            mac,
            job,
        } => {
            check_job(job)?;
            let mut f = FrameBuf::new(op::AUTH, 12 + NONCE_LEN + MAC_LEN + job.len());
            f.u16(*version)
                .u32(*rank)
                .u32(*size)
                .raw(nonce)
                .raw(mac)
                .str(job);
            f.finish()
        }
        Message::Welcome { mac } => {
            let mut f = FrameBuf::new(op::WELCOME, MAC_LEN);
            f.raw(mac);
            f.finish()
        }
        Message::Refused { reason } => {
            let reason = clip(reason);
            let mut f = FrameBuf::new(op::REFUSED, 2 + reason.len());
            f.str(reason);
            f.finish()
        }
        _ => unreachable!("{} is not a handshake message", msg.name()),
    })
}

/// Encodes a client's request (`Put`, `Get`, `Cancel`, `Barrier`,
/// `Allgather`, `Goodbye`).
fn encode_request(msg: &Message) -> Result<Vec<u8>> {
    Ok(match msg {
        Message::Put { id, key, value } => {
            check_key(key)?;
            check_value(value)?;
            let mut f = FrameBuf::new(op::PUT, 10 + key.len() + value.len());
            f.u32(*id).str(key).bytes(value);
            f.finish()
        }
        Message::Get { id, key } => {
            check_key(key)?;
            let mut f = FrameBuf::new(op::GET, 6 + key.len());
            f.u32(*id).str(key);
            f.finish()
        }
        Message::Cancel { id } => {
            let mut f = FrameBuf::new(op::CANCEL, 4);
            f.u32(*id);
            f.finish()
        }
        Message::Barrier { id } => {
            let mut f = FrameBuf::new(op::BARRIER, 4);
            f.u32(*id);
            f.finish()
        }
        Message::Allgather { id, value } => {
            check_value(value)?;
            let mut f = FrameBuf::new(op::ALLGATHER, 8 + value.len());
            f.u32(*id).bytes(value);
            f.finish()
        }
        Message::Goodbye => FrameBuf::new(op::GOODBYE, 0).finish(),
        _ => unreachable!("{} is not a request", msg.name()),
    })
}

/// Encodes what the service sends after the handshake: an answer to a
/// request (`Done`, `Value`, `Gathered`, `Failed`) or a `Departed` notice.
fn encode_reply(msg: &Message) -> Result<Vec<u8>> {
    Ok(match msg {
        Message::Done { id } => {
            let mut f = FrameBuf::new(op::DONE, 4);
            f.u32(*id);
            f.finish()
        }
        Message::Value { id, value } => {
            let mut frame = value_head(*id, value.len())?;
            frame.extend_from_slice(value);
            frame
        }
        Message::Gathered {
            id,
            index,
            count,
            value,
        } => {
            let mut frame = gathered_head(*id, *index, *count, value.len())?;
            frame.extend_from_slice(value);
            frame
        }
        Message::Failed { id, failure } => {
            let text = clip(&failure.text);
            let mut f = FrameBuf::new(op::FAILED, 11 + text.len());
            f.u32(*id)
                .u8(failure.kind.code())
                .u32(failure.rank)
                .str(text);
            f.finish()
        }
        Message::Departed { rank, clean } => {
            let mut f = FrameBuf::new(op::DEPARTED, 5);
            f.u32(*rank).u8(u8::from(*clean));
            f.finish()
        }
        _ => unreachable!("{} is not a reply or notice", msg.name()),
    })
}

/// Writes `msg` as one frame.
pub fn write_message<W: Write>(w: &mut W, msg: &Message) -> Result<()> {
    let frame = encode(msg)?;
    w.write_all(&frame)
        .map_err(|e| Error::transport(format!("bootstrap: sending {}", msg.name()), e))
}

/// Reads fields off a frame body, failing (never panicking) when the body is
/// too short or a field is invalid.
struct Fields<'a> {
    rest: &'a [u8],
    peer: Rank,
}

impl<'a> Fields<'a> {
    fn bad(&self, what: impl Into<String>) -> Error {
        Error::Protocol {
            rank: self.peer,
            what: format!("bootstrap frame: {}", what.into()),
        }
    }
    fn take(&mut self, n: usize, field: &str) -> Result<&'a [u8]> {
        if self.rest.len() < n {
            return Err(self.bad(format!("frame ends inside field {field}")));
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }
    fn u8(&mut self, field: &str) -> Result<u8> {
        Ok(self.take(1, field)?[0])
    }
    fn u16(&mut self, field: &str) -> Result<u16> {
        let b = self.take(2, field)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self, field: &str) -> Result<u32> {
        let b = self.take(4, field)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn array<const N: usize>(&mut self, field: &str) -> Result<[u8; N]> {
        let b = self.take(N, field)?;
        let mut a = [0; N];
        a.copy_from_slice(b);
        Ok(a)
    }
    fn bool(&mut self, field: &str) -> Result<bool> {
        match self.u8(field)? {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(self.bad(format!("field {field} is {b}, not a boolean"))),
        }
    }
    fn str(&mut self, field: &str, max: usize) -> Result<String> {
        let len = self.u16(field)? as usize;
        if len > max {
            return Err(self.bad(format!(
                "field {field} is {len} bytes long, over the limit of {max}"
            )));
        }
        let b = self.take(len, field)?;
        match std::str::from_utf8(b) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => Err(self.bad(format!("field {field} is not UTF-8"))),
        }
    }
    fn bytes(&mut self, field: &str) -> Result<Vec<u8>> {
        let len = self.u32(field)? as usize;
        if len > MAX_VALUE_LEN {
            return Err(self.bad(format!(
                "field {field} is {len} bytes long, over the limit of {MAX_VALUE_LEN}"
            )));
        }
        Ok(self.take(len, field)?.to_vec())
    }
    fn end(&self, what: &str) -> Result<()> {
        if !self.rest.is_empty() {
            return Err(self.bad(format!(
                "{} stray bytes after a {what} message",
                self.rest.len()
            )));
        }
        Ok(())
    }
}

/// Decodes one frame body (without its length prefix). Errors are
/// [`Error::Protocol`] naming `peer`.
pub fn decode(body: &[u8], peer: Rank) -> Result<Message> {
    let mut f = Fields { rest: body, peer };
    let opcode = f.u8("opcode")?;
    let msg = match opcode {
        op::CHALLENGE => Message::Challenge {
            version: f.u16("version")?,
            nonce: f.array("nonce")?,
        },
        op::AUTH => Message::Auth {
            version: f.u16("version")?,
            rank: f.u32("rank")?,
            size: f.u32("size")?,
            nonce: f.array("nonce")?,
            mac: f.array("mac")?,
            job: f.str("job", MAX_JOB_LEN)?,
        },
        op::WELCOME => Message::Welcome {
            mac: f.array("mac")?,
        },
        op::REFUSED => Message::Refused {
            reason: f.str("reason", MAX_TEXT_LEN)?,
        },
        op::PUT => Message::Put {
            id: f.u32("id")?,
            key: f.str("key", MAX_KEY_LEN)?,
            value: f.bytes("value")?,
        },
        op::GET => Message::Get {
            id: f.u32("id")?,
            key: f.str("key", MAX_KEY_LEN)?,
        },
        op::CANCEL => Message::Cancel { id: f.u32("id")? },
        op::BARRIER => Message::Barrier { id: f.u32("id")? },
        op::ALLGATHER => Message::Allgather {
            id: f.u32("id")?,
            value: f.bytes("value")?,
        },
        op::GOODBYE => Message::Goodbye,
        op::DONE => Message::Done { id: f.u32("id")? },
        op::VALUE => Message::Value {
            id: f.u32("id")?,
            value: f.bytes("value")?,
        },
        op::GATHERED => Message::Gathered {
            id: f.u32("id")?,
            index: f.u32("index")?,
            count: f.u32("count")?,
            value: f.bytes("value")?,
        },
        op::FAILED => {
            let id = f.u32("id")?;
            let code = f.u8("failure kind")?;
            let Some(kind) = FailureKind::from_code(code) else {
                return Err(f.bad(format!("unknown failure kind {code}")));
            };
            Message::Failed {
                id,
                failure: Failure {
                    kind,
                    rank: f.u32("rank")?,
                    text: f.str("text", MAX_TEXT_LEN)?,
                },
            }
        }
        op::DEPARTED => Message::Departed {
            rank: f.u32("rank")?,
            clean: f.bool("clean")?,
        },
        other => return Err(f.bad(format!("unknown opcode {other:#04x}"))),
    };
    f.end(msg.name())?;
    Ok(msg)
}

/// Reads one frame and decodes it.
///
/// Returns `Ok(None)` on a clean end of stream (no byte of a next frame was
/// read). A length of 0 or above `max_len` is refused with
/// [`Error::Protocol`] right after the 4-byte prefix, before anything is
/// allocated or read further; a stream ending inside a frame is a protocol
/// violation; I/O failures (including read timeouts) are
/// [`Error::Transport`]. Errors name `peer` as the offender.
pub fn read_message<R: Read>(r: &mut R, max_len: usize, peer: Rank) -> Result<Option<Message>> {
    let mut prefix = [0u8; 4];
    let mut got = 0;
    while got < prefix.len() {
        match r.read(&mut prefix[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => {
                return Err(Error::Protocol {
                    rank: peer,
                    what: "bootstrap stream ends inside a frame length".into(),
                })
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::transport("bootstrap: reading a frame", e)),
        }
    }
    let len = u32::from_le_bytes(prefix) as usize;
    if len == 0 || len > max_len {
        return Err(Error::Protocol {
            rank: peer,
            what: format!("bootstrap frame length {len} is outside 1..={max_len}"),
        });
    }
    // Grow the body as bytes arrive (doubling from 64 KiB, capped at `len`),
    // so a peer that announces a large frame and stops costs little memory.
    let mut body = Vec::new();
    while body.len() < len {
        let start = body.len();
        let target = len.min((2 * start).max(INITIAL_BODY));
        body.reserve_exact(target - start);
        body.resize(target, 0);
        if let Err(e) = r.read_exact(&mut body[start..]) {
            return Err(if e.kind() == io::ErrorKind::UnexpectedEof {
                Error::Protocol {
                    rank: peer,
                    what: format!("bootstrap stream ends inside a {len}-byte frame"),
                }
            } else {
                Error::transport("bootstrap: reading a frame", e)
            });
        }
    }
    decode(&body, peer).map(Some)
}

#[cfg(test)]
mod tests;
