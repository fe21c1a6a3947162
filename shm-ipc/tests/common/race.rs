//! `finish` racing with receives posted by other threads of the rank:
//! shared by the thread device's fault tests and the process device's unit
//! tests (included by path in both).

use std::sync::Barrier;
use std::time::{Duration, Instant};

use xdev::{Buffer, Device, Error, Rank, Source, TagSel};

/// Two threads post receives from `peer` on `dev` until one fails with
/// `Closed`, while this thread calls `finish`; every request they posted
/// must then end (`i`: the iteration, for the message).
pub fn finish_while_posting(dev: &impl Device, peer: Rank, i: usize) {
    let go = Barrier::new(3);
    let posted = std::thread::scope(|s| {
        let poster = |tag: i32| {
            let go = &go;
            move || {
                let mut reqs = Vec::new();
                go.wait();
                loop {
                    let r = dev.irecv(Buffer::zeroed(8), Source::Rank(peer), TagSel::Tag(tag), 0);
                    match r.test() {
                        Ok(c) if c.status.error == Some(Error::Closed) => break,
                        Ok(c) => panic!("unexpected completion {:?}", c.status),
                        Err(r) => reqs.push(r),
                    }
                }
                reqs
            }
        };
        let a = s.spawn(poster(1));
        let b = s.spawn(poster(2));
        go.wait();
        let _ = dev.finish();
        let mut all = a.join().unwrap();
        all.extend(b.join().unwrap());
        all
    });
    for mut r in posted {
        let t = Instant::now();
        loop {
            match r.test() {
                Ok(_) => break,
                Err(back) => r = back,
            }
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "iteration {i}: a request posted during finish never completed"
            );
            std::thread::yield_now();
        }
    }
}
