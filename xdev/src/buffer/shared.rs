//! The shared arena: huge-page-sized extents of one sealed `memfd` that
//! the process devices of this host can map, so that a receiver copies a
//! large message straight from the sender's buffer in user space (and a
//! sender can write the tail of a split copy into the receiver's).
//!
//! Why: between processes on one host the kernel's copy (CMA,
//! `process_vm_readv`) is what both this library and Open MPI spend a
//! large message's time in, at the speed of `memcpy` with both cores
//! copying (profiled at osu_bibw 4 MiB: `_copy_to_iter` 40-45% of all
//! samples on both sides). A copy in user space from the sender's pages
//! mapped here can use non-temporal stores, which skip reading the
//! destination's lines before writing them: measured on the 2-core test
//! machine with both cores copying, 1.5-1.9x `memcpy`'s speed at 512 KiB
//! to 1 MiB. XPMEM gives Open MPI and UCX such mappings of any memory,
//! through a kernel module; here they are had for the buffers this crate
//! allocates (page-aligned, from 256 KiB up), which a peer takes with
//! `pidfd_getfd(2)` (the same ptrace permission as CMA).
//!
//! How:
//! - off until a device calls [`share_with_peers`] (the process device,
//!   where CMA is allowed); until then, and where the arena cannot be set
//!   up, huge-backed buffers are private anonymous memory as before;
//! - one `memfd`, sealed against shrinking (`F_SEAL_SHRINK`: a mapping of
//!   it can never fault past its end), grown in extents that are multiples
//!   of 2 MiB and mapped at fixed offsets of a reserved address range, so
//!   a buffer's offset in the file is its distance from the range's start;
//! - the range is reserved once (`XDEV_SHARED_ARENA_MIB`, default
//!   [`DEFAULT_SHARED_MIB`] MiB of address space, no memory; at most a
//!   quarter of what `RLIMIT_AS` allows); an extent
//!   given back has its pages released (`FALLOC_FL_PUNCH_HOLE`), so it
//!   reads zeros when handed out again and holds no memory while free;
//!   the 256 KiB-1 MiB blocks' 2 MiB chunks come from here too and stay
//!   with their size classes, bounded as before (`XDEV_HUGE_ARENA_MIB`);
//! - the range is `MADV_DONTFORK`, and a forked child stops using the
//!   arena (`pthread_atfork`): a child that wrote into its parent's shared
//!   pages would change them under the parent.

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

use super::huge::HUGE_PAGE;

/// Default size, in MiB, of the address range reserved for the shared
/// arena (`XDEV_SHARED_ARENA_MIB`). Address space only: memory is used by
/// live buffers and the size classes' chunks.
pub const DEFAULT_SHARED_MIB: usize = 8192;

/// Where a slice lies in this process's shared arena: the arena's file
/// descriptor number in this process (for a peer's `pidfd_getfd(2)`) and
/// the slice's offset in that file.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct SharedSpan {
    /// The arena's descriptor number in this process.
    pub fd: RawFd,
    /// The slice's first byte, as an offset in the arena's file.
    pub offset: u64,
}

/// Turns the shared arena on for this process: page-aligned buffers of
/// 256 KiB and more made from now on lie in it (see the module doc).
/// Returns whether it is on (false where the arena cannot be set up, with
/// `XDEV_HUGE_PAGES=0`, or in a child forked after it was set up).
pub fn share_with_peers() -> bool {
    if FORKED.load(Ordering::Relaxed) || !super::huge::enabled() || region().is_none() {
        return false;
    }
    ON.store(true, Ordering::Release);
    true
}

/// Where `data` lies in the shared arena, or `None` if it does not (or the
/// arena is off). Only compares addresses.
pub fn span_of(data: &[u8]) -> Option<SharedSpan> {
    if !ON.load(Ordering::Relaxed) || data.is_empty() {
        return None;
    }
    let r = REGION.get()?.as_ref()?;
    let offset = r.offset_of(data.as_ptr() as usize)?;
    (data.len() <= r.reserve - offset).then(|| SharedSpan {
        fd: r.fd.as_raw_fd(),
        offset: offset as u64,
    })
}

/// Whether `addr` lies in the shared arena's range.
pub(super) fn holds(addr: usize) -> bool {
    REGION
        .get()
        .and_then(Option::as_ref)
        .is_some_and(|r| r.offset_of(addr).is_some())
}

/// Whether the arena hands out memory now.
pub(super) fn on() -> bool {
    ON.load(Ordering::Relaxed) && !FORKED.load(Ordering::Relaxed)
}

static ON: AtomicBool = AtomicBool::new(false);
static FORKED: AtomicBool = AtomicBool::new(false);
static REGION: OnceLock<Option<Region>> = OnceLock::new();
static EXTENTS: Mutex<Extents> = Mutex::new(Extents {
    top: 0,
    free: BTreeMap::new(),
});

/// The file and the reserved range it is mapped into.
struct Region {
    fd: OwnedFd,
    base: usize,
    reserve: usize,
}

/// The file's extents: how far it has grown, and the free extents (their
/// pages released) by size.
struct Extents {
    top: usize,
    free: BTreeMap<usize, Vec<usize>>,
}

fn region() -> Option<&'static Region> {
    REGION.get_or_init(Region::create).as_ref()
}

extern "C" fn forked_child() {
    // Async-signal-safe: two atomic stores.
    FORKED.store(true, Ordering::Relaxed);
    ON.store(false, Ordering::Relaxed);
}

impl Region {
    /// `addr`'s offset in the file, if it lies in the reserved range.
    fn offset_of(&self, addr: usize) -> Option<usize> {
        addr.checked_sub(self.base).filter(|&o| o < self.reserve)
    }

    fn create() -> Option<Region> {
        let mib = std::env::var("XDEV_SHARED_ARENA_MIB")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(DEFAULT_SHARED_MIB);
        let reserve = mib.checked_mul(1 << 20)?.min(address_space_share()) / HUGE_PAGE * HUGE_PAGE;
        if reserve == 0 {
            return None;
        }
        // SAFETY: a NUL-terminated name and flags; returns a new descriptor.
        let raw = unsafe {
            libc::memfd_create(
                c"xdev-shared-buffers".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if raw < 0 {
            return None;
        }
        // SAFETY: `raw` is a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: adds a seal to our own memfd; no memory effects.
        if unsafe { libc::fcntl(raw, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) } != 0 {
            return None;
        }
        // An inaccessible reservation (no memory), never inherited by a
        // forked child.
        let base = super::huge::map_aligned(reserve, libc::PROT_NONE, libc::MAP_NORESERVE)?;
        // SAFETY: advice on the reservation just made.
        unsafe { libc::madvise(base as *mut libc::c_void, reserve, libc::MADV_DONTFORK) };
        // SAFETY: registers a handler that only stores to two atomics.
        unsafe { libc::pthread_atfork(None, None, Some(forked_child)) };
        Some(Region { fd, base, reserve })
    }
}

/// A quarter of the address space `RLIMIT_AS` allows (batch systems set
/// it), or no bound: the reservation must not starve the process's other
/// mappings.
fn address_space_share() -> usize {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into `lim`, which lives across the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut lim) } != 0
        || lim.rlim_cur == libc::RLIM_INFINITY
    {
        return usize::MAX;
    }
    usize::try_from(lim.rlim_cur / 4).unwrap_or(usize::MAX)
}

fn extents() -> std::sync::MutexGuard<'static, Extents> {
    EXTENTS.lock().unwrap_or_else(|e| e.into_inner())
}

/// `bytes` (a multiple of [`HUGE_PAGE`]) of zero-filled shared memory
/// aligned to [`HUGE_PAGE`], or `None` (arena off, range used up, or a
/// system call refused).
pub(super) fn take(bytes: usize) -> Option<NonNull<u8>> {
    if !on() || bytes == 0 || bytes % HUGE_PAGE != 0 {
        return None;
    }
    let r = region()?;
    let mut x = extents();
    if let Some(off) = x.free.get_mut(&bytes).and_then(Vec::pop) {
        return NonNull::new((r.base + off) as *mut u8);
    }
    let off = x.top;
    let end = off.checked_add(bytes).filter(|&e| e <= r.reserve)?;
    // SAFETY: grows our own memfd; no memory effects here.
    if unsafe { libc::ftruncate(r.fd.as_raw_fd(), end as libc::off_t) } != 0 {
        return None;
    }
    let at = r.base + off;
    // SAFETY: replaces part of our own reservation (`off..end` lies in it
    // and above every extent handed out so far) with the file's new
    // extent; no other mapping lives there.
    let p = unsafe {
        libc::mmap(
            at as *mut libc::c_void,
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_FIXED,
            r.fd.as_raw_fd(),
            off as libc::off_t,
        )
    };
    if p == libc::MAP_FAILED {
        return None;
    }
    // SAFETY: advice on the extent just mapped. Huge pages where the
    // system gives them to shared memory (`shmem_enabled`); not inherited
    // by a forked child (see the module doc).
    unsafe {
        libc::madvise(p, bytes, libc::MADV_HUGEPAGE);
        libc::madvise(p, bytes, libc::MADV_DONTFORK);
    }
    x.top = end;
    NonNull::new(at as *mut u8)
}

/// Gives back an extent [`take`] handed out: its pages are released (it
/// reads zeros when handed out again) and it goes on its size's free list.
///
/// # Safety
/// `p` and `bytes` came from one call of [`take`], and nothing uses the
/// memory any more.
pub(super) unsafe fn give_back(p: NonNull<u8>, bytes: usize) {
    let Some(r) = REGION.get().and_then(Option::as_ref) else {
        return;
    };
    let off = p.as_ptr() as usize - r.base;
    // SAFETY: releases the pages of an extent nobody uses (the caller's
    // contract); the file keeps its size, so the mapping stays valid.
    let punched = unsafe {
        libc::fallocate(
            r.fd.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            off as libc::off_t,
            bytes as libc::off_t,
        )
    } == 0;
    if !punched {
        // SAFETY: the extent is ours and unused (as above): zeroed so that
        // it is handed out zero-filled.
        unsafe { p.as_ptr().write_bytes(0, bytes) };
    }
    extents().free.entry(bytes).or_default().push(off);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_aligned_buffers_lie_in_a_sealed_file_peers_can_map() {
        assert!(share_with_peers(), "the shared arena could not be set up");
        let mut b = crate::Buffer::zeroed_page_aligned(6 << 20);
        for (i, x) in b.iter_mut().enumerate() {
            *x = (i % 251) as u8;
        }
        let span = span_of(&b).expect("a 6 MiB page-aligned buffer is shared");
        assert_eq!(span.offset % HUGE_PAGE as u64, 0);
        // SAFETY: F_GET_SEALS on a descriptor of this process.
        let seals = unsafe { libc::fcntl(span.fd, libc::F_GET_SEALS) };
        assert!(seals & libc::F_SEAL_SHRINK != 0, "seals {seals:#x}");
        // The file holds the buffer's bytes at its offset (read through the
        // descriptor, not the buffer's mapping).
        let mut got = vec![0u8; 8192];
        let at = span.offset as libc::off_t + 4096;
        // SAFETY: reads into a live vector of that length.
        let n = unsafe { libc::pread(span.fd, got.as_mut_ptr().cast(), got.len(), at) };
        assert_eq!(n, 8192);
        assert!(got[..] == b[4096..4096 + 8192]);
        // A 512 KiB buffer (a size class's block) is shared too; a heap
        // buffer is not.
        let small = crate::Buffer::zeroed_page_aligned(512 << 10);
        assert!(span_of(&small).is_some());
        assert!(span_of(&vec![0u8; 1 << 20]).is_none());
        // An extent given back and handed out again reads zeros (no other
        // test takes 6 MiB extents).
        drop(b);
        let again = crate::Buffer::zeroed_page_aligned(6 << 20);
        assert_eq!(span_of(&again).map(|s| s.offset), Some(span.offset));
        assert!(again.iter().all(|&x| x == 0), "a reused extent is zeroed");
    }
}
