//! Wire-up of the `ibv` device: the verbs resources of one rank, the
//! [`PeerRecord`] every rank publishes through the bootstrap, and the
//! connection of every queue pair. Nothing here runs after start-up.

use xdev::bootstrap::Bootstrap;
use xdev::{Config, Error, Rank, Result};

use super::engine::{Fabric, IbvEngine};
use super::options::IbvOptions;
use super::regcache::{CacheLimits, RegistrationCache};
use crate::verbs::{
    self, Access, CompletionChannel, CompletionQueue, Gid, InitAttr, MemoryRegion, Mtu,
    PortAddress, ProtectionDomain, QpCaps, QueuePair, RemoteQp, RtsAttr,
};

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

/// Wires up one rank (collective: every rank of the job calls it): opens
/// the RDMA device and port, builds the fabric, exchanges [`PeerRecord`]s,
/// connects every queue pair and waits for all ranks. Returns the engine and
/// the RDMA device's name.
pub(super) fn wire_up(config: &Config, boot: Bootstrap) -> Result<(IbvEngine, String)> {
    config.validate()?;
    let opts = IbvOptions::from_config(config)?;
    let (rank, size) = (config.rank, config.size);
    let ctx = verbs::Context::open(opts.device.as_deref())
        .map_err(verbs_error("open the RDMA device"))?;
    let device_name = ctx.name().to_string();
    let port = ctx
        .port_address(opts.port, opts.gid_index)
        .map_err(verbs_error("query the RDMA port"))?;
    let pd = ProtectionDomain::new(&ctx).map_err(verbs_error("allocate a protection domain"))?;
    let (fab, send_mr) = fabric(&ctx, &pd, opts, rank, size)?;
    // Exchange addresses.
    let psns: Vec<u32> = (0..size).map(|_| verbs::random_psn()).collect();
    let records = exchange_records(&boot, &port, &fab, &psns)?;
    connect_all(&fab.qps, &records, &port, &psns, rank)?;
    // Nobody sends before every queue pair is connected.
    boot.barrier()?;
    let engine = IbvEngine::new(fab, send_mr, boot)?;
    Ok((engine, device_name))
}

/// The verbs resources of one rank: completion channel and queues, a queue
/// pair per peer (in INIT), the registered send and receive slots (the
/// receive slots posted) and the registration cache; the send slots apart,
/// for the engine.
fn fabric(
    ctx: &verbs::Context,
    pd: &ProtectionDomain,
    opts: IbvOptions,
    rank: Rank,
    size: usize,
) -> Result<(Fabric, MemoryRegion<'static>)> {
    let channel =
        CompletionChannel::new(ctx).map_err(verbs_error("create a completion channel"))?;
    let peers = size.saturating_sub(1).max(1) as u32;
    let send_cq = CompletionQueue::new(ctx, peers * opts.sq_depth() + 1, Some(&channel))
        .map_err(verbs_error("create the send completion queue"))?;
    let recv_cq = CompletionQueue::new(ctx, peers * opts.recv_depth + 1, Some(&channel))
        .map_err(verbs_error("create the receive completion queue"))?;
    let qps = create_qps(pd, &send_cq, &recv_cq, &opts, rank, size)?;
    let inline_max = qps
        .iter()
        .flatten()
        .map(|q| q.caps().max_inline_data)
        .min()
        .unwrap_or(0) as usize;
    let slot_len = opts.slot_len();
    let depth = opts.recv_depth as usize;
    let recv_mr = MemoryRegion::alloc(pd, size * depth * slot_len, Access::LOCAL_WRITE)
        .map_err(verbs_error("register the receive slots"))?;
    let send_mr = MemoryRegion::alloc(pd, opts.send_slots * slot_len, Access::LOCAL_WRITE)
        .map_err(verbs_error("register the send slots"))?;
    let cache = RegistrationCache::new(
        pd,
        Access::LOCAL_WRITE,
        CacheLimits {
            max_idle_chunks: 64,
            max_idle_bytes: opts.reg_cache_idle_bytes,
            max_pinned_bytes: opts.max_pinned_bytes,
            ..CacheLimits::default()
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
    let slots: Vec<u32> = (0..fab.opts.recv_depth).collect();
    for p in (0..size).filter(|&p| p != rank) {
        fab.post_recv_slots(p, &slots)
            .map_err(verbs_error("post the receive slots"))?;
    }
    Ok((fab, send_mr))
}

/// One RC queue pair per peer, moved to INIT (`None` at our own index).
fn create_qps(
    pd: &ProtectionDomain,
    send_cq: &CompletionQueue,
    recv_cq: &CompletionQueue,
    opts: &IbvOptions,
    rank: Rank,
    size: usize,
) -> Result<Vec<Option<QueuePair>>> {
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
        let qp = match QueuePair::new_rc(pd, send_cq, recv_cq, caps, false) {
            Ok(qp) => qp,
            Err(_) if caps.max_inline_data > 0 => {
                // The device may not send inline at all.
                caps.max_inline_data = 0;
                QueuePair::new_rc(pd, send_cq, recv_cq, caps, false)
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
    Ok(qps)
}

/// Sends our [`PeerRecord`] to every rank and checks theirs (the protocol
/// parameters must agree); the records by rank.
fn exchange_records(
    boot: &Bootstrap,
    port: &PortAddress,
    fab: &Fabric,
    psns: &[u32],
) -> Result<Vec<PeerRecord>> {
    let size = fab.size;
    let opts = &fab.opts;
    let qps = &fab.qps;
    let me = PeerRecord {
        lid: port.lid,
        mtu: port.active_mtu,
        gid: port.gid.map(|(_, g)| g),
        eager_limit: opts.eager_limit as u32,
        recv_depth: opts.recv_depth,
        eager_window: opts.eager_window as u32,
        qps: qps
            .iter()
            .zip(psns)
            .map(|(q, &psn)| q.as_ref().map_or((0, 0), |q| (q.qp_num(), psn)))
            .collect(),
    };
    let all = boot.allgather(&me.encode())?;
    let mut records = Vec::with_capacity(size);
    for (p, raw) in all.iter().enumerate() {
        let r = PeerRecord::decode(raw, size).map_err(|what| Error::Protocol { rank: p, what })?;
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
    Ok(records)
}

/// Connects our queue pair to each peer's (RTR, then RTS).
fn connect_all(
    qps: &[Option<QueuePair>],
    records: &[PeerRecord],
    port: &PortAddress,
    psns: &[u32],
    rank: Rank,
) -> Result<()> {
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
        qp.connect_with(port, &remote, mtu, &rts)
            .map_err(verbs_error("connect a queue pair"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
