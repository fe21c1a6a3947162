use super::*;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use xdev::devkit::conformance::finish_while_posting;

use xdev::{Buffer, Error, Rank, Request, Source, Status, TagSel};

use crate::ring::Header;
use crate::wire::*;

use xdev::bootstrap::{BootstrapServer, Secret};

mod mapped;
mod split;

/// Two ranks of one job as two devices in this process (threads).
fn pair(options: &[(&str, &str)]) -> (ProcessDevice, ProcessDevice) {
    static JOBS: AtomicU64 = AtomicU64::new(0);
    let job = format!(
        "unit-{}-{}",
        std::process::id(),
        JOBS.fetch_add(1, Ordering::Relaxed)
    );
    let secret = Secret::generate().unwrap();
    let server =
        BootstrapServer::start("127.0.0.1:0".parse().unwrap(), 2, &job, secret.clone()).unwrap();
    let addr = server.addr();
    let mut devs: Vec<ProcessDevice> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let (job, secret) = (job.clone(), secret.clone());
                s.spawn(move || {
                    let boot = Bootstrap::connect(addr, rank, 2, &job, &secret).unwrap();
                    let mut cfg = Config::new(rank, 2, job);
                    for (k, v) in options {
                        cfg = cfg.with(k, v);
                    }
                    ProcessDevice::with_bootstrap(&cfg, boot).unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    std::mem::forget(server); // lives as long as the test process
    let d1 = devs.pop().unwrap();
    (devs.pop().unwrap(), d1)
}

/// Rank 1 pushes a raw entry into its ring to rank 0, bypassing its
/// protocol (a buggy or hostile peer).
fn raw_push(from: &ProcessDevice, to: Rank, h: Header, payload: &[u8]) -> bool {
    let mut l = from.engine.lock();
    let ok = from
        .engine
        .producer(&mut l, to)
        .try_push(&h, payload)
        .unwrap();
    from.engine.m.sh.wake(to);
    ok
}

fn recv_from_1(d0: &ProcessDevice) -> Result<Status> {
    let mut buf = [0u8; 256];
    d0.recv(&mut buf, Source::Rank(1), TagSel::Any, 1)
}

fn assert_violation(d0: &ProcessDevice, needle: &str) {
    match recv_from_1(d0) {
        Err(Error::Protocol { rank: 1, what }) => assert!(what.contains(needle), "{what}"),
        other => panic!("expected a protocol violation by rank 1, got {other:?}"),
    }
    // Rank 1 is cut off; rank 0 itself still works.
    d0.send(b"self", 0, 5, 1).unwrap();
    let mut b = [0u8; 4];
    d0.recv(&mut b, Source::Rank(0), TagSel::Tag(5), 1).unwrap();
    assert_eq!(&b, b"self");
    // New operations involving rank 1 fail with the same cause.
    assert!(matches!(
        d0.send(b"x", 1, 0, 1),
        Err(Error::Protocol { rank: 1, .. })
    ));
    let r = d0
        .irecv(Buffer::zeroed(4), Source::Rank(1), TagSel::Any, 1)
        .wait();
    assert!(matches!(
        r.status.error.as_deref(),
        Some(Error::Protocol { rank: 1, .. })
    ));
}

#[test]
fn an_irecv_leaves_its_cma_copy_to_the_next_progress() {
    // A posting call that copied a large message it matched would keep
    // its caller from posting the sends its peer waits for (measured:
    // osu_bibw at 1 MiB went from 5.0 to 10.7 GB/s without it).
    let (d0, d1) = pair(&[("cma", "on")]);
    assert_eq!(d0.rendezvous(), &RendezvousPath::Cma);
    let big: Vec<u8> = (0..1_000_000u32).map(|i| (i % 253) as u8).collect();
    for (round, probe_first) in [(0, false), (1, true), (2, false)] {
        let send = d1.isend(Buffer::from(big.clone()), 0, 5, 3);
        if probe_first {
            // In the unexpected queue rather than the ring.
            while d0
                .iprobe(Source::Rank(1), TagSel::Tag(5), 3)
                .unwrap()
                .is_none()
            {}
        } else {
            while !d0.engine.m.sh.mine.ring(1).has_message() {}
        }
        // Round 2: another receive is posted first (the queued path).
        let other =
            (round == 2).then(|| d0.irecv(Buffer::zeroed(8), Source::Rank(1), TagSel::Tag(6), 3));
        let r = d0.irecv(
            Buffer::zeroed(big.len()),
            Source::Rank(1),
            TagSel::Tag(5),
            3,
        );
        assert_eq!(d0.engine.lock().m.copies.len(), 1, "round {round}");
        let Err(r) = r.take_if_done() else {
            panic!("round {round}: copied inside irecv");
        };
        // (The sender writes half of it: it must make progress too.)
        let got = std::thread::scope(|s| {
            s.spawn(|| assert!(send.wait().status.error.is_none()));
            r.wait()
        });
        assert!(got.status.error.is_none(), "{:?}", got.status);
        assert!(got.buf[..] == big[..], "round {round}: wrong bytes");
        if let Some(o) = other {
            assert!(d1.send(&[7; 8], 0, 6, 3).is_ok());
            assert!(o.wait().status.error.is_none());
        }
    }
    d0.finish().unwrap();
    d1.finish().unwrap();
}

#[test]
fn finish_does_the_copies_left_by_irecv() {
    let (d0, d1) = pair(&[("cma", "on")]);
    let big = vec![0xA5u8; 300_000];
    let send = d1.isend(Buffer::from(big.clone()), 0, 5, 3);
    while !d0.engine.m.sh.mine.ring(1).has_message() {}
    let r = d0.irecv(
        Buffer::zeroed(big.len()),
        Source::Rank(1),
        TagSel::Tag(5),
        3,
    );
    let Err(r) = r.take_if_done() else {
        panic!("copied inside irecv");
    };
    std::thread::scope(|s| {
        s.spawn(|| d1.finish().unwrap());
        d0.finish().unwrap();
    });
    let got = r.wait();
    assert!(got.status.error.is_none(), "{:?}", got.status);
    assert!(got.buf[..] == big[..]);
    assert!(send.wait().status.error.is_none());
}

#[test]
fn an_irecv_takes_messages_already_here_and_streams_pipelined_ones() {
    // cma=off: a large message goes by the pipelined copy. Each kind
    // arrives before its receive is posted, once still in the ring and
    // once already moved to the unexpected queue (by a probe).
    let (d0, d1) = pair(&[("cma", "off"), ("eager_limit", "1024")]);
    let big: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    for (round, probe_first) in [(0, false), (1, true)] {
        let small = d1.isend(Buffer::from(vec![round as u8; 100]), 0, 1, 9);
        let large = d1.isend(Buffer::from(big.clone()), 0, 2, 9);
        assert!(small.wait().status.error.is_none());
        let (small_st, large_buf) = std::thread::scope(|s| {
            s.spawn(|| {
                // Give rank 0 the large message (it streams as rank 0
                // asks for fragments).
                while !d1.engine.lock().m.sends.is_empty() || !large_done(&d1) {
                    d1.progress();
                }
            });
            if probe_first {
                while d0
                    .iprobe(Source::Rank(1), TagSel::Tag(2), 9)
                    .unwrap()
                    .is_none()
                {}
            } else {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            let small = d0
                .irecv(Buffer::zeroed(100), Source::Rank(1), TagSel::Tag(1), 9)
                .wait();
            let large = d0
                .irecv(
                    Buffer::zeroed(big.len()),
                    Source::Rank(1),
                    TagSel::Tag(2),
                    9,
                )
                .wait();
            (small, large)
        });
        assert!(small_st.status.error.is_none(), "{:?}", small_st.status);
        assert_eq!(&small_st.buf[..], &[round as u8; 100][..]);
        assert!(large_buf.status.error.is_none(), "{:?}", large_buf.status);
        assert_eq!(large_buf.status.count, big.len());
        assert!(large_buf.buf[..] == big[..], "round {round}: wrong bytes");
        drop(large);
    }
    d0.finish().unwrap();
    d1.finish().unwrap();
}

fn large_done(d: &ProcessDevice) -> bool {
    d.engine.tracker.outstanding_sends() == 0
}

#[test]
fn finish_racing_with_posts_leaves_no_request_behind() {
    for i in 0..200 {
        let (d0, d1) = pair(&[]);
        let what = format!("iteration {i}");
        let _ = finish_while_posting(
            &d0,
            1,
            std::time::Duration::ZERO,
            std::time::Duration::from_secs(5),
            &what,
        );
        let _ = d1.finish();
    }
}

/// Clears CAP_SYS_PTRACE from this process's effective capabilities
/// (capget/capset through rustix, which issues the raw system calls with
/// stack buffers: async-signal-safe, for a forked child).
fn drop_cap_sys_ptrace() {
    use rustix::thread::{capabilities, set_capabilities, CapabilitySet};
    let Ok(mut caps) = capabilities(None) else {
        return;
    };
    // Effective only: Yama asks whether the tracer is capable (the
    // effective set), while the commoncap check wants the tracee's
    // permitted set to be a subset of the tracer's permitted set, which
    // a child that also dropped it from its permitted set would fail
    // whatever Yama says (root parent, full permitted set).
    caps.effective.remove(CapabilitySet::SYS_PTRACE);
    let _ = set_capabilities(None, caps);
}

#[test]
fn ptrace_is_allowed_only_while_cma_is_used() {
    // Yama (ptrace_scope 1) is what PR_SET_PTRACER talks to: without it
    // any same-user process may attach whatever we do.
    match std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope") {
        Err(_) => {
            println!(
                "skipped: no Yama LSM in this kernel, PR_SET_PTRACER has no effect \
                 (the VM suite runs this with ptrace_scope 1)"
            );
            return;
        }
        Ok(s) if s.trim() != "1" => {
            println!("skipped: Yama ptrace_scope is {}, not 1", s.trim());
            return;
        }
        Ok(_) => {}
    }
    let secret = Box::new(0x5eed_cafe_u64);
    let addr = &*secret as *const u64 as u64;
    // A child (not an ancestor of us) reads 8 bytes of ours by CMA.
    let child_reads = || -> bool {
        // SAFETY: the child only makes a system call and `_exit`s, both
        // async-signal-safe, as required after fork in a threaded process.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            // Root's CAP_SYS_PTRACE passes Yama's check whatever we
            // declared: drop it, as an ordinary same-user process.
            drop_cap_sys_ptrace();
            let mut got = 0u64;
            let local = libc::iovec {
                iov_base: (&mut got as *mut u64).cast(),
                iov_len: 8,
            };
            let remote = libc::iovec {
                iov_base: addr as *mut libc::c_void,
                iov_len: 8,
            };
            // SAFETY: the local iovec points at our own `got`; the remote
            // one is checked by the kernel.
            let n = unsafe { libc::process_vm_readv(libc::getppid(), &local, 1, &remote, 1, 0) };
            let code = if n == 8 && got == 0x5eed_cafe { 0 } else { 1 };
            // SAFETY: ends the forked child without running anything else.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0
    };
    assert!(!child_reads(), "no grant yet: a child cannot attach");
    let (d0, d1) = pair(&[("cma", "on")]);
    assert_eq!(d0.rendezvous(), &RendezvousPath::Cma);
    assert!(child_reads(), "CMA in use: siblings may read us");
    d0.finish().unwrap();
    assert!(child_reads(), "one device still uses CMA");
    d1.finish().unwrap();
    assert!(!child_reads(), "both finished: the grant is gone");
    let (d0, d1) = pair(&[("cma", "off")]);
    assert!(!child_reads(), "cma=off never opens us");
    drop((d0, d1));
    drop(secret);
}

thread_local! {
    /// Makes the next pipelined transfer into a blocking receive of
    /// this thread panic right after it is registered.
    pub(super) static PANIC_AFTER_STREAM: std::cell::Cell<bool> =
        const { std::cell::Cell::new(false) };
}

#[test]
fn a_blocking_recv_that_unwinds_is_written_no_more() {
    let (d0, d1) = pair(&[("cma", "off"), ("eager_limit", "1024")]);
    let data = vec![0x5au8; 200_000];
    let send = d1.isend(Buffer::from(data), 0, 4, 0);
    let mut block = vec![0u8; 200_000];
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        PANIC_AFTER_STREAM.with(|p| p.set(true));
        d0.recv(&mut block, Source::Rank(1), TagSel::Tag(4), 0)
    }));
    assert!(unwound.is_err(), "the injected panic unwound the receive");
    // The caller owns its block again: nothing may write it now, even
    // as both engines go on (the sender streams to an abandoned id).
    block.fill(0xaa);
    let t = std::time::Instant::now();
    while t.elapsed() < std::time::Duration::from_millis(300) {
        d0.progress();
        d1.progress();
    }
    assert!(
        block.iter().all(|&b| b == 0xaa),
        "written after the receive unwound"
    );
    drop(send);
    drop((d0, d1));
}

#[test]
fn a_blocking_recv_that_unwinds_waits_for_the_sender_writing_into_it() {
    // A split copy: the sender writes the second half into the
    // receiver's slice. The receive unwinds right after it asked; its
    // guard must wait until the sender is done, so that the caller's
    // block is written no more once it has it back.
    let (d0, d1) = pair(&[("cma", "on")]);
    let data = vec![0x5au8; 1 << 20];
    let mut block = vec![0u8; 1 << 20];
    std::thread::scope(|s| {
        let sender = s.spawn(|| {
            let send = d1.isend(Buffer::from(data.clone()), 0, 4, 0);
            assert!(send.wait().status.error.is_none());
        });
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            PANIC_AFTER_STREAM.with(|p| p.set(true));
            d0.recv(&mut block, Source::Rank(1), TagSel::Tag(4), 0)
        }));
        assert!(unwound.is_err(), "the injected panic unwound the receive");
        assert!(d0.engine.lock().m.splits.is_empty(), "the guard waited");
        // Both halves landed before the guard let go.
        assert!(block.iter().all(|&b| b == 0x5a));
        block.fill(0xaa);
        sender.join().unwrap();
    });
    let t = std::time::Instant::now();
    while t.elapsed() < std::time::Duration::from_millis(100) {
        d0.progress();
        d1.progress();
    }
    assert!(block.iter().all(|&b| b == 0xaa), "written after the guard");
}

#[test]
fn a_blocking_send_that_unwinds_still_waits_for_its_receiver() {
    // cma=off: the pipelined copy reads the sender's buffer as the
    // receiver asks for fragments, long after the send was published.
    let (d0, d1) = pair(&[("cma", "off"), ("eager_limit", "1024")]);
    let want: Vec<u8> = (0..65_536u32).map(|i| (i * 7 % 251) as u8).collect();
    let got = std::thread::scope(|s| {
        let receiver = s.spawn(|| {
            std::thread::sleep(std::time::Duration::from_millis(50));
            let mut buf = vec![0u8; 65_536];
            let st = d0.recv(&mut buf, Source::Rank(1), TagSel::Tag(3), 0);
            (st, buf)
        });
        let mut block = want.clone();
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            crate::engine::test_hooks::PANIC_AFTER_PUBLISH.with(|p| p.set(true));
            d1.send(&block, 0, 3, 0)
        }));
        assert!(unwound.is_err(), "the injected panic unwound the send");
        // The caller reuses its block at once: had the send returned
        // before the receiver was done, the engine (driven below) would
        // stream these bytes.
        block.fill(0xee);
        while !receiver.is_finished() {
            d1.progress();
        }
        receiver.join().unwrap()
    });
    let (st, buf) = got;
    assert_eq!(st.unwrap().count, 65_536);
    assert!(buf == want, "the receiver got the reused block's bytes");
    d0.finish().unwrap();
    d1.finish().unwrap();
}

fn rss() -> usize {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: usize = s.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

#[test]
fn a_departed_senders_rendezvous_is_not_read() {
    // The read side of the same gap: a rendezvous matched while
    // draining a sender that has left is not copied from its pid.
    let (d0, d1) = pair(&[("cma", "on"), ("cma_split_bytes", "0")]);
    let len = 256 << 10;
    let recv = d0.irecv(Buffer::zeroed(len), Source::Rank(1), TagSel::Tag(5), 2);
    let _send = d1.isend(Buffer::from(vec![0xAB; len]), 0, 5, 2);
    // It leaves with its send outstanding.
    d1.engine.depart(true);
    let done = recv.wait();
    assert!(
        matches!(
            done.status.error.as_deref(),
            Some(Error::PeerLost { rank: 1, .. })
        ),
        "{:?}",
        done.status
    );
    assert!(
        done.buf.iter().all(|&b| b == 0),
        "read from a departed sender"
    );
}

#[test]
fn a_flood_of_rendezvous_headers_is_bounded_at_the_receiver() {
    // A hostile sender writes rendezvous starts straight into its ring,
    // far beyond the window, keeping it full; the receiver keeps at most
    // the window's worth, then fails that sender, and its memory stays
    // flat.
    let (d0, d1) = pair(&[("rndv_window", "256")]);
    let rss_before = rss();
    let mut pushed = 0u64;
    let t = std::time::Instant::now();
    while t.elapsed() < std::time::Duration::from_secs(2) && pushed < 200_000 {
        let h = Header {
            kind: KIND_RNDV,
            tag: 1,
            context: 3,
            len: 8,
            cookie: pushed,
            aux: 1 << 20,
            ..Header::default()
        };
        if raw_push(&d1, 0, h, &0x1000u64.to_le_bytes()) {
            pushed += 1;
        } else {
            d0.progress();
        }
        let l = d0.engine.lock();
        assert!(
            l.matching.unexpected_len() <= 256,
            "held {}",
            l.matching.unexpected_len()
        );
        if l.broken[1] {
            break;
        }
    }
    d0.progress();
    {
        let l = d0.engine.lock();
        assert!(
            l.broken[1],
            "the flooding sender was failed after {pushed} headers"
        );
        assert!(l.matching.unexpected_len() <= 256);
    }
    let e = recv_from_1(&d0).unwrap_err();
    assert!(
        matches!(&e, Error::Protocol { rank: 1, what } if what.contains("unfinished rendezvous")),
        "{e:?}"
    );
    let grown = rss().saturating_sub(rss_before);
    assert!(grown < 8 << 20, "receiver grew by {grown} bytes");
}

#[test]
fn a_sender_beyond_its_rendezvous_window_waits_and_loses_nothing() {
    let (d0, d1) = pair(&[("rndv_window", "16"), ("eager_limit", "1024")]);
    let n = 200u32;
    let sends: Vec<Request> = (0..n)
        .map(|i| d1.isend(Buffer::from(vec![i as u8; 4096]), 0, 5, 2))
        .collect();
    assert!(d1.engine.lock().m.rndv_out[0] <= 16, "the window holds");
    for i in 0..n {
        let mut buf = vec![0u8; 4096];
        let st = std::thread::scope(|s| {
            let h = s.spawn(|| d0.recv(&mut buf, Source::Rank(1), TagSel::Tag(5), 2));
            while !h.is_finished() {
                d1.progress();
            }
            h.join().unwrap()
        });
        assert_eq!(st.unwrap().count, 4096);
        assert!(
            buf.iter().all(|&b| b == i as u8),
            "message {i} out of order or wrong"
        );
        assert!(d0.engine.lock().m.rndv_in[1] <= 16);
    }
    for r in sends {
        assert!(r.wait().status.error.is_none());
    }
    assert_eq!(d1.engine.lock().m.rndv_out[0], 0);
    assert_eq!(d0.engine.lock().m.rndv_in[1], 0);
}

#[test]
fn one_drain_takes_at_most_its_budget() {
    let (d0, d1) = pair(&[]);
    for i in 0..600u32 {
        let h = Header {
            kind: KIND_EAGER,
            tag: 1,
            context: 3,
            len: 4,
            ..Header::default()
        };
        assert!(raw_push(&d1, 0, h, &i.to_le_bytes()), "ring full at {i}");
    }
    {
        let mut l = d0.engine.lock();
        d0.engine.drain(&mut l, 1, None, false);
        assert_eq!(l.matching.unexpected_len(), DRAIN_BUDGET);
    }
    // The rest comes with later rounds, in order.
    for i in 0..600u32 {
        let mut b = [0u8; 4];
        d0.recv(&mut b, Source::Rank(1), TagSel::Tag(1), 3).unwrap();
        assert_eq!(u32::from_le_bytes(b), i);
    }
}

#[test]
fn a_peer_that_claims_to_have_left_and_keeps_sending_is_drained_boundedly() {
    // Issue 21: a live peer that marks itself departed and keeps its ring
    // full kept the receiver in one drain loop ("departed peers are
    // drained whole"): millions of messages inside one iprobe.
    use std::sync::atomic::AtomicUsize;
    let (d0, d1) = pair(&[("ring_bytes", "4096")]);
    let nslots = d0.engine.m.sh.mine.ring(1).nslots();
    // It says it finished (state word, departures counter, doorbell)...
    d1.engine.depart(false);
    // ... and keeps the ring full of replies nobody waits for (ignored,
    // not violations: fragments of an abandoned stream).
    const CAP: usize = 100_000;
    let pushed = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let full = AtomicBool::new(false);
    let during = std::thread::scope(|s| {
        s.spawn(|| {
            let h = Header {
                kind: KIND_DATA,
                cookie: 0xdead,
                ..Header::default()
            };
            while !stop.load(Ordering::Relaxed) && pushed.load(Ordering::Relaxed) < CAP {
                if raw_push(&d1, 0, h, &[]) {
                    pushed.fetch_add(1, Ordering::Relaxed);
                } else {
                    full.store(true, Ordering::Relaxed);
                    std::thread::yield_now();
                }
            }
        });
        while !full.load(Ordering::Relaxed) {
            std::thread::yield_now();
        }
        let before = pushed.load(Ordering::Relaxed);
        let r = d0.iprobe(Source::Any, TagSel::Any, 0);
        let during = pushed.load(Ordering::Relaxed) - before;
        stop.store(true, Ordering::Relaxed);
        assert!(matches!(r, Ok(None)), "{r:?}");
        during
    });
    // The ring was full when the iprobe began: it took what was there
    // (at most a ring's worth) and whatever arrived in between, bounded.
    let bound = 2 * nslots + DRAIN_BUDGET;
    assert!(
        during <= bound,
        "one iprobe let the peer push {during} more messages (bound {bound})"
    );
    // Later progress does not read its ring on either.
    let before = pushed.load(Ordering::Relaxed);
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            let h = Header {
                kind: KIND_DATA,
                cookie: 0xdead,
                ..Header::default()
            };
            while !stop.load(Ordering::Relaxed) {
                if raw_push(&d1, 0, h, &[]) {
                    pushed.fetch_add(1, Ordering::Relaxed);
                } else {
                    std::thread::yield_now();
                }
            }
        });
        for _ in 0..100 {
            let _ = d0.iprobe(Source::Any, TagSel::Any, 0);
        }
        stop.store(true, Ordering::Relaxed);
    });
    let after = pushed.load(Ordering::Relaxed) - before;
    assert!(after <= bound, "100 iprobes let it push {after} more");
}

#[test]
fn a_negative_tag_is_a_violation() {
    let (d0, d1) = pair(&[]);
    let h = Header {
        kind: KIND_EAGER,
        tag: -5,
        context: 1,
        len: 4,
        ..Header::default()
    };
    assert!(raw_push(&d1, 0, h, &[1, 2, 3, 4]));
    let e = recv_from_1(&d0).unwrap_err();
    assert!(
        matches!(&e, Error::Protocol { rank: 1, what } if what.contains("negative tag -5")),
        "{e:?}"
    );
    // Sends refuse one at the source, blocking or not.
    assert!(matches!(
        d1.send(b"x", 0, -1, 1),
        Err(Error::InvalidTag(-1))
    ));
    let r = d1.isend(Buffer::from(vec![0u8; 1]), 0, -1, 1).wait();
    assert!(matches!(
        r.status.error.as_deref(),
        Some(Error::InvalidTag(-1))
    ));
}

#[test]
fn unknown_kind_is_a_violation() {
    let (d0, d1) = pair(&[]);
    let h = Header {
        kind: 99,
        ..Header::default()
    };
    assert!(raw_push(&d1, 0, h, &[]));
    assert_violation(&d0, "unknown message kind 99");
}

#[test]
fn reply_for_unknown_send_is_a_violation() {
    let (d0, d1) = pair(&[]);
    let h = Header {
        kind: KIND_FIN,
        cookie: 12345,
        ..Header::default()
    };
    assert!(raw_push(&d1, 0, h, &[]));
    assert_violation(&d0, "unknown send 12345");
}

#[test]
fn malformed_rendezvous_start_is_a_violation() {
    let (d0, d1) = pair(&[]);
    let h = Header {
        kind: KIND_RNDV,
        aux: 1 << 20,
        ..Header::default()
    };
    assert!(raw_push(&d1, 0, h, &[0u8; 3]));
    assert_violation(&d0, "rendezvous start of 3 bytes");
}

#[test]
fn eager_data_beyond_credit_is_a_violation() {
    let (d0, d1) = pair(&[("ring_bytes", "4096"), ("credit_bytes", "4096")]);
    let h = Header {
        kind: KIND_EAGER,
        tag: 3,
        context: 1,
        ..Header::default()
    };
    // Nothing is received, so all of it is unexpected data held by rank 0.
    let mut pushed = 0;
    while pushed < 200 {
        if raw_push(&d1, 0, h, &[7u8; 500]) {
            pushed += 1;
        } else {
            // Let rank 0 drain its ring into its unexpected queue.
            let _ = d0.iprobe(Source::Rank(1), TagSel::Tag(99), 1);
        }
        if d0.engine.lock().broken[1] {
            break;
        }
    }
    assert!(pushed < 200, "rank 0 kept accepting uncredited data");
    let _ = d0.iprobe(Source::Any, TagSel::Any, 1);
    assert!(d0.engine.lock().broken[1]);
}

#[test]
fn unreadable_rendezvous_source_fails_that_receive_only() {
    // CMA forced: the default may choose the pipelined path here.
    let (d0, d1) = pair(&[("cma", "on")]);
    assert_eq!(d0.rendezvous(), &RendezvousPath::Cma);
    let h = Header {
        kind: KIND_RNDV,
        tag: 4,
        context: 1,
        cookie: 1,
        aux: 100,
        ..Header::default()
    };
    assert!(raw_push(&d1, 0, h, &8u64.to_le_bytes()));
    match recv_from_1(&d0) {
        Err(Error::Protocol { rank: 1, what }) => {
            assert!(what.contains("unreadable"), "{what}")
        }
        other => panic!("expected an unreadable source, got {other:?}"),
    }
    // Not a ring violation: rank 1 may still talk to rank 0.
    d1.send(b"ok", 0, 6, 1).unwrap();
    let mut b = [0u8; 2];
    d0.recv(&mut b, Source::Rank(1), TagSel::Tag(6), 1).unwrap();
    assert_eq!(&b, b"ok");
}

#[test]
fn fragment_out_of_place_is_a_violation() {
    let (d0, d1) = pair(&[("cma", "off")]);
    let r = d0.irecv(Buffer::zeroed(100), Source::Rank(1), TagSel::Tag(4), 1);
    let start = Header {
        kind: KIND_RNDV,
        tag: 4,
        context: 1,
        cookie: 5,
        aux: 100,
        ..Header::default()
    };
    assert!(raw_push(&d1, 0, start, &0u64.to_le_bytes()));
    let _ = d0.iprobe(Source::Any, TagSel::Any, 1); // matches, answers PULL
    let data = Header {
        kind: KIND_DATA,
        cookie: 5,
        aux: 50, // the stream is at 0
        ..Header::default()
    };
    assert!(raw_push(&d1, 0, data, &[1u8; 10]));
    let done = r.wait();
    match done.status.error.as_deref() {
        Some(Error::Protocol { rank: 1, what }) => assert!(what.contains("fragment"), "{what}"),
        other => panic!("expected a protocol violation, got {other:?}"),
    }
}

#[test]
fn impossible_consumer_position_is_a_violation() {
    let (d0, d1) = pair(&[("ring_bytes", "4096")]);
    // Rank 1 owns the ring from rank 0 in its inbox; it writes a
    // consumer position past anything rank 0 published.
    let ring = d1.engine.m.sh.mine.ring(0);
    // SAFETY: the tail word is the first 8 bytes of the ring, inside the
    // mapping, 8-aligned; a plain write is what a hostile peer could do
    // (nothing else touches it now).
    unsafe { std::ptr::write_volatile(ring.base_ptr() as *mut u64, u64::MAX) };
    // Rank 0 reads the position only once its ring looks full: three
    // 1000-byte messages fit in 64 slots, the fourth does not.
    let msg = [1u8; 1000];
    for _ in 0..3 {
        d0.send(&msg, 1, 0, 1).unwrap();
    }
    match d0.send(&msg, 1, 0, 1) {
        Err(Error::Protocol { rank: 1, what }) => {
            assert!(what.contains("consumer position"), "{what}")
        }
        other => panic!("expected a protocol violation by rank 1, got {other:?}"),
    }
    // Rank 1 is cut off for good.
    assert!(matches!(
        d0.send(b"x", 1, 0, 1),
        Err(Error::Protocol { rank: 1, .. })
    ));
}

#[test]
fn peer_info_roundtrip_and_rejects() {
    let i = PeerInfo {
        pid: 42,
        nslots: 1024,
        credit_bytes: 1 << 18,
        probe_addr: 0xdead_beef,
        probe_value: 7,
        segment: "xdev-fd-0123456789abcdef0123456789abcdef".into(),
    };
    assert_eq!(PeerInfo::decode(&i.encode()).unwrap(), i);
    let mut b = i.encode();
    b.push(0);
    assert!(PeerInfo::decode(&b).is_err());
    let bad = PeerInfo {
        segment: "xdev-fd-../x".into(),
        ..i.clone()
    };
    assert!(PeerInfo::decode(&bad.encode()).is_err());
    let bad = PeerInfo { nslots: 1000, ..i };
    assert!(PeerInfo::decode(&bad.encode()).is_err());
}
