//! The plot of a test: one line per device or peer, the floors dashed
//! ([`crate::plot`] draws it).

use super::Report;
use crate::plot::{Plot, Series};

impl Report {
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
}
