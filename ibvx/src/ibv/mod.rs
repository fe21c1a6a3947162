//! IBVX over verbs, and [`IbvDevice`], the `ibv` xdev device.
//!
//! This is the seed paper's IBV eXpress layer: message passing over RC queue
//! pairs with an eager protocol through pre-registered buffers, a zero-copy
//! rendezvous protocol by RDMA write (`RNDZ_START`, `RNDZ_REPLY` with
//! address and rkey, the RDMA write of the data, `RNDZ_END`), a pin-down
//! [`RegistrationCache`], and a polling progress engine that sleeps on the
//! completion channel. Matching is xdev's software
//! [`MatchingEngine`](xdev::devkit::matching::MatchingEngine); the verbs layer knows
//! nothing of it.
//!
//! It is not a general verbs library (see [`crate::verbs`] for the thin safe
//! layer it is built on), and it does not use shared memory between ranks on
//! one host: every peer, local or remote, is reached through the RDMA device.
//!
//! # Start-up
//!
//! Every rank opens the RDMA device and port named by the configuration
//! (`ibv_device`, `ibv_port`, `ibv_gid_index`; by default the first device,
//! port 1, and on RoCE the GID perftest would pick: RoCE v2, IPv4-mapped
//! first), creates one RC queue pair per peer on one send and one receive
//! completion queue that share a completion channel, posts its receive
//! slots, and exchanges LID, GID, MTU, queue pair numbers and first PSNs
//! through the bootstrap service ([`PeerRecord`]). The protocol parameters
//! (eager limit, receive depth, eager window) must be the same on every rank.
//!
//! # Budgets (defaults, each a configuration key)
//!
//! | key | default | what it bounds |
//! |-----|---------|----------------|
//! | `eager_limit` | 8192 | largest eager payload; larger messages use rendezvous |
//! | `recv_depth` | 64 | receive slots posted per peer (`size * recv_depth * slot` bytes registered) |
//! | `send_slots` | 256 | pre-registered send buffers shared by all peers |
//! | `eager_window` | 1 MiB | unexpected eager bytes one peer may leave here |
//! | `inline` | 64 | largest send posted inline (if the device allows) |
//! | `reg_cache_idle_bytes` | 64 MiB | registered memory kept for reuse |
//! | `max_pinned_bytes` | 1 GiB | all registered user memory at once |
//!
//! The registration cache also keeps at most 64 user buffers and 256 MiB of
//! them registered between sends ([`CacheLimits::max_user_entries`],
//! [`CacheLimits::max_user_bytes`]; least recently used first out).

//!
//! # What the NIC may touch, and who decides
//!
//! Only this module's engine posts work requests, and it does so only into
//! memory it owns for the duration: its receive and send slots, the buffer
//! of a send or receive it holds, or a cache chunk it has leased. The
//! building blocks that name raw memory to the NIC are therefore private to
//! the crate: the registration cache's lookups and registrations (a
//! lookup would find a chunk that a user holds as a leased [`Buffer`], or an
//! idle one about to be leased to someone else, and a posted receive would
//! then write into it) and the wire format (whose rendezvous replies carry
//! raw addresses and rkeys). [`RegistrationCache`] itself stays public for
//! its statistics and for leasing registered buffers, but hands out no key
//! or scatter/gather entry. None of these compiles outside the crate any
//! more:
//!
//! ```compile_fail,E0603
//! // The cache's module (with `Registration`, whose `sge` names memory).
//! use ibvx::ibv::regcache::Registration;
//! fn lkey_of(reg: &Registration) -> u32 {
//!     reg.lkey()
//! }
//! ```
//!
//! ```compile_fail,E0599
//! // A lookup of a leased buffer's registration.
//! fn lkey_of(dev: &ibvx::ibv::IbvDevice, buf: &xdev::Buffer) -> Option<u32> {
//!     let reg = dev.cache().find(buf.as_ptr(), buf.len())?; // only in ibvx's tests
//!     Some(reg.lkey())
//! }
//! ```
//!
//! ```compile_fail,E0599
//! // The registration of a lease (it outlives the lease).
//! fn lkey_of(cache: &ibvx::ibv::RegistrationCache) -> u32 {
//!     let lease = cache.lease(4096).unwrap();
//!     lease.registration().lkey() // only in ibvx's tests
//! }
//! ```
//!
//! ```compile_fail,E0624
//! // A transient registration of foreign memory.
//! fn lkey_of(cache: &ibvx::ibv::RegistrationCache, v: &mut [u8]) -> u32 {
//!     // SAFETY: `v` outlives the registration (dropped at once).
//!     let reg = unsafe { cache.register(v.as_mut_ptr(), v.len()) }.unwrap(); // private to ibvx
//!     reg.lkey()
//! }
//! ```
//!
//! ```compile_fail,E0624
//! // A remote-write grant (its rkey lets a peer write the range).
//! fn rkey_of(cache: &ibvx::ibv::RegistrationCache, v: &mut [u8]) -> u32 {
//!     // SAFETY: `v` outlives the registration (dropped at once).
//!     let reg = unsafe { cache.grant_remote_write(v.as_mut_ptr(), v.len()) }.unwrap(); // private to ibvx
//!     reg.rkey()
//! }
//! ```
//!
//! ```compile_fail,E0603
//! // The wire format.
//! use ibvx::ibv::wire::{decode, HEADER_LEN};
//! let frame = [0u8; HEADER_LEN];
//! assert!(decode(&frame, 0).is_err());
//! ```
//!
//! The verbs layer's posting calls, which do name memory to the NIC, are
//! `unsafe` with their contract stated at [`QueuePair::post_send`] and
//! [`QueuePair::post_recv`].
//!
//! [`QueuePair::post_send`]: crate::verbs::QueuePair::post_send
//! [`QueuePair::post_recv`]: crate::verbs::QueuePair::post_recv

#[cfg(test)]
mod device_tests;
mod engine;
#[cfg(test)]
mod first_slot_tests;
mod options;
pub(crate) mod regcache;
mod setup;
#[cfg(test)]
mod signal_tests;
#[cfg(test)]
mod user_cache_tests;
pub(crate) mod wire;

use std::sync::Arc;

use xdev::bootstrap::Bootstrap;
use xdev::registry::{Entry, Placement};
use xdev::{Buffer, Config, Device, Result};

use self::engine::IbvEngine;
pub use self::options::IbvOptions;
pub use self::regcache::{CacheLimits, CacheStats, Lease, RegistrationCache};
pub use self::setup::PeerRecord;

/// One rank of a job over RDMA verbs (RC queue pairs): an xdev [`Device`].
pub struct IbvDevice {
    engine: Arc<IbvEngine>,
    device_name: String,
}

impl IbvDevice {
    /// Opens the device for `config` with the bootstrap service named by the
    /// environment (`xdev-run` sets it). Collective.
    pub fn open(config: &Config) -> Result<IbvDevice> {
        // Options first: a bad one fails before any connection.
        IbvOptions::from_config(config)?;
        Self::with_bootstrap(config, Bootstrap::for_config(config)?)
    }

    /// Opens the device over a connected bootstrap (collective: every rank
    /// of the job calls it).
    pub fn with_bootstrap(config: &Config, boot: Bootstrap) -> Result<IbvDevice> {
        let (engine, device_name) = setup::wire_up(config, boot)?;
        Ok(IbvDevice {
            engine: Arc::new(engine),
            device_name,
        })
    }

    /// The options in use.
    pub fn options(&self) -> &IbvOptions {
        self.engine.options()
    }

    /// The RDMA device in use (e.g. `rxe0`).
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// A zeroed buffer of `len` bytes in memory this device has registered
    /// (leased from its [`RegistrationCache`]): rendezvous transfers from and
    /// into it need no registration. Dropping it returns it to the cache.
    /// The same as [`Device::alloc_buffer`], which a runtime holding an
    /// `Arc<dyn Device>` calls.
    pub fn alloc_buffer(&self, len: usize) -> Result<Buffer> {
        xdev::devkit::Transport::alloc_buffer(&*self.engine, len)
    }

    /// The registration cache (for statistics).
    pub fn cache(&self) -> &RegistrationCache {
        self.engine.cache()
    }
}

impl xdev::devkit::Face for IbvDevice {
    type Engine = IbvEngine;
    fn engine(&self) -> &Arc<IbvEngine> {
        &self.engine
    }
}

/// Adds the `ibv` device to `registry`.
pub fn register(registry: &mut xdev::Registry) {
    registry.register(Entry {
        name: "ibv",
        description: "IBVX over RDMA verbs (RC queue pairs, eager + RDMA-write rendezvous)",
        placement: Placement::Processes,
        options: IbvOptions::KEYS,
        open: |cfg| Ok(Arc::new(IbvDevice::open(cfg)?) as Arc<dyn Device>),
    });
}
