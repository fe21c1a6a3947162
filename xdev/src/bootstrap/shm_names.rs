//! Names of a job's shared-memory objects, so that the launcher can clean up
//! after a job whose ranks crashed before they unlinked their segments.
//!
//! Every multi-process device names its POSIX shared-memory objects
//! `/xdev-<job>-<anything>` ([`shm_prefix`], the job id sanitized), and
//! `xdev-run` removes what is left with that prefix when the job ends
//! ([`remove_job_shm`]).

/// The prefix of every shared-memory object name of `job`:
/// `/xdev-<job with non-alphanumerics as '_', at most 64 chars>-`.
pub fn shm_prefix(job: &str) -> String {
    let clean: String = job
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .take(64)
        .collect();
    format!("/xdev-{clean}-")
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(shm_prefix("a b/c"), "/xdev-a_b_c-");
        assert!(is_xdev_shm_name("/xdev-job-0-00ff"));
        assert!(!is_xdev_shm_name("/xdev-"));
        assert!(!is_xdev_shm_name("/xdev-../../etc"));
        assert!(!is_xdev_shm_name("/other-1"));
        assert!(!is_xdev_shm_name(&format!("/xdev-{}", "a".repeat(300))));
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
