//! The raw PSM2 peer of the `psm` device: the same OSU latency, bandwidth
//! and message rate loops as [`crate::latency`], [`crate::bandwidth`],
//! [`crate::bibandwidth`] and [`crate::message_rate`], written directly
//! against the device's safe PSM2 layer ([`ibvx::psm::layer`]) on the
//! device's own endpoint and matched queue, so the device's overhead over
//! PSM2 is measured side by side in one run.
//!
//! [`split_rate`] mixes the two: one side through the device, the other
//! raw, so a gap in the message rate is put on the side that makes it.
//!
//! Each loop holds the queue (the device's lock) for its whole run, so the
//! floor pays no locking per message. Raw messages use their own context
//! (the middle tag word), which no xdev user of the benchmark uses.

use std::time::{Duration, Instant};

use ibvx::psm::layer::{MatchedQueue, MqTag, Selector};
use ibvx::psm::RawPsm;
use xdev::{Buffer, Device, Pattern, Rank, Request, Result, Source, Tag, TagSel};

use crate::benchmarks::{post_window, wait_window, Side};
use crate::{timed, BENCH_CONTEXT, WINDOW};

/// Context word of raw PSM2 benchmark traffic.
const RAW_CONTEXT: u32 = 0x5241_5750;

/// The tag of raw message `t` from `source`.
fn tag(t: u32, source: Rank) -> MqTag {
    MqTag([t, RAW_CONTEXT, source as u32])
}

/// Message `t` from `from`, exactly.
fn from(from: Rank, t: u32) -> Selector {
    Selector {
        from: Some(from),
        tag: tag(t, from),
        mask: MqTag([u32::MAX; 3]),
    }
}

/// Raw PSM2 pingpong between ranks 0 and 1 (blocking send, posted receive
/// and wait), as [`crate::latency`]: half the round trip in microseconds on
/// rank 0.
pub fn latency(
    raw: &RawPsm,
    me: Rank,
    size: usize,
    iters: usize,
    skip: usize,
) -> Result<Option<f64>> {
    let mut buf = vec![0xA5u8; size];
    let secs = raw.with_queue(|q| {
        timed(iters, skip, || {
            match me {
                0 => {
                    q.send(1, tag(1, 0), &buf)?;
                    q.recv(&from(1, 1), &mut buf)?;
                }
                1 => {
                    q.recv(&from(0, 1), &mut buf)?;
                    q.send(0, tag(1, 1), &buf)?;
                }
                _ => {}
            }
            Ok(())
        })
    })?;
    Ok((me == 0).then_some(secs * 1e6 / (2.0 * iters as f64)))
}

/// Raw PSM2 osu_bw, as [`crate::bandwidth`]: `WINDOW` non-blocking sends
/// against `WINDOW` posted receives, then a zero-byte acknowledgement. MB/s
/// on rank 0.
pub fn bandwidth(
    raw: &RawPsm,
    me: Rank,
    size: usize,
    iters: usize,
    skip: usize,
) -> Result<Option<f64>> {
    let (secs, _) = window(raw, me, size, iters, skip, 2, false)?;
    let mb = (size * WINDOW * iters) as f64 / 1e6;
    Ok(secs.map(|s| mb / s))
}

/// Raw PSM2 message rate, as [`crate::message_rate`] (osu_mbw_mr's loop
/// with one pair): rank 0 posts `WINDOW` non-blocking sends, rank 1
/// `WINDOW` receives, both wait for all, then a zero-byte acknowledgement.
/// Messages per second on rank 0 (`WINDOW * iters / time`).
///
/// The device's loop also passes a barrier before and after the timed
/// iterations; PSM2 has none of its own, and none is needed here: every
/// warm-up window ends with the acknowledgement, which leaves the two ranks
/// in step when the clock starts, and rank 0's clock stops when the last
/// acknowledgement has arrived.
pub fn rate(raw: &RawPsm, me: Rank, size: usize, iters: usize, skip: usize) -> Result<Option<f64>> {
    let (secs, _) = window(raw, me, size, iters, skip, 5, false)?;
    Ok(secs.map(|s| (WINDOW * iters) as f64 / s))
}

/// [`rate`], and on rank 0 also the receiver's phases (rank 1's, handed
/// over after the loop).
pub fn rate_with_phases(
    raw: &RawPsm,
    (size, iters, skip): (usize, usize, usize),
) -> Result<Option<(f64, ReceiverPhases)>> {
    let me = raw.rank();
    let (secs, phases) = window(raw, me, size, iters, skip, 5, true)?;
    let phases = gather_phases(raw, phases)?;
    Ok(secs
        .zip(phases)
        .map(|(s, p)| ((WINDOW * iters) as f64 / s, p)))
}

/// Where the receiving rank (rank 1) of a rate loop spent its time, per
/// message of the timed windows: posting the window's receives, and waiting
/// for them all.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ReceiverPhases {
    /// Nanoseconds per message in the posting calls.
    pub post_ns: f64,
    /// Nanoseconds per message from the last post to the last completion.
    pub wait_ns: f64,
}

/// Adds up the phases of a loop's windows, from the first timed one (the
/// `skip` warm-up windows are left out). Three clock reads per window.
struct PhaseClock {
    skip: usize,
    seen: usize,
    post: Duration,
    wait: Duration,
}

impl PhaseClock {
    fn new(skip: usize) -> Self {
        PhaseClock {
            skip,
            seen: 0,
            post: Duration::ZERO,
            wait: Duration::ZERO,
        }
    }

    /// A window that started posting at `start`, had posted everything at
    /// `posted` and had every completion at `end`.
    fn add(&mut self, start: Instant, posted: Instant, end: Instant) {
        self.seen += 1;
        if self.seen > self.skip {
            self.post += posted - start;
            self.wait += end - posted;
        }
    }

    fn per_message(&self) -> ReceiverPhases {
        let n = (self.seen.saturating_sub(self.skip) * WINDOW).max(1) as f64;
        ReceiverPhases {
            post_ns: self.post.as_nanos() as f64 / n,
            wait_ns: self.wait.as_nanos() as f64 / n,
        }
    }
}

/// Rank 1 hands its `phases` to rank 0 (raw PSM2, tag 9): rank 0's result
/// is rank 1's phases, the other ranks' `None`.
fn gather_phases(raw: &RawPsm, phases: ReceiverPhases) -> Result<Option<ReceiverPhases>> {
    raw.with_queue(|q| match raw.rank() {
        0 => {
            let mut b = [0u8; 16];
            q.recv(&from(1, 9), &mut b)?;
            let (post, wait) = b.split_at(8);
            let f = |x: &[u8]| f64::from_le_bytes(x.try_into().expect("8 bytes"));
            Ok(Some(ReceiverPhases {
                post_ns: f(post),
                wait_ns: f(wait),
            }))
        }
        1 => {
            let mut b = [0u8; 16];
            b[..8].copy_from_slice(&phases.post_ns.to_le_bytes());
            b[8..].copy_from_slice(&phases.wait_ns.to_le_bytes());
            q.send(0, tag(9, 1), &b).map(|()| None)
        }
        _ => Ok(None),
    })
}

/// One window of [`window`] (and of [`split_rate`]'s raw side): rank 0
/// sends every buffer with `send_tag`, rank 1 receives into every one with
/// `recv_sel`, and both wait for all (the scope waits for every posted
/// request even after an error, so none outlives its buffer).
fn one_window(
    q: &mut MatchedQueue,
    me: Rank,
    peer: Rank,
    (send_tag, recv_sel): (MqTag, &Selector),
    bufs: &mut [Vec<u8>],
    clock: Option<&mut PhaseClock>,
) -> Result<()> {
    // The clock is read only when the phases are asked for (`rate` and
    // `bandwidth`, the device's floors, read none).
    let now = |on: bool| on.then(Instant::now);
    let start = now(clock.is_some());
    let mut posted = start;
    let r = q.scope(|s| {
        for b in bufs.iter_mut() {
            if me == 0 {
                s.isend(peer, send_tag, b)?;
            } else {
                s.irecv(recv_sel, b)?;
            }
        }
        posted = now(clock.is_some());
        s.wait_all()
    });
    if let (Some(clock), Some(start), Some(posted)) = (clock, start, posted) {
        clock.add(start, posted, Instant::now());
    }
    r
}

/// The loop of [`bandwidth`] and [`rate`], data messages tagged `t`, the
/// acknowledgement `t + 1`: seconds of the timed iterations on rank 0, and
/// with `phases` this rank's phases (rank 1's are the receiver's; zero
/// without).
fn window(
    raw: &RawPsm,
    me: Rank,
    size: usize,
    iters: usize,
    skip: usize,
    t: u32,
    phases: bool,
) -> Result<(Option<f64>, ReceiverPhases)> {
    let peer = match me {
        0 => 1,
        1 => 0,
        _ => return Ok((None, ReceiverPhases::default())),
    };
    let mut bufs: Vec<Vec<u8>> = (0..WINDOW).map(|_| vec![0x5Au8; size]).collect();
    let mut clock = phases.then(|| PhaseClock::new(skip));
    let secs = raw.with_queue(|q| {
        timed(iters, skip, || {
            let on_the_wire = (tag(t, me), &from(peer, t));
            one_window(q, me, peer, on_the_wire, &mut bufs, clock.as_mut())?;
            if me == 0 {
                q.recv(&from(peer, t + 1), &mut []).map(drop)
            } else {
                q.send(peer, tag(t + 1, me), &[])
            }
        })
    })?;
    let phases = clock.map_or_else(ReceiverPhases::default, |c| c.per_message());
    Ok(((me == 0).then_some(secs), phases))
}

/// Raw PSM2 osu_bibw, as [`crate::bibandwidth`]: both ranks post `WINDOW`
/// receives, then `WINDOW` sends, and wait for all. MB/s of both directions
/// on rank 0.
pub fn bibandwidth(
    raw: &RawPsm,
    me: Rank,
    size: usize,
    iters: usize,
    skip: usize,
) -> Result<Option<f64>> {
    let peer = match me {
        0 => 1,
        1 => 0,
        _ => return Ok(None),
    };
    let mut rbufs: Vec<Vec<u8>> = (0..WINDOW).map(|_| vec![0u8; size]).collect();
    let sbufs: Vec<Vec<u8>> = (0..WINDOW).map(|_| vec![0x3Cu8; size]).collect();
    let secs = raw.with_queue(|q| {
        timed(iters, skip, || {
            // Every posted request is waited for, even after an error, so
            // no request outlives the buffer it uses.
            q.scope(|s| {
                for b in rbufs.iter_mut() {
                    s.irecv(&from(peer, 4), b)?;
                }
                for b in &sbufs {
                    s.isend(peer, tag(4, me), b)?;
                }
                s.wait_all()
            })
        })
    })?;
    let mb = (2 * size * WINDOW * iters) as f64 / 1e6;
    Ok((me == 0).then_some(mb / secs))
}

/// Which side of [`split_rate`] goes through the psm device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceSide {
    /// Rank 0 sends through the device; rank 1 receives with raw PSM2.
    Sender,
    /// Rank 0 sends with raw PSM2; rank 1 receives through the device.
    Receiver,
}

/// The message rate of [`rate`] with one side through the psm device and the
/// other raw PSM2 (`side`), on the same endpoint: which side of the device
/// falls short of raw PSM2. The data messages carry the device's tags (the
/// raw side uses [`RawPsm::device_tag`] and [`RawPsm::device_selector`]);
/// the acknowledgement is raw on both ranks. The raw side takes the device's
/// lock once per window and once per acknowledgement (the device's side
/// takes it in its own calls), where the other loops hold it throughout.
/// Messages per second on rank 0, with the receiver's phases.
pub fn split_rate(
    raw: &RawPsm,
    dev: &dyn Device,
    side: DeviceSide,
    (size, iters, skip): (usize, usize, usize),
) -> Result<Option<(f64, ReceiverPhases)>> {
    const DATA_TAG: Tag = 7;
    let me = raw.rank();
    let peer = match me {
        0 => 1,
        1 => 0,
        _ => return Ok(None),
    };
    let context = BENCH_CONTEXT + 7;
    let wire = raw.device_tag(DATA_TAG, context, size)?;
    let pattern = Pattern::new(Source::Rank(0), TagSel::Tag(DATA_TAG), context);
    let sel = raw.device_selector(&pattern);
    let through_device = match side {
        DeviceSide::Sender => me == 0,
        DeviceSide::Receiver => me == 1,
    };
    let mut bufs: Vec<Buffer> = (0..WINDOW).map(|_| Buffer::zeroed(size)).collect();
    let mut raw_bufs: Vec<Vec<u8>> = (0..WINDOW).map(|_| vec![0x5Au8; size]).collect();
    let mut reqs: Vec<Request> = Vec::with_capacity(WINDOW);
    let mut clock = PhaseClock::new(skip);
    let dev_side = match me {
        0 => Side::Sender(peer),
        _ => Side::Receiver(peer),
    };
    let secs = timed(iters, skip, || {
        if through_device {
            let start = Instant::now();
            post_window(dev, dev_side, &mut bufs, &mut reqs, DATA_TAG, context);
            let posted = Instant::now();
            wait_window(&mut bufs, &mut reqs)?;
            clock.add(start, posted, Instant::now());
        } else {
            let on_the_wire = (wire, &sel);
            raw.with_queue(|q| {
                one_window(q, me, peer, on_the_wire, &mut raw_bufs, Some(&mut clock))
            })?;
        }
        raw.with_queue(|q| {
            if me == 0 {
                q.recv(&from(peer, 8), &mut []).map(drop)
            } else {
                q.send(peer, tag(8, me), &[])
            }
        })
    })?;
    let phases = gather_phases(raw, clock.per_message())?;
    Ok(phases.map(|p| ((WINDOW * iters) as f64 / secs, p)))
}
