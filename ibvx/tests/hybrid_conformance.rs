//! The xdev conformance suite on the `hybrid` device, on this one machine:
//! host groups are simulated (`simulate_hosts`), with shared memory inside a
//! group and, between groups, a second shared-memory world (`remote=shm`) or
//! PSM2 in its shm-only mode (`remote=psm`), so that the layer's routing,
//! rank mapping and held wildcard receives run over real devices in real
//! processes. One job without simulation runs the single-host case (no
//! network device at all). With an RDMA device (the soft-RoCE VM suite),
//! two simulated hosts use the `ibv` device between them; elsewhere that
//! part says `skipped: ...`. `ci/two-guest-suite.sh` runs the real thing:
//! two guests, two ranks each, verbs between them.
#![cfg(all(feature = "ibv", feature = "psm", feature = "hybrid"))]

use std::time::Duration;

use xdev::devkit::launch::LocalJob;

mod common;
mod rank;

fn run(n: usize, case: &str, options: &[&str]) {
    if options.contains(&"remote=ibv") && common::open().is_none() {
        return;
    }
    if options.contains(&"remote=psm") {
        if let Err(e) = psm_sys::Psm2::load() {
            println!("skipped: {e}");
            return;
        }
    }
    let mut args = vec!["conformance", case];
    args.extend_from_slice(options);
    let Some(program) = rank::program() else {
        return;
    };
    let job = LocalJob::start(n, program, &args, &[("XDEV_DEVICE", "hybrid")]).expect("start job");
    let exits = job.wait(Duration::from_secs(300)).expect("job ends");
    let failures = xdev::devkit::launch::failures(&exits);
    assert!(failures.is_empty(), "{failures}");
}

/// Two simulated hosts of two ranks, a second shm world between them.
mod two_hosts_over_shm {
    xdev::devkit::conformance_tests!(|case| super::run(
        4,
        case,
        &["simulate_hosts=2", "remote=shm"]
    ));
}

/// Four simulated hosts of one rank: every peer is remote.
mod four_hosts_over_shm {
    xdev::devkit::conformance_tests!(|case| super::run(
        4,
        case,
        &["simulate_hosts=4", "remote=shm"]
    ));
}

/// Two simulated hosts of two ranks, PSM2 (shm-only mode) between them.
mod two_hosts_over_psm {
    xdev::devkit::conformance_tests!(|case| super::run(
        4,
        case,
        &["simulate_hosts=2", "remote=psm"]
    ));
}

/// Two simulated hosts of two ranks, verbs between them (RDMA device only).
mod two_hosts_over_ibv {
    xdev::devkit::conformance_tests!(|case| super::run(
        4,
        case,
        &["simulate_hosts=2", "remote=ibv"]
    ));
}

/// One real host: shared memory only.
mod one_host {
    xdev::devkit::conformance_tests!(|case| super::run(2, case, &[]));
}
