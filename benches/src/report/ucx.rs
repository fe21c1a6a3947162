//! UCX as a peer of the report: `ucx_perftest` (Debian's `ucx-utils`)
//! `tag_lat` and `tag_bw` over shared memory, a server and a client on two
//! pinned cores, one pair of processes per test and size.
//!
//! `tag_lat` is a blocking pingpong of UCP tag-matched messages; its
//! latency is half the round trip, as osu_latency's. `tag_bw` is UCX's own
//! streaming loop: the client keeps tag sends in flight and the server
//! receives them, with no window of 64 and no acknowledgement per window as
//! in osu_bw and osu_mbw_mr; its bandwidth and message rate are taken as
//! this report's `bw` and `rate`, with that note ([`UCX_LOOP_NOTE`]).
//! `ucx_perftest` has no bi-directional test: UCX has no `bibw` line.

use std::fmt;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::measure::{run_captured, which};
use super::records::Record;

/// The series name of the UCX peer.
pub const UCX: &str = "UCX";

/// The program that measures it.
pub const UCX_PERFTEST: &str = "ucx_perftest";

/// How to install it on Debian.
pub const UCX_INSTALL: &str = "apt-get install ucx-utils";

/// The transports UCX may use: shared memory (posix, sysv, cma, knem,
/// xpmem, whichever are built) and loopback.
pub const UCX_TLS: &str = "shm,self";

/// What the report says of UCX's loops next to the OSU ones.
pub const UCX_LOOP_NOTE: &str = "UCX is `ucx_perftest` (UCP tag matching over shared memory, \
     `UCX_TLS=shm,self`, client on core 0 and server on core 1): latency is its `tag_lat` \
     pingpong (half the round trip, as osu_latency); bandwidth and messages/s are its \
     `tag_bw` loop, which differs from osu_bw and osu_mbw_mr: the client keeps sends in \
     flight continuously, with no window of 64 and no acknowledgement per window, and \
     reuses one buffer for every message (its MiB/s converted to MB/s). It has no \
     bi-directional test, so UCX has no bibw figure";

/// The figures of one `ucx_perftest -f -v` run (its CSV output's last row).
#[derive(Clone, Debug, PartialEq)]
pub struct PerftestFigures {
    /// Iterations (messages) measured.
    pub iterations: u64,
    /// The percentile latency (`-R`, 50 by default), us.
    pub typical_lat: f64,
    /// Average latency of the last report interval, us.
    pub avg_lat: f64,
    /// Latency over the whole run, us (half the round trip for `*_lat`).
    pub overall_lat: f64,
    /// Bandwidth of the last report interval, MiB/s (2^20 bytes).
    pub avg_bw: f64,
    /// Bandwidth over the whole run, MiB/s (2^20 bytes).
    pub overall_bw: f64,
    /// Message rate of the last report interval, messages/s.
    pub avg_mr: f64,
    /// Message rate over the whole run, messages/s.
    pub overall_mr: f64,
}

/// Why `ucx_perftest`'s output gave no figures.
#[derive(Clone, Debug, PartialEq)]
pub enum PerftestError {
    /// No CSV header (`iterations,...,overall_mr`): not run with `-v`, or
    /// it failed before measuring.
    NoHeader,
    /// The header lacks a column the report needs.
    MissingColumn(&'static str),
    /// A header but no row of figures after it.
    NoFigures,
    /// A field of the figures row is not a number.
    BadField {
        /// The column's name.
        column: String,
        /// What it held.
        value: String,
    },
}

impl fmt::Display for PerftestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PerftestError::NoHeader => write!(f, "no CSV header in ucx_perftest's output"),
            PerftestError::MissingColumn(c) => {
                write!(f, "ucx_perftest's CSV header has no column {c}")
            }
            PerftestError::NoFigures => write!(f, "ucx_perftest printed no figures"),
            PerftestError::BadField { column, value } => {
                write!(f, "ucx_perftest's {column} is not a number: {value:?}")
            }
        }
    }
}

impl std::error::Error for PerftestError {}

/// Parses the output of `ucx_perftest -f -v` (CSV: a header naming the
/// columns, then rows of figures; batch runs put test names before them,
/// and UCX's log lines may come between): the last row with as many fields
/// as the header.
pub fn parse_perftest(text: &str) -> Result<PerftestFigures, PerftestError> {
    let mut lines = text.lines().map(str::trim);
    let header: Vec<&str> = lines
        .by_ref()
        .find(|l| {
            let f: Vec<&str> = l.split(',').map(str::trim).collect();
            f.contains(&"iterations") && f.contains(&"overall_mr")
        })
        .ok_or(PerftestError::NoHeader)?
        .split(',')
        .map(str::trim)
        .collect();
    let col = |name: &'static str| {
        header
            .iter()
            .position(|c| *c == name)
            .ok_or(PerftestError::MissingColumn(name))
    };
    let typical = header
        .iter()
        .position(|c| c.ends_with("_percentile_lat"))
        .ok_or(PerftestError::MissingColumn("<rank>_percentile_lat"))?;
    let cols = [
        col("iterations")?,
        typical,
        col("avg_lat")?,
        col("overall_lat")?,
        col("avg_bw")?,
        col("overall_bw")?,
        col("avg_mr")?,
        col("overall_mr")?,
    ];
    let row: Vec<&str> = lines
        .map(|l| l.split(',').map(str::trim).collect::<Vec<_>>())
        .rfind(|f| f.len() == header.len() && f[cols[0]].parse::<u64>().is_ok())
        .ok_or(PerftestError::NoFigures)?;
    let num = |i: usize| -> Result<f64, PerftestError> {
        let v = row[cols[i]];
        v.parse::<f64>()
            .ok()
            .filter(|x| x.is_finite() && *x >= 0.0)
            .ok_or_else(|| PerftestError::BadField {
                column: header[cols[i]].to_string(),
                value: v.to_string(),
            })
    };
    Ok(PerftestFigures {
        iterations: row[cols[0]].parse().map_err(|_| PerftestError::NoFigures)?,
        typical_lat: num(1)?,
        avg_lat: num(2)?,
        overall_lat: num(3)?,
        avg_bw: num(4)?,
        overall_bw: num(5)?,
        avg_mr: num(6)?,
        overall_mr: num(7)?,
    })
}

/// A `ucx_perftest` test of the report.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum UcxTest {
    /// `tag_lat`: the report's latency.
    TagLat,
    /// `tag_bw`: the report's bw and rate.
    TagBw,
}

impl UcxTest {
    fn name(self) -> &'static str {
        match self {
            UcxTest::TagLat => "tag_lat",
            UcxTest::TagBw => "tag_bw",
        }
    }

    /// (iterations, warm-up): OSU's counts (latency: 10000 and 100 up to 8
    /// KiB, 1000 and 10 above; bandwidth: 100 and 10 windows of 64
    /// messages, 20 above 8 KiB with xdev-bench's longer warm-up,
    /// [`large_warm_up`](crate::large_warm_up) windows; here counted in
    /// messages), a tenth with `quick`.
    pub fn iterations(self, size: usize, quick: bool) -> (usize, usize) {
        let large = size > 8192;
        let (n, w) = match (self, large) {
            (UcxTest::TagLat, false) => (10_000, 100),
            (UcxTest::TagLat, true) => (1000, 10),
            (UcxTest::TagBw, false) => (64 * 100, 64 * 10),
            (UcxTest::TagBw, true) => (64 * 20, 64 * crate::large_warm_up(size)),
        };
        if quick {
            ((n / 10).max(2), (w / 10).max(1))
        } else {
            (n, w)
        }
    }
}

/// The report's records of one run's figures: `tag_lat` gives latency
/// (overall, us), `tag_bw` gives bw (overall, MiB/s as MB/s: × 1.048576)
/// and rate (overall, messages/s). Floors are 0: the report divides by the
/// floors measured in the same run.
pub fn records_of(test: UcxTest, size: usize, f: &PerftestFigures) -> Vec<Record> {
    let rec = |test: &str, value: f64, unit: &str| Record {
        device: UCX.into(),
        test: test.into(),
        size,
        value,
        unit: unit.into(),
        floor: 0.0,
    };
    match test {
        UcxTest::TagLat => vec![rec("latency", f.overall_lat, "us")],
        UcxTest::TagBw => vec![
            rec("bw", f.overall_bw * 1.048576, "MB/s"),
            rec("rate", f.overall_mr, "msg/s"),
        ],
    }
}

/// The server's arguments: pinned to core 1, on `port`.
fn server_args(port: u16) -> Vec<String> {
    ["-c", "1", "-p", &port.to_string()]
        .map(String::from)
        .to_vec()
}

/// The client's arguments: pinned to core 0, the test, one message of
/// `size` bytes, the counts, final figures only as CSV.
pub fn client_args(port: u16, test: UcxTest, size: usize, quick: bool) -> Vec<String> {
    let (n, w) = test.iterations(size, quick);
    let mut a: Vec<String> = ["127.0.0.1", "-p", &port.to_string(), "-c", "0", "-t"]
        .map(String::from)
        .to_vec();
    a.push(test.name().into());
    for (k, v) in [("-s", size), ("-n", n), ("-w", w)] {
        a.push(k.into());
        a.push(v.to_string());
    }
    a.push("-f".into());
    a.push("-v".into());
    a
}

/// A free TCP port on the loopback (the kernel's choice, released at once).
fn free_port() -> Result<u16, String> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free TCP port: {e}"))
}

/// Whether something listens on TCP `port` (from `/proc/net/tcp`; state
/// 0A is LISTEN).
fn listening(port: u16) -> bool {
    let want = format!(":{port:04X}");
    std::fs::read_to_string("/proc/net/tcp")
        .map(|t| {
            t.lines().skip(1).any(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                f.len() > 3 && f[1].ends_with(&want) && f[3] == "0A"
            })
        })
        .unwrap_or(false)
}

/// Waits until `server` listens on `port`; `Err` if it exits or 20 s pass.
fn await_server(server: &mut Child, port: u16) -> Result<(), String> {
    let start = Instant::now();
    while !listening(port) {
        if let Ok(Some(st)) = server.try_wait() {
            return Err(format!("ucx_perftest server exited at start ({st})"));
        }
        if start.elapsed() > Duration::from_secs(20) {
            return Err("ucx_perftest server did not listen within 20 s".into());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

/// One server and client pair of `exe` (`ucx_perftest`) for `test` at
/// `size`: the client's figures.
pub fn run_pair(
    exe: &Path,
    test: UcxTest,
    size: usize,
    quick: bool,
) -> Result<PerftestFigures, String> {
    let port = free_port()?;
    let mut server = Command::new(exe)
        .args(server_args(port))
        .env("UCX_TLS", UCX_TLS)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", exe.display()))?;
    let out = await_server(&mut server, port).and_then(|()| {
        let mut client = Command::new(exe);
        client
            .args(client_args(port, test, size, quick))
            .env("UCX_TLS", UCX_TLS);
        let (out, r) = run_captured(&mut client, Duration::from_secs(300), |_| {});
        r.map(|()| out)
    });
    // The server ends with its client; it is stopped if it does not.
    let deadline = Instant::now() + Duration::from_secs(10);
    while matches!(server.try_wait(), Ok(None)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = server.kill();
    let _ = server.wait();
    let out = out.map_err(|e| format!("{} {} -s {size}: {e}", UCX_PERFTEST, test.name()))?;
    parse_perftest(&out).map_err(|e| format!("{} {} -s {size}: {e}", UCX_PERFTEST, test.name()))
}

/// The UCX peer: `tag_lat` at 0 bytes and `tag_lat` and `tag_bw` at every
/// power of two from 1 byte to `max_size`, `rounds` times (the report keeps each size's best). Its
/// records and a note on how, or why it was not measured. Sizes whose runs
/// failed are left out and named in the note.
pub fn measure_ucx(
    max_size: usize,
    rounds: usize,
    quick: bool,
) -> Result<(Vec<Record>, String), String> {
    measure_ucx_at(which(UCX_PERFTEST), max_size, rounds, quick)
}

/// [`measure_ucx`] with `ucx_perftest` at `exe` (`None`: not installed).
fn measure_ucx_at(
    exe: Option<PathBuf>,
    max_size: usize,
    rounds: usize,
    quick: bool,
) -> Result<(Vec<Record>, String), String> {
    let exe = exe.ok_or_else(|| {
        format!("UCX is not installed (no {UCX_PERFTEST} on PATH; install with `{UCX_INSTALL}`)")
    })?;
    let mut records = Vec::new();
    let mut failed = Vec::new();
    for _ in 0..rounds.max(1) {
        for test in [UcxTest::TagLat, UcxTest::TagBw] {
            for size in sizes(test, max_size) {
                match run_pair(&exe, test, size, quick) {
                    Ok(f) => records.extend(records_of(test, size, &f)),
                    Err(e) => {
                        eprintln!("report: UCX: {e}");
                        failed.push(format!("{} {size} B", test.name()));
                    }
                }
            }
        }
    }
    if records.is_empty() {
        return Err(format!(
            "{UCX_PERFTEST} gave no figures ({})",
            failed.first().map_or("no sizes", String::as_str)
        ));
    }
    let mut how = format!(
        "{}; `UCX_TLS={UCX_TLS} {UCX_PERFTEST} -c 1` and `{UCX_PERFTEST} 127.0.0.1 -c 0 -t \
         tag_lat|tag_bw -s SIZE -n N -w W -f -v`, {} round(s), the best kept",
        version(&exe).unwrap_or_else(|| "version unknown".into()),
        rounds.max(1)
    );
    if !failed.is_empty() {
        how.push_str(&format!("; runs that failed: {}", failed.join(", ")));
    }
    Ok((records, how))
}

/// The sizes of `test` up to `max_size`: 0 (latency only), then the powers
/// of two, as the OSU loops.
pub fn sizes(test: UcxTest, max_size: usize) -> Vec<usize> {
    let first = (test == UcxTest::TagLat).then_some(0);
    first
        .into_iter()
        .chain(std::iter::successors(Some(1usize), |s| s.checked_mul(2)))
        .take_while(|&s| s <= max_size)
        .collect()
}

/// UCX's version, from `ucx_info -v` beside `ucx_perftest`.
fn version(perftest: &Path) -> Option<String> {
    let info = perftest.with_file_name("ucx_info");
    let out = Command::new(info)
        .arg("-v")
        .stdin(Stdio::null())
        .output()
        .ok()?;
    version_of(&String::from_utf8_lossy(&out.stdout))
}

/// The version in `ucx_info -v`'s output (`# Version 1.13.1`).
pub fn version_of(text: &str) -> Option<String> {
    text.lines()
        .find_map(|l| l.trim().strip_prefix("# Version"))
        .map(|v| format!("UCX {}", v.trim()))
}

#[cfg(test)]
mod tests;
