//! The command line of a measuring run: its options ([`Args`], [`parse`]),
//! the help text, and what follows from the options (the message sizes,
//! iteration counts, rounds, and the jobs of a run on one device).

use xdev::registry::{Placement, Registry};

use crate::sizes;

const USAGE: &str = "\
xdev-bench: OSU-style benchmarks of xdev devices, with floors from the same run

USAGE: xdev-bench [OPTIONS]
       xdev-bench report [REPORT OPTIONS]   (see xdev-bench report --help)

OPTIONS:
  --device NAME      device to measure (repeatable; default: every device in this build)
  --test TEST        latency | bw | bibw | bibw_window | rate | mbw_mr | all (default: latency and bw) |
                     crossover (eager vs rendezvous by size; thread devices only);
                     rate_split (psm only: its rate with one side raw PSM2);
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

/// The parsed command line of a measuring run (not `report`).
#[derive(Clone, Debug, PartialEq)]
pub struct Args {
    /// The devices named with `--device`, in order (none: every device).
    pub devices: Vec<String>,
    /// The tests, in order, `all` expanded, no repeats.
    pub tests: Vec<String>,
    /// Ranks of the mbw_mr test.
    pub ranks: usize,
    /// Smallest message measured (`--min-size`; default 0).
    pub min_size: usize,
    /// Largest message measured (`--max-size`).
    pub max_size: usize,
    /// Timed iterations per size instead of OSU's counts (`--iterations`,
    /// for profiling); warm-up a tenth of them.
    pub iterations: Option<usize>,
    /// Device options (`--option K=V`), in order.
    pub options: Vec<(String, String)>,
    /// A tenth of OSU's iterations and one round (`--quick`).
    pub quick: bool,
    /// JSON records instead of OSU tables (`--json`).
    pub json: bool,
}

/// What the command line asks for.
#[derive(Debug, PartialEq)]
pub enum Parsed {
    /// A measuring run.
    Run(Args),
    /// `--help`.
    Help,
}

/// Tests `--test` takes besides `all`; `floor` (the floors alone) is not
/// advertised. `crossover` and `floor` run alone.
const TESTS: [&str; 9] = [
    "latency",
    "bw",
    "bibw",
    "bibw_window",
    "rate",
    "rate_split",
    "mbw_mr",
    "crossover",
    "floor",
];

/// What `all` (and no `--test`) means.
const ALL: [&str; 2] = ["latency", "bw"];

/// Default ranks of the mbw_mr test.
const MBW_RANKS: usize = 4;
/// Parses the arguments after the program name.
pub fn parse(args: impl IntoIterator<Item = String>) -> Result<Parsed, String> {
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
pub fn registry() -> Registry {
    ibvx::registry()
}

/// The `--option`s a device with options `known` takes: each device of a
/// run gets the keys it declares (so `--option cma=off` reaches shm and not
/// thread).
pub fn options_for(
    known: &[xdev::devkit::OptionSpec],
    options: &[(String, String)],
) -> Vec<(String, String)> {
    options
        .iter()
        .filter(|(k, _)| known.iter().any(|s| s.accepts(k)))
        .cloned()
        .collect()
}

/// Checks that every `--option` key is known to some device of the run (all
/// the registered ones when `--device` was not given), so a misspelled key is
/// refused rather than given to nobody.
pub fn check_options(a: &Args, reg: &Registry) -> Result<(), String> {
    let devices: Vec<_> = reg
        .entries()
        .iter()
        .filter(|e| a.devices.is_empty() || a.devices.iter().any(|d| d == e.name))
        .collect();
    for (k, _) in &a.options {
        if !devices
            .iter()
            .any(|e| e.options.iter().any(|s| s.accepts(k)))
        {
            let known: Vec<String> = devices
                .iter()
                .map(|e| {
                    let keys: Vec<&str> = e.options.iter().map(|s| s.key).collect();
                    format!("{}: {}", e.name, keys.join(", "))
                })
                .collect();
            return Err(format!(
                "no device of the run has option {k:?}; their options are {}",
                known.join("; ")
            ));
        }
    }
    Ok(())
}

impl Args {
    /// Whether the run includes test `t`.
    pub fn has(&self, t: &str) -> bool {
        self.tests.iter().any(|x| x == t)
    }

    /// The message sizes of the run: 0 and powers of two up to
    /// `--max-size`, from `--min-size` on.
    pub fn sizes(&self) -> Vec<usize> {
        sizes(self.max_size)
            .into_iter()
            .filter(|&s| s >= self.min_size)
            .collect()
    }

    /// (iterations, warm-up) for a test whose OSU counts at this size are
    /// `osu`: `--iterations` if given (warm-up a tenth), else OSU's, scaled
    /// down with `--quick`.
    pub fn counts(&self, osu: (usize, usize)) -> (usize, usize) {
        match self.iterations {
            Some(n) => (n, (n / 10).max(1)),
            None => scaled(self.quick, osu),
        }
    }

    /// Whether `t` is the one test of the run.
    pub fn only(&self, t: &str) -> bool {
        self.tests.len() == 1 && self.tests[0] == t
    }

    /// The arguments that make a rank process run `tests` of this run on
    /// `device` (a rank runs one job's tests: see [`jobs`]).
    pub fn rank_args(&self, device: Option<&str>, tests: &[String]) -> Vec<String> {
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
pub fn jobs(a: &Args) -> Vec<(usize, Vec<String>)> {
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

/// The `--help` text, with the devices of `reg`.
pub fn help(reg: &Registry) -> String {
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

/// (iterations, warm-up) scaled down to a tenth with `--quick`.
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
pub(crate) fn rounds(a: &Args) -> usize {
    rounds_for(a.quick)
}

/// [`rounds`] of a run with or without `--quick` (also an MPI peer's
/// rounds per size in a report, so that both sides of a ratio get as many).
pub(crate) fn rounds_for(quick: bool) -> usize {
    if quick {
        1
    } else {
        3
    }
}

/// Round trips per cache-line floor run.
pub(crate) fn floor_iters(a: &Args) -> u64 {
    if a.quick {
        20_000
    } else {
        200_000
    }
}

#[cfg(test)]
mod tests;
