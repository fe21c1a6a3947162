//! `xdev-rank`: one rank of a test job on any multi-process device of this
//! workspace, named by `XDEV_DEVICE` (`xdev-run --device NAME` sets it).
//!
//! ```text
//! xdev-rank conformance CASE [KEY=VALUE...]   run one xdev conformance case
//! ```
//! Exits 0 on success, 1 with a message on failure.

use std::process::ExitCode;

use xdev::conformance::{barrier, run_case};
use xdev::{Config, Device};

fn config(options: &[String]) -> Result<Config, String> {
    let mut cfg = xdev::bootstrap::config_from_env().map_err(|e| e.to_string())?;
    for kv in options {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| format!("option {kv:?} is not KEY=VALUE"))?;
        cfg = cfg.with(k, v);
    }
    Ok(cfg)
}

fn open(options: &[String]) -> Result<std::sync::Arc<dyn Device>, String> {
    let name = xdev::bootstrap::device_from_env()
        .ok_or("XDEV_DEVICE is not set (xdev-run --device NAME sets it)")?;
    let cfg = config(options)?;
    ibvx::registry()
        .open(&name, &cfg)
        .map_err(|e| format!("open {name}: {e}"))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let r = match args.first().map(String::as_str) {
        Some("conformance") if args.len() >= 2 => conformance(&args[1], &args[2..]),
        _ => Err("usage: xdev-rank conformance CASE [K=V...]".into()),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xdev-rank: {e}");
            ExitCode::FAILURE
        }
    }
}

fn conformance(case: &str, options: &[String]) -> Result<(), String> {
    let dev = open(options)?;
    run_case(&*dev, case).map_err(|f| f.to_string())?;
    // Everyone is done with the case before anyone closes its endpoint.
    barrier(&*dev).map_err(|e| format!("final barrier: {e}"))?;
    dev.finish().map_err(|e| format!("finish: {e}"))
}
