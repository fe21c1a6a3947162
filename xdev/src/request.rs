//! Non-blocking requests: the in-flight state a device owns, the handle user
//! code holds, and the [`Tracker`] that counts outstanding requests and queues
//! completions for [`Device::peek`](crate::Device::peek).
//!
//! Ownership rule: the buffer of a non-blocking operation moves into a
//! [`RequestCore`] shared (through `Arc`) by the device and the [`Request`]
//! handle. Safe code can reach the buffer again only through a completed
//! request. Dropping a handle early leaves the core with the device until the
//! operation ends; `mem::forget` of a handle leaks the core, so the memory the
//! device may still touch is never freed under it.
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

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

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

#[derive(Default)]
struct Slot {
    buf: Option<Buffer>,
    status: Option<Status>,
    /// Set by [`RequestCore::on_complete`]: receives the completion instead
    /// of a handle.
    hook: Option<CompletionHook>,
}

impl Slot {
    /// The buffer, or an empty one if it was already taken.
    fn take_buf(&mut self) -> Buffer {
        self.buf.take().unwrap_or_else(|| Buffer::from(Vec::new()))
    }
}

/// The device-side state of one non-blocking operation: it owns the buffer
/// until completion.
pub struct RequestCore {
    id: RequestId,
    kind: RequestKind,
    /// The [`Tracker`] that started this request: the only one that may
    /// complete it.
    tracker: u64,
    ptr: *mut u8,
    len: usize,
    done: AtomicBool,
    completing: AtomicBool,
    /// True while a handle exists that has not consumed the completion; only
    /// such requests are reported by `peek`.
    peekable: AtomicBool,
    /// A device-private cookie (for example a posted-receive id for cancel).
    token: AtomicU64,
    slot: Mutex<Slot>,
    /// The request of the device below that carries this one, once a
    /// layered device relayed it (see [`RequestCore::relay`]).
    below: OnceLock<(Arc<RequestCore>, Arc<dyn Progress>)>,
}

// SAFETY: `ptr` points into the Buffer owned by `slot`; it is only an address.
// Devices write through it only under the contract of `buffer_ptr`.
unsafe impl Send for RequestCore {}
// SAFETY: all shared mutable state is atomic or behind the Mutex.
unsafe impl Sync for RequestCore {}

impl RequestCore {
    fn new(tracker: u64, id: RequestId, kind: RequestKind, buf: Option<Buffer>) -> Self {
        let mut buf = buf;
        let (ptr, len) = match &mut buf {
            Some(b) => (b.as_mut_ptr(), b.len()),
            None => (std::ptr::null_mut(), 0),
        };
        RequestCore {
            id,
            kind,
            tracker,
            ptr,
            len,
            done: AtomicBool::new(false),
            completing: AtomicBool::new(false),
            peekable: AtomicBool::new(true),
            token: AtomicU64::new(u64::MAX),
            below: OnceLock::new(),
            slot: Mutex::new(Slot {
                buf,
                status: None,
                hook: None,
            }),
        }
    }

    /// The request's id.
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// Send or receive.
    pub fn kind(&self) -> RequestKind {
        self.kind
    }

    /// Start of the owned buffer. The address stays valid while the core is
    /// alive and incomplete.
    ///
    /// Devices may read through it (sends) or write through it (receives)
    /// only before completing the request, and only one party may write at a
    /// time; that is the device's protocol to guarantee.
    pub fn buffer_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Length of the owned buffer.
    pub fn buffer_len(&self) -> usize {
        self.len
    }

    /// Whether the operation has completed.
    pub fn is_done(&self) -> bool {
        // Acquire pairs with the Release in `finish`, so the status and the
        // data written before completion are visible.
        self.done.load(Ordering::Acquire)
    }

    /// Device cookie (`u64::MAX` when unset).
    pub fn token(&self) -> u64 {
        self.token.load(Ordering::Relaxed)
    }

    /// Sets the device cookie.
    pub fn set_token(&self, t: u64) {
        self.token.store(t, Ordering::Relaxed)
    }

    fn lock(&self) -> MutexGuard<'_, Slot> {
        // A poisoned slot only means a panic elsewhere; its data stays sound.
        self.slot.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Claims the right to complete; false if already claimed.
    fn claim(&self) -> bool {
        !self.completing.swap(true, Ordering::AcqRel)
    }

    fn finish(&self, status: Status) {
        let mut slot = self.lock();
        match slot.hook.take() {
            Some(hook) => {
                let buf = slot.take_buf();
                drop(slot);
                // The hook runs before `done` is set, so whoever sees this
                // request done also sees the relaying request done.
                run_hook(hook, Completion { buf, status });
            }
            None => {
                slot.status = Some(status);
                drop(slot);
            }
        }
        // Release: publishes the status and all data the device wrote.
        self.done.store(true, Ordering::Release);
    }

    /// Hands the completion (buffer and status) to `hook` instead of to a
    /// handle: at once if the request has completed, else when it does.
    fn on_complete(&self, hook: CompletionHook) {
        let mut slot = self.lock();
        match slot.status.take() {
            Some(status) => {
                let buf = slot.take_buf();
                drop(slot);
                run_hook(hook, Completion { buf, status });
            }
            None => slot.hook = Some(hook),
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
    /// second call only sets the hook of its `below`.
    pub fn relay(&self, below: Request, hook: CompletionHook) {
        let (core, engine) = below.into_parts();
        let _ = self.below.set((core.clone(), engine));
        core.on_complete(hook);
    }

    /// The request this one was relayed to, with the engine that waits for
    /// and cancels it.
    pub fn relayed_to(&self) -> Option<&(Arc<RequestCore>, Arc<dyn Progress>)> {
        self.below.get()
    }

    /// Takes the completion of a done request. A request whose completion
    /// went to a hook has none left: it reports an empty buffer and an error.
    fn take(&self) -> Completion {
        debug_assert!(self.is_done());
        let mut s = self.lock();
        let status = s.status.take().unwrap_or_else(|| {
            let env = crate::Envelope {
                source: usize::MAX,
                tag: -1,
                context: 0,
            };
            Status::failed(env, crate::Error::Closed)
        });
        Completion {
            buf: s.take_buf(),
            status,
        }
    }
}

/// Runs a completion hook; a panic in it aborts the process (see
/// [`RequestCore::relay`]).
fn run_hook(hook: CompletionHook, completion: Completion) {
    struct AbortOnUnwind;
    impl Drop for AbortOnUnwind {
        fn drop(&mut self) {
            eprintln!("xdev: a request completion hook panicked; aborting");
            std::process::abort();
        }
    }
    let guard = AbortOnUnwind;
    hook(completion);
    std::mem::forget(guard);
}

impl fmt::Debug for RequestCore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RequestCore")
            .field("id", &self.id)
            .field("kind", &self.kind)
            .field("len", &self.len)
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

impl Completion {
    /// The buffer and status on success, the error otherwise (the buffer is
    /// dropped: keep the `Completion` when it must be reused on error).
    pub fn into_result(self) -> crate::Result<(Buffer, Status)> {
        match self.status.error {
            Some(e) => Err(e),
            None => Ok((self.buf, self.status)),
        }
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
    fn cancel(&self, core: &Arc<RequestCore>) -> bool;
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
/// # use xdev::{Buffer, Progress, Request, RequestCore, RequestKind, Tracker};
/// # struct Inert;
/// # impl Progress for Inert {
/// #     fn progress(&self) {}
/// #     fn wait(&self, _: &RequestCore) {}
/// #     fn cancel(&self, _: &Arc<RequestCore>) -> bool { false }
/// # }
/// let t = Tracker::new();
/// let req = Request::new(t.start(RequestKind::Recv, Buffer::zeroed(64)), Arc::new(Inert));
/// let (core, _engine) = req.into_parts(); // private to xdev
/// ```
///
/// ```compile_fail,E0599
/// # use xdev::{Buffer, RequestKind, Tracker};
/// let t = Tracker::new();
/// let core = t.start(RequestKind::Recv, Buffer::zeroed(64));
/// let buf = core.lend_buffer(); // no such method: relaying starts without a buffer
/// ```
#[must_use = "a request must be waited or tested to get its buffer back"]
pub struct Request {
    core: Arc<RequestCore>,
    engine: Arc<dyn Progress>,
}

impl Request {
    /// Wraps a core created by [`Tracker::start`].
    pub fn new(core: Arc<RequestCore>, engine: Arc<dyn Progress>) -> Self {
        Request { core, engine }
    }

    /// The request id (as reported by `peek`).
    pub fn id(&self) -> RequestId {
        self.core.id
    }

    /// Drives progress once and says whether the operation has completed.
    pub fn is_complete(&self) -> bool {
        if !self.core.is_done() {
            self.engine.progress();
        }
        self.core.is_done()
    }

    /// The completion if the operation has completed, else the request back.
    pub fn test(self) -> Result<Completion, Request> {
        if self.is_complete() {
            Ok(self.consume())
        } else {
            Err(self)
        }
    }

    /// Blocks until completion (spinning, then sleeping) and returns the
    /// buffer and status.
    pub fn wait(self) -> Completion {
        if !self.core.is_done() {
            self.engine.wait(&self.core);
        }
        // The buffer comes back only once the request is done, even if the
        // engine's wait returned early.
        while !self.core.is_done() {
            self.engine.progress();
            std::thread::yield_now();
        }
        self.consume()
    }

    /// Cancels an unmatched receive. Returns true if it was cancelled; the
    /// request then completes at once with `status.cancelled` set. Sends and
    /// matched receives are not cancelled.
    pub fn cancel(&self) -> bool {
        !self.core.is_done() && self.engine.cancel(&self.core)
    }

    /// Takes the request apart (for [`RequestCore::relay`]): the core and
    /// the engine that progresses, waits for and cancels it. The request is
    /// no longer reported by its device's `peek`.
    pub(crate) fn into_parts(self) -> (Arc<RequestCore>, Arc<dyn Progress>) {
        self.core.peekable.store(false, Ordering::Relaxed);
        (self.core.clone(), self.engine.clone())
    }

    fn consume(self) -> Completion {
        self.core.peekable.store(false, Ordering::Relaxed);
        self.core.take()
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        self.core.peekable.store(false, Ordering::Relaxed);
    }
}

impl fmt::Debug for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.core.fmt(f)
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

/// Per-device bookkeeping of requests: ids, outstanding counts, and the queue
/// of completions `peek` reports. Devices create every request core through
/// it and complete them through it.
///
/// The completion queue holds only requests whose handles are alive and
/// unconsumed, plus garbage that is compacted away whenever the queue doubles,
/// so its memory is proportional to the handles user code holds.
pub struct Tracker {
    /// This tracker's identity, recorded in every core it starts.
    id: u64,
    next_id: AtomicU64,
    outstanding: AtomicUsize,
    outstanding_sends: AtomicUsize,
    completed: Mutex<CompletedQueue>,
}

struct CompletedQueue {
    queue: VecDeque<Arc<RequestCore>>,
    compact_at: usize,
}

impl Default for Tracker {
    fn default() -> Self {
        static TRACKERS: AtomicU64 = AtomicU64::new(1);
        Tracker {
            id: TRACKERS.fetch_add(1, Ordering::Relaxed),
            next_id: AtomicU64::new(1),
            outstanding: AtomicUsize::new(0),
            outstanding_sends: AtomicUsize::new(0),
            completed: Mutex::new(CompletedQueue {
                queue: VecDeque::new(),
                compact_at: 64,
            }),
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
    pub fn start(&self, kind: RequestKind, buf: Buffer) -> Arc<RequestCore> {
        self.start_core(kind, Some(buf))
    }

    /// Starts a request that holds no buffer yet, for a device layered over
    /// others: the buffer goes to a request on the device below, and comes
    /// back with [`complete_returning`](Tracker::complete_returning) (see
    /// [`RequestCore::relay`]). Its [`buffer_ptr`](RequestCore::buffer_ptr)
    /// is null and its length 0.
    pub fn start_relay(&self, kind: RequestKind) -> Arc<RequestCore> {
        self.start_core(kind, None)
    }

    fn start_core(&self, kind: RequestKind, buf: Option<Buffer>) -> Arc<RequestCore> {
        let id = RequestId(self.next_id.fetch_add(1, Ordering::Relaxed));
        self.outstanding.fetch_add(1, Ordering::Relaxed);
        if kind == RequestKind::Send {
            self.outstanding_sends.fetch_add(1, Ordering::Relaxed);
        }
        Arc::new(RequestCore::new(self.id, id, kind, buf))
    }

    /// Whether `core` was started by this tracker.
    pub fn started(&self, core: &RequestCore) -> bool {
        core.tracker == self.id
    }

    /// Completes `core` with `status` unless it was already completed, or
    /// was started by another tracker (which this one refuses); returns
    /// whether this call completed it. After it returns true the device must
    /// not touch the buffer again.
    pub fn complete(&self, core: &Arc<RequestCore>, status: Status) -> bool {
        if !self.started(core) || !core.claim() {
            return false;
        }
        self.finish_claimed(core, status);
        true
    }

    fn finish_claimed(&self, core: &Arc<RequestCore>, status: Status) {
        core.finish(status);
        if core.kind == RequestKind::Send {
            self.outstanding_sends.fetch_sub(1, Ordering::Release);
        }
        self.outstanding.fetch_sub(1, Ordering::Release);
        if core.peekable.load(Ordering::Relaxed) {
            let mut q = self.completed.lock().unwrap_or_else(|p| p.into_inner());
            q.queue.push_back(core.clone());
            if q.queue.len() >= q.compact_at {
                q.queue.retain(|c| c.peekable.load(Ordering::Relaxed));
                q.compact_at = (q.queue.len() * 2).max(64);
            }
        }
    }

    /// Completes `core`, a request started by
    /// [`start_relay`](Tracker::start_relay), with `buf` as its buffer; as
    /// [`complete`](Tracker::complete) otherwise. A request that already
    /// holds a buffer is refused (its buffer may be in use).
    pub fn complete_returning(&self, core: &Arc<RequestCore>, buf: Buffer, status: Status) -> bool {
        if !self.started(core) || !core.ptr.is_null() || !core.claim() {
            return false;
        }
        core.lock().buf = Some(buf);
        self.finish_claimed(core, status);
        true
    }

    /// Starts and at once completes a request (for operations rejected before
    /// they start, such as an invalid rank): the buffer comes back through the
    /// handle as usual.
    pub fn rejected(&self, kind: RequestKind, buf: Buffer, status: Status) -> Arc<RequestCore> {
        let core = self.start(kind, buf);
        self.complete(&core, status);
        core
    }

    /// Pops the oldest completion whose handle is still unconsumed.
    pub fn pop_completed(&self) -> Option<Peeked> {
        let mut q = self.completed.lock().unwrap_or_else(|p| p.into_inner());
        while let Some(core) = q.queue.pop_front() {
            if core.peekable.swap(false, Ordering::Relaxed) {
                let status = core.lock().status.clone()?;
                return Some(Peeked {
                    id: core.id,
                    status,
                });
            }
        }
        None
    }

    /// Requests started and not yet completed.
    pub fn outstanding(&self) -> usize {
        self.outstanding.load(Ordering::Acquire)
    }

    /// Send requests started and not yet completed.
    pub fn outstanding_sends(&self) -> usize {
        self.outstanding_sends.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Envelope;

    struct Inert;
    impl Progress for Inert {
        fn progress(&self) {}
        fn wait(&self, core: &RequestCore) {
            while !core.is_done() {
                std::thread::yield_now();
            }
        }
        fn cancel(&self, _: &Arc<RequestCore>) -> bool {
            false
        }
    }

    fn env() -> Envelope {
        Envelope {
            source: 1,
            tag: 2,
            context: 3,
        }
    }

    #[test]
    fn completion_returns_buffer_and_counts() {
        let t = Tracker::new();
        let core = t.start(RequestKind::Send, Buffer::from(vec![5u8; 4]));
        assert_eq!((t.outstanding(), t.outstanding_sends()), (1, 1));
        let req = Request::new(core.clone(), Arc::new(Inert));
        let req = req.test().expect_err("not complete yet");
        assert!(t.complete(&core, Status::ok(env(), 4)));
        assert!(
            !t.complete(&core, Status::ok(env(), 0)),
            "second completion refused"
        );
        assert_eq!((t.outstanding(), t.outstanding_sends()), (0, 0));
        let c = req.wait();
        assert_eq!(&c.buf[..], &[5, 5, 5, 5]);
        assert_eq!(c.status.count, 4);
        // Consumed by wait: peek no longer reports it.
        assert!(t.pop_completed().is_none());
    }

    #[test]
    fn peek_reports_live_handles_once() {
        let t = Tracker::new();
        let a = Request::new(
            t.start(RequestKind::Recv, Buffer::zeroed(1)),
            Arc::new(Inert),
        );
        let b_core = t.start(RequestKind::Recv, Buffer::zeroed(1));
        drop(Request::new(b_core.clone(), Arc::new(Inert)));
        t.complete(&b_core, Status::ok(env(), 1));
        assert!(
            t.pop_completed().is_none(),
            "dropped handle is not peekable"
        );
        let a_core = a.core.clone();
        t.complete(&a_core, Status::ok(env(), 1));
        assert_eq!(t.pop_completed().map(|p| p.id), Some(a.id()));
        assert!(t.pop_completed().is_none(), "reported once");
        assert_eq!(a.wait().status.count, 1);
    }

    #[test]
    fn forgotten_handle_keeps_memory_alive() {
        let t = Tracker::new();
        let core = t.start(RequestKind::Recv, Buffer::zeroed(8));
        std::mem::forget(Request::new(core.clone(), Arc::new(Inert)));
        // The device can still write: the core (and buffer) is alive.
        // SAFETY: the core owns an 8-byte buffer and nobody else writes it.
        unsafe { core.buffer_ptr().write_bytes(1, 8) };
        assert!(t.complete(&core, Status::ok(env(), 8)));
    }

    #[test]
    fn relayed_request_returns_buffer_through_the_outer_one() {
        let outer_t = Arc::new(Tracker::new());
        let inner_t = Tracker::new();
        let outer = outer_t.start_relay(RequestKind::Recv);
        assert!(outer.buffer_ptr().is_null());
        let handle = Request::new(outer.clone(), Arc::new(Inert));
        let inner_core = inner_t.start(RequestKind::Recv, Buffer::from(vec![0u8; 4]));
        let inner = Request::new(inner_core.clone(), Arc::new(Inert));
        let (t, o) = (outer_t.clone(), outer.clone());
        outer.relay(
            inner,
            Box::new(move |c: Completion| {
                let mut st = c.status;
                st.source = 7;
                t.complete_returning(&o, c.buf, st);
            }),
        );
        assert!(Arc::ptr_eq(
            &outer.relayed_to().expect("relayed").0,
            &inner_core
        ));
        assert!(!outer.is_done());
        // SAFETY: the inner core owns the 4-byte buffer; nothing else writes it.
        unsafe { inner_core.buffer_ptr().write_bytes(9, 4) };
        assert!(inner_t.complete(&inner_core, Status::ok(env(), 4)));
        assert!(
            outer.is_done(),
            "the hook ran before the inner request was done"
        );
        assert!(inner_t.pop_completed().is_none(), "inner is not peekable");
        assert_eq!(outer_t.pop_completed().map(|p| p.id), Some(handle.id()));
        let c = handle.wait();
        assert_eq!((&c.buf[..], c.status.source), (&[9u8; 4][..], 7));
        assert_eq!(outer_t.outstanding(), 0);
    }

    #[test]
    fn hook_on_a_completed_request_runs_at_once() {
        let t = Tracker::new();
        let core = t.start(RequestKind::Send, Buffer::from(vec![3u8; 2]));
        t.complete(&core, Status::ok(env(), 2));
        let got = Arc::new(Mutex::new(None));
        let g = got.clone();
        core.on_complete(Box::new(move |c| *g.lock().unwrap() = Some(c)));
        let c = got.lock().unwrap().take().expect("hook ran");
        assert_eq!((&c.buf[..], c.status.count), (&[3u8, 3][..], 2));
    }

    #[test]
    fn a_tracker_refuses_requests_it_did_not_start() {
        // The review's reproduction: another tracker completing a device's
        // request would hand its buffer out while the device writes it.
        let device = Tracker::new();
        let core = device.start(RequestKind::Recv, Buffer::zeroed(64));
        let stranger = Tracker::new();
        assert!(!stranger.started(&core));
        assert!(!stranger.complete(&core, Status::ok(env(), 0)));
        assert!(!stranger.complete_returning(&core, Buffer::zeroed(1), Status::ok(env(), 0)));
        assert!(
            !core.is_done(),
            "a refused completion leaves the request alone"
        );
        assert!(device.complete(&core, Status::ok(env(), 64)));
    }

    #[test]
    fn complete_returning_refuses_a_request_that_owns_a_buffer() {
        let t = Tracker::new();
        let core = t.start(RequestKind::Recv, Buffer::zeroed(8));
        assert!(!t.complete_returning(&core, Buffer::zeroed(8), Status::ok(env(), 0)));
        assert!(!core.is_done());
        assert!(t.complete(&core, Status::ok(env(), 8)));
    }

    /// A `Progress` whose `wait` returns at once, done or not.
    struct Liar;
    impl Progress for Liar {
        fn progress(&self) {}
        fn wait(&self, _: &RequestCore) {}
        fn cancel(&self, _: &Arc<RequestCore>) -> bool {
            false
        }
    }

    #[test]
    fn wait_returns_the_buffer_only_once_done_whatever_the_engine_says() {
        let t = Arc::new(Tracker::new());
        let core = t.start(RequestKind::Recv, Buffer::zeroed(16));
        let handle = Request::new(core.clone(), Arc::new(Liar));
        let (t2, c2) = (t.clone(), core.clone());
        let completer = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            // SAFETY: the request is incomplete, so it still owns its
            // 16-byte buffer, and only this thread writes it.
            unsafe { c2.buffer_ptr().write_bytes(5, 16) };
            t2.complete(&c2, Status::ok(env(), 16));
        });
        let c = handle.wait();
        assert!(core.is_done());
        assert_eq!(&c.buf[..], &[5u8; 16][..]);
        completer.join().unwrap();
    }

    #[test]
    fn completed_queue_is_compacted() {
        let t = Tracker::new();
        for _ in 0..10_000 {
            let core = t.start(RequestKind::Send, Buffer::zeroed(0));
            let r = Request::new(core.clone(), Arc::new(Inert));
            t.complete(&core, Status::ok(env(), 0));
            drop(r.wait());
        }
        assert!(t.completed.lock().unwrap().queue.len() <= 64);
    }
}
