//! `xdev-bench report`: its options, and the run that measures the suite
//! and the peers and writes the report's files.

use std::path::{Path, PathBuf};
use std::time::Instant;

use xdev::registry::Registry;

use super::measure::{
    measure_floors_for_peers, measure_mpis, measure_suite, raw_psm2_status, ucx_peer,
};
use super::{
    parse_vm, passes_jsonl, perftest_status, LoadSampler, Machine, PeerStatus, Report, PASSES,
    PERFTEST, PERFTEST_ABSENT, QUICK_PASSES, TESTS,
};
use crate::osu;

const REPORT_USAGE: &str = "\
xdev-bench report: run the suite and write a comparison report

USAGE: xdev-bench report [OPTIONS]

Runs latency, bw, bibw and rate on every device that works here (with the
floors, and raw PSM2 on the psm device's endpoint), shm's bibw once more per
rendezvous path (cma=on with the split on and off, cma=off), thread's and
shm's bibw up to 64 KiB once more with the window calls (isend_many,
irecv_many, wait_all; not in the headline: osu's loop posts one call per
message), psm's 8-byte message rate by side (rate_split: the sender, then
the receiver, through the device and the other side raw PSM2), builds
benches/mpi/osu_peer.c with the mpicc of Open MPI and of MPICH where installed
and runs it on two ranks (Open MPI a second time over PSM2, pml cm with mtl
psm2, as the psm device's peer: as root, in a mount namespace that shows the
MTL an hfi1 unit), runs UCX's ucx_perftest (tag_lat, tag_bw over shared
memory) where installed, and writes DIR/report.md, DIR/latency.svg,
DIR/bw.svg, DIR/bibw.svg, DIR/rate.svg and DIR/results.jsonl (every record). Absent devices and peers are listed as not
measured, with the reason. The MPI and UCX peers need Debian's packages:
  apt-get install openmpi-bin libopenmpi-dev mpich libmpich-dev
  apt-get install ucx-utils
The ibv device and perftest need an RDMA device: ci/bench-vm.sh measures them
in the soft-RoCE VM and then runs this command with --vm FILE, which adds
their section (DIR/vm-latency.svg, DIR/vm-bw.svg, DIR/vm-results.jsonl).

OPTIONS:
  --out DIR          where to write (default: benches/reports/DATE-HOST)
  --quick            a tenth of OSU's iterations, one round (smoke runs)
  --max-size BYTES   largest message (default 4194304)
  --vm FILE          the soft-RoCE VM's results (ci/bench-vm.sh writes them):
                     ibv and perftest, measured in the guest
  --no-mpi           do not build or run the MPI peers
  --no-ucx           do not run the UCX peer (ucx_perftest)
  --passes N         interleaved passes against Open MPI (default 7, quick
                     2; 0: none): Open MPI, thread and shm up to 64 B in
                     turn, then Open MPI and shm osu_bibw from 256 KiB up
                     to --max-size (at most 4 MiB), each device divided by
                     its own pass's Open MPI (DIR/passes.jsonl)
  -h, --help         this text";

/// Options of `xdev-bench report`.
#[derive(Debug, PartialEq)]
struct ReportArgs {
    out: Option<PathBuf>,
    quick: bool,
    max_size: usize,
    vm: Option<PathBuf>,
    mpi: bool,
    ucx: bool,
    /// `None`: the default for the run ([`PASSES`], quick [`QUICK_PASSES`]).
    passes: Option<usize>,
}

/// Parses the arguments after `report`: `None` for `--help`.
fn parse_report(args: &[String]) -> Result<Option<ReportArgs>, String> {
    let mut r = ReportArgs {
        out: None,
        quick: false,
        max_size: 4 << 20,
        vm: None,
        mpi: true,
        ucx: true,
        passes: None,
    };
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        match arg.as_str() {
            "--out" => r.out = Some(value("--out")?.into()),
            "--quick" => r.quick = true,
            "--max-size" => {
                r.max_size = value("--max-size")?
                    .parse()
                    .map_err(|_| "--max-size takes a byte count".to_string())?
            }
            "--vm" => r.vm = Some(value("--vm")?.into()),
            "--no-mpi" => r.mpi = false,
            "--no-ucx" => r.ucx = false,
            "--passes" => {
                r.passes = Some(
                    value("--passes")?
                        .parse()
                        .map_err(|_| "--passes takes a count".to_string())?,
                )
            }
            "-h" | "--help" => return Ok(None),
            other => {
                return Err(format!(
                    "report: unknown argument {other:?} (see report --help)"
                ))
            }
        }
    }
    Ok(Some(r))
}

/// `xdev-bench report` (see `xdev-bench report --help`). The path of the report
/// written; `Err` of an empty string after printing the help.
pub fn report_main(args: &[String], reg: &Registry) -> Result<PathBuf, String> {
    let Some(r) = parse_report(args)? else {
        println!("{REPORT_USAGE}");
        return Err(String::new());
    };
    // Read before the run, so that a wrong path fails at once.
    let vm_text = match &r.vm {
        Some(f) => Some(std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?),
        None => None,
    };
    let machine = Machine::here();
    let start = Instant::now();
    let sampler = LoadSampler::start();
    let out = r.out.clone().unwrap_or_else(|| {
        let day = machine
            .date
            .split(' ')
            .next()
            .unwrap_or("today")
            .to_string();
        PathBuf::from("benches/reports").join(format!("{day}-{}", machine.host))
    });
    std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this executable: {e}"))?;

    let mut results = measure_suite(&exe, r.max_size, r.quick);
    super::paths::measure_paths(&exe, r.max_size, r.quick, &mut results);
    super::window::measure_window_calls(&exe, r.max_size, r.quick, &mut results);
    super::split::measure_split(&exe, r.quick, &mut results);
    let mut peers = vec![raw_psm2_status(&results)];
    if r.mpi || r.ucx {
        measure_floors_for_peers(&exe, r.max_size, r.quick, &mut results);
    }
    peers.extend(measure_mpis(r.mpi, r.max_size, r.quick, &mut results));
    let passes = r
        .passes
        .unwrap_or(if r.quick { QUICK_PASSES } else { PASSES });
    let passes = super::passes::measure_passes(&exe, passes, (r.quick, r.max_size), r.mpi);
    peers.push(ucx_peer(r.ucx, r.max_size, r.quick, &mut results));

    let vm = vm_text.as_deref().map(parse_vm);
    peers.push((
        PERFTEST.to_string(),
        match (&vm, &r.vm) {
            (Some(vm), Some(f)) => perftest_status(vm, &f.display().to_string()),
            _ => PeerStatus::NotMeasured(PERFTEST_ABSENT.into()),
        },
    ));

    let mut command = String::from("xdev-bench report");
    for a in args {
        command.push(' ');
        command.push_str(a);
    }
    let report = Report {
        machine,
        load_after: Machine::here().load,
        load_range: sampler.finish(),
        command,
        elapsed: start.elapsed(),
        built: reg.entries().iter().map(|e| e.name.to_string()).collect(),
        results,
        peers,
        passes,
        vm,
        relative: None,
    };
    write_report(&report, &out, vm_text.as_deref())?;
    Ok(out.join("report.md"))
}

/// Writes `report` into `out`: `report.md`, a plot per test, the VM
/// section's plots and records when there is a VM results file
/// (`vm_text`), and every record in `results.jsonl`.
fn write_report(report: &Report, out: &Path, vm_text: Option<&str>) -> Result<(), String> {
    let write = |name: &str, body: &str| {
        let p = out.join(name);
        std::fs::write(&p, body).map_err(|e| format!("{}: {e}", p.display()))
    };
    write("report.md", &report.markdown())?;
    for test in TESTS {
        write(&format!("{test}.svg"), &report.plot(test).svg())?;
    }
    if let (Some(sub), Some(text)) = (report.vm_report(), vm_text) {
        for test in ["latency", "bw"] {
            write(&format!("vm-{test}.svg"), &sub.plot(test).svg())?;
        }
        write("vm-results.jsonl", text)?;
    }
    let mut jsonl = String::new();
    for x in &report.results.records {
        jsonl.push_str(&osu::json(
            &x.device, &x.test, x.size, x.value, &x.unit, x.floor,
        ));
        jsonl.push('\n');
    }
    for (d, why) in &report.results.not_measured {
        jsonl.push_str(&osu::not_measured(d, why, true));
        jsonl.push('\n');
    }
    write("results.jsonl", &jsonl)?;
    if let Ok(passes) = &report.passes {
        write("passes.jsonl", &passes_jsonl(passes))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
