//! The cache's bookkeeping, generic over a registrar so that it is tested
//! without an RDMA device: size classes, chunks (mapped, registered,
//! unmapped), the idle list in LRU order, the pinned budget, lookups and
//! transient registrations, and the limits and counters they answer to.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::io;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::verbs;

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
    /// Bytes pinned by leased, idle, user and transient registrations
    /// together (default 1 GiB). Mind `ulimit -l` when not running as root.
    pub max_pinned_bytes: usize,
    /// User buffers kept registered between operations (default 64).
    pub max_user_entries: usize,
    /// Bytes (whole pages) of user buffers kept registered between
    /// operations (default 256 MiB); a larger buffer is registered for one
    /// operation only.
    pub max_user_bytes: usize,
}

impl Default for CacheLimits {
    fn default() -> Self {
        CacheLimits {
            max_idle_chunks: 64,
            max_idle_bytes: 64 << 20,
            max_pinned_bytes: 1 << 30,
            max_user_entries: 64,
            max_user_bytes: 256 << 20,
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
    /// Operations on a user buffer whose registration was kept (no verbs call).
    pub user_hits: u64,
    /// User buffers registered and entered in the cache.
    pub user_misses: u64,
    /// User entries evicted (limits or budget pressure).
    pub user_evictions: u64,
    /// User buffers registered now.
    pub user_entries: usize,
    /// Bytes (whole pages) of user buffers registered now.
    pub user_bytes: usize,
}

// ---------------------------------------------------------------------------
// The registrar: what the bookkeeping needs from verbs (faked in tests).

/// The keys of a registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Keys {
    pub(super) lkey: u32,
    pub(super) rkey: u32,
}

/// What a registration lets the NIC do with the memory.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum Exposure {
    /// Local access only (the cache's chunks, send sources): its rkey
    /// grants a peer nothing.
    Local,
    /// Local access, and RDMA writes by whoever holds the rkey: only ever a
    /// transient registration of one rendezvous receive, deregistered (so
    /// the rkey dies) when that receive ends.
    RemoteWrite,
}

/// Registers and deregisters memory; the pool's only contact with verbs.
pub(super) trait Registrar: Send + Sync + 'static {
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
        tracing::error!(
            bytes = len,
            error = %io::Error::last_os_error(),
            "munmap of a registration cache chunk failed"
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
pub(super) struct Shared<R: Registrar> {
    registrar: R,
    pub(super) limits: CacheLimits,
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
                tracing::error!(error = %e, bytes = len, "registration cache: deregistration failed; leaking the chunk");
                self.leaked.fetch_add(len, Ordering::AcqRel);
                false
            }
        }
    }
}

/// One registered mapping the cache owns.
pub(super) struct Chunk<R: Registrar> {
    pub(super) ptr: NonNull<u8>,
    pub(super) len: usize,
    pub(super) keys: Keys,
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

/// A foreign range registered for one operation, or a user buffer's
/// registration kept in the user table (`user`: not counted as transient).
pub(super) struct Transient<R: Registrar> {
    addr: usize,
    len: usize,
    pinned: usize,
    user: bool,
    keys: Keys,
    region: Option<R::Region>,
    shared: Arc<Shared<R>>,
}

impl<R: Registrar> Drop for Transient<R> {
    fn drop(&mut self) {
        if !self.user {
            self.shared
                .transient_bytes
                .fetch_sub(self.pinned, Ordering::AcqRel);
        }
        if let Some(region) = self.region.take() {
            self.shared.deregister(region, self.pinned);
        }
    }
}

/// A registration handle of either kind.
pub(super) enum Reg<R: Registrar> {
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
    pub(super) fn addr(&self) -> usize {
        match self {
            Reg::Cached(c) => c.ptr.as_ptr() as usize,
            Reg::Transient(t) => t.addr,
        }
    }

    pub(super) fn len(&self) -> usize {
        match self {
            Reg::Cached(c) => c.len,
            Reg::Transient(t) => t.len,
        }
    }

    pub(super) fn keys(&self) -> Keys {
        match self {
            Reg::Cached(c) => c.keys,
            Reg::Transient(t) => t.keys,
        }
    }

    pub(super) fn contains(&self, ptr: usize, len: usize) -> bool {
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

/// A user buffer's registration in the user table, with its LRU stamp.
struct UserSlot<R: Registrar> {
    reg: Arc<Transient<R>>,
    stamp: u64,
}

/// Everything behind the pool's lock.
struct State<R: Registrar> {
    /// User buffers kept registered, by buffer identity.
    users: HashMap<u64, UserSlot<R>>,
    /// User entries, least recently used first: stamp -> identity.
    user_lru: BTreeMap<u64, u64>,
    user_bytes: usize,
    user_hits: u64,
    user_misses: u64,
    user_evictions: u64,
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
        tracing::debug!(
            bytes = slot.chunk.len,
            evictions = self.evictions,
            "registration cache: idle chunk evicted"
        );
        Some(slot.chunk)
    }

    /// Removes user entry `id` (its registration ends once no operation
    /// holds it).
    fn remove_user(&mut self, id: u64) -> Option<Arc<Transient<R>>> {
        let slot = self.users.remove(&id)?;
        self.user_lru.remove(&slot.stamp);
        self.user_bytes -= slot.reg.pinned;
        Some(slot.reg)
    }

    /// Removes the least recently used user entry.
    fn evict_user_lru(&mut self) -> Option<Arc<Transient<R>>> {
        let (_, &id) = self.user_lru.iter().next()?;
        self.user_evictions += 1;
        tracing::debug!(
            id,
            evictions = self.user_evictions,
            "registration cache: user entry evicted"
        );
        self.remove_user(id)
    }
}

/// The cache, generic over the registrar.
pub(super) struct Pool<R: Registrar> {
    pub(super) shared: Arc<Shared<R>>,
    state: Mutex<State<R>>,
    /// Debug identity for `fmt::Debug`.
    pub(super) id: u64,
}

static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);

impl<R: Registrar> Pool<R> {
    pub(super) fn new(registrar: R, limits: CacheLimits) -> Arc<Self> {
        Arc::new(Pool {
            shared: Arc::new(Shared {
                registrar,
                limits,
                pinned: AtomicUsize::new(0),
                transient_bytes: AtomicUsize::new(0),
                leaked: AtomicUsize::new(0),
            }),
            state: Mutex::new(State {
                users: HashMap::new(),
                user_lru: BTreeMap::new(),
                user_bytes: 0,
                user_hits: 0,
                user_misses: 0,
                user_evictions: 0,
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
            let (chunk, user) = {
                let mut st = self.state();
                match st.evict_lru() {
                    Some(c) => (Some(c), None),
                    None => (None, st.evict_user_lru()),
                }
            };
            match (chunk, user) {
                // Dropping the pool's handle deregisters (and releases its
                // bytes) unless a live Registration still holds it.
                (Some(chunk), _) => drop(chunk),
                (None, Some(user)) => drop(user),
                (None, None) => {
                    return if self.shared.try_reserve(n) {
                        Ok(())
                    } else {
                        Err(refuse())
                    };
                }
            }
        }
    }

    pub(super) fn lease(self: &Arc<Self>, len: usize) -> verbs::Result<PoolLease<R>> {
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

    pub(super) fn find(&self, ptr: *const u8, len: usize) -> Option<Reg<R>> {
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
    pub(super) unsafe fn register(
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
            user: false,
            keys,
            region: Some(region),
            shared: self.shared.clone(),
        })))
    }

    pub(super) fn stats(&self) -> CacheStats {
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
            user_hits: st.user_hits,
            user_misses: st.user_misses,
            user_evictions: st.user_evictions,
            user_entries: st.users.len(),
            user_bytes: st.user_bytes,
        }
    }
}

impl<R: Registrar> Pool<R> {
    /// The registration of user buffer `id`, `[ptr, ptr + len)`, for local
    /// access: the one kept in the user table (a hit, no verbs call), else
    /// a new one entered there (least recently used entries evicted beyond
    /// `max_user_entries` and `max_user_bytes`). A buffer larger than
    /// `max_user_bytes` gets a transient registration instead.
    ///
    /// # Safety
    /// `id` names one allocation for as long as it is registered: the range
    /// stays mapped until [`forget_user`](Self::forget_user)`(id)` was
    /// called and every returned registration (and clone) is dropped, and
    /// no other range is ever passed with the same `id`.
    pub(super) unsafe fn register_user(
        &self,
        id: u64,
        ptr: *mut u8,
        len: usize,
    ) -> verbs::Result<Reg<R>> {
        let limits = self.shared.limits;
        let pinned = pages_spanned(ptr as usize, len).unwrap_or(usize::MAX);
        if ptr.is_null()
            || len == 0
            || limits.max_user_entries == 0
            || pinned > limits.max_user_bytes
        {
            // SAFETY: forwarded contract (a transient registration ends
            // with its last handle).
            return unsafe { self.register(ptr, len, Exposure::Local) };
        }
        if let Some(r) = self.user_hit(id, ptr as usize, len) {
            return Ok(r);
        }
        let victims = self.make_user_room(pinned);
        drop(victims);
        self.reserve(pinned, "user buffer registration")?;
        let nn = NonNull::new(ptr).expect("checked above");
        // SAFETY: the caller keeps the range mapped until the entry is
        // forgotten and every handle dropped; `Transient::drop` deregisters.
        let (region, keys) =
            match unsafe { self.shared.registrar.register(nn, len, Exposure::Local) } {
                Ok(r) => r,
                Err(e) => {
                    self.shared.release(pinned);
                    return Err(e);
                }
            };
        let reg = Arc::new(Transient {
            addr: ptr as usize,
            len,
            pinned,
            user: true,
            keys,
            region: Some(region),
            shared: self.shared.clone(),
        });
        let old = {
            let mut st = self.state();
            st.user_misses += 1;
            let old = st.remove_user(id);
            let stamp = st.next_stamp;
            st.next_stamp += 1;
            st.user_lru.insert(stamp, id);
            st.user_bytes += pinned;
            st.users.insert(
                id,
                UserSlot {
                    reg: reg.clone(),
                    stamp,
                },
            );
            old
        };
        drop(old);
        Ok(Reg::Transient(reg))
    }

    /// The kept registration of user buffer `id` if it is of exactly
    /// `[addr, addr + len)` (it always is: an identity names one
    /// allocation), made the most recently used.
    fn user_hit(&self, id: u64, addr: usize, len: usize) -> Option<Reg<R>> {
        let mut st = self.state();
        let slot = st.users.get(&id)?;
        if slot.reg.addr != addr || slot.reg.len != len {
            return None;
        }
        let (reg, old) = (slot.reg.clone(), slot.stamp);
        let stamp = st.next_stamp;
        st.next_stamp += 1;
        st.user_lru.remove(&old);
        st.user_lru.insert(stamp, id);
        st.users.get_mut(&id)?.stamp = stamp;
        st.user_hits += 1;
        Some(Reg::Transient(reg))
    }

    /// Evicts least recently used user entries until one more of `pinned`
    /// bytes fits the user limits; the caller drops them outside the lock.
    fn make_user_room(&self, pinned: usize) -> Vec<Arc<Transient<R>>> {
        let limits = self.shared.limits;
        let mut st = self.state();
        let mut victims = Vec::new();
        while st.users.len() + 1 > limits.max_user_entries
            || st.user_bytes + pinned > limits.max_user_bytes
        {
            match st.evict_user_lru() {
                Some(v) => victims.push(v),
                None => break,
            }
        }
        victims
    }

    /// Ends user entry `id` (its buffer is releasing its memory): its
    /// registration is deregistered once no operation holds it.
    pub(super) fn forget_user(&self, id: u64) {
        let old = self.state().remove_user(id);
        drop(old);
    }
}

/// A leased chunk, generic over the registrar.
pub(super) struct PoolLease<R: Registrar> {
    pub(super) chunk: Arc<Chunk<R>>,
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

#[cfg(test)]
mod tests;
