//! The library's run of a process device under the launcher, with this
//! test binary as the ranks (`rank_child`): what rank 0 prints, the
//! not-measured path of a device that cannot open, mbw_mr on 4 ranks, the
//! message rate, and the plan of a run started by hand. A test device over
//! the bootstrap's store ([`kv_device`]) stands in for a real one.
//!
//! The launcher must sit next to the test binaries (`cargo test --workspace`
//! builds it; with `-p xdev-bench` alone, build it with `cargo build -p
//! xdev` in the same profile first). Tests that cannot run say `skipped:
//! why`.

mod kv_device;

use std::ffi::OsString;
use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use xdev::bootstrap;
use xdev::registry::{Entry, Placement, Registry};
use xdev::Error;
use xdev_bench::cli::{jobs, parse, registry, Args, Parsed};
use xdev_bench::launch::{outcome, Failure, UNAVAILABLE};
use xdev_bench::orchestrate::{orchestrate, plan, run_status, Outcome, Step};
use xdev_bench::rank::{rank_main, rank_status};

use kv_device::kv_entry;

fn args(line: &str) -> Args {
    match parse(line.split_whitespace().map(String::from)).unwrap() {
        Parsed::Run(a) => a,
        Parsed::Help => panic!("help"),
    }
}

/// The launcher's file name, looked for next to the test binaries.
const LAUNCHER: &str = "xdev-run";

/// `xdev-run` next to `exe`, or why there is none.
fn find_launcher(exe: &Path) -> Result<PathBuf, String> {
    let dir = exe.parent().ok_or("the executable has no directory")?;
    let launcher = dir.join(LAUNCHER);
    if launcher.is_file() {
        Ok(launcher)
    } else {
        Err(format!(
            "process devices run under {LAUNCHER}, and there is no {} next to this executable: \
         build it into the same target directory with `cargo build --release -p xdev-tools` \
         (without --release for a debug xdev-bench)",
            launcher.display()
        ))
    }
}

/// `launcher -n RANKS [--device NAME] -- program args...`.
fn launch_command(
    launcher: &Path,
    ranks: usize,
    device: Option<&str>,
    program: &Path,
    args: &[OsString],
) -> Command {
    let mut c = Command::new(launcher);
    c.args(["-n", &ranks.to_string()]);
    if let Some(d) = device {
        c.args(["--device", d]);
    }
    c.arg("--").arg(program).args(args);
    c
}

/// The thread device and the two test devices (not this build's
/// process devices, so the tests do not depend on what is linked).
fn test_registry() -> Registry {
    let mut r = Registry::new();
    shm_ipc::thread::register(&mut r);
    r.register(kv_entry());
    r.register(Entry {
        name: "broken",
        description: "a process device that never opens",
        placement: Placement::Processes,
        options: &[],
        open: |_| Err(Error::Config("not here".into())),
    });
    r
}

/// Environment variable: the arguments of a rank played by this test
/// binary (see `rank_child`).
const CHILD_ARGS: &str = "XDEV_BENCH_TEST_ARGS";

/// Not a test of its own: the body of a rank when this test binary is
/// started by the launcher with `CHILD_ARGS` set.
#[test]
fn rank_child() {
    let Ok(line) = std::env::var(CHILD_ARGS) else {
        return;
    };
    // Only rank 0 prints. The other ranks' libtest lines ("ok", "test
    // result: ...") would land amid rank 0's rows on the shared stdout,
    // so they go to /dev/null. (What libtest printed before this body
    // precedes rank 0's first line: rank 0 prints once every rank has
    // opened the device.)
    if std::env::var(bootstrap::XDEV_RANK).is_ok_and(|r| r != "0") {
        use std::os::fd::AsRawFd;
        let null = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/null")
            .unwrap();
        let _ = std::io::stdout().flush();
        // SAFETY: dup2(2) on two descriptors open in this process: fd 1
        // becomes a copy of /dev/null's; `null` keeps owning its own.
        let r = unsafe { libc::dup2(null.as_raw_fd(), 1) };
        assert_eq!(r, 1, "dup2 onto stdout");
    }
    match rank_status(rank_main(&args(&line), &test_registry())) {
        0 => {}
        code => std::process::exit(code.into()),
    }
}

/// `xdev-run` for this test binary (in `target/<profile>/deps`): the one
/// in `target/<profile>`, if built.
fn launcher_for_tests() -> Option<PathBuf> {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent()?.parent()?;
    find_launcher(&profile_dir.join("xdev-bench")).ok()
}

/// The command that starts `ranks` ranks of this test binary playing
/// `xdev-bench` with arguments `line`, as the binary's re-exec does.
fn rank_command(ranks: usize, device: Option<&str>, line: &str) -> Option<Command> {
    let launcher = launcher_for_tests()?;
    let me = std::env::current_exe().unwrap();
    let child: Vec<OsString> = ["rank_child", "--exact", "--nocapture", "--test-threads=1"]
        .iter()
        .map(OsString::from)
        .collect();
    let mut c = launch_command(&launcher, ranks, device, &me, &child);
    c.env(CHILD_ARGS, line).stdin(std::process::Stdio::null());
    Some(c)
}

const NO_LAUNCHER: &str =
    "skipped: xdev-run is not built next to this target's binaries (cargo build -p xdev-tools)";

/// Runs `line` as the ranks of a process-mode job of test device
/// `device`, through the same command the binary builds for a re-exec.
fn run_ranks_n(ranks: usize, device: &str, line: &str) -> Option<(std::process::Output, String)> {
    let Some(mut c) = rank_command(ranks, Some(device), line) else {
        println!("{NO_LAUNCHER}");
        return None;
    };
    let out = c.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    Some((out, stdout))
}

fn run_ranks(device: &str, line: &str) -> Option<(std::process::Output, String)> {
    run_ranks_n(2, device, line)
}

/// The spawner of the tests: ranks of this test binary, their output
/// discarded (the outcomes are what the tests check).
fn test_spawner(ranks: usize, device: Option<&str>, args: &[String]) -> Result<Command, String> {
    let mut c = rank_command(ranks, device, &args.join(" ")).ok_or(NO_LAUNCHER)?;
    c.stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    Ok(c)
}

/// OSU data rows (size, value, floor, ratio) of `stdout`.
fn rows(stdout: &str) -> Vec<Vec<f64>> {
    stdout
        .lines()
        .filter(|l| l.starts_with(|c: char| c.is_ascii_digit()))
        .map(|l| l.split_whitespace().map(|v| v.parse().unwrap()).collect())
        .collect()
}

#[test]
fn a_process_device_runs_under_the_launcher() {
    let Some((out, stdout)) = run_ranks("kv", "--quick --max-size 16 --test all") else {
        return;
    };
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        stdout.matches("# OSU MPI Latency Test").count(),
        1,
        "rank 0 prints, rank 1 does not:\n{stdout}"
    );
    assert!(
        stdout.contains("# Device: kv; cache-line floor"),
        "{stdout}"
    );
    assert!(stdout.contains("(two processes pinned"), "{stdout}");
    assert!(stdout.contains("# OSU MPI Bandwidth Test"), "{stdout}");
    let rows = rows(&stdout);
    // Latency: 0, 1, 2, 4, 8, 16; bandwidth: 1 .. 16.
    assert_eq!(rows.len(), 6 + 5, "{stdout}");
    for r in &rows {
        assert_eq!(r.len(), 4, "{stdout}");
        // The KV device is far slower than a copy: its bandwidth ratios
        // print as 0.00, and so may its 1-byte bandwidth (under 5 kB/s
        // once a message takes 200 us, as on a slow CI machine).
        assert!(r[1] >= 0.0 && r[2] > 0.0 && r[3] >= 0.0, "{r:?}");
    }
    // Latency rows are times and never print as zero; the 16-byte
    // bandwidth prints as zero only past 3 ms a message.
    assert!(rows[..6].iter().all(|r| r[1] > 0.0), "{stdout}");
    assert!(rows[10][0] == 16.0 && rows[10][1] > 0.0, "{stdout}");
    let json = run_ranks("kv", "--quick --max-size 4 --test latency --json")
        .unwrap()
        .1;
    // (libtest's own "test ... " may precede the first record on its line.)
    assert_eq!(
        json.matches("{\"device\":\"kv\",\"test\":\"latency\"")
            .count(),
        4,
        "{json}"
    );
}

#[test]
fn an_unopenable_device_exits_with_its_own_status() {
    let Some((out, _)) = run_ranks("broken", "--quick --max-size 4") else {
        return;
    };
    assert_eq!(out.status.code(), Some(i32::from(UNAVAILABLE)), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("cannot open device broken: invalid configuration: not here"),
        "{stderr}"
    );
    assert!(matches!(outcome(out.status), Err(Failure::Unavailable(_))));
    assert!(outcome(std::process::ExitStatus::from_raw(0)).is_ok());
    assert!(matches!(
        outcome(std::process::ExitStatus::from_raw(9)),
        Err(Failure::Status(137))
    ));
    assert!(matches!(
        outcome(std::process::ExitStatus::from_raw(1 << 8)),
        Err(Failure::Status(1))
    ));
}

/// (bibw is tested on the thread device and, in process mode, on shm:
/// the KV device's receives block where they are posted, and both
/// ranks of bibw post receives before sends.)
#[test]
fn mbw_mr_under_the_launcher() {
    let Some((out, stdout)) = run_ranks_n(4, "kv", "--quick --max-size 2 --test mbw_mr --ranks 4")
    else {
        return;
    };
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        stdout
            .matches("# OSU MPI Multiple Bandwidth / Message Rate Test")
            .count(),
        1,
        "{stdout}"
    );
    assert!(
        stdout.contains("# [ pairs: 2 ] [ window size: 64 ]"),
        "{stdout}"
    );
    let rows = rows(&stdout);
    assert_eq!(rows.len(), 2, "{stdout}");
    for r in &rows {
        // size, MB/s, messages/s, floor, ratio
        assert_eq!(r.len(), 5, "{r:?}");
        // (MB/s may print as 0.00 on a slow machine, messages/s not.)
        assert!(r[1] >= 0.0 && r[2] > 0.0 && r[3] > 0.0, "{r:?}");
        // Messages/s = MB/s * 10^6 / size, up to the rounding of MB/s
        // to 2 decimals.
        let rate = r[1] * 1e6 / r[0];
        assert!((r[2] - rate).abs() <= 0.005e6 / r[0] + 1.0, "{r:?}");
    }
}

#[test]
fn rate_runs_with_the_two_rank_tests_and_under_the_launcher() {
    assert_eq!(
        jobs(&args("--test rate,mbw_mr,latency")),
        [
            (2, vec!["rate".to_string(), "latency".to_string()]),
            (4, vec!["mbw_mr".to_string()])
        ]
    );
    assert_eq!(args("--test all,rate").tests, ["latency", "bw", "rate"]);
    let Some((out, stdout)) = run_ranks("kv", "--quick --max-size 2 --test rate") else {
        return;
    };
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        stdout.matches("# OSU MPI Message Rate Test").count(),
        1,
        "{stdout}"
    );
    assert!(
        stdout.contains("# [ pairs: 1 ] [ window size: 64 ]"),
        "{stdout}"
    );
    assert!(stdout.contains("(two processes pinned"), "{stdout}");
    let rows = rows(&stdout);
    assert_eq!(rows.len(), 2, "sizes 1 and 2:\n{stdout}");
    for r in &rows {
        // size, messages/s, floor (1 / cache-line floor), ratio
        assert_eq!(r.len(), 4, "{r:?}");
        assert!(r[1].is_finite() && r[1] > 0.0, "{r:?}");
        assert!(r[2].is_finite() && r[2] > 0.0, "{r:?}");
        assert!((r[3] - r[1] / r[2]).abs() <= 0.01, "{r:?}");
    }
    let json = run_ranks("kv", "--quick --max-size 1 --test rate --json")
        .unwrap()
        .1;
    let recs = xdev_bench::report::parse_results(&json).records;
    assert_eq!(recs.len(), 1, "{json}");
    let r = &recs[0];
    assert_eq!((r.device.as_str(), r.test.as_str()), ("kv", "rate"));
    assert_eq!((r.size, r.unit.as_str()), (1, "msg/s"));
    assert!(r.value > 0.0 && r.floor > 0.0, "{r:?}");
}

#[test]
fn a_device_that_cannot_open_is_not_measured_and_the_run_goes_on() {
    if launcher_for_tests().is_none() {
        println!("{NO_LAUNCHER}");
        return;
    }
    let reg = test_registry();
    let a = args("--quick --max-size 2 --test latency --device broken --device kv");
    let outcomes = orchestrate(&a, &reg, &test_spawner).unwrap();
    assert_eq!(outcomes.len(), 2, "{outcomes:?}");
    assert_eq!(outcomes[0].0, "broken");
    match &outcomes[0].1 {
        Outcome::NotMeasured(why) => assert_eq!(
            why, "cannot open device broken: invalid configuration: not here",
            "the ranks' own reason"
        ),
        o => panic!("{o:?}"),
    }
    assert_eq!(outcomes[1], ("kv".to_string(), Outcome::Measured));
    // Named devices: a device not measured is the run's status.
    assert_eq!(run_status(&a, &outcomes), UNAVAILABLE);
    // The default run skips it.
    assert_eq!(run_status(&args(""), &outcomes), 0);
    let failed = [("kv".to_string(), Outcome::Failed("x".into(), 7))];
    assert_eq!(run_status(&args(""), &failed), 7);
    // No launcher: not measured either, with the spawner's reason.
    let none = |_: usize, _: Option<&str>, _: &[String]| -> Result<Command, String> {
        Err("no launcher here".into())
    };
    let outcomes = orchestrate(&args("--quick --device kv"), &reg, &none).unwrap();
    assert_eq!(
        outcomes,
        [(
            "kv".to_string(),
            Outcome::NotMeasured("no launcher here".into())
        )]
    );
}

#[test]
fn the_plan_measures_every_device_in_its_placement() {
    let reg = test_registry();
    let names = |steps: Vec<Step>| -> Vec<(bool, Option<&str>)> {
        steps
            .into_iter()
            .map(|s| match s {
                Step::Here(e) => (true, e.map(|e| e.name)),
                Step::Launch(e) => (false, e.map(|e| e.name)),
            })
            .collect()
    };
    assert_eq!(
        names(plan(&args(""), &reg).unwrap()),
        [
            (true, Some("thread")),
            (false, Some("kv")),
            (false, Some("broken"))
        ]
    );
    assert_eq!(
        names(plan(&args("--device kv --test latency"), &reg).unwrap()),
        [(false, Some("kv"))]
    );
    assert_eq!(
        names(plan(&args("--test floor --device kv"), &reg).unwrap()),
        [(true, None), (false, None)]
    );
    assert!(plan(&args("--device kv --test crossover"), &reg)
        .unwrap_err()
        .contains("thread devices only"));
    assert!(plan(&args("--device nope"), &reg)
        .unwrap_err()
        .contains("devices here: thread, kv, broken"));
    // The default run of this build: every linked device, in its place.
    let linked = registry();
    let every: Vec<(bool, Option<&str>)> = linked
        .entries()
        .iter()
        .map(|e| (e.placement == Placement::Threads, Some(e.name)))
        .collect();
    assert_eq!(names(plan(&args(""), &linked).unwrap()), every);
    assert!(every.contains(&(true, Some("thread"))));
}

#[test]
fn the_reexec_keeps_the_arguments() {
    let raw: Vec<OsString> = ["--device", "shm", "--quick"]
        .iter()
        .map(OsString::from)
        .collect();
    let c = launch_command(
        Path::new("/t/xdev-run"),
        2,
        Some("shm"),
        Path::new("/t/xdev-bench"),
        &raw,
    );
    assert_eq!(c.get_program(), "/t/xdev-run");
    let got: Vec<&std::ffi::OsStr> = c.get_args().collect();
    assert_eq!(
        got,
        [
            "-n",
            "2",
            "--device",
            "shm",
            "--",
            "/t/xdev-bench",
            "--device",
            "shm",
            "--quick"
        ]
    );
    let e = find_launcher(Path::new("/nonexistent/dir/xdev-bench")).unwrap_err();
    assert!(e.contains("cargo build --release -p xdev-tools"), "{e}");
}
