use super::*;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

#[test]
fn wait_returns_on_value_mismatch_and_timeout() {
    let w = AtomicU32::new(1);
    let t = Instant::now();
    wait(&w, 0, Some(Duration::from_secs(5)), Scope::Private);
    assert!(
        t.elapsed() < Duration::from_secs(4),
        "mismatch must not sleep"
    );
    let t = Instant::now();
    wait(&w, 1, Some(Duration::from_millis(20)), Scope::Private);
    assert!(t.elapsed() >= Duration::from_millis(15));
}

#[test]
fn wake_releases_a_sleeper() {
    let w = Arc::new(AtomicU32::new(0));
    let w2 = w.clone();
    let h = std::thread::spawn(move || {
        while w2.load(Ordering::SeqCst) == 0 {
            wait(&w2, 0, Some(Duration::from_secs(10)), Scope::Shared);
        }
    });
    std::thread::sleep(Duration::from_millis(20));
    let t = Instant::now();
    w.store(1, Ordering::SeqCst);
    wake(&w, 1, Scope::Shared);
    h.join().unwrap();
    assert!(t.elapsed() < Duration::from_secs(5));
}
