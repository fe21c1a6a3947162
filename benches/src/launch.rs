//! How a run started by hand starts the ranks of a process device: it
//! re-executes itself as the launcher of a job of its own ranks
//! ([`LAUNCH_RANKS`], [`launcher_main`]), and learns from the job's status
//! ([`outcome`]) and the reasons its ranks wrote (`tell_reason`) whether
//! the device was measured.

use std::ffi::OsString;
use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use xdev::bootstrap;

/// Exit status of a rank whose device cannot be opened here (the default
/// run skips such a device instead of failing).
pub const UNAVAILABLE: u8 = 3;

/// Environment variable: set to a number of ranks on the xdev-bench that a
/// run started by hand re-executes to start that many ranks of itself.
pub const LAUNCH_RANKS: &str = "XDEV_BENCH_LAUNCH_RANKS";

/// Environment variable: a file where a rank that cannot open its device
/// appends the reason (one line), for the run that launched it.
const REASON_FILE: &str = "XDEV_BENCH_REASON_FILE";

/// What ended a step.
#[derive(Debug)]
pub enum Failure {
    /// Report and exit with this status.
    Exit(String, u8),
    /// The launched job already reported; exit with its status.
    Status(u8),
    /// The device cannot be opened here, and why.
    Unavailable(String),
}

/// A failed child's exit status as this process's (128 + signal when killed;
/// at least 1).
fn exit_status(s: std::process::ExitStatus) -> u8 {
    match (s.code(), s.signal()) {
        (Some(c), _) => u8::try_from(c).unwrap_or(1).max(1),
        (None, Some(sig)) => u8::try_from(128 + sig).unwrap_or(1),
        _ => 1,
    }
}

/// How a run started by hand starts the ranks of a process-device job:
/// `(ranks, device, rank arguments)` to the command, or why it cannot.
pub type Spawner<'a> = dyn Fn(usize, Option<&str>, &[String]) -> Result<Command, String> + 'a;

/// `exe args...` re-executed as the launcher of `ranks` ranks of itself
/// ([`LAUNCH_RANKS`]), with `XDEV_DEVICE` set to `device` or removed.
fn self_launch_command(
    exe: &Path,
    ranks: usize,
    device: Option<&str>,
    args: &[OsString],
) -> Command {
    let mut c = Command::new(exe);
    c.args(args).env(LAUNCH_RANKS, ranks.to_string());
    match device {
        Some(d) => c.env(bootstrap::XDEV_DEVICE, d),
        None => c.env_remove(bootstrap::XDEV_DEVICE),
    };
    c
}

/// The spawner of this executable: itself, launching its own ranks.
pub fn self_spawner(
    ranks: usize,
    device: Option<&str>,
    args: &[String],
) -> Result<Command, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this executable: {e}"))?;
    let args: Vec<OsString> = args.iter().map(OsString::from).collect();
    Ok(self_launch_command(&exe, ranks, device, &args))
}

/// The re-executed launcher ([`LAUNCH_RANKS`] set to `ranks`): runs that
/// many ranks of this executable with `args` as one job served here, and
/// exits with the first failed rank's status.
pub fn launcher_main(ranks: &str, args: &[OsString]) -> ExitCode {
    // The ranks must not launch again.
    std::env::remove_var(LAUNCH_RANKS);
    let ranks: usize = match ranks.trim().parse() {
        Ok(n) if n >= 1 => n,
        _ => {
            eprintln!("xdev-bench: {LAUNCH_RANKS}={ranks:?} is not a number of ranks");
            return ExitCode::from(2);
        }
    };
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("xdev-bench: cannot find this executable: {e}");
            return ExitCode::FAILURE;
        }
    };
    match xdev::devkit::launch::run_job(ranks, &exe, args, &[]) {
        Ok(st) if st.success() => ExitCode::SUCCESS,
        Ok(st) => ExitCode::from(exit_status(st)),
        Err(e) => {
            eprintln!("xdev-bench: starting {ranks} ranks: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Runs one job of a process device (or of the process floors): the
/// launcher's status, with the reason the ranks gave when the device cannot
/// be opened.
pub(crate) fn launch(
    spawn: &Spawner,
    ranks: usize,
    device: Option<&str>,
    args: &[String],
) -> Result<(), Failure> {
    let mut cmd = spawn(ranks, device, args).map_err(|e| Failure::Exit(e, 1))?;
    let reasons = ReasonFile::new().map_err(|e| Failure::Exit(e, 1))?;
    let _ = std::io::stdout().flush();
    let status = cmd
        .env(REASON_FILE, &reasons.0)
        .status()
        .map_err(|e| Failure::Exit(format!("cannot start {:?}: {e}", cmd.get_program()), 1))?;
    outcome(status).map_err(|f| match f {
        Failure::Unavailable(_) => Failure::Unavailable(reasons.first()),
        f => f,
    })
}

/// A fresh temporary file for the reasons of a job's ranks, removed on drop.
struct ReasonFile(PathBuf);

impl ReasonFile {
    fn new() -> Result<ReasonFile, String> {
        static SEQ: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path =
            std::env::temp_dir().join(format!("xdev-bench-reason-{}-{n}", std::process::id()));
        std::fs::write(&path, b"").map_err(|e| format!("cannot create {}: {e}", path.display()))?;
        Ok(ReasonFile(path))
    }

    /// The first reason a rank wrote, or a generic one.
    fn first(&self) -> String {
        std::fs::read_to_string(&self.0)
            .ok()
            .and_then(|s| s.lines().find(|l| !l.trim().is_empty()).map(String::from))
            .unwrap_or_else(|| "the device cannot be opened here (the ranks gave no reason)".into())
    }
}

impl Drop for ReasonFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Appends why this rank cannot open its device to the file the launching
/// run named (best effort: the reason is also on stderr). The line goes out
/// in one write, so the ranks' lines do not interleave (`writeln!` writes
/// the text and its newline separately).
pub(crate) fn tell_reason(reason: &str) {
    if let Some(path) = std::env::var_os(REASON_FILE) {
        if let Ok(mut f) = std::fs::OpenOptions::new().append(true).open(path) {
            let line = format!("{}\n", reason.replace('\n', " "));
            let _ = f.write_all(line.as_bytes());
        }
    }
}

/// What the launcher's exit status means for the run.
pub fn outcome(status: std::process::ExitStatus) -> Result<(), Failure> {
    match status.code() {
        Some(0) => Ok(()),
        Some(c) if c == i32::from(UNAVAILABLE) => Err(Failure::Unavailable(String::new())),
        _ => Err(Failure::Status(exit_status(status))),
    }
}

#[cfg(test)]
mod tests;
