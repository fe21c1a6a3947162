//! The exchange of endpoints: the native handshake of [`wire`], perftest's
//! exchange, and connecting the queue pair to what the peer sent.

use ibvx::verbs::{Gid, Mtu, RemoteAddr, RemoteQp};

use super::{PeerKind, Session};
use crate::pingpong::error::PingpongError;
use crate::pingpong::perftest::{self, KeyMsg};
use crate::pingpong::wire::{self, Endpoint, Hello, Message, MAGIC};

/// What this side knows about the peer after the handshake.
#[derive(Debug, Clone, Copy)]
pub(super) struct Remote {
    pub(super) qp: RemoteQp,
    /// The region this side RDMA-writes into.
    pub(super) region: RemoteAddr,
    /// Its length (perftest does not say: assumed large enough).
    pub(super) len: u64,
    /// The peer's bandwidth window (native only; slots of `--check`).
    pub(super) window: u32,
}

impl Session<'_> {
    pub(super) fn hello(&self) -> Hello {
        let o = self.o;
        let local = &self.r.local;
        Hello {
            test: o.test,
            all: o.all,
            check: o.check,
            size: if o.all { 0 } else { o.size as u64 },
            iters: o.iters,
            mtu_requested: o.mtu.map_or(0, |m| m.bytes() as u16),
            mtu_active: local.active_mtu.bytes() as u16,
            window: o.window(),
            endpoint: Endpoint {
                lid: local.lid,
                qpn: self.r.qp.qp_num(),
                psn: self.r.psn,
                gid: local.gid.map_or([0; 16], |(_, g)| g.0),
                rkey: self.r.recv_mr.rkey(),
                addr: self.r.recv_mr.addr(),
                len: self.r.recv_mr.len() as u64,
            },
        }
    }

    /// The path MTU: the requested one (or the port's), at most what both
    /// ports have active.
    pub(super) fn path_mtu(&self, peer_active: Option<Mtu>) -> Mtu {
        let mine = self
            .o
            .mtu
            .unwrap_or(self.r.local.active_mtu)
            .min(self.r.local.active_mtu);
        peer_active.map_or(mine, |p| mine.min(p))
    }

    pub(super) fn native_handshake(
        &mut self,
        first: Option<[u8; 16]>,
    ) -> Result<(), PingpongError> {
        let mine = self.hello();
        let theirs = if self.client() {
            self.link
                .write(&greeting(&Message::Hello(mine)), "the greeting")?;
            let mut magic = [0u8; 16];
            self.link.read(&mut magic, "the server's greeting").map_err(|e| match e {
                PingpongError::PeerGone { .. } => PingpongError::Protocol(
                    "the server closed the connection at the greeting (a perftest server? use --perftest)".into(),
                ),
                e => e,
            })?;
            if magic != MAGIC {
                return Err(PingpongError::Protocol(
                    match perftest::parse_version(&magic) {
                        Some(v) => format!("the server is perftest {v} (use --perftest)"),
                        None => format!(
                            "the server is not ibvx-pingpong (greeting {:?})",
                            String::from_utf8_lossy(&magic)
                        ),
                    },
                ));
            }
            match self.link.recv("the server's parameters")? {
                Message::Hello(h) => {
                    if let Some(m) = wire::mismatch(&h, &mine) {
                        return Err(PingpongError::Mismatch(m));
                    }
                    h
                }
                Message::Reject(why) => return Err(PingpongError::Rejected(why)),
                m => return Err(unexpected("Hello", &m)),
            }
        } else {
            debug_assert_eq!(first, Some(MAGIC));
            let h = match self.link.recv("the client's parameters")? {
                Message::Hello(h) => h,
                m => return Err(unexpected("Hello", &m)),
            };
            if let Some(m) = wire::mismatch(&mine, &h) {
                // Best effort: the error is this side's result either way.
                let _ = self
                    .link
                    .write(&greeting(&Message::Reject(m.clone())), "the refusal");
                return Err(PingpongError::Mismatch(m));
            }
            self.link
                .write(&greeting(&Message::Hello(mine)), "the greeting")?;
            h
        };
        let e = theirs.endpoint;
        self.remote = Remote {
            qp: RemoteQp {
                qpn: e.qpn,
                psn: e.psn,
                lid: e.lid,
                gid: (e.gid != [0; 16]).then_some(Gid(e.gid)),
            },
            region: RemoteAddr {
                addr: e.addr,
                rkey: e.rkey,
            },
            len: e.len,
            window: theirs.window,
        };
        self.path_mtu = self.path_mtu(Mtu::from_bytes(usize::from(theirs.mtu_active)));
        self.connect_qp()
    }

    pub(super) fn connect_qp(&mut self) -> Result<(), PingpongError> {
        if self.r.local.gid.is_some() && self.remote.qp.gid.is_none() {
            return Err(PingpongError::Setup(
                "the local port needs a GRH (RoCE) but the peer sent no GID".into(),
            ));
        }
        self.r
            .qp
            .connect(&self.r.local, &self.remote.qp, self.path_mtu, self.r.psn)?;
        Ok(())
    }

    pub(super) fn key_xchg(&mut self, what: &str) -> Result<KeyMsg, PingpongError> {
        let with_gid = self.key.gid.is_some();
        let mut theirs = vec![0u8; KeyMsg::len(with_gid)];
        let mine = self.key.encode();
        self.link.xchg(&mine, &mut theirs, what)?;
        KeyMsg::decode(&theirs, with_gid)
            .map_err(|e| PingpongError::Protocol(format!("{e} ({what})")))
    }

    /// Step 1 of perftest's exchange: the versions (a server has read the
    /// client's already, as `first`); a peer too old is refused.
    fn perftest_versions(&mut self, first: Option<[u8; 16]>) -> Result<(), PingpongError> {
        let mut theirs = [0u8; perftest::VERSION_LEN];
        match first {
            Some(f) => {
                theirs = f;
                self.link
                    .write(&perftest::version_msg(), "the version exchange")?;
            }
            None => self.link.xchg(
                &perftest::version_msg(),
                &mut theirs,
                "the version exchange",
            )?,
        }
        let version = perftest::parse_version(&theirs).ok_or_else(|| {
            PingpongError::Protocol(if theirs == MAGIC {
                "the server is ibvx-pingpong in native mode (run the client without --perftest)"
                    .into()
            } else {
                format!(
                    "the peer is not perftest (version {:?})",
                    String::from_utf8_lossy(&theirs)
                )
            })
        })?;
        if version < perftest::MIN_PEER_VERSION {
            return Err(PingpongError::Protocol(format!(
                "perftest {version} is too old: this side speaks the protocol of perftest {} and newer",
                perftest::MIN_PEER_VERSION
            )));
        }
        self.peer = PeerKind::Perftest { version };
        Ok(())
    }

    pub(super) fn perftest_handshake(
        &mut self,
        first: Option<[u8; 16]>,
    ) -> Result<(), PingpongError> {
        // 1. versions
        self.perftest_versions(first)?;
        // 2. cycle buffer and cache line size
        let mut four = [0u8; 4];
        self.link.xchg(
            &4096u32.to_be_bytes(),
            &mut four,
            "the cycle buffer exchange",
        )?;
        self.link
            .xchg(&64u32.to_be_bytes(), &mut four, "the cache line exchange")?;
        // 3. MTU
        let mine = self.path_mtu(None);
        let mut two = [0u8; 2];
        self.link
            .xchg(&perftest::mtu_msg(mine), &mut two, "the MTU exchange")?;
        self.path_mtu = mine.min(perftest::parse_mtu(&two).unwrap_or(mine));
        // 4. keys
        let l = &self.r.local;
        self.key = KeyMsg {
            lid: u32::from(l.lid),
            out_reads: 1,
            qpn: self.r.qp.qp_num(),
            psn: self.r.psn,
            rkey: self.r.recv_mr.rkey(),
            vaddr: self.r.recv_mr.addr(),
            gid: l.gid.map(|(_, g)| g.0),
            srqn: 0,
        };
        let k = self.key_xchg("the QP exchange")?;
        self.remote = Remote {
            qp: RemoteQp {
                qpn: k.qpn,
                psn: k.psn,
                lid: k.lid as u16,
                gid: k.gid.filter(|g| *g != [0; 16]).map(Gid),
            },
            region: RemoteAddr {
                addr: k.vaddr,
                rkey: k.rkey,
            },
            len: u64::MAX,
            window: self.o.window(),
        };
        if let (Some((_, mine)), Some(theirs)) = (self.r.local.gid, self.remote.qp.gid) {
            if mine.is_ipv4_mapped() != theirs.is_ipv4_mapped() {
                return Err(PingpongError::Setup(
                    "GID types differ (IPv4-mapped on one side only): choose matching --gid-index values".into(),
                ));
            }
        }
        self.connect_qp()?;
        for _ in 1..perftest::handshakes_before_run(self.o.test) {
            self.key_xchg("a synchronization")?;
        }
        Ok(())
    }
}

/// What each side sends first in the native protocol: the magic and `m`,
/// in one write.
pub(super) fn greeting(m: &Message) -> Vec<u8> {
    let mut g = MAGIC.to_vec();
    m.encode_into(&mut g);
    g
}

/// The error for a message of the wrong kind where `want` was due.
pub(super) fn unexpected(want: &str, got: &Message) -> PingpongError {
    PingpongError::Protocol(format!("expected {want}, got {}", got.name()))
}
