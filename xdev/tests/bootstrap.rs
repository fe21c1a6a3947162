//! The bootstrap service and client in one process: ranks as threads, plus
//! raw TCP connections playing stray or hostile clients.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::Sha256;
use xdev::bootstrap::{
    Bootstrap, BootstrapServer, Departure, JobEnv, Secret, ServerOptions, SERVICE,
};
use xdev::devkit::wire::{self, Message, MAX_FRAME_LEN, MAX_HANDSHAKE_FRAME_LEN};
use xdev::Error;

const JOB: &str = "test-job";

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn start(size: usize) -> (BootstrapServer, Secret) {
    start_with(size, ServerOptions::default())
}

fn start_with(size: usize, opts: ServerOptions) -> (BootstrapServer, Secret) {
    let secret = Secret::generate().unwrap();
    let server = BootstrapServer::start_with(loopback(), size, JOB, secret.clone(), opts).unwrap();
    (server, secret)
}

fn join(server: &BootstrapServer, secret: &Secret, rank: usize) -> Bootstrap {
    Bootstrap::connect(server.addr(), rank, server.size(), JOB, secret).unwrap()
}

/// Ends the whole test process if the test holding the guard has not
/// finished within `limit`: a broken service must fail the run, not hang it.
struct Watchdog(Arc<std::sync::atomic::AtomicBool>);

fn watchdog(name: &'static str, limit: Duration) -> Watchdog {
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let d = done.clone();
    thread::spawn(move || {
        let end = Instant::now() + limit;
        while Instant::now() < end {
            if d.load(std::sync::atomic::Ordering::SeqCst) {
                return;
            }
            thread::sleep(Duration::from_millis(20));
        }
        eprintln!("test {name} hung for {limit:?}; aborting");
        std::process::exit(101);
    });
    Watchdog(done)
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Polls `f` until it returns `Some` or `limit` passes.
fn eventually<T>(limit: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let end = Instant::now() + limit;
    loop {
        if let Some(t) = f() {
            return Some(t);
        }
        if Instant::now() >= end {
            return None;
        }
        thread::sleep(Duration::from_millis(5));
    }
}

/// Waits until the peer closes `s` (end of stream or reset); panics if it is
/// still open after `limit`.
fn assert_closed_within(s: &mut TcpStream, limit: Duration) {
    s.set_read_timeout(Some(limit)).unwrap();
    let mut buf = [0u8; 4096];
    let start = Instant::now();
    loop {
        match s.read(&mut buf) {
            Ok(0) => return,
            Ok(_) => {} // a Refused frame, say; keep reading
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::TimedOut => {
                panic!("connection still open after {:?}", start.elapsed())
            }
            Err(_) => return, // reset
        }
    }
}

/// The client side of the handshake done by hand, following the documented
/// construction (`HMAC-SHA256(secret, label | ns | nc | rank | size | len(job) | job)`).
fn raw_handshake(addr: SocketAddr, rank: u32, size: u32, job: &str, secret: &Secret) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let ns = match wire::read_message(&mut s, MAX_HANDSHAKE_FRAME_LEN, SERVICE).unwrap() {
        Some(Message::Challenge { nonce, .. }) => nonce,
        other => panic!("expected a challenge, got {other:?}"),
    };
    let nc = [0x5a; 32];
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(secret.as_bytes()).unwrap();
    m.update(b"xdev-bootstrap-v1/client");
    m.update(&ns);
    m.update(&nc);
    m.update(&rank.to_le_bytes());
    m.update(&size.to_le_bytes());
    m.update(&(job.len() as u32).to_le_bytes());
    m.update(job.as_bytes());
    let mut mac = [0u8; 32];
    mac.copy_from_slice(&m.finalize().into_bytes());
    wire::write_message(
        &mut s,
        &Message::Auth {
            version: wire::PROTOCOL_VERSION,
            rank,
            size,
            nonce: nc,
            mac,
            job: job.into(),
        },
    )
    .unwrap();
    match wire::read_message(&mut s, MAX_FRAME_LEN, SERVICE).unwrap() {
        Some(Message::Welcome { .. }) => s,
        other => panic!("expected a welcome, got {other:?}"),
    }
}

#[test]
fn handle_is_send_and_sync() {
    let _w = watchdog("handle_is_send_and_sync", Duration::from_secs(20));
    fn check<T: Send + Sync>() {}
    check::<Bootstrap>();
    check::<BootstrapServer>();
}

#[test]
fn ranks_as_threads_put_get_barrier_allgather() {
    let _w = watchdog(
        "ranks_as_threads_put_get_barrier_allgather",
        Duration::from_secs(20),
    );
    let size = 4;
    let (server, secret) = start(size);
    let addr = server.addr();
    let go = Arc::new(Barrier::new(size));
    let handles: Vec<_> = (0..size)
        .map(|rank| {
            let secret = secret.clone();
            let go = go.clone();
            thread::spawn(move || {
                go.wait(); // connect all at once
                let b = Bootstrap::connect(addr, rank, size, JOB, &secret).unwrap();
                assert_eq!((b.rank(), b.size(), b.job()), (rank, size, JOB));
                // A get issued before anyone puts the key blocks until rank 3 does.
                if rank == 0 {
                    let late = b.get("late", Duration::from_secs(10)).unwrap();
                    assert_eq!(late, b"from 3");
                }
                if rank == 3 {
                    thread::sleep(Duration::from_millis(50));
                    b.put("late", b"from 3").unwrap();
                }
                b.put(&format!("ep/{rank}"), format!("endpoint-{rank}").as_bytes())
                    .unwrap();
                b.barrier().unwrap();
                for peer in 0..size {
                    let v = b
                        .get(&format!("ep/{peer}"), Duration::from_secs(1))
                        .unwrap();
                    assert_eq!(v, format!("endpoint-{peer}").as_bytes());
                }
                for round in 0..3u8 {
                    let mine = vec![rank as u8 ^ round; rank + 1];
                    let all = b.allgather(&mine).unwrap();
                    assert_eq!(all.len(), size);
                    for (peer, v) in all.iter().enumerate() {
                        assert_eq!(v, &vec![peer as u8 ^ round; peer + 1], "round {round}");
                    }
                }
                let empty = b.allgather(&[]).unwrap();
                assert!(empty.iter().all(Vec::is_empty));
                b.barrier().unwrap();
                assert_eq!(b.departed().unwrap(), Vec::<usize>::new());
                b.barrier().unwrap();
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert!(server.wait_finished(Some(Duration::from_secs(5))));
    let st = server.status();
    assert!(st.finished());
    assert!(st.departed.iter().all(|d| d.clean), "{st:?}");
}

/// Issue 21: a rank cannot replace a record another rank put (and so pose
/// as it); the service says who put each key.
#[test]
fn a_key_belongs_to_the_rank_that_first_put_it() {
    let _w = watchdog(
        "a_key_belongs_to_the_rank_that_first_put_it",
        Duration::from_secs(20),
    );
    let (server, secret) = start(3);
    let b0 = join(&server, &secret, 0);
    let b1 = join(&server, &secret, 1);
    let b2 = join(&server, &secret, 2);
    b0.put("rec.0", b"honest").unwrap();
    match b1.put("rec.0", b"forged") {
        Err(Error::Protocol { rank, what }) => {
            assert_eq!(rank, 1, "the putter is blamed: {what}");
            assert!(what.contains("rec.0") && what.contains("rank 0"), "{what}");
        }
        other => panic!("expected a protocol failure, got {other:?}"),
    }
    // The owner's value stands, the owner may replace it, and the service
    // goes on serving the refused rank.
    assert_eq!(
        b2.get("rec.0", Duration::from_secs(1)).unwrap(),
        b"honest".to_vec()
    );
    b0.put("rec.0", b"again").unwrap();
    assert_eq!(
        b2.get("rec.0", Duration::from_secs(1)).unwrap(),
        b"again".to_vec()
    );
    b1.put("rec.1", b"mine").unwrap();
    // A key first put by a rank other than the one it names stays that
    // rank's: the launcher sees who put it.
    b2.put("rec.9", b"odd").unwrap();
    assert!(matches!(
        b0.put("rec.9", b"x"),
        Err(Error::Protocol { rank: 0, .. })
    ));
    let mut stored = server.stored("rec.");
    stored.sort();
    assert_eq!(
        stored,
        vec![
            ("rec.0".to_string(), 0, b"again".to_vec()),
            ("rec.1".to_string(), 1, b"mine".to_vec()),
            ("rec.9".to_string(), 2, b"odd".to_vec()),
        ]
    );
    assert_eq!(
        b1.get("rec.1", Duration::from_secs(1)).unwrap(),
        b"mine".to_vec()
    );
}

#[test]
fn concurrent_requests_from_threads_of_one_rank() {
    let _w = watchdog(
        "concurrent_requests_from_threads_of_one_rank",
        Duration::from_secs(20),
    );
    let (server, secret) = start(1);
    let b = Arc::new(join(&server, &secret, 0));
    let handles: Vec<_> = (0..4)
        .map(|t| {
            let b = b.clone();
            thread::spawn(move || {
                for i in 0..50 {
                    let key = format!("t{t}/{i}");
                    b.put(&key, key.as_bytes()).unwrap();
                    assert_eq!(b.get(&key, Duration::from_secs(5)).unwrap(), key.as_bytes());
                }
                b.barrier().unwrap();
                assert_eq!(b.allgather(&[t]).unwrap(), vec![vec![t]]);
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

#[test]
fn refuses_wrong_secret_job_size_and_rank() {
    let _w = watchdog(
        "refuses_wrong_secret_job_size_and_rank",
        Duration::from_secs(20),
    );
    let (server, secret) = start(2);
    let addr = server.addr();
    let refused = |r: Result<Bootstrap, Error>, needle: &str| match r {
        Err(Error::Config(msg)) => assert!(msg.contains(needle), "{msg:?} lacks {needle:?}"),
        other => panic!("expected a refusal mentioning {needle:?}, got {other:?}"),
    };
    let wrong = Secret::generate().unwrap();
    refused(
        Bootstrap::connect(addr, 0, 2, JOB, &wrong),
        "authentication failed",
    );
    refused(
        Bootstrap::connect(addr, 0, 2, "other-job", &secret),
        "wrong job",
    );
    refused(
        Bootstrap::connect(addr, 0, 3, JOB, &secret),
        "wrong job size",
    );
    refused(Bootstrap::connect(addr, 2, 2, JOB, &secret), "out of range");
    refused(Bootstrap::connect(addr, 7, 2, JOB, &secret), "out of range");
    // None of these claimed a rank: both ranks can still join.
    let r0 = join(&server, &secret, 0);
    // A second claim of rank 0 (spoofing) is refused, and so is a claim of
    // rank 0 after it left.
    refused(
        Bootstrap::connect(addr, 0, 2, JOB, &secret),
        "already claimed",
    );
    let r1 = join(&server, &secret, 1);
    let t = thread::spawn(move || {
        r1.barrier().unwrap();
        r1
    });
    r0.barrier().unwrap();
    drop(t.join().unwrap());
    drop(r0);
    assert!(server.wait_finished(Some(Duration::from_secs(5))));
    refused(
        Bootstrap::connect(addr, 0, 2, JOB, &secret),
        "already claimed",
    );
}

#[test]
fn a_fake_service_cannot_pass_itself_off() {
    let _w = watchdog(
        "a_fake_service_cannot_pass_itself_off",
        Duration::from_secs(20),
    );
    // A listener that answers the challenge with a made-up Welcome: the
    // client must notice that it does not know the secret.
    let listener = std::net::TcpListener::bind(loopback()).unwrap();
    let addr = listener.local_addr().unwrap();
    let fake = thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        wire::write_message(
            &mut s,
            &Message::Challenge {
                version: wire::PROTOCOL_VERSION,
                nonce: [1; 32],
            },
        )
        .unwrap();
        let _ = wire::read_message(&mut s, MAX_HANDSHAKE_FRAME_LEN, SERVICE).unwrap();
        wire::write_message(&mut s, &Message::Welcome { mac: [0; 32] }).unwrap();
    });
    let secret = Secret::generate().unwrap();
    match Bootstrap::connect(addr, 0, 1, JOB, &secret) {
        Err(Error::Protocol { rank, what }) => {
            assert_eq!(rank, SERVICE);
            assert!(what.contains("prove"), "{what}");
        }
        other => panic!("expected a protocol error, got {other:?}"),
    }
    fake.join().unwrap();
}

#[test]
fn garbage_and_oversize_frames_are_dropped_and_service_goes_on() {
    let _w = watchdog(
        "garbage_and_oversize_frames_are_dropped_and_service_goes_on",
        Duration::from_secs(20),
    );
    let (server, secret) = start(2);
    let addr = server.addr();
    let challenge = |s: &mut TcpStream| {
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        match wire::read_message(s, MAX_HANDSHAKE_FRAME_LEN, SERVICE).unwrap() {
            Some(Message::Challenge { .. }) => {}
            other => panic!("expected a challenge, got {other:?}"),
        }
    };
    // Garbage instead of Auth.
    let mut s = TcpStream::connect(addr).unwrap();
    challenge(&mut s);
    s.write_all(&[0x13; 64]).unwrap();
    assert_closed_within(&mut s, Duration::from_secs(3));
    // A huge length prefix: refused without waiting for (or allocating) the body.
    let mut s = TcpStream::connect(addr).unwrap();
    challenge(&mut s);
    s.write_all(&u32::MAX.to_le_bytes()).unwrap();
    assert_closed_within(&mut s, Duration::from_secs(3));
    // A well-formed frame of the wrong kind.
    let mut s = TcpStream::connect(addr).unwrap();
    challenge(&mut s);
    wire::write_message(&mut s, &Message::Barrier { id: 1 }).unwrap();
    assert_closed_within(&mut s, Duration::from_secs(3));

    // An authenticated rank 1 that then sends an oversize frame is dropped,
    // and rank 0 hears that it left (uncleanly).
    let r0 = join(&server, &secret, 0);
    let mut raw = raw_handshake(addr, 1, 2, JOB, &secret);
    raw.write_all(&((MAX_FRAME_LEN + 1) as u32).to_le_bytes())
        .unwrap();
    assert_closed_within(&mut raw, Duration::from_secs(3));
    let gone = eventually(Duration::from_secs(3), || {
        let d = r0.departures().unwrap();
        (!d.is_empty()).then_some(d)
    })
    .expect("rank 0 was not told that rank 1 left");
    assert_eq!(
        gone,
        vec![Departure {
            rank: 1,
            clean: false
        }]
    );
    // The service still serves rank 0.
    r0.put("still", b"here").unwrap();
    assert_eq!(r0.get("still", Duration::from_secs(1)).unwrap(), b"here");
}

#[test]
fn silent_and_flooding_connections_cannot_exhaust_the_service() {
    let _w = watchdog(
        "silent_and_flooding_connections_cannot_exhaust_the_service",
        Duration::from_secs(20),
    );
    let opts = ServerOptions {
        max_pending_handshakes: 2,
        handshake_timeout: Duration::from_millis(300),
        ..ServerOptions::default()
    };
    let (server, secret) = start_with(1, opts);
    // Connections that never answer the challenge hold the two handshake
    // slots until their deadline, then are dropped.
    let mut silent: Vec<TcpStream> = (0..6)
        .map(|_| TcpStream::connect(server.addr()).unwrap())
        .collect();
    let t = Instant::now();
    let b = join(&server, &secret, 0);
    assert!(t.elapsed() < Duration::from_secs(5));
    b.barrier().unwrap();
    for s in &mut silent {
        assert_closed_within(s, Duration::from_secs(3));
    }
}

/// Issue 21: connections that connect and stay silent hold every handshake
/// slot; a real rank's handshake must still complete promptly (it timed
/// out before, waiting in the backlog behind them).
#[test]
fn silent_connections_holding_every_slot_do_not_hold_off_a_rank() {
    let _w = watchdog(
        "silent_connections_holding_every_slot_do_not_hold_off_a_rank",
        Duration::from_secs(30),
    );
    let opts = ServerOptions::default();
    let slots = opts.max_pending_handshakes;
    let (server, secret) = start_with(1, opts);
    let silent: Vec<TcpStream> = (0..slots + 8)
        .map(|_| TcpStream::connect(server.addr()).unwrap())
        .collect();
    // Let the service take them into their handshakes.
    thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    let b = join(&server, &secret, 0);
    let took = t.elapsed();
    assert!(took < Duration::from_secs(2), "the handshake took {took:?}");
    b.put("k", b"v").unwrap();
    b.barrier().unwrap();
    drop(silent);
}

/// Issue 21: another local user's connection is closed at once, before the
/// challenge, and takes no handshake slot. Needs root (to run a process as
/// another user); skipped otherwise.
#[test]
fn another_users_connection_is_closed_at_once() {
    use std::os::unix::process::CommandExt;
    let _w = watchdog(
        "another_users_connection_is_closed_at_once",
        Duration::from_secs(30),
    );
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to connect as another user");
        return;
    }
    let (server, secret) = start(1);
    let port = server.addr().port();
    // As nobody: connect, then count the bytes the service sends within 3 s.
    let script =
        format!("exec 3<>/dev/tcp/127.0.0.1/{port} || exit 3; timeout 3 head -c 1 <&3 | wc -c");
    let t = Instant::now();
    let out = std::process::Command::new("bash")
        .args(["-c", &script])
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    let took = t.elapsed();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "0",
        "another user's connection got a challenge"
    );
    assert!(took < Duration::from_secs(2), "closed only after {took:?}");
    // This user's ranks still get in.
    let b = join(&server, &secret, 0);
    b.barrier().unwrap();
}

#[test]
fn departures_are_reported_and_fail_collectives() {
    let _w = watchdog(
        "departures_are_reported_and_fail_collectives",
        Duration::from_secs(20),
    );
    let (server, secret) = start(3);
    let r0 = join(&server, &secret, 0);
    let r1 = join(&server, &secret, 1);
    let r2 = join(&server, &secret, 2);
    assert!(r0.departed().unwrap().is_empty());
    // Rank 1 enters a barrier that rank 2 will never enter.
    let waiting = thread::spawn(move || (r1.barrier(), r1));
    thread::sleep(Duration::from_millis(50));
    let t = Instant::now();
    drop(r2); // clean: says goodbye
    let seen = eventually(Duration::from_secs(2), || {
        let d = r0.departures().unwrap();
        (!d.is_empty()).then_some(d)
    })
    .expect("departure not reported");
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "took {:?}",
        t.elapsed()
    );
    assert_eq!(
        seen,
        vec![Departure {
            rank: 2,
            clean: true
        }]
    );
    assert_eq!(r0.departed().unwrap(), vec![2]);
    let (res, r1) = waiting.join().unwrap();
    assert!(
        matches!(res, Err(Error::PeerLost { rank: 2, .. })),
        "{res:?}"
    );
    // Later collectives fail at once; point-to-point requests still work.
    assert!(matches!(
        r0.allgather(b"x"),
        Err(Error::PeerLost { rank: 2, .. })
    ));
    r1.put("k", b"v").unwrap();
    assert_eq!(r0.get("k", Duration::from_secs(1)).unwrap(), b"v");
    drop(r1);
    assert!(eventually(Duration::from_secs(2), || {
        (r0.departed().unwrap().len() == 2).then_some(())
    })
    .is_some());
    let st = server.status();
    assert_eq!(st.connected, vec![0]);
    assert!(!st.finished());
    drop(r0);
    assert!(server.wait_finished(Some(Duration::from_secs(5))));
}

#[test]
fn late_joiner_learns_earlier_departures() {
    let _w = watchdog(
        "late_joiner_learns_earlier_departures",
        Duration::from_secs(20),
    );
    let (server, secret) = start(3);
    drop(join(&server, &secret, 2));
    let r0 = join(&server, &secret, 0);
    let seen = eventually(Duration::from_secs(2), || {
        let d = r0.departed().unwrap();
        (!d.is_empty()).then_some(d)
    });
    assert_eq!(seen, Some(vec![2]));
}

#[test]
fn service_shutdown_is_seen_by_clients() {
    let _w = watchdog(
        "service_shutdown_is_seen_by_clients",
        Duration::from_secs(20),
    );
    let (server, secret) = start(2);
    let r0 = join(&server, &secret, 0);
    server.shutdown();
    let err = eventually(Duration::from_secs(2), || r0.departed().err())
        .expect("lost service not reported");
    assert!(matches!(err, Error::Transport { .. }), "{err:?}");
    assert!(matches!(r0.barrier(), Err(Error::Transport { .. })));
}

#[test]
fn get_times_out_and_the_handle_stays_usable() {
    let _w = watchdog(
        "get_times_out_and_the_handle_stays_usable",
        Duration::from_secs(20),
    );
    let (server, secret) = start(2);
    let r0 = join(&server, &secret, 0);
    let r1 = join(&server, &secret, 1);
    let t = Instant::now();
    match r0.get("missing", Duration::from_millis(100)) {
        Err(Error::Transport { source, .. }) => {
            let io = source
                .downcast_ref::<std::io::Error>()
                .expect("an io::Error");
            assert_eq!(io.kind(), ErrorKind::TimedOut);
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(t.elapsed() >= Duration::from_millis(100));
    assert!(t.elapsed() < Duration::from_secs(2));
    // The withdrawn get does not swallow a later value.
    r1.put("missing", b"now here").unwrap();
    assert_eq!(
        r0.get("missing", Duration::from_secs(1)).unwrap(),
        b"now here"
    );
    // Timed-out gets are withdrawn, so they do not use up the per-rank
    // bound on waiting gets.
    let opts = ServerOptions {
        max_waiting_gets: 2,
        ..ServerOptions::default()
    };
    let (server, secret) = start_with(1, opts);
    let b = join(&server, &secret, 0);
    for i in 0..20 {
        assert!(b
            .get(&format!("never/{i}"), Duration::from_millis(1))
            .is_err());
    }
    // Cancels are processed in order before this put's reply.
    b.put("x", b"y").unwrap();
    let b = Arc::new(b);
    let waiters: Vec<_> = (0..2)
        .map(|i| {
            let b = b.clone();
            thread::spawn(move || b.get(&format!("later/{i}"), Duration::from_secs(5)))
        })
        .collect();
    thread::sleep(Duration::from_millis(100));
    // A third waiting get exceeds the bound.
    assert!(matches!(
        b.get("later/2", Duration::from_secs(5)),
        Err(Error::ResourceExhausted(_))
    ));
    b.put("later/0", b"0").unwrap();
    b.put("later/1", b"1").unwrap();
    for (i, w) in waiters.into_iter().enumerate() {
        assert_eq!(w.join().unwrap().unwrap(), i.to_string().as_bytes());
    }
}

#[test]
fn bounded_store_and_value_limits() {
    let _w = watchdog("bounded_store_and_value_limits", Duration::from_secs(20));
    let opts = ServerOptions {
        max_store_bytes: 10_000,
        ..ServerOptions::default()
    };
    let (server, secret) = start_with(1, opts);
    let b = join(&server, &secret, 0);
    b.put("a", &[1; 6000]).unwrap();
    match b.put("b", &[2; 6000]) {
        Err(Error::ResourceExhausted(msg)) => assert!(msg.contains("store full"), "{msg}"),
        other => panic!("expected ResourceExhausted, got {other:?}"),
    }
    // Replacing a value frees the old one first.
    b.put("a", &[3; 9000]).unwrap();
    assert_eq!(b.get("a", Duration::from_secs(1)).unwrap(), vec![3; 9000]);
    assert!(matches!(
        b.allgather(&[0; 2000]),
        Err(Error::ResourceExhausted(_))
    ));
    b.put("a", b"small").unwrap();
    assert_eq!(b.allgather(&[7; 2000]).unwrap(), vec![vec![7; 2000]]);
    assert_eq!(server.status().store_bytes, 1 + 5);
    // Per-message limits are checked before sending.
    assert!(matches!(
        b.put("big", &vec![0; wire::MAX_VALUE_LEN + 1]),
        Err(Error::ResourceExhausted(_))
    ));
    assert!(matches!(
        b.put(&"k".repeat(wire::MAX_KEY_LEN + 1), b""),
        Err(Error::Config(_))
    ));
    // The largest value that fits a frame goes through (with a big store).
    let (server, secret) = start(1);
    let b = join(&server, &secret, 0);
    let big = vec![0xa5; wire::MAX_VALUE_LEN];
    b.put(&"k".repeat(wire::MAX_KEY_LEN), &big).unwrap();
    assert_eq!(
        b.get(&"k".repeat(wire::MAX_KEY_LEN), Duration::from_secs(5))
            .unwrap(),
        big
    );
    assert_eq!(b.allgather(&big).unwrap(), vec![big]);
}

#[test]
fn mismatched_collectives_fail_for_everyone() {
    let _w = watchdog(
        "mismatched_collectives_fail_for_everyone",
        Duration::from_secs(20),
    );
    let (server, secret) = start(2);
    let r0 = join(&server, &secret, 0);
    let r1 = join(&server, &secret, 1);
    let t = thread::spawn(move || (r1.allgather(b"x"), r1));
    thread::sleep(Duration::from_millis(50));
    let e0 = r0.barrier();
    let (e1, r1) = t.join().unwrap();
    assert!(matches!(e0, Err(Error::Protocol { rank: 0, .. })), "{e0:?}");
    assert!(matches!(e1, Err(Error::Protocol { rank: 0, .. })), "{e1:?}");
    // Matching collectives work again afterwards.
    let t = thread::spawn(move || r1.barrier());
    r0.barrier().unwrap();
    t.join().unwrap().unwrap();
}

#[test]
fn environment_parsing_names_the_variable() {
    let _w = watchdog(
        "environment_parsing_names_the_variable",
        Duration::from_secs(20),
    );
    let secret = Secret::generate().unwrap();
    let full: HashMap<&str, String> = [
        ("XDEV_RANK", "1".to_string()),
        ("XDEV_SIZE", "3".to_string()),
        ("XDEV_JOB", "j1".to_string()),
        ("XDEV_BOOTSTRAP", "127.0.0.1:9".to_string()),
        ("XDEV_SECRET", secret.to_hex()),
        ("XDEV_DEVICE", "shm".to_string()),
    ]
    .into_iter()
    .collect();
    let parse = |m: &HashMap<&str, String>| JobEnv::from_lookup(|k| m.get(k).cloned());
    let env = parse(&full).unwrap();
    assert_eq!(env.config, xdev::Config::new(1, 3, "j1"));
    assert_eq!(env.bootstrap.as_deref(), Some("127.0.0.1:9"));
    assert_eq!(env.secret, Some(secret));
    assert_eq!(env.device.as_deref(), Some("shm"));

    let config_error = |changes: &[(&'static str, Option<&str>)], needle: &str| {
        let mut m = full.clone();
        for &(k, v) in changes {
            match v {
                Some(v) => m.insert(k, v.to_string()),
                None => m.remove(k),
            };
        }
        match parse(&m) {
            Err(Error::Config(msg)) => assert!(msg.contains(needle), "{msg:?} lacks {needle:?}"),
            other => panic!("expected a config error naming {needle}, got {other:?}"),
        }
    };
    config_error(&[("XDEV_RANK", None)], "XDEV_RANK is not set");
    config_error(&[("XDEV_SIZE", None)], "XDEV_SIZE is not set");
    config_error(&[("XDEV_JOB", None)], "XDEV_JOB is not set");
    config_error(&[("XDEV_RANK", Some("one"))], "XDEV_RANK");
    config_error(&[("XDEV_RANK", Some("-1"))], "XDEV_RANK");
    config_error(&[("XDEV_RANK", Some("3"))], "out of range");
    config_error(&[("XDEV_SIZE", Some("0"))], "XDEV_SIZE");
    config_error(&[("XDEV_JOB", Some(""))], "XDEV_JOB");
    config_error(&[("XDEV_SECRET", Some("12ab"))], "XDEV_SECRET");

    // Optional variables, checked by whoever needs them.
    let mut m = full.clone();
    m.remove("XDEV_BOOTSTRAP");
    m.remove("XDEV_DEVICE");
    let env = parse(&m).unwrap();
    assert_eq!(env.device, None);
    match Bootstrap::from_job_env(&env) {
        Err(Error::Config(msg)) => assert!(msg.contains("XDEV_BOOTSTRAP"), "{msg}"),
        other => panic!("{other:?}"),
    }
    m.remove("XDEV_SECRET");
    m.insert("XDEV_BOOTSTRAP", "127.0.0.1:9".into());
    match Bootstrap::from_job_env(&parse(&m).unwrap()) {
        Err(Error::Config(msg)) => assert!(msg.contains("XDEV_SECRET"), "{msg}"),
        other => panic!("{other:?}"),
    }
}
