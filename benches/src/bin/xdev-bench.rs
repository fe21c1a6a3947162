//! `xdev-bench`: OSU-style latency and bandwidth of xdev devices, with the
//! cache-line and memcpy floors measured in the same run.
//!
//! With no arguments it runs latency and bandwidth on every device in this
//! build: thread devices in this process, process devices by re-executing
//! itself as the ranks of a job it serves itself (through
//! [`xdev::launch::run_job`]; no `xdev-run` needed). Started by a launcher
//! (`xdev-run`, `srun`, `mpirun`: see [`xdev::bootstrap::Launcher`]) it is
//! one rank of such a run. See `--help`.

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
    bandwidth, bandwidth_iterations, bibandwidth, cache_line_floor, latency, latency_iterations,
    mbw_pairs, message_rate, multi_bandwidth, osu, parallel_memcpy_floor, rate_floor, sizes,
    WINDOW,
};

const USAGE: &str = "\
xdev-bench: OSU-style benchmarks of xdev devices, with floors from the same run

USAGE: xdev-bench [OPTIONS]
       xdev-bench report [REPORT OPTIONS]   (see xdev-bench report --help)

OPTIONS:
  --device NAME      device to measure (repeatable; default: every device in this build)
  --test TEST        latency | bw | bibw | rate | mbw_mr | all (default: latency and bw) |
                     crossover (eager vs rendezvous by size; thread devices only);
                     repeatable, or a comma-separated list
  -n, --ranks N      ranks of the mbw_mr test (N/2 pairs; default 4); the other
                     tests run on 2 ranks
  --max-size BYTES   largest message (default 4194304)
  --min-size BYTES   smallest message (default 0)
  --iterations N     timed iterations per size instead of OSU's counts (warm-up
                     N/10), e.g. to profile one size for long enough
  --option K=V       device option, e.g. eager_limit=4096 (repeatable)
  --quick            a tenth of OSU's iterations (smoke runs)
  --json             one JSON record per size instead of OSU tables
  -h, --help         this text";

const DETAILS: &str = "\
Thread devices run in this process, rank r a thread pinned to core r. Process
devices run as processes: xdev-bench starts 2 ranks of itself (N for the
mbw_mr test) as one job with its own bootstrap service, as `xdev-run -n 2
--device NAME -- xdev-bench ARGS...` would, and takes their status. Started
by a launcher (xdev-run; srun --mpi=pmix or --mpi=pmi2; mpirun.openmpi;
mpirun.mpich), xdev-bench is one rank: it pins itself to core RANK, opens the
device named by XDEV_DEVICE or --device, and rank 0 prints.

Columns: value, the floor measured in this run, and value/floor. For each size
the floor and the device are measured alternately, three rounds (one with
--quick), and the best of each is shown: OSU's average per round, best round.
Latency floor: one-way hand-off of a cache line between the two ranks' cores,
by the ranks themselves (two pinned threads for a thread device, the two rank
processes through a shared mapping for a process device); lower is better,
ratio >= 1. Message rate (rate: osu_mbw_mr's loop with one pair, a window of
64, messages/s): floor = one message per cache-line hand-off (1 / the
latency floor); higher is better; a stream overlaps hand-offs, so a ratio
above 1 is possible. Bandwidth floor: single-thread memcpy over the same working set,
in one process (ratio <= 1 is the fraction of a copy's speed achieved); for
bibw two such copies at once, for mbw_mr one per pair.

A device that cannot be opened (or launched) here is reported on stdout as
\"# Device: NAME: not measured: REASON\" (with --json, a record
{\"device\":NAME,\"not_measured\":REASON}) and skipped; the run goes on. The
exit status is then 0 for the default run and 3 when the device was named.";

/// Exit status of a rank whose device cannot be opened here (the default
/// run skips such a device instead of failing).
const UNAVAILABLE: u8 = 3;

/// The launcher's file name, looked for next to the test binaries.
#[cfg(test)]
const LAUNCHER: &str = "xdev-run";

/// Environment variable: set to a number of ranks on the xdev-bench that a
/// run started by hand re-executes to start that many ranks of itself.
const LAUNCH_RANKS: &str = "XDEV_BENCH_LAUNCH_RANKS";

#[derive(Clone, Debug, PartialEq)]
struct Args {
    devices: Vec<String>,
    /// The tests, in order, `all` expanded, no repeats.
    tests: Vec<String>,
    /// Ranks of the mbw_mr test.
    ranks: usize,
    /// Smallest message measured (`--min-size`; default 0).
    min_size: usize,
    max_size: usize,
    /// Timed iterations per size instead of OSU's counts (`--iterations`,
    /// for profiling); warm-up a tenth of them.
    iterations: Option<usize>,
    options: Vec<(String, String)>,
    quick: bool,
    json: bool,
}

#[derive(Debug, PartialEq)]
enum Parsed {
    Run(Args),
    Help,
}

/// Tests `--test` takes besides `all`; `floor` (the floors alone) is not
/// advertised. `crossover` and `floor` run alone.
const TESTS: [&str; 7] = [
    "latency",
    "bw",
    "bibw",
    "rate",
    "mbw_mr",
    "crossover",
    "floor",
];

/// What `all` (and no `--test`) means.
const ALL: [&str; 2] = ["latency", "bw"];

/// Default ranks of the mbw_mr test.
const MBW_RANKS: usize = 4;

fn parse(args: impl IntoIterator<Item = String>) -> Result<Parsed, String> {
    let mut a = Args {
        devices: Vec::new(),
        tests: Vec::new(),
        ranks: MBW_RANKS,
        min_size: 0,
        max_size: 4 << 20,
        iterations: None,
        options: Vec::new(),
        quick: false,
        json: false,
    };
    let mut it = args.into_iter();
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        match arg.as_str() {
            "--device" => a.devices.push(value("--device")?),
            "--test" => {
                for t in value("--test")?.split(',') {
                    let expanded: Vec<&str> = if t == "all" { ALL.to_vec() } else { vec![t] };
                    for t in expanded {
                        if !TESTS.contains(&t) {
                            return Err(format!("unknown test {t:?}"));
                        }
                        if !a.tests.iter().any(|x| x == t) {
                            a.tests.push(t.to_string());
                        }
                    }
                }
            }
            "-n" | "--ranks" => {
                a.ranks = value("--ranks")?
                    .parse()
                    .ok()
                    .filter(|&n: &usize| n >= 2 && n % 2 == 0)
                    .ok_or("--ranks takes an even number of ranks, at least 2")?
            }
            "--max-size" => {
                a.max_size = value("--max-size")?
                    .parse()
                    .map_err(|_| "--max-size takes a byte count".to_string())?
            }
            "--min-size" => {
                a.min_size = value("--min-size")?
                    .parse()
                    .map_err(|_| "--min-size takes a byte count".to_string())?
            }
            "--iterations" => {
                a.iterations = Some(
                    value("--iterations")?
                        .parse()
                        .ok()
                        .filter(|&n: &usize| n > 0)
                        .ok_or("--iterations takes a positive count")?,
                )
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
    if a.tests.is_empty() {
        a.tests = ALL.iter().map(|t| t.to_string()).collect();
    }
    for alone in ["crossover", "floor"] {
        if a.tests.iter().any(|t| t == alone) && a.tests.len() > 1 {
            return Err(format!("--test {alone} runs alone"));
        }
    }
    Ok(Parsed::Run(a))
}

/// Every device this binary links.
fn registry() -> Registry {
    ibvx::registry()
}

impl Args {
    /// Whether the run includes test `t`.
    fn has(&self, t: &str) -> bool {
        self.tests.iter().any(|x| x == t)
    }

    /// The message sizes of the run: 0 and powers of two up to
    /// `--max-size`, from `--min-size` on.
    fn sizes(&self) -> Vec<usize> {
        sizes(self.max_size)
            .into_iter()
            .filter(|&s| s >= self.min_size)
            .collect()
    }

    /// (iterations, warm-up) for a test whose OSU counts at this size are
    /// `osu`: `--iterations` if given (warm-up a tenth), else OSU's, scaled
    /// down with `--quick`.
    fn counts(&self, osu: (usize, usize)) -> (usize, usize) {
        match self.iterations {
            Some(n) => (n, (n / 10).max(1)),
            None => scaled(self.quick, osu),
        }
    }

    /// Whether `t` is the one test of the run.
    fn only(&self, t: &str) -> bool {
        self.tests.len() == 1 && self.tests[0] == t
    }

    /// The arguments that make a rank process run `tests` of this run on
    /// `device` (a rank runs one job's tests: see [`jobs`]).
    fn rank_args(&self, device: Option<&str>, tests: &[String]) -> Vec<String> {
        let mut v = Vec::new();
        if let Some(d) = device {
            v.extend(["--device".to_string(), d.to_string()]);
        }
        v.extend(["--test".to_string(), tests.join(",")]);
        v.extend(["--ranks".to_string(), self.ranks.to_string()]);
        v.extend(["--min-size".to_string(), self.min_size.to_string()]);
        v.extend(["--max-size".to_string(), self.max_size.to_string()]);
        if let Some(n) = self.iterations {
            v.extend(["--iterations".to_string(), n.to_string()]);
        }
        for (k, val) in &self.options {
            v.extend(["--option".to_string(), format!("{k}={val}")]);
        }
        if self.quick {
            v.push("--quick".into());
        }
        if self.json {
            v.push("--json".into());
        }
        v
    }
}

/// The jobs of a run on one device, in order, as (ranks, tests): the
/// two-rank tests together, then mbw_mr on its own rank count.
fn jobs(a: &Args) -> Vec<(usize, Vec<String>)> {
    let mut v = Vec::new();
    let pair: Vec<String> = a
        .tests
        .iter()
        .filter(|t| t.as_str() != "mbw_mr")
        .cloned()
        .collect();
    if !pair.is_empty() {
        v.push((2, pair));
    }
    if a.has("mbw_mr") {
        v.push((a.ranks, vec!["mbw_mr".to_string()]));
    }
    v
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
    /// One run of the memcpy floor with `copiers` concurrent copies (in one
    /// process, on the reporting rank).
    fn memcpy_floor(&self, size: usize, copiers: usize) -> Option<f64>;
    /// Runs `bench` on the device.
    fn run(&self, bench: &Bench) -> Result<Option<f64>, String>;
}

/// Ranks as threads of this process: a fresh world of the `thread` device
/// per measurement, rank r pinned to core r (modulo the cores online).
struct ThreadRig<'a> {
    args: &'a Args,
    ranks: usize,
}

fn world(a: &Args, ranks: usize, extra: &[(&str, String)]) -> shm_ipc::ThreadWorld {
    let mut w = shm_ipc::ThreadWorld::new(ranks).pin(true);
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

    fn memcpy_floor(&self, size: usize, copiers: usize) -> Option<f64> {
        Some(parallel_memcpy_floor(size, WINDOW, copiers, 1))
    }

    fn run(&self, bench: &Bench) -> Result<Option<f64>, String> {
        rank0(world(self.args, self.ranks, &[]).run(|dev| bench(dev))).map(Some)
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

    fn memcpy_floor(&self, size: usize, copiers: usize) -> Option<f64> {
        self.reports()
            .then(|| parallel_memcpy_floor(size, WINDOW, copiers, 1))
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
    for size in a.sizes() {
        let (n, skip) = a.counts(latency_iterations(size));
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

/// The message rate test: per size, the rate of [`message_rate`] next to
/// its floor ([`rate_floor`] of the cache-line floor between the rig's
/// ranks), measured alternately, best of the rounds.
fn run_rate(a: &Args, device: &str, rig: &dyn Rig) -> Result<(), String> {
    let iters = floor_iters(a);
    if !a.json {
        let floor = (0..3).fold(None, |f, _| best(f, rig.cache_line_floor(iters), f64::min));
        if rig.reports() {
            let floor = figure(floor)?;
            println!("{}", osu::rate_header(device, rig.placement(), floor));
        }
    }
    for size in a.sizes().into_iter().filter(|&s| s > 0) {
        let (n, skip) = a.counts(bandwidth_iterations(size));
        let (mut rate, mut floor_us) = (None, None);
        for _ in 0..rounds(a) {
            floor_us = best(floor_us, rig.cache_line_floor(iters), f64::min);
            rate = best(
                rate,
                rig.run(&|dev| message_rate(dev, size, n, skip))?,
                f64::max,
            );
        }
        if rig.reports() {
            let (rate, floor) = (figure(rate)?, rate_floor(figure(floor_us)?));
            if a.json {
                println!("{}", osu::json(device, "rate", size, rate, "msg/s", floor));
            } else {
                println!("{}", osu::row(size, rate, floor));
            }
        }
    }
    Ok(())
}

/// The bandwidth-like tests: what each measures and prints.
#[derive(Clone, Copy, Debug, PartialEq)]
enum BwTest {
    /// osu_bw: one direction.
    Uni,
    /// osu_bibw: both directions at once.
    Bi,
    /// osu_mbw_mr: `pairs` pairs at once.
    Multi { pairs: usize },
}

impl BwTest {
    fn name(self) -> &'static str {
        match self {
            BwTest::Uni => "bw",
            BwTest::Bi => "bibw",
            BwTest::Multi { .. } => "mbw_mr",
        }
    }

    /// Concurrent copies of the memcpy floor: one per copy the test makes
    /// at once.
    fn copiers(self) -> usize {
        match self {
            BwTest::Uni => 1,
            BwTest::Bi => 2,
            BwTest::Multi { pairs } => pairs,
        }
    }

    fn header(self, device: &str) -> String {
        match self {
            BwTest::Uni => osu::bandwidth_header(device),
            BwTest::Bi => osu::bibandwidth_header(device),
            BwTest::Multi { pairs } => osu::multi_bandwidth_header(device, pairs),
        }
    }

    fn measure(
        self,
        dev: &dyn Device,
        size: usize,
        n: usize,
        skip: usize,
    ) -> xdev::Result<Option<f64>> {
        match self {
            BwTest::Uni => bandwidth(dev, size, n, skip),
            BwTest::Bi => bibandwidth(dev, size, n, skip),
            BwTest::Multi { .. } => multi_bandwidth(dev, size, n, skip),
        }
    }

    fn line(self, a: &Args, device: &str, size: usize, mbs: f64, floor: f64) -> String {
        match (self, a.json) {
            (BwTest::Multi { pairs }, true) => {
                osu::multi_bandwidth_json(device, size, mbs, floor, pairs)
            }
            (BwTest::Multi { .. }, false) => osu::multi_bandwidth_row(size, mbs, floor),
            (t, true) => osu::json(device, t.name(), size, mbs, "MB/s", floor),
            (_, false) => osu::row(size, mbs, floor),
        }
    }
}

fn run_bandwidth(a: &Args, device: &str, rig: &dyn Rig, test: BwTest) -> Result<(), String> {
    if !a.json && rig.reports() {
        println!("{}", test.header(device));
    }
    for size in a.sizes().into_iter().filter(|&s| s > 0) {
        let (n, skip) = a.counts(bandwidth_iterations(size));
        let (mut mbs, mut floor) = (None, None);
        for _ in 0..rounds(a) {
            floor = best(floor, rig.memcpy_floor(size, test.copiers()), f64::max);
            mbs = best(
                mbs,
                rig.run(&|dev| test.measure(dev, size, n, skip))?,
                f64::max,
            );
        }
        if rig.reports() {
            let (mbs, floor) = (figure(mbs)?, figure(floor)?);
            println!("{}", test.line(a, device, size, mbs, floor));
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
    for size in a.sizes() {
        let (mut us, mut mbs) = (None, None);
        for _ in 0..rounds(a) {
            us = best(us, rig.cache_line_floor(iters), f64::min);
            mbs = best(mbs, rig.memcpy_floor(size, 1), f64::max);
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

/// The tests `a.tests` names, in order, on `device` through `rig` (not
/// crossover; mbw_mr on the rig's ranks, the others on ranks 0 and 1).
fn run_tests(a: &Args, device: &str, rig: &dyn Rig, ranks: usize) -> Result<(), String> {
    for (i, t) in a.tests.iter().enumerate() {
        if i > 0 && !a.json && rig.reports() {
            println!();
        }
        match t.as_str() {
            "latency" => run_latency(a, device, rig)?,
            "bw" => run_bandwidth(a, device, rig, BwTest::Uni)?,
            "bibw" => run_bandwidth(a, device, rig, BwTest::Bi)?,
            "rate" => run_rate(a, device, rig)?,
            "mbw_mr" => run_bandwidth(
                a,
                device,
                rig,
                BwTest::Multi {
                    pairs: mbw_pairs(ranks),
                },
            )?,
            "floor" => run_floors(a, rig)?,
            other => return Err(format!("test {other:?} does not run here")),
        }
    }
    Ok(())
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
    let latency_test = a.has("latency");
    if latency_test {
        if report && !a.json {
            println!(
                "\n# OSU MPI Latency Test (xdev-bench)\n# Device: psm against raw PSM2 MQ calls on the same endpoint (the floor column)\n{:<10}{:>20}{:>20}{:>12}",
                "# Size", "Avg Latency(us)", "Raw PSM2(us)", "Ratio"
            );
        }
        for size in a.sizes() {
            let (n, skip) = a.counts(latency_iterations(size));
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
    for test in [BwTest::Uni, BwTest::Bi] {
        if !a.has(test.name()) {
            continue;
        }
        if report && !a.json {
            let title = match test {
                BwTest::Bi => "Bi-Directional Bandwidth",
                _ => "Bandwidth",
            };
            println!(
                "\n# OSU MPI {title} Test (xdev-bench)\n# Device: psm against raw PSM2 MQ calls on the same endpoint (the floor column)\n{:<10}{:>20}{:>20}{:>12}",
                "# Size", "Bandwidth (MB/s)", "Raw PSM2(MB/s)", "Ratio"
            );
        }
        for size in a.sizes().into_iter().filter(|&s| s > 0) {
            let (n, skip) = a.counts(bandwidth_iterations(size));
            let (mut dev_mbs, mut raw_mbs) = (None, None);
            for _ in 0..rounds(a) {
                let r = match test {
                    BwTest::Bi => psm_raw::bibandwidth(&raw, rank, size, n, skip),
                    _ => psm_raw::bandwidth(&raw, rank, size, n, skip),
                };
                raw_mbs = best(raw_mbs, r.map_err(e)?, f64::max);
                let d = test.measure(psm, size, n, skip).map_err(e)?;
                dev_mbs = best(dev_mbs, d, f64::max);
            }
            if report {
                let (d, r) = (figure(dev_mbs)?, figure(raw_mbs)?);
                if a.json {
                    println!(
                        "{}",
                        osu::json("psm-vs-raw", test.name(), size, d, "MB/s", r)
                    );
                } else {
                    println!("{}", osu::row(size, d, r));
                }
            }
        }
    }
    if a.has("rate") {
        if report && !a.json {
            println!(
                "\n# OSU MPI Message Rate Test (xdev-bench)\n# [ pairs: 1 ] [ window size: {WINDOW} ]\n# Device: psm against raw PSM2 MQ calls on the same endpoint (the floor column)\n{:<10}{:>20}{:>20}{:>12}",
                "# Size", "Messages/s", "Raw PSM2(msg/s)", "Ratio"
            );
        }
        for size in a.sizes().into_iter().filter(|&s| s > 0) {
            let (n, skip) = a.counts(bandwidth_iterations(size));
            let (mut dev_rate, mut raw_rate) = (None, None);
            for _ in 0..rounds(a) {
                let r = psm_raw::rate(&raw, rank, size, n, skip).map_err(e)?;
                raw_rate = best(raw_rate, r, f64::max);
                let d = message_rate(psm, size, n, skip).map_err(e)?;
                dev_rate = best(dev_rate, d, f64::max);
            }
            if report {
                let (d, r) = (figure(dev_rate)?, figure(raw_rate)?);
                if a.json {
                    println!("{}", osu::json("psm-vs-raw", "rate", size, d, "msg/s", r));
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
            let (iters, skip) = a.counts(latency_iterations(size));
            let us = rank0(world(a, 2, &extra).run(|dev| latency(dev, size, iters, skip)))?;
            row.push_str(&format!("{us:>20.2}"));
            let (iters, skip) = a.counts(bandwidth_iterations(size));
            let mbs = rank0(world(a, 2, &extra).run(|dev| bandwidth(dev, size, iters, skip)))?;
            bws.push_str(&format!("{mbs:>20.2}"));
        }
        println!("{row}{bws}");
        size *= 2;
    }
    Ok(())
}

/// One part of a run started by hand.
#[derive(Debug)]
enum Step<'r> {
    /// In this process: a thread device, or the thread floors (`None`).
    Here(Option<&'r Entry>),
    /// As processes this run starts: a process device, or the process floors (`None`).
    Launch(Option<&'r Entry>),
}

/// What a run started by hand does, in order: the named devices (default:
/// every registered one), or with `--test floor` the floors of both
/// placements.
fn plan<'r>(a: &Args, reg: &'r Registry) -> Result<Vec<Step<'r>>, String> {
    if a.only("floor") {
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
            Placement::Processes if a.only("crossover") => Err(format!(
                "--test crossover reopens the device per setting and runs on thread devices only, not {:?}",
                e.name
            )),
            Placement::Processes => Ok(Step::Launch(Some(e))),
        })
        .collect()
}

/// `xdev-run` next to `exe`, or why there is none.
#[cfg(test)]
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

/// `launcher -n RANKS [--device NAME] -- program args...`.
#[cfg(test)]
fn launch_command(
    launcher: &Path,
    ranks: usize,
    device: Option<&str>,
    program: &Path,
    args: &[OsString],
) -> Command {
    let mut c = Command::new(launcher);
    c.args(["-n", &ranks.to_string()]);
    if let Some(d) = device {
        c.args(["--device", d]);
    }
    c.arg("--").arg(program).args(args);
    c
}

/// Environment variable: a file where a rank that cannot open its device
/// appends the reason (one line), for the run that launched it.
const REASON_FILE: &str = "XDEV_BENCH_REASON_FILE";

/// What ended a step.
#[derive(Debug)]
enum Failure {
    /// Report and exit with this status.
    Exit(String, u8),
    /// The launched job already reported; exit with its status.
    Status(u8),
    /// The device cannot be opened here, and why.
    Unavailable(String),
}

fn exit_status(s: std::process::ExitStatus) -> u8 {
    match (s.code(), s.signal()) {
        (Some(c), _) => u8::try_from(c).unwrap_or(1).max(1),
        (None, Some(sig)) => u8::try_from(128 + sig).unwrap_or(1),
        _ => 1,
    }
}

/// How a run started by hand starts the ranks of a process-device job:
/// `(ranks, device, rank arguments)` to the command, or why it cannot.
type Spawner<'a> = dyn Fn(usize, Option<&str>, &[String]) -> Result<Command, String> + 'a;

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
fn self_spawner(ranks: usize, device: Option<&str>, args: &[String]) -> Result<Command, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this executable: {e}"))?;
    let args: Vec<OsString> = args.iter().map(OsString::from).collect();
    Ok(self_launch_command(&exe, ranks, device, &args))
}

/// The re-executed launcher ([`LAUNCH_RANKS`] set to `ranks`): runs that
/// many ranks of this executable with `args` as one job served here, and
/// exits with the first failed rank's status.
fn launcher_main(ranks: &str, args: &[OsString]) -> ExitCode {
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
    match xdev::launch::run_job(ranks, &exe, args, &[]) {
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
fn launch(
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
fn tell_reason(reason: &str) {
    if let Some(path) = std::env::var_os(REASON_FILE) {
        if let Ok(mut f) = std::fs::OpenOptions::new().append(true).open(path) {
            let line = format!("{}\n", reason.replace('\n', " "));
            let _ = f.write_all(line.as_bytes());
        }
    }
}

/// What the launcher's exit status means for the run.
fn outcome(status: std::process::ExitStatus) -> Result<(), Failure> {
    match status.code() {
        Some(0) => Ok(()),
        Some(c) if c == i32::from(UNAVAILABLE) => Err(Failure::Unavailable(String::new())),
        _ => Err(Failure::Status(exit_status(status))),
    }
}

/// How one device (or the floors) of a run started by hand ended.
#[derive(Debug, PartialEq)]
enum Outcome {
    /// Every table printed.
    Measured,
    /// Skipped: the device cannot be opened here, or its ranks cannot be
    /// launched; why.
    NotMeasured(String),
    /// Failed while measuring: why, and the exit status.
    Failed(String, u8),
}

/// A run started by hand: every step of the plan, thread devices here,
/// process devices under the launcher (through `spawn`), each device's jobs
/// in turn. A device that cannot be opened or launched is reported "not
/// measured: why" (on stdout, as a `#` line or a JSON record) and skipped; a
/// device that fails while measuring is reported on stderr, and the run goes
/// on with the next one. Returns each step's name and outcome.
fn orchestrate(
    a: &Args,
    reg: &Registry,
    spawn: &Spawner,
) -> Result<Vec<(String, Outcome)>, String> {
    let steps = plan(a, reg)?;
    let mut outcomes = Vec::new();
    for (i, step) in steps.iter().enumerate() {
        if i > 0 && !a.json {
            println!();
        }
        let (name, r) = match step {
            Step::Here(None) => (
                "floors",
                run_floors(a, &ThreadRig { args: a, ranks: 2 }).map_err(|e| Failure::Exit(e, 1)),
            ),
            Step::Here(Some(e)) => {
                let r = if a.only("crossover") {
                    run_crossover(a, e.name)
                } else {
                    jobs(a).into_iter().try_for_each(|(ranks, tests)| {
                        let job = Args { tests, ..a.clone() };
                        run_tests(&job, e.name, &ThreadRig { args: &job, ranks }, ranks)
                    })
                };
                (e.name, r.map_err(|e| Failure::Exit(e, 1)))
            }
            Step::Launch(e) => {
                let device = e.map(|e| e.name);
                let r = jobs(a).into_iter().try_for_each(|(ranks, tests)| {
                    launch(spawn, ranks, device, &a.rank_args(device, &tests))
                });
                (device.unwrap_or("floors"), r)
            }
        };
        let outcome = match r {
            Ok(()) => Outcome::Measured,
            Err(Failure::Unavailable(why)) => Outcome::NotMeasured(why),
            // No launcher (or no executable): nothing ran.
            Err(Failure::Exit(why, _)) if matches!(step, Step::Launch(_)) => {
                Outcome::NotMeasured(why)
            }
            Err(Failure::Exit(why, code)) => Outcome::Failed(why, code),
            Err(Failure::Status(code)) => {
                Outcome::Failed(format!("its ranks failed with status {code}"), code)
            }
        };
        match &outcome {
            Outcome::Measured => {}
            Outcome::NotMeasured(why) => {
                println!("{}", osu::not_measured(name, why, a.json));
                eprintln!("xdev-bench: {name}: not measured: {why}");
            }
            Outcome::Failed(why, _) => eprintln!("xdev-bench: {name}: {why}"),
        }
        outcomes.push((name.to_string(), outcome));
    }
    Ok(outcomes)
}

/// The exit status of a run started by hand: the first failure's; else,
/// when devices were named, [`UNAVAILABLE`] if one of them was not measured;
/// else success (the default run skips what does not work here).
fn run_status(a: &Args, outcomes: &[(String, Outcome)]) -> u8 {
    if let Some(code) = outcomes.iter().find_map(|(_, o)| match o {
        Outcome::Failed(_, code) => Some(*code),
        _ => None,
    }) {
        return code;
    }
    let named = !a.devices.is_empty() || a.only("floor");
    if named
        && outcomes
            .iter()
            .any(|(_, o)| matches!(o, Outcome::NotMeasured(_)))
    {
        return UNAVAILABLE;
    }
    0
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
    if a.only("floor") {
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
    if a.only("crossover") {
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
        let why = format!("cannot open device {name}: {e}");
        eprintln!("xdev-bench: rank {rank}: {why}");
        tell_reason(&why);
        Failure::Unavailable(why)
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
    run_tests(a, &name, &rig, config.size).map_err(fail)?;
    if let Some(psm) = &psm {
        run_psm_peer(a, psm, rank).map_err(fail)?;
    }
    if let Some(dev) = &rig.dev {
        dev.finish().map_err(|e| fail(format!("finish: {e}")))?;
    }
    Ok(())
}

const REPORT_USAGE: &str = "\
xdev-bench report: run the suite and write a comparison report

USAGE: xdev-bench report [OPTIONS]

Runs latency, bw, bibw and rate on every device that works here (with the
floors, and raw PSM2 on the psm device's endpoint), builds
benches/mpi/osu_peer.c with the mpicc of Open MPI and of MPICH where installed
and runs it on two ranks, and writes DIR/report.md, DIR/latency.svg,
DIR/bw.svg, DIR/bibw.svg, DIR/rate.svg and DIR/results.jsonl (every record). Absent devices and peers are listed as not
measured, with the reason. The MPI peers need Debian's packages:
  apt-get install openmpi-bin libopenmpi-dev mpich libmpich-dev
The ibv device and perftest need an RDMA device: ci/bench-vm.sh measures them
in the soft-RoCE VM and then runs this command with --vm FILE, which adds
their section (DIR/vm-latency.svg, DIR/vm-bw.svg, DIR/vm-results.jsonl).

OPTIONS:
  --out DIR          where to write (default: benches/reports/DATE-HOST)
  --quick            a tenth of OSU's iterations, one round (smoke runs)
  --max-size BYTES   largest message (default 4194304)
  --vm FILE          the soft-RoCE VM's results (ci/bench-vm.sh writes them):
                     ibv and perftest, measured in the guest
  --no-mpi           do not build or run the MPI peers
  -h, --help         this text";

/// Options of `xdev-bench report`.
#[derive(Debug, PartialEq)]
struct ReportArgs {
    out: Option<PathBuf>,
    quick: bool,
    max_size: usize,
    vm: Option<PathBuf>,
    mpi: bool,
}

fn parse_report(args: &[String]) -> Result<Option<ReportArgs>, String> {
    let mut r = ReportArgs {
        out: None,
        quick: false,
        max_size: 4 << 20,
        vm: None,
        mpi: true,
    };
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        match arg.as_str() {
            "--out" => r.out = Some(value("--out")?.into()),
            "--quick" => r.quick = true,
            "--max-size" => {
                r.max_size = value("--max-size")?
                    .parse()
                    .map_err(|_| "--max-size takes a byte count".to_string())?
            }
            "--vm" => r.vm = Some(value("--vm")?.into()),
            "--no-mpi" => r.mpi = false,
            "-h" | "--help" => return Ok(None),
            other => {
                return Err(format!(
                    "report: unknown argument {other:?} (see report --help)"
                ))
            }
        }
    }
    Ok(Some(r))
}

/// `xdev-bench report`: see [`REPORT_USAGE`].
fn report_main(args: &[String], reg: &Registry) -> Result<PathBuf, String> {
    use xdev_bench::report::{
        measure_mpi, parse_results, parse_vm, perftest_status, run_captured, which, LoadSampler,
        Machine, PeerStatus, Report, MPIS, PERFTEST, PERFTEST_ABSENT, RAW_PSM2, TESTS,
    };
    let Some(r) = parse_report(args)? else {
        println!("{REPORT_USAGE}");
        return Err(String::new());
    };
    // Read before the run, so that a wrong path fails at once.
    let vm_text = match &r.vm {
        Some(f) => Some(std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?),
        None => None,
    };
    let machine = Machine::here();
    let start = std::time::Instant::now();
    let sampler = LoadSampler::start();
    let out = r.out.clone().unwrap_or_else(|| {
        let day = machine
            .date
            .split(' ')
            .next()
            .unwrap_or("today")
            .to_string();
        PathBuf::from("benches/reports").join(format!("{day}-{}", machine.host))
    });
    std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this executable: {e}"))?;

    // The suite: this program, every device, JSON records.
    let mut suite = vec![
        "--json".to_string(),
        "--test".to_string(),
        TESTS.join(","),
        "--max-size".to_string(),
        r.max_size.to_string(),
    ];
    if r.quick {
        suite.push("--quick".into());
    }
    eprintln!("report: xdev-bench {}", suite.join(" "));
    let mut last = (String::new(), String::new());
    let (text, status) = run_captured(
        Command::new(&exe).args(&suite),
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
    let mut results = parse_results(&text);

    let mut peers = Vec::new();
    let raw = if results.records.iter().any(|x| x.device == "psm-vs-raw") {
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
    peers.push((RAW_PSM2.to_string(), raw));

    // The peers run after the suite: the floors once more, next to them.
    if r.mpi && MPIS.iter().any(|m| which(m.mpicc).is_some()) {
        let mut floors = vec![
            "--json".to_string(),
            "--test".to_string(),
            "floor".to_string(),
            "--max-size".to_string(),
            r.max_size.to_string(),
        ];
        if r.quick {
            floors.push("--quick".into());
        }
        eprintln!("report: measuring the floors next to the MPI peers");
        let (text, status) = run_captured(
            Command::new(&exe).args(&floors),
            std::time::Duration::from_secs(1800),
            |_| {},
        );
        if let Err(e) = status {
            eprintln!("report: the floors next to the peers: {e}");
        }
        results.records.extend(parse_results(&text).records);
    }

    let build_dir = std::env::temp_dir().join(format!("xdev-bench-report-{}", std::process::id()));
    for mpi in &MPIS {
        let status = if !r.mpi {
            PeerStatus::NotMeasured("skipped (--no-mpi)".into())
        } else {
            eprintln!("report: measuring {} (osu_peer.c)", mpi.name);
            let rounds = if r.quick { 1 } else { 3 };
            match measure_mpi(mpi, &build_dir, r.max_size, rounds, r.quick) {
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

    let vm = vm_text.as_deref().map(parse_vm);
    peers.push((
        PERFTEST.to_string(),
        match (&vm, &r.vm) {
            (Some(vm), Some(f)) => perftest_status(vm, &f.display().to_string()),
            _ => PeerStatus::NotMeasured(PERFTEST_ABSENT.into()),
        },
    ));

    let mut command = String::from("xdev-bench report");
    for a in args {
        command.push(' ');
        command.push_str(a);
    }
    let report = Report {
        machine,
        load_after: Machine::here().load,
        load_range: sampler.finish(),
        command,
        elapsed: start.elapsed(),
        built: reg.entries().iter().map(|e| e.name.to_string()).collect(),
        results,
        peers,
        vm,
        relative: None,
    };
    let write = |name: &str, body: &str| {
        let p = out.join(name);
        std::fs::write(&p, body).map_err(|e| format!("{}: {e}", p.display()))
    };
    write("report.md", &report.markdown())?;
    for test in TESTS {
        write(&format!("{test}.svg"), &report.plot(test).svg())?;
    }
    if let (Some(sub), Some(text)) = (report.vm_report(), &vm_text) {
        for test in ["latency", "bw"] {
            write(&format!("vm-{test}.svg"), &sub.plot(test).svg())?;
        }
        write("vm-results.jsonl", text)?;
    }
    let mut jsonl = String::new();
    for x in &report.results.records {
        jsonl.push_str(&osu::json(
            &x.device, &x.test, x.size, x.value, &x.unit, x.floor,
        ));
        jsonl.push('\n');
    }
    for (d, why) in &report.results.not_measured {
        jsonl.push_str(&osu::not_measured(d, why, true));
        jsonl.push('\n');
    }
    write("results.jsonl", &jsonl)?;
    Ok(out.join("report.md"))
}

fn main() -> ExitCode {
    let raw: Vec<OsString> = std::env::args_os().skip(1).collect();
    if let Ok(ranks) = std::env::var(LAUNCH_RANKS) {
        return launcher_main(&ranks, &raw);
    }
    let strings: Result<Vec<String>, _> = raw.iter().map(|s| s.clone().into_string()).collect();
    let reg = registry();
    if let Ok(s) = &strings {
        if s.first().map(String::as_str) == Some("report") {
            return match report_main(&s[1..], &reg) {
                Ok(path) => {
                    println!("report: wrote {}", path.display());
                    ExitCode::SUCCESS
                }
                Err(e) if e.is_empty() => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("xdev-bench report: {e}");
                    ExitCode::FAILURE
                }
            };
        }
    }
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
    if bootstrap::Launcher::from_env().is_err() {
        return match orchestrate(&a, &reg, &self_spawner) {
            Ok(outcomes) => ExitCode::from(run_status(&a, &outcomes)),
            Err(e) => {
                eprintln!("xdev-bench: {e}");
                ExitCode::from(2)
            }
        };
    }
    ExitCode::from(rank_status(rank_main(&a, &reg)))
}

/// A rank's exit status, after saying why it failed.
fn rank_status(r: Result<(), Failure>) -> u8 {
    match r {
        Ok(()) => 0,
        Err(Failure::Unavailable(_)) => UNAVAILABLE,
        Err(Failure::Exit(why, code)) => {
            // Whichever launcher started this rank names it.
            let rank = [
                bootstrap::XDEV_RANK,
                bootstrap::PMIX_RANK,
                bootstrap::PMI_RANK,
            ]
            .iter()
            .find_map(|v| std::env::var(v).ok())
            .unwrap_or_default();
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
        fn cancel(&self, _: &xdev::CoreRef) -> bool {
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
        // Only rank 0 prints. The other ranks' libtest lines ("ok", "test
        // result: ...") would land amid rank 0's rows on the shared stdout,
        // so they go to /dev/null. (What libtest printed before this body
        // precedes rank 0's first line: rank 0 prints once every rank has
        // opened the device.)
        if std::env::var(bootstrap::XDEV_RANK).is_ok_and(|r| r != "0") {
            use std::os::fd::AsRawFd;
            let null = std::fs::OpenOptions::new()
                .write(true)
                .open("/dev/null")
                .unwrap();
            let _ = std::io::stdout().flush();
            // SAFETY: dup2(2) on two descriptors open in this process: fd 1
            // becomes a copy of /dev/null's; `null` keeps owning its own.
            let r = unsafe { libc::dup2(null.as_raw_fd(), 1) };
            assert_eq!(r, 1, "dup2 onto stdout");
        }
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

    /// The command that starts `ranks` ranks of this test binary playing
    /// `xdev-bench` with arguments `line`, as the binary's re-exec does.
    fn rank_command(ranks: usize, device: Option<&str>, line: &str) -> Option<Command> {
        let launcher = launcher_for_tests()?;
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
        let mut c = launch_command(&launcher, ranks, device, &me, &child);
        c.env(CHILD_ARGS, line).stdin(std::process::Stdio::null());
        Some(c)
    }

    const NO_LAUNCHER: &str =
        "skipped: xdev-run is not built next to this target's binaries (cargo build -p xdev)";

    /// Runs `line` as the ranks of a process-mode job of test device
    /// `device`, through the same command the binary builds for a re-exec.
    fn run_ranks_n(
        ranks: usize,
        device: &str,
        line: &str,
    ) -> Option<(std::process::Output, String)> {
        let Some(mut c) = rank_command(ranks, Some(device), line) else {
            println!("{NO_LAUNCHER}");
            return None;
        };
        let out = c.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        Some((out, stdout))
    }

    fn run_ranks(device: &str, line: &str) -> Option<(std::process::Output, String)> {
        run_ranks_n(2, device, line)
    }

    /// The spawner of the tests: ranks of this test binary, their output
    /// discarded (the outcomes are what the tests check).
    fn test_spawner(
        ranks: usize,
        device: Option<&str>,
        args: &[String],
    ) -> Result<Command, String> {
        let mut c = rank_command(ranks, device, &args.join(" ")).ok_or(NO_LAUNCHER)?;
        c.stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        Ok(c)
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
        assert!(matches!(outcome(out.status), Err(Failure::Unavailable(_))));
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

    /// (bibw is tested on the thread device and, in process mode, on shm:
    /// the KV device's receives block where they are posted, and both
    /// ranks of bibw post receives before sends.)
    #[test]
    fn mbw_mr_under_the_launcher() {
        let Some((out, stdout)) =
            run_ranks_n(4, "kv", "--quick --max-size 2 --test mbw_mr --ranks 4")
        else {
            return;
        };
        assert!(out.status.success(), "{out:?}");
        assert_eq!(
            stdout
                .matches("# OSU MPI Multiple Bandwidth / Message Rate Test")
                .count(),
            1,
            "{stdout}"
        );
        assert!(
            stdout.contains("# [ pairs: 2 ] [ window size: 64 ]"),
            "{stdout}"
        );
        let rows = rows(&stdout);
        assert_eq!(rows.len(), 2, "{stdout}");
        for r in &rows {
            // size, MB/s, messages/s, floor, ratio
            assert_eq!(r.len(), 5, "{r:?}");
            assert!(r[1] > 0.0 && r[3] > 0.0, "{r:?}");
            // Messages/s = MB/s * 10^6 / size, up to the rounding of MB/s
            // to 2 decimals.
            let rate = r[1] * 1e6 / r[0];
            assert!((r[2] - rate).abs() <= 0.005e6 / r[0] + 1.0, "{r:?}");
        }
    }

    #[test]
    fn rate_runs_with_the_two_rank_tests_and_under_the_launcher() {
        assert_eq!(
            jobs(&args("--test rate,mbw_mr,latency")),
            [
                (2, vec!["rate".to_string(), "latency".to_string()]),
                (4, vec!["mbw_mr".to_string()])
            ]
        );
        assert_eq!(args("--test all,rate").tests, ["latency", "bw", "rate"]);
        let Some((out, stdout)) = run_ranks("kv", "--quick --max-size 2 --test rate") else {
            return;
        };
        assert!(out.status.success(), "{out:?}");
        assert_eq!(
            stdout.matches("# OSU MPI Message Rate Test").count(),
            1,
            "{stdout}"
        );
        assert!(
            stdout.contains("# [ pairs: 1 ] [ window size: 64 ]"),
            "{stdout}"
        );
        assert!(stdout.contains("(two processes pinned"), "{stdout}");
        let rows = rows(&stdout);
        assert_eq!(rows.len(), 2, "sizes 1 and 2:\n{stdout}");
        for r in &rows {
            // size, messages/s, floor (1 / cache-line floor), ratio
            assert_eq!(r.len(), 4, "{r:?}");
            assert!(r[1].is_finite() && r[1] > 0.0, "{r:?}");
            assert!(r[2].is_finite() && r[2] > 0.0, "{r:?}");
            assert!((r[3] - r[1] / r[2]).abs() <= 0.01, "{r:?}");
        }
        let json = run_ranks("kv", "--quick --max-size 1 --test rate --json")
            .unwrap()
            .1;
        let recs = xdev_bench::report::parse_results(&json).records;
        assert_eq!(recs.len(), 1, "{json}");
        let r = &recs[0];
        assert_eq!((r.device.as_str(), r.test.as_str()), ("kv", "rate"));
        assert_eq!((r.size, r.unit.as_str()), (1, "msg/s"));
        assert!(r.value > 0.0 && r.floor > 0.0, "{r:?}");
    }

    #[test]
    fn a_device_that_cannot_open_is_not_measured_and_the_run_goes_on() {
        if launcher_for_tests().is_none() {
            println!("{NO_LAUNCHER}");
            return;
        }
        let reg = test_registry();
        let a = args("--quick --max-size 2 --test latency --device broken --device kv");
        let outcomes = orchestrate(&a, &reg, &test_spawner).unwrap();
        assert_eq!(outcomes.len(), 2, "{outcomes:?}");
        assert_eq!(outcomes[0].0, "broken");
        match &outcomes[0].1 {
            Outcome::NotMeasured(why) => assert_eq!(
                why, "cannot open device broken: invalid configuration: not here",
                "the ranks' own reason"
            ),
            o => panic!("{o:?}"),
        }
        assert_eq!(outcomes[1], ("kv".to_string(), Outcome::Measured));
        // Named devices: a device not measured is the run's status.
        assert_eq!(run_status(&a, &outcomes), UNAVAILABLE);
        // The default run skips it.
        assert_eq!(run_status(&args(""), &outcomes), 0);
        let failed = [("kv".to_string(), Outcome::Failed("x".into(), 7))];
        assert_eq!(run_status(&args(""), &failed), 7);
        // No launcher: not measured either, with the spawner's reason.
        let none = |_: usize, _: Option<&str>, _: &[String]| -> Result<Command, String> {
            Err("no launcher here".into())
        };
        let outcomes = orchestrate(&args("--quick --device kv"), &reg, &none).unwrap();
        assert_eq!(
            outcomes,
            [(
                "kv".to_string(),
                Outcome::NotMeasured("no launcher here".into())
            )]
        );
    }

    #[test]
    fn not_measured_lines() {
        assert_eq!(
            osu::not_measured("ibv", "verbs not available: no device", false),
            "# Device: ibv: not measured: verbs not available: no device"
        );
        assert_eq!(
            osu::not_measured("ibv", "say \"no\"\n", true),
            "{\"device\":\"ibv\",\"not_measured\":\"say \\\"no\\\"\\u000a\"}"
        );
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
            2,
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
    fn the_self_launch_keeps_the_arguments_and_names_the_device() {
        let raw: Vec<OsString> = ["--device", "shm", "--quick"]
            .iter()
            .map(OsString::from)
            .collect();
        let c = self_launch_command(Path::new("/t/xdev-bench"), 3, Some("shm"), &raw);
        assert_eq!(c.get_program(), "/t/xdev-bench");
        let got: Vec<&std::ffi::OsStr> = c.get_args().collect();
        assert_eq!(got, ["--device", "shm", "--quick"]);
        let envs: Vec<_> = c.get_envs().collect();
        assert!(envs.contains(&(LAUNCH_RANKS.as_ref(), Some("3".as_ref()))));
        assert!(envs.contains(&(bootstrap::XDEV_DEVICE.as_ref(), Some("shm".as_ref()))));
        let c = self_launch_command(Path::new("/t/xdev-bench"), 2, None, &raw);
        assert!(c
            .get_envs()
            .any(|(k, v)| k == bootstrap::XDEV_DEVICE && v.is_none()));
    }

    #[test]
    fn report_arguments() {
        let v = |l: &str| l.split_whitespace().map(String::from).collect::<Vec<_>>();
        let r = parse_report(&v("--out /tmp/r --quick --max-size 64 --vm f --no-mpi"))
            .unwrap()
            .unwrap();
        assert_eq!(
            r,
            ReportArgs {
                out: Some("/tmp/r".into()),
                quick: true,
                max_size: 64,
                vm: Some("f".into()),
                mpi: false
            }
        );
        let d = parse_report(&[]).unwrap().unwrap();
        assert!(d.mpi && !d.quick && d.out.is_none() && d.max_size == 4 << 20);
        assert_eq!(parse_report(&v("--help")).unwrap(), None);
        assert!(parse_report(&v("--bogus")).is_err());
    }

    #[test]
    fn arguments() {
        assert_eq!(parse(["--help".to_string()]).unwrap(), Parsed::Help);
        assert!(parse(["--test".to_string(), "nope".to_string()]).is_err());
        let a = args("--device shm --option a=b --json --max-size 64 --test floor");
        assert_eq!(a.devices, ["shm"]);
        assert_eq!(a.options, [("a".to_string(), "b".to_string())]);
        assert!(a.json && a.max_size == 64 && a.only("floor"));
        assert_eq!(args("").tests, ["latency", "bw"]);
        assert_eq!(
            args("--test bw,all --test bibw,mbw_mr -n 6").tests,
            ["bw", "latency", "bibw", "mbw_mr"]
        );
        assert_eq!(args("-n 6").ranks, 6);
        assert_eq!(args("").ranks, MBW_RANKS);
        assert!(parse(["-n".to_string(), "3".to_string()]).is_err());
        assert!(parse(["--test".to_string(), "floor,bw".to_string()]).is_err());
        assert!(parse(["--test".to_string(), "bw,nope".to_string()]).is_err());
        // One size for long: what a profile needs.
        let one = args("--min-size 8 --max-size 8 --iterations 50 --test rate");
        assert_eq!(one.sizes(), [8]);
        assert_eq!(one.counts((100, 10)), (50, 5));
        assert_eq!(args("--quick").counts((100, 10)), (10, 1));
        assert_eq!(args("").counts((100, 10)), (100, 10));
        assert_eq!(args("--max-size 4").sizes(), [0, 1, 2, 4]);
        let again = args(&one.rank_args(Some("shm"), &one.tests).join(" "));
        assert_eq!(
            (again.min_size, again.max_size, again.iterations),
            (8, 8, Some(50))
        );
        assert!(parse(["--iterations".to_string(), "0".to_string()]).is_err());
        assert!(parse(["--min-size".to_string(), "x".to_string()]).is_err());
    }

    #[test]
    fn mbw_mr_runs_as_a_job_of_its_own() {
        let a = args("--test latency,mbw_mr,bibw --ranks 6 --quick --option k=v");
        let j = jobs(&a);
        assert_eq!(
            j,
            [
                (2, vec!["latency".to_string(), "bibw".to_string()]),
                (6, vec!["mbw_mr".to_string()])
            ]
        );
        // The rank arguments say the same run again, for one job.
        let again = args(&a.rank_args(Some("shm"), &j[1].1).join(" "));
        assert_eq!(again.devices, ["shm"]);
        assert_eq!(again.tests, ["mbw_mr"]);
        assert_eq!((again.ranks, again.quick, again.json), (6, true, false));
        assert_eq!(again.options, a.options);
        assert_eq!(
            jobs(&args("--test mbw_mr")),
            [(4, vec!["mbw_mr".to_string()])]
        );
    }
}
