//! Real-device test of the inline ops-table equivalents (`ibv_post_send`,
//! `ibv_post_recv`, `ibv_post_srq_recv`, `ibv_poll_cq`, `ibv_req_notify_cq`)
//! and of the loaded `Verbs` table: two RC QPs on the first verbs device are
//! connected to each other in loopback and exchange one message each way.
//!
//! Needs an RDMA device (soft-RoCE is enough); without one it prints
//! "skipped: no RDMA device ..." and returns. Inside the soft-RoCE VM:
//!
//! ```text
//! RXE_GID_INDEX=1 cargo test -p ibvx-sys --test device_loopback -- --nocapture
//! ```
//!
//! Environment: `RXE_GID_INDEX` (GID table index of port 1, default 1: the
//! IPv4-mapped RoCE v2 GID of an rxe device), `RXE_DEVICE` (device name,
//! default: the first device listed).

use std::ffi::{c_int, c_void, CStr};
use std::io;
use std::ptr;
use std::time::{Duration, Instant};

use ibvx_sys::*;

const SKIP: &str = "skipped: no RDMA device (run inside the soft-RoCE VM: ci/softroce-vm.sh)";
const PORT: u8 = 1;
const PSN: u32 = 0x1234;
/// Size of each of the four buffer slots (send A, recv A, send B, recv B).
const SLOT: usize = 256;
const TIMEOUT: Duration = Duration::from_secs(10);

const WR_SEND_A: u64 = 0xA0;
const WR_RECV_A: u64 = 0xA1;
const WR_SEND_B: u64 = 0xB0;
const WR_RECV_B: u64 = 0xB1;

fn check(rc: c_int, what: &str) {
    assert_eq!(rc, 0, "{what} failed: {}", io::Error::from_raw_os_error(rc));
}

fn non_null<T>(p: *mut T, what: &str) -> *mut T {
    assert!(
        !p.is_null(),
        "{what} failed: {}",
        io::Error::last_os_error()
    );
    p
}

fn cstr(p: *const std::ffi::c_char) -> String {
    // SAFETY: libibverbs' name and *_str functions return NUL-terminated
    // strings that outlive this call.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// What `connect` needs to know about the local port.
struct PortInfo {
    attr: ibv_port_attr,
    gid: ibv_gid,
    gid_index: u8,
    use_grh: bool,
}

/// Drives `qp` through INIT, RTR and RTS, connected to `remote_qpn` on the
/// same port (loopback), as ibv_rc_pingpong does.
///
/// # Safety
/// `qp` is a live RC QP of the device `port` was queried on.
unsafe fn connect(verbs: &Verbs, qp: *mut ibv_qp, remote_qpn: u32, port: &PortInfo) {
    // SAFETY: `qp` is a live RC QP of the device `port` was queried on (the
    // caller's contract), moved through the states in order.
    unsafe {
        modify_to_init(verbs, qp);
        modify_to_rtr(verbs, qp, remote_qpn, port);
        modify_to_rts(verbs, qp);
    }

    let mut got = ibv_qp_attr::default();
    let mut init = ibv_qp_init_attr::default();
    // SAFETY: live QP, valid out-parameters.
    check(
        unsafe { (verbs.ibv_query_qp)(qp, &mut got, IBV_QP_STATE as c_int, &mut init) },
        "ibv_query_qp",
    );
    assert_eq!(got.qp_state, IBV_QPS_RTS);
}

/// RESET -> INIT on port `PORT`, local write access.
///
/// # Safety
/// `qp` is a live RC QP.
unsafe fn modify_to_init(verbs: &Verbs, qp: *mut ibv_qp) {
    let mut attr = ibv_qp_attr {
        qp_state: IBV_QPS_INIT,
        pkey_index: 0,
        port_num: PORT,
        qp_access_flags: IBV_ACCESS_LOCAL_WRITE,
        ..Default::default()
    };
    let mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
    // SAFETY: live QP, valid attr.
    check(
        unsafe { (verbs.ibv_modify_qp)(qp, &mut attr, mask as c_int) },
        "ibv_modify_qp(INIT)",
    );
}

/// INIT -> RTR, with the path to `remote_qpn` on the local port.
///
/// # Safety
/// `qp` is a live RC QP in INIT of the device `port` was queried on.
unsafe fn modify_to_rtr(verbs: &Verbs, qp: *mut ibv_qp, remote_qpn: u32, port: &PortInfo) {
    let mut attr = ibv_qp_attr {
        qp_state: IBV_QPS_RTR,
        path_mtu: port.attr.active_mtu,
        dest_qp_num: remote_qpn,
        rq_psn: PSN,
        max_dest_rd_atomic: 1,
        min_rnr_timer: 12,
        ah_attr: ibv_ah_attr {
            grh: ibv_global_route {
                dgid: port.gid,
                flow_label: 0,
                sgid_index: port.gid_index,
                hop_limit: 1,
                traffic_class: 0,
            },
            dlid: port.attr.lid,
            sl: 0,
            src_path_bits: 0,
            static_rate: 0,
            is_global: u8::from(port.use_grh),
            port_num: PORT,
        },
        ..Default::default()
    };
    let mask = IBV_QP_STATE
        | IBV_QP_AV
        | IBV_QP_PATH_MTU
        | IBV_QP_DEST_QPN
        | IBV_QP_RQ_PSN
        | IBV_QP_MAX_DEST_RD_ATOMIC
        | IBV_QP_MIN_RNR_TIMER;
    // SAFETY: live QP, valid attr.
    check(
        unsafe { (verbs.ibv_modify_qp)(qp, &mut attr, mask as c_int) },
        "ibv_modify_qp(RTR)",
    );
}

/// RTR -> RTS.
///
/// # Safety
/// `qp` is a live RC QP in RTR.
unsafe fn modify_to_rts(verbs: &Verbs, qp: *mut ibv_qp) {
    let mut attr = ibv_qp_attr {
        qp_state: IBV_QPS_RTS,
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        sq_psn: PSN,
        max_rd_atomic: 1,
        ..Default::default()
    };
    let mask = IBV_QP_STATE
        | IBV_QP_TIMEOUT
        | IBV_QP_RETRY_CNT
        | IBV_QP_RNR_RETRY
        | IBV_QP_SQ_PSN
        | IBV_QP_MAX_QP_RD_ATOMIC;
    // SAFETY: live QP, valid attr.
    check(
        unsafe { (verbs.ibv_modify_qp)(qp, &mut attr, mask as c_int) },
        "ibv_modify_qp(RTS)",
    );
}

/// Polls `cq` through the inline `ibv_poll_cq` until `want` completions
/// arrived, all successful.
///
/// # Safety
/// `cq` is a live CQ.
unsafe fn poll_until(verbs: &Verbs, cq: *mut ibv_cq, want: usize) -> Vec<ibv_wc> {
    let deadline = Instant::now() + TIMEOUT;
    let mut got = Vec::new();
    while got.len() < want {
        let mut wc = [ibv_wc::default(); 4];
        // SAFETY: live CQ; `wc` has room for 4 entries.
        let n = unsafe { ibv_poll_cq(cq, wc.len() as c_int, wc.as_mut_ptr()) };
        assert!(n >= 0, "ibv_poll_cq returned {n}");
        got.extend_from_slice(&wc[..n as usize]);
        assert!(
            Instant::now() < deadline,
            "only {} of {want} completions after {TIMEOUT:?}",
            got.len()
        );
    }
    assert_eq!(got.len(), want, "unexpected extra completions");
    for wc in &got {
        assert_eq!(
            wc.status,
            IBV_WC_SUCCESS,
            "wr_id {:#x}: {} (vendor_err {:#x})",
            wc.wr_id,
            // SAFETY: static string lookup.
            cstr(unsafe { (verbs.ibv_wc_status_str)(wc.status) }),
            wc.vendor_err
        );
    }
    got
}

fn find(wcs: &[ibv_wc], wr_id: u64) -> ibv_wc {
    *wcs.iter()
        .find(|wc| wc.wr_id == wr_id)
        .unwrap_or_else(|| panic!("no completion for wr_id {wr_id:#x}"))
}

/// The two connected QPs, their CQ, channel and SRQ, and the registered
/// buffer of four slots: what both exchanges use.
struct Loopback {
    cq: *mut ibv_cq,
    channel: *mut ibv_comp_channel,
    srq: *mut ibv_srq,
    qp_a: *mut ibv_qp,
    qp_b: *mut ibv_qp,
    qpn_a: u32,
    qpn_b: u32,
    /// Start of the registered buffer.
    base: *mut u8,
    lkey: u32,
}

impl Loopback {
    /// The start of buffer slot `i`.
    fn slot(&self, i: usize) -> *mut u8 {
        self.base.wrapping_add(i * SLOT)
    }

    /// An SGE over the first `len` bytes of slot `i`.
    fn sge(&self, i: usize, len: usize) -> ibv_sge {
        ibv_sge {
            addr: self.slot(i) as u64,
            length: len as u32,
            lkey: self.lkey,
        }
    }
}

#[test]
fn rc_loopback_send_recv_through_ops_table() {
    let verbs = match Verbs::load() {
        Ok(v) => v,
        Err(e) => {
            println!("{SKIP} [{e}]");
            return;
        }
    };
    let Some((ctx, name)) = open_device(verbs) else {
        return;
    };
    // SAFETY: live context.
    let port = unsafe { query_port_info(verbs, ctx, &name) };

    // SAFETY: live context.
    let pd = non_null(unsafe { (verbs.ibv_alloc_pd)(ctx) }, "ibv_alloc_pd");
    let mut buf = vec![0u8; 4 * SLOT];
    let base = buf.as_mut_ptr();
    // SAFETY: `buf` outlives the MR (deregistered before `buf` is dropped)
    // and is only accessed through `base` from here on.
    let mr = non_null(
        unsafe { verbs.reg_mr(pd, base.cast::<c_void>(), buf.len(), IBV_ACCESS_LOCAL_WRITE) },
        "ibv_reg_mr",
    );
    // SAFETY: live MR.
    let lkey = unsafe { (*mr).lkey };
    // SAFETY: live context and PD.
    let (channel, cq, srq) = unsafe { create_queues(verbs, ctx, pd) };
    // SAFETY: live PD, CQ and SRQ of one context.
    let (qp_a, qp_b) = unsafe { create_qps(verbs, pd, cq, srq) };
    // SAFETY: live QPs.
    let (qpn_a, qpn_b) = unsafe { ((*qp_a).qp_num, (*qp_b).qp_num) };
    // SAFETY: live RC QPs of this device.
    unsafe {
        connect(verbs, qp_a, qpn_b, &port);
        connect(verbs, qp_b, qpn_a, &port);
    }
    let lb = Loopback {
        cq,
        channel,
        srq,
        qp_a,
        qp_b,
        qpn_a,
        qpn_b,
        base,
        lkey,
    };

    // SAFETY: `lb` holds live, connected objects and the registered buffer,
    // which only the exchanges touch.
    unsafe {
        exchange_through_srq(verbs, &lb);
        exchange_with_cq_event(verbs, &lb);
    }
    println!("{name}: both messages delivered");

    // SAFETY: nothing is in flight; every object is destroyed here once.
    unsafe { destroy(verbs, ctx, pd, mr, &lb) };
    drop(buf);
}

/// Opens `RXE_DEVICE`, or the first device listed; returns the context and
/// the device's name. Prints the skip message and returns `None` when there
/// is no device.
fn open_device(verbs: &Verbs) -> Option<(*mut ibv_context, String)> {
    let mut num: c_int = 0;
    // SAFETY: valid out-parameter.
    let list = unsafe { (verbs.ibv_get_device_list)(&mut num) };
    if list.is_null() || num == 0 {
        if !list.is_null() {
            // SAFETY: list from ibv_get_device_list, freed once.
            unsafe { (verbs.ibv_free_device_list)(list) };
        }
        println!("{SKIP}");
        return None;
    }
    // SAFETY: `list` holds `num` devices followed by NULL.
    let devices: Vec<*mut ibv_device> =
        (0..num as usize).map(|i| unsafe { *list.add(i) }).collect();
    let names: Vec<String> = devices
        .iter()
        // SAFETY: devices of the live list.
        .map(|&d| cstr(unsafe { (verbs.ibv_get_device_name)(d) }))
        .collect();
    let index = match std::env::var("RXE_DEVICE") {
        Ok(want) => names
            .iter()
            .position(|n| *n == want)
            .unwrap_or_else(|| panic!("RXE_DEVICE={want} not among {names:?}")),
        Err(_) => 0,
    };
    let name = names[index].clone();
    // SAFETY: a device of the live list.
    let ctx = non_null(
        unsafe { (verbs.ibv_open_device)(devices[index]) },
        "ibv_open_device",
    );
    // SAFETY: the opened context stays valid after the list is freed.
    unsafe { (verbs.ibv_free_device_list)(list) };
    Some((ctx, name))
}

/// Checks that port `PORT` of device `name` is active and reads the GID at
/// `RXE_GID_INDEX` (default 1), which must be set when the port needs a GRH.
///
/// # Safety
/// `ctx` is a live context.
unsafe fn query_port_info(verbs: &Verbs, ctx: *mut ibv_context, name: &str) -> PortInfo {
    let gid_index: u8 = std::env::var("RXE_GID_INDEX")
        .map(|v| v.parse().expect("RXE_GID_INDEX must be a small integer"))
        .unwrap_or(1);
    let mut port_attr = ibv_port_attr::default();
    // SAFETY: live context, valid out-parameter.
    check(
        unsafe { verbs.query_port(ctx, PORT, &mut port_attr) },
        "ibv_query_port",
    );
    assert_eq!(
        port_attr.state,
        IBV_PORT_ACTIVE,
        "{name} port {PORT} is {}",
        // SAFETY: static string lookup.
        cstr(unsafe { (verbs.ibv_port_state_str)(port_attr.state) })
    );
    let mut gid = ibv_gid::default();
    // SAFETY: live context, valid out-parameter.
    check(
        unsafe { (verbs.ibv_query_gid)(ctx, PORT, c_int::from(gid_index), &mut gid) },
        "ibv_query_gid",
    );
    let use_grh = u32::from(port_attr.link_layer) == IBV_LINK_LAYER_ETHERNET
        || port_attr.flags & IBV_QPF_GRH_REQUIRED != 0;
    // SAFETY: every bit pattern is a valid `raw` GID.
    let raw_gid = unsafe { gid.raw };
    if use_grh {
        assert_ne!(
            raw_gid, [0; 16],
            "GID index {gid_index} of {name} port {PORT} is empty: set RXE_GID_INDEX"
        );
    }
    println!(
        "device {name}: port {PORT} active, mtu enum {}, lid {}, gid[{gid_index}] {raw_gid:02x?}, grh {use_grh}",
        port_attr.active_mtu, port_attr.lid
    );
    PortInfo {
        attr: port_attr,
        gid,
        gid_index,
        use_grh,
    }
}

/// A completion channel, a CQ of 16 entries on it, and an SRQ of 4.
///
/// # Safety
/// `ctx` is a live context and `pd` a live PD of it.
unsafe fn create_queues(
    verbs: &Verbs,
    ctx: *mut ibv_context,
    pd: *mut ibv_pd,
) -> (*mut ibv_comp_channel, *mut ibv_cq, *mut ibv_srq) {
    // SAFETY: live context.
    let channel = non_null(
        unsafe { (verbs.ibv_create_comp_channel)(ctx) },
        "ibv_create_comp_channel",
    );
    // SAFETY: live context and channel.
    let cq = non_null(
        unsafe { (verbs.ibv_create_cq)(ctx, 16, ptr::null_mut(), channel, 0) },
        "ibv_create_cq",
    );
    let mut srq_init = ibv_srq_init_attr {
        srq_context: ptr::null_mut(),
        attr: ibv_srq_attr {
            max_wr: 4,
            max_sge: 1,
            srq_limit: 0,
        },
    };
    // SAFETY: live PD, valid attr.
    let srq = non_null(
        unsafe { (verbs.ibv_create_srq)(pd, &mut srq_init) },
        "ibv_create_srq",
    );
    (channel, cq, srq)
}

/// QPs A and B, both on `cq`: A receives on its own RQ, B through `srq`.
///
/// # Safety
/// `pd`, `cq` and `srq` are live objects of one context.
unsafe fn create_qps(
    verbs: &Verbs,
    pd: *mut ibv_pd,
    cq: *mut ibv_cq,
    srq: *mut ibv_srq,
) -> (*mut ibv_qp, *mut ibv_qp) {
    let qp_init = |srq: *mut ibv_srq| ibv_qp_init_attr {
        send_cq: cq,
        recv_cq: cq,
        srq,
        cap: ibv_qp_cap {
            max_send_wr: 4,
            max_recv_wr: if srq.is_null() { 4 } else { 0 },
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        qp_type: IBV_QPT_RC,
        sq_sig_all: 0,
        ..Default::default()
    };
    // A receives on its own RQ, B through the SRQ.
    // SAFETY: live PD, valid attr.
    let qp_a = non_null(
        unsafe { (verbs.ibv_create_qp)(pd, &mut qp_init(ptr::null_mut())) },
        "ibv_create_qp(A)",
    );
    // SAFETY: live PD, valid attr.
    let qp_b = non_null(
        unsafe { (verbs.ibv_create_qp)(pd, &mut qp_init(srq)) },
        "ibv_create_qp(B)",
    );
    (qp_a, qp_b)
}

/// Exchange 1: A -> B, received through the SRQ; completions by busy polling.
///
/// # Safety
/// `lb` holds live objects, its QPs connected, and its registered buffer
/// is used by no work request.
unsafe fn exchange_through_srq(verbs: &Verbs, lb: &Loopback) {
    let (send_a, recv_b) = (0, 3);
    let msg1 = b"ibvx-sys loopback: A to B through the SRQ";
    // SAFETY: slot `send_a` is in `buf` and no work request uses it yet.
    unsafe { ptr::copy_nonoverlapping(msg1.as_ptr(), lb.slot(send_a), msg1.len()) };
    let mut rsge = lb.sge(recv_b, SLOT);
    let mut rwr = ibv_recv_wr {
        wr_id: WR_RECV_B,
        next: ptr::null_mut(),
        sg_list: &mut rsge,
        num_sge: 1,
    };
    let mut bad_r: *mut ibv_recv_wr = ptr::null_mut();
    // SAFETY: live SRQ; the WR and its SGE outlive the call and describe registered memory.
    check(
        unsafe { ibv_post_srq_recv(lb.srq, &mut rwr, &mut bad_r) },
        "ibv_post_srq_recv",
    );
    let mut ssge = lb.sge(send_a, msg1.len());
    let mut swr = ibv_send_wr {
        wr_id: WR_SEND_A,
        sg_list: &mut ssge,
        num_sge: 1,
        opcode: IBV_WR_SEND,
        send_flags: IBV_SEND_SIGNALED,
        ..Default::default()
    };
    let mut bad_s: *mut ibv_send_wr = ptr::null_mut();
    // SAFETY: live QP in RTS; the WR and its SGE describe registered memory.
    check(
        unsafe { ibv_post_send(lb.qp_a, &mut swr, &mut bad_s) },
        "ibv_post_send(A)",
    );
    // SAFETY: live CQ.
    let wcs = unsafe { poll_until(verbs, lb.cq, 2) };
    let s = find(&wcs, WR_SEND_A);
    assert_eq!((s.opcode, s.qp_num), (IBV_WC_SEND, lb.qpn_a));
    let r = find(&wcs, WR_RECV_B);
    assert_eq!(
        (r.opcode, r.qp_num, r.byte_len as usize),
        (IBV_WC_RECV, lb.qpn_b, msg1.len())
    );
    // SAFETY: the receive completed, so the device is done writing the slot.
    let got1 = unsafe { std::slice::from_raw_parts(lb.slot(recv_b), msg1.len()) };
    assert_eq!(got1, msg1);
}

/// Exchange 2: B -> A into A's RQ; completion signalled through the channel.
///
/// # Safety
/// As for `exchange_through_srq`, which has completed.
unsafe fn exchange_with_cq_event(verbs: &Verbs, lb: &Loopback) {
    let (recv_a, send_b) = (1, 2);
    // SAFETY: live CQ.
    check(unsafe { ibv_req_notify_cq(lb.cq, 0) }, "ibv_req_notify_cq");
    let msg2 = b"ibvx-sys loopback: B to A through the RQ, with a CQ event";
    // SAFETY: slot `send_b` is in `buf` and unused.
    unsafe { ptr::copy_nonoverlapping(msg2.as_ptr(), lb.slot(send_b), msg2.len()) };
    let mut rsge = lb.sge(recv_a, SLOT);
    let mut rwr = ibv_recv_wr {
        wr_id: WR_RECV_A,
        next: ptr::null_mut(),
        sg_list: &mut rsge,
        num_sge: 1,
    };
    let mut bad_r: *mut ibv_recv_wr = ptr::null_mut();
    // SAFETY: live QP (own RQ); valid WR over registered memory.
    check(
        unsafe { ibv_post_recv(lb.qp_a, &mut rwr, &mut bad_r) },
        "ibv_post_recv",
    );
    let mut ssge = lb.sge(send_b, msg2.len());
    let mut swr = ibv_send_wr {
        wr_id: WR_SEND_B,
        sg_list: &mut ssge,
        num_sge: 1,
        opcode: IBV_WR_SEND,
        send_flags: IBV_SEND_SIGNALED,
        ..Default::default()
    };
    let mut bad_s: *mut ibv_send_wr = ptr::null_mut();
    // SAFETY: live QP in RTS; valid WR over registered memory.
    check(
        unsafe { ibv_post_send(lb.qp_b, &mut swr, &mut bad_s) },
        "ibv_post_send(B)",
    );
    // SAFETY: live channel and CQ, armed above.
    unsafe { wait_cq_event(verbs, lb.channel, lb.cq) };
    // SAFETY: live CQ.
    let wcs = unsafe { poll_until(verbs, lb.cq, 2) };
    let s = find(&wcs, WR_SEND_B);
    assert_eq!((s.opcode, s.qp_num), (IBV_WC_SEND, lb.qpn_b));
    let r = find(&wcs, WR_RECV_A);
    assert_eq!(
        (r.opcode, r.qp_num, r.byte_len as usize),
        (IBV_WC_RECV, lb.qpn_a, msg2.len())
    );
    // SAFETY: the receive completed.
    let got2 = unsafe { std::slice::from_raw_parts(lb.slot(recv_a), msg2.len()) };
    assert_eq!(got2, msg2);
}

/// Waits (up to `TIMEOUT`) for the event of `cq` on `channel`, takes it and
/// acknowledges it.
///
/// # Safety
/// `channel` and `cq` are live, `cq` attached to `channel`.
unsafe fn wait_cq_event(verbs: &Verbs, channel: *mut ibv_comp_channel, cq: *mut ibv_cq) {
    let mut pfd = libc::pollfd {
        // SAFETY: live channel.
        fd: unsafe { (*channel).fd },
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let ready = unsafe { libc::poll(&mut pfd, 1, TIMEOUT.as_millis() as c_int) };
    assert_eq!(ready, 1, "no CQ event within {TIMEOUT:?}");
    let mut ev_cq: *mut ibv_cq = ptr::null_mut();
    let mut ev_ctx: *mut c_void = ptr::null_mut();
    // SAFETY: live channel with a pending event; valid out-parameters.
    check(
        unsafe { (verbs.ibv_get_cq_event)(channel, &mut ev_cq, &mut ev_ctx) },
        "ibv_get_cq_event",
    );
    assert_eq!(ev_cq, cq);
    // SAFETY: acknowledges the one event just received.
    unsafe { (verbs.ibv_ack_cq_events)(cq, 1) };
}

/// Destroys every object of the test, children first.
///
/// # Safety
/// Every object is live and idle, and used no more after this call.
unsafe fn destroy(
    verbs: &Verbs,
    ctx: *mut ibv_context,
    pd: *mut ibv_pd,
    mr: *mut ibv_mr,
    lb: &Loopback,
) {
    // SAFETY: each object is live, idle, and destroyed once, children first.
    unsafe {
        check((verbs.ibv_destroy_qp)(lb.qp_a), "ibv_destroy_qp(A)");
        check((verbs.ibv_destroy_qp)(lb.qp_b), "ibv_destroy_qp(B)");
        check((verbs.ibv_destroy_srq)(lb.srq), "ibv_destroy_srq");
        check((verbs.ibv_destroy_cq)(lb.cq), "ibv_destroy_cq");
        check(
            (verbs.ibv_destroy_comp_channel)(lb.channel),
            "ibv_destroy_comp_channel",
        );
        check((verbs.ibv_dereg_mr)(mr), "ibv_dereg_mr");
        check((verbs.ibv_dealloc_pd)(pd), "ibv_dealloc_pd");
        check((verbs.ibv_close_device)(ctx), "ibv_close_device");
    }
}
