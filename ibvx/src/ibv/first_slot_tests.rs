//! The first slot of a blocking receive (see the engine's `Local::first`)
//! over a real RDMA device (soft-RoCE in the VM suite): it is matched
//! before receives posted after it, a wildcard in it takes a self-send,
//! and it fails with a typed error when its peer fails or its device is
//! finished. Without an RDMA
//! device they say `skipped: ...`.

use std::time::{Duration, Instant};

use xdev::{Buffer, Device, Source, TagSel};

use super::device_tests::{job, unavailable, within};
use super::IbvDevice;

/// Waits until `dev` has a blocking receive in its first slot and
/// `queued` receives in its matching engine.
fn wait_posted(dev: &IbvDevice, queued: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while dev.engine.posted() != (true, queued) {
        assert!(
            Instant::now() < deadline,
            "posted receives: {:?}, want (true, {queued})",
            dev.engine.posted()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A blocking receive waiting in the first slot gets the first of two
/// messages that also match a non-blocking receive posted after it (MPI's
/// order of posted receives), and the later receive gets the second.
#[test]
fn the_first_slot_matches_before_receives_posted_after_it() {
    if unavailable().is_some() {
        return;
    }
    let j = job(2, &[]);
    let (a, b) = (&j.devs[0], &j.devs[1]);
    std::thread::scope(|s| {
        let first = s.spawn(|| {
            let mut buf = [0u8; 8];
            let st = b
                .recv(&mut buf, Source::Rank(0), TagSel::Tag(5), 0)
                .unwrap();
            (st.count, buf)
        });
        wait_posted(b, 0);
        let later = b.irecv(Buffer::zeroed(8), Source::Any, TagSel::Tag(5), 0);
        wait_posted(b, 1);
        a.send(b"message1", 1, 5, 0).unwrap();
        a.send(b"message2", 1, 5, 0).unwrap();
        let (n, got) = first.join().unwrap();
        assert_eq!((n, &got), (8, b"message1"), "the first slot's message");
        let c = within(later, 30, "the later receive");
        assert!(c.status.error.is_none(), "{:?}", c.status);
        assert_eq!(&c.buf[..], b"message2", "the later receive's message");
        assert_eq!(b.engine.posted(), (false, 0), "receives left behind");
    });
    for d in &j.devs {
        d.finish().unwrap();
    }
}

/// A wildcard blocking receive in the first slot takes a self-send made
/// from another thread while it waits.
#[test]
fn a_wildcard_in_the_first_slot_takes_a_self_send() {
    if unavailable().is_some() {
        return;
    }
    let j = job(2, &[]);
    let a = &j.devs[0];
    std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            let mut buf = [0u8; 4];
            let st = a.recv(&mut buf, Source::Any, TagSel::Any, 3).unwrap();
            (st.source, st.tag, buf)
        });
        wait_posted(a, 0);
        a.send(b"self", 0, 11, 3).unwrap();
        assert_eq!(waiter.join().unwrap(), (0, 11, *b"self"));
    });
    for d in &j.devs {
        d.finish().unwrap();
    }
}

/// Rank 1 of a fresh 2-rank job blocks in a receive from rank 0 in its
/// first slot, `end` is done to it, and the receive's result comes back;
/// no receive may be left behind in rank 1's engine.
fn first_slot_receive_ended_by(end: impl FnOnce(&IbvDevice)) -> xdev::Result<xdev::Status> {
    let j = job(2, &[]);
    let b = &j.devs[1];
    let r = std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            let mut buf = [0u8; 8];
            b.recv(&mut buf, Source::Rank(0), TagSel::Tag(1), 0)
        });
        wait_posted(b, 0);
        end(b);
        waiter.join().unwrap()
    });
    assert_eq!(b.engine.posted(), (false, 0), "receives left behind");
    let _ = j.devs[0].finish();
    let _ = j.devs[1].finish();
    r
}

/// A blocking receive in the first slot fails with a typed error, instead
/// of waiting forever, when its peer's queue pair fails.
#[test]
fn the_first_slot_fails_with_its_peer() {
    if unavailable().is_some() {
        return;
    }
    let r = first_slot_receive_ended_by(|b| b.engine.inject_qp_error(0));
    assert!(r.is_err(), "the receive from the failed peer: {r:?}");
}

/// A blocking receive in the first slot ends with `Error::Closed` when its
/// device is finished from another thread, and leaves nothing behind.
#[test]
fn the_first_slot_fails_with_closed_at_finish() {
    if unavailable().is_some() {
        return;
    }
    let r = first_slot_receive_ended_by(|b| {
        let _ = b.finish();
    });
    assert_eq!(r.err(), Some(xdev::Error::Closed), "the receive at finish");
}
