use super::*;

#[test]
fn reads_own_memory_and_reports_bad_addresses() {
    let src: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
    let mut dst = vec![0u8; src.len()];
    read_remote(std::process::id(), src.as_ptr() as u64, &mut dst).unwrap();
    assert_eq!(src, dst);
    let e = read_remote(std::process::id(), 8, &mut dst[..16]).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EFAULT));
    let e = read_remote(u32::MAX >> 1, src.as_ptr() as u64, &mut dst[..16]).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ESRCH));
    read_remote(std::process::id(), 8, &mut []).unwrap();
}

#[test]
fn writes_own_memory_and_reports_bad_addresses() {
    let src: Vec<u8> = (0..10_000u32).map(|i| (i * 3) as u8).collect();
    let mut dst = vec![0u8; src.len()];
    write_remote(std::process::id(), dst.as_mut_ptr() as u64, &src).unwrap();
    assert_eq!(src, std::hint::black_box(&dst)[..]);
    let e = write_remote(std::process::id(), 8, &src[..16]).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EFAULT));
}

#[test]
fn calibration_gives_a_plausible_speed() {
    let s = calibrate().expect("CMA works on the own process");
    assert!(s > 0.0 && s < 100.0, "{s}");
    println!("CMA speed relative to memcpy here: {s:.2}");
}
