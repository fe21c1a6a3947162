//! Dead-host detection on bootstrap connections. A crashed process closes
//! its connection at once, but a crashed host or a network partition closes
//! nothing: without these options a rank's departure from another host would
//! go unnoticed, and a receive from it would wait forever.
//!
//! Every bootstrap connection (the rank's and the service's side) gets TCP
//! keepalive probes after [`KEEPALIVE_IDLE`] of silence, every
//! [`KEEPALIVE_INTERVAL`], [`KEEPALIVE_PROBES`] unanswered ones ending the
//! connection, and `TCP_USER_TIMEOUT` of [`USER_TIMEOUT`], which ends it when
//! data sent stays unacknowledged that long. A dead host is so noticed
//! within about 15 seconds, as a closed connection: the service announces
//! the departure of the ranks it lost, and a rank learns that its service
//! is gone.

use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::Duration;

/// Silence before the first keepalive probe.
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(5);
/// Time between unanswered probes.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);
/// Unanswered probes that end the connection.
pub const KEEPALIVE_PROBES: u32 = 5;
/// How long sent data may stay unacknowledged before the connection ends.
pub const USER_TIMEOUT: Duration = Duration::from_secs(15);

/// Applies the options above to `stream`.
pub(crate) fn watch_peer(stream: &TcpStream) -> std::io::Result<()> {
    let secs = |d: Duration| d.as_secs() as libc::c_int;
    set(stream, libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1)?;
    set(
        stream,
        libc::IPPROTO_TCP,
        libc::TCP_KEEPIDLE,
        secs(KEEPALIVE_IDLE),
    )?;
    set(
        stream,
        libc::IPPROTO_TCP,
        libc::TCP_KEEPINTVL,
        secs(KEEPALIVE_INTERVAL),
    )?;
    set(
        stream,
        libc::IPPROTO_TCP,
        libc::TCP_KEEPCNT,
        KEEPALIVE_PROBES as libc::c_int,
    )?;
    let ms = USER_TIMEOUT.as_millis() as libc::c_int;
    set(stream, libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT, ms)
}

fn set(
    s: &TcpStream,
    level: libc::c_int,
    name: libc::c_int,
    value: libc::c_int,
) -> std::io::Result<()> {
    // SAFETY: the fd is the stream's, open for the call; the option value
    // is a c_int read by the kernel for the given length.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            level,
            name,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
fn get(s: &TcpStream, level: libc::c_int, name: libc::c_int) -> libc::c_int {
    let mut value: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: value and len are valid out-pointers for a c_int option.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            level,
            name,
            (&mut value as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    assert_eq!(r, 0, "getsockopt: {}", std::io::Error::last_os_error());
    value
}

#[cfg(test)]
mod tests;
