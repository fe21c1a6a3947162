//! Process mode: the pieces a rank process of a launched job (`xdev-run`)
//! needs beyond the device's own benchmarks.
//!
//! * [`Coordinator`]: how the ranks agree on things outside the
//!   measurements, through the bootstrap service when the program owns this
//!   rank's connection to it, or through the device (a device that uses the
//!   bootstrap holds that connection: the service lets each rank connect
//!   once per job).
//! * [`SharedLine`]: a [`HandoffLine`] in a POSIX shared-memory object.
//! * [`ProcessFloor`]: the cache-line floor between the rank processes,
//!   the same [`HandoffLine`] loop as the thread floor.

use std::ffi::{CStr, CString};
use std::io;
use std::ptr::NonNull;
use std::time::Duration;

use xdev::bootstrap::{is_xdev_shm_name, shm_prefix, Bootstrap, Secret};
use xdev::{Device, Error, Rank, Source, TagSel};

use crate::{HandoffLine, BENCH_CONTEXT};

/// How the ranks of a process-mode run agree on things outside the
/// measurements. Every rank calls the same methods in the same order.
pub trait Coordinator {
    /// This rank.
    fn rank(&self) -> Rank;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// Rank 0's `value` (the argument is ignored on other ranks), returned
    /// on every rank. `key` names the value; it is unique within a job.
    fn share(&self, key: &str, value: &[u8]) -> xdev::Result<Vec<u8>>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> xdev::Result<()>;
}

/// How long a rank waits for rank 0's shared value through the bootstrap.
pub const SHARE_TIMEOUT: Duration = Duration::from_secs(60);

impl Coordinator for Bootstrap {
    fn rank(&self) -> Rank {
        Bootstrap::rank(self)
    }

    fn size(&self) -> usize {
        Bootstrap::size(self)
    }

    fn share(&self, key: &str, value: &[u8]) -> xdev::Result<Vec<u8>> {
        if Bootstrap::rank(self) == 0 {
            self.put(key, value)?;
            Ok(value.to_vec())
        } else {
            self.get(key, SHARE_TIMEOUT)
        }
    }

    fn barrier(&self) -> xdev::Result<()> {
        Bootstrap::barrier(self)
    }
}

/// A [`Coordinator`] over the device itself: rank 0 sends to every rank on a
/// context of its own ([`BENCH_CONTEXT`] + 2), and the barrier is
/// [`xdev::devkit::conformance::barrier`]. Keys are not sent: messages from one
/// sender match in order, and every rank calls in the same order.
pub struct DeviceCoordinator<'a>(pub &'a dyn Device);

const COORDINATION: u32 = BENCH_CONTEXT + 2;
const SHARE_TAG: i32 = 1;

impl Coordinator for DeviceCoordinator<'_> {
    fn rank(&self) -> Rank {
        self.0.id()
    }

    fn size(&self) -> usize {
        self.0.size()
    }

    fn share(&self, _key: &str, value: &[u8]) -> xdev::Result<Vec<u8>> {
        let dev = self.0;
        if dev.id() == 0 {
            for r in 1..dev.size() {
                dev.send(value, r, SHARE_TAG, COORDINATION)?;
            }
            Ok(value.to_vec())
        } else {
            let (from, tag) = (Source::Rank(0), TagSel::Tag(SHARE_TAG));
            let len = dev.probe(from, tag, COORDINATION)?.count;
            let mut buf = vec![0; len];
            dev.recv(&mut buf, from, tag, COORDINATION)?;
            Ok(buf)
        }
    }

    fn barrier(&self) -> xdev::Result<()> {
        xdev::devkit::conformance::barrier(self.0)
    }
}

/// What follows the job's prefix ([`shm_prefix`]) in the names of the
/// objects [`SharedLine::create`] makes.
const NAME_TAG: &str = "bench-line-";

/// Bytes mapped: one page holds the line.
const MAP_LEN: usize = 4096;
const _: () = assert!(std::mem::size_of::<HandoffLine>() <= MAP_LEN);

/// A [`HandoffLine`] in a mapping of a POSIX shared-memory object, shared by
/// the processes that map it. Unmapped on drop; the object itself is removed
/// by dropping the [`ShmObject`] that [`SharedLine::create`] returns.
pub struct SharedLine {
    line: NonNull<HandoffLine>,
}

// SAFETY: the mapping is only reached through `&HandoffLine`, whose state is
// one atomic; it stays mapped until the SharedLine is dropped.
unsafe impl Send for SharedLine {}
// SAFETY: as above: shared access is through atomics only.
unsafe impl Sync for SharedLine {}

/// A shared-memory object this process created: its name, and its removal
/// (`shm_unlink`) on drop. Mappings made before the removal stay valid.
pub struct ShmObject {
    name: CString,
}

impl ShmObject {
    /// The object's name (`/xdev-<job>-bench-line-...`), as
    /// [`SharedLine::attach`] takes it.
    pub fn name(&self) -> &str {
        // Names are built from ASCII in `SharedLine::create`.
        self.name.to_str().unwrap_or_default()
    }
}

impl Drop for ShmObject {
    fn drop(&mut self) {
        // SAFETY: `name` is a NUL-terminated string that outlives the call.
        unsafe { libc::shm_unlink(self.name.as_ptr()) };
    }
}

/// 64 random bits from the operating system (through xdev's [`Secret`]).
fn random_u64() -> io::Result<u64> {
    let secret = Secret::generate().map_err(io::Error::other)?;
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&secret.as_bytes()[..8]);
    Ok(u64::from_ne_bytes(bytes))
}

/// Closes a file descriptor on drop.
struct Fd(libc::c_int);

impl Drop for Fd {
    fn drop(&mut self) {
        // SAFETY: the descriptor is owned by this guard and closed once.
        unsafe { libc::close(self.0) };
    }
}

impl SharedLine {
    /// Creates a shared-memory object of job `job` with a fresh random name
    /// under the job's prefix ([`shm_prefix`], so that the launcher removes it
    /// should this process die before removing it), readable and writable by
    /// this user only (mode 0600), sized and mapped; the line in it is fresh
    /// (zero).
    pub fn create(job: &str) -> io::Result<(SharedLine, ShmObject)> {
        let mut tries = 0;
        let (fd, object) = loop {
            let name = format!("{}{NAME_TAG}{:016x}", shm_prefix(job), random_u64()?);
            let name = CString::new(name).map_err(io::Error::other)?;
            // SAFETY: `name` is NUL-terminated; shm_open has no other
            // preconditions.
            let fd = unsafe {
                libc::shm_open(
                    name.as_ptr(),
                    libc::O_CREAT | libc::O_EXCL | libc::O_RDWR | libc::O_CLOEXEC,
                    0o600,
                )
            };
            if fd >= 0 {
                break (Fd(fd), ShmObject { name });
            }
            let e = io::Error::last_os_error();
            tries += 1;
            if e.kind() != io::ErrorKind::AlreadyExists || tries == 8 {
                return Err(e);
            }
        };
        // SAFETY: `fd` is an open shared-memory object of ours.
        if unsafe { libc::ftruncate(fd.0, MAP_LEN as libc::off_t) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok((Self::map(&fd)?, object))
    }

    /// Maps the object `name` that [`SharedLine::create`] made for job `job`
    /// in another process. Only well-formed names under the job's prefix and
    /// objects of the size `create` gives are accepted.
    pub fn attach(job: &str, name: &str) -> io::Result<SharedLine> {
        let ours = format!("{}{NAME_TAG}", shm_prefix(job));
        let valid = is_xdev_shm_name(name) && name.len() > ours.len() && name.starts_with(&ours);
        if !valid {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{name:?} is not a shared line's name"),
            ));
        }
        let name = CString::new(name).map_err(io::Error::other)?;
        Self::attach_c(&name)
    }

    fn attach_c(name: &CStr) -> io::Result<SharedLine> {
        // SAFETY: `name` is NUL-terminated; shm_open has no other preconditions.
        let fd = unsafe {
            libc::shm_open(
                name.as_ptr(),
                libc::O_RDWR | libc::O_CLOEXEC | libc::O_NOFOLLOW,
                0,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let fd = Fd(fd);
        // SAFETY: all-zero is a valid `stat`, which fstat overwrites.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `fd` is open and `st` is a valid `stat` to fill.
        if unsafe { libc::fstat(fd.0, &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // A smaller object would fault (SIGBUS) on access instead of failing here.
        if st.st_size != MAP_LEN as libc::off_t {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{name:?} holds {} bytes, not a shared line's {MAP_LEN}",
                    st.st_size
                ),
            ));
        }
        Self::map(&fd)
    }

    fn map(fd: &Fd) -> io::Result<SharedLine> {
        // SAFETY: a fresh shared mapping of MAP_LEN bytes of an object of at
        // least that size; it aliases no Rust object.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                MAP_LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.0,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let line = NonNull::new(p.cast::<HandoffLine>())
            .ok_or_else(|| io::Error::other("mmap returned a null mapping"))?;
        Ok(SharedLine { line })
    }

    /// The line.
    pub fn line(&self) -> &HandoffLine {
        // SAFETY: the mapping is page-aligned (enough for HandoffLine's
        // alignment of 128), at least size_of::<HandoffLine>() long, mapped
        // until `self` is dropped, and all-zero or written only through
        // HandoffLine's atomic, so it always holds a valid HandoffLine. Other
        // processes change it only through the same atomic.
        unsafe { self.line.as_ref() }
    }
}

impl Drop for SharedLine {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `map`; no reference
        // into it outlives `self`.
        unsafe { libc::munmap(self.line.as_ptr().cast(), MAP_LEN) };
    }
}

/// The cache-line floor between two rank processes: ranks 0 and 1 pass a
/// [`HandoffLine`] through a [`SharedLine`], with the same loop and iteration
/// policy as the thread floor ([`cache_line_floor`](crate::cache_line_floor)),
/// so the two are comparable. Ranks pin themselves (rank r to core r) before
/// measuring; this type does not touch affinity.
pub struct ProcessFloor {
    rank: Rank,
    shared: Option<SharedLine>,
}

/// The key under which rank 0 shares the object's name.
const NAME_KEY: &str = "xdev-bench/cache-line";

impl ProcessFloor {
    /// Sets the floor up across job `job`: rank 0 creates the shared object and
    /// shares its name through `coord`, rank 1 maps it, and once every rank
    /// has passed the barrier (rank 1 has attached, or failed to) rank 0
    /// removes the name, so nothing is left in `/dev/shm` whatever happens
    /// next. Ranks beyond 1 take no part in the measurement. Collective: every
    /// rank calls it, in the same place of its sequence of calls on `coord`.
    pub fn setup(coord: &dyn Coordinator, job: &str) -> xdev::Result<ProcessFloor> {
        let rank = coord.rank();
        if coord.size() < 2 {
            return Err(Error::Config(
                "the process cache-line floor needs at least 2 ranks".into(),
            ));
        }
        let io_err = |what: &str| {
            let what = what.to_string();
            move |e: io::Error| Error::transport(format!("cache-line floor: {what}"), e)
        };
        match rank {
            0 => {
                let (shared, object) =
                    SharedLine::create(job).map_err(io_err("creating the shared object"))?;
                coord.share(NAME_KEY, object.name().as_bytes())?;
                let joined = coord.barrier();
                drop(object);
                joined?;
                Ok(ProcessFloor {
                    rank,
                    shared: Some(shared),
                })
            }
            1 => {
                let name = coord.share(NAME_KEY, &[])?;
                let name = String::from_utf8_lossy(&name).into_owned();
                let attached =
                    SharedLine::attach(job, &name).map_err(io_err(&format!("attaching {name:?}")));
                // Pass the barrier even on failure, so rank 0 removes the name.
                coord.barrier()?;
                Ok(ProcessFloor {
                    rank,
                    shared: Some(attached?),
                })
            }
            _ => {
                coord.share(NAME_KEY, &[])?;
                coord.barrier()?;
                Ok(ProcessFloor { rank, shared: None })
            }
        }
    }

    /// One run of the floor, as one repetition of the thread floor: at most
    /// `iters` round trips, bounded by [`FLOOR_BUDGET`](crate::FLOOR_BUDGET).
    /// Rank 0 times it and gets the one-way hand-off in microseconds; rank 1
    /// echoes and gets `None`; other ranks return `None` at once. Ranks 0 and
    /// 1 must call it equally often; it synchronizes them itself.
    pub fn cache_line(&self, iters: u64) -> Option<f64> {
        let shared = self.shared.as_ref()?;
        match self.rank {
            0 => Some(shared.line().ping(iters)),
            _ => {
                shared.line().echo();
                None
            }
        }
    }
}

#[cfg(test)]
mod tests;
