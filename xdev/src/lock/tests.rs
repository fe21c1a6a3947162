use super::*;

#[test]
fn excludes_concurrent_holders() {
    let lock = RankLock::new((0u64, 0u64));
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..100_000 {
                    let mut g = lock.lock();
                    // A torn update would leave the two halves unequal.
                    g.0 += 1;
                    std::hint::black_box(&mut *g);
                    g.1 += 1;
                }
            });
        }
    });
    let g = lock.lock();
    assert_eq!(*g, (400_000, 400_000));
}

#[test]
fn try_lock_fails_while_held() {
    let lock = RankLock::new(1);
    let g = lock.lock();
    assert!(lock.try_lock().is_none());
    drop(g);
    assert_eq!(*lock.try_lock().unwrap(), 1);
}
