//! The machine a report was measured on ([`Machine`]), the date, and how
//! busy the machine was during the run ([`LoadSampler`]).

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The machine a report was measured on.
#[derive(Clone, Debug, PartialEq)]
pub struct Machine {
    /// Host name.
    pub host: String,
    /// CPU model (`/proc/cpuinfo`).
    pub cpu: String,
    /// Cores online.
    pub cores: usize,
    /// Kernel release.
    pub kernel: String,
    /// UTC date and time, `YYYY-MM-DD HH:MM UTC`.
    pub date: String,
    /// Load averages when the run started (`/proc/loadavg`, first three).
    pub load: String,
}

fn read_trimmed(path: &str) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
}

/// (year, month, day) of the day `days` after 1970-01-01 (proleptic
/// Gregorian; Howard Hinnant's `civil_from_days`).
pub fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// Now, as `(YYYY-MM-DD, HH:MM)` in UTC.
pub fn utc_now() -> (String, String) {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    let (y, m, d) = civil_from_days(secs.div_euclid(86_400));
    let t = secs.rem_euclid(86_400);
    (
        format!("{y:04}-{m:02}-{d:02}"),
        format!("{:02}:{:02}", t / 3600, t % 3600 / 60),
    )
}

impl Machine {
    /// This machine, now.
    pub fn here() -> Machine {
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split_once(':'))
                    .map(|(_, v)| v.trim().to_string())
            })
            .unwrap_or_else(|| "unknown".into());
        let (day, time) = utc_now();
        Machine {
            host: read_trimmed("/proc/sys/kernel/hostname").unwrap_or_else(|| "unknown".into()),
            cpu,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            kernel: read_trimmed("/proc/sys/kernel/osrelease").unwrap_or_else(|| "unknown".into()),
            date: format!("{day} {time} UTC"),
            load: read_trimmed("/proc/loadavg")
                .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
                .unwrap_or_else(|| "unknown".into()),
        }
    }
}

/// How often [`LoadSampler`] reads the load average.
pub const LOAD_SAMPLE_EVERY: Duration = Duration::from_secs(10);

/// Samples the 1-minute load average (`/proc/loadavg`) in a thread, every
/// [`LOAD_SAMPLE_EVERY`], until [`LoadSampler::finish`]: how busy the machine
/// was while a run measured.
pub struct LoadSampler {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Vec<f64>>,
}

impl LoadSampler {
    /// Starts sampling (the first sample at once).
    pub fn start() -> LoadSampler {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let stopped = || flag.load(std::sync::atomic::Ordering::Acquire);
            let mut samples = Vec::new();
            while !stopped() {
                if let Some(l) = read_trimmed("/proc/loadavg")
                    .and_then(|l| l.split_whitespace().next()?.parse().ok())
                {
                    samples.push(l);
                }
                let t = Instant::now();
                while t.elapsed() < LOAD_SAMPLE_EVERY && !stopped() {
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
            samples
        });
        LoadSampler { stop, thread }
    }

    /// Stops; the least and the most sampled, if any sample was taken.
    pub fn finish(self) -> Option<(f64, f64)> {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        let samples = self.thread.join().ok()?;
        let lo = samples.iter().copied().reduce(f64::min)?;
        let hi = samples.iter().copied().reduce(f64::max)?;
        Some((lo, hi))
    }
}

#[cfg(test)]
mod tests;
