use super::check::check_pattern;
use super::{check_slots, pattern, CHECK_REGION, CLIENT_SEED, SERVER_SEED};
use crate::pingpong::error::PingpongError;

#[test]
fn patterns_differ_between_sides_iterations_and_offsets() {
    assert_ne!(pattern(CLIENT_SEED, 0, 0), pattern(SERVER_SEED, 0, 0));
    assert_ne!(pattern(CLIENT_SEED, 0, 0), pattern(CLIENT_SEED, 1, 0));
    let row: Vec<u8> = (0..512).map(|j| pattern(CLIENT_SEED, 3, j)).collect();
    assert!(row.windows(2).any(|w| w[0] != w[1]));
    // bytes 256 apart differ too
    assert_ne!(pattern(CLIENT_SEED, 3, 1), pattern(CLIENT_SEED, 3, 257));
}

#[test]
fn the_data_check_finds_the_first_wrong_byte() {
    let len = 10_000; // more than one chunk
    let mut msg: Vec<u8> = (0..len).map(|j| pattern(CLIENT_SEED, 7, j)).collect();
    fn read(m: &[u8]) -> impl FnMut(usize, &mut [u8]) + '_ {
        move |at, out| out.copy_from_slice(&m[at..at + out.len()])
    }
    let what = || "send_lat 10000 B".to_string();
    check_pattern(read(&msg), len, CLIENT_SEED, 7, what).unwrap();
    let e = check_pattern(read(&msg), len, CLIENT_SEED, 8, what).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("data check failed: send_lat 10000 B: byte 0 of message 8 is "),
        "{e}"
    );
    msg[9000] ^= 1;
    let e = check_pattern(read(&msg), len, CLIENT_SEED, 7, what).unwrap_err();
    assert!(matches!(e, PingpongError::DataCheck(_)), "{e}");
    assert!(e.to_string().contains("byte 9000 of message 7"), "{e}");
    // Only the first `len` bytes count.
    check_pattern(read(&msg), 9000, CLIENT_SEED, 7, what).unwrap();
}

#[test]
fn check_slots_fit_the_region() {
    assert_eq!(check_slots(128, 2), 128);
    assert_eq!(check_slots(128, 1 << 20), 16);
    assert_eq!(check_slots(128, 8 << 20), 2);
    assert_eq!(check_slots(128, 64 << 20), 1);
    assert_eq!(check_slots(0, 64), 1);
    for size in [1usize, 4096, 1 << 20, 1 << 23] {
        assert!(check_slots(128, size) * size <= CHECK_REGION.max(size));
    }
}
