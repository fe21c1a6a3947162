//! `ibvx-pingpong` as a program: arguments, exit codes, one-line errors.
//! Runs anywhere; what needs a device is exercised by ci/vm-suite.sh.

use std::path::PathBuf;
use std::process::{Command, Output};

/// The binary cargo built (`IBVX_PINGPONG` overrides, e.g. when this test
/// binary runs on another machine).
fn binary() -> PathBuf {
    std::env::var_os("IBVX_PINGPONG")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_ibvx-pingpong")))
}

fn pingpong(args: &[&str]) -> Output {
    let bin = binary();
    Command::new(&bin)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {} ({e}); set IBVX_PINGPONG", bin.display()))
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn help_and_version() {
    let o = pingpong(&["--help"]);
    assert!(o.status.success());
    let out = String::from_utf8_lossy(&o.stdout);
    for word in [
        "send_lat",
        "write_lat",
        "write_bw",
        "--perftest",
        "--check",
        "--events",
        "--json",
    ] {
        assert!(out.contains(word), "help lacks {word}");
    }
    let o = pingpong(&["-V"]);
    assert!(o.status.success());
    assert!(String::from_utf8_lossy(&o.stdout).starts_with("ibvx-pingpong "));
}

#[test]
fn bad_arguments_exit_2_with_one_line() {
    for args in [
        &["--test", "read_bw"][..],
        &["-m", "1000"],
        &["--bogus"],
        &["-a", "-s", "4"],
    ] {
        let o = pingpong(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        let e = stderr(&o);
        assert!(e.starts_with("ibvx-pingpong: "), "{e}");
        assert_eq!(e.trim_end().lines().count(), 1, "{e}");
    }
}

#[test]
fn no_device_is_a_one_line_error() {
    let o = pingpong(&["--test", "write_lat", "127.0.0.1", "--connect-timeout", "0"]);
    let e = stderr(&o);
    if o.status.success() || e.contains("cannot connect") {
        // A device exists here (the VM suite covers this machine).
        println!(
            "skipped: no RDMA device expected (runs in ci/vm-suite.sh) [{}]",
            e.trim()
        );
        return;
    }
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert_eq!(e.trim_end().lines().count(), 1, "{e}");
    assert!(
        e.starts_with("ibvx-pingpong: error: no RDMA device found")
            || e.starts_with("ibvx-pingpong: error: verbs not available"),
        "{e}"
    );
}
