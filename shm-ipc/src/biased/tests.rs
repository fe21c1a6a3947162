use super::*;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

#[test]
fn the_first_thread_takes_the_bias_and_keeps_it() {
    let lock = BiasedLock::new(0u64);
    for _ in 0..1000 {
        *lock.lock() += 1;
    }
    assert_eq!(*lock.lock(), 1000);
    assert_eq!(lock.moves(), 0, "one thread: the bias never moved");
    assert_eq!(owner(lock.bias.load(Ordering::Relaxed)), token());
}

#[test]
fn the_bias_follows_a_device_handed_to_another_thread() {
    let lock = Arc::new(BiasedLock::new(0u64));
    *lock.lock() += 1; // opened here
    let l2 = lock.clone();
    let t = std::thread::spawn(move || {
        for _ in 0..1000 {
            *l2.lock() += 1;
        }
        token()
    })
    .join()
    .unwrap();
    assert_eq!(lock.moves(), 1, "moved once, to the thread that drives it");
    assert_eq!(owner(lock.bias.load(Ordering::Relaxed)), t);
    assert_eq!(*lock.lock(), 1001);
}

#[test]
fn four_threads_never_hold_it_at_once() {
    // A non-atomic read-modify-write under the lock: a lost update shows
    // two holders at once.
    let lock = Arc::new(BiasedLock::new((0u64, 0u64)));
    let inside = Arc::new(AtomicUsize::new(0));
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let (lock, inside) = (lock.clone(), inside.clone());
            std::thread::spawn(move || {
                for i in 0..20_000u64 {
                    let mut g = lock.lock();
                    assert_eq!(
                        inside.fetch_add(1, std::sync::atomic::Ordering::SeqCst),
                        0,
                        "two holders"
                    );
                    let v = g.0;
                    if i % 64 == 0 {
                        std::hint::spin_loop();
                    }
                    g.0 = v + 1;
                    g.1 = g.1.wrapping_add(v);
                    inside.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(lock.lock().0, 80_000, "no update lost");
    assert!(lock.moves() <= MOVES + 1, "moved {} times", lock.moves());
}

#[test]
fn two_threads_in_strict_turns_leave_the_lock_unbiased() {
    let lock = Arc::new(BiasedLock::new(0u64));
    let (to_b, from_a) = std::sync::mpsc::channel::<()>();
    let (to_a, from_b) = std::sync::mpsc::channel::<()>();
    let rounds = 2 * MOVES as u64;
    let l2 = lock.clone();
    let b = std::thread::spawn(move || {
        for _ in 0..rounds {
            from_a.recv().unwrap();
            *l2.lock() += 1;
            to_a.send(()).unwrap();
        }
    });
    for _ in 0..rounds {
        *lock.lock() += 1;
        to_b.send(()).unwrap();
        from_b.recv().unwrap();
    }
    b.join().unwrap();
    assert_eq!(*lock.lock(), 2 * rounds);
    assert_eq!(lock.moves(), MOVES + 1, "the bias stopped moving");
    assert_eq!(lock.bias.load(Ordering::Relaxed), DISABLED);
}

#[test]
fn a_holder_never_gets_a_second_guard_from_its_own_try_lock() {
    // Every way into the lock, each while this thread holds it: a fresh
    // lock's first entry (by the test-and-set lock, taking the bias), the
    // fast path, and an entry that moved the bias here from another thread.
    let lock = Arc::new(BiasedLock::new(0u64));
    {
        let _g = lock.lock();
        assert!(lock.try_lock().is_none(), "first entry: a second guard");
    }
    {
        let _g = lock.lock();
        assert!(lock.try_lock().is_none(), "fast path: a second guard");
    }
    let l2 = lock.clone();
    std::thread::spawn(move || {
        let _g = l2.lock();
        assert_eq!(l2.moves(), 1, "this entry moved the bias here");
        assert!(l2.try_lock().is_none(), "moved here: a second guard");
    })
    .join()
    .unwrap();
    // And an entry with the bias gone for good.
    let l3 = lock.clone();
    std::thread::spawn(move || {
        for _ in 0..=MOVES {
            let l4 = l3.clone();
            std::thread::spawn(move || *l4.lock() += 1).join().unwrap();
        }
        assert_eq!(l3.bias.load(Ordering::Relaxed), DISABLED);
        let _g = l3.lock();
        assert!(l3.try_lock().is_none(), "unbiased: a second guard");
    })
    .join()
    .unwrap();
}

#[cfg(debug_assertions)]
#[test]
#[should_panic(expected = "already holds")]
fn a_debug_build_panics_when_a_holder_locks_again() {
    let lock = BiasedLock::new(0u64);
    let _g = lock.lock();
    let _again = lock.lock();
}

#[test]
fn three_threads_through_the_moves_of_fresh_locks() {
    // The moves happen once per lock, in its first few entries: a new
    // lock per round, opened on this thread and then taken by two others
    // and this one at once, as a device opened here and driven by two
    // threads (the finish-racing conformance test). A non-atomic counter
    // and a vector's length under the lock show any overlap.
    const ROUNDS: usize = 3_000;
    const PER: u64 = 12;
    fn bump(g: &mut (u64, Vec<u64>)) {
        let v = g.0;
        g.1.push(v);
        g.0 = v + 1;
    }
    for round in 0..ROUNDS {
        let lock = BiasedLock::new((0u64, Vec::<u64>::new()));
        drop(lock.lock()); // opened here: the bias is this thread's
        std::thread::scope(|s| {
            for t in 0..2u64 {
                let lock = &lock;
                s.spawn(move || {
                    for i in 0..PER {
                        match (i + t) % 3 {
                            0 => bump(&mut lock.try_lock().unwrap_or_else(|| lock.lock())),
                            _ => bump(&mut lock.lock()),
                        }
                    }
                });
            }
            for _ in 0..PER {
                bump(&mut lock.lock());
            }
        });
        let g = lock.lock();
        assert_eq!((g.0, g.1.len() as u64), (3 * PER, 3 * PER), "round {round}");
    }
}
