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
//! It is not the hybrid device (shared memory inside a host, verbs between
//! hosts), which is not written yet, and the `ibv` device uses the RDMA
//! device even between ranks on one host.
//!
//! Nothing here links libibverbs: it is loaded at run time, and without it
//! every entry point fails with `verbs not available: ...`.

pub mod ibv;
pub mod pingpong;
pub mod psm;
pub mod verbs;

pub use ibv::{IbvDevice, IbvOptions};
pub use psm::{PsmDevice, PsmMode};

/// A registry of every xdev device this workspace provides: `thread` and
/// `shm` (from `shm-ipc`), `ibv` and `psm`.
pub fn registry() -> xdev::Registry {
    let mut r = xdev::Registry::new();
    shm_ipc::register(&mut r);
    ibv::register(&mut r);
    psm::register(&mut r);
    r
}
