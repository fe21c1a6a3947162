//! [`PeerWatch`]: notices at once when a peer process exits, however it
//! exits (including `SIGKILL`), at no cost to the data path.
//!
//! One background thread per device sleeps in `poll(2)` on a pidfd per peer
//! (`pidfd_open(2)`, Linux 5.3+), which becomes readable when that process
//! exits, and on an eventfd that stops the watch. Where a pidfd cannot be
//! had (an old kernel, another pid namespace), that peer is checked with
//! `kill(pid, 0)` every [`FALLBACK_POLL`]. A pid was taken while the peer was
//! alive (it published it itself, and the bootstrap barrier that follows
//! proves it was still there), so pid reuse before the pidfd is opened would
//! need the peer to die and its pid to be recycled within that window.
//!
//! The same pidfds answer [`PeerWatch::has_exited`] on the data path: the
//! process device asks right before each CMA call (which names the peer by
//! pid, as `process_vm_readv(2)` and `process_vm_writev(2)` require), so
//! that it never copies from or into whatever process got a dead peer's pid.
//! An exited process's pid can only be reused once it is reaped, and a
//! pidfd turns readable at the exit, before the reaping.

use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use xdev::Rank;

/// How often peers without a pidfd are checked.
pub const FALLBACK_POLL: Duration = Duration::from_millis(100);

/// Watches peer processes; calls back once per peer that exits.
pub struct PeerWatch {
    stop: OwnedFd,
    thread: Option<JoinHandle<()>>,
    /// How each peer is watched, by rank (shared with the watch thread).
    peers: Arc<[Option<Watched>]>,
}

fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    let pid = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
        .ok_or_else(|| io::Error::from_raw_os_error(libc::ESRCH))?;
    Ok(rustix::process::pidfd_open(
        pid,
        rustix::process::PidfdFlags::empty(),
    )?)
}

fn alive_by_kill(pid: u32) -> bool {
    // SAFETY: signal 0 only checks for existence and permission.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    r == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

enum Watched {
    Pidfd(OwnedFd),
    Kill(u32),
    /// Already gone when the watch started (`pidfd_open` said `ESRCH`).
    Exited,
}

impl Watched {
    /// Whether the process has exited, without blocking.
    fn exited_now(&self) -> bool {
        match self {
            Watched::Pidfd(fd) => {
                let mut p = libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                loop {
                    // SAFETY: one live pollfd, a zero timeout.
                    let n = unsafe { libc::poll(&mut p, 1, 0) };
                    if n >= 0 {
                        // Readable (or an error on the pidfd): exited.
                        return p.revents != 0;
                    }
                    if io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                        // Cannot tell (not expected): the safe answer.
                        return true;
                    }
                }
            }
            Watched::Kill(pid) => !alive_by_kill(*pid),
            Watched::Exited => true,
        }
    }
}

impl PeerWatch {
    /// Starts watching `peers` (rank, pid). `on_exit(rank)` runs on the
    /// watch thread, once per peer, when its process has exited.
    pub fn start(
        peers: Vec<(Rank, u32)>,
        on_exit: impl Fn(Rank) + Send + 'static,
    ) -> io::Result<PeerWatch> {
        // SAFETY: eventfd takes an initial value and flags; returns a new fd.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if efd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: efd is a fresh descriptor that nothing else owns.
        let stop = unsafe { OwnedFd::from_raw_fd(efd) };
        let stop_raw = stop.as_raw_fd();
        let n = peers.iter().map(|&(r, _)| r + 1).max().unwrap_or(0);
        let mut table: Vec<Option<Watched>> = (0..n).map(|_| None).collect();
        for (rank, pid) in peers {
            table[rank] = Some(match pidfd_open(pid) {
                Ok(fd) => Watched::Pidfd(fd),
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Watched::Exited,
                Err(_) => Watched::Kill(pid),
            });
        }
        let table: Arc<[Option<Watched>]> = table.into();
        let shared = table.clone();
        let thread = std::thread::Builder::new()
            .name("xdev-peer-watch".into())
            .spawn(move || {
                let mut live = Vec::new();
                for (r, w) in shared.iter().enumerate() {
                    match w {
                        Some(Watched::Exited) => on_exit(r),
                        Some(_) => live.push(r),
                        None => {}
                    }
                }
                watch(stop_raw, &shared, live, &on_exit);
            })?;
        Ok(PeerWatch {
            stop,
            thread: Some(thread),
            peers: table,
        })
    }

    /// Whether `rank`'s process has exited, asked now of its pidfd (without
    /// blocking; where no pidfd could be had, of `kill(pid, 0)`, which a
    /// recycled pid fools). False for a rank not watched.
    pub fn has_exited(&self, rank: Rank) -> bool {
        self.peers
            .get(rank)
            .and_then(Option::as_ref)
            .is_some_and(Watched::exited_now)
    }

    /// `rank`'s pidfd, where it is watched by one.
    pub fn pidfd(&self, rank: Rank) -> Option<std::os::fd::BorrowedFd<'_>> {
        match self.peers.get(rank)?.as_ref()? {
            Watched::Pidfd(fd) => Some(fd.as_fd()),
            _ => None,
        }
    }
}

fn watch(
    stop: libc::c_int,
    peers: &[Option<Watched>],
    mut live: Vec<Rank>,
    on_exit: &dyn Fn(Rank),
) {
    loop {
        let mut fds = vec![libc::pollfd {
            fd: stop,
            events: libc::POLLIN,
            revents: 0,
        }];
        let mut any_kill = false;
        for &r in &live {
            match &peers[r] {
                Some(Watched::Pidfd(fd)) => fds.push(libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                }),
                _ => any_kill = true,
            }
        }
        let timeout = if any_kill {
            FALLBACK_POLL.as_millis() as libc::c_int
        } else {
            -1
        };
        // SAFETY: fds is a live array of fds.len() pollfd structs.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
        if n < 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            // Cannot watch any more (not expected): stop quietly; waits are
            // still bounded by their sleep timeouts and the state words.
            return;
        }
        if fds[0].revents != 0 {
            return;
        }
        let mut k = 1;
        live.retain(|&rank| {
            let gone = match &peers[rank] {
                Some(Watched::Pidfd(_)) => {
                    let r = fds[k].revents;
                    k += 1;
                    r != 0
                }
                Some(w) => w.exited_now(),
                None => true,
            };
            if gone {
                on_exit(rank);
            }
            !gone
        });
    }
}

impl Drop for PeerWatch {
    fn drop(&mut self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our eventfd.
        unsafe { libc::write(self.stop.as_raw_fd(), (&one as *const u64).cast(), 8) };
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests;
