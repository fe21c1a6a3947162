//! The comparison report (`xdev-bench report`): runs the suite (latency, bw,
//! bibw and message rate of every device that works here, with the floors),
//! measures the installed peers in the same run (raw PSM2 on the psm
//! device's endpoint, Open MPI and MPICH through `benches/mpi/osu_peer.c`
//! built with their `mpicc`, Open MPI over PSM2 as the psm device's MPI
//! peer ([`psm2_peer`]), UCX through `ucx_perftest`: [`measure_ucx`]),
//! takes the `ibv` device and perftest from a
//! soft-RoCE VM results file when one is given (`ci/bench-vm.sh` writes it:
//! [`parse_vm`]), and writes a self-contained markdown report with SVG plots
//! ([`crate::plot`]).
//!
//! Nothing is invented: a device or peer that could not be measured is listed
//! as "not measured" with the reason.

mod driver;
mod lines;
mod machine;
mod markdown;
mod measure;
mod passes;
mod paths;
mod plots;
pub mod psm2_peer;
mod records;
mod split;
mod tables;
mod ucx;
mod window;

use std::time::Duration;

pub use driver::report_main;
pub use machine::{civil_from_days, utc_now, LoadSampler, Machine, LOAD_SAMPLE_EVERY};
pub use measure::{measure_mpi, run_captured, which, Mpi, MPIS, MPI_INSTALL, MPI_PEER_SOURCE};
pub use passes::{
    large_pass_args, large_pass_rows, pass_args, pass_ratio, passes_jsonl, Pass, PassRatio,
    LARGE_PASS_DEVICES, LARGE_PASS_MAX_SIZE, LARGE_PASS_MIN_SIZE, LARGE_PASS_TEST, PASSES,
    PASS_DEVICES, PASS_MAX_SIZE, PASS_PEER, PASS_ROWS, QUICK_PASSES,
};
pub use paths::{path_args, path_records, PATHS, PATH_MIN_SIZE, PATH_PREFIX};
pub use records::{
    parse_results, parse_vm, perftest_status, Record, Results, SyscallCount, VmRun, PERFTEST_FAILED,
};
pub use split::{split_args, split_records, SPLIT_SIZE, SPLIT_TESTS};
pub use tables::{DISTURBED, DISTURBED_MARK};
pub use ucx::{
    measure_ucx, parse_perftest, PerftestError, PerftestFigures, UcxTest, UCX, UCX_INSTALL,
    UCX_LOOP_NOTE, UCX_PERFTEST,
};
pub use window::{window_args, window_records, WINDOW_DEVICES, WINDOW_MAX_SIZE, WINDOW_SUFFIX};

/// The devices the project names (issue 7), measured when in the build.
pub const KNOWN_DEVICES: [&str; 5] = ["thread", "shm", "ibv", "psm", "hybrid"];

/// The tests of the report, in order.
pub const TESTS: [&str; 4] = ["latency", "bw", "bibw", "rate"];

/// Series name of the raw PSM2 peer.
pub const RAW_PSM2: &str = "raw PSM2";

/// The name `xdev-bench` gives the psm device's comparison with raw PSM2.
const PSM_VS_RAW: &str = "psm-vs-raw";

/// How the pseudo-devices of floors measured alone begin (`floor (threads)`,
/// `floor (processes)`).
pub const FLOOR_PREFIX: &str = "floor (";

/// The reason perftest is absent without a VM results file.
pub const PERFTEST_ABSENT: &str =
    "needs the soft-RoCE VM: run ci/bench-vm.sh, or pass its results file with --vm FILE";

/// Series name of the perftest peer in a VM results file.
pub const PERFTEST: &str = "perftest";

/// The host name the VM section's plots and tables carry.
pub const VM_HOST: &str = "soft-RoCE VM";

/// A peer of the report and how it went.
#[derive(Clone, Debug, PartialEq)]
pub enum PeerStatus {
    /// Measured; a note on how (version, command).
    Measured(String),
    /// Not measured, and why.
    NotMeasured(String),
}

/// What the report shows: the run's results and every peer's status.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    /// Where and when.
    pub machine: Machine,
    /// Load averages when the run ended.
    pub load_after: String,
    /// The least and the most 1-minute load average sampled during the run
    /// ([`LoadSampler`]), if sampled.
    pub load_range: Option<(f64, f64)>,
    /// How the suite was run (the command line, for the reader).
    pub command: String,
    /// Wall-clock time of the whole run.
    pub elapsed: Duration,
    /// Devices in this build (registry order).
    pub built: Vec<String>,
    /// Every measurement: the devices', and the MPI peers'.
    pub results: Results,
    /// (peer, status): raw PSM2, Open MPI, MPICH, UCX, perftest.
    pub peers: Vec<(String, PeerStatus)>,
    /// The interleaved passes against Open MPI ([`passes`](self::Pass)):
    /// small messages, and osu_bibw at large ones; or why there are none.
    pub passes: Result<Vec<Pass>, String>,
    /// What was measured in the soft-RoCE VM, if a results file was given.
    pub vm: Option<VmRun>,
    /// (a, b): the tables end with a column `a / b`, the two lines' values
    /// divided (the VM section: `ibv / perftest`).
    pub relative: Option<(String, String)>,
}

impl Report {
    /// The report of what was measured in the soft-RoCE VM, with the
    /// guest's own floors: the tables and plots of its section.
    pub fn vm_report(&self) -> Option<Report> {
        let vm = self.vm.as_ref()?;
        Some(Report {
            machine: Machine {
                host: VM_HOST.into(),
                ..self.machine.clone()
            },
            load_after: self.load_after.clone(),
            load_range: self.load_range,
            command: self.command.clone(),
            elapsed: self.elapsed,
            built: vec!["ibv".into()],
            results: vm.results.clone(),
            peers: Vec::new(),
            passes: Err("not run in the VM".into()),
            vm: None,
            relative: Some(("ibv".into(), PERFTEST.into())),
        })
    }
}

#[cfg(test)]
mod tests;
