//! IBVX: the stack's verbs side. The crate is three things: [`ibv`], the
//! IBVX message layer over RC queue pairs (eager messages through
//! pre-registered slots with credit-based flow control, RDMA-write
//! rendezvous, a pin-down registration cache of library-owned memory, a
//! progress engine that sleeps on the completion channel) and the `ibv` xdev
//! device built on it; [`psm`], the xdev device over PSM2's matched queues;
//! and [`verbs`], the small safe layer over the raw libibverbs bindings of
//! `ibvx-sys` that both the message layer and the tools use. The
//! command-line tools (`ibvx-pingpong`, `xdev-rank`, `xdev-run`) are not
//! here: they are the unpublished `xdev-tools` package (`benches/tools`).
//!
//! It also holds [`hybrid`], the device that puts `shm-ipc`'s shared memory
//! (ranks on one host) and a network device (ranks on other hosts) behind one
//! xdev device. It is not a matching engine of its own: each device keeps its
//! matching, and the hybrid layer only routes, and holds receives from any
//! source until it knows which device has their message.
//!
//! Nothing here links libibverbs: it is loaded at run time, and without it
//! every entry point fails with `verbs not available: ...`.
//!
//! # Features
//!
//! - `ibv` (default): the `ibv` device and the [`verbs`] layer (brings
//!   `ibvx-sys`).
//! - `psm` (default): the `psm` device (brings `psm-sys`).
//! - `hybrid` (default): the `hybrid` device; its network side is `ibv` or
//!   `psm` when that feature is on, or a second shm world (`remote=shm`).
//!
//! With `default-features = false` the crate holds only [`registry`] over
//! `shm-ipc`'s `thread` and `shm` devices: no verbs or PSM2 code is built.

#[cfg(feature = "hybrid")]
pub mod hybrid;
#[cfg(feature = "ibv")]
pub mod ibv;
#[cfg(feature = "psm")]
pub mod psm;
#[cfg(feature = "ibv")]
pub mod verbs;

#[cfg(feature = "hybrid")]
pub use hybrid::{HybridDevice, HybridOptions};
#[cfg(feature = "ibv")]
pub use ibv::{IbvDevice, IbvOptions};
#[cfg(feature = "psm")]
pub use psm::{PsmDevice, PsmMode};

/// A registry of every xdev device this build of the crate provides:
/// `thread` and `shm` (from `shm-ipc`) always, and `ibv`, `psm` and `hybrid`
/// when their features are on (all three are by default).
pub fn registry() -> xdev::Registry {
    let mut r = xdev::Registry::new();
    shm_ipc::register(&mut r);
    #[cfg(feature = "ibv")]
    ibv::register(&mut r);
    #[cfg(feature = "psm")]
    psm::register(&mut r);
    #[cfg(feature = "hybrid")]
    hybrid::register(&mut r);
    r
}
