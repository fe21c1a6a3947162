//! Job-private shared-memory segments for the process device.
//!
//! Every rank creates one segment, its *inbox*: a header, its doorbell, its
//! state word, the eager credit it returns to each sender, and one ring per
//! sender. Peers map it read-write (they produce into their ring and ring the
//! doorbell).
//!
//! An inbox is a **sealed memfd**: an anonymous shared-memory file made with
//! `memfd_create`, sized, then sealed with `F_SEAL_SHRINK | F_SEAL_GROW |
//! F_SEAL_SEAL`, so nobody (a buggy or hostile peer included) can change its
//! size: no rank that mapped it can die of `SIGBUS` because a peer truncated
//! it. It has no name in any file system: the creator hands its descriptor
//! to the job's other processes over a Unix socket (`SCM_RIGHTS`, to the job's processes only), and
//! a peer refuses it unless its seals, owner, size and header are the ones
//! expected. The creator closes its descriptor once every rank has attached,
//! after which only the mappings remain; nothing is ever left in `/dev/shm`,
//! even after a crash.
//!
//! Nothing read from a peer's segment sizes or locates anything: the layout
//! is computed locally from the world size and the ring size (agreed through
//! the bootstrap), and the header is only compared against it.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};

use xdev::{Error, Rank, Result};

use crate::doorbell::Doorbell;
use crate::ring::{self, RingRef};

const MAGIC: u64 = u64::from_le_bytes(*b"XDEVSHM1");
const VERSION: u32 = 1;
const PAGE: usize = 4096;

const OFF_DOORBELL: usize = 64;
const OFF_STATE: usize = 128;
const OFF_DEPARTURES: usize = 192;
const OFF_FREED: usize = 256;

/// The state word of a rank: open, closed by `finish`, or dead (its device
/// was dropped without `finish`).
pub mod state {
    /// The rank's device is open.
    pub const OPEN: u32 = 0;
    /// The rank finished cleanly.
    pub const CLOSED: u32 = 1;
    /// The rank's device went away without finishing.
    pub const DEAD: u32 = 2;
}

/// Whether `r` is a well-formed inbox reference as peers publish it: the
/// abstract socket name their descriptor is handed out under
/// (`xdev-fd-` and 32 hex digits).
pub fn valid_ref(r: &str) -> bool {
    crate::fd_pass::valid_offer_name(r)
}

/// Seals every inbox carries.
const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// Where everything sits in an inbox segment. Computed locally; never read
/// from shared memory.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct InboxLayout {
    /// Ranks in the world (one ring per sender).
    pub size: usize,
    /// Slots per ring.
    pub nslots: usize,
}

impl InboxLayout {
    fn rings_offset(&self) -> usize {
        (OFF_FREED + 64 * self.size).next_multiple_of(PAGE)
    }

    fn ring_stride(&self) -> usize {
        ring::bytes_for(self.nslots).next_multiple_of(PAGE)
    }

    /// Total bytes of the segment.
    pub fn len(&self) -> usize {
        self.rings_offset() + self.size * self.ring_stride()
    }

    /// Always false: a segment has at least its header (for clippy's
    /// `len_without_is_empty`).
    pub fn is_empty(&self) -> bool {
        false
    }
}

/// A mapped inbox segment (our own, or a peer's).
pub struct Inbox {
    base: NonNull<u8>,
    layout: InboxLayout,
    /// Our own segment's descriptor, until every peer has attached.
    owned_fd: Option<OwnedFd>,
}

// SAFETY: the mapping is shared memory accessed only through atomics and the
// ring protocol; the struct itself is an address, a layout and a descriptor.
unsafe impl Send for Inbox {}
// SAFETY: as above.
unsafe impl Sync for Inbox {}

fn os(context: impl Into<String>, e: io::Error) -> Error {
    Error::transport(context, e)
}

impl Inbox {
    /// Creates this rank's inbox: a sealed memfd of the layout's size,
    /// zero-filled, mapped, with its header written.
    pub fn create(rank: Rank, layout: InboxLayout) -> Result<Inbox> {
        let label = CString::new(format!("xdev-inbox-{rank}")).expect("no NUL");
        // SAFETY: `label` is NUL-terminated; the call only returns a new
        // descriptor.
        let fd = unsafe {
            libc::memfd_create(label.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if fd < 0 {
            return Err(os("memfd_create for the inbox", io::Error::last_os_error()));
        }
        // SAFETY: memfd_create returned a fresh descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: fd is our open descriptor; ftruncate only sizes the file.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), layout.len() as libc::off_t) } != 0 {
            return Err(os("ftruncate of the inbox", io::Error::last_os_error()));
        }
        // SAFETY: F_ADD_SEALS on our own memfd; no memory effects.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SEALS) } != 0 {
            return Err(os("sealing the inbox", io::Error::last_os_error()));
        }
        let base = map(&fd, layout.len())?;
        let h = base.as_ptr();
        // SAFETY: the mapping is at least one page long, fresh (zeroed) and
        // not yet shared with anyone; these are plain writes of the header.
        unsafe {
            (h as *mut u64).write(MAGIC);
            (h.add(8) as *mut u32).write(VERSION);
            (h.add(12) as *mut u32).write(rank as u32);
            (h.add(16) as *mut u32).write(layout.size as u32);
            (h.add(20) as *mut u32).write(layout.nslots as u32);
            (h.add(24) as *mut u32).write(std::process::id());
            (h.add(32) as *mut u64).write(layout.len() as u64);
        }
        Ok(Inbox {
            base,
            layout,
            owned_fd: Some(fd),
        })
    }

    /// A descriptor of our own inbox to hand to a peer (a duplicate; `None`
    /// once [`Inbox::close_descriptor`] ran or for a peer's inbox).
    pub fn share(&self) -> Option<io::Result<OwnedFd>> {
        self.owned_fd.as_ref().map(|fd| fd.try_clone())
    }

    /// Maps rank `rank`'s inbox, received as `fd` from process `pid`, after
    /// checking the file: sealed against resizing, owned by this user, the
    /// size `layout` implies, and a header naming `rank`, `pid` and the same
    /// layout.
    pub fn attach(fd: OwnedFd, rank: Rank, pid: u32, layout: InboxLayout) -> Result<Inbox> {
        let bad = |what: String| Error::Protocol { rank, what };
        // SAFETY: F_GET_SEALS on an open descriptor; no memory effects.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0
            || seals & (libc::F_SEAL_SHRINK | libc::F_SEAL_GROW)
                != (libc::F_SEAL_SHRINK | libc::F_SEAL_GROW)
        {
            return Err(bad(format!(
                "its inbox is not sealed against resizing (seals {seals:#x})"
            )));
        }
        // SAFETY: an all-zero stat is a valid value to be overwritten.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fd is open and `st` is a valid out-pointer.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(os("fstat of a peer inbox", io::Error::last_os_error()));
        }
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        if st.st_uid != me {
            return Err(bad(format!(
                "its inbox has owner {}, expected {me}",
                st.st_uid
            )));
        }
        if st.st_size as u64 != layout.len() as u64 {
            return Err(bad(format!(
                "its inbox is {} bytes, expected {}",
                st.st_size,
                layout.len()
            )));
        }
        let inbox = Inbox {
            base: map(&fd, layout.len())?,
            layout,
            owned_fd: None,
        };
        let h = inbox.base.as_ptr();
        // SAFETY: the mapping is layout.len() >= one page long; the reads are
        // plain data (a hostile peer may change them, we only compare).
        let (magic, version, r, size, nslots, p) = unsafe {
            (
                (h as *const u64).read_volatile(),
                (h.add(8) as *const u32).read_volatile(),
                (h.add(12) as *const u32).read_volatile(),
                (h.add(16) as *const u32).read_volatile(),
                (h.add(20) as *const u32).read_volatile(),
                (h.add(24) as *const u32).read_volatile(),
            )
        };
        if magic != MAGIC
            || version != VERSION
            || r as usize != rank
            || size as usize != layout.size
            || nslots as usize != layout.nslots
            || p != pid
        {
            return Err(bad(format!(
                "its inbox header does not match (rank {r}, size {size}, \
                 {nslots} slots, pid {p}, version {version})"
            )));
        }
        Ok(inbox)
    }

    /// Closes our own segment's descriptor once every peer has attached
    /// (peers keep their mappings; nobody can open it any more).
    pub fn close_descriptor(&mut self) {
        self.owned_fd = None;
    }

    fn word<T>(&self, off: usize) -> &T {
        // SAFETY: callers pass fixed offsets inside the first page, aligned
        // for T (an atomic), and the mapping lives as long as self.
        unsafe { &*(self.base.as_ptr().add(off) as *const T) }
    }

    /// The owner's doorbell.
    pub fn doorbell(&self) -> &Doorbell {
        self.word(OFF_DOORBELL)
    }

    /// The owner's state word (see [`state`]).
    pub fn state(&self) -> &AtomicU32 {
        self.word(OFF_STATE)
    }

    /// Bumped by anyone who tells the owner that a rank departed.
    pub fn departures(&self) -> &AtomicU64 {
        self.word(OFF_DEPARTURES)
    }

    /// Eager credit the owner returned to `sender` (bytes consumed, growing).
    pub fn freed(&self, sender: Rank) -> &AtomicU64 {
        assert!(sender < self.layout.size);
        self.word(OFF_FREED + 64 * sender)
    }

    /// The ring from `sender` into this inbox.
    pub fn ring(&self, sender: Rank) -> RingRef<'_> {
        assert!(sender < self.layout.size);
        let off = self.layout.rings_offset() + sender * self.layout.ring_stride();
        // SAFETY: off + bytes_for(nslots) <= len (see InboxLayout), page
        // aligned; the segment was zero-filled by ftruncate before use.
        unsafe {
            RingRef::from_raw(
                NonNull::new_unchecked(self.base.as_ptr().add(off)),
                self.layout.nslots,
            )
        }
    }
}

impl Drop for Inbox {
    fn drop(&mut self) {
        self.close_descriptor();
        if self.base != NonNull::dangling() {
            // SAFETY: base/len is a mapping we created and nothing borrows it
            // any more (rings and words borrow self).
            unsafe { libc::munmap(self.base.as_ptr().cast(), self.layout.len()) };
        }
    }
}

/// An owned file descriptor.
fn map(fd: &OwnedFd, len: usize) -> Result<NonNull<u8>> {
    // SAFETY: a fresh shared mapping of an open descriptor; the kernel picks
    // the address. The result is checked below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(os("mmap of an inbox", io::Error::last_os_error()));
    }
    Ok(NonNull::new(p.cast()).expect("mmap returned null"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> InboxLayout {
        InboxLayout {
            size: 3,
            nslots: 64,
        }
    }

    #[test]
    fn create_attach_close() {
        let layout = layout();
        let mut mine = Inbox::create(1, layout).unwrap();
        let me = std::process::id();
        let share = || mine.share().expect("ours").unwrap();
        let peer = Inbox::attach(share(), 1, me, layout).unwrap();
        // Wrong expectations are refused.
        assert!(matches!(
            Inbox::attach(share(), 2, me, layout),
            Err(Error::Protocol { rank: 2, .. })
        ));
        assert!(Inbox::attach(
            share(),
            1,
            me,
            InboxLayout {
                size: 4,
                nslots: 64
            }
        )
        .is_err());
        assert!(
            Inbox::attach(share(), 1, me + 1, layout).is_err(),
            "another pid"
        );
        let passwd = OwnedFd::from(std::fs::File::open("/etc/passwd").unwrap());
        assert!(
            Inbox::attach(passwd, 1, me, layout).is_err(),
            "not an inbox"
        );
        assert!(
            peer.share().is_none(),
            "a peer's inbox is not ours to share"
        );
        // Both mappings see the same memory.
        peer.state().store(7, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(mine.state().load(std::sync::atomic::Ordering::SeqCst), 7);
        mine.close_descriptor();
        assert!(mine.share().is_none(), "closed: nothing more to hand out");
        assert_eq!(peer.state().load(std::sync::atomic::Ordering::SeqCst), 7);
        // Nothing in /dev/shm, ever.
        let here = std::fs::read_dir("/dev/shm")
            .unwrap()
            .flatten()
            .any(|e| e.file_name().to_string_lossy().contains("xdev-inbox"));
        assert!(!here);
    }

    #[test]
    fn a_peer_cannot_resize_an_inbox() {
        let layout = layout();
        let mine = Inbox::create(0, layout).unwrap();
        // What a hostile peer holds after the hand-over: the descriptor.
        // It tries to shrink (SIGBUS for every mapper) or grow it.
        let f = std::fs::File::from(mine.share().unwrap().unwrap());
        let e = f.set_len(4096).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
        let e = f.set_len(layout.len() as u64 * 2).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
        // Nor remove the seals.
        // SAFETY: F_ADD_SEALS on an open descriptor; no memory effects.
        let r = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_WRITE) };
        assert_eq!(r, -1, "F_SEAL_SEAL forbids more seals");
        // The mapping is intact.
        mine.state().store(3, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(mine.ring(2).nslots(), 64);
    }

    #[test]
    fn an_unsealed_inbox_is_refused() {
        let layout = layout();
        // A peer offering an ordinary memfd with a perfect header.
        let label = CString::new("fake").unwrap();
        // SAFETY: NUL-terminated label; returns a new descriptor.
        let raw = unsafe { libc::memfd_create(label.as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0);
        // SAFETY: a fresh descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        assert_eq!(
            // SAFETY: our own descriptor.
            unsafe { libc::ftruncate(fd.as_raw_fd(), layout.len() as libc::off_t) },
            0
        );
        let base = map(&fd, layout.len()).unwrap();
        let h = base.as_ptr();
        // SAFETY: fresh mapping of at least one page.
        unsafe {
            (h as *mut u64).write(MAGIC);
            (h.add(8) as *mut u32).write(VERSION);
            (h.add(12) as *mut u32).write(1);
            (h.add(16) as *mut u32).write(layout.size as u32);
            (h.add(20) as *mut u32).write(layout.nslots as u32);
            (h.add(24) as *mut u32).write(std::process::id());
        }
        let e = Inbox::attach(fd, 1, std::process::id(), layout)
            .err()
            .expect("refused");
        assert!(
            matches!(&e, Error::Protocol { rank: 1, what } if what.contains("not sealed")),
            "{e:?}"
        );
        // SAFETY: our mapping, unused now.
        unsafe { libc::munmap(base.as_ptr().cast(), layout.len()) };
    }
}
