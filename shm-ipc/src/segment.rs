//! Job-private shared-memory segments for the process device.
//!
//! Every rank creates one segment, its *inbox*: a header, its doorbell, its
//! state word, the eager credit it returns to each sender, and one ring per
//! sender. Peers map it read-write (they produce into their ring and ring the
//! doorbell).
//!
//! Privacy: a segment is a POSIX shared-memory object created with `O_EXCL`
//! and mode 0600 under an unguessable name (128 random bits); whoever attaches
//! checks that the object belongs to this user, has mode 0600 and exactly
//! the size the layout computes. The creator unlinks it as soon as every rank
//! has attached (and on any error before that), so a crash afterwards leaves
//! nothing in `/dev/shm`; `xdev-run` also sweeps its job's prefix when the job
//! ends, which covers a crash during start-up.
//!
//! Nothing read from a peer's segment sizes or locates anything: the layout
//! is computed locally from the world size and the ring size (agreed through
//! the bootstrap), and the header is only compared against it.

use std::ffi::CString;
use std::io;
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

pub use xdev::bootstrap::{is_xdev_shm_name as valid_name, shm_prefix as name_prefix};

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
    name: String,
    /// Our own segment, not yet unlinked.
    owned_name: Option<CString>,
}

// SAFETY: the mapping is shared memory accessed only through atomics and the
// ring protocol; the struct itself is an address, a layout and a name.
unsafe impl Send for Inbox {}
// SAFETY: as above.
unsafe impl Sync for Inbox {}

fn os(context: impl Into<String>, e: io::Error) -> Error {
    Error::transport(context, e)
}

fn shm_name(name: &str) -> Result<CString> {
    CString::new(name).map_err(|_| Error::Config(format!("segment name {name:?} contains NUL")))
}

impl Inbox {
    /// Creates this rank's inbox under a fresh random name with `prefix`
    /// (see [`name_prefix`]), mode 0600, zero-filled, and writes its header.
    pub fn create(prefix: &str, rank: Rank, layout: InboxLayout) -> Result<Inbox> {
        let mut rnd = [0u8; 16];
        getrandom::fill(&mut rnd)
            .map_err(|e| os("segment name", io::Error::other(e.to_string())))?;
        let hex: String = rnd.iter().map(|b| format!("{b:02x}")).collect();
        let name = format!("{prefix}{rank}-{hex}");
        let c = shm_name(&name)?;
        // SAFETY: `c` is a valid NUL-terminated string; the call has no memory
        // effects on our side besides returning a new descriptor.
        let fd = unsafe {
            libc::shm_open(
                c.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_RDWR | libc::O_CLOEXEC,
                0o600,
            )
        };
        if fd < 0 {
            return Err(os(
                format!("shm_open({name}) to create the inbox"),
                io::Error::last_os_error(),
            ));
        }
        let fd = Fd(fd);
        let mut inbox = Inbox {
            base: NonNull::dangling(),
            layout,
            name,
            owned_name: Some(c),
        };
        // Until mapped, a failure still unlinks through Drop (base dangling is
        // never unmapped: see Drop).
        // SAFETY: fd is our open descriptor; ftruncate only resizes the object.
        if unsafe { libc::ftruncate(fd.0, layout.len() as libc::off_t) } != 0 {
            return Err(os("ftruncate of the inbox", io::Error::last_os_error()));
        }
        inbox.base = map(&fd, layout.len())?;
        let h = inbox.base.as_ptr();
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
        Ok(inbox)
    }

    /// Maps a peer's inbox `name` after checking the object: owned by this
    /// user, mode 0600, the size `layout` implies, and a header naming
    /// `rank`, `pid` and the same layout.
    pub fn attach(name: &str, rank: Rank, pid: u32, layout: InboxLayout) -> Result<Inbox> {
        let bad = |what: String| Error::Protocol { rank, what };
        if !valid_name(name) {
            return Err(bad(format!("malformed segment name {name:?}")));
        }
        let c = shm_name(name)?;
        // SAFETY: `c` is NUL-terminated; no memory effects on our side.
        let fd = unsafe { libc::shm_open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC, 0) };
        if fd < 0 {
            return Err(os(
                format!("shm_open({name}) of rank {rank}'s inbox"),
                io::Error::last_os_error(),
            ));
        }
        let fd = Fd(fd);
        // SAFETY: an all-zero stat is a valid value to be overwritten.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fd is open and `st` is a valid out-pointer.
        if unsafe { libc::fstat(fd.0, &mut st) } != 0 {
            return Err(os("fstat of a peer inbox", io::Error::last_os_error()));
        }
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        if st.st_uid != me || st.st_mode & 0o777 != 0o600 {
            return Err(bad(format!(
                "segment {name} has owner {} and mode {:o}, expected {me} and 600",
                st.st_uid,
                st.st_mode & 0o777
            )));
        }
        if st.st_size as u64 != layout.len() as u64 {
            return Err(bad(format!(
                "segment {name} is {} bytes, expected {}",
                st.st_size,
                layout.len()
            )));
        }
        let inbox = Inbox {
            base: map(&fd, layout.len())?,
            layout,
            name: name.to_string(),
            owned_name: None,
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
                "segment {name} header does not match (rank {r}, size {size}, \
                 {nslots} slots, pid {p}, version {version})"
            )));
        }
        Ok(inbox)
    }

    /// The segment's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Removes our own segment's name (peers keep their mappings).
    pub fn unlink(&mut self) {
        if let Some(c) = self.owned_name.take() {
            // SAFETY: c is NUL-terminated; unlinking only removes the name.
            unsafe { libc::shm_unlink(c.as_ptr()) };
        }
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
        self.unlink();
        if self.base != NonNull::dangling() {
            // SAFETY: base/len is a mapping we created and nothing borrows it
            // any more (rings and words borrow self).
            unsafe { libc::munmap(self.base.as_ptr().cast(), self.layout.len()) };
        }
    }
}

struct Fd(libc::c_int);

impl Drop for Fd {
    fn drop(&mut self) {
        // SAFETY: we own the descriptor.
        unsafe { libc::close(self.0) };
    }
}

fn map(fd: &Fd, len: usize) -> Result<NonNull<u8>> {
    // SAFETY: a fresh shared mapping of an open descriptor; the kernel picks
    // the address. The result is checked below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.0,
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

    #[test]
    fn create_attach_unlink() {
        let layout = InboxLayout {
            size: 3,
            nslots: 64,
        };
        let prefix = name_prefix("unit test/segments");
        let mut mine = Inbox::create(&prefix, 1, layout).unwrap();
        assert!(mine.name().starts_with(&format!("{prefix}1-")));
        let path = format!("/dev/shm{}", mine.name());
        let meta = std::fs::metadata(&path).unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        let peer = Inbox::attach(mine.name(), 1, std::process::id(), layout).unwrap();
        // Wrong expectations are refused.
        assert!(matches!(
            Inbox::attach(mine.name(), 2, std::process::id(), layout),
            Err(Error::Protocol { rank: 2, .. })
        ));
        assert!(Inbox::attach(
            mine.name(),
            1,
            std::process::id(),
            InboxLayout {
                size: 4,
                nslots: 64
            }
        )
        .is_err());
        assert!(Inbox::attach("/etc/passwd", 1, 1, layout).is_err());
        // Both mappings see the same memory.
        peer.state().store(7, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(mine.state().load(std::sync::atomic::Ordering::SeqCst), 7);
        mine.unlink();
        assert!(!std::path::Path::new(&path).exists());
        assert_eq!(peer.state().load(std::sync::atomic::Ordering::SeqCst), 7);
    }

    #[test]
    fn sweep_removes_only_the_job() {
        let layout = InboxLayout { size: 1, nslots: 4 };
        let a = Inbox::create(&name_prefix("sweep-a"), 0, layout).unwrap();
        let b = Inbox::create(&name_prefix("sweep-b"), 0, layout).unwrap();
        let (pa, pb) = (
            format!("/dev/shm{}", a.name()),
            format!("/dev/shm{}", b.name()),
        );
        std::mem::forget(a); // a crash: never unlinked
        assert_eq!(xdev::bootstrap::remove_job_shm("sweep-a"), 1);
        assert!(!std::path::Path::new(&pa).exists());
        assert!(std::path::Path::new(&pb).exists());
        drop(b);
        assert!(!std::path::Path::new(&pb).exists());
    }
}
