//! `xdev-bench`: OSU-style latency and bandwidth of xdev devices, with the
//! cache-line and memcpy floors measured in the same run.
//!
//! With no arguments it runs latency and bandwidth on every device available
//! on this machine. See `--help`.

use std::process::ExitCode;

use xdev_bench::{
    bandwidth, bandwidth_iterations, cache_line_floor, latency, latency_iterations, memcpy_floor,
    osu, sizes, WINDOW,
};

const HELP: &str = "\
xdev-bench: OSU-style benchmarks of xdev devices, with floors from the same run

USAGE: xdev-bench [OPTIONS]

OPTIONS:
  --device NAME      device to measure (repeatable; default: every available device)
  --test TEST        latency | bw | all (default) | crossover (eager vs rendezvous by size)
  --max-size BYTES   largest message (default 4194304)
  --option K=V       device option, e.g. eager_limit=4096 (repeatable)
  --quick            a tenth of OSU's iterations (smoke runs)
  --json             one JSON record per size instead of OSU tables
  -h, --help         this text

Devices here: thread (ranks as threads, pinned to cores 0 and 1).
Columns: value, the floor measured in this run, and value/floor. For each size
the floor and the device are measured alternately, three rounds (one with
--quick), and the best of each is shown: OSU's average per round, best round.
Latency floor:
one-way cache-line hand-off between two pinned threads (lower is better, ratio
>= 1). Bandwidth floor: single-thread memcpy over the same working set (ratio
<= 1 is the fraction of a copy's speed achieved).";

struct Args {
    devices: Vec<String>,
    test: String,
    max_size: usize,
    options: Vec<(String, String)>,
    quick: bool,
    json: bool,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        devices: Vec::new(),
        test: "all".into(),
        max_size: 4 << 20,
        options: Vec::new(),
        quick: false,
        json: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        match arg.as_str() {
            "--device" => a.devices.push(value("--device")?),
            "--test" => a.test = value("--test")?,
            "--max-size" => {
                a.max_size = value("--max-size")?
                    .parse()
                    .map_err(|_| "--max-size takes a byte count".to_string())?
            }
            "--option" => {
                let kv = value("--option")?;
                let (k, v) = kv.split_once('=').ok_or("--option takes K=V")?;
                a.options.push((k.into(), v.into()));
            }
            "--quick" => a.quick = true,
            "--json" => a.json = true,
            "-h" | "--help" => {
                println!("{HELP}");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?} (see --help)")),
        }
    }
    if !["latency", "bw", "all", "crossover"].contains(&a.test.as_str()) {
        return Err(format!("unknown test {:?}", a.test));
    }
    if a.devices.is_empty() {
        a.devices.push("thread".into());
    }
    Ok(a)
}

fn scaled(quick: bool, (iters, skip): (usize, usize)) -> (usize, usize) {
    if quick {
        ((iters / 10).max(2), (skip / 10).max(1))
    } else {
        (iters, skip)
    }
}

fn world(a: &Args, extra: &[(&str, String)]) -> shm_ipc::ThreadWorld {
    let mut w = shm_ipc::ThreadWorld::new(2).pin(true);
    for (k, v) in &a.options {
        w = w.option(k, v);
    }
    for (k, v) in extra {
        w = w.option(k, v);
    }
    w
}

/// Rounds per size: floor and device are measured alternately this many
/// times and the best of each is kept, so that a neighbour's burst on this
/// shared machine hits both sides of a ratio alike.
fn rounds(a: &Args) -> usize {
    if a.quick {
        1
    } else {
        3
    }
}

fn rank0(out: Vec<xdev::Result<Option<f64>>>) -> Result<f64, String> {
    out.into_iter()
        .next()
        .ok_or("no ranks")?
        .map_err(|e| e.to_string())?
        .ok_or_else(|| "rank 0 gave no figure".to_string())
}

fn run_latency(a: &Args, device: &str) -> Result<(), String> {
    let floor_iters = if a.quick { 20_000 } else { 200_000 };
    if !a.json {
        let floor = cache_line_floor(floor_iters, 3);
        println!("{}", osu::latency_header(device, floor));
    }
    for size in sizes(a.max_size) {
        let (iters, skip) = scaled(a.quick, latency_iterations(size));
        let (mut us, mut floor) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..rounds(a) {
            floor = floor.min(cache_line_floor(floor_iters, 1));
            us = us.min(rank0(
                world(a, &[]).run(|dev| latency(dev, size, iters, skip)),
            )?);
        }
        if a.json {
            println!("{}", osu::json(device, "latency", size, us, "us", floor));
        } else {
            println!("{}", osu::row(size, us, floor));
        }
    }
    Ok(())
}

fn run_bandwidth(a: &Args, device: &str) -> Result<(), String> {
    if !a.json {
        println!("{}", osu::bandwidth_header(device));
    }
    for size in sizes(a.max_size).into_iter().filter(|&s| s > 0) {
        let (iters, skip) = scaled(a.quick, bandwidth_iterations(size));
        let (mut mbs, mut floor) = (0.0f64, 0.0f64);
        for _ in 0..rounds(a) {
            floor = floor.max(memcpy_floor(size, WINDOW, 1));
            mbs = mbs.max(rank0(
                world(a, &[]).run(|dev| bandwidth(dev, size, iters, skip)),
            )?);
        }
        if a.json {
            println!("{}", osu::json(device, "bw", size, mbs, "MB/s", floor));
        } else {
            println!("{}", osu::row(size, mbs, floor));
        }
    }
    Ok(())
}

/// Latency and bandwidth with every message forced eager, then forced
/// rendezvous: where the curves cross justifies the default `eager_limit`.
fn run_crossover(a: &Args, device: &str) -> Result<(), String> {
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
            let (iters, skip) = scaled(a.quick, latency_iterations(size));
            let us = rank0(world(a, &extra).run(|dev| latency(dev, size, iters, skip)))?;
            row.push_str(&format!("{us:>20.2}"));
            let (iters, skip) = scaled(a.quick, bandwidth_iterations(size));
            let mbs = rank0(world(a, &extra).run(|dev| bandwidth(dev, size, iters, skip)))?;
            bws.push_str(&format!("{mbs:>20.2}"));
        }
        println!("{row}{bws}");
        size *= 2;
    }
    Ok(())
}

fn main() -> ExitCode {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("xdev-bench: {e}");
            return ExitCode::from(2);
        }
    };
    for device in &a.devices {
        if device != "thread" {
            eprintln!("xdev-bench: device {device:?} is not available in this build");
            return ExitCode::from(2);
        }
        let r = match a.test.as_str() {
            "latency" => run_latency(&a, device),
            "bw" => run_bandwidth(&a, device),
            "crossover" => run_crossover(&a, device),
            _ => run_latency(&a, device).and_then(|_| {
                println!();
                run_bandwidth(&a, device)
            }),
        };
        if let Err(e) = r {
            eprintln!("xdev-bench: {device}: {e}");
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}
