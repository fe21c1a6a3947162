//! Dispatch tests for the inline equivalents, on fake contexts built here:
//! they check which function pointer is called, with which arguments, and
//! that its result is passed back (no device involved; the device test in
//! tests/device_loopback.rs exercises real providers).

use super::*;
use std::cell::RefCell;

#[derive(Debug, PartialEq, Eq)]
enum Call {
    PostSend(usize, usize, usize),
    PostRecv(usize, usize, usize),
    PostSrqRecv(usize, usize, usize),
    PollCq(usize, c_int, usize),
    ReqNotifyCq(usize, c_int),
    /// context, port, attr, whether *attr was all zero at call time
    CompatQueryPort(usize, u8, usize, bool),
    /// context, port, attr, attr_len
    ExtQueryPort(usize, u8, usize, usize),
    RegMr(usize, usize, usize, c_int),
    RegMrIova2(usize, usize, usize, u64, c_uint),
}

thread_local! {
    static CALLS: RefCell<Vec<Call>> = const { RefCell::new(Vec::new()) };
}

fn record(call: Call) {
    CALLS.with(|c| c.borrow_mut().push(call));
}

fn take_calls() -> Vec<Call> {
    CALLS.with(|c| std::mem::take(&mut *c.borrow_mut()))
}

fn addr<T>(p: *const T) -> usize {
    p as usize
}

unsafe extern "C" fn fake_post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad: *mut *mut ibv_send_wr,
) -> c_int {
    record(Call::PostSend(addr(qp), addr(wr), addr(bad)));
    101
}

unsafe extern "C" fn fake_post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int {
    record(Call::PostRecv(addr(qp), addr(wr), addr(bad)));
    102
}

unsafe extern "C" fn fake_post_srq_recv(
    srq: *mut ibv_srq,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int {
    record(Call::PostSrqRecv(addr(srq), addr(wr), addr(bad)));
    103
}

unsafe extern "C" fn fake_poll_cq(cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
    record(Call::PollCq(addr(cq), n, addr(wc)));
    104
}

unsafe extern "C" fn fake_req_notify_cq(cq: *mut ibv_cq, solicited_only: c_int) -> c_int {
    record(Call::ReqNotifyCq(addr(cq), solicited_only));
    105
}

unsafe extern "C" fn fake_compat_query_port(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut _compat_ibv_port_attr,
) -> c_int {
    // SAFETY: the tests pass a pointer to a whole ibv_port_attr.
    let bytes =
        unsafe { std::slice::from_raw_parts(attr.cast::<u8>(), size_of::<ibv_port_attr>()) };
    record(Call::CompatQueryPort(
        addr(ctx),
        port,
        addr(attr),
        bytes.iter().all(|&b| b == 0),
    ));
    106
}

unsafe extern "C" fn fake_ext_query_port(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
    len: usize,
) -> c_int {
    record(Call::ExtQueryPort(addr(ctx), port, addr(attr), len));
    107
}

unsafe extern "C" fn fake_reg_mr(
    pd: *mut ibv_pd,
    a: *mut c_void,
    len: usize,
    access: c_int,
) -> *mut ibv_mr {
    record(Call::RegMr(addr(pd), addr(a), len, access));
    0x1000 as *mut ibv_mr
}

unsafe extern "C" fn fake_reg_mr_iova2(
    pd: *mut ibv_pd,
    a: *mut c_void,
    len: usize,
    iova: u64,
    access: c_uint,
) -> *mut ibv_mr {
    record(Call::RegMrIova2(addr(pd), addr(a), len, iova, access));
    0x2000 as *mut ibv_mr
}

/// A context whose ops table has a distinct fake for every op under test.
fn fake_context() -> Box<ibv_context> {
    let mut ctx = Box::<ibv_context>::default();
    ctx.ops.post_send = Some(fake_post_send);
    ctx.ops.post_recv = Some(fake_post_recv);
    ctx.ops.post_srq_recv = Some(fake_post_srq_recv);
    ctx.ops.poll_cq = Some(fake_poll_cq);
    ctx.ops.req_notify_cq = Some(fake_req_notify_cq);
    ctx
}

#[test]
fn post_send_calls_context_ops_post_send() {
    let mut ctx = fake_context();
    let mut qp = ibv_qp {
        context: &mut *ctx,
        ..Default::default()
    };
    let mut wr = ibv_send_wr::default();
    let mut bad: *mut ibv_send_wr = ptr::null_mut();
    // SAFETY: `qp.context` points to a context whose post_send is a fake that
    // only records its arguments.
    let rc = unsafe { ibv_post_send(&mut qp, &mut wr, &mut bad) };
    assert_eq!(rc, 101);
    assert_eq!(
        take_calls(),
        [Call::PostSend(addr(&qp), addr(&wr), addr(&bad))]
    );
}

#[test]
fn post_recv_calls_context_ops_post_recv() {
    let mut ctx = fake_context();
    let mut qp = ibv_qp {
        context: &mut *ctx,
        ..Default::default()
    };
    let mut wr = ibv_recv_wr::default();
    let mut bad: *mut ibv_recv_wr = ptr::null_mut();
    // SAFETY: fake context, see post_send test.
    let rc = unsafe { ibv_post_recv(&mut qp, &mut wr, &mut bad) };
    assert_eq!(rc, 102);
    assert_eq!(
        take_calls(),
        [Call::PostRecv(addr(&qp), addr(&wr), addr(&bad))]
    );
}

#[test]
fn post_srq_recv_calls_context_ops_post_srq_recv() {
    let mut ctx = fake_context();
    let mut srq = ibv_srq {
        context: &mut *ctx,
        ..Default::default()
    };
    let mut wr = ibv_recv_wr::default();
    let mut bad: *mut ibv_recv_wr = ptr::null_mut();
    // SAFETY: fake context, see post_send test.
    let rc = unsafe { ibv_post_srq_recv(&mut srq, &mut wr, &mut bad) };
    assert_eq!(rc, 103);
    assert_eq!(
        take_calls(),
        [Call::PostSrqRecv(addr(&srq), addr(&wr), addr(&bad))]
    );
}

#[test]
fn poll_cq_calls_context_ops_poll_cq() {
    let mut ctx = fake_context();
    let mut cq = ibv_cq {
        context: &mut *ctx,
        ..Default::default()
    };
    let mut wc = [ibv_wc::default(); 4];
    // SAFETY: fake context; `wc` has room for 4 entries.
    let rc = unsafe { ibv_poll_cq(&mut cq, 4, wc.as_mut_ptr()) };
    assert_eq!(rc, 104);
    assert_eq!(
        take_calls(),
        [Call::PollCq(addr(&cq), 4, addr(wc.as_ptr()))]
    );
}

#[test]
fn req_notify_cq_calls_context_ops_req_notify_cq() {
    let mut ctx = fake_context();
    let mut cq = ibv_cq {
        context: &mut *ctx,
        ..Default::default()
    };
    // SAFETY: fake context.
    let rc = unsafe { ibv_req_notify_cq(&mut cq, 1) };
    assert_eq!(rc, 105);
    assert_eq!(take_calls(), [Call::ReqNotifyCq(addr(&cq), 1)]);
}

#[test]
#[should_panic(expected = "ops.poll_cq is NULL")]
fn null_op_panics_instead_of_jumping_to_null() {
    let mut ctx = Box::<ibv_context>::default();
    let mut cq = ibv_cq {
        context: &mut *ctx,
        ..Default::default()
    };
    // SAFETY: `cq.context` is live; its NULL poll_cq must panic before any call.
    unsafe { ibv_poll_cq(&mut cq, 1, ptr::null_mut()) };
}

#[test]
fn verbs_get_ctx_is_container_of_for_extended_contexts_only() {
    let mut vctx = Box::<verbs_context>::default();
    vctx.context.abi_compat = VERBS_ABI_IS_EXTENDED;
    let vp: *mut verbs_context = &mut *vctx;
    // SAFETY: `vp` is a live verbs_context; the pointer to its `context`
    // field is derived from it, as libibverbs does.
    let got = unsafe { verbs_get_ctx(ptr::addr_of_mut!((*vp).context)) };
    assert_eq!(got, vp);

    let mut legacy = Box::<ibv_context>::default();
    // SAFETY: live context with abi_compat NULL (legacy).
    assert!(unsafe { verbs_get_ctx(&mut *legacy) }.is_null());
}

fn dirty_port_attr() -> ibv_port_attr {
    let mut attr = ibv_port_attr::default();
    // SAFETY: ibv_port_attr is plain integers, any byte pattern is valid.
    unsafe { ptr::write_bytes(&mut attr, 0xAA, 1) };
    attr
}

#[test]
fn query_port_legacy_context_zeroes_attr_and_calls_compat_export() {
    let mut ctx = Box::<ibv_context>::default();
    let mut attr = dirty_port_attr();
    // SAFETY: live legacy context; `attr` is a whole ibv_port_attr.
    let rc = unsafe { query_port_with(fake_compat_query_port, &mut *ctx, 1, &mut attr) };
    assert_eq!(rc, 106);
    assert_eq!(
        take_calls(),
        [Call::CompatQueryPort(addr(&*ctx), 1, addr(&attr), true)]
    );
}

#[test]
fn query_port_extended_context_calls_verbs_context_query_port_with_size() {
    let mut vctx = Box::<verbs_context>::default();
    vctx.sz = size_of::<verbs_context>();
    vctx.query_port = Some(fake_ext_query_port);
    vctx.context.abi_compat = VERBS_ABI_IS_EXTENDED;
    let vp: *mut verbs_context = &mut *vctx;
    // SAFETY: as in verbs_get_ctx test.
    let ctx = unsafe { ptr::addr_of_mut!((*vp).context) };
    let mut attr = dirty_port_attr();
    // SAFETY: extended fake context with a recording query_port.
    let rc = unsafe { query_port_with(fake_compat_query_port, ctx, 2, &mut attr) };
    assert_eq!(rc, 107);
    assert_eq!(
        take_calls(),
        [Call::ExtQueryPort(
            addr(ctx),
            2,
            addr(&attr),
            size_of::<ibv_port_attr>()
        )]
    );
    // The header does not clear the buffer on this path.
    assert_eq!(attr.lid, 0xAAAA);
}

#[test]
fn query_port_falls_back_when_extended_op_is_absent_or_beyond_sz() {
    for (sz, op) in [
        // verbs_context too old to contain query_port
        (
            size_of::<verbs_context>() - offset_of!(verbs_context, query_port) - 1,
            Some(fake_ext_query_port as ExtQueryPort),
        ),
        // recent enough, but the provider left it NULL
        (size_of::<verbs_context>(), None),
    ] {
        let mut vctx = Box::<verbs_context>::default();
        vctx.sz = sz;
        vctx.query_port = op;
        vctx.context.abi_compat = VERBS_ABI_IS_EXTENDED;
        let vp: *mut verbs_context = &mut *vctx;
        // SAFETY: as in verbs_get_ctx test.
        let ctx = unsafe { ptr::addr_of_mut!((*vp).context) };
        let mut attr = dirty_port_attr();
        // SAFETY: extended fake context; compat fake only records.
        let rc = unsafe { query_port_with(fake_compat_query_port, ctx, 1, &mut attr) };
        assert_eq!(rc, 106);
        assert_eq!(
            take_calls(),
            [Call::CompatQueryPort(addr(ctx), 1, addr(&attr), true)]
        );
    }
}

#[test]
fn reg_mr_uses_plain_export_without_optional_flags() {
    let pd = 0x10 as *mut ibv_pd;
    let mut buf = [0u8; 64];
    let a = buf.as_mut_ptr().cast::<c_void>();
    let access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
    // SAFETY: fakes only record their arguments.
    let mr = unsafe { reg_mr_with(fake_reg_mr, fake_reg_mr_iova2, pd, a, 64, access) };
    assert_eq!(mr as usize, 0x1000);
    assert_eq!(
        take_calls(),
        [Call::RegMr(0x10, addr(a), 64, access as c_int)]
    );
}

#[test]
fn reg_mr_uses_iova2_with_addr_as_iova_for_optional_flags() {
    let pd = 0x10 as *mut ibv_pd;
    let mut buf = [0u8; 64];
    let a = buf.as_mut_ptr().cast::<c_void>();
    let access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_RELAXED_ORDERING;
    assert_ne!(access & IBV_ACCESS_OPTIONAL_RANGE, 0);
    // SAFETY: fakes only record their arguments.
    let mr = unsafe { reg_mr_with(fake_reg_mr, fake_reg_mr_iova2, pd, a, 64, access) };
    assert_eq!(mr as usize, 0x2000);
    assert_eq!(
        take_calls(),
        [Call::RegMrIova2(0x10, addr(a), 64, addr(a) as u64, access)]
    );
}
