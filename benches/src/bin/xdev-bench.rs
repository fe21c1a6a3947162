//! `xdev-bench`: OSU-style latency and bandwidth of xdev devices, with the
//! cache-line and memcpy floors measured in the same run.
//!
//! With no arguments it runs latency and bandwidth on every device in this
//! build: thread devices in this process, process devices by re-executing
//! itself as the ranks of a job it serves itself (through
//! [`xdev::devkit::launch::run_job`]; no `xdev-run` needed). Started by a launcher
//! (`xdev-run`, `srun`, `mpirun`: see [`xdev::bootstrap::Launcher`]) it is
//! one rank of such a run. See `--help`.
//!
//! This file only dispatches; the tool lives in the `xdev_bench` library.

use std::ffi::OsString;
use std::process::ExitCode;

use xdev::bootstrap;
use xdev_bench::cli::{check_options, help, parse, registry, Parsed};
use xdev_bench::launch::{launcher_main, self_spawner, LAUNCH_RANKS};
use xdev_bench::orchestrate::{orchestrate, run_status};
use xdev_bench::rank::{rank_main, rank_status};
use xdev_bench::report::report_main;

fn main() -> ExitCode {
    xdev_tools::init_tracing("xdev-bench");
    let raw: Vec<OsString> = std::env::args_os().skip(1).collect();
    if let Ok(ranks) = std::env::var(LAUNCH_RANKS) {
        return launcher_main(&ranks, &raw);
    }
    let strings: Result<Vec<String>, _> = raw.iter().map(|s| s.clone().into_string()).collect();
    let reg = registry();
    if let Ok(s) = &strings {
        if s.first().map(String::as_str) == Some("report") {
            return match report_main(&s[1..], &reg) {
                Ok(path) => {
                    println!("report: wrote {}", path.display());
                    ExitCode::SUCCESS
                }
                Err(e) if e.is_empty() => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("xdev-bench report: {e}");
                    ExitCode::FAILURE
                }
            };
        }
    }
    let parsed = strings
        .map_err(|s| format!("argument {s:?} is not UTF-8"))
        .and_then(parse);
    let a = match parsed {
        Ok(Parsed::Run(a)) => a,
        Ok(Parsed::Help) => {
            println!("{}", help(&reg));
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("xdev-bench: {e}");
            return ExitCode::from(2);
        }
    };
    if let Err(e) = check_options(&a, &reg) {
        eprintln!("xdev-bench: {e}");
        return ExitCode::from(2);
    }
    if bootstrap::Launcher::from_env().is_err() {
        return match orchestrate(&a, &reg, &self_spawner) {
            Ok(outcomes) => ExitCode::from(run_status(&a, &outcomes)),
            Err(e) => {
                eprintln!("xdev-bench: {e}");
                ExitCode::from(2)
            }
        };
    }
    ExitCode::from(rank_status(rank_main(&a, &reg)))
}
