//! The shared-memory engine, written once for both devices: matching, the
//! unexpected queue, eager delivery and its credit, the send backlog, the
//! drain budget, departures and blocking with spin-then-sleep, `finish`.
//!
//! What differs between the thread device and the process device is a
//! [`Medium`]: how a rank reaches its rings, doorbells and peers' states, and
//! how a rendezvous moves (a hand-off between threads of one process; CMA,
//! a split copy or the pipelined stream between processes), with the
//! per-rank state that only one of them has ([`Medium::State`]).
//!
//! * [`recv`]: draining rings, delivery, the unexpected queue.
//! * [`send`]: eager sends into the pair's ring, the backlog.
//! * [`progress`]: progress rounds, departures, waits.
//! * [`ops`]: the operations a device calls.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use xdev::devkit::matching::{MatchingEngine, PostedId};
use xdev::devkit::target::{lost, BlockingRecv, Pending, Target};
use xdev::devkit::{CoreRef, Tracker};
use xdev::{Context, Envelope, Error, Pattern, Rank, Result, Source, Status, Tag};

use crate::biased::{BiasedGuard as RankGuard, BiasedLock};
use crate::doorbell::DoorbellRef;
use crate::futex::Scope;
use crate::ring::{Consumer, Header, Incoming, Producer, RingRef};

mod lend;
mod ops;
mod progress;
mod recv;
mod send;

/// What a shared-memory device does its own way; the [`Engine`] does the
/// rest.
///
/// # Safety
///
/// [`inbox_ring`](Medium::inbox_ring) and [`outbox_ring`](Medium::outbox_ring)
/// return rings that stay valid for as long as the medium lives, whose only
/// consumer (an inbox ring) or only producer (an outbox ring) is the rank
/// that owns the medium: the engine makes one `Consumer` or `Producer` of
/// each and keeps it while the medium lives.
pub unsafe trait Medium: Send + Sync + Sized + 'static {
    /// Per-rank protocol state only this device has, behind the rank lock.
    type State: Send;
    /// What acknowledges a synchronous eager message once it is matched.
    type Ack: Send;
    /// A rendezvous start as the receiver keeps it.
    type Rndv: Send;
    /// A matched rendezvous whose transfer is not done yet.
    type Later: Send;
    /// What a blocking send waits on once it is published.
    type Waiter: Clone;
    /// The device's name, for messages.
    const NAME: &'static str;
    /// Whether the peers are threads of this process, whose rings are
    /// trusted: a malformed ring is then a bug (a panic), not a protocol
    /// violation by a peer.
    const TRUSTED: bool;
    /// The futex scope of the doorbells.
    const SCOPE: Scope;

    // ---------------------------------------------------- rings and peers

    /// The ring from sender `s` to this rank, if it exists yet.
    fn inbox_ring(&self, s: Rank) -> Option<RingRef<'_>>;
    /// The ring from this rank to `d` (made on first use where rings are).
    fn outbox_ring(&self, d: Rank) -> RingRef<'_>;
    /// Rank `r`'s doorbell.
    fn doorbell(&self, r: Rank) -> DoorbellRef<'_>;
    /// This rank's count of departures (bumped when a peer leaves).
    fn departures(&self, order: Ordering) -> u64;
    /// Whether peer `r` finished or died.
    fn peer_gone(&self, r: Rank) -> bool;
    /// The eager credit `d` returned to this rank so far (as `d` wrote it).
    fn returned_credit(&self, d: Rank) -> u64;
    /// Returns eager credit to sender `s`: `bytes` in all so far.
    fn return_credit(&self, s: Rank, bytes: u64);
    /// A lock-free hint that one of this rank's rings holds a message worth
    /// a step.
    fn any_message(&self) -> bool;
    /// Marks this rank closed (or dead) for every peer, and wakes them.
    fn depart(&self, dead: bool);

    // ---------------------------------------------------- receiving

    /// The acknowledgement that a synchronous eager message carries.
    ///
    /// # Safety
    /// Called at most once per ring message.
    unsafe fn take_ack(h: &Header) -> Self::Ack;
    /// The rendezvous start that a `KIND_RNDV` message carries.
    ///
    /// # Safety
    /// Called at most once per ring message, `msg` at the head of `s`'s ring.
    unsafe fn take_rndv(e: &Engine<Self>, l: &Local<Self>, s: Rank, msg: &Incoming) -> Self::Rndv;
    /// Checks a message read from `s`'s ring (`Err`: a protocol violation).
    fn admit(_e: &Engine<Self>, _l: &mut Local<Self>, _s: Rank, _h: &Header) -> Result<(), String> {
        Ok(())
    }
    /// Undoes [`admit`](Medium::admit) for a message left in the ring.
    fn unadmit(_l: &mut Local<Self>, _s: Rank, _h: &Header) {}
    /// Whether a message nothing matches may be held as unexpected now
    /// (`false`: leave it in the ring).
    fn hold(_e: &Engine<Self>, _l: &mut Local<Self>, _s: Rank, _h: &Header) -> bool {
        true
    }
    /// An unexpected rendezvous from `s` was taken out of the queue.
    fn rndv_taken(_e: &Engine<Self>, _l: &mut Local<Self>, _s: Rank) {}
    /// A receive is being posted: rings left alone may hold its message.
    fn unstall(_e: &Engine<Self>, _l: &mut Local<Self>) {}
    /// Acknowledges a matched synchronous eager message from `s`.
    fn acknowledge(e: &Engine<Self>, l: &mut Local<Self>, s: Rank, ack: Self::Ack);
    /// The receiver's side of a matched rendezvous of `len` bytes, into
    /// `dst` (valid for `cap` bytes while the receive is in the engine).
    #[allow(clippy::too_many_arguments)]
    fn rendezvous(
        e: &Engine<Self>,
        l: &mut Local<Self>,
        env: Envelope,
        len: usize,
        r: Self::Rndv,
        dst: *mut u8,
        cap: usize,
    ) -> Outcome<Self::Later>;
    /// Goes on with a matched rendezvous for a queued or posted receive.
    fn settle(e: &Engine<Self>, l: &mut Local<Self>, env: Envelope, x: Self::Later, t: Target);
    /// Goes on with a matched rendezvous for a blocking receive's own
    /// buffer (`d`).
    fn settle_blocking(
        e: &Engine<Self>,
        l: &mut Local<Self>,
        env: Envelope,
        x: Self::Later,
        d: &mut Direct<'_, Self::Later>,
    );
    /// Handles a message of another kind than `EAGER` and `RNDV` (`Err`: a
    /// protocol violation).
    fn control(
        e: &Engine<Self>,
        l: &mut Local<Self>,
        s: Rank,
        msg: &Incoming,
    ) -> Result<(), String>;
    /// Takes a blocking receive `b` that its call abandons out of whatever
    /// still delivers into it (the call does not return before this does).
    fn abandon(_e: &Engine<Self>, _l: RankGuard<'_, Local<Self>>, _b: &Arc<BlockingRecv>) {}

    // ---------------------------------------------------- sending

    /// Whether a rendezvous to `d` may start now (else it waits, in order).
    fn may_start_rndv(_e: &Engine<Self>, _l: &Local<Self>, _d: Rank) -> bool {
        true
    }
    /// Publishes a send that waits for its receiver (rendezvous or
    /// synchronous); see [`Publication`].
    fn publish(e: &Engine<Self>, l: &mut Local<Self>, p: Publication<'_>) -> Sent<Self::Waiter>;
    /// Waits until a published blocking send is done.
    fn wait_send(e: &Engine<Self>, w: &Self::Waiter) -> Result<()>;
    /// Ends a blocking send's call, an unwind included: returns once the
    /// receiver can no longer read the caller's buffer.
    fn settle_send(e: &Engine<Self>, w: Self::Waiter);

    // ---------------------------------------------------- progress, finish

    /// The medium's own queues, once per progress round.
    fn flush(e: &Engine<Self>, l: &mut Local<Self>) -> bool;
    /// Whether the medium's queues wait for ring room.
    fn queued(_l: &Local<Self>) -> bool {
        false
    }
    /// Fails what the medium holds that involves `d`.
    fn fail_peer(e: &Engine<Self>, l: &mut Local<Self>, d: Rank, err: &Error);
    /// Whether everything `finish` waits for besides the sends is through.
    fn settled(_l: &Local<Self>) -> bool {
        true
    }
    /// `finish`, under the lock, before it empties the queues.
    fn close(e: &Engine<Self>, l: &mut Local<Self>);
    /// `finish`, after the rank departed.
    fn finished(&self) {}
    /// The engine is dropped: first thing.
    fn before_drop(&self) {}
    /// The engine is dropped: last thing, under the lock.
    fn release(e: &Engine<Self>, l: &mut Local<Self>);
}

/// A message the receiver keeps before a receive matches it (the unexpected
/// queue's entry).
pub enum Unexpected<M: Medium> {
    Eager { data: Vec<u8>, sync: Option<M::Ack> },
    Rndv { len: usize, start: M::Rndv },
}

impl<M: Medium> Unexpected<M> {
    fn len(&self) -> usize {
        match self {
            Unexpected::Eager { data, .. } => data.len(),
            Unexpected::Rndv { len, .. } => *len,
        }
    }
}

/// The outcome of delivering a matched message.
pub enum Outcome<L> {
    Done(Status),
    /// A rendezvous whose transfer goes on (the medium's).
    Later(L),
}

/// One message to send.
#[derive(Copy, Clone)]
pub struct Outgoing<'a> {
    pub(crate) dest: Rank,
    pub(crate) tag: Tag,
    pub(crate) context: Context,
    pub(crate) data: &'a [u8],
    pub(crate) sync: bool,
}

impl Outgoing<'_> {
    /// The envelope the send's status reports (source = destination).
    pub(crate) fn env(&self) -> Envelope {
        Envelope {
            source: self.dest,
            tag: self.tag,
            context: self.context,
        }
    }
}

/// A send that waits for its receiver, ready to publish: `header` and
/// `payload` are made, the cookie is the medium's to set.
pub struct Publication<'a> {
    pub(crate) out: &'a Outgoing<'a>,
    pub(crate) header: Header,
    pub(crate) payload: &'a [u8],
    /// The send's request, or `None` for a blocking send, whose waiter
    /// comes back in `Sent::Waiting`.
    pub(crate) request: Option<&'a CoreRef>,
}

/// What became of a send.
pub enum Sent<W> {
    /// Eager, not synchronous: the buffer may be reused.
    Complete,
    /// Waits for the receiver; a blocking send's waiter.
    Waiting(Option<W>),
    /// No room (in the ring, or in the rendezvous window): nothing was sent.
    Full,
    /// Refused (the peer is gone, the device is closing).
    Refused(Error),
}

/// A blocking receive queued in the engine (as a posted receive, or in a
/// transfer when `None`), for its `Unpost` guard.
pub type Queued = RefCell<Option<(Arc<BlockingRecv>, Option<PostedId>)>>;

/// A receive that can complete straight from the ring (the caller's buffer).
pub struct Direct<'a, L> {
    pub(crate) pattern: Pattern,
    pub(crate) buf: &'a mut [u8],
    pub(crate) status: Option<Status>,
    /// A blocking receive's transfer that goes on (a stream or split copy
    /// into `buf`).
    pub(crate) stream: Option<Arc<BlockingRecv>>,
    /// For a blocking receive: its `Unpost` guard's slot, which a transfer
    /// into `buf` is recorded in the moment it is registered (so that an
    /// unwind between then and the caller's own bookkeeping still takes it
    /// out of the engine).
    pub(crate) guard: Option<&'a Queued>,
    /// For a non-blocking receive: a rendezvous that matched is not started
    /// here but left to the caller (`start_recv`), which settles it into its
    /// request.
    pub(crate) deferred: Option<(Envelope, L)>,
    /// A non-blocking receive (see `deferred`).
    pub(crate) defer: bool,
}

impl<'a, L> Direct<'a, L> {
    pub(crate) fn new(pattern: Pattern, buf: &'a mut [u8], defer: bool) -> Self {
        Direct {
            pattern,
            buf,
            status: None,
            stream: None,
            guard: None,
            deferred: None,
            defer,
        }
    }

    fn resolved(&self) -> bool {
        self.status.is_some() || self.stream.is_some() || self.deferred.is_some()
    }
}

/// One rank's private protocol state, behind the rank lock.
///
/// A producer's waiting-for-room flag, once set (by a backlog, a queued
/// reply or stream, or a blocking send that found its ring full), is never
/// cleared: clearing it safely would need a count of every kind of waiter
/// on that ring, and a flag set for nothing only costs the consumer a
/// doorbell ring per pop, which wakes us only while we sleep.
pub struct Local<M: Medium> {
    consumers: Vec<Option<Consumer>>,
    producers: Vec<Option<Producer>>,
    pub(crate) matching: MatchingEngine<Unexpected<M>, Target>,
    pub(crate) backlog: Vec<VecDeque<Pending>>,
    pub(crate) backlog_total: usize,
    pub(crate) eager_sent: Vec<u64>,
    pub(crate) freed_seen: Vec<u64>,
    pub(crate) freed_local: Vec<u64>,
    pub(crate) departures_seen: u64,
    /// Bumped by every progress round that did something.
    pub(crate) events: u64,
    pub(crate) gone: Vec<bool>,
    /// Why each gone peer is gone (what its operations fail with).
    pub(crate) gone_why: Vec<Option<Error>>,
    /// Peers whose ring is no longer read (protocol violation).
    pub(crate) broken: Vec<bool>,
    /// Payload buffers of delivered unexpected eager messages, reused for
    /// the next ones (at most [`SPARE_PAYLOADS`](crate::wire::SPARE_PAYLOADS),
    /// each at most the eager limit).
    pub(crate) spare_payloads: Vec<Vec<u8>>,
    /// Set while a posting call (`start_recv`) works under the lock: a
    /// rendezvous it matches is not copied there but left to the next
    /// progress (a posting call that copied would keep its caller from
    /// posting the sends its peer is waiting for, so that the two ranks of a
    /// bidirectional exchange would copy in turn instead of together).
    pub(crate) defer_copies: bool,
    /// Receives queued behind others that skip their look at the ring
    /// (see `post_target`), and how many the next empty look makes skip.
    pub(crate) post_looks: PostLooks,
    /// The receives lent out (see `lend.rs`).
    pub(crate) leases: lend::Leases<M>,
    /// The medium's own.
    pub(crate) m: M::State,
}

/// When a receive queued behind others looks at its source's ring (see
/// `post_target`): always while looks find messages; after a look that finds
/// the ring empty, the next 1, then 2, 4, 8 and at most
/// [`POST_LOOK_SKIP_MAX`] receives do not look, until a look finds a message
/// again. So a receiver that posts a window of 64 before its messages come
/// looks about once per window in steady state.
#[derive(Debug, Default)]
pub(crate) struct PostLooks {
    skip: u8,
    backoff: u8,
}

/// The most queued receives in a row that skip their look at the ring (the
/// osu window).
const POST_LOOK_SKIP_MAX: u8 = 64;

impl PostLooks {
    /// Whether this receive looks (counting a skipped one).
    #[inline]
    pub(crate) fn take_turn(&mut self) -> bool {
        if self.skip == 0 {
            return true;
        }
        self.skip -= 1;
        false
    }

    /// What the look found: a message (looks go on) or an empty ring (the
    /// next receives skip theirs, twice as many as after the last empty
    /// one).
    #[inline]
    pub(crate) fn found(&mut self, message: bool) {
        if message {
            self.backoff = 0;
        } else {
            self.backoff = (self.backoff * 2).clamp(1, POST_LOOK_SKIP_MAX);
        }
        self.skip = self.backoff;
    }
}

#[cfg(test)]
mod post_looks_tests {
    use super::{PostLooks, POST_LOOK_SKIP_MAX};

    /// The turns taken by `n` posts whose looks find `message`.
    fn turns(p: &mut PostLooks, n: usize, message: bool) -> Vec<bool> {
        (0..n)
            .map(|_| {
                let look = p.take_turn();
                if look {
                    p.found(message);
                }
                look
            })
            .collect()
    }

    #[test]
    fn looks_go_on_while_they_find_messages() {
        let mut p = PostLooks::default();
        assert!(turns(&mut p, 10, true).iter().all(|&t| t));
    }

    #[test]
    fn empty_looks_back_off_doubling_up_to_the_cap_and_a_message_resets() {
        let mut p = PostLooks::default();
        let t = turns(&mut p, 400, false);
        let looks: Vec<usize> = (0..t.len()).filter(|&i| t[i]).collect();
        let gaps: Vec<usize> = looks.windows(2).map(|w| w[1] - w[0] - 1).collect();
        let cap = usize::from(POST_LOOK_SKIP_MAX);
        assert_eq!(gaps[..7], [1, 2, 4, 8, 16, 32, 64]);
        assert!(gaps.iter().all(|&g| g <= cap), "{gaps:?}");
        assert_eq!(*gaps.last().unwrap(), cap);
        // The next look finds a message: looks are taken on every post again.
        while !p.take_turn() {}
        p.found(true);
        assert!(turns(&mut p, 5, true).iter().all(|&t| t));
    }
}

impl<M: Medium> Local<M> {
    /// The state of a rank in a job of `size` ranks.
    pub(crate) fn new(size: usize, m: M::State) -> Self {
        let n = size;
        Local {
            consumers: (0..n).map(|_| None).collect(),
            producers: (0..n).map(|_| None).collect(),
            matching: MatchingEngine::new(),
            backlog: (0..n).map(|_| VecDeque::new()).collect(),
            backlog_total: 0,
            eager_sent: vec![0; n],
            freed_seen: vec![0; n],
            freed_local: vec![0; n],
            departures_seen: 0,
            events: 0,
            gone: vec![false; n],
            gone_why: vec![None; n],
            broken: vec![false; n],
            spare_payloads: Vec::new(),
            defer_copies: false,
            post_looks: PostLooks::default(),
            leases: Default::default(),
            m,
        }
    }
}

/// The `ring_bytes` option, as both shared-memory devices declare it.
pub(crate) const RING_BYTES_SPEC: xdev::devkit::OptionSpec = xdev::devkit::OptionSpec::new(
    "ring_bytes",
    "a byte count, 4096..=2^30",
    "bytes per pair ring (64 KiB up to 22 ranks, then 32 MiB / n², at least 8 KiB)",
);

/// The `credit_bytes` option, as both shared-memory devices declare it.
pub(crate) const CREDIT_BYTES_SPEC: xdev::devkit::OptionSpec = xdev::devkit::OptionSpec::new(
    "credit_bytes",
    "a byte count",
    "eager bytes a sender may have unreceived at one receiver (4 × ring_bytes)",
);

/// The `ring_bytes` option (`default` if unset): bytes per pair ring,
/// between 4 KiB and 1 GiB.
pub(crate) fn ring_bytes_option(
    options: &xdev::devkit::Options<'_>,
    default: usize,
) -> Result<usize> {
    let ring_bytes: usize = options.get("ring_bytes", default)?;
    if !(4096..=(1 << 30)).contains(&ring_bytes) {
        return Err(Error::Config(
            "ring_bytes must be between 4 KiB and 1 GiB".into(),
        ));
    }
    Ok(ring_bytes)
}

/// The limits of a rank, fixed at start-up.
pub struct Limits {
    pub(crate) rank: Rank,
    pub(crate) size: usize,
    /// The eager limit in force (capped by what one ring message carries).
    pub(crate) eager_max: usize,
    /// Eager bytes (with charges) a sender may have unreceived at one
    /// receiver.
    pub(crate) credit_bytes: u64,
}

/// The engine of one rank: shared by the device handle and its requests.
pub struct Engine<M: Medium> {
    pub(crate) m: M,
    pub(crate) rank: Rank,
    pub(crate) size: usize,
    pub(crate) eager_max: usize,
    pub(crate) credit_bytes: u64,
    pub(crate) tracker: Arc<Tracker>,
    pub(crate) local: BiasedLock<Local<M>>,
    pub(crate) closing: AtomicBool,
    pub(crate) closed: AtomicBool,
}

/// Takes a blocking receive out of the engine when its call ends, even by
/// unwinding, so that the device never keeps a pointer into a buffer whose
/// borrow ended.
pub struct Unpost<'e, M: Medium> {
    engine: &'e Engine<M>,
    queued: Queued,
}

impl<M: Medium> Drop for Unpost<'_, M> {
    fn drop(&mut self) {
        if let Some((b, id)) = self.queued.get_mut().take() {
            let mut l = self.engine.lock();
            if let Some(id) = id {
                l.matching.cancel(id);
            }
            if !b.is_done() {
                M::abandon(self.engine, l, &b);
            }
        }
    }
}

/// Settles a blocking send on every exit, an unwind included: from the
/// moment the send is published until the receiver is done with it, the
/// receiver may read the caller's buffer, so the call must not return
/// before then (see [`Medium::settle_send`]).
pub struct SettleSend<'e, M: Medium> {
    engine: &'e Engine<M>,
    waiter: RefCell<Option<M::Waiter>>,
}

impl<M: Medium> Drop for SettleSend<'_, M> {
    fn drop(&mut self) {
        if let Some(w) = self.waiter.get_mut().take() {
            M::settle_send(self.engine, w);
        }
    }
}

/// What operations involving gone peer `s` fail with.
pub(crate) fn gone_error<M: Medium>(l: &Local<M>, s: Rank) -> Error {
    l.gone_why[s]
        .clone()
        .unwrap_or_else(|| lost(s, "peer finished or died"))
}

impl<M: Medium> Engine<M> {
    /// The engine of rank `limits.rank` over `m`.
    pub(crate) fn new(m: M, limits: Limits, state: M::State) -> Self {
        Engine {
            m,
            rank: limits.rank,
            size: limits.size,
            eager_max: limits.eager_max,
            credit_bytes: limits.credit_bytes,
            tracker: Arc::new(Tracker::new()),
            local: BiasedLock::new(Local::new(limits.size, state)),
            closing: AtomicBool::new(false),
            closed: AtomicBool::new(false),
        }
    }

    /// The device's name.
    pub(crate) fn lock(&self) -> RankGuard<'_, Local<M>> {
        self.local.lock()
    }

    /// Makes progress until `done` (with `until_closed`, or until the
    /// engine closed).
    pub(crate) fn wait_until(&self, until_closed: bool, done: impl Fn() -> bool) -> Result<()> {
        self.block_until(
            until_closed,
            |eng, l| {
                if !done() {
                    eng.progress_locked(l, None);
                }
                Ok(done())
            },
            &done,
        )
    }

    /// Rings rank `r`'s doorbell.
    pub(crate) fn wake(&self, r: Rank) {
        self.m.doorbell(r).ring(M::SCOPE);
    }

    /// The consumer of the ring from `s`, if that ring exists yet.
    pub(crate) fn consumer<'l>(&self, l: &'l mut Local<M>, s: Rank) -> Option<&'l mut Consumer> {
        if l.consumers[s].is_none() {
            let ring = self.m.inbox_ring(s)?;
            // SAFETY: per `Medium`'s contract the ring lives as long as the
            // medium, which the engine (and so `Local`) does not outlive,
            // and this rank is its only consumer.
            l.consumers[s] = Some(unsafe { Consumer::new(ring) });
        }
        l.consumers[s].as_mut()
    }

    /// The producer of the ring to `d`.
    pub(crate) fn producer<'l>(&self, l: &'l mut Local<M>, d: Rank) -> &'l mut Producer {
        l.producers[d].get_or_insert_with(|| {
            // SAFETY: per `Medium`'s contract the ring lives as long as the
            // medium, which the engine (and so `Local`) does not outlive,
            // and this rank is its only producer.
            unsafe { Producer::new(self.m.outbox_ring(d)) }
        })
    }

    /// The consumer of a ring a message was just peeked from.
    pub(crate) fn consumer_of(l: &Local<M>, s: Rank) -> &Consumer {
        l.consumers[s].as_ref().expect("consumer exists")
    }

    /// Pushes into `d`'s ring. A ring whose consumer position is impossible
    /// (written by a broken or hostile peer) is a protocol violation: the
    /// peer is failed and its error returned. Inlined, with the violation
    /// out of line.
    #[inline]
    pub(crate) fn try_push(
        &self,
        l: &mut Local<M>,
        d: Rank,
        h: &Header,
        payload: &[u8],
    ) -> Result<bool> {
        match self.producer(l, d).try_push(h, payload) {
            Ok(pushed) => Ok(pushed),
            Err(e) => Err(self.push_violation(l, d, e)),
        }
    }

    /// [`try_push`](Self::try_push)'s failure: the peer is failed.
    #[cold]
    #[inline(never)]
    fn push_violation(&self, l: &mut Local<M>, d: Rank, e: crate::ring::RingError) -> Error {
        self.violation(l, d, format!("its ring's consumer position: {e}"));
        gone_error(l, d)
    }

    /// Returns eager credit for `len` payload bytes to sender `s` at once.
    pub(crate) fn credit(&self, l: &mut Local<M>, s: Rank, len: u64) {
        Self::count_credit(l, s, len);
        self.m.return_credit(s, l.freed_local[s]);
    }

    /// Counts eager credit for `len` payload bytes from sender `s`, to be
    /// returned later (by `drain`, once per call).
    #[inline]
    pub(crate) fn count_credit(l: &mut Local<M>, s: Rank, len: u64) {
        l.freed_local[s] += len + crate::wire::ENTRY_CHARGE;
    }

    /// Completes target `t` with `st`.
    pub(crate) fn complete_target(&self, l: &mut Local<M>, t: Target, st: Status) {
        self.complete_target_with(l, t, || st);
    }

    /// The status of a receive the engine's close ended: `Closed`, this
    /// rank's envelope, no tag.
    pub(crate) fn closed_status(&self) -> Status {
        Status::closed(self.rank)
    }

    /// Ends every queued receive with [`closed_status`](Self::closed_status)
    /// (`finish`, or the device's drop with receives lent out).
    pub(crate) fn fail_posted_closed(&self, l: &mut Local<M>) {
        for t in l.matching.remove_posted_where(|_, _| true) {
            self.complete_target(l, t, self.closed_status());
        }
    }

    /// A peer broke the protocol: stop reading its ring, fail what involves
    /// it. (With trusted peers, a bug.)
    pub(crate) fn violation(&self, l: &mut Local<M>, s: Rank, what: String) {
        if M::TRUSTED {
            // Only our own process writes these rings; corruption is a bug.
            panic!("{} ring with rank {s} corrupt: {what}", M::NAME);
        }
        l.broken[s] = true;
        tracing::warn!(peer = s, what = %what, "peer broke the ring protocol");
        if !l.gone[s] {
            self.fail_peer(l, s, Error::Protocol { rank: s, what });
        }
    }

    /// Fails everything that involves `d` with `err` and marks it gone.
    pub(crate) fn fail_peer(&self, l: &mut Local<M>, d: Rank, err: Error) {
        // Info, not warn: a peer that finished normally departs the same way
        // as one that died, and every operation that involves it gets the
        // typed error anyway. A broken protocol warns (`violation`).
        tracing::info!(peer = d, error = %err, "peer lost");
        l.gone[d] = true;
        l.gone_why[d] = Some(err.clone());
        for t in l
            .matching
            .remove_posted_where(|p, _| p.source == Source::Rank(d))
        {
            let env = Envelope::untagged(d, 0);
            self.complete_target(l, t, Status::failed(env, err.clone()));
        }
        for p in std::mem::take(&mut l.backlog[d]) {
            l.backlog_total -= 1;
            let env = Envelope {
                source: d,
                tag: p.tag,
                context: p.context,
            };
            self.tracker
                .complete(&p.core, Status::failed(env, err.clone()));
        }
        M::fail_peer(self, l, d, &err);
    }
}

/// Switches for tests that unwind out of the engine at chosen points.
#[cfg(test)]
pub(crate) mod test_hooks {
    thread_local! {
        /// Panics in a blocking send right after it was published.
        pub(crate) static PANIC_AFTER_PUBLISH: std::cell::Cell<bool> =
            const { std::cell::Cell::new(false) };
    }
}
