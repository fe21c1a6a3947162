//! Requests a device *lends* out: the handle owns the buffer and the device
//! knows the operation by a token ([`Lender`]; the handle keeps the token
//! and the device in its buffer's carry, see `carry.rs`).
//!
//! Why: a request held through a pooled [`RequestCore`](super::RequestCore)
//! pays, per message, the pool's take and reset, three locked instructions
//! (the claim, the table's counted reference, the handle's release) and a
//! second copy of the status. A device that keeps its operations in its own
//! table under its own lock (PSM2's requests, which PSM2 completes and
//! matches itself) needs none of it: it writes the status once, in its
//! table, and the handle takes it from there at `wait`. On the psm
//! device's receive (`xdev-bench --device psm --test rate_split`,
//! alternating runs), lending cut the wait from 145-170 ns to 117-130 ns
//! per 8-byte message; `request/lifecycle/lend_wait` in the criterion
//! bench takes 20-22 ns where a held request's lifecycle takes 63.
//!
//! What keeps it sound:
//! - the handle gives the buffer back only from [`Lender::wait_lent`],
//!   which returns once the device no longer uses the memory;
//! - dropping the handle unwaited hands the buffer to the device
//!   ([`Lender::drop_lent`]), which frees it only once it is done with it;
//!   an unwind drops the handle the same way;
//! - `mem::forget` of the handle leaks the buffer (never freed, so the
//!   device may go on writing it) and the device's keep-alive (below);
//! - the handle reaches the device through an uncounted pointer: the device
//!   keeps itself alive (a strong reference to its own engine, taken when
//!   its first lease starts and handed back when the last one ends) for as
//!   long as any of its leases is open. That is the contract of
//!   [`Request::lent`](super::Request::lent), the one `unsafe` call here.

use std::sync::Arc;

use super::carry::{Lease, Owned};
use super::{Completion, Request};
use crate::Buffer;

/// A strong reference the device handed back as a lease ended: dropped by
/// the handle after the call returned (never inside the device's own
/// method, whose `&self` must outlive the call).
pub type KeepAlive = Option<Arc<dyn Lender>>;

/// A device that lends requests out: it keeps each lent operation in its
/// own table, known by a token, until the handle ends the lease with
/// [`wait_lent`](Lender::wait_lent), [`drop_lent`](Lender::drop_lent) or
/// [`hold_lent`](Lender::hold_lent). Each of those three is called at most
/// once per token, and after it no other call names that token.
pub trait Lender: Send + Sync + 'static {
    /// Drives progress once; whether operation `token` has ended (a
    /// [`wait_lent`](Lender::wait_lent) would return at once).
    fn test_lent(&self, token: u64) -> bool;
    /// Blocks until operation `token` has ended, and ends its lease: its
    /// completion, with `buf` (the handle's buffer) and the status (a
    /// failed one if the device closed under it), built in place (a status
    /// returned apart and moved into a completion costs a stalled wide load
    /// of its freshly written fields). After this the device no longer
    /// touches the buffer. A strong reference the lease held goes to
    /// `keep`.
    fn wait_lent(&self, token: u64, buf: Buffer, keep: &mut KeepAlive) -> Completion;
    /// Cancels operation `token` if it is a receive that has not matched;
    /// true if it was cancelled (its wait then reports `cancelled`).
    fn cancel_lent(&self, token: u64) -> bool;
    /// The handle was dropped unwaited: the device takes the buffer, and
    /// frees it only once it no longer uses it (cancelling a receive that
    /// has not matched). Ends the lease.
    fn drop_lent(&self, token: u64, buf: Buffer) -> KeepAlive;
    /// Turns operation `token` into a request held the usual way (a pooled
    /// core, which a layered device can relay), with `buf` moving into it.
    /// Ends the lease.
    fn hold_lent(&self, token: u64, buf: Buffer) -> (Request, KeepAlive);
}

impl Owned {
    /// The lease and the lender, or (born complete) `None`.
    #[inline(always)]
    fn lender(&self) -> Option<(u64, &dyn Lender)> {
        let (token, engine) = self.lease()?;
        // SAFETY: the lease is open (it ends only in `wait_lent`, `hold` or
        // the drop, which consume the handle), so the device keeps the
        // engine alive.
        Some((token, unsafe { engine.as_ref() }))
    }

    /// Drives progress once if lent; whether the operation has ended.
    #[inline]
    pub(super) fn test(&self) -> bool {
        match self.lender() {
            Some((token, engine)) => engine.test_lent(token),
            None => true,
        }
    }

    /// Cancels a lent unmatched receive; true if cancelled.
    pub(super) fn cancel(&self) -> bool {
        match self.lender() {
            Some((token, engine)) => engine.cancel_lent(token),
            None => false,
        }
    }

    /// Waits for the lent operation (`self`'s [`lease`](Owned::lease)) and
    /// ends the lease. Out of line, so that
    /// `Request::wait` stays small enough to inline where a request is born
    /// complete (inlined here, it made `Request::wait` an out-of-line call
    /// whose returned completion the caller read back wide, a stalled load:
    /// psm's eager sender lost 10-40% of its rate). The completion is still
    /// built once, in the caller's place, by the device.
    #[inline(never)]
    pub(super) fn wait_lent(self, (token, engine): Lease) -> Completion {
        let buf = self.into_buffer();
        let mut keep = None;
        // SAFETY: the lease is open until `wait_lent` returns; the pointer
        // is not used after it.
        let completion = unsafe { engine.as_ref() }.wait_lent(token, buf, &mut keep);
        if keep.is_some() {
            let_go(&mut keep);
        }
        completion
    }

    /// The request held the usual way (for a relay); ends the lease.
    pub(super) fn hold(self, (token, engine): Lease) -> Request {
        let buf = self.into_buffer();
        // SAFETY: as in `wait_lent`.
        let (req, keep) = unsafe { engine.as_ref() }.hold_lent(token, buf);
        drop(keep);
        req
    }
}

/// Drops the device's reference that the last lease handed back: out of
/// line, and rare (once per window of requests).
///
/// `extern "C"`, so that it cannot unwind (a panic in the device's drop
/// aborts the process here): with no unwind path to clean up after, the
/// device's wait builds the completion straight in `Owned::wait_lent`'s caller's
/// place. With a plain call the completion went through a temporary, its
/// status written narrow by the device and copied wide, a stalled load
/// (criterion `request/lifecycle/lend_wait`: 27.5-27.8 ns with it,
/// 20.4-21.7 ns without, two alternating runs).
#[cold]
#[inline(never)]
extern "C" fn let_go(keep: &mut KeepAlive) {
    drop(keep.take());
}

#[cfg(test)]
mod tests;
