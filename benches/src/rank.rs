//! One rank of a launched job (`XDEV_RANK` or a PMI rank is set): the
//! device it measures, the run on it ([`rank_main`]), and its exit status
//! ([`rank_status`]).

use std::sync::Arc;

use xdev::bootstrap::{self, Bootstrap};
use xdev::registry::{Placement, Registry};
use xdev::Device;

use crate::cli::Args;
use crate::launch::{tell_reason, Failure, UNAVAILABLE};
use crate::process::{DeviceCoordinator, ProcessFloor};
use crate::rig::ProcessRig;
use crate::suite::{run_floors, run_psm_vs_raw, run_tests};

/// The device a rank measures: `XDEV_DEVICE` (set by `xdev-run --device`),
/// else the one `--device`.
fn rank_device(a: &Args, from_env: Option<String>) -> Result<String, String> {
    match (from_env, a.devices.as_slice()) {
        (Some(d), named) if named.is_empty() || named.contains(&d) => Ok(d),
        (Some(d), named) => Err(format!(
            "{} names {d:?} but --device names {}",
            bootstrap::XDEV_DEVICE,
            named.join(", ")
        )),
        (None, [d]) => Ok(d.clone()),
        (None, []) => Err(format!(
            "name the device to measure: --device NAME, or xdev-run --device NAME (sets {})",
            bootstrap::XDEV_DEVICE
        )),
        (None, named) => Err(format!(
            "one rank measures one device, not {} (or set {})",
            named.join(", "),
            bootstrap::XDEV_DEVICE
        )),
    }
}

/// One rank of a launched job (`XDEV_RANK` is set): pins itself to core
/// `rank`, sets the process floor up, opens the device unless measuring the
/// floors alone, and runs the tests; rank 0 prints.
pub fn rank_main(a: &Args, reg: &Registry) -> Result<(), Failure> {
    let fail = |e: String| Failure::Exit(e, 1);
    let mut config = bootstrap::config_from_env().map_err(|e| fail(e.to_string()))?;
    if config.size < 2 {
        return Err(fail(format!(
            "process mode needs at least 2 ranks, {}={}",
            bootstrap::XDEV_SIZE,
            config.size
        )));
    }
    let rank = config.rank;
    // Best effort, as for the thread ranks: an unpinned rank still measures.
    let _ = shm_ipc::futex::pin_current_thread(rank);
    if a.only("floor") {
        // No device: the bootstrap connection is this program's to use.
        let boot = Bootstrap::from_env().map_err(|e| fail(e.to_string()))?;
        let floor = ProcessFloor::setup(&boot, &config.job).map_err(|e| fail(e.to_string()))?;
        let rig = ProcessRig {
            rank,
            dev: None,
            floor,
        };
        return run_floors(a, &rig).map_err(fail);
    }
    if a.only("crossover") {
        return Err(fail("--test crossover runs on thread devices only".into()));
    }
    let name = rank_device(a, bootstrap::device_from_env()).map_err(fail)?;
    let known = reg.get(&name).map_or(&[][..], |e| e.options);
    match reg.get(&name).map(|e| e.placement) {
        Some(Placement::Processes) => {}
        Some(Placement::Threads) => {
            return Err(fail(format!(
                "device {name:?} runs ranks as threads: run xdev-bench without a launcher to measure it"
            )))
        }
        None => return Err(fail(format!("device {name:?} is not available in this build"))),
    }
    for (k, v) in crate::cli::options_for(known, &a.options) {
        config = config.with(&k, v);
    }
    // The psm device is opened as itself so that its raw PSM2 peer can be
    // measured on the same endpoint.
    let mut psm = None;
    let opened = if name == "psm" {
        ibvx::PsmDevice::open(&config).map(|d| {
            let d = Arc::new(d);
            psm = Some(d.clone());
            d as Arc<dyn Device>
        })
    } else {
        reg.open(&name, &config)
    };
    let dev = opened.map_err(|e| {
        let why = format!("cannot open device {name}: {e}");
        eprintln!("xdev-bench: rank {rank}: {why}");
        tell_reason(&why);
        Failure::Unavailable(why)
    })?;
    // The device may hold this rank's bootstrap connection (a rank connects
    // once per job), so the floor is set up through the device itself.
    let floor = ProcessFloor::setup(&DeviceCoordinator(&*dev), &config.job)
        .map_err(|e| fail(e.to_string()))?;
    let rig = ProcessRig {
        rank,
        dev: Some(dev),
        floor,
    };
    run_tests(a, &name, &rig, config.size).map_err(fail)?;
    if let Some(psm) = &psm {
        run_psm_vs_raw(a, psm, rank).map_err(fail)?;
    }
    if let Some(dev) = &rig.dev {
        dev.finish().map_err(|e| fail(format!("finish: {e}")))?;
    }
    Ok(())
}

/// A rank's exit status, after saying why it failed.
pub fn rank_status(r: Result<(), Failure>) -> u8 {
    match r {
        Ok(()) => 0,
        Err(Failure::Unavailable(_)) => UNAVAILABLE,
        Err(Failure::Exit(why, code)) => {
            // Whichever launcher started this rank names it.
            let rank = [
                bootstrap::XDEV_RANK,
                bootstrap::PMIX_RANK,
                bootstrap::PMI_RANK,
            ]
            .iter()
            .find_map(|v| std::env::var(v).ok())
            .unwrap_or_default();
            eprintln!("xdev-bench: rank {rank}: {why}");
            code
        }
        Err(Failure::Status(code)) => code,
    }
}

#[cfg(test)]
mod tests;
