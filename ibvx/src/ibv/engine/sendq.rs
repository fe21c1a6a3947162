//! Room on one queue pair's send queue, with selective signalling.
//!
//! Most sends are posted unsignalled: the NIC writes no completion for them,
//! and the engine neither polls nor handles one. A send queue entry of an
//! unsignalled request is only known to be free once a *later* signalled
//! request of the same queue pair has completed (an RC queue pair completes
//! its requests in order), so every signalled request carries the number of
//! unsignalled ones posted before it, and its completion returns them all.
//! At most `every - 1` unsignalled requests are posted in a row: with a
//! queue of `depth` entries (`every` at most a quarter of it) the queue can
//! never overflow, and room for a multi-request post always comes back.
//!
//! A request whose completion something waits for (a send's last RDMA write
//! or `RNDZ_END`, a send from a slot that is not inline) is always
//! signalled. A queue pair in the error state flushes every outstanding
//! request with a completion, signalled or not, so a failure is always seen.

use std::collections::VecDeque;

/// Send-queue room of one queue pair (see the module docs).
#[derive(Debug)]
pub(super) struct SendQueue {
    free: u32,
    every: u32,
    /// Unsignalled requests posted since the last signalled one.
    unsignaled: u32,
    /// For each signalled request not yet completed, in posting order: the
    /// entries its completion frees (itself and the unsignalled ones before
    /// it).
    signaled: VecDeque<u32>,
}

impl SendQueue {
    /// A queue of `depth` entries that signals at least every `every`-th
    /// request (`every` is clamped to 1..=depth/4, at least 1).
    pub(super) fn new(depth: u32, every: u32) -> Self {
        SendQueue {
            free: depth,
            every: every.clamp(1, (depth / 4).max(1)),
            unsignaled: 0,
            signaled: VecDeque::new(),
        }
    }

    /// Whether `wrs` requests can be posted now.
    #[inline]
    pub(super) fn has_room(&self, wrs: u32) -> bool {
        self.free >= wrs
    }

    /// Whether the next request must be signalled: `required` (something
    /// waits for its completion), or `every - 1` unsignalled ones precede it.
    #[inline]
    pub(super) fn must_signal(&self, required: bool) -> bool {
        required || self.unsignaled + 1 >= self.every
    }

    /// Records one request posted (the caller checked [`has_room`](Self::has_room)).
    #[inline]
    pub(super) fn posted(&mut self, signaled: bool) {
        self.free -= 1;
        if signaled {
            self.signaled.push_back(self.unsignaled + 1);
            self.unsignaled = 0;
        } else {
            self.unsignaled += 1;
        }
    }

    /// A signalled request completed: frees its entry and those of the
    /// unsignalled requests posted before it.
    #[inline]
    pub(super) fn completed(&mut self) {
        self.free += self.signaled.pop_front().unwrap_or(1);
    }

    /// Free entries (tests).
    #[cfg(test)]
    pub(super) fn free(&self) -> u32 {
        self.free
    }
}

#[cfg(test)]
mod tests;
