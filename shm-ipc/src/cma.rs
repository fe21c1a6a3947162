//! Cross-memory attach (CMA): typed wrappers over `process_vm_readv(2)` and
//! the Yama opt-in that lets a sibling process use it on us.
//!
//! The kernel checks ptrace access ("attach" mode) for every call: same user
//! and, with Yama's `ptrace_scope` = 1, the reader must be an ancestor of the
//! target or named by it through `prctl(PR_SET_PTRACER)`. Ranks are siblings,
//! so a process that wants CMA calls [`allow_any_ptracer`] first; with
//! `ptrace_scope` >= 2, in containers without `CAP_SYS_PTRACE`, or on kernels
//! without CMA, reads fail and the device falls back to copying through the
//! segment.
//!
//! The copies themselves (`read_remote` and `write_remote`) are private to
//! this crate: they read or write any address of any process the caller may
//! ptrace, this one included, which no safe public function may offer. Code
//! outside the crate cannot call them:
//!
//! ```compile_fail,E0603
//! let x = 7u64;
//! let addr = &x as *const u64 as u64;
//! // Would change a value behind a shared reference.
//! shm_ipc::cma::write_remote(std::process::id(), addr, &9u64.to_le_bytes()).unwrap();
//! ```
//!
//! ```compile_fail,E0603
//! let mut buf = [0u8; 8];
//! shm_ipc::cma::read_remote(std::process::id(), 8, &mut buf).unwrap();
//! ```

use std::io;

/// Lets any process of this user ptrace-attach (and so CMA-read) this one
/// under Yama `ptrace_scope` = 1. Without Yama the call fails with `EINVAL`,
/// which is harmless: the classic same-user rule applies.
pub fn allow_any_ptracer() -> io::Result<()> {
    set_ptracer(libc::PR_SET_PTRACER_ANY)
}

/// Takes back [`allow_any_ptracer`]: only ancestors may attach again
/// (Yama's default). `EINVAL` without Yama, harmlessly.
pub fn forbid_ptracers() -> io::Result<()> {
    set_ptracer(0)
}

fn set_ptracer(who: libc::c_ulong) -> io::Result<()> {
    // SAFETY: PR_SET_PTRACER takes a pid-or-ANY argument and has no memory
    // effects on this process.
    let r = unsafe { libc::prctl(libc::PR_SET_PTRACER, who, 0, 0, 0) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Devices of this process whose peers may read it by CMA now.
static CMA_GRANTS: std::sync::Mutex<usize> = std::sync::Mutex::new(0);

/// This process stays open to ptrace-attach by any same-user process (so
/// that sibling ranks can CMA-read it) while at least one grant lives: the
/// first grant allows it, dropping the last one forbids it again. A device
/// holds one from start-up until it knows it does not use CMA, or until it
/// finishes.
#[derive(Debug)]
pub struct PtracerGrant(());

impl PtracerGrant {
    /// Takes a grant (allowing any ptracer if it is the first).
    pub fn take() -> Self {
        let mut n = CMA_GRANTS.lock().unwrap_or_else(|p| p.into_inner());
        if *n == 0 {
            let _ = allow_any_ptracer();
        }
        *n += 1;
        PtracerGrant(())
    }
}

impl Drop for PtracerGrant {
    fn drop(&mut self) {
        let mut n = CMA_GRANTS.lock().unwrap_or_else(|p| p.into_inner());
        *n -= 1;
        if *n == 0 {
            let _ = forbid_ptracers();
        }
    }
}

/// Copies `dst.len()` bytes from address `remote` in process `pid` into `dst`.
///
/// The remote address is not trusted: the kernel validates it against the
/// other process's mappings (`EFAULT`), and only `dst`, which we own, is
/// written. Errors: `EPERM` (ptrace rules forbid it), `ESRCH` (no such
/// process), `EFAULT` (bad remote range), `ENOSYS` (no CMA in this kernel).
pub(crate) fn read_remote(pid: u32, remote: u64, dst: &mut [u8]) -> io::Result<()> {
    // SAFETY: `dst` is borrowed mutably for the call: valid for writes of
    // its length and written by nobody else.
    unsafe { transfer(pid, remote, dst.as_mut_ptr(), dst.len(), Direction::Read) }
}

/// Copies `src` to address `remote` in process `pid` (`process_vm_writev`).
///
/// Only the other process's memory is written, and the kernel validates the
/// range against its mappings (`EFAULT`); `src` is only read. The same
/// errors as [`read_remote`].
pub(crate) fn write_remote(pid: u32, remote: u64, src: &[u8]) -> io::Result<()> {
    // SAFETY: `src` is borrowed for the call and only read.
    unsafe {
        transfer(
            pid,
            remote,
            src.as_ptr() as *mut u8,
            src.len(),
            Direction::Write,
        )
    }
}

#[derive(Copy, Clone, PartialEq, Eq)]
enum Direction {
    Read,
    Write,
}

/// Moves `len` bytes between `local` and `remote` in process `pid`,
/// resuming after partial transfers.
///
/// # Safety
/// `local` must be valid for `len` bytes: for writes when reading from the
/// other process, for reads when writing to it.
unsafe fn transfer(
    pid: u32,
    remote: u64,
    local: *mut u8,
    len: usize,
    direction: Direction,
) -> io::Result<()> {
    let mut done = 0usize;
    while done < len {
        let near = libc::iovec {
            // SAFETY: done < len, inside the caller's buffer.
            iov_base: unsafe { local.add(done) }.cast(),
            iov_len: len - done,
        };
        let far = libc::iovec {
            iov_base: (remote as usize).wrapping_add(done) as *mut libc::c_void,
            iov_len: len - done,
        };
        let pid = pid as libc::pid_t;
        // SAFETY: `near` describes the untransferred tail of the caller's
        // buffer (valid as the caller promised); `far` is interpreted by the
        // kernel in the other process's address space (validated there).
        // One iovec each.
        let n = unsafe {
            match direction {
                Direction::Read => libc::process_vm_readv(pid, &near, 1, &far, 1, 0),
                Direction::Write => libc::process_vm_writev(pid, &near, 1, &far, 1, 0),
            }
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n == 0 {
            return Err(io::Error::from_raw_os_error(libc::EFAULT));
        }
        done += n as usize;
    }
    Ok(())
}

/// CMA's speed relative to `memcpy` in this process, measured once (best of
/// four 1 MiB copies each, CMA reading this process's own memory, which
/// takes the same kernel path as reading a peer's). `None` if CMA fails.
pub fn calibrate() -> Option<f64> {
    static SPEED: std::sync::OnceLock<Option<f64>> = std::sync::OnceLock::new();
    *SPEED.get_or_init(|| {
        const LEN: usize = 1 << 20;
        let src: Vec<u8> = (0..LEN).map(|i| i as u8).collect();
        let mut dst = vec![0u8; LEN];
        let best = |f: &mut dyn FnMut() -> bool| -> Option<f64> {
            let mut t = f64::MAX;
            for _ in 0..4 {
                let start = std::time::Instant::now();
                if !f() {
                    return None;
                }
                t = t.min(start.elapsed().as_secs_f64());
            }
            Some(t)
        };
        let pid = std::process::id();
        let addr = src.as_ptr() as u64;
        let cma = best(&mut || read_remote(pid, addr, &mut dst).is_ok())?;
        let copy = best(&mut || {
            dst.copy_from_slice(&src);
            std::hint::black_box(&dst);
            true
        })?;
        Some(copy / cma)
    })
}

#[cfg(test)]
mod tests;
