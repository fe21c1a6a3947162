//! [`BiasedLock`]: the engine lock, biased toward the thread that uses it,
//! so that the usual case (one thread drives a rank) takes it without a
//! locked instruction.
//!
//! Why: a profile of the small-message rate showed each side stalled on the
//! engine lock's `lock cmpxchg`. A locked instruction waits until every
//! earlier store has left the store buffer, and the store just before it
//! is the previous message's ring slot (sender) or the previous pop's slot
//! zeroing and tail (receiver): lines the other core holds. So every message
//! paid a full cross-core transfer in series, where a lock-free producer
//! (Open MPI's vader, UCX's mm) overlaps a window's transfers in its store
//! buffer.
//!
//! How: the lock has an owner thread (its *bias*). The owner enters with
//! plain stores: it raises `inside`, a light fence (a compiler fence while
//! this process uses `membarrier`), then checks that the bias is still its
//! own. Any other thread takes the ordinary test-and-set lock, and before it
//! enters it moves the bias away: it stores the new bias, runs the heavy
//! fence (`membarrier`, a full barrier on every CPU that runs a thread of
//! this process), and waits until `inside` is down. This is the doorbell's
//! store-buffer handshake (`crate::doorbell`): either the owner's check
//! sees the moved bias, or the mover's wait sees the owner inside. Each
//! move starts a new epoch with its own `inside` flag, so an owner that
//! read the bias just before it moved, and raises then lowers its flag
//! while it backs out, never lowers the new owner's (the loom model
//! `tests/biased_loom.rs` found that race in a single shared flag). A moved
//! bias goes to the mover (a device opened on one thread and driven by
//! another settles on the second), at most [`MOVES`] times; then the lock
//! stays unbiased: threads that take turns on one rank pay the
//! test-and-set, never a `membarrier` per call.
//!
//! Where `membarrier` is refused, both fences are `fence(SeqCst)` (the
//! symmetric form of the same argument): correct, and no faster than the
//! plain lock. The lock is not reentrant: a thread that locks it twice
//! waits forever, as with the plain lock (a debug build panics instead),
//! and its `try_lock` fails. It never gets two guards: a thread that
//! entered by the test-and-set lock and now owns the bias holds the lock by
//! its epoch's flag, as the fast path does, so its own fast path refuses.

use std::cell::UnsafeCell;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

use crate::sync::{heavy_fence_strict, light_fence, AtomicBool, AtomicU64, Ordering};

/// How many times the bias may move to another thread; the next move
/// leaves the lock unbiased.
pub const MOVES: u32 = 8;

/// `bias`: no thread yet (the first to lock takes it).
const UNBIASED: u64 = 0;
/// `bias`: moved too often; every thread takes the test-and-set lock.
const DISABLED: u64 = u64::MAX;

/// A mutual-exclusion lock biased toward one thread (see the module docs).
pub struct BiasedLock<T> {
    /// The owner's thread token and the bias's epoch (how often it moved,
    /// in the top bits; see [`biased`]), or [`UNBIASED`] or [`DISABLED`].
    bias: AtomicU64,
    /// Per epoch, whether that epoch's owner is inside. Each epoch has its
    /// own flag, written only by its owner: an owner that read the bias
    /// just before it moved may still raise and lower its flag while it
    /// backs out, and must not lower the flag of the owner after it.
    inside: [AtomicBool; MOVES as usize + 1],
    /// The test-and-set lock of every other entry.
    locked: AtomicBool,
    value: UnsafeCell<T>,
}

/// Bits of `bias` that hold the epoch.
const EPOCH_SHIFT: u32 = 56;

/// A bias word: `token` owns the lock in `epoch`.
fn biased(token: u64, epoch: u32) -> u64 {
    debug_assert!(token < 1 << EPOCH_SHIFT && epoch <= MOVES);
    (u64::from(epoch) << EPOCH_SHIFT) | token
}

/// The owner's token of a bias word.
fn owner(bias: u64) -> u64 {
    bias & ((1 << EPOCH_SHIFT) - 1)
}

/// The epoch of a bias word.
fn epoch(bias: u64) -> usize {
    (bias >> EPOCH_SHIFT) as usize
}

// SAFETY: the lock hands out `&mut T` to one guard at a time (the module
// docs' argument), so sharing it between threads only needs `T: Send`.
unsafe impl<T: Send> Sync for BiasedLock<T> {}
// SAFETY: as for `Mutex<T>`: owning the lock owns `T`.
unsafe impl<T: Send> Send for BiasedLock<T> {}

/// The access to a [`BiasedLock`]'s value; unlocks when dropped.
pub struct BiasedGuard<'a, T> {
    lock: &'a BiasedLock<T>,
    /// The epoch whose owner entered by the fast path, or `None` for the
    /// test-and-set lock.
    epoch: Option<usize>,
    _not_send: PhantomData<*const ()>,
}

// SAFETY: through `&BiasedGuard<T>` a thread only gets `&T`, which is sound
// to share between threads exactly when `T: Sync` (as for `MutexGuard`).
unsafe impl<T: Sync> Sync for BiasedGuard<'_, T> {}

/// This thread's token: unique among all threads the process ever ran,
/// below 2^56, and never [`UNBIASED`] or [`DISABLED`].
#[inline]
fn token() -> u64 {
    #[cfg(not(loom))]
    std::thread_local! {
        static TOKEN: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    }
    // Loom runs its threads on one OS thread: their locals are loom's.
    #[cfg(loom)]
    loom::thread_local! {
        static TOKEN: std::cell::Cell<u64> = std::cell::Cell::new(0);
    }
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    TOKEN
        .try_with(|t| {
            if t.get() == 0 {
                t.set(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
            }
            t.get()
        })
        // A thread whose locals are gone (a destructor at its exit) gets a
        // token nobody else has, and so the test-and-set path.
        .unwrap_or_else(|_| NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
}

impl<T> BiasedLock<T> {
    /// An unlocked lock, biased toward the first thread that takes it.
    ///
    /// It fixes this process's fence mode first
    /// ([`init_fences`](crate::doorbell::init_fences)): until then the
    /// owner's fence is a full `fence(SeqCst)` on every lock, so a lock made
    /// before it would keep paying for one (the psm engine did, as nothing
    /// else in a PSM2-only process sets the mode).
    pub fn new(value: T) -> Self {
        crate::sync::init_fences();
        BiasedLock {
            bias: AtomicU64::new(UNBIASED),
            inside: std::array::from_fn(|_| AtomicBool::new(false)),
            locked: AtomicBool::new(false),
            value: UnsafeCell::new(value),
        }
    }

    /// Takes the lock: with plain stores on the owner thread, else with the
    /// test-and-set lock (moving the bias away first).
    #[inline]
    pub fn lock(&self) -> BiasedGuard<'_, T> {
        #[cfg(all(debug_assertions, not(loom)))]
        held::check(self as *const Self as usize);
        let me = token();
        // Relaxed: only a mover changes the bias, and the re-check after
        // the fence below decides.
        let b = self.bias.load(Ordering::Relaxed);
        if owner(b) == me && b != DISABLED {
            let flag = &self.inside[epoch(b)];
            if !flag.load(Ordering::Relaxed) {
                flag.store(true, Ordering::Relaxed);
                // Store-buffer handshake, owner's half: our flag before the
                // re-check of `bias` (pairs with the heavy fence in
                // `move_bias`).
                light_fence();
                if self.bias.load(Ordering::Relaxed) == b {
                    return self.guard(Some(epoch(b)));
                }
                // Moved meanwhile: its mover waits for this store.
                flag.store(false, Ordering::Release);
            }
        }
        self.lock_slow(me)
    }

    /// Takes the lock unless another thread holds it by the test-and-set
    /// lock (or this thread holds it already). A thread that is not the
    /// owner may wait for one critical section of the owner to end (while
    /// it moves the bias).
    #[inline]
    pub fn try_lock(&self) -> Option<BiasedGuard<'_, T>> {
        let me = token();
        let b = self.bias.load(Ordering::Relaxed);
        if owner(b) == me && b != DISABLED {
            // Inside already (a call made under the lock): taken, as a
            // plain lock's `try_lock` would say.
            if self.inside[epoch(b)].load(Ordering::Relaxed) {
                return None;
            }
            return Some(self.lock());
        }
        // Acquire: as in `lock_slow`.
        self.locked
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .ok()?;
        Some(self.entered(me))
    }

    #[cold]
    fn lock_slow(&self, me: u64) -> BiasedGuard<'_, T> {
        let mut spins = 0u32;
        // Acquire pairs with the Release in the guard's drop: the previous
        // test-and-set holder's writes happen before ours.
        while self
            .locked
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            spins = spins.saturating_add(1);
            backoff(spins);
        }
        self.entered(me)
    }

    /// Under the test-and-set lock: makes sure no owner is inside (moving
    /// the bias to this thread if another thread has it), then gives the
    /// guard.
    ///
    /// Where the bias is now ours, the guard holds the lock as its owner
    /// does (our epoch's flag up, the test-and-set lock let go), so that a
    /// thread holds it one way only. Held by the test-and-set lock, the
    /// owner's own fast path (a `lock` or `try_lock` made under the lock)
    /// would have found its flag down and handed out a second guard; with
    /// the flag up it refuses, as a plain lock does.
    fn entered(&self, me: u64) -> BiasedGuard<'_, T> {
        // The bias is never already ours here: only this thread moves it
        // to itself, here, and from then on enters by its flag; its fast
        // path falls back to this lock only once the bias moved away, or
        // while it holds the lock itself (a re-entry, which waits in
        // `move_bias` for its own flag forever, as with a plain lock).
        let ours = match self.bias.load(Ordering::Relaxed) {
            DISABLED => None,
            UNBIASED => {
                let b = biased(me, 0);
                self.bias.store(b, Ordering::Relaxed);
                Some(b)
            }
            b => self.move_bias(b, me),
        };
        if let Some(b) = ours {
            let e = epoch(b);
            self.inside[e].store(true, Ordering::Relaxed);
            // Release: the next test-and-set holder, which acquires
            // `locked`, sees our flag up (and our writes so far); it moves
            // the bias and waits for the flag as for any owner's.
            self.locked.store(false, Ordering::Release);
            return self.guard(Some(e));
        }
        self.guard(None)
    }

    /// The guard of an entry by the fast path of `epoch`, or by the
    /// test-and-set lock (`None`).
    #[inline]
    fn guard(&self, epoch: Option<usize>) -> BiasedGuard<'_, T> {
        #[cfg(all(debug_assertions, not(loom)))]
        held::enter(self as *const Self as usize);
        BiasedGuard {
            lock: self,
            epoch,
            _not_send: PhantomData,
        }
    }

    /// Moves the bias `from` its owner (to `me` in the next epoch, or
    /// nowhere once it moved [`MOVES`] times) and waits until that owner is
    /// out. Called under the test-and-set lock. The new bias if it is ours.
    fn move_bias(&self, from: u64, me: u64) -> Option<u64> {
        let next = epoch(from) as u32 + 1;
        let to = if next <= MOVES {
            biased(me, next)
        } else {
            DISABLED
        };
        self.bias.store(to, Ordering::Relaxed);
        // Mover's half of the handshake: the new bias before the check of
        // the flag, on every CPU (pairs with the owner's light fence).
        heavy_fence_strict();
        let mut spins = 0u32;
        // Acquire pairs with the owner's Release as it leaves: its writes
        // to the value happen before ours. (The owner itself, locking again
        // while inside, would wait here forever, as with a plain lock.)
        while self.inside[epoch(from)].load(Ordering::Acquire) {
            spins = spins.saturating_add(1);
            backoff(spins);
        }
        (to != DISABLED).then_some(to)
    }

    /// How often the bias moved.
    pub fn moves(&self) -> u32 {
        match self.bias.load(Ordering::Relaxed) {
            DISABLED => MOVES + 1,
            b => epoch(b) as u32,
        }
    }
}

/// Spins, then yields.
#[inline]
fn backoff(spins: u32) {
    // Loom explores every iteration of a spin: it yields at once.
    #[cfg(loom)]
    {
        let _ = spins;
        loom::thread::yield_now();
    }
    #[cfg(not(loom))]
    if spins < 128 {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

impl<T> Deref for BiasedGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: the guard exists only while it holds the lock (the module
        // docs' argument), so no other reference to the value exists.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for BiasedGuard<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`, and `&mut self` makes this access unique.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for BiasedGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        #[cfg(all(debug_assertions, not(loom)))]
        held::leave(self.lock as *const BiasedLock<T> as usize);
        // Release: publishes our writes to the next holder (the owner's
        // next entry is ordered by its own program order; a mover acquires
        // `inside`, a test-and-set holder `locked`).
        match self.epoch {
            Some(e) => self.lock.inside[e].store(false, Ordering::Release),
            None => self.lock.locked.store(false, Ordering::Release),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests;

/// Debug builds: the locks this thread holds, so that a thread that locks
/// one it holds panics at once (naming the call) rather than waiting
/// forever, and a second guard of one lock on one thread, which would alias
/// the value, cannot go unnoticed.
#[cfg(all(debug_assertions, not(loom)))]
mod held {
    use std::cell::RefCell;

    std::thread_local! {
        static HELD: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
    }

    /// Panics if this thread holds the lock at `addr`.
    pub(super) fn check(addr: usize) {
        // A thread whose locals are gone is not checked.
        let _ = HELD.try_with(|h| {
            assert!(
                !h.borrow().contains(&addr),
                "a thread locked a BiasedLock it already holds (it would wait forever)"
            );
        });
    }

    /// This thread now holds the lock at `addr`.
    pub(super) fn enter(addr: usize) {
        let _ = HELD.try_with(|h| {
            let mut h = h.borrow_mut();
            assert!(
                !h.contains(&addr),
                "two guards of one BiasedLock on one thread"
            );
            h.push(addr);
        });
    }

    /// This thread let go of the lock at `addr`.
    pub(super) fn leave(addr: usize) {
        let _ = HELD.try_with(|h| {
            let mut h = h.borrow_mut();
            if let Some(i) = h.iter().rposition(|&a| a == addr) {
                h.swap_remove(i);
            }
        });
    }
}
