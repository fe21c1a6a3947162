//! IBVX over verbs, and [`IbvDevice`], the `ibv` xdev device.
//!
//! This is the seed paper's IBV eXpress layer: message passing over RC queue
//! pairs with an eager protocol through pre-registered buffers, a zero-copy
//! rendezvous protocol by RDMA write (`RNDZ_START`, `RNDZ_REPLY` with
//! address and rkey, the RDMA write of the data, `RNDZ_END`), a pin-down
//! [`RegistrationCache`], and a polling progress engine that sleeps on the
//! completion channel. Matching is xdev's software
//! [`MatchingEngine`](xdev::matching::MatchingEngine); the verbs layer knows
//! nothing of it.
//!
//! It is not a general verbs library (see [`crate::verbs`] for the thin safe
//! layer it is built on), and it does not use shared memory between ranks on
//! one host: every peer, local or remote, is reached through the RDMA device.
//!
//! # Start-up
//!
//! Every rank opens the RDMA device and port named by the configuration
//! (`ibv_device`, `ibv_port`, `ibv_gid_index`; by default the first device,
//! port 1, and on RoCE the GID perftest would pick: RoCE v2, IPv4-mapped
//! first), creates one RC queue pair per peer on one send and one receive
//! completion queue that share a completion channel, posts its receive
//! slots, and exchanges LID, GID, MTU, queue pair numbers and first PSNs
//! through the bootstrap service ([`PeerRecord`]). The protocol parameters
//! (eager limit, receive depth, eager window) must be the same on every rank.
//!
//! # Budgets (defaults, each a configuration key)
//!
//! | key | default | what it bounds |
//! |-----|---------|----------------|
//! | `eager_limit` | 8192 | largest eager payload; larger messages use rendezvous |
//! | `recv_depth` | 64 | receive slots posted per peer (`size * recv_depth * slot` bytes registered) |
//! | `send_slots` | 256 | pre-registered send buffers shared by all peers |
//! | `eager_window` | 1 MiB | unexpected eager bytes one peer may leave here |
//! | `inline` | 64 | largest send posted inline (if the device allows) |
//! | `reg_cache_idle_bytes` | 64 MiB | registered memory kept for reuse |
//! | `max_pinned_bytes` | 1 GiB | all registered user memory at once |

//!
//! # What the NIC may touch, and who decides
//!
//! Only this module's engine posts work requests, and it does so only into
//! memory it owns for the duration: its receive and send slots, the buffer
//! of a send or receive it holds, or a cache chunk it has leased. The
//! building blocks that name raw memory to the NIC are therefore private to
//! the crate: the registration cache's lookups and registrations (a
//! lookup would find a chunk that a user holds as a leased [`Buffer`], or an
//! idle one about to be leased to someone else, and a posted receive would
//! then write into it) and the wire format (whose rendezvous replies carry
//! raw addresses and rkeys). [`RegistrationCache`] itself stays public for
//! its statistics and for leasing registered buffers, but hands out no key
//! or scatter/gather entry. None of these compiles outside the crate any
//! more:
//!
//! ```compile_fail,E0603
//! // The cache's module (with `Registration`, whose `sge` names memory).
//! use ibvx::ibv::regcache::Registration;
//! fn lkey_of(reg: &Registration) -> u32 {
//!     reg.lkey()
//! }
//! ```
//!
//! ```compile_fail,E0599
//! // A lookup of a leased buffer's registration.
//! fn lkey_of(dev: &ibvx::ibv::IbvDevice, buf: &xdev::Buffer) -> Option<u32> {
//!     let reg = dev.cache().find(buf.as_ptr(), buf.len())?; // only in ibvx's tests
//!     Some(reg.lkey())
//! }
//! ```
//!
//! ```compile_fail,E0599
//! // The registration of a lease (it outlives the lease).
//! fn lkey_of(cache: &ibvx::ibv::RegistrationCache) -> u32 {
//!     let lease = cache.lease(4096).unwrap();
//!     lease.registration().lkey() // only in ibvx's tests
//! }
//! ```
//!
//! ```compile_fail,E0624
//! // A transient registration of foreign memory.
//! fn lkey_of(cache: &ibvx::ibv::RegistrationCache, v: &mut [u8]) -> u32 {
//!     // SAFETY: `v` outlives the registration (dropped at once).
//!     let reg = unsafe { cache.register(v.as_mut_ptr(), v.len()) }.unwrap(); // private to ibvx
//!     reg.lkey()
//! }
//! ```
//!
//! ```compile_fail,E0624
//! // A remote-write grant (its rkey lets a peer write the range).
//! fn rkey_of(cache: &ibvx::ibv::RegistrationCache, v: &mut [u8]) -> u32 {
//!     // SAFETY: `v` outlives the registration (dropped at once).
//!     let reg = unsafe { cache.grant_remote_write(v.as_mut_ptr(), v.len()) }.unwrap(); // private to ibvx
//!     reg.rkey()
//! }
//! ```
//!
//! ```compile_fail,E0603
//! // The wire format.
//! use ibvx::ibv::wire::{decode, HEADER_LEN};
//! let frame = [0u8; HEADER_LEN];
//! assert!(decode(&frame, 0).is_err());
//! ```
//!
//! The verbs layer's posting calls, which do name memory to the NIC, are
//! `unsafe` with their contract stated at [`QueuePair::post_send`] and
//! [`QueuePair::post_recv`].

#[cfg(test)]
mod device_tests;
mod engine;
pub(crate) mod regcache;
pub(crate) mod wire;

use std::sync::Arc;

use xdev::bootstrap::Bootstrap;
use xdev::registry::{Entry, Placement};
use xdev::{
    Buffer, Config, Context, Device, Error, Pattern, Peeked, Rank, Request, Result, Source, Status,
    Tag, TagSel,
};

use self::engine::{Engine, Fabric};
pub use self::regcache::{CacheLimits, CacheStats, Lease, RegistrationCache};
use crate::verbs::{
    self, Access, CompletionChannel, CompletionQueue, Gid, InitAttr, MemoryRegion, Mtu,
    ProtectionDomain, QpCaps, QueuePair, RemoteQp, RtsAttr,
};

/// Configuration of the `ibv` device (see the module docs for the keys).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IbvOptions {
    /// RDMA device name (`None`: the first one).
    pub device: Option<String>,
    /// Port number.
    pub port: u8,
    /// GID table index (`None`: automatic).
    pub gid_index: Option<u32>,
    /// Largest eager payload in bytes.
    pub eager_limit: usize,
    /// Receive slots posted per peer.
    pub recv_depth: u32,
    /// Send slots shared by all peers.
    pub send_slots: usize,
    /// Unexpected eager bytes one peer may leave at this rank.
    pub eager_window: usize,
    /// Largest inline send.
    pub inline: u32,
    /// Registered memory the cache keeps for reuse.
    pub reg_cache_idle_bytes: usize,
    /// Registered user memory at once.
    pub max_pinned_bytes: usize,
}

impl Default for IbvOptions {
    fn default() -> Self {
        IbvOptions {
            device: None,
            port: 1,
            gid_index: None,
            eager_limit: 8192,
            recv_depth: 64,
            send_slots: 256,
            eager_window: 1 << 20,
            inline: 64,
            reg_cache_idle_bytes: 64 << 20,
            max_pinned_bytes: 1 << 30,
        }
    }
}

impl IbvOptions {
    /// Reads the options from `config`, validating them.
    pub fn from_config(config: &Config) -> Result<IbvOptions> {
        let d = IbvOptions::default();
        let device: String = config.option("ibv_device", String::new())?;
        let gid: i64 = config.option("ibv_gid_index", -1)?;
        let o = IbvOptions {
            device: (!device.is_empty()).then_some(device),
            port: config.option("ibv_port", d.port)?,
            gid_index: u32::try_from(gid).ok(),
            eager_limit: config.option("eager_limit", d.eager_limit)?,
            recv_depth: config.option("recv_depth", d.recv_depth)?,
            send_slots: config.option("send_slots", d.send_slots)?,
            eager_window: config.option("eager_window", d.eager_window)?,
            inline: config.option("inline", d.inline)?,
            reg_cache_idle_bytes: config.option("reg_cache_idle_bytes", d.reg_cache_idle_bytes)?,
            max_pinned_bytes: config.option("max_pinned_bytes", d.max_pinned_bytes)?,
        };
        let bad = |what: String| Err(Error::Config(what));
        if o.recv_depth < 4 || o.recv_depth > 4096 {
            return bad(format!("recv_depth {} must be in 4..=4096", o.recv_depth));
        }
        if o.send_slots < 4 || o.send_slots > 65536 {
            return bad(format!("send_slots {} must be in 4..=65536", o.send_slots));
        }
        if o.eager_limit > 1 << 20 {
            return bad(format!(
                "eager_limit {} must be at most 1 MiB",
                o.eager_limit
            ));
        }
        if o.eager_window < o.eager_limit || o.eager_window > u32::MAX as usize {
            return bad(format!(
                "eager_window {} must be at least eager_limit ({}) and below 4 GiB",
                o.eager_window, o.eager_limit
            ));
        }
        if o.max_pinned_bytes == 0 {
            return bad("max_pinned_bytes must be positive".into());
        }
        Ok(o)
    }

    /// Send work requests per queue pair: every credit, plus the writes
    /// and ends of rendezvous sends.
    pub(crate) fn sq_depth(&self) -> u32 {
        self.recv_depth * 2 + 16
    }

    /// Bytes of one send or receive slot.
    fn slot_len(&self) -> usize {
        (wire::HEADER_LEN + self.eager_limit)
            .max(wire::MAX_CONTROL_LEN)
            .next_multiple_of(64)
    }
}

/// What every rank tells the others at start-up (through the bootstrap).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerRecord {
    /// Port LID (0 on RoCE).
    pub lid: u16,
    /// Active MTU of the port.
    pub mtu: Mtu,
    /// Port GID (always on RoCE).
    pub gid: Option<Gid>,
    /// Protocol parameters that must agree.
    pub eager_limit: u32,
    /// Receive slots per peer.
    pub recv_depth: u32,
    /// Unexpected-eager window.
    pub eager_window: u32,
    /// Per rank: the queue pair number and first PSN this rank uses for it
    /// (0, 0 for itself).
    pub qps: Vec<(u32, u32)>,
}

const RECORD_MAGIC: &[u8; 4] = b"IBVX";
const RECORD_VERSION: u8 = 1;
const RECORD_FIXED: usize = 4 + 4 + 2 + 4 + 1 + 16 + 4 + 4 + 4 + 4;

impl PeerRecord {
    /// The record's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(RECORD_FIXED + self.qps.len() * 8);
        b.extend_from_slice(RECORD_MAGIC);
        b.extend_from_slice(&[RECORD_VERSION, 0, 0, 0]);
        b.extend_from_slice(&self.lid.to_le_bytes());
        b.extend_from_slice(&self.mtu.raw().to_le_bytes());
        b.push(u8::from(self.gid.is_some()));
        b.extend_from_slice(&self.gid.map_or([0; 16], |g| g.0));
        b.extend_from_slice(&self.eager_limit.to_le_bytes());
        b.extend_from_slice(&self.recv_depth.to_le_bytes());
        b.extend_from_slice(&self.eager_window.to_le_bytes());
        b.extend_from_slice(&(self.qps.len() as u32).to_le_bytes());
        for (qpn, psn) in &self.qps {
            b.extend_from_slice(&qpn.to_le_bytes());
            b.extend_from_slice(&psn.to_le_bytes());
        }
        b
    }

    /// Decodes and checks a record from a job of `size` ranks.
    pub fn decode(b: &[u8], size: usize) -> std::result::Result<PeerRecord, String> {
        if b.len() < RECORD_FIXED {
            return Err(format!("record of {} bytes is too short", b.len()));
        }
        if &b[0..4] != RECORD_MAGIC || b[4..8] != [RECORD_VERSION, 0, 0, 0] {
            return Err("not an IBVX version 1 record".into());
        }
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        let lid = u16::from_le_bytes([b[8], b[9]]);
        let mtu =
            Mtu::from_raw(u32_at(10)).ok_or_else(|| format!("bad MTU code {}", u32_at(10)))?;
        let gid = match b[14] {
            0 if b[15..31].iter().all(|&x| x == 0) => None,
            1 => Some(Gid(b[15..31].try_into().expect("16 bytes"))),
            v => return Err(format!("bad GID flag {v}")),
        };
        let n = u32_at(43) as usize;
        if n != size {
            return Err(format!("record for {n} ranks in a job of {size}"));
        }
        if b.len() != RECORD_FIXED + n * 8 {
            return Err(format!(
                "record of {} bytes for {n} ranks (expected {})",
                b.len(),
                RECORD_FIXED + n * 8
            ));
        }
        let qps = (0..n)
            .map(|i| {
                (
                    u32_at(RECORD_FIXED + i * 8),
                    u32_at(RECORD_FIXED + i * 8 + 4),
                )
            })
            .collect();
        Ok(PeerRecord {
            lid,
            mtu,
            gid,
            eager_limit: u32_at(31),
            recv_depth: u32_at(35),
            eager_window: u32_at(39),
            qps,
        })
    }
}

fn verbs_error(what: &str) -> impl Fn(verbs::Error) -> Error + '_ {
    move |e| Error::transport(what.to_string(), e)
}

/// One rank of a job over RDMA verbs (RC queue pairs): an xdev [`Device`].
pub struct IbvDevice {
    engine: Arc<Engine>,
    device_name: String,
}

impl IbvDevice {
    /// Opens the device for `config` with the bootstrap service named by the
    /// environment (`xdev-run` sets it). Collective.
    pub fn open(config: &Config) -> Result<IbvDevice> {
        Self::with_bootstrap(config, Bootstrap::for_config(config)?)
    }

    /// Opens the device over a connected bootstrap (collective: every rank
    /// of the job calls it).
    pub fn with_bootstrap(config: &Config, boot: Bootstrap) -> Result<IbvDevice> {
        config.validate()?;
        let opts = IbvOptions::from_config(config)?;
        let (rank, size) = (config.rank, config.size);
        let ctx = verbs::Context::open(opts.device.as_deref())
            .map_err(verbs_error("open the RDMA device"))?;
        let device_name = ctx.name().to_string();
        let port = ctx
            .port_address(opts.port, opts.gid_index)
            .map_err(verbs_error("query the RDMA port"))?;
        let pd =
            ProtectionDomain::new(&ctx).map_err(verbs_error("allocate a protection domain"))?;
        let channel =
            CompletionChannel::new(&ctx).map_err(verbs_error("create a completion channel"))?;
        let peers = size.saturating_sub(1).max(1) as u32;
        let send_cq = CompletionQueue::new(&ctx, peers * opts.sq_depth() + 1, Some(&channel))
            .map_err(verbs_error("create the send completion queue"))?;
        let recv_cq = CompletionQueue::new(&ctx, peers * opts.recv_depth + 1, Some(&channel))
            .map_err(verbs_error("create the receive completion queue"))?;
        let mut caps = QpCaps {
            max_send_wr: opts.sq_depth(),
            max_recv_wr: opts.recv_depth,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: opts.inline,
        };
        let mut qps = Vec::with_capacity(size);
        for p in 0..size {
            if p == rank {
                qps.push(None);
                continue;
            }
            let qp = match QueuePair::new_rc(&pd, &send_cq, &recv_cq, caps, false) {
                Ok(qp) => qp,
                Err(_) if caps.max_inline_data > 0 => {
                    // The device may not send inline at all.
                    caps.max_inline_data = 0;
                    QueuePair::new_rc(&pd, &send_cq, &recv_cq, caps, false)
                        .map_err(verbs_error("create a queue pair"))?
                }
                Err(e) => return Err(verbs_error("create a queue pair")(e)),
            };
            qp.modify_to_init(&InitAttr {
                port: opts.port,
                access: Access::LOCAL_WRITE | Access::REMOTE_WRITE,
                ..InitAttr::default()
            })
            .map_err(verbs_error("move a queue pair to INIT"))?;
            qps.push(Some(qp));
        }
        let inline_max = qps
            .iter()
            .flatten()
            .map(|q| q.caps().max_inline_data)
            .min()
            .unwrap_or(0) as usize;
        let slot_len = opts.slot_len();
        let depth = opts.recv_depth as usize;
        let recv_mr = MemoryRegion::alloc(&pd, size * depth * slot_len, Access::LOCAL_WRITE)
            .map_err(verbs_error("register the receive slots"))?;
        let send_mr = MemoryRegion::alloc(&pd, opts.send_slots * slot_len, Access::LOCAL_WRITE)
            .map_err(verbs_error("register the send slots"))?;
        let cache = RegistrationCache::new(
            &pd,
            Access::LOCAL_WRITE,
            CacheLimits {
                max_idle_chunks: 64,
                max_idle_bytes: opts.reg_cache_idle_bytes,
                max_pinned_bytes: opts.max_pinned_bytes,
            },
        );
        let fab = Fabric {
            rank,
            size,
            opts,
            slot_len,
            inline_max,
            qps,
            send_cq,
            recv_cq,
            channel,
            recv_mr,
            cache,
        };
        for p in (0..size).filter(|&p| p != rank) {
            for slot in 0..fab.opts.recv_depth {
                fab.post_recv_slot(p, slot)
                    .map_err(verbs_error("post the receive slots"))?;
            }
        }
        let opts = &fab.opts;
        let qps = &fab.qps;
        // Exchange addresses.
        let psns: Vec<u32> = (0..size).map(|_| verbs::random_psn()).collect();
        let me = PeerRecord {
            lid: port.lid,
            mtu: port.active_mtu,
            gid: port.gid.map(|(_, g)| g),
            eager_limit: opts.eager_limit as u32,
            recv_depth: opts.recv_depth,
            eager_window: opts.eager_window as u32,
            qps: qps
                .iter()
                .zip(&psns)
                .map(|(q, &psn)| q.as_ref().map_or((0, 0), |q| (q.qp_num(), psn)))
                .collect(),
        };
        let all = boot.allgather(&me.encode())?;
        let mut records = Vec::with_capacity(size);
        for (p, raw) in all.iter().enumerate() {
            let r =
                PeerRecord::decode(raw, size).map_err(|what| Error::Protocol { rank: p, what })?;
            if (r.eager_limit, r.recv_depth, r.eager_window)
                != (me.eager_limit, me.recv_depth, me.eager_window)
            {
                return Err(Error::Config(format!(
                    "rank {p} uses eager_limit {}, recv_depth {}, eager_window {}; this rank {}, {}, {}",
                    r.eager_limit, r.recv_depth, r.eager_window, me.eager_limit, me.recv_depth, me.eager_window
                )));
            }
            records.push(r);
        }
        for (p, qp) in qps.iter().enumerate() {
            let Some(qp) = qp else { continue };
            let r = &records[p];
            let (qpn, psn) = r.qps[rank];
            let remote = RemoteQp {
                qpn,
                psn,
                lid: r.lid,
                gid: r.gid,
            };
            let mtu = if r.mtu.bytes() < port.active_mtu.bytes() {
                r.mtu
            } else {
                port.active_mtu
            };
            // Credits guarantee a posted receive for every message, so a
            // receiver-not-ready NAK means the peer's queue pair is broken:
            // a few RNR retries, then an error, never endless retries.
            let rts = RtsAttr {
                sq_psn: psns[p],
                rnr_retry: 4,
                ..RtsAttr::default()
            };
            qp.connect_with(&port, &remote, mtu, &rts)
                .map_err(verbs_error("connect a queue pair"))?;
        }
        // Nobody sends before every queue pair is connected.
        boot.barrier()?;
        let engine = Engine::new(fab, send_mr, boot)?;
        Ok(IbvDevice {
            engine: Arc::new(engine),
            device_name,
        })
    }

    /// The options in use.
    pub fn options(&self) -> &IbvOptions {
        self.engine.options()
    }

    /// The RDMA device in use (e.g. `rxe0`).
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// A zeroed buffer of `len` bytes in memory this device has registered
    /// (leased from its [`RegistrationCache`]): rendezvous transfers from and
    /// into it need no registration. Dropping it returns it to the cache.
    pub fn alloc_buffer(&self, len: usize) -> Result<Buffer> {
        self.engine
            .cache()
            .buffer(len)
            .map_err(|e| Error::ResourceExhausted(format!("registered buffer of {len} bytes: {e}")))
    }

    /// The registration cache (for statistics).
    pub fn cache(&self) -> &RegistrationCache {
        self.engine.cache()
    }
}

impl Device for IbvDevice {
    fn name(&self) -> &'static str {
        "ibv"
    }

    fn id(&self) -> Rank {
        self.engine.rank()
    }

    fn size(&self) -> usize {
        self.engine.size()
    }

    fn send(&self, buf: &[u8], dest: Rank, tag: Tag, context: Context) -> Result<()> {
        self.engine.blocking_send(buf, dest, tag, context, false)
    }

    fn ssend(&self, buf: &[u8], dest: Rank, tag: Tag, context: Context) -> Result<()> {
        self.engine.blocking_send(buf, dest, tag, context, true)
    }

    fn recv(
        &self,
        buf: &mut [u8],
        source: Source,
        tag: TagSel,
        context: Context,
    ) -> Result<Status> {
        self.engine
            .recv_into(buf, Pattern::new(source, tag, context))
    }

    fn isend(&self, buf: Buffer, dest: Rank, tag: Tag, context: Context) -> Request {
        self.engine.start_send(buf, dest, tag, context, false)
    }

    fn issend(&self, buf: Buffer, dest: Rank, tag: Tag, context: Context) -> Request {
        self.engine.start_send(buf, dest, tag, context, true)
    }

    fn irecv(&self, buf: Buffer, source: Source, tag: TagSel, context: Context) -> Request {
        self.engine
            .start_recv(buf, Pattern::new(source, tag, context))
    }

    fn probe(&self, source: Source, tag: TagSel, context: Context) -> Result<Status> {
        self.engine
            .probe(Pattern::new(source, tag, context), true)?
            .ok_or(Error::Closed)
    }

    fn iprobe(&self, source: Source, tag: TagSel, context: Context) -> Result<Option<Status>> {
        self.engine.probe(Pattern::new(source, tag, context), false)
    }

    fn peek(&self) -> Result<Option<Peeked>> {
        self.engine.peek()
    }

    fn progress(&self) {
        xdev::Progress::progress(&*self.engine)
    }

    fn finish(&self) -> Result<()> {
        self.engine.finish()
    }
}

/// Adds the `ibv` device to `registry`.
pub fn register(registry: &mut xdev::Registry) {
    registry.register(Entry {
        name: "ibv",
        description: "IBVX over RDMA verbs (RC queue pairs, eager + RDMA-write rendezvous)",
        placement: Placement::Processes,
        open: |cfg| Ok(Arc::new(IbvDevice::open(cfg)?) as Arc<dyn Device>),
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn record(n: usize) -> PeerRecord {
        PeerRecord {
            lid: 7,
            mtu: Mtu::from_bytes(1024).unwrap(),
            gid: Some(Gid([9; 16])),
            eager_limit: 8192,
            recv_depth: 64,
            eager_window: 1 << 20,
            qps: (0..n as u32).map(|i| (i + 100, i * 3)).collect(),
        }
    }

    #[test]
    fn record_round_trip_and_rejects() {
        let r = record(3);
        let b = r.encode();
        assert_eq!(PeerRecord::decode(&b, 3).unwrap(), r);
        assert!(PeerRecord::decode(&b, 4).unwrap_err().contains("3 ranks"));
        assert!(PeerRecord::decode(&b[..b.len() - 1], 3).is_err());
        let mut bad = b.clone();
        bad[0] = b'X';
        assert!(PeerRecord::decode(&bad, 3).is_err());
        let mut bad = b.clone();
        bad[14] = 7;
        assert!(PeerRecord::decode(&bad, 3)
            .unwrap_err()
            .contains("GID flag"));
        let mut bad = b;
        bad[10] = 99;
        assert!(PeerRecord::decode(&bad, 3).unwrap_err().contains("MTU"));
    }

    #[test]
    fn options_validate() {
        let c = Config::new(0, 2, "j");
        assert_eq!(IbvOptions::from_config(&c).unwrap(), IbvOptions::default());
        let c2 = c.clone().with("recv_depth", 2);
        assert!(IbvOptions::from_config(&c2).is_err());
        let c3 = c.clone().with("eager_window", 10);
        assert!(IbvOptions::from_config(&c3).is_err());
        let c4 = c.with("ibv_gid_index", 3).with("ibv_device", "rxe0");
        let o = IbvOptions::from_config(&c4).unwrap();
        assert_eq!((o.gid_index, o.device.as_deref()), (Some(3), Some("rxe0")));
    }

    proptest! {
        #[test]
        fn record_decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..120), n in 0usize..6) {
            if let Ok(r) = PeerRecord::decode(&bytes, n) {
                prop_assert_eq!(r.qps.len(), n);
                prop_assert_eq!(r.encode(), bytes);
            }
        }
    }
}
