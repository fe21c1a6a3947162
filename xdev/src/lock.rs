//! [`RankLock`]: the lock that protects one rank's protocol state (and a
//! tracker's request pool).
//!
//! It is contended only by threads of the same rank, its critical sections
//! never sleep, and the common case is a single thread taking it over and
//! over, so it is a test-and-test-and-set spin lock: one compare-exchange to
//! take it and a plain `Release` store to give it back (a `std::sync::Mutex`
//! spends a second read-modify-write on unlock to look for sleepers, which
//! matters on a path measured in tens of nanoseconds). A waiter spins
//! briefly, then yields its core, so oversubscribed ranks still progress.

use std::cell::UnsafeCell;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::Ordering;

use crate::sync::AtomicBool;

/// A spin-then-yield lock around `T`.
#[derive(Default)]
pub struct RankLock<T> {
    locked: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: the lock hands out `&mut T` to one guard at a time, so sharing the
// lock between threads only requires that `T` may move between them.
unsafe impl<T: Send> Sync for RankLock<T> {}
// SAFETY: as for `Mutex<T>`: owning the lock owns `T`.
unsafe impl<T: Send> Send for RankLock<T> {}

/// Exclusive access to the value of a [`RankLock`], released on drop.
///
/// Like `std::sync::MutexGuard`, it is `Sync` only when `T` is (a shared
/// guard hands out `&T` to every thread that holds a reference to it), and
/// it is not `Send` (a lock is released by the thread that took it):
///
/// ```compile_fail,E0277
/// use std::cell::Cell;
/// use xdev::devkit::lock::RankLock;
///
/// let lock = RankLock::new(Cell::new(0u64));
/// let guard = lock.lock();
/// std::thread::scope(|s| {
///     // `Cell` is `Send` but not `Sync`: two threads must not share it.
///     s.spawn(|| guard.set(guard.get() + 1));
///     s.spawn(|| guard.set(guard.get() + 1));
/// });
/// ```
pub struct RankGuard<'a, T> {
    lock: &'a RankLock<T>,
    /// Neither `Send` nor `Sync` by default (see the `Sync` impl below).
    _not_send: PhantomData<*const ()>,
}

// SAFETY: through `&RankGuard<T>` a thread only gets `&T`, which is sound to
// share between threads exactly when `T: Sync` (as for `MutexGuard`).
unsafe impl<T: Sync> Sync for RankGuard<'_, T> {}

impl<T> RankLock<T> {
    /// A lock around `value`.
    #[cfg(not(loom))]
    pub const fn new(value: T) -> Self {
        RankLock {
            locked: AtomicBool::new(false),
            value: UnsafeCell::new(value),
        }
    }

    /// The lock around `value` (loom's atomics have no `const` constructor).
    #[cfg(loom)]
    pub fn new(value: T) -> Self {
        RankLock {
            locked: AtomicBool::new(false),
            value: UnsafeCell::new(value),
        }
    }

    /// Takes the lock, spinning then yielding while another thread holds it.
    #[inline]
    pub fn lock(&self) -> RankGuard<'_, T> {
        let mut spins = 0u32;
        loop {
            if let Some(g) = self.try_lock() {
                return g;
            }
            // Test before test-and-set: wait on a plain load so the line is
            // not bounced between waiters.
            while self.locked.load(Ordering::Relaxed) {
                spins += 1;
                if spins < 128 {
                    crate::sync::spin_loop();
                } else {
                    crate::sync::yield_now();
                }
            }
        }
    }

    /// Takes the lock if it is free.
    #[inline]
    pub fn try_lock(&self) -> Option<RankGuard<'_, T>> {
        // Acquire pairs with the Release in `RankGuard::drop`: the previous
        // holder's writes to `value` happen before ours.
        self.locked
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| RankGuard {
                lock: self,
                _not_send: PhantomData,
            })
    }
}

impl<T> Deref for RankGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the guard exists only while `locked` is held by it, so no
        // other reference to the value exists.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for RankGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`, and `&mut self` makes this access unique.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for RankGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        // Release: publishes our writes to the next holder.
        self.lock.locked.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests;
