//! The series of a test ([`Line`]: a device or a peer, best of the rounds
//! per size) and the floors they are divided by: the best of the run, per
//! placement for the cache-line floor.

use std::collections::BTreeMap;

use super::{Report, FLOOR_PREFIX, PSM_VS_RAW, RAW_PSM2};

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
pub(super) struct Line {
    /// The device or peer.
    pub(super) name: String,
    /// size -> value.
    pub(super) points: BTreeMap<usize, f64>,
    /// size -> the floor measured alongside that value (devices only).
    pub(super) alongside: BTreeMap<usize, f64>,
}

impl Report {
    /// The device and peer lines of `test`, in report order: the devices as
    /// built, raw PSM2, then the other peers as their records come. Of
    /// several records of one size (rounds), the best value.
    pub(super) fn lines(&self, test: &str) -> Vec<Line> {
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
    pub(super) fn floor_of(&self, test: &str, line: &Line, size: usize) -> Option<f64> {
        let place = matches!(test, "latency" | "rate").then(|| placement(&line.name));
        self.best_floor(test, place).get(&size).copied()
    }

    /// The floor lines of `test`'s plot and table: the cache-line floor per
    /// placement for latency (for the message rate, one message per
    /// hand-off), the memcpy floor for the bandwidths.
    pub(super) fn floors(&self, test: &str) -> Vec<(String, BTreeMap<usize, f64>)> {
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
}
