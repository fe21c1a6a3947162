//! Wire-up, apart from the data path: every rank creates its inbox,
//! publishes a [`PeerInfo`] through the bootstrap, takes every peer's inbox
//! (each hand-over checked by the kernel at both ends), starts the watch on
//! the peers' processes and chooses the rendezvous path.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use xdev::bootstrap::Bootstrap;
use xdev::{Config, Error, Rank, Result};

use super::medium::{ProcessMedium, ProcessState, Shared};
use super::{CmaMode, ProcessOptions, RendezvousPath, CMA_MIN_SPEED};
use crate::engine::{Engine, Limits};
use crate::futex::Scope;
use crate::liveness::PeerWatch;
use crate::segment::{self, Inbox, InboxLayout};

/// What each rank publishes through the bootstrap at start-up.
///
/// Encoded as `XSP1`, then little-endian pid (u32), slots per ring (u32),
/// credit bytes (u64), probe address (u64), probe value (u64), name length
/// (u16) and the inbox reference. [`PeerInfo::decode`] accepts exactly that and
/// nothing else.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerInfo {
    /// The rank's process id.
    pub pid: u32,
    /// Slots per ring.
    pub nslots: u32,
    /// Eager credit per pair.
    pub credit_bytes: u64,
    /// Address of an 8-byte probe value (CMA check).
    pub probe_addr: u64,
    /// The probe value.
    pub probe_value: u64,
    /// Where to fetch the inbox's descriptor: an abstract Unix socket name
    /// (see [`crate::segment::valid_ref`]).
    pub segment: String,
}

const INFO_MAGIC: &[u8; 4] = b"XSP1";
const INFO_FIXED: usize = 4 + 4 + 4 + 8 + 8 + 8 + 2;

impl PeerInfo {
    /// The wire form.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(INFO_FIXED + self.segment.len());
        v.extend_from_slice(INFO_MAGIC);
        v.extend_from_slice(&self.pid.to_le_bytes());
        v.extend_from_slice(&self.nslots.to_le_bytes());
        v.extend_from_slice(&self.credit_bytes.to_le_bytes());
        v.extend_from_slice(&self.probe_addr.to_le_bytes());
        v.extend_from_slice(&self.probe_value.to_le_bytes());
        v.extend_from_slice(&(self.segment.len() as u16).to_le_bytes());
        v.extend_from_slice(self.segment.as_bytes());
        v
    }

    /// Parses the wire form; rejects anything malformed (wrong magic or
    /// length, an inbox reference that is not well formed).
    pub fn decode(b: &[u8]) -> std::result::Result<PeerInfo, String> {
        if b.len() < INFO_FIXED || &b[..4] != INFO_MAGIC {
            return Err(format!("bad peer record ({} bytes)", b.len()));
        }
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        let name_len = u16::from_le_bytes([b[36], b[37]]) as usize;
        if b.len() != INFO_FIXED + name_len {
            return Err(format!(
                "peer record is {} bytes, its name length says {}",
                b.len(),
                INFO_FIXED + name_len
            ));
        }
        let segment = std::str::from_utf8(&b[INFO_FIXED..])
            .map_err(|_| "inbox reference is not UTF-8".to_string())?
            .to_string();
        if !segment::valid_ref(&segment) {
            return Err(format!("invalid inbox reference {segment:?}"));
        }
        let nslots = u32_at(8);
        if !nslots.is_power_of_two() || nslots < 4 {
            return Err(format!("invalid ring size {nslots}"));
        }
        if u32_at(4) == 0 {
            return Err("pid 0".into());
        }
        Ok(PeerInfo {
            pid: u32_at(4),
            nslots,
            credit_bytes: u64_at(12),
            probe_addr: u64_at(20),
            probe_value: u64_at(28),
            segment,
        })
    }
}

/// Opens rank `config.rank`'s engine over `boot` (collective: every rank
/// of the job calls it).
pub(super) fn open(config: &Config, boot: Bootstrap) -> Result<Engine<ProcessMedium>> {
    config.validate()?;
    boot.check_config(config)?;
    let opts = ProcessOptions::from_config(config)?;
    crate::doorbell::init_fences();
    let (rank, size) = (config.rank, config.size);
    let cma_wanted = opts.cma != CmaMode::Off;
    // Lets sibling ranks read our buffers under Yama ptrace_scope 1
    // (their CMA probe of us comes next); harmless where Yama is absent.
    let grant = cma_wanted.then(crate::cma::PtracerGrant::take);
    let layout = InboxLayout {
        size,
        nslots: opts.nslots(),
    };
    let mut mine = Inbox::create(rank, layout)?;
    // Our inbox's descriptor goes to the job's other ranks over a Unix
    // socket named in our bootstrap record (see segment.rs).
    let offer = crate::fd_pass::FdOffer::listen()
        .map_err(|e| Error::transport("listening to hand out the inbox", e))?;
    let mut rnd = [0u8; 8];
    let _ = getrandom::fill(&mut rnd);
    let probe = Box::new(u64::from_le_bytes(rnd) | 1);
    let info = PeerInfo {
        pid: std::process::id(),
        nslots: layout.nslots as u32,
        credit_bytes: opts.credit_bytes as u64,
        probe_addr: &*probe as *const u64 as u64,
        probe_value: *probe,
        segment: offer.name().to_string(),
    };
    let infos = gather(&boot, &info, rank)?;
    let peers = exchange(&boot, &mut mine, &infos, rank, layout, offer)?;
    let pids: Vec<u32> = infos.iter().map(|i| i.pid).collect();
    let max_payload = crate::ring::max_payload_for(layout.nslots);
    let sh = Arc::new(Shared {
        rank,
        size,
        eager_max: opts.eager_limit.min(max_payload),
        fragment: opts.fragment_bytes.min(max_payload),
        opts,
        mine,
        peers,
        pids,
        exited: (0..size).map(|_| AtomicBool::new(false)).collect(),
    });
    let watch = watch(&sh)?;
    let rendezvous = choose_path(&sh, &infos, cma_wanted);
    let cma_ok = rendezvous == RendezvousPath::Cma;
    // Not using CMA: nobody needs to attach to us (peers that chose CMA
    // get EPERM and fall back to the pipelined copy for us).
    let grant = if cma_ok { grant } else { None };
    let limits = Limits {
        rank,
        size,
        eager_max: sh.eager_max,
        credit_bytes: sh.opts.credit_bytes as u64,
    };
    let medium = ProcessMedium {
        sh,
        watch: Mutex::new(Some(watch)),
        rendezvous,
        _boot: boot,
        _probe: probe,
        ptracer: Mutex::new(grant),
    };
    Ok(Engine::new(medium, limits, ProcessState::new(size, cma_ok)))
}

/// Every rank's record, checked.
fn gather(boot: &Bootstrap, info: &PeerInfo, rank: Rank) -> Result<Vec<PeerInfo>> {
    let all = boot.allgather(&info.encode())?;
    let mut infos = Vec::with_capacity(all.len());
    for (r, b) in all.iter().enumerate() {
        let i = PeerInfo::decode(b).map_err(|what| Error::Protocol { rank: r, what })?;
        if i.nslots != info.nslots || i.credit_bytes != info.credit_bytes {
            return Err(Error::Config(format!(
                "rank {r} uses ring_bytes/credit_bytes different from rank {rank}'s"
            )));
        }
        // (Ranks that are threads of this process, as tests make them,
        // share its pid; the kernel's check of each hand-over still
        // holds for them.)
        let twice = infos.iter().position(|o: &PeerInfo| o.pid == i.pid);
        if let Some(o) = twice.filter(|_| i.pid != std::process::id()) {
            return Err(Error::Protocol {
                rank: r,
                what: format!(
                    "ranks {o} and {r} both name process {}: one record was put by a \
                     process posing as another rank",
                    i.pid
                ),
            });
        }
        infos.push(i);
    }
    Ok(infos)
}

/// Hands our inbox to every peer and takes theirs; returns every rank's
/// inbox (`None` at our own index).
fn exchange(
    boot: &Bootstrap,
    mine: &mut Inbox,
    infos: &[PeerInfo],
    rank: Rank,
    layout: InboxLayout,
    offer: crate::fd_pass::FdOffer,
) -> Result<Vec<Option<Inbox>>> {
    let size = infos.len();
    // Each sender gets our control and notice pages and its own ring.
    let mut handouts = Vec::with_capacity(size - 1);
    for (r, i) in infos.iter().enumerate().filter(|&(r, _)| r != rank) {
        let fds = mine
            .share_with(r)
            .expect("our own inbox")
            .map_err(|e| Error::transport("duplicating the inbox descriptors", e))?;
        handouts.push((i.pid, fds));
    }
    let server = offer.serve(handouts);
    let mut peers = Vec::with_capacity(size);
    for (r, i) in infos.iter().enumerate() {
        peers.push(if r == rank {
            None
        } else {
            // The serving process must be the one the record names (the
            // kernel says who serves), and the inbox's header must name it.
            let fds = crate::fd_pass::take(&i.segment, segment::SHARED_FDS, i.pid).map_err(
                |e| match e.kind() {
                    std::io::ErrorKind::PermissionDenied => Error::Protocol {
                        rank: r,
                        what: format!("rank {r}'s record: {e}"),
                    },
                    _ => Error::transport(format!("receiving rank {r}'s inbox"), e),
                },
            )?;
            Some(Inbox::attach(fds, r, rank, i.pid, layout)?)
        });
    }
    // Every rank we know of took our inbox, each checked by the kernel's
    // account of its process, before we enter the barrier: a rank whose
    // record another process replaced never gets through both checks
    // (it or we refuse), so nobody passes the barrier and no message
    // goes anywhere (SECURITY.md, "Whom a rank trusts").
    server
        .join()
        .map_err(|_| Error::transport("handing out the inbox", std::io::Error::other("panicked")))?
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::PermissionDenied => Error::Protocol {
                rank,
                what: format!("handing out rank {rank}'s inbox: {e}"),
            },
            _ => Error::transport("handing out the inbox", e),
        })?;
    // Everyone has attached every inbox: our descriptors can go.
    boot.barrier()?;
    mine.close_descriptors();
    Ok(peers)
}

/// Starts the watch on the peers' processes.
fn watch(sh: &Arc<Shared>) -> Result<PeerWatch> {
    let watched: Vec<(Rank, u32)> = (0..sh.size)
        .filter(|&r| r != sh.rank)
        .map(|r| (r, sh.pids[r]))
        .collect();
    let w = sh.clone();
    PeerWatch::start(watched, move |r| {
        w.exited[r].store(true, Ordering::Release);
        w.mine.departures().fetch_add(1, Ordering::AcqRel);
        w.mine.doorbell().wake_all(Scope::Shared);
    })
    .map_err(|e| Error::transport("starting the peer watch", e))
}

/// The rendezvous path: CMA if a probe of the next rank reads what it
/// published (and, with `cma=auto`, CMA is fast enough here).
fn choose_path(sh: &Shared, infos: &[PeerInfo], cma_wanted: bool) -> RendezvousPath {
    let (rank, size, pids, opts_cma) = (sh.rank, sh.size, &sh.pids, sh.opts.cma);
    if !cma_wanted {
        RendezvousPath::Pipelined("disabled by option cma=off".into())
    } else {
        let p = (rank + 1) % size;
        let mut got = [0u8; 8];
        match crate::cma::read_remote(pids[p], infos[p].probe_addr, &mut got) {
            Ok(()) if u64::from_le_bytes(got) == infos[p].probe_value => {
                match (opts_cma, crate::cma::calibrate()) {
                    (CmaMode::Auto, Some(speed)) if speed < CMA_MIN_SPEED => {
                        RendezvousPath::Pipelined(format!(
                            "CMA runs at {:.2} of memcpy's speed here (below {CMA_MIN_SPEED}; \
                             cma=on forces it)",
                            speed
                        ))
                    }
                    _ => RendezvousPath::Cma,
                }
            }
            Ok(()) => {
                RendezvousPath::Pipelined(format!("CMA probe of rank {p} read the wrong value"))
            }
            Err(e) => {
                RendezvousPath::Pipelined(format!("process_vm_readv from rank {p} refused: {e}"))
            }
        }
    }
}
