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
