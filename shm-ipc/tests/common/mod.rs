//! Jobs of `shm-rank` processes, one at a time, with the bootstrap service
//! served by the test itself (`xdev::devkit::launch::LocalJob`).

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::Child;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use xdev::devkit::launch::{LocalJob, RankExit};

/// Jobs run one at a time: 16 processes on 2 cores are enough load.
static SERIAL: Mutex<()> = Mutex::new(());

/// A started job and the guard that keeps others from starting.
pub struct Running {
    pub job: LocalJob,
    _serial: MutexGuard<'static, ()>,
}

/// Starts `n` ranks of `shm-rank args`.
pub fn start(n: usize, args: &[&str]) -> Running {
    let serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let job = LocalJob::start(n, env!("CARGO_BIN_EXE_shm-rank"), args, &[]).expect("start job");
    Running {
        job,
        _serial: serial,
    }
}

/// Leftover shared-memory objects of `job` in /dev/shm (inboxes are
/// memfds, which have no name there; the launcher's sweep would remove
/// anything else the job made under its prefix).
pub fn leftovers(job: &str) -> Vec<String> {
    let prefix = xdev::bootstrap::shm_prefix(job);
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .map(|e| format!("/{}", e.file_name().to_string_lossy()))
                .filter(|n| n.starts_with(&prefix))
                .collect()
        })
        .unwrap_or_default()
}

/// Waits for the job (5 minutes at most) and checks it left no segment.
pub fn finish(run: Running) -> Vec<RankExit> {
    let id = run.job.job.clone();
    let exits = run.job.wait(Duration::from_secs(300)).expect("job ends");
    assert_eq!(leftovers(&id), Vec::<String>::new(), "segments left behind");
    exits
}

/// Runs a job to completion; panics with every failing rank's output.
/// Returns each rank's stdout.
pub fn run_job(n: usize, args: &[&str]) -> Vec<String> {
    let exits = finish(start(n, args));
    let failures = xdev::devkit::launch::failures(&exits);
    assert!(failures.is_empty(), "{failures}");
    exits.into_iter().map(|e| e.stdout).collect()
}

/// Reads lines from `child`'s stdout until one equals `line`.
pub fn wait_for_line(child: &mut Child, line: &str) -> BufReader<std::process::ChildStdout> {
    let mut r = BufReader::new(child.stdout.take().expect("stdout piped"));
    let mut s = String::new();
    loop {
        s.clear();
        assert!(r.read_line(&mut s).unwrap() > 0, "no {line:?} line");
        if s.trim() == line {
            return r;
        }
    }
}
