//! The shm device's bi-directional bandwidth per rendezvous path: the
//! suite's bibw once more with the path forced (`cma=on` with the split on
//! and off, `cma=off`), each a series of its own in the bibw table and
//! plot, and a table of every path against Open MPI's bibw.

use std::fmt::Write as _;
use std::path::Path;

use super::measure::{measure_series, series_args};
use super::records::{parse_results, Results};
use super::Report;

/// How the path series' names begin (the device is `shm`).
pub const PATH_PREFIX: &str = "shm cma=";

/// The path series: (series name, device options).
pub const PATHS: [(&str, &[&str]); 3] = [
    ("shm cma=on split=on", &["cma=on", "mapped=false"]),
    (
        "shm cma=on split=off",
        &["cma=on", "cma_split_bytes=0", "mapped=false"],
    ),
    ("shm cma=off", &["cma=off"]),
];

/// The smallest size of the path series: twice the shm device's default
/// eager limit (16 KiB), where every message is a rendezvous.
pub const PATH_MIN_SIZE: usize = 32 << 10;

/// The peer the path table divides by.
const VERSUS: &str = "Open MPI";

/// The arguments of one path's run of `xdev-bench`.
pub fn path_args(options: &[&str], max_size: usize, quick: bool) -> Vec<String> {
    series_args("shm", "bibw", (PATH_MIN_SIZE, max_size), options, quick)
}

/// The records of `text` (one path's run) named `series` instead of `shm`.
pub fn path_records(text: &str, series: &str) -> Results {
    let mut r = parse_results(text);
    for x in &mut r.records {
        if x.device == "shm" {
            x.device = series.into();
        }
    }
    r.records.retain(|x| x.device == series);
    r
}

/// Measures every path with `exe` when the suite measured shm's bibw: the
/// records go into `results`.
pub(super) fn measure_paths(exe: &Path, max_size: usize, quick: bool, results: &mut Results) {
    let shm_bibw = results
        .records
        .iter()
        .any(|x| x.device == "shm" && x.test == "bibw");
    if !shm_bibw || max_size < PATH_MIN_SIZE {
        return;
    }
    for (series, options) in PATHS {
        eprintln!("report: measuring shm bibw by path: {series}");
        let args = path_args(options, max_size, quick);
        measure_series(
            exe,
            args,
            (series, "bibw"),
            |text| path_records(text, series),
            results,
        );
    }
}

impl Report {
    /// The bibw of shm (its own choice of path) and of each forced path,
    /// each as a ratio to Open MPI's bibw at the same size; empty when
    /// there are no path series.
    pub(super) fn path_section(&self) -> String {
        let lines = self.lines("bibw");
        let versus = lines.iter().find(|l| l.name == VERSUS);
        let shown: Vec<_> = lines
            .iter()
            .filter(|l| l.name == "shm" || l.name.starts_with(PATH_PREFIX))
            .collect();
        if !shown.iter().any(|l| l.name.starts_with(PATH_PREFIX)) {
            return String::new();
        }
        let mut s = String::from(
            "### Bi-directional bandwidth of shm by rendezvous path\n\n\
             `shm` is the device as it chose at start-up (`cma=auto`: where CMA is used, \
             from `cma_min_bytes`, 256 KiB, the receiver copies from the sender's buffer \
             mapped into it where that lies in the sender's shared arena, as xdev-bench's \
             page-aligned buffers do, and the pipelined copy below); the others force a \
             path: `cma=on` with `mapped=false` (CMA for every rendezvous: the receiver \
             copies with `process_vm_readv`) with the split \
             (`split=on`: a large copy shared with the sender, `process_vm_writev`; skipped \
             while the receiver has rendezvous of its own out to that sender) or without it \
             (`cma_split_bytes=0`), and `cma=off` (the pipelined copy through the ring). \
             Each cell: MB/s, and in brackets the ratio to Open MPI's bibw at that size \
             in this run (– where Open MPI was not measured).\n\n| size |",
        );
        for l in &shown {
            let _ = write!(s, " {} |", l.name);
        }
        s.push_str("\n|---|");
        s.push_str(&"---:|".repeat(shown.len()));
        s.push('\n');
        let mut sizes: Vec<usize> = shown
            .iter()
            .filter(|l| l.name.starts_with(PATH_PREFIX))
            .flat_map(|l| l.points.keys().copied())
            .collect();
        sizes.sort_unstable();
        sizes.dedup();
        for size in sizes {
            let _ = write!(s, "| {} |", crate::plot::size_label(size));
            for l in &shown {
                let cell = match (
                    l.points.get(&size),
                    versus.and_then(|v| v.points.get(&size)),
                ) {
                    (Some(v), Some(o)) if *o > 0.0 => format!("{v:.0} ({:.2}x)", v / o),
                    (Some(v), _) => format!("{v:.0} (–)"),
                    (None, _) => "–".into(),
                };
                let _ = write!(s, " {cell} |");
            }
            s.push('\n');
        }
        s.push('\n');
        s
    }
}

#[cfg(test)]
mod tests;
