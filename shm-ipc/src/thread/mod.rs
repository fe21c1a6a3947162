//! The thread device (smdev-style): ranks are threads of one process.
//!
//! Each ordered pair of ranks has a single-producer single-consumer
//! [`ring`](crate::ring) owned by the receiver. Matching happens on the
//! receiving rank, under that rank's own lock (there is no global lock):
//!
//! * **Eager** (payload up to `eager_limit`): the payload is copied into the
//!   ring and out into the receive buffer. A message of up to 24 bytes is one
//!   cache line.
//! * **Rendezvous** (larger, or when eager credit runs out): the ring carries
//!   only a `Handoff` pointer; the receiver, once matched, copies straight
//!   from the sender's buffer into its own (one copy) and marks the handoff
//!   done, which completes the send.
//! * **Flow control**: a full ring never drops or overwrites. Sends wait in a
//!   per-destination backlog (their buffers stay owned by their requests).
//!   Eager data that the receiver had to buffer as unexpected is bounded by a
//!   per-pair credit (`credit_bytes`): beyond it, messages go by rendezvous,
//!   which buffers only a header.
//! * **Synchronous sends** carry a handoff that the receiver completes when it
//!   matches the message.
//! * **Peers that go away** (their device finished or dropped, for example on
//!   a panic) make the operations that involve them fail with
//!   [`Error::PeerLost`]; messages they sent before are still delivered.
//!
//! Waits spin briefly, then sleep on the rank's [`Doorbell`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use xdev::devkit::{OptionSpec, Options};
use xdev::registry::{Entry, Placement};
use xdev::{Config, Device, Error, Rank, Registry, Result};

use crate::doorbell::Doorbell;
use crate::engine::{Engine, Limits};
use crate::ring::{HeapRing, RingRef};

mod handoff;
mod medium;

use handoff::{Handoff, PendingPull};
pub(crate) use medium::ThreadMedium;

/// Tunables of the thread device. Every field can be set through
/// [`Config::options`] under the same name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ThreadOptions {
    /// Largest payload sent eagerly (default 4 KiB, capped by the ring).
    ///
    /// Chosen by `xdev-bench --test crossover` on the 2-core test machine:
    /// eager (two copies through the ring) wins latency up to 4 KiB (0.40 vs
    /// 0.43 us), the two tie at 8 KiB (0.53 vs 0.51 us, equal bandwidth), and
    /// rendezvous (one copy) wins from 16 KiB on (0.75 vs 0.78 us, 16.3 vs
    /// 11.0 GB/s).
    pub eager_limit: usize,
    /// Bytes per pair ring (default 64 KiB up to 22 ranks, then 32 MiB / n²,
    /// at least 8 KiB). Rings are allocated on first use.
    pub ring_bytes: usize,
    /// Eager bytes (plus 64 per message) a sender may have unreceived at one
    /// receiver before it switches to rendezvous (default 4 × `ring_bytes`).
    pub credit_bytes: usize,
    /// Rendezvous headers from one sender that a receiver keeps as
    /// unexpected (default 16,384, about 100 bytes of the receiver's memory
    /// each; the conformance suite keeps 10,000 rendezvous sends from one
    /// peer unreceived while it waits for a later message). Beyond it the receiver leaves that sender's
    /// ring alone, except for messages that match a posted receive, until
    /// receives take some: the sender waits (its sends stay queued in its
    /// own memory) and nothing is lost. A program with more unmatched
    /// rendezvous sends from one peer than this in flight, that waits for a
    /// message behind them, needs a larger value.
    pub max_unexpected_rndv: usize,
}

impl ThreadOptions {
    /// Defaults for a world of `size` ranks.
    pub fn for_size(size: usize) -> Self {
        let n2 = (size * size).max(1);
        let ring_bytes = ((32usize << 20) / n2)
            .clamp(8 << 10, 64 << 10)
            .next_power_of_two();
        ThreadOptions {
            eager_limit: 4 << 10,
            ring_bytes,
            credit_bytes: 4 * ring_bytes,
            max_unexpected_rndv: 16_384,
        }
    }

    /// The options the `thread` device knows.
    pub const KEYS: &'static [OptionSpec] = &[
        OptionSpec::new(
            "eager_limit",
            "a byte count",
            "largest payload sent eagerly (4 KiB)",
        ),
        crate::engine::RING_BYTES_SPEC,
        crate::engine::CREDIT_BYTES_SPEC,
        OptionSpec::new(
            "max_unexpected_rndv",
            "a count",
            "rendezvous headers from one sender kept as unexpected (16,384)",
        ),
    ];

    /// Defaults for `config.size`, overridden by its options; an option the
    /// device does not know ([`KEYS`](Self::KEYS)) or one that does not parse
    /// is an error.
    pub fn from_config(config: &Config) -> Result<Self> {
        let o = Options::new("thread", Self::KEYS, config)?;
        let d = Self::for_size(config.size);
        let ring_bytes = crate::engine::ring_bytes_option(&o, d.ring_bytes)?;
        Ok(ThreadOptions {
            eager_limit: o.get("eager_limit", d.eager_limit)?,
            ring_bytes,
            credit_bytes: o.get("credit_bytes", 4 * ring_bytes)?,
            max_unexpected_rndv: o.get("max_unexpected_rndv", d.max_unexpected_rndv)?,
        })
    }

    fn nslots(&self) -> usize {
        crate::ring::slots_for_bytes(self.ring_bytes)
    }
}

#[repr(align(64))]
struct Padded<T>(T);

const OPEN: u8 = 0;
const CLOSED: u8 = 1;
const DEAD: u8 = 2;

/// What every rank of a world can see of one rank.
struct RankShared {
    doorbell: Doorbell,
    state: AtomicU8,
    joined: AtomicBool,
    /// Rings from each sender to this rank, created by the sender on first use.
    inbox: Box<[OnceLock<HeapRing>]>,
    /// Eager bytes (plus per-message charge) from each sender that this rank
    /// has taken out of its buffers: the sender's returned credit.
    freed: Box<[Padded<AtomicU64>]>,
}

struct World {
    job: String,
    opts: ThreadOptions,
    /// The eager limit in force: `opts.eager_limit`, capped by what one ring
    /// message can carry.
    eager_max: usize,
    ranks: Box<[RankShared]>,
    /// Bumped whenever a rank closes or dies, so others re-check their peers.
    departures: AtomicU64,
}

impl World {
    fn new(job: String, size: usize, opts: ThreadOptions) -> World {
        World {
            job,
            eager_max: opts
                .eager_limit
                .min(crate::ring::max_payload_for(opts.nslots())),
            ranks: (0..size)
                .map(|_| RankShared {
                    doorbell: Doorbell::new(),
                    state: AtomicU8::new(OPEN),
                    joined: AtomicBool::new(false),
                    inbox: (0..size).map(|_| OnceLock::new()).collect(),
                    freed: (0..size).map(|_| Padded(AtomicU64::new(0))).collect(),
                })
                .collect(),
            opts,
            departures: AtomicU64::new(0),
        }
    }

    fn size(&self) -> usize {
        self.ranks.len()
    }

    fn ring(&self, from: Rank, to: Rank) -> RingRef<'_> {
        self.ranks[to].inbox[from]
            .get_or_init(|| HeapRing::new(self.opts.nslots()))
            .view()
    }

    fn gone(&self, r: Rank) -> bool {
        self.ranks[r].state.load(Ordering::Acquire) != OPEN
    }

    /// Joins (or creates) the world `config.job` as `config.rank`.
    fn join(config: &Config, opts: ThreadOptions) -> Result<Arc<World>> {
        let mut map = worlds().lock().unwrap_or_else(|p| p.into_inner());
        map.retain(|_, e| e.weak.strong_count() > 0);
        let world = match map.get(&config.job).and_then(|e| e.weak.upgrade()) {
            Some(w) => w,
            None => {
                let w = Arc::new(World::new(config.job.clone(), config.size, opts.clone()));
                map.insert(
                    config.job.clone(),
                    WorldEntry {
                        weak: Arc::downgrade(&w),
                        until_complete: Some(w.clone()),
                    },
                );
                w
            }
        };
        if world.size() != config.size || world.opts != opts {
            return Err(Error::Config(format!(
                "job {:?} exists with size {} and options {:?}",
                world.job,
                world.size(),
                world.opts
            )));
        }
        if world.ranks[config.rank].joined.swap(true, Ordering::AcqRel) {
            return Err(Error::Config(format!(
                "rank {} of job {:?} already joined",
                config.rank, config.job
            )));
        }
        if world.ranks.iter().all(|r| r.joined.load(Ordering::Acquire)) {
            if let Some(e) = map.get_mut(&config.job) {
                e.until_complete = None;
            }
        }
        Ok(world)
    }
}

/// Worlds by job id. An entry holds its world strongly until every rank has
/// joined (so a rank that sends, finishes and leaves before a slow peer joins
/// does not take the messages it sent with it), then only weakly.
struct WorldEntry {
    weak: Weak<World>,
    until_complete: Option<Arc<World>>,
}

fn worlds() -> &'static Mutex<HashMap<String, WorldEntry>> {
    static W: OnceLock<Mutex<HashMap<String, WorldEntry>>> = OnceLock::new();
    W.get_or_init(Default::default)
}

/// One rank of a thread world: an xdev [`Device`] whose peers are threads of
/// this process.
pub struct ThreadDevice {
    engine: Arc<Engine<ThreadMedium>>,
}

impl ThreadDevice {
    /// Joins (or creates) the world `config.job` as `config.rank`.
    /// All ranks of a job must pass the same size and options. A world stays
    /// in memory until every rank has joined and then until the last rank's
    /// device (and its requests) are gone.
    pub fn open(config: &Config) -> Result<ThreadDevice> {
        config.validate()?;
        let opts = ThreadOptions::from_config(config)?;
        crate::doorbell::init_fences();
        let world = World::join(config, opts)?;
        let n = config.size;
        let limits = Limits {
            rank: config.rank,
            size: n,
            eager_max: world.eager_max,
            credit_bytes: world.opts.credit_bytes as u64,
        };
        let medium = ThreadMedium {
            world,
            rank: config.rank,
            stalled: (0..n).map(|_| AtomicBool::new(false)).collect(),
        };
        let state = medium::ThreadState::new(n);
        Ok(ThreadDevice {
            engine: Arc::new(Engine::new(medium, limits, state)),
        })
    }

    /// The options in force.
    pub fn options(&self) -> &ThreadOptions {
        &self.engine.m.world.opts
    }

    /// Messages this rank holds as unexpected (taken out of its rings
    /// before a receive matched them), for diagnostics and tests.
    pub fn unexpected_messages(&self) -> usize {
        self.engine.lock().matching.unexpected_len()
    }
}

impl Drop for ThreadDevice {
    /// With receives still lent out (which keep the engine alive), closes
    /// the engine now, as its own drop would: their waits end `Closed`.
    fn drop(&mut self) {
        self.engine.close_lent();
    }
}

impl xdev::devkit::Face for ThreadDevice {
    type Engine = Engine<ThreadMedium>;
    fn engine(&self) -> &Arc<Engine<ThreadMedium>> {
        &self.engine
    }
}

/// Starts a world of N rank threads, each with its own [`ThreadDevice`].
///
/// ```
/// use shm_ipc::ThreadWorld;
/// use xdev::{Buffer, Device, Source, TagSel};
///
/// let counts = ThreadWorld::new(2).run(|dev| {
///     let ctx = 7; // a communicator id
///     if dev.id() == 0 {
///         dev.send(b"hello", 1, 0, ctx).unwrap();
///         0
///     } else {
///         // Non-blocking: the buffer moves into the request and comes back.
///         let done = dev.irecv(Buffer::zeroed(16), Source::Rank(0), TagSel::Tag(0), ctx).wait();
///         assert_eq!(&done.buf[..5], b"hello");
///         done.status.count
///     }
/// });
/// assert_eq!(counts, vec![0, 5]);
/// ```
#[derive(Clone, Debug)]
pub struct ThreadWorld {
    size: usize,
    pin: bool,
    options: Vec<(String, String)>,
}

impl ThreadWorld {
    /// A world of `size` ranks.
    pub fn new(size: usize) -> Self {
        ThreadWorld {
            size,
            pin: false,
            options: Vec::new(),
        }
    }

    /// Pins rank `r` to core `r mod cores`.
    pub fn pin(mut self, pin: bool) -> Self {
        self.pin = pin;
        self
    }

    /// Sets a device option (see [`ThreadOptions`]).
    pub fn option(mut self, key: &str, value: impl ToString) -> Self {
        self.options.push((key.to_string(), value.to_string()));
        self
    }

    /// Runs `f` on every rank, each in its own thread, finishes each device,
    /// and returns the results in rank order. A panic in any rank is resumed
    /// here after the others have ended (they see the panicked rank as lost).
    pub fn run<T: Send>(&self, f: impl Fn(&ThreadDevice) -> T + Sync) -> Vec<T> {
        static JOBS: AtomicU64 = AtomicU64::new(0);
        let job = format!(
            "threads-{}-{}",
            std::process::id(),
            JOBS.fetch_add(1, Ordering::Relaxed)
        );
        let f = &f;
        let results: Vec<std::thread::Result<T>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..self.size)
                .map(|rank| {
                    let mut cfg = Config::new(rank, self.size, job.clone());
                    for (k, v) in &self.options {
                        cfg = cfg.with(k, v);
                    }
                    let pin = self.pin;
                    std::thread::Builder::new()
                        .name(format!("rank-{rank}"))
                        .spawn_scoped(s, move || {
                            if pin {
                                let _ = crate::futex::pin_current_thread(rank);
                            }
                            let dev = ThreadDevice::open(&cfg).expect("open thread device");
                            let out = f(&dev);
                            if let Err(e) = dev.finish() {
                                tracing::warn!(rank, error = %e, "thread device: finish failed");
                            }
                            out
                        })
                        .expect("spawn rank thread")
                })
                .collect();
            handles.into_iter().map(|h| h.join()).collect()
        });
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    }
}

/// Adds the `thread` device to `registry`.
pub fn register(registry: &mut Registry) {
    registry.register(Entry {
        name: "thread",
        description: "ranks as threads of one process; one-copy rendezvous",
        placement: Placement::Threads,
        options: ThreadOptions::KEYS,
        open: |cfg| Ok(Arc::new(ThreadDevice::open(cfg)?) as Arc<dyn Device>),
    });
}

#[cfg(test)]
mod tests;
