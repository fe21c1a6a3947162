//! `shm-ipc` holds the shared-memory xdev devices: the **thread device**
//! ([`ThreadDevice`], ranks as threads of one process, smdev-style, with
//! one-copy rendezvous) and the **process device** ([`ProcessDevice`], ranks
//! as processes on one host, with rings in job-private shared memory and
//! one-copy CMA rendezvous), and the building blocks they share: the
//! single-producer single-consumer [`ring`], the futex [`doorbell`] and
//! spin-then-sleep [`Backoff`].
//!
//! It is not a general IPC library: it implements the xdev contract and
//! nothing else, and it does not cross hosts.

pub mod biased;
pub mod cma;
pub mod doorbell;
mod engine;
mod fd_pass;
pub mod futex;
pub mod liveness;
pub use xdev::devkit::lock;
pub mod process;
pub mod ring;
pub mod segment;
mod sync;
pub mod thread;
mod wire;

pub use doorbell::{Backoff, Doorbell, DoorbellRef};
pub use process::{ProcessDevice, ProcessOptions, RendezvousPath};
pub use thread::{ThreadDevice, ThreadOptions, ThreadWorld};

/// Adds this crate's devices (`thread` and `shm`) to `registry`.
pub fn register(registry: &mut xdev::Registry) {
    thread::register(registry);
    process::register(registry);
}
