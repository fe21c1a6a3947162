//! Job-private shared memory of the process device.
//!
//! Every rank owns an *inbox*, made of three kinds of shared-memory files:
//!
//! * its **control page**: a header, its state word, its doorbell's
//!   `sleepers` count (whether a sender must wake it) and the eager credit
//!   it returns to each sender. Only the owner writes it; peers map it
//!   read-only, and the file is sealed with `F_SEAL_FUTURE_WRITE`, so no
//!   peer can map it writable or write it by any other way.
//! * its **notice page**: its doorbell's futex word and its departures
//!   counter, which every peer writes (to wake it, and to tell it that
//!   someone left). A peer that writes nonsense here causes a spurious
//!   wake-up or an extra look at the state words, nothing else: what a
//!   sender reads to decide whether to wake the owner is in the control
//!   page (see [`DoorbellRef`]).
//! * one **ring per sender**, shared by the owner (the consumer) and that
//!   sender (the producer) only: no third rank ever holds it, so no rank can
//!   forge messages in another pair's ring.
//!
//! Each file is a **sealed memfd**: an anonymous file made with
//! `memfd_create`, sized, then sealed with `F_SEAL_SHRINK | F_SEAL_GROW`
//! (and `F_SEAL_SEAL`), so nobody (a buggy or hostile peer included) can
//! change its size: no rank that mapped it can die of `SIGBUS` because a
//! peer truncated it. None has a name in any file system: the owner hands
//! sender `s` the control page, the notice page and ring `s` over a Unix
//! socket (`SCM_RIGHTS`, to the job's processes only), and a peer refuses
//! them unless their seals, owner, sizes and header are the ones expected.
//! The owner closes its descriptors once every rank has attached, and peers
//! close theirs once mapped, after which only the mappings remain; nothing
//! is ever left in `/dev/shm`, even after a crash.
//!
//! Nothing read from a peer's memory sizes or locates anything: the layout
//! is computed locally from the world size and the ring size (agreed through
//! the bootstrap), and the header is only compared against it.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use xdev::{Error, Rank, Result};

use crate::doorbell::DoorbellRef;
use crate::ring::{self, RingRef};

const MAGIC: u64 = u64::from_le_bytes(*b"XDEVSHM2");
const VERSION: u32 = 3;
const PAGE: usize = 4096;

// Control page.
const OFF_STATE: usize = 64;
const OFF_SLEEPERS: usize = 128;
const OFF_FREED: usize = 192;
// Notice page.
const OFF_DOORBELL_SEQ: usize = 0;
const OFF_DEPARTURES: usize = 64;

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
/// abstract socket name their descriptors are handed out under
/// (`xdev-fd-` and 32 hex digits).
pub fn valid_ref(r: &str) -> bool {
    crate::fd_pass::valid_offer_name(r)
}

/// Seals every file of an inbox carries.
const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;

/// How many descriptors a peer receives: control page, notice page, its ring.
pub const SHARED_FDS: usize = 3;

/// Where everything sits in an inbox. Computed locally; never read from
/// shared memory.
///
/// Made with [`InboxLayout::new`], which refuses a layout no inbox can have
/// (no ranks, a ring of an invalid slot count, a mapping too large to
/// address). The fields are private to this crate, so code outside cannot
/// make an unchecked one:
///
/// ```compile_fail,E0451
/// use shm_ipc::segment::InboxLayout;
/// let layout = InboxLayout { size: 1, nslots: 0 }; // private fields
/// ```
///
/// ```
/// use shm_ipc::segment::InboxLayout;
/// assert!(InboxLayout::new(1, 0).is_err());
/// assert!(InboxLayout::new(0, 64).is_err());
/// let l = InboxLayout::new(3, 64).unwrap();
/// assert_eq!((l.size(), l.nslots()), (3, 64));
/// ```
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct InboxLayout {
    /// Ranks in the world (one ring per sender).
    pub(crate) size: usize,
    /// Slots per ring.
    pub(crate) nslots: usize,
}

/// The most ranks an inbox serves: the header stores the world size in 32
/// bits, and each sender costs a control-page line and a descriptor.
pub const MAX_RANKS: usize = 1 << 20;

impl InboxLayout {
    /// The layout of a world of `size` ranks with rings of `nslots` slots.
    ///
    /// # Errors
    /// [`Error::Config`] unless `1 <= size <= MAX_RANKS` and `nslots` is a
    /// slot count a ring may have (a power of two from [`ring::MIN_SLOTS`]
    /// to [`ring::MAX_SLOTS`]).
    pub fn new(size: usize, nslots: usize) -> Result<InboxLayout> {
        let layout = InboxLayout { size, nslots };
        layout.check()?;
        Ok(layout)
    }

    /// Ranks in the world.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Slots per ring.
    pub fn nslots(&self) -> usize {
        self.nslots
    }

    /// Refuses a layout [`InboxLayout::new`] would refuse (the crate makes
    /// some with a literal; every inbox checks its layout again).
    fn check(&self) -> Result<()> {
        if !(1..=MAX_RANKS).contains(&self.size) {
            return Err(Error::Config(format!(
                "an inbox serves 1 to {MAX_RANKS} ranks, not {}",
                self.size
            )));
        }
        if !ring::valid_nslots(self.nslots) {
            return Err(Error::Config(format!(
                "a ring has a power of two of {} to {} slots, not {}",
                ring::MIN_SLOTS,
                ring::MAX_SLOTS,
                self.nslots
            )));
        }
        // Both bounds above keep these far from overflowing; checked anyway.
        let control = 64usize
            .checked_mul(self.size)
            .and_then(|n| n.checked_add(OFF_FREED))
            .and_then(|n| n.checked_next_multiple_of(PAGE));
        let ring = self
            .nslots
            .checked_mul(ring::SLOT)
            .and_then(|n| n.checked_add(ring::CONTROL))
            .and_then(|n| n.checked_next_multiple_of(PAGE));
        match (control, ring) {
            (Some(c), Some(r)) if c <= isize::MAX as usize && r <= isize::MAX as usize => Ok(()),
            _ => Err(Error::Config(format!(
                "an inbox of {} ranks and {}-slot rings is too large to map",
                self.size, self.nslots
            ))),
        }
    }

    /// Bytes of the control page(s).
    pub fn control_len(&self) -> usize {
        (OFF_FREED + 64 * self.size).next_multiple_of(PAGE)
    }

    /// Bytes of one ring's file.
    pub fn ring_len(&self) -> usize {
        ring::bytes_for(self.nslots).next_multiple_of(PAGE)
    }
}

/// One shared mapping, unmapped on drop.
struct Mapping {
    base: NonNull<u8>,
    len: usize,
}

impl Mapping {
    fn new(fd: &OwnedFd, len: usize, writable: bool) -> Result<Mapping> {
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a fresh shared mapping of an open descriptor; the kernel
        // picks the address. The result is checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os("mmap of an inbox", io::Error::last_os_error()));
        }
        Ok(Mapping {
            base: NonNull::new(p.cast()).expect("mmap returned null"),
            len,
        })
    }

    fn word<T>(&self, off: usize) -> &T {
        assert!(off + std::mem::size_of::<T>() <= self.len);
        // SAFETY: in bounds (checked above); callers pass offsets aligned for
        // T (an atomic or a doorbell), and the mapping lives as long as self.
        unsafe { &*(self.base.as_ptr().add(off) as *const T) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: base/len is a mapping we created, and nothing borrows it
        // any more (rings and words borrow the Inbox that owns self).
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// The descriptors of our own inbox, until every peer has attached.
struct OwnFds {
    control: OwnedFd,
    notice: OwnedFd,
    rings: Vec<OwnedFd>,
}

/// A mapped inbox: our own (everything, writable), or a peer's as one of
/// its senders sees it (its control page read-only, its notice page, and
/// the one ring we produce into).
pub struct Inbox {
    layout: InboxLayout,
    control: Mapping,
    notice: Mapping,
    /// Indexed by sender; a peer's inbox maps only ours.
    rings: Vec<Option<Mapping>>,
    own: Option<OwnFds>,
    is_own: bool,
}

// SAFETY: the mappings are shared memory accessed only through atomics and
// the ring protocol; the struct itself is addresses, a layout and
// descriptors.
unsafe impl Send for Inbox {}
// SAFETY: as above.
unsafe impl Sync for Inbox {}

fn os(context: impl Into<String>, e: io::Error) -> Error {
    Error::transport(context, e)
}

/// A new sealed memfd of `len` zero bytes.
fn sealed_memfd(label: &str, len: usize, extra_seals: libc::c_int) -> Result<OwnedFd> {
    let label = CString::new(label).expect("no NUL");
    // SAFETY: `label` is NUL-terminated; the call only returns a new
    // descriptor.
    let fd =
        unsafe { libc::memfd_create(label.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(os("memfd_create for the inbox", io::Error::last_os_error()));
    }
    // SAFETY: memfd_create returned a fresh descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: fd is our open descriptor; ftruncate only sizes the file.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
        return Err(os("ftruncate of the inbox", io::Error::last_os_error()));
    }
    seal(&fd, SEALS | extra_seals)?;
    Ok(fd)
}

fn seal(fd: &OwnedFd, seals: libc::c_int) -> Result<()> {
    // SAFETY: F_ADD_SEALS on our own memfd; no memory effects.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(os("sealing the inbox", io::Error::last_os_error()));
    }
    Ok(())
}

/// Checks a received file: `seals` present, this user's, `len` bytes.
fn check_file(
    fd: &OwnedFd,
    what: &str,
    seals: libc::c_int,
    len: usize,
    bad: &dyn Fn(String) -> Error,
) -> Result<()> {
    // SAFETY: F_GET_SEALS on an open descriptor; no memory effects.
    let got = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if got < 0 || got & seals != seals {
        return Err(bad(format!(
            "its {what} is not sealed as an inbox is (seals {got:#x}, needs {seals:#x})"
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
            "its {what} has owner {}, expected {me}",
            st.st_uid
        )));
    }
    if st.st_size as u64 != len as u64 {
        return Err(bad(format!(
            "its {what} is {} bytes, expected {len}",
            st.st_size
        )));
    }
    Ok(())
}

impl Inbox {
    /// Creates this rank's inbox: its sealed memfds, zero-filled, mapped,
    /// with the header written and the control page then sealed against
    /// any further writable mapping.
    ///
    /// # Errors
    /// [`Error::Config`] for a layout [`InboxLayout::new`] refuses, or a
    /// rank outside it; [`Error::Transport`] if the system refuses a file or
    /// a mapping.
    pub fn create(rank: Rank, layout: InboxLayout) -> Result<Inbox> {
        layout.check()?;
        if rank >= layout.size {
            return Err(Error::InvalidRank {
                rank,
                size: layout.size,
            });
        }
        let control_fd = sealed_memfd(
            &format!("xdev-inbox-{rank}-control"),
            layout.control_len(),
            0,
        )?;
        let control = Mapping::new(&control_fd, layout.control_len(), true)?;
        let h = control.base.as_ptr();
        // SAFETY: the mapping is at least one page long, fresh (zeroed) and
        // not yet shared with anyone; these are plain writes of the header.
        unsafe {
            (h as *mut u64).write(MAGIC);
            (h.add(8) as *mut u32).write(VERSION);
            (h.add(12) as *mut u32).write(rank as u32);
            (h.add(16) as *mut u32).write(layout.size as u32);
            (h.add(20) as *mut u32).write(layout.nslots as u32);
            (h.add(24) as *mut u32).write(std::process::id());
        }
        // Our writable mapping exists; from now on nobody can make another
        // (nor write(2) it): peers get a read-only view.
        seal(&control_fd, libc::F_SEAL_FUTURE_WRITE | libc::F_SEAL_SEAL)?;
        let notice_fd = sealed_memfd(
            &format!("xdev-inbox-{rank}-notice"),
            PAGE,
            libc::F_SEAL_SEAL,
        )?;
        let notice = Mapping::new(&notice_fd, PAGE, true)?;
        let mut ring_fds = Vec::with_capacity(layout.size);
        let mut rings = Vec::with_capacity(layout.size);
        for s in 0..layout.size {
            let fd = sealed_memfd(
                &format!("xdev-ring-{s}-to-{rank}"),
                layout.ring_len(),
                libc::F_SEAL_SEAL,
            )?;
            rings.push(Some(Mapping::new(&fd, layout.ring_len(), true)?));
            ring_fds.push(fd);
        }
        Ok(Inbox {
            layout,
            control,
            notice,
            rings,
            own: Some(OwnFds {
                control: control_fd,
                notice: notice_fd,
                rings: ring_fds,
            }),
            is_own: true,
        })
    }

    /// What sender `sender` receives of our own inbox (duplicates of the
    /// control page, the notice page and ring `sender`, in that order);
    /// `None` once [`Inbox::close_descriptors`] ran, for a peer's inbox, or
    /// for a sender outside the world.
    pub fn share_with(&self, sender: Rank) -> Option<io::Result<Vec<OwnedFd>>> {
        let own = self.own.as_ref()?;
        let ring = own.rings.get(sender)?;
        Some(
            [&own.control, &own.notice, ring]
                .into_iter()
                .map(|fd| fd.try_clone())
                .collect(),
        )
    }

    /// Maps rank `rank`'s inbox as its sender `me` sees it, from the
    /// [`SHARED_FDS`] descriptors received from process `pid` (control page,
    /// notice page, our ring), after checking each file: sealed against
    /// resizing (the control page also against writing), owned by this
    /// user, of the size `layout` implies, and a header naming `rank`, `pid`
    /// and the same layout.
    pub fn attach(
        fds: Vec<OwnedFd>,
        rank: Rank,
        me: Rank,
        pid: u32,
        layout: InboxLayout,
    ) -> Result<Inbox> {
        layout.check()?;
        let bad = |what: String| Error::Protocol { rank, what };
        let Ok([control_fd, notice_fd, ring_fd]) = <[OwnedFd; SHARED_FDS]>::try_from(fds) else {
            return Err(bad(format!("it sent other than {SHARED_FDS} descriptors")));
        };
        if me >= layout.size {
            return Err(Error::InvalidRank {
                rank: me,
                size: layout.size,
            });
        }
        check_file(
            &control_fd,
            "control page",
            SEALS | libc::F_SEAL_FUTURE_WRITE,
            layout.control_len(),
            &bad,
        )?;
        check_file(&notice_fd, "notice page", SEALS, PAGE, &bad)?;
        check_file(&ring_fd, "ring", SEALS, layout.ring_len(), &bad)?;
        let control = Mapping::new(&control_fd, layout.control_len(), false)?;
        let h = control.base.as_ptr();
        // SAFETY: the mapping is at least one page long; the reads are plain
        // data (the owner may change them, we only compare).
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
        let mut rings: Vec<Option<Mapping>> = (0..layout.size).map(|_| None).collect();
        rings[me] = Some(Mapping::new(&ring_fd, layout.ring_len(), true)?);
        Ok(Inbox {
            layout,
            control,
            notice: Mapping::new(&notice_fd, PAGE, true)?,
            rings,
            own: None,
            is_own: false,
        })
        // The descriptors close here; the mappings stay.
    }

    /// Closes our own inbox's descriptors once every peer has attached
    /// (peers keep their mappings; nobody can be handed it any more).
    pub fn close_descriptors(&mut self) {
        self.own = None;
    }

    /// The owner's doorbell: its futex word in the notice page, its
    /// sleepers count in the control page (owner-written). On a peer's
    /// inbox, a waker's view (it rings, it cannot arm).
    pub fn doorbell(&self) -> DoorbellRef<'_> {
        let seq = self.notice.word(OFF_DOORBELL_SEQ);
        let sleepers = self.control.word(OFF_SLEEPERS);
        if self.is_own {
            DoorbellRef::owner(seq, sleepers)
        } else {
            DoorbellRef::waker(seq, sleepers)
        }
    }

    /// Bumped by anyone who tells the owner that a rank departed.
    pub fn departures(&self) -> &AtomicU64 {
        self.notice.word(OFF_DEPARTURES)
    }

    /// The owner's state (see [`state`]).
    pub fn state(&self, order: Ordering) -> u32 {
        // An atomic load of read-only memory (a peer's view) is allowed.
        self.control.word::<AtomicU32>(OFF_STATE).load(order)
    }

    /// Publishes our own state (see [`state`]).
    ///
    /// # Panics
    /// On a peer's inbox, which is not ours to write (and mapped read-only).
    pub fn set_state(&self, st: u32, order: Ordering) {
        assert!(self.is_own, "a peer's state is not ours to write");
        self.control.word::<AtomicU32>(OFF_STATE).store(st, order);
    }

    fn freed_word(&self, sender: Rank) -> &AtomicU64 {
        assert!(sender < self.layout.size);
        self.control.word(OFF_FREED + 64 * sender)
    }

    /// Eager credit the owner returned to `sender` (bytes consumed, growing).
    pub fn freed(&self, sender: Rank, order: Ordering) -> u64 {
        self.freed_word(sender).load(order)
    }

    /// Publishes the eager credit we returned to `sender`.
    ///
    /// # Panics
    /// On a peer's inbox, which is not ours to write (and mapped read-only).
    pub fn set_freed(&self, sender: Rank, bytes: u64, order: Ordering) {
        assert!(self.is_own, "a peer's credit is not ours to write");
        self.freed_word(sender).store(bytes, order);
    }

    /// Whether the ring from `sender` is mapped here (always in our own
    /// inbox; only our own ring in a peer's).
    pub fn has_ring(&self, sender: Rank) -> bool {
        self.rings.get(sender).is_some_and(Option::is_some)
    }

    /// The ring from `sender` into this inbox, if it is mapped here (see
    /// [`Inbox::has_ring`]).
    pub fn try_ring(&self, sender: Rank) -> Option<RingRef<'_>> {
        let m = self.rings.get(sender)?.as_ref()?;
        // SAFETY: the mapping is ring_len() >= bytes_for(nslots) bytes, page
        // aligned, zero-filled by ftruncate before use, and lives as long
        // as self; nslots passed `InboxLayout::check` when the inbox was
        // made (a power of two of at least 4).
        Some(unsafe { RingRef::from_raw(m.base, self.layout.nslots) })
    }

    /// The ring from `sender` into this inbox.
    ///
    /// # Panics
    /// If it is not mapped here (see [`Inbox::has_ring`] and
    /// [`Inbox::try_ring`]), in every build: a sender outside the world is
    /// never an access outside the inbox.
    pub fn ring(&self, sender: Rank) -> RingRef<'_> {
        self.try_ring(sender)
            .expect("only the rings a rank takes part in are mapped")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{FileExt, MetadataExt};

    fn layout() -> InboxLayout {
        InboxLayout {
            size: 3,
            nslots: 64,
        }
    }

    fn inode(fd: &OwnedFd) -> (u64, u64) {
        let m = std::fs::metadata(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap();
        (m.dev(), m.ino())
    }

    #[test]
    fn create_attach_close() {
        let layout = layout();
        let mut mine = Inbox::create(1, layout).unwrap();
        let me = std::process::id();
        let share = |s| mine.share_with(s).expect("ours").unwrap();
        let peer = Inbox::attach(share(2), 1, 2, me, layout).unwrap();
        // Wrong expectations are refused.
        assert!(matches!(
            Inbox::attach(share(2), 2, 2, me, layout),
            Err(Error::Protocol { rank: 2, .. })
        ));
        let bigger = InboxLayout {
            size: 4,
            nslots: 64,
        };
        assert!(Inbox::attach(share(2), 1, 2, me, bigger).is_err());
        assert!(
            Inbox::attach(share(2), 1, 2, me + 1, layout).is_err(),
            "another pid"
        );
        let mut short = share(2);
        short.pop();
        assert!(
            Inbox::attach(short, 1, 2, me, layout).is_err(),
            "two descriptors"
        );
        let mut swapped = share(2);
        swapped.swap(0, 2);
        assert!(
            Inbox::attach(swapped, 1, 2, me, layout).is_err(),
            "ring as control"
        );
        let passwd = || OwnedFd::from(std::fs::File::open("/etc/passwd").unwrap());
        assert!(Inbox::attach(vec![passwd(), passwd(), passwd()], 1, 2, me, layout).is_err());
        assert!(
            peer.share_with(0).is_none(),
            "a peer's inbox is not ours to share"
        );
        assert!(mine.share_with(3).is_none(), "no sender 3 in a world of 3");
        // Both mappings see the same memory.
        mine.set_state(7, Ordering::SeqCst);
        assert_eq!(peer.state(Ordering::SeqCst), 7);
        mine.set_freed(2, 99, Ordering::SeqCst);
        assert_eq!(peer.freed(2, Ordering::SeqCst), 99);
        peer.departures().fetch_add(1, Ordering::SeqCst);
        assert_eq!(mine.departures().load(Ordering::SeqCst), 1);
        assert!(!peer.ring(2).has_message());
        mine.close_descriptors();
        assert!(
            mine.share_with(2).is_none(),
            "closed: nothing more to hand out"
        );
        assert_eq!(peer.state(Ordering::SeqCst), 7);
        // Nothing in /dev/shm, ever.
        let here = std::fs::read_dir("/dev/shm")
            .unwrap()
            .flatten()
            .any(|e| e.file_name().to_string_lossy().contains("xdev-inbox"));
        assert!(!here);
    }

    /// A hostile peer zeroes the whole notice page (through the same
    /// writable mapping every peer has) before each of `rounds` wake-ups of
    /// the owner by an honest sender. Returns the owner's total wait time
    /// and how many of its sleeps ended by their timeout.
    fn wake_ups_with_a_hostile_notice_page(rounds: u32) -> (std::time::Duration, u32) {
        use std::sync::atomic::AtomicBool;
        use std::time::{Duration, Instant};
        crate::doorbell::init_fences();
        let layout = layout();
        let mine = Inbox::create(0, layout).unwrap();
        let me = std::process::id();
        let [_, hostile_notice, _] = <[OwnedFd; 3]>::try_from(mine.share_with(1).unwrap().unwrap())
            .ok()
            .unwrap();
        let hostile = Mapping::new(&hostile_notice, PAGE, true).unwrap();
        let honest = Inbox::attach(mine.share_with(2).unwrap().unwrap(), 0, 2, me, layout).unwrap();
        let work = AtomicBool::new(false);
        let started = AtomicU32::new(0);
        std::thread::scope(|s| {
            let sleeper = s.spawn(|| {
                let (mut waited, mut timeouts) = (Duration::ZERO, 0);
                for round in 1..=rounds {
                    let t = Instant::now();
                    started.store(round, Ordering::SeqCst);
                    while !work.load(Ordering::SeqCst) {
                        let woken = mine.doorbell().sleep(
                            Duration::from_millis(50),
                            crate::futex::Scope::Shared,
                            || work.load(Ordering::SeqCst),
                        );
                        timeouts += u32::from(!woken);
                    }
                    work.store(false, Ordering::SeqCst);
                    waited += t.elapsed();
                }
                (waited, timeouts)
            });
            for round in 1..=rounds {
                while started.load(Ordering::SeqCst) != round {
                    std::thread::yield_now();
                }
                // Time to fall asleep.
                std::thread::sleep(Duration::from_millis(5));
                for off in (0..PAGE).step_by(8) {
                    hostile.word::<AtomicU64>(off).store(0, Ordering::SeqCst);
                }
                work.store(true, Ordering::SeqCst);
                honest.doorbell().ring(crate::futex::Scope::Shared);
            }
            sleeper.join().unwrap()
        })
    }

    #[test]
    fn a_peer_zeroing_the_notice_page_does_not_cost_wake_ups() {
        // Issue 21: with the sleepers word in the notice page, a peer
        // zeroed it, honest senders skipped the wake-up, and every blocking
        // wait ran into its 50 ms timeout.
        let rounds = 10;
        let (waited, timeouts) = wake_ups_with_a_hostile_notice_page(rounds);
        assert_eq!(timeouts, 0, "woken by the timeout, not the doorbell");
        assert!(
            waited < std::time::Duration::from_millis(25) * rounds,
            "{rounds} wake-ups took {waited:?}"
        );
    }

    #[test]
    fn a_layout_no_inbox_can_have_is_refused() {
        // Issue 21: a zero-slot ring made `ring(0).has_message()` read
        // outside the mapping (only a debug_assert stood in the way).
        let zero = InboxLayout { size: 1, nslots: 0 };
        assert!(matches!(Inbox::create(0, zero), Err(Error::Config(_))));
        assert!(matches!(InboxLayout::new(1, 0), Err(Error::Config(_))));
        for (size, nslots) in [
            (0, 64),
            (1, 3),
            (1, 2),
            (1, 96),
            (1, ring::MAX_SLOTS * 2),
            (MAX_RANKS + 1, 64),
            (usize::MAX, 64),
            (1, usize::MAX),
        ] {
            assert!(
                matches!(InboxLayout::new(size, nslots), Err(Error::Config(_))),
                "{size} ranks, {nslots} slots"
            );
            let raw = InboxLayout { size, nslots };
            assert!(
                Inbox::create(0, raw).is_err(),
                "{size} ranks, {nslots} slots"
            );
        }
        // A rank outside the layout, and a peer's inbox attached with a bad
        // layout, are refused too.
        let ok = InboxLayout::new(2, 4).unwrap();
        assert!(matches!(
            Inbox::create(2, ok),
            Err(Error::InvalidRank { rank: 2, size: 2 })
        ));
        let mine = Inbox::create(0, ok).unwrap();
        let fds = mine.share_with(1).unwrap().unwrap();
        let bad = InboxLayout { size: 2, nslots: 0 };
        assert!(matches!(
            Inbox::attach(fds, 0, 1, std::process::id(), bad),
            Err(Error::Config(_))
        ));
        // Rings outside the world: None, or a panic, never a read outside.
        assert!(mine.try_ring(2).is_none());
        assert!(mine.try_ring(1).is_some_and(|r| !r.has_message()));
        assert!(std::panic::catch_unwind(|| mine.ring(2).has_message()).is_err());
    }

    #[test]
    fn a_peer_cannot_resize_any_file_of_an_inbox() {
        let layout = layout();
        let mine = Inbox::create(0, layout).unwrap();
        // What a hostile peer holds after the hand-over: the descriptors.
        // It tries to shrink (SIGBUS for every mapper) or grow each file.
        for fd in mine.share_with(1).unwrap().unwrap() {
            let f = std::fs::File::from(fd);
            let e = f.set_len(0).unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
            let e = f.set_len(1 << 20).unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
            // Nor remove the seals or add new ones.
            // SAFETY: F_ADD_SEALS on an open descriptor; no memory effects.
            let r = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_WRITE) };
            assert_eq!(r, -1, "F_SEAL_SEAL forbids more seals");
        }
        // The mappings are intact.
        mine.set_state(3, Ordering::SeqCst);
        assert_eq!(mine.ring(2).nslots(), 64);
    }

    #[test]
    fn a_peer_cannot_write_the_owners_control_page() {
        let layout = layout();
        let mine = Inbox::create(0, layout).unwrap();
        mine.set_state(state::OPEN, Ordering::SeqCst);
        let [control, notice, ring] =
            <[OwnedFd; 3]>::try_from(mine.share_with(2).unwrap().unwrap())
                .ok()
                .unwrap();
        // A writable mapping of the control page is refused...
        // SAFETY: a new mapping of an open descriptor; checked, never used.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                layout.control_len(),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                control.as_raw_fd(),
                0,
            )
        };
        assert_eq!(p, libc::MAP_FAILED);
        assert_eq!(io::Error::last_os_error().raw_os_error(), Some(libc::EPERM));
        // ... and so is write(2) of the owner's state word.
        let f = std::fs::File::from(control);
        let e = f
            .write_at(&state::DEAD.to_le_bytes(), OFF_STATE as u64)
            .unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
        assert_eq!(mine.state(Ordering::SeqCst), state::OPEN);
        // A read-only mapping made writable later is refused too.
        let ro = Mapping::new(&OwnedFd::from(f), layout.control_len(), false).unwrap();
        // SAFETY: mprotect of our own mapping; refused, nothing changes.
        let r = unsafe {
            libc::mprotect(
                ro.base.as_ptr().cast(),
                ro.len,
                libc::PROT_READ | libc::PROT_WRITE,
            )
        };
        assert_eq!(r, -1, "F_SEAL_FUTURE_WRITE keeps it read-only");
        // The notice page and the sender's own ring are writable.
        assert!(Mapping::new(&notice, PAGE, true).is_ok());
        assert!(Mapping::new(&ring, layout.ring_len(), true).is_ok());
    }

    #[test]
    fn each_sender_gets_only_its_own_ring() {
        let layout = layout();
        let mine = Inbox::create(0, layout).unwrap();
        let one = mine.share_with(1).unwrap().unwrap();
        let two = mine.share_with(2).unwrap().unwrap();
        // Same control and notice pages, different rings.
        assert_eq!(inode(&one[0]), inode(&two[0]));
        assert_eq!(inode(&one[1]), inode(&two[1]));
        assert_ne!(inode(&one[2]), inode(&two[2]));
        let me = std::process::id();
        let as_two = Inbox::attach(two, 0, 2, me, layout).unwrap();
        assert!(as_two.has_ring(2));
        assert!(!as_two.has_ring(1), "rank 1's ring into rank 0 is not ours");
        assert!(mine.has_ring(1) && mine.has_ring(2) && mine.has_ring(0));
    }

    #[test]
    fn an_unsealed_inbox_is_refused() {
        let layout = layout();
        // A peer offering ordinary memfds of the right sizes, with a
        // perfect header.
        let plain = |len: usize| {
            let label = CString::new("fake").unwrap();
            // SAFETY: NUL-terminated label; returns a new descriptor.
            let raw = unsafe { libc::memfd_create(label.as_ptr(), libc::MFD_CLOEXEC) };
            assert!(raw >= 0);
            // SAFETY: a fresh descriptor nobody else owns.
            let fd = unsafe { OwnedFd::from_raw_fd(raw) };
            std::fs::File::from(fd.try_clone().unwrap())
                .set_len(len as u64)
                .unwrap();
            fd
        };
        let control = plain(layout.control_len());
        {
            let m = Mapping::new(&control, layout.control_len(), true).unwrap();
            let h = m.base.as_ptr();
            // SAFETY: fresh mapping of at least one page.
            unsafe {
                (h as *mut u64).write(MAGIC);
                (h.add(8) as *mut u32).write(VERSION);
                (h.add(12) as *mut u32).write(1);
                (h.add(16) as *mut u32).write(layout.size as u32);
                (h.add(20) as *mut u32).write(layout.nslots as u32);
                (h.add(24) as *mut u32).write(std::process::id());
            }
        }
        let fds = vec![control, plain(PAGE), plain(layout.ring_len())];
        let e = Inbox::attach(fds, 1, 0, std::process::id(), layout)
            .err()
            .expect("refused");
        assert!(
            matches!(&e, Error::Protocol { rank: 1, what } if what.contains("not sealed")),
            "{e:?}"
        );
    }
}
