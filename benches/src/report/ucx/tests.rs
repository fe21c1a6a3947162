use super::*;

/// `ucx_perftest 127.0.0.1 -c 0 -t tag_bw -s 8 -n 6400 -w 640 -f -v`,
/// UCX 1.13.1, `UCX_TLS=shm,self`, on this machine (stdout and stderr).
const TAG_BW_8: &str = "\
iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr
6400,0.136,0.122,0.122,62.36,62.36,8174039,8174039
";

/// `-t tag_bw -s 1048576 -n 200 -w 20 -f -v` (the count is padded).
const TAG_BW_1M: &str = "\
iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr
 200,0.104,3466.030,3466.030,288.51,288.51,289,289
";

/// `-t tag_lat -s 8 -n 3000000 -w 100 -v` without `-f`: interval rows,
/// then the final one; the final row is the last.
const TAG_LAT_PROGRESS: &str = "\
iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr
1325201,0.287,0.755,0.755,10.11,10.11,1325201,1325201
3000000,0.287,1.318,0.556,5.79,13.73,758796,1800113
";

/// A failed client (stderr captured with stdout).
const REFUSED: &str = "[1795642808.077317] [vm:23590:0]        perftest.c:405  UCX  ERROR \
client failed. connect() failed: Connection refused\n";

#[test]
fn parses_captured_csv_output() {
    let f = parse_perftest(TAG_BW_8).unwrap();
    assert_eq!(
        f,
        PerftestFigures {
            iterations: 6400,
            typical_lat: 0.136,
            avg_lat: 0.122,
            overall_lat: 0.122,
            avg_bw: 62.36,
            overall_bw: 62.36,
            avg_mr: 8174039.0,
            overall_mr: 8174039.0,
        }
    );
    let f = parse_perftest(TAG_BW_1M).unwrap();
    assert_eq!(
        (f.iterations, f.overall_bw, f.overall_mr),
        (200, 288.51, 289.0)
    );
    let f = parse_perftest(TAG_LAT_PROGRESS).unwrap();
    assert_eq!(
        (f.iterations, f.overall_lat, f.avg_lat),
        (3_000_000, 0.556, 1.318)
    );
}

#[test]
fn log_lines_and_test_name_columns_are_skipped() {
    let text = format!(
        "[1795641736.967206] [vm:4499 :0] perftest_params.c:434  UCX  WARN something\n\
         batch,iterations,99.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr\n\
         {REFUSED}\
         lat8,20000,0.286,2.551,2.551,2.99,2.99,392019,392019\n"
    );
    let f = parse_perftest(&text).unwrap();
    assert_eq!(
        (f.iterations, f.typical_lat, f.overall_mr),
        (20000, 0.286, 392019.0)
    );
}

#[test]
fn bad_output_is_a_typed_error() {
    assert_eq!(parse_perftest(REFUSED), Err(PerftestError::NoHeader));
    assert_eq!(parse_perftest(""), Err(PerftestError::NoHeader));
    let header_only = TAG_BW_8.lines().next().unwrap();
    assert_eq!(parse_perftest(header_only), Err(PerftestError::NoFigures));
    // A truncated row (the client killed mid-line) is not taken.
    let cut = format!("{header_only}\n6400,0.136,0.122\n");
    assert_eq!(parse_perftest(&cut), Err(PerftestError::NoFigures));
    let nan = format!("{header_only}\n6400,0.136,0.122,x,62.36,62.36,8174039,8174039\n");
    assert_eq!(
        parse_perftest(&nan),
        Err(PerftestError::BadField {
            column: "overall_lat".into(),
            value: "x".into()
        })
    );
    let negative = format!("{header_only}\n6400,0.136,0.122,-1,62.36,62.36,8174039,8174039\n");
    assert!(matches!(
        parse_perftest(&negative),
        Err(PerftestError::BadField { .. })
    ));
    let no_mr = "iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr\n1,1,1,1,1,1,1\n";
    assert_eq!(parse_perftest(no_mr), Err(PerftestError::NoHeader));
    let no_pct =
        "iterations,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr\n1,1,1,1,1,1,1\n";
    assert_eq!(
        parse_perftest(no_pct),
        Err(PerftestError::MissingColumn("<rank>_percentile_lat"))
    );
}

#[test]
fn figures_become_the_reports_records() {
    let f = parse_perftest(TAG_BW_8).unwrap();
    let r = records_of(UcxTest::TagBw, 8, &f);
    assert_eq!(r.len(), 2);
    assert_eq!((r[0].device.as_str(), r[0].test.as_str()), (UCX, "bw"));
    // ucx_perftest's MB/s are MiB/s: 62.36 MiB/s = 65.39 MB/s.
    assert!((r[0].value - 65.388_708).abs() < 1e-3, "{}", r[0].value);
    assert_eq!(
        (r[1].test.as_str(), r[1].value, r[1].unit.as_str()),
        ("rate", 8174039.0, "msg/s")
    );
    let r = records_of(
        UcxTest::TagLat,
        0,
        &parse_perftest(TAG_LAT_PROGRESS).unwrap(),
    );
    assert_eq!(r.len(), 1);
    assert_eq!(
        (r[0].test.as_str(), r[0].value, r[0].size, r[0].floor),
        ("latency", 0.556, 0, 0.0)
    );
}

#[test]
fn counts_sizes_and_arguments_follow_osu() {
    assert_eq!(UcxTest::TagLat.iterations(8192, false), (10_000, 100));
    assert_eq!(UcxTest::TagLat.iterations(16384, false), (1000, 10));
    assert_eq!(UcxTest::TagBw.iterations(8, false), (6400, 640));
    assert_eq!(UcxTest::TagBw.iterations(1 << 20, true), (128, 12));
    assert_eq!(sizes(UcxTest::TagLat, 4), [0, 1, 2, 4]);
    assert_eq!(sizes(UcxTest::TagBw, 5), [1, 2, 4]);
    assert_eq!(sizes(UcxTest::TagBw, 0), Vec::<usize>::new());
    let a = client_args(4242, UcxTest::TagBw, 64, false).join(" ");
    assert_eq!(
        a,
        "127.0.0.1 -p 4242 -c 0 -t tag_bw -s 64 -n 6400 -w 640 -f -v"
    );
    assert_eq!(server_args(4242).join(" "), "-c 1 -p 4242");
}

#[test]
fn versions() {
    assert_eq!(
        version_of("# Version 1.13.1\n# Git branch '<unknown>', revision 0000000\n").as_deref(),
        Some("UCX 1.13.1")
    );
    assert_eq!(version_of("nothing"), None);
}

#[test]
fn an_absent_ucx_is_not_measured_with_the_install_command() {
    let e = measure_ucx_at(None, 8, 1, true).unwrap_err();
    assert!(
        e.contains("not installed") && e.contains(UCX_INSTALL),
        "{e}"
    );
}

#[test]
fn an_installed_ucx_perftest_runs_and_parses() {
    let Some(exe) = which(UCX_PERFTEST) else {
        println!("skipped: {UCX_PERFTEST} is not installed ({UCX_INSTALL})");
        return;
    };
    let f = run_pair(&exe, UcxTest::TagLat, 8, true).unwrap();
    assert_eq!(f.iterations, 1000);
    assert!(f.overall_lat > 0.0 && f.overall_mr > 0.0, "{f:?}");
    let (records, how) = measure_ucx_at(Some(exe), 2, 1, true).unwrap();
    // tag_lat at 0, 1 and 2 bytes; tag_bw (bw and rate) at 1 and 2.
    assert_eq!(records.len(), 3 + 2 * 2, "{records:?}");
    assert!(how.contains("UCX 1.") && !how.contains("failed"), "{how}");
}
