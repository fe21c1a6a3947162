//! Where request cores live: counted references ([`CoreRef`]), each
//! tracker's pool of cores, and a small per-thread stash of free cores, so
//! that starting a request takes no lock and no locked instruction.
//!
//! A core is freed only when its last reference goes; the pool holds one
//! reference to every core it made, so a core is *free* (reusable) exactly
//! when its count is 1. Reuse goes:
//! 1. a sweep, under the pool's lock, collects the free cores (count 1, an
//!    `Acquire` load that orders every former holder's last use, made with
//!    a `Release` decrement, before our reuse);
//! 2. a thread moves a batch of them into its stash, giving each a second
//!    reference with a plain store (nobody else can reach a core whose only
//!    reference is the pool's, so nobody can race the store), and reserves
//!    as many request ids;
//! 3. it pops one per request start and resets it without any lock: only
//!    the pool's scans (`peek`, `outstanding`) can look at it meanwhile,
//!    and they read its atomics only (`peek` reads a status too, under the
//!    pool's lock, of a request whose handle then leaves the core to a
//!    sweep instead of a stash: see `RequestCore` and
//!    `Tracker::pop_completed`).

use std::cell::RefCell;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::atomic::Ordering;

use crate::sync::fence;

use super::{RequestCore, RequestId};

/// A counted reference to a [`RequestCore`], like `Arc<RequestCore>`: the
/// core lives while any reference does. Unlike an `Arc`, its tracker's pool
/// can hand a free core out again without a locked instruction.
pub struct CoreRef {
    ptr: NonNull<RequestCore>,
    _owns: PhantomData<RequestCore>,
}

// SAFETY: a CoreRef gives shared access to a RequestCore, which is Send +
// Sync; the count is atomic.
unsafe impl Send for CoreRef {}
// SAFETY: as above.
unsafe impl Sync for CoreRef {}

impl CoreRef {
    /// The first reference to a new core (the pool's).
    pub(super) fn new(core: RequestCore) -> Self {
        debug_assert_eq!(core.refs.load(Ordering::Relaxed), 1);
        CoreRef {
            ptr: NonNull::from(Box::leak(Box::new(core))),
            _owns: PhantomData,
        }
    }

    /// Whether `a` and `b` refer to the same core.
    pub fn ptr_eq(a: &CoreRef, b: &CoreRef) -> bool {
        a.ptr == b.ptr
    }

    /// The address of the core (for identity checks).
    pub fn as_ptr(this: &CoreRef) -> *const RequestCore {
        this.ptr.as_ptr()
    }

    /// How many references exist, this one included. `Acquire`: when this
    /// says 1, every former holder's use of the core happened before.
    pub(super) fn count(&self) -> usize {
        self.refs.load(Ordering::Acquire)
    }

    /// A second reference to a core whose only reference is `self`, made
    /// with a plain store.
    ///
    /// # Safety
    /// `self.count()` returned 1 after the last other reference was dropped,
    /// and no other thread can reach `self` meanwhile to clone it (the pool
    /// hands free cores out only under its lock).
    pub(super) unsafe fn share_unique(&self) -> CoreRef {
        self.refs.store(2, Ordering::Relaxed);
        CoreRef {
            ptr: self.ptr,
            _owns: PhantomData,
        }
    }

    /// One more reference to a core just taken from the pool, counted with
    /// a plain store instead of a locked increment (which would wait for
    /// every store before it, a ring slot's among them, to leave the store
    /// buffer).
    ///
    /// # Safety
    /// `self` was just taken from the pool ([`take_core`]) and no reference
    /// to it has been made since: its count is 2 (the pool's and `self`),
    /// and no other thread can reach the core to change it (the pool only
    /// reads the count).
    #[inline]
    pub(super) unsafe fn share_fresh(&self) -> CoreRef {
        debug_assert_eq!(self.count(), 2);
        self.refs.store(3, Ordering::Relaxed);
        CoreRef {
            ptr: self.ptr,
            _owns: PhantomData,
        }
    }

    /// The reference as its address, counted still (for a [`Request`]'s
    /// two words: see `handle.rs`); [`from_raw`](Self::from_raw) takes it
    /// back.
    ///
    /// [`Request`]: super::Request
    #[inline(always)]
    pub(super) fn into_raw(self) -> NonNull<RequestCore> {
        std::mem::ManuallyDrop::new(self).ptr
    }

    /// The reference [`into_raw`](Self::into_raw) gave as `ptr`.
    ///
    /// # Safety
    /// `ptr` came from `into_raw`, and each such address is taken back
    /// once (or viewed without being dropped).
    #[inline(always)]
    pub(super) unsafe fn from_raw(ptr: NonNull<RequestCore>) -> Self {
        CoreRef {
            ptr,
            _owns: PhantomData,
        }
    }
}

impl Clone for CoreRef {
    #[inline]
    fn clone(&self) -> Self {
        // Relaxed, as `Arc`: a new reference is made from an existing one,
        // which keeps the core alive; nothing is published by counting.
        let old = self.refs.fetch_add(1, Ordering::Relaxed);
        if old > isize::MAX as usize {
            // As `Arc`: only leaked references can get here.
            std::process::abort();
        }
        CoreRef {
            ptr: self.ptr,
            _owns: PhantomData,
        }
    }
}

impl Drop for CoreRef {
    #[inline]
    fn drop(&mut self) {
        // Release: our uses of the core happen before its reuse (the
        // sweep's Acquire) or its free (the fence below).
        if self.refs.fetch_sub(1, Ordering::Release) != 1 {
            return;
        }
        fence(Ordering::Acquire);
        // SAFETY: the count reached zero: this was the last reference, and
        // the core was allocated by `CoreRef::new` as a Box.
        drop(unsafe { Box::from_raw(self.ptr.as_ptr()) });
    }
}

impl std::ops::Deref for CoreRef {
    type Target = RequestCore;
    #[inline]
    fn deref(&self) -> &RequestCore {
        // SAFETY: the core lives while this reference does.
        unsafe { self.ptr.as_ref() }
    }
}

impl std::fmt::Debug for CoreRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (**self).fmt(f)
    }
}

/// Free cores a thread takes from a pool at once (and ids it reserves).
pub(super) const STASH_BATCH: usize = 32;
/// Trackers a thread keeps a stash for (the most recently used ones).
const STASHES: usize = 4;

/// A tracker's cores: every core it made, and those found free.
pub(super) struct Pool {
    pub(super) next_id: u64,
    /// Every core this tracker made (one reference each).
    pub(super) all: Vec<CoreRef>,
    /// Indices into `all` of cores found free by the last sweep.
    free: Vec<usize>,
}

impl Pool {
    pub(super) fn new() -> Self {
        Pool {
            next_id: 1,
            all: Vec::new(),
            free: Vec::new(),
        }
    }

    /// Refills `free` with the cores nobody but the pool holds any more.
    fn sweep(&mut self) {
        let Pool { all, free, .. } = self;
        free.extend(
            all.iter()
                .enumerate()
                .filter(|(_, c)| c.count() == 1)
                .map(|(i, _)| i),
        );
    }

    /// Adds half as many spare cores as there are (at least 16) to `free`.
    fn grow(&mut self, tracker: u64) {
        let first = self.all.len();
        let grow = (first / 2).max(16);
        for _ in 0..grow {
            self.all.push(CoreRef::new(RequestCore::spare(tracker)));
        }
        self.free.extend(first..first + grow);
    }

    /// Moves up to `n` free cores (at least one) into `out`, each with its
    /// second reference, and reserves as many ids; returns the first id.
    pub(super) fn take(&mut self, tracker: u64, n: usize, out: &mut Vec<CoreRef>) -> u64 {
        if self.free.is_empty() {
            self.sweep();
            if self.free.len() * 4 < self.all.len() + 4 {
                // Few free: grow by half, so that the next sweep comes only
                // after as many starts (a sweep of n cores is followed by at
                // least n/4 starts that need none).
                self.grow(tracker);
            }
        }
        let mut taken = 0;
        while taken < n {
            let Some(i) = self.free.pop() else {
                if taken > 0 {
                    break;
                }
                self.grow(tracker);
                continue;
            };
            // Still free? (Nothing hands out a core in `free` but us, so it
            // is; checked anyway, it costs a load.)
            if self.all[i].count() != 1 {
                continue;
            }
            // SAFETY: count 1 (Acquire, just now): only the pool's reference
            // exists, and we hold the pool's lock, the only way to reach it.
            out.push(unsafe { self.all[i].share_unique() });
            taken += 1;
        }
        self.reserve_ids(taken as u64)
    }

    /// Reserves `n` request ids; returns the first.
    pub(super) fn reserve_ids(&mut self, n: u64) -> u64 {
        let first = self.next_id;
        self.next_id += n;
        first
    }
}

/// A thread's free cores of one tracker, with the ids reserved for them.
struct Stash {
    tracker: u64,
    cores: Vec<CoreRef>,
    /// The next reserved id, and how many are left from it.
    next_id: u64,
    ids_left: u64,
}

#[cfg(not(loom))]
thread_local! {
    /// This thread's stashes, most recently used first.
    static STASH: RefCell<Vec<Stash>> = const { RefCell::new(Vec::new()) };
}

// Loom runs its threads on one OS thread: their stashes are loom's locals.
#[cfg(loom)]
loom::thread_local! {
    static STASH: RefCell<Vec<Stash>> = RefCell::new(Vec::new());
}

impl Stash {
    /// The next reserved id (one is left).
    #[inline]
    fn next(&mut self) -> RequestId {
        debug_assert!(self.ids_left > 0);
        let id = RequestId(self.next_id);
        self.next_id += 1;
        self.ids_left -= 1;
        id
    }
}

/// Cores a thread's stash takes back from [`recycle`] beyond a refill.
const STASH_KEEP: usize = 2 * STASH_BATCH;

/// Lets go of a completed core whose handle consumed it: into this thread's
/// stash for its tracker, with the reference still counted, when only its
/// pool holds it besides us (the device has dropped its reference); else
/// an ordinary drop.
///
/// Kept, the core skips the two costs of going back through the pool: the
/// locked decrement, and the sweep that finds free cores by their count.
/// Nobody can take a second reference meanwhile: the pool hands out only
/// cores whose count is 1, and the count stays 2 while the stash holds
/// ours. (With the pool already gone, a count of 2 may include a device
/// still holding the core; no start of that tracker pops it any more, and
/// the stash drops it like any other reference.)
#[inline]
pub(super) fn recycle(core: CoreRef) {
    // Acquire (in `count`): the device's uses of the core, before its
    // Release decrement, happen before the core is reset for reuse.
    if core.count() != 2 {
        return;
    }
    let tracker = core.tracker;
    // If this thread's stashes are gone or busy, the closure does not run
    // or hands the core back, and it is dropped.
    let _ = STASH.try_with(move |stashes| {
        let Ok(mut stashes) = stashes.try_borrow_mut() else {
            return Some(core);
        };
        match stashes.first_mut() {
            Some(s) if s.tracker == tracker && s.cores.len() < STASH_KEEP => {
                s.cores.push(core);
                None
            }
            _ => Some(core),
        }
    });
}

/// A free core of `tracker` (its second reference) and a fresh id, from
/// this thread's stash, refilled from `pool` (under its lock) when empty.
///
/// Inlined into the request's start: the common case is the stash in front
/// being this tracker's with a core and an id left (no search, no
/// reordering, no refill); everything else is [`take_core_slow`].
#[inline]
pub(super) fn take_core(tracker: u64, pool: &crate::lock::RankLock<Pool>) -> (CoreRef, RequestId) {
    let fast = STASH.try_with(|stashes| {
        let mut stashes = stashes.try_borrow_mut().ok()?;
        let stash = stashes
            .first_mut()
            .filter(|s| s.tracker == tracker && s.ids_left > 0)?;
        let core = stash.cores.pop()?;
        Some((core, stash.next()))
    });
    match fast {
        Ok(Some(got)) => got,
        _ => take_core_slow(tracker, pool),
    }
}

/// [`take_core`] when the stash in front cannot give a core at once: finds
/// or makes this tracker's stash, moves it to the front, refills it.
#[cold]
#[inline(never)]
fn take_core_slow(tracker: u64, pool: &crate::lock::RankLock<Pool>) -> (CoreRef, RequestId) {
    let mut evicted = None;
    let from_stash = STASH.try_with(|stashes| {
        let mut stashes = stashes.try_borrow_mut().ok()?;
        let at = match stashes.iter().position(|s| s.tracker == tracker) {
            Some(at) => at,
            None => {
                if stashes.len() == STASHES {
                    // Its cores go back to their pool by their count (the
                    // drop waits until our borrow ends).
                    evicted = stashes.pop();
                }
                stashes.push(Stash {
                    tracker,
                    cores: Vec::with_capacity(STASH_BATCH),
                    next_id: 0,
                    ids_left: 0,
                });
                stashes.len() - 1
            }
        };
        if at != 0 {
            stashes.swap(0, at);
        }
        let stash = &mut stashes[0];
        if stash.cores.is_empty() {
            // Ids left over from recycled cores are dropped: ids need only
            // be unique.
            stash.next_id = pool.lock().take(tracker, STASH_BATCH, &mut stash.cores);
            stash.ids_left = stash.cores.len() as u64;
        } else if stash.ids_left == 0 {
            // Cores came back by `recycle`, which reserves no ids.
            stash.next_id = pool.lock().reserve_ids(STASH_BATCH as u64);
            stash.ids_left = STASH_BATCH as u64;
        }
        let core = stash.cores.pop()?;
        Some((core, stash.next()))
    });
    drop(evicted);
    match from_stash {
        Ok(Some(got)) => got,
        // No stash in this thread now (it is being torn down, or we are
        // inside a stash operation): straight from the pool.
        _ => {
            let mut one = Vec::with_capacity(1);
            let id = pool.lock().take(tracker, 1, &mut one);
            let core = one.pop().expect("the pool gives at least one core");
            (core, RequestId(id))
        }
    }
}
