//! Departures on the PMIx and PMI backends, where the launcher reports none
//! (PMI) or not always (PMIx): the ranks on this host watch each other's
//! processes.
//!
//! With the first allgather, each rank publishes its pid, its pid namespace
//! and the kernel's boot id. A rank then opens a pidfd for every other rank
//! with the same boot id and pid namespace (a process on this host that this
//! process can name) and one background thread polls them: a pidfd turns
//! readable when its process has exited, and the rank is recorded as
//! departed (not cleanly: an exit says nothing about how). Ranks on other
//! hosts are not watched; where `pidfd_open` is missing (Linux before 5.3)
//! nothing is.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Mutex, MutexGuard, OnceLock};

use super::Departure;
use crate::Rank;

/// The departures seen so far.
static DEPARTED: Mutex<Vec<Departure>> = Mutex::new(Vec::new());
/// Set once the watch has been set up (or found impossible).
static STARTED: OnceLock<()> = OnceLock::new();

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether the watch was set up already (the caller then publishes nothing).
pub(crate) fn started() -> bool {
    STARTED.get().is_some()
}

fn pid_namespace() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid")
        .map(|m| m.ino())
        .unwrap_or(0)
}

/// This process's record: pid (4 bytes LE), pid namespace inode (8 bytes
/// LE), then the boot id.
pub(crate) fn my_record() -> Vec<u8> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let mut r = std::process::id().to_le_bytes().to_vec();
    r.extend_from_slice(&pid_namespace().to_le_bytes());
    r.extend_from_slice(boot.trim().as_bytes());
    r
}

/// The peers of `me` to watch among `records` (rank order): the pids of
/// the ranks whose boot id and pid namespace are this process's (both
/// known), except `me`.
///
/// A record is not tied to its putter under PMI, so a pid is watched only
/// if it is a process of this user other than this one, and no two ranks
/// name the same pid (such ranks are left unwatched: one of them poses as
/// the other, and its owner fails the job, see `front::owned_record_intact`).
pub(crate) fn peers_to_watch(me: Rank, mine: &[u8], records: &[Vec<u8>]) -> Vec<(Rank, u32)> {
    if mine.len() <= 12 || mine[4..12] == [0; 8] {
        return Vec::new();
    }
    let pid_of = |rec: &[u8]| u32::from_le_bytes(rec[..4].try_into().expect("4 bytes"));
    let own = pid_of(mine);
    let local: Vec<(Rank, u32)> = records
        .iter()
        .enumerate()
        .filter(|&(r, rec)| r != me && rec.len() == mine.len() && rec[4..] == mine[4..])
        .map(|(r, rec)| (r, pid_of(rec)))
        .filter(|&(_, pid)| pid != 0 && pid != own)
        .collect();
    local
        .iter()
        .filter(|&&(r, pid)| !local.iter().any(|&(o, p)| o != r && p == pid))
        .filter(|&&(_, pid)| same_user(pid))
        .copied()
        .collect()
}

/// Whether process `pid` exists and belongs to this process's real user.
fn same_user(pid: u32) -> bool {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: getuid has no preconditions.
    let me = unsafe { libc::getuid() };
    std::fs::metadata(format!("/proc/{pid}")).is_ok_and(|m| m.uid() == me)
}

/// Starts watching `peers` (rank, pid), once per process.
pub(crate) fn start(peers: Vec<(Rank, u32)>) {
    STARTED.get_or_init(|| {
        let mut fds: Vec<(Rank, OwnedFd)> = Vec::new();
        for (rank, pid) in peers {
            let pid = rustix::process::Pid::from_raw(pid as i32);
            match pid.map(|p| rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()))
            {
                Some(Ok(fd)) => fds.push((rank, fd)),
                // Already gone.
                Some(Err(rustix::io::Errno::SRCH)) => add(rank),
                _ => {}
            }
        }
        if !fds.is_empty() {
            let _ = std::thread::Builder::new()
                .name("xdev-peer-watch".into())
                .spawn(move || watch(fds));
        }
    });
}

fn add(rank: Rank) {
    let mut d = lock(&DEPARTED);
    if !d.iter().any(|x| x.rank == rank) {
        d.push(Departure { rank, clean: false });
    }
}

fn watch(mut fds: Vec<(Rank, OwnedFd)>) {
    while !fds.is_empty() {
        let mut polls: Vec<libc::pollfd> = fds
            .iter()
            .map(|(_, fd)| libc::pollfd {
                fd: fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        // SAFETY: `polls` is a valid array of `polls.len()` pollfds.
        let n = unsafe { libc::poll(polls.as_mut_ptr(), polls.len() as libc::nfds_t, -1) };
        if n < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return;
        }
        let mut i = 0;
        fds.retain(|(rank, _)| {
            let gone = polls[i].revents != 0;
            i += 1;
            if gone {
                add(*rank);
            }
            !gone
        });
    }
}

/// The ranks seen gone, in the order they were seen.
pub(crate) fn departures() -> Vec<Departure> {
    lock(&DEPARTED).clone()
}

#[cfg(test)]
mod tests;
