//! The psm device against raw PSM2 calls on its own endpoint ([`crate::psm_raw`]),
//! measured alternately per size, best of the rounds: the device's overhead
//! over PSM2 (ratio device/raw: above 1 for latency and below 1 for
//! bandwidth means the device costs something). Records of the series
//! `psm-vs-raw`: value = the device, floor = raw PSM2.

use ibvx::psm::RawPsm;
use xdev::Rank;

use super::{best, figure, BwTest};
use crate::cli::{rounds, Args};
use crate::{
    bandwidth_iterations, latency, latency_iterations, message_rate, osu, psm_raw, WINDOW,
};

/// What each comparison needs: the run, the device, its raw handles, and
/// whether this rank prints.
struct Peer<'a> {
    a: &'a Args,
    psm: &'a ibvx::PsmDevice,
    raw: RawPsm,
    rank: Rank,
    report: bool,
}

fn e(e: xdev::Error) -> String {
    e.to_string()
}

/// The psm device against raw PSM2 calls on its own endpoint: the latency,
/// bandwidth, bidirectional bandwidth and message rate tables the run asks
/// for, in that order.
pub(crate) fn run_psm_vs_raw(a: &Args, psm: &ibvx::PsmDevice, rank: Rank) -> Result<(), String> {
    // SAFETY: the benchmark alternates strictly: no device operation runs or
    // is outstanding while the raw loops run (each completes all it starts),
    // and the raw loops use their own context.
    let raw = unsafe { psm.raw_handles() };
    let peer = Peer {
        a,
        psm,
        raw,
        rank,
        report: rank == 0,
    };
    if a.has("latency") {
        peer.latency()?;
    }
    for test in [BwTest::Uni, BwTest::Bi] {
        if a.has(test.name()) {
            peer.bandwidth(test)?;
        }
    }
    if a.has("rate") {
        peer.rate()?;
    }
    if a.has("rate_split") {
        peer.rate_split()?;
    }
    Ok(())
}

impl Peer<'_> {
    /// The latency table: device and raw PSM2 per size.
    fn latency(&self) -> Result<(), String> {
        let (a, psm, raw, rank, report) = (self.a, self.psm, &self.raw, self.rank, self.report);
        if report && !a.json {
            println!(
                "\n# OSU MPI Latency Test (xdev-bench)\n# Device: psm against raw PSM2 MQ calls on the same endpoint (the floor column)\n{:<10}{:>20}{:>20}{:>12}",
                "# Size", "Avg Latency(us)", "Raw PSM2(us)", "Ratio"
            );
        }
        for size in a.sizes() {
            let (n, skip) = a.counts(latency_iterations(size));
            let (mut dev_us, mut raw_us) = (None, None);
            for _ in 0..rounds(a) {
                raw_us = best(
                    raw_us,
                    psm_raw::latency(raw, rank, size, n, skip).map_err(e)?,
                    f64::min,
                );
                dev_us = best(dev_us, latency(psm, size, n, skip).map_err(e)?, f64::min);
            }
            if report {
                let (d, r) = (figure(dev_us)?, figure(raw_us)?);
                if a.json {
                    println!("{}", osu::json("psm-vs-raw", "latency", size, d, "us", r));
                } else {
                    println!("{}", osu::row(size, d, r));
                }
            }
        }
        Ok(())
    }

    /// The bandwidth (`bw`) or bidirectional bandwidth (`bibw`) table.
    fn bandwidth(&self, test: BwTest) -> Result<(), String> {
        let (a, psm, raw, rank, report) = (self.a, self.psm, &self.raw, self.rank, self.report);
        if report && !a.json {
            let title = match test {
                BwTest::Bi => "Bi-Directional Bandwidth",
                _ => "Bandwidth",
            };
            println!(
                "\n# OSU MPI {title} Test (xdev-bench)\n# Device: psm against raw PSM2 MQ calls on the same endpoint (the floor column)\n{:<10}{:>20}{:>20}{:>12}",
                "# Size", "Bandwidth (MB/s)", "Raw PSM2(MB/s)", "Ratio"
            );
        }
        for size in a.sizes().into_iter().filter(|&s| s > 0) {
            let (n, skip) = a.counts(bandwidth_iterations(size));
            let (mut dev_mbs, mut raw_mbs) = (None, None);
            for _ in 0..rounds(a) {
                let r = match test {
                    BwTest::Bi => psm_raw::bibandwidth(raw, rank, size, n, skip),
                    _ => psm_raw::bandwidth(raw, rank, size, n, skip),
                };
                raw_mbs = best(raw_mbs, r.map_err(e)?, f64::max);
                let d = test.measure(psm, size, n, skip).map_err(e)?;
                dev_mbs = best(dev_mbs, d, f64::max);
            }
            if report {
                let (d, r) = (figure(dev_mbs)?, figure(raw_mbs)?);
                if a.json {
                    println!(
                        "{}",
                        osu::json("psm-vs-raw", test.name(), size, d, "MB/s", r)
                    );
                } else {
                    println!("{}", osu::row(size, d, r));
                }
            }
        }
        Ok(())
    }

    /// The message rate table.
    fn rate(&self) -> Result<(), String> {
        let (a, psm, raw, rank, report) = (self.a, self.psm, &self.raw, self.rank, self.report);
        if report && !a.json {
            println!(
                "\n# OSU MPI Message Rate Test (xdev-bench)\n# [ pairs: 1 ] [ window size: {WINDOW} ]\n# Device: psm against raw PSM2 MQ calls on the same endpoint (the floor column)\n{:<10}{:>20}{:>20}{:>12}",
                "# Size", "Messages/s", "Raw PSM2(msg/s)", "Ratio"
            );
        }
        for size in a.sizes().into_iter().filter(|&s| s > 0) {
            let (n, skip) = a.counts(bandwidth_iterations(size));
            let (mut dev_rate, mut raw_rate) = (None, None);
            for _ in 0..rounds(a) {
                let r = psm_raw::rate(raw, rank, size, n, skip).map_err(e)?;
                raw_rate = best(raw_rate, r, f64::max);
                let d = message_rate(psm, size, n, skip).map_err(e)?;
                dev_rate = best(dev_rate, d, f64::max);
            }
            if report {
                let (d, r) = (figure(dev_rate)?, figure(raw_rate)?);
                if a.json {
                    println!("{}", osu::json("psm-vs-raw", "rate", size, d, "msg/s", r));
                } else {
                    println!("{}", osu::row(size, d, r));
                }
            }
        }
        Ok(())
    }

    /// The message rate with one side through the device and the other raw
    /// PSM2 ([`psm_raw::split_rate`]), each beside raw PSM2 on both sides,
    /// in one run: the side whose rate stays near raw's is not the one that
    /// holds the device back. Each row also has the receiving rank's time
    /// per message posting receives and waiting for them (best round's).
    fn rate_split(&self) -> Result<(), String> {
        let (a, psm, raw, report) = (self.a, self.psm, &self.raw, self.report);
        if report && !a.json {
            println!(
                "\n# Message rate of the psm device split by side [ window size: {WINDOW} ]\n# Each side through the device against raw PSM2 on the other (the floor column: raw on both);\n# the receiving rank's ns per message posting receives and waiting for them\n{:<10}{:<22}{:>16}{:>20}{:>8}{:>12}{:>12}",
                "# Size", "Through the device", "Messages/s", "Raw PSM2(msg/s)", "Ratio", "Post(ns)", "Wait(ns)"
            );
        }
        let sides = [
            (psm_raw::DeviceSide::Sender, "sender", "rate_send"),
            (psm_raw::DeviceSide::Receiver, "receiver", "rate_recv"),
        ];
        // The best round of each loop (by rate), with its phases.
        type Best = Option<(f64, psm_raw::ReceiverPhases)>;
        let faster = |a: (f64, _), b: (f64, _)| if a.0 >= b.0 { a } else { b };
        for size in a.sizes().into_iter().filter(|&s| s > 0) {
            let (n, skip) = a.counts(bandwidth_iterations(size));
            let mut raw_best: Best = None;
            let mut split: [Best; 2] = [None, None];
            for _ in 0..rounds(a) {
                let r = psm_raw::rate_with_phases(raw, (size, n, skip)).map_err(e)?;
                raw_best = best(raw_best, r, faster);
                for (kept, (side, ..)) in split.iter_mut().zip(sides) {
                    let d = psm_raw::split_rate(raw, psm, side, (size, n, skip)).map_err(e)?;
                    *kept = best(*kept, d, faster);
                }
            }
            if !report {
                continue;
            }
            let (r, rp) = figure(raw_best)?;
            let row = |name: &str, d: f64, p: psm_raw::ReceiverPhases| {
                println!(
                    "{:<10}{:<22}{:>16.2}{:>20.2}{:>8.2}{:>12.1}{:>12.1}",
                    size,
                    name,
                    d,
                    r,
                    d / r,
                    p.post_ns,
                    p.wait_ns
                )
            };
            if !a.json {
                row("neither (raw PSM2)", r, rp);
            }
            for (kept, (_, name, test)) in split.into_iter().zip(sides) {
                let (d, p) = figure(kept)?;
                if !a.json {
                    row(name, d, p);
                    continue;
                }
                println!("{}", osu::json("psm-vs-raw", test, size, d, "msg/s", r));
                if test == "rate_recv" {
                    let (post, wait) = ("rate_recv_post", "rate_recv_wait");
                    println!(
                        "{}",
                        osu::json("psm-vs-raw", post, size, p.post_ns, "ns", rp.post_ns)
                    );
                    println!(
                        "{}",
                        osu::json("psm-vs-raw", wait, size, p.wait_ns, "ns", rp.wait_ns)
                    );
                }
            }
        }
        Ok(())
    }
}
