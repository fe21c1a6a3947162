//! Measuring for the report: running a program with its output captured
//! and a time limit ([`run_captured`]), and the MPI peers built from
//! `benches/mpi/osu_peer.c` and run on two ranks ([`measure_mpi`]).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::records::{parse_results, Record, Results};
use super::{PeerStatus, PSM_VS_RAW, RAW_PSM2, TESTS};
use crate::cli::rounds_for;

/// The C source of the MPI peer, built at report time with each MPI's `mpicc`.
pub const MPI_PEER_SOURCE: &str = include_str!("../../mpi/osu_peer.c");

/// How to install the MPI peers on Debian.
pub const MPI_INSTALL: &str = "apt-get install openmpi-bin libopenmpi-dev mpich libmpich-dev";

/// The arguments of one run of this program beside the suite: `device`'s
/// `tests` (a comma list) from `min` to `max` bytes as JSON records, with
/// each of `options` as a device option (`--option K=V`), and `--quick`.
pub fn series_args(
    device: &str,
    tests: &str,
    (min, max): (usize, usize),
    options: &[&str],
    quick: bool,
) -> Vec<String> {
    let mut a: Vec<String> = ["--json", "--device", device, "--test", tests, "--min-size"]
        .map(String::from)
        .to_vec();
    a.push(min.to_string());
    a.push("--max-size".into());
    a.push(max.to_string());
    for o in options {
        a.push("--option".into());
        a.push((*o).into());
    }
    if quick {
        a.push("--quick".into());
    }
    a
}

/// Runs `exe` with `args` as the series `series` (a run of its own beside
/// the suite's, within 30 minutes) and adds what `records` makes of its
/// output to `results`; a run that gave no `test` records is listed as not
/// measured, with the first reason it printed.
pub(super) fn measure_series(
    exe: &Path,
    args: Vec<String>,
    (series, test): (&str, &str),
    records: impl FnOnce(&str) -> Results,
    results: &mut Results,
) {
    let (text, status) = run_captured(
        Command::new(exe).args(args),
        Duration::from_secs(1800),
        |_| {},
    );
    if let Err(e) = status {
        eprintln!("report: {series}: {e}");
    }
    let r = records(&text);
    if r.records.is_empty() {
        let why = r.not_measured.first().map_or("no records", |(_, w)| w);
        results
            .not_measured
            .push((series.into(), format!("its run gave no {test}: {why}")));
    }
    results.records.extend(r.records);
}

/// Runs `cmd` with stdout captured line by line (each line also passed to
/// `each`), stderr inherited, killed after `limit`. Returns what it printed
/// on stdout (also when it failed), and whether it succeeded.
pub fn run_captured(
    cmd: &mut Command,
    limit: Duration,
    each: impl FnMut(&str),
) -> (String, Result<(), String>) {
    let mut out = String::new();
    let r = capture(cmd, limit, each, &mut out);
    (out, r)
}

/// [`run_captured`] into `out`.
fn capture(
    cmd: &mut Command,
    limit: Duration,
    mut each: impl FnMut(&str),
    out: &mut String,
) -> Result<(), String> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start {:?}: {e}", cmd.get_program()))?;
    let stdout = child.stdout.take().ok_or("no stdout pipe")?;
    let id = child.id();
    let start = Instant::now();
    // A watchdog while stdout is read: kills the child when the limit
    // passes. The child is not waited for before the watchdog has been
    // joined, so its pid cannot have been reused.
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watchdog = {
        let done = done.clone();
        std::thread::spawn(move || {
            while !done.load(std::sync::atomic::Ordering::Acquire) {
                if start.elapsed() > limit {
                    // SAFETY: kill(2) on the pid of a child this process
                    // started and has not reaped yet (see above).
                    unsafe { libc::kill(id as libc::pid_t, libc::SIGKILL) };
                    return true;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            false
        })
    };
    for line in BufReader::new(stdout).lines() {
        let Ok(line) = line else { break };
        each(&line);
        out.push_str(&line);
        out.push('\n');
    }
    done.store(true, std::sync::atomic::Ordering::Release);
    let mut killed = watchdog.join().unwrap_or(false);
    // Stdout is closed; the child may still be running.
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Ok(status),
            Ok(None) if start.elapsed() > limit => {
                let _ = child.kill();
                killed = true;
                break child.wait();
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => break Err(e),
        }
    };
    if killed {
        return Err(format!("stopped after {} s", limit.as_secs()));
    }
    let status = status.map_err(|e| e.to_string())?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("exited with {status}"))
    }
}

/// An installed MPI: its name in the report, `mpicc` and `mpirun`.
#[derive(Clone, Debug, PartialEq)]
pub struct Mpi {
    /// Name in the report (`Open MPI`, `MPICH`).
    pub name: &'static str,
    /// The series name of its records.
    pub series: &'static str,
    /// Compiler wrapper (Debian's alternative name).
    pub mpicc: &'static str,
    /// Launcher.
    pub mpirun: &'static str,
    /// Extra launcher arguments (binding, running as root).
    pub run_args: &'static [&'static str],
    /// Run over PSM2 in a mount namespace that shows an hfi1 unit (see
    /// [`super::psm2_peer`]): the psm device's peer.
    pub over_psm2: bool,
}

/// The MPIs the report looks for (Debian's names): Open MPI and MPICH on
/// shared memory, the peers of `thread` and `shm`, and Open MPI over PSM2,
/// the peer of `psm`.
pub const MPIS: [Mpi; 3] = [
    Mpi {
        name: "Open MPI",
        series: "Open MPI",
        mpicc: "mpicc.openmpi",
        mpirun: "mpirun.openmpi",
        run_args: &["--bind-to", "core", "--map-by", "core"],
        over_psm2: false,
    },
    Mpi {
        name: "MPICH",
        series: "MPICH",
        mpicc: "mpicc.mpich",
        mpirun: "mpirun.mpich",
        run_args: &["-bind-to", "core"],
        over_psm2: false,
    },
    Mpi {
        name: "Open MPI over PSM2",
        series: "Open MPI (PSM2)",
        mpicc: "mpicc.openmpi",
        mpirun: "mpirun.openmpi",
        run_args: super::psm2_peer::PSM2_RUN_ARGS,
        over_psm2: true,
    },
];

/// `program` on `PATH`.
pub fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(program))
            .find(|f| f.is_file())
    })
}

/// What `mpirun --version` says of its version: the value of a `Version:`
/// line (MPICH's Hydra), else the first line (Open MPI's).
fn version(mpirun: &Path) -> Option<String> {
    let out = Command::new(mpirun)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .ok()?;
    let text = if out.stdout.is_empty() {
        out.stderr
    } else {
        out.stdout
    };
    version_of(&String::from_utf8_lossy(&text))
}

/// The version in `mpirun --version`'s output `text` (see [`version`]).
fn version_of(text: &str) -> Option<String> {
    let lines = || text.lines().map(str::trim).filter(|l| !l.is_empty());
    lines()
        .find_map(|l| l.strip_prefix("Version:"))
        .map(|v| format!("version {}", v.trim()))
        .or_else(|| lines().next().map(String::from))
}

/// Builds the MPI peer with `mpi`'s `mpicc` in `dir` and runs it on two
/// ranks: its records (named `mpi.series`) and a note on how, or why not.
pub fn measure_mpi(
    mpi: &Mpi,
    dir: &Path,
    max_size: usize,
    rounds: usize,
    quick: bool,
) -> Result<(Vec<Record>, String), String> {
    build_mpi_peer(mpi, dir)?.run(max_size, rounds, quick)
}

/// The MPI peer built for one MPI ([`build_mpi_peer`]), ready to run as
/// often as wanted.
pub struct MpiPeer<'m> {
    mpi: &'m Mpi,
    mpirun: PathBuf,
    exe: PathBuf,
}

/// Builds the MPI peer with `mpi`'s `mpicc` in `dir`, or says why not
/// (the MPI is not installed, the build failed).
pub fn build_mpi_peer<'m>(mpi: &'m Mpi, dir: &Path) -> Result<MpiPeer<'m>, String> {
    let mpicc = which(mpi.mpicc).ok_or_else(|| {
        format!(
            "{} is not installed (no {} on PATH; install with `{MPI_INSTALL}`)",
            mpi.name, mpi.mpicc
        )
    })?;
    let mpirun = which(mpi.mpirun).ok_or_else(|| {
        format!(
            "{} has {} but no {} (install with `{MPI_INSTALL}`)",
            mpi.name, mpi.mpicc, mpi.mpirun
        )
    })?;
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let src = dir.join("osu_peer.c");
    std::fs::write(&src, MPI_PEER_SOURCE).map_err(|e| format!("{}: {e}", src.display()))?;
    let exe = dir.join(format!("osu_peer-{}", mpi.mpicc.replace('.', "-")));
    let cc = Command::new(&mpicc)
        .args(["-O2", "-Wno-stringop-overflow", "-o"])
        .arg(&exe)
        .arg(&src)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", mpicc.display()))?;
    if !cc.status.success() {
        return Err(format!(
            "{} failed: {}",
            mpi.mpicc,
            String::from_utf8_lossy(&cc.stderr).trim()
        ));
    }
    Ok(MpiPeer { mpi, mpirun, exe })
}

impl MpiPeer<'_> {
    /// Runs the peer on two ranks up to `max_size` bytes, `rounds` rounds
    /// per size: its records (named after its MPI's series) and a note on
    /// how, or why not.
    pub fn run(
        &self,
        max_size: usize,
        rounds: usize,
        quick: bool,
    ) -> Result<(Vec<Record>, String), String> {
        self.run_only(None, max_size, rounds, quick)
    }

    /// [`run`](Self::run) narrowed to `only`'s tests (a comma list of
    /// latency, bw, bibw and rate) from `only`'s smallest size up to
    /// `max_size` (osu_peer's MIN_SIZE and TESTS); `None`: every test and
    /// size.
    pub fn run_only(
        &self,
        only: Option<(&str, usize)>,
        max_size: usize,
        rounds: usize,
        quick: bool,
    ) -> Result<(Vec<Record>, String), String> {
        let (mpi, mpirun, exe) = (self.mpi, &self.mpirun, &self.exe);
        let mut cmd = if mpi.over_psm2 {
            super::psm2_peer::command(mpirun)?
        } else {
            Command::new(mpirun)
        };
        cmd.args(["-np", "2"])
            .args(mpi.run_args)
            .arg(exe)
            .arg(mpi.series)
            .arg(max_size.to_string())
            .arg(rounds.to_string())
            .arg(if quick { "1" } else { "0" })
            .arg(crate::WARM_UP_BYTES.to_string())
            .args(
                only.into_iter()
                    .flat_map(|(tests, min)| [min.to_string(), tests.to_string()]),
            )
            // Open MPI refuses to run as root without these (containers, CI).
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
        let (out, r) = run_captured(&mut cmd, Duration::from_secs(900), |_| {});
        r.map_err(|e| format!("{} -np 2 osu_peer {e}", mpi.mpirun))?;
        let records = parse_results(&out).records;
        if records.is_empty() {
            return Err(format!("{} printed no records", mpi.mpirun));
        }
        let version = version(mpirun).unwrap_or_else(|| "version unknown".into());
        let mut how = format!(
            "{version}; `{} -np 2 {}`",
            mpi.mpirun,
            mpi.run_args.join(" ")
        );
        if mpi.over_psm2 {
            how.push_str("; ");
            how.push_str(super::psm2_peer::PSM2_HOW);
        }
        Ok((records, how))
    }
}

/// The suite of the report: this program (`exe`) on every device, the
/// report's tests as JSON records, its progress on stderr. What it measured,
/// also when it did not finish cleanly.
pub(super) fn measure_suite(exe: &Path, max_size: usize, quick: bool) -> Results {
    let mut suite = vec![
        "--json".to_string(),
        "--test".to_string(),
        TESTS.join(","),
        "--max-size".to_string(),
        max_size.to_string(),
    ];
    if quick {
        suite.push("--quick".into());
    }
    eprintln!("report: xdev-bench {}", suite.join(" "));
    let mut last = (String::new(), String::new());
    let (text, status) = run_captured(
        Command::new(exe).args(&suite),
        std::time::Duration::from_secs(3600),
        |line| {
            let rec = parse_results(line);
            if let Some(x) = rec.records.first() {
                if (x.device.as_str(), x.test.as_str()) != (last.0.as_str(), last.1.as_str()) {
                    eprintln!("report: measuring {} {}", x.device, x.test);
                    last = (x.device.clone(), x.test.clone());
                }
            }
        },
    );
    if let Err(e) = &status {
        eprintln!("report: the suite did not finish cleanly ({e}); reporting what it measured");
    }
    parse_results(&text)
}

/// Raw PSM2's status: measured when the suite has the psm device's
/// `psm-vs-raw` records, else why not.
pub(super) fn raw_psm2_status(results: &Results) -> (String, PeerStatus) {
    let raw = if results.records.iter().any(|x| x.device == PSM_VS_RAW) {
        PeerStatus::Measured(
            "psm2_mq_* on the psm device's own endpoint, alternating with the device".into(),
        )
    } else {
        let why = results
            .not_measured
            .iter()
            .find(|(d, _)| d == "psm")
            .map_or("the psm device was not measured".to_string(), |(_, w)| {
                format!("the psm device was not measured: {w}")
            });
        PeerStatus::NotMeasured(why)
    };
    (RAW_PSM2.to_string(), raw)
}

/// The floors once more, alone (`--test floor`), right before the MPI
/// and UCX peers run, when one of them is installed: their records go into
/// `results`.
pub(super) fn measure_floors_for_peers(
    exe: &Path,
    max_size: usize,
    quick: bool,
    results: &mut Results,
) {
    if !MPIS.iter().any(|m| which(m.mpicc).is_some()) && which(super::UCX_PERFTEST).is_none() {
        return;
    }
    let mut floors = vec![
        "--json".to_string(),
        "--test".to_string(),
        "floor".to_string(),
        "--max-size".to_string(),
        max_size.to_string(),
    ];
    if quick {
        floors.push("--quick".into());
    }
    eprintln!("report: measuring the floors next to the MPI and UCX peers");
    let (text, status) = run_captured(
        Command::new(exe).args(&floors),
        std::time::Duration::from_secs(1800),
        |_| {},
    );
    if let Err(e) = status {
        eprintln!("report: the floors next to the peers: {e}");
    }
    results.records.extend(parse_results(&text).records);
}

/// Every MPI of [`MPIS`] ([`measure_mpi`], skipped unless `mpi`): its
/// records go into `results`; (name, status) of each.
pub(super) fn measure_mpis(
    mpi_wanted: bool,
    max_size: usize,
    quick: bool,
    results: &mut Results,
) -> Vec<(String, PeerStatus)> {
    let mut peers = Vec::new();
    let build_dir = std::env::temp_dir().join(format!("xdev-bench-report-{}", std::process::id()));
    for mpi in &MPIS {
        let status = if !mpi_wanted {
            PeerStatus::NotMeasured("skipped (--no-mpi)".into())
        } else {
            eprintln!("report: measuring {} (osu_peer.c)", mpi.name);
            match measure_mpi(mpi, &build_dir, max_size, rounds_for(quick), quick) {
                Ok((records, how)) => {
                    results.records.extend(records);
                    PeerStatus::Measured(how)
                }
                Err(why) => {
                    eprintln!("report: {}: not measured: {why}", mpi.name);
                    PeerStatus::NotMeasured(why)
                }
            }
        };
        peers.push((mpi.name.to_string(), status));
    }
    let _ = std::fs::remove_dir_all(&build_dir);
    peers
}

/// The UCX peer ([`super::measure_ucx`], skipped unless `wanted`): its
/// records go into `results`; its name and status.
pub(super) fn ucx_peer(
    wanted: bool,
    max_size: usize,
    quick: bool,
    results: &mut Results,
) -> (String, PeerStatus) {
    let status = if !wanted {
        PeerStatus::NotMeasured("skipped (--no-ucx)".into())
    } else {
        eprintln!("report: measuring UCX (ucx_perftest tag_lat, tag_bw)");
        match super::measure_ucx(max_size, if quick { 1 } else { 3 }, quick) {
            Ok((records, how)) => {
                results.records.extend(records);
                PeerStatus::Measured(how)
            }
            Err(why) => {
                eprintln!("report: UCX: not measured: {why}");
                PeerStatus::NotMeasured(why)
            }
        }
    };
    (super::UCX.to_string(), status)
}

#[cfg(test)]
mod tests;
