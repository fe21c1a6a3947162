//! A [`BiasedLock`] fixes the process's fence mode when it is made, so its
//! owner's fence is the light one from the first lock on, whoever makes it.
//!
//! Its own test binary (its own process): the fence mode is process state,
//! and nothing may have set it before this test looks. Before the lock
//! did it, a process that made its only biased lock outside `shm-ipc`'s
//! devices (the psm engine) never set the mode and paid a `fence(SeqCst)`
//! on every lock.
#![cfg(not(loom))]

use shm_ipc::biased::BiasedLock;
use shm_ipc::doorbell::{fence_mode, init_fences};

#[test]
fn making_a_biased_lock_fixes_the_fence_mode() {
    assert_eq!(fence_mode(), None, "nothing in this process set it yet");
    let lock = BiasedLock::new(7u32);
    let mode = fence_mode().expect("the lock's constructor fixed the fence mode");
    // The mode it fixed is the one registration gives (asymmetric wherever
    // the kernel allows `membarrier`), and the lock works in it.
    assert_eq!(mode, init_fences());
    *lock.lock() += 1;
    assert_eq!(*lock.lock(), 8);
}
