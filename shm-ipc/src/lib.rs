//! `shm-ipc` holds the shared-memory xdev devices: the **thread device**
//! ([`ThreadDevice`], ranks as threads of one process, smdev-style, with
//! one-copy rendezvous) and the building blocks it shares with the
//! process-to-process device: the single-producer single-consumer
//! [`ring`], the futex [`doorbell`] and spin-then-sleep [`Backoff`].
//!
//! It is not a general IPC library: it implements the xdev contract and
//! nothing else, and it does not cross hosts.

pub mod doorbell;
pub mod futex;
pub mod lock;
pub mod ring;
mod sync;
pub mod thread;

pub use doorbell::{Backoff, Doorbell};
pub use thread::{register, ThreadDevice, ThreadOptions, ThreadWorld};
