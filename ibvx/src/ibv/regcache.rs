//! The pin-down registration cache: registered memory for IBVX's sends,
//! receives and RDMA writes without an `ibv_reg_mr` per message.
//!
//! # The rule: only memory whose allocation is known to be unchanged
//!
//! An address-keyed pin-down cache has a classic failure: user memory is
//! freed (`munmap`), a new allocation lands at the same virtual address,
//! and the cache hands out the old registration, which still pins the *old*
//! physical pages, so the device sends stale bytes (or writes into memory
//! nobody reads). Interception of `munmap`/`free` (memory hooks, userfault,
//! ODP) makes this rarer; this cache makes it **impossible by design**:
//! nothing is ever looked up by address alone.
//!
//! - **Chunks**: memory the library itself maps and leases out. A chunk is
//!   an anonymous mapping made by the cache, registered once, and leased out
//!   through [`RegistrationCache::lease`] / [`RegistrationCache::buffer`]
//!   (what `Device::alloc_buffer` returns). A chunk is never unmapped while
//!   it is registered: it is deregistered first, and unmapped only if
//!   deregistration succeeded (otherwise it is leaked). A chunk leaves the
//!   lookup table before it is deregistered, so no lookup can return a
//!   dying registration.
//! - **User buffers** (an `xdev::Buffer` the user made, sent by `isend`):
//!   keyed by the buffer's identity ([`xdev::BufferId`], unique in the
//!   process and never reused), not by address. The first rendezvous from
//!   it registers its whole memory and attaches a token to the buffer
//!   ([`xdev::Buffer::attach`]); the buffer drops the token just before it
//!   releases its memory (dropped, or its `Vec` taken back), and the token
//!   takes the entry out. So an entry exists only while its allocation is
//!   held, unchanged, by that one buffer; a new allocation at the same
//!   address is a new buffer with a new identity, a miss. Entries are
//!   bounded (`max_user_entries`, `max_user_bytes`, the pinned budget) and
//!   evicted least recently used first.
//! - **Other memory** (a borrowed slice of a blocking call, a user buffer
//!   larger than `max_user_bytes`, a rendezvous receive's remote-write
//!   grant) is registered for one operation only:
//!   [`RegistrationCache::register`] returns a *transient* [`Registration`]
//!   that is deregistered when its last clone is dropped (when the operation
//!   completes), never entered in any table.
//!
//! So every registration the cache returns names pages that are mapped and
//! pinned for as long as the [`Registration`] lives, and an entry it keeps
//! always names the allocation that is there now.
//!
//! # Chunks, the idle list and the budgets
//!
//! Chunks come in power-of-two size classes from 4 KiB
//! ([`MIN_CHUNK`](pool::MIN_CHUNK)). Each is its own
//! `mmap(MAP_PRIVATE | MAP_ANONYMOUS)` mapping: page aligned,
//! zero-filled by the kernel, sharing no page with the `malloc` heap, and
//! returned to the kernel when the chunk is evicted. A [`Lease`] owns one
//! chunk while it lives; leased chunks are never evicted. Dropping the lease
//! puts the chunk on the idle list (the most-recently-used end), still
//! registered: that *is* the cache. A later lease of the same size class
//! takes the most recently used idle chunk of that class (a hit, zeroed
//! again, no verbs call) or registers a new chunk (a miss).
//!
//! [`CacheLimits`] bounds everything (there is no "unlimited"): after a
//! lease is dropped, least-recently-used idle chunks are evicted
//! (deregistered, then unmapped) while there are more than
//! `max_idle_chunks` of them or they hold more than `max_idle_bytes`; and
//! leased, idle and transient registrations together never pin more than
//! `max_pinned_bytes` (transient ones count the whole pages they span). When
//! a new registration would exceed that budget, idle chunks are evicted
//! first; if that is not enough, the request fails with
//! [`verbs::Error::Budget`] and nothing is registered.
//!
//! A [`Registration`] (a chunk's or a transient one) is a cheap handle that
//! keeps its region registered and mapped while alive, so a work request
//! can name it safely even if the lease it came from is dropped first.
//!
//! The bookkeeping (size classes, LRU, budgets: the `pool` module) is
//! generic over a small registrar trait so that it is tested without an RDMA
//! device; the public types use the verbs registrar (`ibv_reg_mr` with the
//! cache's [`Access`]).

use std::any::Any;
use std::fmt;
use std::ptr::NonNull;
use std::sync::{Arc, Weak};

pub use self::pool::{CacheLimits, CacheStats};
use self::pool::{Exposure, Keys, Pool, PoolLease, Reg, Registrar};
use crate::verbs::{self, Access, MemoryRegion, ProtectionDomain, RemoteAddr, Sge};

mod pool;
#[cfg(test)]
mod rxe_tests;

/// The real registrar: `ibv_reg_mr` on one protection domain.
struct VerbsRegistrar {
    pd: ProtectionDomain,
    access: Access,
}

impl Registrar for VerbsRegistrar {
    type Region = MemoryRegion<'static>;

    unsafe fn register(
        &self,
        ptr: NonNull<u8>,
        len: usize,
        exposure: Exposure,
    ) -> verbs::Result<(MemoryRegion<'static>, Keys)> {
        let access = match exposure {
            Exposure::Local => self.access,
            Exposure::RemoteWrite => self.access | Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        };
        // SAFETY: forwarded contract: the range stays mapped until the
        // region is deregistered (`deregister` below, or its drop).
        let mr = unsafe { MemoryRegion::register_raw_parts(&self.pd, ptr, len, access)? };
        let keys = Keys {
            lkey: mr.lkey(),
            rkey: mr.rkey(),
        };
        Ok((mr, keys))
    }

    fn deregister(&self, region: MemoryRegion<'static>) -> verbs::Result<()> {
        region.deregister()
    }
}

// ---------------------------------------------------------------------------
// The public face: the pool over verbs.

/// The pin-down registration cache of one protection domain. Cheap to clone
/// (reference counted); `Send + Sync`.
///
/// It caches registrations of memory it owns itself: *chunks*, page-aligned
/// anonymous mappings in power-of-two size classes from 4 KiB, registered
/// once and leased out ([`lease`](Self::lease), [`buffer`](Self::buffer)); a
/// dropped [`Lease`] goes on an idle list, still registered, for the next
/// lease of its class. It also keeps user [`xdev::Buffer`]s registered
/// between sends, keyed by buffer identity and ended by a token the buffer
/// drops before it releases its memory (see the module docs).
/// [`CacheLimits`] bounds the idle list, the user entries and all pinned
/// memory. Other memory is registered for one operation only, so the cache
/// cannot hand out a stale registration of memory that was freed and
/// reused.
///
/// Outside this crate the cache is for statistics and leasing: the lookups
/// and registrations that yield keys and scatter/gather entries (of a chunk
/// that may be leased to someone else) are private to the crate, whose
/// engine uses them only for memory it holds (see the [`ibv`](super)
/// module docs).
#[derive(Clone)]
pub struct RegistrationCache {
    inner: Arc<Pool<VerbsRegistrar>>,
}

impl RegistrationCache {
    /// A cache registering its chunks on `pd` with `access` (the engine
    /// passes `LOCAL_WRITE`), bounded by `limits`.
    pub fn new(pd: &ProtectionDomain, access: Access, limits: CacheLimits) -> RegistrationCache {
        RegistrationCache {
            inner: Pool::new(
                VerbsRegistrar {
                    pd: pd.clone(),
                    access,
                },
                limits,
            ),
        }
    }

    /// The limits the cache was made with.
    pub fn limits(&self) -> CacheLimits {
        self.inner.shared.limits
    }

    /// A registered, zero-filled chunk of at least `len` bytes (`len` 0
    /// gives the smallest chunk): the most recently used idle chunk of the
    /// right size class (a hit), or a newly mapped and registered one (a
    /// miss).
    ///
    /// Errors: [`verbs::Error::Registration`] when mapping or `ibv_reg_mr`
    /// fails, [`verbs::Error::Budget`] when a new chunk would exceed
    /// `max_pinned_bytes` even after evicting every idle chunk, and
    /// [`verbs::Error::InvalidArgument`] for a `len` with no size class.
    pub fn lease(&self, len: usize) -> Result<Lease, verbs::Error> {
        self.inner.lease(len).map(|inner| Lease { inner })
    }

    /// [`lease`](Self::lease) wrapped as an [`xdev::Buffer`] of exactly
    /// `len` bytes; the buffer's [`storage`](xdev::Buffer::storage)
    /// downcasts to [`Lease`].
    pub fn buffer(&self, len: usize) -> Result<xdev::Buffer, verbs::Error> {
        let lease = self.lease(len)?;
        Ok(xdev::Buffer::from_storage(Box::new(lease), len))
    }

    /// The registration of `[ptr, ptr + len)` if the range lies entirely
    /// inside one chunk of this cache (leased or idle): a hit, no verbs
    /// call, `O(log n)` in the number of chunks.
    ///
    /// Only in tests (the engine's lookups go through
    /// [`register`](Self::register)): the chunk may be leased to someone
    /// else or idle (and leased later), so only a caller that holds the
    /// memory may use the registration for a work request.
    #[cfg(test)]
    pub(crate) fn find(&self, ptr: *const u8, len: usize) -> Option<Registration> {
        self.inner
            .find(ptr, len)
            .map(|inner| Registration { inner })
    }

    /// [`find`](Self::find), else a transient registration of exactly that
    /// range, never cached: it is deregistered when the last clone of the
    /// returned [`Registration`] is dropped. While alive it counts against
    /// `max_pinned_bytes` (the whole pages it spans); idle chunks are
    /// evicted to make room, else it fails with [`verbs::Error::Budget`].
    /// A null pointer or an empty range outside every chunk is
    /// [`verbs::Error::InvalidArgument`].
    ///
    /// # Safety
    /// The range must stay mapped, and must not be freed, until the returned
    /// `Registration` and all its clones are dropped.
    pub(crate) unsafe fn register(
        &self,
        ptr: *mut u8,
        len: usize,
    ) -> Result<Registration, verbs::Error> {
        // SAFETY: forwarded contract.
        unsafe { self.inner.register(ptr, len, Exposure::Local) }
            .map(|inner| Registration { inner })
    }

    /// Registers `len` bytes at `ptr` for one rendezvous receive: local
    /// access and remote write, always a registration of its own (never a
    /// chunk's, whose keys grant no remote access), counted in the pinned
    /// budget. Dropping the last clone deregisters it, after which its rkey
    /// lets nobody write anything.
    ///
    /// # Safety
    /// As [`register`](Self::register).
    pub(crate) unsafe fn grant_remote_write(
        &self,
        ptr: *mut u8,
        len: usize,
    ) -> Result<Registration, verbs::Error> {
        // SAFETY: forwarded contract.
        unsafe { self.inner.register(ptr, len, Exposure::RemoteWrite) }
            .map(|inner| Registration { inner })
    }

    /// Counters and occupancy.
    pub fn stats(&self) -> CacheStats {
        self.inner.stats()
    }

    /// Lets this cache keep `buf`'s memory registered between operations:
    /// attaches a token whose drop (just before the buffer releases its
    /// memory, see [`xdev::Buffer::attach`]) ends the entry. True when `buf`
    /// carries this cache's token (now or already); false for an empty
    /// buffer or one of this cache's leases (a leased chunk is registered
    /// anyway). Other foreign storage (a page-aligned buffer, say) is
    /// adopted like heap memory: its attachment too is dropped before the
    /// storage releases the memory.
    pub(crate) fn adopt(&self, buf: &mut xdev::Buffer) -> bool {
        if buf.is_empty() || buf.storage().is_some_and(|s| s.is::<Lease>()) {
            return false;
        }
        let ours = buf
            .attachment()
            .and_then(|a| a.downcast_ref::<UserToken>())
            .is_some_and(|t| {
                t.id == buf.id().get() && Weak::ptr_eq(&t.pool, &Arc::downgrade(&self.inner))
            });
        if !ours {
            buf.attach(Box::new(UserToken {
                pool: Arc::downgrade(&self.inner),
                id: buf.id().get(),
            }));
        }
        true
    }

    /// The registration of the whole memory of user buffer `id` (adopted by
    /// [`adopt`](Self::adopt)), `[ptr, ptr + len)`: kept from an earlier
    /// operation on the same buffer (no verbs call), or made and kept now.
    /// Bounded by `max_user_entries`, `max_user_bytes` and the pinned
    /// budget (least recently used entries evicted); see [`Pool`].
    ///
    /// # Safety
    /// `[ptr, ptr + len)` is the whole memory of the buffer `id`, which
    /// carries this cache's token, and the caller holds that buffer (its
    /// request or call owns it) until every returned registration is
    /// dropped.
    pub(crate) unsafe fn register_user(
        &self,
        id: xdev::BufferId,
        ptr: *mut u8,
        len: usize,
    ) -> Result<Registration, verbs::Error> {
        // SAFETY: the token attached to the buffer calls `forget_user` just
        // before the buffer releases its memory, and identities are never
        // reused, so the entry of `id` names this allocation only while it
        // is mapped; the caller keeps it mapped while the handle lives.
        unsafe { self.inner.register_user(id.get(), ptr, len) }.map(|inner| Registration { inner })
    }
}

/// Attached to a user's [`xdev::Buffer`] whose memory the cache keeps
/// registered: dropped just before the buffer releases its memory, it takes
/// the buffer's entry out of the cache (the registration ends once no
/// operation holds it).
struct UserToken {
    pool: Weak<Pool<VerbsRegistrar>>,
    id: u64,
}

impl Drop for UserToken {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.upgrade() {
            pool.forget_user(self.id);
        }
    }
}

impl fmt::Debug for RegistrationCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegistrationCache")
            .field("id", &self.inner.id)
            .field("limits", &self.inner.shared.limits)
            .field("stats", &self.stats())
            .finish()
    }
}

/// One chunk of a [`RegistrationCache`], owned while the lease lives.
/// Dropping it returns the chunk to the idle list (still registered), then
/// evicts least-recently-used idle chunks while the idle limits are
/// exceeded.
pub struct Lease {
    inner: PoolLease<VerbsRegistrar>,
}

impl Lease {
    /// The chunk's registration (keeps it registered even after the lease
    /// is dropped, when the chunk may be leased again): only in tests.
    #[cfg(test)]
    pub(crate) fn registration(&self) -> Registration {
        Registration {
            inner: Reg::Cached(self.inner.chunk.clone()),
        }
    }

    /// The chunk's capacity in bytes (its size class).
    pub fn len(&self) -> usize {
        self.inner.chunk.len
    }

    /// Never true: a chunk has at least 4 KiB.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Start of the chunk.
    pub fn as_ptr(&self) -> *const u8 {
        self.inner.chunk.ptr.as_ptr()
    }

    /// Start of the chunk, for writing.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.inner.chunk.ptr.as_ptr()
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.fmt(f)
    }
}

// SAFETY: the chunk's mapping has a fixed address and `len` bytes, is owned
// by this lease alone while it lives (the pool hands a chunk to one lease at
// a time), and is neither unmapped nor moved before the lease (and every
// Registration of it) is dropped: the Arc<Chunk> keeps it mapped.
unsafe impl xdev::BufferStorage for Lease {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        Lease::as_mut_ptr(self)
    }

    fn capacity(&self) -> usize {
        self.len()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A registered range: a chunk of the cache, or a transient registration of
/// foreign memory. Keeps its region registered (and a chunk mapped) while
/// any clone lives; cheap to clone.
///
/// Crate-private: its keys and scatter/gather entries name memory to the
/// NIC, and a chunk's registration outlives the lease it came from.
#[derive(Clone)]
pub(crate) struct Registration {
    inner: Reg<VerbsRegistrar>,
}

impl Registration {
    /// Local key, for scatter/gather entries.
    pub fn lkey(&self) -> u32 {
        self.inner.keys().lkey
    }

    /// Remote key, for peers' RDMA operations.
    pub fn rkey(&self) -> u32 {
        self.inner.keys().rkey
    }

    /// Whether this is a cache chunk (else a transient registration).
    #[cfg(test)]
    pub fn is_cached(&self) -> bool {
        matches!(self.inner, Reg::Cached(_))
    }

    /// A scatter/gather entry for `[ptr, ptr + len)`.
    ///
    /// # Panics
    /// If the range is not inside the registration or is 4 GiB or longer
    /// (callers only pass ranges they registered).
    pub fn sge(&self, ptr: *const u8, len: usize) -> Sge<'_> {
        assert!(
            self.inner.contains(ptr as usize, len),
            "range {ptr:p}+{len} outside the registration at {:#x}+{}",
            self.inner.addr(),
            self.inner.len()
        );
        let length = u32::try_from(len).expect("a scatter/gather entry is at most 4 GiB");
        Sge::from_parts(ptr as u64, length, self.lkey())
    }

    /// The address and remote key a peer uses to RDMA-write (or read) at
    /// `ptr`.
    ///
    /// # Panics
    /// If `ptr` is outside the registration (its end is allowed).
    pub fn remote(&self, ptr: *const u8) -> RemoteAddr {
        assert!(
            self.inner.contains(ptr as usize, 0),
            "address {ptr:p} outside the registration at {:#x}+{}",
            self.inner.addr(),
            self.inner.len()
        );
        RemoteAddr {
            addr: ptr as u64,
            rkey: self.rkey(),
        }
    }
}

impl fmt::Debug for Registration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.fmt(f)
    }
}
