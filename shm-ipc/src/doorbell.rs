//! [`Doorbell`]: how a waiting rank sleeps and how a peer wakes it, and
//! [`Backoff`], the spin-then-sleep policy of every blocking wait.
//!
//! A rank that finds nothing to do spins briefly, yields a few times, then
//! arms its doorbell and sleeps on a futex. A peer that publishes something
//! for it (a message, a completion) rings the doorbell, which costs a futex
//! wake only when a sleeper is armed.
//!
//! Ordering argument (the store-buffer pattern): the publisher does
//! `publish (SeqCst store)` then `sleepers.load(SeqCst)`; the sleeper does
//! `sleepers.fetch_add(SeqCst)`, a `SeqCst` fence, then re-checks for work.
//! In the single total order of SeqCst operations either the publisher's load
//! comes after the increment (it sees a sleeper and wakes it) or the publish
//! comes before the fence (the re-check sees the work). The futex word `seq`
//! is bumped before each wake, so a wake between the re-check and the sleep
//! makes `FUTEX_WAIT` return at once.

use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::time::Duration;

use crate::futex::{self, Scope};

/// A futex-based wake-up word, on its own cache line, usable in private or
/// shared memory (it is plain `repr(C)` atomics).
#[repr(C, align(64))]
#[derive(Default)]
pub struct Doorbell {
    seq: AtomicU32,
    sleepers: AtomicU32,
}

impl Doorbell {
    /// A doorbell with no sleepers.
    pub const fn new() -> Self {
        Doorbell {
            seq: AtomicU32::new(0),
            sleepers: AtomicU32::new(0),
        }
    }

    /// Wakes the sleepers, if any. Call after publishing with a `SeqCst`
    /// store (or after a `SeqCst` fence).
    #[inline]
    pub fn ring(&self, scope: Scope) {
        if self.sleepers.load(Ordering::SeqCst) != 0 {
            self.wake_all(scope);
        }
    }

    /// Wakes every sleeper unconditionally (used for rare events such as a
    /// peer's death).
    pub fn wake_all(&self, scope: Scope) {
        self.seq.fetch_add(1, Ordering::SeqCst);
        futex::wake(&self.seq, i32::MAX, scope);
    }

    /// Sleeps until rung or `timeout`, unless `has_work` (called after arming)
    /// says there is already something to do.
    pub fn sleep(&self, timeout: Duration, scope: Scope, has_work: impl FnOnce() -> bool) {
        let seq = self.seq.load(Ordering::SeqCst);
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if !has_work() {
            futex::wait(&self.seq, seq, Some(timeout), scope);
        }
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Spin-then-sleep policy for one blocking wait.
///
/// Defaults: 2,000 polls with a CPU relax hint (a few microseconds to tens of
/// microseconds), then 8 polls separated by `sched_yield`, then sleeps on the
/// doorbell with a timeout so that liveness checks still run.
#[derive(Debug)]
pub struct Backoff {
    polls: u32,
}

/// Polls spent spinning before yielding.
pub const SPIN_POLLS: u32 = 2_000;
/// Polls spent yielding before sleeping.
pub const YIELD_POLLS: u32 = 8;

impl Default for Backoff {
    fn default() -> Self {
        Self::new()
    }
}

impl Backoff {
    /// A fresh wait.
    pub fn new() -> Self {
        Backoff { polls: 0 }
    }

    /// Whether the next [`snooze`](Backoff::snooze) would sleep.
    pub fn should_sleep(&self) -> bool {
        self.polls >= SPIN_POLLS + YIELD_POLLS
    }

    /// Pauses between two polls: spins, then yields. Returns false once the
    /// caller should sleep instead.
    #[inline]
    pub fn snooze(&mut self) -> bool {
        self.polls = self.polls.saturating_add(1);
        if self.polls < SPIN_POLLS {
            std::hint::spin_loop();
            true
        } else if self.polls < SPIN_POLLS + YIELD_POLLS {
            std::thread::yield_now();
            true
        } else {
            false
        }
    }

    /// Starts spinning again (after a sleep that found work).
    pub fn reset(&mut self) {
        self.polls = 0;
    }
}
