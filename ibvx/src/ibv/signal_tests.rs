//! Selective signalling over a real RDMA device (soft-RoCE in the VM
//! suite): most small sends are posted unsignalled, the send queue never
//! overflows, and a queue pair that fails with unsignalled sends
//! outstanding still completes every request with a typed error. Without
//! an RDMA device they say `skipped: ...`.

use xdev::{Buffer, Device, Error, Source, TagSel};

use super::device_tests::{job, pattern, unavailable, within};

/// Thousands of small sends through a send queue of 24 entries (4 receive
/// slots per peer), as a burst of non-blocking sends and as a pingpong:
/// nothing overflows (a full queue refuses the post, which fails the
/// peer), everything arrives in order, most sends went unsignalled, and
/// the queue has room again at the end.
#[test]
fn small_sends_never_overflow_the_send_queue() {
    if unavailable().is_some() {
        return;
    }
    let j = job(2, &[("recv_depth", "4")]);
    let (a, b) = (&j.devs[0], &j.devs[1]);
    const N: usize = 3000;
    std::thread::scope(|s| {
        s.spawn(|| {
            let reqs: Vec<_> = (0..N)
                .map(|i| a.isend(Buffer::from(pattern(i, 8)), 1, 1, 0))
                .collect();
            for (i, r) in reqs.into_iter().enumerate() {
                let c = within(r, 60, "burst send");
                assert!(c.status.error.is_none(), "send {i}: {:?}", c.status);
            }
            let mut buf = [0u8; 8];
            for i in 0..N {
                a.send(&pattern(i, 8), 1, 2, 0).unwrap();
                a.recv(&mut buf, Source::Rank(1), TagSel::Tag(3), 0)
                    .unwrap();
                assert_eq!(&buf[..], &pattern(i + 1, 8)[..], "pingpong {i}");
            }
        });
        let mut buf = [0u8; 8];
        for i in 0..N {
            b.recv(&mut buf, Source::Rank(0), TagSel::Tag(1), 0)
                .unwrap();
            assert_eq!(&buf[..], &pattern(i, 8)[..], "burst message {i}");
        }
        for i in 0..N {
            b.recv(&mut buf, Source::Rank(0), TagSel::Tag(2), 0)
                .unwrap();
            assert_eq!(&buf[..], &pattern(i, 8)[..], "pingpong {i}");
            b.send(&pattern(i + 1, 8), 0, 3, 0).unwrap();
        }
    });
    let (unsignaled, room) = a.engine.send_queue(1, 18);
    assert!(
        unsignaled >= (2 * N as u64) / 2,
        "only {unsignaled} of {} sends went unsignalled",
        2 * N
    );
    assert!(room, "send-queue room did not come back");
    for d in &j.devs {
        d.finish().unwrap();
    }
}

/// A queue pair moved to the error state while unsignalled sends are
/// outstanding on it: every request of that peer (a rendezvous send waiting
/// for its reply, a receive, later sends) completes with a typed error and
/// none hangs (the flushes of the unsignalled sends complete nothing).
#[test]
fn a_failed_queue_pair_with_unsignalled_sends_completes_every_request() {
    if unavailable().is_some() {
        return;
    }
    let j = job(2, &[]);
    let (a, b) = (&j.devs[0], &j.devs[1]);
    // Delivered unsignalled sends, then some the peer has not received.
    for i in 0..5 {
        a.send(&pattern(i, 16), 1, 1, 0).unwrap();
    }
    let mut buf = [0u8; 16];
    for i in 0..5 {
        b.recv(&mut buf, Source::Rank(0), TagSel::Tag(1), 0)
            .unwrap();
        assert_eq!(&buf[..], &pattern(i, 16)[..]);
    }
    for i in 0..7 {
        a.send(&pattern(i, 16), 1, 2, 0).unwrap();
    }
    let before = a.engine.send_queue(1, 1).0;
    assert!(before >= 10, "only {before} unsignalled sends");
    let rndv = a.isend(Buffer::from(pattern(9, 200_000)), 1, 3, 0);
    let recv = a.irecv(Buffer::zeroed(16), Source::Rank(1), TagSel::Any, 0);
    a.engine.inject_qp_error(1);
    let typed = |e: &Option<Box<Error>>, what: &str| match e.as_deref() {
        Some(Error::PeerLost { rank: 1, .. }) | Some(Error::Transport { .. }) => {}
        other => panic!("{what}: {other:?}"),
    };
    typed(&within(recv, 30, "receive").status.error, "receive");
    typed(
        &within(rndv, 30, "rendezvous send").status.error,
        "rendezvous send",
    );
    let later = a.isend(Buffer::from(&b"late"[..]), 1, 4, 0);
    typed(&within(later, 30, "later send").status.error, "later send");
    a.finish().unwrap();
}
