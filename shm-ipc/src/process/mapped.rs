//! The mapped copy: a rendezvous whose send buffer lies in the sender's
//! shared arena ([`xdev::devkit::shared_arena`]) is copied by the receiver
//! from the sender's pages mapped read-only into its own address space,
//! with non-temporal stores, instead of by the kernel (CMA).
//!
//! The sender's `RNDV` says where (`FLAG_MAPPED`: its arena's descriptor
//! number and the buffer's offset). The receiver takes the descriptor once
//! per peer with `pidfd_getfd(2)` on the peer's pidfd (the ptrace
//! permission CMA needs, so only where CMA is allowed), and maps the file.
//! A peer names the file, so nothing about it is trusted: it must be a
//! `memfd` on shmem (`fstatfs`: not hugetlbfs, whose faults can fail) that
//! is sealed against shrinking (so a mapping of it cannot fault past its
//! end), and a span must lie inside its current size. Anything else is an
//! error that sends this rendezvous, and this peer's later ones, back to
//! CMA.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};

/// A peer's shared arena mapped read-only here.
pub(super) struct PeerArena {
    /// The descriptor number in the peer that it was taken from.
    pub(super) peer_fd: i32,
    file: OwnedFd,
    base: *const u8,
    len: usize,
}

// SAFETY: the mapping is read-only and private to this value; it is only
// used under the rank lock that owns the `ProcessState` holding it.
unsafe impl Send for PeerArena {}
// SAFETY: as above.
unsafe impl Sync for PeerArena {}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

impl PeerArena {
    /// Takes descriptor `peer_fd` of the process behind `pidfd`, checks it
    /// (see the module doc) and maps it.
    pub(super) fn open(pidfd: BorrowedFd<'_>, peer_fd: i32) -> io::Result<PeerArena> {
        use rustix::process::{pidfd_getfd, PidfdGetfdFlags};
        let file = pidfd_getfd(pidfd, peer_fd, PidfdGetfdFlags::empty())?;
        let raw = file.as_raw_fd();
        // SAFETY: a zeroed statfs is a valid out-parameter for fstatfs.
        let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: fstatfs writes into `fs`, which lives across the call.
        if unsafe { libc::fstatfs(raw, &mut fs) } != 0 {
            return Err(io::Error::last_os_error());
        }
        if fs.f_type != libc::TMPFS_MAGIC {
            return Err(invalid("the peer's arena is not a shmem file"));
        }
        // SAFETY: F_GET_SEALS reads the file's seals; no memory effects.
        let seals = unsafe { libc::fcntl(raw, libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(invalid("the peer's arena is not sealed against shrinking"));
        }
        let mut a = PeerArena {
            peer_fd,
            file,
            base: std::ptr::null(),
            len: 0,
        };
        a.remap()?;
        Ok(a)
    }

    /// Maps the file at its current size (it only grows), in place of the
    /// previous mapping.
    fn remap(&mut self) -> io::Result<()> {
        // SAFETY: a zeroed stat is a valid out-parameter for fstat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstat writes into `st`, which lives across the call.
        if unsafe { libc::fstat(self.file.as_raw_fd(), &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let size = usize::try_from(st.st_size).map_err(|_| invalid("negative size"))?;
        if size <= self.len {
            return Ok(());
        }
        // SAFETY: a new read-only shared mapping of the file at an address
        // of the kernel's choosing touches no existing memory.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ,
                libc::MAP_SHARED,
                self.file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        self.unmap();
        self.base = p as *const u8;
        self.len = size;
        Ok(())
    }

    fn unmap(&mut self) {
        if self.len > 0 {
            // SAFETY: `base..base + len` is our mapping, and no copy from it
            // is under way (copies run under `&mut self`).
            unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
            self.len = 0;
        }
    }

    /// Copies `dst.len()` bytes from `offset` of the peer's arena into
    /// `dst` ([`stream_copy`]). An error (the span lies past the file's
    /// end) copies nothing.
    pub(super) fn copy(&mut self, offset: u64, dst: &mut [u8]) -> io::Result<()> {
        let end = usize::try_from(offset)
            .ok()
            .and_then(|o| o.checked_add(dst.len()))
            .ok_or_else(|| invalid("span out of range"))?;
        if end > self.len {
            self.remap()?;
            if end > self.len {
                return Err(invalid("span past the end of the peer's arena"));
            }
        }
        // SAFETY: `offset..end` lies inside our mapping of the file, which
        // cannot shrink under it (sealed), so every byte is readable; the
        // peer may write them meanwhile, which yields other bytes, never a
        // fault. `dst` is ours.
        unsafe { stream_copy(dst, self.base.add(end - dst.len())) };
        Ok(())
    }
}

impl Drop for PeerArena {
    fn drop(&mut self) {
        self.unmap();
    }
}

/// Copies `dst.len()` bytes from `src` into `dst` with non-temporal
/// stores (x86-64; elsewhere a plain copy), then a store fence, so the
/// bytes are visible before whatever this thread publishes next. The
/// stores skip reading `dst`'s lines before writing them: measured with
/// both cores copying, 1.5-1.9x `memcpy` at 512 KiB-1 MiB.
///
/// # Safety
/// `src` is valid for reads of `dst.len()` bytes and does not overlap
/// `dst`.
pub(super) unsafe fn stream_copy(dst: &mut [u8], src: *const u8) {
    let n = dst.len();
    let d = dst.as_mut_ptr();
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        // Up to 16-byte alignment of the destination by a plain copy.
        let head = ((d as usize).wrapping_neg() & 15).min(n);
        // SAFETY: both ranges are valid for `head <= n` bytes (the caller's
        // contract) and do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src, d, head) };
        let mut i = head;
        while i + 64 <= n {
            // SAFETY: `i + 64 <= n`: the four 16-byte loads and stores stay
            // inside both ranges; `d + i` is 16-byte aligned (after `head`),
            // as `_mm_stream_si128` needs. SSE2 is part of x86-64.
            unsafe {
                let s = src.add(i) as *const __m128i;
                let t = d.add(i) as *mut __m128i;
                let (a, b) = (_mm_loadu_si128(s), _mm_loadu_si128(s.add(1)));
                let (c, e) = (_mm_loadu_si128(s.add(2)), _mm_loadu_si128(s.add(3)));
                _mm_stream_si128(t, a);
                _mm_stream_si128(t.add(1), b);
                _mm_stream_si128(t.add(2), c);
                _mm_stream_si128(t.add(3), e);
            }
            i += 64;
        }
        // SAFETY: the tail `i..n` of both ranges; then the fence that
        // orders the non-temporal stores before later ones.
        unsafe {
            std::ptr::copy_nonoverlapping(src.add(i), d.add(i), n - i);
            _mm_sfence();
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: both ranges are valid for `n` bytes and do not overlap.
    unsafe {
        std::ptr::copy_nonoverlapping(src, d, n)
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_streaming_copy_copies_every_byte_at_any_alignment() {
        let src: Vec<u8> = (0..70_000u32).map(|i| (i * 7 % 253) as u8).collect();
        for (from, to, len) in [(0, 0, 70_000 - 64), (3, 5, 4099), (1, 0, 63), (17, 9, 1000)] {
            let mut dst = vec![0xeeu8; len + 64];
            // SAFETY: `src[from..]` holds at least `len` bytes.
            unsafe { stream_copy(&mut dst[to..to + len], src[from..].as_ptr()) };
            assert!(
                dst[to..to + len] == src[from..from + len],
                "{from} {to} {len}"
            );
            assert!(dst[..to].iter().all(|&b| b == 0xee));
            assert!(dst[to + len..].iter().all(|&b| b == 0xee));
        }
    }
}
