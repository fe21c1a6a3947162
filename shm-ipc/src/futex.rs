//! Thin typed wrappers over the Linux calls the shared-memory devices need:
//! futex wait and wake, and pinning a thread to a core.

use std::io;
use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Whether a futex word may be shared between processes (a mapping) or lives
/// in private memory of one process.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Word in private memory: the cheaper private futex.
    Private,
    /// Word in a mapping shared between processes.
    Shared,
}

fn op(base: libc::c_int, scope: Scope) -> libc::c_int {
    match scope {
        Scope::Private => base | libc::FUTEX_PRIVATE_FLAG,
        Scope::Shared => base,
    }
}

/// Sleeps while `*word == expected`, at most `timeout`. Returns on a wake,
/// a value change, a timeout or a signal; callers re-check their condition.
/// Returns false only when the timeout expired.
pub fn wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>, scope: Scope) -> bool {
    let ts = timeout.map(|d| libc::timespec {
        tv_sec: d.as_secs().min(i32::MAX as u64) as libc::time_t,
        tv_nsec: d.subsec_nanos() as libc::c_long,
    });
    let ts_ptr = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: `word` is a live, aligned 32-bit atomic for the duration of the
    // call and `ts_ptr` is null or points to a timespec on this stack frame.
    // FUTEX_WAIT only reads the word; any result (EAGAIN, ETIMEDOUT, EINTR) is
    // a plain return to the caller's re-check loop.
    let r = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            op(libc::FUTEX_WAIT, scope),
            expected,
            ts_ptr,
        )
    };
    r == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ETIMEDOUT)
}

/// Wakes up to `count` sleepers on `word`.
pub fn wake(word: &AtomicU32, count: i32, scope: Scope) {
    // SAFETY: `word` is a live, aligned 32-bit atomic; FUTEX_WAKE does not
    // access memory beyond using the address as a key.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            op(libc::FUTEX_WAKE, scope),
            count,
        );
    }
}

const MEMBARRIER_CMD_GLOBAL_EXPEDITED: libc::c_int = 1 << 1;
const MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED: libc::c_int = 1 << 2;

fn membarrier(cmd: libc::c_int) -> io::Result<()> {
    // SAFETY: membarrier takes two integers and touches no user memory.
    let rc = unsafe { libc::syscall(libc::SYS_membarrier, cmd, 0, 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Registers the calling process for [`membarrier_global_expedited`]: after
/// this, other processes' (and this process's) expedited barriers also
/// serialize this process's running threads.
pub fn membarrier_register_global_expedited() -> io::Result<()> {
    membarrier(MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED)
}

/// Executes a full memory barrier on every CPU currently running a thread of
/// a registered process (`MEMBARRIER_CMD_GLOBAL_EXPEDITED`).
pub fn membarrier_global_expedited() -> io::Result<()> {
    membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED)
}

/// Pins the calling thread to CPU `cpu` (modulo the CPUs online).
///
/// The count is of online CPUs, not of this thread's current affinity mask:
/// a thread spawned by an already pinned thread inherits a one-CPU mask, and
/// counting that would pin every such thread to the same CPU.
pub fn pin_current_thread(cpu: usize) -> io::Result<()> {
    // SAFETY: sysconf has no memory-safety preconditions.
    let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    let n = usize::try_from(online)
        .unwrap_or(1)
        .clamp(1, libc::CPU_SETSIZE as usize);
    // SAFETY: cpu_set_t is a plain bit array for which all-zero is valid.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: CPU_SET writes one bit inside `set`; the index is < n <= CPU_SETSIZE
    // on any machine this runs on.
    unsafe { libc::CPU_SET(cpu % n, &mut set) };
    // SAFETY: pid 0 means the calling thread; `set` is a valid cpu_set_t of the
    // size passed.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests;
