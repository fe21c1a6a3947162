//! Tests of the `ibv` device over a real RDMA device (soft-RoCE in the VM
//! suite): ranks as threads of this process, each with its own device and
//! bootstrap connection. Without an RDMA device they say `skipped: ...`
//! (and fail when `IBVX_REQUIRE_RDMA=1`).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use xdev::bootstrap::{Bootstrap, BootstrapServer, Secret};
use xdev::{Buffer, Config, Device, Error, Source, TagSel};

use super::IbvDevice;

pub(super) fn unavailable() -> Option<String> {
    let why = match crate::verbs::device_list() {
        Ok(list) if !list.is_empty() => return None,
        Ok(_) => "no RDMA device".to_string(),
        Err(e) => e.to_string(),
    };
    assert!(
        std::env::var("IBVX_REQUIRE_RDMA").as_deref() != Ok("1"),
        "IBVX_REQUIRE_RDMA=1 but {why}"
    );
    println!("skipped: {why}");
    Some(why)
}

/// A job of `n` ranks in this process.
pub(super) struct Job {
    pub(super) devs: Vec<IbvDevice>,
    _server: BootstrapServer,
}

pub(super) fn job(n: usize, options: &[(&str, &str)]) -> Job {
    let (server, devs) = open_ranks(n, |_| options.to_vec());
    Job {
        devs: devs.into_iter().map(|d| d.unwrap()).collect(),
        _server: server,
    }
}

/// Opens `n` ranks, rank `r` with `options(r)`; each rank's outcome.
fn open_ranks<'o>(
    n: usize,
    options: impl Fn(usize) -> Vec<(&'o str, &'o str)>,
) -> (BootstrapServer, Vec<xdev::Result<IbvDevice>>) {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let name = format!(
        "ibv-test-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    let secret = Secret::generate().unwrap();
    let server =
        BootstrapServer::start("127.0.0.1:0".parse().unwrap(), n, &name, secret.clone()).unwrap();
    let addr = server.addr();
    let handles: Vec<_> = (0..n)
        .map(|r| {
            let (name, secret) = (name.clone(), secret.clone());
            let options: Vec<(String, String)> = options(r)
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            std::thread::spawn(move || {
                let boot = Bootstrap::connect(addr, r, n, &name, &secret).unwrap();
                let cfg = options
                    .iter()
                    .fold(Config::new(r, n, name.as_str()), |c, (k, v)| c.with(k, v));
                IbvDevice::with_bootstrap(&cfg, boot)
            })
        })
        .collect();
    let devs = handles.into_iter().map(|h| h.join().unwrap()).collect();
    (server, devs)
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

pub(super) fn pattern(seed: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(31) ^ seed) as u8)
        .collect()
}

/// Init and finish in a loop: every verbs object, file descriptor and
/// registration is released each time.
#[test]
fn init_finish_loop_releases_everything() {
    if unavailable().is_some() {
        return;
    }
    let mut baseline = None;
    for round in 0..8 {
        let j = job(2, &[]);
        let (a, b) = (&j.devs[0], &j.devs[1]);
        std::thread::scope(|s| {
            s.spawn(|| {
                a.send(b"small", 1, 1, 0).unwrap();
                a.send(&pattern(round, 100_000), 1, 2, 0).unwrap();
            });
            let mut small = [0u8; 8];
            assert_eq!(
                b.recv(&mut small, Source::Rank(0), TagSel::Any, 0)
                    .unwrap()
                    .count,
                5
            );
            let mut big = vec![0u8; 100_000];
            b.recv(&mut big, Source::Rank(0), TagSel::Tag(2), 0)
                .unwrap();
            assert_eq!(big, pattern(round, 100_000));
        });
        for d in &j.devs {
            d.finish().unwrap();
            assert_eq!(d.cache().stats().transient_bytes, 0);
        }
        drop(j);
        let fds = open_fds();
        match baseline {
            None => baseline = Some(fds),
            Some(b) => assert_eq!(
                fds, b,
                "file descriptors leak across init/finish (round {round})"
            ),
        }
    }
}

/// Waits for `req` up to `secs`, panicking with `what` when it does not
/// complete (so a hang shows where it is).
pub(super) fn within(mut req: xdev::Request, secs: u64, what: &str) -> xdev::devkit::Completion {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        match req.test() {
            Ok(c) => return c,
            Err(r) => req = r,
        }
        assert!(
            Instant::now() < deadline,
            "{what}: no completion within {secs} s"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A queue pair that enters the error state fails the requests that
/// involve its peer with typed errors and without a hang, while the other
/// peers keep working. The broken side notices at once (its completions
/// fail); the other side's pending send to it fails once the broken side
/// leaves (its departure, seen through the bootstrap), not later.
#[test]
fn qp_in_error_state_fails_only_its_peer() {
    if unavailable().is_some() {
        return;
    }
    let Job { devs, _server } = job(3, &[]);
    let mut devs = devs.into_iter();
    let (d0, d1, d2) = (
        devs.next().unwrap(),
        devs.next().unwrap(),
        devs.next().unwrap(),
    );
    d0.engine.inject_qp_error(1);
    std::thread::scope(|s| {
        s.spawn(move || {
            // Rank 0: a receive from rank 1 fails once the fault is seen.
            let r = d0.irecv(Buffer::zeroed(16), Source::Rank(1), TagSel::Any, 0);
            let st = within(r, 30, "rank 0 receive from 1").status;
            assert!(st.error.is_some(), "receive from the broken peer: {st:?}");
            let c = within(
                d0.isend(Buffer::from(&b"x"[..]), 1, 0, 0),
                30,
                "rank 0 send to 1",
            );
            assert!(
                c.status.error.is_some(),
                "send to the broken peer: {:?}",
                c.status
            );
            // Rank 0 still talks to rank 2.
            within(
                d0.isend(Buffer::from(&b"hello 2"[..]), 2, 5, 0),
                30,
                "rank 0 send to 2",
            );
            let r = d0.irecv(Buffer::zeroed(16), Source::Rank(2), TagSel::Tag(6), 0);
            let c = within(r, 30, "rank 0 receive from 2");
            assert!(c.status.error.is_none());
            d0.finish().unwrap();
            drop(d0); // leaves the job
        });
        let d2 = &d2;
        s.spawn(move || {
            let r = d1.isend(Buffer::from(pattern(1, 200_000)), 0, 9, 0);
            // Rank 1 still talks to rank 2 while that send is pending.
            within(
                d1.isend(Buffer::from(&b"hello 2"[..]), 2, 7, 0),
                30,
                "rank 1 send to 2",
            );
            let c = within(r, 60, "rank 1 send to 0");
            match c.status.error.as_deref() {
                Some(Error::PeerLost { rank: 0, .. }) | Some(Error::Transport { .. }) => {}
                other => panic!("send to the broken peer: {other:?}"),
            }
        });
        let r = d2.irecv(Buffer::zeroed(16), Source::Rank(0), TagSel::Tag(5), 0);
        within(r, 30, "rank 2 receive from 0");
        within(
            d2.isend(Buffer::from(&b"back"[..]), 0, 6, 0),
            30,
            "rank 2 send to 0",
        );
        let r = d2.irecv(Buffer::zeroed(16), Source::Rank(1), TagSel::Tag(7), 0);
        within(r, 60, "rank 2 receive from 1");
    });
}

/// A receive buffer that cannot be registered (the pinned-memory budget is
/// exhausted) fails both sides of that rendezvous with typed errors; the
/// device stays usable.
#[test]
fn registration_failure_is_a_typed_error() {
    if unavailable().is_some() {
        return;
    }
    let j = job(2, &[("max_pinned_bytes", "65536")]);
    let (a, b) = (&j.devs[0], &j.devs[1]);
    std::thread::scope(|s| {
        s.spawn(|| {
            let c = a.isend(Buffer::from(vec![7u8; 1 << 20]), 1, 1, 0).wait();
            assert!(
                matches!(
                    c.status.error.as_deref(),
                    Some(Error::Transport { .. }) | Some(Error::ResourceExhausted(_))
                ),
                "{:?}",
                c.status
            );
            a.send(b"still here", 1, 2, 0).unwrap();
        });
        let c = b
            .irecv(Buffer::zeroed(1 << 20), Source::Rank(0), TagSel::Tag(1), 0)
            .wait();
        assert!(
            matches!(c.status.error.as_deref(), Some(Error::ResourceExhausted(_))),
            "{:?}",
            c.status
        );
        let mut buf = [0u8; 32];
        let st = b
            .recv(&mut buf, Source::Rank(0), TagSel::Tag(2), 0)
            .unwrap();
        assert_eq!(&buf[..st.count], b"still here");
    });
    for d in &j.devs {
        d.finish().unwrap();
    }
}

/// The stale-registration stress: buffers freed and reallocated (leased
/// chunks reused; heap buffers landing at the same address) and sent again
/// with new contents; every message arrives with its own contents.
#[test]
fn free_reallocate_resend_never_sends_stale_data() {
    if unavailable().is_some() {
        return;
    }
    let j = job(2, &[]);
    let (a, b) = (&j.devs[0], &j.devs[1]);
    const ROUNDS: usize = 120;
    let len = 256 * 1024;
    let mut addrs = HashSet::new();
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut buf = vec![0u8; len];
            for i in 0..ROUNDS {
                let st = b
                    .recv(&mut buf, Source::Rank(0), TagSel::Tag(i as i32), 0)
                    .unwrap();
                assert_eq!(st.count, len);
                assert!(buf == pattern(i, len), "round {i}: stale or corrupt data");
            }
        });
        for i in 0..ROUNDS {
            let data = pattern(i, len);
            let buf = if i % 2 == 0 {
                let mut lease = a.alloc_buffer(len).unwrap();
                lease.copy_from_slice(&data);
                lease
            } else {
                let v = data.clone();
                addrs.insert(v.as_ptr() as usize);
                Buffer::from(v)
            };
            let c = a.isend(buf, 1, i as i32, 0).wait();
            assert!(c.status.error.is_none(), "{:?}", c.status);
            drop(c); // frees the heap buffer or returns the lease
        }
    });
    let st = a.cache().stats();
    assert!(st.hits > 0, "leased chunks were reused: {st:?}");
    assert!(
        st.user_misses >= (ROUNDS / 2) as u64,
        "each heap buffer was registered anew (a new identity): {st:?}"
    );
    assert_eq!(st.user_entries, 0, "freed buffers left no entry: {st:?}");
    assert!(
        addrs.len() < ROUNDS / 2,
        "some heap buffer reused an address"
    );
    assert_eq!(st.transient_bytes, 0);
    for d in &j.devs {
        d.finish().unwrap();
    }
}

/// Ranks that disagree on the protocol parameters refuse to start, each
/// with a configuration error naming the other rank's values.
#[test]
fn different_protocol_parameters_refuse_to_start() {
    if unavailable().is_some() {
        return;
    }
    let (_server, devs) = open_ranks(2, |r| {
        if r == 0 {
            vec![("eager_limit", "4096")]
        } else {
            vec![]
        }
    });
    for (r, d) in devs.into_iter().enumerate() {
        match d {
            Err(Error::Config(what)) => assert!(what.contains("eager_limit"), "rank {r}: {what}"),
            Err(e) => panic!("rank {r}: {e}"),
            Ok(_) => panic!("rank {r} started with mismatched parameters"),
        }
    }
}

/// What a peer could not legitimately send is a protocol violation: the
/// receiver fails that peer with `Error::Protocol` saying what was wrong
/// (a receive from it fails), and neither crashes nor hangs.
#[test]
fn hostile_frames_fail_their_sender_with_protocol_errors() {
    use super::wire::{encode, Body, Header, MAX_CONTROL_LEN};
    if unavailable().is_some() {
        return;
    }
    let frame = |head: Header, body: Body<'_>| {
        let mut f = vec![0u8; MAX_CONTROL_LEN];
        let n = encode(&head, &body, &mut f);
        f.truncate(n);
        if let Body::Eager(p) = body {
            f.extend_from_slice(p);
        }
        f
    };
    let id = |id| Header {
        id,
        ..Header::default()
    };
    let mut unknown_kind = frame(Header::default(), Body::Credit);
    unknown_kind[0] = 99;
    let reply = Body::RndzReply {
        rid: 1,
        addr: 0x1000,
        len: 10,
        rkey: 5,
    };
    let too_much_credit = Header {
        slots: 1000,
        ..Header::default()
    };
    let big = vec![1u8; 8192];
    let eager = |p| {
        frame(
            Header {
                context: 7,
                ..Header::default()
            },
            Body::Eager(p),
        )
    };
    let cases: Vec<(&str, Vec<Vec<u8>>)> = vec![
        ("unknown message kind 99", vec![unknown_kind]),
        (
            "RNDZ_REPLY for unknown send 999",
            vec![frame(id(999), reply)],
        ),
        (
            "RNDZ_END for unknown receive 4242",
            vec![frame(id(4242), Body::RndzEnd)],
        ),
        ("ACK for unknown send 77", vec![frame(id(77), Body::Ack)]),
        (
            "returned more credit than it was given",
            vec![frame(too_much_credit, Body::Credit)],
        ),
        // Two eager messages nobody receives, beyond an 8 KiB window.
        (
            "eager data beyond its window",
            vec![eager(&big[..]), eager(&big[..])],
        ),
    ];
    for (what, frames) in cases {
        let j = job(2, &[("eager_window", "8192")]);
        let (a, b) = (&j.devs[0], &j.devs[1]);
        let r = a.irecv(Buffer::zeroed(16), Source::Rank(1), TagSel::Any, 0);
        for f in &frames {
            b.engine.post_raw(0, f);
        }
        let c = within(r, 30, what);
        match c.status.error.as_deref() {
            Some(Error::Protocol { rank: 1, what: w }) => {
                assert!(w.contains(what), "expected {what:?}, got {w:?}")
            }
            other => panic!("{what}: {other:?}"),
        }
    }
}

/// After a rendezvous into `buf` (a user's heap buffer, or memory leased
/// from the device), a peer that kept the rkey of the grant writes nothing:
/// the raw write fails, and the receiver's memory keeps its bytes.
fn old_rkey_writes_nothing(leased: bool) {
    if unavailable().is_some() {
        return;
    }
    let j = job(2, &[("eager_limit", "1024")]);
    let (a, b) = (&j.devs[0], &j.devs[1]);
    let len = 64 << 10;
    let data = vec![0x42u8; len];
    let target = if leased {
        a.alloc_buffer(len).unwrap()
    } else {
        Buffer::zeroed(len)
    };
    let got = std::thread::scope(|s| {
        s.spawn(|| b.send(&data, 0, 1, 0).unwrap());
        a.irecv(target, Source::Rank(1), TagSel::Tag(1), 0).wait()
    });
    assert!(got.status.error.is_none(), "{:?}", got.status);
    assert!(got.buf[..] == data[..]);
    let grant = a.engine.last_grant().expect("the receiver granted a write");
    // The receive is over (its grant deregistered); its memory is still
    // ours and mapped (we hold `got.buf`).
    let r = b.engine.write_raw(0, grant, &[0xee; 4096]);
    assert!(
        r.is_err(),
        "a write with the rendezvous's old rkey succeeded"
    );
    println!("write with the old rkey: {}", r.unwrap_err());
    assert!(
        got.buf.iter().all(|&x| x == 0x42),
        "the receiver's memory changed"
    );
}

#[test]
fn an_old_rkey_writes_nothing_after_a_rendezvous_into_a_heap_buffer() {
    old_rkey_writes_nothing(false);
}

#[test]
fn an_old_rkey_writes_nothing_after_a_rendezvous_into_leased_memory() {
    old_rkey_writes_nothing(true);
}

/// Memory leased from the device (its registration cache) is registered for
/// local access only: its rkey lets a peer write nothing.
#[test]
fn leased_memory_grants_no_remote_write() {
    if unavailable().is_some() {
        return;
    }
    let j = job(2, &[]);
    let (a, b) = (&j.devs[0], &j.devs[1]);
    let mut lease = a.cache().lease(8192).unwrap();
    // SAFETY: the lease's chunk is ours, 8192 bytes.
    unsafe { std::ptr::write_bytes(lease.as_mut_ptr(), 0x17, 8192) };
    let own = lease.registration().remote(lease.as_ptr());
    let r = b.engine.write_raw(0, own, &[0xee; 4096]);
    assert!(r.is_err(), "a write with a cached chunk's rkey succeeded");
    // SAFETY: as above; nothing writes the chunk now.
    let bytes = unsafe { std::slice::from_raw_parts(lease.as_ptr(), 8192) };
    assert!(bytes.iter().all(|&x| x == 0x17), "the chunk changed");
}

/// A blocking send that unwinds after it was published still waits until
/// the NIC has read its buffer: the caller reusing its block at once
/// changes nothing the receiver gets.
#[test]
fn a_blocking_send_that_unwinds_still_waits_for_the_nic() {
    if unavailable().is_some() {
        return;
    }
    let j = job(2, &[("eager_limit", "1024")]);
    let (a, b) = (&j.devs[0], &j.devs[1]);
    let want: Vec<u8> = (0..65_536u32).map(|i| (i * 7 % 251) as u8).collect();
    let (st, got) = std::thread::scope(|s| {
        let receiver = s.spawn(|| {
            std::thread::sleep(Duration::from_millis(50));
            let mut buf = vec![0u8; want.len()];
            let st = a.recv(&mut buf, Source::Rank(1), TagSel::Tag(3), 0);
            (st, buf)
        });
        let mut block = want.clone();
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            super::engine::PANIC_AFTER_PUBLISH.with(|p| p.set(true));
            b.send(&block, 0, 3, 0)
        }));
        assert!(unwound.is_err(), "the injected panic unwound the send");
        block.fill(0xee);
        while !receiver.is_finished() {
            b.progress();
        }
        receiver.join().unwrap()
    });
    assert_eq!(st.unwrap().count, want.len());
    assert!(got == want, "the receiver got the reused block's bytes");
    for d in &j.devs {
        d.finish().unwrap();
    }
}

/// `finish` racing with receives posted from other threads: every request
/// completes (with `Closed`), none is left behind in a queue `finish`
/// already emptied.
#[test]
fn finish_racing_with_posts_leaves_no_request_behind() {
    if unavailable().is_some() {
        return;
    }
    for i in 0..40 {
        let j = job(2, &[]);
        let what = format!("iteration {i}");
        let _ = xdev::devkit::conformance::finish_while_posting(
            &j.devs[0],
            1,
            Duration::ZERO,
            Duration::from_secs(10),
            &what,
        );
        let _ = j.devs[1].finish();
    }
}

/// Rendezvous starts are bounded per sender: a flood of raw `RNDZ_START`s
/// that nothing receives fails its sender once past the window, with the
/// receiver holding no more than the window; an honest sender beyond the
/// window waits instead, and everything arrives in order.
#[test]
fn rendezvous_starts_are_bounded_per_sender() {
    use super::wire::{encode, Body, Header, MAX_CONTROL_LEN};
    if unavailable().is_some() {
        return;
    }
    super::engine::RNDV_WINDOW_FOR_TESTS.store(16, std::sync::atomic::Ordering::Relaxed);
    struct Restore;
    impl Drop for Restore {
        fn drop(&mut self) {
            super::engine::RNDV_WINDOW_FOR_TESTS.store(0, std::sync::atomic::Ordering::Relaxed);
        }
    }
    let _restore = Restore;
    // The hostile flood.
    let j = job(2, &[]);
    let (a, b) = (&j.devs[0], &j.devs[1]);
    let r = a.irecv(Buffer::zeroed(16), Source::Rank(1), TagSel::Tag(9), 0);
    for i in 0..17u64 {
        let mut f = vec![0u8; MAX_CONTROL_LEN];
        let head = Header {
            id: 1000 + i,
            tag: 5,
            ..Header::default()
        };
        let n = encode(&head, &Body::RndzStart { len: 1 << 20 }, &mut f);
        f.truncate(n);
        let t = Instant::now();
        while !b.engine.has_credit(0) {
            a.progress();
            b.progress();
            assert!(t.elapsed() < Duration::from_secs(30), "no credit");
        }
        b.engine.post_raw(0, &f);
        a.progress();
        assert!(
            a.engine.rendezvous_counts(1).0 <= 16,
            "held beyond the window"
        );
    }
    let c = within(r, 30, "flood");
    match c.status.error.as_deref() {
        Some(Error::Protocol { rank: 1, what }) => {
            assert!(what.contains("unfinished rendezvous"), "{what}")
        }
        other => panic!("the flooding sender was not failed: {other:?}"),
    }
    drop(j);
    // An honest sender past the window.
    let j = job(2, &[("eager_limit", "1024")]);
    let (a, b) = (&j.devs[0], &j.devs[1]);
    let sends: Vec<_> = (0..40u8)
        .map(|i| b.isend(Buffer::from(vec![i; 4096]), 0, 2, 0))
        .collect();
    assert!(b.engine.rendezvous_counts(0).1 <= 16, "the window holds");
    std::thread::scope(|s| {
        s.spawn(|| {
            for r in sends {
                assert!(r.wait().status.error.is_none());
            }
        });
        for i in 0..40u8 {
            let mut buf = vec![0u8; 4096];
            a.recv(&mut buf, Source::Rank(1), TagSel::Tag(2), 0)
                .unwrap();
            assert!(buf.iter().all(|&x| x == i), "message {i} out of order");
        }
    });
    assert_eq!(a.engine.rendezvous_counts(1).0, 0);
    for d in &j.devs {
        d.finish().unwrap();
    }
}
