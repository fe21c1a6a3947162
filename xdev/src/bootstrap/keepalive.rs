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
#[cfg(test)]
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

/// Applies the options above to `stream` (through `socket2`, which names
/// each option and holds the `setsockopt` calls and their `unsafe`).
pub(crate) fn watch_peer(stream: &TcpStream) -> std::io::Result<()> {
    let s = socket2::SockRef::from(stream);
    s.set_tcp_keepalive(
        &socket2::TcpKeepalive::new()
            .with_time(KEEPALIVE_IDLE)
            .with_interval(KEEPALIVE_INTERVAL)
            .with_retries(KEEPALIVE_PROBES),
    )?;
    s.set_tcp_user_timeout(Some(USER_TIMEOUT))
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
