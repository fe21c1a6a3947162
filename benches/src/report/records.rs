//! The records a run prints and how they are read back: [`Record`] and
//! [`Results`] from `xdev-bench --json` and the MPI peer ([`parse_results`]),
//! and a soft-RoCE VM results file ([`parse_vm`], [`perftest_status`]).

use std::collections::BTreeMap;

use super::{PeerStatus, FLOOR_PREFIX, PERFTEST};

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
/// --json` and the MPI peer print) with `serde_json`; `None` for anything
/// else (not JSON, not an object, or a member that is neither).
fn flat_object(line: &str) -> Option<BTreeMap<String, Scalar>> {
    let serde_json::Value::Object(map) = serde_json::from_str(line.trim()).ok()? else {
        return None;
    };
    map.into_iter()
        .map(|(k, v)| match v {
            serde_json::Value::String(s) => Some((k, Scalar::Str(s))),
            serde_json::Value::Number(n) => Some((k, Scalar::Num(n.as_f64()?))),
            _ => None,
        })
        .collect()
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
    /// System-call counts of 8 B latency runs (`ci/lib/syscalls.sh`), in
    /// file order.
    pub syscalls: Vec<SyscallCount>,
}

/// One `{"vm_syscalls":TOOL,"placement":P,"round":R,"calls":C,"writes":W,
/// "messages":M}` line: the system calls and `write`s `strace -f -c`
/// counted over one 8 B latency run of TOOL (`ibv` or `perftest`), both
/// sides, and the messages both sides sent.
#[derive(Clone, Debug, PartialEq)]
pub struct SyscallCount {
    /// `ibv` or `perftest`.
    pub tool: String,
    /// Where the two sides ran (`one guest`, `two guests`).
    pub placement: String,
    /// System calls of both sides.
    pub calls: f64,
    /// `write` calls of both sides (verbs commands and doorbells on rxe).
    pub writes: f64,
    /// Messages both sides sent.
    pub messages: f64,
}

fn syscall_count(o: &BTreeMap<String, Scalar>) -> Option<SyscallCount> {
    let s = |k: &str| match o.get(k) {
        Some(Scalar::Str(v)) => Some(v.clone()),
        _ => None,
    };
    let n = |k: &str| match o.get(k) {
        Some(Scalar::Num(v)) if v.is_finite() && *v >= 0.0 => Some(*v),
        _ => None,
    };
    let c = SyscallCount {
        tool: s("vm_syscalls")?,
        placement: s("placement")?,
        calls: n("calls")?,
        writes: n("writes")?,
        messages: n("messages")?,
    };
    (c.messages > 0.0).then_some(c)
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
    let syscalls = text
        .lines()
        .filter_map(|l| flat_object(&l[l.find('{')?..]))
        .filter_map(|o| syscall_count(&o))
        .collect();
    VmRun {
        info,
        results: parse_results(text),
        syscalls,
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

#[cfg(test)]
mod tests;
