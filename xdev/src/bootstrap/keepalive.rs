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
mod tests {
    use super::*;
    use crate::bootstrap::{Bootstrap, BootstrapServer, Secret};

    #[test]
    fn options_are_set_on_a_stream() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        assert_eq!(
            get(&c, libc::SOL_SOCKET, libc::SO_KEEPALIVE),
            0,
            "off by default"
        );
        watch_peer(&c).unwrap();
        assert_ne!(get(&c, libc::SOL_SOCKET, libc::SO_KEEPALIVE), 0);
        assert_eq!(get(&c, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE), 5);
        assert_eq!(get(&c, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL), 2);
        assert_eq!(get(&c, libc::IPPROTO_TCP, libc::TCP_KEEPCNT), 5);
        assert_eq!(get(&c, libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT), 15_000);
    }

    #[test]
    fn both_ends_of_a_bootstrap_connection_watch_their_peer() {
        let secret = Secret::generate().unwrap();
        let server =
            BootstrapServer::start("127.0.0.1:0".parse().unwrap(), 1, "ka", secret.clone())
                .unwrap();
        let boot = Bootstrap::connect(server.addr(), 0, 1, "ka", &secret).unwrap();
        let local = boot.with_stream_for_tests(|stream| {
            assert_eq!(
                get(stream, libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT),
                15_000
            );
            assert_ne!(get(stream, libc::SOL_SOCKET, libc::SO_KEEPALIVE), 0);
            stream.local_addr().unwrap()
        });
        // The service's end: the socket whose peer is the rank's end.
        let service_end = server.with_socket_for_tests(local, |s| {
            (
                get(s, libc::SOL_SOCKET, libc::SO_KEEPALIVE),
                get(s, libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT),
            )
        });
        let (keepalive, timeout) = service_end.expect("the service holds the rank's connection");
        assert_ne!(keepalive, 0);
        assert_eq!(timeout, 15_000);
    }
}
