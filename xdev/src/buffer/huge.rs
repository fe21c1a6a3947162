//! Huge-page backing for large [`PageAligned`](super::aligned::PageAligned)
//! buffers.
//!
//! Why: a large message between processes on one host is copied by the
//! kernel (CMA, `process_vm_readv`), which first looks up and pins the
//! sender's pages one by one. A profile of shm osu_bibw at 1 MiB (both
//! ranks copying) had a quarter of all samples there (`follow_page_pte`
//! 13%, `__get_user_pages`, `try_grab_folio`, `unpin_user_pages`, the page
//! table walks) against 58% in the copy itself. Backed by 2 MiB transparent
//! huge pages, a buffer is looked up once per 2 MiB, and its copy misses
//! the TLB 512 times less. UCX allocates the memory of its memory domains
//! with transparent huge pages for the same reason.
//!
//! How (from [`MIN_BYTES`] up; smaller buffers stay on the heap):
//! - from 2 MiB: a mapping of its own, aligned to 2 MiB and rounded up to
//!   a multiple of it, advised `MADV_HUGEPAGE`; unmapped on drop;
//! - from 256 KiB to 2 MiB: a block of 256 KiB, 512 KiB or 1 MiB (the
//!   smallest that holds it), carved from 2 MiB chunks that the arena maps
//!   the same way and keeps. A freed block goes back to its size's free
//!   list and is zeroed when it is handed out again. The arena keeps at
//!   most [`DEFAULT_ARENA_MIB`] MiB of chunks (`XDEV_HUGE_ARENA_MIB`);
//!   beyond that, such buffers come from the heap.
//!
//! `XDEV_HUGE_PAGES=0` turns all of this off, and a failed `mmap` falls
//! back to the heap. Where the kernel hands out no huge pages (THP set to
//! `never`, or no free 2 MiB page to be found), the mappings are of
//! ordinary pages: correct, and as fast as the heap.

use std::ptr::NonNull;
use std::sync::{Mutex, OnceLock};

/// The huge page size this backs buffers with (x86-64's and most aarch64
/// kernels' transparent huge page).
pub const HUGE_PAGE: usize = 2 << 20;

/// The smallest buffer given huge-page backing.
pub const MIN_BYTES: usize = 256 << 10;

/// Default bound, in MiB, on the arena's chunks (`XDEV_HUGE_ARENA_MIB`).
pub const DEFAULT_ARENA_MIB: usize = 512;

/// The block sizes the arena hands out, smallest first.
const CLASSES: [usize; 3] = [256 << 10, 512 << 10, 1 << 20];

/// How a [`PageAligned`](super::aligned::PageAligned) block is backed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Backing {
    /// The global allocator (or nothing, for an empty block).
    Heap,
    /// A mapping of its own of `bytes` bytes (a multiple of
    /// [`HUGE_PAGE`]).
    Mapping { bytes: usize },
    /// A block of the arena's size class `class`.
    Block { class: usize },
    /// An extent of `bytes` bytes (a multiple of [`HUGE_PAGE`]) of the
    /// shared arena ([`super::shared`]).
    Shared { bytes: usize },
}

/// Memory for `len` zero-filled bytes with huge-page backing, or `None`
/// where the heap should be used (too small, turned off, refused).
pub(super) fn alloc(len: usize) -> Option<(NonNull<u8>, Backing)> {
    if len < MIN_BYTES || !enabled() {
        return None;
    }
    if len >= HUGE_PAGE {
        let bytes = len.checked_next_multiple_of(HUGE_PAGE)?;
        // A shared extent is handed out zero-filled.
        if let Some(p) = super::shared::take(bytes) {
            return Some((p, Backing::Shared { bytes }));
        }
        // A fresh anonymous mapping reads as zeros.
        return map_huge(bytes).map(|p| (p, Backing::Mapping { bytes }));
    }
    let class = CLASSES.iter().position(|&c| c >= len)?;
    let (addr, dirty) = arena().take(class, arena_limit())?;
    let p = NonNull::new(addr as *mut u8)?;
    if dirty {
        // SAFETY: the block is `CLASSES[class] >= len` bytes of a live
        // chunk, handed out to no one else (just taken off its free list).
        unsafe { p.as_ptr().write_bytes(0, len) };
    }
    Some((p, Backing::Block { class }))
}

/// Gives back memory [`alloc`] handed out.
///
/// # Safety
/// `p` and `backing` came from one call of [`alloc`], and nothing uses the
/// memory any more.
pub(super) unsafe fn free(p: NonNull<u8>, backing: Backing) {
    match backing {
        Backing::Heap => {}
        Backing::Mapping { bytes } => {
            // SAFETY: `p` is the start of a mapping of `bytes` bytes that
            // `map_huge` made and nothing else refers to (the caller's
            // contract).
            unsafe { libc::munmap(p.as_ptr().cast(), bytes) };
        }
        Backing::Block { class } => arena().give_back(class, p.as_ptr() as usize),
        // SAFETY: `p` is an extent of `bytes` bytes that `shared::take`
        // handed out and nothing uses any more (the caller's contract).
        Backing::Shared { bytes } => unsafe { super::shared::give_back(p, bytes) },
    }
}

/// Whether huge-page backing is on (`XDEV_HUGE_PAGES` is not `0`).
pub(super) fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("XDEV_HUGE_PAGES").map_or(true, |v| v.trim() != "0"))
}

/// The arena's bound in bytes (`XDEV_HUGE_ARENA_MIB`, default
/// [`DEFAULT_ARENA_MIB`]).
fn arena_limit() -> usize {
    static LIMIT: OnceLock<usize> = OnceLock::new();
    *LIMIT.get_or_init(|| {
        let mib = std::env::var("XDEV_HUGE_ARENA_MIB")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(DEFAULT_ARENA_MIB);
        mib.saturating_mul(1 << 20)
    })
}

/// The process's arena (a poisoned lock is still usable: its state is
/// updated in single steps that leave it consistent).
fn arena() -> std::sync::MutexGuard<'static, Arena> {
    static ARENA: Mutex<Arena> = Mutex::new(Arena::new());
    ARENA.lock().unwrap_or_else(|e| e.into_inner())
}

/// `bytes` (a multiple of [`HUGE_PAGE`]) of fresh memory aligned to
/// [`HUGE_PAGE`] and advised `MADV_HUGEPAGE`, or `None` if `mmap` fails.
fn map_huge(bytes: usize) -> Option<NonNull<u8>> {
    let start = map_aligned(bytes, libc::PROT_READ | libc::PROT_WRITE, 0)?;
    // SAFETY: advice on the mapping just made. Advice only: where the
    // kernel refuses it, the pages are ordinary.
    unsafe { libc::madvise(start as *mut libc::c_void, bytes, libc::MADV_HUGEPAGE) };
    NonNull::new(start as *mut u8)
}

/// A fresh private anonymous mapping of `bytes` bytes with `prot`,
/// aligned to [`HUGE_PAGE`]: its address, or `None` if `mmap` fails.
/// `extra` adds flags that change how it is backed (`MAP_NORESERVE`), never
/// where it lies: the mapping is always private, anonymous and placed by
/// the kernel.
pub(super) fn map_aligned(bytes: usize, prot: libc::c_int, extra: libc::c_int) -> Option<usize> {
    let placement = libc::MAP_FIXED | libc::MAP_SHARED;
    debug_assert_eq!(extra & placement, 0, "map_aligned's extra flags");
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | (extra & !placement);
    let span = bytes.checked_add(HUGE_PAGE)?;
    // SAFETY: a private anonymous mapping at an address of the kernel's
    // choosing (MAP_FIXED and MAP_SHARED masked out above) touches no
    // existing memory.
    let base = unsafe { libc::mmap(std::ptr::null_mut(), span, prot, flags, -1, 0) };
    if base == libc::MAP_FAILED {
        return None;
    }
    let base = base as usize;
    let start = base.next_multiple_of(HUGE_PAGE);
    let (head, tail) = (start - base, span - (start - base) - bytes);
    // SAFETY: the head and the tail are the parts of the mapping just made
    // outside `start..start + bytes`, which nothing refers to.
    unsafe {
        if head > 0 {
            libc::munmap(base as *mut libc::c_void, head);
        }
        if tail > 0 {
            libc::munmap((start + bytes) as *mut libc::c_void, tail);
        }
    }
    Some(start)
}

/// Blocks of 256 KiB to 1 MiB carved from kept 2 MiB huge-page chunks.
#[derive(Debug)]
pub(super) struct Arena {
    /// Per kind of chunk (private, then shared: see [`super::shared`]) and
    /// size class, the addresses of its free blocks, with the low bit set on
    /// a block that was used (and must be zeroed before reuse). While the
    /// shared arena is on, blocks come from shared chunks, so that a peer
    /// can map every one handed out.
    free: [[Vec<usize>; CLASSES.len()]; 2],
    /// Bytes of chunks mapped so far.
    mapped: usize,
}

/// The low bit of a free-list entry: the block was used.
const DIRTY: usize = 1;

impl Arena {
    /// An arena with no chunks.
    pub(super) const fn new() -> Self {
        Arena {
            free: [
                [Vec::new(), Vec::new(), Vec::new()],
                [Vec::new(), Vec::new(), Vec::new()],
            ],
            mapped: 0,
        }
    }

    /// A free block of size class `class` and whether it was used before,
    /// mapping a new chunk if its free list is empty and `limit` bytes of
    /// chunks allow; `None` past the limit or if `mmap` fails.
    pub(super) fn take(&mut self, class: usize, limit: usize) -> Option<(usize, bool)> {
        if super::shared::on() {
            if let Some(b) = self.take_of(1, class, limit) {
                return Some(b);
            }
        }
        self.take_of(0, class, limit)
    }

    /// [`take`](Self::take) from the private (`kind` 0) or shared (1)
    /// chunks.
    fn take_of(&mut self, kind: usize, class: usize, limit: usize) -> Option<(usize, bool)> {
        if let Some(e) = self.free[kind][class].pop() {
            return Some((e & !DIRTY, e & DIRTY != 0));
        }
        if self.mapped + HUGE_PAGE > limit {
            return None;
        }
        let chunk = match kind {
            0 => map_huge(HUGE_PAGE),
            _ => super::shared::take(HUGE_PAGE),
        }?
        .as_ptr() as usize;
        self.mapped += HUGE_PAGE;
        let size = CLASSES[class];
        // The chunk's later blocks, in reverse so the next `take`s hand
        // them out in address order.
        self.free[kind][class].extend((1..HUGE_PAGE / size).rev().map(|i| chunk + i * size));
        Some((chunk, false))
    }

    /// Puts used block `addr` of size class `class` back on its free list.
    pub(super) fn give_back(&mut self, class: usize, addr: usize) {
        let kind = usize::from(super::shared::holds(addr));
        self.free[kind][class].push(addr | DIRTY);
    }

    /// Bytes of chunks mapped so far.
    #[cfg(test)]
    pub(super) fn mapped(&self) -> usize {
        self.mapped
    }
}

#[cfg(test)]
mod tests;
