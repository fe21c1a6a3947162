//! The message rate test (`xdev-bench --test rate`) as built, and its place
//! in the comparison report: the headline's "messages/s at 8 B" column, the
//! rate table and plot, the `rate` records.
//!
//! The thread device runs in-process and is always measured. Process
//! devices need `xdev-run` next to the binary (`cargo test --workspace`
//! builds it; with `-p xdev-bench` alone, `cargo build -p xdev-tools` in the same
//! profile first); a test that cannot run them says `skipped: why`.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use xdev_bench::report::{parse_results, Record};

const BENCH: &str = env!("CARGO_BIN_EXE_xdev-bench");

fn bench(args: &[&str]) -> (Output, String) {
    let out = Command::new(BENCH)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("xdev-bench starts");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    (out, stdout)
}

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

/// Checks the rate records of `device` in `stdout`: one per size from 1 to
/// 64 bytes, in messages per second, positive and finite, each with a
/// positive floor (one message per cache-line hand-off).
fn check_rate_records(device: &str, stdout: &str) -> Vec<Record> {
    let recs: Vec<Record> = parse_results(stdout)
        .records
        .into_iter()
        .filter(|r| r.device == device && r.test == "rate")
        .collect();
    let sizes: Vec<usize> = recs.iter().map(|r| r.size).collect();
    assert_eq!(sizes, [1, 2, 4, 8, 16, 32, 64], "{stdout}");
    for r in &recs {
        assert_eq!(r.unit, "msg/s", "{r:?}");
        assert!(r.value.is_finite() && r.value > 0.0, "{r:?}");
        assert!(r.floor.is_finite() && r.floor > 0.0, "{r:?}");
        // Nothing moves more than a few hundred million messages per
        // second between two cores: a figure above that is a unit error.
        assert!(r.value < 1e9, "{r:?}");
    }
    recs
}

#[test]
fn rate_on_the_thread_device() {
    let (out, stdout) = bench(&[
        "--quick",
        "--max-size",
        "64",
        "--test",
        "rate",
        "--device",
        "thread",
        "--json",
    ]);
    assert!(out.status.success(), "{out:?}");
    check_rate_records("thread", &stdout);

    let (out, stdout) = bench(&[
        "--quick",
        "--max-size",
        "8",
        "--test",
        "rate",
        "--device",
        "thread",
    ]);
    assert!(out.status.success(), "{out:?}");
    assert!(
        stdout.starts_with(
            "# OSU MPI Message Rate Test (xdev-bench)\n# [ pairs: 1 ] [ window size: 64 ]\n"
        ),
        "{stdout}"
    );
    assert!(
        stdout.contains("(two threads pinned to cores 0 and 1)"),
        "{stdout}"
    );
    let rows: Vec<Vec<f64>> = stdout
        .lines()
        .filter(|l| l.starts_with(|c: char| c.is_ascii_digit()))
        .map(|l| l.split_whitespace().map(|v| v.parse().unwrap()).collect())
        .collect();
    let sizes: Vec<f64> = rows.iter().map(|r| r[0]).collect();
    assert_eq!(sizes, [1.0, 2.0, 4.0, 8.0], "{stdout}");
    for r in &rows {
        assert_eq!(r.len(), 4, "size, messages/s, floor, ratio: {r:?}");
        assert!(r[1] > 0.0 && r[2] > 0.0, "{r:?}");
    }
}

#[test]
fn rate_on_shm_in_process_mode() {
    if launcher().is_none() {
        return;
    }
    let (out, stdout) = bench(&[
        "--quick",
        "--max-size",
        "64",
        "--test",
        "rate",
        "--device",
        "shm",
        "--json",
    ]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        stdout.matches("\"test\":\"rate\"").count(),
        7,
        "rank 0 alone prints:\n{stdout}"
    );
    check_rate_records("shm", &stdout);
}

/// The headline row of `name` in `md`, as its cells.
fn headline_row<'a>(md: &'a str, name: &str) -> Option<Vec<&'a str>> {
    let headline = md
        .split("## Headline figures")
        .nth(1)?
        .split("\n## ")
        .next()?;
    let row = headline
        .lines()
        .find(|l| l.starts_with(&format!("| {name} |")))?;
    Some(row.trim_matches('|').split(" | ").map(str::trim).collect())
}

#[test]
fn the_report_has_the_message_rate_of_every_device() {
    let dir = std::env::temp_dir().join(format!("xdev-bench-rate-report-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let dir_arg = dir.display().to_string();
    // --no-mpi: the MPI peers are not what this test checks, and need
    // packages; the report says they were skipped.
    let (out, _) = bench(&[
        "report",
        "--quick",
        "--no-mpi",
        "--max-size",
        "8",
        "--out",
        &dir_arg,
    ]);
    assert!(out.status.success(), "{out:?}");
    let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert!(
        md.contains(
            "| device or peer | latency 8 B (us) | ratio | bw 1 MiB (MB/s) | ratio | \
             bibw 1 MiB (MB/s) | ratio | messages/s at 8 B | ratio |"
        ),
        "{md}"
    );
    // The thread device is always measured: a rate and its ratio.
    let thread = headline_row(&md, "thread").expect("a thread row");
    assert_eq!(thread.len(), 9, "{thread:?}");
    let rate: f64 = thread[7].parse().unwrap_or_else(|_| panic!("{thread:?}"));
    let ratio: f64 = thread[8].parse().unwrap_or_else(|_| panic!("{thread:?}"));
    assert!(rate > 0.0 && ratio > 0.0, "{thread:?}");
    // Every other row: a rate, or "not measured: why".
    let headline = md.split("## Headline figures").nth(1).unwrap();
    let rows: Vec<&str> = headline
        .lines()
        .skip_while(|l| !l.starts_with("|---"))
        .skip(1)
        .take_while(|l| l.starts_with('|'))
        .collect();
    assert!(!rows.is_empty(), "{md}");
    for row in rows {
        let cells: Vec<&str> = row.trim_matches('|').split(" | ").map(str::trim).collect();
        assert_eq!(cells.len(), 9, "{row}");
        let measured = cells[7].parse::<f64>().is_ok_and(|v| v > 0.0);
        assert!(measured || cells[7].starts_with("not measured: "), "{row}");
    }
    // The rate section, its plot and its records.
    assert!(md.contains("## Message rate (messages/s)"), "{md}");
    assert!(md.contains("![Message rate](rate.svg)"), "{md}");
    let svg = std::fs::read_to_string(dir.join("rate.svg")).unwrap();
    assert!(svg.contains("thread") && svg.contains("1 / cache-line floor (threads)"));
    let jsonl = std::fs::read_to_string(dir.join("results.jsonl")).unwrap();
    let recs = parse_results(&jsonl).records;
    let thread_rates: Vec<&Record> = recs
        .iter()
        .filter(|r| r.device == "thread" && r.test == "rate")
        .collect();
    assert_eq!(thread_rates.len(), 4, "sizes 1 to 8:\n{jsonl}");
    assert!(thread_rates
        .iter()
        .all(|r| r.unit == "msg/s" && r.value > 0.0 && r.floor > 0.0));
    let _ = std::fs::remove_dir_all(Path::new(&dir));
}

/// `xdev-bench --test rate_split` on psm: the message rate with the sender,
/// then the receiver, through the device and the other side raw PSM2 on
/// the same endpoint, each beside raw PSM2 on both sides. The data carries
/// the device's tags on both paths: were the raw side's tags not the
/// device's, no message would match and the run would hang, which the
/// deadline turns into a failure.
#[test]
fn rate_split_puts_the_psm_device_against_raw_psm2_on_each_side() {
    if launcher().is_none() {
        return;
    }
    // In a process group of its own, so that the deadline ends its ranks
    // too (they inherit the group).
    let mut child = Command::new(BENCH)
        .process_group(0)
        .args(["--quick", "--min-size", "8", "--max-size", "8"])
        .args(["--test", "rate_split", "--device", "psm", "--json"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("xdev-bench starts");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(240);
    while child.try_wait().expect("wait").is_none() {
        if std::time::Instant::now() > deadline {
            let group = format!("-{}", child.id());
            let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
            let _ = child.kill();
            let _ = child.wait();
            panic!("rate_split on psm did not end in 240 s: a side's messages never matched");
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let out = child.wait_with_output().expect("output");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() && stderr.contains("cannot open device psm") {
        println!("skipped: the psm device does not open here (libpsm2 missing?): {stderr}");
        return;
    }
    assert!(out.status.success(), "{out:?}");
    let recs = parse_results(&stdout).records;
    // The rates (the device's side, and raw PSM2 on both sides as the
    // floor), then the receiving rank's phases per message, posting and
    // waiting (the receiver through the device, and raw): each positive and
    // within (lo, hi) (a message takes more than a nanosecond and less than
    // a millisecond in each phase).
    let expected = [
        ("rate_send", "msg/s", 0.0, 1e9),
        ("rate_recv", "msg/s", 0.0, 1e9),
        ("rate_recv_post", "ns", 1.0, 1e6),
        ("rate_recv_wait", "ns", 1.0, 1e6),
    ];
    for (test, unit, lo, hi) in expected {
        let r: Vec<&Record> = recs
            .iter()
            .filter(|r| r.device == "psm-vs-raw" && r.test == test)
            .collect();
        assert_eq!(r.len(), 1, "one {test} record at 8 B:\n{stdout}");
        let r = r[0];
        assert_eq!((r.size, r.unit.as_str()), (8, unit), "{r:?}");
        for x in [r.value, r.floor] {
            assert!(x.is_finite() && x > lo && x < hi, "{r:?}");
        }
    }

    // Another device says it does not measure the split, and runs on.
    let (out, stdout) = bench(&[
        "--quick",
        "--max-size",
        "8",
        "--test",
        "rate_split",
        "--device",
        "thread",
    ]);
    assert!(out.status.success(), "{out:?}");
    assert!(
        stdout.contains("# rate_split: skipped on thread: it splits the psm device's rate"),
        "{stdout}"
    );
}
