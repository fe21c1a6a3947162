use super::*;
use crate::{osu, rate_floor};

#[test]
fn sizes_are_osu_powers_of_two() {
    assert_eq!(sizes(8), vec![0, 1, 2, 4, 8]);
    assert_eq!(*sizes(4 << 20).last().unwrap(), 4 << 20);
}

#[test]
fn large_window_tests_warm_up_for_128_mib_per_side() {
    // Up to 8 KiB: OSU's counts, unchanged.
    assert_eq!(bandwidth_iterations(8192), (100, 10));
    // Above: 20 timed windows, and warm-up windows enough to move
    // WARM_UP_BYTES (64 messages per window), at least OSU's 2.
    assert_eq!(bandwidth_iterations(16384), (20, 128));
    assert_eq!(bandwidth_iterations(256 << 10), (20, 8));
    assert_eq!(bandwidth_iterations(1 << 20), (20, 2));
    assert_eq!(bandwidth_iterations(4 << 20), (20, 2));
    // A size that does not divide it rounds up.
    assert_eq!(large_warm_up(3 << 20), 2);
    assert_eq!(large_warm_up(96 << 10), 22);
    for size in (14..=22).map(|p| 1usize << p) {
        assert!(large_warm_up(size) * size * WINDOW >= WARM_UP_BYTES);
    }
}

#[test]
fn benchmarks_run_on_the_thread_device() {
    let out = shm_ipc::ThreadWorld::new(2).run(|dev| {
        let l = latency(dev, 8, 50, 5).unwrap();
        let b = bandwidth(dev, 1024, 3, 1).unwrap();
        (l, b)
    });
    assert!(out[0].0.unwrap() > 0.0 && out[0].1.unwrap() > 0.0);
    assert!(out[1].0.is_none());
}

#[test]
fn bibw_and_mbw_mr_run_on_the_thread_device() {
    let out = shm_ipc::ThreadWorld::new(2).run(|dev| bibandwidth(dev, 4096, 3, 1).unwrap());
    assert!(out[0].unwrap() > 0.0 && out[1].is_none());
    // Five ranks: two pairs, rank 4 idles but passes the barriers.
    let out = shm_ipc::ThreadWorld::new(5).run(|dev| multi_bandwidth(dev, 64, 3, 1).unwrap());
    assert!(out[0].unwrap() > 0.0);
    assert!(out[1..].iter().all(Option::is_none));
    assert_eq!((mbw_pairs(4), mbw_pairs(5), mbw_pairs(2)), (2, 2, 1));
}

#[test]
fn message_rate_runs_on_the_thread_device() {
    let out = shm_ipc::ThreadWorld::new(2).run(|dev| message_rate(dev, 8, 5, 1).unwrap());
    let rate = out[0].unwrap();
    assert!(rate.is_finite() && rate > 0.0, "{rate}");
    assert!(out[1].is_none());
    // One pair whatever the world: rank 2 idles but passes the barriers.
    let out = shm_ipc::ThreadWorld::new(3).run(|dev| message_rate(dev, 1, 3, 1).unwrap());
    assert!(out[0].unwrap() > 0.0 && out[1].is_none() && out[2].is_none());
    assert_eq!(rate_floor(0.25), 4e6);
    assert_eq!(rate_floor(0.0), 0.0);
    let h = osu::rate_header("thread", "threads", 0.25);
    assert!(
        h.starts_with(
            "# OSU MPI Message Rate Test (xdev-bench)\n# [ pairs: 1 ] [ window size: 64 ]\n"
        ),
        "{h}"
    );
    assert!(h.contains("1 / 0.250 us (two threads pinned"), "{h}");
    assert!(
        h.lines()
            .last()
            .unwrap()
            .starts_with("# Size              Messages/s        Floor(msg/s)"),
        "{h}"
    );
}
