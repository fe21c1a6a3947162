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
//! A device that keeps an operation in its own table may instead lend the
//! request out ([`Lender`], `lent.rs`): the handle owns the buffer and
//! gives it back only once the device says the operation left it.
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

mod carry;
mod handle;
mod lent;
mod pool;
mod tracker;

pub(crate) use carry::Carry;
use handle::Held;
pub use handle::{Failed, Handle, Request};
pub use lent::{KeepAlive, Lender};
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
    /// The engine the handle keeps: the one [`Request::new`] was given, or
    /// one the handle upgraded to drive the request (so that a loop of
    /// tests upgrades once). Here, not in the handle, so that the handle
    /// is one word. Touched only by the core's one handle, and empty once
    /// the handle let go (so a reused core starts without one). A plain
    /// `UnsafeCell`, also under loom: only that one party reaches it.
    handle_engine: std::cell::UnsafeCell<Option<Arc<dyn Progress>>>,
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
            handle_engine: std::cell::UnsafeCell::new(None),
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

    /// The engine the handle keeps, if any.
    ///
    /// # Safety
    /// The caller is the core's one handle, and nobody writes the cell
    /// meanwhile (writers hold the handle exclusively).
    #[inline]
    unsafe fn handle_engine(&self) -> Option<&Arc<dyn Progress>> {
        // SAFETY: the caller's contract.
        unsafe { (*self.handle_engine.get()).as_ref() }
    }

    /// Sets the engine the handle keeps (dropping one it kept before).
    ///
    /// # Safety
    /// The caller is the core's one handle and holds it exclusively.
    #[inline]
    unsafe fn set_handle_engine(&self, engine: Option<Arc<dyn Progress>>) {
        // SAFETY: the caller's contract.
        unsafe { *self.handle_engine.get() = engine };
    }

    /// Takes the engine the handle keeps (as the handle lets go).
    ///
    /// # Safety
    /// As [`set_handle_engine`](Self::set_handle_engine).
    #[inline]
    unsafe fn take_handle_engine(&self) -> Option<Arc<dyn Progress>> {
        // SAFETY: the caller's contract.
        let cell = unsafe { &mut *self.handle_engine.get() };
        // Written only when there is one to take: a handle of
        // `Tracker::start_request` keeps none unless a test upgraded it.
        if cell.is_none() {
            return None;
        }
        cell.take()
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
/// leave a completion half done. Always inlined: on a per-message path,
/// a closure called out of line reads what it captured back from memory.
#[inline(always)]
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
    Status::closed(usize::MAX)
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
