//! The mapped copy: a rendezvous whose send buffer lies in the sender's
//! shared arena ([`xdev::devkit::shared_arena`]) is copied by the receiver
//! from the sender's pages mapped into its own address space, with
//! non-temporal stores, instead of by the kernel (CMA); and the tail of a
//! split copy is written by the sender into the receiver's buffer mapped
//! the same way, where that lies in the receiver's arena.
//!
//! The sender's `RNDV` says where (`FLAG_MAPPED`: its arena's descriptor
//! number and the buffer's offset); so does the receiver's `WRITE` for its
//! buffer (`FLAG_MAPPED`: the descriptor in `tag`, the offset in `aux`).
//! A rank takes a peer's descriptor once with `pidfd_getfd(2)` on the
//! peer's pidfd (the ptrace permission CMA needs, so only where CMA is
//! allowed), and maps the file. A peer names the file, so nothing about it
//! is trusted: it must be a `memfd` on shmem (`fstatfs`: not hugetlbfs,
//! whose faults can fail) that is sealed against shrinking (so a mapping
//! of it cannot fault past its end), and a span must lie inside its current
//! size. Anything else is an error that sends this copy, and this peer's
//! later ones, back to CMA. What a peer can do with our mapping of its
//! arena, or with its mapping of ours, it can do by CMA already: read and
//! write the other's memory, which the same permission grants.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};

use xdev::devkit::shared_arena;
use xdev::Rank;

use super::medium::{Eng, Loc, ProcessMedium};
use crate::ring::Header;
use crate::wire::FLAG_MAPPED;

/// A peer's shared arena mapped here.
pub(super) struct PeerArena {
    /// The descriptor number in the peer that it was taken from.
    pub(super) peer_fd: i32,
    file: OwnedFd,
    base: *mut u8,
    len: usize,
}

// SAFETY: the mapping is private to this value and moves with it; it is
// only used through `&mut self`, under the rank lock that owns the
// `ProcessState` holding it. (Not `Sync`: nothing shares it.)
unsafe impl Send for PeerArena {}

/// Bytes of transfers under way above which a mapped copy streams (see
/// `ProcessMedium::streams`): an eighth of this machine's 32 MiB
/// last-level cache. Streaming skips reading the destination's lines
/// before writing them, but sends every byte to memory. Measured on the
/// 2-core test machine (`xdev-bench --device shm`, 256 KiB-4 MiB): osu_bibw
/// (64 receives posted) 21-25 GB/s streamed, 14-22 through the cache; a
/// pingpong of 4 MiB (one buffer each way, in the cache) 47 us through the
/// cache, 165 streamed.
pub(super) const STREAM_ABOVE_BYTES: usize = 4 << 20;

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

impl PeerArena {
    /// Takes descriptor `peer_fd` of the process behind `pidfd`, checks it
    /// (see the module doc) and maps it.
    pub(super) fn open(pidfd: BorrowedFd<'_>, peer_fd: i32) -> io::Result<PeerArena> {
        use rustix::fs::{fcntl_get_seals, fstatfs, SealFlags};
        use rustix::process::{pidfd_getfd, PidfdGetfdFlags};
        let file = pidfd_getfd(pidfd, peer_fd, PidfdGetfdFlags::empty())?;
        if fstatfs(&file)?.f_type as u64 != libc::TMPFS_MAGIC as u64 {
            return Err(invalid("the peer's arena is not a shmem file"));
        }
        if !fcntl_get_seals(&file)?.contains(SealFlags::SHRINK) {
            return Err(invalid("the peer's arena is not sealed against shrinking"));
        }
        let mut a = PeerArena {
            peer_fd,
            file,
            base: std::ptr::null_mut(),
            len: 0,
        };
        a.remap()?;
        Ok(a)
    }

    /// Maps the file at its current size (it only grows), in place of the
    /// previous mapping.
    fn remap(&mut self) -> io::Result<()> {
        let size = rustix::fs::fstat(&self.file)?.st_size;
        let size = usize::try_from(size).map_err(|_| invalid("negative size"))?;
        if size <= self.len {
            return Ok(());
        }
        // SAFETY: a new shared mapping of the file at an address of the
        // kernel's choosing touches no existing memory.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                self.file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        self.unmap();
        self.base = p as *mut u8;
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

    /// Where `len` bytes from `offset` of the file are mapped here
    /// (remapping if the file grew); an error if they lie past its end.
    fn span(&mut self, offset: u64, len: usize) -> io::Result<*mut u8> {
        let end = usize::try_from(offset)
            .ok()
            .and_then(|o| o.checked_add(len))
            .ok_or_else(|| invalid("span out of range"))?;
        if end > self.len {
            self.remap()?;
            if end > self.len {
                return Err(invalid("span past the end of the peer's arena"));
            }
        }
        // SAFETY: end - len = offset <= end <= self.len: inside the mapping.
        Ok(unsafe { self.base.add(end - len) })
    }

    /// Copies `dst.len()` bytes from `offset` of the peer's arena into
    /// `dst` ([`stream_copy`]). An error (the span lies past the file's
    /// end) copies nothing.
    pub(super) fn copy(&mut self, offset: u64, dst: &mut [u8], stream: bool) -> io::Result<()> {
        let src = self.span(offset, dst.len())?;
        // SAFETY: the span lies inside our mapping of the file, which cannot
        // shrink under it (sealed), so every byte is readable; the peer may
        // write them meanwhile, which yields other bytes, never a fault.
        // `dst` is ours.
        unsafe { stream_copy(dst.as_mut_ptr(), src, dst.len(), stream) };
        Ok(())
    }

    /// Copies `src` to `offset` of the peer's arena ([`stream_copy`]). An
    /// error (the span lies past the file's end) writes nothing.
    pub(super) fn write(&mut self, offset: u64, src: &[u8], stream: bool) -> io::Result<()> {
        let dst = self.span(offset, src.len())?;
        // SAFETY: the span lies inside our writable mapping of the file,
        // which cannot shrink under it (sealed); it is the peer's memory,
        // written where the peer asked (only it can be misled), and does
        // not overlap `src`, which is ours.
        unsafe { stream_copy(dst, src.as_ptr(), src.len(), stream) };
        Ok(())
    }
}

impl Drop for PeerArena {
    fn drop(&mut self) {
        self.unmap();
    }
}

impl ProcessMedium {
    /// Copies `out` from `at` (descriptor, offset) in `s`'s shared arena,
    /// mapping it first if needed; false (and CMA from now on for this
    /// peer) where mapping is off for `s`, or the arena cannot be taken, is
    /// not what it must be, or does not hold the span. Called right after
    /// `may_copy_with` said `s` is alive.
    pub(super) fn mapped_copy(
        e: &Eng,
        l: &mut Loc,
        s: Rank,
        at: Option<(i32, u64)>,
        out: &mut [u8],
    ) -> bool {
        let Some((fd, offset)) = at else {
            return false;
        };
        // The receives this rank has under way: posted, or matched and
        // waiting for their copy (osu_bibw: up to 64; a pingpong: this one).
        let pending = l.matching.posted_len() + l.m.copies.len() + 1;
        let stream = Self::streams(pending, out.len());
        let done = Self::on_peer_arena(e, l, s, fd, |a| a.copy(offset, out, stream));
        l.m.mapped_copies += u64::from(done);
        done
    }

    /// Writes `tail` to `offset` of `s`'s shared arena (descriptor `fd`),
    /// as its `WRITE` asked; false as [`mapped_copy`](Self::mapped_copy).
    pub(super) fn mapped_write(
        e: &Eng,
        l: &mut Loc,
        s: Rank,
        (fd, offset): (i32, u64),
        tail: &[u8],
    ) -> bool {
        // Our rendezvous sends under way to `s`, this one included.
        let stream = Self::streams(l.m.rndv_out[s], tail.len());
        let done = Self::on_peer_arena(e, l, s, fd, |a| a.write(offset, tail, stream));
        l.m.mapped_writes += u64::from(done);
        done
    }

    /// Runs `op` on `s`'s arena (descriptor `fd` in `s`), mapping it
    /// first if needed; whether it succeeded. Where mapping is off for `s`
    /// it is not run; where it fails, mapping with `s` stops.
    fn on_peer_arena(
        e: &Eng,
        l: &mut Loc,
        s: Rank,
        fd: i32,
        op: impl FnOnce(&mut PeerArena) -> io::Result<()>,
    ) -> bool {
        let Some(arena) = Self::peer_arena(e, l, s, fd) else {
            return false;
        };
        match op(arena) {
            Ok(()) => true,
            Err(err) => Self::stop_mapping(l, s, &err),
        }
    }

    /// Whether a copy of `len` bytes, one of `in_flight` such transfers
    /// under way, streams (non-temporal stores) rather than copies through
    /// the cache: where their bytes exceed [`STREAM_ABOVE_BYTES`], more
    /// than what stays in a last-level cache beside the rest of the working
    /// set.
    fn streams(in_flight: usize, len: usize) -> bool {
        in_flight.max(1).saturating_mul(len) > STREAM_ABOVE_BYTES
    }

    /// Marks a split copy's `WRITE` (`h`) for a tail that lies in our shared
    /// arena, so that the sender writes it through its mapping of the
    /// arena: the descriptor in `tag`, the offset in `aux` (else the sender
    /// writes it by CMA at `aux`, the address).
    pub(super) fn ask_mapped_write(l: &Loc, s: Rank, h: &mut Header, tail: &[u8]) {
        if !l.m.mapped[s] {
            return;
        }
        if let Some(span) = shared_arena::span_of(tail) {
            h.flags |= FLAG_MAPPED;
            h.tag = span.fd;
            h.aux = span.offset;
        }
    }

    /// `s`'s arena, named `fd` in `s`, mapped here (mapped now if it is
    /// not yet, or was another); `None` where mapping is off for `s` or
    /// fails (then off from now on).
    fn peer_arena<'a>(e: &Eng, l: &'a mut Loc, s: Rank, fd: i32) -> Option<&'a mut PeerArena> {
        if !l.m.mapped[s] {
            return None;
        }
        if !l.m.arenas[s].as_ref().is_some_and(|a| a.peer_fd == fd) {
            let watch = e.m.watch.lock().unwrap_or_else(|p| p.into_inner());
            let opened = match watch.as_ref().and_then(|w| w.pidfd(s)) {
                Some(pidfd) => PeerArena::open(pidfd, fd),
                None => Err(io::Error::from_raw_os_error(libc::ESRCH)),
            };
            drop(watch);
            match opened {
                Ok(a) => l.m.arenas[s] = Some(a),
                Err(err) => {
                    Self::stop_mapping(l, s, &err);
                    return None;
                }
            }
        }
        l.m.arenas[s].as_mut()
    }

    /// Mapping failed with `s`: copies with it go by CMA from now on.
    /// Returns false (the copy was not made).
    #[cold]
    fn stop_mapping(l: &mut Loc, s: Rank, err: &io::Error) -> bool {
        tracing::info!(peer = s, error = %err, "shm: the peer's shared arena cannot be mapped; copies with it go by CMA");
        l.m.mapped[s] = false;
        l.m.arenas[s] = None;
        false
    }
}

/// Copies `n` bytes from `src` to `d`, with non-temporal stores if
/// `stream` (x86-64; elsewhere a plain copy), then a store fence, so the
/// bytes are visible before whatever this thread publishes next. The
/// stores skip reading `d`'s lines before writing them: measured with
/// both cores copying, 1.5-1.9x `memcpy` at 512 KiB-1 MiB. Raw pointers:
/// one side is memory another process maps too, which no reference may
/// claim.
///
/// # Safety
/// `src` is valid for reads and `d` for writes of `n` bytes, and the two
/// do not overlap.
pub(super) unsafe fn stream_copy(d: *mut u8, src: *const u8, n: usize, stream: bool) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{
            __m128i, _mm_loadu_si128, _mm_sfence, _mm_store_si128, _mm_stream_si128,
        };
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
                if stream {
                    _mm_stream_si128(t, a);
                    _mm_stream_si128(t.add(1), b);
                    _mm_stream_si128(t.add(2), c);
                    _mm_stream_si128(t.add(3), e);
                } else {
                    _mm_store_si128(t, a);
                    _mm_store_si128(t.add(1), b);
                    _mm_store_si128(t.add(2), c);
                    _mm_store_si128(t.add(3), e);
                }
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
    {
        // No streaming stores here: a plain copy either way.
        let _ = stream;
        // SAFETY: both ranges are valid for `n` bytes and do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src, d, n) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_streams_only_when_more_than_4_mib_are_under_way() {
        assert!(!ProcessMedium::streams(1, 4 << 20), "a 4 MiB pingpong");
        assert!(!ProcessMedium::streams(0, 1 << 20));
        assert!(ProcessMedium::streams(1, (4 << 20) + 1));
        assert!(ProcessMedium::streams(17, 256 << 10), "a window of 256 KiB");
        assert!(!ProcessMedium::streams(16, 256 << 10));
        assert!(ProcessMedium::streams(usize::MAX, usize::MAX));
    }

    #[test]
    fn the_streaming_copy_copies_every_byte_at_any_alignment() {
        let src: Vec<u8> = (0..70_000u32).map(|i| (i * 7 % 253) as u8).collect();
        for (from, to, len) in [(0, 0, 70_000 - 64), (3, 5, 4099), (1, 0, 63), (17, 9, 1000)] {
            let mut dst = vec![0xeeu8; len + 64];
            let (d, s) = (dst[to..].as_mut_ptr(), src[from..].as_ptr());
            // SAFETY: `dst[to..]` and `src[from..]` hold at least `len`
            // bytes each, in two vectors.
            unsafe { stream_copy(d, s, len, len % 2 == 0) };
            assert!(
                dst[to..to + len] == src[from..from + len],
                "{from} {to} {len}"
            );
            assert!(dst[..to].iter().all(|&b| b == 0xee));
            assert!(dst[to + len..].iter().all(|&b| b == 0xee));
        }
    }
}
