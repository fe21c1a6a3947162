//! Memory regions: registered buffers, their keys and scatter/gather entries.

use std::alloc::{self, Layout};
use std::fmt;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::ops::BitOr;
use std::ptr::{self, NonNull};

use ibvx_sys as sys;

use super::error::{errno_error, Error, Result};
use super::pd::ProtectionDomain;

/// Access rights of a memory region (`ibv_access_flags`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Access(u32);

impl Access {
    /// Local read access only (no flag).
    pub const NONE: Access = Access(0);
    /// The device may write the region for local operations (receives).
    pub const LOCAL_WRITE: Access = Access(sys::IBV_ACCESS_LOCAL_WRITE);
    /// Peers may RDMA-write the region (implies `LOCAL_WRITE`).
    pub const REMOTE_WRITE: Access = Access(sys::IBV_ACCESS_REMOTE_WRITE);
    /// Peers may RDMA-read the region.
    pub const REMOTE_READ: Access = Access(sys::IBV_ACCESS_REMOTE_READ);
    /// Peers may perform atomics on the region (implies `LOCAL_WRITE`).
    pub const REMOTE_ATOMIC: Access = Access(sys::IBV_ACCESS_REMOTE_ATOMIC);

    /// The `ibv_access_flags` bits.
    pub fn bits(self) -> u32 {
        self.0
    }

    /// Whether every flag of `other` is set.
    pub fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }
}

impl BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

/// Where the bytes of a [`MemoryRegion`] live.
enum Storage {
    /// A zeroed, page-aligned allocation owned by the region.
    Owned(Layout),
    /// A caller's buffer, borrowed for the region's lifetime parameter.
    Borrowed,
}

/// A registered buffer (`ibv_mr`) and its bytes.
///
/// The region either owns its memory ([`MemoryRegion::alloc`], a zeroed
/// page-aligned allocation; `'buf` is `'static`) or mutably borrows the
/// caller's buffer for `'buf` ([`MemoryRegion::register`]). Dropping the
/// region deregisters it first (after which the device can no longer touch
/// the memory) and then frees or releases the buffer. It holds its
/// [`ProtectionDomain`], so the domain outlives it.
///
/// The device reads and writes the bytes behind the program's back (sends,
/// receives and, with [`Access::REMOTE_WRITE`], peers' RDMA writes at any
/// time), so the region hands out no long-lived references by default: the
/// accessors copy in and out through raw pointers ([`MemoryRegion::write`],
/// [`MemoryRegion::read`]) or use volatile accesses
/// ([`MemoryRegion::load_u8`], for polling a byte a peer writes).
/// [`MemoryRegion::as_slice`] and [`MemoryRegion::as_mut_slice`] exist for
/// zero-copy use, under the contract stated there.
pub struct MemoryRegion<'buf> {
    raw: NonNull<sys::ibv_mr>,
    ptr: NonNull<u8>,
    len: usize,
    access: Access,
    storage: Storage,
    pd: ProtectionDomain,
    _buf: PhantomData<&'buf mut [u8]>,
}

// SAFETY: the region's memory is only reached through the methods below
// (writes need `&mut self`), and ibv_mr may be used from any thread.
unsafe impl Send for MemoryRegion<'_> {}
// SAFETY: `&self` methods only read the memory (through raw pointers) or
// return keys/addresses; mutation needs `&mut self`.
unsafe impl Sync for MemoryRegion<'_> {}

/// Page size used to align owned regions.
const ALIGN: usize = 4096;

impl MemoryRegion<'static> {
    /// Allocates `len` zeroed bytes (page aligned, at least one byte) and
    /// registers them with `access` on `pd`.
    pub fn alloc(
        pd: &ProtectionDomain,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion<'static>> {
        let layout = Layout::from_size_align(len.max(1), ALIGN)
            .map_err(|_| Error::InvalidArgument(format!("region of {len} bytes is too large")))?;
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(p) else {
            return Err(Error::Registration {
                len,
                source: std::io::Error::from_raw_os_error(libc::ENOMEM),
                hint: " (out of memory)",
            });
        };
        // SAFETY: `ptr` is a fresh allocation of `layout.size()` bytes that
        // the region owns and frees only after deregistering.
        unsafe { Self::from_parts(pd, ptr, layout.size(), access, Storage::Owned(layout)) }
            .inspect_err(|_| {
                // SAFETY: allocated above with `layout`, not registered.
                unsafe { alloc::dealloc(ptr.as_ptr(), layout) };
            })
    }

    /// Registers `len` bytes at `ptr` that the caller manages itself (for
    /// memory that is not a Rust slice the region could borrow, such as a
    /// registration cache's own mappings). The region does not free the
    /// memory: dropping it (or [`MemoryRegion::deregister`]) only
    /// deregisters.
    ///
    /// # Safety
    /// `ptr .. ptr + len` must be mapped, and must stay mapped (neither
    /// unmapped nor freed) until the returned region has been deregistered.
    /// The region's accessors ([`MemoryRegion::write`] and friends) treat
    /// the memory as the region's own, so the caller must not use them
    /// while anything else holds references into the range.
    pub unsafe fn register_raw_parts(
        pd: &ProtectionDomain,
        ptr: NonNull<u8>,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion<'static>> {
        // SAFETY: the caller keeps the range mapped until deregistration.
        unsafe { Self::from_parts(pd, ptr, len, access, Storage::Borrowed) }
    }
}

impl<'buf> MemoryRegion<'buf> {
    /// Registers the caller's `buf` with `access` on `pd`. The buffer stays
    /// mutably borrowed until the region is dropped (deregistered).
    ///
    /// The borrow alone cannot keep the promise, because it ends when the
    /// region is leaked: after `mem::forget(region)` the pages would stay
    /// registered (with `REMOTE_WRITE`, writable by any peer holding the
    /// rkey) while the buffer is freed and reused. Hence `unsafe`; use
    /// [`MemoryRegion::alloc`] for memory the region owns.
    ///
    /// ```compile_fail,E0133
    /// # use ibvx::verbs::{Access, MemoryRegion, ProtectionDomain};
    /// # fn f(pd: &ProtectionDomain) {
    /// let mut buf = vec![0u8; 4096];
    /// let mr = MemoryRegion::register(pd, &mut buf, Access::LOCAL_WRITE); // needs `unsafe`
    /// std::mem::forget(mr);
    /// drop(buf); // freed while registered
    /// # }
    /// ```
    ///
    /// # Safety
    /// The region must be dropped or deregistered before `buf`'s memory is
    /// freed or reused: never leak it (`mem::forget`, a reference cycle).
    pub unsafe fn register(
        pd: &ProtectionDomain,
        buf: &'buf mut [u8],
        access: Access,
    ) -> Result<MemoryRegion<'buf>> {
        let len = buf.len();
        let ptr = NonNull::from(buf).cast::<u8>();
        // SAFETY: `buf` is borrowed exclusively for 'buf, and the caller
        // drops the region before the memory goes (this fn's contract), so
        // it stays mapped until deregistration.
        unsafe { Self::from_parts(pd, ptr, len, access, Storage::Borrowed) }
    }

    /// Registers `len` bytes at `ptr` with `access` on `pd`: the one
    /// constructor behind [`MemoryRegion::alloc`],
    /// [`MemoryRegion::register_raw_parts`] and [`MemoryRegion::register`].
    /// Refuses an empty range, and one that is not a valid Rust allocation's
    /// extent (longer than `isize::MAX` bytes, or past the end of the
    /// address space): every offset the accessors and [`MemoryRegion::sge`]
    /// compute from `ptr` and `len` then stays in range.
    ///
    /// # Safety
    /// `ptr .. ptr + len` must stay mapped until the returned region is
    /// deregistered, and be the memory `storage` describes.
    unsafe fn from_parts(
        pd: &ProtectionDomain,
        ptr: NonNull<u8>,
        len: usize,
        access: Access,
        storage: Storage,
    ) -> Result<MemoryRegion<'buf>> {
        if len == 0 {
            return Err(Error::InvalidArgument(
                "cannot register an empty buffer".into(),
            ));
        }
        if isize::try_from(len).is_err() || (ptr.as_ptr() as usize).checked_add(len).is_none() {
            return Err(Error::InvalidArgument(format!(
                "range of {len} bytes at {ptr:p} is not a valid allocation"
            )));
        }
        let verbs = pd.context().verbs();
        // SAFETY: live PD; the memory stays mapped per this function's contract.
        let raw = unsafe { verbs.reg_mr(pd.as_raw(), ptr.as_ptr().cast(), len, access.bits()) };
        let raw = NonNull::new(raw).ok_or_else(|| {
            let source = std::io::Error::last_os_error();
            let hint = match source.raw_os_error() {
                Some(libc::ENOMEM) | Some(libc::EPERM) | Some(libc::EAGAIN) => {
                    " (check the locked-memory limit: ulimit -l)"
                }
                _ => "",
            };
            Error::Registration { len, source, hint }
        })?;
        Ok(MemoryRegion {
            raw,
            ptr,
            len,
            access,
            storage,
            pd: pd.clone(),
            _buf: PhantomData,
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Start of the registered bytes, for copying in and out under the
    /// contract of [`MemoryRegion::as_slice`] (no work request or peer may
    /// be accessing the range at the same time).
    #[inline]
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Whether the region is empty (never: regions have at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Start address, as work requests and peers name it.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Local key, for scatter/gather entries.
    pub fn lkey(&self) -> u32 {
        // SAFETY: live MR; plain field read.
        unsafe { (*self.raw.as_ptr()).lkey }
    }

    /// Remote key, for peers' RDMA operations.
    pub fn rkey(&self) -> u32 {
        // SAFETY: live MR; plain field read.
        unsafe { (*self.raw.as_ptr()).rkey }
    }

    /// The access rights the region was registered with.
    pub fn access(&self) -> Access {
        self.access
    }

    /// The protection domain.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    /// The raw `ibv_mr`, valid while the region lives.
    pub fn as_raw(&self) -> *mut sys::ibv_mr {
        self.raw.as_ptr()
    }

    fn check_range(&self, offset: usize, len: usize) {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len),
            "range {offset}+{len} outside the {}-byte memory region",
            self.len
        );
    }

    /// A scatter/gather entry for `len` bytes at `offset`, for work requests.
    ///
    /// # Panics
    /// If the range is not inside the region.
    #[inline]
    pub fn sge(&self, offset: usize, len: usize) -> Sge<'_> {
        self.check_range(offset, len);
        Sge {
            raw: sys::ibv_sge {
                addr: self.addr() + offset as u64,
                length: u32::try_from(len).expect("a scatter/gather entry is at most 4 GiB"),
                lkey: self.lkey(),
            },
            _mr: PhantomData,
        }
    }

    /// The remote address of `offset`, for a peer's RDMA operations (send it
    /// with the region's length so the peer can stay inside it).
    ///
    /// # Panics
    /// If `offset` is past the end of the region.
    pub fn remote(&self, offset: usize) -> RemoteAddr {
        self.check_range(offset, 0);
        RemoteAddr {
            addr: self.addr() + offset as u64,
            rkey: self.rkey(),
        }
    }

    /// Copies `data` into the region at `offset`.
    ///
    /// # Panics
    /// If the range is not inside the region.
    #[inline]
    pub fn write(&mut self, offset: usize, data: &[u8]) {
        self.check_range(offset, data.len());
        // SAFETY: in bounds (checked); `data` cannot overlap the region
        // (the region is borrowed mutably or owned).
        unsafe {
            ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(offset), data.len())
        };
    }

    /// Fills `len` bytes at `offset` with `f(i)` for `i` in `0..len`.
    ///
    /// # Panics
    /// If the range is not inside the region.
    pub fn fill(&mut self, offset: usize, len: usize, mut f: impl FnMut(usize) -> u8) {
        self.check_range(offset, len);
        let base = self.ptr.as_ptr();
        for i in 0..len {
            // SAFETY: in bounds (checked); raw write, no reference created.
            unsafe { base.add(offset + i).write(f(i)) };
        }
    }

    /// Copies `out.len()` bytes at `offset` into `out`.
    ///
    /// # Panics
    /// If the range is not inside the region.
    pub fn read(&self, offset: usize, out: &mut [u8]) {
        self.check_range(offset, out.len());
        // SAFETY: in bounds (checked); `out` is a distinct buffer.
        unsafe {
            ptr::copy_nonoverlapping(self.ptr.as_ptr().add(offset), out.as_mut_ptr(), out.len())
        };
    }

    /// Volatile read of the byte at `offset`: sees a peer's RDMA write as
    /// soon as it lands (for polling, as perftest's write latency test does).
    ///
    /// # Panics
    /// If `offset` is outside the region.
    #[inline]
    pub fn load_u8(&self, offset: usize) -> u8 {
        assert!(
            offset < self.len,
            "offset {offset} outside the {}-byte region",
            self.len
        );
        // SAFETY: in bounds; a volatile read of initialized memory.
        unsafe { ptr::read_volatile(self.ptr.as_ptr().add(offset)) }
    }

    /// Volatile write of the byte at `offset`.
    ///
    /// # Panics
    /// If `offset` is outside the region.
    #[inline]
    pub fn store_u8(&mut self, offset: usize, value: u8) {
        assert!(
            offset < self.len,
            "offset {offset} outside the {}-byte region",
            self.len
        );
        // SAFETY: in bounds; a volatile write.
        unsafe { ptr::write_volatile(self.ptr.as_ptr().add(offset), value) };
    }

    /// The bytes as a slice.
    ///
    /// # Safety
    /// While the slice lives, no outstanding work request and no peer may
    /// write the region (receives, RDMA writes from peers, atomics):
    /// memory behind a shared reference must not change.
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: in bounds and initialized; immutability is the caller's promise.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes as a mutable slice.
    ///
    /// # Safety
    /// While the slice lives, no outstanding work request may read or write
    /// the region and no peer may access it remotely.
    pub unsafe fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: in bounds and initialized; exclusivity is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl MemoryRegion<'_> {
    /// Deregisters the region now and reports whether `ibv_dereg_mr`
    /// succeeded (dropping the region does the same but can only print a
    /// failure). On failure the device may still reach the memory, so owned
    /// memory is leaked rather than freed, and the caller must not free or
    /// reuse borrowed memory either.
    pub fn deregister(self) -> Result<()> {
        let mut this = ManuallyDrop::new(self);
        let rc = this.dereg_and_release();
        // SAFETY: `this` is never used or dropped again, so moving the PD
        // handle out drops it exactly once.
        drop(unsafe { ptr::read(&this.pd) });
        if rc == 0 {
            Ok(())
        } else {
            Err(Error::from_rc("ibv_dereg_mr", rc))
        }
    }

    /// Deregisters, then frees owned memory if that succeeded (else leaks
    /// it). Returns `ibv_dereg_mr`'s return code. Called exactly once.
    fn dereg_and_release(&mut self) -> i32 {
        let verbs = self.pd.context().verbs();
        // SAFETY: registered by reg_mr; both callers (drop, deregister) run
        // at most once per region.
        let rc = unsafe { (verbs.ibv_dereg_mr)(self.raw.as_ptr()) };
        if rc != 0 {
            // The device may still reach the memory: leaking it is the only
            // safe choice.
            tracing::error!(
                error = %errno_error(rc),
                bytes = self.len,
                "ibv_dereg_mr failed; leaking the region"
            );
            return rc;
        }
        if let Storage::Owned(layout) = self.storage {
            // SAFETY: allocated in `alloc` with this layout; deregistered above.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
        0
    }
}

impl Drop for MemoryRegion<'_> {
    fn drop(&mut self) {
        self.dereg_and_release();
    }
}

impl fmt::Debug for MemoryRegion<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len)
            .field("lkey", &format_args!("{:#x}", self.lkey()))
            .field("rkey", &format_args!("{:#x}", self.rkey()))
            .finish()
    }
}

/// A scatter/gather entry (`ibv_sge`) inside a live [`MemoryRegion`]; the
/// borrow keeps the region registered while the entry is in use. Layout
/// compatible with `ibv_sge`, so a slice of entries is passed to the
/// provider as is.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct Sge<'mr> {
    raw: sys::ibv_sge,
    _mr: PhantomData<&'mr ()>,
}

impl<'mr> Sge<'mr> {
    /// An entry from its parts, for registrations that are not a
    /// [`MemoryRegion`] borrow (the registration cache); the caller ties
    /// `'mr` to whatever keeps `lkey` registered, and checks that the range
    /// lies inside that registration.
    ///
    /// # Panics
    /// If the range wraps around the end of the address space.
    pub(crate) fn from_parts(addr: u64, length: u32, lkey: u32) -> Sge<'mr> {
        assert!(
            addr.checked_add(u64::from(length)).is_some(),
            "scatter/gather entry of {length} bytes at {addr:#x} wraps"
        );
        Sge {
            raw: sys::ibv_sge { addr, length, lkey },
            _mr: PhantomData,
        }
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.raw.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> u32 {
        self.raw.length
    }

    /// Whether the entry covers no byte.
    pub fn is_empty(&self) -> bool {
        self.raw.length == 0
    }

    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.raw.lkey
    }
}

impl fmt::Debug for Sge<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Sge {{ addr: {:#x}, len: {}, lkey: {:#x} }}",
            self.raw.addr, self.raw.length, self.raw.lkey
        )
    }
}

/// A peer's memory for RDMA operations: an address in one of its regions
/// and the region's remote key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RemoteAddr {
    /// Remote virtual address.
    pub addr: u64,
    /// Remote key of the region.
    pub rkey: u32,
}

impl RemoteAddr {
    /// The address `offset` bytes further.
    ///
    /// # Panics
    /// If that is past the end of the 64-bit address space (it would wrap
    /// to the start of the peer's address space otherwise).
    pub fn offset(self, offset: u64) -> RemoteAddr {
        RemoteAddr {
            addr: self
                .addr
                .checked_add(offset)
                .expect("a remote address past the end of the address space"),
            rkey: self.rkey,
        }
    }
}
