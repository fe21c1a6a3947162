//! Where the ranks of a measurement run: threads of this process
//! ([`ThreadRig`]) or this process as one rank of a launched job
//! ([`ProcessRig`]), behind one [`Rig`] face.

use std::sync::Arc;

use xdev::{Device, Rank};

use crate::cli::Args;
use crate::process::ProcessFloor;
use crate::{cache_line_floor, parallel_memcpy_floor, WINDOW};

/// A benchmark on one rank's device: the figure on rank 0, `None` elsewhere.
pub(crate) type Bench<'a> = dyn Fn(&dyn Device) -> xdev::Result<Option<f64>> + Sync + 'a;

/// Where the two ranks of a measurement run: threads of this process, or
/// this process as one rank of a launched job. Every figure is `Some` on the
/// rank that reports (rank 0) and `None` elsewhere; every rank runs the same
/// sequence of calls.
pub(crate) trait Rig {
    /// `"threads"` or `"processes"`, for headers.
    fn placement(&self) -> &'static str;
    /// Whether this rank prints.
    fn reports(&self) -> bool;
    /// One run of the cache-line floor between the ranks' cores.
    fn cache_line_floor(&self, iters: u64) -> Option<f64>;
    /// One run of the memcpy floor with `copiers` concurrent copies (in one
    /// process, on the reporting rank).
    fn memcpy_floor(&self, size: usize, copiers: usize) -> Option<f64>;
    /// Runs `bench` on the device.
    fn run(&self, bench: &Bench) -> Result<Option<f64>, String>;
}

/// Ranks as threads of this process: a fresh world of the `thread` device
/// per measurement, rank r pinned to core r (modulo the cores online).
pub(crate) struct ThreadRig<'a> {
    pub(crate) args: &'a Args,
    pub(crate) ranks: usize,
}

/// A thread world of `ranks` pinned ranks with the run's device options and
/// `extra` ones.
pub(crate) fn world(a: &Args, ranks: usize, extra: &[(&str, String)]) -> shm_ipc::ThreadWorld {
    let mut w = shm_ipc::ThreadWorld::new(ranks).pin(true);
    for (k, v) in crate::cli::options_for(shm_ipc::ThreadOptions::KEYS, &a.options) {
        w = w.option(&k, v);
    }
    for (k, v) in extra {
        w = w.option(k, v);
    }
    w
}

/// Rank 0's figure of a thread world's run.
pub(crate) fn rank0(out: Vec<xdev::Result<Option<f64>>>) -> Result<f64, String> {
    out.into_iter()
        .next()
        .ok_or("no ranks")?
        .map_err(|e| e.to_string())?
        .ok_or_else(|| "rank 0 gave no figure".to_string())
}

impl Rig for ThreadRig<'_> {
    fn placement(&self) -> &'static str {
        "threads"
    }

    fn reports(&self) -> bool {
        true
    }

    fn cache_line_floor(&self, iters: u64) -> Option<f64> {
        Some(cache_line_floor(iters, 1))
    }

    fn memcpy_floor(&self, size: usize, copiers: usize) -> Option<f64> {
        Some(parallel_memcpy_floor(size, WINDOW, copiers, 1))
    }

    fn run(&self, bench: &Bench) -> Result<Option<f64>, String> {
        rank0(world(self.args, self.ranks, &[]).run(|dev| bench(dev))).map(Some)
    }
}

/// This process as one rank of a launched job, pinned to core `rank`; the
/// device (none when measuring the floors alone) is opened once for the run.
pub(crate) struct ProcessRig {
    pub(crate) rank: Rank,
    pub(crate) dev: Option<Arc<dyn Device>>,
    pub(crate) floor: ProcessFloor,
}

impl Rig for ProcessRig {
    fn placement(&self) -> &'static str {
        "processes"
    }

    fn reports(&self) -> bool {
        self.rank == 0
    }

    fn cache_line_floor(&self, iters: u64) -> Option<f64> {
        self.floor.cache_line(iters)
    }

    fn memcpy_floor(&self, size: usize, copiers: usize) -> Option<f64> {
        self.reports()
            .then(|| parallel_memcpy_floor(size, WINDOW, copiers, 1))
    }

    fn run(&self, bench: &Bench) -> Result<Option<f64>, String> {
        let dev = self.dev.as_deref().ok_or("no device is open")?;
        let figure = bench(dev).map_err(|e| e.to_string())?;
        // A rank's last operation may complete only when its peer makes
        // progress (the sender of a PSM2 rendezvous waits for the
        // receiver's last control message): a barrier through the device
        // lets both finish before either goes on to the floor, which does
        // not drive the device.
        xdev::devkit::conformance::barrier(dev).map_err(|e| format!("barrier: {e}"))?;
        Ok(figure)
    }
}
