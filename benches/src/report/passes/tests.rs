use super::*;

fn rec(device: &str, test: &str, size: usize, value: f64) -> Record {
    Record {
        device: device.into(),
        test: test.into(),
        size,
        value,
        unit: if test == "latency" { "us" } else { "MB/s" }.into(),
        floor: 0.0,
    }
}

/// Three passes of bibw at 1 B where the host's state flips: Open MPI
/// fast in the first, slow in the others, and thread following it.
fn flipping() -> Vec<Pass> {
    let pass = |o: f64, t: f64| Pass {
        records: vec![
            rec(PASS_PEER, "bibw", 1, o),
            rec("thread", "bibw", 1, t),
            rec(PASS_PEER, "latency", 8, 0.3),
            rec("thread", "latency", 8, 0.2),
        ],
    };
    vec![pass(14.0, 13.0), pass(8.0, 8.8), pass(8.0, 9.6)]
}

#[test]
fn a_pass_runs_the_small_message_tests_of_one_device() {
    let a = pass_args("shm", true);
    let s = a.join(" ");
    assert!(
        s.starts_with("--json --device shm --test latency,bw,bibw,rate"),
        "{s}"
    );
    assert!(s.contains(&format!("--max-size {PASS_MAX_SIZE}")), "{s}");
    assert!(s.ends_with("--quick"), "{s}");
    assert!(!pass_args("thread", false).contains(&"--quick".to_string()));
}

#[test]
fn each_device_is_divided_by_the_peer_of_its_own_pass() {
    let r = pass_ratio(&flipping(), "thread", "bibw", 1).unwrap();
    // Per pass: 13/14, 8.8/8, 9.6/8; the median of those, not the ratio
    // of the medians (9.6 / 8 = 1.2).
    assert!((r.ratio - 1.1).abs() < 1e-9, "{r:?}");
    assert!((r.range.0 - 13.0 / 14.0).abs() < 1e-9, "{r:?}");
    assert!((r.range.1 - 1.2).abs() < 1e-9, "{r:?}");
    assert_eq!((r.level, r.passes), (2, 3));
    assert!((r.value - 9.6).abs() < 1e-9, "{r:?}");
    // Latency: the peer's over the device's, so above 1 is ahead too.
    let l = pass_ratio(&flipping(), "thread", "latency", 8).unwrap();
    assert!((l.ratio - 1.5).abs() < 1e-9, "{l:?}");
}

#[test]
fn a_pass_without_the_peer_or_the_device_does_not_count() {
    let mut p = flipping();
    p[0].records.retain(|r| r.device != PASS_PEER);
    p[1].records.retain(|r| r.device != "thread");
    let r = pass_ratio(&p, "thread", "bibw", 1).unwrap();
    assert_eq!((r.passes, r.level), (1, 1));
    assert!((r.ratio - 1.2).abs() < 1e-9, "{r:?}");
    assert_eq!(pass_ratio(&p, "shm", "bibw", 1), None);
}

#[test]
fn the_section_shows_the_median_ratio_and_how_many_passes_were_level() {
    let mut report = super::super::tests::report_with_rates();
    report.passes = Ok(flipping());
    let md = report.markdown();
    assert!(
        md.contains("### Small messages in interleaved passes"),
        "{md}"
    );
    assert!(
        md.contains("| bibw | 1 B | 8.00 MB/s (8.00–14.00) | 9.60 MB/s: **1.10x** (0.93–1.20, 2 of 3 ≥ 1) | – |"),
        "{md}"
    );
    assert!(md.contains("| latency | 8 B | 0.300 us"), "{md}");
    report.passes = Err("skipped (--no-mpi)".into());
    assert!(report
        .markdown()
        .contains("### Small messages in interleaved passes\n\nNot measured: skipped (--no-mpi)."));
}

#[test]
fn the_pass_records_are_written_with_their_pass_and_read_back() {
    let text = passes_jsonl(&flipping());
    assert_eq!(text.lines().count(), 12);
    assert!(
        text.lines()
            .nth(4)
            .unwrap()
            .starts_with("{\"pass\":2,\"device\":"),
        "{text}"
    );
    let back = parse_results(&text).records;
    assert_eq!(back.len(), 12);
    assert_eq!(back[1], rec("thread", "bibw", 1, 13.0));
}

#[test]
fn the_large_part_runs_bibw_from_256_kib_up_to_the_reports_largest_size() {
    assert!(large_pass_rows(128 << 10).is_empty());
    let rows = large_pass_rows(1 << 20);
    assert_eq!(
        rows,
        [("bibw", 256 << 10), ("bibw", 512 << 10), ("bibw", 1 << 20)]
    );
    assert_eq!(large_pass_rows(64 << 20).last(), Some(&("bibw", 4 << 20)));
    let s = large_pass_args("shm", 64 << 20, true).join(" ");
    assert_eq!(
        s,
        "--json --device shm --test bibw --min-size 262144 --max-size 4194304 --quick"
    );
}

#[test]
fn large_bibw_gets_its_own_section_only_where_measured() {
    let mut report = super::super::tests::report_with_rates();
    let pass = |o: f64, d: f64| Pass {
        records: vec![
            rec(PASS_PEER, "bibw", 1 << 20, o),
            rec("shm", "bibw", 1 << 20, d),
        ],
    };
    report.passes = Ok(vec![pass(8000.0, 7200.0), pass(10000.0, 10600.0)]);
    let md = report.markdown();
    let large = md
        .split("### Large bi-directional bandwidth in interleaved passes")
        .nth(1)
        .unwrap_or_else(|| panic!("{md}"));
    // Per pass 0.90 and 1.06: their median 0.98, one pass level.
    assert!(
        large.contains("| bibw | 1 MiB | 9000.00 MB/s (8000.00–10000.00) | 8900.00 MB/s: **0.98x** (0.90–1.06, 1 of 2 ≥ 1) |"),
        "{large}"
    );
    // Only the sizes some pass measured.
    assert!(!large.contains("| bibw | 256 KiB |"), "{large}");
    report.passes = Ok(flipping());
    assert!(!report
        .markdown()
        .contains("### Large bi-directional bandwidth"));
}
