use crate::osu;

#[test]
fn osu_row_layout() {
    let r = osu::row(8, 0.25, 0.125);
    assert_eq!(&r[..10], "8         ");
    assert_eq!(r[10..30].trim_start(), "0.25");
    assert_eq!(r.len(), 62);
    assert!(r.ends_with("2.00"));
}

#[test]
fn multi_bandwidth_layout() {
    let r = osu::multi_bandwidth_row(4, 2.0, 4.0);
    assert_eq!(&r[..10], "4         ");
    assert_eq!(r[10..30].trim_start(), "2.00");
    assert_eq!(r[30..50].trim_start(), "500000.00");
    assert!(r.ends_with("0.50"), "{r}");
    let h = osu::multi_bandwidth_header("shm", 2);
    assert!(h.starts_with("# OSU MPI Multiple Bandwidth / Message Rate Test"));
    assert!(h.contains("# [ pairs: 2 ] [ window size: 64 ]"));
    let cols = h.lines().last().unwrap();
    assert!(
        cols.starts_with("# Size                    MB/s          Messages/s"),
        "{cols:?}"
    );
    assert!(osu::bibandwidth_header("shm").starts_with("# OSU MPI Bi-Directional Bandwidth Test"));
    assert_eq!(
        osu::multi_bandwidth_json("shm", 2, 1.0, 2.0, 2),
        "{\"device\":\"shm\",\"test\":\"mbw_mr\",\"size\":2,\"value\":1.0000,\"unit\":\"MB/s\",\"floor\":2.0000,\"pairs\":2,\"messages_per_s\":500000.00}"
    );
}

#[test]
fn not_measured_lines() {
    assert_eq!(
        osu::not_measured("ibv", "verbs not available: no device", false),
        "# Device: ibv: not measured: verbs not available: no device"
    );
    assert_eq!(
        osu::not_measured("ibv", "say \"no\"\n", true),
        "{\"device\":\"ibv\",\"not_measured\":\"say \\\"no\\\"\\n\"}"
    );
}
