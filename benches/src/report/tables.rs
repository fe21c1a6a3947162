//! The report's tables: the headline figures, one table per test (value and
//! value/floor per size), the VM headline, and the mark of figures measured
//! on disturbed cores.

use std::fmt::Write as _;

use super::lines::Line;
use super::{
    Report, PATH_PREFIX, PERFTEST, PSM_VS_RAW, RAW_PSM2, UCX, UCX_LOOP_NOTE, WINDOW_SUFFIX,
};
use crate::plot::size_label;

/// A latency figure whose cache-line floor, measured alongside it, was more
/// than this many times the row's floor was measured on disturbed cores.
pub const DISTURBED: f64 = 2.0;

/// The mark of such a figure in the tables.
pub const DISTURBED_MARK: &str = "†";

impl Report {
    /// The headline figures: per device and peer, latency at 8 bytes, the
    /// bandwidths at 1 MiB and the message rate at 8 bytes, each with
    /// value/floor. A line without a rate at 8 bytes says so ("not
    /// measured: why") rather than leaving a dash: the rate is the figure
    /// the headline is read for next to latency.
    pub(super) fn headline(&self) -> String {
        let picks = [
            ("latency", 8usize),
            ("bw", 1 << 20),
            ("bibw", 1 << 20),
            ("rate", 8),
        ];
        let mut names: Vec<String> = Vec::new();
        for (test, _) in picks {
            for l in self.lines(test) {
                // The path series have their own table (bibw section); the
                // window series are not osu's loop.
                if !names.contains(&l.name)
                    && !l.name.starts_with(PATH_PREFIX)
                    && !l.name.ends_with(WINDOW_SUFFIX)
                {
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
                } else if test == "bibw" && name == UCX && cells.starts_with("| – ") {
                    s.push_str("| not measured: ucx_perftest has no bi-directional test | – ");
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
        if self
            .lines("latency")
            .iter()
            .chain(&self.lines("bw"))
            .any(|l| l.name == UCX)
        {
            let _ = writeln!(s, "\n{UCX_LOOP_NOTE}.");
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
                format!("| {}{mark} | {} ", fmt_value(v), fmt_ratio(v / f))
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
    pub(super) fn table(&self, test: &str) -> String {
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
                            let _ = write!(s, "| {}{mark} | {} ", fmt_value(v), fmt_ratio(v / f));
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
                        let _ = write!(s, "| {} ", fmt_ratio(x / y));
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

    /// The VM headline: `ibv` and perftest at 8 B latency and 1 and 4 MiB
    /// bandwidth, each over its floor, and `ibv / perftest`.
    pub(super) fn vm_headline(&self) -> String {
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
                        let _ = writeln!(s, "| {} |", fmt_ratio(x / y));
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
}

/// A ratio with two decimals, or two significant digits below 0.01 (a run
/// disturbed by other load can be far below the floor, and "0.00" would
/// read as no figure at all).
fn fmt_ratio(r: f64) -> String {
    if r >= 0.01 || r <= 0.0 || !r.is_finite() {
        format!("{r:.2}")
    } else {
        let decimals = (-r.log10()).ceil() as usize + 1;
        format!("{r:.decimals$}")
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

#[cfg(test)]
mod tests;
