//! Loom model of the biased engine lock (`shm_ipc::biased`): in the
//! symmetric form of its handshake (`fence(SeqCst)` on both sides, as
//! `sync.rs` builds it under loom), two threads never hold it at once, and
//! a holder sees the previous holder's writes. Loom's `UnsafeCell` fails
//! the model on any access that is not ordered after the last one.
//!
//! Run with `RUSTFLAGS="--cfg loom" cargo test -p shm-ipc --release --test biased_loom`.
#![cfg(loom)]

use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::thread;

use shm_ipc::biased::BiasedLock;

struct Shared {
    lock: BiasedLock<()>,
    value: UnsafeCell<u32>,
}

// SAFETY: `value` is reached only under `lock` (what the model checks).
unsafe impl Sync for Shared {}
// SAFETY: as above.
unsafe impl Send for Shared {}

fn shared() -> Arc<Shared> {
    Arc::new(Shared {
        lock: BiasedLock::new(()),
        value: UnsafeCell::new(0),
    })
}

/// The value, once every other thread has ended.
fn value(s: &Shared) -> u32 {
    // SAFETY: only this thread is left.
    s.value.with(|v| unsafe { *v })
}

fn bump(s: &Shared) {
    let _g = s.lock.lock();
    s.value.with_mut(|v| {
        // SAFETY: under the lock (a concurrent access fails the model).
        unsafe { *v += 1 }
    });
}

#[test]
fn owner_and_mover_exclude_each_other() {
    loom::model(|| {
        let s = shared();
        bump(&s); // this thread takes the bias
        let s2 = s.clone();
        let t = thread::spawn(move || bump(&s2)); // moves it
        bump(&s); // the owner's fast path, racing the move
        t.join().unwrap();
        bump(&s);
        assert_eq!(value(&s), 4);
    });
}

#[test]
fn try_lock_of_another_thread_never_overlaps_the_owner() {
    loom::model(|| {
        let s = shared();
        bump(&s);
        let s2 = s.clone();
        let t = thread::spawn(move || {
            if let Some(_g) = s2.lock.try_lock() {
                s2.value.with_mut(|v| {
                    // SAFETY: under the lock.
                    unsafe { *v += 10 }
                });
            }
        });
        bump(&s);
        t.join().unwrap();
        let v = value(&s);
        assert!(v == 2 || v == 12, "{v}");
    });
}

#[test]
fn a_stale_owner_never_unmarks_the_new_owner() {
    // The mover takes the lock twice (moving the bias, then by its own
    // fast path) while the old owner, which read the old bias, retries.
    loom::model(|| {
        let s = shared();
        bump(&s);
        let s2 = s.clone();
        let t = thread::spawn(move || {
            bump(&s2);
            bump(&s2);
        });
        bump(&s);
        t.join().unwrap();
        assert_eq!(value(&s), 4);
    });
}

#[test]
fn two_movers_and_the_first_owner_exclude_each_other() {
    // Three threads, as in a rank whose device one thread opened and two
    // others drive (the finish-racing conformance test): the bias moves
    // from the opener to one driver, then to the other (or back), while
    // the earlier owners retry on stale reads of it. (Bounded at two
    // preemptions, 585 executions; three did not end within 10 minutes.)
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(2);
    b.max_branches = 100_000;
    b.check(|| {
        let s = shared();
        bump(&s);
        let (s1, s2) = (s.clone(), s.clone());
        let t1 = thread::spawn(move || {
            bump(&s1);
            bump(&s1);
        });
        let t2 = thread::spawn(move || bump(&s2));
        bump(&s);
        t1.join().unwrap();
        t2.join().unwrap();
        assert_eq!(value(&s), 5);
    });
}
