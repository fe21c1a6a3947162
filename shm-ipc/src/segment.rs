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

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use xdev::{Error, Rank, Result};

use crate::doorbell::DoorbellRef;
use crate::ring::{self, RingRef};

const MAGIC: u64 = u64::from_le_bytes(*b"XDEVSHM2");
/// The layout's version: 4 since the rings' 32-byte slots and short
/// messages (a peer of another version is refused at attach).
const VERSION: u32 = 4;
const PAGE: usize = 4096;

// Control page.
const OFF_STATE: usize = 64;
/// In the state's line: whether the owner is idle for receiving (see
/// [`Inbox::idle`]); written at most twice per window of messages.
const OFF_IDLE: usize = OFF_STATE + 8;
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

/// A new sealed memfd of `len` zero bytes (`rustix`: memfd_create,
/// ftruncate and F_ADD_SEALS without `unsafe`).
fn sealed_memfd(label: &str, len: usize, extra_seals: libc::c_int) -> Result<OwnedFd> {
    use rustix::fs::MemfdFlags;
    let fd = rustix::fs::memfd_create(label, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
        .map_err(|e| os("memfd_create for the inbox", e.into()))?;
    rustix::fs::ftruncate(&fd, len as u64).map_err(|e| os("ftruncate of the inbox", e.into()))?;
    seal(&fd, SEALS | extra_seals)?;
    Ok(fd)
}

fn seal(fd: &OwnedFd, seals: libc::c_int) -> Result<()> {
    rustix::fs::fcntl_add_seals(fd, rustix::fs::SealFlags::from_bits_retain(seals as u32))
        .map_err(|e| os("sealing the inbox", e.into()))
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

    /// Whether the owner said it has nothing to receive now: no receive
    /// posted and no rendezvous copy of its own under way (see
    /// [`set_idle`](Self::set_idle)). A hint, which a hostile owner may
    /// falsify at will: it only decides whether a peer asks the owner to
    /// write half of a large copy, which the owner may always be asked
    /// (its rendezvous header says so too).
    pub fn idle(&self) -> bool {
        // An atomic load of read-only memory (a peer's view) is allowed.
        // Relaxed: a hint; a peer reads it after a rendezvous header of
        // ours (an Acquire in the ring), and we store it before pushing one.
        self.control
            .word::<AtomicU32>(OFF_IDLE)
            .load(Ordering::Relaxed)
            != 0
    }

    /// Publishes whether we are idle for receiving (see [`idle`](Self::idle);
    /// the word starts at 0, busy, until the first publication).
    ///
    /// # Panics
    /// On a peer's inbox, which is not ours to write (and mapped read-only).
    pub fn set_idle(&self, idle: bool) {
        assert!(self.is_own, "a peer's idle word is not ours to write");
        self.control
            .word::<AtomicU32>(OFF_IDLE)
            .store(u32::from(idle), Ordering::Relaxed);
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
        // aligned (so 64-byte aligned), zero-filled by ftruncate before use,
        // and lives as long as self; nslots passed `InboxLayout::check` when
        // the inbox was made (a valid slot count). So `from_raw`'s checks
        // hold, and are not repeated on every poll.
        Some(unsafe { RingRef::from_checked(m.base, self.layout.nslots) })
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
mod tests;
