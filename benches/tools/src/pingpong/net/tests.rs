use super::*;

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A client of the test server on `port`, whose reads time out after `timeout`.
fn client(port: u16, timeout: Duration) -> Link {
    Link::connect("127.0.0.1", port, Duration::from_secs(10), timeout).unwrap()
}

#[test]
fn refused_connection_is_a_clear_error() {
    let port = free_port();
    let e = Link::connect("127.0.0.1", port, Duration::ZERO, Duration::from_secs(1)).unwrap_err();
    let s = e.to_string();
    assert!(
        s.starts_with(&format!("cannot connect to 127.0.0.1:{port}: ")),
        "{s}"
    );
    assert!(s.contains("refused"), "{s}");
    let e = Link::connect(
        "no-such-host.invalid",
        port,
        Duration::ZERO,
        Duration::from_secs(1),
    )
    .unwrap_err();
    assert!(e.to_string().contains("cannot resolve"), "{e}");
}

#[test]
fn accept_times_out() {
    let port = free_port();
    let e = Link::accept(port, Duration::from_millis(50)).unwrap_err();
    assert!(e.to_string().contains("waiting for a client"), "{e}");
}

#[test]
fn exchange_frames_and_detect_a_closed_peer() {
    let port = free_port();
    let server = thread::spawn(move || {
        let mut l = Link::accept(port, Duration::from_secs(10)).unwrap();
        let mut got = [0u8; 3];
        l.xchg(b"srv", &mut got, "test").unwrap();
        assert_eq!(&got, b"cli");
        assert_eq!(l.recv("sync").unwrap(), Message::Sync(9));
        l.send(&Message::Bye).unwrap();
        // wait for the client to close
        let t0 = Instant::now();
        while l.peer_gone().is_none() {
            assert!(t0.elapsed() < Duration::from_secs(10));
            thread::sleep(Duration::from_millis(5));
        }
    });
    let mut c = client(port, Duration::from_secs(10));
    let mut got = [0u8; 3];
    c.xchg(b"cli", &mut got, "test").unwrap();
    assert_eq!(&got, b"srv");
    c.send(&Message::Sync(9)).unwrap();
    assert_eq!(c.recv("bye").unwrap(), Message::Bye);
    // The server is still connected, waiting for this side to close.
    assert_eq!(c.peer_gone(), None);
    drop(c);
    server.join().unwrap();
}

#[test]
fn a_read_times_out_and_eof_means_gone() {
    let port = free_port();
    let server = thread::spawn(move || {
        let l = Link::accept(port, Duration::from_secs(10)).unwrap();
        thread::sleep(Duration::from_millis(200));
        drop(l);
    });
    let mut c = client(port, Duration::from_millis(50));
    let mut b = [0u8; 4];
    let e = c.read(&mut b, "hello").unwrap_err();
    assert!(matches!(e, PingpongError::Timeout { .. }), "{e}");
    c.set_timeout(Duration::from_secs(10)).unwrap();
    let e = c.read(&mut b, "hello").unwrap_err();
    assert!(matches!(e, PingpongError::PeerGone { .. }), "{e}");
    server.join().unwrap();
}

#[test]
fn a_bad_frame_is_a_protocol_error() {
    let port = free_port();
    let server = thread::spawn(move || {
        let mut l = Link::accept(port, Duration::from_secs(10)).unwrap();
        // An unknown kind, then a Reject whose reason is not UTF-8.
        l.write(&[9, 0, 0, 0, 0], "junk").unwrap();
        l.write(&[2, 0, 0, 0, 1, 0xff], "junk").unwrap();
        // Until the client has read both and closed.
        let e = l.read(&mut [0u8; 1], "the close").unwrap_err();
        assert!(matches!(e, PingpongError::PeerGone { .. }), "{e}");
    });
    let mut c = client(port, Duration::from_secs(10));
    let e = c.recv("the greeting").unwrap_err();
    assert!(matches!(e, PingpongError::Protocol(_)), "{e}");
    assert_eq!(
        e.to_string(),
        "protocol error: unknown frame kind 9 (the greeting)"
    );
    let e = c.recv("the parameters").unwrap_err();
    assert_eq!(
        e.to_string(),
        "protocol error: invalid reason (the parameters)"
    );
    drop(c);
    server.join().unwrap();
}
