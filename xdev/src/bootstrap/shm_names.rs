//! Names of a job's shared-memory objects, so that the launcher can clean up
//! after a job whose ranks crashed before they unlinked their segments.
//!
//! Every multi-process device names its POSIX shared-memory objects
//! `/xdev-<job>-<hash>-<anything>` ([`shm_prefix`]), and `xdev-run` removes
//! what is left with that prefix when the job ends ([`remove_job_shm`]).
//! The readable part is the job id sanitized and cut short; the hash is
//! over the whole id, so that two jobs whose ids differ anywhere (past the
//! cut, or only in characters the sanitizing maps alike) never share a
//! prefix, and one job's sweep never removes the other's segments.

use sha2::{Digest, Sha256};

/// Characters of the job id kept readable in a name.
const READABLE: usize = 40;

/// The prefix of every shared-memory object name of `job`:
/// `/xdev-<job with non-alphanumerics as '_', at most 40 chars>-<16 hex
/// digits of SHA-256 of the whole job id>-`.
pub fn shm_prefix(job: &str) -> String {
    let clean: String = job
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .take(READABLE)
        .collect();
    let digest = Sha256::digest(job.as_bytes());
    let hash: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("/xdev-{clean}-{hash}-")
}

/// Whether `name` is a well-formed xdev shared-memory object name: the
/// `/xdev-` prefix, then 1..=194 of `[A-Za-z0-9_-]` (so no path tricks).
pub fn is_xdev_shm_name(name: &str) -> bool {
    name.len() > 6
        && name.len() <= 200
        && name.starts_with("/xdev-")
        && name[1..]
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// Removes every shared-memory object of `job` left in `/dev/shm`; returns
/// how many were removed.
pub fn remove_job_shm(job: &str) -> usize {
    let prefix = shm_prefix(job);
    let Ok(dir) = std::fs::read_dir("/dev/shm") else {
        return 0;
    };
    let mut n = 0;
    for e in dir.flatten() {
        let name = format!("/{}", e.file_name().to_string_lossy());
        if !(name.starts_with(&prefix) && is_xdev_shm_name(&name)) {
            continue;
        }
        let Ok(c) = std::ffi::CString::new(name) else {
            continue;
        };
        // SAFETY: c is NUL-terminated; shm_unlink only removes a name.
        if unsafe { libc::shm_unlink(c.as_ptr()) } == 0 {
            n += 1;
        }
    }
    n
}

/// Bootstrap key prefix (then the rank) under which the psm device stores
/// each rank's PSM2 epid (8 bytes, little-endian).
pub const PSM2_EPID_KEY: &str = "xdev.psm2.epid.";

/// Removes the shared-memory segments PSM2 made for the endpoint `epid` of
/// this user (`/dev/shm/psm2_shm.<uid><epid as 16 hex digits><n>`), which a
/// rank that crashed leaves behind, 4 MiB each. Only segments last changed
/// no later than `died` (when the rank was seen gone) go: a segment of a
/// later process that happens to get the same epid is left alone. Returns
/// how many were removed.
pub fn remove_psm2_shm(epid: u64, died: std::time::SystemTime) -> usize {
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    let prefix = format!("psm2_shm.{uid}{epid:016x}");
    let Ok(dir) = std::fs::read_dir("/dev/shm") else {
        return 0;
    };
    let mut n = 0;
    for e in dir.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(&prefix) else {
            continue;
        };
        if rest.is_empty() || !rest.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let old_enough = e
            .metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|t| t <= died);
        if old_enough && std::fs::remove_file(e.path()).is_ok() {
            n += 1;
        }
    }
    n
}

#[cfg(test)]
mod tests {
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
}
