//! Hands a file descriptor (an inbox's sealed memfd) to the other ranks of
//! a job over a Unix socket (`SCM_RIGHTS`), without any name in a file
//! system and without ptrace rights (which `pidfd_getfd` and
//! `/proc/PID/fd` need, and which a non-dumpable process or Yama denies).
//!
//! The owner listens on an abstract-namespace socket under an unguessable
//! name (128 random bits) and gives its descriptor only to connections whose
//! kernel-reported credentials (`SO_PEERCRED`) are this user and one of the
//! job's processes, as published through the bootstrap.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a hand-over waits for the peers (the bootstrap's own bound).
const WAIT: Duration = xdev::bootstrap::CONNECT_TIMEOUT;

/// A listening socket that will hand out one descriptor.
pub(crate) struct FdOffer {
    listener: UnixListener,
    name: String,
}

/// The abstract socket name of an offer (`xdev-fd-` and 32 hex digits).
pub(crate) fn valid_offer_name(name: &str) -> bool {
    name.strip_prefix("xdev-fd-")
        .is_some_and(|h| h.len() == 32 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

impl FdOffer {
    /// Listens under a fresh random abstract name.
    pub(crate) fn listen() -> io::Result<FdOffer> {
        let mut rnd = [0u8; 16];
        getrandom::fill(&mut rnd).map_err(|e| io::Error::other(e.to_string()))?;
        let hex = hex::encode(rnd);
        let name = format!("xdev-fd-{hex}");
        let addr = SocketAddr::from_abstract_name(name.as_bytes())?;
        let listener = UnixListener::bind_addr(&addr)?;
        listener.set_nonblocking(true)?;
        Ok(FdOffer { listener, name })
    }

    /// The name peers connect to.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Hands each process in `handouts` its descriptors, once (the process
    /// is checked by the kernel's account of the connecting end, and must be
    /// this user's), in a thread; its result says whether all were served
    /// within the bootstrap's connect timeout.
    ///
    /// A connection of another user gets nothing and is forgotten. A
    /// connection of this user from a process that is none of `handouts`,
    /// or that was served already, ends the hand-over with an error of kind
    /// [`io::ErrorKind::PermissionDenied`]: only the job's ranks know the
    /// offer's name, so such a process is a rank whose view of the job's
    /// records differs from ours (a record replaced by another rank).
    pub(crate) fn serve(
        self,
        mut handouts: Vec<(u32, Vec<OwnedFd>)>,
    ) -> JoinHandle<io::Result<()>> {
        std::thread::spawn(move || {
            let deadline = Instant::now() + WAIT;
            let me = my_uid();
            let mut served: Vec<u32> = Vec::with_capacity(handouts.len());
            while !handouts.is_empty() {
                match self.listener.accept() {
                    Ok((s, _)) => {
                        let Ok((pid, uid)) = peer_cred(&s) else {
                            continue;
                        };
                        if uid != me {
                            continue; // not this user's: nothing to say to it
                        }
                        let Some(at) = handouts.iter().position(|(p, _)| *p == pid) else {
                            let why = if served.contains(&pid) {
                                "came a second time"
                            } else {
                                "is none of the processes the job's records name"
                            };
                            return Err(io::Error::new(
                                io::ErrorKind::PermissionDenied,
                                format!(
                                    "process {pid} asked for the inbox and {why}: another rank's \
                                     record may have been replaced"
                                ),
                            ));
                        };
                        if s.set_nonblocking(false).is_err() {
                            continue;
                        }
                        // A rank that connected and went away is its own
                        // problem; the others are still served.
                        if send_fds(&s, &handouts[at].1).is_ok() {
                            served.push(pid);
                            handouts.swap_remove(at);
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        if Instant::now() > deadline {
                            let pids: Vec<u32> = handouts.iter().map(|(p, _)| *p).collect();
                            return Err(io::Error::new(
                                io::ErrorKind::TimedOut,
                                format!("processes {pids:?} did not come for the inbox"),
                            ));
                        }
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        })
    }
}

fn my_uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// At most this many descriptors go in one hand-over.
pub(crate) const MAX_FDS: usize = 4;

/// Connects to the offer `name`, checks that the process serving it is
/// `owner` (the pid the offering rank published) and this user's, and
/// receives exactly `count` descriptors.
///
/// A server that is another process fails with an error of kind
/// [`io::ErrorKind::PermissionDenied`] before anything is received: the
/// record that named `name` was not put by the process it names.
pub(crate) fn take(name: &str, count: usize, owner: u32) -> io::Result<Vec<OwnedFd>> {
    let addr = SocketAddr::from_abstract_name(name.as_bytes())?;
    let s = UnixStream::connect_addr(&addr)?;
    let (pid, uid) = peer_cred(&s)?;
    if pid != owner || uid != my_uid() {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "the inbox is served by process {pid} (uid {uid}), not by the published \
                 process {owner} of this user: its record was replaced by another process"
            ),
        ));
    }
    s.set_read_timeout(Some(WAIT))?;
    let got = recv_fds(&s)?;
    if got.len() != count {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} descriptors came, expected {count}", got.len()),
        ));
    }
    Ok(got)
}

/// The pid and uid of the process at the other end of `s`.
fn peer_cred(s: &UnixStream) -> io::Result<(u32, u32)> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid out-pointers for SO_PEERCRED.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((cred.pid as u32, cred.uid))
}

/// Room for the control message of [`MAX_FDS`] descriptors.
const CMSG_ROOM: usize = 64;

fn send_fds(s: &UnixStream, fds: &[OwnedFd]) -> io::Result<()> {
    assert!((1..=MAX_FDS).contains(&fds.len()));
    let mut byte = [1u8];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut control = [0u64; CMSG_ROOM / 8]; // aligned for cmsghdr
    let data_len = (fds.len() * std::mem::size_of::<RawFd>()) as u32;
    // SAFETY: an all-zero msghdr is valid; the fields are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE computes a size; no memory is touched.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE(data_len) } as _;
    // SAFETY: msg_control points at `control`, which is larger than
    // CMSG_SPACE(MAX_FDS descriptors); the header and data are written
    // inside it.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(data_len) as _;
        let data = libc::CMSG_DATA(c).cast::<RawFd>();
        for (k, fd) in fds.iter().enumerate() {
            std::ptr::write_unaligned(data.add(k), fd.as_raw_fd());
        }
    }
    // SAFETY: msg describes valid buffers for the call.
    let n = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n == 1 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn recv_fds(s: &UnixStream) -> io::Result<Vec<OwnedFd>> {
    let mut byte = [0u8];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut control = [0u64; CMSG_ROOM / 8];
    // SAFETY: an all-zero msghdr is valid; the fields are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = CMSG_ROOM as _;
    // SAFETY: msg describes valid buffers; MSG_CMSG_CLOEXEC marks the
    // received descriptors close-on-exec.
    let n = unsafe { libc::recvmsg(s.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n != 1 {
        return Err(if n < 0 {
            io::Error::last_os_error()
        } else {
            io::Error::new(io::ErrorKind::UnexpectedEof, "no descriptor came")
        });
    }
    let mut got = Vec::new();
    // SAFETY: the kernel filled msg_control up to msg_controllen; CMSG_FIRSTHDR
    // and CMSG_NXTHDR stay inside it, and each SCM_RIGHTS payload holds
    // descriptors the kernel installed for us (we own them from here on).
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let header = libc::CMSG_LEN(0) as usize;
                let count =
                    ((*c).cmsg_len as usize).saturating_sub(header) / std::mem::size_of::<RawFd>();
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                for k in 0..count {
                    got.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(k))));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "more descriptors came than were expected",
        ));
    }
    Ok(got)
}

#[cfg(test)]
mod tests;
