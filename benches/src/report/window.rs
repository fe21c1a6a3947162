//! The window calls in the report: the bibw exchange of thread and shm made
//! with `irecv_many`, `isend_many` and `wait_all` (`--test bibw_window`),
//! each a series of its own in the bibw table and plot. Not in the
//! headline: osu_bibw, like an MPI program, posts one call per message.

use std::path::Path;

use super::measure::{measure_series, series_args};
use super::records::{parse_results, Results};

/// How the window series' names end (`"shm (window calls)"`).
pub const WINDOW_SUFFIX: &str = " (window calls)";

/// The devices measured with the window calls.
pub const WINDOW_DEVICES: [&str; 2] = ["thread", "shm"];

/// The largest size of the window series: the calls save per-message work,
/// which shows on small messages.
pub const WINDOW_MAX_SIZE: usize = 64 << 10;

/// The arguments of `device`'s window run of `xdev-bench`.
pub fn window_args(device: &str, max_size: usize, quick: bool) -> Vec<String> {
    let sizes = (1, max_size.min(WINDOW_MAX_SIZE));
    series_args(device, "bibw_window", sizes, &[], quick)
}

/// The records of `text` (`device`'s window run) as bibw records of the
/// series `device (window calls)`.
pub fn window_records(text: &str, device: &str) -> Results {
    let mut r = parse_results(text);
    let series = format!("{device}{WINDOW_SUFFIX}");
    r.records
        .retain(|x| x.device == device && x.test == "bibw_window");
    for x in &mut r.records {
        x.device = series.clone();
        x.test = "bibw".into();
    }
    r
}

/// Measures the window series with `exe` for each device whose bibw the
/// suite measured: the records go into `results`.
pub(super) fn measure_window_calls(
    exe: &Path,
    max_size: usize,
    quick: bool,
    results: &mut Results,
) {
    for device in WINDOW_DEVICES {
        let measured = results
            .records
            .iter()
            .any(|x| x.device == device && x.test == "bibw");
        if !measured {
            continue;
        }
        eprintln!("report: measuring {device} bibw with the window calls");
        let series = format!("{device}{WINDOW_SUFFIX}");
        let args = window_args(device, max_size, quick);
        measure_series(
            exe,
            args,
            (&series, "bibw"),
            |text| window_records(text, device),
            results,
        );
    }
}

#[cfg(test)]
mod tests;
