//! [`PageAligned`]: zero-filled memory that starts on a page boundary, the
//! storage of [`Buffer::zeroed_page_aligned`](super::Buffer::zeroed_page_aligned);
//! from 256 KiB up backed by huge pages where the system gives them
//! (`super::huge`).
//!
//! Why: a copy between two processes (CMA) or by a NIC runs page by page,
//! and two buffers that sit at different offsets into their pages split
//! every page's copy in two. `malloc` puts large blocks 16 bytes into a
//! page; benchmarks such as OSU's align their buffers to a page
//! (`posix_memalign`), and so can a runtime's own large buffers.

use std::alloc::{alloc_zeroed, dealloc, handle_alloc_error, Layout};
use std::any::Any;
use std::ptr::NonNull;

use super::huge::{self, Backing};
use super::BufferStorage;

/// `len` zero-filled bytes starting on a [`PAGE`](Self::PAGE) boundary, freed when
/// dropped.
///
/// From [`HUGE_MIN_BYTES`](Self::HUGE_MIN_BYTES) up the block is backed by
/// 2 MiB transparent huge pages where the system gives them: a copy
/// between processes (which pins the pages first) or a NIC's registration
/// then handles one page per 2 MiB. `XDEV_HUGE_PAGES=0` turns this off;
/// blocks below 2 MiB come from a bounded arena of 2 MiB chunks
/// (`XDEV_HUGE_ARENA_MIB`, default 512), and from the heap beyond it.
pub struct PageAligned {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
}

// SAFETY: `PageAligned` owns its block exclusively (like a `Box<[u8]>`);
// the pointer is only its address.
unsafe impl Send for PageAligned {}
// SAFETY: as above: shared access gives nothing but the address.
unsafe impl Sync for PageAligned {}

impl PageAligned {
    /// The alignment of a block: the base page of the platforms the crate
    /// builds for (4 KiB on x86-64 and most aarch64 kernels; with a larger
    /// page the block starts on a 4 KiB boundary within it).
    pub const PAGE: usize = 4096;

    /// The smallest block backed by huge pages (256 KiB).
    pub const HUGE_MIN_BYTES: usize = huge::MIN_BYTES;

    /// A zero-filled block of `len` bytes (an empty one allocates nothing).
    /// Aborts like `Vec` if the allocator fails, and panics if `len` is
    /// beyond what a layout can describe.
    pub fn zeroed(len: usize) -> Self {
        if len == 0 {
            return PageAligned {
                ptr: NonNull::dangling(),
                len,
                backing: Backing::Heap,
            };
        }
        if let Some((ptr, backing)) = huge::alloc(len) {
            return PageAligned { ptr, len, backing };
        }
        let layout = Self::layout(len);
        // SAFETY: `layout` has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| handle_alloc_error(layout));
        PageAligned {
            ptr,
            len,
            backing: Backing::Heap,
        }
    }

    /// Whether the block is backed by huge-page memory (its own mapping or
    /// the arena's): advised `MADV_HUGEPAGE`, though the kernel may still
    /// have given it ordinary pages.
    pub fn huge_backed(&self) -> bool {
        self.backing != Backing::Heap
    }

    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len, Self::PAGE).expect("a page-aligned block of this length")
    }
}

impl Drop for PageAligned {
    fn drop(&mut self) {
        if self.backing != Backing::Heap {
            // SAFETY: `ptr` and `backing` came from `huge::alloc` in
            // `zeroed`, and this drop is the block's last use.
            unsafe { huge::free(self.ptr, self.backing) };
        } else if self.len != 0 {
            // SAFETY: allocated in `zeroed` with this layout, freed once.
            unsafe { dealloc(self.ptr.as_ptr(), Self::layout(self.len)) };
        }
    }
}

// SAFETY: the pointer is fixed for the object's life, valid for `len`
// bytes (none when empty), owned by it alone, and freed only in its drop.
unsafe impl BufferStorage for PageAligned {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    fn capacity(&self) -> usize {
        self.len
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
