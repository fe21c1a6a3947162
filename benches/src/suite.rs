//! The tests of a run on one rig, printed as OSU tables (or JSON records):
//! per size the device and its floor, measured alternately, best of the
//! rounds; the floors alone; the eager/rendezvous crossover.

use xdev::Device;

use crate::cli::{floor_iters, rounds, Args};
use crate::rig::{rank0, world, Rig};
use crate::{
    bandwidth, bandwidth_iterations, bibandwidth, bibandwidth_window, latency, latency_iterations,
    mbw_pairs, message_rate, multi_bandwidth, osu, rate_floor,
};

mod psm_vs_raw;

pub(crate) use psm_vs_raw::run_psm_vs_raw;

/// The better of two figures where one side may have none (`None` is "not
/// measured on this rank").
pub(crate) fn best<T>(acc: Option<T>, x: Option<T>, better: fn(T, T) -> T) -> Option<T> {
    match (acc, x) {
        (Some(a), Some(x)) => Some(better(a, x)),
        (a, x) => a.or(x),
    }
}

/// Rank 0's figure, or the error that it gave none.
pub(crate) fn figure<T>(x: Option<T>) -> Result<T, String> {
    x.ok_or_else(|| "rank 0 gave no figure".to_string())
}

/// The latency test: per size, latency next to the cache-line floor
/// between the rig's ranks, measured alternately, best of the rounds.
fn run_latency(a: &Args, device: &str, rig: &dyn Rig) -> Result<(), String> {
    let iters = floor_iters(a);
    if !a.json {
        let floor = (0..3).fold(None, |f, _| best(f, rig.cache_line_floor(iters), f64::min));
        if rig.reports() {
            let floor = figure(floor)?;
            println!("{}", osu::latency_header(device, rig.placement(), floor));
        }
    }
    for size in a.sizes() {
        let (n, skip) = a.counts(latency_iterations(size));
        let (mut us, mut floor) = (None, None);
        for _ in 0..rounds(a) {
            floor = best(floor, rig.cache_line_floor(iters), f64::min);
            us = best(us, rig.run(&|dev| latency(dev, size, n, skip))?, f64::min);
        }
        if rig.reports() {
            let (us, floor) = (figure(us)?, figure(floor)?);
            if a.json {
                println!("{}", osu::json(device, "latency", size, us, "us", floor));
            } else {
                println!("{}", osu::row(size, us, floor));
            }
        }
    }
    Ok(())
}

/// The message rate test: per size, the rate of [`message_rate`] next to
/// its floor ([`rate_floor`] of the cache-line floor between the rig's
/// ranks), measured alternately, best of the rounds.
fn run_rate(a: &Args, device: &str, rig: &dyn Rig) -> Result<(), String> {
    let iters = floor_iters(a);
    if !a.json {
        let floor = (0..3).fold(None, |f, _| best(f, rig.cache_line_floor(iters), f64::min));
        if rig.reports() {
            let floor = figure(floor)?;
            println!("{}", osu::rate_header(device, rig.placement(), floor));
        }
    }
    for size in a.sizes().into_iter().filter(|&s| s > 0) {
        let (n, skip) = a.counts(bandwidth_iterations(size));
        let (mut rate, mut floor_us) = (None, None);
        for _ in 0..rounds(a) {
            floor_us = best(floor_us, rig.cache_line_floor(iters), f64::min);
            rate = best(
                rate,
                rig.run(&|dev| message_rate(dev, size, n, skip))?,
                f64::max,
            );
        }
        if rig.reports() {
            let (rate, floor) = (figure(rate)?, rate_floor(figure(floor_us)?));
            if a.json {
                println!("{}", osu::json(device, "rate", size, rate, "msg/s", floor));
            } else {
                println!("{}", osu::row(size, rate, floor));
            }
        }
    }
    Ok(())
}

/// The bandwidth-like tests: what each measures and prints.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum BwTest {
    /// osu_bw: one direction.
    Uni,
    /// osu_bibw: both directions at once.
    Bi,
    /// osu_bibw's exchange with the window calls (`isend_many`,
    /// `irecv_many`, `wait_all`).
    BiWindow,
    /// osu_mbw_mr: `pairs` pairs at once.
    Multi { pairs: usize },
}

impl BwTest {
    /// The test's name on the command line and in records.
    pub(crate) fn name(self) -> &'static str {
        match self {
            BwTest::Uni => "bw",
            BwTest::Bi => "bibw",
            BwTest::BiWindow => "bibw_window",
            BwTest::Multi { .. } => "mbw_mr",
        }
    }

    /// Concurrent copies of the memcpy floor: one per copy the test makes
    /// at once.
    fn copiers(self) -> usize {
        match self {
            BwTest::Uni => 1,
            BwTest::Bi | BwTest::BiWindow => 2,
            BwTest::Multi { pairs } => pairs,
        }
    }

    /// The header lines of the test's table.
    fn header(self, device: &str) -> String {
        match self {
            BwTest::Uni => osu::bandwidth_header(device),
            BwTest::Bi => osu::bibandwidth_header(device),
            BwTest::BiWindow => osu::bibandwidth_header(&format!("{device} (window calls)")),
            BwTest::Multi { pairs } => osu::multi_bandwidth_header(device, pairs),
        }
    }

    /// One run of the test on `dev`: MB/s on rank 0.
    pub(crate) fn measure(
        self,
        dev: &dyn Device,
        size: usize,
        n: usize,
        skip: usize,
    ) -> xdev::Result<Option<f64>> {
        match self {
            BwTest::Uni => bandwidth(dev, size, n, skip),
            BwTest::Bi => bibandwidth(dev, size, n, skip),
            BwTest::BiWindow => bibandwidth_window(dev, size, n, skip),
            BwTest::Multi { .. } => multi_bandwidth(dev, size, n, skip),
        }
    }

    /// One row (or JSON record) of the test's table.
    fn line(self, a: &Args, device: &str, size: usize, mbs: f64, floor: f64) -> String {
        match (self, a.json) {
            (BwTest::Multi { pairs }, true) => {
                osu::multi_bandwidth_json(device, size, mbs, floor, pairs)
            }
            (BwTest::Multi { .. }, false) => osu::multi_bandwidth_row(size, mbs, floor),
            (t, true) => osu::json(device, t.name(), size, mbs, "MB/s", floor),
            (_, false) => osu::row(size, mbs, floor),
        }
    }
}

/// A bandwidth-like test: per size, MB/s next to the memcpy floor with as
/// many copiers as the test copies at once, measured alternately, best of
/// the rounds.
fn run_bandwidth(a: &Args, device: &str, rig: &dyn Rig, test: BwTest) -> Result<(), String> {
    if !a.json && rig.reports() {
        println!("{}", test.header(device));
    }
    for size in a.sizes().into_iter().filter(|&s| s > 0) {
        let (n, skip) = a.counts(bandwidth_iterations(size));
        let (mut mbs, mut floor) = (None, None);
        for _ in 0..rounds(a) {
            floor = best(floor, rig.memcpy_floor(size, test.copiers()), f64::max);
            mbs = best(
                mbs,
                rig.run(&|dev| test.measure(dev, size, n, skip))?,
                f64::max,
            );
        }
        if rig.reports() {
            let (mbs, floor) = (figure(mbs)?, figure(floor)?);
            println!("{}", test.line(a, device, size, mbs, floor));
        }
    }
    Ok(())
}

/// The floors alone (`--test floor`): per size, the cache-line floor between
/// the rig's ranks and the memcpy floor, measured alternately.
pub(crate) fn run_floors(a: &Args, rig: &dyn Rig) -> Result<(), String> {
    if !a.json && rig.reports() {
        println!("{}", osu::floor_header(rig.placement()));
    }
    let iters = floor_iters(a);
    for size in a.sizes() {
        let (mut us, mut mbs) = (None, None);
        for _ in 0..rounds(a) {
            us = best(us, rig.cache_line_floor(iters), f64::min);
            mbs = best(mbs, rig.memcpy_floor(size, 1), f64::max);
        }
        if rig.reports() {
            let (us, mbs) = (figure(us)?, figure(mbs)?);
            if a.json {
                let p = rig.placement();
                println!("{}", osu::floor_json(p, "cache_line", size, us, "us"));
                println!("{}", osu::floor_json(p, "memcpy", size, mbs, "MB/s"));
            } else {
                println!("{}", osu::floor_row(size, us, mbs));
            }
        }
    }
    Ok(())
}

/// The tests `a.tests` names, in order, on `device` through `rig` (not
/// crossover; mbw_mr on the rig's ranks, the others on ranks 0 and 1).
pub(crate) fn run_tests(a: &Args, device: &str, rig: &dyn Rig, ranks: usize) -> Result<(), String> {
    for (i, t) in a.tests.iter().enumerate() {
        if i > 0 && !a.json && rig.reports() {
            println!();
        }
        match t.as_str() {
            "latency" => run_latency(a, device, rig)?,
            "bw" => run_bandwidth(a, device, rig, BwTest::Uni)?,
            "bibw" => run_bandwidth(a, device, rig, BwTest::Bi)?,
            "bibw_window" => run_bandwidth(a, device, rig, BwTest::BiWindow)?,
            "rate" => run_rate(a, device, rig)?,
            "mbw_mr" => run_bandwidth(
                a,
                device,
                rig,
                BwTest::Multi {
                    pairs: mbw_pairs(ranks),
                },
            )?,
            "floor" => run_floors(a, rig)?,
            // Measured beside raw PSM2 (`run_psm_vs_raw`) on psm; it has no
            // meaning on another device.
            "rate_split" if device == "psm" => {}
            "rate_split" => {
                if rig.reports() && !a.json {
                    println!("# rate_split: skipped on {device}: it splits the psm device's rate against raw PSM2");
                }
            }
            other => return Err(format!("test {other:?} does not run here")),
        }
    }
    Ok(())
}

/// Latency and bandwidth with every message forced eager, then forced
/// rendezvous: where the curves cross justifies the default `eager_limit`.
pub(crate) fn run_crossover(a: &Args, device: &str) -> Result<(), String> {
    println!("# Eager/rendezvous crossover on {device}: latency (us) and bandwidth (MB/s)");
    println!(
        "{:<10}{:>20}{:>20}{:>20}{:>20}",
        "# Size", "Eager lat", "Rndv lat", "Eager bw", "Rndv bw"
    );
    let mut size = 256;
    while size <= 32 << 10 {
        let mut row = format!("{size:<10}");
        let mut bws = String::new();
        for limit in [64 << 10, 0] {
            let extra = [
                ("eager_limit", limit.to_string()),
                ("ring_bytes", (256usize << 10).to_string()),
            ];
            let (iters, skip) = a.counts(latency_iterations(size));
            let us = rank0(world(a, 2, &extra).run(|dev| latency(dev, size, iters, skip)))?;
            row.push_str(&format!("{us:>20.2}"));
            let (iters, skip) = a.counts(bandwidth_iterations(size));
            let mbs = rank0(world(a, 2, &extra).run(|dev| bandwidth(dev, size, iters, skip)))?;
            bws.push_str(&format!("{mbs:>20.2}"));
        }
        println!("{row}{bws}");
        size *= 2;
    }
    Ok(())
}
