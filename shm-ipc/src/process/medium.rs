//! The process device's [`Medium`]: rings in the ranks' inbox segments,
//! shared futex doorbells, peers watched by pidfd, every message from a
//! peer checked, and rendezvous by CMA or the pipelined copy.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use xdev::bootstrap::Bootstrap;
use xdev::devkit::target::{BlockingRecv, BlockingSend, SendOwner, Target};
use xdev::{Envelope, Error, Rank, Result, Status};

use super::mapped::PeerArena;
use super::rendezvous::{InStream, Later, OutSend, PendingCopy, RndvStart, SplitRecv};
use super::{ProcessOptions, RendezvousPath};
use crate::biased::BiasedGuard as RankGuard;
use crate::doorbell::DoorbellRef;
use crate::engine::{Direct, Engine, Local, Medium, Outcome, Publication, Sent};
use crate::futex::Scope;
use crate::liveness::PeerWatch;
use crate::ring::{Header, Incoming, RingRef};
use crate::segment::{state, Inbox};
use crate::wire::{
    rndv_start_bytes, ENTRY_CHARGE, FLAG_EXPECTING, FLAG_MAPPED, KIND_ACK, KIND_EAGER,
    RNDV_MAPPED_BYTES,
};

pub(super) type Eng = Engine<ProcessMedium>;
pub(super) type Loc = Local<ProcessMedium>;

/// Everything fixed after start-up, shared by the engine and the watch thread.
pub struct Shared {
    pub(super) rank: Rank,
    pub(super) size: usize,
    pub(super) opts: ProcessOptions,
    pub(super) eager_max: usize,
    pub(super) fragment: usize,
    pub(super) mine: Inbox,
    /// Every rank's inbox (`None` at our own index: use `mine`).
    pub(super) peers: Vec<Option<Inbox>>,
    pub(super) pids: Vec<u32>,
    /// Set by the watch thread when a peer's process has exited.
    pub(super) exited: Box<[AtomicBool]>,
}

impl Shared {
    pub(super) fn inbox(&self, r: Rank) -> &Inbox {
        self.peers[r].as_ref().unwrap_or(&self.mine)
    }

    pub(super) fn gone(&self, r: Rank) -> bool {
        self.exited[r].load(Ordering::Acquire)
            || self.inbox(r).state(Ordering::Acquire) != state::OPEN
    }

    #[cfg(test)]
    pub(super) fn wake(&self, r: Rank) {
        self.inbox(r).doorbell().ring(Scope::Shared);
    }
}

/// How one rank of a job of processes reaches the others.
pub struct ProcessMedium {
    pub(super) sh: Arc<Shared>,
    pub(super) watch: Mutex<Option<PeerWatch>>,
    pub(super) rendezvous: RendezvousPath,
    pub(super) _boot: Bootstrap,
    pub(super) _probe: Box<u64>,
    /// Held while peers may CMA-read this process (see
    /// [`PtracerGrant`](crate::cma::PtracerGrant)): from start-up until the
    /// rendezvous path is chosen (kept only if it is CMA), then until
    /// `finish`.
    pub(super) ptracer: Mutex<Option<crate::cma::PtracerGrant>>,
}

/// The process device's own per-rank state, behind the rank lock.
pub struct ProcessState {
    /// Replies waiting for ring room, per destination.
    pub(super) control: Vec<VecDeque<Header>>,
    pub(super) control_total: usize,
    /// Sends waiting for a reply, by id.
    pub(super) sends: HashMap<u64, OutSend>,
    pub(super) next_id: u64,
    /// Ids being streamed, per destination, in order.
    pub(super) streams_out: Vec<VecDeque<u64>>,
    pub(super) streams_total: usize,
    pub(super) streams_in: HashMap<(Rank, u64), InStream>,
    /// CMA copies matched inside posting calls, for the next progress.
    pub(super) copies: VecDeque<PendingCopy>,
    /// Split CMA copies waiting for the sender's `KIND_WROTE`, by (sender,
    /// send id).
    pub(super) splits: HashMap<(Rank, u64), SplitRecv>,
    /// Split copies that completed (for tests and diagnostics).
    pub(super) splits_done: u64,
    /// Rendezvous received by the pipelined copy (`PULL`s sent; for tests
    /// and diagnostics).
    pub(super) pulls_sent: u64,
    /// Eager bytes (with charges) read from each sender's ring.
    pub(super) eager_recv: Vec<u64>,
    /// Whether CMA reads from each peer are allowed.
    pub(super) cma: Vec<bool>,
    /// Our unfinished rendezvous sends per destination (at most
    /// `rndv_window`).
    pub(super) rndv_out: Vec<usize>,
    /// Each sender's rendezvous headers we read and have not finished
    /// (answered with `FIN`, or streamed to the end): at most `rndv_window`.
    pub(super) rndv_in: Vec<usize>,
    /// What we last published as our idle word
    /// ([`Inbox::idle`](crate::segment::Inbox::idle)).
    pub(super) idle_published: bool,
    /// Whether rendezvous from each peer's shared arena are copied from
    /// its pages mapped here (option `mapped`; off for a peer after a
    /// failure: CMA then).
    pub(super) mapped: Vec<bool>,
    /// Each peer's shared arena, once mapped.
    pub(super) arenas: Vec<Option<PeerArena>>,
    /// Rendezvous copied from a peer's mapped arena, and split copies'
    /// tails written into one (for tests and diagnostics).
    pub(super) mapped_copies: u64,
    pub(super) mapped_writes: u64,
}

impl ProcessState {
    /// State for `n` ranks; `cma`: CMA is used with every peer; `mapped`:
    /// so are mapped copies (the caller asks only where `cma` holds).
    pub(super) fn new(n: usize, cma: bool, mapped: bool) -> Self {
        ProcessState {
            control: (0..n).map(|_| VecDeque::new()).collect(),
            control_total: 0,
            sends: HashMap::new(),
            next_id: 1,
            streams_out: (0..n).map(|_| VecDeque::new()).collect(),
            streams_total: 0,
            streams_in: HashMap::new(),
            copies: VecDeque::new(),
            splits: HashMap::new(),
            splits_done: 0,
            pulls_sent: 0,
            eager_recv: vec![0; n],
            cma: vec![cma; n],
            rndv_out: vec![0; n],
            rndv_in: vec![0; n],
            idle_published: false,
            mapped: vec![mapped; n],
            arenas: (0..n).map(|_| None).collect(),
            mapped_copies: 0,
            mapped_writes: 0,
        }
    }
}

// SAFETY: each ring lives in a mapping held by `sh` (kept alive by the
// medium); this rank is the only consumer of the rings in its own inbox and
// the only producer of its ring in every peer's inbox.
unsafe impl Medium for ProcessMedium {
    type State = ProcessState;
    type Ack = u64;
    type Rndv = RndvStart;
    type Later = Later;
    type Waiter = Arc<BlockingSend>;
    const NAME: &'static str = "shm";
    const TRUSTED: bool = false;
    const SCOPE: Scope = Scope::Shared;

    fn inbox_ring(&self, s: Rank) -> Option<RingRef<'_>> {
        Some(self.sh.mine.ring(s))
    }

    fn outbox_ring(&self, d: Rank) -> RingRef<'_> {
        self.sh.inbox(d).ring(self.sh.rank)
    }

    fn doorbell(&self, r: Rank) -> DoorbellRef<'_> {
        self.sh.inbox(r).doorbell()
    }

    fn departures(&self, order: Ordering) -> u64 {
        self.sh.mine.departures().load(order)
    }

    #[inline]
    fn peer_gone(&self, r: Rank) -> bool {
        self.sh.gone(r)
    }

    fn returned_credit(&self, d: Rank) -> u64 {
        // Acquire pairs with the receiver's Release store of its credit.
        self.sh.inbox(d).freed(self.sh.rank, Ordering::Acquire)
    }

    fn return_credit(&self, s: Rank, bytes: u64) {
        // Release: the sender that sees the credit may reuse it; nothing else
        // is published by it.
        self.sh.mine.set_freed(s, bytes, Ordering::Release);
    }

    fn any_message(&self) -> bool {
        (0..self.sh.size).any(|s| self.sh.mine.ring(s).has_message())
    }

    fn depart(&self, dead: bool) {
        let st = if dead { state::DEAD } else { state::CLOSED };
        self.sh.mine.set_state(st, Ordering::Release);
        for r in 0..self.sh.size {
            let inbox = self.sh.inbox(r);
            inbox.departures().fetch_add(1, Ordering::AcqRel);
            inbox.doorbell().wake_all(Scope::Shared);
        }
    }

    unsafe fn take_ack(h: &Header) -> u64 {
        h.cookie
    }

    unsafe fn take_rndv(_: &Eng, l: &Loc, s: Rank, msg: &Incoming) -> RndvStart {
        // `admit` checked the length: 8 bytes, or 24 with FLAG_MAPPED.
        let mut a = [0u8; RNDV_MAPPED_BYTES];
        Eng::consumer_of(l, s).copy_payload(msg, &mut a);
        let word = |i: usize| u64::from_le_bytes(a[8 * i..8 * i + 8].try_into().unwrap());
        let mapped = if msg.header.flags & FLAG_MAPPED != 0 {
            i32::try_from(word(1)).ok().map(|fd| (fd, word(2)))
        } else {
            None
        };
        RndvStart {
            id: msg.header.cookie,
            addr: word(0),
            may_split: msg.header.flags & FLAG_EXPECTING == 0,
            mapped,
        }
    }

    fn admit(e: &Eng, l: &mut Loc, s: Rank, h: &Header) -> Result<(), String> {
        if h.kind == KIND_EAGER {
            l.m.eager_recv[s] += h.len as u64 + ENTRY_CHARGE;
            if l.m.eager_recv[s] - l.freed_local[s] > e.credit_bytes {
                return Err("eager data beyond its credit".into());
            }
        } else if h.len as usize != rndv_start_bytes(h.flags) {
            return Err(format!("rendezvous start of {} bytes", h.len));
        } else {
            l.m.rndv_in[s] += 1;
            let window = e.m.sh.opts.rndv_window;
            if l.m.rndv_in[s] > window {
                return Err(format!("more than {window} unfinished rendezvous sends"));
            }
        }
        if h.tag < 0 {
            // No send can carry one (`check_send`): a buggy or hostile
            // peer, as the ibv device's wire decoding says.
            return Err(format!("negative tag {}", h.tag));
        }
        Ok(())
    }

    fn unadmit(l: &mut Loc, s: Rank, h: &Header) {
        // Its credit charge is taken again when it is read for real.
        if h.kind == KIND_EAGER {
            l.m.eager_recv[s] -= h.len as u64 + ENTRY_CHARGE;
        } else {
            l.m.rndv_in[s] -= 1;
        }
    }

    fn acknowledge(e: &Eng, l: &mut Loc, s: Rank, id: u64) {
        Self::reply(e, l, s, KIND_ACK, 0, id);
    }

    fn rendezvous(
        e: &Eng,
        l: &mut Loc,
        env: Envelope,
        len: usize,
        r: RndvStart,
        dst: *mut u8,
        cap: usize,
    ) -> Outcome<Later> {
        Self::start_rendezvous(e, l, env, len, r, dst, cap)
    }

    fn settle(e: &Eng, l: &mut Loc, env: Envelope, x: Later, t: Target) {
        Self::settle_later(e, l, env, x, t)
    }

    fn settle_blocking(e: &Eng, l: &mut Loc, env: Envelope, x: Later, d: &mut Direct<'_, Later>) {
        Self::continue_blocking(e, l, env, x, d)
    }

    fn control(e: &Eng, l: &mut Loc, s: Rank, msg: &Incoming) -> Result<(), String> {
        Self::control_message(e, l, s, msg)
    }

    fn abandon(e: &Eng, mut l: RankGuard<'_, Loc>, b: &Arc<BlockingRecv>) {
        let abandoned: Vec<(Rank, u64)> =
            l.m.streams_in
                .iter()
                .filter(|(_, s)| s.target.is(b))
                .map(|(k, _)| *k)
                .collect();
        for k in abandoned {
            l.m.streams_in.remove(&k);
            Self::stream_ended(&mut l, k.0);
        }
        // A split copy cannot be abandoned: its sender may be writing into
        // the slice. Wait until it answered or left.
        if l.m.splits.values().any(|sp| sp.target.is(b)) {
            drop(l);
            let _ = e.block_until(
                false,
                |eng, l| {
                    eng.progress_locked(l, None);
                    Ok(!l.m.splits.values().any(|sp| sp.target.is(b)))
                },
                || b.is_done(),
            );
        }
    }

    fn may_start_rndv(e: &Eng, l: &Loc, d: Rank) -> bool {
        l.m.rndv_out[d] < e.m.sh.opts.rndv_window
    }

    fn publish(e: &Eng, l: &mut Loc, p: Publication<'_>) -> Sent<Arc<BlockingSend>> {
        Self::publish_send(e, l, p)
    }

    fn wait_send(e: &Eng, w: &Arc<BlockingSend>) -> Result<()> {
        // The receiver may read the buffer until the reply comes or it is
        // gone.
        Self::wait_done(e, w);
        w.outcome()
    }

    fn settle_send(e: &Eng, w: Arc<BlockingSend>) {
        Self::wait_done(e, &w);
    }

    fn flush(e: &Eng, l: &mut Loc) -> bool {
        let mut any = false;
        if !l.m.copies.is_empty() {
            any |= Self::flush_copies(e, l);
        }
        if l.m.control_total > 0 {
            any |= Self::flush_control(e, l);
        }
        if l.m.streams_total > 0 {
            any |= Self::flush_streams(e, l);
        }
        Self::publish_idle(e, l);
        any
    }

    fn queued(l: &Loc) -> bool {
        l.m.control_total + l.m.streams_total > 0
    }

    fn fail_peer(e: &Eng, l: &mut Loc, d: Rank, err: &Error) {
        l.m.rndv_in[d] = 0;
        let ids: Vec<u64> = (l.m.sends.iter())
            .filter(|(_, s)| s.dest == d)
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            let s = l.m.sends.remove(&id).expect("present");
            Self::complete_send(e, l, s, Err(err.clone()));
        }
        l.m.streams_total -= l.m.streams_out[d].len();
        l.m.streams_out[d].clear();
        l.m.control_total -= l.m.control[d].len();
        l.m.control[d].clear();
        let keys: Vec<(Rank, u64)> = l.m.splits.keys().filter(|k| k.0 == d).copied().collect();
        for k in keys {
            let sp = l.m.splits.remove(&k).expect("present");
            e.complete_target(l, sp.target, Status::failed(sp.env, err.clone()));
        }
        let keys: Vec<(Rank, u64)> = (l.m.streams_in.keys())
            .filter(|k| k.0 == d)
            .copied()
            .collect();
        for k in keys {
            let st = l.m.streams_in.remove(&k).expect("present");
            e.complete_target(l, st.target, Status::failed(st.env, err.clone()));
        }
        // Unexpected rendezvous starts from it fail when matched (l.gone).
    }

    fn settled(l: &Loc) -> bool {
        l.m.copies.is_empty()
            && l.m.splits.is_empty()
            && l.m.sends.is_empty()
            && l.m.control_total == 0
    }

    fn close(e: &Eng, l: &mut Loc) {
        for (_, st) in std::mem::take(&mut l.m.streams_in) {
            e.complete_target(l, st.target, Status::failed(st.env, Error::Closed));
        }
    }

    fn finished(&self) {
        // No more reads of our memory are needed.
        drop(
            self.ptracer
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take(),
        );
    }

    fn before_drop(&self) {
        drop(self.watch.lock().unwrap_or_else(|p| p.into_inner()).take());
    }

    fn release(_: &Eng, l: &mut Loc) {
        // A peer may still be reading a rendezvous buffer with CMA (it does
        // not know yet that we are gone): leak those buffers rather than free
        // memory another process is copying from.
        for (_, s) in l.m.sends.drain() {
            if let SendOwner::Request(core) = s.owner {
                std::mem::forget(core);
            }
        }
        // Likewise a sender may still be writing the tail of a split copy
        // into a receive's buffer.
        for (_, sp) in l.m.splits.drain() {
            std::mem::forget(sp.target);
        }
    }
}
