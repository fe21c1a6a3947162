//! Starting the ranks of a job as local processes: the environment contract
//! ([`rank_command`]) shared by `xdev-run` and by tests, [`LocalJob`], a
//! job whose bootstrap service runs in the calling process (what integration
//! tests of multi-process devices use), and [`run_job`], which runs such a
//! job to its end with the caller's stdout and stderr (what `xdev-bench`
//! uses to start its own ranks).
//!
//! It is not a process manager: `xdev-run` adds output labels, signal
//! forwarding and kill-on-first-failure on top.

use std::ffi::OsStr;
use std::io::Read;
use std::net::SocketAddr;
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use crate::bootstrap::{
    remove_job_shm, remove_psm2_shm, BootstrapServer, Secret, PSM2_EPID_KEY, XDEV_BOOTSTRAP,
    XDEV_JOB, XDEV_RANK, XDEV_SECRET, XDEV_SIZE,
};
use crate::{Error, Rank, Result};

/// A command that runs `program args` as `rank` of a job of `size` ranks,
/// with the bootstrap environment set.
pub fn rank_command(
    program: impl AsRef<OsStr>,
    args: &[impl AsRef<OsStr>],
    rank: Rank,
    size: usize,
    job: &str,
    service: SocketAddr,
    secret: &Secret,
) -> Command {
    let mut cmd = Command::new(program);
    cmd.args(args)
        .env(XDEV_RANK, rank.to_string())
        .env(XDEV_SIZE, size.to_string())
        .env(XDEV_JOB, job)
        .env(XDEV_BOOTSTRAP, service.to_string())
        .env(XDEV_SECRET, secret.to_hex())
        .stdin(Stdio::null());
    cmd
}

/// Runs `size` processes of `program args` as one job whose bootstrap
/// service runs in this process: each with `env` added, stdin from
/// `/dev/null`, stdout and stderr the caller's. When a rank fails, the
/// others are killed. Returns the first failed rank's exit status, else
/// rank 0's (success). Afterwards the job's shared-memory objects and the
/// PSM2 segments of its endpoints that a crashed rank left are removed.
pub fn run_job(
    size: usize,
    program: impl AsRef<OsStr>,
    args: &[impl AsRef<OsStr>],
    env: &[(&str, &str)],
) -> Result<ExitStatus> {
    let (job, server, mut children) = spawn_job(size, program, args, env, false)?;
    let exits = ExitWatch::new(&children);
    let mut reaped: Vec<Option<ExitStatus>> = vec![None; size];
    let mut gone_at: Vec<Option<SystemTime>> = vec![None; size];
    let mut failed: Option<ExitStatus> = None;
    while reaped.iter().any(Option::is_none) {
        for r in 0..size {
            if reaped[r].is_some() {
                continue;
            }
            let st = match children[r].try_wait() {
                Ok(Some(st)) => st,
                Ok(None) => continue,
                Err(_) => ExitStatus::from_raw(1 << 8),
            };
            reaped[r] = Some(st);
            gone_at[r] = Some(SystemTime::now());
            if !st.success() && failed.is_none() {
                failed = Some(st);
                for (o, c) in children.iter_mut().enumerate() {
                    if reaped[o].is_none() {
                        let _ = c.kill();
                    }
                }
            }
        }
        if reaped.iter().any(Option::is_none) {
            exits.wait(|r| reaped[r].is_none(), ExitWatch::LONGEST);
        }
    }
    remove_psm2_shm_of_job(&server, &gone_at);
    drop(server);
    remove_job_shm(&job);
    Ok(failed.unwrap_or_else(|| reaped[0].expect("every rank was reaped")))
}

/// Waits for children to exit without polling them on a timer: a pidfd per
/// child turns readable when it exits, so the launcher sleeps in `poll`
/// for the whole job (a timer that woke it every few milliseconds took CPU
/// time from the ranks it launched, visibly on a 2-CPU guest).
struct ExitWatch {
    /// The pidfd of each child (`None` where `pidfd_open` failed: Linux
    /// before 5.3, or the child already reaped).
    fds: Vec<Option<std::os::fd::OwnedFd>>,
}

impl ExitWatch {
    /// How long a wait lasts when some child has no pidfd.
    const FALLBACK: Duration = Duration::from_millis(5);
    /// The longest wait otherwise (a safety net; an exit wakes it at once).
    const LONGEST: Duration = Duration::from_secs(1);

    fn new(children: &[Child]) -> Self {
        let fds = children
            .iter()
            .map(|c| {
                let pid = rustix::process::Pid::from_raw(c.id() as i32)?;
                rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).ok()
            })
            .collect();
        ExitWatch { fds }
    }

    /// Returns once a child `r` with `pending(r)` may have exited, or after
    /// `at_most` (at most [`LONGEST`](Self::LONGEST)).
    fn wait(&self, pending: impl Fn(usize) -> bool, at_most: Duration) {
        use rustix::event::{poll, PollFd, PollFlags, Timespec};
        let mut polls: Vec<PollFd<'_>> = Vec::with_capacity(self.fds.len());
        for r in (0..self.fds.len()).filter(|&r| pending(r)) {
            let Some(fd) = &self.fds[r] else {
                std::thread::sleep(Self::FALLBACK);
                return;
            };
            polls.push(PollFd::new(fd, PollFlags::IN));
        }
        let at_most = at_most.min(Self::LONGEST);
        let timeout = Timespec {
            tv_sec: at_most.as_secs() as i64,
            tv_nsec: at_most.subsec_nanos() as i64,
        };
        // An error (EINTR) only ends this wait early; the caller re-checks.
        let _ = poll(&mut polls, Some(&timeout));
    }
}

/// Removes the PSM2 segments that the psm ranks of the job served by
/// `server` left (see [`remove_psm2_shm`]), after the job: what `run_job`
/// and `xdev-run` do once every rank is gone. `gone_at[r]` is when rank `r`
/// was seen gone (`None`: now).
///
/// Each psm rank R stores its endpoint id under `PSM2_EPID_KEY` + R. Only
/// such a record put by rank R itself is used (the service binds a key to
/// the rank that first put it, see [`BootstrapServer::stored`]), so a rank
/// cannot name a segment in another rank's stead; and `remove_psm2_shm`
/// leaves a segment some process still maps or holds open. Returns how many
/// segments were removed.
pub fn remove_psm2_shm_of_job(server: &BootstrapServer, gone_at: &[Option<SystemTime>]) -> usize {
    let mut n = 0;
    for (key, putter, value) in server.stored(PSM2_EPID_KEY) {
        if key != format!("{PSM2_EPID_KEY}{putter}") {
            // Another rank's record, or not one at all: not trusted.
            continue;
        }
        let Ok(epid) = <[u8; 8]>::try_from(&value[..]) else {
            continue;
        };
        let gone = gone_at
            .get(putter)
            .copied()
            .flatten()
            .unwrap_or_else(SystemTime::now);
        n += remove_psm2_shm(u64::from_le_bytes(epid), gone);
    }
    n
}

/// Starts the bootstrap service of a new job on loopback and `size`
/// processes of `program args` as its ranks, each with `env` added (and
/// its stdout and stderr piped if `capture`). If one cannot be started, the
/// ones already started are killed.
fn spawn_job(
    size: usize,
    program: impl AsRef<OsStr>,
    args: &[impl AsRef<OsStr>],
    env: &[(&str, &str)],
    capture: bool,
) -> Result<(String, BootstrapServer, Vec<Child>)> {
    let job = unique_job();
    let secret = Secret::generate()?;
    let bind: SocketAddr = "127.0.0.1:0".parse().expect("loopback address");
    let server = BootstrapServer::start(bind, size, &job, secret.clone())?;
    let mut children: Vec<Child> = Vec::with_capacity(size);
    for rank in 0..size {
        let mut cmd = rank_command(&program, args, rank, size, &job, server.addr(), &secret);
        cmd.envs(env.iter().copied());
        if capture {
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        }
        match cmd.spawn() {
            Ok(c) => children.push(c),
            Err(e) => {
                for c in &mut children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(Error::transport(
                    format!("starting rank {rank} of {:?}", program.as_ref()),
                    e,
                ));
            }
        }
    }
    Ok((job, server, children))
}

fn unique_job() -> String {
    static JOBS: AtomicU64 = AtomicU64::new(0);
    format!(
        "local-{}-{}",
        std::process::id(),
        JOBS.fetch_add(1, Ordering::Relaxed)
    )
}

/// A job of local processes with its bootstrap service served by this
/// process on loopback. Each rank's stdout and stderr are captured.
pub struct LocalJob {
    /// The rank processes, in rank order (stdout/stderr piped).
    pub children: Vec<Child>,
    /// The job identity (unique per call).
    pub job: String,
    server: BootstrapServer,
}

/// How one rank ended.
#[derive(Clone, Debug)]
pub struct RankExit {
    /// Exit status 0.
    pub success: bool,
    /// What it wrote to stdout (empty if the caller took the pipe).
    pub stdout: String,
    /// What it wrote to stderr.
    pub stderr: String,
}

/// The output of every rank that did not exit with status 0, one block per
/// rank (`rank R: stdout stderr`); empty when all succeeded.
pub fn failures(exits: &[RankExit]) -> String {
    report(exits, |e| !e.success)
}

/// The output of the ranks `which` selects, one block per rank.
fn report(exits: &[RankExit], which: impl Fn(&RankExit) -> bool) -> String {
    exits
        .iter()
        .enumerate()
        .filter(|(_, e)| which(e))
        .map(|(r, e)| format!("rank {r}: {}{}", e.stdout, e.stderr))
        .collect::<Vec<_>>()
        .join("\n")
}

impl LocalJob {
    /// Starts `size` processes of `program args`, each with `env` added.
    pub fn start(
        size: usize,
        program: impl AsRef<OsStr>,
        args: &[impl AsRef<OsStr>],
        env: &[(&str, &str)],
    ) -> Result<LocalJob> {
        let (job, server, children) = spawn_job(size, program, args, env, true)?;
        Ok(LocalJob {
            children,
            job,
            server,
        })
    }

    /// The bootstrap service's address.
    pub fn service(&self) -> SocketAddr {
        self.server.addr()
    }

    /// Waits for every rank; at `timeout` kills the rest and fails with
    /// [`Error::Transport`] (a hung job), after collecting their output.
    pub fn wait(mut self, timeout: Duration) -> Result<Vec<RankExit>> {
        let deadline = Instant::now() + timeout;
        let readers: Vec<_> = self
            .children
            .iter_mut()
            .map(|c| {
                let (so, se) = (c.stdout.take(), c.stderr.take());
                std::thread::spawn(move || {
                    let (mut a, mut b) = (String::new(), String::new());
                    if let Some(mut so) = so {
                        let _ = so.read_to_string(&mut a);
                    }
                    if let Some(mut se) = se {
                        let _ = se.read_to_string(&mut b);
                    }
                    (a, b)
                })
            })
            .collect();
        let mut timed_out = false;
        let exits_of = ExitWatch::new(&self.children);
        let mut success: Vec<Option<bool>> = vec![None; self.children.len()];
        loop {
            for (r, c) in self.children.iter_mut().enumerate() {
                if success[r].is_none() {
                    success[r] = match c.try_wait() {
                        Ok(Some(st)) => Some(st.success()),
                        Ok(None) => None,
                        Err(_) => Some(false),
                    };
                }
            }
            if success.iter().all(Option::is_some) {
                break;
            }
            let now = Instant::now();
            if now > deadline && !timed_out {
                timed_out = true;
                for (r, c) in self.children.iter_mut().enumerate() {
                    if success[r].is_none() {
                        let _ = c.kill();
                    }
                }
                continue;
            }
            // Until the next exit, or the deadline.
            let left = deadline.saturating_duration_since(now);
            exits_of.wait(|r| success[r].is_none(), left.max(ExitWatch::FALLBACK));
        }
        let exits: Vec<RankExit> = success
            .into_iter()
            .map(|s| s.unwrap_or(false))
            .zip(readers)
            .map(|(success, h)| {
                let (stdout, stderr) = h.join().unwrap_or_default();
                RankExit {
                    success,
                    stdout,
                    stderr,
                }
            })
            .collect();
        if timed_out {
            return Err(Error::transport(
                format!(
                    "job {} timed out after {timeout:?}\n{}",
                    self.job,
                    report(&exits, |_| true)
                ),
                std::io::Error::from(std::io::ErrorKind::TimedOut),
            ));
        }
        Ok(exits)
    }
}

impl Drop for LocalJob {
    fn drop(&mut self) {
        for c in &mut self.children {
            if let Ok(None) = c.try_wait() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

#[cfg(test)]
mod tests;
