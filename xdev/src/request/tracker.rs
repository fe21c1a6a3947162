//! [`Tracker`]: the per-device bookkeeping of requests (ids, the pool of
//! cores, born-complete handles, what `peek` and `finish` ask).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::pool::{self, CoreRef, Pool};
use super::{Handle, Held, Peeked, Progress, Request, RequestCore, RequestId, RequestKind};
use super::{LIVE, REPORTED};
use crate::lock::RankLock;
use crate::{Buffer, Status};

/// Per-device bookkeeping of requests: ids, the pool their cores come
/// from, and what `peek` and `finish` ask (completions of live handles,
/// requests still outstanding). Devices create every request core through
/// it and complete them through it.
///
/// The pool holds every core this tracker made: at most as many as were
/// alive at once (requests in flight plus handles user code holds), about
/// 200 bytes each, like a `Vec`'s capacity; cores are reused once neither
/// a handle nor the device holds them. Completing a request takes no lock
/// and queues nothing; `peek`, `outstanding` and `outstanding_sends` look
/// through the pool instead (they are not on the per-message path).
pub struct Tracker {
    /// This tracker's identity, recorded in every core it starts.
    id: u64,
    pub(super) pool: RankLock<Pool>,
}

/// The first id of a request born complete: pooled requests count from 1
/// up, these from 2^63 up, so the two never meet.
const BORN_IDS: u64 = 1 << 63;

/// How many ids a thread takes at a time for requests born complete.
const BORN_BLOCK: u64 = 1 << 32;

/// Blocks of ids for requests born complete, handed to threads.
static BORN_BLOCKS: AtomicU64 = AtomicU64::new(BORN_IDS);

#[cfg(not(loom))]
thread_local! {
    /// This thread's next id for a request born complete, and the end of
    /// its block (0, 0 before its first).
    static BORN_NEXT: std::cell::Cell<(u64, u64)> = const { std::cell::Cell::new((0, 0)) };
}

// Loom runs its threads on one OS thread: each one's block is a loom local.
#[cfg(loom)]
loom::thread_local! {
    static BORN_NEXT: std::cell::Cell<(u64, u64)> = std::cell::Cell::new((0, 0));
}

/// A fresh id for a request born complete, unique in the process. No
/// locked instruction per request: one would wait for the ring slot the
/// send just wrote to leave the store buffer (the sender's largest cost in
/// a profile when this was one shared counter).
#[inline]
fn born_id() -> RequestId {
    let next = |(n, end): (u64, u64)| {
        if n < end {
            (n, end)
        } else {
            // Relaxed: the blocks only need to be disjoint.
            let first = BORN_BLOCKS.fetch_add(BORN_BLOCK, Ordering::Relaxed);
            (first, first + BORN_BLOCK)
        }
    };
    let (n, end) = BORN_NEXT
        .try_with(|c| {
            let (n, end) = next(c.get());
            c.set((n + 1, end));
            (n, end)
        })
        // A thread whose locals are gone (a destructor at its exit) takes a
        // one-id block.
        .unwrap_or_else(|_| {
            let n = BORN_BLOCKS.fetch_add(1, Ordering::Relaxed);
            (n, n + 1)
        });
    debug_assert!(n < end);
    RequestId(n)
}

impl Default for Tracker {
    fn default() -> Self {
        static TRACKERS: AtomicU64 = AtomicU64::new(1);
        Tracker {
            id: TRACKERS.fetch_add(1, Ordering::Relaxed),
            pool: RankLock::new(Pool::new()),
        }
    }
}

impl Tracker {
    /// A new tracker.
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts a request that owns `buf`; it counts as outstanding until
    /// completed.
    pub fn start(&self, kind: RequestKind, buf: Buffer) -> CoreRef {
        self.start_core(kind, Some(buf), false)
    }

    /// Starts a request that owns `buf` and makes its handle at once: the
    /// device's reference to the core and the [`Request`] for the caller,
    /// with `engine` to progress, wait for and cancel it. The same as
    /// [`start`](Tracker::start), a clone of the core and [`Request::new`],
    /// without their locked instructions: the core is fresh from the pool
    /// (nobody else can reach it yet), and the handle counts no reference
    /// to `engine`. The core keeps a weak one, which the handle upgrades
    /// only if it must drive the engine (see [`Request`]): once the
    /// engine's device is dropped, a request it had not completed ends
    /// with `Error::Closed`.
    #[inline]
    pub fn start_request<E: Progress + 'static>(
        &self,
        kind: RequestKind,
        buf: Buffer,
        engine: &Arc<E>,
    ) -> (CoreRef, Handle) {
        let core = self.start_core(kind, Some(buf), true);
        // SAFETY: `start_core` just took the core from the pool and made no
        // reference to it but `core`.
        unsafe { core.bind_engine(engine) };
        // SAFETY: as above.
        let held = unsafe { core.share_fresh() };
        (core, Handle(Held { core: held }))
    }

    /// The handle of a request born complete with `status`, owning `buf`:
    /// for an operation that ended inside the call that started it (an
    /// `isend` whose data already left, an `irecv` whose message was
    /// already there, one refused before it started: an invalid rank, a
    /// closed device). The handle carries the buffer and the status itself:
    /// no core, no lock, no locked instruction (ids come from per-thread
    /// blocks). It is never outstanding, and `peek` does not report it.
    #[inline]
    pub fn completed(&self, buf: Buffer, status: Status) -> Request {
        Request::born(born_id(), buf, status)
    }

    /// A fresh request id for a request a device lends out
    /// ([`Request::lent`]): from the same per-thread blocks as the ids of
    /// requests born complete, so no locked instruction per request.
    #[inline]
    pub fn lend_id(&self) -> RequestId {
        born_id()
    }

    /// Starts a request that holds no buffer yet, for a device layered over
    /// others: the buffer goes to a request on the device below, and comes
    /// back with [`complete_returning`](Tracker::complete_returning) (see
    /// [`RequestCore::relay`]). Its [`buffer_ptr`](RequestCore::buffer_ptr)
    /// is null and its length 0.
    pub fn start_relay(&self, kind: RequestKind) -> CoreRef {
        self.start_core(kind, None, false)
    }

    /// Inlined into each start: as a call (about 80 instructions a request)
    /// it cost 28 more than inlined on psm's receive, 20 on thread's.
    #[inline]
    fn start_core(&self, kind: RequestKind, buf: Option<Buffer>, handle: bool) -> CoreRef {
        let (core, id) = pool::take_core(self.id, &self.pool);
        // SAFETY: `take_core` gives a core whose only other reference is
        // its pool's.
        unsafe { core.reset(id, kind, buf, handle) };
        core
    }

    /// Whether `core` was started by this tracker.
    pub fn started(&self, core: &RequestCore) -> bool {
        core.tracker == self.id
    }

    /// Completes `core` with `status` unless it was already completed, or
    /// was started by another tracker (which this one refuses); returns
    /// whether this call completed it. After it returns true the device must
    /// not touch the buffer again.
    #[inline]
    pub fn complete(&self, core: &CoreRef, status: Status) -> bool {
        self.complete_with(core, || status)
    }

    /// [`complete`](Tracker::complete) with the status made by `status`
    /// (called only if this call completes the request), built where the
    /// core keeps it: for a device's per-message path, where a status built
    /// first and then moved costs a stalled load.
    #[inline]
    pub fn complete_with(&self, core: &CoreRef, status: impl FnOnce() -> Status) -> bool {
        if !self.started(core) {
            return false;
        }
        match core.claim() {
            None => false,
            Some(hooked) => {
                core.finish_with(hooked, None, status);
                true
            }
        }
    }

    /// Completes `core`, a request started by
    /// [`start_relay`](Tracker::start_relay), with `buf` as its buffer; as
    /// [`complete`](Tracker::complete) otherwise. A request that already
    /// holds a buffer is refused (its buffer may be in use).
    pub fn complete_returning(&self, core: &CoreRef, buf: Buffer, status: Status) -> bool {
        if !self.started(core) || !core.buffer_ptr().is_null() {
            return false;
        }
        match core.claim() {
            None => false,
            Some(hooked) => {
                core.finish(hooked, Some(buf), status);
                true
            }
        }
    }

    /// Completes `core` with `status` as [`complete`](Tracker::complete)
    /// does, for a send whose memory the transport may still read after it
    /// failed (its peer left before the transport let go of it): the
    /// request's buffer is swapped for a copy of it, which the handle gets
    /// back with the error, and the original comes back here, for the
    /// device to keep until the transport lets go of it (or for good).
    /// `None` if this call did not complete the request. A receive is
    /// refused (not completed): the transport may be writing its memory, so
    /// no copy of it can be taken.
    pub fn complete_keeping(&self, core: &CoreRef, status: Status) -> Option<Buffer> {
        if !self.started(core) || core.kind() != RequestKind::Send {
            return None;
        }
        let hooked = core.claim()?;
        // SAFETY: as the claimer we are the only one touching the cells
        // before `done`; the handle reads them only after it.
        let kept = core.buf.with_mut(|b| unsafe { (*b).take() });
        let copy = kept.as_ref().map(|b| Buffer::from(&b[..]));
        core.finish(hooked, copy, status);
        kept
    }

    /// Reports the earliest-started completed request whose handle is still
    /// held and has not consumed it, once.
    pub fn pop_completed(&self) -> Option<Peeked> {
        let pool = self.pool.lock();
        // Acquire on `handle`: a core reset to LIVE without the pool's lock
        // (`RequestCore::reset`) shows its new id and status.
        let mut candidates: Vec<&CoreRef> = pool
            .all
            .iter()
            .filter(|c| c.handle.load(Ordering::Acquire) == LIVE && c.is_done())
            .collect();
        candidates.sort_by_key(|c| c.id());
        for core in candidates {
            // Each completion is reported once: only the one LIVE -> REPORTED
            // exchange reports it. Acquire pairs with the Release store of
            // LIVE in `reset`: the core may have been reused since the scan
            // above, and `done` below is then the new request's (or later).
            if core
                .handle
                .compare_exchange(LIVE, REPORTED, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
            {
                continue;
            }
            if !core.is_done() {
                // A request that reused the core since the scan, and is not
                // complete yet: not ours to report. If its handle has let
                // go meanwhile (and stored RELEASED), this fails.
                let _ = core.handle.compare_exchange(
                    REPORTED,
                    LIVE,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                );
                continue;
            }
            // SAFETY: the request is done (Acquire just now, after the
            // exchange that tied us to this request), so its completer's
            // writes are over and visible. Its handle only reads the status,
            // and the core cannot be reused while we read: the handle, which
            // finds REPORTED when it lets go, leaves the core to a sweep,
            // and a sweep needs the pool's lock, which we hold.
            let status = core.status.with(|s| unsafe { (*s).clone() });
            if let Some(status) = status {
                return Some(Peeked {
                    id: core.id(),
                    status,
                });
            }
        }
        None
    }

    /// Requests started and not yet completed.
    pub fn outstanding(&self) -> usize {
        self.pool.lock().all.iter().filter(|c| !c.is_done()).count()
    }

    /// Send requests started and not yet completed.
    pub fn outstanding_sends(&self) -> usize {
        self.pool
            .lock()
            .all
            .iter()
            .filter(|c| c.kind() == RequestKind::Send && !c.is_done())
            .count()
    }
}
