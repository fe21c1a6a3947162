//! The raw PSM2 peer of the `psm` device: the same OSU latency, bandwidth
//! and message rate loops as [`crate::latency`], [`crate::bandwidth`],
//! [`crate::bibandwidth`] and [`crate::message_rate`], written directly
//! against `psm-sys` on the device's own endpoint and matched queue, so the
//! device's overhead over PSM2 is measured side by side in one run.
//!
//! Raw messages use their own context (the middle tag word), which no xdev
//! user of the benchmark uses.

use std::ffi::c_void;
use std::ptr;

use ibvx::psm::RawPsm;
use psm_sys::ffi::*;
use xdev::{Error, Rank, Result};

use crate::{timed, WINDOW};

/// Context word of raw PSM2 benchmark traffic.
const RAW_CONTEXT: u32 = 0x5241_5750;

fn check(what: &str, e: psm2_error_t) -> Result<()> {
    if e == psm2_error::PSM2_OK {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "raw PSM2 {what} failed with error {}",
            e.0
        )))
    }
}

fn tag(t: u32, source: Rank) -> psm2_mq_tag_t {
    psm2_mq_tag_t {
        tag: [t, RAW_CONTEXT, source as u32, 0],
    }
}

const EXACT: psm2_mq_tag_t = psm2_mq_tag_t {
    tag: [u32::MAX, u32::MAX, u32::MAX, 0],
};

fn send(raw: &RawPsm, to: Rank, me: Rank, t: u32, buf: &[u8]) -> Result<()> {
    let mut stag = tag(t, me);
    // SAFETY: mq and the address come from an open device the caller does
    // not use meanwhile (RawPsm's contract); psm2_mq_send2 returns once `buf`
    // may be reused.
    let e = unsafe {
        (raw.psm.psm2_mq_send2)(
            raw.mq,
            raw.addrs[to],
            0,
            &mut stag,
            buf.as_ptr().cast::<c_void>(),
            buf.len() as u32,
        )
    };
    check("send", e)
}

fn post_recv(raw: &RawPsm, from: Rank, t: u32, buf: &mut [u8]) -> Result<psm2_mq_req_t> {
    let mut rtag = tag(t, from);
    let mut sel = EXACT;
    let mut req: psm2_mq_req_t = ptr::null_mut();
    // SAFETY: as in `send`; `buf` outlives the request, which the caller
    // waits for before touching `buf` again.
    let e = unsafe {
        (raw.psm.psm2_mq_irecv2)(
            raw.mq,
            raw.addrs[from],
            &mut rtag,
            &mut sel,
            0,
            buf.as_mut_ptr().cast::<c_void>(),
            buf.len() as u32,
            ptr::null_mut(),
            &mut req,
        )
    };
    check("irecv", e)?;
    Ok(req)
}

fn post_send(raw: &RawPsm, to: Rank, me: Rank, t: u32, buf: &[u8]) -> Result<psm2_mq_req_t> {
    let mut stag = tag(t, me);
    let mut req: psm2_mq_req_t = ptr::null_mut();
    // SAFETY: as in `post_recv`.
    let e = unsafe {
        (raw.psm.psm2_mq_isend2)(
            raw.mq,
            raw.addrs[to],
            0,
            &mut stag,
            buf.as_ptr().cast::<c_void>(),
            buf.len() as u32,
            ptr::null_mut(),
            &mut req,
        )
    };
    check("isend", e)?;
    Ok(req)
}

fn wait(raw: &RawPsm, mut req: psm2_mq_req_t) -> Result<()> {
    let mut st = std::mem::MaybeUninit::<psm2_mq_status2_t>::zeroed();
    // SAFETY: req is a live request of this MQ; wait2 frees it.
    let e = unsafe { (raw.psm.psm2_mq_wait2)(&mut req, st.as_mut_ptr()) };
    check("wait", e)
}

fn recv(raw: &RawPsm, from: Rank, t: u32, buf: &mut [u8]) -> Result<()> {
    let req = post_recv(raw, from, t, buf)?;
    wait(raw, req)
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
    let secs = timed(iters, skip, || {
        match me {
            0 => {
                send(raw, 1, 0, 1, &buf)?;
                recv(raw, 1, 1, &mut buf)?;
            }
            1 => {
                recv(raw, 0, 1, &mut buf)?;
                send(raw, 0, 1, 1, &buf)?;
            }
            _ => {}
        }
        Ok(())
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
    let secs = window(raw, me, size, iters, skip, 2)?;
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
    let secs = window(raw, me, size, iters, skip, 5)?;
    Ok(secs.map(|s| (WINDOW * iters) as f64 / s))
}

/// The loop of [`bandwidth`] and [`rate`], data messages tagged `t`, the
/// acknowledgement `t + 1`: seconds of the timed iterations on rank 0.
fn window(
    raw: &RawPsm,
    me: Rank,
    size: usize,
    iters: usize,
    skip: usize,
    t: u32,
) -> Result<Option<f64>> {
    let peer = match me {
        0 => 1,
        1 => 0,
        _ => return Ok(None),
    };
    let mut bufs: Vec<Vec<u8>> = (0..WINDOW).map(|_| vec![0x5Au8; size]).collect();
    let mut reqs: Vec<psm2_mq_req_t> = Vec::with_capacity(WINDOW);
    let secs = timed(iters, skip, || {
        let mut posted = Ok(());
        for b in bufs.iter_mut() {
            let r = if me == 0 {
                post_send(raw, peer, me, t, b)
            } else {
                post_recv(raw, peer, t, b)
            };
            match r {
                Ok(r) => reqs.push(r),
                Err(e) => {
                    posted = Err(e);
                    break;
                }
            }
        }
        // Every posted request is waited for, even after an error, so no
        // request outlives the buffer it uses.
        let mut waited = Ok(());
        for r in reqs.drain(..) {
            let w = wait(raw, r);
            if waited.is_ok() {
                waited = w;
            }
        }
        posted.and(waited)?;
        if me == 0 {
            recv(raw, peer, t + 1, &mut [])
        } else {
            send(raw, peer, me, t + 1, &[])
        }
    })?;
    Ok((me == 0).then_some(secs))
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
    let step = |rbufs: &mut Vec<Vec<u8>>| -> Result<()> {
        let mut reqs = Vec::with_capacity(2 * WINDOW);
        let mut posted = Ok(());
        for b in rbufs.iter_mut() {
            match post_recv(raw, peer, 4, b) {
                Ok(r) => reqs.push(r),
                Err(e) => {
                    posted = Err(e);
                    break;
                }
            }
        }
        if posted.is_ok() {
            for b in &sbufs {
                match post_send(raw, peer, me, 4, b) {
                    Ok(r) => reqs.push(r),
                    Err(e) => {
                        posted = Err(e);
                        break;
                    }
                }
            }
        }
        // Every posted request is waited for, even after an error, so no
        // request outlives the buffer it uses.
        let mut waited = Ok(());
        for r in reqs {
            let w = wait(raw, r);
            if waited.is_ok() {
                waited = w;
            }
        }
        posted.and(waited)
    };
    let secs = timed(iters, skip, || step(&mut rbufs))?;
    let mb = (2 * size * WINDOW * iters) as f64 / 1e6;
    Ok((me == 0).then_some(mb / secs))
}
