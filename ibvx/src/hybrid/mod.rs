//! The `hybrid` device: shared memory between the ranks of one host, a
//! network device (verbs by default) between hosts, behind one xdev device.
//!
//! # How it is put together
//!
//! At open, the ranks tell each other which host they run on (the kernel's
//! boot id and the host name, through the job's bootstrap) and split into
//! host groups. Each group opens a
//! [`ProcessDevice`](shm_ipc::ProcessDevice) (`shm`) of its own, with
//! a private bootstrap service run by the group's lowest rank on loopback
//! (its address and a fresh secret travel through the job's bootstrap). When
//! the job spans more than one host, every rank also opens the network
//! device over the whole job (`remote=ibv`, or `psm`, or `shm` for tests).
//! A message to a rank of the same host goes through shared memory; any
//! other through the network device. Both keep their own matching; this
//! layer adds none for messages with a named source.
//!
//! # Receives from any source
//!
//! A receive with [`ANY_SOURCE`](xdev::ANY_SOURCE) could be matched by either
//! device, so it is *held* here until a message for it is known: it is then
//! bound to that message's sender and tag with a probe of the device that
//! holds the message, and posted there (a probe sees only messages no posted
//! receive took, and a receive naming the sender and tag matches that
//! device's earliest such message, so the bound receive gets exactly the
//! probed one). Receives in the same context posted after a held one are
//! held behind it, in order, so MPI's rule holds: a message goes to the
//! earliest posted receive that matches it. Posting and binding happen under
//! one lock, so no other thread's receive can take a probed message first.
//! Blocking receives go the same way, with the caller's buffer lent to the
//! request for the length of the call.
//!
//! A wait that involves both devices (a held receive, `peek`, a probe from
//! any source) polls both, then sleeps in steps of at most
//! [`MAX_POLL_SLEEP`]: the two devices have no common wake-up event. A wait
//! on a request that went to one device is that device's own wait (which
//! sleeps on its doorbell or completion channel).

mod held;
mod lend;
mod ops;
mod options;
mod progress;
mod route;
mod setup;
mod state;
#[cfg(test)]
mod tests;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use xdev::bootstrap::{Bootstrap, BootstrapServer};
use xdev::registry::{Entry, Placement};
use xdev::Device;

pub use options::HybridOptions;
use state::HybridEngine;

/// The longest sleep between two polls of a wait that involves both devices.
pub const MAX_POLL_SLEEP: Duration = Duration::from_micros(200);

/// The hybrid xdev device (see the module documentation).
pub struct HybridDevice {
    inner: Arc<HybridEngine>,
    /// The host group's bootstrap service, on the group's lowest rank. Only
    /// needed while the group's shared-memory device opens; kept so that
    /// ranks still reading their last reply are not cut off.
    _local_service: Option<BootstrapServer>,
    /// The job's bootstrap when no network device took it (one host).
    _boot: Option<Bootstrap>,
    description: String,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock only means a panic elsewhere; the data stays sound.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl std::fmt::Debug for HybridDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.description)
    }
}

/// Registers `hybrid` in `registry`.
pub fn register(registry: &mut xdev::Registry) {
    registry.register(Entry {
        name: "hybrid",
        description: "shared memory inside a host, verbs (or remote=psm|shm) between hosts",
        placement: Placement::Processes,
        options: HybridOptions::KEYS,
        open: |cfg| Ok(Arc::new(HybridDevice::open(cfg)?) as Arc<dyn Device>),
    });
}
