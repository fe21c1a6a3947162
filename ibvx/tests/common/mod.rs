//! What the device tests of this directory share (`verbs_loopback`,
//! `regcache_rxe`, `ibv_conformance`, `device_scenarios`): opening the
//! device or skipping without one, two RC QPs of that device connected to
//! each other, and the rank program of multi-process jobs.
//!
//! Environment: `RXE_DEVICE` (default: the first device), `RXE_GID_INDEX`
//! (default: the layer's choice), `IBVX_REQUIRE_RDMA=1` (a missing device is
//! a failure instead of a skip).

// Each test crate that includes this module uses a different part of it.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use ibvx::verbs::*;

/// The device port the tests use.
pub const PORT: u8 = 1;

/// The device to test on, or `None` (after printing why the test is
/// skipped) when there is none or libibverbs is missing.
pub fn open() -> Option<Context> {
    match Context::open(std::env::var("RXE_DEVICE").ok().as_deref()) {
        Ok(c) => Some(c),
        Err(e @ (Error::NoDevice { .. } | Error::Unavailable(_))) => {
            if std::env::var("IBVX_REQUIRE_RDMA").as_deref() == Ok("1") {
                panic!("IBVX_REQUIRE_RDMA=1 but: {e}");
            }
            println!("skipped: no RDMA device (runs in ci/vm-suite.sh) [{e}]");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

/// `RXE_GID_INDEX`, if set.
pub fn gid_index() -> Option<u32> {
    std::env::var("RXE_GID_INDEX")
        .ok()
        .map(|v| v.parse().expect("RXE_GID_INDEX"))
}

/// Two connected RC QPs of one device, on one CQ each.
pub struct Pair {
    pub a: QueuePair,
    pub b: QueuePair,
    pub cq_a: CompletionQueue,
    pub cq_b: CompletionQueue,
}

/// Creates two RC QPs with `caps`, each with its own CQ of `cq_entries`
/// (attached to `channel`), and connects them to each other (RTS).
pub fn pair(
    ctx: &Context,
    pd: &ProtectionDomain,
    cq_entries: u32,
    channel: Option<&CompletionChannel>,
    caps: QpCaps,
) -> Pair {
    let local = ctx.port_address(PORT, gid_index()).unwrap();
    let cq_a = CompletionQueue::new(ctx, cq_entries, channel).unwrap();
    let cq_b = CompletionQueue::new(ctx, cq_entries, channel).unwrap();
    let a = QueuePair::new_rc(pd, &cq_a, &cq_a, caps, false).unwrap();
    let b = QueuePair::new_rc(pd, &cq_b, &cq_b, caps, false).unwrap();
    assert_eq!(a.state().unwrap(), QpState::Reset);
    for qp in [&a, &b] {
        qp.modify_to_init(&InitAttr {
            port: PORT,
            ..InitAttr::default()
        })
        .unwrap();
    }
    let gid = local.gid.map(|(_, g)| g);
    let ra = RemoteQp {
        qpn: a.qp_num(),
        psn: 0x100,
        lid: local.lid,
        gid,
    };
    let rb = RemoteQp {
        qpn: b.qp_num(),
        psn: 0x200,
        lid: local.lid,
        gid,
    };
    a.connect(&local, &rb, local.active_mtu, ra.psn).unwrap();
    b.connect(&local, &ra, local.active_mtu, rb.psn).unwrap();
    assert_eq!(a.state().unwrap(), QpState::Rts);
    Pair { a, b, cq_a, cq_b }
}

/// Polls `cq` until `n` completions arrived (in any status), failing after
/// `timeout`.
pub fn poll_n(cq: &CompletionQueue, n: usize, timeout: Duration) -> Vec<WorkCompletion> {
    let deadline = Instant::now() + timeout;
    let mut got = Vec::new();
    let mut wcs = [WorkCompletion::default(); 8];
    while got.len() < n {
        let k = cq.poll(&mut wcs).unwrap();
        got.extend_from_slice(&wcs[..k]);
        assert!(
            Instant::now() < deadline,
            "{} of {n} completions",
            got.len()
        );
    }
    got
}
