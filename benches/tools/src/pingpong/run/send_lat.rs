//! The send/receive latency test (`send_lat`).

use ibvx::verbs::{SendFlags, SendOp, SendRequest};

use super::check::{fill, verify};
use super::completion::{run_error, wait_wc, Watch};
use super::resources::Resources;
use super::RECV_WR_ID;
use crate::pingpong::clock::cycles;
use crate::pingpong::error::PingpongError;
use crate::pingpong::net::Link;
use crate::pingpong::options::Options;

/// perftest's `run_iter_lat_send`: the server waits for a message and
/// answers, the client sends first; every send is signaled and awaited.
/// Returns the post timestamps.
pub(super) fn send_lat(
    r: &mut Resources,
    link: &Link,
    w: &mut Watch,
    o: &Options,
    size: usize,
    (my_seed, peer_seed): (u8, u8),
) -> Result<Vec<u64>, PingpongError> {
    let iters = o.iters;
    let client = o.is_client();
    let mut stamps = Vec::with_capacity(iters as usize);
    let flags = SendFlags::SIGNALED.with(SendFlags::INLINE, r.inline(size));
    let (mut scnt, mut rcnt) = (0u64, 0u64);
    while scnt < iters || rcnt < iters {
        if rcnt < iters && !(client && scnt == 0) {
            let what = || format!("send_lat {size} B: waiting for message {rcnt} of {iters}");
            let wc = wait_wc(&r.recv_cq, o.events, w, link, &what)?;
            if wc.byte_len() as usize != size {
                return Err(PingpongError::Protocol(format!(
                    "send_lat: received {} bytes, expected {size} (do both sides use the same --size?)",
                    wc.byte_len()
                )));
            }
            if o.check {
                verify(&r.recv_mr, 0, size, peer_seed, rcnt, || {
                    format!("send_lat {size} B")
                })?;
            }
            rcnt += 1;
            // SAFETY: as in `setup`: the region is ours, outlives the QP and
            // is only read through raw pointers after a completion.
            unsafe {
                r.qp.post_recv(RECV_WR_ID, &[r.recv_mr.sge(0, r.recv_mr.len())])
            }
            .map_err(|e| run_error(link, "send_lat: reposting a receive".into(), e))?;
        }
        if scnt < iters {
            if o.check {
                fill(&mut r.send_mr, 0, size, my_seed, scnt);
            }
            stamps.push(cycles());
            let sge = [r.send_mr.sge(0, size)];
            // SAFETY: `send_mr` is the tool's own region, dropped after the
            // QP, and not written again before this send's completion is
            // awaited just below.
            unsafe {
                r.qp.post_send(&SendRequest {
                    wr_id: scnt,
                    op: SendOp::Send,
                    sges: &sge,
                    flags,
                })
            }
            .map_err(|e| run_error(link, format!("send_lat {size} B: post {scnt}"), e))?;
            scnt += 1;
            let what = || format!("send_lat {size} B: completion of send {scnt} of {iters}");
            wait_wc(&r.send_cq, o.events, w, link, &what)?;
        }
    }
    Ok(stamps)
}
