//! The floors a figure is divided by, measured in the same run: the one-way
//! hand-off of a cache line between two cores ([`HandoffLine`],
//! [`cache_line_floor`]; between rank processes [`crate::process`]), the
//! message rate it allows ([`rate_floor`]), and `memcpy` bandwidth over a
//! test's working set ([`memcpy_floor`], [`parallel_memcpy_floor`]).

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The floor of the message rate test: messages per second if each message
/// cost one one-way cache-line hand-off of `cache_line_us` microseconds
/// (`10^6 / cache_line_us`). A reference, not a bound: a stream of messages
/// overlaps its hand-offs, so a transport may beat it (ratio above 1), but a
/// ratio of 0.25 reads "each message costs as much as four hand-offs".
pub fn rate_floor(cache_line_us: f64) -> f64 {
    if cache_line_us > 0.0 {
        1e6 / cache_line_us
    } else {
        0.0
    }
}

/// How long one cache-line floor run may take at most (about): a loaded
/// machine slows the measurement down instead of stalling it.
pub const FLOOR_BUDGET: Duration = Duration::from_millis(200);

/// One cache line that two parties pass back and forth, the least any message
/// between two cores can cost: the ping side writes an odd count, the echo
/// side answers with the next even one. Threads share it on the heap
/// ([`cache_line_floor`]); rank processes share it through a mapping
/// ([`crate::process::ProcessFloor`]), so both floors run this very loop.
///
/// A run is self-synchronizing: the echo side announces itself before the
/// ping side starts the clock, and the ping side ends the run, so the same
/// line serves any number of runs one after the other.
#[repr(C, align(128))]
pub struct HandoffLine {
    /// 0 when fresh; [`Self::READY`] once the echo side waits; odd counts
    /// from the ping side, even ones from the echo side; [`Self::STOP`] at
    /// the end of a run.
    word: AtomicU64,
}

impl HandoffLine {
    /// The echo side is in place and the ping side may start.
    const READY: u64 = u64::MAX - 1;
    /// The ping side has ended the run.
    const STOP: u64 = u64::MAX;

    /// A fresh line (all-zero, as a new shared mapping is).
    pub const fn new() -> Self {
        HandoffLine {
            word: AtomicU64::new(0),
        }
    }

    /// The timing side of one run: waits for the echo side, then times at
    /// most `iters` round trips, stopping early once [`FLOOR_BUDGET`] has
    /// passed (checked every 1024 round trips), and ends the run. Returns the
    /// one-way hand-off time in microseconds (half a round trip).
    pub fn ping(&self, iters: u64) -> f64 {
        // Ends the run even if this side unwinds, so the echo side returns.
        struct Stop<'a>(&'a AtomicU64);
        impl Drop for Stop<'_> {
            fn drop(&mut self) {
                self.0.store(HandoffLine::STOP, Ordering::Release);
            }
        }
        let word = &self.word;
        let _stop = Stop(word);
        let iters = iters.clamp(1, (Self::READY - 1) / 2);
        while word.load(Ordering::Acquire) != Self::READY {
            std::hint::spin_loop();
        }
        let start = Instant::now();
        let mut done = 0;
        while done < iters {
            word.store(2 * done + 1, Ordering::Release);
            while word.load(Ordering::Acquire) != 2 * done + 2 {
                std::hint::spin_loop();
            }
            done += 1;
            if done % 1024 == 0 && start.elapsed() > FLOOR_BUDGET {
                break;
            }
        }
        start.elapsed().as_secs_f64() * 1e6 / (2.0 * done as f64)
    }

    /// The echo side of one run: announces itself, answers every hand-off,
    /// and returns when the ping side ends the run.
    pub fn echo(&self) {
        let word = &self.word;
        // Only the echo side writes READY, and the ping side writes nothing
        // before it has seen READY, so this store cannot hide a hand-off.
        word.store(Self::READY, Ordering::Release);
        let mut i = 0;
        loop {
            let v = word.load(Ordering::Acquire);
            if v == Self::STOP {
                return;
            }
            if v == 2 * i + 1 {
                word.store(2 * i + 2, Ordering::Release);
                i += 1;
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

impl Default for HandoffLine {
    fn default() -> Self {
        Self::new()
    }
}

/// The cache-line floor between threads: one-way hand-off time
/// (microseconds) of a [`HandoffLine`] between two threads pinned to cores 0
/// and 1, the best of `reps` runs of at most `iters` round trips each (every
/// run also bounded by [`FLOOR_BUDGET`]). Both sides run in threads of their
/// own, so the caller's affinity is left alone.
pub fn cache_line_floor(iters: u64, reps: usize) -> f64 {
    (0..reps)
        .map(|_| {
            let line = HandoffLine::new();
            let line = &line;
            std::thread::scope(|s| {
                s.spawn(move || {
                    let _ = shm_ipc::futex::pin_current_thread(1);
                    line.echo();
                });
                s.spawn(move || {
                    let _ = shm_ipc::futex::pin_current_thread(0);
                    line.ping(iters)
                })
                .join()
                .unwrap_or(f64::INFINITY)
            })
        })
        .fold(f64::INFINITY, f64::min)
}

/// The memcpy floor: single-thread copy bandwidth in MB/s for `size`-byte
/// copies, cycling through `buffers` distinct source/destination pairs (the
/// working set of the benchmark it is compared with). Best of `reps`.
pub fn memcpy_floor(size: usize, buffers: usize, reps: usize) -> f64 {
    parallel_memcpy_floor(size, buffers, 1, reps)
}

/// The memcpy floor of a test in which `copiers` copies run at once (both
/// directions of `bibw`, the pairs of `mbw_mr`): `copiers` threads, thread
/// `i` pinned to core `i` (modulo the cores online), each copying as
/// [`memcpy_floor`] does over its own working set of `buffers` pairs, all
/// started together. Aggregate MB/s (all threads' bytes over the slowest
/// thread's time), best of `reps`. With one copier the copy runs in the
/// calling thread, which is left unpinned.
pub fn parallel_memcpy_floor(size: usize, buffers: usize, copiers: usize, reps: usize) -> f64 {
    if size == 0 || copiers == 0 {
        return 0.0;
    }
    let copies = ((256usize << 20) / size).clamp(buffers, 200_000);
    let mut sets: Vec<CopySet> = (0..copiers).map(|_| CopySet::new(size, buffers)).collect();
    (0..reps)
        .map(|_| {
            let secs = if copiers == 1 {
                sets[0].copy(copies)
            } else {
                let gate = std::sync::Barrier::new(copiers);
                let gate = &gate;
                std::thread::scope(|s| {
                    let runs: Vec<_> = sets
                        .iter_mut()
                        .enumerate()
                        .map(|(i, set)| {
                            s.spawn(move || {
                                let _ = shm_ipc::futex::pin_current_thread(i);
                                gate.wait();
                                set.copy(copies)
                            })
                        })
                        .collect();
                    runs.into_iter()
                        .map(|r| r.join().unwrap_or(f64::INFINITY))
                        .fold(0.0, f64::max)
                })
            };
            (copiers * size * copies) as f64 / 1e6 / secs
        })
        .fold(0.0, f64::max)
}

/// One copier's working set: `buffers` source/destination pairs.
struct CopySet {
    src: Vec<Vec<u8>>,
    dst: Vec<Vec<u8>>,
}

impl CopySet {
    fn new(size: usize, buffers: usize) -> CopySet {
        let src: Vec<Vec<u8>> = (0..buffers).map(|i| vec![i as u8; size]).collect();
        // Non-zero fill: zeroed allocations are lazily mapped, and the first
        // copy would time page faults instead of copying.
        let mut dst: Vec<Vec<u8>> = (0..buffers).map(|_| vec![1u8; size]).collect();
        for (d, s) in dst.iter_mut().zip(&src) {
            d.copy_from_slice(s); // warm-up pass, untimed
        }
        CopySet { src, dst }
    }

    /// `copies` copies cycling through the pairs; seconds.
    fn copy(&mut self, copies: usize) -> f64 {
        let n = self.src.len();
        let start = Instant::now();
        for k in 0..copies {
            let i = k % n;
            self.dst[i].copy_from_slice(black_box(&self.src[i]));
            black_box(&mut self.dst[i]);
        }
        start.elapsed().as_secs_f64()
    }
}

#[cfg(test)]
mod tests;
