//! Faults and lifecycle on the thread device: peers that die or finish,
//! requests that are dropped or forgotten while in flight, a closed device,
//! and opening the device by name through the registry.

use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use shm_ipc::ThreadDevice;

use xdev::devkit::conformance::{finish_while_posting, Watchdog};
use xdev::{Buffer, Config, Device, Error, Registry, Source, TagSel, ANY_SOURCE, ANY_TAG};

fn job(name: &str) -> String {
    format!("faults-{name}-{}", std::process::id())
}

fn open(job: &str, rank: usize, size: usize) -> ThreadDevice {
    ThreadDevice::open(&Config::new(rank, size, job)).expect("open")
}

fn is_lost(e: &Error, rank: usize) -> bool {
    matches!(e, Error::PeerLost { rank: r, .. } if *r == rank)
}

#[test]
fn dead_peer_fails_its_operations_and_others_keep_working() {
    let _dog = Watchdog::arm("dead peer", Duration::from_secs(60));
    let job = job("dead");
    let start = Arc::new(Barrier::new(3));
    let (j0, s0) = (job.clone(), start.clone());
    let survivor = thread::spawn(move || {
        let dev = open(&j0, 0, 3);
        let pending = dev.irecv(Buffer::zeroed(8), Source::Rank(2), ANY_TAG, 1);
        let large = dev.isend(Buffer::from(vec![7u8; 1 << 20]), 2, 1, 1);
        s0.wait();
        // Rank 2 dies without receiving anything.
        let t = Instant::now();
        let c = pending.wait();
        assert!(
            is_lost(c.status.error.as_deref().unwrap(), 2),
            "{:?}",
            c.status
        );
        let c = large.wait();
        assert!(
            is_lost(c.status.error.as_deref().unwrap(), 2),
            "{:?}",
            c.status
        );
        assert_eq!(c.buf.len(), 1 << 20, "buffer comes back");
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "detected in {:?}",
            t.elapsed()
        );
        // New operations to it fail at once.
        assert!(is_lost(&dev.send(b"x", 2, 0, 1).unwrap_err(), 2));
        assert!(is_lost(
            &dev.recv(&mut [0; 4], Source::Rank(2), ANY_TAG, 1)
                .unwrap_err(),
            2
        ));
        // The other peer still works, also through wildcards.
        dev.send(b"alive", 1, 5, 1).unwrap();
        let mut b = [0u8; 5];
        let st = dev.recv(&mut b, ANY_SOURCE, ANY_TAG, 1).unwrap();
        assert_eq!((st.source, &b), (1, b"back!"));
        dev.finish().unwrap();
    });
    let (j1, s1) = (job.clone(), start.clone());
    let other = thread::spawn(move || {
        let dev = open(&j1, 1, 3);
        s1.wait();
        let mut b = [0u8; 5];
        dev.recv(&mut b, Source::Rank(0), TagSel::Tag(5), 1)
            .unwrap();
        dev.send(b"back!", 0, 6, 1).unwrap();
        dev.finish().unwrap();
    });
    let dying = thread::spawn(move || {
        let dev = open(&job, 2, 3);
        start.wait();
        thread::sleep(Duration::from_millis(50));
        drop(dev); // dies: no finish
    });
    dying.join().unwrap();
    survivor.join().unwrap();
    other.join().unwrap();
}

#[test]
fn a_panicking_rank_is_reported_lost_not_hung() {
    let _dog = Watchdog::arm("panicking rank", Duration::from_secs(60));
    let r = std::panic::catch_unwind(|| {
        shm_ipc::ThreadWorld::new(2).run(|dev| {
            if dev.id() == 1 {
                panic!("rank 1 fails");
            }
            dev.recv(&mut [0; 1], Source::Rank(1), ANY_TAG, 0)
        })
    });
    // run() resumes rank 1's panic, after rank 0 ended with PeerLost instead of hanging.
    assert!(r.is_err());
}

#[test]
fn messages_sent_before_finish_are_still_delivered() {
    let job = job("finish");
    let j = job.clone();
    let sender = thread::spawn(move || {
        let dev = open(&j, 1, 2);
        dev.send(b"last words", 0, 3, 0).unwrap();
        dev.finish().unwrap();
        assert!(matches!(dev.send(b"x", 0, 3, 0), Err(Error::Closed)));
        let c = dev.isend(Buffer::from(vec![1u8]), 0, 3, 0).wait();
        assert!(matches!(c.status.error.as_deref(), Some(Error::Closed)));
    });
    let dev = open(&job, 0, 2);
    sender.join().unwrap();
    let mut b = [0u8; 10];
    dev.recv(&mut b, Source::Rank(1), ANY_TAG, 0).unwrap();
    assert_eq!(&b, b"last words");
    let e = dev.recv(&mut b, Source::Rank(1), ANY_TAG, 0).unwrap_err();
    assert!(is_lost(&e, 1), "{e}");
    dev.finish().unwrap();
    dev.finish().unwrap(); // idempotent
    assert!(matches!(
        dev.iprobe(ANY_SOURCE, ANY_TAG, 0),
        Err(Error::Closed)
    ));
}

#[test]
fn finish_waits_for_sends_but_not_for_a_dead_receiver() {
    let _dog = Watchdog::arm("finish with dead peer", Duration::from_secs(60));
    let job = job("finish-dead");
    let dev0 = open(&job, 0, 2);
    let dev1 = open(&job, 1, 2);
    let r = dev0.isend(Buffer::from(vec![3u8; 1 << 20]), 1, 0, 0);
    let dropper = thread::spawn(move || {
        thread::sleep(Duration::from_millis(100));
        drop(dev1);
    });
    dev0.finish().unwrap();
    dropper.join().unwrap();
    assert!(is_lost(r.wait().status.error.as_deref().unwrap(), 1));
}

#[test]
fn dropped_and_forgotten_requests_are_safe() {
    let job = job("forget");
    let dev0 = open(&job, 0, 2);
    let dev1 = open(&job, 1, 2);
    // A rendezvous send whose handle is dropped at once: the device keeps the
    // buffer alive and the receiver still gets the right bytes.
    let payload: Vec<u8> = (0..(1 << 20)).map(|i| (i % 251) as u8).collect();
    drop(dev0.isend(Buffer::from(payload.clone()), 1, 1, 0));
    // A receive whose handle is forgotten: the leaked core keeps its buffer
    // valid while the device writes into it.
    std::mem::forget(dev1.irecv(Buffer::zeroed(1 << 20), Source::Rank(0), TagSel::Tag(2), 0));
    let second = dev0.isend(Buffer::from(payload.clone()), 1, 2, 0);
    let mut got = vec![0u8; 1 << 20];
    dev1.recv(&mut got, Source::Rank(0), TagSel::Tag(1), 0)
        .unwrap();
    // One thread drives both ranks: progress rank 1 until the forgotten
    // receive has taken the second message.
    let mut second = Some(second);
    while let Some(r) = second.take() {
        dev1.iprobe(ANY_SOURCE, ANY_TAG, 0).unwrap();
        if let Err(r) = r.test() {
            second = Some(r);
        }
    }
    assert!(got == payload, "dropped isend delivered wrong bytes");
    dev0.finish().unwrap();
    dev1.finish().unwrap();
}

#[test]
fn open_by_name_through_the_registry() {
    let mut reg = Registry::new();
    shm_ipc::register(&mut reg);
    let job = job("registry");
    assert!(matches!(
        reg.open("no-such-device", &Config::new(0, 1, &job)),
        Err(Error::UnknownDevice(_))
    ));
    assert!(matches!(
        reg.open("thread", &Config::new(3, 2, &job)),
        Err(Error::InvalidRank { .. })
    ));
    let handles: Vec<_> = (0..3)
        .map(|rank| {
            let (reg, job) = (reg.clone(), job.clone());
            thread::spawn(move || {
                let dev: Arc<dyn Device> = reg.open("thread", &Config::new(rank, 3, job)).unwrap();
                assert_eq!((dev.name(), dev.id(), dev.size()), ("thread", rank, 3));
                let next = (rank + 1) % 3;
                dev.send(&[rank as u8], next, 0, 9).unwrap();
                let mut b = [0u8];
                let st = dev.recv(&mut b, ANY_SOURCE, ANY_TAG, 9).unwrap();
                assert_eq!(st.source, (rank + 2) % 3);
                assert_eq!(b[0] as usize, st.source);
                dev.finish().unwrap();
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    // A rank cannot join twice, and options must agree.
    let j2 = job.clone() + "-2";
    let _a = reg.open("thread", &Config::new(0, 2, &j2)).unwrap();
    assert!(matches!(
        reg.open("thread", &Config::new(0, 2, &j2)),
        Err(Error::Config(_))
    ));
    let bad = Config::new(1, 2, &j2).with("eager_limit", 1);
    assert!(matches!(reg.open("thread", &bad), Err(Error::Config(_))));
}

#[test]
fn bad_options_are_config_errors() {
    let c = Config::new(0, 1, job("opts")).with("ring_bytes", "lots");
    assert!(matches!(
        ThreadDevice::open(&c),
        Err(Error::BadOption(b)) if b.key == "ring_bytes"
    ));
    let c = Config::new(0, 1, job("opts1")).with("ring_byte", 8192);
    assert!(matches!(
        ThreadDevice::open(&c),
        Err(Error::UnknownOption(u)) if u.known.contains(&"ring_bytes")
    ));
    let c = Config::new(0, 1, job("opts2")).with("ring_bytes", 16);
    assert!(matches!(ThreadDevice::open(&c), Err(Error::Config(_))));
}

#[test]
fn a_world_outlives_a_rank_that_leaves_before_its_peer_joins() {
    // Rank 0 sends, finishes and drops its device before rank 1 has even
    // opened: the world (and the message in it) must still be there.
    let job = job("early-leaver");
    let dev0 = open(&job, 0, 2);
    dev0.send(b"early", 1, 4, 0).unwrap();
    dev0.finish().unwrap();
    drop(dev0);
    let dev1 = open(&job, 1, 2);
    let mut b = [0u8; 5];
    let st = dev1.recv(&mut b, Source::Rank(0), ANY_TAG, 0).unwrap();
    assert_eq!((&b, st.tag), (b"early", 4));
    dev1.finish().unwrap();
}

/// `finish` racing with `irecv` on other threads of the rank:
/// every request posted completes (with `Closed` once the device is closed),
/// none is left in a queue that `finish` already emptied. Before the closed
/// check moved under the rank lock, about 2 runs in 3 of this test hung.
#[test]
fn finish_racing_with_posts_leaves_no_request_behind() {
    let _dog = Watchdog::arm("finish race", Duration::from_secs(120));
    for i in 0..5_000 {
        let job = job(&format!("finish-race-{i}"));
        let dev = open(&job, 0, 1);
        let what = format!("iteration {i}");
        let _ = finish_while_posting(&dev, 0, Duration::ZERO, Duration::from_secs(5), &what);
    }
}

/// A sender that floods a receiver with rendezvous sends it does not
/// receive: the receiver holds at most `max_unexpected_rndv` of their
/// headers (the rest wait in the ring and in the sender's own queue), and
/// receives then get every message, in order.
#[test]
fn a_flood_of_rendezvous_headers_is_bounded_at_the_receiver() {
    const COUNT: usize = 20_000;
    const CAP: usize = 100;
    let _dog = Watchdog::arm("rendezvous flood", Duration::from_secs(120));
    let job = job("rndv-flood");
    let open_opts = |rank| {
        let cfg = Config::new(rank, 2, job.as_str())
            // Every message by rendezvous: a header in the ring, no credit.
            .with("eager_limit", 0)
            .with("max_unexpected_rndv", CAP);
        ThreadDevice::open(&cfg).expect("open")
    };
    let posted = Barrier::new(2);
    thread::scope(|s| {
        s.spawn(|| {
            let dev = open_opts(0);
            let reqs: Vec<_> = (0..COUNT)
                .map(|i| dev.isend(Buffer::from((i as u32).to_le_bytes().to_vec()), 1, 3, 0))
                .collect();
            posted.wait();
            for r in reqs {
                assert!(r.wait().status.error.is_none());
            }
            dev.finish().unwrap();
        });
        s.spawn(|| {
            let dev = open_opts(1);
            posted.wait();
            // Progress without receiving: probes drain the ring.
            let mut seen = 0;
            for _ in 0..1_000 {
                let _ = dev.iprobe(Source::Rank(0), TagSel::Tag(99), 0).unwrap();
                seen = seen.max(dev.unexpected_messages());
            }
            assert!(seen >= CAP, "the flood reached the receiver ({seen} held)");
            assert!(
                seen <= CAP,
                "{seen} headers held as unexpected, bound {CAP}"
            );
            let mut b = [0u8; 4];
            for i in 0..COUNT {
                let st = dev
                    .recv(&mut b, Source::Rank(0), TagSel::Tag(3), 0)
                    .unwrap();
                assert_eq!((st.count, u32::from_le_bytes(b)), (4, i as u32));
            }
            assert_eq!(dev.unexpected_messages(), 0);
            dev.finish().unwrap();
        });
    });
}

/// A request does not keep its device open: a receive still posted when
/// the device is dropped ends at once with `Closed` and its own buffer (a
/// lent receive: the device's drop closes the engine and takes it out of
/// the queue, so nothing writes the buffer any more), while one the device
/// completed before it went still gives its completion.
#[test]
fn a_request_in_flight_when_its_device_is_dropped_ends_closed() {
    let _dog = Watchdog::arm("request outliving its device", Duration::from_secs(60));
    let job = job("outlive");
    let dev0 = open(&job, 0, 2);
    let dev1 = open(&job, 1, 2);
    let arrived = dev0.irecv(Buffer::zeroed(5), Source::Rank(1), TagSel::Tag(3), 0);
    let never = dev0.irecv(Buffer::zeroed(64), Source::Rank(1), TagSel::Tag(4), 0);
    dev1.send(b"early", 0, 3, 0).unwrap();
    dev1.send(b"later", 0, 5, 0).unwrap();
    // "later" is received after "early" (one sender's messages arrive in
    // order), so the posted receive of "early" is complete by then.
    let mut later = [0u8; 5];
    dev0.recv(&mut later, Source::Rank(1), TagSel::Tag(5), 0)
        .unwrap();
    drop(dev0);
    let c = arrived.wait();
    assert_eq!(
        (&c.buf[..], c.status.error.is_none()),
        (&b"early"[..], true)
    );
    let t = Instant::now();
    let c = never.wait();
    assert!(
        matches!(c.status.error.as_deref(), Some(Error::Closed)),
        "{:?}",
        c.status
    );
    assert_eq!(c.buf.len(), 64, "the receive's own buffer comes back");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    dev1.finish().unwrap();
}
