//! The safe verbs layer on a real device: two RC QPs of one device connected
//! to each other, every operation the layer offers, and its error paths.
//!
//! Needs an RDMA device (soft-RoCE is enough); without one each test prints
//! "skipped: no RDMA device (runs in ci/vm-suite.sh)" and returns (see
//! `common` for the environment).
#![cfg(feature = "ibv")]

mod common;

use std::time::{Duration, Instant};

use common::{gid_index, open, Pair, PORT};
use ibvx::verbs::*;

const TIMEOUT: Duration = Duration::from_secs(10);

/// Two connected RC QPs with `inline` bytes of inline data and two
/// scatter/gather entries, on CQs of 64 entries attached to `channel`.
fn pair(
    ctx: &Context,
    pd: &ProtectionDomain,
    channel: Option<&CompletionChannel>,
    inline: u32,
) -> Pair {
    let caps = QpCaps {
        max_send_sge: 2,
        max_recv_sge: 2,
        max_inline_data: inline,
        ..QpCaps::default()
    };
    common::pair(ctx, pd, 64, channel, caps)
}

/// Polls until `n` completions arrived (in any status).
fn poll_n(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    common::poll_n(cq, n, TIMEOUT)
}

fn by_id(wcs: &[WorkCompletion], id: u64) -> WorkCompletion {
    *wcs.iter()
        .find(|w| w.wr_id() == id)
        .unwrap_or_else(|| panic!("no wr_id {id}: {wcs:?}"))
}

#[test]
fn device_port_and_gid_queries() {
    let Some(ctx) = open() else { return };
    let list = device_list().unwrap();
    assert!(list.iter().any(|d| d.name == ctx.name()), "{list:?}");
    assert!(ctx.port_count() >= 1);
    let attr = ctx.query_port(PORT).unwrap();
    println!("{}: port {PORT} {attr:?}", ctx.name());
    assert_eq!(attr.state, PortState::Active);
    let local = ctx.port_address(PORT, gid_index()).unwrap();
    if attr.link_layer == LinkLayer::Ethernet {
        let (i, g) = local.gid.expect("RoCE needs a GID");
        println!("GID index {i}: {g}");
        assert!(!g.is_zero());
        assert_eq!(ctx.query_gid(PORT, i).unwrap(), g);
    }

    // Errors, each one line naming the problem.
    let e = Context::open(Some("no-such-device")).unwrap_err();
    let s = e.to_string();
    assert!(
        s.contains("\"no-such-device\" not found") && s.contains(ctx.name()),
        "{s}"
    );
    for port in [0, ctx.port_count() + 1] {
        let e = ctx.query_port(port).unwrap_err();
        assert!(matches!(e, Error::BadPort { .. }), "{e}");
        assert!(
            e.to_string()
                .starts_with(&format!("bad port {port} on {}", ctx.name())),
            "{e}"
        );
    }
    let e = ctx.query_gid(PORT, attr.gid_tbl_len + 5).unwrap_err();
    assert!(e.to_string().contains("out of range"), "{e}");
    // An unset entry: rxe fills only the first few.
    let zero = (0..attr.gid_tbl_len.min(64))
        .find(|&i| matches!(ctx.query_gid(PORT, i), Err(Error::BadGidIndex { .. })));
    match zero {
        Some(i) => {
            let e = ctx.query_gid(PORT, i).unwrap_err().to_string();
            assert!(e.contains("all zeros"), "{e}");
            let e = ctx.port_address(PORT, Some(i)).unwrap_err().to_string();
            assert!(e.starts_with(&format!("bad GID index {i}")), "{e}");
        }
        None => println!("no unset GID entry among the first 64"),
    }
}

#[test]
fn send_write_and_immediates_through_the_safe_layer() {
    let Some(ctx) = open() else { return };
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let p = pair(&ctx, &pd, None, 0);
    let rw = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    let mut a_mem = MemoryRegion::alloc(&pd, 8192, rw).unwrap();
    let mut b_backing = vec![0u8; 8192];
    // SAFETY: `b_mem` is dropped at the end of this function, before
    // `b_backing`; it is never leaked.
    let mut b_mem = unsafe { MemoryRegion::register(&pd, &mut b_backing, rw) }.unwrap();
    assert_eq!(a_mem.addr() % 4096, 0);
    assert!(a_mem.access().contains(Access::REMOTE_WRITE));

    send_then_recv(&p, &mut a_mem, &mut b_mem);
    send_with_imm_gathered(&p, &mut a_mem, &b_mem);
    let dst = b_mem.remote(4096);
    rdma_write(&p, &mut a_mem, &b_mem, dst);
    rdma_write_with_imm(&p, &a_mem, dst);
    unsignaled_sends(&p, &a_mem, &b_mem);
    drop(b_mem);
    // the borrow ended with the region
    b_backing[0] = 1;
}

/// send -> recv
fn send_then_recv(p: &Pair, a_mem: &mut MemoryRegion, b_mem: &mut MemoryRegion) {
    let msg = b"through the safe verbs layer";
    b_mem.fill(0, 4096, |_| 0xee);
    // SAFETY: (this argument covers every post in this test) `a_mem` and
    // `b_mem` are this test's own regions, dropped after the QPs' last use of them (each
    // request's completion is polled before its memory is touched again,
    // and `b_mem` is dropped before `b_backing` is reused); they are only
    // accessed through the regions' raw-pointer accessors; every RDMA write
    // targets `b_mem`, registered for remote write for this purpose.
    unsafe { p.b.post_recv(10, &[b_mem.sge(0, 4096)]) }.unwrap();
    a_mem.write(0, msg);
    // SAFETY: see above.
    unsafe {
        p.a.post_send(&SendRequest {
            wr_id: 1,
            op: SendOp::Send,
            sges: &[a_mem.sge(0, msg.len())],
            flags: SendFlags::SIGNALED,
        })
    }
    .unwrap();
    let s = poll_n(&p.cq_a, 1)[0];
    s.ok().unwrap();
    assert_eq!((s.wr_id(), s.opcode()), (1, WcOpcode::Send));
    let r = poll_n(&p.cq_b, 1)[0];
    r.ok().unwrap();
    assert_eq!(
        (r.wr_id(), r.opcode(), r.byte_len()),
        (10, WcOpcode::Recv, msg.len() as u32)
    );
    assert_eq!(r.imm_data(), None);
    let mut got = vec![0u8; msg.len()];
    b_mem.read(0, &mut got);
    assert_eq!(&got, msg);
}

/// send with immediate, two scatter/gather entries gathered into one
fn send_with_imm_gathered(p: &Pair, a_mem: &mut MemoryRegion, b_mem: &MemoryRegion) {
    // SAFETY: see the first post (in `send_then_recv`).
    unsafe { p.b.post_recv(11, &[b_mem.sge(0, 4096)]) }.unwrap();
    a_mem.write(100, b"abc");
    a_mem.write(200, b"def");
    // SAFETY: see the first post (in `send_then_recv`).
    unsafe {
        p.a.post_send(&SendRequest {
            wr_id: 2,
            op: SendOp::SendWithImm(0xdead_beef),
            sges: &[a_mem.sge(100, 3), a_mem.sge(200, 3)],
            flags: SendFlags::SIGNALED,
        })
    }
    .unwrap_or_else(|e| {
        // a provider with one send SGE refuses; fall back to one entry
        println!("two SGEs refused ({e}); sending one");
        // SAFETY: see the first post (in `send_then_recv`).
        unsafe {
            p.a.post_send(&SendRequest {
                wr_id: 2,
                op: SendOp::SendWithImm(0xdead_beef),
                sges: &[a_mem.sge(100, 3)],
                flags: SendFlags::SIGNALED,
            })
        }
        .unwrap()
    });
    poll_n(&p.cq_a, 1)[0].ok().unwrap();
    let r = poll_n(&p.cq_b, 1)[0];
    r.ok().unwrap();
    assert_eq!(r.imm_data(), Some(0xdead_beef));
    assert_eq!(r.opcode(), WcOpcode::Recv);
    let mut got = vec![0u8; r.byte_len() as usize];
    b_mem.read(0, &mut got);
    assert!(got == b"abcdef" || got == b"abc", "{got:?}");
}

/// RDMA write to `dst` (offset 4096 of `b_mem`): no completion at the
/// target, data visible by polling
fn rdma_write(p: &Pair, a_mem: &mut MemoryRegion, b_mem: &MemoryRegion, dst: RemoteAddr) {
    a_mem.fill(1024, 1000, |i| (i % 251) as u8);
    a_mem.store_u8(2023, 0x5c);
    // SAFETY: see the first post (in `send_then_recv`).
    unsafe {
        p.a.post_send(&SendRequest {
            wr_id: 3,
            op: SendOp::RdmaWrite(dst),
            sges: &[a_mem.sge(1024, 1000)],
            flags: SendFlags::SIGNALED,
        })
    }
    .unwrap();
    let w = poll_n(&p.cq_a, 1)[0];
    w.ok().unwrap();
    assert_eq!(w.opcode(), WcOpcode::RdmaWrite);
    let deadline = Instant::now() + TIMEOUT;
    while b_mem.load_u8(4096 + 999) != 0x5c {
        assert!(Instant::now() < deadline, "RDMA write not visible");
    }
    let mut got = vec![0u8; 999];
    b_mem.read(4096, &mut got);
    assert!(got.iter().enumerate().all(|(i, &v)| v == (i % 251) as u8));
    let mut none = [WorkCompletion::default(); 1];
    assert_eq!(p.cq_b.poll(&mut none).unwrap(), 0);
}

/// RDMA write with immediate: consumes a receive (even an empty one)
fn rdma_write_with_imm(p: &Pair, a_mem: &MemoryRegion, dst: RemoteAddr) {
    // SAFETY: an empty receive names no memory; the write as the first post
    // (in `send_then_recv`).
    unsafe {
        p.b.post_recv(12, &[]).unwrap();
        p.a.post_send(&SendRequest {
            wr_id: 4,
            op: SendOp::RdmaWriteWithImm(dst.offset(2000), 42),
            sges: &[a_mem.sge(0, 16)],
            flags: SendFlags::SIGNALED,
        })
    }
    .unwrap();
    poll_n(&p.cq_a, 1)[0].ok().unwrap();
    let r = poll_n(&p.cq_b, 1)[0];
    r.ok().unwrap();
    assert_eq!(
        (r.wr_id(), r.opcode(), r.imm_data()),
        (12, WcOpcode::RecvRdmaWithImm, Some(42))
    );
}

/// unsignaled sends produce no completion; a later signaled one does
fn unsignaled_sends(p: &Pair, a_mem: &MemoryRegion, b_mem: &MemoryRegion) {
    for id in 5..8 {
        // SAFETY: see the first post (in `send_then_recv`); the unsignaled
        // sends are complete once the signaled one after them is.
        unsafe {
            p.b.post_recv(100 + id, &[b_mem.sge(0, 64)]).unwrap();
            p.a.post_send(&SendRequest {
                wr_id: id,
                op: SendOp::Send,
                sges: &[a_mem.sge(0, 8)],
                flags: if id == 7 {
                    SendFlags::SIGNALED
                } else {
                    SendFlags::NONE
                },
            })
        }
        .unwrap();
    }
    let s = poll_n(&p.cq_a, 1);
    assert_eq!(s[0].wr_id(), 7);
    let r = poll_n(&p.cq_b, 3);
    assert_eq!(by_id(&r, 107).byte_len(), 8);
}

#[test]
fn inline_sends_and_event_driven_completions() {
    let Some(ctx) = open() else { return };
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let channel = CompletionChannel::new(&ctx).unwrap();
    let p = pair(&ctx, &pd, Some(&channel), 64);
    let max_inline = p.a.caps().max_inline_data;
    println!("max_inline_data granted: {max_inline}");
    let mut a_mem = MemoryRegion::alloc(&pd, 4096, Access::LOCAL_WRITE).unwrap();
    let b_mem = MemoryRegion::alloc(&pd, 4096, Access::LOCAL_WRITE).unwrap();

    p.cq_b.req_notify(false).unwrap();
    // SAFETY: `b_mem` is this test's own region, dropped after the QPs,
    // read only through `read` after the receive completed.
    unsafe { p.b.post_recv(1, &[b_mem.sge(0, 4096)]) }.unwrap();
    a_mem.write(0, b"inline!");
    let inline = max_inline >= 7;
    // SAFETY: `a_mem` is this test's own region, dropped after the QPs; it
    // is overwritten below only if the send is inline (copied at post
    // time), and only through `write`.
    unsafe {
        p.a.post_send(&SendRequest {
            wr_id: 1,
            op: SendOp::Send,
            sges: &[a_mem.sge(0, 7)],
            flags: SendFlags::SIGNALED.with(SendFlags::INLINE, inline),
        })
    }
    .unwrap();
    // inline data was copied at post time: overwriting it changes nothing
    if inline {
        a_mem.write(0, b"XXXXXXX");
    }
    assert!(
        p.cq_b.wait_event(Some(TIMEOUT)).unwrap(),
        "no completion event"
    );
    let r = poll_n(&p.cq_b, 1)[0];
    r.ok().unwrap();
    let mut got = [0u8; 7];
    b_mem.read(0, &mut got);
    if inline {
        assert_eq!(&got, b"inline!");
    }
    poll_n(&p.cq_a, 1)[0].ok().unwrap();
    // nothing pending: the wait times out
    p.cq_b.req_notify(false).unwrap();
    assert!(!p.cq_b.wait_event(Some(Duration::from_millis(20))).unwrap());

    // an inline send above the limit is refused before reaching the provider
    // SAFETY: refused before anything is posted (and `a_mem` is ours).
    let e = unsafe {
        p.a.post_send(&SendRequest {
            wr_id: 9,
            op: SendOp::Send,
            sges: &[a_mem.sge(0, max_inline as usize + 1)],
            flags: SendFlags::INLINE,
        })
    }
    .unwrap_err();
    assert!(e.to_string().contains("max_inline_data"), "{e}");
}

#[test]
fn error_paths_name_the_failure() {
    let Some(ctx) = open() else { return };
    let pd = ProtectionDomain::new(&ctx).unwrap();

    // Registration: remote write without local write is invalid.
    match MemoryRegion::alloc(&pd, 4096, Access::REMOTE_WRITE) {
        Err(e @ Error::Registration { .. }) => {
            let s = e.to_string();
            assert!(
                s.starts_with("memory registration of 4096 bytes failed: "),
                "{s}"
            );
        }
        Err(e) => panic!("{e}"),
        Ok(_) => println!("the provider accepted REMOTE_WRITE without LOCAL_WRITE"),
    }

    // QP transition: RESET -> RTR skips INIT.
    let cq = CompletionQueue::new(&ctx, 16, None).unwrap();
    let qp = QueuePair::new_rc(&pd, &cq, &cq, QpCaps::default(), false).unwrap();
    let local = ctx.port_address(PORT, gid_index()).unwrap();
    let e = qp
        .connect(
            &local,
            &RemoteQp {
                qpn: qp.qp_num(),
                psn: 0,
                lid: local.lid,
                gid: local.gid.map(|(_, g)| g),
            },
            local.active_mtu,
            0,
        )
        .unwrap_err();
    let s = e.to_string();
    assert!(s.contains("transition INIT->RTR failed"), "{s}");

    // Work completion error: an RDMA write with a bad rkey.
    let p = pair(&ctx, &pd, None, 0);
    let mem = MemoryRegion::alloc(&pd, 4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE).unwrap();
    let bad = RemoteAddr {
        addr: mem.addr(),
        rkey: mem.rkey() ^ 0x5a5a00,
    };
    // SAFETY: `mem` is this test's own region, dropped after the QPs; the
    // write's target is `mem` itself with a wrong rkey, which the device
    // refuses (what this checks).
    unsafe {
        p.a.post_send(&SendRequest {
            wr_id: 77,
            op: SendOp::RdmaWrite(bad),
            sges: &[mem.sge(0, 64)],
            flags: SendFlags::SIGNALED,
        })
    }
    .unwrap();
    let wc = poll_n(&p.cq_a, 1)[0];
    let e = wc.ok().unwrap_err();
    let s = e.to_string();
    println!("{s}");
    assert!(s.starts_with("work completion error: "), "{s}");
    assert!(s.contains("wr_id 0x4d"), "{s}");
    assert!(
        s.contains("remote access error") || s.contains("remote"),
        "{s}"
    );
    // the QP is in error now; moving it there explicitly is also fine
    p.a.modify_to_error().unwrap();
    assert_eq!(p.a.state().unwrap(), QpState::Error);
}

#[test]
fn objects_outlive_the_handles_they_came_from() {
    let Some(ctx) = open() else { return };
    // Build everything, then drop the context and PD handles first: the QP,
    // CQs and MR keep what they need alive.
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let p = pair(&ctx, &pd, None, 0);
    let mem = MemoryRegion::alloc(&pd, 4096, Access::LOCAL_WRITE).unwrap();
    drop(pd);
    drop(ctx);
    // SAFETY: `mem` is this test's own region, untouched by the test; both
    // requests' completions are polled below before it is dropped.
    unsafe {
        p.b.post_recv(1, &[mem.sge(0, 64)]).unwrap();
        p.a.post_send(&SendRequest {
            wr_id: 2,
            op: SendOp::Send,
            sges: &[mem.sge(64, 8)],
            flags: SendFlags::SIGNALED,
        })
    }
    .unwrap();
    poll_n(&p.cq_a, 1)[0].ok().unwrap();
    poll_n(&p.cq_b, 1)[0].ok().unwrap();
    // drop in "wrong" order: CQ handles before the QPs
    let Pair { a, b, cq_a, cq_b } = p;
    drop(cq_a);
    drop(cq_b);
    drop(a);
    drop(mem);
    drop(b);
}

#[test]
fn argument_errors_are_refused_before_the_provider() {
    let Some(ctx) = open() else { return };
    let pd = ProtectionDomain::new(&ctx).unwrap();

    // Empty ranges cannot be registered, whichever constructor is used.
    // SAFETY: the call fails (empty range): there is no region to leak.
    let e = unsafe { MemoryRegion::register(&pd, &mut [], Access::LOCAL_WRITE) }.unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert!(e.to_string().contains("empty buffer"), "{e}");
    let mut byte = 0u8;
    // SAFETY: `byte` outlives the call; an empty range is refused before
    // anything is registered.
    let e = unsafe {
        MemoryRegion::register_raw_parts(
            &pd,
            std::ptr::NonNull::from(&mut byte),
            0,
            Access::LOCAL_WRITE,
        )
    }
    .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");

    // Explicit deregistration reports success.
    let mr = MemoryRegion::alloc(&pd, 100, Access::LOCAL_WRITE).unwrap();
    assert_eq!(mr.len(), 100);
    mr.deregister().unwrap();

    // A queue without a completion channel cannot wait for events.
    let cq = CompletionQueue::new(&ctx, 4, None).unwrap();
    let e = cq.wait_event(Some(Duration::from_millis(1))).unwrap_err();
    assert!(e.to_string().contains("no completion channel"), "{e}");

    // A port that needs a GRH cannot connect to a peer without a GID; the
    // QP stays where it was.
    let local = ctx.port_address(PORT, gid_index()).unwrap();
    if local.gid.is_some() {
        let qp = QueuePair::new_rc(&pd, &cq, &cq, QpCaps::default(), false).unwrap();
        qp.modify_to_init(&InitAttr {
            port: PORT,
            ..InitAttr::default()
        })
        .unwrap();
        let peer = RemoteQp {
            qpn: qp.qp_num(),
            psn: 0,
            lid: local.lid,
            gid: None,
        };
        let e = qp.connect(&local, &peer, local.active_mtu, 0).unwrap_err();
        assert!(e.to_string().contains("the peer sent no GID"), "{e}");
        assert_eq!(qp.state().unwrap(), QpState::Init);
    }
}
