//! The OSU benchmark loops over any xdev [`Device`]: latency (osu_latency),
//! bandwidth (osu_bw), bidirectional bandwidth (osu_bibw), multiple bandwidth
//! and message rate (osu_mbw_mr), with OSU's message sizes and iteration
//! counts. Each gives its figure on rank 0 and `None` elsewhere.

use std::time::Instant;

use xdev::devkit::Completion;
use xdev::{Buffer, Device, Rank, Request, Source, TagSel};

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

/// OSU's iteration counts for bandwidth at `size`: (iterations, warm-up),
/// the warm-up of messages above 8 KiB lengthened to
/// [`large_warm_up`] windows.
pub fn bandwidth_iterations(size: usize) -> (usize, usize) {
    if size > 8192 {
        (20, large_warm_up(size))
    } else {
        (100, 10)
    }
}

/// Bytes per side that the warm-up of a window test (bw, bibw, rate) moves
/// at least, for messages above 8 KiB.
///
/// OSU warms up such sizes with 2 windows, a few milliseconds. On a
/// virtualized host that is shorter than the time a core takes to come
/// back to speed after idling, and a device's rounds here start after an
/// idle stretch (the other rank waits while the floor is measured), where
/// the MPI peers run their rounds back to back. Traced at 256 KiB (shm
/// bibw): each round's first five windows copied at 55-110 us per message,
/// then 29-33 us; a bare `process_vm_readv` loop in C idled 50 ms before
/// each round of 5 windows fell from 17-19 to 9.6-11 GB/s. 128 MiB is
/// about 15 ms at the copy speeds measured. The MPI peers (`osu_peer.c`)
/// and UCX's `tag_bw` warm up as long.
pub const WARM_UP_BYTES: usize = 128 << 20;

/// Warm-up windows of a window test with `size`-byte messages above 8 KiB:
/// enough to move [`WARM_UP_BYTES`] per side, and at least OSU's 2.
pub fn large_warm_up(size: usize) -> usize {
    WARM_UP_BYTES.div_ceil(size.max(1) * WINDOW).max(2)
}

/// The OSU window of outstanding sends in the bandwidth test.
pub const WINDOW: usize = 64;

/// A benchmark buffer of `size` bytes filled with `fill`.
///
/// From one page up it starts on a page boundary, as OSU's
/// `posix_memalign`ed buffers (and `osu_peer`'s) do: a copy between two
/// processes or by a NIC runs page by page, and buffers at different
/// offsets into their pages split every page's copy. `malloc` puts large
/// blocks 16 bytes into a page, so without this the device and the peer it
/// is compared with were measured on differently placed memory. Below a
/// page it is a plain heap buffer: a window of 64 page-aligned small
/// buffers would all fall into the same cache sets.
pub fn bench_buffer(size: usize, fill: u8) -> Buffer {
    if size < xdev::PageAligned::PAGE {
        return Buffer::from(vec![fill; size]);
    }
    let mut b = Buffer::zeroed_page_aligned(size);
    b.fill(fill);
    b
}

/// Pingpong between ranks 0 and 1: half the round-trip time in microseconds,
/// on rank 0 (`None` elsewhere). Other ranks idle.
pub fn latency(
    dev: &dyn Device,
    size: usize,
    iters: usize,
    skip: usize,
) -> xdev::Result<Option<f64>> {
    let me = dev.id();
    let mut buf = bench_buffer(size, 0xA5);
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
/// uses `WINDOW` distinct buffers per side, allocated once and reused; the
/// requests go into one vector allocated once (OSU's static array).
pub fn bandwidth(
    dev: &dyn Device,
    size: usize,
    iters: usize,
    skip: usize,
) -> xdev::Result<Option<f64>> {
    let me = dev.id();
    let c = BENCH_CONTEXT + 1;
    let mut bufs: Vec<Buffer> = (0..WINDOW).map(|_| bench_buffer(size, 0x5A)).collect();
    let mut reqs: Vec<Request> = Vec::with_capacity(WINDOW);
    let side = match me {
        0 => Some(Side::Sender(1)),
        1 => Some(Side::Receiver(0)),
        _ => None,
    };
    let secs = timed(iters, skip, || match side {
        Some(side) => window(dev, side, &mut bufs, &mut reqs, 2, c),
        None => Ok(()),
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
/// and reused (an outstanding operation owns its buffer), and one vector of
/// requests, allocated once.
pub fn bibandwidth(
    dev: &dyn Device,
    size: usize,
    iters: usize,
    skip: usize,
) -> xdev::Result<Option<f64>> {
    let c = BENCH_CONTEXT + 3;
    // One vector for the window's requests, allocated once (OSU's loop
    // keeps them in a static array): the loop allocates nothing per window.
    let mut reqs: Vec<Request> = Vec::with_capacity(2 * WINDOW);
    bibw_loop(dev, size, iters, skip, |peer, rbufs, sbufs| {
        let receives = rbufs.len();
        reqs.extend(
            rbufs
                .drain(..)
                .map(|b| dev.irecv(b, Source::Rank(peer), TagSel::Tag(4), c)),
        );
        reqs.extend(sbufs.drain(..).map(|b| dev.isend(b, peer, 4, c)));
        let waited = reqs.drain(..).map(|r| r.wait().into_result());
        give_back(waited, receives, rbufs, sbufs)
    })
}

/// osu_bibw's exchange made with the window calls: both ranks post their
/// [`WINDOW`] receives with one [`Device::irecv_many`], then their sends
/// with one [`Device::isend_many`], and wait for all with
/// [`Request::wait_all`]. Not OSU's loop (an MPI program posts one call per
/// message), so it is a series of its own beside `bibw`: what a runtime
/// that batches its posts gets. The buffers, the requests and the
/// completions live in vectors allocated once. MB/s of both directions on
/// rank 0.
pub fn bibandwidth_window(
    dev: &dyn Device,
    size: usize,
    iters: usize,
    skip: usize,
) -> xdev::Result<Option<f64>> {
    let c = BENCH_CONTEXT + 6;
    let mut reqs = Vec::with_capacity(2 * WINDOW);
    let mut done = Vec::with_capacity(2 * WINDOW);
    bibw_loop(dev, size, iters, skip, |peer, rbufs, sbufs| {
        let receives = rbufs.len();
        dev.irecv_many(rbufs, Source::Rank(peer), TagSel::Tag(4), c, &mut reqs);
        dev.isend_many(sbufs, peer, 4, c, &mut reqs);
        Request::wait_all(&mut reqs, &mut done);
        give_back(
            done.drain(..).map(Completion::into_result),
            receives,
            rbufs,
            sbufs,
        )
    })
}

/// Gives each buffer of an osu_bibw window back to the vector it came from,
/// in the order they were posted: the first `receives` to `rbufs`, the rest
/// to `sbufs`. The first failed operation's error ends it.
fn give_back(
    done: impl Iterator<Item = xdev::Result<(Buffer, xdev::Status)>>,
    receives: usize,
    rbufs: &mut Vec<Buffer>,
    sbufs: &mut Vec<Buffer>,
) -> xdev::Result<()> {
    for (i, d) in done.enumerate() {
        let (b, _) = d?;
        if i < receives {
            rbufs.push(b);
        } else {
            sbufs.push(b);
        }
    }
    Ok(())
}

/// The loop of [`bibandwidth`] and [`bibandwidth_window`]: ranks 0 and 1
/// each run `exchange` with the other's rank and their [`WINDOW`] receive
/// and send buffers of `size` bytes (allocated once; `exchange` gives every
/// one back), `skip` times and then `iters` timed times; other ranks run
/// empty steps. MB/s of both directions on rank 0.
fn bibw_loop(
    dev: &dyn Device,
    size: usize,
    iters: usize,
    skip: usize,
    mut exchange: impl FnMut(Rank, &mut Vec<Buffer>, &mut Vec<Buffer>) -> xdev::Result<()>,
) -> xdev::Result<Option<f64>> {
    let me = dev.id();
    let peer = match me {
        0 => Some(1),
        1 => Some(0),
        _ => None,
    };
    let mut rbufs: Vec<Buffer> = (0..WINDOW).map(|_| bench_buffer(size, 0)).collect();
    let mut sbufs: Vec<Buffer> = (0..WINDOW).map(|_| bench_buffer(size, 0x3C)).collect();
    let secs = timed(iters, skip, || match peer {
        Some(peer) => exchange(peer, &mut rbufs, &mut sbufs),
        None => Ok(()),
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

/// A rank's part in an osu_bw window, with its partner's rank.
#[derive(Clone, Copy)]
pub(crate) enum Side {
    Sender(Rank),
    Receiver(Rank),
}

/// One osu_bw window: the sender posts a non-blocking send of each buffer
/// of `bufs` to its partner (tag `tag`), waits for them all and receives a
/// zero-byte acknowledgement (tag `tag + 1`); the receiver posts the
/// matching receives, waits for them all, then sends the acknowledgement.
/// The requests go through `reqs` (allocated once, OSU's static array); every
/// buffer comes back to `bufs`.
fn window(
    dev: &dyn Device,
    side: Side,
    bufs: &mut Vec<Buffer>,
    reqs: &mut Vec<Request>,
    tag: i32,
    c: u32,
) -> xdev::Result<()> {
    let ack = tag + 1;
    post_window(dev, side, bufs, reqs, tag, c);
    wait_window(bufs, reqs)?;
    match side {
        Side::Sender(to) => dev
            .recv(&mut [], Source::Rank(to), TagSel::Tag(ack), c)
            .map(drop),
        Side::Receiver(from) => dev.send(&[], from, ack, c),
    }
}

/// The posts of a [`window`]: a non-blocking send (sender) or receive
/// (receiver) of each buffer of `bufs`, tag `tag`, into `reqs`.
#[inline]
pub(crate) fn post_window(
    dev: &dyn Device,
    side: Side,
    bufs: &mut Vec<Buffer>,
    reqs: &mut Vec<Request>,
    tag: i32,
    c: u32,
) {
    match side {
        Side::Sender(to) => reqs.extend(bufs.drain(..).map(|b| dev.isend(b, to, tag, c))),
        Side::Receiver(from) => reqs.extend(
            bufs.drain(..)
                .map(|b| dev.irecv(b, Source::Rank(from), TagSel::Tag(tag), c)),
        ),
    }
}

/// The waits of a [`window`]: every request of `reqs` in order, its buffer
/// back to `bufs`; the first failed one is the error.
#[inline]
pub(crate) fn wait_window(bufs: &mut Vec<Buffer>, reqs: &mut Vec<Request>) -> xdev::Result<()> {
    for r in reqs.drain(..) {
        let (b, _) = r.wait().into_result()?;
        bufs.push(b);
    }
    Ok(())
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
    let mut bufs: Vec<Buffer> = (0..WINDOW).map(|_| bench_buffer(size, 0x69)).collect();
    let mut reqs: Vec<Request> = Vec::with_capacity(WINDOW);
    let side = if me < pairs {
        Some(Side::Sender(me + pairs))
    } else if me < 2 * pairs {
        Some(Side::Receiver(me - pairs))
    } else {
        None
    };
    let mut step = || match side {
        Some(side) => window(dev, side, &mut bufs, &mut reqs, 5, c),
        None => Ok(()),
    };
    for _ in 0..skip {
        step()?;
    }
    xdev::devkit::conformance::barrier(dev)?;
    let start = Instant::now();
    for _ in 0..iters {
        step()?;
    }
    xdev::devkit::conformance::barrier(dev)?;
    let secs = start.elapsed().as_secs_f64();
    Ok((me == 0).then_some(secs))
}

#[cfg(test)]
mod tests;
