//! The pin-down registration cache: registered memory for IBVX's sends,
//! receives and RDMA writes without an `ibv_reg_mr` per message.
//!
//! # The rule: only library-owned memory is ever cached
//!
//! An address-keyed pin-down cache has a classic failure: user memory is
//! freed (`munmap`), a new allocation lands at the same virtual address,
//! and the cache hands out the old registration, which still pins the *old*
//! physical pages, so the device sends stale bytes (or writes into memory
//! nobody reads). Interception of `munmap`/`free` (memory hooks, userfault,
//! ODP) makes this rarer; this cache makes it **impossible by design**:
//!
//! - **The cache only ever holds registrations of memory the library itself
//!   owns and leases out.** Such memory is a *chunk*: an anonymous mapping
//!   made by the cache, registered once, and leased out through
//!   [`RegistrationCache::lease`] / [`RegistrationCache::buffer`]. A chunk
//!   is never unmapped while it is registered: it is deregistered first, and
//!   unmapped only if deregistration succeeded (otherwise it is leaked).
//!   A chunk leaves the lookup table ([`RegistrationCache::find`]) before it
//!   is deregistered, so no lookup can return a dying registration.
//! - **Foreign memory** (a user's `Vec`, a borrowed slice: anything not
//!   inside a chunk) is registered for one operation only:
//!   [`RegistrationCache::register`] returns a *transient* [`Registration`]
//!   that is deregistered when its last clone is dropped (when the operation
//!   completes). It is never entered in the lookup table, so a later
//!   [`RegistrationCache::find`] of the same address cannot return it.
//!
//! So every registration the cache returns names pages that are mapped and
//! pinned for as long as the [`Registration`] lives, and an address that
//! `find` resolves is always the chunk that is mapped there now.
//!
//! # Chunks, the idle list and the budgets
//!
//! Chunks come in power-of-two size classes from 4 KiB ([`MIN_CHUNK`]). Each
//! is its own `mmap(MAP_PRIVATE | MAP_ANONYMOUS)` mapping: page aligned,
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
//! The bookkeeping (size classes, LRU, budgets) is generic over a small
//! registrar trait so that it is tested without an RDMA device; the public
//! types use the verbs registrar (`ibv_reg_mr` with the cache's
//! [`Access`]).

use std::any::Any;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::io;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::verbs::{self, Access, MemoryRegion, ProtectionDomain, RemoteAddr, Sge};

/// The smallest chunk (and page) size: 4 KiB.
pub const MIN_CHUNK: usize = 4096;

/// The cache's bounds. Every limit is taken literally (0 means none may be
/// kept, not "unlimited").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheLimits {
    /// Idle chunks kept registered for reuse (default 64).
    pub max_idle_chunks: usize,
    /// Bytes of idle chunks kept registered for reuse (default 64 MiB).
    pub max_idle_bytes: usize,
    /// Bytes pinned by leased, idle and transient registrations together
    /// (default 1 GiB). Mind `ulimit -l` when not running as root.
    pub max_pinned_bytes: usize,
}

impl Default for CacheLimits {
    fn default() -> Self {
        CacheLimits {
            max_idle_chunks: 64,
            max_idle_bytes: 64 << 20,
            max_pinned_bytes: 1 << 30,
        }
    }
}

/// A snapshot of the cache's counters and occupancy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Leases served from an idle chunk (no verbs call).
    pub hits: u64,
    /// Leases that registered a new chunk.
    pub misses: u64,
    /// Lookups (`find`, and `register`'s first step) answered by a chunk
    /// (no verbs call).
    pub find_hits: u64,
    /// Lookups that found no chunk.
    pub find_misses: u64,
    /// Transient registrations made by `register`.
    pub transient: u64,
    /// Idle chunks evicted (limits or budget pressure).
    pub evictions: u64,
    /// Idle chunks now.
    pub idle_chunks: usize,
    /// Bytes in idle chunks now.
    pub idle_bytes: usize,
    /// Bytes in leased chunks now.
    pub leased_bytes: usize,
    /// Bytes (whole pages) of live transient registrations now.
    pub transient_bytes: usize,
    /// Bytes pinned now: leased + idle + transient, plus evicted chunks a
    /// live registration handle (of a work request in flight) still holds,
    /// plus leaked bytes.
    pub pinned_bytes: usize,
    /// Bytes whose deregistration failed: still pinned, never freed.
    pub leaked_bytes: usize,
}

// ---------------------------------------------------------------------------
// The registrar: what the bookkeeping needs from verbs (faked in tests).

/// The keys of a registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Keys {
    lkey: u32,
    rkey: u32,
}

/// What a registration lets the NIC do with the memory.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Exposure {
    /// Local access only (the cache's chunks, send sources): its rkey
    /// grants a peer nothing.
    Local,
    /// Local access, and RDMA writes by whoever holds the rkey: only ever a
    /// transient registration of one rendezvous receive, deregistered (so
    /// the rkey dies) when that receive ends.
    RemoteWrite,
}

/// Registers and deregisters memory; the pool's only contact with verbs.
trait Registrar: Send + Sync + 'static {
    /// The handle of one registration.
    type Region: Send + Sync + 'static;

    /// Registers `len` bytes at `ptr`, for local access only or granting
    /// remote write as well.
    ///
    /// # Safety
    /// The range must stay mapped until the region is deregistered.
    unsafe fn register(
        &self,
        ptr: NonNull<u8>,
        len: usize,
        exposure: Exposure,
    ) -> verbs::Result<(Self::Region, Keys)>;

    /// Deregisters; on failure the device may still reach the memory.
    fn deregister(&self, region: Self::Region) -> verbs::Result<()>;
}

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
// Chunk memory.

/// Maps `len` zeroed bytes (a multiple of the page size).
fn map(len: usize) -> verbs::Result<NonNull<u8>> {
    // SAFETY: an anonymous private mapping at an address of the kernel's
    // choice touches no existing memory.
    let p = unsafe {
        libc::mmap(
            ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(verbs::Error::Registration {
            len,
            source: io::Error::last_os_error(),
            hint: " (mmap of a registration cache chunk)",
        });
    }
    NonNull::new(p.cast()).ok_or_else(|| verbs::Error::InvalidArgument("mmap returned 0".into()))
}

/// Unmaps a chunk.
///
/// # Safety
/// `ptr`/`len` come from one [`map`] call, the range is not registered, and
/// nothing uses it afterwards.
unsafe fn unmap(ptr: NonNull<u8>, len: usize) {
    // SAFETY: the caller's contract.
    let rc = unsafe { libc::munmap(ptr.as_ptr().cast(), len) };
    if rc != 0 {
        eprintln!(
            "ibvx: munmap of a {len}-byte registration cache chunk failed: {}",
            io::Error::last_os_error()
        );
    }
}

/// The size class (chunk length) that holds `len` bytes.
fn class_of(len: usize) -> Option<usize> {
    len.max(MIN_CHUNK).checked_next_power_of_two()
}

/// Bytes of the whole pages `[ptr, ptr + len)` spans (what registering it
/// pins).
fn pages_spanned(ptr: usize, len: usize) -> Option<usize> {
    let start = ptr & !(MIN_CHUNK - 1);
    let end = ptr.checked_add(len)?.checked_add(MIN_CHUNK - 1)? & !(MIN_CHUNK - 1);
    Some(end - start)
}

// ---------------------------------------------------------------------------
// The generic pool.

/// What chunks and transient registrations share with the pool (no chunk
/// table here, so chunks can hold it without a cycle).
struct Shared<R: Registrar> {
    registrar: R,
    limits: CacheLimits,
    pinned: AtomicUsize,
    transient_bytes: AtomicUsize,
    leaked: AtomicUsize,
}

impl<R: Registrar> Shared<R> {
    /// Adds `n` pinned bytes if that stays within the budget.
    fn try_reserve(&self, n: usize) -> bool {
        let limit = self.limits.max_pinned_bytes;
        self.pinned
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| {
                cur.checked_add(n).filter(|&t| t <= limit)
            })
            .is_ok()
    }

    fn release(&self, n: usize) {
        self.pinned.fetch_sub(n, Ordering::AcqRel);
    }

    /// Deregisters `region`; true if the memory may be freed. On failure
    /// the bytes stay pinned (counted as leaked) forever.
    fn deregister(&self, region: R::Region, len: usize) -> bool {
        match self.registrar.deregister(region) {
            Ok(()) => {
                self.release(len);
                true
            }
            Err(e) => {
                eprintln!("ibvx: registration cache: {e}; leaking {len} bytes");
                self.leaked.fetch_add(len, Ordering::AcqRel);
                false
            }
        }
    }
}

/// One registered mapping the cache owns.
struct Chunk<R: Registrar> {
    ptr: NonNull<u8>,
    len: usize,
    keys: Keys,
    region: Option<R::Region>,
    shared: Arc<Shared<R>>,
}

// SAFETY: `ptr` is only an address of the chunk's own mapping (written only
// through a `Lease`, which owns the chunk exclusively); the other fields are
// Send + Sync.
unsafe impl<R: Registrar> Send for Chunk<R> {}
// SAFETY: as above; `&Chunk` only reads immutable fields.
unsafe impl<R: Registrar> Sync for Chunk<R> {}

impl<R: Registrar> Drop for Chunk<R> {
    fn drop(&mut self) {
        let Some(region) = self.region.take() else {
            return;
        };
        if self.shared.deregister(region, self.len) {
            // SAFETY: mapped by `map` with this length, deregistered just
            // now, and this was the last handle to the chunk.
            unsafe { unmap(self.ptr, self.len) };
        }
    }
}

/// A foreign range registered for one operation.
struct Transient<R: Registrar> {
    addr: usize,
    len: usize,
    pinned: usize,
    keys: Keys,
    region: Option<R::Region>,
    shared: Arc<Shared<R>>,
}

impl<R: Registrar> Drop for Transient<R> {
    fn drop(&mut self) {
        self.shared
            .transient_bytes
            .fetch_sub(self.pinned, Ordering::AcqRel);
        if let Some(region) = self.region.take() {
            self.shared.deregister(region, self.pinned);
        }
    }
}

/// A registration handle of either kind.
enum Reg<R: Registrar> {
    Cached(Arc<Chunk<R>>),
    Transient(Arc<Transient<R>>),
}

impl<R: Registrar> Clone for Reg<R> {
    fn clone(&self) -> Self {
        match self {
            Reg::Cached(c) => Reg::Cached(c.clone()),
            Reg::Transient(t) => Reg::Transient(t.clone()),
        }
    }
}

impl<R: Registrar> Reg<R> {
    fn addr(&self) -> usize {
        match self {
            Reg::Cached(c) => c.ptr.as_ptr() as usize,
            Reg::Transient(t) => t.addr,
        }
    }

    fn len(&self) -> usize {
        match self {
            Reg::Cached(c) => c.len,
            Reg::Transient(t) => t.len,
        }
    }

    fn keys(&self) -> Keys {
        match self {
            Reg::Cached(c) => c.keys,
            Reg::Transient(t) => t.keys,
        }
    }

    fn contains(&self, ptr: usize, len: usize) -> bool {
        ptr >= self.addr()
            && ptr
                .checked_add(len)
                .is_some_and(|end| end <= self.addr() + self.len())
    }
}

impl<R: Registrar> fmt::Debug for Reg<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registration")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("cached", &matches!(self, Reg::Cached(_)))
            .field("lkey", &format_args!("{:#x}", self.keys().lkey))
            .field("rkey", &format_args!("{:#x}", self.keys().rkey))
            .finish()
    }
}

/// One chunk in the table: the pool's handle, and its idle stamp when idle.
struct Slot<R: Registrar> {
    chunk: Arc<Chunk<R>>,
    idle: Option<u64>,
}

/// Everything behind the pool's lock.
struct State<R: Registrar> {
    /// Every chunk the pool owns (leased or idle), by start address.
    chunks: BTreeMap<usize, Slot<R>>,
    /// Idle chunks, least recently used first: stamp -> start address.
    lru: BTreeMap<u64, usize>,
    /// Idle chunks by (size class, stamp), for the most recent of a class.
    by_class: BTreeSet<(usize, u64)>,
    next_stamp: u64,
    idle_bytes: usize,
    leased_bytes: usize,
    hits: u64,
    misses: u64,
    find_hits: u64,
    find_misses: u64,
    transient: u64,
    evictions: u64,
}

impl<R: Registrar> State<R> {
    /// Takes the most recently used idle chunk of `class` and marks it leased.
    fn take_idle(&mut self, class: usize) -> Option<Arc<Chunk<R>>> {
        let &(_, stamp) = self
            .by_class
            .range((class, 0)..=(class, u64::MAX))
            .next_back()?;
        self.by_class.remove(&(class, stamp));
        let addr = self.lru.remove(&stamp)?;
        let slot = self.chunks.get_mut(&addr)?;
        slot.idle = None;
        self.idle_bytes -= class;
        self.leased_bytes += class;
        Some(slot.chunk.clone())
    }

    /// Removes the least recently used idle chunk from the pool.
    fn evict_lru(&mut self) -> Option<Arc<Chunk<R>>> {
        let (stamp, addr) = self.lru.pop_first()?;
        let slot = self.chunks.remove(&addr)?;
        self.by_class.remove(&(slot.chunk.len, stamp));
        self.idle_bytes -= slot.chunk.len;
        self.evictions += 1;
        Some(slot.chunk)
    }
}

/// The cache, generic over the registrar.
struct Pool<R: Registrar> {
    shared: Arc<Shared<R>>,
    state: Mutex<State<R>>,
    /// Debug identity for `fmt::Debug`.
    id: u64,
}

static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);

impl<R: Registrar> Pool<R> {
    fn new(registrar: R, limits: CacheLimits) -> Arc<Self> {
        Arc::new(Pool {
            shared: Arc::new(Shared {
                registrar,
                limits,
                pinned: AtomicUsize::new(0),
                transient_bytes: AtomicUsize::new(0),
                leaked: AtomicUsize::new(0),
            }),
            state: Mutex::new(State {
                chunks: BTreeMap::new(),
                lru: BTreeMap::new(),
                by_class: BTreeSet::new(),
                next_stamp: 0,
                idle_bytes: 0,
                leased_bytes: 0,
                hits: 0,
                misses: 0,
                find_hits: 0,
                find_misses: 0,
                transient: 0,
                evictions: 0,
            }),
            id: NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// The state; a panic while it was held cannot leave it inconsistent in
    /// a way that matters more than refusing service, so poisoning is ignored.
    fn state(&self) -> MutexGuard<'_, State<R>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reserves `n` pinned bytes, evicting idle chunks (least recently used
    /// first) while the budget is short. Evicted chunks are deregistered
    /// outside the lock.
    fn reserve(&self, n: usize, what: &'static str) -> verbs::Result<()> {
        let limit = self.shared.limits.max_pinned_bytes;
        let refuse = || verbs::Error::Budget {
            what,
            requested: n,
            pinned: self.shared.pinned.load(Ordering::Acquire),
            limit,
        };
        if n > limit {
            return Err(refuse());
        }
        loop {
            if self.shared.try_reserve(n) {
                return Ok(());
            }
            let victim = self.state().evict_lru();
            match victim {
                // Dropping the pool's handle deregisters (and releases its
                // bytes) unless a live Registration still holds the chunk.
                Some(chunk) => drop(chunk),
                None => {
                    return if self.shared.try_reserve(n) {
                        Ok(())
                    } else {
                        Err(refuse())
                    };
                }
            }
        }
    }

    fn lease(self: &Arc<Self>, len: usize) -> verbs::Result<PoolLease<R>> {
        let class = class_of(len).ok_or_else(|| {
            verbs::Error::InvalidArgument(format!("a lease of {len} bytes is too large"))
        })?;
        let hit = {
            let mut st = self.state();
            let c = st.take_idle(class);
            if c.is_some() {
                st.hits += 1;
            }
            c
        };
        if let Some(chunk) = hit {
            // SAFETY: the chunk is mapped for `len` bytes and now leased to
            // us alone (only stale Registration handles may name it).
            unsafe { ptr::write_bytes(chunk.ptr.as_ptr(), 0, chunk.len) };
            return Ok(PoolLease {
                chunk,
                pool: self.clone(),
            });
        }
        self.reserve(class, "registration cache lease")?;
        let ptr = match map(class) {
            Ok(p) => p,
            Err(e) => {
                self.shared.release(class);
                return Err(e);
            }
        };
        // SAFETY: the mapping is unmapped only by `Chunk::drop`, after the
        // region is deregistered (or on the error path below, when it is
        // not registered).
        let (region, keys) =
            match unsafe { self.shared.registrar.register(ptr, class, Exposure::Local) } {
                Ok(r) => r,
                Err(e) => {
                    // SAFETY: mapped above, registration failed, not shared.
                    unsafe { unmap(ptr, class) };
                    self.shared.release(class);
                    return Err(e);
                }
            };
        let chunk = Arc::new(Chunk {
            ptr,
            len: class,
            keys,
            region: Some(region),
            shared: self.shared.clone(),
        });
        {
            let mut st = self.state();
            st.misses += 1;
            st.leased_bytes += class;
            st.chunks.insert(
                ptr.as_ptr() as usize,
                Slot {
                    chunk: chunk.clone(),
                    idle: None,
                },
            );
        }
        Ok(PoolLease {
            chunk,
            pool: self.clone(),
        })
    }

    /// Puts a leased chunk back on the idle list, then trims the list.
    fn give_back(&self, chunk: &Chunk<R>) {
        let limits = self.shared.limits;
        let mut victims = Vec::new();
        {
            let mut st = self.state();
            let stamp = st.next_stamp;
            st.next_stamp += 1;
            let addr = chunk.ptr.as_ptr() as usize;
            if let Some(slot) = st.chunks.get_mut(&addr) {
                slot.idle = Some(stamp);
                st.lru.insert(stamp, addr);
                st.by_class.insert((chunk.len, stamp));
                st.leased_bytes -= chunk.len;
                st.idle_bytes += chunk.len;
            }
            while st.lru.len() > limits.max_idle_chunks || st.idle_bytes > limits.max_idle_bytes {
                match st.evict_lru() {
                    Some(c) => victims.push(c),
                    None => break,
                }
            }
        }
        // Deregistered and unmapped here, outside the lock.
        drop(victims);
    }

    fn find(&self, ptr: *const u8, len: usize) -> Option<Reg<R>> {
        let p = ptr as usize;
        let mut st = self.state();
        let found = p.checked_add(len).and_then(|end| {
            let (&start, slot) = st.chunks.range(..=p).next_back()?;
            let chunk_end = start + slot.chunk.len;
            (p < chunk_end && end <= chunk_end).then(|| slot.chunk.clone())
        });
        match found {
            Some(c) => {
                st.find_hits += 1;
                Some(Reg::Cached(c))
            }
            None => {
                st.find_misses += 1;
                None
            }
        }
    }

    /// # Safety
    /// The range must stay mapped until the returned registration (every
    /// clone) is dropped.
    unsafe fn register(
        &self,
        ptr: *mut u8,
        len: usize,
        exposure: Exposure,
    ) -> verbs::Result<Reg<R>> {
        // A chunk serves local access; a remote grant is always its own.
        if exposure == Exposure::Local {
            if let Some(r) = self.find(ptr, len) {
                return Ok(r);
            }
        }
        let Some(nn) = NonNull::new(ptr) else {
            return Err(verbs::Error::InvalidArgument(
                "cannot register a null pointer".into(),
            ));
        };
        if len == 0 {
            return Err(verbs::Error::InvalidArgument(
                "cannot register an empty range".into(),
            ));
        }
        let pinned = pages_spanned(ptr as usize, len).ok_or_else(|| {
            verbs::Error::InvalidArgument(format!("range of {len} bytes at {ptr:p} wraps"))
        })?;
        self.reserve(pinned, "transient registration")?;
        // SAFETY: the caller keeps the range mapped until the Registration
        // is dropped, and `Transient::drop` deregisters it.
        let (region, keys) = match unsafe { self.shared.registrar.register(nn, len, exposure) } {
            Ok(r) => r,
            Err(e) => {
                self.shared.release(pinned);
                return Err(e);
            }
        };
        self.shared
            .transient_bytes
            .fetch_add(pinned, Ordering::AcqRel);
        self.state().transient += 1;
        Ok(Reg::Transient(Arc::new(Transient {
            addr: ptr as usize,
            len,
            pinned,
            keys,
            region: Some(region),
            shared: self.shared.clone(),
        })))
    }

    fn stats(&self) -> CacheStats {
        let st = self.state();
        CacheStats {
            hits: st.hits,
            misses: st.misses,
            find_hits: st.find_hits,
            find_misses: st.find_misses,
            transient: st.transient,
            evictions: st.evictions,
            idle_chunks: st.lru.len(),
            idle_bytes: st.idle_bytes,
            leased_bytes: st.leased_bytes,
            transient_bytes: self.shared.transient_bytes.load(Ordering::Acquire),
            pinned_bytes: self.shared.pinned.load(Ordering::Acquire),
            leaked_bytes: self.shared.leaked.load(Ordering::Acquire),
        }
    }
}

/// A leased chunk, generic over the registrar.
struct PoolLease<R: Registrar> {
    chunk: Arc<Chunk<R>>,
    pool: Arc<Pool<R>>,
}

impl<R: Registrar> fmt::Debug for PoolLease<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("addr", &self.chunk.ptr)
            .field("len", &self.chunk.len)
            .field("lkey", &format_args!("{:#x}", self.chunk.keys.lkey))
            .finish()
    }
}

impl<R: Registrar> Drop for PoolLease<R> {
    fn drop(&mut self) {
        self.pool.give_back(&self.chunk);
    }
}

// ---------------------------------------------------------------------------
// The public face: the pool over verbs.

/// The pin-down registration cache of one protection domain. Cheap to clone
/// (reference counted); `Send + Sync`.
///
/// It only ever caches registrations of memory it owns itself: *chunks*,
/// page-aligned anonymous mappings in power-of-two size classes from 4 KiB,
/// registered once and leased out ([`lease`](Self::lease),
/// [`buffer`](Self::buffer)). A dropped [`Lease`] goes on an idle list,
/// still registered, for the next lease of its class; [`CacheLimits`] bounds
/// the idle list and all pinned memory. Foreign memory is only ever
/// registered for one operation, never cached, so the cache cannot hand out
/// a stale registration of memory that was freed and reused.
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

#[cfg(test)]
mod rxe_tests;
#[cfg(test)]
mod tests;
