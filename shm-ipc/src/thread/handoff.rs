//! The thread device's rendezvous: a [`Handoff`] from the sender's buffer,
//! claimed and copied once by the receiver, and the copies a posting call
//! leaves to the next progress ([`PendingPull`]).

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use xdev::devkit::target::{lost, Target};
use xdev::devkit::{CoreRef, Tracker};
use xdev::{Envelope, Rank, Result, Status};

use super::{ThreadMedium, World};
use crate::engine::{Direct, Engine, Local, Outcome, Publication, Sent};
use crate::futex::Scope;

const OFFERED: u8 = 0;
const CLAIMED: u8 = 1;
const DONE: u8 = 2;
const REVOKED: u8 = 3;

/// The sender's side of a rendezvous or synchronous send, shared with the
/// receiver through a pointer in the ring (a `RendezvousStart`).
///
/// The receiver claims it (`OFFERED -> CLAIMED`) before copying from `data`
/// and marks it `DONE` after; a sender that gives up on a lost peer revokes it
/// (`OFFERED -> REVOKED`), and if the claim won, waits for `DONE`. So `data` is
/// never read after the sender stops guaranteeing it.
pub struct Handoff {
    state: AtomicU8,
    data: *const u8,
    len: usize,
    dest: Rank,
    /// The user-visible envelope of the send (source = destination rank).
    status_env: Envelope,
    request: Option<CoreRef>,
    tracker: Arc<Tracker>,
    world: Arc<World>,
    sender: Rank,
}

// SAFETY: `data` is read only under the claim protocol above, while the
// sender's buffer is kept alive (owned by `request`, or borrowed by a blocking
// send that does not return before DONE or REVOKED).
unsafe impl Send for Handoff {}
// SAFETY: as above; all mutable state is atomic.
unsafe impl Sync for Handoff {}

impl Handoff {
    /// Marks the handoff done and completes the send (receiver side).
    fn finish(&self) {
        if let Some(core) = &self.request {
            self.tracker
                .complete(core, Status::ok(self.status_env, self.len));
        }
        self.state.store(DONE, Ordering::Release);
        self.world.ranks[self.sender].doorbell.ring(Scope::Private);
    }

    pub(super) fn is_done(&self) -> bool {
        self.state.load(Ordering::Acquire) == DONE
    }

    /// Sender side: gives up because the receiver is gone. Returns once the
    /// receiver can no longer touch the data.
    pub(super) fn revoke(&self) -> bool {
        match self
            .state
            .compare_exchange(OFFERED, REVOKED, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => {
                if let Some(core) = &self.request {
                    let err = lost(self.dest, "receiver went away before matching");
                    self.tracker
                        .complete(core, Status::failed(self.status_env, err));
                }
                true
            }
            Err(_) => {
                while self.state.load(Ordering::Acquire) == CLAIMED {
                    std::hint::spin_loop();
                }
                false
            }
        }
    }

    fn into_cookie(self: Arc<Self>) -> u64 {
        Arc::into_raw(self) as u64
    }

    /// # Safety
    /// `cookie` must come from `into_cookie` and be taken back exactly once.
    pub(super) unsafe fn from_cookie(cookie: u64) -> Arc<Handoff> {
        // SAFETY: per the contract, this is a pointer from Arc::into_raw whose
        // reference has not been reclaimed yet.
        unsafe { Arc::from_raw(cookie as *const Handoff) }
    }

    /// The receiver side of a rendezvous: claim, copy once, finish.
    pub(super) fn pull(&self, env: Envelope, dst: *mut u8, cap: usize) -> Status {
        if self
            .state
            .compare_exchange(OFFERED, CLAIMED, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Status::failed(env, lost(env.source, "sender withdrew the message"));
        }
        let n = self.len.min(cap);
        // SAFETY: CLAIMED guarantees the sender keeps `data` valid for `len`
        // bytes until DONE; dst is valid for cap >= n bytes and exclusively ours.
        unsafe { std::ptr::copy_nonoverlapping(self.data, dst, n) };
        self.finish();
        Status::received(env, self.len, cap)
    }

    /// The receiver matched a synchronous eager send.
    pub(super) fn acknowledge(&self) {
        if self
            .state
            .compare_exchange(OFFERED, CLAIMED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            self.finish();
        }
    }
}

/// A rendezvous matched to a request inside a posting call, whose copy is
/// left to the next progress (see `Local::defer_copies`). The request's core
/// owns the buffer until it completes; the sender keeps its data until the
/// handoff is finished or revoked.
pub(crate) struct PendingPull {
    pub(super) env: Envelope,
    pub(super) hand: Arc<Handoff>,
    pub(super) target: Target,
}

type Eng = Engine<ThreadMedium>;
type Loc = Local<ThreadMedium>;

impl ThreadMedium {
    /// The receiver's side of a matched rendezvous: the copy, unless a
    /// posting call works (then it is left for later).
    pub(super) fn pull_or_defer(
        l: &Loc,
        env: Envelope,
        hand: Arc<Handoff>,
        dst: *mut u8,
        cap: usize,
    ) -> Outcome<Arc<Handoff>> {
        if l.defer_copies {
            return Outcome::Later(hand);
        }
        Outcome::Done(hand.pull(env, dst, cap))
    }

    /// A rendezvous left for later, matched to `target`: a request's copy
    /// (a lent one's too) waits for the next progress, a blocking
    /// receive's is done now.
    pub(super) fn settle_pull(
        e: &Eng,
        l: &mut Loc,
        env: Envelope,
        hand: Arc<Handoff>,
        target: Target,
    ) {
        if !target.is_blocking() {
            l.m.pulls.push_back(PendingPull { env, hand, target });
        } else {
            let (dst, cap) = target.dst();
            let st = hand.pull(env, dst, cap);
            e.complete_target(l, target, st);
        }
    }

    pub(super) fn pull_into(env: Envelope, hand: Arc<Handoff>, d: &mut Direct<'_, Arc<Handoff>>) {
        d.status = Some(hand.pull(env, d.buf.as_mut_ptr(), d.buf.len()));
    }

    /// Does the rendezvous copies posting calls left (see [`PendingPull`]).
    pub(super) fn flush_pulls(e: &Eng, l: &mut Loc) -> bool {
        let mut any = false;
        while let Some(p) = l.m.pulls.pop_front() {
            let (dst, cap) = p.target.dst();
            let st = p.hand.pull(p.env, dst, cap);
            e.complete_target(l, p.target, st);
            any = true;
        }
        any
    }

    /// Publishes a send that waits: its handoff goes into the ring.
    pub(super) fn publish_handoff(e: &Eng, l: &mut Loc, p: Publication<'_>) -> Sent<Arc<Handoff>> {
        let (out, request) = (p.out, p.request);
        let mut header = p.header;
        let hand = Arc::new(Handoff {
            state: AtomicU8::new(OFFERED),
            data: out.data.as_ptr(),
            len: out.data.len(),
            dest: out.dest,
            status_env: out.env(),
            request: request.cloned(),
            tracker: e.tracker.clone(),
            world: e.m.world.clone(),
            sender: e.rank,
        });
        header.cookie = hand.clone().into_cookie();
        let pushed = e.push_message(l, out.dest, &header, p.payload);
        if pushed != Ok(true) {
            // SAFETY: the cookie was made just above and never published.
            drop(unsafe { Handoff::from_cookie(header.cookie) });
            return match pushed {
                Err(err) => Sent::Refused(err),
                _ => Sent::Full,
            };
        }
        l.m.handoffs.push(hand.clone());
        if l.m.handoffs.len() >= l.m.handoffs_compact_at {
            l.m.handoffs.retain(|h| !h.is_done());
            l.m.handoffs_compact_at = (l.m.handoffs.len() * 2).max(64);
        }
        Sent::Waiting(request.is_none().then_some(hand))
    }

    /// A blocking send waits for its handoff's end.
    pub(super) fn wait_handoff(e: &Eng, h: &Arc<Handoff>) -> Result<()> {
        e.block_until(
            true,
            |eng, l| {
                if h.is_done() {
                    return Ok(true);
                }
                eng.progress_locked(l, None);
                if eng.m.world.gone(h.dest) && h.revoke() {
                    return Err(lost(h.dest, "receiver went away before matching"));
                }
                Ok(h.is_done())
            },
            || h.is_done(),
        )
    }

    /// Revokes the handoffs to `d`, which left.
    pub(super) fn revoke_to(l: &Loc, d: Rank) {
        for h in l.m.handoffs.iter().filter(|h| h.dest == d) {
            h.revoke();
        }
    }
}
