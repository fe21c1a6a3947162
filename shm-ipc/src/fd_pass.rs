//! Hands a file descriptor (an inbox's sealed memfd) to the other ranks of
//! a job over a Unix socket (`SCM_RIGHTS`), without any name in a file
//! system and without ptrace rights (which `pidfd_getfd` and
//! `/proc/PID/fd` need, and which a non-dumpable process or Yama denies).
//!
//! The owner listens on an abstract-namespace socket under an unguessable
//! name (128 random bits) and gives its descriptor only to connections whose
//! kernel-reported credentials (`SO_PEERCRED`) are this user and one of the
//! job's processes, as published through the bootstrap.

use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
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
const CMSG_ROOM: usize = rustix::cmsg_space!(ScmRights(MAX_FDS));

/// Sends one byte with `fds` attached (`SCM_RIGHTS`, through `rustix`,
/// which builds the control message without `unsafe` here).
fn send_fds(s: &UnixStream, fds: &[OwnedFd]) -> io::Result<()> {
    use rustix::net::{sendmsg, SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    assert!((1..=MAX_FDS).contains(&fds.len()));
    let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(AsFd::as_fd).collect();
    let mut space = [MaybeUninit::<u8>::uninit(); CMSG_ROOM];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(&borrowed)) {
        return Err(io::Error::other(
            "descriptors do not fit the control buffer",
        ));
    }
    let n = sendmsg(s, &[IoSlice::new(&[1])], &mut control, SendFlags::NOSIGNAL)?;
    if n == 1 {
        Ok(())
    } else {
        Err(io::Error::new(
            io::ErrorKind::WriteZero,
            "the byte was not sent",
        ))
    }
}

/// Receives one byte and the descriptors attached to it, close-on-exec; more
/// than [`MAX_FDS`] (a truncated control message) is an error.
fn recv_fds(s: &UnixStream) -> io::Result<Vec<OwnedFd>> {
    use rustix::net::{recvmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags};
    let mut byte = [0u8];
    let mut space = [MaybeUninit::<u8>::uninit(); CMSG_ROOM];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let r = recvmsg(
        s,
        &mut [IoSliceMut::new(&mut byte)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    // Take ownership of whatever came before any check, so nothing leaks.
    let mut got = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = m {
            got.extend(fds);
        }
    }
    if r.bytes != 1 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "no descriptor came",
        ));
    }
    if r.flags.contains(ReturnFlags::CTRUNC) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "more descriptors came than were expected",
        ));
    }
    Ok(got)
}

#[cfg(test)]
mod tests;
