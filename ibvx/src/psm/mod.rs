//! The PSM2 device (`psm`): xdev over Omni-Path PSM2's matched queues (MQ),
//! as FastMPJ's psmdev did for Java.
//!
//! PSM2 does the matching and the protocols (eager, rendezvous, its shm and
//! hfi transports); this device only maps xdev onto it, with no second
//! matching layer:
//!
//! * **Tags.** PSM2's 96-bit tag carries the xdev tag (`tag0`), the context
//!   (`tag1`) and the message length (`tag2`, never matched: PSM2 does not
//!   report the sender's length of a truncated rendezvous message, and xdev
//!   must). A receive selects the tag exactly unless `ANY_TAG`, the context
//!   always, and the source by endpoint address (`PSM2_MQ_ANY_ADDR` for
//!   `ANY_SOURCE`); the sender's rank comes back from the status's
//!   `msg_peer`. PSM2's MQ keeps MPI's ordering rules.
//! * **Operations.** `isend`/`irecv` are `psm2_mq_isend2`/`psm2_mq_irecv2`
//!   with the request's buffer, except an eager `isend` to another rank
//!   (shorter than `rndv_shm_bytes`): `psm2_mq_send2` returns once PSM2 has
//!   copied it out, so it is born complete with no PSM2 request to test and
//!   free, as a blocking send is; `ssend` uses `PSM2_MQ_FLAG_SENDSYNC` (done
//!   only once matched); `probe` is `psm2_mq_iprobe2` in a progress loop;
//!   cancel is `psm2_mq_cancel` (receives only, as in PSM2); completions are
//!   collected in batches with `psm2_mq_ipeek_dequeue_multi` by every
//!   progress call (which is also what polls PSM2: it polls when its
//!   completion queue is empty).
//!   Truncation is PSM2's: the bytes that fit are delivered and the status
//!   reports the sender's length.
//! * **Start-up** goes through the bootstrap: rank 0's job key (a PSM2 UUID)
//!   is shared, every rank opens its endpoint, the epids are allgathered and
//!   every rank connects to all (itself included).
//! * **Shm-only mode.** Without an Omni-Path hfi unit (no `/dev/hfi1_*`),
//!   `psm2_init` fails with `PSM2_INTERNAL_ERR` yet leaves a library that
//!   runs PSM2's `self` and `shm` devices (see `psm_sys`'s docs). The device
//!   needs `PSM2_DEVICES=self,shm`: a program linking this crate sets it
//!   before `main` (from the ELF initializers, while no thread exists that
//!   could read the environment; a user's value is kept). The device says
//!   so on stderr once and in [`PsmDevice::mode`], and refuses a job whose
//!   ranks are not all on this host. With hardware, nothing is overridden.
//! * **Never crash at finish**: `psm2_finalize` is never called (after the
//!   failed init it crashes; with hardware, process exit releases the
//!   library), endpoints are closed with `psm2_ep_close`, and only one
//!   endpoint exists per process (PSM2's rule): a second open fails cleanly.
//! * **Waits** poll PSM2, then yield, then sleep in short steps: PSM2's shm
//!   device offers no wake-up event to block on.
//! * **Peers that leave** are learnt from the bootstrap (its departure
//!   notices): new operations to them fail at once with
//!   [`PeerLost`](xdev::Error::PeerLost), as do receives naming them
//!   (cancelled in PSM2). A send PSM2 has already taken cannot be
//!   cancelled; its buffer stays with the device (never freed while PSM2
//!   might read it) and the request fails.
//!
//! # Layout
//!
//! * [`layer`]: the safe PSM2 layer (library, endpoint, matched queue, the
//!   table of outstanding requests); every PSM2 call of the device is there.
//! * `setup`: the wire-up ([`PsmDevice::with_bootstrap`]) and its records.
//! * `engine`: the state under one lock, progress, departures, cancel and
//!   waiting; `blocking`: the blocking calls and their unwind guard
//!   (`Settle`).
//! * this file: the face ([`Device`] for [`PsmDevice`]), and [`RawPsm`] for
//!   the raw-PSM2 benchmark.

use std::sync::Arc;

use xdev::registry::{Entry, Placement};
use xdev::{Device, Rank, Registry, Result};

mod blocking;
mod engine;
pub mod layer;
mod lend;
mod ops;
mod setup;

use engine::PsmEngine;
pub use layer::PsmMode;

/// Bootstrap key prefix (then the rank) under which each rank stores its
/// PSM2 epid (8 bytes, little-endian), so that `xdev-run` can remove the
/// `/dev/shm/psm2_shm.*` segments of ranks that crashed.
pub const PSM2_EPID_KEY: &str = xdev::bootstrap::PSM2_EPID_KEY;

/// Default of the `rndv_shm_bytes` option: the message size from which
/// PSM2's shm device uses rendezvous instead of eager copies. PSM2 buffers
/// unexpected eager messages without bound, so this bounds what a slow
/// receiver holds per message to an envelope for anything larger (10,000
/// unreceived 8 KiB sends would otherwise take 80 MiB at the receiver).
pub const DEFAULT_RNDV_SHM_BYTES: u32 = 4096;

/// The options the `psm` device knows.
pub const PSM_OPTIONS: &[xdev::devkit::OptionSpec] = &[xdev::devkit::OptionSpec::new(
    "rndv_shm_bytes",
    "a byte count",
    "message size from which PSM2's shm device uses rendezvous (4096)",
)];

/// One rank over PSM2's matched queues: an xdev [`Device`].
pub struct PsmDevice {
    engine: Arc<PsmEngine>,
}

impl PsmDevice {
    /// How PSM2 runs in this process (hardware, or shm-only).
    pub fn mode(&self) -> &PsmMode {
        self.engine.lib.mode()
    }

    /// The device's own PSM2 matched queue, for benchmarks that compare the
    /// device with raw PSM2 calls on the same endpoint ([`RawPsm`]).
    ///
    /// # Safety
    /// Memory safety does not depend on it (the [`layer`] keeps every
    /// request sound), but the device's correctness does: while the caller
    /// uses the queue, no operation of this device may be outstanding (the
    /// device's progress would collect what the caller's traffic completes,
    /// and the caller's could match the device's receives), and the caller
    /// must use only contexts (the middle tag word) the device's users do
    /// not use.
    pub unsafe fn raw_handles(&self) -> RawPsm {
        RawPsm {
            engine: self.engine.clone(),
        }
    }
}

/// The matched queue of an open [`PsmDevice`] (see
/// [`PsmDevice::raw_handles`]), for raw PSM2 traffic beside the device.
pub struct RawPsm {
    engine: Arc<PsmEngine>,
}

impl RawPsm {
    /// Runs `f` on the device's matched queue, holding the device's lock
    /// meanwhile (so `f` must not call the device: it would wait for
    /// itself). Fails with [`Closed`](xdev::Error::Closed) once the device
    /// finished or was dropped.
    pub fn with_queue<R>(
        &self,
        f: impl FnOnce(&mut layer::MatchedQueue) -> Result<R>,
    ) -> Result<R> {
        let mut l = self.engine.lock();
        f(l.open_queue()?)
    }

    /// This rank (its peer index on the queue).
    pub fn rank(&self) -> Rank {
        self.engine.rank
    }

    /// The PSM2 tag the device gives a message of `len` bytes with `tag`
    /// on `context`, so that raw PSM2 traffic can meet the device's: a raw
    /// send with this tag matches the device's receives of that tag and
    /// context (`Err` for 4 GiB or more, which PSM2 cannot carry).
    pub fn device_tag(
        &self,
        tag: xdev::Tag,
        context: xdev::Context,
        len: usize,
    ) -> Result<layer::MqTag> {
        Ok(engine::tag(tag, context, layer::msg_len(len)?))
    }

    /// What the device's receive of `pattern` selects, so that a raw
    /// receive with it takes the device's sends of that tag and context.
    pub fn device_selector(&self, pattern: &xdev::Pattern) -> layer::Selector {
        engine::selector(pattern)
    }
}

impl Drop for PsmDevice {
    /// Closes the queue (forced) if `finish` did not: requests still in
    /// flight end with `Closed`. A lent request keeps the engine's memory
    /// alive past this (see `lend.rs`), not its endpoint.
    fn drop(&mut self) {
        self.engine.close_queue(true);
    }
}

impl xdev::devkit::Face for PsmDevice {
    type Engine = PsmEngine;
    fn engine(&self) -> &Arc<PsmEngine> {
        &self.engine
    }
}

/// Adds the `psm` device to `registry`.
pub fn register(registry: &mut Registry) {
    registry.register(Entry {
        name: "psm",
        description: "Omni-Path PSM2 matched queues (shm-only mode without hfi hardware)",
        placement: Placement::Processes,
        options: PSM_OPTIONS,
        open: |cfg| Ok(Arc::new(PsmDevice::open(cfg)?) as Arc<dyn Device>),
    });
}

#[cfg(test)]
mod tests;
