//! Scenarios of `xdev-rank` on every multi-process device that runs here
//! (`ibv` needs an RDMA device: the soft-RoCE VM suite runs it):
//! - a rendezvous-size message into a smaller receive posted before it was
//!   sent reports the truncation with the sender's length (libpsm2 itself
//!   does not report it; the psm device carries the length in its tag);
//! - a peer that exits without finishing makes a receive from it, a send to
//!   it and a probe naming it fail with PeerLost, and the survivor finishes;
//! - a peer that exits with a rendezvous send to it in flight makes that
//!   send fail with PeerLost, and its data comes back (on psm in a copy:
//!   PSM2 may still read the memory, which the device keeps);
//! - receives still posted at finish end with Closed, as do operations
//!   started after it.
#![cfg(all(feature = "ibv", feature = "psm", feature = "hybrid"))]

use std::time::Duration;

use xdev::devkit::launch::LocalJob;

mod common;
mod rank;

fn run(device: &str, scenario: &str) {
    run_with(device, scenario, &[]);
}

/// The hybrid device with each of the two ranks on a simulated host of its
/// own, so that every peer is reached through the network side (here a
/// second shared-memory world).
const HYBRID_TWO_HOSTS: &[&str] = &["simulate_hosts=2", "remote=shm"];

fn run_with(device: &str, scenario: &str, options: &[&str]) {
    if device == "psm" {
        if let Err(e) = psm_sys::Psm2::load() {
            println!("skipped: {e}");
            return;
        }
    }
    if device == "ibv" && common::open().is_none() {
        return;
    }
    let Some(program) = rank::program() else {
        return;
    };
    let job = LocalJob::start(
        2,
        program,
        &[&[scenario], options].concat(),
        &[("XDEV_DEVICE", device)],
    )
    .expect("start job");
    let exits = job.wait(Duration::from_secs(120)).expect("job ends");
    let failures = xdev::devkit::launch::failures(&exits);
    assert!(failures.is_empty(), "{device}: {failures}");
}

#[test]
fn shm_posted_truncation() {
    run("shm", "posted-truncation");
}

#[test]
fn psm_posted_truncation() {
    run("psm", "posted-truncation");
}

#[test]
fn shm_peer_exit() {
    run("shm", "peer-exit");
}

#[test]
fn psm_peer_exit() {
    run("psm", "peer-exit");
}

#[test]
fn shm_inflight_send() {
    run("shm", "inflight-send");
}

#[test]
fn psm_inflight_send() {
    run("psm", "inflight-send");
}

#[test]
fn shm_finish_posted() {
    run("shm", "finish-posted");
}

#[test]
fn psm_finish_posted() {
    run("psm", "finish-posted");
}

#[test]
fn ibv_posted_truncation() {
    run("ibv", "posted-truncation");
}

#[test]
fn ibv_peer_exit() {
    run("ibv", "peer-exit");
}

#[test]
fn ibv_inflight_send() {
    run("ibv", "inflight-send");
}

#[test]
fn ibv_finish_posted() {
    run("ibv", "finish-posted");
}

#[test]
fn hybrid_posted_truncation() {
    run_with("hybrid", "posted-truncation", HYBRID_TWO_HOSTS);
}

#[test]
fn hybrid_peer_exit() {
    run_with("hybrid", "peer-exit", HYBRID_TWO_HOSTS);
}

#[test]
fn hybrid_inflight_send() {
    run_with("hybrid", "inflight-send", HYBRID_TWO_HOSTS);
}

#[test]
fn hybrid_finish_posted() {
    run_with("hybrid", "finish-posted", HYBRID_TWO_HOSTS);
}

#[test]
fn hybrid_one_host_peer_exit() {
    run_with("hybrid", "peer-exit", &[]);
}
