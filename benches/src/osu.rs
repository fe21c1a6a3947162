//! OSU-style output: the header lines and rows of the OSU Micro-Benchmarks
//! tables, and the JSON records of `--json`.

/// The header lines of a latency table. `between` says whose cores the
/// cache-line floor joins (`"threads"` or `"processes"`).
pub fn latency_header(device: &str, between: &str, floor_us: f64) -> String {
    format!(
        "# OSU MPI Latency Test (xdev-bench)\n# Device: {device}; cache-line floor {floor_us:.3} us (two {between} pinned to cores 0 and 1)\n{:<10}{:>20}{:>20}{:>12}",
        "# Size", "Avg Latency(us)", "Floor(us)", "Ratio"
    )
}

/// The header lines of a bandwidth table.
pub fn bandwidth_header(device: &str) -> String {
    format!(
        "# OSU MPI Bandwidth Test (xdev-bench)\n# Device: {device}; floor = memcpy over the same working set\n{:<10}{:>20}{:>20}{:>12}",
        "# Size", "Bandwidth (MB/s)", "Floor(MB/s)", "Ratio"
    )
}

/// The header lines of a bidirectional bandwidth table (osu_bibw).
pub fn bibandwidth_header(device: &str) -> String {
    format!(
        "# OSU MPI Bi-Directional Bandwidth Test (xdev-bench)\n# Device: {device}; window size: {window}; floor = two concurrent memcpys (one per rank's core) over the same working set\n{:<10}{:>20}{:>20}{:>12}",
        "# Size", "Bandwidth (MB/s)", "Floor(MB/s)", "Ratio",
        window = crate::WINDOW
    )
}

/// The header lines of a multiple bandwidth / message rate table
/// (osu_mbw_mr): OSU's `MB/s` and `Messages/s` columns, then the floor
/// and MB/s over the floor.
pub fn multi_bandwidth_header(device: &str, pairs: usize) -> String {
    format!(
        "# OSU MPI Multiple Bandwidth / Message Rate Test (xdev-bench)\n# [ pairs: {pairs} ] [ window size: {window} ]\n# Device: {device}; floor = {pairs} concurrent memcpys (one per pair) over the same working set\n{:<10}{:>20}{:>20}{:>20}{:>12}",
        "# Size", "MB/s", "Messages/s", "Floor(MB/s)", "Ratio",
        window = crate::WINDOW
    )
}

/// The header lines of a message rate table (`--test rate`: osu_mbw_mr
/// with one pair): size, messages per second, the floor
/// ([`crate::rate_floor`] of the cache-line floor between the ranks'
/// cores, `between` being `"threads"` or `"processes"`) and the ratio.
pub fn rate_header(device: &str, between: &str, cache_line_us: f64) -> String {
    format!(
        "# OSU MPI Message Rate Test (xdev-bench)\n# [ pairs: 1 ] [ window size: {window} ]\n# Device: {device}; floor = one cache-line hand-off per message: 1 / {cache_line_us:.3} us (two {between} pinned to cores 0 and 1)\n{:<10}{:>20}{:>20}{:>12}",
        "# Size", "Messages/s", "Floor(msg/s)", "Ratio",
        window = crate::WINDOW
    )
}

/// One row of a multiple bandwidth / message rate table: size, MB/s,
/// messages per second, floor, MB/s over the floor.
pub fn multi_bandwidth_row(size: usize, mbs: f64, floor: f64) -> String {
    let ratio = if floor > 0.0 { mbs / floor } else { f64::NAN };
    format!(
        "{size:<10}{mbs:>20.2}{rate:>20.2}{floor:>20.2}{ratio:>12.2}",
        rate = message_rate(size, mbs)
    )
}

/// Messages per second of `size`-byte messages at `mbs` MB/s.
pub fn message_rate(size: usize, mbs: f64) -> f64 {
    if size == 0 {
        0.0
    } else {
        mbs * 1e6 / size as f64
    }
}

/// One JSON record of a multiple bandwidth / message rate run: the
/// [`json`] fields plus the pairs and messages per second.
pub fn multi_bandwidth_json(
    device: &str,
    size: usize,
    mbs: f64,
    floor: f64,
    pairs: usize,
) -> String {
    let base = json(device, "mbw_mr", size, mbs, "MB/s", floor);
    format!(
        "{},\"pairs\":{pairs},\"messages_per_s\":{:.2}}}",
        &base[..base.len() - 1],
        message_rate(size, mbs)
    )
}

/// The line saying a device was not measured, and why: an OSU comment
/// line, or with `json` a record `{"device":..,"not_measured":..}`.
pub fn not_measured(device: &str, reason: &str, json: bool) -> String {
    if json {
        serde_json::json!({"device": device, "not_measured": reason}).to_string()
    } else {
        let reason = reason.replace('\n', " ");
        format!("# Device: {device}: not measured: {reason}")
    }
}

/// `s` as the inside of a JSON string (`serde_json`'s escaping, without
/// the quotes), for the SVG and text writers that embed it.
pub fn escape(s: &str) -> String {
    let quoted = serde_json::Value::from(s).to_string();
    quoted[1..quoted.len() - 1].to_string()
}

/// One row: size left-aligned in 10 columns, values right-aligned in 20
/// with 2 decimals, then value/floor.
pub fn row(size: usize, value: f64, floor: f64) -> String {
    let ratio = if floor > 0.0 { value / floor } else { f64::NAN };
    format!("{size:<10}{value:>20.2}{floor:>20.2}{ratio:>12.2}")
}

/// The header lines of the floors table (`--test floor`).
pub fn floor_header(between: &str) -> String {
    format!(
        "# xdev-bench floors\n# Cache-line hand-off between two {between} pinned to cores 0 and 1; memcpy in one thread over the bandwidth test's working set\n{:<10}{:>20}{:>20}",
        "# Size", "Cache-line(us)", "memcpy(MB/s)"
    )
}

/// One row of the floors table.
pub fn floor_row(size: usize, cache_line_us: f64, memcpy_mbs: f64) -> String {
    format!("{size:<10}{cache_line_us:>20.3}{memcpy_mbs:>20.2}")
}

/// One JSON record of a floor measured alone; `between` is
/// `"threads"` or `"processes"`, `test` `"cache_line"` or `"memcpy"`.
pub fn floor_json(between: &str, test: &str, size: usize, value: f64, unit: &str) -> String {
    format!(
        "{{\"floor\":{},\"test\":{},\"size\":{size},\"value\":{value:.4},\"unit\":{}}}",
        string(between),
        string(test),
        string(unit)
    )
}

/// One JSON record.
pub fn json(device: &str, test: &str, size: usize, value: f64, unit: &str, floor: f64) -> String {
    format!(
        "{{\"device\":{},\"test\":{},\"size\":{size},\"value\":{value:.4},\"unit\":{},\"floor\":{floor:.4}}}",
        string(device),
        string(test),
        string(unit)
    )
}

/// `s` as a JSON string, quotes included (`serde_json`'s escaping). The
/// numbers of a record are written with `format!` so that they keep their
/// fixed decimals.
fn string(s: &str) -> String {
    serde_json::Value::from(s).to_string()
}

#[cfg(test)]
mod tests;
