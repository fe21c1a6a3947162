//! `xdev-bench` is the stack's OSU-style benchmark harness: pingpong latency
//! and windowed bandwidth over any xdev [`Device`], printed in the OSU
//! Micro-Benchmarks layout (or as JSON lines), next to **floors** measured in
//! the same run: the one-way hand-off of a cache line between the two ranks'
//! cores (two pinned threads, or for devices whose ranks are processes, the
//! two rank processes through a shared mapping: [`process`]), and
//! single-thread `memcpy` bandwidth over the same working set.
//!
//! It is not a timed test suite: nothing here asserts a speed. The figures are
//! ratios read side by side (value / floor).

pub mod plot;
pub mod psm_raw;
pub mod report;

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use xdev::{Buffer, Device, Request, Source, TagSel};

pub mod process;

/// Context the benchmarks use.
pub const BENCH_CONTEXT: u32 = 0x4245_4e43;

/// Message sizes: 0, then powers of two up to `max`.
pub fn sizes(max: usize) -> Vec<usize> {
    let mut v = vec![0];
    let mut s = 1;
    while s <= max {
        v.push(s);
        s *= 2;
    }
    v
}

/// OSU's iteration counts for latency at `size`: (iterations, warm-up).
pub fn latency_iterations(size: usize) -> (usize, usize) {
    if size > 8192 {
        (1_000, 10)
    } else {
        (10_000, 100)
    }
}

/// OSU's iteration counts for bandwidth at `size`: (iterations, warm-up).
pub fn bandwidth_iterations(size: usize) -> (usize, usize) {
    if size > 8192 {
        (20, 2)
    } else {
        (100, 10)
    }
}

/// The OSU window of outstanding sends in the bandwidth test.
pub const WINDOW: usize = 64;

/// Pingpong between ranks 0 and 1: half the round-trip time in microseconds,
/// on rank 0 (`None` elsewhere). Other ranks idle.
pub fn latency(
    dev: &dyn Device,
    size: usize,
    iters: usize,
    skip: usize,
) -> xdev::Result<Option<f64>> {
    let me = dev.id();
    let mut buf = vec![0xA5u8; size];
    let c = BENCH_CONTEXT;
    let secs = timed(iters, skip, || {
        match me {
            0 => {
                dev.send(&buf, 1, 1, c)?;
                dev.recv(&mut buf, Source::Rank(1), TagSel::Tag(1), c)?;
            }
            1 => {
                dev.recv(&mut buf, Source::Rank(0), TagSel::Tag(1), c)?;
                dev.send(&buf, 0, 1, c)?;
            }
            _ => {}
        }
        Ok(())
    })?;
    Ok((me == 0).then_some(secs * 1e6 / (2.0 * iters as f64)))
}

/// Runs `step` `skip` times untimed, then `iters` times timed; seconds.
pub(crate) fn timed(
    iters: usize,
    skip: usize,
    mut step: impl FnMut() -> xdev::Result<()>,
) -> xdev::Result<f64> {
    for _ in 0..skip {
        step()?;
    }
    let start = Instant::now();
    for _ in 0..iters {
        step()?;
    }
    Ok(start.elapsed().as_secs_f64())
}

/// osu_bw: rank 0 posts `WINDOW` non-blocking sends, rank 1 the matching
/// receives, then rank 1 answers with a zero-byte acknowledgement; repeated
/// `iters` times. MB/s (10^6 bytes per second) on rank 0.
///
/// Each outstanding operation owns its buffer (the xdev rule), so the window
/// uses `WINDOW` distinct buffers per side, allocated once and reused.
pub fn bandwidth(
    dev: &dyn Device,
    size: usize,
    iters: usize,
    skip: usize,
) -> xdev::Result<Option<f64>> {
    let me = dev.id();
    let c = BENCH_CONTEXT + 1;
    let mut bufs: Vec<Buffer> = (0..WINDOW)
        .map(|_| Buffer::from(vec![0x5Au8; size]))
        .collect();
    let secs = timed(iters, skip, || {
        match me {
            0 => {
                let reqs: Vec<Request> = bufs.drain(..).map(|b| dev.isend(b, 1, 2, c)).collect();
                for r in reqs {
                    let (b, _) = r.wait().into_result()?;
                    bufs.push(b);
                }
                dev.recv(&mut [], Source::Rank(1), TagSel::Tag(3), c)?;
            }
            1 => {
                let reqs: Vec<Request> = bufs
                    .drain(..)
                    .map(|b| dev.irecv(b, Source::Rank(0), TagSel::Tag(2), c))
                    .collect();
                for r in reqs {
                    let (b, _) = r.wait().into_result()?;
                    bufs.push(b);
                }
                dev.send(&[], 0, 3, c)?;
            }
            _ => {}
        }
        Ok(())
    })?;
    let mb = (size * WINDOW * iters) as f64 / 1e6;
    Ok((me == 0).then_some(mb / secs))
}

/// osu_bibw: both ranks post `WINDOW` non-blocking receives from the other,
/// then `WINDOW` non-blocking sends to it, and wait for all of them;
/// repeated `iters` times. MB/s in both directions together (10^6 bytes per
/// second: `2 * size * WINDOW * iters / time`), on rank 0.
///
/// Each side uses `WINDOW` receive and `WINDOW` send buffers, allocated once
/// and reused (an outstanding operation owns its buffer).
pub fn bibandwidth(
    dev: &dyn Device,
    size: usize,
    iters: usize,
    skip: usize,
) -> xdev::Result<Option<f64>> {
    let me = dev.id();
    let c = BENCH_CONTEXT + 3;
    let mut rbufs: Vec<Buffer> = (0..WINDOW).map(|_| Buffer::from(vec![0u8; size])).collect();
    let mut sbufs: Vec<Buffer> = (0..WINDOW)
        .map(|_| Buffer::from(vec![0x3Cu8; size]))
        .collect();
    let secs = timed(iters, skip, || {
        let peer = match me {
            0 => 1,
            1 => 0,
            _ => return Ok(()),
        };
        let recvs: Vec<Request> = rbufs
            .drain(..)
            .map(|b| dev.irecv(b, Source::Rank(peer), TagSel::Tag(4), c))
            .collect();
        let sends: Vec<Request> = sbufs.drain(..).map(|b| dev.isend(b, peer, 4, c)).collect();
        for r in recvs {
            let (b, _) = r.wait().into_result()?;
            rbufs.push(b);
        }
        for r in sends {
            let (b, _) = r.wait().into_result()?;
            sbufs.push(b);
        }
        Ok(())
    })?;
    let mb = (2 * size * WINDOW * iters) as f64 / 1e6;
    Ok((me == 0).then_some(mb / secs))
}

/// The pairs of an osu_mbw_mr run on `ranks` ranks: rank `i` of the first
/// half sends to rank `i + ranks / 2` (an odd last rank idles).
pub fn mbw_pairs(ranks: usize) -> usize {
    ranks / 2
}

/// osu_mbw_mr: the first half of the ranks each send to their partner in
/// the second half ([`mbw_pairs`]), all pairs at once: per iteration a
/// sender posts `WINDOW` non-blocking sends and waits for them, then receives
/// a zero-byte acknowledgement, which its receiver sends once its `WINDOW`
/// receives have completed. Every rank passes a barrier before the timed
/// iterations and another after them, so rank 0's clock covers every pair.
/// Aggregate MB/s of all pairs on rank 0 (messages per second are
/// `MB/s * 10^6 / size`).
pub fn multi_bandwidth(
    dev: &dyn Device,
    size: usize,
    iters: usize,
    skip: usize,
) -> xdev::Result<Option<f64>> {
    let pairs = mbw_pairs(dev.size());
    let secs = stream(dev, pairs, size, iters, skip, BENCH_CONTEXT + 4)?;
    let mb = (pairs * size * WINDOW * iters) as f64 / 1e6;
    Ok(secs.map(|s| mb / s))
}

/// The message rate test (`xdev-bench --test rate`): osu_mbw_mr's loop with
/// one pair, rank 0 sending to rank 1 (other ranks idle but pass the
/// barriers). Per iteration rank 0 posts [`WINDOW`] non-blocking sends of
/// `size` bytes and rank 1 the matching [`WINDOW`] receives; both wait for
/// all of them, then rank 1 sends a zero-byte acknowledgement. Messages per
/// second on rank 0: `WINDOW * iters / time`, the acknowledgements not
/// counted (OSU's `Messages/s` column).
///
/// Each outstanding operation owns its buffer (the xdev rule), so each side
/// posts `WINDOW` distinct buffers, allocated once and reused, and the
/// requests go into one vector allocated once: in steady state the loop
/// itself allocates nothing, so what a profile or an allocation count shows
/// per message is the device's.
pub fn message_rate(
    dev: &dyn Device,
    size: usize,
    iters: usize,
    skip: usize,
) -> xdev::Result<Option<f64>> {
    let secs = stream(dev, 1, size, iters, skip, BENCH_CONTEXT + 5)?;
    Ok(secs.map(|s| (WINDOW * iters) as f64 / s))
}

/// The loop of [`multi_bandwidth`] and [`message_rate`] with `pairs` pairs
/// (rank `i < pairs` sends to rank `i + pairs`) on context `c`: seconds of
/// the timed iterations on rank 0, between two barriers of every rank.
fn stream(
    dev: &dyn Device,
    pairs: usize,
    size: usize,
    iters: usize,
    skip: usize,
    c: u32,
) -> xdev::Result<Option<f64>> {
    let me = dev.id();
    let mut bufs: Vec<Buffer> = (0..WINDOW)
        .map(|_| Buffer::from(vec![0x69u8; size]))
        .collect();
    let mut reqs: Vec<Request> = Vec::with_capacity(WINDOW);
    let mut step = || -> xdev::Result<()> {
        if me < pairs {
            let to = me + pairs;
            reqs.extend(bufs.drain(..).map(|b| dev.isend(b, to, 5, c)));
            for r in reqs.drain(..) {
                let (b, _) = r.wait().into_result()?;
                bufs.push(b);
            }
            dev.recv(&mut [], Source::Rank(to), TagSel::Tag(6), c)?;
        } else if me < 2 * pairs {
            let from = me - pairs;
            reqs.extend(
                bufs.drain(..)
                    .map(|b| dev.irecv(b, Source::Rank(from), TagSel::Tag(5), c)),
            );
            for r in reqs.drain(..) {
                let (b, _) = r.wait().into_result()?;
                bufs.push(b);
            }
            dev.send(&[], from, 6, c)?;
        }
        Ok(())
    };
    for _ in 0..skip {
        step()?;
    }
    xdev::conformance::barrier(dev)?;
    let start = Instant::now();
    for _ in 0..iters {
        step()?;
    }
    xdev::conformance::barrier(dev)?;
    let secs = start.elapsed().as_secs_f64();
    Ok((me == 0).then_some(secs))
}

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
/// ([`process::ProcessFloor`]), so both floors run this very loop.
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

/// OSU-style output.
pub mod osu {
    /// The header lines of a latency table. `between` says whose cores the
    /// cache-line floor joins (`"threads"` or `"processes"`).
    pub fn latency_header(device: &str, between: &str, floor_us: f64) -> String {
        format!(
            "# OSU MPI Latency Test (xdev-bench)\n# Device: {device}; cache-line floor {floor_us:.3} us (two {between} pinned to cores 0 and 1)\n{:<10}{:>20}{:>20}{:>12}",
            "# Size", "Avg Latency(us)", "Floor(us)", "Ratio"
        )
    }

    /// The header lines of a bandwidth table.
    pub fn bandwidth_header(device: &str) -> String {
        format!(
            "# OSU MPI Bandwidth Test (xdev-bench)\n# Device: {device}; floor = memcpy over the same working set\n{:<10}{:>20}{:>20}{:>12}",
            "# Size", "Bandwidth (MB/s)", "Floor(MB/s)", "Ratio"
        )
    }

    /// The header lines of a bidirectional bandwidth table (osu_bibw).
    pub fn bibandwidth_header(device: &str) -> String {
        format!(
            "# OSU MPI Bi-Directional Bandwidth Test (xdev-bench)\n# Device: {device}; window size: {window}; floor = two concurrent memcpys (one per rank's core) over the same working set\n{:<10}{:>20}{:>20}{:>12}",
            "# Size", "Bandwidth (MB/s)", "Floor(MB/s)", "Ratio",
            window = crate::WINDOW
        )
    }

    /// The header lines of a multiple bandwidth / message rate table
    /// (osu_mbw_mr): OSU's `MB/s` and `Messages/s` columns, then the floor
    /// and MB/s over the floor.
    pub fn multi_bandwidth_header(device: &str, pairs: usize) -> String {
        format!(
            "# OSU MPI Multiple Bandwidth / Message Rate Test (xdev-bench)\n# [ pairs: {pairs} ] [ window size: {window} ]\n# Device: {device}; floor = {pairs} concurrent memcpys (one per pair) over the same working set\n{:<10}{:>20}{:>20}{:>20}{:>12}",
            "# Size", "MB/s", "Messages/s", "Floor(MB/s)", "Ratio",
            window = crate::WINDOW
        )
    }

    /// The header lines of a message rate table (`--test rate`: osu_mbw_mr
    /// with one pair): size, messages per second, the floor
    /// ([`crate::rate_floor`] of the cache-line floor between the ranks'
    /// cores, `between` being `"threads"` or `"processes"`) and the ratio.
    pub fn rate_header(device: &str, between: &str, cache_line_us: f64) -> String {
        format!(
            "# OSU MPI Message Rate Test (xdev-bench)\n# [ pairs: 1 ] [ window size: {window} ]\n# Device: {device}; floor = one cache-line hand-off per message: 1 / {cache_line_us:.3} us (two {between} pinned to cores 0 and 1)\n{:<10}{:>20}{:>20}{:>12}",
            "# Size", "Messages/s", "Floor(msg/s)", "Ratio",
            window = crate::WINDOW
        )
    }

    /// One row of a multiple bandwidth / message rate table: size, MB/s,
    /// messages per second, floor, MB/s over the floor.
    pub fn multi_bandwidth_row(size: usize, mbs: f64, floor: f64) -> String {
        let ratio = if floor > 0.0 { mbs / floor } else { f64::NAN };
        format!(
            "{size:<10}{mbs:>20.2}{rate:>20.2}{floor:>20.2}{ratio:>12.2}",
            rate = message_rate(size, mbs)
        )
    }

    /// Messages per second of `size`-byte messages at `mbs` MB/s.
    pub fn message_rate(size: usize, mbs: f64) -> f64 {
        if size == 0 {
            0.0
        } else {
            mbs * 1e6 / size as f64
        }
    }

    /// One JSON record of a multiple bandwidth / message rate run: the
    /// [`json`] fields plus the pairs and messages per second.
    pub fn multi_bandwidth_json(
        device: &str,
        size: usize,
        mbs: f64,
        floor: f64,
        pairs: usize,
    ) -> String {
        let base = json(device, "mbw_mr", size, mbs, "MB/s", floor);
        format!(
            "{},\"pairs\":{pairs},\"messages_per_s\":{:.2}}}",
            &base[..base.len() - 1],
            message_rate(size, mbs)
        )
    }

    /// The line saying a device was not measured, and why: an OSU comment
    /// line, or with `json` a record `{"device":..,"not_measured":..}`.
    pub fn not_measured(device: &str, reason: &str, json: bool) -> String {
        if json {
            format!(
                "{{\"device\":\"{}\",\"not_measured\":\"{}\"}}",
                escape(device),
                escape(reason)
            )
        } else {
            let reason = reason.replace('\n', " ");
            format!("# Device: {device}: not measured: {reason}")
        }
    }

    /// `s` as the inside of a JSON string.
    pub fn escape(s: &str) -> String {
        let mut out = String::with_capacity(s.len());
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
                c => out.push(c),
            }
        }
        out
    }

    /// One row: size left-aligned in 10 columns, values right-aligned in 20
    /// with 2 decimals, then value/floor.
    pub fn row(size: usize, value: f64, floor: f64) -> String {
        let ratio = if floor > 0.0 { value / floor } else { f64::NAN };
        format!("{size:<10}{value:>20.2}{floor:>20.2}{ratio:>12.2}")
    }

    /// The header lines of the floors table (`--test floor`).
    pub fn floor_header(between: &str) -> String {
        format!(
            "# xdev-bench floors\n# Cache-line hand-off between two {between} pinned to cores 0 and 1; memcpy in one thread over the bandwidth test's working set\n{:<10}{:>20}{:>20}",
            "# Size", "Cache-line(us)", "memcpy(MB/s)"
        )
    }

    /// One row of the floors table.
    pub fn floor_row(size: usize, cache_line_us: f64, memcpy_mbs: f64) -> String {
        format!("{size:<10}{cache_line_us:>20.3}{memcpy_mbs:>20.2}")
    }

    /// One JSON record of a floor measured alone; `between` is
    /// `"threads"` or `"processes"`, `test` `"cache_line"` or `"memcpy"`.
    pub fn floor_json(between: &str, test: &str, size: usize, value: f64, unit: &str) -> String {
        format!(
            "{{\"floor\":\"{between}\",\"test\":\"{test}\",\"size\":{size},\"value\":{value:.4},\"unit\":\"{unit}\"}}"
        )
    }

    /// One JSON record.
    pub fn json(
        device: &str,
        test: &str,
        size: usize,
        value: f64,
        unit: &str,
        floor: f64,
    ) -> String {
        format!(
            "{{\"device\":\"{device}\",\"test\":\"{test}\",\"size\":{size},\"value\":{value:.4},\"unit\":\"{unit}\",\"floor\":{floor:.4}}}"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_osu_powers_of_two() {
        assert_eq!(sizes(8), vec![0, 1, 2, 4, 8]);
        assert_eq!(*sizes(4 << 20).last().unwrap(), 4 << 20);
    }

    #[test]
    fn osu_row_layout() {
        let r = osu::row(8, 0.25, 0.125);
        assert_eq!(&r[..10], "8         ");
        assert_eq!(r[10..30].trim_start(), "0.25");
        assert_eq!(r.len(), 62);
        assert!(r.ends_with("2.00"));
    }

    #[test]
    fn floors_are_positive() {
        assert!(cache_line_floor(2_000, 1) > 0.0);
        assert!(memcpy_floor(4096, 2, 1) > 0.0);
    }

    #[test]
    fn benchmarks_run_on_the_thread_device() {
        let out = shm_ipc::ThreadWorld::new(2).run(|dev| {
            let l = latency(dev, 8, 50, 5).unwrap();
            let b = bandwidth(dev, 1024, 3, 1).unwrap();
            (l, b)
        });
        assert!(out[0].0.unwrap() > 0.0 && out[0].1.unwrap() > 0.0);
        assert!(out[1].0.is_none());
    }

    #[test]
    fn bibw_and_mbw_mr_run_on_the_thread_device() {
        let out = shm_ipc::ThreadWorld::new(2).run(|dev| bibandwidth(dev, 4096, 3, 1).unwrap());
        assert!(out[0].unwrap() > 0.0 && out[1].is_none());
        // Five ranks: two pairs, rank 4 idles but passes the barriers.
        let out = shm_ipc::ThreadWorld::new(5).run(|dev| multi_bandwidth(dev, 64, 3, 1).unwrap());
        assert!(out[0].unwrap() > 0.0);
        assert!(out[1..].iter().all(Option::is_none));
        assert_eq!((mbw_pairs(4), mbw_pairs(5), mbw_pairs(2)), (2, 2, 1));
    }

    #[test]
    fn message_rate_runs_on_the_thread_device() {
        let out = shm_ipc::ThreadWorld::new(2).run(|dev| message_rate(dev, 8, 5, 1).unwrap());
        let rate = out[0].unwrap();
        assert!(rate.is_finite() && rate > 0.0, "{rate}");
        assert!(out[1].is_none());
        // One pair whatever the world: rank 2 idles but passes the barriers.
        let out = shm_ipc::ThreadWorld::new(3).run(|dev| message_rate(dev, 1, 3, 1).unwrap());
        assert!(out[0].unwrap() > 0.0 && out[1].is_none() && out[2].is_none());
        assert_eq!(rate_floor(0.25), 4e6);
        assert_eq!(rate_floor(0.0), 0.0);
        let h = osu::rate_header("thread", "threads", 0.25);
        assert!(
            h.starts_with(
                "# OSU MPI Message Rate Test (xdev-bench)\n# [ pairs: 1 ] [ window size: 64 ]\n"
            ),
            "{h}"
        );
        assert!(h.contains("1 / 0.250 us (two threads pinned"), "{h}");
        assert!(
            h.lines()
                .last()
                .unwrap()
                .starts_with("# Size              Messages/s        Floor(msg/s)"),
            "{h}"
        );
    }

    #[test]
    fn parallel_memcpy_floor_counts_every_copier() {
        assert_eq!(parallel_memcpy_floor(0, 4, 2, 1), 0.0);
        assert!(parallel_memcpy_floor(4096, 4, 2, 1) > 0.0);
        assert!(parallel_memcpy_floor(4096, 4, 1, 1) > 0.0);
    }

    #[test]
    fn multi_bandwidth_layout() {
        let r = osu::multi_bandwidth_row(4, 2.0, 4.0);
        assert_eq!(&r[..10], "4         ");
        assert_eq!(r[10..30].trim_start(), "2.00");
        assert_eq!(r[30..50].trim_start(), "500000.00");
        assert!(r.ends_with("0.50"), "{r}");
        let h = osu::multi_bandwidth_header("shm", 2);
        assert!(h.starts_with("# OSU MPI Multiple Bandwidth / Message Rate Test"));
        assert!(h.contains("# [ pairs: 2 ] [ window size: 64 ]"));
        let cols = h.lines().last().unwrap();
        assert!(
            cols.starts_with("# Size                    MB/s          Messages/s"),
            "{cols:?}"
        );
        assert!(
            osu::bibandwidth_header("shm").starts_with("# OSU MPI Bi-Directional Bandwidth Test")
        );
        assert_eq!(
            osu::multi_bandwidth_json("shm", 2, 1.0, 2.0, 2),
            "{\"device\":\"shm\",\"test\":\"mbw_mr\",\"size\":2,\"value\":1.0000,\"unit\":\"MB/s\",\"floor\":2.0000,\"pairs\":2,\"messages_per_s\":500000.00}"
        );
    }
}
