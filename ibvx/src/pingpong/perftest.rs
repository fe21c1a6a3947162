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
pub fn mtu_msg(mtu: crate::verbs::Mtu) -> [u8; 2] {
    [b'0' + mtu.raw() as u8, 0]
}

/// The MTU the peer announced (`None` if not a valid `ibv_mtu`).
pub fn parse_mtu(msg: &[u8; 2]) -> Option<crate::verbs::Mtu> {
    let digits: Vec<u8> = msg.iter().copied().take_while(u8::is_ascii_digit).collect();
    let v: u32 = std::str::from_utf8(&digits).ok()?.parse().ok()?;
    crate::verbs::Mtu::from_raw(v)
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
mod tests {
    use super::*;
    use crate::verbs::Mtu;
    use proptest::prelude::*;

    /// A key message captured from `ib_send_lat` 6.06 on rxe0.
    const CAPTURED: &str = "0000:0001:000011:f90b5d:00000000:000055b02cab2000:00:00:00:00:00:00:00:00:00:00:ff:ff:0a:4d:00:01:00000000:";

    #[test]
    fn decodes_a_captured_perftest_message() {
        let mut msg = CAPTURED.as_bytes().to_vec();
        msg.resize(KEY_MSG_SIZE_GID, 0);
        let k = KeyMsg::decode(&msg, true).unwrap();
        assert_eq!((k.lid, k.out_reads, k.qpn, k.psn), (0, 1, 0x11, 0xf90b5d));
        assert_eq!((k.rkey, k.vaddr, k.srqn), (0, 0x55b0_2cab_2000, 0));
        assert_eq!(k.gid.unwrap()[10..], [0xff, 0xff, 10, 77, 0, 1]);
        // and encodes to the same bytes
        assert_eq!(k.encode(), msg);
    }

    #[test]
    fn key_messages_have_perftests_lengths() {
        let k = KeyMsg {
            lid: 0xffff,
            out_reads: 16,
            qpn: 0xff_ffff,
            psn: 0xff_ffff,
            rkey: u32::MAX,
            vaddr: u64::MAX,
            gid: Some([0xab; 16]),
            srqn: u32::MAX,
        };
        assert_eq!(k.encode().len(), KEY_MSG_SIZE_GID);
        assert_eq!(KeyMsg::decode(&k.encode(), true), Ok(k));
        let k = KeyMsg { gid: None, ..k };
        assert_eq!(k.encode().len(), KEY_MSG_SIZE);
        assert_eq!(*k.encode().last().unwrap(), 0);
        assert_eq!(KeyMsg::decode(&k.encode(), false), Ok(k));
        assert!(KeyMsg::decode(&k.encode(), true).is_err());
    }

    #[test]
    fn versions_and_mtus() {
        let v = version_msg();
        assert_eq!(&v[..5], b"6.06\0");
        assert_eq!(parse_version(&v), Some(6.06));
        assert_eq!(parse_version(b"5.70\0\0"), Some(5.70));
        assert_eq!(parse_version(&super::super::wire::MAGIC), None);
        assert_eq!(mtu_msg(Mtu::Mtu1024), *b"3\0");
        assert_eq!(parse_mtu(b"3\0"), Some(Mtu::Mtu1024));
        assert_eq!(parse_mtu(b"9\0"), None);
        assert_eq!(parse_mtu(b"\0\0"), None);
    }

    #[test]
    fn bw_report_fields_match_a_capture() {
        // From ib_write_bw 6.06: 65536 bytes, 20 iterations, then the doubles.
        let f = [
            0x0000_0000_0001_0000u64.to_be_bytes(),
            0x14u64.to_be_bytes(),
            0x4049_948c_58be_a9b1u64.to_be_bytes(),
            0x4048_94e7_2fbd_f39du64.to_be_bytes(),
            0x3f49_c696_4e46_3c93u64.to_be_bytes(),
        ];
        let r = PerftestBwReport::from_fields(&f);
        assert_eq!((r.size, r.iters), (65536, 20));
        assert!((r.bw_peak - 51.16).abs() < 0.01, "{}", r.bw_peak);
        assert!((r.bw_avg - 49.16).abs() < 0.01, "{}", r.bw_avg);
        assert!((r.msg_rate - 0.000787).abs() < 1e-6, "{}", r.msg_rate);
        assert_eq!(r.fields(), f);
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic_the_key_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..130), gid: bool) {
            let _ = KeyMsg::decode(&bytes, gid);
            let _ = parse_version(&bytes);
        }

        #[test]
        fn colon_heavy_text_never_panics(s in "[0-9a-fx:]{0,120}", gid: bool) {
            let _ = KeyMsg::decode(s.as_bytes(), gid);
        }

        #[test]
        fn key_messages_round_trip(lid: u16, qpn in 0u32..0x100_0000, psn in 0u32..0x100_0000,
                                   rkey: u32, vaddr: u64, gid: Option<[u8; 16]>, srqn: u32) {
            let k = KeyMsg { lid: u32::from(lid), out_reads: 1, qpn, psn, rkey, vaddr, gid, srqn };
            let bytes = k.encode();
            prop_assert_eq!(bytes.len(), KeyMsg::len(gid.is_some()));
            prop_assert_eq!(KeyMsg::decode(&bytes, gid.is_some()), Ok(k));
        }
    }
}
