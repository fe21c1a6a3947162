//! The receive side: draining a ring, matching what it holds, delivering
//! into a receive (from the ring or the unexpected queue), probing.

use xdev::devkit::target::Target;
use xdev::{Envelope, Pattern, Rank, Status};

use super::{Direct, Engine, Local, Medium, Outcome, Unexpected};
use crate::ring::Incoming;
use crate::wire::{DRAIN_BUDGET, FLAG_SYNC, KIND_EAGER, KIND_RNDV, SPARE_PAYLOADS};

/// What became of one message at the head of a ring.
enum Step {
    /// Handled: pop it.
    Taken,
    /// Left in the ring (nothing takes it now).
    Left,
    /// A protocol violation: the ring is read no more.
    Broken,
}

impl<M: Medium> Engine<M> {
    /// Processes the messages waiting in the ring from `s`, at most
    /// [`DRAIN_BUDGET`] of them. With `direct`, stops as soon as that receive
    /// is resolved. With `leave_unmatched`, stops at the first message no
    /// posted receive takes: a receive just posted then takes its message
    /// straight from the ring (one copy) and leaves later ones there for
    /// later receives, instead of copying them into the unexpected queue and
    /// out again. Returns whether anything was processed.
    ///
    /// The eager credit of the messages delivered is returned to `s` once,
    /// at the end, not per message: one store to the line the sender reads
    /// per call instead of one per message.
    pub(crate) fn drain(
        &self,
        l: &mut Local<M>,
        s: Rank,
        direct: Option<&mut Direct<'_, M::Later>>,
        leave_unmatched: bool,
    ) -> bool {
        let freed = l.freed_local[s];
        let any = self.drain_ring(l, s, direct, leave_unmatched);
        if l.freed_local[s] != freed {
            self.m.return_credit(s, l.freed_local[s]);
        }
        any
    }

    /// [`drain`](Self::drain) but for returning the credit.
    fn drain_ring(
        &self,
        l: &mut Local<M>,
        s: Rank,
        mut direct: Option<&mut Direct<'_, M::Later>>,
        leave_unmatched: bool,
    ) -> bool {
        let mut any = false;
        for _ in 0..DRAIN_BUDGET {
            if l.broken[s] || direct.as_ref().is_some_and(|d| d.resolved()) {
                return any;
            }
            let Some(c) = self.consumer(l, s) else {
                return any;
            };
            let msg = match c.peek() {
                None => return any,
                Some(Ok(m)) => m,
                Some(Err(e)) => {
                    self.violation(l, s, e.to_string());
                    return true;
                }
            };
            let kind = msg.header.kind;
            if kind == KIND_EAGER || kind == KIND_RNDV {
                match self.message(l, s, &msg, direct.as_deref_mut(), leave_unmatched) {
                    Step::Taken => {}
                    Step::Left => return any,
                    Step::Broken => return true,
                }
            } else if let Err(what) = M::control(self, l, s, &msg) {
                self.violation(l, s, what);
                return true;
            }
            any = true;
            let c = l.consumers[s].as_mut().expect("consumer exists");
            if c.pop(&msg) {
                self.wake(s);
            }
        }
        any
    }

    /// Matches one message (eager or a rendezvous start) from `s`'s ring:
    /// into `direct`, a posted receive, or the unexpected queue.
    fn message(
        &self,
        l: &mut Local<M>,
        s: Rank,
        msg: &Incoming,
        direct: Option<&mut Direct<'_, M::Later>>,
        leave_unmatched: bool,
    ) -> Step {
        // By reference: a copy of the header, which `peek` just wrote field
        // by field, would be a stalled wide load.
        let h = &msg.header;
        if let Err(what) = M::admit(self, l, s, h) {
            self.violation(l, s, what);
            return Step::Broken;
        }
        let env = h.envelope(s);
        let direct_hit = match direct {
            Some(d) if l.matching.posted_len() == 0 && d.pattern.matches(&env) => Some(d),
            _ => None,
        };
        if let Some(d) = direct_hit {
            let (p, n) = (d.buf.as_mut_ptr(), d.buf.len());
            if h.kind == KIND_EAGER {
                // The common case, with the status written straight into
                // `d` (through an `Outcome` it would be written, then moved).
                self.eager_payload(l, s, msg, p, n);
                d.status = Some(Status::received(env, h.len as usize, n));
            } else {
                let out = self.rendezvous_from_ring(l, s, msg, p, n);
                self.settle_direct(l, env, out, d);
            }
        } else if let Some((at, t)) = l.matching.find_posted(&env) {
            let (p, n) = t.dst();
            let len = h.len as usize;
            let lent = t.lent_slot().filter(|_| h.kind == KIND_EAGER);
            // Taken at `at`, found just now: the queues have not changed
            // since, so these cannot miss.
            if let Some(slot) = lent {
                // The common case: an eager message for a lent receive. It
                // is read where it is queued and dropped there (see
                // `MatchingEngine::find_posted`), and its status is written
                // into its slot of the leases.
                let dropped = l.matching.drop_posted_at(at);
                debug_assert!(dropped, "found just now");
                self.eager_payload(l, s, msg, p, n);
                l.leases
                    .complete_with(&self.tracker, slot, || Status::received(env, len, n));
            } else if let Some(target) = l.matching.take_posted_at(at) {
                if h.kind == KIND_EAGER {
                    // The status is built where the receive keeps it (built
                    // here and moved, it would be a stalled wide load).
                    self.eager_payload(l, s, msg, p, n);
                    self.complete_target_with(l, target, || Status::received(env, len, n));
                } else {
                    let out = self.rendezvous_from_ring(l, s, msg, p, n);
                    self.settle(l, env, out, target);
                }
            } else {
                // Found just now under `&mut`: it cannot miss. Were it to,
                // the message waits as unexpected rather than being lost.
                debug_assert!(false, "found just now");
                return self.queue_unexpected(l, s, msg, env);
            }
        } else {
            if leave_unmatched {
                // Not consumed: it is admitted again when it is read for real.
                M::unadmit(l, s, h);
                return Step::Left;
            }
            return self.queue_unexpected(l, s, msg, env);
        }
        Step::Taken
    }

    /// Queues the message at the head of `s`'s ring as unexpected, held
    /// against its sender's credit ([`Medium::hold`]): `Left` in the ring if
    /// it cannot be held now.
    #[inline(always)]
    fn queue_unexpected(&self, l: &mut Local<M>, s: Rank, msg: &Incoming, env: Envelope) -> Step {
        if !M::hold(self, l, s, &msg.header) {
            return Step::Left;
        }
        let u = self.materialize(l, s, msg);
        l.matching.push_unexpected(env, u);
        Step::Taken
    }

    /// What delivering an eager message from the head of `s`'s ring does
    /// besides its status: the copy into `dst` (`cap` bytes), the credit
    /// (counted here, returned by `drain` when it is done), the
    /// acknowledgement of a synchronous send.
    #[inline(always)]
    fn eager_payload(&self, l: &mut Local<M>, s: Rank, msg: &Incoming, dst: *mut u8, cap: usize) {
        let h = &msg.header;
        // SAFETY: dst is valid for cap bytes (a posted target's buffer or
        // the caller's slice), and nobody else writes it now.
        let out = unsafe { std::slice::from_raw_parts_mut(dst, cap) };
        Self::consumer_of(l, s).copy_payload(msg, out);
        Self::count_credit(l, s, h.len as u64);
        if h.flags & FLAG_SYNC != 0 {
            // SAFETY: once for this message, which is popped right after.
            let ack = unsafe { M::take_ack(h) };
            M::acknowledge(self, l, s, ack);
        }
    }

    /// Delivers the rendezvous start at the head of `s`'s ring into `dst`
    /// (valid for `cap` bytes while its receive is in the engine).
    #[inline(never)]
    fn rendezvous_from_ring(
        &self,
        l: &mut Local<M>,
        s: Rank,
        msg: &Incoming,
        dst: *mut u8,
        cap: usize,
    ) -> Outcome<M::Later> {
        let h = &msg.header;
        let env = h.envelope(s);
        // SAFETY: once for this message, which is popped right after.
        let start = unsafe { M::take_rndv(self, l, s, msg) };
        M::rendezvous(self, l, env, h.aux as usize, start, dst, cap)
    }

    /// Copies the message at the head of `s`'s ring into an unexpected-queue
    /// entry.
    fn materialize(&self, l: &mut Local<M>, s: Rank, msg: &Incoming) -> Unexpected<M> {
        let h = &msg.header;
        if h.kind == KIND_EAGER {
            // A buffer kept from an earlier unexpected message: no
            // allocation in steady state.
            let mut data = l.spare_payloads.pop().unwrap_or_default();
            data.clear();
            data.resize(h.len as usize, 0);
            Self::consumer_of(l, s).copy_payload(msg, &mut data);
            let sync = (h.flags & FLAG_SYNC != 0).then(|| {
                // SAFETY: once for this message, which is popped right after.
                unsafe { M::take_ack(h) }
            });
            return Unexpected::Eager { data, sync };
        }
        // SAFETY: once for this message, which is popped right after.
        let start = unsafe { M::take_rndv(self, l, s, msg) };
        Unexpected::Rndv {
            len: h.aux as usize,
            start,
        }
    }

    pub(crate) fn deliver_unexpected(
        &self,
        l: &mut Local<M>,
        env: Envelope,
        u: Unexpected<M>,
        dst: *mut u8,
        cap: usize,
    ) -> Outcome<M::Later> {
        match u {
            Unexpected::Eager { data, sync } => {
                let n = data.len().min(cap);
                // SAFETY: dst is valid for cap >= n bytes and exclusively ours.
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, n) };
                self.credit(l, env.source, data.len() as u64);
                if let Some(ack) = sync {
                    M::acknowledge(self, l, env.source, ack);
                }
                let st = Status::received(env, data.len(), cap);
                if l.spare_payloads.len() < SPARE_PAYLOADS {
                    l.spare_payloads.push(data);
                }
                Outcome::Done(st)
            }
            Unexpected::Rndv { len, start } => {
                M::rndv_taken(self, l, env.source);
                M::rendezvous(self, l, env, len, start, dst, cap)
            }
        }
    }

    /// Finishes a delivery to a queued target.
    pub(crate) fn settle(
        &self,
        l: &mut Local<M>,
        env: Envelope,
        out: Outcome<M::Later>,
        target: Target,
    ) {
        match out {
            Outcome::Done(st) => self.complete_target(l, target, st),
            Outcome::Later(x) => M::settle(self, l, env, x, target),
        }
    }

    /// Finishes a delivery to a direct receive.
    pub(crate) fn settle_direct(
        &self,
        l: &mut Local<M>,
        env: Envelope,
        out: Outcome<M::Later>,
        d: &mut Direct<'_, M::Later>,
    ) {
        match out {
            Outcome::Done(st) => d.status = Some(st),
            Outcome::Later(x) if d.defer => d.deferred = Some((env, x)),
            Outcome::Later(x) => M::settle_blocking(self, l, env, x, d),
        }
    }

    /// Completes `d` from the unexpected queue if a queued message matches.
    pub(crate) fn direct_from_unexpected(
        &self,
        l: &mut Local<M>,
        d: &mut Direct<'_, M::Later>,
    ) -> bool {
        if l.matching.unexpected_len() == 0 {
            return false;
        }
        let Some((env, u)) = l.matching.take(&d.pattern) else {
            return false;
        };
        let out = self.deliver_unexpected(l, env, u, d.buf.as_mut_ptr(), d.buf.len());
        self.settle_direct(l, env, out, d);
        true
    }

    /// One progress round, then the status of the first unexpected message
    /// that matches `pattern`.
    pub(crate) fn probe_once(&self, l: &mut Local<M>, pattern: &Pattern) -> Option<Status> {
        self.progress_locked(l, None);
        l.matching
            .probe(pattern)
            .map(|(env, u)| Status::ok(env, u.len()))
    }
}
