//! Statistics and output, computed and laid out as perftest does.

use std::fmt::Write as _;

/// Samples perftest drops from the top of the sorted latency samples before
/// computing the median, mean and percentiles (`LAT_MEASURE_TAIL`).
pub const LAT_MEASURE_TAIL: usize = 2;

/// The dashed line around perftest's tables.
pub const RESULT_LINE: &str =
    "---------------------------------------------------------------------------------------";

/// Header of the latency table (perftest's `RESULT_FMT_LAT`).
pub const LAT_HEADER: &str = " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] ";

/// Header of the bandwidth table (perftest's `RESULT_FMT`); MB is 2^20 bytes.
pub const BW_HEADER: &str =
    " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]";

/// One latency result, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatencyStats {
    /// Smallest sample.
    pub min: f64,
    /// Largest sample kept (perftest's `t_max`: the tail of
    /// [`LAT_MEASURE_TAIL`] samples minus one is left out).
    pub max: f64,
    /// Median ("typical").
    pub typical: f64,
    /// Mean.
    pub avg: f64,
    /// Standard deviation (computed in floating point; perftest truncates
    /// each deviation to an integer).
    pub stdev: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p99_9: f64,
}

/// Latency from the post timestamps of a pingpong (`stamps[i]` is when
/// iteration `i` posted, in cycles): samples are the differences between
/// consecutive posts (one round trip each) divided by two, as perftest's
/// `print_report_lat` does. `None` with fewer than 2 samples.
pub fn latency_stats(stamps: &[u64], cycles_per_us: f64) -> Option<LatencyStats> {
    let mut d: Vec<u64> = stamps
        .windows(2)
        .map(|w| w[1].saturating_sub(w[0]))
        .collect();
    if d.len() < 2 || cycles_per_us <= 0.0 {
        return None;
    }
    d.sort_unstable();
    let n = d.len();
    let m = if n > LAT_MEASURE_TAIL + 1 {
        n - LAT_MEASURE_TAIL
    } else {
        n
    };
    let us = |c: u64| c as f64 / cycles_per_us / 2.0;
    // perftest's get_median(m, delta): integer mean of the two middle samples.
    let median = if (m - 1) % 2 != 0 {
        (d[m / 2] + d[m / 2 - 1]) / 2
    } else {
        d[m / 2]
    };
    let avg = d[..m].iter().map(|&c| us(c)).sum::<f64>() / m as f64;
    let var = d[..m].iter().map(|&c| (us(c) - avg).powi(2)).sum::<f64>() / m as f64;
    let at = |q: f64| d[((m as f64 * q).ceil() as usize).min(n - 1)];
    Some(LatencyStats {
        min: us(d[0]),
        max: us(d[m.min(n - 1)]),
        typical: us(median),
        avg,
        stdev: var.sqrt(),
        p99: us(at(0.99)),
        p99_9: us(at(0.999)),
    })
}

/// One bandwidth result.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BwStats {
    /// Best rate over any run of consecutive messages, MiB/s.
    pub peak: f64,
    /// Average rate from the first post to the last completion, MiB/s.
    pub avg: f64,
    /// Messages per second, in millions.
    pub msg_rate: f64,
}

/// Bandwidth as perftest's `print_report_bw` computes it. `posted[i]` is
/// when message `i` was posted; `completed` holds `(j, t)`: messages up to
/// `j` were complete at `t` (one entry per signaled completion), all in
/// cycles. The average runs from the first post to the last completion;
/// the peak is the best `(j - i + 1) * size / (t_j - posted[i])`.
pub fn bw_stats(
    size: usize,
    posted: &[u64],
    completed: &[(usize, u64)],
    cycles_per_us: f64,
) -> Option<BwStats> {
    let &(last_j, last_t) = completed.last()?;
    let first = *posted.first()?;
    if cycles_per_us <= 0.0 || last_t <= first {
        return None;
    }
    let mib = (1u64 << 20) as f64;
    let cycles_per_s = cycles_per_us * 1e6;
    let n = (last_j + 1) as f64;
    let secs = (last_t - first) as f64 / cycles_per_s;
    // The exact search is O(posts x completions); bound the work on huge runs.
    let span = if posted.len().saturating_mul(completed.len()) > 20_000_000 {
        4096
    } else {
        usize::MAX
    };
    let mut best = 0.0f64;
    for &(j, t) in completed {
        for (i, &p) in posted
            .iter()
            .enumerate()
            .take(j + 1)
            .skip(j.saturating_sub(span))
        {
            if t > p {
                best = best.max((j - i + 1) as f64 / ((t - p) as f64 / cycles_per_s));
            }
        }
    }
    Some(BwStats {
        peak: best * size as f64 / mib,
        avg: n * size as f64 / secs / mib,
        msg_rate: n / secs / 1e6,
    })
}

/// A latency row in perftest's `REPORT_FMT_LAT` layout.
pub fn latency_row(size: usize, iters: u64, s: &LatencyStats) -> String {
    format!(
        " {:<7} {}          {:<7.2}        {:<7.2}      {:<7.2}  \t       {:<7.2}     \t{:<7.2}\t\t{:<7.2} \t\t{:<7.2}",
        size, iters, s.min, s.max, s.typical, s.avg, s.stdev, s.p99, s.p99_9
    )
}

/// A bandwidth row in perftest's `REPORT_FMT` layout.
pub fn bw_row(size: u64, iters: u64, s: &BwStats) -> String {
    format!(
        " {:<7}    {:<10}       {:<7.2}            {:<7.2}\t\t   {:<7.6}",
        size, iters, s.peak, s.avg, s.msg_rate
    )
}

/// A JSON number, or `null` when not finite.
fn num(v: f64) -> String {
    if v.is_finite() {
        format!("{v:.4}")
    } else {
        "null".into()
    }
}

/// A JSON string literal.
pub fn json_str(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

/// Fields common to every JSON record.
#[derive(Debug, Clone)]
pub struct RecordContext {
    /// Test name.
    pub test: String,
    /// `client` or `server`.
    pub role: String,
    /// `ibvx-pingpong` or `perftest`.
    pub peer: String,
    /// Device name.
    pub device: String,
}

impl RecordContext {
    fn prefix(&self) -> String {
        format!(
            "{{\"tool\":\"ibvx-pingpong\",\"test\":{},\"role\":{},\"peer\":{},\"device\":{}",
            json_str(&self.test),
            json_str(&self.role),
            json_str(&self.peer),
            json_str(&self.device)
        )
    }

    /// A latency record (microseconds).
    pub fn latency_json(&self, size: usize, iters: u64, s: &LatencyStats) -> String {
        format!(
            "{},\"bytes\":{size},\"iterations\":{iters},\"t_min_us\":{},\"t_max_us\":{},\"t_typical_us\":{},\"t_avg_us\":{},\"t_stdev_us\":{},\"t_p99_us\":{},\"t_p99_9_us\":{}}}",
            self.prefix(),
            num(s.min),
            num(s.max),
            num(s.typical),
            num(s.avg),
            num(s.stdev),
            num(s.p99),
            num(s.p99_9)
        )
    }

    /// A bandwidth record (MiB/s, as perftest's MB/sec; Mpps).
    pub fn bw_json(&self, size: u64, iters: u64, s: &BwStats) -> String {
        format!(
            "{},\"bytes\":{size},\"iterations\":{iters},\"bw_peak_mib_s\":{},\"bw_avg_mib_s\":{},\"msg_rate_mpps\":{}}}",
            self.prefix(),
            num(s.peak),
            num(s.avg),
            format_args!("{:.6}", if s.msg_rate.is_finite() { s.msg_rate } else { 0.0 })
        )
    }
}

#[cfg(test)]
mod tests;
