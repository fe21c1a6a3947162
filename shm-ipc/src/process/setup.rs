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
    let rendezvous = choose_path(&sh, &infos, cma_wanted, &boot)?;
    let cma_ok = rendezvous == RendezvousPath::Cma;
    if let RendezvousPath::Pipelined(why) = &rendezvous {
        tracing::info!(rank, why = %why, "shm: rendezvous falls back from CMA to the pipelined copy");
    }
    // Not using CMA: nobody needs to attach to us (peers that chose CMA
    // get EPERM and fall back to the pipelined copy for us).
    let grant = if cma_ok { grant } else { None };
    // Our page-aligned buffers from now on lie in the shared arena, which
    // peers that may read us by CMA may also map (the same permission);
    // and we map theirs.
    let mapped = cma_ok && sh.opts.mapped;
    if mapped && !xdev::devkit::shared_arena::share_with_peers() {
        tracing::info!(
            rank,
            "shm: no shared arena here; peers copy our buffers by CMA"
        );
    }
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
    Ok(Engine::new(
        medium,
        limits,
        ProcessState::new(size, cma_ok, mapped),
    ))
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
/// published and, with `cma=auto`, CMA copies at least [`CMA_MIN_SPEED`]
/// of the pipelined copy's speed as rank 0 timed both ([`PathTiming`]).
/// Collective: every rank takes part in one allgather, whatever its mode.
fn choose_path(
    sh: &Shared,
    infos: &[PeerInfo],
    cma_wanted: bool,
    boot: &Bootstrap,
) -> Result<RendezvousPath> {
    let (rank, size, pids, opts_cma) = (sh.rank, sh.size, &sh.pids, sh.opts.cma);
    let p = (rank + 1) % size;
    let probe = cma_wanted.then(|| {
        let mut got = [0u8; 8];
        match crate::cma::read_remote(pids[p], infos[p].probe_addr, &mut got) {
            Ok(()) if u64::from_le_bytes(got) == infos[p].probe_value => Ok(()),
            Ok(()) => Err(format!("CMA probe of rank {p} read the wrong value")),
            Err(e) => Err(format!("process_vm_readv from rank {p} refused: {e}")),
        }
    });
    // Rank 0 times both paths while the others wait in the allgather (so
    // its helper has the next rank's core to itself), and every rank takes
    // its figures: one choice for the whole job.
    let timed = (rank == 0 && opts_cma == CmaMode::Auto && matches!(probe, Some(Ok(()))))
        .then(|| PathTiming::measure(sh.fragment, sh.opts.ring_bytes, pids[p]))
        .flatten();
    let all = boot.allgather(&timed.map_or_else(Vec::new, |t| t.encode()))?;
    let timing = all.first().and_then(|b| PathTiming::decode(b));
    Ok(match probe {
        None => RendezvousPath::Pipelined("disabled by option cma=off".into()),
        Some(Err(why)) => RendezvousPath::Pipelined(why),
        Some(Ok(())) => match (opts_cma, timing.and_then(|t| t.prefers_pipelined())) {
            (CmaMode::Auto, Some(why)) => RendezvousPath::Pipelined(why),
            _ => RendezvousPath::Cma,
        },
    })
}

/// What rank 0 timed at start-up for `cma=auto`, in bytes per second: a
/// 1 MiB CMA copy (one core, the receiver's), and the pipelined copy of 1
/// MiB one way with both cores, the way the pipelined rendezvous runs: this
/// thread copies fragments of `fragment_bytes` into a ring-sized buffer, a
/// helper thread on the next rank's cores copies them out as they come.
///
/// Per byte the pipelined path costs two such copies, one on each core;
/// CMA one, on the receiver's (in a two-way exchange each core copies its
/// own incoming data; one way the split lets both cores copy). Both ways
/// CMA moves data at least as fast when its copy reaches half the pipelined
/// copy's speed ([`CMA_MIN_SPEED`]). (The previous choice compared CMA
/// with a single-core 1 MiB `memcpy` instead: on the 2-core test VM CMA
/// sat at 0.51-0.68 of it, across the old threshold of 0.5, so runs chose
/// differently, while the pipelined copy, whose second copy reads lines
/// the other core just wrote, ran at about half of CMA's speed.)
#[derive(Copy, Clone, Debug, PartialEq)]
pub(super) struct PathTiming {
    /// CMA copy speed.
    pub(super) cma: f64,
    /// Pipelined copy speed, one way, both cores.
    pub(super) pipelined: f64,
}

/// Bytes each timing copies.
const TIMED_BYTES: usize = 1 << 20;

/// The longest the pipelined timing may take (a loaded machine can
/// deschedule the helper); the best round finished by then counts.
const TIMING_BUDGET: std::time::Duration = std::time::Duration::from_millis(200);

impl PathTiming {
    /// Times both paths (see [`PathTiming`]); `None` if either could not
    /// be timed.
    fn measure(fragment: usize, ring_bytes: usize, peer: u32) -> Option<PathTiming> {
        let src: Vec<u8> = (0..TIMED_BYTES).map(|i| (i * 7) as u8).collect();
        let mut dst = vec![0u8; TIMED_BYTES];
        let addr = src.as_ptr() as u64;
        let pid = std::process::id();
        let mut cma = f64::MAX;
        for _ in 0..4 {
            let t = std::time::Instant::now();
            crate::cma::read_remote(pid, addr, &mut dst).ok()?;
            cma = cma.min(t.elapsed().as_secs_f64());
        }
        let pipelined = pipelined_copy(&src, fragment, ring_bytes, peer)?;
        let speed = |t: f64| TIMED_BYTES as f64 / t.max(1e-9);
        Some(PathTiming {
            cma: speed(cma),
            pipelined: speed(pipelined),
        })
    }

    /// `Some(why)` when the pipelined copy is the faster path.
    pub(super) fn prefers_pipelined(&self) -> Option<String> {
        (self.cma < CMA_MIN_SPEED * self.pipelined).then(|| {
            format!(
                "CMA copies {:.1} GB/s here, below {CMA_MIN_SPEED} of the pipelined copy's {:.1} \
                 GB/s (one way, both cores); cma=on forces it",
                self.cma / 1e9,
                self.pipelined / 1e9
            )
        })
    }

    /// The wire form: `XPT1`, then the two speeds (f64, little-endian).
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut v = b"XPT1".to_vec();
        v.extend_from_slice(&self.cma.to_le_bytes());
        v.extend_from_slice(&self.pipelined.to_le_bytes());
        v
    }

    /// Parses [`Self::encode`]'s form; `None` for anything else (rank 0
    /// did not time, or sent nonsense: the choice is then CMA's).
    pub(super) fn decode(b: &[u8]) -> Option<PathTiming> {
        if b.len() != 20 || &b[..4] != b"XPT1" {
            return None;
        }
        let f = |o: usize| f64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        let (cma, pipelined) = (f(4), f(12));
        let ok = |x: f64| x.is_finite() && x > 0.0;
        (ok(cma) && ok(pipelined)).then_some(PathTiming { cma, pipelined })
    }
}

/// A ring of fragment slots between the timing thread and its helper.
struct Staging {
    slots: Box<[std::cell::UnsafeCell<u8>]>,
    /// Fragments published by the producer.
    head: std::sync::atomic::AtomicUsize,
    /// Fragments copied out by the helper.
    tail: std::sync::atomic::AtomicUsize,
    stop: AtomicBool,
}

// SAFETY: the slot bytes are written only by the producer to slots the
// helper has released (`head - tail < nslots`) and read only by the helper
// from slots published to it (`tail < head`), with Release/Acquire on
// `head` and `tail`: no byte is accessed by both threads at once.
unsafe impl Sync for Staging {}

/// Spins until `ready`, yielding now and then; false once `stop` is set.
fn spin_until(stop: &AtomicBool, mut ready: impl FnMut() -> bool) -> bool {
    let mut n = 0u32;
    while !ready() {
        if stop.load(Ordering::Relaxed) {
            return false;
        }
        n = n.wrapping_add(1);
        if n % 256 == 0 {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
    true
}

/// The best time of one-way pipelined copies of `src` in `fragment`-byte
/// pieces through `ring_bytes` of slots, the helper on `peer`'s cores;
/// `None` if no round finished within [`TIMING_BUDGET`].
pub(super) fn pipelined_copy(
    src: &[u8],
    fragment: usize,
    ring_bytes: usize,
    peer: u32,
) -> Option<f64> {
    let frag = fragment.clamp(1, src.len().max(1));
    let nslots = (ring_bytes / frag).max(2);
    let st = std::sync::Arc::new(Staging {
        slots: (0..nslots * frag)
            .map(|_| std::cell::UnsafeCell::new(0))
            .collect(),
        head: 0.into(),
        tail: 0.into(),
        stop: AtomicBool::new(false),
    });
    let pieces = src.len().div_ceil(frag);
    let helper = {
        let st = st.clone();
        let len = src.len();
        std::thread::Builder::new()
            .name("xdev-shm-timing".into())
            .spawn(move || helper(&st, len, frag, nslots, peer))
            .ok()?
    };
    let base = st.slots.as_ptr() as *mut u8;
    let (start, mut best, mut h) = (std::time::Instant::now(), None::<f64>, 0usize);
    'rounds: for _ in 0..8 {
        let t = std::time::Instant::now();
        for i in 0..pieces {
            let off = i * frag;
            let n = frag.min(src.len() - off);
            let free = || h - st.tail.load(Ordering::Acquire) < nslots;
            if !spin_until(&st.stop, free) || start.elapsed() > TIMING_BUDGET {
                break 'rounds;
            }
            // SAFETY: slot h % nslots lies inside `slots` (nslots * frag
            // bytes, n <= frag) and was released by the helper (checked
            // above); `src[off..off + n]` is in bounds.
            unsafe {
                std::ptr::copy_nonoverlapping(src[off..].as_ptr(), base.add((h % nslots) * frag), n)
            };
            h += 1;
            st.head.store(h, Ordering::Release);
        }
        if !spin_until(&st.stop, || st.tail.load(Ordering::Acquire) == h) {
            break;
        }
        let e = t.elapsed().as_secs_f64();
        best = Some(best.map_or(e, |b: f64| b.min(e)));
        if start.elapsed() > TIMING_BUDGET {
            break;
        }
    }
    st.stop.store(true, Ordering::Relaxed);
    let copied = helper.join().ok()?;
    // What the helper received must be exactly what was sent.
    (copied? == src).then_some(best?)
}

/// The helper of [`pipelined_copy`]: pinned to `peer`'s cores where they
/// differ from ours, copies out each fragment as it comes, until told to
/// stop. Every round writes the same bytes to the same places, so after one
/// complete round its buffer holds what was sent: it returns that buffer,
/// or `None` if no round completed.
fn helper(st: &Staging, len: usize, frag: usize, nslots: usize, peer: u32) -> Option<Vec<u8>> {
    pin_like(peer);
    let mut dst = vec![0u8; len];
    let (base, mut t) = (st.slots.as_ptr() as *const u8, 0usize);
    let pieces = len.div_ceil(frag);
    'copying: loop {
        for off in (0..len).step_by(frag) {
            let n = frag.min(len - off);
            if !spin_until(&st.stop, || st.head.load(Ordering::Acquire) > t) {
                break 'copying;
            }
            // SAFETY: slot t % nslots was published by the producer
            // (checked above) and is not written again before `tail`
            // passes it; `dst[off..off + n]` is in bounds.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    base.add((t % nslots) * frag),
                    dst[off..].as_mut_ptr(),
                    n,
                )
            };
            t += 1;
            st.tail.store(t, Ordering::Release);
        }
    }
    (t >= pieces).then_some(dst)
}

/// Pins this thread to the cores process `pid` may run on, when that set
/// differs from ours (ranks pinned to their own cores); else leaves it.
fn pin_like(pid: u32) {
    // SAFETY: cpu_set_t is plain data, all-zero is a valid empty set.
    let (mut theirs, mut ours): (libc::cpu_set_t, libc::cpu_set_t) =
        unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
    let n = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: both calls write at most `n` bytes into the sets given.
    let got = unsafe {
        libc::sched_getaffinity(pid as libc::pid_t, n, &mut theirs) == 0
            && libc::sched_getaffinity(0, n, &mut ours) == 0
    };
    // SAFETY: CPU_EQUAL reads two valid sets.
    if got && !unsafe { libc::CPU_EQUAL(&theirs, &ours) } {
        // SAFETY: sets this thread's affinity from a valid set; failure
        // leaves it as it was.
        let _ = unsafe { libc::sched_setaffinity(0, n, &theirs) };
    }
}

#[cfg(test)]
mod timing_tests {
    use super::*;

    #[test]
    fn the_pipelined_timing_copies_every_byte_and_takes_time() {
        let src: Vec<u8> = (0..TIMED_BYTES).map(|i| (i * 31 + 7) as u8).collect();
        // Uneven fragments: the last one is short.
        for (frag, ring) in [(16 << 10, 64 << 10), (3000, 16 << 10), (TIMED_BYTES, 1024)] {
            let t = pipelined_copy(&src, frag, ring, std::process::id())
                .expect("a round finishes within the budget");
            assert!(t > 0.0 && t < TIMING_BUDGET.as_secs_f64(), "{t}");
        }
    }

    #[test]
    fn cma_is_chosen_from_half_the_pipelined_speed() {
        let t = |cma: f64, pipelined: f64| PathTiming { cma, pipelined };
        assert_eq!(t(18e9, 9.4e9).prefers_pipelined(), None);
        assert_eq!(t(4.7e9, 9.4e9).prefers_pipelined(), None);
        let why = t(2e9, 9.4e9).prefers_pipelined().expect("pipelined");
        assert!(
            why.contains("2.0 GB/s") && why.contains("9.4 GB/s"),
            "{why}"
        );
    }

    #[test]
    fn timings_cross_the_bootstrap_intact_and_nonsense_is_refused() {
        let t = PathTiming {
            cma: 18.1e9,
            pipelined: 9.4e9,
        };
        assert_eq!(PathTiming::decode(&t.encode()), Some(t));
        assert_eq!(PathTiming::decode(&[]), None, "rank 0 did not time");
        let mut bad = t.encode();
        bad[0] = b'Y';
        assert_eq!(PathTiming::decode(&bad), None);
        assert_eq!(PathTiming::decode(&t.encode()[..19]), None);
        for x in [f64::NAN, f64::INFINITY, 0.0, -1.0] {
            let b = PathTiming {
                cma: x,
                pipelined: 1.0,
            }
            .encode();
            assert_eq!(PathTiming::decode(&b), None, "{x}");
        }
    }

    #[test]
    fn the_real_timing_gives_positive_speeds() {
        // CMA on our own process works wherever this test can run it; where
        // the kernel refuses it, there is nothing to time.
        match PathTiming::measure(16 << 10, 64 << 10, std::process::id()) {
            Some(t) => {
                assert!(t.cma > 0.0 && t.pipelined > 0.0, "{t:?}");
                println!(
                    "start-up timing here: CMA {:.1} GB/s, pipelined {:.1} GB/s: {}",
                    t.cma / 1e9,
                    t.pipelined / 1e9,
                    t.prefers_pipelined().unwrap_or_else(|| "CMA".into())
                );
            }
            None => println!("skipped: CMA on this process refused here"),
        }
    }
}
