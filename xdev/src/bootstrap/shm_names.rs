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
    let hash = hex::encode(&digest[..8]);
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
/// later process that happens to get the same epid is left alone. A segment
/// that some process still maps or holds open (as far as `/proc` shows this
/// process: every process of this user) is live and never removed, whatever
/// its age, so an epid a rank made up cannot take another job's live
/// segment away. Returns how many were removed.
pub fn remove_psm2_shm(epid: u64, died: std::time::SystemTime) -> usize {
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    let prefix = format!("psm2_shm.{uid}{epid:016x}");
    let Ok(dir) = std::fs::read_dir("/dev/shm") else {
        return 0;
    };
    let candidates: Vec<(std::path::PathBuf, std::fs::Metadata)> = dir
        .flatten()
        .filter(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.strip_prefix(&prefix)
                .is_some_and(|rest| !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit()))
        })
        .filter_map(|e| {
            let m = e.metadata().ok()?;
            let old_enough = m.modified().is_ok_and(|t| t <= died);
            (old_enough && m.is_file()).then(|| (e.path(), m))
        })
        .collect();
    if candidates.is_empty() {
        return 0;
    }
    let in_use = InUse::scan(&format!("/dev/shm/{prefix}"));
    let mut n = 0;
    for (path, m) in candidates {
        if in_use.holds(&path, &m) {
            continue;
        }
        if std::fs::remove_file(&path).is_ok() {
            n += 1;
        }
    }
    n
}

/// What the processes `/proc` lets this process see map (device and inode
/// of each file-backed mapping) and hold open (paths under one prefix).
struct InUse {
    mapped: std::collections::HashSet<(u64, u64, u64)>,
    open: std::collections::HashSet<std::path::PathBuf>,
}

impl InUse {
    /// Scans `/proc/<pid>/maps` and `/proc/<pid>/fd` of every process this
    /// process may inspect (those of its user; every process for root).
    /// Open descriptors count only for paths starting with `prefix`.
    fn scan(prefix: &str) -> InUse {
        let mut mapped = std::collections::HashSet::new();
        let mut open = std::collections::HashSet::new();
        let Ok(procs) = std::fs::read_dir("/proc") else {
            return InUse { mapped, open };
        };
        for p in procs.flatten() {
            let name = p.file_name();
            let Some(pid) = name
                .to_str()
                .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
            else {
                continue;
            };
            if let Ok(maps) = std::fs::read_to_string(format!("/proc/{pid}/maps")) {
                mapped.extend(maps.lines().filter_map(map_file_id));
            }
            if let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
                for fd in fds.flatten() {
                    if let Ok(target) = std::fs::read_link(fd.path()) {
                        if target.to_string_lossy().starts_with(prefix) {
                            open.insert(target);
                        }
                    }
                }
            }
        }
        InUse { mapped, open }
    }

    /// Whether the file at `path` with metadata `m` is mapped or open.
    fn holds(&self, path: &std::path::Path, m: &std::fs::Metadata) -> bool {
        use std::os::unix::fs::MetadataExt;
        // glibc's encoding of st_dev, as `gnu_dev_major` and `gnu_dev_minor`.
        let dev = m.dev();
        let major = ((dev >> 32) & 0xffff_f000) | ((dev >> 8) & 0xfff);
        let minor = ((dev >> 12) & 0xffff_ff00) | (dev & 0xff);
        self.mapped.contains(&(major, minor, m.ino())) || self.open.contains(path)
    }
}

/// The device (major, minor) and inode of a file-backed line of
/// `/proc/<pid>/maps` (`addr perms offset MAJ:MIN inode path`).
fn map_file_id(line: &str) -> Option<(u64, u64, u64)> {
    let mut f = line.split_ascii_whitespace();
    let dev = f.nth(3)?;
    let inode: u64 = f.next()?.parse().ok()?;
    if inode == 0 {
        return None;
    }
    let (major, minor) = dev.split_once(':')?;
    Some((
        u64::from_str_radix(major, 16).ok()?,
        u64::from_str_radix(minor, 16).ok()?,
        inode,
    ))
}

#[cfg(test)]
mod tests;
