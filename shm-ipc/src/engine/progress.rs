//! Progress rounds, departures of peers, and blocking: spin while
//! something may happen, then sleep on the rank's doorbell.

use std::sync::atomic::Ordering;
use std::time::Duration;

use xdev::devkit::target::{cancelled, lost, unpost};
use xdev::devkit::{Progress, RequestCore};
use xdev::{Error, Result, Source};

use super::{Direct, Engine, Local, Medium};
use crate::doorbell::Backoff;

impl<M: Medium> Engine<M> {
    /// One round of progress: departures, all rings (messages matching
    /// `direct` go straight into its buffer), the medium's queues, the
    /// backlogs. Counts `events`.
    pub(crate) fn progress_locked(
        &self,
        l: &mut Local<M>,
        mut direct: Option<&mut Direct<'_, M::Later>>,
    ) -> bool {
        let mut any = false;
        let dep = self.m.departures(Ordering::Acquire);
        if dep != l.departures_seen {
            l.departures_seen = dep;
            any |= self.handle_departures(l);
        }
        // The direct receive's own source first: its message is the likely one.
        let first = match direct.as_ref().map(|d| d.pattern.source) {
            Some(Source::Rank(s)) => s,
            _ => self.rank,
        };
        let n = self.size;
        for k in 0..n {
            any |= self.drain(l, (first + k) % n, direct.as_deref_mut(), false);
        }
        any |= M::flush(self, l);
        if l.backlog_total > 0 {
            any |= self.flush_backlogs(l);
        }
        if any {
            l.events += 1;
            // Other threads of this rank may sleep on requests we completed.
            self.wake(self.rank);
        }
        any
    }

    fn handle_departures(&self, l: &mut Local<M>) -> bool {
        let mut any = false;
        for d in 0..self.size {
            if l.gone[d] || d == self.rank || !self.m.peer_gone(d) {
                continue;
            }
            any = true;
            // What it sent before leaving is still deliverable, all of it,
            // whatever the per-call budget: it lies within a ring's worth of
            // slots from where we are now (a producer is never further
            // ahead). Nothing after that is read, now or later: a live peer
            // that only claims to have left and keeps refilling its ring
            // cannot keep us here (issue 21).
            if let Some(c) = self.consumer(l, d) {
                let nslots = self.m.inbox_ring(d).map_or(0, |r| r.nslots());
                let end = c.position().saturating_add(nslots as u64);
                c.stop_at(end);
            }
            while self.drain(l, d, None, false) {}
            if !l.gone[d] {
                self.fail_peer(l, d, lost(d, "peer finished or died"));
            }
        }
        any
    }

    /// A lock-free hint that a step may find something: a message in one of
    /// this rank's rings, or a peer's departure not yet handled.
    fn worth_a_step(&self, departures_seen: u64) -> bool {
        self.m.departures(Ordering::Relaxed) != departures_seen || self.m.any_message()
    }

    /// Calls `done` (which makes progress itself, see `progress_locked`)
    /// until it says done, spinning then sleeping while nothing happens.
    /// With `until_closed`, a closed device ends the wait with
    /// [`Error::Closed`].
    pub(crate) fn block_until(
        &self,
        until_closed: bool,
        mut done: impl FnMut(&Self, &mut Local<M>) -> Result<bool>,
        ready: impl Fn() -> bool,
    ) -> Result<()> {
        let mut backoff = Backoff::new();
        loop {
            let (busy, queued, seen) = {
                let mut l = self.lock();
                let before = l.events;
                if done(self, &mut l)? {
                    return Ok(());
                }
                let queued = l.backlog_total > 0 || M::queued(&l);
                (l.events != before, queued, l.departures_seen)
            };
            if until_closed && self.closed.load(Ordering::Acquire) {
                return Err(Error::Closed);
            }
            if busy {
                backoff.reset();
                continue;
            }
            // Spin without the lock until something may have happened (sends
            // waiting for room need a locked step to retry).
            let mut sleep = false;
            while !ready() && !self.worth_a_step(seen) {
                if !backoff.snooze() {
                    sleep = true;
                    break;
                }
                if queued {
                    break;
                }
            }
            if sleep {
                self.sleep(queued, seen, &ready);
            }
        }
    }

    /// Sleeps on this rank's doorbell until `ready` or a step is worth it.
    fn sleep(&self, queued: bool, seen: u64, ready: &impl Fn() -> bool) {
        // Short sleeps while this rank's queues wait for room: the sleeper's
        // re-check does not look at their rings, so a consumer's wake-up on
        // freed room can come before we sleep and be missed. (A blocking send
        // waiting for room re-checks its ring in `ready`, and needs no short
        // sleep.) Longer otherwise; both bounded so that departures are
        // noticed.
        let t = if queued {
            Duration::from_millis(1)
        } else {
            Duration::from_millis(50)
        };
        // A message another thread of this rank is consuming right now may
        // hide from `worth_a_step`; that thread rings our doorbell when its
        // progress round ends.
        self.m
            .doorbell(self.rank)
            .sleep(t, M::SCOPE, || ready() || self.worth_a_step(seen));
    }

    /// Marks this rank closed (or dead) for every peer.
    pub(crate) fn depart(&self, dead: bool) {
        self.closed.store(true, Ordering::Release);
        self.m.depart(dead);
    }
}

impl<M: Medium> Drop for Engine<M> {
    fn drop(&mut self) {
        self.m.before_drop();
        if !self.closed.load(Ordering::Acquire) {
            self.depart(true);
        }
        let mut l = self.lock();
        M::release(self, &mut l);
    }
}

impl<M: Medium> Progress for Engine<M> {
    fn progress(&self) {
        if let Some(mut l) = self.local.try_lock() {
            self.progress_locked(&mut l, None);
        }
    }

    fn wait(&self, core: &RequestCore) {
        let _ = self.wait_until(true, || core.is_done());
        // A closed device completes every request it holds (receives fail with
        // Closed); spin out the tiny window before that completion lands.
        while !core.is_done() {
            std::thread::yield_now();
        }
    }

    fn cancel(&self, core: &xdev::devkit::CoreRef) -> bool {
        let mut l = self.lock();
        let t = unpost(&mut l.matching, core);
        t.map(|t| self.complete_target(&mut l, t, cancelled()))
            .is_some()
    }
}
