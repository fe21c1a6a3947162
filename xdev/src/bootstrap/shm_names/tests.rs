use super::*;

#[test]
fn names() {
    let p = shm_prefix("a b/c");
    assert!(p.starts_with("/xdev-a_b_c-") && p.ends_with('-'), "{p}");
    assert!(is_xdev_shm_name(&format!("{p}0-ring")), "{p}");
    assert!(is_xdev_shm_name("/xdev-job-0-00ff"));
    assert!(!is_xdev_shm_name("/xdev-"));
    assert!(!is_xdev_shm_name("/xdev-../../etc"));
    assert!(!is_xdev_shm_name("/other-1"));
    assert!(!is_xdev_shm_name(&format!("/xdev-{}", "a".repeat(300))));
}

#[test]
fn jobs_that_differ_anywhere_have_unrelated_prefixes() {
    let long = "j".repeat(100);
    let pairs = [
        (format!("{long}-a"), format!("{long}-b")), // past the cut
        ("a b".to_string(), "a_b".to_string()),     // sanitized alike
        ("job".to_string(), "job1".to_string()),    // one a prefix of the other
    ];
    for (a, b) in pairs {
        let (pa, pb) = (shm_prefix(&a), shm_prefix(&b));
        assert!(
            !pa.starts_with(&pb) && !pb.starts_with(&pa),
            "{a:?} and {b:?}: {pa} / {pb}"
        );
    }
    // The same job always gets the same prefix (ranks and the launcher
    // compute it apart).
    assert_eq!(shm_prefix("same"), shm_prefix("same"));
}

#[test]
fn a_sweep_of_one_long_job_leaves_its_twin_alone() {
    let long = format!("rm-{}", "x".repeat(80));
    let (a, b) = (format!("{long}-a"), format!("{long}-b"));
    let path = |job: &str| format!("/dev/shm{}0-ring", shm_prefix(job));
    std::fs::write(path(&a), b"x").unwrap();
    std::fs::write(path(&b), b"x").unwrap();
    assert_eq!(remove_job_shm(&a), 1);
    assert!(!std::path::Path::new(&path(&a)).exists());
    assert!(
        std::path::Path::new(&path(&b)).exists(),
        "the twin's segment survived"
    );
    assert_eq!(remove_job_shm(&b), 1);
}

#[test]
fn psm2_segments_of_a_dead_endpoint_go_and_nothing_else() {
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    let epid = 0x0000_7e57_0000_00a0_u64 ^ u64::from(std::process::id());
    let path = |tail: &str| format!("/dev/shm/psm2_shm.{uid}{epid:016x}{tail}");
    let other = format!("/dev/shm/psm2_shm.{uid}{:016x}0", epid ^ 1);
    for p in [path("0"), path("1"), path("x"), other.clone()] {
        std::fs::write(&p, b"x").unwrap();
    }
    // Seen dead before the segments were made: nothing goes.
    let before = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    assert_eq!(remove_psm2_shm(epid, before), 0);
    let now = std::time::SystemTime::now();
    assert_eq!(remove_psm2_shm(epid, now), 2);
    assert!(!std::path::Path::new(&path("0")).exists());
    assert!(!std::path::Path::new(&path("1")).exists());
    assert!(std::path::Path::new(&path("x")).exists(), "not a PSM2 name");
    assert!(std::path::Path::new(&other).exists(), "another endpoint's");
    std::fs::remove_file(path("x")).unwrap();
    std::fs::remove_file(other).unwrap();
}

/// Issue 21: a rank may store any epid as its own; the sweep must not
/// take a segment some process still uses, however old it looks.
#[test]
fn a_psm2_segment_still_mapped_or_open_is_never_removed() {
    use std::os::fd::AsRawFd;
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    let epid = 0x0000_11fe_0000_00b0_u64 ^ u64::from(std::process::id());
    let path = |n: u32| format!("/dev/shm/psm2_shm.{uid}{epid:016x}{n}");
    let old = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    let make = |n: u32| {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path(n))
            .unwrap();
        f.set_len(4096).unwrap();
        f.set_modified(old).unwrap();
        f
    };
    // Segment 0: mapped by this process (its descriptor closed).
    let f0 = make(0);
    // SAFETY: a fresh shared read-only mapping of a 4096-byte file;
    // nothing else refers to that address range.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f0.as_raw_fd(),
            0,
        )
    };
    assert_ne!(map, libc::MAP_FAILED);
    drop(f0);
    // Segment 1: held open by another process.
    let f1 = make(1);
    let mut holder = std::process::Command::new("sleep")
        .arg("30")
        .stdin(f1)
        .spawn()
        .unwrap();
    let now = std::time::SystemTime::now();
    let left = remove_psm2_shm(epid, now);
    let (kept0, kept1) = (
        std::path::Path::new(&path(0)).exists(),
        std::path::Path::new(&path(1)).exists(),
    );
    // SAFETY: `map` is the mapping made above, unmapped once.
    unsafe { libc::munmap(map, 4096) };
    let _ = holder.kill();
    let _ = holder.wait();
    assert!(kept0, "a segment this process maps was removed");
    assert!(kept1, "a segment another process holds open was removed");
    assert_eq!(left, 0);
    // Unused now: both go.
    assert_eq!(remove_psm2_shm(epid, now), 2);
    assert!(!std::path::Path::new(&path(0)).exists());
    assert!(!std::path::Path::new(&path(1)).exists());
}

#[test]
fn maps_lines_name_device_and_inode() {
    assert_eq!(
        map_file_id("7f00-7f01 r--s 00000000 00:1a 4242    /dev/shm/psm2_shm.0x0"),
        Some((0, 0x1a, 4242))
    );
    assert_eq!(
        map_file_id("7f00-7f01 rw-p 00000000 fd:01 77 /usr/lib/x.so (deleted)"),
        Some((0xfd, 1, 77))
    );
    assert_eq!(map_file_id("7f00-7f01 rw-p 00000000 00:00 0 [heap]"), None);
    assert_eq!(map_file_id("garbage"), None);
}

#[test]
fn removes_only_the_job() {
    let mk = |name: &str| {
        std::fs::write(format!("/dev/shm{name}"), b"x").unwrap();
        format!("/dev/shm{name}")
    };
    let a = mk(&format!("{}1-abc", shm_prefix("rm-job-a")));
    let b = mk(&format!("{}1-abc", shm_prefix("rm-job-b")));
    assert_eq!(remove_job_shm("rm-job-a"), 1);
    assert!(!std::path::Path::new(&a).exists());
    assert!(std::path::Path::new(&b).exists());
    assert_eq!(remove_job_shm("rm-job-b"), 1);
}
