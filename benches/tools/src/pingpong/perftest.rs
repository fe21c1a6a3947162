//! perftest's out-of-band exchange (perftest 6.x, `perftest_communication.c`,
//! the "Ethernet" method without rdma_cm), for `--perftest`.
//!
//! Every step is an exchange of equal-sized messages in which the client
//! writes first and the server reads first. Observed with perftest 6.06
//! (Debian 12) on the TCP stream, in order:
//!
//! 1. versions: 16 bytes, the version string padded with NULs (`"6.06"`);
//! 2. if the peer is 5.32 or newer: the cycle buffer (page size) and the
//!    cache line size, 4 bytes each, big-endian (each side keeps the larger);
//! 3. the MTU: `"%d"` of the `ibv_mtu` enum, 2 bytes with the NUL (each side
//!    uses the smaller);
//! 4. "keys", once per handshake: `LID:OUT_READS:QPN:PSN:RKEY:VADDR` in hex
//!    ([`KeyMsg`]), with the 16 GID bytes and the SRQ number when a GID is
//!    used (108 bytes with the NUL) or without (59 bytes). The first carries
//!    the QP; the others are synchronization points: before the run 3 for
//!    `ib_send_lat` and `ib_write_bw`, 4 for `ib_write_lat`; then
//!    `ib_send_lat` syncs once before each size (after posting receives);
//! 5. at the end `ib_send_lat` does one more handshake; `ib_write_bw` does a
//!    handshake, exchanges the client's result ([`PerftestBwReport`], five
//!    8-byte big-endian fields) and does one more; then each side writes
//!    `"done\0"` and closes. `ib_write_lat` just closes.
//!
//! perftest does not exchange the test type, sizes or iteration counts, so
//! mismatched options cannot be detected: both sides must be given the same
//! `-s`/`-a`/`-n`.

use std::fmt;

/// The version this side announces (that of Debian 12's perftest); perftest
/// refuses peers older than 5.70.
pub const VERSION: &str = "6.06";

/// Length of the version message.
pub const VERSION_LEN: usize = 16;

/// Oldest perftest this implementation talks to (the protocol above).
pub const MIN_PEER_VERSION: f64 = 5.70;

/// Key message length with a GID (including the NUL).
pub const KEY_MSG_SIZE_GID: usize = 108;

/// Key message length without a GID (including the NUL).
pub const KEY_MSG_SIZE: usize = 59;

/// The `done` message of the close.
pub const DONE: &[u8; 5] = b"done\0";

/// Handshakes before the run (the first one carries the QP).
pub fn handshakes_before_run(test: super::TestKind) -> usize {
    match test {
        super::TestKind::WriteLat => 4,
        super::TestKind::SendLat | super::TestKind::WriteBw => 3,
    }
}

/// The version message: `VERSION` padded with NULs to 16 bytes.
pub fn version_msg() -> [u8; VERSION_LEN] {
    let mut m = [0u8; VERSION_LEN];
    m[..VERSION.len()].copy_from_slice(VERSION.as_bytes());
    m
}

/// The number perftest reads from a version message (`atof`): the leading
/// digits and dot, or `None` when it does not start with a number (the
/// native protocol's magic, for instance).
pub fn parse_version(msg: &[u8]) -> Option<f64> {
    let end = msg
        .iter()
        .position(|&c| !(c.is_ascii_digit() || c == b'.'))
        .unwrap_or(msg.len());
    std::str::from_utf8(&msg[..end]).ok()?.parse().ok()
}

/// The MTU message: the `ibv_mtu` enum value as `"%d"` in 2 bytes.
pub fn mtu_msg(mtu: ibvx::verbs::Mtu) -> [u8; 2] {
    [b'0' + mtu.raw() as u8, 0]
}

/// The MTU the peer announced (`None` if not a valid `ibv_mtu`).
pub fn parse_mtu(msg: &[u8; 2]) -> Option<ibvx::verbs::Mtu> {
    let digits: Vec<u8> = msg.iter().copied().take_while(u8::is_ascii_digit).collect();
    let v: u32 = std::str::from_utf8(&digits).ok()?.parse().ok()?;
    ibvx::verbs::Mtu::from_raw(v)
}

/// perftest's `struct pingpong_dest` as it travels (hex text).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KeyMsg {
    /// LID.
    pub lid: u32,
    /// Outstanding RDMA reads.
    pub out_reads: u32,
    /// QP number.
    pub qpn: u32,
    /// First PSN.
    pub psn: u32,
    /// Remote key of the buffer the peer writes.
    pub rkey: u32,
    /// Address the peer writes.
    pub vaddr: u64,
    /// GID, when the sender uses one.
    pub gid: Option<[u8; 16]>,
    /// SRQ number (0 without SRQ).
    pub srqn: u32,
}

/// Why a key message cannot be parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyError(pub String);

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "bad perftest key message: {}", self.0)
    }
}

impl std::error::Error for KeyError {}

impl KeyMsg {
    /// The length of the message with or without a GID.
    pub fn len(with_gid: bool) -> usize {
        if with_gid {
            KEY_MSG_SIZE_GID
        } else {
            KEY_MSG_SIZE
        }
    }

    /// The message bytes: perftest's `KEY_PRINT_FMT_GID`
    /// (`%04x:%04x:%06x:%06x:%08x:%016llx:` + 16 × `%02x:` + `%08x:`) or
    /// `KEY_PRINT_FMT` (`%04x:%04x:%06x:%06x:%08x:%016llx:%08x`), NUL padded.
    pub fn encode(&self) -> Vec<u8> {
        let mut s = format!(
            "{:04x}:{:04x}:{:06x}:{:06x}:{:08x}:{:016x}",
            self.lid, self.out_reads, self.qpn, self.psn, self.rkey, self.vaddr
        );
        match self.gid {
            Some(gid) => {
                s.push(':');
                for b in gid {
                    s.push_str(&format!("{b:02x}:"));
                }
                s.push_str(&format!("{:08x}:", self.srqn));
            }
            None => s.push_str(&format!(":{:08x}", self.srqn)),
        }
        let mut v = s.into_bytes();
        let len = Self::len(self.gid.is_some());
        v.resize(len.max(v.len() + 1), 0);
        v
    }

    /// Parses a message of the form above. `with_gid` says which form is
    /// expected (perftest decides by its own use of a GID).
    pub fn decode(msg: &[u8], with_gid: bool) -> Result<KeyMsg, KeyError> {
        let text_end = msg.iter().position(|&c| c == 0).unwrap_or(msg.len());
        let text =
            std::str::from_utf8(&msg[..text_end]).map_err(|_| KeyError("not ASCII".into()))?;
        let fields: Vec<&str> = text.split(':').collect();
        let want = if with_gid { 6 + 16 + 1 } else { 7 };
        if fields.len() < want {
            return Err(KeyError(format!(
                "{} fields, expected {want} ({:?})",
                fields.len(),
                text.chars().take(120).collect::<String>()
            )));
        }
        let hex32 = |i: usize, name: &str| -> Result<u32, KeyError> {
            u32::from_str_radix(fields[i], 16)
                .map_err(|_| KeyError(format!("{name} {:?}", fields[i])))
        };
        let mut k = KeyMsg {
            lid: hex32(0, "LID")?,
            out_reads: hex32(1, "OUT_READS")?,
            qpn: hex32(2, "QPN")?,
            psn: hex32(3, "PSN")?,
            rkey: hex32(4, "RKEY")?,
            vaddr: u64::from_str_radix(fields[5], 16)
                .map_err(|_| KeyError(format!("VADDR {:?}", fields[5])))?,
            gid: None,
            srqn: 0,
        };
        if with_gid {
            let mut gid = [0u8; 16];
            for (i, b) in gid.iter_mut().enumerate() {
                *b = u8::from_str_radix(fields[6 + i], 16)
                    .map_err(|_| KeyError(format!("GID byte {:?}", fields[6 + i])))?;
            }
            k.gid = Some(gid);
            k.srqn = hex32(22, "SRQN")?;
        } else {
            k.srqn = hex32(6, "SRQN")?;
        }
        if k.qpn > 0xff_ffff || k.psn > 0xff_ffff {
            return Err(KeyError("QPN or PSN wider than 24 bits".into()));
        }
        Ok(k)
    }
}

/// perftest's `struct bw_report_data` as exchanged by `xchg_bw_reports`
/// (peers of version 5.33 and newer): five 8-byte big-endian fields.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PerftestBwReport {
    /// Message size.
    pub size: u64,
    /// Iterations.
    pub iters: u64,
    /// Peak bandwidth, MiB/s.
    pub bw_peak: f64,
    /// Average bandwidth, MiB/s.
    pub bw_avg: f64,
    /// Message rate, Mpps.
    pub msg_rate: f64,
}

impl PerftestBwReport {
    /// The five fields in exchange order, each 8 bytes big-endian (doubles
    /// byte-swapped as perftest's `hton_double` does).
    pub fn fields(&self) -> [[u8; 8]; 5] {
        [
            self.size.to_be_bytes(),
            self.iters.to_be_bytes(),
            self.bw_peak.to_bits().to_be_bytes(),
            self.bw_avg.to_bits().to_be_bytes(),
            self.msg_rate.to_bits().to_be_bytes(),
        ]
    }

    /// From the five exchanged fields.
    pub fn from_fields(f: &[[u8; 8]; 5]) -> PerftestBwReport {
        PerftestBwReport {
            size: u64::from_be_bytes(f[0]),
            iters: u64::from_be_bytes(f[1]),
            bw_peak: f64::from_bits(u64::from_be_bytes(f[2])),
            bw_avg: f64::from_bits(u64::from_be_bytes(f[3])),
            msg_rate: f64::from_bits(u64::from_be_bytes(f[4])),
        }
    }
}

#[cfg(test)]
mod tests;
