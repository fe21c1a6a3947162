//! The engine lends its posted receives out ([`Lender`]): the handle owns
//! the buffer, and the receive lives in the matching queue as a
//! [`Target::Lent`] and in this rank's [`Leases`] table (under the rank
//! lock) until the handle ends the lease.
//!
//! A receive held through a pooled request core costs, per message, the
//! pool's take and reset, the claim's locked `cmpxchg` at completion, the
//! locked decrement of the queue's counted reference and the handle's
//! consume. A lent receive costs none of them: the drain writes its status
//! once, into its slot, under the lock it already holds, and the handle's
//! wait takes it from there.
//!
//! The handle reaches the engine through an uncounted pointer, so the
//! engine keeps itself alive for it: the first open lease stores a strong
//! reference to the engine in [`Leases`] (one `Arc` increment per window of
//! receives), and the lease that ends last hands it back to the handle, to
//! drop after the call. A handle forgotten with `mem::forget` leaks the
//! engine, never frees it under another handle. Dropping the device with
//! leases open closes the engine at once ([`Engine::close_lent`]): their
//! waits end.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use xdev::devkit::matching::PostedId;
use xdev::devkit::target::{cancelled, LentRecv, Target};
use xdev::devkit::{Completion, CoreRef, KeepAlive, Lender, RequestKind};
use xdev::{Buffer, Envelope, Pattern, Peeked, Request, RequestId, Status};

use super::{Engine, Local, Medium};

/// What a lent receive's slot holds now.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum State {
    /// Not in use.
    Free,
    /// Lent and not ended: queued as posted receive `posted`, or (once the
    /// queue no longer has it) matched to a rendezvous that goes on.
    Open,
    /// Ended with `status`, not reported by `peek` yet.
    Ended,
    /// Ended with `status`, and reported by `peek`.
    Reported,
    /// Turned into a held request (a relay): the completion goes to `held`.
    Held,
    /// The handle went while a rendezvous wrote the buffer: `dropped`
    /// keeps it until that ends (`None`: leaked, the engine closed under
    /// it).
    Dropped,
}

/// The posted id of a receive that is not (or no longer known to be)
/// queued: it names no posted receive.
const NOT_QUEUED: PostedId = PostedId::from_raw(u64::MAX);

/// One lent receive. Flat, not an enum with data: opening and ending a
/// lease write the words they change in place (an enum value built aside
/// and moved in was a stalled wide load of its narrow stores, and a call
/// to drop the old value).
struct Slot {
    state: State,
    id: RequestId,
    posted: PostedId,
    /// The status, once ended (stale otherwise).
    status: Status,
    held: Option<CoreRef>,
    dropped: Option<Buffer>,
}

impl Slot {
    fn new() -> Self {
        let env = Envelope::untagged(0, 0);
        Slot {
            state: State::Free,
            id: RequestId(0),
            posted: NOT_QUEUED,
            status: Status::ok(env, 0),
            held: None,
            dropped: None,
        }
    }
}

/// This rank's lent receives, by slot (the handle's token), and what keeps
/// the engine alive for them. Bounded by the receives a user keeps open
/// (one slot each, reused).
pub(crate) struct Leases<M: Medium> {
    slots: Vec<Slot>,
    free: Vec<u32>,
    /// Leases open (handles not ended).
    open: usize,
    /// The engine's own strong reference while a lease is open.
    keep: Option<Arc<Engine<M>>>,
}

impl<M: Medium> Default for Leases<M> {
    fn default() -> Self {
        Leases {
            slots: Vec::new(),
            free: Vec::new(),
            open: 0,
            keep: None,
        }
    }
}

impl<M: Medium> Leases<M> {
    /// A free slot for a new lease, opened for receive `id` (not queued
    /// yet: no posted id).
    #[inline(always)]
    fn open_slot(&mut self, id: RequestId) -> u32 {
        let s = match self.free.pop() {
            Some(s) => s,
            None => {
                self.slots.push(Slot::new());
                (self.slots.len() - 1) as u32
            }
        };
        let slot = &mut self.slots[s as usize];
        slot.state = State::Open;
        slot.id = id;
        slot.posted = NOT_QUEUED;
        s
    }

    /// Opens a lease (with its slot already open): the first one keeps
    /// `engine` alive until the last one ends ([`end_lease`](Self::end_lease)).
    #[inline]
    fn open_lease(&mut self, engine: &Arc<Engine<M>>) {
        if self.open == 0 {
            self.keep = Some(Arc::clone(engine));
        }
        self.open += 1;
    }

    #[inline]
    fn free_slot(&mut self, s: u32) {
        self.slots[s as usize].state = State::Free;
        self.free.push(s);
    }

    /// Ends a lease: the last one hands back the engine's reference, which
    /// the caller drops after the call.
    #[inline]
    fn end_lease(&mut self) -> KeepAlive {
        self.open -= 1;
        if self.open == 0 {
            self.keep.take().map(|e| e as Arc<dyn Lender>)
        } else {
            None
        }
    }

    /// The open receive at `s` was queued as `posted` (its cancel token).
    /// A receive never queued keeps no posted id, so that a cancel or drop
    /// of it can never take another receive out of the queue.
    #[inline]
    fn queued_as(&mut self, s: u32, posted: PostedId) {
        let slot = &mut self.slots[s as usize];
        if slot.state == State::Open {
            slot.posted = posted;
        }
    }

    /// Whether the lease at `s` ended (a wait would return at once).
    #[inline]
    fn ended(&self, s: u32) -> bool {
        matches!(self.slots[s as usize].state, State::Ended | State::Reported)
    }

    /// The status of the ended receive at `s`, taken (field by field, into
    /// the caller's place), and the slot freed.
    #[inline(always)]
    fn take_status(&mut self, s: u32) -> Status {
        let slot = &mut self.slots[s as usize];
        slot.state = State::Free;
        let st = &mut slot.status;
        let status = Status {
            source: st.source,
            tag: st.tag,
            context: st.context,
            count: st.count,
            message_len: st.message_len,
            cancelled: st.cancelled,
            error: st.error.take(),
        };
        self.free.push(s);
        status
    }

    /// Ends the lease of the ended receive at `s`: its completion, with
    /// `buf`, built in the caller's place; the engine's reference to `keep`
    /// if it was the last lease.
    #[inline(always)]
    fn end_ended(&mut self, s: u32, buf: Buffer, keep: &mut KeepAlive) -> Completion {
        *keep = self.end_lease();
        Completion {
            buf,
            status: self.take_status(s),
        }
    }

    /// Ends the open receive at `s` with `status`.
    fn end(&mut self, s: u32, status: Status) {
        let slot = &mut self.slots[s as usize];
        slot.status = status;
        slot.state = State::Ended;
    }

    /// Completes the lent receive at `s` with the status `st` makes, built
    /// in its slot.
    #[inline(always)]
    pub(crate) fn complete_with(
        &mut self,
        tracker: &xdev::devkit::Tracker,
        s: u32,
        st: impl FnOnce() -> Status,
    ) {
        let slot = &mut self.slots[s as usize];
        if slot.state == State::Open {
            slot.status = st();
            slot.state = State::Ended;
            return;
        }
        self.complete_rest(tracker, s, st());
    }

    /// [`complete_with`](Self::complete_with) for a slot that is not
    /// simply open: held (its core completes) or dropped (freed).
    #[cold]
    #[inline(never)]
    fn complete_rest(&mut self, tracker: &xdev::devkit::Tracker, s: u32, st: Status) {
        let slot = &mut self.slots[s as usize];
        match slot.state {
            State::Held => {
                let core = slot.held.take().expect("a held slot holds its core");
                self.free_slot(s);
                tracker.complete(&core, st);
            }
            State::Dropped => {
                drop(slot.dropped.take());
                self.free_slot(s);
            }
            // A slot is completed once, while open, held or dropped.
            other => debug_assert!(false, "lent slot {s} completed while {other:?}"),
        }
    }

    /// The earliest-started ended receive not reported yet, marked
    /// reported: for `peek`.
    pub(crate) fn peek(&mut self) -> Option<Peeked> {
        let slot = self
            .slots
            .iter_mut()
            .filter(|s| s.state == State::Ended)
            .min_by_key(|s| s.id)?;
        slot.state = State::Reported;
        Some(Peeked {
            id: slot.id,
            status: slot.status.clone(),
        })
    }

    /// Whether a lent receive is outstanding for `peek`: open, or ended
    /// and not reported yet.
    pub(crate) fn outstanding(&self) -> bool {
        self.slots
            .iter()
            .any(|s| matches!(s.state, State::Open | State::Ended))
    }
}

impl<M: Medium> Drop for Leases<M> {
    fn drop(&mut self) {
        // A buffer kept for a rendezvous that never ended may still be
        // written (a peer's split copy): leak it rather than free it.
        for s in &mut self.slots {
            std::mem::forget(s.dropped.take());
        }
    }
}

impl<M: Medium> Engine<M> {
    /// Queues receive `buf` for `pattern` as a lent request (the caller
    /// has ruled out a closing engine, and found nothing here to take):
    /// its id and slot (the handle's token). The caller makes the handle
    /// ([`Request::lent`]) in the place it returns it.
    ///
    /// # Safety
    /// The caller makes the handle from `buf` (whose memory the engine now
    /// writes), and until then lets nothing free it (an unwind included:
    /// hold it in a `ManuallyDrop`).
    #[inline(always)]
    pub(crate) unsafe fn lend_recv(
        self: &Arc<Self>,
        l: &mut Local<M>,
        buf: &mut Buffer,
        pattern: Pattern,
    ) -> (RequestId, u32) {
        let id = self.tracker.lend_id();
        let slot = l.leases.open_slot(id);
        l.leases.open_lease(self);
        let (ptr, cap) = (buf.as_mut_ptr(), buf.len());
        // Made where the matching engine stores it (see `post_target`).
        // SAFETY: the buffer's memory stays valid and unused by anything
        // else until the receive completes: the caller's handle owns it and
        // hands it out only from `wait_lent` once the slot ended;
        // `drop_lent` moves it into the slot while a rendezvous may write
        // it; `mem::forget` of the handle leaks it.
        let recv = move || Target::Lent(unsafe { LentRecv::new(ptr, cap, slot) });
        // The posted id is recorded once the receive is queued (a look at
        // the ring inside `post_target` may already have ended it or
        // matched it to a rendezvous: the id then names nothing queued).
        if let Some(posted) = self.post_target(l, recv, pattern) {
            l.leases.queued_as(slot, posted);
        }
        (id, slot)
    }

    /// Completes target `t` with the status `st` makes (a lent receive in
    /// its slot, built there).
    #[inline(always)]
    pub(crate) fn complete_target_with(
        &self,
        l: &mut Local<M>,
        t: Target,
        st: impl FnOnce() -> Status,
    ) {
        match t {
            Target::Lent(r) => l.leases.complete_with(&self.tracker, r.slot(), st),
            t => t.complete_with(&self.tracker, st),
        }
    }

    /// The device goes with leases open: the engine closes now (as a rank
    /// that died, if it did not finish), so that their waits end. Queued
    /// receives end `Closed`; one a rendezvous still writes ends `Closed`
    /// at its wait, its buffer leaked. Without open leases the engine's
    /// own drop does this.
    pub(crate) fn close_lent(&self) {
        {
            let mut l = self.lock();
            if l.leases.open == 0 {
                return;
            }
            // Under the lock: a post that comes after sees `closing`.
            self.closing.store(true, Ordering::Release);
            self.fail_posted_closed(&mut l);
        }
        if !self.closed.load(Ordering::Acquire) {
            self.depart(true);
        }
    }

    /// The end of lease `s` once the engine closed without ending it (a
    /// rendezvous may still write its buffer): `Closed`, the buffer leaked.
    #[cold]
    fn abandon_lent(&self, l: &mut Local<M>, s: u32, buf: Buffer) -> Status {
        std::mem::forget(buf);
        let slot = &l.leases.slots[s as usize];
        // Still queued (a close that raced): nothing writes it now.
        if slot.state == State::Open && l.matching.cancel(slot.posted).is_some() {
            l.leases.free_slot(s);
        } else {
            let slot = &mut l.leases.slots[s as usize];
            slot.state = State::Dropped;
            slot.dropped = None;
        }
        self.closed_status()
    }

    /// [`wait_lent`](Lender::wait_lent) for a receive that had not ended
    /// at its first look.
    #[inline(never)]
    fn wait_lent_end(&self, s: u32, buf: Buffer, keep: &mut KeepAlive) -> Completion {
        let r = self.block_until(
            true,
            |eng, l| {
                // Nothing moves once the engine closed (a dropped device).
                if !l.leases.ended(s) && !eng.closed.load(Ordering::Acquire) {
                    eng.progress_locked(l, None);
                }
                Ok(l.leases.ended(s))
            },
            || false,
        );
        let mut l = self.lock();
        let l = &mut *l;
        if l.leases.ended(s) {
            return l.leases.end_ended(s, buf, keep);
        }
        debug_assert!(r.is_err(), "the wait ends early only on a close");
        let status = self.abandon_lent(l, s, buf);
        *keep = l.leases.end_lease();
        Completion {
            buf: Buffer::zeroed(0),
            status,
        }
    }
}

impl<M: Medium> Lender for Engine<M> {
    fn test_lent(&self, token: u64) -> bool {
        let s = token as u32;
        let mut l = self.lock();
        if !l.leases.ended(s) {
            self.progress_locked(&mut l, None);
        }
        l.leases.ended(s) || self.closed.load(Ordering::Acquire)
    }

    #[inline]
    fn wait_lent(&self, token: u64, buf: Buffer, keep: &mut KeepAlive) -> Completion {
        let s = token as u32;
        {
            let mut l = self.lock();
            if l.leases.ended(s) {
                return l.leases.end_ended(s, buf, keep);
            }
        }
        self.wait_lent_end(s, buf, keep)
    }

    fn cancel_lent(&self, token: u64) -> bool {
        let s = token as u32;
        let mut l = self.lock();
        let l = &mut *l;
        let slot = &l.leases.slots[s as usize];
        if slot.state != State::Open || l.matching.cancel(slot.posted).is_none() {
            return false; // ended, or matched: its rendezvous goes on
        }
        l.leases.end(s, cancelled());
        true
    }

    fn drop_lent(&self, token: u64, buf: Buffer) -> KeepAlive {
        let s = token as u32;
        let mut buf = Some(buf);
        let mut l = self.lock();
        let l = &mut *l;
        let slot = &mut l.leases.slots[s as usize];
        if slot.state == State::Open && l.matching.cancel(slot.posted).is_none() {
            // A rendezvous writes the buffer until it ends.
            slot.state = State::Dropped;
            slot.dropped = buf.take();
        } else {
            // Ended, or still queued (the cancel took it out).
            l.leases.free_slot(s);
        }
        let keep = l.leases.end_lease();
        drop(buf);
        keep
    }

    fn hold_lent(&self, token: u64, buf: Buffer) -> (Request, KeepAlive) {
        let s = token as u32;
        let mut l = self.lock();
        let l = &mut *l;
        let state = l.leases.slots[s as usize].state;
        let req = match state {
            State::Ended | State::Reported => {
                let status = l.leases.take_status(s);
                self.tracker.completed(buf, status)
            }
            State::Open if !self.closed.load(Ordering::Acquire) => {
                let posted = l.leases.slots[s as usize].posted;
                let engine = l.leases.keep.as_ref().expect("a lease is open");
                // The receive moves into a core, which the slot holds from
                // now on (the buffer's memory unmoved); a cancel of the
                // held request finds it by its posted id.
                let (core, handle) = self.tracker.start_request(RequestKind::Recv, buf, engine);
                core.set_token(posted.as_u64());
                let slot = &mut l.leases.slots[s as usize];
                slot.state = State::Held;
                slot.held = Some(core);
                handle.into_request()
            }
            _ => {
                let status = self.abandon_lent(l, s, buf);
                self.tracker.completed(Buffer::zeroed(0), status)
            }
        };
        let keep = l.leases.end_lease();
        (req, keep)
    }
}
