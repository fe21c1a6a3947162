use super::*;

#[test]
fn civil_dates() {
    assert_eq!(civil_from_days(0), (1970, 1, 1));
    assert_eq!(civil_from_days(19_723), (2024, 1, 1));
    assert_eq!(civil_from_days(19_782), (2024, 2, 29));
    assert_eq!(civil_from_days(-1), (1969, 12, 31));
}

#[test]
fn the_load_sampler_samples_at_once() {
    let s = LoadSampler::start();
    std::thread::sleep(Duration::from_millis(300));
    let (lo, hi) = s.finish().expect("a sample of /proc/loadavg");
    assert!(lo >= 0.0 && lo <= hi, "{lo} {hi}");
}
