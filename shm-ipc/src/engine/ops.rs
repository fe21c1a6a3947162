//! The operations a device calls: blocking and non-blocking sends and
//! receives, probes, `peek` and `finish`.

use std::cell::Cell;
use std::mem::ManuallyDrop;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use xdev::devkit::matching::{Posted, PostedId};
use xdev::devkit::target::{lost, BlockingRecv, Pending, Target};
use xdev::devkit::{start_each, CoreRef, RequestKind, Seat, SendTo, Transport};
use xdev::{
    Buffer, Context, Envelope, Error, Pattern, Peeked, Rank, Request, Result, Source, Status, Tag,
};

use super::{gone_error, Direct, Engine, Local, Medium, Outgoing, Sent, SettleSend, Unpost};

impl<M: Medium> Transport for Engine<M> {
    const NAME: &'static str = M::NAME;

    fn seat(&self) -> Seat<'_> {
        Seat::new(self.rank, self.size, &self.tracker, &self.closing)
    }
    /// Sends `buf` and returns once it may be reused (`sync`: once the
    /// receiver matched it).
    fn blocking_send(self: &Arc<Self>, buf: &[u8], to: SendTo) -> Result<()> {
        let (dest, tag, context, sync) = to.parts();
        if self.dest_gone(dest) {
            return Err(lost(dest, "peer finished or died"));
        }
        // Holds the send's waiter from the moment the send is published
        // (there is one only when it must wait for its receiver).
        let settle = SettleSend {
            engine: self,
            waiter: Default::default(),
        };
        let out = Outgoing {
            dest,
            tag,
            context,
            data: buf,
            sync,
        };
        // While the ring is full: the consumer position it was full against.
        let full_at = Cell::new(None);
        let ring = self.m.outbox_ring(dest);
        self.block_until(
            true,
            |eng, l| {
                if !l.backlog[dest].is_empty() {
                    eng.progress_locked(l, None);
                    if !l.backlog[dest].is_empty() {
                        return Ok(false); // keep order behind queued isends
                    }
                }
                if l.gone[dest] {
                    return Err(gone_error(l, dest));
                }
                let sent = eng.push(l, &out, None);
                full_at.set(None);
                match sent {
                    Sent::Complete => Ok(true),
                    Sent::Waiting(w) => {
                        *settle.waiter.borrow_mut() = w;
                        Ok(true)
                    }
                    Sent::Refused(e) => Err(e),
                    Sent::Full => {
                        // Flag first, then note what the ring was full
                        // against: `ready` re-checks it after the doorbell
                        // is armed, and a pop that frees room rings us.
                        let p = eng.producer(l, dest);
                        p.set_waiting(true);
                        full_at.set(Some(p.consumer_position_seen()));
                        eng.progress_locked(l, None);
                        Ok(false)
                    }
                }
            },
            || full_at.get().is_some_and(|t| ring.consumer_position() != t),
        )?;
        let Some(waiter) = settle.waiter.borrow().clone() else {
            return Ok(()); // eager: the buffer may be reused
        };
        #[cfg(test)]
        if super::test_hooks::PANIC_AFTER_PUBLISH.with(|p| p.replace(false)) {
            panic!("injected: unwinding out of a published blocking send");
        }
        // `waiter` is tied to the caller's borrowed `buf`: whatever happens
        // (even a panic), `settle` makes sure the receiver is done with it
        // or locked out before we return.
        M::wait_send(self, &waiter)
    }

    /// Starts sending `buf`, which moves into the request. Inlined into
    /// the face's `isend` (as `start_recv` into `irecv`): one call, not
    /// two, between the user and the ring, and the buffer and the request
    /// are not copied once more at a second call's boundary (osu_bibw 1 B,
    /// 6 alternating runs: thread 7.89 -> 8.34 MB/s, shm 7.77 -> 8.67).
    #[inline(always)]
    fn start_send(self: &Arc<Self>, buf: Buffer, to: SendTo) -> Request {
        let (dest, tag, context, sync) = to.parts();
        let env = to.envelope();
        if self.dest_gone(dest) {
            let e = lost(dest, "peer finished or died");
            return self.refused(buf, env, e);
        }
        let mut buf = buf;
        if !sync && buf.len() <= self.eager_max {
            // The common small send: a request born complete (no request
            // core to publish, no locked instruction after the ring push, so
            // a window of sends overlaps its publications), made *before*
            // the push. The caller reads the request back in 16-byte words
            // right after this call, and a wide load that spans narrower
            // stores waits until every older store has reached the cache:
            // made after the push, that includes the ring slot just written,
            // whose line the receiver holds (a cross-core transfer per
            // message: 90% of the sender's loop samples sat on that load,
            // shm rate at 8 B). Made before, the load waits at most for the
            // previous message's slot (measured: 4 paired reports, shm rate
            // at 8 B 0.94-1.08 -> 1.12-1.19 of Open MPI's in the same pass).
            let (data, len) = (buf.as_ptr(), buf.len());
            let req = self.tracker.completed(buf, Status::ok(env, len));
            let mut l = self.lock();
            // SAFETY: `req` owns the buffer and is ours until returned, so
            // its memory (which a move of the handle does not move) stays
            // valid and unchanged for `len` bytes while the push copies it.
            let data = unsafe { std::slice::from_raw_parts(data, len) };
            if self.push_eager_now(&mut l, data, to) {
                drop(l);
                return req;
            }
            drop(l);
            // No room (or credit) now: take the buffer back for the queued
            // send. The request was never handed out.
            buf = req.wait().buf;
        }
        let (core, handle) = self.tracker.start_request(RequestKind::Send, buf, self);
        self.queue_send(&core, dest, tag, context, sync);
        handle.into_request()
    }

    /// Receives the first message that matches `pattern` into `buf`.
    fn recv_into(self: &Arc<Self>, buf: &mut [u8], pattern: Pattern) -> Result<Status> {
        // The guard first: everything that can lend `buf` to the engine
        // records itself in it the moment it does.
        let unpost = Unpost {
            engine: self,
            queued: Default::default(),
        };
        let queued = &unpost.queued;
        let mut direct = Direct::new(pattern, buf, false);
        direct.guard = Some(queued);
        let r = self.block_until(
            true,
            |eng, l| {
                if let Some((b, _)) = &*queued.borrow() {
                    eng.progress_locked(l, None);
                    return Ok(b.is_done());
                }
                if l.matching.posted_len() == 0 {
                    if let Some(done) = eng.recv_direct(l, &mut direct)? {
                        return Ok(done);
                    }
                }
                // Other receives are posted: queue behind them to keep order.
                let b = BlockingRecv::new(direct.buf);
                match l.matching.post(pattern, Target::Blocking(b.clone())) {
                    Posted::Matched { env, msg, recv } => {
                        let (p, n) = recv.dst();
                        let out = eng.deliver_unexpected(l, env, msg, p, n);
                        eng.settle(l, env, out, recv);
                        let done = b.is_done();
                        *queued.borrow_mut() = Some((b, None));
                        Ok(done)
                    }
                    Posted::Queued(id) => {
                        M::unstall(eng, l);
                        *queued.borrow_mut() = Some((b, Some(id)));
                        Ok(false)
                    }
                }
            },
            || queued.borrow().as_ref().is_some_and(|(b, _)| b.is_done()),
        );
        // Never read a queued entry's outcome while it can still be written:
        // dropping `unpost` takes it out of the engine first.
        let queued_recv = queued.borrow().as_ref().map(|(b, _)| b.clone());
        let direct_status = direct.status.take();
        drop(unpost);
        if let Some(b) = queued_recv {
            if b.is_done() {
                return b.outcome();
            }
            r?;
            return Err(Error::Closed);
        }
        r?;
        direct_status
            .map(|s| s.into_result())
            .unwrap_or(Err(Error::Closed))
    }

    /// Starts a receive into `buf`, which moves into the request.
    #[inline(always)]
    fn start_recv(self: &Arc<Self>, buf: Buffer, pattern: Pattern) -> Request {
        let mut l = self.lock();
        self.start_recv_locked(&mut l, buf, pattern)
    }

    /// A window of receives under one lock: each is what `start_recv`
    /// would make.
    fn start_recv_many(
        self: &Arc<Self>,
        bufs: &mut Vec<Buffer>,
        pattern: Pattern,
        out: &mut Vec<Request>,
    ) {
        let mut l = self.lock();
        start_each(bufs, out, |buf| {
            self.start_recv_locked(&mut l, buf, pattern)
        });
    }

    /// A window of sends: the eager ones that fit go into the ring under
    /// one lock, each born complete as in `start_send`; from the first one
    /// that cannot (too long, no credit, a full ring, a backlog), that one
    /// and the rest take `start_send` one by one, so they stay in order.
    fn start_send_many(
        self: &Arc<Self>,
        bufs: &mut Vec<Buffer>,
        to: SendTo,
        out: &mut Vec<Request>,
    ) {
        let (dest, sync) = (to.dest(), to.sync());
        out.reserve(bufs.len());
        let mut rest = bufs.drain(..);
        if !sync && !self.dest_gone(dest) {
            let env = to.envelope();
            let mut l = self.lock();
            for buf in rest.by_ref() {
                if self.push_eager_now(&mut l, &buf, to) {
                    let len = buf.len();
                    out.push(self.tracker.completed(buf, Status::ok(env, len)));
                    continue;
                }
                drop(l);
                out.push(self.start_send(buf, to));
                break;
            }
        }
        for buf in rest {
            out.push(self.start_send(buf, to));
        }
    }

    /// The status of the first message that matches `pattern`, without
    /// receiving it; `block`: wait for one (then `None` only if the engine
    /// closed meanwhile).
    fn probe(&self, pattern: Pattern, block: bool) -> Result<Option<Status>> {
        if !block {
            let mut l = self.lock();
            return Ok(self.probe_once(&mut l, &pattern));
        }
        let mut found = None;
        self.block_until(
            true,
            |eng, l| {
                found = eng.probe_once(l, &pattern);
                if found.is_none() {
                    if let Source::Rank(s) = pattern.source {
                        if l.gone[s] && s != eng.rank {
                            return Err(gone_error(l, s));
                        }
                    }
                }
                Ok(found.is_some())
            },
            || false,
        )?;
        Ok(found)
    }

    /// See [`xdev::Device::peek`].
    fn peek(&self) -> Result<Option<Peeked>> {
        let mut found = None;
        self.block_until(
            true,
            |eng, l| {
                eng.progress_locked(l, None);
                found = l.leases.peek().or_else(|| eng.tracker.pop_completed());
                Ok(found.is_some() || (eng.tracker.outstanding() == 0 && !l.leases.outstanding()))
            },
            || false,
        )?;
        Ok(found.or_else(|| self.tracker.pop_completed()))
    }

    /// See [`xdev::Device::finish`].
    fn finish(&self) -> Result<()> {
        if self.closing.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        // Our sends (requests and blocking ones) and the medium's replies
        // must be through: a peer that got our data must not see us leave
        // before our answers.
        let r = self.block_until(
            false,
            |eng, l| {
                eng.progress_locked(l, None);
                Ok(eng.tracker.outstanding_sends() == 0 && l.backlog_total == 0 && M::settled(l))
            },
            || false,
        );
        let mut guard = self.lock();
        let l = &mut *guard;
        M::close(self, l);
        self.fail_posted_closed(l);
        l.matching.drain_unexpected();
        drop(guard);
        self.depart(false);
        self.m.finished();
        r
    }
}

/// What [`Engine::recv_here`] found for a receive.
enum Here<L> {
    /// No message for it is here yet.
    Absent,
    /// An eager message, delivered: the receive's status.
    Done(Status),
    /// A rendezvous that matched, to be settled into the receive's request.
    Later(Envelope, L),
}

impl<M: Medium> Engine<M> {
    /// Starts a send whose request exists: into the ring, or into the
    /// backlog to `dest`.
    fn queue_send(&self, core: &CoreRef, dest: Rank, tag: Tag, context: Context, sync: bool) {
        let env = Envelope {
            source: dest,
            tag,
            context,
        };
        let p = Pending {
            core: core.clone(),
            tag,
            context,
            sync,
        };
        let mut l = self.lock();
        if self.closing.load(Ordering::Acquire) {
            // `finish` may be past its wait for queued sends (see `start_recv`).
            self.tracker
                .complete(core, Status::failed(env, Error::Closed));
        } else if l.gone[dest] {
            let err = gone_error(&l, dest);
            self.tracker.complete(core, Status::failed(env, err));
        } else if !(l.backlog[dest].is_empty() && self.push_pending(&mut l, dest, &p)) {
            l.backlog[dest].push_back(p);
            l.backlog_total += 1;
            // Never cleared (see `Local`).
            self.producer(&mut l, dest).set_waiting(true);
        }
    }

    /// A request that failed before it started.
    fn refused(self: &Arc<Self>, buf: Buffer, env: Envelope, e: Error) -> Request {
        self.tracker.completed(buf, Status::failed(env, e))
    }

    /// One step of a blocking receive while nothing else is posted: from the
    /// unexpected queue, or straight from the rings. `Some(done)` ends the
    /// step; `None`: other receives were posted meanwhile.
    fn recv_direct(
        &self,
        l: &mut Local<M>,
        direct: &mut Direct<'_, M::Later>,
    ) -> Result<Option<bool>> {
        // A stalled ring's head may be the message we want.
        M::unstall(self, l);
        if !self.direct_from_unexpected(l, direct) {
            self.progress_locked(l, Some(direct));
            // Progress may have queued a match as unexpected (a departed
            // peer's ring is drained to its end).
            if !direct.resolved() {
                self.direct_from_unexpected(l, direct);
            }
        }
        if direct.status.is_some() {
            return Ok(Some(true));
        }
        if let Some(b) = direct.stream.take() {
            if let Some(g) = direct.guard {
                *g.borrow_mut() = Some((b, None));
            }
            return Ok(Some(false));
        }
        if let Source::Rank(s) = direct.pattern.source {
            if l.gone[s] && s != self.rank {
                return Err(gone_error(l, s));
            }
        }
        if l.matching.posted_len() == 0 {
            return Ok(Some(false));
        }
        Ok(None)
    }

    /// Whether the destination `dest` of a send is another rank that
    /// finished or died (a send to ourselves never finds us gone).
    #[inline]
    fn dest_gone(&self, dest: Rank) -> bool {
        dest != self.rank && self.m.peer_gone(dest)
    }

    /// Pushes the small send `data` to `to` into the ring now, under `l`,
    /// if it is eager-sized, nothing of ours waits before it (the backlog)
    /// and it fits (credit, ring space); whether it went. Its request is
    /// then born complete. For `start_send` and a window's sends; the
    /// caller has ruled out a synchronous send and a departed peer.
    #[inline(always)]
    fn push_eager_now(&self, l: &mut Local<M>, data: &[u8], to: SendTo) -> bool {
        let dest = to.dest();
        if !l.backlog[dest].is_empty() || !self.eager_fits(l, dest, data.len()) {
            return false;
        }
        matches!(
            self.push_eager(l, dest, (to.tag(), to.context()), data),
            Sent::Complete
        )
    }

    /// `start_recv` under the lock `l` (held by the caller, for one
    /// receive or a window of them).
    #[inline(always)]
    fn start_recv_locked(
        self: &Arc<Self>,
        l: &mut Local<M>,
        buf: Buffer,
        pattern: Pattern,
    ) -> Request {
        let env = Envelope::untagged(self.rank, pattern.context);
        if self.closing.load(Ordering::Acquire) {
            // `finish` began after our first check; it sets `closing` before
            // it empties the queues under this lock, so nothing posted now
            // would be completed.
            return self.refused(buf, env, Error::Closed);
        }
        // A rendezvous this call matches is not copied here (see
        // `Local::defer_copies`). Every exit below clears the flag.
        l.defer_copies = true;
        let mut buf = buf;
        if l.matching.posted_len() == 0 {
            // Each request is returned from where it is made: through a
            // `Result` or a local it would be moved once more.
            match self.recv_here(l, &mut buf, pattern) {
                Here::Absent => {}
                Here::Done(status) => {
                    l.defer_copies = false;
                    return self.tracker.completed(buf, status);
                }
                Here::Later(env, x) => {
                    // (The pool's lock is a leaf: taking it under ours is
                    // fine.)
                    let (core, handle) = self.tracker.start_request(RequestKind::Recv, buf, self);
                    M::settle(self, l, env, x, Target::Request(core));
                    l.defer_copies = false;
                    return handle.into_request();
                }
            }
        }
        // Lent out (see `lend.rs`): no request core. The buffer is held in
        // a `ManuallyDrop` until the handle owns it: should anything unwind
        // while it is queued, it leaks instead of being freed.
        let mut buf = ManuallyDrop::new(buf);
        // SAFETY: the handle is made from the buffer right below, and
        // nothing frees it before.
        let (id, slot) = unsafe { self.lend_recv(l, &mut buf, pattern) };
        l.defer_copies = false;
        let buf = ManuallyDrop::into_inner(buf);
        // SAFETY: the lease `lend_recv` opened keeps the engine alive
        // (`Leases::keep`) until the call that ends it returns, and that
        // call hands the reference back only when it was the last lease.
        unsafe { Request::lent(id, u64::from(slot), buf, &**self) }
    }

    /// The common case of `start_recv`: nothing else is posted (so this
    /// receive may take the first match) and the message is already here, in
    /// the unexpected queue or at the head of its sender's ring. An eager
    /// message is copied straight into `buf` ([`Here::Done`]: the request is
    /// born complete); a rendezvous is left for the request made for it
    /// ([`Here::Later`]).
    #[inline(always)]
    fn recv_here(&self, l: &mut Local<M>, buf: &mut Buffer, pattern: Pattern) -> Here<M::Later> {
        let mut direct = Direct::new(pattern, buf, true);
        if !self.direct_from_unexpected(l, &mut direct) {
            if let Source::Rank(s) = pattern.source {
                if s != self.rank && !l.gone[s] {
                    M::unstall(self, l);
                    self.drain(l, s, Some(&mut direct), true);
                }
            }
        }
        match (direct.status, direct.deferred) {
            (Some(status), _) => Here::Done(status),
            (None, Some((env, x))) => Here::Later(env, x),
            (None, None) => Here::Absent,
        }
    }

    /// Queues the receive `t` makes for `pattern` (matched against the
    /// unexpected queue first): the posted id it was queued as (its cancel
    /// token), or `None` if it matched at once and was never queued.
    /// Inlined into its one caller: the per-message path pays no call. The
    /// target is made where the matching engine puts it
    /// ([`MatchingEngine::post_with`](xdev::devkit::matching::MatchingEngine::post_with)),
    /// not built here and moved there.
    #[inline(always)]
    pub(crate) fn post_target(
        &self,
        l: &mut Local<M>,
        t: impl FnOnce() -> Target,
        pattern: Pattern,
    ) -> Option<PostedId> {
        match l.matching.post_with(pattern, t) {
            Posted::Matched { env, msg, recv } => {
                let (p, n) = recv.dst();
                let out = self.deliver_unexpected(l, env, msg, p, n);
                self.settle(l, env, out, recv);
                None
            }
            Posted::Queued(id) => {
                M::unstall(self, l);
                // A look at the source's ring: a sender ahead of us has
                // the messages for the receives queued so far there, and
                // taking them now empties the queue, so that the next
                // receives take their messages straight from the ring,
                // born complete (the rate test's receiver). But looks that
                // find the ring empty become rarer (`PostLooks`): a receiver
                // posting a window before its messages come (bibw, where
                // each side posts while the other does) would poll, on every
                // post, the line the sender is about to write, a cross-core
                // transfer each time (measured: osu_bibw 8 B +5-15% without
                // those looks).
                if let Source::Rank(s) = pattern.source {
                    if !l.gone[s] && l.post_looks.take_turn() {
                        let took = self.drain(l, s, None, true);
                        let waiting =
                            took || self.consumer(l, s).is_some_and(|c| c.peek().is_some());
                        l.post_looks.found(waiting);
                    }
                    // A receive naming a peer that already left fails at
                    // once (after what it sent has been drained).
                    if l.gone[s] && s != self.rank {
                        self.drain(l, s, None, false);
                        // Still queued (so not done) exactly when the cancel
                        // finds it.
                        if let Some(t) = l.matching.cancel(id) {
                            let env = Envelope::untagged(s, pattern.context);
                            let err = gone_error(l, s);
                            self.complete_target(l, t, Status::failed(env, err));
                        }
                    }
                }
                Some(id)
            }
        }
    }
}
