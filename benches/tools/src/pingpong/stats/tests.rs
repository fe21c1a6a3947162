use super::*;

#[test]
fn latency_is_half_the_round_trip_like_perftest() {
    // 1 cycle per us; round trips of 20 cycles, two outliers at the top.
    let mut t = vec![0u64];
    for i in 0..100 {
        let rt = if i == 50 {
            2000
        } else if i == 60 {
            1000
        } else {
            20 + (i % 3) as u64
        };
        t.push(t.last().unwrap() + rt);
    }
    let s = latency_stats(&t, 1.0).unwrap();
    assert_eq!(s.min, 10.0);
    assert_eq!(s.typical, 10.5); // median of 20, 21, 22 cycles, halved
                                 // perftest's t_max is the second largest sample: the largest is dropped.
    assert_eq!(s.max, 500.0);
    assert!(s.avg > 10.0 && s.avg < 11.5, "{}", s.avg);
    assert!(s.stdev < 1.0, "{}", s.stdev);
    assert!(s.p99 >= s.typical && s.p99_9 >= s.p99);
    assert_eq!(latency_stats(&[0, 5], 1.0), None);
    assert_eq!(latency_stats(&t, 0.0), None);
}

#[test]
fn perftest_median_of_an_even_count() {
    // 5 stamps -> 4 samples, 2 kept after the tail: (d0 + d1) / 2.
    let s = latency_stats(&[0, 10, 30, 60, 100], 1.0).unwrap();
    assert_eq!(s.typical, 7.5); // (10 + 20) / 2 / 2
    assert_eq!(s.max, 15.0); // delta[measure_cnt] = 30
}

#[test]
fn bandwidth_average_and_peak() {
    // 1 MiB messages, 1000 cycles/us; one message every 10 ms (1e7 cycles),
    // completions at the same pace: 100 MiB/s.
    let posted: Vec<u64> = (0..10).map(|i| i * 10_000_000).collect();
    let completed: Vec<(usize, u64)> = (0..10).map(|j| (j, (j as u64 + 1) * 10_000_000)).collect();
    let s = bw_stats(1 << 20, &posted, &completed, 1000.0).unwrap();
    assert!((s.avg - 100.0).abs() < 1e-9, "{}", s.avg);
    assert!((s.peak - 100.0).abs() < 1e-9, "{}", s.peak);
    assert!((s.msg_rate - 0.0001).abs() < 1e-12, "{}", s.msg_rate);
    assert!(bw_stats(8, &[], &[], 1.0).is_none());
}

#[test]
fn rows_match_perftests_layout() {
    let s = LatencyStats {
        min: 13.63,
        max: 271.5,
        typical: 14.68,
        avg: 16.71,
        stdev: 14.01,
        p99: 62.88,
        p99_9: 271.5,
    };
    // A row printed by ib_send_lat 6.06.
    assert_eq!(
        latency_row(8, 1000, &s),
        " 8       1000          13.63          271.50       14.68    \t       16.71       \t14.01  \t\t62.88   \t\t271.50 "
    );
    let b = BwStats {
        peak: 56.57,
        avg: 50.55,
        msg_rate: 0.000051,
    };
    assert_eq!(
        bw_row(1048576, 300, &b),
        " 1048576    300              56.57              50.55  \t\t   0.000051"
    );
}

#[test]
fn json_records_are_single_lines() {
    let c = RecordContext {
        test: "send_lat".into(),
        role: "client".into(),
        peer: "perftest".into(),
        device: "rx\"e0".into(),
    };
    let s = LatencyStats {
        min: 1.0,
        max: f64::NAN,
        typical: 1.5,
        avg: 1.25,
        stdev: 0.1,
        p99: 2.0,
        p99_9: 3.0,
    };
    let j = c.latency_json(8, 1000, &s);
    assert!(
        j.starts_with("{\"tool\":\"ibvx-pingpong\",\"test\":\"send_lat\""),
        "{j}"
    );
    assert!(j.contains("\"device\":\"rx\\\"e0\""), "{j}");
    assert!(j.contains("\"t_max_us\":null"), "{j}");
    assert!(j.contains("\"t_typical_us\":1.5000"), "{j}");
    assert!(j.ends_with('}') && !j.contains('\n'));
    let b = c.bw_json(
        65536,
        5000,
        &BwStats {
            peak: 1.0,
            avg: 0.5,
            msg_rate: 0.000008,
        },
    );
    assert!(
        b.contains("\"bw_avg_mib_s\":0.5000") && b.contains("\"msg_rate_mpps\":0.000008"),
        "{b}"
    );
    assert_eq!(json_str("a\nb"), "\"a\\u000ab\"");
}
