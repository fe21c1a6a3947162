//! A run started by hand (no launcher in the environment): the plan of its
//! steps ([`plan`]), thread devices measured here and process devices
//! launched ([`orchestrate`]), and the run's exit status ([`run_status`]).

use xdev::registry::{Entry, Placement, Registry};

use crate::cli::{jobs, Args};
use crate::launch::{launch, Failure, Spawner, UNAVAILABLE};
use crate::osu;
use crate::rig::ThreadRig;
use crate::suite::{run_crossover, run_floors, run_tests};

/// One part of a run started by hand.
#[derive(Debug)]
pub enum Step<'r> {
    /// In this process: a thread device, or the thread floors (`None`).
    Here(Option<&'r Entry>),
    /// As processes this run starts: a process device, or the process floors (`None`).
    Launch(Option<&'r Entry>),
}

/// What a run started by hand does, in order: the named devices (default:
/// every registered one), or with `--test floor` the floors of both
/// placements.
pub fn plan<'r>(a: &Args, reg: &'r Registry) -> Result<Vec<Step<'r>>, String> {
    if a.only("floor") {
        return Ok(vec![Step::Here(None), Step::Launch(None)]);
    }
    let entries: Vec<&Entry> = if a.devices.is_empty() {
        reg.entries().iter().collect()
    } else {
        a.devices
            .iter()
            .map(|d| {
                reg.get(d).ok_or_else(|| {
                    let here: Vec<&str> = reg.entries().iter().map(|e| e.name).collect();
                    format!(
                        "device {d:?} is not available in this build (devices here: {})",
                        here.join(", ")
                    )
                })
            })
            .collect::<Result<_, _>>()?
    };
    entries
        .into_iter()
        .map(|e| match e.placement {
            Placement::Threads if e.name == "thread" => Ok(Step::Here(Some(e))),
            Placement::Threads => Err(format!(
                "device {:?} runs ranks as threads, and xdev-bench has no runner for it",
                e.name
            )),
            Placement::Processes if a.only("crossover") => Err(format!(
                "--test crossover reopens the device per setting and runs on thread devices only, not {:?}",
                e.name
            )),
            Placement::Processes => Ok(Step::Launch(Some(e))),
        })
        .collect()
}

/// How one device (or the floors) of a run started by hand ended.
#[derive(Debug, PartialEq)]
pub enum Outcome {
    /// Every table printed.
    Measured,
    /// Skipped: the device cannot be opened here, or its ranks cannot be
    /// launched; why.
    NotMeasured(String),
    /// Failed while measuring: why, and the exit status.
    Failed(String, u8),
}

/// A run started by hand: every step of the plan, thread devices here,
/// process devices under the launcher (through `spawn`), each device's jobs
/// in turn. A device that cannot be opened or launched is reported "not
/// measured: why" (on stdout, as a `#` line or a JSON record) and skipped; a
/// device that fails while measuring is reported on stderr, and the run goes
/// on with the next one. Returns each step's name and outcome.
pub fn orchestrate(
    a: &Args,
    reg: &Registry,
    spawn: &Spawner,
) -> Result<Vec<(String, Outcome)>, String> {
    let steps = plan(a, reg)?;
    let mut outcomes = Vec::new();
    for (i, step) in steps.iter().enumerate() {
        if i > 0 && !a.json {
            println!();
        }
        let (name, r) = match step {
            Step::Here(None) => (
                "floors",
                run_floors(a, &ThreadRig { args: a, ranks: 2 }).map_err(|e| Failure::Exit(e, 1)),
            ),
            Step::Here(Some(e)) => {
                let r = if a.only("crossover") {
                    run_crossover(a, e.name)
                } else {
                    jobs(a).into_iter().try_for_each(|(ranks, tests)| {
                        let job = Args { tests, ..a.clone() };
                        run_tests(&job, e.name, &ThreadRig { args: &job, ranks }, ranks)
                    })
                };
                (e.name, r.map_err(|e| Failure::Exit(e, 1)))
            }
            Step::Launch(e) => {
                let device = e.map(|e| e.name);
                let r = jobs(a).into_iter().try_for_each(|(ranks, tests)| {
                    launch(spawn, ranks, device, &a.rank_args(device, &tests))
                });
                (device.unwrap_or("floors"), r)
            }
        };
        let outcome = match r {
            Ok(()) => Outcome::Measured,
            Err(Failure::Unavailable(why)) => Outcome::NotMeasured(why),
            // No launcher (or no executable): nothing ran.
            Err(Failure::Exit(why, _)) if matches!(step, Step::Launch(_)) => {
                Outcome::NotMeasured(why)
            }
            Err(Failure::Exit(why, code)) => Outcome::Failed(why, code),
            Err(Failure::Status(code)) => {
                Outcome::Failed(format!("its ranks failed with status {code}"), code)
            }
        };
        match &outcome {
            Outcome::Measured => {}
            Outcome::NotMeasured(why) => {
                println!("{}", osu::not_measured(name, why, a.json));
                eprintln!("xdev-bench: {name}: not measured: {why}");
            }
            Outcome::Failed(why, _) => eprintln!("xdev-bench: {name}: {why}"),
        }
        outcomes.push((name.to_string(), outcome));
    }
    Ok(outcomes)
}

/// The exit status of a run started by hand: the first failure's; else,
/// when devices were named, [`UNAVAILABLE`] if one of them was not measured;
/// else success (the default run skips what does not work here).
pub fn run_status(a: &Args, outcomes: &[(String, Outcome)]) -> u8 {
    if let Some(code) = outcomes.iter().find_map(|(_, o)| match o {
        Outcome::Failed(_, code) => Some(*code),
        _ => None,
    }) {
        return code;
    }
    let named = !a.devices.is_empty() || a.only("floor");
    if named
        && outcomes
            .iter()
            .any(|(_, o)| matches!(o, Outcome::NotMeasured(_)))
    {
        return UNAVAILABLE;
    }
    0
}
