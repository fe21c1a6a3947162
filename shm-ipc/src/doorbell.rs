//! [`Doorbell`]: how a waiting rank sleeps and how a peer wakes it, and
//! [`Backoff`], the spin-then-sleep policy of every blocking wait.
//!
//! A rank that finds nothing to do spins briefly, yields a few times, then
//! arms its doorbell and sleeps on a futex. A peer that publishes something
//! for it (a message, a completion) rings the doorbell, which costs a futex
//! wake only when a sleeper is armed.
//!
//! Ordering argument (the store-buffer pattern, with asymmetric fences):
//! the publisher does `publish (Release store)`, a *light* fence, then
//! `sleepers.load`; the sleeper does `sleepers.fetch_add`, a *heavy* fence,
//! then re-checks for work. The heavy fence is `membarrier(2)`
//! (`MEMBARRIER_CMD_GLOBAL_EXPEDITED`): it makes every CPU running a thread of
//! a registered process execute a full barrier, so either the publisher's
//! load runs after it and sees the sleeper, or its publish was already
//! globally visible and the re-check sees the work. The light fence is then
//! only a compiler fence, which keeps the publisher's fast path free of
//! `mfence`/`xchg`. Every process registers in [`init_fences`] (called by
//! device constructors before any device exists). Where the kernel refuses
//! `membarrier`, both sides use `fence(SeqCst)` instead, the symmetric form of
//! the same argument. The futex word `seq` is bumped before each wake, so a
//! wake between the re-check and the sleep makes `FUTEX_WAIT` return at once.
//!
//! The ring's "waiting for room" flag is the same handshake with the roles
//! swapped (the producer arms, the consumer publishes room), and uses the
//! same fence pair (`light_fence`, `heavy_fence`; see
//! `ring::Producer::set_waiting`).

use std::sync::atomic::{compiler_fence, fence, AtomicBool, AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use crate::futex::{self, Scope};

/// A futex-based wake-up word, on its own cache line, usable in private or
/// shared memory (it is plain `repr(C)` atomics). For a doorbell whose
/// waking peers must not be trusted, see [`DoorbellRef`].
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

    /// Its two words, as a [`DoorbellRef`] its owner may sleep on.
    #[inline]
    pub fn view(&self) -> DoorbellRef<'_> {
        DoorbellRef {
            seq: &self.seq,
            sleepers: &self.sleepers,
            owner: true,
        }
    }

    /// Wakes the sleepers, if any. Call after publishing with a `Release`
    /// (or stronger) store.
    #[inline]
    pub fn ring(&self, scope: Scope) {
        self.view().ring(scope)
    }

    /// Wakes every sleeper unconditionally (used for rare events such as a
    /// peer's death).
    pub fn wake_all(&self, scope: Scope) {
        self.view().wake_all(scope)
    }

    /// Sleeps until rung or `timeout`, unless `has_work` (called after arming)
    /// says there is already something to do. Returns false if the timeout
    /// ended the sleep.
    pub fn sleep(&self, timeout: Duration, scope: Scope, has_work: impl FnOnce() -> bool) -> bool {
        self.view().sleep(timeout, scope, has_work)
    }
}

/// A doorbell whose two words may live apart: the futex word `seq`, which
/// every waker bumps (so it must be writable by them), and the `sleepers`
/// count that a waker reads to decide whether to wake at all, which only the
/// owner writes.
///
/// The process device keeps `seq` in a rank's notice page (written by every
/// peer) and `sleepers` in its control page (peers map it read-only, see
/// `segment`): a peer that scribbles on the notice page can cause spurious
/// wake-ups, but cannot make an honest waker skip a wake-up the owner is
/// sleeping for.
#[derive(Copy, Clone, Debug)]
pub struct DoorbellRef<'a> {
    seq: &'a AtomicU32,
    sleepers: &'a AtomicU32,
    /// Whether this view may arm `sleepers` (the owner's; a peer's view of
    /// it is read-only memory).
    owner: bool,
}

impl<'a> DoorbellRef<'a> {
    /// The owner's view of a doorbell made of `seq` and `sleepers`.
    pub fn owner(seq: &'a AtomicU32, sleepers: &'a AtomicU32) -> Self {
        DoorbellRef {
            seq,
            sleepers,
            owner: true,
        }
    }

    /// A waker's view: it rings, and never writes `sleepers` (which may be
    /// mapped read-only here).
    pub fn waker(seq: &'a AtomicU32, sleepers: &'a AtomicU32) -> Self {
        DoorbellRef {
            seq,
            sleepers,
            owner: false,
        }
    }

    /// Wakes the sleepers, if any. Call after publishing with a `Release`
    /// (or stronger) store.
    #[inline]
    pub fn ring(&self, scope: Scope) {
        light_fence();
        if self.sleepers.load(Ordering::Relaxed) != 0 {
            self.wake_all(scope);
        }
    }

    /// Wakes every sleeper unconditionally (used for rare events such as a
    /// peer's death).
    pub fn wake_all(&self, scope: Scope) {
        self.seq.fetch_add(1, Ordering::SeqCst);
        futex::wake(self.seq, i32::MAX, scope);
    }

    /// Sleeps until rung or `timeout`, unless `has_work` (called after arming)
    /// says there is already something to do. Returns false if the timeout
    /// ended the sleep.
    ///
    /// A waker's view cannot arm the doorbell: it waits for `timeout` (or a
    /// wake-up someone else armed) without being announced.
    pub fn sleep(&self, timeout: Duration, scope: Scope, has_work: impl FnOnce() -> bool) -> bool {
        let seq = self.seq.load(Ordering::SeqCst);
        if self.owner {
            self.sleepers.fetch_add(1, Ordering::SeqCst);
            heavy_fence();
        }
        let mut woken = true;
        if !has_work() {
            woken = futex::wait(self.seq, seq, Some(timeout), scope);
        }
        if self.owner {
            self.sleepers.fetch_sub(1, Ordering::SeqCst);
        }
        woken
    }
}

/// How the doorbell's fences work in this process.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum FenceMode {
    /// `membarrier` on the sleeping side, a compiler fence on the publisher.
    Asymmetric,
    /// `fence(SeqCst)` on both sides (the kernel refused `membarrier`).
    Symmetric,
}

static FENCE_MODE: OnceLock<FenceMode> = OnceLock::new();

/// `FENCE_MODE` is `Asymmetric`, as one load for the fences on every
/// message (a `OnceLock::get` is an ordered load of its state, a branch and
/// a second load). Set once, after `membarrier` registration succeeded.
/// Like `FENCE_MODE`, it reaches the threads that use a device through the
/// hand-off that gave them the device, made after `init_fences`.
static ASYMMETRIC: AtomicBool = AtomicBool::new(false);

/// This process's fence mode, once [`init_fences`] fixed it; `None` before
/// (the fences are then the symmetric `fence(SeqCst)`).
pub fn fence_mode() -> Option<FenceMode> {
    FENCE_MODE.get().copied()
}

/// Registers this process for `membarrier` and fixes the fence mode. Device
/// constructors call it before creating anything that rings or sleeps, and
/// [`BiasedLock::new`](crate::biased::BiasedLock::new) before its lock
/// exists; calling it again is free.
pub fn init_fences() -> FenceMode {
    let mode = *FENCE_MODE.get_or_init(|| {
        if crate::futex::membarrier_register_global_expedited().is_ok() {
            FenceMode::Asymmetric
        } else {
            FenceMode::Symmetric
        }
    });
    if mode == FenceMode::Asymmetric {
        ASYMMETRIC.store(true, Ordering::Relaxed);
    }
    mode
}

#[inline]
fn asymmetric() -> bool {
    // Unset (nothing initialised yet) counts as symmetric: the safe side.
    ASYMMETRIC.load(Ordering::Relaxed)
}

/// The publisher's half of the store-buffer handshake: between its
/// publication store and its load of the sleeper's flag. A compiler fence in
/// [`FenceMode::Asymmetric`] (the sleeper's [`heavy_fence`] does the work),
/// `fence(SeqCst)` otherwise.
#[inline]
pub(crate) fn light_fence() {
    if asymmetric() {
        compiler_fence(Ordering::SeqCst);
    } else {
        fence(Ordering::SeqCst);
    }
}

/// The sleeper's half: between its store arming the flag and its re-check.
/// `membarrier` in [`FenceMode::Asymmetric`], `fence(SeqCst)` otherwise.
pub(crate) fn heavy_fence() {
    if asymmetric() && crate::futex::membarrier_global_expedited().is_ok() {
        return;
    }
    // Symmetric mode. (A membarrier failure after successful registration is
    // not expected; this fence alone would not pair with the publisher's
    // compiler fence then, and what bounds a missed wake-up in that case is
    // the sleep's timeout, which every caller passes.)
    fence(Ordering::SeqCst);
}

/// [`heavy_fence`] for a lock ([`crate::biased`]), where a fence that does
/// not pair with the other side's would break mutual exclusion, not just
/// delay a wake-up: in asymmetric mode it retries `membarrier` until the
/// kernel runs it (it is not expected to fail once registered), yielding
/// between tries, and never falls back to a fence alone.
#[cfg_attr(loom, allow(dead_code))]
pub(crate) fn heavy_fence_strict() {
    if !asymmetric() {
        fence(Ordering::SeqCst);
        return;
    }
    while crate::futex::membarrier_global_expedited().is_err() {
        std::thread::yield_now();
    }
}

/// Spin-then-sleep policy for one blocking wait.
///
/// Defaults: 2,000 back-to-back polls (a few to tens of microseconds), then
/// polls separated by `sched_yield` for [`YIELD_TIME`] (at least
/// [`YIELD_POLLS`] of them), then sleeps on the doorbell with a timeout so
/// that liveness checks still run.
///
/// Why a yield phase measured in time: arming the doorbell costs the
/// sleeper a `membarrier` (an inter-processor interrupt on every core
/// running a rank) and the waker a futex wake, several microseconds in all.
/// A wait that sleeps after a few microseconds pays that on every window of
/// a message stream (measured: 17% of the thread device's time in a
/// 64-message window benchmark went to the interrupts and rescheduling). A
/// yield costs a system call when nothing else wants the core, and hands
/// the core over when another rank does, so an oversubscribed run (more
/// ranks than cores) still progresses.
#[derive(Debug)]
pub struct Backoff {
    polls: u32,
    /// When the yield phase began.
    yielding_since: Option<std::time::Instant>,
}

/// Polls spent spinning before yielding.
pub const SPIN_POLLS: u32 = 2_000;
/// Least polls spent yielding before sleeping.
pub const YIELD_POLLS: u32 = 8;
/// How long a wait yields before it sleeps.
pub const YIELD_TIME: Duration = Duration::from_micros(100);

impl Default for Backoff {
    fn default() -> Self {
        Self::new()
    }
}

impl Backoff {
    /// A fresh wait.
    pub fn new() -> Self {
        Backoff {
            polls: 0,
            yielding_since: None,
        }
    }

    /// Whether the next [`snooze`](Backoff::snooze) would sleep.
    pub fn should_sleep(&self) -> bool {
        self.polls >= SPIN_POLLS + YIELD_POLLS
            && self
                .yielding_since
                .is_some_and(|t| t.elapsed() >= YIELD_TIME)
    }

    /// Pauses between two polls: spins, then yields. Returns false once the
    /// caller should sleep instead.
    #[inline]
    pub fn snooze(&mut self) -> bool {
        self.polls = self.polls.saturating_add(1);
        if self.polls < SPIN_POLLS {
            // A `pause` between polls. An earlier measurement (main tables,
            // minutes apart) had it cost 8-byte latency (0.16 -> 0.18 us);
            // measured in the report's interleaved passes, each against
            // Open MPI in the same pass, 7 reports alternating with and
            // without it: latency 8 B ahead in 6 of 7 pairs on thread
            // (1.32-1.66x Open MPI's against 1.20-1.46x) and in 5 of 7 on
            // shm, bandwidth and message rate unchanged within the spread.
            // Likely why (not isolated): leaving a spin loop without the
            // hint costs a pipeline clear when the awaited store lands, and
            // tighter polling pulls the line the sender writes back to us
            // more often.
            std::hint::spin_loop();
            return true;
        }
        let since = *self
            .yielding_since
            .get_or_insert_with(std::time::Instant::now);
        if self.polls < SPIN_POLLS + YIELD_POLLS || since.elapsed() < YIELD_TIME {
            std::thread::yield_now();
            true
        } else {
            false
        }
    }

    /// Starts spinning again (after a sleep that found work).
    pub fn reset(&mut self) {
        self.polls = 0;
        self.yielding_since = None;
    }
}
