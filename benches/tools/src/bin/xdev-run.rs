//! `xdev-run`: the launcher of xdev jobs. It starts the bootstrap service of
//! [`xdev::bootstrap`] and N local processes with the job's environment, and
//! stops them all when one fails; or, with `--serve`, runs only the service
//! for ranks started by hand or by a batch scheduler, possibly on other hosts.
//!
//! It is not a remote process starter (no ssh, no scheduler integration) and
//! does not forward standard input. Run `xdev-run --help` for the usage.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant, SystemTime};

use xdev::bootstrap::{
    BootstrapServer, Secret, XDEV_BOOTSTRAP, XDEV_DEVICE, XDEV_JOB, XDEV_RANK, XDEV_SECRET,
    XDEV_SIZE,
};

const HELP: &str = "\
xdev-run: start the ranks of an xdev job, or serve the bootstrap of one.

USAGE:
    xdev-run -n N [--device NAME] [--label] [--keep-going] [--bind ADDR] [--timeout SECS]
             [--] PROGRAM [ARGS...]
    xdev-run --serve -n N [--device NAME] [--bind ADDR] [--timeout SECS]

LAUNCH MODE starts the bootstrap service, then N processes of PROGRAM on this
host, each in its own process group with standard input from /dev/null and
this environment:
    XDEV_RANK       the process's rank, 0..N-1
    XDEV_SIZE       N
    XDEV_JOB        a fresh job identity
    XDEV_BOOTSTRAP  host:port of the bootstrap service
    XDEV_SECRET     a fresh per-job secret (64 hex digits) that ranks prove
                    they know when they connect to the service
    XDEV_DEVICE     the device name given with --device (unset otherwise)
Programs read them with xdev::bootstrap::Bootstrap::from_env() and
xdev::bootstrap::config_from_env().

When a rank exits with a non-zero status or is killed by a signal, the other
ranks get SIGTERM, then SIGKILL after 2 s, and xdev-run exits with the failing
rank's status (128+N for signal N), saying which rank failed and how. With
--keep-going the others go on instead (the devices report the lost rank to
them as PeerLost): xdev-run waits for all and then exits with the first
failing rank's status. When all ranks exit with 0, xdev-run exits with 0.
SIGINT, SIGTERM and SIGHUP sent to xdev-run are passed on to the ranks the
same way. At the end xdev-run removes the shared-memory segments the job's
ranks left: the shm device's (/dev/shm/xdev-<job>-*) and PSM2's for the psm
device's endpoints (/dev/shm/psm2_shm.*, 4 MiB each).

SERVE MODE (--serve) starts only the bootstrap service and prints the lines
to export, in sh syntax, on standard output:
    export XDEV_BOOTSTRAP=... XDEV_SECRET=... XDEV_JOB=... XDEV_SIZE=...
Start the N ranks by hand or with a batch scheduler with these variables and
XDEV_RANK set per process (0..N-1); bind to an address the ranks' hosts can
reach (e.g. --bind 0.0.0.0:7000; then XDEV_BOOTSTRAP names this host). The
service runs until all N ranks have connected and disconnected, then exits
with 0, reporting ranks that disconnected without a goodbye (they died or
exited without dropping their Bootstrap). Keep the printed secret private:
whoever has it can join the job.

OPTIONS:
    -n, --np N        number of ranks (required, at least 1)
    --device NAME     device the ranks should open (sets XDEV_DEVICE)
    --label           prefix each line the ranks print with \"[RANK] \"
                      (otherwise the ranks share xdev-run's stdout and stderr)
    --keep-going      when a rank fails, let the others run to their end
                      (for fault-tolerant programs); exit with the first
                      failure's status
    --bind ADDR       address of the bootstrap service (IP:PORT, or IP for
                      any free port); default 127.0.0.1:0, loopback only
    --timeout SECS    stop everything after SECS seconds and exit with 124
    --serve           serve mode (see above)
    -h, --help        this text

EXIT STATUS:
    0 success; the first failing rank's status (128+signal if killed);
    124 timeout; 127/126 PROGRAM could not be started; 2 usage error;
    1 other failures of xdev-run itself.
";

/// Time ranks get between SIGTERM and SIGKILL.
const GRACE: Duration = Duration::from_secs(2);
/// How often the launcher looks at its children.
const POLL: Duration = Duration::from_millis(10);
/// Longest line forwarded in one piece with `--label`.
const MAX_LINE: u64 = 64 * 1024;

#[derive(Debug)]
struct Opts {
    n: usize,
    device: Option<String>,
    label: bool,
    keep_going: bool,
    bind: SocketAddr,
    timeout: Option<Duration>,
    serve: bool,
    program: Vec<OsString>,
}

/// Parses the arguments (without the program name) with `lexopt`;
/// `Ok(None)` asks for the help text. Options end at `--` or at the first
/// argument that is not one (PROGRAM): the rest are PROGRAM's arguments.
fn parse(args: Vec<OsString>) -> Result<Option<Opts>, String> {
    use lexopt::prelude::*;

    let mut n = None;
    let mut device = None;
    let mut label = false;
    let mut keep_going = false;
    let mut bind = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0);
    let mut timeout = None;
    let mut serve = false;
    let mut program = Vec::new();
    let mut p = lexopt::Parser::from_args(args);
    // The value of the option just read, as UTF-8 ("NAME needs WHAT" if absent).
    fn value(p: &mut lexopt::Parser, name: &str, what: &str) -> Result<String, String> {
        p.value()
            .ok()
            .and_then(|v| v.into_string().ok())
            .ok_or_else(|| format!("{name} needs {what}"))
    }
    while let Some(arg) = p.next().map_err(|e| e.to_string())? {
        match arg {
            Short('h') | Long("help") => return Ok(None),
            Short('n') | Long("np") => {
                let name = if arg == Short('n') { "-n" } else { "--np" };
                let v = value(&mut p, name, "a number of ranks")?;
                n = Some(parse_ranks(name, &v)?);
            }
            Long("device") => {
                let v = value(&mut p, "--device", "a device name")?;
                if v.is_empty() {
                    return Err("--device needs a non-empty name".into());
                }
                device = Some(v);
            }
            Long("label") => label = true,
            Long("keep-going") => keep_going = true,
            Long("serve") => serve = true,
            Long("bind") => bind = parse_bind(&value(&mut p, "--bind", "an address")?)?,
            Long("timeout") => {
                let v = value(&mut p, "--timeout", "a number of seconds")?;
                timeout = Some(parse_timeout(&v)?);
            }
            Value(v) => {
                program.push(v);
                program.extend(p.raw_args().map_err(|e| e.to_string())?);
                break;
            }
            Short(c) => return Err(format!("unknown option \"-{c}\"")),
            Long(l) => return Err(format!("unknown option \"--{l}\"")),
        }
    }
    let n = n.ok_or("-n N is required")?;
    let opts = Opts {
        n,
        device,
        label,
        keep_going,
        bind,
        timeout,
        serve,
        program,
    };
    check_mode(&opts)?;
    Ok(Some(opts))
}

/// The value of `-n`/`--np` (given as `name`): a number of ranks, at least 1.
fn parse_ranks(name: &str, v: &str) -> Result<usize, String> {
    match v.parse::<usize>() {
        Ok(k) if k >= 1 && k <= u32::MAX as usize => Ok(k),
        _ => Err(format!("{name} {v:?}: expected a number of ranks >= 1")),
    }
}

/// The value of `--bind`: IP:PORT, or IP for any free port.
fn parse_bind(v: &str) -> Result<SocketAddr, String> {
    match (v.parse::<SocketAddr>(), v.parse::<IpAddr>()) {
        (Ok(a), _) => Ok(a),
        (_, Ok(ip)) => Ok(SocketAddr::new(ip, 0)),
        _ => Err(format!("--bind {v:?}: expected IP:PORT or IP")),
    }
}

/// The value of `--timeout`: a positive number of seconds.
fn parse_timeout(v: &str) -> Result<Duration, String> {
    match v.parse::<f64>() {
        Ok(t) if t > 0.0 && t < 1e9 => Ok(Duration::from_secs_f64(t)),
        _ => Err(format!(
            "--timeout {v:?}: expected a positive number of seconds"
        )),
    }
}

/// Checks that the options fit the mode: serve mode starts no program and
/// takes no launch-only option; launch mode needs a program.
fn check_mode(opts: &Opts) -> Result<(), String> {
    if opts.serve {
        if !opts.program.is_empty() {
            return Err("--serve starts no program".into());
        }
        if opts.label {
            return Err("--label has no effect with --serve".into());
        }
        if opts.keep_going {
            return Err("--keep-going has no effect with --serve".into());
        }
    } else if opts.program.is_empty() {
        return Err("no program to run".into());
    }
    Ok(())
}

fn main() {
    xdev_tools::init_tracing("xdev-run");
    let opts = match parse(std::env::args_os().skip(1).collect()) {
        Ok(Some(o)) => o,
        Ok(None) => {
            print!("{HELP}");
            return;
        }
        Err(e) => {
            eprintln!("xdev-run: {e}\nTry 'xdev-run --help'.");
            std::process::exit(2);
        }
    };
    let code = if opts.serve {
        serve(&opts)
    } else {
        launch(&opts)
    };
    let _ = std::io::stdout().flush();
    std::process::exit(code);
}

/// The job's secret and identity, and its service.
fn start_service(opts: &Opts) -> Result<(Secret, String, BootstrapServer), String> {
    let secret = Secret::generate().map_err(|e| e.to_string())?;
    let tag = Secret::generate().map_err(|e| e.to_string())?.to_hex();
    let job = format!("xdev-{}-{}", std::process::id(), &tag[..12]);
    let server = BootstrapServer::start(opts.bind, opts.n, &job, secret.clone())
        .map_err(|e| format!("cannot start the bootstrap service on {}: {e}", opts.bind))?;
    Ok((secret, job, server))
}

fn serve(opts: &Opts) -> i32 {
    let (secret, job, server) = match start_service(opts) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("xdev-run: {e}");
            return 1;
        }
    };
    let addr = server.addr();
    let advertised = if addr.ip().is_unspecified() {
        match hostname() {
            Some(h) => format!("{h}:{}", addr.port()),
            None => addr.to_string(),
        }
    } else {
        addr.to_string()
    };
    let mut out = format!(
        "export {XDEV_BOOTSTRAP}='{advertised}'\nexport {XDEV_SECRET}='{}'\nexport {XDEV_JOB}='{job}'\nexport {XDEV_SIZE}='{}'\n",
        secret.to_hex(),
        opts.n
    );
    if let Some(d) = &opts.device {
        out.push_str(&format!(
            "export {XDEV_DEVICE}='{}'\n",
            d.replace('\'', "'\\''")
        ));
    }
    out.push_str(&format!(
        "# start {} processes with {XDEV_RANK}=0..{} set per process\n",
        opts.n,
        opts.n - 1
    ));
    let mut stdout = std::io::stdout();
    let _ = stdout
        .write_all(out.as_bytes())
        .and_then(|()| stdout.flush());
    eprintln!("xdev-run: serving job {job} for {} ranks on {addr}", opts.n);
    let deadline = opts.timeout.map(|t| Instant::now() + t);
    loop {
        if server.wait_finished(Some(Duration::from_millis(200))) {
            break;
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            let st = server.status();
            eprintln!(
                "xdev-run: timeout: {} of {} ranks connected and left within {:?} ({} connected now)",
                st.departed.len(),
                opts.n,
                opts.timeout.unwrap_or_default(),
                st.connected.len()
            );
            return 124;
        }
    }
    for d in server.status().departed.iter().filter(|d| !d.clean) {
        eprintln!(
            "xdev-run: rank {} disconnected without a goodbye (it died, or exited without dropping its Bootstrap)",
            d.rank
        );
    }
    0
}

/// This host's name, for the address ranks on other hosts should use.
fn hostname() -> Option<String> {
    let h = std::fs::read_to_string("/proc/sys/kernel/hostname").ok()?;
    let h = h.trim();
    (!h.is_empty()).then(|| h.to_owned())
}

static SIGNALLED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    SIGNALLED.store(sig, Ordering::SeqCst);
}

/// Catches SIGINT, SIGTERM and SIGHUP so they can be passed on to the ranks
/// (which live in their own process groups and so do not get the terminal's
/// signals themselves).
fn catch_signals() {
    let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: `on_signal` only stores to an atomic, which is
        // async-signal-safe; signal(2) has no other preconditions. Exec
        // resets caught signals, so the ranks start with default handlers.
        unsafe {
            libc::signal(sig, handler);
        }
    }
}

/// Sends `sig` to the process group led by `pid` (each rank is started as
/// the leader of its own group, so this reaches its children too).
fn signal_group(pid: u32, sig: libc::c_int) {
    let Ok(pgid) = libc::pid_t::try_from(pid) else {
        return;
    };
    // SAFETY: kill(2) has no memory-safety preconditions. A negative pid
    // addresses the process group the rank created at spawn; Linux does not
    // reuse a group id while any member lives, and an empty group gives ESRCH,
    // which is ignored.
    unsafe {
        libc::kill(-pgid, sig);
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        _ => "signal",
    }
}

/// The launcher's exit code for a rank's status, and how to say it.
fn describe(status: ExitStatus) -> (i32, String) {
    if let Some(code) = status.code() {
        (code, format!("exited with status {code}"))
    } else if let Some(sig) = status.signal() {
        (
            128 + sig,
            format!("was killed by signal {sig} ({})", signal_name(sig)),
        )
    } else {
        (1, format!("ended with {status}"))
    }
}

/// Copies a rank's output line by line, each line prefixed with `[rank] `.
fn forward(rank: usize, src: impl Read + Send + 'static, to_stderr: bool, done: mpsc::Sender<()>) {
    let spawned = thread::Builder::new()
        .name(format!("xdev-run-label-{rank}"))
        .spawn(move || {
            let mut r = BufReader::new(src);
            let mut line = Vec::new();
            loop {
                line.clear();
                match (&mut r).take(MAX_LINE).read_until(b'\n', &mut line) {
                    Ok(0) => break,
                    Ok(_) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(_) => break,
                }
                let mut buf = format!("[{rank}] ").into_bytes();
                buf.extend_from_slice(&line);
                if !buf.ends_with(b"\n") {
                    buf.push(b'\n');
                }
                // Keep draining even if our own output is gone, so the rank
                // never blocks on a full pipe.
                let _ = if to_stderr {
                    std::io::stderr().lock().write_all(&buf)
                } else {
                    std::io::stdout().lock().write_all(&buf)
                };
            }
            let _ = done.send(());
        });
    if spawned.is_err() {
        eprintln!("xdev-run: cannot start a thread to label rank {rank}'s output");
    }
}

/// Signals every rank's group with `first`, gives them [`GRACE`], then kills
/// what is left and reaps every child.
fn stop_all(children: &mut [Child], reaped: &mut [Option<ExitStatus>], first: libc::c_int) {
    for c in children.iter() {
        signal_group(c.id(), first);
    }
    let deadline = Instant::now() + GRACE;
    loop {
        for (c, st) in children.iter_mut().zip(reaped.iter_mut()) {
            if st.is_none() {
                if let Ok(Some(s)) = c.try_wait() {
                    *st = Some(s);
                }
            }
        }
        if reaped.iter().all(Option::is_some) || Instant::now() >= deadline {
            break;
        }
        thread::sleep(POLL);
    }
    for c in children.iter() {
        signal_group(c.id(), libc::SIGKILL);
    }
    for (c, st) in children.iter_mut().zip(reaped.iter_mut()) {
        if st.is_none() {
            *st = c.wait().ok();
        }
    }
}

enum Outcome {
    Success,
    RankFailed(usize, ExitStatus),
    /// With --keep-going: all ranks ended, this one failed first.
    KeptGoing(usize, ExitStatus),
    Timeout,
    Signalled(i32),
}

fn launch(opts: &Opts) -> i32 {
    catch_signals();
    let (secret, job, server) = match start_service(opts) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("xdev-run: {e}");
            return 1;
        }
    };
    let addr = address_for_ranks(server.addr());
    let (done_tx, done_rx) = mpsc::channel();
    let mut children = match spawn_ranks(opts, &job, addr, &secret, &done_tx) {
        Ok(children) => children,
        Err(code) => return code,
    };
    drop(done_tx);

    let mut reaped: Vec<Option<ExitStatus>> = vec![None; opts.n];
    // When each rank was seen gone (for the clean-up of its segments).
    let mut gone_at: Vec<Option<SystemTime>> = vec![None; opts.n];
    let outcome = watch_ranks(opts, &mut children, &mut reaped, &mut gone_at);
    let code = report_and_stop(opts, outcome, &mut children, &mut reaped);
    // Let the label threads print what the ranks wrote last; a grandchild
    // that keeps a pipe open does not hold the launcher up for long.
    if opts.label {
        wait_for_labels(&done_rx, 2 * children.len());
    }
    // PSM2 names its segments after each endpoint's epid, which psm ranks
    // stored in the bootstrap: remove what a crashed one left.
    // (Only a rank's own record counts, and a segment still in use stays.)
    xdev::devkit::launch::remove_psm2_shm_of_job(&server, &gone_at);
    drop(server);
    // Ranks unlink their shared-memory segments once all have attached; a
    // rank that died before that leaves its segment behind: remove it.
    xdev::bootstrap::remove_job_shm(&job);
    code
}

/// The address ranks on this host reach the service at: `addr`, or
/// loopback where the service listens on every address.
fn address_for_ranks(mut addr: SocketAddr) -> SocketAddr {
    if addr.ip().is_unspecified() {
        addr.set_ip(match addr.ip() {
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
        });
    }
    addr
}

/// Starts the N ranks, each in its own process group, with `--label`'s
/// forwarding threads (each says on `done` when its stream ends). When one
/// cannot be started, stops those already running and returns the exit
/// code (127 for a program not found, else 126).
fn spawn_ranks(
    opts: &Opts,
    job: &str,
    addr: SocketAddr,
    secret: &Secret,
    done: &mpsc::Sender<()>,
) -> Result<Vec<Child>, i32> {
    let mut children: Vec<Child> = Vec::with_capacity(opts.n);
    for rank in 0..opts.n {
        let mut cmd = xdev::devkit::launch::rank_command(
            &opts.program[0],
            &opts.program[1..],
            rank,
            opts.n,
            job,
            addr,
            secret,
        );
        cmd.process_group(0);
        match &opts.device {
            Some(d) => cmd.env(XDEV_DEVICE, d),
            None => cmd.env_remove(XDEV_DEVICE),
        };
        if opts.label {
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        }
        match cmd.spawn() {
            Ok(mut child) => {
                if let Some(out) = child.stdout.take() {
                    forward(rank, out, false, done.clone());
                }
                if let Some(err) = child.stderr.take() {
                    forward(rank, err, true, done.clone());
                }
                children.push(child);
            }
            Err(e) => {
                eprintln!(
                    "xdev-run: cannot start rank {rank} ({}): {e}",
                    opts.program[0].to_string_lossy()
                );
                let mut reaped = vec![None; children.len()];
                stop_all(&mut children, &mut reaped, libc::SIGTERM);
                return Err(if e.kind() == std::io::ErrorKind::NotFound {
                    127
                } else {
                    126
                });
            }
        }
    }
    Ok(children)
}

/// Watches the ranks until the job ends: all ranks exited, one failed
/// (without `--keep-going`), a signal came, or the timeout passed.
fn watch_ranks(
    opts: &Opts,
    children: &mut [Child],
    reaped: &mut [Option<ExitStatus>],
    gone_at: &mut [Option<SystemTime>],
) -> Outcome {
    let deadline = opts.timeout.map(|t| Instant::now() + t);
    // With --keep-going: the first failure, reported when all have ended.
    let mut first_failure: Option<(usize, ExitStatus)> = None;
    loop {
        if let Some((rank, s)) = reap_exited(children, reaped, gone_at) {
            if !opts.keep_going {
                return Outcome::RankFailed(rank, s);
            }
            let (_, how) = describe(s);
            eprintln!("xdev-run: rank {rank} {how}; the others go on (--keep-going)");
            first_failure = first_failure.or(Some((rank, s)));
        }
        if reaped.iter().all(Option::is_some) {
            return match first_failure {
                Some((rank, s)) => Outcome::KeptGoing(rank, s),
                None => Outcome::Success,
            };
        }
        let sig = SIGNALLED.load(Ordering::SeqCst);
        if sig != 0 {
            return Outcome::Signalled(sig);
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Outcome::Timeout;
        }
        thread::sleep(POLL);
    }
}

/// Reaps the ranks that have exited since the last look, noting when each
/// was seen gone; returns the first of them that failed.
fn reap_exited(
    children: &mut [Child],
    reaped: &mut [Option<ExitStatus>],
    gone_at: &mut [Option<SystemTime>],
) -> Option<(usize, ExitStatus)> {
    let mut failed = None;
    for (rank, (c, st)) in children.iter_mut().zip(reaped.iter_mut()).enumerate() {
        if st.is_some() {
            continue;
        }
        match c.try_wait() {
            Ok(Some(s)) => {
                *st = Some(s);
                gone_at[rank] = Some(SystemTime::now());
                if !s.success() && failed.is_none() {
                    failed = Some((rank, s));
                }
            }
            Ok(None) => {}
            Err(e) => {
                eprintln!("xdev-run: cannot wait for rank {rank}: {e}");
                let s = ExitStatus::from_raw(1 << 8);
                *st = Some(s);
                gone_at[rank] = Some(SystemTime::now());
                failed = failed.or(Some((rank, s)));
            }
        }
    }
    failed
}

/// Says how the job ended, stops the ranks still running where the outcome
/// asks for it, and returns xdev-run's exit code.
fn report_and_stop(
    opts: &Opts,
    outcome: Outcome,
    children: &mut [Child],
    reaped: &mut [Option<ExitStatus>],
) -> i32 {
    let left = reaped.iter().filter(|s| s.is_none()).count();
    let stopping = if left > 0 {
        format!("; stopping the {left} rank(s) still running")
    } else {
        String::new()
    };
    match outcome {
        Outcome::Success => 0,
        Outcome::KeptGoing(rank, s) => {
            let (code, how) = describe(s);
            eprintln!("xdev-run: all ranks ended; the first failure: rank {rank} {how}");
            code
        }
        Outcome::RankFailed(rank, s) => {
            let (code, how) = describe(s);
            eprintln!("xdev-run: rank {rank} {how}{stopping}");
            stop_all(children, reaped, libc::SIGTERM);
            code
        }
        Outcome::Timeout => {
            eprintln!(
                "xdev-run: timeout: the job did not finish within {:?}{stopping}",
                opts.timeout.unwrap_or_default()
            );
            stop_all(children, reaped, libc::SIGTERM);
            124
        }
        Outcome::Signalled(sig) => {
            eprintln!(
                "xdev-run: got {} (signal {sig}){}",
                signal_name(sig),
                if left > 0 {
                    format!("; passing it on to the {left} rank(s) still running")
                } else {
                    String::new()
                }
            );
            stop_all(children, reaped, sig);
            128 + sig
        }
    }
}

/// Waits up to [`GRACE`] for the `streams` label threads to forward the
/// last of the ranks' output.
fn wait_for_labels(done: &mpsc::Receiver<()>, streams: usize) {
    let until = Instant::now() + GRACE;
    for _ in 0..streams {
        let left = until.saturating_duration_since(Instant::now());
        if done.recv_timeout(left).is_err() {
            break;
        }
    }
}
