//! The handle user code holds: [`Request`] (a request born complete, or
//! the handle's share of one in flight, [`Held`]), the small [`Handle`] a
//! device moves through its posting path, and [`Failed`].

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use std::ptr::NonNull;

use super::carry::Owned;
use super::pool::{self, CoreRef};
use super::{Completion, Progress, RequestId, LIVE, NO_HANDLE};
use crate::{Buffer, Status};

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
    /// An [`Inner`] as two scalar words (see [`Request::from_inner`]): a
    /// struct of two scalars comes back from a call in two registers, where
    /// an enum of the same two words comes back through memory (rustc's
    /// Rust ABI on x86_64: a caller's 16-byte reload of it stalled as the
    /// 72-byte request's did). Non-null: the address of the buffer the
    /// handle holds ([`Inner::Own`]); null: a request in flight.
    addr: *mut u8,
    /// The buffer's tail ([`Inner::Own`]), or the core
    /// ([`Inner::InFlight`]).
    ptr: NonNull<()>,
}

// SAFETY: a `Request` is an `Inner` in two words: a `Buffer` (Send + Sync,
// its carry's lender pointer included) or a `CoreRef` (Send + Sync).
unsafe impl Send for Request {}
// SAFETY: as above; through `&Request` only a view of the `Inner` is
// reached, for its `&self` methods.
unsafe impl Sync for Request {}

impl Drop for Request {
    #[inline]
    fn drop(&mut self) {
        // SAFETY: the words are an `Inner` this request owns, taken back
        // once, here.
        drop(unsafe { self.decode() });
    }
}

/// The shapes of a request, each two words at most, so that a `Request`
/// comes back from a device's call in two registers (see `carry.rs`).
pub(super) enum Inner {
    /// The handle holds the buffer: the operation ended inside the call
    /// that started it (its status in the buffer's carry: no pooled core,
    /// no reference count, no engine; `peek` does not report it), or it is
    /// lent to a device that keeps the operation in its own table
    /// ([`Lender`](super::Lender)), its lease in the carry.
    Own(Owned),
    /// The device owns the buffer until the core completes.
    InFlight(Held),
}

/// The handle's share of a request in flight: its core. Dropping it
/// releases the handle (so `peek` no longer reports the request); the core
/// stays with the device until the operation ends.
///
/// The engine that progresses, waits for and cancels the request is the
/// one the handle keeps in its core ([`RequestCore::handle_engine`]), else
/// the one a request started by
/// [`Tracker::start_request`](super::Tracker::start_request) finds through
/// its core's weak reference, upgraded only when the handle must drive the
/// engine (a wait or a test that finds it not done, a cancel): a request
/// that is done by the time its handle looks (the common case in a window
/// of requests, which one progress round completes together) never counts
/// a reference to the engine, where a counted one cost two locked
/// instructions per request (profiled on psm's receive: the increment was
/// 30% of its start, the decrement 35% of its consume). `wait` and `test`
/// keep what they upgraded in the core, so a loop of tests upgrades once.
///
/// [`RequestCore::handle_engine`]: super::RequestCore
pub(super) struct Held {
    pub(super) core: CoreRef,
}

impl Drop for Held {
    #[inline]
    fn drop(&mut self) {
        // SAFETY: we are the core's one handle, and being dropped.
        let engine = unsafe { self.core.take_handle_engine() };
        self.core.release_handle();
        drop(engine);
    }
}

impl Held {
    /// The engine the handle keeps in its core, if it keeps one.
    #[inline]
    fn kept_engine(&self) -> Option<&Arc<dyn Progress>> {
        // SAFETY: we are the core's one handle; through `&self` the cell is
        // only read (writes take `&mut self` or `self`).
        unsafe { self.core.handle_engine() }
    }

    /// Runs `f` on the engine that drives this request: the one the handle
    /// keeps, else its core's, upgraded for the call. `None` once the
    /// engine is gone (its device was dropped): nothing will drive the
    /// request any more.
    #[inline]
    fn with_engine<R>(&self, f: impl FnOnce(&dyn Progress) -> R) -> Option<R> {
        match self.kept_engine() {
            Some(e) => Some(f(&**e)),
            None => self.core.bound_engine().map(|e| f(&*e)),
        }
    }

    /// Makes sure the handle keeps its engine (upgrading the core's weak
    /// reference if it does not yet); false if the engine is gone. Called
    /// only through an owned request (`Request::test`), so that no other
    /// use of the handle overlaps the write. A handle that keeps its engine
    /// already touches no count: a loop of tests pays nothing here.
    #[inline]
    fn hold_engine(&self) -> bool {
        if self.kept_engine().is_some() {
            return true;
        }
        let Some(e) = self.core.bound_engine() else {
            return false;
        };
        // SAFETY: we are the core's one handle, held exclusively here.
        unsafe { self.core.set_handle_engine(Some(e)) };
        true
    }

    /// [`Request::wait`] for a request not done yet: the engine waits for
    /// it (upgraded from the core's weak reference if the handle does not
    /// keep it), or, once the engine is gone, [`orphaned`](Self::orphaned).
    /// Out of line, so that `wait` stays small enough to inline where a
    /// request is done when waited for (a completion returned by a call
    /// is written through memory and read back wide: a stalled load).
    #[inline(never)]
    fn wait_for_engine(self) -> Completion {
        // The kept engine is used where it is (no count taken); only an
        // upgraded one is held for the wait.
        let upgraded;
        let engine: &dyn Progress = match self.kept_engine() {
            Some(e) => &**e,
            None => match self.core.bound_engine() {
                Some(e) => {
                    upgraded = e;
                    &*upgraded
                }
                None => return self.orphaned(),
            },
        };
        engine.wait(&self.core);
        // The buffer comes back only once the request is done, even if the
        // engine's wait returned early.
        while !self.core.is_done() {
            engine.progress();
            crate::sync::yield_now();
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

    /// The core, with the handle still on it (for a request's words: see
    /// [`Request::from_inner`]), without `Held`'s drop.
    #[inline(always)]
    fn into_core(self) -> CoreRef {
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `this` is never used or dropped again; the core is read
        // out exactly once.
        unsafe { std::ptr::read(&this.core) }
    }

    /// [`into_parts`](Held::into_parts) (the engine only if the handle kept
    /// it), and whether `peek` had reported the request (see
    /// [`RequestCore::release_handle`](super::RequestCore::release_handle)).
    #[inline]
    fn release(self) -> (CoreRef, Option<Arc<dyn Progress>>, bool) {
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: we are the core's one handle, letting go of it.
        let engine = unsafe { this.core.take_handle_engine() };
        let reported = this.core.release_handle();
        // SAFETY: `this` is never used or dropped again; the core is read
        // out exactly once.
        let core = unsafe { std::ptr::read(&this.core) };
        (core, engine, reported)
    }
}

/// The caller's share of a request that
/// [`Tracker::start_request`](super::Tracker::start_request) just
/// started, before it becomes the [`Request`] handed to the caller
/// ([`into_request`](Handle::into_request)): one word, the core. Dropping it is dropping
/// the request (the handle is released; the device keeps the core).
#[must_use = "a started request must reach its caller"]
pub struct Handle(pub(super) Held);

impl Handle {
    /// The request handed to the caller.
    #[inline]
    pub fn into_request(self) -> Request {
        Request::from_inner(Inner::InFlight(self.0))
    }
}

impl fmt::Debug for Handle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Handle").field(&self.0.core.id()).finish()
    }
}

impl Request {
    /// The two words of `inner`.
    #[inline(always)]
    pub(super) fn from_inner(inner: Inner) -> Request {
        match inner {
            Inner::Own(o) => {
                let (addr, tail) = o.into_buffer().into_raw_parts();
                Request {
                    addr: addr.as_ptr(),
                    ptr: tail,
                }
            }
            Inner::InFlight(h) => Request {
                addr: std::ptr::null_mut(),
                ptr: h.into_core().into_raw().cast(),
            },
        }
    }

    /// The `Inner` behind the words, owned.
    ///
    /// # Safety
    /// Taken once: the caller then forgets or drops `self` without its
    /// drop, or only views the result without dropping it.
    #[inline(always)]
    unsafe fn decode(&self) -> Inner {
        match NonNull::new(self.addr) {
            // SAFETY: non-null, the words are a buffer's raw parts
            // (`from_inner`), taken back as the caller's contract says.
            Some(addr) => Inner::Own(Owned::from_buffer(unsafe {
                Buffer::from_raw_parts(addr, self.ptr)
            })),
            None => Inner::InFlight(Held {
                // SAFETY: null, the second word is a core reference's
                // address (`from_inner`), taken back as above.
                core: unsafe { CoreRef::from_raw(self.ptr.cast()) },
            }),
        }
    }

    /// The `Inner` behind the words, owned by the caller now.
    #[inline(always)]
    pub(super) fn into_inner(self) -> Inner {
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: taken once; `this` is never dropped.
        unsafe { this.decode() }
    }

    /// The `Inner` behind the words, to look at: never dropped (the
    /// request still owns it).
    #[inline(always)]
    pub(super) fn view(&self) -> std::mem::ManuallyDrop<Inner> {
        // SAFETY: the result is only viewed (`ManuallyDrop`), and borrows
        // `self`'s lifetime through the caller's use.
        std::mem::ManuallyDrop::new(unsafe { self.decode() })
    }

    /// Wraps a core created by [`Tracker::start`](super::Tracker::start) (or
    /// [`Tracker::start_relay`](super::Tracker::start_relay)), with the
    /// engine that progresses, waits
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
        // SAFETY: the exchange above made us the core's one handle.
        unsafe { core.set_handle_engine(Some(engine)) };
        Request::from_inner(Inner::InFlight(Held { core }))
    }

    /// A request born complete with `status`, its handle holding `buf`.
    #[inline(always)]
    pub(super) fn born(id: RequestId, buf: Buffer, status: Status) -> Self {
        Request::from_inner(Inner::Own(Owned::done(id, buf, status)))
    }

    /// A request lent out by `engine`, which keeps operation `token` (into
    /// or from `buf`) in its own table until the handle ends the lease (see
    /// [`Lender`](super::Lender)). `id` is what `peek` reports it as (from
    /// [`Tracker::lend_id`](super::Tracker::lend_id)).
    ///
    /// # Safety
    /// `engine` stays alive (its device holds a strong reference to it
    /// somewhere) until the call of its `wait_lent`, `drop_lent` or
    /// `hold_lent` for `token` returns: the handle reaches it through an
    /// uncounted pointer. `buf`'s memory may be used by the device until
    /// then; the handle gives it back only from `wait_lent`.
    #[inline]
    pub unsafe fn lent<E: super::Lender>(
        id: RequestId,
        token: u64,
        buf: Buffer,
        engine: &E,
    ) -> Request {
        let engine: &dyn super::Lender = engine;
        // SAFETY: the caller's contract.
        let own = unsafe { Owned::lent(id, token, buf, NonNull::from(engine)) };
        Request::from_inner(Inner::Own(own))
    }

    /// The request id (as reported by `peek`).
    #[inline]
    pub fn id(&self) -> RequestId {
        match &*self.view() {
            Inner::Own(o) => o.id(),
            Inner::InFlight(h) => h.core.id(),
        }
    }

    /// Whether the request was born complete: its operation ended inside
    /// the call that started it. `peek` reports only requests that were
    /// not.
    pub fn was_born_complete(&self) -> bool {
        matches!(&*self.view(), Inner::Own(o) if o.lease().is_none())
    }

    /// Drives progress once and says whether the operation has completed,
    /// or can no longer complete (its device was dropped first: `wait` then
    /// returns `Error::Closed` at once). A request not done yet upgrades its
    /// engine's weak reference for each call (two locked instructions);
    /// [`test`](Request::test) keeps it after the first.
    #[inline]
    pub fn is_complete(&self) -> bool {
        match &*self.view() {
            Inner::Own(o) => o.test(),
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
    pub fn test(self) -> Result<Completion, Request> {
        if let Inner::InFlight(h) = &*self.view() {
            // Kept from now on, so that a loop of tests upgrades once.
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
        let done = match &*self.view() {
            // (A lent one: cannot tell without asking the device, which
            // may progress.)
            Inner::Own(o) => o.lease().is_none(),
            Inner::InFlight(h) => h.core.is_done(),
        };
        if done {
            Ok(self.consume())
        } else {
            Err(self)
        }
    }

    /// The buffer of a request made by [`Request::lent`] whose operation
    /// its engine never started, taken back without ending a lease (there
    /// is none): for an engine that makes the handle before it posts the
    /// operation, so that the handle's fields are written before the
    /// post's own stores and not read back behind them, and whose post
    /// then failed. Any other request is waited for, its buffer returned.
    ///
    /// # Safety
    /// For a lent request: its engine holds nothing for its token, never
    /// had the buffer, and does not expect the lease to end.
    #[inline]
    pub unsafe fn take_back_unposted(self) -> Buffer {
        match self.into_inner() {
            Inner::Own(o) => o.into_buffer(),
            inner => Request::from_inner(inner).wait().buf,
        }
    }

    /// Blocks until completion (spinning, then sleeping) and returns the
    /// buffer and status.
    #[inline]
    pub fn wait(self) -> Completion {
        // Matched here, not through `split`: the completion of a request
        // born complete is then built once, in the caller's slot.
        match self.into_inner() {
            Inner::Own(o) => match o.lease() {
                Some(lease) => o.wait_lent(lease),
                None => o.into_completion(),
            },
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
        match &*self.view() {
            Inner::Own(o) => o.cancel(),
            Inner::InFlight(h) => {
                !h.core.is_done() && h.with_engine(|e| e.cancel(&h.core)) == Some(true)
            }
        }
    }

    /// Takes the request apart (for
    /// [`RequestCore::relay`](super::RequestCore::relay)): the completion
    /// of a request born complete, or (`Err`) the core and the engine that
    /// progresses, waits for and cancels it (`None` if it is gone). The
    /// request is no longer reported by its device's `peek`.
    pub(super) fn into_parts(self) -> Result<Completion, (CoreRef, Option<Arc<dyn Progress>>)> {
        self.split().map_err(Held::into_parts)
    }

    #[inline]
    fn consume(self) -> Completion {
        self.split().unwrap_or_else(Held::consume)
    }

    /// The completion of a request born complete, or the handle's share of
    /// one in flight.
    /// A lent request is first turned into a held one (its device ends the
    /// lease).
    #[inline(always)]
    fn split(self) -> Result<Completion, Held> {
        match self.into_inner() {
            Inner::Own(o) => match o.lease() {
                Some(lease) => o.hold(lease).split(),
                None => Ok(o.into_completion()),
            },
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
        match &*self.view() {
            Inner::Own(o) => o.fmt(f),
            Inner::InFlight(h) => h.core.fmt(f),
        }
    }
}
