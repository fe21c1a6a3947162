//! `xdev-bench`: OSU-style latency and bandwidth of xdev devices, with the
//! cache-line and memcpy floors measured in the same run.
//!
//! With no arguments it runs latency and bandwidth on every device in this
//! build: thread devices in this process, process devices by re-executing
//! itself under `xdev-run`. With `XDEV_RANK` set it is one rank of such a
//! run. See `--help`.

use std::ffi::OsString;
use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::Arc;

use xdev::bootstrap::{self, Bootstrap};
use xdev::registry::{Entry, Placement, Registry};
use xdev::{Device, Rank};
use xdev_bench::process::{DeviceCoordinator, ProcessFloor};
use xdev_bench::{
    bandwidth, bandwidth_iterations, cache_line_floor, latency, latency_iterations, memcpy_floor,
    osu, sizes, WINDOW,
};

const USAGE: &str = "\
xdev-bench: OSU-style benchmarks of xdev devices, with floors from the same run

USAGE: xdev-bench [OPTIONS]

OPTIONS:
  --device NAME      device to measure (repeatable; default: every device in this build)
  --test TEST        latency | bw | all (default) | crossover (eager vs rendezvous by
                     size; thread devices only)
  --max-size BYTES   largest message (default 4194304)
  --option K=V       device option, e.g. eager_limit=4096 (repeatable)
  --quick            a tenth of OSU's iterations (smoke runs)
  --json             one JSON record per size instead of OSU tables
  -h, --help         this text";

const DETAILS: &str = "\
Thread devices run in this process, rank r a thread pinned to core r. Process
devices run under the launcher: xdev-bench re-executes itself as
  xdev-run -n 2 --device NAME -- xdev-bench ARGS...
and exits with its status (xdev-run must sit next to xdev-bench, from
`cargo build --release -p xdev`; the default run skips process devices
without it). Started with XDEV_RANK set (by xdev-run, or by hand with the
variables `xdev-run --serve` prints), xdev-bench is one rank: it pins itself
to core RANK, opens the device named by XDEV_DEVICE or --device, and rank 0
prints.

Columns: value, the floor measured in this run, and value/floor. For each size
the floor and the device are measured alternately, three rounds (one with
--quick), and the best of each is shown: OSU's average per round, best round.
Latency floor: one-way hand-off of a cache line between the two ranks' cores,
by the ranks themselves (two pinned threads for a thread device, the two rank
processes through a shared mapping for a process device); lower is better,
ratio >= 1. Bandwidth floor: single-thread memcpy over the same working set,
in one process (ratio <= 1 is the fraction of a copy's speed achieved).";

/// Exit status of a rank whose device cannot be opened here (the default
/// run skips such a device instead of failing).
const UNAVAILABLE: u8 = 3;

/// The launcher's file name, looked for next to this executable.
const LAUNCHER: &str = "xdev-run";

#[derive(Clone, Debug, PartialEq)]
struct Args {
    devices: Vec<String>,
    test: String,
    max_size: usize,
    options: Vec<(String, String)>,
    quick: bool,
    json: bool,
}

#[derive(Debug, PartialEq)]
enum Parsed {
    Run(Args),
    Help,
}

/// Tests `--test` takes; `floor` (the floors alone) is not advertised.
const TESTS: [&str; 5] = ["latency", "bw", "all", "crossover", "floor"];

fn parse(args: impl IntoIterator<Item = String>) -> Result<Parsed, String> {
    let mut a = Args {
        devices: Vec::new(),
        test: "all".into(),
        max_size: 4 << 20,
        options: Vec::new(),
        quick: false,
        json: false,
    };
    let mut it = args.into_iter();
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        match arg.as_str() {
            "--device" => a.devices.push(value("--device")?),
            "--test" => a.test = value("--test")?,
            "--max-size" => {
                a.max_size = value("--max-size")?
                    .parse()
                    .map_err(|_| "--max-size takes a byte count".to_string())?
            }
            "--option" => {
                let kv = value("--option")?;
                let (k, v) = kv.split_once('=').ok_or("--option takes K=V")?;
                a.options.push((k.into(), v.into()));
            }
            "--quick" => a.quick = true,
            "--json" => a.json = true,
            "-h" | "--help" => return Ok(Parsed::Help),
            other => return Err(format!("unknown argument {other:?} (see --help)")),
        }
    }
    if !TESTS.contains(&a.test.as_str()) {
        return Err(format!("unknown test {:?}", a.test));
    }
    Ok(Parsed::Run(a))
}

/// Every device this binary links.
fn registry() -> Registry {
    ibvx::registry()
}

fn help(reg: &Registry) -> String {
    let mut s = format!("{USAGE}\n\nDevices in this build:\n");
    for e in reg.entries() {
        let ranks = match e.placement {
            Placement::Threads => "[threads]",
            Placement::Processes => "[processes]",
        };
        s.push_str(&format!("  {:<10} {ranks:<12} {}\n", e.name, e.description));
    }
    s.push('\n');
    s.push_str(DETAILS);
    s
}

fn scaled(quick: bool, (iters, skip): (usize, usize)) -> (usize, usize) {
    if quick {
        ((iters / 10).max(2), (skip / 10).max(1))
    } else {
        (iters, skip)
    }
}

/// Rounds per size: floor and device are measured alternately this many
/// times and the best of each is kept, so that a neighbour's burst on this
/// shared machine hits both sides of a ratio alike.
fn rounds(a: &Args) -> usize {
    if a.quick {
        1
    } else {
        3
    }
}

/// Round trips per cache-line floor run.
fn floor_iters(a: &Args) -> u64 {
    if a.quick {
        20_000
    } else {
        200_000
    }
}

/// A benchmark on one rank's device: the figure on rank 0, `None` elsewhere.
type Bench<'a> = dyn Fn(&dyn Device) -> xdev::Result<Option<f64>> + Sync + 'a;

/// Where the two ranks of a measurement run: threads of this process, or
/// this process as one rank of a launched job. Every figure is `Some` on the
/// rank that reports (rank 0) and `None` elsewhere; every rank runs the same
/// sequence of calls.
trait Rig {
    /// `"threads"` or `"processes"`, for headers.
    fn placement(&self) -> &'static str;
    /// Whether this rank prints.
    fn reports(&self) -> bool;
    /// One run of the cache-line floor between the ranks' cores.
    fn cache_line_floor(&self, iters: u64) -> Option<f64>;
    /// One run of the memcpy floor (in one process, on the reporting rank).
    fn memcpy_floor(&self, size: usize) -> Option<f64>;
    /// Runs `bench` on the device.
    fn run(&self, bench: &Bench) -> Result<Option<f64>, String>;
}

/// Ranks as threads of this process: a fresh two-rank world of the `thread`
/// device per measurement, rank r pinned to core r.
struct ThreadRig<'a> {
    args: &'a Args,
}

fn world(a: &Args, extra: &[(&str, String)]) -> shm_ipc::ThreadWorld {
    let mut w = shm_ipc::ThreadWorld::new(2).pin(true);
    for (k, v) in &a.options {
        w = w.option(k, v);
    }
    for (k, v) in extra {
        w = w.option(k, v);
    }
    w
}

fn rank0(out: Vec<xdev::Result<Option<f64>>>) -> Result<f64, String> {
    out.into_iter()
        .next()
        .ok_or("no ranks")?
        .map_err(|e| e.to_string())?
        .ok_or_else(|| "rank 0 gave no figure".to_string())
}

impl Rig for ThreadRig<'_> {
    fn placement(&self) -> &'static str {
        "threads"
    }

    fn reports(&self) -> bool {
        true
    }

    fn cache_line_floor(&self, iters: u64) -> Option<f64> {
        Some(cache_line_floor(iters, 1))
    }

    fn memcpy_floor(&self, size: usize) -> Option<f64> {
        Some(memcpy_floor(size, WINDOW, 1))
    }

    fn run(&self, bench: &Bench) -> Result<Option<f64>, String> {
        rank0(world(self.args, &[]).run(|dev| bench(dev))).map(Some)
    }
}

/// This process as one rank of a launched job, pinned to core `rank`; the
/// device (none when measuring the floors alone) is opened once for the run.
struct ProcessRig {
    rank: Rank,
    dev: Option<Arc<dyn Device>>,
    floor: ProcessFloor,
}

impl Rig for ProcessRig {
    fn placement(&self) -> &'static str {
        "processes"
    }

    fn reports(&self) -> bool {
        self.rank == 0
    }

    fn cache_line_floor(&self, iters: u64) -> Option<f64> {
        self.floor.cache_line(iters)
    }

    fn memcpy_floor(&self, size: usize) -> Option<f64> {
        self.reports().then(|| memcpy_floor(size, WINDOW, 1))
    }

    fn run(&self, bench: &Bench) -> Result<Option<f64>, String> {
        let dev = self.dev.as_deref().ok_or("no device is open")?;
        let figure = bench(dev).map_err(|e| e.to_string())?;
        // A rank's last operation may complete only when its peer makes
        // progress (the sender of a PSM2 rendezvous waits for the
        // receiver's last control message): a barrier through the device
        // lets both finish before either goes on to the floor, which does
        // not drive the device.
        xdev::conformance::barrier(dev).map_err(|e| format!("barrier: {e}"))?;
        Ok(figure)
    }
}

/// The better of two figures where one side may have none (`None` is "not
/// measured on this rank").
fn best(acc: Option<f64>, x: Option<f64>, better: fn(f64, f64) -> f64) -> Option<f64> {
    match (acc, x) {
        (Some(a), Some(x)) => Some(better(a, x)),
        (a, x) => a.or(x),
    }
}

fn figure(x: Option<f64>) -> Result<f64, String> {
    x.ok_or_else(|| "rank 0 gave no figure".to_string())
}

fn run_latency(a: &Args, device: &str, rig: &dyn Rig) -> Result<(), String> {
    let iters = floor_iters(a);
    if !a.json {
        let floor = (0..3).fold(None, |f, _| best(f, rig.cache_line_floor(iters), f64::min));
        if rig.reports() {
            let floor = figure(floor)?;
            println!("{}", osu::latency_header(device, rig.placement(), floor));
        }
    }
    for size in sizes(a.max_size) {
        let (n, skip) = scaled(a.quick, latency_iterations(size));
        let (mut us, mut floor) = (None, None);
        for _ in 0..rounds(a) {
            floor = best(floor, rig.cache_line_floor(iters), f64::min);
            us = best(us, rig.run(&|dev| latency(dev, size, n, skip))?, f64::min);
        }
        if rig.reports() {
            let (us, floor) = (figure(us)?, figure(floor)?);
            if a.json {
                println!("{}", osu::json(device, "latency", size, us, "us", floor));
            } else {
                println!("{}", osu::row(size, us, floor));
            }
        }
    }
    Ok(())
}

fn run_bandwidth(a: &Args, device: &str, rig: &dyn Rig) -> Result<(), String> {
    if !a.json && rig.reports() {
        println!("{}", osu::bandwidth_header(device));
    }
    for size in sizes(a.max_size).into_iter().filter(|&s| s > 0) {
        let (n, skip) = scaled(a.quick, bandwidth_iterations(size));
        let (mut mbs, mut floor) = (None, None);
        for _ in 0..rounds(a) {
            floor = best(floor, rig.memcpy_floor(size), f64::max);
            mbs = best(
                mbs,
                rig.run(&|dev| bandwidth(dev, size, n, skip))?,
                f64::max,
            );
        }
        if rig.reports() {
            let (mbs, floor) = (figure(mbs)?, figure(floor)?);
            if a.json {
                println!("{}", osu::json(device, "bw", size, mbs, "MB/s", floor));
            } else {
                println!("{}", osu::row(size, mbs, floor));
            }
        }
    }
    Ok(())
}

/// The floors alone (`--test floor`): per size, the cache-line floor between
/// the rig's ranks and the memcpy floor, measured alternately.
fn run_floors(a: &Args, rig: &dyn Rig) -> Result<(), String> {
    if !a.json && rig.reports() {
        println!("{}", osu::floor_header(rig.placement()));
    }
    let iters = floor_iters(a);
    for size in sizes(a.max_size) {
        let (mut us, mut mbs) = (None, None);
        for _ in 0..rounds(a) {
            us = best(us, rig.cache_line_floor(iters), f64::min);
            mbs = best(mbs, rig.memcpy_floor(size), f64::max);
        }
        if rig.reports() {
            let (us, mbs) = (figure(us)?, figure(mbs)?);
            if a.json {
                let p = rig.placement();
                println!("{}", osu::floor_json(p, "cache_line", size, us, "us"));
                println!("{}", osu::floor_json(p, "memcpy", size, mbs, "MB/s"));
            } else {
                println!("{}", osu::floor_row(size, us, mbs));
            }
        }
    }
    Ok(())
}

/// The tests `a.test` names, on `device` through `rig` (not crossover).
fn run_tests(a: &Args, device: &str, rig: &dyn Rig) -> Result<(), String> {
    match a.test.as_str() {
        "latency" => run_latency(a, device, rig),
        "bw" => run_bandwidth(a, device, rig),
        "floor" => run_floors(a, rig),
        _ => {
            run_latency(a, device, rig)?;
            if !a.json && rig.reports() {
                println!();
            }
            run_bandwidth(a, device, rig)
        }
    }
}

/// The psm device against raw PSM2 calls on its own endpoint, measured
/// alternately per size, best of the rounds: the device's overhead over
/// PSM2 (ratio device/raw: above 1 for latency and below 1 for bandwidth
/// means the device costs something).
fn run_psm_peer(a: &Args, psm: &ibvx::PsmDevice, rank: Rank) -> Result<(), String> {
    use xdev_bench::psm_raw;
    // SAFETY: the benchmark alternates strictly: no device operation runs or
    // is outstanding while the raw loops run (each completes all it starts),
    // and the raw loops use their own context.
    let raw = unsafe { psm.raw_handles() };
    let e = |e: xdev::Error| e.to_string();
    let report = rank == 0;
    let latency_test = matches!(a.test.as_str(), "latency" | "all");
    let bw_test = matches!(a.test.as_str(), "bw" | "all");
    if latency_test {
        if report && !a.json {
            println!(
                "\n# OSU MPI Latency Test (xdev-bench)\n# Device: psm against raw PSM2 MQ calls on the same endpoint (the floor column)\n{:<10}{:>20}{:>20}{:>12}",
                "# Size", "Avg Latency(us)", "Raw PSM2(us)", "Ratio"
            );
        }
        for size in sizes(a.max_size) {
            let (n, skip) = scaled(a.quick, latency_iterations(size));
            let (mut dev_us, mut raw_us) = (None, None);
            for _ in 0..rounds(a) {
                raw_us = best(
                    raw_us,
                    psm_raw::latency(&raw, rank, size, n, skip).map_err(e)?,
                    f64::min,
                );
                dev_us = best(dev_us, latency(psm, size, n, skip).map_err(e)?, f64::min);
            }
            if report {
                let (d, r) = (figure(dev_us)?, figure(raw_us)?);
                if a.json {
                    println!("{}", osu::json("psm-vs-raw", "latency", size, d, "us", r));
                } else {
                    println!("{}", osu::row(size, d, r));
                }
            }
        }
    }
    if bw_test {
        if report && !a.json {
            println!(
                "\n# OSU MPI Bandwidth Test (xdev-bench)\n# Device: psm against raw PSM2 MQ calls on the same endpoint (the floor column)\n{:<10}{:>20}{:>20}{:>12}",
                "# Size", "Bandwidth (MB/s)", "Raw PSM2(MB/s)", "Ratio"
            );
        }
        for size in sizes(a.max_size).into_iter().filter(|&s| s > 0) {
            let (n, skip) = scaled(a.quick, bandwidth_iterations(size));
            let (mut dev_mbs, mut raw_mbs) = (None, None);
            for _ in 0..rounds(a) {
                raw_mbs = best(
                    raw_mbs,
                    psm_raw::bandwidth(&raw, rank, size, n, skip).map_err(e)?,
                    f64::max,
                );
                dev_mbs = best(dev_mbs, bandwidth(psm, size, n, skip).map_err(e)?, f64::max);
            }
            if report {
                let (d, r) = (figure(dev_mbs)?, figure(raw_mbs)?);
                if a.json {
                    println!("{}", osu::json("psm-vs-raw", "bw", size, d, "MB/s", r));
                } else {
                    println!("{}", osu::row(size, d, r));
                }
            }
        }
    }
    Ok(())
}

/// Latency and bandwidth with every message forced eager, then forced
/// rendezvous: where the curves cross justifies the default `eager_limit`.
fn run_crossover(a: &Args, device: &str) -> Result<(), String> {
    println!("# Eager/rendezvous crossover on {device}: latency (us) and bandwidth (MB/s)");
    println!(
        "{:<10}{:>20}{:>20}{:>20}{:>20}",
        "# Size", "Eager lat", "Rndv lat", "Eager bw", "Rndv bw"
    );
    let mut size = 256;
    while size <= 32 << 10 {
        let mut row = format!("{size:<10}");
        let mut bws = String::new();
        for limit in [64 << 10, 0] {
            let extra = [
                ("eager_limit", limit.to_string()),
                ("ring_bytes", (256usize << 10).to_string()),
            ];
            let (iters, skip) = scaled(a.quick, latency_iterations(size));
            let us = rank0(world(a, &extra).run(|dev| latency(dev, size, iters, skip)))?;
            row.push_str(&format!("{us:>20.2}"));
            let (iters, skip) = scaled(a.quick, bandwidth_iterations(size));
            let mbs = rank0(world(a, &extra).run(|dev| bandwidth(dev, size, iters, skip)))?;
            bws.push_str(&format!("{mbs:>20.2}"));
        }
        println!("{row}{bws}");
        size *= 2;
    }
    Ok(())
}

/// One part of a run started by hand (not under a launcher).
#[derive(Debug)]
enum Step<'r> {
    /// In this process: a thread device, or the thread floors (`None`).
    Here(Option<&'r Entry>),
    /// Under `xdev-run`: a process device, or the process floors (`None`).
    Launch(Option<&'r Entry>),
}

/// What a run started by hand does, in order: the named devices (default:
/// every registered one), or with `--test floor` the floors of both
/// placements.
fn plan<'r>(a: &Args, reg: &'r Registry) -> Result<Vec<Step<'r>>, String> {
    if a.test == "floor" {
        return Ok(vec![Step::Here(None), Step::Launch(None)]);
    }
    let entries: Vec<&Entry> = if a.devices.is_empty() {
        reg.entries().iter().collect()
    } else {
        a.devices
            .iter()
            .map(|d| {
                reg.get(d).ok_or_else(|| {
                    let here: Vec<&str> = reg.entries().iter().map(|e| e.name).collect();
                    format!(
                        "device {d:?} is not available in this build (devices here: {})",
                        here.join(", ")
                    )
                })
            })
            .collect::<Result<_, _>>()?
    };
    entries
        .into_iter()
        .map(|e| match e.placement {
            Placement::Threads if e.name == "thread" => Ok(Step::Here(Some(e))),
            Placement::Threads => Err(format!(
                "device {:?} runs ranks as threads, and xdev-bench has no runner for it",
                e.name
            )),
            Placement::Processes if a.test == "crossover" => Err(format!(
                "--test crossover reopens the device per setting and runs on thread devices only, not {:?}",
                e.name
            )),
            Placement::Processes => Ok(Step::Launch(Some(e))),
        })
        .collect()
}

/// `xdev-run` next to `exe`, or why there is none.
fn find_launcher(exe: &Path) -> Result<PathBuf, String> {
    let dir = exe.parent().ok_or("the executable has no directory")?;
    let launcher = dir.join(LAUNCHER);
    if launcher.is_file() {
        Ok(launcher)
    } else {
        Err(format!(
            "process devices run under {LAUNCHER}, and there is no {} next to this executable: \
             build it into the same target directory with `cargo build --release -p xdev` \
             (without --release for a debug xdev-bench)",
            launcher.display()
        ))
    }
}

/// `launcher -n 2 [--device NAME] -- program args...`.
fn launch_command(
    launcher: &Path,
    device: Option<&str>,
    program: &Path,
    args: &[OsString],
) -> Command {
    let mut c = Command::new(launcher);
    c.args(["-n", "2"]);
    if let Some(d) = device {
        c.args(["--device", d]);
    }
    c.arg("--").arg(program).args(args);
    c
}

/// What ended a step.
#[derive(Debug)]
enum Failure {
    /// Report and exit with this status.
    Exit(String, u8),
    /// The launched job already reported; exit with its status.
    Status(u8),
    /// The device cannot be opened here (its ranks said why).
    Unavailable,
}

fn exit_status(s: std::process::ExitStatus) -> u8 {
    match (s.code(), s.signal()) {
        (Some(c), _) => u8::try_from(c).unwrap_or(1).max(1),
        (None, Some(sig)) => u8::try_from(128 + sig).unwrap_or(1),
        _ => 1,
    }
}

fn launch(device: Option<&str>, raw: &[OsString]) -> Result<(), Failure> {
    let exe = std::env::current_exe()
        .map_err(|e| Failure::Exit(format!("cannot find this executable: {e}"), 1))?;
    let launcher = find_launcher(&exe).map_err(|e| Failure::Exit(e, 1))?;
    let _ = std::io::stdout().flush();
    let status = launch_command(&launcher, device, &exe, raw)
        .status()
        .map_err(|e| Failure::Exit(format!("cannot start {}: {e}", launcher.display()), 1))?;
    outcome(status)
}

/// What the launcher's exit status means for the run.
fn outcome(status: std::process::ExitStatus) -> Result<(), Failure> {
    match status.code() {
        Some(0) => Ok(()),
        Some(c) if c == i32::from(UNAVAILABLE) => Err(Failure::Unavailable),
        _ => Err(Failure::Status(exit_status(status))),
    }
}

/// A run started by hand: every step of the plan, thread devices here,
/// process devices under the launcher.
fn orchestrate(a: &Args, reg: &Registry, raw: &[OsString]) -> ExitCode {
    let steps = match plan(a, reg) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("xdev-bench: {e}");
            return ExitCode::from(2);
        }
    };
    let by_default = a.devices.is_empty() && a.test != "floor";
    for (i, step) in steps.iter().enumerate() {
        if i > 0 && !a.json {
            println!();
        }
        let (name, r) = match step {
            Step::Here(None) => (
                "floors",
                run_floors(a, &ThreadRig { args: a }).map_err(|e| Failure::Exit(e, 1)),
            ),
            Step::Here(Some(e)) => {
                let r = if a.test == "crossover" {
                    run_crossover(a, e.name)
                } else {
                    run_tests(a, e.name, &ThreadRig { args: a })
                };
                (e.name, r.map_err(|e| Failure::Exit(e, 1)))
            }
            Step::Launch(e) => {
                let name = e.map_or("floors", |e| e.name);
                match launch(e.map(|e| e.name), raw) {
                    Err(Failure::Exit(why, _)) if by_default && e.is_some() => {
                        eprintln!("xdev-bench: skipping device {name}: {why}");
                        continue;
                    }
                    r => (name, r),
                }
            }
        };
        match r {
            Ok(()) => {}
            Err(Failure::Unavailable) if by_default => {
                eprintln!("xdev-bench: skipping device {name}: it cannot be opened here");
            }
            Err(Failure::Unavailable) => return ExitCode::from(UNAVAILABLE),
            Err(Failure::Exit(why, code)) => {
                eprintln!("xdev-bench: {name}: {why}");
                return ExitCode::from(code);
            }
            Err(Failure::Status(code)) => return ExitCode::from(code),
        }
    }
    ExitCode::SUCCESS
}

/// The device a rank measures: `XDEV_DEVICE` (set by `xdev-run --device`),
/// else the one `--device`.
fn rank_device(a: &Args, from_env: Option<String>) -> Result<String, String> {
    match (from_env, a.devices.as_slice()) {
        (Some(d), named) if named.is_empty() || named.contains(&d) => Ok(d),
        (Some(d), named) => Err(format!(
            "{} names {d:?} but --device names {}",
            bootstrap::XDEV_DEVICE,
            named.join(", ")
        )),
        (None, [d]) => Ok(d.clone()),
        (None, []) => Err(format!(
            "name the device to measure: --device NAME, or xdev-run --device NAME (sets {})",
            bootstrap::XDEV_DEVICE
        )),
        (None, named) => Err(format!(
            "one rank measures one device, not {} (or set {})",
            named.join(", "),
            bootstrap::XDEV_DEVICE
        )),
    }
}

/// One rank of a launched job (`XDEV_RANK` is set): pins itself to core
/// `rank`, sets the process floor up, opens the device unless measuring the
/// floors alone, and runs the tests; rank 0 prints.
fn rank_main(a: &Args, reg: &Registry) -> Result<(), Failure> {
    let fail = |e: String| Failure::Exit(e, 1);
    let mut config = bootstrap::config_from_env().map_err(|e| fail(e.to_string()))?;
    if config.size < 2 {
        return Err(fail(format!(
            "process mode needs at least 2 ranks, {}={}",
            bootstrap::XDEV_SIZE,
            config.size
        )));
    }
    let rank = config.rank;
    // Best effort, as for the thread ranks: an unpinned rank still measures.
    let _ = shm_ipc::futex::pin_current_thread(rank);
    if a.test == "floor" {
        // No device: the bootstrap connection is this program's to use.
        let boot = Bootstrap::from_env().map_err(|e| fail(e.to_string()))?;
        let floor = ProcessFloor::setup(&boot, &config.job).map_err(|e| fail(e.to_string()))?;
        let rig = ProcessRig {
            rank,
            dev: None,
            floor,
        };
        return run_floors(a, &rig).map_err(fail);
    }
    if a.test == "crossover" {
        return Err(fail("--test crossover runs on thread devices only".into()));
    }
    let name = rank_device(a, bootstrap::device_from_env()).map_err(fail)?;
    match reg.get(&name).map(|e| e.placement) {
        Some(Placement::Processes) => {}
        Some(Placement::Threads) => {
            return Err(fail(format!(
                "device {name:?} runs ranks as threads: run xdev-bench without a launcher to measure it"
            )))
        }
        None => return Err(fail(format!("device {name:?} is not available in this build"))),
    }
    for (k, v) in &a.options {
        config = config.with(k, v);
    }
    // The psm device is opened as itself so that its raw PSM2 peer can be
    // measured on the same endpoint.
    let mut psm = None;
    let opened = if name == "psm" {
        ibvx::PsmDevice::open(&config).map(|d| {
            let d = Arc::new(d);
            psm = Some(d.clone());
            d as Arc<dyn Device>
        })
    } else {
        reg.open(&name, &config)
    };
    let dev = opened.map_err(|e| {
        eprintln!("xdev-bench: rank {rank}: cannot open device {name}: {e}");
        Failure::Unavailable
    })?;
    // The device may hold this rank's bootstrap connection (a rank connects
    // once per job), so the floor is set up through the device itself.
    let floor = ProcessFloor::setup(&DeviceCoordinator(&*dev), &config.job)
        .map_err(|e| fail(e.to_string()))?;
    let rig = ProcessRig {
        rank,
        dev: Some(dev),
        floor,
    };
    run_tests(a, &name, &rig).map_err(fail)?;
    if let Some(psm) = &psm {
        run_psm_peer(a, psm, rank).map_err(fail)?;
    }
    if let Some(dev) = &rig.dev {
        dev.finish().map_err(|e| fail(format!("finish: {e}")))?;
    }
    Ok(())
}

fn main() -> ExitCode {
    let raw: Vec<OsString> = std::env::args_os().skip(1).collect();
    let strings: Result<Vec<String>, _> = raw.iter().map(|s| s.clone().into_string()).collect();
    let reg = registry();
    let parsed = strings
        .map_err(|s| format!("argument {s:?} is not UTF-8"))
        .and_then(parse);
    let a = match parsed {
        Ok(Parsed::Run(a)) => a,
        Ok(Parsed::Help) => {
            println!("{}", help(&reg));
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("xdev-bench: {e}");
            return ExitCode::from(2);
        }
    };
    if std::env::var_os(bootstrap::XDEV_RANK).is_none() {
        return orchestrate(&a, &reg, &raw);
    }
    ExitCode::from(rank_status(rank_main(&a, &reg)))
}

/// A rank's exit status, after saying why it failed.
fn rank_status(r: Result<(), Failure>) -> u8 {
    match r {
        Ok(()) => 0,
        Err(Failure::Unavailable) => UNAVAILABLE,
        Err(Failure::Exit(why, code)) => {
            let rank = std::env::var(bootstrap::XDEV_RANK).unwrap_or_default();
            eprintln!("xdev-bench: rank {rank}: {why}");
            code
        }
        Err(Failure::Status(code)) => code,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::sync::Mutex;
    use std::time::Duration;

    use xdev::{
        Buffer, Config, Context, Envelope, Error, Peeked, Progress, Request, RequestCore,
        RequestKind, Source, Status, Tag, TagSel, Tracker,
    };

    fn args(line: &str) -> Args {
        match parse(line.split_whitespace().map(String::from)).unwrap() {
            Parsed::Run(a) => a,
            Parsed::Help => panic!("help"),
        }
    }

    /// Only for these tests: a device between processes whose messages are
    /// keys of the bootstrap's store (one round trip to the service each).
    /// Slow, but like a real process device it holds its rank's bootstrap
    /// connection, so the benchmark must coordinate through the device.
    struct KvDevice {
        boot: Bootstrap,
        tracker: Tracker,
        sent: Mutex<HashMap<(Rank, Tag, Context), u64>>,
        taken: Mutex<HashMap<(Rank, Tag, Context), u64>>,
    }

    /// Requests of the KV device complete when they start.
    struct Inert;

    impl Progress for Inert {
        fn progress(&self) {}
        fn wait(&self, _: &RequestCore) {}
        fn cancel(&self, _: &Arc<RequestCore>) -> bool {
            false
        }
    }

    fn kv_entry() -> Entry {
        Entry {
            name: "kv",
            description: "test device over the bootstrap key-value store",
            placement: Placement::Processes,
            open: |cfg| Ok(Arc::new(KvDevice::open(cfg)?) as Arc<dyn Device>),
        }
    }

    fn next(counters: &Mutex<HashMap<(Rank, Tag, Context), u64>>, k: (Rank, Tag, Context)) -> u64 {
        let mut m = counters.lock().unwrap();
        let n = m.entry(k).or_insert(0);
        *n += 1;
        *n - 1
    }

    impl KvDevice {
        fn open(cfg: &Config) -> xdev::Result<KvDevice> {
            let boot = Bootstrap::from_env()?;
            assert_eq!((boot.rank(), boot.size()), (cfg.rank, cfg.size));
            Ok(KvDevice {
                boot,
                tracker: Tracker::new(),
                sent: Mutex::default(),
                taken: Mutex::default(),
            })
        }

        fn key(src: Rank, dst: Rank, tag: Tag, ctx: Context, seq: u64) -> String {
            format!("kv/{ctx}/{src}/{dst}/{tag}/{seq}")
        }

        fn exact(source: Source, tag: TagSel) -> xdev::Result<(Rank, Tag)> {
            match (source, tag) {
                (Source::Rank(r), TagSel::Tag(t)) => Ok((r, t)),
                _ => Err(Error::Config("kv test device: no wildcards".into())),
            }
        }

        /// The next message from `src`; consumes it when `take`.
        fn message(&self, src: Rank, tag: Tag, ctx: Context, take: bool) -> xdev::Result<Vec<u8>> {
            let k = (src, tag, ctx);
            let seq = if take {
                next(&self.taken, k)
            } else {
                self.taken.lock().unwrap().get(&k).copied().unwrap_or(0)
            };
            let key = Self::key(src, self.boot.rank(), tag, ctx, seq);
            self.boot.get(&key, Duration::from_secs(30))
        }
    }

    impl Device for KvDevice {
        fn name(&self) -> &'static str {
            "kv"
        }
        fn id(&self) -> Rank {
            self.boot.rank()
        }
        fn size(&self) -> usize {
            self.boot.size()
        }
        fn send(&self, buf: &[u8], dest: Rank, tag: Tag, context: Context) -> xdev::Result<()> {
            xdev::check_send(dest, tag, self.size())?;
            let seq = next(&self.sent, (dest, tag, context));
            self.boot
                .put(&Self::key(self.id(), dest, tag, context, seq), buf)
        }
        fn ssend(&self, buf: &[u8], dest: Rank, tag: Tag, context: Context) -> xdev::Result<()> {
            self.send(buf, dest, tag, context)
        }
        fn recv(
            &self,
            buf: &mut [u8],
            source: Source,
            tag: TagSel,
            context: Context,
        ) -> xdev::Result<Status> {
            let (src, tag) = Self::exact(source, tag)?;
            let m = self.message(src, tag, context, true)?;
            let n = m.len().min(buf.len());
            buf[..n].copy_from_slice(&m[..n]);
            let env = Envelope {
                source: src,
                tag,
                context,
            };
            Status::received(env, m.len(), buf.len()).into_result()
        }
        fn isend(&self, buf: Buffer, dest: Rank, tag: Tag, context: Context) -> Request {
            let env = Envelope {
                source: dest,
                tag,
                context,
            };
            let st = match self.send(&buf, dest, tag, context) {
                Ok(()) => Status::ok(env, buf.len()),
                Err(e) => Status::failed(env, e),
            };
            Request::new(
                self.tracker.rejected(RequestKind::Send, buf, st),
                Arc::new(Inert),
            )
        }
        fn issend(&self, buf: Buffer, dest: Rank, tag: Tag, context: Context) -> Request {
            self.isend(buf, dest, tag, context)
        }
        fn irecv(&self, mut buf: Buffer, source: Source, tag: TagSel, context: Context) -> Request {
            let st = self
                .recv(&mut buf, source, tag, context)
                .unwrap_or_else(|e| {
                    let env = Envelope {
                        source: 0,
                        tag: 0,
                        context,
                    };
                    Status::failed(env, e)
                });
            Request::new(
                self.tracker.rejected(RequestKind::Recv, buf, st),
                Arc::new(Inert),
            )
        }
        fn probe(&self, source: Source, tag: TagSel, context: Context) -> xdev::Result<Status> {
            let (src, tag) = Self::exact(source, tag)?;
            let m = self.message(src, tag, context, false)?;
            let env = Envelope {
                source: src,
                tag,
                context,
            };
            Ok(Status::ok(env, m.len()))
        }
        fn iprobe(&self, _: Source, _: TagSel, _: Context) -> xdev::Result<Option<Status>> {
            Err(Error::Config("kv test device: no iprobe".into()))
        }
        fn peek(&self) -> xdev::Result<Option<Peeked>> {
            Ok(self.tracker.pop_completed())
        }
        fn finish(&self) -> xdev::Result<()> {
            Ok(())
        }
    }

    /// The thread device and the two test devices (not this build's
    /// process devices, so the tests do not depend on what is linked).
    fn test_registry() -> Registry {
        let mut r = Registry::new();
        shm_ipc::thread::register(&mut r);
        r.register(kv_entry());
        r.register(Entry {
            name: "broken",
            description: "a process device that never opens",
            placement: Placement::Processes,
            open: |_| Err(Error::Config("not here".into())),
        });
        r
    }

    /// Environment variable: the arguments of a rank played by this test
    /// binary (see `rank_child`).
    const CHILD_ARGS: &str = "XDEV_BENCH_TEST_ARGS";

    /// Not a test of its own: the body of a rank when this test binary is
    /// started by the launcher with `CHILD_ARGS` set.
    #[test]
    fn rank_child() {
        let Ok(line) = std::env::var(CHILD_ARGS) else {
            return;
        };
        match rank_status(rank_main(&args(&line), &test_registry())) {
            0 => {}
            code => std::process::exit(code.into()),
        }
    }

    /// `xdev-run` for this test binary (in `target/<profile>/deps`): the one
    /// in `target/<profile>`, if built.
    fn launcher_for_tests() -> Option<PathBuf> {
        let exe = std::env::current_exe().unwrap();
        let profile_dir = exe.parent()?.parent()?;
        find_launcher(&profile_dir.join("xdev-bench")).ok()
    }

    /// Runs `line` as the ranks of a process-mode job of test device
    /// `device`, through the same command the binary builds for a re-exec.
    fn run_ranks(device: &str, line: &str) -> Option<(std::process::Output, String)> {
        let Some(launcher) = launcher_for_tests() else {
            println!("skipped: xdev-run is not built next to this target's binaries (cargo build -p xdev)");
            return None;
        };
        let me = std::env::current_exe().unwrap();
        let child: Vec<OsString> = [
            "tests::rank_child",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ]
        .iter()
        .map(OsString::from)
        .collect();
        let out = launch_command(&launcher, Some(device), &me, &child)
            .env(CHILD_ARGS, line)
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        Some((out, stdout))
    }

    /// OSU data rows (size, value, floor, ratio) of `stdout`.
    fn rows(stdout: &str) -> Vec<Vec<f64>> {
        stdout
            .lines()
            .filter(|l| l.starts_with(|c: char| c.is_ascii_digit()))
            .map(|l| l.split_whitespace().map(|v| v.parse().unwrap()).collect())
            .collect()
    }

    #[test]
    fn a_process_device_runs_under_the_launcher() {
        let Some((out, stdout)) = run_ranks("kv", "--quick --max-size 16 --test all") else {
            return;
        };
        assert!(out.status.success(), "{out:?}");
        assert_eq!(
            stdout.matches("# OSU MPI Latency Test").count(),
            1,
            "rank 0 prints, rank 1 does not:\n{stdout}"
        );
        assert!(
            stdout.contains("# Device: kv; cache-line floor"),
            "{stdout}"
        );
        assert!(stdout.contains("(two processes pinned"), "{stdout}");
        assert!(stdout.contains("# OSU MPI Bandwidth Test"), "{stdout}");
        let rows = rows(&stdout);
        // Latency: 0, 1, 2, 4, 8, 16; bandwidth: 1 .. 16.
        assert_eq!(rows.len(), 6 + 5, "{stdout}");
        for r in &rows {
            assert_eq!(r.len(), 4, "{stdout}");
            // The KV device is far slower than a copy: its bandwidth ratios
            // print as 0.00.
            assert!(r[1] > 0.0 && r[2] > 0.0 && r[3] >= 0.0, "{r:?}");
        }
        let json = run_ranks("kv", "--quick --max-size 4 --test latency --json")
            .unwrap()
            .1;
        // (libtest's own "test ... " may precede the first record on its line.)
        assert_eq!(
            json.matches("{\"device\":\"kv\",\"test\":\"latency\"")
                .count(),
            4,
            "{json}"
        );
    }

    #[test]
    fn an_unopenable_device_exits_with_its_own_status() {
        let Some((out, _)) = run_ranks("broken", "--quick --max-size 4") else {
            return;
        };
        assert_eq!(out.status.code(), Some(i32::from(UNAVAILABLE)), "{out:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("cannot open device broken: invalid configuration: not here"),
            "{stderr}"
        );
        assert!(matches!(outcome(out.status), Err(Failure::Unavailable)));
        assert!(outcome(std::process::ExitStatus::from_raw(0)).is_ok());
        assert!(matches!(
            outcome(std::process::ExitStatus::from_raw(9)),
            Err(Failure::Status(137))
        ));
        assert!(matches!(
            outcome(std::process::ExitStatus::from_raw(1 << 8)),
            Err(Failure::Status(1))
        ));
    }

    #[test]
    fn the_plan_measures_every_device_in_its_placement() {
        let reg = test_registry();
        let names = |steps: Vec<Step>| -> Vec<(bool, Option<&str>)> {
            steps
                .into_iter()
                .map(|s| match s {
                    Step::Here(e) => (true, e.map(|e| e.name)),
                    Step::Launch(e) => (false, e.map(|e| e.name)),
                })
                .collect()
        };
        assert_eq!(
            names(plan(&args(""), &reg).unwrap()),
            [
                (true, Some("thread")),
                (false, Some("kv")),
                (false, Some("broken"))
            ]
        );
        assert_eq!(
            names(plan(&args("--device kv --test latency"), &reg).unwrap()),
            [(false, Some("kv"))]
        );
        assert_eq!(
            names(plan(&args("--test floor --device kv"), &reg).unwrap()),
            [(true, None), (false, None)]
        );
        assert!(plan(&args("--device kv --test crossover"), &reg)
            .unwrap_err()
            .contains("thread devices only"));
        assert!(plan(&args("--device nope"), &reg)
            .unwrap_err()
            .contains("devices here: thread, kv, broken"));
        // The default run of this build: every linked device, in its place.
        let linked = registry();
        let every: Vec<(bool, Option<&str>)> = linked
            .entries()
            .iter()
            .map(|e| (e.placement == Placement::Threads, Some(e.name)))
            .collect();
        assert_eq!(names(plan(&args(""), &linked).unwrap()), every);
        assert!(every.contains(&(true, Some("thread"))));
    }

    #[test]
    fn a_rank_measures_the_launchers_device_or_the_one_named() {
        let env = |d: &str| Some(d.to_string());
        assert_eq!(rank_device(&args(""), env("shm")).unwrap(), "shm");
        assert_eq!(
            rank_device(&args("--device thread --device shm"), env("shm")).unwrap(),
            "shm"
        );
        assert!(rank_device(&args("--device verbs"), env("shm")).is_err());
        assert_eq!(rank_device(&args("--device shm"), None).unwrap(), "shm");
        assert!(rank_device(&args(""), None).is_err());
        assert!(rank_device(&args("--device a --device b"), None).is_err());
    }

    #[test]
    fn the_reexec_keeps_the_arguments() {
        let raw: Vec<OsString> = ["--device", "shm", "--quick"]
            .iter()
            .map(OsString::from)
            .collect();
        let c = launch_command(
            Path::new("/t/xdev-run"),
            Some("shm"),
            Path::new("/t/xdev-bench"),
            &raw,
        );
        assert_eq!(c.get_program(), "/t/xdev-run");
        let got: Vec<&std::ffi::OsStr> = c.get_args().collect();
        assert_eq!(
            got,
            [
                "-n",
                "2",
                "--device",
                "shm",
                "--",
                "/t/xdev-bench",
                "--device",
                "shm",
                "--quick"
            ]
        );
        let e = find_launcher(Path::new("/nonexistent/dir/xdev-bench")).unwrap_err();
        assert!(e.contains("cargo build --release -p xdev"), "{e}");
    }

    #[test]
    fn arguments() {
        assert_eq!(parse(["--help".to_string()]).unwrap(), Parsed::Help);
        assert!(parse(["--test".to_string(), "nope".to_string()]).is_err());
        let a = args("--device shm --option a=b --json --max-size 64 --test floor");
        assert_eq!(a.devices, ["shm"]);
        assert_eq!(a.options, [("a".to_string(), "b".to_string())]);
        assert!(a.json && a.max_size == 64 && a.test == "floor");
    }
}
