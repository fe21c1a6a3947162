//! IBVX: the stack's verbs side. Eventually this crate is the IBVX message
//! layer (RC queue pairs, eager messages plus RDMA-write rendezvous), the
//! PSM2 device and the hybrid device behind the `xdev` device trait; the
//! IBVX layer and the hybrid device come with issue 5 and are **not** here
//! yet. Today the crate is three things: [`psm`], the xdev device over PSM2's
//! matched queues; [`verbs`], a small safe layer over the raw libibverbs bindings of
//! `ibvx-sys` (device contexts, protection domains, memory regions,
//! completion channels and queues, RC queue pairs) on which the message
//! layer will be built, and [`pingpong`], the engine of the `ibvx-pingpong`
//! tool: send/recv latency, RDMA-write latency and RDMA-write bandwidth
//! between two processes, reported in perftest's table layout, and able to
//! talk to perftest's `ib_send_lat`, `ib_write_lat` and `ib_write_bw`.
//!
//! Nothing here links libibverbs: it is loaded at run time, and without it
//! every entry point fails with `verbs not available: ...`.

pub mod ibv;
pub mod pingpong;
pub mod psm;
pub mod verbs;

pub use psm::{PsmDevice, PsmMode};

/// A registry of every xdev device this workspace provides: `thread` and
/// `shm` (from `shm-ipc`) and `psm`.
pub fn registry() -> xdev::Registry {
    let mut r = xdev::Registry::new();
    shm_ipc::register(&mut r);
    psm::register(&mut r);
    r
}
