//! Small messages in interleaved passes: Open MPI, thread and shm measured
//! in turn, a few seconds each, several times over, and each device
//! compared with the Open MPI run of its own pass.
//!
//! Why: on this kind of host (two vCPUs of a shared machine) the speed of
//! a cross-core hand-off flips between two levels from one second to the
//! next, for every transport alike (Open MPI's osu_bibw at 1 B: 7.9-10 or
//! 12.7-14.5 MB/s in back-to-back runs). The report's main tables measure
//! each device and peer once, minutes apart, so a ratio between two of
//! them also carries the host's state at two moments. A pass puts the
//! three runs seconds apart, in an order rotated from pass to pass, and
//! the section gives each device the median of its per-pass ratios to Open
//! MPI, with their range and how many passes were at least level: what a
//! small-message target can be read from. The main tables are unchanged.
//!
//! Large messages swing too: the host's memory bandwidth moved Open MPI's
//! osu_bibw at 512 KiB between 6.2 and 12.5 GB/s in runs minutes apart,
//! more than the gap between shm and Open MPI (both copy with CMA there).
//! So a pass also runs osu_bibw from 256 KiB on Open MPI and shm, in turn,
//! when the report goes that far.

use std::fmt::Write as _;
use std::path::Path;

use super::measure::{build_mpi_peer, measure_series, series_args, MpiPeer, MPIS};
use super::records::{parse_results, Record, Results};
use super::Report;
use crate::cli::rounds_for;
use crate::osu;

/// The peer each pass compares with (its `mpicc` and `mpirun`: [`MPIS`]).
pub const PASS_PEER: &str = "Open MPI";

/// The devices measured in each pass.
pub const PASS_DEVICES: [&str; 2] = ["thread", "shm"];

/// The largest message of a pass.
pub const PASS_MAX_SIZE: usize = 64;

/// Passes of a full report (`--passes` sets it).
pub const PASSES: usize = 7;

/// Passes of a quick report (`--passes` sets it).
pub const QUICK_PASSES: usize = 2;

/// The rows of the section: the small-message targets.
pub const PASS_ROWS: [(&str, usize); 8] = [
    ("latency", 8),
    ("bw", 1),
    ("bw", 8),
    ("bw", 64),
    ("bibw", 1),
    ("bibw", 8),
    ("bibw", 64),
    ("rate", 8),
];

/// The devices of the large-message part of a pass: the target is
/// shm's osu_bibw against Open MPI's, both one-copy (CMA) there.
pub const LARGE_PASS_DEVICES: [&str; 1] = ["shm"];

/// The sizes of the large-message part of a pass: osu_bibw from this size
/// up to the report's `--max-size` (at most [`LARGE_PASS_MAX_SIZE`]); none
/// when `--max-size` is below it.
pub const LARGE_PASS_MIN_SIZE: usize = 256 << 10;

/// The largest message of the large-message part of a pass.
pub const LARGE_PASS_MAX_SIZE: usize = 4 << 20;

/// The test of the large-message part of a pass.
pub const LARGE_PASS_TEST: &str = "bibw";

/// The rows of the large-message section, up to `max_size`: osu_bibw at
/// every power of two from [`LARGE_PASS_MIN_SIZE`].
pub fn large_pass_rows(max_size: usize) -> Vec<(&'static str, usize)> {
    std::iter::successors(Some(LARGE_PASS_MIN_SIZE), |s| Some(s * 2))
        .take_while(|&s| s <= max_size.min(LARGE_PASS_MAX_SIZE))
        .map(|s| (LARGE_PASS_TEST, s))
        .collect()
}

/// What one pass measured: the records of its runs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Pass {
    /// Every record of the pass (the peer's and the devices').
    pub records: Vec<Record>,
}

impl Pass {
    /// The value `series` measured for (`test`, `size`) in this pass.
    fn value(&self, series: &str, test: &str, size: usize) -> Option<f64> {
        self.records
            .iter()
            .find(|r| r.device == series && r.test == test && r.size == size)
            .map(|r| r.value)
            .filter(|v| *v > 0.0)
    }
}

/// The arguments of `device`'s run in a pass.
pub fn pass_args(device: &str, quick: bool) -> Vec<String> {
    let tests = "latency,bw,bibw,rate";
    series_args(device, tests, (1, PASS_MAX_SIZE), &[], quick)
}

/// The arguments of `device`'s large-message run in a pass, up to
/// `max_size` (see [`large_pass_rows`]).
pub fn large_pass_args(device: &str, max_size: usize, quick: bool) -> Vec<String> {
    let sizes = (LARGE_PASS_MIN_SIZE, max_size.min(LARGE_PASS_MAX_SIZE));
    series_args(device, LARGE_PASS_TEST, sizes, &[], quick)
}

/// Runs `passes` passes with `exe` (this program) and the [`PASS_PEER`]'s
/// osu_peer (built once): none when Open MPI is not wanted or cannot be
/// built (the section then says why).
///
/// Each pass also measures osu_bibw at large messages
/// ([`large_pass_rows`]) on [`LARGE_PASS_DEVICES`] and the peer, in the
/// same rotated order, when `max_size` reaches [`LARGE_PASS_MIN_SIZE`].
pub(super) fn measure_passes(
    exe: &Path,
    passes: usize,
    (quick, max_size): (bool, usize),
    mpi_wanted: bool,
) -> Result<Vec<Pass>, String> {
    if passes == 0 {
        return Err("skipped (--passes 0)".into());
    }
    if !mpi_wanted {
        return Err("skipped (--no-mpi)".into());
    }
    let mpi = MPIS
        .iter()
        .find(|m| m.series == PASS_PEER)
        .expect("Open MPI is one of the MPI peers");
    let dir = std::env::temp_dir().join(format!("xdev-bench-passes-{}", std::process::id()));
    let peer = build_mpi_peer(mpi, &dir);
    let out = peer.map(|peer| {
        (0..passes)
            .map(|i| one_pass(exe, &peer, (i, passes), (quick, max_size)))
            .collect()
    });
    let _ = std::fs::remove_dir_all(&dir);
    out
}

/// Pass `i` of `n`: the peer and each device at small messages, then (when
/// `max_size` reaches [`LARGE_PASS_MIN_SIZE`]) the peer and each of
/// [`LARGE_PASS_DEVICES`] at osu_bibw from that size.
fn one_pass(
    exe: &Path,
    peer: &MpiPeer<'_>,
    (i, n): (usize, usize),
    (quick, max_size): (bool, usize),
) -> Pass {
    eprintln!("report: small messages, pass {} of {n}", i + 1);
    let mut r = Results::default();
    let small = Part {
        what: "small-message records",
        devices: &PASS_DEVICES,
        peer: (None, PASS_MAX_SIZE),
        args: &|d| pass_args(d, quick),
    };
    small.run(exe, peer, i, quick, &mut r);
    if max_size >= LARGE_PASS_MIN_SIZE {
        eprintln!("report: large bibw, pass {} of {n}", i + 1);
        let large = Part {
            what: "large bibw records",
            devices: &LARGE_PASS_DEVICES,
            peer: (
                Some((LARGE_PASS_TEST, LARGE_PASS_MIN_SIZE)),
                max_size.min(LARGE_PASS_MAX_SIZE),
            ),
            args: &|d| large_pass_args(d, max_size, quick),
        };
        large.run(exe, peer, i, quick, &mut r);
    }
    Pass { records: r.records }
}

/// One part of a pass: the peer's run and each device's.
struct Part<'a> {
    /// What the devices' runs give, for messages.
    what: &'static str,
    devices: &'a [&'a str],
    /// The peer's narrowing and largest size ([`MpiPeer::run_only`]).
    peer: (Option<(&'static str, usize)>, usize),
    /// A device's arguments.
    args: &'a dyn Fn(&str) -> Vec<String>,
}

impl Part<'_> {
    /// Runs the peer and each device, in an order rotated by `i` so that no
    /// run always comes first (after the idle stretch) or always follows
    /// the same other, into `r`.
    fn run(&self, exe: &Path, peer: &MpiPeer<'_>, i: usize, quick: bool, r: &mut Results) {
        let n = self.devices.len() + 1;
        for k in 0..n {
            match (i + k) % n {
                0 => match peer.run_only(self.peer.0, self.peer.1, rounds_for(quick), quick) {
                    Ok((records, _)) => r.records.extend(records),
                    Err(e) => eprintln!("report: pass {}: {PASS_PEER}: {e}", i + 1),
                },
                d => {
                    let device = self.devices[d - 1];
                    let only_device = |text: &str| {
                        let mut x = parse_results(text);
                        x.records.retain(|x| x.device == device);
                        x
                    };
                    let args = (self.args)(device);
                    measure_series(exe, args, (device, self.what), only_device, r);
                }
            }
        }
    }
}

/// `passes` as JSON lines: each record with its pass (from 1).
pub fn passes_jsonl(passes: &[Pass]) -> String {
    let mut s = String::new();
    for (i, p) in passes.iter().enumerate() {
        for r in &p.records {
            let rec = osu::json(&r.device, &r.test, r.size, r.value, &r.unit, r.floor);
            let _ = writeln!(s, "{{\"pass\":{},{}", i + 1, &rec[1..]);
        }
    }
    s
}

/// The median, the least and the largest of `v` (not empty); the median
/// of an even count is the mean of the two middle values.
fn spread(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let median = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    (median, v[0], v[n - 1])
}

/// One device's figures on one row across the passes.
#[derive(Debug, PartialEq)]
pub struct PassRatio {
    /// The device's median value.
    pub value: f64,
    /// The median of the per-pass ratios to the peer (the peer's latency
    /// over the device's, the device's bandwidth or rate over the peer's:
    /// above 1 the device is ahead).
    pub ratio: f64,
    /// The least and the largest per-pass ratio.
    pub range: (f64, f64),
    /// Passes with a ratio of at least 1.
    pub level: usize,
    /// Passes where both the device and the peer measured the row.
    pub passes: usize,
}

/// `device` against [`PASS_PEER`] on (`test`, `size`) over `passes`: only
/// passes where both measured it count. `None` if none did.
pub fn pass_ratio(passes: &[Pass], device: &str, test: &str, size: usize) -> Option<PassRatio> {
    let pairs: Vec<(f64, f64)> = passes
        .iter()
        .filter_map(|p| {
            Some((
                p.value(device, test, size)?,
                p.value(PASS_PEER, test, size)?,
            ))
        })
        .collect();
    if pairs.is_empty() {
        return None;
    }
    let ratios: Vec<f64> = pairs
        .iter()
        .map(|&(d, o)| if test == "latency" { o / d } else { d / o })
        .collect();
    let level = ratios.iter().filter(|&&r| r >= 1.0).count();
    let (ratio, least, most) = spread(ratios);
    Some(PassRatio {
        value: spread(pairs.iter().map(|p| p.0).collect()).0,
        ratio,
        range: (least, most),
        level,
        passes: pairs.len(),
    })
}

/// A figure of `test` with its unit's precision, without the unit.
fn number(test: &str, v: f64) -> String {
    match test {
        "latency" => format!("{v:.3}"),
        "rate" => format!("{:.2}", v / 1e6),
        _ => format!("{v:.2}"),
    }
}

/// A figure of `test` with its unit.
fn figure(test: &str, v: f64) -> String {
    let unit = match test {
        "latency" => "us",
        "rate" => "M/s",
        _ => "MB/s",
    };
    format!("{} {unit}", number(test, v))
}

impl Report {
    /// The sections of the interleaved passes: small messages (per row,
    /// Open MPI's median and range, and each device's median with its
    /// ratio to Open MPI: median of the passes' ratios, their range, passes
    /// at least level), then osu_bibw at large messages where measured.
    pub(super) fn pass_section(&self) -> String {
        let mut s = String::from("### Small messages in interleaved passes\n\n");
        let passes = match &self.passes {
            Err(why) => {
                let _ = writeln!(s, "Not measured: {why}.\n");
                return s;
            }
            Ok(p) => p,
        };
        let _ = write!(
            s,
            "{n} passes, each running {PASS_PEER}'s osu_peer and `xdev-bench` on {devices} up to \
             {PASS_MAX_SIZE} B, seconds apart, in an order rotated from pass to pass. The speed \
             of a cross-core hand-off on this host flips between two levels from one second \
             to the next, for every transport alike, so a ratio between runs minutes apart \
             (the tables above) also carries that; here each device is divided by the \
             {PASS_PEER} run of its own pass. Each device cell: its median, then the median of \
             its per-pass ratios to {PASS_PEER} (latency: {PASS_PEER}'s over the device's; \
             above 1 the device is ahead), their range, and how many passes were at least \
             level. Records: `passes.jsonl`.\n\n",
            n = passes.len(),
            devices = PASS_DEVICES.join(" and "),
        );
        pass_table(&mut s, passes, &PASS_ROWS, &PASS_DEVICES);
        let large: Vec<(&str, usize)> = large_pass_rows(LARGE_PASS_MAX_SIZE)
            .into_iter()
            .filter(|&(test, size)| {
                passes
                    .iter()
                    .any(|p| p.value(PASS_PEER, test, size).is_some())
            })
            .collect();
        if !large.is_empty() {
            let _ = write!(
                s,
                "### Large bi-directional bandwidth in interleaved passes\n\n\
                 The same passes also ran osu_bibw from {} KiB by {PASS_PEER}'s osu_peer and \
                 `xdev-bench` on {}, in an order rotated from pass to pass: at these sizes Open \
                 MPI's receiver copies with CMA (`process_vm_readv`), and shm's from the \
                 sender's buffer mapped into it (the sender's shared arena; with non-temporal \
                 stores while more than 4 MiB of receives are under way), and the host's \
                 memory bandwidth swings from one run to the next. Cells as above.\n\n",
                LARGE_PASS_MIN_SIZE >> 10,
                LARGE_PASS_DEVICES.join(" and "),
            );
            pass_table(&mut s, passes, &large, &LARGE_PASS_DEVICES);
        }
        s
    }
}

/// Appends to `s` the table of `rows` for `devices` over `passes`.
fn pass_table(s: &mut String, passes: &[Pass], rows: &[(&str, usize)], devices: &[&str]) {
    let _ = write!(s, "| test | size | {PASS_PEER} (median, range) |");
    for d in devices {
        let _ = write!(s, " {d} |");
    }
    s.push_str("\n|---|---:|---:|");
    s.push_str(&"---:|".repeat(devices.len()));
    s.push('\n');
    for &(test, size) in rows {
        let peer: Vec<f64> = passes
            .iter()
            .filter_map(|p| p.value(PASS_PEER, test, size))
            .collect();
        let peer_cell = if peer.is_empty() {
            "–".to_string()
        } else {
            let (m, least, most) = spread(peer);
            format!(
                "{} ({}–{})",
                figure(test, m),
                number(test, least),
                number(test, most)
            )
        };
        let _ = write!(s, "| {test} | {} | {peer_cell} |", size_label(size));
        for d in devices {
            let cell = match pass_ratio(passes, d, test, size) {
                Some(r) => format!(
                    "{}: **{:.2}x** ({:.2}–{:.2}, {} of {} ≥ 1)",
                    figure(test, r.value),
                    r.ratio,
                    r.range.0,
                    r.range.1,
                    r.level,
                    r.passes
                ),
                None => "–".into(),
            };
            let _ = write!(s, " {cell} |");
        }
        s.push('\n');
    }
    s.push('\n');
}

/// A message size as the pass tables write it: bytes, or whole KiB and MiB
/// ([`size_in_units`](crate::plot::size_in_units), the plots' scaling).
fn size_label(size: usize) -> String {
    match crate::plot::size_in_units(size) {
        (n, "") => format!("{n} B"),
        (n, prefix) => format!("{n} {prefix}iB"),
    }
}

#[cfg(test)]
mod tests;
