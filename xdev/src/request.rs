//! Non-blocking requests: the in-flight state a device owns, the handle user
//! code holds, and the [`Tracker`] that counts outstanding requests and queues
//! completions for [`Device::peek`](crate::Device::peek).
//!
//! Ownership rule: the buffer of a non-blocking operation moves into a
//! [`RequestCore`] shared (through counted references, [`CoreRef`]) by the
//! device and the [`Request`] handle. Safe code can reach the buffer again
//! only through a completed request. Dropping a handle early leaves the core
//! with the device until the operation ends; `mem::forget` of a handle leaks
//! the core, so the memory the device may still touch is never freed under
//! it. A handle counts no reference to its device's engine (the core keeps
//! a weak one): a request still in flight when its engine is gone ends with
//! `Error::Closed` and an empty buffer, its own buffer staying in the core.
//!
//! What keeps that rule sound against code outside the device:
//! - a [`Tracker`] completes only the requests it started (each core records
//!   its tracker), so nobody but the device that owns a request can hand its
//!   buffer out;
//! - a [`Request`] gives its buffer back only once the core is done, whatever
//!   its [`Progress`] hooks do;
//! - a device layered over others never takes a buffer out of a request in
//!   flight: its own request starts without one ([`Tracker::start_relay`]),
//!   the buffer goes to the request below, and it comes back with that
//!   request's completion ([`RequestCore::relay`]);
//! - a completion hook that panics aborts the process, since unwinding there
//!   would leave a device half-way through a completion.

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock, Weak};

use crate::sync::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, UnsafeCell};

mod pool;
mod tracker;

pub use pool::CoreRef;
pub use tracker::Tracker;

use crate::{Buffer, Status};

/// Identifies a request within its device (returned by `peek`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// Whether a request sends or receives.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum RequestKind {
    /// `isend` or `issend`.
    Send,
    /// `irecv`.
    Recv,
}

/// What a layered device runs when a request it relays completes.
pub type CompletionHook = Box<dyn FnOnce(Completion) + Send>;

/// `RequestCore::state` bits: a completer claimed the request.
const CLAIMED: u8 = 1;
/// `RequestCore::state` bits: a completion hook is installed.
const HOOKED: u8 = 2;

/// `RequestCore::handle`: no handle was made yet.
const NO_HANDLE: u8 = 0;
/// A handle holds the request and has not consumed it (peek may report it).
const LIVE: u8 = 1;
/// `peek` reported the completion; the handle still consumes it.
const REPORTED: u8 = 2;
/// The handle consumed the completion, was dropped, or was taken apart.
const RELEASED: u8 = 3;

/// The device-side state of one non-blocking operation: it owns the buffer
/// until completion.
///
/// Cores live in their [`Tracker`]'s pool and are reused once nobody holds
/// them, so a request costs no allocation in steady state.
///
/// Who touches what (the `UnsafeCell`s):
/// - `buf` and `status` are written by whoever claimed the completion
///   (`state` has `CLAIMED`), before `done` is set with `Release`; after
///   that they are read by the one handle (after an `Acquire` load of
///   `done`), or by the hook that received the completion;
/// - `hook` is written once by [`relay`](RequestCore::relay) before it sets
///   `HOOKED` with `Release`, and read by the one party that sees both
///   bits (see `finish` and `on_complete`);
/// - `peek` ([`Tracker::pop_completed`]) reads the status of a done
///   request whose handle it moved from `LIVE` to `REPORTED`, under the
///   pool's lock; a handle that finds `REPORTED` when it lets go (an
///   exchange, `release_handle`) leaves the core to a sweep, which takes
///   that lock, instead of its thread's stash, so the core is not reused
///   under the read;
/// - a reused core is reset only by the one thread that took it from the
///   pool, when no other reference to it exists but the pool's own (whose
///   scans read only the atomics, and `peek` the status as above); the
///   reset leaves the previous status in place, unread until the next
///   completion overwrites it.
///
/// The loom model `xdev/tests/request_loom.rs` checks these rules on this
/// code (completion against wait and reuse, `peek` against reuse, a relay's
/// hook against the completion below).
pub struct RequestCore {
    /// Counted references ([`CoreRef`]), the pool's own included.
    refs: AtomicUsize,
    id: AtomicU64,
    /// A [`RequestKind`] as 0 (send) or 1 (receive).
    kind: AtomicU8,
    /// The [`Tracker`] that started this request: the only one that may
    /// complete it.
    tracker: u64,
    /// Start and length of the owned buffer (written only by `reset`).
    span: UnsafeCell<(*mut u8, usize)>,
    /// [`CLAIMED`] and [`HOOKED`] bits.
    state: AtomicU8,
    done: AtomicBool,
    /// Where the handle is ([`NO_HANDLE`], [`LIVE`], [`REPORTED`],
    /// [`RELEASED`]).
    handle: AtomicU8,
    /// A device-private cookie (for example a posted-receive id for cancel).
    token: AtomicU64,
    buf: UnsafeCell<Option<Buffer>>,
    status: UnsafeCell<Option<Status>>,
    hook: UnsafeCell<Option<CompletionHook>>,
    /// The request of the device below that carries this one, once a
    /// layered device relayed it (see [`RequestCore::relay`]). A plain
    /// `UnsafeCell`, also under loom: what it holds is reached by
    /// reference (`relayed_to`), and its own `OnceLock` synchronizes it.
    below: std::cell::UnsafeCell<OnceLock<(CoreRef, Arc<dyn Progress>)>>,
    /// The engine that drives this core's requests, as
    /// [`Tracker::start_request`] bound it (`bind_engine`): a weak
    /// reference, so that a handle counts no reference to the engine. The
    /// handle upgrades it only when it must drive the engine: a wait or a
    /// test of a request not done yet, a cancel.
    engine: UnsafeCell<Option<Weak<dyn Progress>>>,
}

// SAFETY: `span` points into the Buffer this core owns (an address only;
// the device writes through it under the contract of `buffer_ptr`). The
// cells are accessed under the protocol in the type's docs: one writer
// before `done` (Release), readers after it (Acquire), never both at once;
// `reset` only with no other reference but the pool's.
unsafe impl Send for RequestCore {}
// SAFETY: as above; all other shared state is atomic or a OnceLock.
unsafe impl Sync for RequestCore {}

impl RequestCore {
    /// A spare core for `tracker`'s pool: done, with no handle (so neither
    /// outstanding nor reported by peek), and no buffer.
    fn spare(tracker: u64) -> Self {
        RequestCore {
            refs: AtomicUsize::new(1),
            id: AtomicU64::new(0),
            kind: AtomicU8::new(0),
            tracker,
            span: UnsafeCell::new((std::ptr::null_mut(), 0)),
            state: AtomicU8::new(CLAIMED),
            done: AtomicBool::new(true),
            handle: AtomicU8::new(RELEASED),
            token: AtomicU64::new(u64::MAX),
            buf: UnsafeCell::new(None),
            status: UnsafeCell::new(None),
            hook: UnsafeCell::new(None),
            below: std::cell::UnsafeCell::new(OnceLock::new()),
            engine: UnsafeCell::new(None),
        }
    }

    /// Makes a core new again: in flight, with `buf` (if any) as its
    /// buffer, and with a handle already if `handle` (then published as
    /// `LIVE`).
    ///
    /// Writes only what the next request reads before its completion
    /// writes the rest. What the previous request left goes in place: a
    /// buffer nobody took, a hook or a relayed request (each only if there
    /// is one). Its status stays until the completion overwrites it: the
    /// status is read only once `done` is set, and every completion that
    /// sets `done` for a core with a handle writes it first (a hooked
    /// completion has no handle to read it).
    ///
    /// # Safety
    /// The caller holds the only reference to the core besides its pool's
    /// (taken from the pool, see `pool`): nobody else reads or writes the
    /// cells or `span` meanwhile.
    #[inline]
    unsafe fn reset(
        &self,
        id: RequestId,
        kind: RequestKind,
        mut buf: Option<Buffer>,
        handle: bool,
    ) {
        let span = match &mut buf {
            Some(b) => (b.as_mut_ptr(), b.len()),
            None => (std::ptr::null_mut(), 0),
        };
        // Relaxed stores: whoever gets the core from us gets it through a
        // synchronizing hand-off (a lock, a channel, this thread); the pool
        // reads these only after an Acquire load of `handle` (below) or of
        // `done`, or as counts that need no exactness against a concurrent
        // start (`outstanding`).
        self.id.store(id.0, Ordering::Relaxed);
        self.kind.store(kind as u8, Ordering::Relaxed);
        self.token.store(u64::MAX, Ordering::Relaxed);
        self.state.store(0, Ordering::Relaxed);
        // SAFETY: exclusive access to the cells (the caller's contract).
        self.span.with_mut(|s| unsafe { *s = span });
        // SAFETY: as above.
        self.buf.with_mut(|b| unsafe { *b = buf });
        // SAFETY: as above.
        self.hook.with_mut(|h| unsafe {
            if (*h).is_some() {
                *h = None;
            }
        });
        // SAFETY: as above.
        unsafe {
            if (*self.below.get()).get().is_some() {
                *self.below.get() = OnceLock::new();
            }
        }
        // Release: peek, which reads the id and the status of a LIVE core
        // after an Acquire load of `handle` (and only once `done`), sees
        // this request's values.
        self.done.store(false, Ordering::Release);
        self.handle
            .store(if handle { LIVE } else { NO_HANDLE }, Ordering::Release);
    }

    /// Records `engine` as the one that drives this core's requests, unless
    /// it already is: a core serves one tracker, and a tracker one engine,
    /// so the first start binds it and every later one compares two
    /// addresses (no reference count changes hands per request).
    ///
    /// # Safety
    /// As [`reset`](Self::reset): the caller holds the only reference to the
    /// core besides its pool's.
    #[inline]
    unsafe fn bind_engine<E: Progress + 'static>(&self, engine: &Arc<E>) {
        let want = Arc::as_ptr(engine).cast::<()>();
        // SAFETY: exclusive access to the cell (the caller's contract).
        self.engine.with_mut(|e| unsafe {
            let bound = (*e)
                .as_ref()
                .is_some_and(|w| w.as_ptr().cast::<()>() == want);
            if !bound {
                *e = Some(Arc::downgrade(engine) as Weak<dyn Progress>);
            }
        });
    }

    /// The engine [`bind_engine`](Self::bind_engine) recorded, if it is
    /// still alive (its device was not dropped).
    fn bound_engine(&self) -> Option<Arc<dyn Progress>> {
        // SAFETY: the cell is written only by `bind_engine`, at a start,
        // which no holder of a reference (we are one) can overlap.
        self.engine
            .with(|e| unsafe { (*e).as_ref().and_then(Weak::upgrade) })
    }

    /// The request's id.
    #[inline]
    pub fn id(&self) -> RequestId {
        RequestId(self.id.load(Ordering::Relaxed))
    }

    /// Send or receive.
    #[inline]
    pub fn kind(&self) -> RequestKind {
        if self.kind.load(Ordering::Relaxed) == RequestKind::Send as u8 {
            RequestKind::Send
        } else {
            RequestKind::Recv
        }
    }

    /// Start of the owned buffer. The address stays valid while the core is
    /// alive and incomplete.
    ///
    /// Devices may read through it (sends) or write through it (receives)
    /// only before completing the request, and only one party may write at a
    /// time; that is the device's protocol to guarantee.
    #[inline]
    pub fn buffer_ptr(&self) -> *mut u8 {
        self.span().0
    }

    /// Length of the owned buffer.
    #[inline]
    pub fn buffer_len(&self) -> usize {
        self.span().1
    }

    fn span(&self) -> (*mut u8, usize) {
        // SAFETY: `span` is written only by `reset`, which no holder of a
        // reference (we are one) can overlap.
        self.span.with(|s| unsafe { *s })
    }

    /// Whether the operation has completed.
    #[inline]
    pub fn is_done(&self) -> bool {
        // Acquire pairs with the Release in `finish`, so the status and the
        // data written before completion are visible.
        self.done.load(Ordering::Acquire)
    }

    /// Device cookie (`u64::MAX` when unset).
    #[inline]
    pub fn token(&self) -> u64 {
        self.token.load(Ordering::Relaxed)
    }

    /// Sets the device cookie.
    #[inline]
    pub fn set_token(&self, t: u64) {
        self.token.store(t, Ordering::Relaxed)
    }

    /// Claims the right to complete; false if already claimed. On success,
    /// says whether a hook was installed before the claim.
    #[inline]
    fn claim(&self) -> Option<bool> {
        // AcqRel: Acquire makes a hook installed before us visible; Release
        // orders nothing of ours yet but keeps the RMW symmetric with
        // `on_complete`'s.
        let prev = self.state.fetch_or(CLAIMED, Ordering::AcqRel);
        (prev & CLAIMED == 0).then_some(prev & HOOKED != 0)
    }

    /// Completes a claimed request (`hooked`: what `claim` said), with
    /// `buf` as its buffer if given.
    fn finish(&self, hooked: bool, buf: Option<Buffer>, status: Status) {
        self.finish_with(hooked, buf, || status)
    }

    /// [`finish`](Self::finish) with the status made by `status`, inlined
    /// into the caller so that the status is built where the core keeps it
    /// (built first and then moved, its fields are written narrow and read
    /// back wide: a stalled load, measured as the posted receive's largest
    /// cost after matching).
    #[inline(always)]
    fn finish_with(&self, hooked: bool, buf: Option<Buffer>, status: impl FnOnce() -> Status) {
        if hooked {
            self.finish_hooked(buf, status());
        } else {
            if let Some(b) = buf {
                // SAFETY: as the claimer we are the only one writing the
                // cells before `done`; readers wait for `done`.
                self.buf.with_mut(|p| unsafe { *p = Some(b) });
            }
            let status = status();
            // SAFETY: as above.
            self.status.with_mut(|p| unsafe { *p = Some(status) });
        }
        // Release: publishes the status, the buffer and all data the device
        // wrote into it.
        self.done.store(true, Ordering::Release);
    }

    /// The completion of a claimed request with a hook: to the hook.
    #[inline(never)]
    fn finish_hooked(&self, buf: Option<Buffer>, status: Status) {
        // SAFETY: the HOOKED bit was set (Release) after the hook was
        // written, and our claim saw it (Acquire); `on_complete` saw our
        // CLAIMED bit was not yet set, so it left the hook to us and nobody
        // else reads it.
        let hook = self.hook.with_mut(|h| unsafe { (*h).take() });
        // SAFETY: as the claimer we are the only one touching `buf` before
        // `done`.
        let own = self.buf.with_mut(|b| unsafe { (*b).take() });
        let buf = buf.or(own).unwrap_or_else(|| Buffer::from(Vec::new()));
        if let Some(hook) = hook {
            run_hook(hook, Completion { buf, status });
        }
    }

    /// Hands the completion (buffer and status) to `hook` instead of to a
    /// handle: at once if the request was already claimed (once it is
    /// done), else when it completes. Called at most once, on a core that
    /// has no handle.
    fn on_complete(&self, hook: CompletionHook) {
        // SAFETY: only this call (at most one per core, see `relay`) writes
        // the hook, and nobody reads it before HOOKED is set below.
        self.hook.with_mut(|h| unsafe { *h = Some(hook) });
        // AcqRel: Release publishes the hook to a later claimer; Acquire
        // pairs with an earlier claim.
        let prev = self.state.fetch_or(HOOKED, Ordering::AcqRel);
        if prev & CLAIMED != 0 {
            // The completer claimed without seeing the hook: it stores the
            // completion in the cells. Wait for it (the window between
            // claim and done holds no lock and no wait), then run the hook
            // ourselves.
            while !self.is_done() {
                crate::sync::spin_loop();
            }
            // SAFETY: `done` (Acquire) makes the cells' contents visible;
            // this core has no handle, so nobody else takes them.
            let hook = self.hook.with_mut(|h| unsafe { (*h).take() });
            // SAFETY: as above.
            let buf = self.buf.with_mut(|b| unsafe { (*b).take() });
            // SAFETY: as above.
            let status = self.status.with_mut(|s| unsafe { (*s).take() });
            if let (Some(hook), Some(status)) = (hook, status) {
                let buf = buf.unwrap_or_else(|| Buffer::from(Vec::new()));
                run_hook(hook, Completion { buf, status });
            }
        }
    }

    /// Relays this request, started with [`Tracker::start_relay`] (so it
    /// holds no buffer), to `below`, a request started on the device below
    /// with the buffer this one stands for. When `below` completes, its
    /// buffer and status go to `hook` (which typically maps the status and
    /// completes this request with [`Tracker::complete_returning`]), and
    /// [`relayed_to`](Self::relayed_to) finds `below` for waits and cancels.
    ///
    /// The hook runs on whichever thread completes `below`, possibly under
    /// that device's locks: it must not call back into that device, and if
    /// it panics the process aborts (unwinding would leave the device half
    /// way through a completion). A request is relayed at most once; a
    /// second call is ignored (its `below` is dropped, and with it only a
    /// handle).
    pub fn relay(&self, below: Request, hook: CompletionHook) {
        match below.into_parts() {
            Err((core, Some(engine))) => {
                if self.below().set((core.clone(), engine)).is_ok() {
                    core.on_complete(hook);
                }
            }
            // The device below is gone: nothing will complete `below`.
            Err((_, None)) => {
                if self.below().get().is_none() {
                    run_hook(hook, Completion::closed());
                }
            }
            // Born complete below: nothing to wait for or cancel there.
            Ok(completion) => {
                if self.below().get().is_none() {
                    run_hook(hook, completion);
                }
            }
        }
    }

    /// The request this one was relayed to, with the engine that waits for
    /// and cancels it.
    pub fn relayed_to(&self) -> Option<&(CoreRef, Arc<dyn Progress>)> {
        self.below().get()
    }

    fn below(&self) -> &OnceLock<(CoreRef, Arc<dyn Progress>)> {
        // SAFETY: the cell is replaced only by `reset`, which no holder of
        // a reference (we are one) can overlap; otherwise it is used only
        // through the OnceLock's own synchronized methods.
        unsafe { &*self.below.get() }
    }

    /// Takes the completion of a done request, for its one handle: the
    /// buffer is moved out, the status copied (`peek` may be reading it at
    /// the same time, under the pool's lock; it stays until the core is
    /// reused).
    fn take(&self) -> Completion {
        debug_assert!(self.is_done());
        // SAFETY: the request is done (Acquire in the caller's is_done), so
        // the claimer's writes are visible and over. The single handle
        // (consuming itself) is the only one to touch `buf`; `status` is
        // only read from now on (by us and by `peek`) until the core is
        // reset, which needs the handle's reference gone.
        let buf = self.buf.with_mut(|b| unsafe { (*b).take() });
        // SAFETY: as above.
        let status = self.status.with(|s| unsafe { (*s).clone() });
        // Only a core whose completion went to a hook has none, and such a
        // core has no handle; stay total anyway.
        let status = status.unwrap_or_else(closed_status);
        Completion {
            buf: buf.unwrap_or_else(|| Buffer::from(Vec::new())),
            status,
        }
    }

    /// Marks the handle released, so `peek` no longer reports the request;
    /// says whether `peek` had reported it (and may still be reading its
    /// status: the caller then must not put the core back in its stash).
    #[inline]
    fn release_handle(&self) -> bool {
        // An exchange, not a store: `peek` moves LIVE to REPORTED and then
        // reads the status under the pool's lock, and the two of us must
        // agree on who came first. Reading LIVE, peek's exchange comes
        // after ours and fails; reading REPORTED, we leave the core to a
        // sweep, which needs the pool's lock. (With a plain store, the
        // loom model `tests/request_loom.rs` finds the next request's
        // completion writing the status under peek's read.) Relaxed: the
        // order of the exchanges on `handle` decides it; what the handle
        // did with the core is ordered before a reuse by the release of
        // its reference, or by the pool's lock.
        self.handle.swap(RELEASED, Ordering::Relaxed) == REPORTED
    }
}

/// Runs a completion hook; a panic in it aborts the process (see
/// [`RequestCore::relay`]).
fn run_hook(hook: CompletionHook, completion: Completion) {
    abort_on_unwind("a request completion hook", || hook(completion));
}

/// Runs `f`; should it unwind, the process aborts (after an error event
/// naming `what`). For the stretch of a device's code where unwinding
/// would free or hand back memory a device or a NIC may still use, or
/// leave a completion half done.
pub fn abort_on_unwind<R>(what: &'static str, f: impl FnOnce() -> R) -> R {
    struct AbortOnUnwind(&'static str);
    impl Drop for AbortOnUnwind {
        fn drop(&mut self) {
            tracing::error!("{} panicked; aborting", self.0);
            std::process::abort();
        }
    }
    let guard = AbortOnUnwind(what);
    let r = f();
    std::mem::forget(guard);
    r
}

impl fmt::Debug for RequestCore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RequestCore")
            .field("id", &self.id())
            .field("kind", &self.kind())
            .field("len", &self.buffer_len())
            .field("done", &self.is_done())
            .finish()
    }
}

/// A completed operation: the buffer comes back together with the status
/// (whose `error` says whether the operation failed).
#[derive(Debug)]
pub struct Completion {
    /// The buffer given to `isend`/`irecv`, with received data in place.
    pub buf: Buffer,
    /// What happened.
    pub status: Status,
}

/// The status of a request that ended without an operation to report:
/// `Error::Closed`, from no rank, with no tag.
fn closed_status() -> Status {
    let env = crate::Envelope {
        source: usize::MAX,
        tag: -1,
        context: 0,
    };
    Status::failed(env, crate::Error::Closed)
}

impl Completion {
    /// A request's completion when nothing will drive it any more (its
    /// device was dropped first): [`closed_status`], with an empty buffer.
    fn closed() -> Self {
        Completion {
            buf: Buffer::from(Vec::new()),
            status: closed_status(),
        }
    }

    /// The buffer and status on success, the error otherwise (the buffer is
    /// dropped: keep the `Completion` when it must be reused on error).
    #[inline]
    pub fn into_result(self) -> crate::Result<(Buffer, Status)> {
        let Completion { buf, status } = self;
        status.into_result().map(|status| (buf, status))
    }
}

/// The device hooks a [`Request`] calls.
pub trait Progress: Send + Sync {
    /// Advances the device's protocols once, without blocking.
    fn progress(&self);
    /// Blocks until `core` is complete: polls, then sleeps.
    fn wait(&self, core: &RequestCore);
    /// Cancels `core` if it is a receive that has not matched; true if it was
    /// cancelled (it then completes with `status.cancelled`).
    fn cancel(&self, core: &CoreRef) -> bool;
}

/// The handle of a non-blocking operation.
///
/// Safe code gets the buffer back only from a completed request. A request
/// cannot be taken apart, and a request core lends no buffer, so the review
/// reproduction (take the core of a posted receive, take its buffer, free it
/// while the sender writes) no longer compiles:
///
/// ```compile_fail,E0624
/// # use std::sync::Arc;
/// # use xdev::{Buffer, Request};
/// # use xdev::devkit::{Progress, RequestCore, RequestKind, Tracker};
/// # struct Inert;
/// # impl Progress for Inert {
/// #     fn progress(&self) {}
/// #     fn wait(&self, _: &RequestCore) {}
/// #     fn cancel(&self, _: &xdev::devkit::CoreRef) -> bool { false }
/// # }
/// let t = Tracker::new();
/// let req = Request::new(t.start(RequestKind::Recv, Buffer::zeroed(64)), Arc::new(Inert));
/// let (core, _engine) = req.into_parts(); // private to xdev
/// ```
///
/// ```compile_fail,E0599
/// # use xdev::Buffer;
/// # use xdev::devkit::{RequestKind, Tracker};
/// let t = Tracker::new();
/// let core = t.start(RequestKind::Recv, Buffer::zeroed(64));
/// let buf = core.lend_buffer(); // no such method: relaying starts without a buffer
/// ```
#[must_use = "a request must be waited or tested to get its buffer back"]
pub struct Request {
    inner: Inner,
}

/// The shapes of a request: born complete, or in flight.
enum Inner {
    /// The operation ended inside the call that started it: the handle
    /// itself carries the buffer and the status. No pooled core, no
    /// reference count, no engine; `peek` does not report it (the caller
    /// holds it complete). The status is kept whole, as the device wrote
    /// it: rebuilding it from a narrower copy at `wait` costs a stalled
    /// wide load of freshly written narrow fields, more than the bytes it
    /// saves.
    Done {
        id: RequestId,
        buf: Buffer,
        status: Status,
    },
    /// The device owns the buffer until the core completes.
    InFlight(Held),
}

/// The handle's share of a request in flight: its core, and the engine that
/// progresses, waits for and cancels it once the handle needed it. Dropping
/// it releases the handle (so `peek` no longer reports the request); the
/// core stays with the device until the operation ends.
///
/// A request started by [`Tracker::start_request`] finds its engine through
/// its core's weak reference, upgraded only when the handle must drive the
/// engine (a wait or a test that finds it not done, a cancel): a request
/// that is done by the time its handle looks (the common case in a window
/// of requests, which one progress round completes together) never counts
/// a reference to the engine, where a counted one cost two locked
/// instructions per request (profiled on psm's receive: the increment was
/// 30% of its start, the decrement 35% of its consume). `wait` and `test`
/// keep what they upgraded here, so a loop of tests upgrades once.
struct Held {
    core: CoreRef,
    engine: Option<Arc<dyn Progress>>,
}

impl Drop for Held {
    #[inline]
    fn drop(&mut self) {
        self.core.release_handle();
    }
}

impl Held {
    /// Runs `f` on the engine that drives this request: the one the handle
    /// holds, else its core's, upgraded for the call. `None` once the
    /// engine is gone (its device was dropped): nothing will drive the
    /// request any more.
    #[inline]
    fn with_engine<R>(&self, f: impl FnOnce(&dyn Progress) -> R) -> Option<R> {
        match &self.engine {
            Some(e) => Some(f(&**e)),
            None => self.core.bound_engine().map(|e| f(&*e)),
        }
    }

    /// Makes sure the handle holds its engine (upgrading the core's weak
    /// reference if it does not yet); false if the engine is gone.
    #[inline]
    fn hold_engine(&mut self) -> bool {
        if self.engine.is_none() {
            self.engine = self.core.bound_engine();
        }
        self.engine.is_some()
    }

    /// [`Request::wait`] for a request not done yet: the engine waits for
    /// it (upgraded from the core's weak reference if the handle does not
    /// hold it), or, once the engine is gone, [`orphaned`](Self::orphaned).
    /// Out of line, so that `wait` stays small enough to inline where a
    /// request is done when waited for (a completion returned by a call
    /// is written through memory and read back wide: a stalled load).
    #[inline(never)]
    fn wait_for_engine(mut self) -> Completion {
        self.hold_engine();
        match &self.engine {
            None => return self.orphaned(),
            Some(engine) => {
                engine.wait(&self.core);
                // The buffer comes back only once the request is done, even
                // if the engine's wait returned early.
                while !self.core.is_done() {
                    engine.progress();
                    crate::sync::yield_now();
                }
            }
        }
        self.consume()
    }

    /// The completion of a request whose engine is gone (its device was
    /// dropped) before the request completed: `Error::Closed`, with an
    /// empty buffer. The request's own buffer stays in its core, whoever
    /// may still use it (a peer's copy, say), and is freed with the core.
    #[cold]
    #[inline(never)]
    fn orphaned(self) -> Completion {
        if self.core.is_done() {
            return self.consume();
        }
        drop(self);
        Completion::closed()
    }

    /// Takes the completion of a done core and lets the handle go (the core
    /// to this thread's stash if nobody else holds it, see
    /// [`pool::recycle`]).
    fn consume(self) -> Completion {
        // Released first: after that, `peek` no longer starts reading the
        // status we take, and the pool cannot reuse the core while we hold
        // it.
        let (core, engine, reported) = self.release();
        let completion = core.take();
        drop(engine);
        if reported {
            // `peek` may still be reading the status, under the pool's
            // lock: the core goes back by the count (a sweep, under that
            // lock), not to this thread's stash and a new request at once.
            drop(core);
        } else {
            pool::recycle(core);
        }
        completion
    }

    /// Releases the handle and gives up the core and its engine (`None` if
    /// the engine is gone), without `Held`'s own drop (which would only
    /// release the handle again).
    fn into_parts(self) -> (CoreRef, Option<Arc<dyn Progress>>) {
        let (core, engine, _) = self.release();
        let engine = engine.or_else(|| core.bound_engine());
        (core, engine)
    }

    /// [`into_parts`](Held::into_parts) (the engine only if the handle had
    /// it), and whether `peek` had reported the request (see
    /// [`RequestCore::release_handle`]).
    #[inline]
    fn release(self) -> (CoreRef, Option<Arc<dyn Progress>>, bool) {
        let reported = self.core.release_handle();
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `this` is never used or dropped again; each field is read
        // out exactly once.
        let (core, engine) = unsafe { (std::ptr::read(&this.core), std::ptr::read(&this.engine)) };
        (core, engine, reported)
    }
}

/// The caller's share of a request that [`Tracker::start_request`] just
/// started, before it becomes the [`Request`] handed to the caller
/// ([`into_request`](Handle::into_request)). Four words where a `Request`
/// is eleven: a device moves this through its posting path and makes the
/// `Request` where it returns it, so the large value is written once, in
/// place, instead of being copied at every return. Dropping it is dropping
/// the request (the handle is released; the device keeps the core).
#[must_use = "a started request must reach its caller"]
pub struct Handle(Held);

impl Handle {
    /// The request handed to the caller.
    #[inline]
    pub fn into_request(self) -> Request {
        Request {
            inner: Inner::InFlight(self.0),
        }
    }
}

impl fmt::Debug for Handle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Handle").field(&self.0.core.id()).finish()
    }
}

impl Request {
    /// Wraps a core created by [`Tracker::start`] (or
    /// [`Tracker::start_relay`]), with the engine that progresses, waits
    /// for and cancels it.
    ///
    /// # Panics
    /// If the core already has a handle: a request has exactly one.
    pub fn new(core: CoreRef, engine: Arc<dyn Progress>) -> Self {
        // Relaxed: only the uniqueness of the handle is decided here; the
        // core's contents are published by `done`.
        let first = core
            .handle
            .compare_exchange(NO_HANDLE, LIVE, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok();
        assert!(first, "a request core has exactly one handle");
        Request {
            inner: Inner::InFlight(Held {
                core,
                engine: Some(engine),
            }),
        }
    }

    /// The request id (as reported by `peek`).
    #[inline]
    pub fn id(&self) -> RequestId {
        match &self.inner {
            Inner::Done { id, .. } => *id,
            Inner::InFlight(h) => h.core.id(),
        }
    }

    /// Whether the request was born complete: its operation ended inside
    /// the call that started it. `peek` reports only requests that were
    /// not.
    pub fn was_born_complete(&self) -> bool {
        matches!(self.inner, Inner::Done { .. })
    }

    /// Drives progress once and says whether the operation has completed,
    /// or can no longer complete (its device was dropped first: `wait` then
    /// returns `Error::Closed` at once). A request not done yet upgrades its
    /// engine's weak reference for each call (two locked instructions);
    /// [`test`](Request::test) keeps it after the first.
    #[inline]
    pub fn is_complete(&self) -> bool {
        match &self.inner {
            Inner::Done { .. } => true,
            Inner::InFlight(h) => {
                if !h.core.is_done() && h.with_engine(|e| e.progress()).is_none() {
                    // Nothing drives it any more: `wait` ends it at once
                    // (`Held::orphaned`).
                    return true;
                }
                h.core.is_done()
            }
        }
    }

    /// The completion if the operation has completed, else the request back.
    #[inline]
    pub fn test(mut self) -> Result<Completion, Request> {
        if let Inner::InFlight(h) = &mut self.inner {
            // Held from now on, so that a loop of tests upgrades once.
            if !h.core.is_done() && !h.hold_engine() {
                return Ok(self.wait());
            }
        }
        if self.is_complete() {
            Ok(self.wait())
        } else {
            Err(self)
        }
    }

    /// The completion if the operation has already completed, else the
    /// request back; unlike [`test`](Request::test), drives no progress
    /// (for a layered device that just started this request below).
    pub fn take_if_done(self) -> Result<Completion, Request> {
        let done = match &self.inner {
            Inner::Done { .. } => true,
            Inner::InFlight(h) => h.core.is_done(),
        };
        if done {
            Ok(self.consume())
        } else {
            Err(self)
        }
    }

    /// Blocks until completion (spinning, then sleeping) and returns the
    /// buffer and status.
    #[inline]
    pub fn wait(self) -> Completion {
        // Matched here, not through `split`: the completion of a request
        // born complete is then built once, in the caller's slot.
        match self.inner {
            Inner::Done { buf, status, .. } => Completion { buf, status },
            Inner::InFlight(h) => {
                if h.core.is_done() {
                    h.consume()
                } else {
                    h.wait_for_engine()
                }
            }
        }
    }

    /// Waits for every request of `reqs`, which is left empty with its
    /// allocation kept, and appends their completions to `out` in the order
    /// of the requests (`MPI_Waitall`): every buffer comes back, those of
    /// failed operations too. The requests are waited for in order; the
    /// progress made for one completes the later ones it reaches as well.
    pub fn wait_all(reqs: &mut Vec<Request>, out: &mut Vec<Completion>) {
        out.reserve(reqs.len());
        out.extend(reqs.drain(..).map(Request::wait));
    }

    /// Waits for the operation and returns its buffer and status, or the
    /// error that ended it together with the buffer (so nothing is lost:
    /// a truncated receive's first bytes are in it; boxed, so that the
    /// successful result stays small).
    #[inline]
    pub fn wait_ok(self) -> Result<(Buffer, Status), Box<Failed>> {
        let Completion { buf, mut status } = self.wait();
        match status.error.take() {
            None => Ok((buf, status)),
            Some(error) => Err(Box::new(Failed {
                buf,
                status,
                error: *error,
            })),
        }
    }

    /// Cancels an unmatched receive. Returns true if it was cancelled; the
    /// request then completes at once with `status.cancelled` set. Sends and
    /// matched receives are not cancelled.
    pub fn cancel(&self) -> bool {
        match &self.inner {
            Inner::Done { .. } => false,
            Inner::InFlight(h) => {
                !h.core.is_done() && h.with_engine(|e| e.cancel(&h.core)) == Some(true)
            }
        }
    }

    /// Takes the request apart (for [`RequestCore::relay`]): the completion
    /// of a request born complete, or (`Err`) the core and the engine that
    /// progresses, waits for and cancels it (`None` if it is gone). The
    /// request is no longer reported by its device's `peek`.
    fn into_parts(self) -> Result<Completion, (CoreRef, Option<Arc<dyn Progress>>)> {
        self.split().map_err(Held::into_parts)
    }

    #[inline]
    fn consume(self) -> Completion {
        self.split().unwrap_or_else(Held::consume)
    }

    /// The completion of a request born complete, or the handle's share of
    /// one in flight.
    #[inline(always)]
    fn split(self) -> Result<Completion, Held> {
        match self.inner {
            Inner::Done { buf, status, .. } => Ok(Completion { buf, status }),
            Inner::InFlight(h) => Err(h),
        }
    }
}

/// A request that ended with an error: the error, the status (with its
/// `error` taken out) and the buffer, given back whatever happened.
#[derive(Debug)]
pub struct Failed {
    /// The buffer given to the operation (a truncated receive's first
    /// bytes are in it).
    pub buf: Buffer,
    /// The status, its `error` moved to [`error`](Failed::error).
    pub status: Status,
    /// What ended the operation.
    pub error: crate::Error,
}

impl From<Failed> for crate::Error {
    fn from(f: Failed) -> Self {
        f.error
    }
}

impl From<Box<Failed>> for crate::Error {
    fn from(f: Box<Failed>) -> Self {
        f.error
    }
}

impl fmt::Display for Failed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for Failed {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl fmt::Debug for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.inner {
            Inner::Done { id, buf, status } => f
                .debug_struct("Request")
                .field("id", id)
                .field("len", &buf.len())
                .field("status", status)
                .finish(),
            Inner::InFlight(h) => h.core.fmt(f),
        }
    }
}

/// What `peek` returns: which request completed, and how.
#[derive(Clone, Debug)]
pub struct Peeked {
    /// The completed request.
    pub id: RequestId,
    /// Its status (the handle still returns buffer and status on `wait`).
    pub status: Status,
}

#[cfg(test)]
mod tests;
