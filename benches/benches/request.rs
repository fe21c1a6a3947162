//! Criterion benchmarks of the request lifecycle, the path every
//! non-blocking message takes: time per message **and heap allocations per
//! message**. Run with `cargo bench -p xdev-bench --bench request`.
//!
//! - `request/lifecycle/start_complete_wait`: a request on its own, no
//!   transport: [`Tracker::start`] (a send of an empty buffer),
//!   [`Request::new`], [`Tracker::complete`] with a success status, and
//!   [`Request::wait`], which hands the buffer back for the next iteration.
//! - `request/lifecycle/start_request_complete_wait`: the same through the
//!   path a device takes, [`Tracker::start_request`] (the device's
//!   reference to the core and the handle at once), then the completion,
//!   the device's reference dropped, and the wait.
//! - `request/lifecycle/lend_wait`: the handle's side of a lent request
//!   ([`Request::lent`], the psm device's receive): a fresh id, the
//!   handle, and its wait through a [`Lender`] whose operation is done by
//!   then and that builds the completion in place (no pooled core, no
//!   claim, no reference count).
//! - `request/thread/pingpong_0B`: two ranks of the `thread` device, one
//!   thread each (pinned to cores 0 and 1), opened in one world through the
//!   registry and used through the [`Device`] trait only. Per iteration rank
//!   0 posts an `irecv` for the answer, an `isend` of 0 bytes, and waits for
//!   both; rank 1 answers each message the same way (`irecv` + wait, `isend`
//!   + wait). Two messages per iteration.
//! - `request/thread/window_0B` and `window_8B`: the message rate test's
//!   loop (osu_mbw_mr, one pair): rank 0 posts 64 `isend`s of 0 (8) bytes,
//!   rank 1 64 `irecv`s, both wait for all, then rank 1 sends a zero-byte
//!   acknowledgement (a blocking `send`, not counted as a message). 64
//!   messages per iteration. At 8 bytes a message that arrives before its
//!   receive is posted is kept as an unexpected message, with its payload
//!   on the heap: how often depends on the timing, so that figure varies
//!   from run to run.
//!
//! Criterion prints the time per iteration and, through its throughput, the
//! messages per second (`elem/s`); ns per message is `10^9 / elem/s`.
//!
//! **Allocations.** A counting global allocator (the [`System`] allocator
//! behind atomic counters) counts every allocation of the process, both
//! ranks' threads included. Before criterion measures a benchmark, the
//! benchmark runs 1000 iterations to reach its steady state, then counts
//! the allocations of the next [`COUNTED`] iterations, outside criterion's
//! timing (the counters are switched off while criterion measures), and
//! prints a line
//!
//! ```text
//! request/thread/pingpong_0B: allocations/message: 2.000 (...)
//! request/thread/pingpong_0B: allocations/message by size: 232 B x 2.000
//! ```
//!
//! A message is one `isend` request on one side and one `irecv` request on
//! the other, so a request path with one allocation per request shows 2.
//! The counts run for every benchmark of this binary, also those a
//! criterion filter leaves out (they take well under a second each).
//!
//! Every loop here reuses its buffers (a completed request hands its buffer
//! back, and the next operation takes it again) and its request vectors, so
//! the benchmark itself allocates nothing per message: what is counted is
//! the request path's own.
//!
//! **Target: zero allocations per message in steady state when the caller
//! reuses its buffers** (issue 14). Request cores come from their tracker's
//! pool through a per-thread stash, and eager payloads that arrive early are
//! kept in reused buffers, so the figure printed here is 0 once warm.

// criterion's macros generate undocumented public functions.
#![allow(missing_docs)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use xdev::devkit::{Completion, KeepAlive, Lender, Progress, RequestCore, RequestKind, Tracker};
use xdev::registry::Registry;
use xdev::{Buffer, Config, Device, Envelope, Request, Source, Status, TagSel};

/// The System allocator, counting.
struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);
static FREES: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

/// Set only while [`count_allocations`] counts: the counters (and the
/// by-size table, [`SIZES`]) are updated only then, so criterion's timings
/// pay one relaxed load per allocation and free for them, not the counting
/// itself.
static COUNTING: AtomicBool = AtomicBool::new(false);

/// Slots of the by-size table.
const SLOTS: usize = 64;

/// Allocations by requested size: an open-addressing table of (size + 1,
/// count), filled lock-free (the allocator may not allocate or lock).
/// Sizes that find no free slot are counted in the last slot's overflow.
static SIZES: [(AtomicU64, AtomicU64); SLOTS] =
    [const { (AtomicU64::new(0), AtomicU64::new(0)) }; SLOTS];
static SIZES_OVERFLOW: AtomicU64 = AtomicU64::new(0);

fn count_size(size: usize) {
    let key = size as u64 + 1;
    let start = (size.wrapping_mul(0x9E37_79B9)) % SLOTS;
    for i in 0..SLOTS {
        let (k, n) = &SIZES[(start + i) % SLOTS];
        match k.compare_exchange(0, key, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => {
                n.fetch_add(1, Ordering::Relaxed);
                return;
            }
            Err(existing) if existing == key => {
                n.fetch_add(1, Ordering::Relaxed);
                return;
            }
            Err(_) => {}
        }
    }
    SIZES_OVERFLOW.fetch_add(1, Ordering::Relaxed);
}

fn count(size: usize) {
    if COUNTING.load(Ordering::Relaxed) {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        BYTES.fetch_add(size as u64, Ordering::Relaxed);
        count_size(size);
    }
}

// SAFETY: every call is forwarded to `System` with the caller's arguments;
// the counters are only atomics on the side.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: forwarded as received (GlobalAlloc::alloc's contract).
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: forwarded as received.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // A reallocation is an allocation too (it may move and copy).
        count(new_size);
        // SAFETY: forwarded as received.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if COUNTING.load(Ordering::Relaxed) {
            FREES.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: forwarded as received.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Iterations whose allocations are counted, after [`WARM_UP`] more.
const COUNTED: u64 = 20_000;

/// Iterations run before counting, to reach the steady state (queues and
/// pools grown to their working size).
const WARM_UP: u64 = 1_000;

/// The window of the stream benchmark (as in `xdev-bench --test rate`).
const WINDOW: usize = 64;

/// Context of this benchmark's messages.
const CTX: u32 = 0x5245_5155;

/// Runs `step` [`WARM_UP`] times, then counts the allocations, frees and
/// bytes of [`COUNTED`] more (each moving `messages` messages), and prints
/// them per message with the time per message of this run (one sample,
/// noisier than criterion's).
fn count_allocations(name: &str, messages: u64, mut step: impl FnMut()) {
    for _ in 0..WARM_UP {
        step();
    }
    for (k, n) in &SIZES {
        k.store(0, Ordering::Relaxed);
        n.store(0, Ordering::Relaxed);
    }
    SIZES_OVERFLOW.store(0, Ordering::Relaxed);
    COUNTING.store(true, Ordering::Relaxed);
    let (a0, f0, b0) = counters();
    let start = Instant::now();
    for _ in 0..COUNTED {
        step();
    }
    let secs = start.elapsed().as_secs_f64();
    let (a1, f1, b1) = counters();
    COUNTING.store(false, Ordering::Relaxed);
    let n = (COUNTED * messages) as f64;
    // The sizes, most frequent first, per message.
    let mut sizes: Vec<(u64, u64)> = SIZES
        .iter()
        .map(|(k, c)| (k.load(Ordering::Relaxed), c.load(Ordering::Relaxed)))
        .filter(|&(k, _)| k > 0)
        .map(|(k, c)| (k - 1, c))
        .collect();
    sizes.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut by_size: Vec<String> = sizes
        .iter()
        .map(|&(size, c)| format!("{size} B x {:.3}", c as f64 / n))
        .collect();
    let overflow = SIZES_OVERFLOW.load(Ordering::Relaxed);
    if overflow > 0 {
        by_size.push(format!("other sizes x {:.3}", overflow as f64 / n));
    }
    if by_size.is_empty() {
        by_size.push("none".into());
    }
    println!(
        "{name}: allocations/message: {:.3} (frees/message {:.3}, bytes/message {:.1}; \
         {} allocations over {} messages after {WARM_UP} warm-up iterations; \
         {:.1} ns/message in this run)\n{name}: allocations/message by size: {}",
        (a1 - a0) as f64 / n,
        (f1 - f0) as f64 / n,
        (b1 - b0) as f64 / n,
        a1 - a0,
        COUNTED * messages,
        secs * 1e9 / n,
        by_size.join(", "),
    );
}

fn counters() -> (u64, u64, u64) {
    (
        ALLOCS.load(Ordering::Relaxed),
        FREES.load(Ordering::Relaxed),
        BYTES.load(Ordering::Relaxed),
    )
}

/// Requests whose completion is set by the benchmark itself.
struct Inert;

impl Progress for Inert {
    fn progress(&self) {}
    fn wait(&self, core: &RequestCore) {
        while !core.is_done() {
            std::hint::spin_loop();
        }
    }
    fn cancel(&self, _: &xdev::devkit::CoreRef) -> bool {
        false
    }
}

/// A lender whose operations are done by the time they are waited for,
/// with no table: the handle's side of a lent request alone.
struct Lending;

impl Lending {
    fn status(token: u64) -> Status {
        let env = Envelope {
            source: token as usize,
            tag: 0,
            context: CTX,
        };
        Status::ok(env, 0)
    }
}

impl Lender for Lending {
    fn test_lent(&self, _: u64) -> bool {
        true
    }
    fn wait_lent(&self, token: u64, buf: Buffer, _: &mut KeepAlive) -> Completion {
        Completion {
            buf,
            status: Lending::status(token),
        }
    }
    fn cancel_lent(&self, _: u64) -> bool {
        false
    }
    fn drop_lent(&self, _: u64, _: Buffer) -> KeepAlive {
        None
    }
    fn hold_lent(&self, token: u64, buf: Buffer) -> (Request, KeepAlive) {
        (Tracker::new().completed(buf, Lending::status(token)), None)
    }
}

/// A request created and completed on its own: start, handle, complete,
/// wait; the buffer (empty, never reallocated) comes back for the next one.
fn lifecycle(c: &mut Criterion) {
    let tracker = Tracker::new();
    let engine: Arc<dyn Progress> = Arc::new(Inert);
    let env = Envelope {
        source: 1,
        tag: 0,
        context: CTX,
    };
    let mut buf = Some(Buffer::from(Vec::new()));
    let mut step = || {
        let core = tracker.start(RequestKind::Send, buf.take().expect("buffer back"));
        let req = Request::new(core.clone(), engine.clone());
        tracker.complete(&core, Status::ok(env, 0));
        drop(core);
        buf = Some(req.wait().buf);
    };
    count_allocations("request/lifecycle/start_complete_wait", 1, &mut step);
    let mut g = c.benchmark_group("request/lifecycle");
    g.throughput(Throughput::Elements(1));
    g.bench_function("start_complete_wait", |b| b.iter(&mut step));
    // The path a device takes: `start_request` (the device's reference and
    // the handle at once, the handle counting no reference to the engine),
    // a completion, the device letting go, and the wait.
    let engine = Arc::new(Inert);
    let mut step = || {
        let back = buf.take().expect("buffer back");
        let (core, handle) = tracker.start_request(RequestKind::Recv, back, &engine);
        tracker.complete(&core, Status::ok(env, 0));
        drop(core);
        buf = Some(handle.into_request().wait().buf);
    };
    count_allocations(
        "request/lifecycle/start_request_complete_wait",
        1,
        &mut step,
    );
    g.bench_function("start_request_complete_wait", |b| b.iter(&mut step));
    // A lent request: id, handle, wait.
    let lender = Lending;
    let mut step = || {
        let back = buf.take().expect("buffer back");
        // SAFETY: the lender lives on this stack frame for the whole loop,
        // past every wait.
        let req = unsafe { Request::lent(tracker.lend_id(), 1, back, &lender) };
        buf = Some(req.wait().buf);
    };
    count_allocations("request/lifecycle/lend_wait", 1, &mut step);
    g.bench_function("lend_wait", |b| b.iter(&mut step));
    g.finish();
}

/// Ranks 0 and 1 of a fresh two-rank world of the `thread` device.
fn thread_pair() -> (Arc<dyn Device>, Arc<dyn Device>) {
    let mut reg = Registry::new();
    shm_ipc::thread::register(&mut reg);
    let job = format!("request-bench-{}-{}", std::process::id(), next_job());
    let open = |rank| {
        reg.open("thread", &Config::new(rank, 2, job.clone()))
            .expect("open the thread device")
    };
    (open(0), open(1))
}

fn next_job() -> u64 {
    static JOBS: AtomicU64 = AtomicU64::new(0);
    JOBS.fetch_add(1, Ordering::Relaxed)
}

fn pin(core: usize) {
    // Best effort: an unpinned thread still measures.
    let _ = shm_ipc::futex::pin_current_thread(core);
}

/// Rank 1 of the pingpong: answers every message until `stop` is set
/// (the message that follows `stop` is not answered).
fn echo(dev: &dyn Device, stop: &AtomicBool) {
    pin(1);
    let (mut rbuf, mut sbuf) = (Buffer::from(Vec::new()), Buffer::from(Vec::new()));
    loop {
        let r = dev.irecv(rbuf, Source::Rank(0), TagSel::Tag(0), CTX);
        rbuf = r.wait().into_result().expect("pingpong receive").0;
        if stop.load(Ordering::Acquire) {
            return;
        }
        let s = dev.isend(sbuf, 0, 0, CTX);
        sbuf = s.wait().into_result().expect("pingpong send").0;
    }
}

/// isend + irecv + wait of 0 bytes between two ranks of the thread device.
fn thread_pingpong(c: &mut Criterion) {
    let (d0, d1) = thread_pair();
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| echo(&*d1, &stop));
        pin(0);
        let dev = &*d0;
        let mut bufs = Some((Buffer::from(Vec::new()), Buffer::from(Vec::new())));
        let mut step = || {
            let (rbuf, sbuf) = bufs.take().expect("buffers back");
            let r = dev.irecv(rbuf, Source::Rank(1), TagSel::Tag(0), CTX);
            let s = dev.isend(sbuf, 1, 0, CTX);
            let sbuf = s.wait().into_result().expect("pingpong send").0;
            let rbuf = r.wait().into_result().expect("pingpong receive").0;
            bufs = Some((rbuf, sbuf));
        };
        count_allocations("request/thread/pingpong_0B", 2, &mut step);
        let mut g = c.benchmark_group("request/thread");
        g.throughput(Throughput::Elements(2));
        g.bench_function("pingpong_0B", |b| b.iter(&mut step));
        g.finish();
        stop.store(true, Ordering::Release);
        dev.send(&[], 1, 0, CTX).expect("the last message");
    });
    d0.finish().expect("finish rank 0");
    d1.finish().expect("finish rank 1");
}

/// Rank 1 of the window stream: receives windows of [`WINDOW`] messages of
/// `size` bytes and acknowledges each, until `stop` is set (the window that
/// follows `stop` is not acknowledged).
fn window_receiver(dev: &dyn Device, size: usize, stop: &AtomicBool) {
    pin(1);
    let mut bufs: Vec<Buffer> = (0..WINDOW).map(|_| Buffer::from(vec![0u8; size])).collect();
    let mut reqs: Vec<Request> = Vec::with_capacity(WINDOW);
    loop {
        reqs.extend(
            bufs.drain(..)
                .map(|b| dev.irecv(b, Source::Rank(0), TagSel::Tag(5), CTX)),
        );
        for r in reqs.drain(..) {
            bufs.push(r.wait().into_result().expect("window receive").0);
        }
        if stop.load(Ordering::Acquire) {
            return;
        }
        dev.send(&[], 0, 6, CTX).expect("acknowledgement");
    }
}

/// The message rate loop on the thread device, 0- and 8-byte messages.
fn thread_window(c: &mut Criterion) {
    for size in [0usize, 8] {
        thread_window_of(c, size);
    }
}

fn thread_window_of(c: &mut Criterion, size: usize) {
    let (d0, d1) = thread_pair();
    let stop = AtomicBool::new(false);
    let name = format!("window_{size}B");
    std::thread::scope(|s| {
        s.spawn(|| window_receiver(&*d1, size, &stop));
        pin(0);
        let dev = &*d0;
        let mut bufs: Vec<Buffer> = (0..WINDOW)
            .map(|_| Buffer::from(vec![0x5Au8; size]))
            .collect();
        let mut reqs: Vec<Request> = Vec::with_capacity(WINDOW);
        let send_window = |bufs: &mut Vec<Buffer>, reqs: &mut Vec<Request>| {
            reqs.extend(bufs.drain(..).map(|b| dev.isend(b, 1, 5, CTX)));
            for r in reqs.drain(..) {
                bufs.push(r.wait().into_result().expect("window send").0);
            }
        };
        let mut step = || {
            send_window(&mut bufs, &mut reqs);
            dev.recv(&mut [], Source::Rank(1), TagSel::Tag(6), CTX)
                .expect("acknowledgement");
        };
        count_allocations(&format!("request/thread/{name}"), WINDOW as u64, &mut step);
        let mut g = c.benchmark_group("request/thread");
        g.throughput(Throughput::Elements(WINDOW as u64));
        g.bench_function(&name, |b| b.iter(&mut step));
        g.finish();
        stop.store(true, Ordering::Release);
        send_window(&mut bufs, &mut reqs);
    });
    d0.finish().expect("finish rank 0");
    d1.finish().expect("finish rank 1");
}

criterion_group!(benches, lifecycle, thread_pingpong, thread_window);
criterion_main!(benches);
