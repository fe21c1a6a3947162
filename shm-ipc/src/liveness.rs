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

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::thread::JoinHandle;
use std::time::Duration;

use xdev::Rank;

/// How often peers without a pidfd are checked.
pub const FALLBACK_POLL: Duration = Duration::from_millis(100);

/// Watches peer processes; calls back once per peer that exits.
pub struct PeerWatch {
    stop: OwnedFd,
    thread: Option<JoinHandle<()>>,
}

fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor
    // or -1; no memory is passed.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) })
}

fn alive_by_kill(pid: u32) -> bool {
    // SAFETY: signal 0 only checks for existence and permission.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    r == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

enum Watched {
    Pidfd(OwnedFd),
    Kill(u32),
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
        let mut watched = Vec::new();
        let mut exited = Vec::new();
        for (rank, pid) in peers {
            match pidfd_open(pid) {
                Ok(fd) => watched.push((rank, Watched::Pidfd(fd))),
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => exited.push(rank),
                Err(_) => watched.push((rank, Watched::Kill(pid))),
            }
        }
        let thread = std::thread::Builder::new()
            .name("xdev-peer-watch".into())
            .spawn(move || {
                for r in exited {
                    on_exit(r);
                }
                watch(stop_raw, watched, &on_exit);
            })?;
        Ok(PeerWatch {
            stop,
            thread: Some(thread),
        })
    }
}

fn watch(stop: libc::c_int, mut watched: Vec<(Rank, Watched)>, on_exit: &dyn Fn(Rank)) {
    loop {
        let mut fds = vec![libc::pollfd {
            fd: stop,
            events: libc::POLLIN,
            revents: 0,
        }];
        let mut any_kill = false;
        for (_, w) in &watched {
            match w {
                Watched::Pidfd(fd) => fds.push(libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                }),
                Watched::Kill(_) => any_kill = true,
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
        watched.retain(|(rank, w)| {
            let gone = match w {
                Watched::Pidfd(_) => {
                    let r = fds[k].revents;
                    k += 1;
                    r != 0
                }
                Watched::Kill(pid) => !alive_by_kill(*pid),
            };
            if gone {
                on_exit(*rank);
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
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn reports_a_killed_child_and_stops_on_drop() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let (tx, rx) = mpsc::channel();
        let tx = std::sync::Mutex::new(tx);
        let watch = PeerWatch::start(vec![(3, child.id())], move |r| {
            tx.lock().unwrap().send(r).unwrap();
        })
        .unwrap();
        assert!(
            rx.recv_timeout(Duration::from_millis(200)).is_err(),
            "alive"
        );
        child.kill().unwrap();
        // A pidfd becomes readable when the process exits, before it is reaped.
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), 3);
        child.wait().unwrap();
        drop(watch); // joins the thread: must not hang
    }
}
