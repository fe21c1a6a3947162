//! The psm device's engine: its state under one lock, progress, departures,
//! cancellation and waiting. Every PSM2 call goes through the safe layer
//! ([`super::layer`]).

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use shm_ipc::biased::{BiasedGuard as RankGuard, BiasedLock};
use shm_ipc::doorbell::Backoff;
use xdev::bootstrap::Bootstrap;
use xdev::devkit::{Progress, RequestCore, RequestKind, Tracker};
use xdev::{Context, Envelope, Error, Pattern, Rank, Result, Source, Status, Tag, TagSel};

use super::layer::{CompletionBatch, Library, MqStatus, MqTag, RequestKey, Selector, TrackedQueue};
use super::lend::{Ended, Lent, LentState};

/// The maps below are on every message's path, where SipHash's cost shows.
pub(super) type KeyMap<V> = xdev::devkit::matching::FxMap<RequestKey, V>;

/// What an outstanding PSM2 request belongs to (the payload of its entry in
/// the queue's table).
pub(super) enum Slot {
    /// A non-blocking send PSM2 did not complete inside its post; completed
    /// through the tracker.
    Send {
        core: xdev::devkit::CoreRef,
        /// The envelope (source = destination) and length, for its status.
        env: Envelope,
        len: usize,
    },
    /// A blocking call's request: the call holds the memory and waits; a
    /// collecting progress round that completes it leaves its status in
    /// [`Inner::done`].
    Blocking,
    /// Its call gave up (peer gone); the status is dropped on completion.
    Abandoned,
    /// A blocking send to this rank itself, sent from a copy: PSM2's `self`
    /// device completes a send only when a receive matches it, so the
    /// blocking call returns once the copy is taken (as an eager send
    /// would), and the copy is dropped when PSM2 completes the send.
    SelfCopy(#[allow(dead_code)] Box<[u8]>),
}

/// The device's queue: its requests' payloads, and its lent receives'.
pub(super) type Queue = TrackedQueue<Slot, Lent>;

pub(super) struct Inner {
    /// The matched queue and its outstanding requests (the lent receives
    /// in its second table); `None` once closed (by `finish`, or the
    /// engine's drop).
    pub(super) queue: Option<Queue>,
    /// Statuses of blocking calls' requests that a collecting round got.
    pub(super) done: KeyMap<MqStatus>,
    /// Where a collecting round has PSM2 copy its completions: kept here,
    /// so a round neither builds nor clears a batch (1.3 KB) each time.
    pub(super) batch: Box<CompletionBatch>,
    pub(super) gone: Vec<bool>,
    pub(super) departures_seen: usize,
    /// Send buffers PSM2 may still read (their peer left first): freed
    /// only after the queue (the engine's drop closes it first).
    pub(super) kept: Vec<xdev::Buffer>,
    /// Lent receives that ended before their handle's wait looked (a
    /// collecting round, a cancel, a departure): their status.
    pub(super) ended: KeyMap<Ended>,
    /// The cores of lent receives turned into held requests
    /// ([`LentState::Held`]).
    pub(super) held: KeyMap<xdev::devkit::CoreRef>,
    /// The buffers of lent receives whose handle was dropped while PSM2
    /// was writing them ([`LentState::Dropped`]): freed once PSM2 completes
    /// them, or after the queue (the engine's drop closes it first).
    pub(super) dropped: KeyMap<xdev::Buffer>,
    /// Open leases (lent requests whose handle has not ended them).
    pub(super) leases: usize,
    /// The engine itself, while a lease is open: a lent handle reaches the
    /// engine through an uncounted pointer (see `lend.rs`).
    pub(super) keep: Option<Arc<PsmEngine>>,
}

pub struct PsmEngine {
    pub(super) lib: &'static Library,
    pub(super) rank: Rank,
    pub(super) size: usize,
    /// Sends shorter than this are eager in PSM2 (its shm rendezvous
    /// threshold, `rndv_shm_bytes`).
    pub(super) eager_max: usize,
    pub(super) inner: BiasedLock<Inner>,
    pub(super) tracker: Arc<Tracker>,
    pub(super) closing: AtomicBool,
    pub(super) boot: Bootstrap,
}

/// The PSM2 tag of a message: the xdev tag, the context, and the message's
/// length. The length is never matched on (receives mask it out); it is
/// there because PSM2 does not report the sender's length of a truncated
/// rendezvous message (libpsm2 11.2.185 in shm mode completes such a receive
/// with `msg_length` equal to the receive buffer and no error), and the xdev
/// contract needs it to report truncation. The source is matched by endpoint
/// address instead, and read back from the status's `msg_peer`.
pub(super) fn tag(tag: Tag, context: Context, len: u32) -> MqTag {
    MqTag([tag as u32, context, len])
}

/// What a receive or probe of `p` selects, as PSM2 takes it: the source
/// rank (any for `ANY_SOURCE`), then the tag and its selector: the tag
/// exactly unless `ANY_TAG`, the context always, never the length word.
#[inline]
pub(super) fn selector(p: &Pattern) -> Selector {
    let from = match p.source {
        Source::Rank(s) => Some(s),
        Source::Any => None,
    };
    let (t, tmask) = match p.tag {
        TagSel::Tag(t) => (t, u32::MAX),
        TagSel::Any => (0, 0),
    };
    Selector {
        from,
        tag: tag(t, p.context, 0),
        mask: MqTag([tmask, u32::MAX, 0]),
    }
}

/// The envelope and length of a whole message from `source` with PSM2 tag
/// `tag`, that PSM2 delivered (`ok`, `nbytes`) into `cap` bytes: the
/// message path's status. `None` for an error, a truncation, or a length
/// PSM2 contradicts (the status is then made out of line).
#[inline(always)]
pub(super) fn whole_message(
    source: Rank,
    tag: MqTag,
    (ok, nbytes): (bool, u32),
    cap: usize,
) -> Option<(Envelope, usize)> {
    let t = tag.0;
    let len = t[2] as usize;
    if ok && len <= cap && nbytes as usize == len {
        let env = Envelope {
            source,
            tag: t[0] as i32,
            context: t[1],
        };
        Some((env, len))
    } else {
        None
    }
}

/// The queue a send is posted to, and the send's PSM2 tag: `Closed` if
/// `finish` closed the queue after the caller's first check, and an error
/// for a message PSM2 cannot carry (4 GiB or more).
fn send_queue(l: &mut Inner, t: Tag, context: Context, len: usize) -> Result<(&mut Queue, MqTag)> {
    let q = l.open_queue()?;
    Ok((q, tag(t, context, super::layer::msg_len(len)?)))
}

impl Inner {
    /// The matched queue, or [`Error::Closed`] once `finish` closed it.
    /// The error is made only on that path: built eagerly (`ok_or`), it
    /// was dropped again on every open call, a call of `Error`'s drop glue
    /// per send (callgrind: 15 instructions per eager send).
    #[inline]
    pub(super) fn open_queue(&mut self) -> Result<&mut Queue> {
        self.queue.as_mut().ok_or_else(|| Error::Closed)
    }
}

pub(super) fn lost(rank: Rank) -> Error {
    Error::PeerLost {
        rank,
        reason: "its process left the job".into(),
    }
}

impl PsmEngine {
    #[inline]
    pub(super) fn lock(&self) -> RankGuard<'_, Inner> {
        self.inner.lock()
    }

    /// The xdev status of a completed receive into `cap` bytes, or of a
    /// probed message (`cap` = `None`), sent by `source` (`None`: an
    /// endpoint that is not in the job).
    ///
    /// A whole message from a rank of the job is built here, inlined, in
    /// the caller's place; every other case out of line. (Built by a call
    /// and then moved, the status was read back wide from its narrow
    /// stores: a stalled store forward, half of the lent wait's samples.)
    #[inline(always)]
    pub(super) fn recv_status(
        &self,
        source: Option<Rank>,
        st: &MqStatus,
        cap: Option<usize>,
    ) -> Status {
        if let (Some(source), Some(cap)) = (source, cap) {
            if let Some((env, len)) =
                whole_message(source, st.tag(), (st.is_ok(), st.nbytes()), cap)
            {
                return Status::ok(env, len);
            }
        }
        self.recv_status_rest(source, st, cap)
    }

    /// [`recv_status`](Self::recv_status) for a probe, a truncation, an
    /// error or an unknown sender.
    #[cold]
    #[inline(never)]
    fn recv_status_rest(&self, source: Option<Rank>, st: &MqStatus, cap: Option<usize>) -> Status {
        let t = st.tag().0;
        let env = Envelope {
            source: source.unwrap_or(usize::MAX),
            tag: t[0] as i32,
            context: t[1],
        };
        let Some(source) = source else {
            let what = "a message from an endpoint that is not in the job".to_string();
            return Status::failed(
                env,
                Error::Protocol {
                    rank: usize::MAX,
                    what,
                },
            );
        };
        if !st.is_ok() && !st.is_truncated() {
            return Status::failed(env, st.error("receive"));
        }
        let len = t[2] as usize;
        let Some(cap) = cap else {
            return Status::ok(env, len);
        };
        if (st.nbytes() as usize) != len.min(cap) {
            let what = format!("message says {len} bytes, PSM2 delivered {}", st.nbytes());
            return Status::failed(env, Error::Protocol { rank: source, what });
        }
        Status::received(env, len, cap)
    }

    pub(super) fn send_status(st: &MqStatus, env: Envelope, len: usize) -> Status {
        if st.is_ok() {
            Status::ok(env, len)
        } else {
            Status::failed(env, st.error("send"))
        }
    }

    /// Completes what PSM2 has finished, and makes progress: collecting
    /// ends on an empty completion queue, where PSM2 polls (as
    /// `psm2_mq_ipeek2` does: "ipeek ensures progress if and only if the
    /// MQ's completion queue is empty", psm2_mq.h). No separate poll: that
    /// was a second one per round. Returns whether anything completed.
    pub(super) fn progress_locked(&self, l: &mut Inner) -> bool {
        let Inner {
            queue,
            done,
            batch,
            ended,
            held,
            dropped,
            ..
        } = l;
        let Some(q) = queue.as_mut() else {
            return false;
        };
        let mut any = false;
        loop {
            let more = q.collect(batch);
            for st in batch.statuses() {
                if RequestKey::of(st).is_lent() {
                    if let Some((key, lent)) = q.take_completed_lent(st) {
                        any = true;
                        let source = lent.source().or_else(|| q.peer_of(st));
                        let status = || self.recv_status(source, st, Some(lent.cap()));
                        match lent.state {
                            // Its end waits for the handle.
                            LentState::Out => {
                                ended.insert(key, Ended::new(lent.id(), status()));
                            }
                            LentState::Held => {
                                if let Some(core) = held.remove(&key) {
                                    self.tracker.complete_with(&core, status);
                                }
                            }
                            LentState::Dropped => drop(dropped.remove(&key)),
                        }
                    }
                } else if let Some((key, slot)) = q.take_completed(st) {
                    any = true;
                    self.complete_slot(done, key, slot, st);
                }
            }
            if !more {
                return any;
            }
        }
    }

    /// Completes what the table held for a request PSM2 finished with
    /// status `st`.
    #[inline]
    fn complete_slot(
        &self,
        done: &mut KeyMap<MqStatus>,
        key: RequestKey,
        slot: Slot,
        st: &MqStatus,
    ) {
        match slot {
            // A blocking call's request: hand its status over.
            Slot::Blocking => {
                done.insert(key, *st);
            }
            Slot::Send { core, env, len } => {
                self.tracker
                    .complete_with(&core, || Self::send_status(st, env, len));
            }
            Slot::Abandoned | Slot::SelfCopy(_) => {}
        }
    }

    /// Applies the bootstrap's departure notices: receives naming a departed
    /// peer are cancelled and fail; sends to it fail and their buffers stay
    /// with the device (PSM2 cannot cancel a send it has taken); later
    /// operations to it fail at once.
    pub(super) fn check_departures(&self, l: &mut Inner) {
        let Ok(departed) = self.boot.departed() else {
            return;
        };
        if departed.len() == l.departures_seen {
            return;
        }
        l.departures_seen = departed.len();
        for d in departed {
            if d >= self.size || l.gone[d] || d == self.rank {
                continue;
            }
            tracing::info!(peer = d, "peer lost: its process left the job");
            l.gone[d] = true;
            self.fail_requests_of(l, d);
        }
    }

    /// Fails the outstanding requests naming departed peer `d`.
    fn fail_requests_of(&self, l: &mut Inner, d: Rank) {
        let Some(q) = l.queue.as_mut() else {
            return;
        };
        let (mut recvs, mut sends) = (Vec::new(), Vec::new());
        for (k, s) in q.iter() {
            if matches!(s, Slot::Send { env, .. } if env.source == d) {
                sends.push(k);
            }
        }
        for (k, s) in q.lent_iter() {
            if s.source() == Some(d) && s.state != LentState::Dropped {
                recvs.push(k);
            }
        }
        let env = Envelope::untagged(d, 0);
        for k in recvs {
            let Some(lent) = q.cancel_lent(k) else {
                continue;
            };
            let status = Status::failed(env, lost(d));
            match lent.state {
                LentState::Out => {
                    l.ended.insert(k, Ended::new(lent.id(), status));
                }
                LentState::Held => {
                    if let Some(core) = l.held.remove(&k) {
                        self.tracker.complete(&core, status);
                    }
                }
                LentState::Dropped => {}
            }
        }
        for k in sends {
            let Some(s) = q.get_mut(k) else { continue };
            if let Slot::Send { core, env, .. } = std::mem::replace(s, Slot::Abandoned) {
                // PSM2 may still read the buffer: the handle gets a copy with
                // the error, and the engine keeps the memory.
                let st = Status::failed(env, lost(d));
                if let Some(buf) = self.tracker.complete_keeping(&core, st) {
                    l.kept.push(buf);
                }
            }
        }
    }

    /// Cancels the posted non-blocking receive `key` held through `core`
    /// (a lent receive turned into a held request) if PSM2 has not matched
    /// it yet: it is then returned to PSM2, and its entry removed. Whether
    /// it was.
    fn cancel_recv(&self, l: &mut Inner, key: RequestKey, core: &xdev::devkit::CoreRef) -> bool {
        let Some(q) = l.queue.as_mut() else {
            return false;
        };
        let ours = l.held.get(&key);
        if !ours.is_some_and(|c| xdev::devkit::CoreRef::ptr_eq(c, core)) {
            return false;
        }
        if q.cancel_lent(key).is_none() {
            return false;
        }
        l.held.remove(&key);
        true
    }

    /// Polls until `done` says so: PSM2 polls between the spins and yields
    /// of a [`Backoff`], then sleeps in steps of up to 1 ms (PSM2's shm
    /// device has no wake-up event).
    ///
    /// With `collect`, every round also collects all of PSM2's completions
    /// (`progress_locked`); without it, `done` makes its own progress (see
    /// `take_completion`), the fast path of a blocking call.
    pub(super) fn block_until(
        &self,
        collect: bool,
        mut done: impl FnMut(&Self, &mut Inner) -> Result<bool>,
    ) -> Result<()> {
        let mut backoff = Backoff::new();
        let mut idle: u32 = 0;
        // Sleeps since the last progress: each one longer, up to 1 ms.
        let mut sleeps: u32 = 0;
        let mut last_departure_check: Option<Instant> = None;
        loop {
            {
                let mut l = self.lock();
                let any = collect && self.progress_locked(&mut l);
                // Departures are checked once a wait has been idle a while,
                // then every 5 ms (reading the clock only on that slow path).
                if idle > 0 && idle % 64 == 0 {
                    let now = Instant::now();
                    if last_departure_check
                        .map_or(true, |t| now.duration_since(t) > Duration::from_millis(5))
                    {
                        self.check_departures(&mut l);
                        last_departure_check = Some(now);
                    }
                }
                if done(self, &mut l)? {
                    return Ok(());
                }
                if any {
                    idle = 0;
                    sleeps = 0;
                    backoff.reset();
                    continue;
                }
            }
            idle = idle.saturating_add(1);
            if !backoff.snooze() {
                sleeps = sleeps.saturating_add(1);
                let step = u64::from(sleeps.min(20)) * 50;
                std::thread::sleep(Duration::from_micros(step.max(20)));
            }
        }
    }

    /// The completion of blocking request `key`, if it has completed: taken
    /// from `done` when a collecting round got it first, else polled for
    /// and tested directly (on its handle in the queue's table).
    pub(super) fn take_completion(&self, l: &mut Inner, key: RequestKey) -> Option<MqStatus> {
        if !l.done.is_empty() {
            if let Some(st) = l.done.remove(&key) {
                return Some(st);
            }
        }
        let q = l.queue.as_mut()?;
        q.poll();
        q.test(key).map(|(_, st)| st)
    }

    /// Posts a send of `len` bytes at `data` with `slot` as its payload.
    ///
    /// # Safety
    /// As [`TrackedQueue::isend`]: `data` stays valid and unmodified until
    /// the request leaves the queue.
    pub(super) unsafe fn post_send(
        &self,
        l: &mut Inner,
        (data, len): (*const u8, usize),
        (dest, t, context): (Rank, Tag, Context),
        sync: bool,
        slot: Slot,
    ) -> Result<RequestKey> {
        let (q, stag) = send_queue(l, t, context, len)?;
        // SAFETY: the caller's contract.
        unsafe { q.isend(dest, stag, (data, len), sync, slot) }
    }

    /// Whether a send of `len` bytes to `dest` is over once
    /// `psm2_mq_send2` returns ([`send_eager`](Self::send_eager)): an eager
    /// one (shorter than `eager_max`), not synchronous, to another rank
    /// (to this rank, `psm2_mq_send2` returns only once a receive matches:
    /// see [`Slot::SelfCopy`]).
    #[inline]
    pub(super) fn sends_eagerly(&self, dest: Rank, len: usize, sync: bool) -> bool {
        !sync && len < self.eager_max && dest != self.rank
    }

    /// Sends `data` to `dest` with `psm2_mq_send2`, which returns once
    /// `data` may be reused: for an eager message (shorter than
    /// `eager_max`), once PSM2 has copied it out.
    pub(super) fn send_eager(
        &self,
        l: &mut Inner,
        data: &[u8],
        (dest, t, context): (Rank, Tag, Context),
    ) -> Result<()> {
        let (q, stag) = send_queue(l, t, context, data.len())?;
        q.send(dest, stag, data)
    }

    /// Posts a send of `len` bytes at `data` and tests it once: the status
    /// (`Err`) if PSM2 completed it inside the post, with no table entry;
    /// else the slot `track` makes is its payload, and `track`'s other
    /// value comes back.
    ///
    /// # Safety
    /// As [`TrackedQueue::isend_unless_done`].
    pub(super) unsafe fn post_send_unless_done<X>(
        &self,
        l: &mut Inner,
        (data, len): (*const u8, usize),
        (dest, t, context): (Rank, Tag, Context),
        sync: bool,
        track: impl FnOnce() -> (Slot, X),
    ) -> Result<std::result::Result<X, MqStatus>> {
        let (q, stag) = send_queue(l, t, context, len)?;
        // SAFETY: the caller's contract.
        let posted = unsafe { q.isend_unless_done(dest, stag, (data, len), sync, |_| track()) }?;
        Ok(posted.map(|(_, x)| x))
    }

    /// Posts a receive into `cap` bytes at `buf` for `p`, with `slot` as its
    /// payload.
    ///
    /// # Safety
    /// As [`TrackedQueue::irecv`]: `buf` stays valid and otherwise unused
    /// until the request leaves the queue.
    ///
    /// On failure the slot comes back with the error.
    #[inline(always)]
    pub(super) unsafe fn post_recv(
        &self,
        l: &mut Inner,
        (buf, cap): (*mut u8, usize),
        p: &Pattern,
        slot: Slot,
    ) -> std::result::Result<RequestKey, (Error, Slot)> {
        let Some(q) = l.queue.as_mut() else {
            return Err((Error::Closed, slot));
        };
        // SAFETY: the caller's contract.
        unsafe { q.irecv(&selector(p), (buf, cap), slot) }
    }

    /// The status of a message `p` matches, if one has arrived.
    pub(super) fn iprobe_locked(&self, l: &mut Inner, p: &Pattern) -> Option<Status> {
        // `None` once closed by `finish` after the caller's check.
        let q = l.queue.as_mut()?;
        let st = q.iprobe(&selector(p))?;
        Some(self.recv_status(q.peer_of(&st), &st, None))
    }
}

impl Progress for PsmEngine {
    fn progress(&self) {
        if let Some(mut l) = self.inner.try_lock() {
            self.progress_locked(&mut l);
        }
    }

    fn wait(&self, core: &RequestCore) {
        let _ = self.block_until(true, |_, _| Ok(core.is_done()));
    }

    fn cancel(&self, core: &xdev::devkit::CoreRef) -> bool {
        if core.kind() != RequestKind::Recv || core.is_done() {
            return false;
        }
        let mut l = self.lock();
        let key = RequestKey::from_u64(core.token());
        if !self.cancel_recv(&mut l, key, core) {
            return false;
        }
        drop(l);
        let st = Status::cancelled(Pattern::new(Source::Any, TagSel::Any, 0));
        self.tracker.complete(core, st);
        true
    }
}

impl Drop for PsmEngine {
    fn drop(&mut self) {
        // Unfinished device: the queue's drop finalizes it and force-closes
        // the endpoint, so PSM2 lets go of every buffer, before the request
        // cores (and their buffers) are dropped with the payloads.
        drop(self.lock().queue.take());
    }
}
