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
        (1, 4),
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
    let ok = InboxLayout::new(2, 8).unwrap();
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
    let [control, notice, ring] = <[OwnedFd; 3]>::try_from(mine.share_with(2).unwrap().unwrap())
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
        let fd = rustix::fs::memfd_create("fake", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
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
