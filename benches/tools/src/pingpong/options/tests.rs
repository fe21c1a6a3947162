use super::*;

fn run(args: &[&str]) -> Options {
    match parse(args.iter().copied()) {
        Ok(Command::Run(o)) => *o,
        other => panic!("{args:?}: {other:?}"),
    }
}

fn err(args: &[&str]) -> String {
    match parse(args.iter().copied()) {
        Err(e) => e,
        other => panic!("{args:?} parsed: {other:?}"),
    }
}

#[test]
fn defaults_follow_perftest() {
    let o = run(&[]);
    assert_eq!(o.test, TestKind::SendLat);
    assert!(!o.is_client());
    assert_eq!((o.size, o.iters, o.port), (2, 1000, 18515));
    let o = run(&["--test", "write_bw", "10.0.0.1"]);
    assert_eq!((o.size, o.iters, o.tx_depth), (65536, 5000, 128));
    assert_eq!(o.host.as_deref(), Some("10.0.0.1"));
    assert_eq!(o.window(), 128);
    let o = run(&["--test=write_lat", "-n", "7", "-t", "64"]);
    assert_eq!((o.test, o.iters, o.window()), (TestKind::WriteLat, 7, 7));
}

#[test]
fn every_option_parses() {
    let o = run(&[
        "-d",
        "rxe0",
        "-i",
        "1",
        "-x",
        "1",
        "-s",
        "64K",
        "-n",
        "100",
        "-m",
        "1024",
        "-I",
        "64",
        "-e",
        "-c",
        "--json",
        "-p",
        "2000",
        "--timeout",
        "2.5",
        "--connect-timeout=0",
        "-r",
        "16",
        "host",
    ]);
    assert_eq!(o.ib_dev.as_deref(), Some("rxe0"));
    assert_eq!((o.ib_port, o.gid_index, o.size), (1, Some(1), 65536));
    assert_eq!(
        (o.iters, o.mtu, o.inline_size),
        (100, Some(Mtu::Mtu1024), 64)
    );
    assert!(o.events && o.check && o.json && !o.perftest);
    assert_eq!((o.port, o.rx_depth), (2000, 16));
    assert_eq!(o.timeout, Duration::from_millis(2500));
    assert_eq!(o.connect_timeout, Duration::ZERO);
    let o = run(&["-a", "--perftest", "--test", "write_lat"]);
    assert!(o.all && o.perftest);
    assert_eq!(o.sizes().len(), 23);
    assert_eq!((o.sizes()[0], o.max_size()), (2, 8 << 20));
}

#[test]
fn bad_input_is_refused_with_a_reason() {
    assert!(err(&["--test", "read_lat"]).contains("unknown test"));
    assert!(err(&["-m", "1500"]).contains("--mtu must be"));
    assert!(err(&["-s"]).contains("needs a value"));
    assert!(err(&["-s", "x"]).contains("not a byte count"));
    assert!(err(&["-s", "0"]).contains("--size"));
    assert!(err(&["-n", "4"]).contains("--iters"));
    assert!(err(&["-a", "-s", "8"]).contains("exclude"));
    assert!(err(&["--bogus"]).contains("unknown option"));
    assert!(err(&["a", "b"]).contains("more than one HOST"));
    assert!(err(&["-c", "--perftest"]).contains("--check"));
    assert!(err(&["-x", "300"]).contains("--gid-index"));
    assert!(err(&["--timeout", "0"]).contains("--timeout"));
    assert_eq!(parse(["-h"]), Ok(Command::Help));
    assert_eq!(parse(["--version"]), Ok(Command::Version));
}

#[test]
fn attached_and_inline_values() {
    let o = run(&["-n50", "--size=8", "-ce", "--test=write_lat", "host"]);
    assert_eq!((o.iters, o.size, o.test), (50, 8, TestKind::WriteLat));
    assert!(o.check && o.events);
    assert_eq!(o.host.as_deref(), Some("host"));
    assert!(err(&["--all=1"]).contains("--all"));
}

#[test]
fn byte_counts() {
    assert_eq!(parse_bytes("4096"), Ok(4096));
    assert_eq!(parse_bytes("1M"), Ok(1 << 20));
    assert_eq!(parse_bytes("2g"), Ok(2 << 30));
    assert!(parse_bytes("").is_err());
    assert!(parse_bytes("K").is_err());
    assert!(parse_bytes("99999999999999999999G").is_err());
}

#[test]
fn test_kinds_round_trip() {
    for t in TestKind::ALL {
        assert_eq!(t.name().parse::<TestKind>(), Ok(t));
        assert_eq!(TestKind::from_code(t.code()), Some(t));
        assert!(t.perftest_program().starts_with("ib_"));
    }
    assert_eq!(TestKind::from_code(0), None);
}
