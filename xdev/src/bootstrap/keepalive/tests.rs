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
        BootstrapServer::start("127.0.0.1:0".parse().unwrap(), 1, "ka", secret.clone()).unwrap();
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
