//! Starting jobs of `shm-rank` processes with a bootstrap service served by
//! the test itself.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use xdev::bootstrap::{
    BootstrapServer, Secret, XDEV_BOOTSTRAP, XDEV_JOB, XDEV_RANK, XDEV_SECRET, XDEV_SIZE,
};

/// Jobs run one at a time: 16 processes on 2 cores are enough load.
static SERIAL: Mutex<()> = Mutex::new(());

/// A job to start.
pub struct Job {
    pub n: usize,
    pub args: Vec<String>,
    pub timeout: Duration,
}

impl Job {
    pub fn new(n: usize, args: &[&str]) -> Job {
        Job {
            n,
            args: args.iter().map(|s| s.to_string()).collect(),
            timeout: Duration::from_secs(300),
        }
    }
}

/// A started job: its processes (stdout piped), the server and the job id.
pub struct Running {
    pub children: Vec<Child>,
    pub job: String,
    pub server: BootstrapServer,
    _serial: std::sync::MutexGuard<'static, ()>,
}

pub fn start(job: &Job) -> Running {
    let serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    static JOBS: AtomicU64 = AtomicU64::new(0);
    let id = format!(
        "shmtest-{}-{}",
        std::process::id(),
        JOBS.fetch_add(1, Ordering::Relaxed)
    );
    let secret = Secret::generate().unwrap();
    let bind: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let server = BootstrapServer::start(bind, job.n, &id, secret.clone()).unwrap();
    let children = (0..job.n)
        .map(|rank| {
            Command::new(env!("CARGO_BIN_EXE_shm-rank"))
                .args(&job.args)
                .env(XDEV_RANK, rank.to_string())
                .env(XDEV_SIZE, job.n.to_string())
                .env(XDEV_JOB, &id)
                .env(XDEV_BOOTSTRAP, server.addr().to_string())
                .env(XDEV_SECRET, secret.to_hex())
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("start shm-rank")
        })
        .collect();
    Running {
        children,
        job: id,
        server,
        _serial: serial,
    }
}

/// Leftover inbox segments of `job` in /dev/shm.
pub fn leftovers(job: &str) -> Vec<String> {
    let prefix = shm_ipc::segment::name_prefix(job);
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .map(|e| format!("/{}", e.file_name().to_string_lossy()))
                .filter(|n| n.starts_with(&prefix))
                .collect()
        })
        .unwrap_or_default()
}

/// Waits for every process (killing all at the deadline) and returns each
/// one's exit success, stdout and stderr.
pub fn wait_all(mut run: Running, timeout: Duration) -> Vec<(bool, String, String)> {
    let deadline = Instant::now() + timeout;
    let mut out = Vec::new();
    let outputs: Vec<_> = run
        .children
        .iter_mut()
        .map(|c| {
            let mut so = c.stdout.take().unwrap();
            let mut se = c.stderr.take().unwrap();
            std::thread::spawn(move || {
                let (mut a, mut b) = (String::new(), String::new());
                let _ = so.read_to_string(&mut a);
                let _ = se.read_to_string(&mut b);
                (a, b)
            })
        })
        .collect();
    let mut timed_out = false;
    for c in run.children.iter_mut() {
        loop {
            if let Some(st) = c.try_wait().unwrap() {
                out.push(st.success());
                break;
            }
            if Instant::now() > deadline {
                timed_out = true;
                let _ = c.kill();
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    assert!(!timed_out, "job timed out after {timeout:?}");
    out.into_iter()
        .zip(outputs)
        .map(|(ok, h)| {
            let (a, b) = h.join().unwrap();
            (ok, a, b)
        })
        .collect()
}

/// Runs a job to completion; panics with every failing rank's output.
pub fn run_job(job: Job) -> Vec<String> {
    let running = start(&job);
    let id = running.job.clone();
    let results = wait_all(running, job.timeout);
    let failures: Vec<String> = results
        .iter()
        .enumerate()
        .filter(|(_, r)| !r.0)
        .map(|(rank, r)| format!("rank {rank}: {}{}", r.1, r.2))
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert_eq!(leftovers(&id), Vec::<String>::new(), "segments left behind");
    results.into_iter().map(|r| r.1).collect()
}

/// Reads lines from `child`'s stdout until one equals `line`.
pub fn wait_for_line(child: &mut Child, line: &str) -> BufReader<std::process::ChildStdout> {
    let mut r = BufReader::new(child.stdout.take().unwrap());
    let mut s = String::new();
    loop {
        s.clear();
        assert!(r.read_line(&mut s).unwrap() > 0, "no {line:?} line");
        if s.trim() == line {
            return r;
        }
    }
}
