//! The psm device lends its receives out ([`Lender`]): the handle owns the
//! buffer, and the receive lives only in the queue's lent table (a
//! [`Lent`] in [`LentState::Out`]) until the handle ends the lease.
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
use xdev::{Buffer, Envelope, Pattern, Peeked, Rank, Request, RequestId, Source, Status, TagSel};

use super::engine::{Inner, PsmEngine};
use super::layer::{LentTest, MatchedQueue, MqStatus, RequestKey, StatusSlot};

/// A lent receive, as the queue's lent table holds it: plain data (a held
/// one's core and a dropped one's buffer wait in [`Inner::held`] and
/// [`Inner::dropped`]), so that its test on the message path copies a few
/// words and drops nothing.
#[derive(Clone, Copy)]
pub(super) struct Lent {
    /// What `peek` reports it as.
    id: RequestId,
    /// The source it names (to fail it if that peer leaves), or
    /// [`ANY_SOURCE`].
    source: Rank,
    /// The buffer's length (PSM2 takes at most 4 GiB).
    cap: u32,
    /// Who has it now.
    pub(super) state: LentState,
}

/// [`Lent::source`] of a receive from any source (no rank is `usize::MAX`:
/// ranks are below the job's size).
const ANY_SOURCE: Rank = Rank::MAX;

impl Lent {
    /// Receive `id` of up to `cap` bytes from `source`, lent out.
    pub(super) fn out(id: RequestId, source: Option<Rank>, cap: usize) -> Lent {
        Lent {
            id,
            source: source.unwrap_or(ANY_SOURCE),
            // Longer receives never post (see `layer::msg_len`).
            cap: u32::try_from(cap).unwrap_or(u32::MAX),
            state: LentState::Out,
        }
    }

    /// What `peek` reports it as.
    pub(super) fn id(&self) -> RequestId {
        self.id
    }

    /// The source it names, if any.
    #[inline(always)]
    pub(super) fn source(&self) -> Option<Rank> {
        (self.source != ANY_SOURCE).then_some(self.source)
    }

    /// The buffer's length.
    pub(super) fn cap(&self) -> usize {
        self.cap as usize
    }

    /// Who has it, and the source it names: all its end needs to know
    /// besides the buffer's length.
    #[inline(always)]
    pub(super) fn who(&self) -> Who {
        (self.state, self.source())
    }
}

/// Who has a lent receive, and the source it names.
type Who = (LentState, Option<Rank>);

/// Who has a lent receive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum LentState {
    /// Lent out: the handle owns the buffer; its end goes to
    /// [`Inner::ended`] unless the handle's own wait tests it first.
    Out,
    /// Its handle was turned into a held request
    /// ([`hold_lent`](Lender::hold_lent)): its core, in [`Inner::held`],
    /// is completed through the tracker.
    Held,
    /// Its handle was dropped while PSM2 was writing its buffer: the
    /// buffer, in [`Inner::dropped`], is freed once PSM2 completes it.
    Dropped,
}

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

/// The end of a lent receive on the message path: a whole message, without
/// error, from the source it named, into the lent-out buffer of `cap`
/// bytes: its envelope and length, read from the fields of the status where
/// PSM2 wrote them. `None` for anything else (see
/// [`PsmEngine::lent_status_rest`]).
#[inline(always)]
fn plain_end(who: Who, slot: &StatusSlot, cap: usize) -> Option<(Envelope, usize)> {
    // A receive that named its source matched only that rank's endpoint
    // (PSM2 matches the source address): no lookup of the sender.
    let (LentState::Out, Some(source)) = who else {
        return None;
    };
    super::engine::whole_message(source, slot.tag(), (slot.is_ok(), slot.nbytes()), cap)
}

impl PsmEngine {
    /// The status of a receive (lent or held) or send that the device's
    /// close ended (its `finish`, or its drop) before PSM2 completed it:
    /// this rank's envelope, no tag.
    pub(super) fn closed(&self) -> Status {
        Status::closed(self.rank)
    }

    /// Posts receive `buf` for `p` as a lent request (a [`LentState::Out`]
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
        let lent = Lent::out(id, source, at.1);
        // An unwind from the post aborts: the buffer's drop on the way out
        // would free memory PSM2 may write once the receive is posted.
        let posted = xdev::devkit::abort_on_unwind("posting a lent receive", || {
            let Some(q) = l.queue.as_mut() else {
                return Err(xdev::Error::Closed);
            };
            // SAFETY: the buffer's memory stays valid and unused by anything
            // else until the request leaves the queue: the handle made
            // below owns it and hands it out only once its lease ended, and
            // every end of a lease (`wait_lent`, `drop_lent`, `hold_lent`)
            // first has the request leave the queue or moves the buffer
            // into its entry; `mem::forget` of the handle leaks it.
            unsafe { q.irecv_lent(&super::engine::selector(p), at, lent) }.map_err(|(e, _)| e)
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
            Err(e) => self
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
    /// [`Inner::ended`], or by testing its PSM2 request, which frees it),
    /// as its status for a buffer of `cap` bytes. A receive the device's
    /// close ended has its status. Does not poll.
    #[inline]
    fn take_lent_end(&self, l: &mut Inner, key: RequestKey, cap: usize) -> Option<Status> {
        if !l.ended.is_empty() {
            if let Some(e) = l.ended.remove(&key) {
                return Some(e.status);
            }
        }
        let Some(q) = l.queue.as_mut() else {
            return Some(self.closed());
        };
        let mut slot = StatusSlot::new();
        match q.test_lent(key, &mut slot, Lent::who) {
            LentTest::Done(who) => Some(self.lent_status(who, &slot.status(), q, cap)),
            LentTest::Pending => None,
            // A lease's key names its lent receive until the lease ends;
            // anything else means the table no longer has it: it cannot
            // complete any more.
            LentTest::Unknown => Some(self.closed()),
        }
    }

    /// The status of lent receive `lent` into `cap` bytes, which PSM2
    /// completed with `st`: built in place (inlined) for a whole message
    /// from the source it named; the rest out of line.
    #[inline(always)]
    fn lent_status(&self, who: Who, st: &MqStatus, mq: &MatchedQueue, cap: usize) -> Status {
        match who {
            // A receive that named its source matched only that rank's
            // endpoint (PSM2 matches the source address): no lookup of the
            // sender's address.
            (LentState::Out, Some(source)) => self.recv_status(Some(source), st, Some(cap)),
            _ => self.lent_status_rest(who, st, mq, cap),
        }
    }

    /// [`lent_status`](Self::lent_status) for a receive from any source,
    /// or one no longer lent out (a lease's key names its receive lent out
    /// until the lease ends: it ends as closed).
    #[cold]
    #[inline(never)]
    fn lent_status_rest(&self, who: Who, st: &MqStatus, mq: &MatchedQueue, cap: usize) -> Status {
        let (LentState::Out, source) = who else {
            return self.closed();
        };
        let source = source.or_else(|| mq.peer_of(st));
        self.recv_status(source, st, Some(cap))
    }

    /// [`wait_lent`](Lender::wait_lent) for a receive that had not ended
    /// at its first look: polls (then sleeps) until it has.
    #[inline(never)]
    fn wait_lent_end(&self, key: RequestKey, cap: usize, keep: &mut KeepAlive) -> Status {
        let mut out = None;
        // Without collecting: the wait tests its own request (a departure
        // of its source cancels it, and leaves its status in `ended`).
        let _ = self.block_until(false, |eng, l| {
            let mut end = eng.take_lent_end(l, key, cap);
            if end.is_none() {
                if let Some(q) = l.queue.as_mut() {
                    q.poll();
                }
                end = eng.take_lent_end(l, key, cap);
            }
            if end.is_some() {
                *keep = eng.end_lease(l);
            }
            out = end;
            Ok(out.is_some())
        });
        out.expect("the wait ends only once the receive has")
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
                .is_some_and(|q| q.lent_iter().any(|(_, s)| s.state == LentState::Out))
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
        let Some(q) = l.queue.as_mut() else {
            return true;
        };
        q.poll();
        // Testing frees PSM2's request: its end waits in `ended` for the
        // handle's wait (and a `peek`).
        let mut slot = StatusSlot::new();
        match q.test_lent(key, &mut slot, |lent| *lent) {
            LentTest::Done(lent) => {
                let status = self.lent_status(lent.who(), &slot.status(), q, lent.cap());
                l.ended.insert(key, Ended::new(lent.id(), status));
                true
            }
            LentTest::Pending => false,
            LentTest::Unknown => true,
        }
    }

    #[inline]
    fn wait_lent(&self, token: u64, buf: Buffer, keep: &mut KeepAlive) -> Completion {
        let key = RequestKey::from_u64(token);
        // The handle's buffer is the one the receive was posted with.
        let cap = buf.len();
        // The message path, straight: nothing ended first, and PSM2 has
        // completed the receive with a whole message from the source it
        // named. The completion is built where it is returned, from the
        // envelope and length the test read (built apart and moved, the
        // status was copied three times on the stack).
        let mut guard = self.lock();
        let l = &mut *guard;
        if l.ended.is_empty() {
            if let Some(q) = l.queue.as_mut() {
                let mut slot = StatusSlot::new();
                if let LentTest::Done(who) = q.test_lent(key, &mut slot, Lent::who) {
                    if let Some((env, len)) = plain_end(who, &slot, cap) {
                        *keep = self.end_lease(l);
                        drop(guard);
                        return Completion {
                            buf,
                            status: Status::ok(env, len),
                        };
                    }
                    let status = self.lent_status_rest(who, &slot.status(), q, cap);
                    *keep = self.end_lease(l);
                    drop(guard);
                    return Completion { buf, status };
                }
            }
        }
        drop(guard);
        // Not done yet (or ended another way): the wait's own loop.
        let status = self.wait_lent_end(key, cap, keep);
        Completion { buf, status }
    }

    fn cancel_lent(&self, token: u64) -> bool {
        let key = RequestKey::from_u64(token);
        let mut l = self.lock();
        let l = &mut *l;
        let Some(q) = l.queue.as_mut() else {
            return false;
        };
        if !q.lent(key).is_some_and(|s| s.state == LentState::Out) {
            return false;
        }
        match q.cancel_lent(key) {
            Some(lent) => {
                let st = Status::cancelled(Pattern::new(Source::Any, TagSel::Any, 0));
                l.ended.insert(key, Ended::new(lent.id(), st));
                true
            }
            None => false,
        }
    }

    fn drop_lent(&self, token: u64, buf: Buffer) -> KeepAlive {
        let key = RequestKey::from_u64(token);
        let mut buf = Some(buf);
        let mut l = self.lock();
        let l = &mut *l;
        if l.ended.remove(&key).is_none() {
            if let Some(q) = l.queue.as_mut() {
                if q.lent(key).is_some_and(|s| s.state == LentState::Out) {
                    // Done already (the test frees it), or not matched yet
                    // (the cancel returns it): PSM2 let go of the memory.
                    let let_go = q.test_lent(key, &mut StatusSlot::new(), |_| ())
                        == LentTest::Done(())
                        || q.cancel_lent(key).is_some();
                    if !let_go {
                        // Matched: PSM2 writes the buffer until it completes;
                        // the engine keeps it until then.
                        if let Some(s) = q.lent_mut(key) {
                            s.state = LentState::Dropped;
                            let buf = buf.take().expect("taken only here");
                            l.dropped.insert(key, buf);
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
            let out = l
                .queue
                .as_mut()
                .and_then(|q| q.lent_mut(key))
                .filter(|s| s.state == LentState::Out);
            match (out, l.keep.as_ref()) {
                (Some(s), Some(engine)) => {
                    // The receive moves into a core, which the engine holds
                    // from now on (the buffer's memory unmoved).
                    let (core, handle) = self.tracker.start_request(RequestKind::Recv, buf, engine);
                    core.set_token(key.to_u64());
                    s.state = LentState::Held;
                    l.held.insert(key, core);
                    handle.into_request()
                }
                _ => self.tracker.completed(buf, self.closed()),
            }
        };
        let keep = self.end_lease(l);
        (req, keep)
    }
}
