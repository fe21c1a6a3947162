//! The psm device lends its receives out ([`Lender`]): the handle owns the
//! buffer, and the receive lives only in the queue's table (a
//! [`Slot::Lent`]) until the handle ends the lease.
//!
//! PSM2 matches, copies and completes the receive itself, so the device
//! needs no request core for it: no pooled core, no claim, no counted
//! reference in the table, no second copy of the status. The handle's wait
//! tests the PSM2 request directly (`psm2_mq_test2`, as a raw PSM2 loop's
//! `psm2_mq_wait2` does), and builds the status once; a receive that a
//! collecting round (a `peek`, a held request's wait), a cancel or a
//! departure ended first leaves its status in [`Inner::ended`].
//!
//! The handle reaches the engine through an uncounted pointer. The engine
//! keeps itself alive for it: the first open lease stores a strong
//! reference to the engine in [`Inner::keep`] (one `Arc` increment per
//! window of requests, not per request), and the lease that ends last hands
//! it back to the handle to drop, after the call. A handle forgotten with
//! `mem::forget` thus leaks the engine's memory (its PSM2 endpoint is still
//! closed by the device's drop), never frees it under another handle.

use std::sync::Arc;

use xdev::devkit::{Completion, KeepAlive, Lender, RequestKind};
use xdev::{Buffer, Pattern, Peeked, Rank, Request, RequestId, Source, Status, TagSel};

use super::engine::{Inner, PsmEngine, Slot};
use super::layer::{MqStatus, RequestKey};

/// A lent receive that ended before its handle's wait looked: what `peek`
/// reports (once) and the wait returns.
pub(super) struct Ended {
    id: RequestId,
    status: Status,
    reported: bool,
}

impl Ended {
    /// The end of lent receive `id` with `status`, not reported yet.
    pub(super) fn new(id: RequestId, status: Status) -> Self {
        Ended {
            id,
            status,
            reported: false,
        }
    }
}

/// How a lent receive ended, as its wait found it.
enum LentEnd {
    /// PSM2 completed it: its id, its status, its source's rank, its
    /// capacity.
    Psm {
        id: RequestId,
        source: Option<Rank>,
        st: MqStatus,
        cap: usize,
    },
    /// A collecting round, a cancel or a departure ended it first.
    Ended(Status),
    /// The device's close ended it.
    Closed,
}

impl PsmEngine {
    /// The status of a receive (lent or held) or send that the device's
    /// close ended (its `finish`, or its drop) before PSM2 completed it:
    /// this rank's envelope, no tag.
    pub(super) fn closed(&self) -> Status {
        Status::closed(self.rank)
    }

    /// Posts receive `buf` for `p` as a lent request (a [`Slot::Lent`]
    /// under a new lease) and returns its handle, or a request failed with
    /// the error if it could not be posted (the queue closed, PSM2 refused
    /// it: PSM2 never had the buffer).
    ///
    /// The handle is made after the post, from the key the table gave: a
    /// request is two words, returned in registers, so nothing the caller
    /// reads back waits behind PSM2's stores. (With a request of nine
    /// words, written to memory and copied wide by the caller, it had to
    /// be made before the post, from a key asked for ahead; that second
    /// lookup of the table's next slot was 17% of `start_recv`'s samples.)
    #[inline(always)]
    pub(super) fn lend_recv(
        self: &Arc<Self>,
        l: &mut Inner,
        mut buf: Buffer,
        p: &Pattern,
    ) -> Request {
        let source = match p.source {
            Source::Rank(s) => Some(s),
            Source::Any => None,
        };
        let at = (buf.as_mut_ptr(), buf.len());
        let id = self.tracker.lend_id();
        let slot = Slot::Lent {
            id,
            cap: at.1,
            source,
        };
        // An unwind from the post aborts: the buffer's drop on the way out
        // would free memory PSM2 may write once the receive is posted.
        let posted = xdev::devkit::abort_on_unwind("posting a lent receive", || {
            // SAFETY: the buffer's memory stays valid and unused by anything
            // else until the request leaves the queue: the handle made
            // below owns it and hands it out only once its lease ended, and
            // every end of a lease (`wait_lent`, `drop_lent`, `hold_lent`)
            // first has the request leave the queue or moves the buffer
            // into its slot; `mem::forget` of the handle leaks it.
            unsafe { self.post_recv(l, at, p, slot) }
        });
        match posted {
            Ok(key) => {
                self.open_lease(l);
                // SAFETY: the lease just opened keeps the engine alive
                // (`Inner::keep`) until the call that ends it returns, and
                // that call hands the reference back only when it was the
                // last lease.
                unsafe { Request::lent(id, key.to_u64(), buf, &**self) }
            }
            Err((e, _)) => self
                .tracker
                .completed(buf, Status::failed(self.recv_env(p), e)),
        }
    }

    /// Opens a lease: the first one keeps the engine alive.
    #[inline]
    fn open_lease(self: &Arc<Self>, l: &mut Inner) {
        if l.leases == 0 {
            l.keep = Some(Arc::clone(self));
        }
        l.leases += 1;
    }

    /// Ends a lease: the last one hands back the engine's reference, which
    /// the caller drops after the call.
    #[inline]
    fn end_lease(&self, l: &mut Inner) -> KeepAlive {
        l.leases -= 1;
        if l.leases == 0 {
            l.keep.take().map(|e| e as Arc<dyn Lender>)
        } else {
            None
        }
    }

    /// How lent receive `key` ended, if it has, taken (from
    /// [`Inner::ended`], or by testing its PSM2 request, which frees it).
    /// A receive the device's close ended is `Closed`. Does not poll.
    #[inline(always)]
    fn take_lent_end(&self, l: &mut Inner, key: RequestKey) -> Option<LentEnd> {
        if !l.ended.is_empty() {
            if let Some(e) = l.ended.remove(&key) {
                return Some(LentEnd::Ended(e.status));
            }
        }
        let Some(q) = l.queue.as_mut() else {
            return Some(LentEnd::Closed);
        };
        match q.test(key) {
            // A receive that named its source matched only that rank's
            // endpoint (PSM2 matches the source address): no lookup of the
            // status's address.
            Some((Slot::Lent { id, cap, source }, st)) => Some(LentEnd::Psm {
                id,
                source: source.or_else(|| q.peer_of(&st)),
                st,
                cap,
            }),
            // A lease's key names its lent receive until the lease ends;
            // anything else means the table no longer has it: it cannot
            // complete any more.
            Some(_) => Some(LentEnd::Closed),
            None if q.get(key).is_none() => Some(LentEnd::Closed),
            None => None,
        }
    }

    /// [`wait_lent`](Lender::wait_lent) for a receive that had not ended
    /// at its first look: polls (then sleeps) until it has.
    #[inline(never)]
    fn wait_lent_end(&self, key: RequestKey, keep: &mut KeepAlive) -> LentEnd {
        let mut out = None;
        // Without collecting: the wait tests its own request (a departure
        // of its source cancels it, and leaves its status in `ended`).
        let _ = self.block_until(false, |eng, l| {
            let mut end = eng.take_lent_end(l, key);
            if end.is_none() {
                if let Some(q) = l.queue.as_mut() {
                    q.poll();
                }
                end = eng.take_lent_end(l, key);
            }
            if end.is_some() {
                *keep = eng.end_lease(l);
            }
            out = end;
            Ok(out.is_some())
        });
        out.expect("the wait ends only once the receive has")
    }

    /// The status a lent receive ended with.
    #[inline(always)]
    fn lent_status(&self, end: LentEnd) -> Status {
        match end {
            LentEnd::Psm {
                source, st, cap, ..
            } => self.recv_status(source, &st, Some(cap)),
            LentEnd::Ended(status) => status,
            LentEnd::Closed => self.closed(),
        }
    }

    /// A completed lent receive not reported yet (the earliest started),
    /// marked reported: for `peek`.
    pub(super) fn peek_lent(&self, l: &mut Inner) -> Option<Peeked> {
        let e = l
            .ended
            .values_mut()
            .filter(|e| !e.reported)
            .min_by_key(|e| e.id)?;
        e.reported = true;
        Some(Peeked {
            id: e.id,
            status: e.status.clone(),
        })
    }

    /// Whether a lent receive is outstanding for `peek`: posted, or ended
    /// and not reported yet.
    pub(super) fn lent_outstanding(&self, l: &Inner) -> bool {
        l.ended.values().any(|e| !e.reported)
            || l.queue
                .as_ref()
                .is_some_and(|q| q.iter().any(|(_, s)| matches!(s, Slot::Lent { .. })))
    }
}

impl Lender for PsmEngine {
    fn test_lent(&self, token: u64) -> bool {
        let key = RequestKey::from_u64(token);
        let mut l = self.lock();
        let l = &mut *l;
        if l.ended.contains_key(&key) {
            return true;
        }
        if let Some(q) = l.queue.as_mut() {
            q.poll();
        }
        // Testing frees PSM2's request: its end waits in `ended` for the
        // handle's wait (and a `peek`).
        match self.take_lent_end(l, key) {
            Some(end @ LentEnd::Psm { id, .. }) => {
                let status = self.lent_status(end);
                l.ended.insert(key, Ended::new(id, status));
                true
            }
            Some(_) => true,
            None => false,
        }
    }

    #[inline]
    fn wait_lent(&self, token: u64, buf: Buffer, keep: &mut KeepAlive) -> Completion {
        let key = RequestKey::from_u64(token);
        let end = {
            let mut l = self.lock();
            let end = self.take_lent_end(&mut l, key);
            if end.is_some() {
                *keep = self.end_lease(&mut l);
            }
            end
        };
        let end = match end {
            Some(end) => end,
            None => self.wait_lent_end(key, keep),
        };
        Completion {
            buf,
            status: self.lent_status(end),
        }
    }

    fn cancel_lent(&self, token: u64) -> bool {
        let key = RequestKey::from_u64(token);
        let mut l = self.lock();
        let l = &mut *l;
        let Some(q) = l.queue.as_mut() else {
            return false;
        };
        if !matches!(q.get(key), Some(Slot::Lent { .. })) {
            return false;
        }
        match q.cancel(key) {
            Some(Slot::Lent { id, .. }) => {
                let st = Status::cancelled(Pattern::new(Source::Any, TagSel::Any, 0));
                l.ended.insert(key, Ended::new(id, st));
                true
            }
            _ => false,
        }
    }

    fn drop_lent(&self, token: u64, buf: Buffer) -> KeepAlive {
        let key = RequestKey::from_u64(token);
        let mut buf = Some(buf);
        let mut l = self.lock();
        let l = &mut *l;
        if l.ended.remove(&key).is_none() {
            if let Some(q) = l.queue.as_mut() {
                if matches!(q.get(key), Some(Slot::Lent { .. })) {
                    // Done already (the test frees it), or not matched yet
                    // (the cancel returns it): PSM2 let go of the memory.
                    let let_go = q.test(key).is_some() || q.cancel(key).is_some();
                    if !let_go {
                        // Matched: PSM2 writes the buffer until it completes;
                        // the slot keeps it until then.
                        if let Some(s) = q.get_mut(key) {
                            *s = Slot::Dropped(buf.take().expect("taken only here"));
                        }
                    }
                }
            }
        }
        let keep = self.end_lease(l);
        drop(buf);
        keep
    }

    fn hold_lent(&self, token: u64, buf: Buffer) -> (Request, KeepAlive) {
        let key = RequestKey::from_u64(token);
        let mut l = self.lock();
        let l = &mut *l;
        let req = if let Some(e) = l.ended.remove(&key) {
            self.tracker.completed(buf, e.status)
        } else {
            let source = match l.queue.as_ref().and_then(|q| q.get(key)) {
                Some(Slot::Lent { source, .. }) => Some(*source),
                _ => None,
            };
            match (source, l.keep.as_ref(), l.queue.as_mut()) {
                (Some(source), Some(engine), Some(q)) => {
                    // The receive moves into a core, which the slot holds
                    // from now on (the buffer's memory unmoved).
                    let (core, handle) = self.tracker.start_request(RequestKind::Recv, buf, engine);
                    core.set_token(key.to_u64());
                    if let Some(s) = q.get_mut(key) {
                        *s = Slot::Recv { core, source };
                    }
                    handle.into_request()
                }
                _ => self.tracker.completed(buf, self.closed()),
            }
        };
        let keep = self.end_lease(l);
        (req, keep)
    }
}
