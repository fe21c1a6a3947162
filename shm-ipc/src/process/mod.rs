//! The process device (`shm`): ranks are processes on one host, talking
//! through job-private shared memory.
//!
//! Set-up goes through the [bootstrap](xdev::bootstrap): every rank creates
//! its [inbox segment](crate::segment) (one ring per sender, its doorbell,
//! its state word and the eager credit it returns), publishes the name, its
//! pid and a probe address with an allgather, maps every peer's inbox, starts
//! a [`PeerWatch`](crate::liveness::PeerWatch) on the peers' pids, and after a barrier unlinks its own
//! segment. Then:
//!
//! * **Eager** (payload up to `eager_limit`): the payload is written into the
//!   receiver's ring by the sender and copied out by the receiver. Up to 24
//!   bytes it is one cache line. Synchronous eager sends are acknowledged
//!   (`ACK`) when matched.
//! * **Rendezvous** (larger, or when eager credit runs out): the ring carries a
//!   `RendezvousStart` (the sender's buffer address and length). Once matched,
//!   the receiver copies straight from the sender's memory with
//!   `process_vm_readv` (CMA, one copy) and answers `FIN`, which completes the
//!   send. Where ptrace rules forbid CMA, or where CMA is slower than copying
//!   (see [`CmaMode::Auto`]), the receiver answers `PULL` instead and the
//!   sender streams the data through the same ring in fragments of
//!   `fragment_bytes` (a pipelined copy: several fragments are in flight while
//!   the receiver copies earlier ones out, each core doing one copy). The
//!   choice is made at run time: a probe and a calibration at start-up
//!   ([`ProcessDevice::rendezvous`]), and any later `EPERM` from a peer
//!   switches that peer to the pipelined path.
//! * **Order** holds across both paths because every message of a pair, eager
//!   or rendezvous, goes through the pair's one ring and is matched in ring
//!   order; replies (`ACK`, `FIN`, `PULL`) and fragments are not matched.
//! * **Flow control**: a full ring never drops or overwrites. Sends wait in a
//!   per-destination backlog (their buffers stay owned by their requests),
//!   replies in a per-destination control queue, fragments in the stream
//!   queue. Unexpected eager data is bounded per sender by `credit_bytes`
//!   (enforced by the sender, checked by the receiver).
//! * **Dead peers**: the [`PeerWatch`](crate::liveness::PeerWatch) thread notices a peer's exit at once
//!   (pidfd), a peer that finishes marks its state word; either way every
//!   rank's waits are woken, requests involving the peer fail with
//!   [`Error::PeerLost`](xdev::Error::PeerLost), new operations to it fail at once, and what it sent
//!   before is still delivered.
//! * **Hostile peers**: everything read from shared memory is validated
//!   (ring headers, reply ids, fragment offsets, credit counters, segment
//!   headers); a violation fails that peer with [`Error::Protocol`](xdev::Error::Protocol) and its
//!   ring is not read again. Rendezvous addresses are only ever used in
//!   `process_vm_readv` on the sender's address space, checked by the kernel.
//!
//! Waits spin briefly, then sleep on the rank's [`Doorbell`](crate::Doorbell)
//! (a futex in its inbox); publishers wake it only when a sleeper is armed.
use std::sync::Arc;

use xdev::bootstrap::Bootstrap;
use xdev::registry::{Entry, Placement};
use xdev::{Config, Device, Registry, Result};

use crate::engine::Engine;

mod control;
mod mapped;
mod medium;
mod options;
mod rendezvous;
mod setup;

pub(crate) use medium::ProcessMedium;
pub use options::{CmaMode, ProcessOptions, RendezvousPath, CMA_MIN_SPEED};
pub use setup::PeerInfo;

/// One rank of a job whose ranks are processes on this host: an xdev
/// [`Device`] over job-private shared memory.
pub struct ProcessDevice {
    engine: Arc<Engine<ProcessMedium>>,
}

impl ProcessDevice {
    /// Opens the device for `config` with the bootstrap service named by the
    /// environment (`XDEV_BOOTSTRAP`, `XDEV_SECRET`; `xdev-run` sets them).
    /// The environment's rank, size and job must match `config`.
    pub fn open(config: &Config) -> Result<ProcessDevice> {
        // Options first: a bad one fails before any connection.
        ProcessOptions::from_config(config)?;
        Self::with_bootstrap(config, Bootstrap::for_config(config)?)
    }

    /// Opens the device for `config` over an already connected bootstrap
    /// (collective: every rank of the job must call it).
    pub fn with_bootstrap(config: &Config, boot: Bootstrap) -> Result<ProcessDevice> {
        Ok(ProcessDevice {
            engine: Arc::new(setup::open(config, boot)?),
        })
    }

    /// The options in force.
    pub fn options(&self) -> &ProcessOptions {
        &self.engine.m.sh.opts
    }

    /// How rendezvous data moves, as found at start-up: CMA, or the
    /// pipelined copy and why. (A later `EPERM` from a peer also switches
    /// that peer to the pipelined path.)
    pub fn rendezvous(&self) -> &RendezvousPath {
        &self.engine.m.rendezvous
    }
}

impl Drop for ProcessDevice {
    /// With receives still lent out (which keep the engine alive), closes
    /// the engine now, as its own drop would: their waits end `Closed`.
    fn drop(&mut self) {
        self.engine.close_lent();
    }
}

impl xdev::devkit::Face for ProcessDevice {
    type Engine = Engine<ProcessMedium>;
    fn engine(&self) -> &Arc<Engine<ProcessMedium>> {
        &self.engine
    }
}

/// Adds the `shm` device to `registry`.
pub fn register(registry: &mut Registry) {
    registry.register(Entry {
        name: "shm",
        description: "ranks as processes on one host; shared-memory rings, CMA rendezvous",
        placement: Placement::Processes,
        options: ProcessOptions::KEYS,
        open: |cfg| Ok(Arc::new(ProcessDevice::open(cfg)?) as Arc<dyn Device>),
    });
}

#[cfg(test)]
mod tests;
