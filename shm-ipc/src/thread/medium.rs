//! The thread device's [`Medium`]: rings on the heap of this process, made
//! by the sender on first use, private futex doorbells, and the rendezvous
//! by [`Handoff`].
//!
//! Rendezvous headers a receiver holds as unexpected are bounded per sender
//! (`max_unexpected_rndv`): beyond it the receiver leaves that sender's ring
//! alone ("stalled") until a receive takes one.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use xdev::devkit::target::BlockingRecv;
use xdev::{Envelope, Error, Rank, Result};

use super::{Handoff, PendingPull, World, CLOSED, DEAD};
use crate::biased::BiasedGuard as RankGuard;
use crate::doorbell::DoorbellRef;
use crate::engine::{Direct, Engine, Local, Medium, Outcome, Publication, Sent, Unexpected};
use crate::futex::Scope;
use crate::ring::{Header, Incoming, RingRef};
use crate::wire::{FLAG_SYNC, KIND_RNDV};

/// How one rank of a thread world reaches the others.
pub struct ThreadMedium {
    pub(super) world: Arc<World>,
    pub(super) rank: Rank,
    /// Per sender: its ring is left alone because this rank holds
    /// `max_unexpected_rndv` of its rendezvous headers (written under the
    /// lock, read without it by `any_message`, so a stalled ring with
    /// messages does not keep a waiter spinning).
    pub(super) stalled: Box<[AtomicBool]>,
}

/// The thread device's own per-rank state, behind the rank lock.
pub struct ThreadState {
    /// Our handoffs not seen done yet (revoked if their receiver leaves).
    pub(super) handoffs: Vec<Arc<Handoff>>,
    pub(super) handoffs_compact_at: usize,
    /// Rendezvous headers from each sender held as unexpected.
    unexpected_rndv: Vec<usize>,
    /// Whether a ring may be stalled (see `ThreadMedium::stalled`).
    stalled_any: bool,
    /// Rendezvous matched by posting calls, pulled by the next progress
    /// (see [`PendingPull`]).
    pub(super) pulls: VecDeque<PendingPull>,
}

impl ThreadState {
    pub(super) fn new(size: usize) -> Self {
        ThreadState {
            handoffs: Vec::new(),
            handoffs_compact_at: 64,
            unexpected_rndv: vec![0; size],
            stalled_any: false,
            pulls: VecDeque::new(),
        }
    }
}

type Eng = Engine<ThreadMedium>;
type Loc = Local<ThreadMedium>;

// SAFETY: the rings live in the world, which the medium holds (an `Arc`) and
// so outlives it; a rank's inbox rings (`inbox[s]`) are consumed only by that
// rank and its ring in `to`'s inbox is produced only by it.
unsafe impl Medium for ThreadMedium {
    type State = ThreadState;
    type Ack = Arc<Handoff>;
    type Rndv = Arc<Handoff>;
    type Later = Arc<Handoff>;
    type Waiter = Arc<Handoff>;
    const NAME: &'static str = "thread";
    const TRUSTED: bool = true;
    const SCOPE: Scope = Scope::Private;

    fn inbox_ring(&self, s: Rank) -> Option<RingRef<'_>> {
        self.world.ranks[self.rank].inbox[s].get().map(|r| r.view())
    }

    fn outbox_ring(&self, d: Rank) -> RingRef<'_> {
        self.world.ring(self.rank, d)
    }

    fn doorbell(&self, r: Rank) -> DoorbellRef<'_> {
        self.world.ranks[r].doorbell.view()
    }

    fn departures(&self, order: Ordering) -> u64 {
        self.world.departures.load(order)
    }

    #[inline]
    fn peer_gone(&self, r: Rank) -> bool {
        self.world.gone(r)
    }

    fn returned_credit(&self, d: Rank) -> u64 {
        // Acquire pairs with the receiver's Release store of its credit.
        self.world.ranks[d].freed[self.rank]
            .0
            .load(Ordering::Acquire)
    }

    fn return_credit(&self, s: Rank, bytes: u64) {
        // Release: the sender that sees the credit may reuse it; nothing else
        // is published by it.
        self.world.ranks[self.rank].freed[s]
            .0
            .store(bytes, Ordering::Release);
    }

    fn any_message(&self) -> bool {
        let inbox = &self.world.ranks[self.rank].inbox;
        inbox.iter().enumerate().any(|(s, r)| {
            !self.stalled[s].load(Ordering::Relaxed)
                && r.get().is_some_and(|r| r.view().has_message())
        })
    }

    fn depart(&self, dead: bool) {
        let state = if dead { DEAD } else { CLOSED };
        self.world.ranks[self.rank]
            .state
            .store(state, Ordering::Release);
        self.world.departures.fetch_add(1, Ordering::AcqRel);
        for r in self.world.ranks.iter() {
            r.doorbell.wake_all(Scope::Private);
        }
    }

    unsafe fn take_ack(h: &Header) -> Arc<Handoff> {
        // SAFETY: a sync eager message carries a cookie from into_cookie,
        // taken once (per the caller's contract).
        unsafe { Handoff::from_cookie(h.cookie) }
    }

    unsafe fn take_rndv(_: &Eng, _: &Loc, _: Rank, msg: &Incoming) -> Arc<Handoff> {
        // SAFETY: rendezvous messages carry a cookie from into_cookie, taken
        // once (per the caller's contract).
        unsafe { Handoff::from_cookie(msg.header.cookie) }
    }

    fn hold(e: &Eng, l: &mut Loc, s: Rank, h: &Header) -> bool {
        if h.kind != KIND_RNDV {
            return true;
        }
        let departed = l.gone[s] || e.m.world.gone(s);
        if l.m.unexpected_rndv[s] >= e.m.world.opts.max_unexpected_rndv && !departed {
            // Relaxed: a hint for `any_message`; the lock orders the rest.
            e.m.stalled[s].store(true, Ordering::Relaxed);
            l.m.stalled_any = true;
            return false;
        }
        l.m.unexpected_rndv[s] += 1;
        true
    }

    fn rndv_taken(e: &Eng, l: &mut Loc, s: Rank) {
        l.m.unexpected_rndv[s] -= 1;
        if l.m.unexpected_rndv[s] < e.m.world.opts.max_unexpected_rndv {
            // Relaxed: a hint for `any_message`; the lock orders the rest.
            e.m.stalled[s].store(false, Ordering::Relaxed);
        }
    }

    #[inline]
    fn unstall(e: &Eng, l: &mut Loc) {
        if std::mem::take(&mut l.m.stalled_any) {
            for f in e.m.stalled.iter() {
                f.store(false, Ordering::Relaxed);
            }
        }
    }

    fn acknowledge(_: &Eng, _: &mut Loc, _: Rank, hand: Arc<Handoff>) {
        hand.acknowledge();
    }

    fn rendezvous(
        _: &Eng,
        l: &mut Loc,
        env: Envelope,
        _len: usize,
        hand: Arc<Handoff>,
        dst: *mut u8,
        cap: usize,
    ) -> Outcome<Arc<Handoff>> {
        Self::pull_or_defer(l, env, hand, dst, cap)
    }

    fn settle(
        e: &Eng,
        l: &mut Loc,
        env: Envelope,
        hand: Arc<Handoff>,
        t: xdev::devkit::target::Target,
    ) {
        Self::settle_pull(e, l, env, hand, t)
    }

    fn settle_blocking(
        _: &Eng,
        _: &mut Loc,
        env: Envelope,
        hand: Arc<Handoff>,
        d: &mut Direct<'_, Arc<Handoff>>,
    ) {
        Self::pull_into(env, hand, d)
    }

    fn control(_: &Eng, _: &mut Loc, _: Rank, msg: &Incoming) -> Result<(), String> {
        Err(format!("unknown message kind {}", msg.header.kind))
    }

    fn abandon(_: &Eng, _: RankGuard<'_, Loc>, _: &Arc<BlockingRecv>) {}

    fn publish(e: &Eng, l: &mut Loc, p: Publication<'_>) -> Sent<Arc<Handoff>> {
        Self::publish_handoff(e, l, p)
    }

    fn wait_send(e: &Eng, h: &Arc<Handoff>) -> Result<()> {
        Self::wait_handoff(e, h)
    }

    fn settle_send(_: &Eng, h: Arc<Handoff>) {
        // Idempotent: a no-op once DONE or REVOKED; waits out a copy in
        // progress; revokes an offer nobody claimed.
        h.revoke();
    }

    fn flush(e: &Eng, l: &mut Loc) -> bool {
        !l.m.pulls.is_empty() && Self::flush_pulls(e, l)
    }

    fn fail_peer(_: &Eng, l: &mut Loc, d: Rank, _: &Error) {
        Self::revoke_to(l, d);
    }

    fn close(e: &Eng, l: &mut Loc) {
        Self::flush_pulls(e, l);
    }

    fn release(e: &Eng, l: &mut Loc) {
        // Release the handoffs still sitting in our inbox rings.
        for s in 0..e.size {
            while let Some(Some(Ok(m))) = e.consumer(l, s).map(|c| c.peek()) {
                if m.header.kind == KIND_RNDV || m.header.flags & FLAG_SYNC != 0 {
                    // SAFETY: cookie from into_cookie, never taken (unconsumed).
                    let h = unsafe { Handoff::from_cookie(m.header.cookie) };
                    h.revoke();
                }
                e.consumer(l, s).expect("consumer").pop(&m);
            }
        }
        for (_, u) in l.matching.drain_unexpected() {
            if let Unexpected::Rndv { start: h, .. } | Unexpected::Eager { sync: Some(h), .. } = u {
                h.revoke();
            }
        }
        for p in std::mem::take(&mut l.m.pulls) {
            p.hand.revoke();
        }
    }
}
