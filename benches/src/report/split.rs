//! The psm device's message rate split by side in the report: the rate
//! loop with only the sender, then only the receiver, through the device
//! and the other side raw PSM2 (`--test rate_split`, at 8 bytes), against
//! raw PSM2 on both sides, and the receiving rank's time per message
//! posting and waiting. It says which side of the device holds its rate
//! below raw PSM2's, and in which phase; not in the headline.

use std::fmt::Write as _;
use std::path::Path;

use super::measure::{measure_series, series_args};
use super::records::{parse_results, Results};
use super::{Report, PSM_VS_RAW};

/// The size of the split run: the headline's message rate size.
pub const SPLIT_SIZE: usize = 8;

/// The `psm-vs-raw` tests of the split: the sender through the device,
/// then the receiver.
pub const SPLIT_TESTS: [(&str, &str); 2] = [
    ("rate_send", "sender through the device"),
    ("rate_recv", "receiver through the device"),
];

/// The arguments of the split run of `xdev-bench`.
pub fn split_args(quick: bool) -> Vec<String> {
    series_args("psm", "rate_split", (SPLIT_SIZE, SPLIT_SIZE), &[], quick)
}

/// The `psm-vs-raw` records of the receiving rank's time per message with
/// the receiver through the device (value) and with raw PSM2 on both sides
/// (floor): posting the window's receives, and waiting for them.
pub const PHASE_TESTS: [(&str, &str); 2] =
    [("rate_recv_post", "posting"), ("rate_recv_wait", "waiting")];

/// The split's records in `text` (a split run's output).
pub fn split_records(text: &str) -> Results {
    let mut r = parse_results(text);
    r.records.retain(|x| {
        x.device == PSM_VS_RAW
            && SPLIT_TESTS
                .iter()
                .chain(&PHASE_TESTS)
                .any(|(t, _)| *t == x.test)
    });
    r
}

/// Measures the split with `exe` when the suite measured the psm device
/// against raw PSM2: the records go into `results`.
pub(super) fn measure_split(exe: &Path, quick: bool, results: &mut Results) {
    if !results.records.iter().any(|x| x.device == PSM_VS_RAW) {
        return;
    }
    eprintln!("report: measuring psm's message rate by side (rate_split)");
    measure_series(
        exe,
        split_args(quick),
        ("psm by side", "rate_split"),
        split_records,
        results,
    );
}

impl Report {
    /// The split's table (after the message rate's), or nothing when it
    /// was not measured.
    pub(super) fn split_section(&self) -> String {
        let recs: Vec<_> = SPLIT_TESTS
            .iter()
            .filter_map(|(t, name)| Some((name, self.record(t)?)))
            .collect();
        if recs.is_empty() {
            return String::new();
        }
        let mut s = format!(
            "### Message rate of psm by side ({SPLIT_SIZE} B)\n\n\
             The same loop with one side through the psm device and the other raw PSM2 \
             on the same endpoint (`xdev-bench --test rate_split`); the ratio is to raw \
             PSM2 on both sides in the same run. The side whose ratio stays low is the \
             one that holds the device's rate down.\n\n\
             | through the device | messages/s | raw PSM2 | ratio |\n|---|---:|---:|---:|\n"
        );
        for (name, r) in recs {
            let ratio = if r.floor > 0.0 {
                format!("{:.2}", r.value / r.floor)
            } else {
                "–".into()
            };
            let _ = writeln!(
                s,
                "| {name} | {:.2} M | {:.2} M | {ratio} |",
                r.value / 1e6,
                r.floor / 1e6
            );
        }
        let phases: Vec<String> = PHASE_TESTS
            .iter()
            .filter_map(|(t, what)| {
                let r = self.record(t)?;
                Some(format!(
                    "{what} {:.0} ns (raw PSM2: {:.0} ns)",
                    r.value, r.floor
                ))
            })
            .collect();
        if !phases.is_empty() {
            let _ = write!(
                s,
                "\nPer message on the receiving rank, with the receiver through the device: {}.\n",
                phases.join(", ")
            );
        }
        s.push('\n');
        s
    }

    /// The split's `psm-vs-raw` record of `test`.
    fn record(&self, test: &str) -> Option<&super::Record> {
        self.results
            .records
            .iter()
            .find(|x| x.device == PSM_VS_RAW && x.test == test && x.size == SPLIT_SIZE)
    }
}

#[cfg(test)]
mod tests;
