//! The report's interleaved passes against a real Open MPI: every pass
//! ran Open MPI's osu_peer and the thread and shm devices at small messages,
//! then Open MPI and shm at osu_bibw from 256 KiB, and the sections divide
//! each device by its own pass's Open MPI.

use std::process::{Command, Stdio};

use xdev_bench::report::{
    large_pass_rows, parse_results, which, LARGE_PASS_DEVICES, PASS_DEVICES, PASS_PEER, PASS_ROWS,
};

const BENCH: &str = env!("CARGO_BIN_EXE_xdev-bench");

#[test]
fn every_pass_measures_open_mpi_and_both_devices() {
    if which("mpicc.openmpi").is_none() || which("mpirun.openmpi").is_none() {
        println!("skipped: Open MPI is not installed (the test command installs openmpi-bin)");
        return;
    }
    // The shm device's ranks are processes, started by `xdev-run`.
    if !std::path::Path::new(BENCH)
        .with_file_name("xdev-run")
        .is_file()
    {
        println!("skipped: no xdev-run next to xdev-bench (cargo test --workspace builds it)");
        return;
    }
    let dir = std::env::temp_dir().join(format!("xdev-bench-passes-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let dir_arg = dir.display().to_string();
    let args = [
        "report",
        "--quick",
        "--no-ucx",
        "--max-size",
        "262144",
        "--passes",
        "2",
        "--out",
        &dir_arg,
    ];
    let out = Command::new(BENCH)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("xdev-bench starts");
    assert!(out.status.success(), "{out:?}");
    let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
    let section = md
        .split("### Small messages in interleaved passes")
        .nth(1)
        .unwrap_or_else(|| panic!("no passes section: {md}"));
    assert!(section.trim_start().starts_with("2 passes"), "{section}");
    // The records: each pass has the peer and both devices on every
    // small-message row, and the peer and shm on the large one (256 KiB,
    // the report's --max-size).
    let text = std::fs::read_to_string(dir.join("passes.jsonl")).unwrap();
    assert_eq!(large_pass_rows(262_144), [("bibw", 262_144)]);
    for pass in 1..=2 {
        let tag = format!("{{\"pass\":{pass},");
        let lines: String = text
            .lines()
            .filter(|l| l.starts_with(&tag))
            .map(|l| format!("{l}\n"))
            .collect();
        let records = parse_results(&lines).records;
        for series in std::iter::once(PASS_PEER).chain(PASS_DEVICES) {
            for (test, size) in PASS_ROWS {
                let r = records
                    .iter()
                    .find(|r| r.device == series && r.test == test && r.size == size);
                assert!(
                    r.is_some_and(|r| r.value > 0.0),
                    "pass {pass}: no {series} {test} {size}: {text}"
                );
            }
        }
        for series in std::iter::once(PASS_PEER).chain(LARGE_PASS_DEVICES) {
            let found: Vec<_> = records
                .iter()
                .filter(|r| r.device == series && r.test == "bibw" && r.size > 64)
                .map(|r| (r.size, r.value > 0.0))
                .collect();
            // Nothing below 256 KiB in the large part (osu_peer's MIN_SIZE
            // and TESTS narrowed it), nothing past --max-size.
            assert_eq!(found, [(262_144, true)], "pass {pass}: {series}: {text}");
        }
    }
    // The section's row of rate at 8 B: the peer's median and a ratio for
    // each device, from 2 passes.
    let row = section
        .lines()
        .find(|l| l.starts_with("| rate | 8 B |"))
        .unwrap_or_else(|| panic!("{section}"));
    assert_eq!(row.matches("of 2 ≥ 1").count(), PASS_DEVICES.len(), "{row}");
    let large = md
        .split("### Large bi-directional bandwidth in interleaved passes")
        .nth(1)
        .unwrap_or_else(|| panic!("no large passes section: {md}"));
    let row = large
        .lines()
        .find(|l| l.starts_with("| bibw | 256 KiB |"))
        .unwrap_or_else(|| panic!("{large}"));
    assert_eq!(
        row.matches("of 2 ≥ 1").count(),
        LARGE_PASS_DEVICES.len(),
        "{row}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
