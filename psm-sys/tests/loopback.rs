//! A real round trip through libpsm2, when it is installed.
//!
//! libpsm2 reads `PSM2_DEVICES` from the environment and keeps process-wide
//! state (one endpoint per process, a `psm2_init` that cannot be undone, see
//! the crate docs), while tests run as threads of one process. So the parent
//! test re-runs this test binary as a child process, with
//! `PSM2_DEVICES=self,shm` in its environment from the start, and the child
//! does the PSM2 work.

use std::ffi::{c_void, CStr};
use std::process::Command;
use std::ptr;
use std::time::{Duration, Instant};

use psm_sys::ffi::*;
use psm_sys::{LoadError, Psm2};

/// Set in the child's environment; the child test does nothing without it.
const CHILD_ENV: &str = "PSM_SYS_LOOPBACK_CHILD";
/// Printed by the child once every check passed.
const CHILD_OK: &str = "psm-sys loopback: payload ok";

#[test]
fn mq_loopback_in_child_process() {
    match Psm2::load() {
        Ok(_) => {}
        Err(LoadError::Library { message, .. }) => {
            println!("skipped: libpsm2.so.2 not installed ({message})");
            return;
        }
        Err(e) => panic!("libpsm2.so.2 is installed but unusable: {e}"),
    }
    let exe = std::env::current_exe().expect("path of this test binary");
    let out = Command::new(exe)
        .args([
            "--exact",
            "child_mq_loopback",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
        .env("PSM2_DEVICES", "self,shm")
        .output()
        .expect("spawn the test binary as a child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("--- child stdout ---\n{stdout}--- child stderr ---\n{stderr}---");
    assert!(out.status.success(), "child failed: {}", out.status);
    assert!(stdout.contains(CHILD_OK), "child did not report success");
}

/// The child half of `mq_loopback_in_child_process`; a no-op unless spawned by it.
#[test]
fn child_mq_loopback() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    assert_eq!(
        std::env::var("PSM2_DEVICES").as_deref(),
        Ok("self,shm"),
        "the parent sets PSM2_DEVICES"
    );
    let psm = Psm2::load().expect("libpsm2 loads in the child");
    let init = init(psm);
    let (ep, epid, mq) = open_endpoint(psm);
    let addr = connect_to_self(psm, ep, epid);
    let sent = send_to_self(psm, ep, mq, addr);
    check_stats(psm, mq, sent);
    close(psm, ep, mq, addr, init);
    println!("{CHILD_OK}");
}

/// `e` as its number and, when libpsm2 has one, its description.
fn describe(psm: &Psm2, e: psm2_error_t) -> String {
    // SAFETY: psm2_error_get_string accepts any code and returns a
    // pointer to a static NUL-terminated string (or NULL).
    let s = unsafe { (psm.psm2_error_get_string)(e) };
    if s.is_null() {
        format!("{}", e.0)
    } else {
        // SAFETY: non-null, NUL-terminated, static (see above).
        let text = unsafe { CStr::from_ptr(s) };
        format!("{} ({})", e.0, text.to_string_lossy())
    }
}

/// Asserts that `what` returned PSM2_OK, and says so.
fn check(psm: &Psm2, what: &str, e: psm2_error_t) {
    assert_eq!(e, psm2_error::PSM2_OK, "{what}: {}", describe(psm, e));
    println!("{what}: ok");
}

/// Registers the no-handler error handler and runs `psm2_init`, which may
/// fail only as it does without hfi hardware; returns its result.
fn init(psm: &Psm2) -> psm2_error_t {
    // SAFETY: a global (NULL endpoint) handler may be registered before
    // psm2_init; the sentinel asks PSM2 to return errors instead of exiting.
    let e = unsafe { (psm.psm2_error_register_handler)(ptr::null_mut(), errhandler_no_handler()) };
    check(psm, "psm2_error_register_handler(NULL, NO_HANDLER)", e);

    let (mut major, mut minor) = (PSM2_VERNO_MAJOR as i32, PSM2_VERNO_MINOR as i32);
    // SAFETY: both pointers are valid for the call.
    let init = unsafe { (psm.psm2_init)(&mut major, &mut minor) };
    println!(
        "psm2_init: {} (library API {major}.{minor})",
        describe(psm, init)
    );
    // Without hfi hardware psm2_init fails with PSM2_INTERNAL_ERR, yet shm
    // endpoints work (crate docs); with hardware it succeeds.
    assert!(
        init == psm2_error::PSM2_OK || init == psm2_error::PSM2_INTERNAL_ERR,
        "psm2_init: {}",
        describe(psm, init)
    );
    init
}

/// Opens an endpoint with the default options under a fresh job key, and
/// its matched queue.
fn open_endpoint(psm: &Psm2) -> (psm2_ep_t, psm2_epid_t, psm2_mq_t) {
    let mut opts = std::mem::MaybeUninit::<psm2_ep_open_opts>::zeroed();
    // SAFETY: `opts` is valid for writes of one psm2_ep_open_opts.
    let e = unsafe { (psm.psm2_ep_open_opts_get_defaults)(opts.as_mut_ptr()) };
    check(psm, "psm2_ep_open_opts_get_defaults", e);
    // SAFETY: zero-initialised, then filled by PSM2; all fields are integers.
    let opts = unsafe { opts.assume_init() };

    let mut job_key: psm2_uuid_t = [0; 16];
    // SAFETY: job_key is a 16-byte buffer, as psm2_uuid_t requires.
    unsafe { (psm.psm2_uuid_generate)(job_key.as_mut_ptr()) };
    let mut ep: psm2_ep_t = ptr::null_mut();
    let mut epid: psm2_epid_t = 0;
    // SAFETY: job key, options and out-pointers are valid for the call.
    let e = unsafe { (psm.psm2_ep_open)(job_key.as_ptr(), &opts, &mut ep, &mut epid) };
    check(psm, "psm2_ep_open", e);
    assert!(!ep.is_null() && epid != 0);
    println!("epid {epid:#x}");

    let mut mq: psm2_mq_t = ptr::null_mut();
    // SAFETY: `ep` is open; no options are passed; `mq` is a valid out-pointer.
    let e = unsafe { (psm.psm2_mq_init)(ep, PSM2_MQ_ORDERMASK_ALL, ptr::null(), 0, &mut mq) };
    check(psm, "psm2_mq_init", e);
    (ep, epid, mq)
}

/// Connects the open endpoint `ep` to its own `epid`; returns the epaddr.
fn connect_to_self(psm: &Psm2, ep: psm2_ep_t, epid: psm2_epid_t) -> psm2_epaddr_t {
    let mut addr: psm2_epaddr_t = ptr::null_mut();
    let mut conn_err = psm2_error::PSM2_INTERNAL_ERR;
    // SAFETY: one epid in, one error and one epaddr out, all valid; no mask.
    let e = unsafe {
        (psm.psm2_ep_connect)(
            ep,
            1,
            &epid,
            ptr::null(),
            &mut conn_err,
            &mut addr,
            5_000_000_000,
        )
    };
    check(psm, "psm2_ep_connect(own epid)", e);
    check(psm, "psm2_ep_connect(own epid) per-epid error", conn_err);
    addr
}

/// Posts a tagged receive and a send of a payload to `addr` (ourselves),
/// waits for both and checks what arrived; returns the payload's length.
fn send_to_self(psm: &Psm2, ep: psm2_ep_t, mq: psm2_mq_t, addr: psm2_epaddr_t) -> usize {
    let payload = *b"psm-sys says hi";
    let mut received = [0u8; 64];
    let mut tag = psm2_mq_tag_t {
        tag: [0xdead_beef, 0x0123_4567, 0x89ab_cdef, 0],
    };
    let mut tag_sel = psm2_mq_tag_t { tag: [u32::MAX; 4] };
    let mut recv_req: psm2_mq_req_t = ptr::null_mut();
    let mut send_req: psm2_mq_req_t = ptr::null_mut();
    // SAFETY: `received` outlives the request (it is waited for below); tag,
    // selector and request pointers are valid for the call.
    let e = unsafe {
        (psm.psm2_mq_irecv2)(
            mq,
            PSM2_MQ_ANY_ADDR,
            &mut tag,
            &mut tag_sel,
            0,
            received.as_mut_ptr().cast::<c_void>(),
            received.len() as u32,
            ptr::null_mut(),
            &mut recv_req,
        )
    };
    check(psm, "psm2_mq_irecv2", e);
    // SAFETY: `payload` outlives the request (it is waited for below); `addr`
    // is the connected epaddr.
    let e = unsafe {
        (psm.psm2_mq_isend2)(
            mq,
            addr,
            0,
            &mut tag,
            payload.as_ptr().cast::<c_void>(),
            payload.len() as u32,
            ptr::null_mut(),
            &mut send_req,
        )
    };
    check(psm, "psm2_mq_isend2", e);

    let send_status = complete(psm, ep, &mut send_req, "send");
    assert_eq!(send_status.error_code, psm2_error::PSM2_OK);
    let status = complete(psm, ep, &mut recv_req, "receive");
    check_received(psm, &status, addr, &payload, &received);
    payload.len()
}

/// Polls `ep` until the request `req` completes (within 10 s); returns its
/// status.
fn complete(psm: &Psm2, ep: psm2_ep_t, req: &mut psm2_mq_req_t, what: &str) -> psm2_mq_status2_t {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut status = std::mem::MaybeUninit::<psm2_mq_status2_t>::zeroed();
        // SAFETY: `ep` is open.
        let _ = unsafe { (psm.psm2_poll)(ep) };
        // SAFETY: `req` is a live request; `status` is valid for writes.
        let e = unsafe { (psm.psm2_mq_test2)(req, status.as_mut_ptr()) };
        if e == psm2_error::PSM2_OK {
            assert_eq!(
                *req, PSM2_MQ_REQINVALID,
                "{what}: completed request is reset"
            );
            println!("{what}: complete");
            // SAFETY: zero-initialised, then filled by PSM2 on completion.
            return unsafe { status.assume_init() };
        }
        assert_eq!(
            e,
            psm2_error::PSM2_MQ_NO_COMPLETIONS,
            "{what}: {}",
            describe(psm, e)
        );
        assert!(
            Instant::now() < deadline,
            "{what}: no completion within 10 s"
        );
    }
}

/// The receive's `status` and the `received` bytes: `payload`, with its
/// tag, from `addr`.
fn check_received(
    psm: &Psm2,
    status: &psm2_mq_status2_t,
    addr: psm2_epaddr_t,
    payload: &[u8],
    received: &[u8],
) {
    assert_eq!(
        status.error_code,
        psm2_error::PSM2_OK,
        "{}",
        describe(psm, status.error_code)
    );
    assert_eq!(status.msg_length as usize, payload.len());
    assert_eq!(status.nbytes as usize, payload.len());
    // SAFETY: both union views are plain u32 data over the same bytes.
    let got = unsafe { status.msg_tag.__bindgen_anon_1 };
    assert_eq!(
        (got.tag0, got.tag1, got.tag2),
        (0xdead_beef, 0x0123_4567, 0x89ab_cdef)
    );
    assert_eq!(status.msg_peer, addr, "message comes from our own epaddr");
    assert_eq!(&received[..payload.len()], payload);
}

/// The queue's statistics count at least the `sent` bytes as received.
fn check_stats(psm: &Psm2, mq: psm2_mq_t, sent: usize) {
    let mut stats = std::mem::MaybeUninit::<psm2_mq_stats_t>::zeroed();
    // SAFETY: `mq` is live; `stats` is valid for writes.
    unsafe { (psm.psm2_mq_get_stats)(mq, stats.as_mut_ptr()) };
    // SAFETY: zero-initialised, then filled by PSM2; all fields are u64.
    let stats = unsafe { stats.assume_init() };
    println!(
        "stats: rx_user_num {} rx_user_bytes {} tx_num {}",
        stats.rx_user_num, stats.rx_user_bytes, stats.tx_num
    );
    assert!(stats.rx_user_bytes >= sent as u64);
}

/// Disconnects `addr`, finalizes `mq`, closes `ep`, and finalizes PSM2 if
/// `init` succeeded.
fn close(psm: &Psm2, ep: psm2_ep_t, mq: psm2_mq_t, mut addr: psm2_epaddr_t, init: psm2_error_t) {
    let mut disc_err = psm2_error::PSM2_INTERNAL_ERR;
    // SAFETY: one connected epaddr in, one error out; no mask.
    let e = unsafe {
        (psm.psm2_ep_disconnect2)(
            ep,
            1,
            &mut addr,
            ptr::null(),
            &mut disc_err,
            PSM2_EP_DISCONNECT_GRACEFUL as i32,
            1_000_000_000,
        )
    };
    check(psm, "psm2_ep_disconnect2", e);
    // SAFETY: no request is pending on `mq`.
    let e = unsafe { (psm.psm2_mq_finalize)(mq) };
    check(psm, "psm2_mq_finalize", e);
    // SAFETY: `ep` is open and no longer used after this call.
    let e = unsafe { (psm.psm2_ep_close)(ep, PSM2_EP_CLOSE_GRACEFUL as i32, 0) };
    check(psm, "psm2_ep_close", e);
    if init == psm2_error::PSM2_OK {
        // SAFETY: init succeeded and every endpoint is closed. (After a
        // failed init psm2_finalize crashes; see the crate docs.)
        let e = unsafe { (psm.psm2_finalize)() };
        check(psm, "psm2_finalize", e);
    }
}
