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
        let hex: String = rnd.iter().map(|b| format!("{b:02x}")).collect();
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

    /// Hands `fd` once to each process in `pids` (checked by the kernel's
    /// account of the connecting process, and of this user), in a thread;
    /// its result says whether all were served within the bootstrap's
    /// connect timeout. Connections from anyone else get nothing.
    pub(crate) fn serve(self, fd: OwnedFd, mut pids: Vec<u32>) -> JoinHandle<io::Result<()>> {
        std::thread::spawn(move || {
            let deadline = Instant::now() + WAIT;
            // SAFETY: geteuid has no preconditions.
            let me = unsafe { libc::geteuid() };
            while !pids.is_empty() {
                match self.listener.accept() {
                    Ok((s, _)) => {
                        let Ok((pid, uid)) = peer_cred(&s) else {
                            continue;
                        };
                        let Some(at) = pids.iter().position(|&p| p == pid) else {
                            continue; // not one of the job's ranks (or served)
                        };
                        if uid != me || s.set_nonblocking(false).is_err() {
                            continue;
                        }
                        // A rank that connected and went away is its own
                        // problem; the others are still served.
                        if send_fd(&s, fd.as_raw_fd()).is_ok() {
                            pids.swap_remove(at);
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        if Instant::now() > deadline {
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

/// Connects to the offer `name` and receives its descriptor.
pub(crate) fn take(name: &str) -> io::Result<OwnedFd> {
    let addr = SocketAddr::from_abstract_name(name.as_bytes())?;
    let s = UnixStream::connect_addr(&addr)?;
    s.set_read_timeout(Some(WAIT))?;
    recv_fd(&s)
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

/// Room for one descriptor's control message.
const CMSG_ROOM: usize = 64;

fn send_fd(s: &UnixStream, fd: RawFd) -> io::Result<()> {
    let mut byte = [1u8];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut control = [0u8; CMSG_ROOM];
    // SAFETY: an all-zero msghdr is valid; the fields are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE computes a size; no memory is touched.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as _;
    // SAFETY: msg_control points at `control`, which is larger than
    // CMSG_SPACE(one fd); the header and data are written inside it.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<RawFd>(), fd);
    }
    // SAFETY: msg describes valid buffers for the call.
    let n = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n == 1 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn recv_fd(s: &UnixStream) -> io::Result<OwnedFd> {
    let mut byte = [0u8];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut control = [0u8; CMSG_ROOM];
    // SAFETY: an all-zero msghdr is valid; the fields are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = control.len() as _;
    // SAFETY: msg describes valid buffers; MSG_CMSG_CLOEXEC marks the
    // received descriptor close-on-exec.
    let n = unsafe { libc::recvmsg(s.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n != 1 {
        return Err(if n < 0 {
            io::Error::last_os_error()
        } else {
            io::Error::new(io::ErrorKind::UnexpectedEof, "no descriptor came")
        });
    }
    // SAFETY: the kernel filled msg_control (up to msg_controllen); the
    // header pointers stay inside `control`.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        if c.is_null()
            || (*c).cmsg_level != libc::SOL_SOCKET
            || (*c).cmsg_type != libc::SCM_RIGHTS
            || (*c).cmsg_len < libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "no descriptor in the message",
            ));
        }
        let fd = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<RawFd>());
        Ok(OwnedFd::from_raw_fd(fd))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hands_a_descriptor_to_this_process_only_when_it_is_in_the_job() {
        let offer = FdOffer::listen().unwrap();
        assert!(valid_offer_name(offer.name()));
        let name = offer.name().to_string();
        let file = std::fs::File::open("/proc/self/status").unwrap();
        let copy = || OwnedFd::from(file.try_clone().unwrap());
        let server = offer.serve(copy(), vec![std::process::id()]);
        let got = take(&name).unwrap();
        server.join().unwrap().unwrap();
        // The same open file: its inode matches.
        let a = std::fs::metadata(format!("/proc/self/fd/{}", got.as_raw_fd())).unwrap();
        let b = file.metadata().unwrap();
        use std::os::unix::fs::MetadataExt;
        assert_eq!((a.dev(), a.ino()), (b.dev(), b.ino()));

        // A process outside the job's pids gets nothing.
        let offer = FdOffer::listen().unwrap();
        let name = offer.name().to_string();
        let server = offer.serve(copy(), vec![1]);
        let e = take(&name).unwrap_err();
        assert!(
            matches!(
                e.kind(),
                io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset
            ),
            "{e}"
        );
        assert!(!server.is_finished(), "still waiting for pid 1");
        // Nobody else is listening under an offer name that was not made.
        assert!(take("xdev-fd-00000000000000000000000000000000").is_err());
    }
}
