//! IBVX: the stack's verbs side. The crate is four things: [`ibv`], the
//! IBVX message layer over RC queue pairs (eager messages through
//! pre-registered slots with credit-based flow control, RDMA-write
//! rendezvous, a pin-down registration cache of library-owned memory, a
//! progress engine that sleeps on the completion channel) and the `ibv` xdev
//! device built on it; [`psm`], the xdev device over PSM2's matched queues;
//! [`verbs`], the small safe layer over the raw libibverbs bindings of
//! `ibvx-sys` that both the message layer and the tools use; and
//! [`pingpong`], the engine of the `ibvx-pingpong` tool (perftest-style
//! latency and bandwidth, interoperable with perftest).
//!
//! It also holds [`hybrid`], the device that puts `shm-ipc`'s shared memory
//! (ranks on one host) and a network device (ranks on other hosts) behind one
//! xdev device. It is not a matching engine of its own: each device keeps its
//! matching, and the hybrid layer only routes, and holds receives from any
//! source until it knows which device has their message.
//!
//! Nothing here links libibverbs: it is loaded at run time, and without it
//! every entry point fails with `verbs not available: ...`.

pub mod hybrid;
pub mod ibv;
pub mod pingpong;
pub mod psm;
pub mod verbs;

pub use hybrid::{HybridDevice, HybridOptions};
pub use ibv::{IbvDevice, IbvOptions};
pub use psm::{PsmDevice, PsmMode};

/// A registry of every xdev device this workspace provides: `thread` and
/// `shm` (from `shm-ipc`), `ibv`, `psm` and `hybrid`.
pub fn registry() -> xdev::Registry {
    let mut r = xdev::Registry::new();
    shm_ipc::register(&mut r);
    ibv::register(&mut r);
    psm::register(&mut r);
    hybrid::register(&mut r);
    r
}
