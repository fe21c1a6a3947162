//! `finish` racing with receives that other threads of the rank post: what
//! each device's own tests check (the thread, shm, ibv and psm devices).

use std::sync::Barrier;
use std::time::{Duration, Instant};

use crate::{Buffer, Device, Error, Rank, Result, Source, TagSel};

/// Two threads post receives from `peer` on `dev` until one fails with
/// `Closed`, while this thread waits `pause` and calls `finish`; every
/// request they posted must then complete within `limit` (panics naming
/// `what` otherwise). Returns what `finish` returned.
pub fn finish_while_posting(
    dev: &dyn Device,
    peer: Rank,
    pause: Duration,
    limit: Duration,
    what: &str,
) -> Result<()> {
    let go = Barrier::new(3);
    let (finished, posted) = std::thread::scope(|s| {
        let poster = |tag: i32| {
            let go = &go;
            move || {
                let mut reqs = Vec::new();
                go.wait();
                loop {
                    let r = dev.irecv(Buffer::zeroed(8), Source::Rank(peer), TagSel::Tag(tag), 0);
                    match r.test() {
                        Ok(c) if c.status.error.as_deref() == Some(&Error::Closed) => break,
                        Ok(c) => panic!("{what}: unexpected completion {:?}", c.status),
                        Err(r) => reqs.push(r),
                    }
                }
                reqs
            }
        };
        let a = s.spawn(poster(1));
        let b = s.spawn(poster(2));
        go.wait();
        std::thread::sleep(pause);
        let finished = dev.finish();
        let mut all = a.join().expect("a posting thread panicked");
        all.extend(b.join().expect("a posting thread panicked"));
        (finished, all)
    });
    for mut r in posted {
        let t = Instant::now();
        loop {
            match r.test() {
                Ok(_) => break,
                Err(back) => r = back,
            }
            assert!(
                t.elapsed() < limit,
                "{what}: a request posted during finish never completed"
            );
            std::thread::yield_now();
        }
    }
    finished
}
