//! Thin typed wrappers over the Linux calls the shared-memory devices need:
//! futex wait and wake, `membarrier`, and pinning a thread to a core.
//!
//! Futex and membarrier go through `rustix`, whose Linux backend issues the
//! system call directly (inline `syscall` instruction, errno returned in
//! the result): no libc varargs `syscall(2)` and no thread-local `errno`
//! read, so the doorbell's wake and sleep are no slower than the
//! hand-written calls they replace, and they need no `unsafe` here.

use std::sync::atomic::AtomicU32;
use std::time::Duration;

use rustix::thread::futex;
use rustix::thread::{MembarrierCommand, Timespec};

/// Whether a futex word may be shared between processes (a mapping) or lives
/// in private memory of one process.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Word in private memory: the cheaper private futex.
    Private,
    /// Word in a mapping shared between processes.
    Shared,
}

fn flags(scope: Scope) -> futex::Flags {
    match scope {
        Scope::Private => futex::Flags::PRIVATE,
        Scope::Shared => futex::Flags::empty(),
    }
}

/// Sleeps while `*word == expected`, at most `timeout`. Returns on a wake,
/// a value change, a timeout or a signal; callers re-check their condition.
/// Returns false only when the timeout expired.
pub fn wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>, scope: Scope) -> bool {
    let ts = timeout.map(|d| Timespec {
        tv_sec: d.as_secs().min(i64::MAX as u64) as i64,
        tv_nsec: d.subsec_nanos().into(),
    });
    // FUTEX_WAIT only reads the word; EAGAIN (the value changed) and EINTR
    // are plain returns to the caller's re-check loop.
    !matches!(
        futex::wait(word, flags(scope), expected, ts.as_ref()),
        Err(rustix::io::Errno::TIMEDOUT)
    )
}

/// Wakes up to `count` sleepers on `word`.
pub fn wake(word: &AtomicU32, count: i32, scope: Scope) {
    // FUTEX_WAKE cannot fail on a valid, aligned word (the reference
    // guarantees both); the count of woken sleepers is not needed.
    let _ = futex::wake(word, flags(scope), count.max(0) as u32);
}

/// Registers the calling process for [`membarrier_global_expedited`]: after
/// this, other processes' (and this process's) expedited barriers also
/// serialize this process's running threads.
pub fn membarrier_register_global_expedited() -> std::io::Result<()> {
    rustix::thread::membarrier(MembarrierCommand::RegisterGlobalExpedited).map_err(Into::into)
}

/// Executes a full memory barrier on every CPU currently running a thread of
/// a registered process (`MEMBARRIER_CMD_GLOBAL_EXPEDITED`).
pub fn membarrier_global_expedited() -> std::io::Result<()> {
    rustix::thread::membarrier(MembarrierCommand::GlobalExpedited).map_err(Into::into)
}

/// Pins the calling thread to CPU `cpu` (modulo the CPUs online).
///
/// The count is of online CPUs, not of this thread's current affinity mask:
/// a thread spawned by an already pinned thread inherits a one-CPU mask, and
/// counting that would pin every such thread to the same CPU.
pub fn pin_current_thread(cpu: usize) -> std::io::Result<()> {
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
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests;
