//! Hooks for the device tests: raw frames and raw RDMA writes behind the
//! protocol's back, a queue pair moved to the error state, and a look at
//! credits, rendezvous counts and the last grant.

use std::time::{Duration, Instant};

use xdev::Rank;

use super::{IbvEngine, WR_RAW};
use crate::verbs::{RemoteAddr, SendFlags, SendOp, SendRequest};

impl IbvEngine {
    /// Sends `frame` to `peer` as it is, as a hostile or broken peer would
    /// (no credit accounting of its content).
    #[cfg(test)]
    pub(crate) fn post_raw(&self, peer: Rank, frame: &[u8]) {
        let mut l = self.lock();
        assert!(
            self.can_post(&l, peer, 1, true),
            "no credit to post a raw frame"
        );
        self.post_frame(&mut l, peer, frame, &[], None)
            .expect("post a raw frame");
    }

    /// Whether a raw frame to `peer` may be posted now (a credit).
    #[cfg(test)]
    pub(crate) fn has_credit(&self, peer: Rank) -> bool {
        let l = self.lock();
        self.can_post(&l, peer, 1, true)
    }

    /// `peer`'s unfinished rendezvous starts we hold, and ours to it.
    #[cfg(test)]
    pub(crate) fn rendezvous_counts(&self, peer: Rank) -> (usize, usize) {
        let l = self.lock();
        (l.peers[peer].rndv_in, l.peers[peer].rndv_out)
    }

    /// Send requests this rank posted unsignalled, and whether its send
    /// queue to `peer` has room for `wrs` requests.
    #[cfg(test)]
    pub(crate) fn send_queue(&self, peer: Rank, wrs: u32) -> (u64, bool) {
        let l = self.lock();
        (l.unsignaled_posts, l.peers[peer].sq.has_room(wrs))
    }

    /// Whether a blocking receive waits in the first slot, and how many
    /// receives wait in the matching engine.
    #[cfg(test)]
    pub(crate) fn posted(&self) -> (bool, usize) {
        let l = self.lock();
        (l.first.is_some(), l.matching.posted_len())
    }

    /// The last remote-write grant this rank sent in an `RNDZ_REPLY`.
    #[cfg(test)]
    pub(crate) fn last_grant(&self) -> Option<RemoteAddr> {
        self.lock().last_grant
    }

    /// RDMA-writes `data` to `dst` at `peer` behind the protocol's back, as
    /// a peer that kept an old key would, and waits for the completion: its
    /// status, or the work completion's error.
    #[cfg(test)]
    pub(crate) fn write_raw(
        &self,
        peer: Rank,
        dst: RemoteAddr,
        data: &[u8],
    ) -> std::result::Result<(), String> {
        let mut src = self
            .fab
            .cache
            .lease(data.len())
            .map_err(|e| e.to_string())?;
        // SAFETY: the lease's chunk is ours, at least data.len() bytes.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), src.as_mut_ptr(), data.len()) };
        let reg = src.registration();
        {
            let mut l = self.lock();
            l.raw_write = None;
            let qp = self.fab.qps[peer].as_ref().expect("a peer");
            // SAFETY: the source is our own lease `src`, which stays leased
            // (and `reg` registered) until this function returns, after the
            // write's completion was seen below, or on a timeout, which
            // fails the test. The remote side is what this test hook is
            // for: `dst` is a range of the peer that the test checks stays
            // unwritten (a stale or local-only rkey), or a range it granted.
            unsafe {
                qp.post_send(&SendRequest {
                    wr_id: WR_RAW | peer as u64,
                    op: SendOp::RdmaWrite(dst),
                    sges: &[reg.sge(src.as_ptr(), data.len())],
                    flags: SendFlags::SIGNALED,
                })
            }
            .map_err(|e| e.to_string())?;
            Self::sq_posted(&mut l, peer, true);
        }
        let t = Instant::now();
        loop {
            {
                let mut l = self.lock();
                self.progress_locked(&mut l);
                if let Some(r) = l.raw_write.take() {
                    return r;
                }
            }
            if t.elapsed() > Duration::from_secs(30) {
                return Err("no completion for the raw write".into());
            }
            std::thread::yield_now();
        }
    }

    /// Moves the queue pair to `peer` to the error state behind the
    /// engine's back, as a fault would.
    #[cfg(test)]
    pub(crate) fn inject_qp_error(&self, peer: Rank) {
        self.fab.qps[peer]
            .as_ref()
            .expect("a peer")
            .modify_to_error()
            .expect("modify to error");
    }
}
