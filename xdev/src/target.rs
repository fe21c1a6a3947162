//! Where a matched message goes, shared by the engines of every transport
//! that uses the [`matching`](crate::matching) engine: a non-blocking
//! request's buffer, or the borrowed buffer of a blocking receive that waits
//! for it ([`BlockingRecv`]); the sends that wait for room ([`Pending`]),
//! and who waits for a send in flight ([`SendOwner`], [`BlockingSend`]).
//!
//! These are building blocks for device implementations, not part of the
//! device contract a runtime uses. They carry raw addresses of buffers
//! ([`Target::dst`]) but never dereference them: the engine does, in its own
//! `unsafe` code, under the rules stated on each type.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::{Context, CoreRef, Envelope, Error, Rank, RequestCore, Result, Status, Tag, Tracker};

/// A blocking receive registered with an engine (queued behind other posted
/// receives, or waiting for a pipelined rendezvous): its buffer is borrowed
/// by the waiting call.
///
/// [`Target::dst`] gives the engine that buffer's address. Writing through
/// it is sound only under the engine's obligations: the blocking call does
/// not return (or unwind) while the entry can still be written (it takes the
/// entry out of everything that delivers into it first, for example with a
/// guard whose `Drop` un-posts it), and deliveries into it are serialized
/// (for example under the engine's lock).
pub struct BlockingRecv {
    ptr: *mut u8,
    cap: usize,
    done: AtomicBool,
    status: Mutex<Option<Status>>,
}

// SAFETY: `ptr` is the only field that is not thread-safe, and this type
// never dereferences it: it only hands the address out (`Target::dst`), and
// the engine's writes through it follow the obligations stated on
// BlockingRecv. `done` and `status` are an atomic and a mutex.
unsafe impl Send for BlockingRecv {}
// SAFETY: as above: through a shared reference one can only read the
// address, `done` and (under its mutex) `status`.
unsafe impl Sync for BlockingRecv {}

impl BlockingRecv {
    /// An entry for the caller's `buf` (which must stay borrowed while the
    /// entry is in an engine, see [`BlockingRecv`]).
    pub fn new(buf: &mut [u8]) -> Arc<BlockingRecv> {
        Arc::new(BlockingRecv {
            ptr: buf.as_mut_ptr(),
            cap: buf.len(),
            done: AtomicBool::new(false),
            status: Mutex::new(None),
        })
    }

    /// Whether a message was delivered (or the receive failed).
    #[inline]
    pub fn is_done(&self) -> bool {
        // Acquire pairs with the Release in `Target::complete`.
        self.done.load(Ordering::Acquire)
    }

    /// The outcome, once the entry is out of its engine: `Closed` if it
    /// never completed.
    pub fn outcome(&self) -> Result<Status> {
        let st = self.status.lock().unwrap_or_else(|p| p.into_inner()).take();
        st.map(|s| s.into_result()).unwrap_or(Err(Error::Closed))
    }
}

/// A non-blocking receive its engine lent out
/// ([`Request::lent`](crate::Request::lent)): the handle owns the buffer,
/// and the engine keeps the receive's state in its own table, at `slot`.
/// Such a target is completed by that engine (into its table), never by
/// [`Target::complete`].
///
/// [`Target::dst`] gives the buffer's address, valid for writes under the
/// lender's contract: the handle hands the buffer out only once the engine
/// completed the receive (or took the buffer into its table).
#[derive(Debug)]
pub struct LentRecv {
    ptr: *mut u8,
    cap: usize,
    slot: u32,
}

// SAFETY: as for `BlockingRecv`: the address is only handed out
// (`Target::dst`), never dereferenced here; the engine's writes through it
// follow the lender's contract stated on `LentRecv::new`.
unsafe impl Send for LentRecv {}
// SAFETY: as above; through a shared reference one reads only numbers.
unsafe impl Sync for LentRecv {}

impl LentRecv {
    /// The lent receive at `slot` of its engine's table, into `cap` bytes
    /// at `ptr`.
    ///
    /// # Safety
    /// `ptr` is valid for writes of `cap` bytes, and written by nothing
    /// else, until the engine completes this receive (or takes it out of
    /// everything that delivers into it): the buffer of a lent request,
    /// which its handle gives back only once its lease ended.
    #[inline]
    pub unsafe fn new(ptr: *mut u8, cap: usize, slot: u32) -> Self {
        LentRecv { ptr, cap, slot }
    }

    /// The receive's slot in its engine's table.
    #[inline]
    pub fn slot(&self) -> u32 {
        self.slot
    }
}

/// Where a matched message goes.
pub enum Target {
    /// A non-blocking receive: its request owns the buffer.
    Request(CoreRef),
    /// A blocking receive: the waiting call borrows the buffer.
    Blocking(Arc<BlockingRecv>),
    /// A non-blocking receive its engine lent out: the engine completes it.
    Lent(LentRecv),
}

impl Target {
    /// The buffer to deliver into: its address and length. Valid for writes
    /// of that length while the receive is in the engine (a request owns its
    /// buffer until it is completed; for a blocking receive see
    /// [`BlockingRecv`]); the engine writes through it in its own `unsafe`
    /// code, one delivery at a time.
    pub fn dst(&self) -> (*mut u8, usize) {
        match self {
            Target::Request(c) => (c.buffer_ptr(), c.buffer_len()),
            Target::Blocking(b) => (b.ptr, b.cap),
            Target::Lent(r) => (r.ptr, r.cap),
        }
    }

    /// The engine's table slot of a [`Target::Lent`] receive (`None` for
    /// the others).
    #[inline(always)]
    pub fn lent_slot(&self) -> Option<u32> {
        match self {
            Target::Lent(r) => Some(r.slot),
            _ => None,
        }
    }

    /// Whether the receive is a blocking call's (the waiting call borrows
    /// its buffer), not a request's.
    #[inline]
    pub fn is_blocking(&self) -> bool {
        matches!(self, Target::Blocking(_))
    }

    /// Completes the receive with `st` (not a [`Target::Lent`]: its engine
    /// completes that one into its own table).
    pub fn complete(self, tracker: &Tracker, st: Status) {
        self.complete_with(tracker, || st)
    }

    /// Completes the receive with the status `st` makes, built where the
    /// receive keeps it (see [`Tracker::complete_with`]). Not for a
    /// [`Target::Lent`], which only its engine can complete (a bug of that
    /// engine: it panics).
    #[inline]
    pub fn complete_with(self, tracker: &Tracker, st: impl FnOnce() -> Status) {
        match self {
            Target::Request(core) => {
                tracker.complete_with(&core, st);
            }
            Target::Blocking(b) => {
                *b.status.lock().unwrap_or_else(|p| p.into_inner()) = Some(st());
                // Release: the status is written before the waiter sees done.
                b.done.store(true, Ordering::Release);
            }
            Target::Lent(r) => lent_by_engine(r.slot),
        }
    }

    /// Whether this is the blocking receive `b`.
    pub fn is(&self, b: &Arc<BlockingRecv>) -> bool {
        matches!(self, Target::Blocking(t) if Arc::ptr_eq(t, b))
    }
}

/// A lent receive reached [`Target::complete_with`]: its engine's bug.
#[cold]
#[inline(never)]
fn lent_by_engine(slot: u32) -> ! {
    panic!("lent receive {slot} must be completed by the engine that lent it")
}

/// A non-blocking send waiting for room (ring space, credits) to start.
pub struct Pending {
    /// The send's request.
    pub core: CoreRef,
    /// Its tag.
    pub tag: Tag,
    /// Its context.
    pub context: Context,
    /// Whether it is synchronous (`issend`).
    pub sync: bool,
}

/// A blocking send waiting for its receiver (an acknowledgement, the end of
/// a rendezvous): the waiting call keeps its borrowed buffer alive and
/// returns only once [`is_done`](BlockingSend::is_done).
#[derive(Debug, Default)]
pub struct BlockingSend {
    done: AtomicBool,
    error: Mutex<Option<Error>>,
}

impl BlockingSend {
    /// A send not yet done.
    pub fn new() -> Arc<BlockingSend> {
        Arc::default()
    }

    /// Whether the send completed (or failed).
    #[inline]
    pub fn is_done(&self) -> bool {
        // Acquire pairs with the Release in `SendOwner::complete`.
        self.done.load(Ordering::Acquire)
    }

    /// The outcome, once done (`Ok` if it never failed).
    pub fn outcome(&self) -> Result<()> {
        match self.error.lock().unwrap_or_else(|p| p.into_inner()).take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Who waits for a send that is in an engine.
pub enum SendOwner {
    /// A non-blocking send: its request owns the buffer.
    Request(CoreRef),
    /// A blocking send: the waiting call borrows the buffer.
    Blocking(Arc<BlockingSend>),
}

impl SendOwner {
    /// Completes the send of `len` bytes (`env` as its status reports it)
    /// with `result`.
    pub fn complete(self, tracker: &Tracker, env: Envelope, len: usize, result: Result<()>) {
        match self {
            SendOwner::Request(core) => {
                let st = match result {
                    Ok(()) => Status::ok(env, len),
                    Err(e) => Status::failed(env, e),
                };
                tracker.complete(&core, st);
            }
            SendOwner::Blocking(b) => {
                *b.error.lock().unwrap_or_else(|p| p.into_inner()) = result.err();
                // Release: the error is written before the waiter sees done.
                b.done.store(true, Ordering::Release);
            }
        }
    }
}

/// The first half of cancelling a receive in an engine that matches with
/// [`MatchingEngine`](crate::matching::MatchingEngine): takes `core`'s
/// receive out of `matching` if it is still queued there (not matched yet).
/// The engine stores the receive's [`PostedId`](crate::matching::PostedId)
/// as the request's token when it queues it. The caller completes the
/// returned target with [`cancelled`].
pub fn unpost<M>(
    matching: &mut crate::matching::MatchingEngine<M, Target>,
    core: &RequestCore,
) -> Option<Target> {
    if core.kind() != crate::RequestKind::Recv || core.token() == u64::MAX {
        return None;
    }
    matching.cancel(crate::matching::PostedId::from_raw(core.token()))
}

/// The status of a receive cancelled before it matched.
pub fn cancelled() -> Status {
    Status::cancelled(crate::Pattern::new(
        crate::Source::Any,
        crate::TagSel::Any,
        0,
    ))
}

/// The error of an operation involving a peer that went away.
pub fn lost(rank: Rank, reason: &str) -> Error {
    Error::PeerLost {
        rank,
        reason: reason.to_string(),
    }
}

#[cfg(test)]
mod tests;
