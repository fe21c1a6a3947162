use std::net::{TcpListener, TcpStream};

use super::*;

#[test]
fn addresses_are_written_as_proc_net_tcp_does() {
    let a: SocketAddr = "127.0.0.1:8080".parse().unwrap();
    if cfg!(target_endian = "little") {
        assert_eq!(proc_net_addr(a, false).unwrap(), "0100007F:1F90");
        assert_eq!(
            proc_net_addr(a, true).unwrap(),
            "0000000000000000FFFF00000100007F:1F90"
        );
        let b: SocketAddr = "[::1]:1".parse().unwrap();
        assert_eq!(
            proc_net_addr(b, true).unwrap(),
            "00000000000000000000000001000000:0001"
        );
    }
    let b: SocketAddr = "[::1]:1".parse().unwrap();
    assert_eq!(proc_net_addr(b, false), None);
    let mapped: SocketAddr = "[::ffff:127.0.0.1]:8080".parse().unwrap();
    assert_eq!(proc_net_addr(mapped, false), proc_net_addr(a, false));
}

#[test]
fn the_owner_of_a_loopback_peer_is_found() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let client = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (server_side, peer) = l.accept().unwrap();
    assert_eq!(peer, client.local_addr().unwrap());
    let local = server_side.local_addr().unwrap();
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    match local_owner(local, peer) {
        Owner::Unknown => {} // no /proc/net here: nothing to check
        other => assert_eq!(other, Owner::Uid(me)),
    }
    assert!(peer_allowed(local, peer));
    // A port nobody uses is no socket of this host.
    drop(client);
    let gone: SocketAddr = "127.0.0.1:1".parse().unwrap();
    assert_ne!(local_owner(local, gone), Owner::Uid(me));
    assert!(
        find_owner(
            "header\n 0: 0100007F:0001 0100007F:0002 01 0:0 0:0 0 1234 0 1\n",
            "0100007F:0001",
            "0100007F:0002"
        ) == Some(1234)
    );
    assert_eq!(
        find_owner(
            "header\n 0: 0100007F:0001 0100007F:0002 06 0:0 0:0 0 0 0 1\n",
            "0100007F:0001",
            "0100007F:0002"
        ),
        None,
        "TIME_WAIT has no owner"
    );
}
