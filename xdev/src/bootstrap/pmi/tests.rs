use super::*;

#[test]
fn pmi1_commands_and_replies() {
    assert_eq!(
        pmi1_command("init", &[("pmi_version", "1"), ("pmi_subversion", "1")]),
        "cmd=init pmi_version=1 pmi_subversion=1\n"
    );
    assert_eq!(pmi1_command("barrier_in", &[]), "cmd=barrier_in\n");
    let r = pmi1_parse("cmd=maxes kvsname_max=256 keylen_max=64 vallen_max=1024\n").unwrap();
    assert_eq!(field(&r, "cmd"), Some("maxes"));
    assert_eq!(field(&r, "keylen_max"), Some("64"));
    assert_eq!(field(&r, "vallen_max"), Some("1024"));
    let r = pmi1_parse("cmd=get_result rc=-1 msg=key not found\n").unwrap();
    assert_eq!(field(&r, "rc"), Some("-1"));
    assert_eq!(field(&r, "msg"), Some("key not found"));
    let r = pmi1_parse("cmd=get_result rc=0 msg=success value=1:00ff\n").unwrap();
    assert_eq!(field(&r, "value"), Some("1:00ff"));
    assert!(
        pmi1_parse("rc=0\n").is_err(),
        "a reply names its command first"
    );
    assert!(pmi1_parse("garbage\n").is_err());
}

#[test]
fn pmi2_frames_and_replies() {
    let f = pmi2_frame(
        "fullinit",
        &[("pmijobid", "7.0"), ("pmirank", "2"), ("threaded", "FALSE")],
    )
    .unwrap();
    let text = String::from_utf8(f).unwrap();
    let body = "cmd=fullinit;pmijobid=7.0;pmirank=2;threaded=FALSE;";
    assert_eq!(text, format!("{:<6}{body}", body.len()));
    assert_eq!(&text[..6], "51    ");
    assert_eq!(pmi2_length(b"50    ").unwrap(), 50);
    assert_eq!(pmi2_length(b"    50").unwrap(), 50);
    assert!(pmi2_length(b"abc   ").is_err());
    assert!(pmi2_length(b"999999").is_err(), "bounded");
    let r = pmi2_parse(
        "cmd=fullinit-response;rc=0;pmi-version=2;pmi-subversion=0;rank=2;size=3;appnum=0;",
    )
    .unwrap();
    assert_eq!(field(&r, "cmd"), Some("fullinit-response"));
    assert_eq!(field(&r, "rank"), Some("2"));
    assert_eq!(field(&r, "size"), Some("3"));
    // `;;` is a `;` in a value, both ways.
    let f = pmi2_frame("kvs-put", &[("key", "k"), ("value", "a;b")]).unwrap();
    let body = std::str::from_utf8(&f[6..]).unwrap();
    assert_eq!(body, "cmd=kvs-put;key=k;value=a;;b;");
    let r = pmi2_parse(body).unwrap();
    assert_eq!(field(&r, "value"), Some("a;b"));
    assert!(
        pmi2_parse("key=v;").is_err(),
        "a frame names its command first"
    );
    assert!(pmi2_parse("cmd=x;novalue;").is_err());
}

#[test]
fn keys_fit_the_launchers_limits() {
    assert_eq!(encode_key("xdev.ag.3.1", 64), "xxdev.ag.3.1");
    let long = "k".repeat(100);
    let h = encode_key(&long, 64);
    assert!(h.starts_with('h') && h.len() == 33, "{h}");
    assert_eq!(h, encode_key(&long, 64), "deterministic");
    assert_ne!(h, encode_key(&"k".repeat(101), 64));
    // Separators of either protocol are never sent.
    for k in ["a b", "a=b", "a;b", "a\nb", "ü"] {
        let e = encode_key(k, 64);
        assert!(e.starts_with('h'), "{k:?} -> {e}");
    }
    // Chunk keys still fit.
    assert!(chunk_key(&h, 99_999).len() <= 64);
    let edge = "a".repeat(64 - 1 - SUFFIX_ROOM);
    assert_eq!(encode_key(&edge, 64), format!("x{edge}"));
    assert!(encode_key(&format!("{edge}a"), 64).starts_with('h'));
}

/// A session over one end of a socket pair whose other end is served
/// by `serve` (a fake PMI-1 launcher), on its own thread.
fn fake_session(
    serve: impl FnOnce(BufReader<UnixStream>, UnixStream) + Send + 'static,
) -> (Session, std::thread::JoinHandle<()>) {
    let (mine, theirs) = UnixStream::pair().unwrap();
    let server = std::thread::spawn(move || {
        let reader = BufReader::new(theirs.try_clone().unwrap());
        serve(reader, theirs);
    });
    let session = Session {
        wire: Wire::Pmi1,
        rank: 0,
        size: 2,
        job: "fake".into(),
        keylen_max: 64,
        vallen_max: 1024,
        conn: Mutex::new(Conn {
            reader: BufReader::new(mine.try_clone().unwrap()),
            writer: mine,
        }),
        finalized: Mutex::new(true),
    };
    (session, server)
}

/// Issue 21: a joined value that announces more parts (or longer parts)
/// than a value of at most MAX_VALUE_LEN bytes has fails before the
/// parts are fetched, naming the key.
#[test]
fn an_oversized_joined_value_fails_at_once() {
    for first in ["1048576:00".to_string(), format!("4:{}", "ab".repeat(2000))] {
        let gets = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let seen = gets.clone();
        let (session, server) = fake_session(move |mut r, mut w| {
            let mut line = String::new();
            // At most 100 answers, then the launcher hangs up.
            for _ in 0..100 {
                line.clear();
                if r.read_line(&mut line).unwrap_or(0) == 0 {
                    return;
                }
                let n = seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let value = if n == 0 { first.as_str() } else { "00" };
                let reply = format!("cmd=get_result rc=0 msg=success value={value}\n");
                if w.write_all(reply.as_bytes()).is_err() {
                    return;
                }
            }
        });
        let t = std::time::Instant::now();
        let got = session.get("huge.record");
        let gets = gets.load(std::sync::atomic::Ordering::SeqCst);
        drop(session);
        server.join().unwrap();
        match got {
            Err(Error::Protocol { what, .. }) => {
                assert!(what.contains("huge.record"), "{what}")
            }
            other => panic!("expected a protocol error, got {other:?}"),
        }
        assert_eq!(gets, 1, "parts were fetched");
        assert!(t.elapsed() < Duration::from_secs(5));
    }
}

#[test]
fn values_split_and_join() {
    assert_eq!(chunk_digits(1024), 640);
    assert_eq!(chunk_digits(101), 84);
    for len in [0usize, 1, 319, 320, 321, 5000] {
        let value: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
        let parts = split_value(&value, 640);
        assert_eq!(parts.len(), len.div_ceil(320).max(1), "len {len}");
        assert!(parts.iter().all(|p| p.len() <= 640 + 8));
        assert!(parts[0].starts_with(&format!("{}:", parts.len())));
        let back = join_value("k", &parts[0], 640, |i| Ok(parts[i].clone())).unwrap();
        assert_eq!(back, value, "len {len}");
    }
    let big = vec![7u8; crate::bootstrap::wire::MAX_VALUE_LEN];
    let parts = split_value(&big, 640);
    let back = join_value("k", &parts[0], 640, |i| Ok(parts[i].clone())).unwrap();
    assert_eq!(back, big, "the largest value joins");
    let join = |first: &str| join_value("k", first, 640, |_| unreachable!());
    assert!(join("nocount").is_err());
    assert!(join("1:abc").is_err(), "odd digits");
    assert!(join("1:zz").is_err());
    assert!(join("0:").is_err());
    assert!(join_value("k", "2:00", 640, |_| Err(pmi_err("gone"))).is_err());
    assert_eq!(
        unhex(&hex(&[0, 1, 254, 255])).unwrap(),
        vec![0, 1, 254, 255]
    );
}
