//! The xdev conformance suite on the `ibv` device (IBVX over verbs) with 2
//! and 4 processes. It needs an RDMA device: on a host without one it says
//! `skipped: ...` (and fails instead when `IBVX_REQUIRE_RDMA=1`, as in the
//! soft-RoCE VM suite, which runs it for real over rxe).
#![cfg(feature = "ibv")]

use std::sync::Mutex;
use std::time::Duration;

use xdev::devkit::launch::LocalJob;

mod common;
mod rank;

static SERIAL: Mutex<()> = Mutex::new(());

fn run(n: usize, case: &str, options: &[&str]) {
    if common::open().is_none() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut args = vec!["conformance", case];
    args.extend_from_slice(options);
    let Some(program) = rank::program() else {
        return;
    };
    let job = LocalJob::start(n, program, &args, &[("XDEV_DEVICE", "ibv")]).expect("start job");
    let secs = std::env::var("IBVX_JOB_TIMEOUT")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(300);
    let exits = job.wait(Duration::from_secs(secs)).expect("job ends");
    let failures = xdev::devkit::launch::failures(&exits);
    assert!(failures.is_empty(), "{failures}");
}

mod two_processes {
    xdev::devkit::conformance_tests!(|case| super::run(2, case, &[]));
}

mod four_processes {
    xdev::devkit::conformance_tests!(|case| super::run(4, case, &[]));
}

/// The smallest budgets the device accepts: four receive slots per peer and
/// four send slots, so credits run out all the time (both sides must keep
/// returning them, also the slots their credit messages use), a 256-byte
/// eager window and a 64-byte eager limit, so most messages go rendezvous.
mod tiny_budgets {
    xdev::devkit::conformance_tests!(|case| super::run(
        2,
        case,
        &[
            "recv_depth=4",
            "send_slots=4",
            "eager_window=256",
            "eager_limit=64"
        ]
    ));
}
