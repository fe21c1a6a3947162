//! `xdev-bench` in process mode, as built: it re-executes itself under
//! `xdev-run`, and rank 0 prints the tables.
//!
//! The launcher must sit next to the binary (`cargo test --workspace` builds
//! it there; with `-p xdev-bench` alone, build it with `cargo build -p xdev-tools`
//! in the same profile first). Tests that cannot run say `skipped: why`.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

const BENCH: &str = env!("CARGO_BIN_EXE_xdev-bench");

/// `xdev-run` next to the benchmark binary, or a skip notice.
fn launcher() -> Option<PathBuf> {
    let l = PathBuf::from(BENCH).with_file_name("xdev-run");
    if l.is_file() {
        Some(l)
    } else {
        println!(
            "skipped: {} is not built (cargo build -p xdev-tools, in the profile of this test)",
            l.display()
        );
        None
    }
}

fn bench(args: &[&str]) -> (Output, String) {
    let out = Command::new(BENCH)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("xdev-bench starts");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    (out, stdout)
}

/// The OSU data rows of `stdout`, as numbers.
fn rows(stdout: &str) -> Vec<Vec<f64>> {
    stdout
        .lines()
        .filter(|l| l.starts_with(|c: char| c.is_ascii_digit()))
        .map(|l| {
            l.split_whitespace()
                .map(|v| v.parse().unwrap_or_else(|_| panic!("row {l:?}")))
                .collect()
        })
        .collect()
}

#[test]
fn shm_latency_in_process_mode() {
    if launcher().is_none() {
        return;
    }
    let (out, stdout) = bench(&[
        "--quick",
        "--max-size",
        "64",
        "--test",
        "latency",
        "--device",
        "shm",
    ]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        stdout.matches("# OSU MPI Latency Test").count(),
        1,
        "one table, from rank 0:\n{stdout}"
    );
    assert!(
        stdout.contains("# Device: shm; cache-line floor") && stdout.contains("two processes"),
        "{stdout}"
    );
    let rows = rows(&stdout);
    let sizes: Vec<f64> = rows.iter().map(|r| r[0]).collect();
    assert_eq!(
        sizes,
        [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0],
        "{stdout}"
    );
    for r in &rows {
        assert_eq!(r.len(), 4, "size, latency, floor, ratio: {r:?}");
        // (The ratio is of the unrounded figures, so it is not recomputed
        // from the printed ones.)
        assert!(r[1] > 0.0 && r[2] > 0.0 && r[3] > 0.0, "{r:?}");
    }
}

#[test]
fn floors_alone_between_threads_and_between_processes() {
    if launcher().is_none() {
        return;
    }
    let (out, stdout) = bench(&["--test", "floor", "--quick", "--max-size", "8"]);
    assert!(out.status.success(), "{out:?}");
    assert!(stdout.contains("between two threads pinned"), "{stdout}");
    assert!(stdout.contains("between two processes pinned"), "{stdout}");
    let rows = rows(&stdout);
    assert_eq!(rows.len(), 2 * 5, "sizes 0..=8 per table:\n{stdout}");
    for r in &rows {
        assert_eq!(r.len(), 3, "size, cache-line, memcpy: {r:?}");
        assert!(r[1] > 0.0 && (r[0] == 0.0 || r[2] > 0.0), "{r:?}");
    }
}

#[test]
fn process_floors_as_json() {
    if launcher().is_none() {
        return;
    }
    let (out, stdout) = bench(&["--test", "floor", "--quick", "--max-size", "2", "--json"]);
    assert!(out.status.success(), "{out:?}");
    for placement in ["threads", "processes"] {
        for test in ["cache_line", "memcpy"] {
            let key = format!("{{\"floor\":\"{placement}\",\"test\":\"{test}\"");
            assert_eq!(stdout.matches(&key).count(), 3, "{key}:\n{stdout}");
        }
    }
}

#[test]
fn shm_bibw_and_mbw_mr_in_process_mode() {
    if launcher().is_none() {
        return;
    }
    let (out, stdout) = bench(&[
        "--quick",
        "--max-size",
        "1024",
        "--test",
        "bibw,mbw_mr",
        "--device",
        "shm",
    ]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        stdout
            .matches("# OSU MPI Bi-Directional Bandwidth Test")
            .count(),
        1,
        "{stdout}"
    );
    assert_eq!(
        stdout
            .matches("# OSU MPI Multiple Bandwidth / Message Rate Test")
            .count(),
        1,
        "{stdout}"
    );
    assert!(
        stdout.contains("# [ pairs: 2 ] [ window size: 64 ]"),
        "{stdout}"
    );
    let rows = rows(&stdout);
    // 1 .. 1024 for each test.
    assert_eq!(rows.len(), 2 * 11, "{stdout}");
    let (bi, multi) = rows.split_at(11);
    for r in bi {
        assert_eq!(r.len(), 4, "size, MB/s, floor, ratio: {r:?}");
        assert!(r[1] > 0.0 && r[2] > 0.0, "{r:?}");
    }
    for r in multi {
        assert_eq!(r.len(), 5, "size, MB/s, messages/s, floor, ratio: {r:?}");
        assert!(r[1] > 0.0 && r[2] > 0.0 && r[3] > 0.0, "{r:?}");
    }
}

#[test]
fn a_named_device_that_cannot_open_is_reported_not_measured() {
    if launcher().is_none() {
        return;
    }
    // An option the shm device refuses: it cannot be opened.
    let (out, stdout) = bench(&[
        "--quick",
        "--max-size",
        "4",
        "--test",
        "latency",
        "--device",
        "shm",
        "--device",
        "thread",
        "--option",
        "cma=sometimes",
        "--json",
    ]);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    let line = stdout
        .lines()
        .find(|l| l.contains("\"not_measured\""))
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(
        line.starts_with("{\"device\":\"shm\",\"not_measured\":\"cannot open device shm:"),
        "{line}"
    );
    // The run went on with the thread device.
    assert!(
        stdout.contains("{\"device\":\"thread\",\"test\":\"latency\",\"size\":4"),
        "{stdout}"
    );
}
