//! The comparison report (`xdev-bench report`): runs the suite (latency, bw,
//! bibw and message rate of every device that works here, with the floors),
//! measures the installed peers in the same run (raw PSM2 on the psm
//! device's endpoint, Open MPI and MPICH through `benches/mpi/osu_peer.c`
//! built with their `mpicc`), takes the `ibv` device and perftest from a
//! soft-RoCE VM results file when one is given (`ci/bench-vm.sh` writes it:
//! [`parse_vm`]), and writes a self-contained markdown report with SVG plots
//! ([`crate::plot`]).
//!
//! Nothing is invented: a device or peer that could not be measured is listed
//! as "not measured" with the reason.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::plot::{size_label, Plot, Series};

/// The C source of the MPI peer, built at report time with each MPI's `mpicc`.
pub const MPI_PEER_SOURCE: &str = include_str!("../mpi/osu_peer.c");

/// The devices the project names (issue 7), measured when in the build.
pub const KNOWN_DEVICES: [&str; 5] = ["thread", "shm", "ibv", "psm", "hybrid"];

/// The tests of the report, in order.
pub const TESTS: [&str; 4] = ["latency", "bw", "bibw", "rate"];

/// Series name of the raw PSM2 peer.
pub const RAW_PSM2: &str = "raw PSM2";

/// The name `xdev-bench` gives the psm device's comparison with raw PSM2.
const PSM_VS_RAW: &str = "psm-vs-raw";

/// How the pseudo-devices of floors measured alone begin (`floor (threads)`,
/// `floor (processes)`).
pub const FLOOR_PREFIX: &str = "floor (";

/// How to install the MPI peers on Debian.
pub const MPI_INSTALL: &str = "apt-get install openmpi-bin libopenmpi-dev mpich libmpich-dev";

/// The reason perftest is absent without a VM results file.
pub const PERFTEST_ABSENT: &str =
    "needs the soft-RoCE VM: run ci/bench-vm.sh, or pass its results file with --vm FILE";

/// Series name of the perftest peer in a VM results file.
pub const PERFTEST: &str = "perftest";

/// The host name the VM section's plots and tables carry.
pub const VM_HOST: &str = "soft-RoCE VM";

/// One measurement: a JSON record of `xdev-bench --json` or of the MPI peer.
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    /// Device or peer name.
    pub device: String,
    /// `latency`, `bw`, `bibw`, ...
    pub test: String,
    /// Message size in bytes.
    pub size: usize,
    /// The figure (`unit`).
    pub value: f64,
    /// `us` (latency), `MB/s` (bandwidths) or `msg/s` (rate).
    pub unit: String,
    /// The floor measured alongside (0 when none was).
    pub floor: f64,
}

/// What a run printed: measurements, and devices not measured with why.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Results {
    /// Every measurement record.
    pub records: Vec<Record>,
    /// (device, reason) of every `not_measured` record.
    pub not_measured: Vec<(String, String)>,
}

/// A scalar of a flat JSON object.
#[derive(Clone, Debug, PartialEq)]
enum Scalar {
    Str(String),
    Num(f64),
}

/// Parses one flat JSON object of strings and numbers (what `xdev-bench
/// --json` and the MPI peer print); `None` for anything else.
fn flat_object(line: &str) -> Option<BTreeMap<String, Scalar>> {
    let mut chars = line.trim().chars().peekable();
    let mut out = BTreeMap::new();
    let skip_ws = |c: &mut std::iter::Peekable<std::str::Chars>| {
        while c.peek().is_some_and(|c| c.is_whitespace()) {
            c.next();
        }
    };
    let string = |c: &mut std::iter::Peekable<std::str::Chars>| -> Option<String> {
        if c.next()? != '"' {
            return None;
        }
        let mut s = String::new();
        loop {
            match c.next()? {
                '"' => return Some(s),
                '\\' => match c.next()? {
                    'n' => s.push('\n'),
                    't' => s.push('\t'),
                    'u' => {
                        let hex: String = (0..4).filter_map(|_| c.next()).collect();
                        s.push(char::from_u32(u32::from_str_radix(&hex, 16).ok()?)?);
                    }
                    other => s.push(other),
                },
                ch => s.push(ch),
            }
        }
    };
    if chars.next()? != '{' {
        return None;
    }
    loop {
        skip_ws(&mut chars);
        if chars.peek() == Some(&'}') {
            chars.next();
            break;
        }
        let key = string(&mut chars)?;
        skip_ws(&mut chars);
        if chars.next()? != ':' {
            return None;
        }
        skip_ws(&mut chars);
        let value = if chars.peek() == Some(&'"') {
            Scalar::Str(string(&mut chars)?)
        } else {
            let mut n = String::new();
            while chars
                .peek()
                .is_some_and(|c| !matches!(c, ',' | '}') && !c.is_whitespace())
            {
                n.push(chars.next()?);
            }
            Scalar::Num(n.parse().ok()?)
        };
        out.insert(key, value);
        skip_ws(&mut chars);
        match chars.next()? {
            ',' => continue,
            '}' => break,
            _ => return None,
        }
    }
    Some(out)
}

/// The records and not-measured notices in `text` (one JSON object per
/// line; other lines, and records of other shapes, are ignored).
pub fn parse_results(text: &str) -> Results {
    let mut r = Results::default();
    for line in text.lines() {
        // libtest or a launcher label may precede a record on its line.
        let Some(start) = line.find('{') else {
            continue;
        };
        let Some(obj) = flat_object(&line[start..]) else {
            continue;
        };
        let s = |k: &str| match obj.get(k) {
            Some(Scalar::Str(s)) => Some(s.clone()),
            _ => None,
        };
        let n = |k: &str| match obj.get(k) {
            Some(Scalar::Num(n)) => Some(*n),
            _ => None,
        };
        if let (Some(device), Some(why)) = (s("device"), s("not_measured")) {
            r.not_measured.push((device, why));
            continue;
        }
        // A floor measured alone (`--test floor`): a record of the
        // pseudo-device `floor (PLACEMENT)` whose floor is its value.
        if let (Some(place), Some(test), Some(size), Some(value), Some(unit)) =
            (s("floor"), s("test"), n("size"), n("value"), s("unit"))
        {
            let test = match test.as_str() {
                "cache_line" => "latency",
                "memcpy" => "bw",
                _ => continue,
            };
            r.records.push(Record {
                device: format!("{FLOOR_PREFIX}{place})"),
                test: test.into(),
                size: size as usize,
                value,
                unit,
                floor: value,
            });
            continue;
        }
        if let (Some(device), Some(test), Some(size), Some(value), Some(unit)) =
            (s("device"), s("test"), n("size"), n("value"), s("unit"))
        {
            r.records.push(Record {
                device,
                test,
                size: size as usize,
                value,
                unit,
                floor: n("floor").unwrap_or(0.0),
            });
        }
    }
    r
}

/// What a soft-RoCE VM results file holds (`ci/bench-vm.sh`): measurements
/// taken in the guest, and notes on the guest and the run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct VmRun {
    /// (key, value) of every `{"vm_info":KEY,"value":VALUE}` line, in order.
    pub info: Vec<(String, String)>,
    /// The records (`ibv` with the guest's floors, `perftest`) and
    /// not-measured notices.
    pub results: Results,
}

/// Parses a VM results file: the records and notices of [`parse_results`],
/// and the `vm_info` lines.
pub fn parse_vm(text: &str) -> VmRun {
    let info = text
        .lines()
        .filter_map(|l| flat_object(&l[l.find('{')?..]))
        .filter_map(|o| match (o.get("vm_info"), o.get("value")) {
            (Some(Scalar::Str(k)), Some(Scalar::Str(v))) => Some((k.clone(), v.clone())),
            _ => None,
        })
        .collect();
    VmRun {
        info,
        results: parse_results(text),
    }
}

/// The `vm_info` key of a perftest run that gave no figure.
pub const PERFTEST_FAILED: &str = "perftest failed";

/// perftest's status in a report given the VM results file `file`: measured
/// (with the version the file gives) when it holds perftest's figures, else
/// why not (with the runs that failed).
pub fn perftest_status(vm: &VmRun, file: &str) -> PeerStatus {
    let info = |key: &str| {
        vm.info
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
            .collect::<Vec<_>>()
    };
    if vm.results.records.iter().any(|r| r.device == PERFTEST) {
        let version = info(PERFTEST).first().copied().unwrap_or("version unknown");
        PeerStatus::Measured(format!("in the soft-RoCE VM: perftest {version}"))
    } else {
        let failed = info(PERFTEST_FAILED);
        let failed = if failed.is_empty() {
            String::new()
        } else {
            format!(" ({})", failed.join("; "))
        };
        PeerStatus::NotMeasured(format!("no perftest figures in {file}{failed}"))
    }
}

/// The machine a report was measured on.
#[derive(Clone, Debug, PartialEq)]
pub struct Machine {
    /// Host name.
    pub host: String,
    /// CPU model (`/proc/cpuinfo`).
    pub cpu: String,
    /// Cores online.
    pub cores: usize,
    /// Kernel release.
    pub kernel: String,
    /// UTC date and time, `YYYY-MM-DD HH:MM UTC`.
    pub date: String,
    /// Load averages when the run started (`/proc/loadavg`, first three).
    pub load: String,
}

fn read_trimmed(path: &str) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
}

/// (year, month, day) of the day `days` after 1970-01-01 (proleptic
/// Gregorian; Howard Hinnant's `civil_from_days`).
pub fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// Now, as `(YYYY-MM-DD, HH:MM)` in UTC.
pub fn utc_now() -> (String, String) {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    let (y, m, d) = civil_from_days(secs.div_euclid(86_400));
    let t = secs.rem_euclid(86_400);
    (
        format!("{y:04}-{m:02}-{d:02}"),
        format!("{:02}:{:02}", t / 3600, t % 3600 / 60),
    )
}

impl Machine {
    /// This machine, now.
    pub fn here() -> Machine {
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split_once(':'))
                    .map(|(_, v)| v.trim().to_string())
            })
            .unwrap_or_else(|| "unknown".into());
        let (day, time) = utc_now();
        Machine {
            host: read_trimmed("/proc/sys/kernel/hostname").unwrap_or_else(|| "unknown".into()),
            cpu,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            kernel: read_trimmed("/proc/sys/kernel/osrelease").unwrap_or_else(|| "unknown".into()),
            date: format!("{day} {time} UTC"),
            load: read_trimmed("/proc/loadavg")
                .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
                .unwrap_or_else(|| "unknown".into()),
        }
    }
}

/// How often [`LoadSampler`] reads the load average.
pub const LOAD_SAMPLE_EVERY: Duration = Duration::from_secs(10);

/// Samples the 1-minute load average (`/proc/loadavg`) in a thread, every
/// [`LOAD_SAMPLE_EVERY`], until [`LoadSampler::finish`]: how busy the machine
/// was while a run measured.
pub struct LoadSampler {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Vec<f64>>,
}

impl LoadSampler {
    /// Starts sampling (the first sample at once).
    pub fn start() -> LoadSampler {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let stopped = || flag.load(std::sync::atomic::Ordering::Acquire);
            let mut samples = Vec::new();
            while !stopped() {
                if let Some(l) = read_trimmed("/proc/loadavg")
                    .and_then(|l| l.split_whitespace().next()?.parse().ok())
                {
                    samples.push(l);
                }
                let t = Instant::now();
                while t.elapsed() < LOAD_SAMPLE_EVERY && !stopped() {
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
            samples
        });
        LoadSampler { stop, thread }
    }

    /// Stops; the least and the most sampled, if any sample was taken.
    pub fn finish(self) -> Option<(f64, f64)> {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        let samples = self.thread.join().ok()?;
        let lo = samples.iter().copied().reduce(f64::min)?;
        let hi = samples.iter().copied().reduce(f64::max)?;
        Some((lo, hi))
    }
}

/// A peer of the report and how it went.
#[derive(Clone, Debug, PartialEq)]
pub enum PeerStatus {
    /// Measured; a note on how (version, command).
    Measured(String),
    /// Not measured, and why.
    NotMeasured(String),
}

/// What the report shows: the run's results and every peer's status.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    /// Where and when.
    pub machine: Machine,
    /// Load averages when the run ended.
    pub load_after: String,
    /// The least and the most 1-minute load average sampled during the run
    /// ([`LoadSampler`]), if sampled.
    pub load_range: Option<(f64, f64)>,
    /// How the suite was run (the command line, for the reader).
    pub command: String,
    /// Wall-clock time of the whole run.
    pub elapsed: Duration,
    /// Devices in this build (registry order).
    pub built: Vec<String>,
    /// Every measurement: the devices', and the MPI peers'.
    pub results: Results,
    /// (peer, status): raw PSM2, Open MPI, MPICH, perftest.
    pub peers: Vec<(String, PeerStatus)>,
    /// What was measured in the soft-RoCE VM, if a results file was given.
    pub vm: Option<VmRun>,
    /// (a, b): the tables end with a column `a / b`, the two lines' values
    /// divided (the VM section: `ibv / perftest`).
    pub relative: Option<(String, String)>,
}

/// The placement of a device's ranks, for its cache-line floor.
fn placement(device: &str) -> &'static str {
    if device == "thread" || device == "floor (threads)" {
        "threads"
    } else {
        "processes"
    }
}

/// A series of the report: a device or a peer, with per-size values and
/// the floors measured alongside.
#[derive(Clone, Debug, PartialEq)]
struct Line {
    name: String,
    /// size -> value.
    points: BTreeMap<usize, f64>,
    /// size -> the floor measured alongside that value (devices only).
    alongside: BTreeMap<usize, f64>,
}

/// A latency figure whose cache-line floor, measured alongside it, was more
/// than this many times the row's floor was measured on disturbed cores.
pub const DISTURBED: f64 = 2.0;

/// The mark of such a figure in the tables.
pub const DISTURBED_MARK: &str = "†";

impl Report {
    /// The device and peer lines of `test`, in report order: the devices as
    /// built, raw PSM2, then the other peers as their records come. Of
    /// several records of one size (rounds), the best value.
    fn lines(&self, test: &str) -> Vec<Line> {
        let mut order: Vec<String> = self.built.clone();
        order.push(RAW_PSM2.into());
        for r in &self.results.records {
            if r.device != PSM_VS_RAW
                && !r.device.starts_with(FLOOR_PREFIX)
                && !order.contains(&r.device)
            {
                order.push(r.device.clone());
            }
        }
        let mut lines: Vec<Line> = order
            .iter()
            .map(|name| Line {
                name: name.clone(),
                points: BTreeMap::new(),
                alongside: BTreeMap::new(),
            })
            .collect();
        for r in self.results.records.iter().filter(|r| r.test == test) {
            // psm-vs-raw records: value = psm device, floor = raw PSM2.
            let (name, value) = if r.device == PSM_VS_RAW {
                (RAW_PSM2, r.floor)
            } else {
                (r.device.as_str(), r.value)
            };
            if let Some(l) = lines.iter_mut().find(|l| l.name == name) {
                // Several rounds of one size (a VM results file): the best,
                // with the floor measured alongside it.
                let better = match l.points.get(&r.size) {
                    None => true,
                    Some(&v) if test == "latency" => value < v,
                    Some(&v) => value > v,
                };
                if better {
                    l.points.insert(r.size, value);
                    if r.device != PSM_VS_RAW && r.floor > 0.0 {
                        l.alongside.insert(r.size, r.floor);
                    } else {
                        l.alongside.remove(&r.size);
                    }
                }
            }
        }
        lines.retain(|l| !l.points.is_empty());
        lines
    }

    /// The best floor of `test` at each size among the devices of
    /// `placement` (`None`: all devices): the most memcpy bandwidth at that
    /// size; for latency the least cache-line hand-off of the whole run,
    /// the same at every size (the hand-off of one line does not depend on
    /// the message size, and the least one measured is the least disturbed
    /// by the neighbours' load).
    fn best_floor(&self, test: &str, place: Option<&str>) -> BTreeMap<usize, f64> {
        if test == "rate" {
            return self.rate_floor(place);
        }
        let latency = test == "latency";
        let mut m: BTreeMap<usize, f64> = BTreeMap::new();
        for r in &self.results.records {
            if r.test != test || r.device == PSM_VS_RAW || r.floor <= 0.0 {
                continue;
            }
            if place.is_some_and(|p| placement(&r.device) != p) {
                continue;
            }
            let e = m.entry(r.size).or_insert(r.floor);
            *e = if latency {
                e.min(r.floor)
            } else {
                e.max(r.floor)
            };
        }
        if latency {
            if let Some(least) = m.values().copied().reduce(f64::min) {
                let sizes: Vec<usize> = self
                    .results
                    .records
                    .iter()
                    .filter(|r| r.test == test)
                    .map(|r| r.size)
                    .collect();
                for size in sizes {
                    m.insert(size, least);
                }
            }
        }
        m
    }

    /// The floor of the message rate test at each size of its records, for
    /// the devices of `placement` (`None`: all): one message per cache-line
    /// hand-off ([`crate::rate_floor`]) of the least hand-off measured
    /// anywhere in the run, as [`Self::best_floor`] takes for latency (the
    /// floors of the latency and rate records, and the floors measured
    /// alone), so a rate ratio and a latency ratio of one placement divide
    /// by the same hand-off.
    fn rate_floor(&self, place: Option<&str>) -> BTreeMap<usize, f64> {
        let least_us = self
            .results
            .records
            .iter()
            .filter(|r| r.device != PSM_VS_RAW && r.floor > 0.0)
            .filter(|r| !place.is_some_and(|p| placement(&r.device) != p))
            .filter_map(|r| match r.test.as_str() {
                "latency" => Some(r.floor),
                "rate" => Some(1e6 / r.floor),
                _ => None,
            })
            .reduce(f64::min);
        let Some(us) = least_us else {
            return BTreeMap::new();
        };
        self.results
            .records
            .iter()
            .filter(|r| r.test == "rate")
            .map(|r| (r.size, crate::rate_floor(us)))
            .collect()
    }

    /// A line's floor at `size`: [`Self::best_floor`] (for latency and
    /// rate, of the line's placement: threads for `thread`, processes for
    /// the process devices and every peer), so every ratio of a table row
    /// divides by the floor shown in that row.
    fn floor_of(&self, test: &str, line: &Line, size: usize) -> Option<f64> {
        let place = matches!(test, "latency" | "rate").then(|| placement(&line.name));
        self.best_floor(test, place).get(&size).copied()
    }

    /// The floor lines of `test`'s plot and table: the cache-line floor per
    /// placement for latency (for the message rate, one message per
    /// hand-off), the memcpy floor for the bandwidths.
    fn floors(&self, test: &str) -> Vec<(String, BTreeMap<usize, f64>)> {
        if matches!(test, "latency" | "rate") {
            let name = if test == "rate" {
                "1 / cache-line floor"
            } else {
                "cache-line floor"
            };
            ["threads", "processes"]
                .iter()
                .map(|p| (format!("{name} ({p})"), self.best_floor(test, Some(p))))
                .filter(|(_, m)| !m.is_empty())
                .collect()
        } else {
            let name = if test == "bibw" {
                "memcpy floor (2 concurrent)"
            } else {
                "memcpy floor"
            };
            let m = self.best_floor(test, None);
            if m.is_empty() {
                vec![]
            } else {
                vec![(name.to_string(), m)]
            }
        }
    }

    /// The plot of `test`.
    pub fn plot(&self, test: &str) -> Plot {
        let (title, y_label) = match test {
            "latency" => ("Latency (half round trip), lower is better", "latency (us)"),
            "bw" => (
                "Bandwidth (window of 64), higher is better",
                "bandwidth (MB/s)",
            ),
            "rate" => (
                "Message rate (one pair, window of 64), higher is better",
                "messages/s",
            ),
            _ => (
                "Bi-directional bandwidth (window of 64 each way), higher is better",
                "bandwidth (MB/s)",
            ),
        };
        let mut series: Vec<Series> = self
            .lines(test)
            .into_iter()
            .map(|l| Series {
                name: l.name,
                points: l.points.iter().map(|(&s, &v)| (s, v)).collect(),
                dashed: false,
            })
            .collect();
        for (name, m) in self.floors(test) {
            series.push(Series {
                name,
                points: m.into_iter().collect(),
                dashed: true,
            });
        }
        Plot {
            title: format!("{title} ({})", self.machine.host),
            y_label: y_label.into(),
            series,
        }
    }

    /// The headline figures: per device and peer, latency at 8 bytes, the
    /// bandwidths at 1 MiB and the message rate at 8 bytes, each with
    /// value/floor. A line without a rate at 8 bytes says so ("not
    /// measured: why") rather than leaving a dash: the rate is the figure
    /// the headline is read for next to latency.
    fn headline(&self) -> String {
        let picks = [
            ("latency", 8usize),
            ("bw", 1 << 20),
            ("bibw", 1 << 20),
            ("rate", 8),
        ];
        let mut names: Vec<String> = Vec::new();
        for (test, _) in picks {
            for l in self.lines(test) {
                if !names.contains(&l.name) {
                    names.push(l.name);
                }
            }
        }
        let mut s = String::from(
            "| device or peer | latency 8 B (us) | ratio | bw 1 MiB (MB/s) | ratio | bibw 1 MiB (MB/s) | ratio | messages/s at 8 B | ratio |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        let mut marked = false;
        for name in names {
            let _ = write!(s, "| {name} ");
            for (test, size) in picks {
                let lines = self.lines(test);
                let cells = self.cells(test, &lines, &name, size, &mut marked);
                if test == "rate" && cells.starts_with("| – ") {
                    let _ = write!(s, "| not measured: {} | – ", self.no_rate(&name));
                } else {
                    s.push_str(&cells);
                }
            }
            s.push_str("|\n");
        }
        if marked {
            s.push('\n');
            s.push_str(&Self::disturbed_note());
        }
        s
    }

    /// Why the line `name` has no message rate at 8 bytes in this run.
    fn no_rate(&self, name: &str) -> String {
        let rate = |n: &str| {
            self.results
                .records
                .iter()
                .any(|r| r.test == "rate" && r.device == n)
        };
        if name == RAW_PSM2 {
            if rate(PSM_VS_RAW) {
                "no 8 B figure in this run".into()
            } else {
                "the psm device's run gave no rate records".into()
            }
        } else if rate(name) {
            "no 8 B figure in this run".into()
        } else {
            "no rate records in this run (older results, or the rate test failed: see the run's stderr)".into()
        }
    }

    /// [`DISTURBED_MARK`] when `line`'s latency at `size` was measured next
    /// to a cache-line floor more than [`DISTURBED`] times the row's `floor`.
    fn disturbed(test: &str, line: &Line, size: usize, floor: f64) -> &'static str {
        match line.alongside.get(&size) {
            Some(&a) if test == "latency" && a > DISTURBED * floor => DISTURBED_MARK,
            _ => "",
        }
    }

    /// The `| value | ratio ` cells of the line `name` of `lines` at `size`
    /// for a headline table (dashes when not measured); `marked` is set
    /// when the value is [`Self::disturbed`].
    fn cells(
        &self,
        test: &str,
        lines: &[Line],
        name: &str,
        size: usize,
        marked: &mut bool,
    ) -> String {
        let Some((l, v)) = lines
            .iter()
            .find(|l| l.name == name)
            .and_then(|l| Some((l, *l.points.get(&size)?)))
        else {
            return "| – | – ".into();
        };
        match self.floor_of(test, l, size) {
            Some(f) if f > 0.0 => {
                let mark = Self::disturbed(test, l, size, f);
                *marked |= !mark.is_empty();
                format!("| {}{mark} | {:.2} ", fmt_value(v), v / f)
            }
            _ => format!("| {} | – ", fmt_value(v)),
        }
    }

    /// The note under a table with marked figures.
    fn disturbed_note() -> String {
        format!(
            "{DISTURBED_MARK} The cache-line floor measured alongside this figure was more \
             than {DISTURBED} times the row's: the cores were disturbed (by other jobs or the \
             hypervisor) while it was measured, so the figure is too; its own floor is in \
             the raw records.\n"
        )
    }

    /// The table of `test`: per size, the floors, then per line the value
    /// and value/floor.
    fn table(&self, test: &str) -> String {
        let lines = self.lines(test);
        let floors = self.floors(test);
        let mut sizes: Vec<usize> = lines
            .iter()
            .flat_map(|l| l.points.keys().copied())
            .collect();
        sizes.sort_unstable();
        sizes.dedup();
        let mut s = String::from("| size ");
        for (name, _) in &floors {
            let _ = write!(s, "| {name} ");
        }
        for l in &lines {
            let _ = write!(s, "| {} | ratio ", l.name);
        }
        let relative = self.relative_lines(&lines);
        if let Some((a, b)) = relative {
            let _ = write!(s, "| {} / {} ", a.name, b.name);
        }
        s.push_str("|\n|---");
        for _ in 0..floors.len() + 2 * lines.len() + usize::from(relative.is_some()) {
            s.push_str("|---:");
        }
        s.push_str("|\n");
        let mut marked = false;
        for size in sizes {
            let _ = write!(s, "| {} ", size_label(size));
            for (_, m) in &floors {
                match m.get(&size) {
                    Some(&f) => {
                        let _ = write!(s, "| {} ", fmt_value(f));
                    }
                    None => s.push_str("| – "),
                }
            }
            for l in &lines {
                match l.points.get(&size) {
                    Some(&v) => match self.floor_of(test, l, size) {
                        Some(f) if f > 0.0 => {
                            let mark = Self::disturbed(test, l, size, f);
                            marked |= !mark.is_empty();
                            let _ = write!(s, "| {}{mark} | {:.2} ", fmt_value(v), v / f);
                        }
                        _ => {
                            let _ = write!(s, "| {} | – ", fmt_value(v));
                        }
                    },
                    None => s.push_str("| – | – "),
                }
            }
            if let Some((a, b)) = relative {
                match (a.points.get(&size), b.points.get(&size)) {
                    (Some(x), Some(y)) if *y > 0.0 => {
                        let _ = write!(s, "| {:.2} ", x / y);
                    }
                    _ => s.push_str("| – "),
                }
            }
            s.push_str("|\n");
        }
        if marked {
            s.push('\n');
            s.push_str(&Self::disturbed_note());
        }
        s
    }

    /// The two lines of [`Self::relative`] among `lines`, when both are.
    fn relative_lines<'l>(&self, lines: &'l [Line]) -> Option<(&'l Line, &'l Line)> {
        let (a, b) = self.relative.as_ref()?;
        let find = |n: &str| lines.iter().find(|l| l.name == n);
        Some((find(a)?, find(b)?))
    }

    /// The report of what was measured in the soft-RoCE VM, with the
    /// guest's own floors: the tables and plots of its section.
    pub fn vm_report(&self) -> Option<Report> {
        let vm = self.vm.as_ref()?;
        Some(Report {
            machine: Machine {
                host: VM_HOST.into(),
                ..self.machine.clone()
            },
            load_after: self.load_after.clone(),
            load_range: self.load_range,
            command: self.command.clone(),
            elapsed: self.elapsed,
            built: vec!["ibv".into()],
            results: vm.results.clone(),
            peers: Vec::new(),
            vm: None,
            relative: Some(("ibv".into(), PERFTEST.into())),
        })
    }

    /// The status of the device `d` in the devices table: measured here,
    /// in the VM, or not, and why.
    fn device_status(&self, d: &str) -> String {
        let measured = |r: &Results| r.records.iter().any(|x| x.device == d);
        let why = |r: &Results| {
            r.not_measured
                .iter()
                .find(|(n, _)| n == d)
                .map(|(_, w)| w.clone())
        };
        if measured(&self.results) {
            // On one host the hybrid device is its shared-memory side alone.
            return if d == "hybrid" {
                "measured (on this one host: its shared-memory side; between hosts it uses `ibv`)"
                    .into()
            } else {
                "measured".into()
            };
        }
        let here = if let Some(w) = why(&self.results) {
            format!("not measured: {w}")
        } else if !self.built.iter().any(|b| b == d) {
            "not measured: not in this build (planned)".to_string()
        } else {
            "not measured: no results (see the run's stderr)".to_string()
        };
        match self.vm.as_ref().map(|v| &v.results) {
            Some(v) if measured(v) => {
                format!("measured in the soft-RoCE VM (its section below); on this host {here}")
            }
            Some(v) => match why(v) {
                Some(w) => format!("{here}; in the soft-RoCE VM not measured: {w}"),
                None => here,
            },
            None => here,
        }
    }

    /// The VM section: the guest, the headline of `ibv` against perftest,
    /// a table and a plot per test.
    /// One test's section: heading, what it measures, its plot, and its
    /// table (or "Nothing measured.").
    fn test_section(&self, s: &mut String, heading: &str, what: &str, image: &str, test: &str) {
        let _ = writeln!(s, "{heading}\n\n{what}.\n\n{image}\n");
        if self.lines(test).is_empty() {
            s.push_str("Nothing measured.\n\n");
        } else {
            s.push_str(&self.table(test));
            s.push('\n');
        }
    }

    fn vm_section(&self) -> String {
        let mut s = String::from(
            "## ibv and perftest in the soft-RoCE VM

",
        );
        let (Some(vm), Some(sub)) = (self.vm.as_ref(), self.vm_report()) else {
            let why = self
                .peers
                .iter()
                .find_map(|(p, st)| match (p.as_str(), st) {
                    (PERFTEST, PeerStatus::NotMeasured(why)) => Some(why.clone()),
                    _ => None,
                })
                .unwrap_or_else(|| PERFTEST_ABSENT.into());
            let _ = writeln!(s, "Not measured: {why}.\n");
            return s;
        };
        s.push_str(
            "The `ibv` device needs an RDMA device, which this host lacks, so it is measured \
             with perftest in a qemu guest with soft-RoCE (`rdma_rxe`), both sides in the \
             guest, by `ci/bench-vm.sh` (a separate run, dated in the table below). The guest \
             is emulated (TCG, no KVM): its figures are far from the host's and from real \
             RDMA hardware, and its two virtual CPUs keep the host's two cores busy. Compare \
             `ibv` with perftest (the last column, `ibv / perftest`: above 1 for latency or \
             below 1 for bandwidth means `ibv` is slower), and each with the guest's floors, \
             measured in the guest between two processes; not with the tables above.\n\n",
        );
        s.push_str("| | |\n|---|---|\n");
        for (k, v) in &vm.info {
            let _ = writeln!(s, "| {k} | {v} |");
        }
        s.push('\n');
        s.push_str(&sub.vm_headline());
        s.push('\n');
        for (test, title, unit, what) in [
            (
                "latency",
                "Latency",
                "us",
                "`ibv`: osu_latency (blocking pingpong, half the round trip); perftest: \
                 `ib_send_lat`, t_avg (also half the round trip)",
            ),
            (
                "bw",
                "Bandwidth",
                "MB/s",
                "`ibv`: osu_bw (a window of 64 non-blocking sends, then a zero-byte \
                 acknowledgement); perftest: `ib_write_bw -t 64` (RDMA writes, 64 in \
                 flight), BW average converted to 10^6 bytes per second",
            ),
        ] {
            let heading = format!("### {title} in the VM ({unit})");
            sub.test_section(
                &mut s,
                &heading,
                what,
                &format!("![{title} in the VM](vm-{test}.svg)"),
                test,
            );
        }
        s
    }

    /// The VM headline: `ibv` and perftest at 8 B latency and 1 and 4 MiB
    /// bandwidth, each over its floor, and `ibv / perftest`.
    fn vm_headline(&self) -> String {
        let mut s = String::from(
            "| figure | ibv | ratio | perftest | ratio | ibv / perftest |\n|---|---:|---:|---:|---:|---:|\n",
        );
        let mut marked = false;
        for (test, size, label) in [
            ("latency", 8usize, "latency 8 B (us)"),
            ("bw", 1 << 20, "bw 1 MiB (MB/s)"),
            ("bw", 4 << 20, "bw 4 MiB (MB/s)"),
        ] {
            let lines = self.lines(test);
            let _ = write!(s, "| {label} ");
            for name in ["ibv", PERFTEST] {
                s.push_str(&self.cells(test, &lines, name, size, &mut marked));
            }
            match self.relative_lines(&lines) {
                Some((a, b)) => match (a.points.get(&size), b.points.get(&size)) {
                    (Some(x), Some(y)) if *y > 0.0 => {
                        let _ = writeln!(s, "| {:.2} |", x / y);
                    }
                    _ => s.push_str("| – |\n"),
                },
                None => s.push_str("| – |\n"),
            }
        }
        if marked {
            s.push('\n');
            s.push_str(&Self::disturbed_note());
        }
        s
    }

    /// The report as markdown; the plots are `<test>.svg` beside it (and
    /// `vm-<test>.svg` with a VM results file).
    pub fn markdown(&self) -> String {
        let m = &self.machine;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "# xdev-bench comparison report: {} ({})\n",
            m.host, m.date
        );
        let _ = writeln!(
            s,
            "Generated by `{}` in {:.0} s. Every figure below was measured in this one run, \
             next to the floors it is divided by; nothing is copied from elsewhere, and \
             what could not be measured here is listed as such.\n",
            self.command,
            self.elapsed.as_secs_f64()
        );
        s.push_str("## Machine\n\n| | |\n|---|---|\n");
        let _ = writeln!(s, "| host | {} |", m.host);
        let _ = writeln!(s, "| CPU | {} |", m.cpu);
        let _ = writeln!(s, "| cores online | {} |", m.cores);
        let _ = writeln!(s, "| kernel | {} |", m.kernel);
        let _ = writeln!(s, "| date | {} |", m.date);
        let _ = writeln!(
            s,
            "| load average (1, 5, 15 min) | {} at the start, {} at the end |",
            m.load, self.load_after
        );
        if let Some((lo, hi)) = self.load_range {
            let _ = writeln!(
                s,
                "| 1-minute load average during the run (sampled every {} s) | {lo:.2} to {hi:.2} |",
                LOAD_SAMPLE_EVERY.as_secs()
            );
        }
        s.push('\n');
        s.push_str(
            "The machine is shared and virtualized: absolute figures move from run to run. \
             Read the ratios, which divide each figure by a floor measured in the same run, \
             close in time.",
        );
        // The run itself keeps about two busy (its two ranks spin); more
        // than one beyond the cores means other jobs ran beside it.
        if let Some((_, hi)) = self.load_range.filter(|&(_, hi)| hi > m.cores as f64 + 1.0) {
            let _ = write!(
                s,
                " The machine was busy during this run: the 1-minute load average reached \
                 {hi:.2} on {} cores, of which the run's two spinning ranks account for about \
                 two, so other jobs ran beside it and the figures are noisier than on a quiet \
                 machine; the ratios suffer least.",
                m.cores
            );
        }
        s.push_str("\n\n");
        s.push_str("## How to read value/floor\n\n");
        s.push_str(
            "- **Latency** (`ratio` = latency / cache-line floor): the floor is the one-way \
             hand-off of one cache line between the two ranks' cores (two pinned threads for \
             `thread`, the two rank processes through a shared mapping for process devices; \
             peers are divided by the processes' floor). No message between cores can cost \
             less, so the ratio is at least 1; lower is better.\n\
             - **Bandwidth** (`ratio` = bandwidth / memcpy floor): the floor is `memcpy` in \
             one thread over the test's working set (64 buffers per side); for `bibw`, two \
             such copies running at once on the two cores. A one-copy transport approaches \
             1 at best; a two-copy one about 0.5; higher is better. Ratios above 1 can occur \
             where the floor's copy is less cache-friendly than the transport's (small \
             working sets), or when the neighbours' load hits one side more than the other.\n\
             - **Message rate** (`ratio` = messages/s / (1 / cache-line floor)): the floor is \
             one message per one-way cache-line hand-off between the two ranks' cores, so the \
             ratio is the hand-off time over the time per message: 0.25 means each message \
             costs as much as four hand-offs; higher is better. It is a reference, not a \
             bound: a window of messages overlaps its hand-offs, so a ratio above 1 is \
             possible.\n\n",
        );
        s.push_str("## Devices and peers\n\n| name | kind | status |\n|---|---|---|\n");
        for d in KNOWN_DEVICES {
            let _ = writeln!(s, "| `{d}` | xdev device | {} |", self.device_status(d));
        }
        for (d, why) in &self.results.not_measured {
            if !KNOWN_DEVICES.contains(&d.as_str()) {
                let _ = writeln!(s, "| `{d}` | xdev device | not measured: {why} |");
            }
        }
        for (p, st) in &self.peers {
            let status = match st {
                PeerStatus::Measured(how) => format!("measured ({how})"),
                PeerStatus::NotMeasured(why) => format!("not measured: {why}"),
            };
            let _ = writeln!(s, "| {p} | peer | {status} |");
        }
        s.push_str("\n## Headline figures\n\n");
        s.push_str(&self.headline());
        s.push('\n');
        if self.vm.is_some() {
            s.push_str(
                "`ibv` and perftest, measured in the soft-RoCE VM, have a section of their \
                 own below: their figures come from an emulated guest.\n\n",
            );
        }
        for test in TESTS {
            let (title, unit, what) = match test {
                "latency" => (
                    "Latency",
                    "us",
                    "osu_latency: blocking pingpong, half the round trip",
                ),
                "bw" => (
                    "Bandwidth",
                    "MB/s",
                    "osu_bw: a window of 64 non-blocking sends, then a zero-byte acknowledgement",
                ),
                "rate" => (
                    "Message rate",
                    "messages/s",
                    "osu_mbw_mr's loop with one pair: rank 0 posts 64 non-blocking sends, rank 1 \
                     64 non-blocking receives, both wait for all, then a zero-byte \
                     acknowledgement; messages per second (64 per window, the \
                     acknowledgements not counted). The floor is one message per cache-line \
                     hand-off (1 / the latency floor of the placement)",
                ),
                _ => (
                    "Bi-directional bandwidth",
                    "MB/s",
                    "osu_bibw: both ranks post 64 receives and 64 sends, then wait for all; both directions counted",
                ),
            };
            let heading = format!("## {title} ({unit})");
            self.test_section(
                &mut s,
                &heading,
                what,
                &format!("![{title}]({test}.svg)"),
                test,
            );
        }
        s.push_str(&self.vm_section());
        s.push_str("## Method\n\n");
        s.push_str(
            "Message sizes are 0 (latency only) and powers of two up to the largest shown, with \
             OSU's iteration counts (latency: 10000 iterations and 100 warm-up up to 8 KiB, 1000 \
             and 10 above; bandwidth and message rate: 100 and 10, 20 and 2 above 8 KiB) and \
             window (64). Each \
             size is measured in rounds, the floor and the device alternately, and the best \
             round of each is kept (OSU's average per round, best round). Ranks are pinned to \
             cores 0 and 1. The floors are measured once more, alone (`xdev-bench --test floor`), \
             right before the MPI peers, and count among the floors of their sizes. The MPI peers run `benches/mpi/osu_peer.c` (the same loops, \
             counts and rounds) with `mpirun -np 2` and binding to cores. Raw PSM2 runs the same \
             loops against `psm2_mq_*` on the psm device's own endpoint, alternating with the \
             device. Each device's floors are measured alongside it, size by size. The \
             memcpy floor of a row is the best measured at that size in this run; the \
             cache-line floor, which does not depend on the message size, is the least \
             hand-off measured anywhere in the run between threads, or between processes \
             (for the process devices and the peers); the least is the one the neighbours' \
             load disturbed least. Every ratio in a row divides by the row's floor, so the \
             ratios of a row compare directly. The plots show sizes \
             from 1 byte on log axes, the floors dashed. Raw records, with each device's own \
             floor: `results.jsonl` beside this file.\n",
        );
        if self.vm.is_some() {
            s.push_str(
                "\nIn the soft-RoCE VM (`ci/bench-vm.sh`), `xdev-bench --device ibv --quick` \
                 (a tenth of OSU's iterations, one round of floor and device per size) and \
                 perftest with the same message counts (`ib_send_lat -n` 1000 up to 8 KiB, \
                 100 above; `ib_write_bw -t 64 -n` 640 and 128), server and client in the \
                 guest, take turns in rounds (the tools' order alternating); each figure is \
                 the best of its rounds. The guest's floors are measured by the `ibv` ranks \
                 alongside the device, and alone once per round (`xdev-bench --test floor`, \
                 between two processes); each row divides by the best of them at that size \
                 (for latency, the least cache-line hand-off of the whole guest run). A \
                 perftest run that failed \
                 three times is listed in the guest table, not filled in. Raw records: \
                 `vm-results.jsonl` beside this file.\n",
            );
        }
        s
    }
}

/// A figure with sensible precision.
fn fmt_value(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
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
}

/// The MPIs the report looks for (Debian's names).
pub const MPIS: [Mpi; 2] = [
    Mpi {
        name: "Open MPI",
        series: "Open MPI",
        mpicc: "mpicc.openmpi",
        mpirun: "mpirun.openmpi",
        run_args: &["--bind-to", "core", "--map-by", "core"],
    },
    Mpi {
        name: "MPICH",
        series: "MPICH",
        mpicc: "mpicc.mpich",
        mpirun: "mpirun.mpich",
        run_args: &["-bind-to", "core"],
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
    let mut cmd = Command::new(&mpirun);
    cmd.args(["-np", "2"])
        .args(mpi.run_args)
        .arg(&exe)
        .arg(mpi.series)
        .arg(max_size.to_string())
        .arg(rounds.to_string())
        .arg(if quick { "1" } else { "0" })
        // Open MPI refuses to run as root without these (containers, CI).
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    let (out, r) = run_captured(&mut cmd, Duration::from_secs(900), |_| {});
    r.map_err(|e| format!("{} -np 2 osu_peer {e}", mpi.mpirun))?;
    let records = parse_results(&out).records;
    if records.is_empty() {
        return Err(format!("{} printed no records", mpi.mpirun));
    }
    let version = version(&mpirun).unwrap_or_else(|| "version unknown".into());
    Ok((
        records,
        format!(
            "{version}; `{} -np 2 {}`",
            mpi.mpirun,
            mpi.run_args.join(" ")
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(device: &str, test: &str, size: usize, value: f64, floor: f64) -> Record {
        Record {
            device: device.into(),
            test: test.into(),
            size,
            value,
            unit: match test {
                "latency" => "us",
                "rate" => "msg/s",
                _ => "MB/s",
            }
            .into(),
            floor,
        }
    }

    #[test]
    fn records_and_notices_are_parsed() {
        let text = "\
# a comment
{\"device\":\"shm\",\"test\":\"latency\",\"size\":8,\"value\":0.5000,\"unit\":\"us\",\"floor\":0.0500}
test tests::x ... {\"device\":\"thread\",\"test\":\"bw\",\"size\":1024,\"value\":1.5e3,\"unit\":\"MB/s\",\"floor\":3000}
{\"device\":\"ibv\",\"not_measured\":\"verbs not available: \\\"x\\\"\"}
{\"floor\":\"threads\",\"test\":\"cache_line\",\"size\":0,\"value\":0.1,\"unit\":\"us\"}
{\"floor\":\"processes\",\"test\":\"memcpy\",\"size\":8,\"value\":9,\"unit\":\"MB/s\"}
{broken
";
        let r = parse_results(text);
        assert_eq!(
            r.records,
            [
                rec("shm", "latency", 8, 0.5, 0.05),
                rec("thread", "bw", 1024, 1500.0, 3000.0),
                rec("floor (threads)", "latency", 0, 0.1, 0.1),
                rec("floor (processes)", "bw", 8, 9.0, 9.0),
            ]
        );
        assert_eq!(
            r.not_measured,
            [("ibv".to_string(), "verbs not available: \"x\"".to_string())]
        );
        // What xdev-bench prints parses back.
        let line = crate::osu::not_measured("ibv", "no \"rdma\"\ndevice", true);
        assert_eq!(
            parse_results(&line).not_measured,
            [("ibv".to_string(), "no \"rdma\"\ndevice".to_string())]
        );
        let m = crate::osu::multi_bandwidth_json("shm", 2, 1.0, 2.0, 2);
        assert_eq!(
            parse_results(&m).records,
            [rec("shm", "mbw_mr", 2, 1.0, 2.0)]
        );
    }

    #[test]
    fn mpi_versions() {
        assert_eq!(
            version_of("mpirun.openmpi (OpenRTE) 4.1.4\n\nReport bugs").as_deref(),
            Some("mpirun.openmpi (OpenRTE) 4.1.4")
        );
        assert_eq!(
            version_of("HYDRA build details:\n    Version:      4.0.2\n").as_deref(),
            Some("version 4.0.2")
        );
        assert_eq!(version_of(""), None);
    }

    #[test]
    fn civil_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_723), (2024, 1, 1));
        assert_eq!(civil_from_days(19_782), (2024, 2, 29));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
    }

    fn report() -> Report {
        let records = vec![
            rec("thread", "latency", 0, 0.2, 0.04),
            rec("thread", "latency", 8, 0.25, 0.05),
            rec("shm", "latency", 8, 0.5, 0.1),
            rec("psm", "latency", 8, 1.0, 0.08),
            rec("psm-vs-raw", "latency", 8, 1.0, 0.8),
            // Measured alone, next to the peers: counts among the
            // processes' floors, and is no line of its own.
            rec("floor (processes)", "latency", 8, 0.09, 0.09),
            rec("Open MPI", "latency", 8, 0.4, 0.0),
            rec("shm", "bw", 1 << 20, 5000.0, 10000.0),
            rec("thread", "bw", 1 << 20, 4000.0, 8000.0),
            rec("shm", "bibw", 1 << 20, 6000.0, 12000.0),
        ];
        Report {
            machine: Machine {
                host: "box".into(),
                cpu: "CPU".into(),
                cores: 2,
                kernel: "6.1".into(),
                date: "2024-01-01 00:00 UTC".into(),
                load: "0.1 0.2 0.3".into(),
            },
            load_after: "1 1 1".into(),
            load_range: None,
            command: "xdev-bench report".into(),
            elapsed: Duration::from_secs(3),
            built: vec!["thread".into(), "shm".into(), "psm".into()],
            results: Results {
                records,
                not_measured: vec![("ibv".into(), "no RDMA device".into())],
            },
            peers: vec![
                (
                    RAW_PSM2.into(),
                    PeerStatus::Measured("same endpoint".into()),
                ),
                ("Open MPI".into(), PeerStatus::Measured("v4".into())),
                (
                    "MPICH".into(),
                    PeerStatus::NotMeasured("not installed".into()),
                ),
                (
                    "perftest".into(),
                    PeerStatus::NotMeasured(PERFTEST_ABSENT.into()),
                ),
            ],
            vm: None,
            relative: None,
        }
    }

    #[test]
    fn the_report_divides_by_the_floors_of_the_same_run() {
        let r = report();
        let md = r.markdown();
        assert!(md.contains("| `ibv` | xdev device | not measured: no RDMA device |"));
        assert!(md.contains("| `hybrid` | xdev device | not measured: not in this build"));
        let mut with_hybrid = report();
        with_hybrid.built.push("hybrid".into());
        with_hybrid
            .results
            .records
            .push(rec("hybrid", "latency", 8, 0.3, 0.05));
        assert!(with_hybrid.markdown().contains(
            "| `hybrid` | xdev device | measured (on this one host: its shared-memory side;"
        ));
        assert!(md.contains("| MPICH | peer | not measured: not installed |"));
        assert!(md.contains(&format!("Not measured: {PERFTEST_ABSENT}.")));
        // Headline rows: value and ratio. thread: 0.25 / 0.05 = 5; shm bw
        // 5000 / 10000; raw PSM2 is the floor field of psm-vs-raw, divided
        // by the processes' best cache-line floor (0.08); so is Open MPI.
        // Every ratio divides by the best floor of the run: at that size
        // for memcpy (10000 MB/s at 1 MiB), at any size for the cache line
        // (of the placement: 0.04 for threads, 0.08 for processes).
        assert!(
            md.contains("| thread | 0.250 | 6.25 | 4000 | 0.40 | – | – |"),
            "{md}"
        );
        assert!(
            md.contains("| shm | 0.500 | 6.25 | 5000 | 0.50 | 6000 | 0.50 |"),
            "{md}"
        );
        assert!(md.contains("| psm | 1.00 | 12.50 |"), "{md}");
        assert!(md.contains("| raw PSM2 | 0.800 | 10.00 |"), "{md}");
        assert!(md.contains("| Open MPI | 0.400 | 5.00 |"), "{md}");
        assert!(md.contains("![Latency](latency.svg)"));
        // Latency table: both cache-line floors, size 0 included.
        let lat = r.table("latency");
        assert!(
            lat.contains("\n| 8 | 0.040 | 0.080 | 0.250 | 6.25 | 0.500 | 6.25 |"),
            "{lat}"
        );
        assert!(lat.starts_with(
            "| size | cache-line floor (threads) | cache-line floor (processes) | thread | ratio |"
        ));
        assert!(
            lat.contains("\n| 0 | 0.040 | 0.080 | 0.200 | 5.00 | – | – |"),
            "{lat}"
        );
        // Plots: one line per device or peer, then the floors, dashed.
        let p = r.plot("latency");
        let names: Vec<&str> = p.series.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "thread",
                "shm",
                "psm",
                "raw PSM2",
                "Open MPI",
                "cache-line floor (threads)",
                "cache-line floor (processes)"
            ]
        );
        assert!(p.series[5].dashed && !p.series[0].dashed);
        let bibw = r.plot("bibw");
        assert_eq!(bibw.series.len(), 2, "shm and its floor");
        assert_eq!(bibw.series[1].name, "memcpy floor (2 concurrent)");
    }

    #[test]
    fn the_headline_has_the_message_rate_at_8_bytes_for_every_line() {
        // Without rate records every line says why it has no rate.
        let md = report().markdown();
        assert!(
            md.contains(
                "| device or peer | latency 8 B (us) | ratio | bw 1 MiB (MB/s) | ratio | \
                 bibw 1 MiB (MB/s) | ratio | messages/s at 8 B | ratio |\n\
                 |---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
            ),
            "{md}"
        );
        assert!(
            md.contains("| thread | 0.250 | 6.25 | 4000 | 0.40 | – | – | not measured: no rate records in this run"),
            "{md}"
        );
        assert!(
            md.contains("| raw PSM2 | 0.800 | 10.00 | – | – | – | – | not measured: the psm device's run gave no rate records | – |"),
            "{md}"
        );
        assert!(md.contains("## Message rate (messages/s)\n"), "{md}");
        assert!(md.contains("![Message rate](rate.svg)\n\nNothing measured."));

        let mut r = report();
        r.results.records.extend([
            rec("thread", "rate", 8, 2e6, 2e7),
            // A hand-off of 0.02 us measured next to the rate at 16 B: the
            // least of the threads' run, so every thread row divides by
            // 1 / 0.02 us = 5e7 messages/s.
            rec("thread", "rate", 16, 1e6, 5e7),
            rec("shm", "rate", 8, 3e6, 1e7),
            rec("psm-vs-raw", "rate", 8, 4e6, 1.6e7),
            rec("Open MPI", "rate", 8, 2.5e7, 0.0),
            rec("Open MPI", "rate", 16, 2e7, 0.0),
        ]);
        let md = r.markdown();
        // thread: 2e6 / 5e7; the processes' least hand-off is psm's 0.08 us
        // (latency records), so their floor is 1.25e7 messages/s: shm 3e6
        // / 1.25e7, raw PSM2 (the floor field of psm-vs-raw) 1.6e7 /
        // 1.25e7, Open MPI 2.5e7 / 1.25e7.
        assert!(
            md.contains("| thread | 0.250 | 6.25 | 4000 | 0.40 | – | – | 2000000 | 0.04 |"),
            "{md}"
        );
        assert!(
            md.contains("| shm | 0.500 | 6.25 | 5000 | 0.50 | 6000 | 0.50 | 3000000 | 0.24 |"),
            "{md}"
        );
        assert!(
            md.contains(
                "| psm | 1.00 | 12.50 | – | – | – | – | not measured: no rate records in this run"
            ),
            "{md}"
        );
        assert!(
            md.contains("| raw PSM2 | 0.800 | 10.00 | – | – | – | – | 16000000 | 1.28 |"),
            "{md}"
        );
        assert!(
            md.contains("| Open MPI | 0.400 | 5.00 | – | – | – | – | 25000000 | 2.00 |"),
            "{md}"
        );
        let t = r.table("rate");
        assert!(
            t.starts_with(
                "| size | 1 / cache-line floor (threads) | 1 / cache-line floor (processes) \
                 | thread | ratio | shm | ratio | raw PSM2 | ratio | Open MPI | ratio |\n"
            ),
            "{t}"
        );
        assert!(
            t.contains("\n| 8 | 50000000 | 12500000 | 2000000 | 0.04 | 3000000 | 0.24 | 16000000 | 1.28 | 25000000 | 2.00 |\n"),
            "{t}"
        );
        assert!(
            t.contains("\n| 16 | 50000000 | 12500000 | 1000000 | 0.02 | – | – | – | – | 20000000 | 1.60 |\n"),
            "{t}"
        );
        assert!(!t.contains(DISTURBED_MARK), "latency alone is marked");
        assert!(md.contains("- **Message rate** (`ratio`"), "{md}");
        let p = r.plot("rate");
        assert!(p.title.starts_with("Message rate"), "{}", p.title);
        assert_eq!(p.y_label, "messages/s");
        let names: Vec<&str> = p.series.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "thread",
                "shm",
                "raw PSM2",
                "Open MPI",
                "1 / cache-line floor (threads)",
                "1 / cache-line floor (processes)"
            ]
        );
        // A psm run with rates but none at 8 B says so.
        r.results
            .records
            .push(rec("psm-vs-raw", "rate", 16, 4e6, 1.6e7));
        r.results
            .records
            .retain(|x| !(x.device == "psm-vs-raw" && x.test == "rate" && x.size == 8));
        assert!(r
            .markdown()
            .contains("| raw PSM2 | 0.800 | 10.00 | – | – | – | – | not measured: no 8 B figure in this run | – |"));
    }

    /// A VM results file of two rounds, as `ci/bench-vm.sh` writes it.
    const VM_FILE: &str = "\
{\"vm_info\":\"guest kernel\",\"value\":\"6.1.0\"}
{\"vm_info\":\"perftest\",\"value\":\"6.06: ib_send_lat\"}
{\"device\":\"perftest\",\"test\":\"latency\",\"size\":8,\"value\":20.0,\"unit\":\"us\",\"floor\":0}
{\"device\":\"ibv\",\"test\":\"latency\",\"size\":8,\"value\":30.0,\"unit\":\"us\",\"floor\":0.5}
{\"device\":\"ibv\",\"test\":\"latency\",\"size\":8,\"value\":25.0,\"unit\":\"us\",\"floor\":0.25}
{\"device\":\"perftest\",\"test\":\"latency\",\"size\":8,\"value\":22.0,\"unit\":\"us\",\"floor\":0}
{\"device\":\"perftest\",\"test\":\"bw\",\"size\":4194304,\"value\":40.0,\"unit\":\"MB/s\",\"floor\":0}
{\"device\":\"ibv\",\"test\":\"bw\",\"size\":4194304,\"value\":30.0,\"unit\":\"MB/s\",\"floor\":1000}
{\"device\":\"ibv\",\"test\":\"bw\",\"size\":4194304,\"value\":36.0,\"unit\":\"MB/s\",\"floor\":1200}
{\"vm_info\":\"perftest failed\",\"value\":\"ib_write_bw -s 2 in round 1\"}
";

    #[test]
    fn vm_files_are_parsed() {
        let vm = parse_vm(VM_FILE);
        assert_eq!(
            vm.info,
            [
                ("guest kernel".to_string(), "6.1.0".to_string()),
                ("perftest".to_string(), "6.06: ib_send_lat".to_string()),
                (
                    "perftest failed".to_string(),
                    "ib_write_bw -s 2 in round 1".to_string()
                ),
            ]
        );
        assert_eq!(vm.results.records.len(), 7);
        assert_eq!(
            vm.results.records[0],
            rec("perftest", "latency", 8, 20.0, 0.0)
        );
        assert!(vm.results.not_measured.is_empty());
        assert_eq!(
            perftest_status(&vm, "f"),
            PeerStatus::Measured("in the soft-RoCE VM: perftest 6.06: ib_send_lat".into())
        );
        let only_ibv: String = VM_FILE
            .lines()
            .filter(|l| !l.contains("\"device\":\"perftest\""))
            .map(|l| format!("{l}\n"))
            .collect();
        assert_eq!(
            perftest_status(&parse_vm(&only_ibv), "f"),
            PeerStatus::NotMeasured(
                "no perftest figures in f (ib_write_bw -s 2 in round 1)".into()
            )
        );
    }

    #[test]
    fn the_vm_section_compares_ibv_with_perftest_over_the_guests_floors() {
        let mut r = report();
        r.vm = Some(parse_vm(VM_FILE));
        r.peers.retain(|(p, _)| p != PERFTEST);
        r.peers.push((
            PERFTEST.into(),
            PeerStatus::Measured("in the soft-RoCE VM".into()),
        ));
        let md = r.markdown();
        assert!(md.contains("| perftest | peer | measured (in the soft-RoCE VM) |"));
        // ibv: not measured on the host, measured in the VM.
        assert!(
            md.contains(
                "| `ibv` | xdev device | measured in the soft-RoCE VM (its section below); \
                 on this host not measured: no RDMA device |"
            ),
            "{md}"
        );
        assert!(md.contains("| guest kernel | 6.1.0 |"), "{md}");
        assert!(md.contains("| perftest failed | ib_write_bw -s 2 in round 1 |"));
        // Best of the rounds: ibv 25 us over the least floor of the guest
        // (0.25) = 100; perftest 20 / 0.25 = 80; 25 / 20 = 1.25. At 4 MiB:
        // 36 / 1200, 40 / 1200, 36 / 40.
        assert!(
            md.contains("| latency 8 B (us) | 25.00 | 100.00 | 20.00 | 80.00 | 1.25 |"),
            "{md}"
        );
        assert!(
            md.contains("| bw 4 MiB (MB/s) | 36.00 | 0.03 | 40.00 | 0.03 | 0.90 |"),
            "{md}"
        );
        assert!(
            md.contains("| bw 1 MiB (MB/s) | – | – | – | – | – |"),
            "{md}"
        );
        let sub = r.vm_report().unwrap();
        let lat = sub.table("latency");
        assert!(
            lat.starts_with(
                "| size | cache-line floor (processes) | ibv | ratio | perftest | ratio | ibv / perftest |\n\
                 |---|---:|---:|---:|---:|---:|---:|\n"
            ),
            "{lat}"
        );
        assert!(
            lat.contains("\n| 8 | 0.250 | 25.00 | 100.00 | 20.00 | 80.00 | 1.25 |"),
            "{lat}"
        );
        assert!(sub
            .table("bw")
            .contains("\n| 4M | 1200 | 36.00 | 0.03 | 40.00 | 0.03 | 0.90 |"));
        // The host's tables keep the host's floors and have no such column.
        assert!(!r.table("latency").contains("perftest"));
        let p = sub.plot("bw");
        assert!(p.title.contains(VM_HOST), "{}", p.title);
        let names: Vec<&str> = p.series.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["ibv", "perftest", "memcpy floor"]);
        assert!(md.contains("![Latency in the VM](vm-latency.svg)"));
        assert!(!md.contains(PERFTEST_ABSENT), "{md}");
    }

    #[test]
    fn latency_measured_on_disturbed_cores_is_marked() {
        let mut r = report();
        // thread at 16 B: its own floor 0.2, five times the row's (0.04);
        // a better round at 8 B whose floor was 0.3: that value is kept,
        // with its floor.
        r.results
            .records
            .push(rec("thread", "latency", 16, 0.9, 0.2));
        r.results
            .records
            .push(rec("thread", "latency", 8, 0.24, 0.3));
        let md = r.markdown();
        assert!(md.contains("| thread | 0.240† | 6.00 |"), "headline: {md}");
        let lat = r.table("latency");
        assert!(
            lat.contains("\n| 16 | 0.040 | 0.080 | 0.900† | 22.50 |"),
            "{lat}"
        );
        assert!(
            lat.contains("\n| 0 | 0.040 | 0.080 | 0.200 | 5.00 |"),
            "{lat}"
        );
        assert!(
            lat.contains("† The cache-line floor measured alongside"),
            "{lat}"
        );
        // Not marked: no disturbed figure, and bandwidth never.
        let quiet = report();
        assert!(!quiet.table("latency").contains('†'));
        assert!(!quiet.markdown().contains('†'));
        r.results.records.push(rec("thread", "bw", 16, 1.0, 1.0));
        assert!(!r.table("bw").contains('†'));
    }

    #[test]
    fn a_busy_machine_is_said_to_be() {
        let mut r = report();
        assert!(!r.markdown().contains("during the run"));
        r.load_range = Some((0.5, 1.5));
        let md = r.markdown();
        assert!(
            md.contains(
                "| 1-minute load average during the run (sampled every 10 s) | 0.50 to 1.50 |"
            ),
            "{md}"
        );
        assert!(!md.contains("was busy"), "1.5 on 2 cores: {md}");
        r.load_range = Some((0.5, 2.9));
        assert!(
            !r.markdown().contains("was busy"),
            "the run's own two ranks"
        );
        r.load_range = Some((0.5, 3.25));
        assert!(r
            .markdown()
            .contains("The machine was busy during this run: the 1-minute load average reached 3.25 on 2 cores"));
    }

    #[test]
    fn the_load_sampler_samples_at_once() {
        let s = LoadSampler::start();
        std::thread::sleep(Duration::from_millis(300));
        let (lo, hi) = s.finish().expect("a sample of /proc/loadavg");
        assert!(lo >= 0.0 && lo <= hi, "{lo} {hi}");
    }

    #[test]
    fn without_a_vm_file_its_section_says_why() {
        let md = report().markdown();
        assert!(
            md.contains(&format!("Not measured: {PERFTEST_ABSENT}.")),
            "{md}"
        );
        assert!(md.contains("| `ibv` | xdev device | not measured: no RDMA device |"));
        assert!(report().vm_report().is_none());
    }

    #[test]
    fn an_absent_mpi_is_not_measured_with_the_install_command() {
        let missing = Mpi {
            name: "Nope MPI",
            series: "Nope",
            mpicc: "mpicc.surely-not-installed",
            mpirun: "mpirun.surely-not-installed",
            run_args: &[],
        };
        let e = measure_mpi(&missing, Path::new("/nonexistent"), 8, 1, true).unwrap_err();
        assert!(
            e.contains("not installed") && e.contains(MPI_INSTALL),
            "{e}"
        );
    }

    #[test]
    fn captured_runs_report_failures_and_time_limits() {
        let mut seen = Vec::new();
        let (out, r) = run_captured(
            Command::new("sh").args(["-c", "echo a; echo b"]),
            Duration::from_secs(30),
            |l| seen.push(l.to_string()),
        );
        assert_eq!((out.as_str(), r), ("a\nb\n", Ok(())));
        assert_eq!(seen, ["a", "b"]);
        let (out, r) = run_captured(
            Command::new("sh").args(["-c", "echo partial; exit 3"]),
            Duration::from_secs(30),
            |_| {},
        );
        assert_eq!(out, "partial\n", "what a failed run printed is kept");
        let e = r.unwrap_err();
        assert!(e.contains("exit status: 3"), "{e}");
        let (_, r) = run_captured(
            Command::new("sleep").arg("30"),
            Duration::from_millis(300),
            |_| {},
        );
        let e = r.unwrap_err();
        assert!(e.contains("stopped after"), "{e}");
    }
}
