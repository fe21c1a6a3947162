use super::*;

#[test]
fn floors_are_positive() {
    assert!(cache_line_floor(2_000, 1) > 0.0);
    assert!(memcpy_floor(4096, 2, 1) > 0.0);
}

#[test]
fn parallel_memcpy_floor_counts_every_copier() {
    assert_eq!(parallel_memcpy_floor(0, 4, 2, 1), 0.0);
    assert!(parallel_memcpy_floor(4096, 4, 2, 1) > 0.0);
    assert!(parallel_memcpy_floor(4096, 4, 1, 1) > 0.0);
}
