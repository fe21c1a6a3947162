//! The atomics, fences and cells of the request core's protocol
//! (`request.rs`, `request/pool.rs`, `request/tracker.rs`) and of
//! [`RankLock`](crate::lock::RankLock): `std`'s, or loom's in the
//! `--cfg loom` build that model-checks that protocol
//! (`tests/request_loom.rs`). Nothing else in the crate goes through this
//! shim, and in the ordinary build every item here is `std`'s own or an
//! inlined wrapper around it.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicU8, AtomicUsize};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicU8, AtomicUsize};

#[cfg(loom)]
pub(crate) use loom::cell::UnsafeCell;

/// A cell whose contents are reached only through a raw pointer inside a
/// closure: `std`'s `UnsafeCell` with the access form of loom's, so that
/// the loom build checks every access of the request core's cells
/// against the happens-before order of its atomics.
#[cfg(not(loom))]
#[derive(Debug)]
pub(crate) struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

#[cfg(not(loom))]
impl<T> UnsafeCell<T> {
    #[inline(always)]
    pub(crate) const fn new(value: T) -> Self {
        UnsafeCell(std::cell::UnsafeCell::new(value))
    }

    /// Runs `f` with a pointer for reading the contents.
    #[inline(always)]
    pub(crate) fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
        f(self.0.get())
    }

    /// Runs `f` with a pointer for writing the contents.
    #[inline(always)]
    pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}

// What a thread does between two looks at a flag another thread sets
// (`yield_now`), and the hint inside a spin (`spin_loop`): `std`'s, or
// loom's yield for both (a loom thread that spins without it never lets the
// model switch threads).
#[cfg(loom)]
pub(crate) use loom::thread::{yield_now, yield_now as spin_loop};
#[cfg(not(loom))]
pub(crate) use std::{hint::spin_loop, thread::yield_now};
