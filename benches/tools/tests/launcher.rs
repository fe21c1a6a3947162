//! The `xdev-run` launcher with real processes on loopback.
//!
//! Ranks that must use the bootstrap client are this test binary itself,
//! re-executed by the launcher with `XDEV_TEST_ROLE` set: the `child` test
//! below does nothing in a normal run and plays the role when that variable is
//! set.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use xdev::bootstrap::{self, Bootstrap};

const LAUNCHER: &str = env!("CARGO_BIN_EXE_xdev-run");
const ROLE: &str = "XDEV_TEST_ROLE";

fn run(args: &[&str]) -> (Output, Duration) {
    let t = Instant::now();
    let out = Command::new(LAUNCHER)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("xdev-run starts");
    (out, t.elapsed())
}

fn code(out: &Output) -> i32 {
    out.status
        .code()
        .unwrap_or_else(|| panic!("xdev-run itself died: {out:?}"))
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Runs this test binary's `child` test as every rank, in role `role`.
fn run_role(role: &str, n: usize, extra: &[&str]) -> (Output, Duration) {
    let me = std::env::current_exe().unwrap();
    let t = Instant::now();
    let n = n.to_string();
    let mut args = vec!["-n", &n, "--timeout", "15"];
    args.extend_from_slice(extra);
    let out = Command::new(LAUNCHER)
        .args(&args)
        .arg("--")
        .arg(me)
        .args(["child", "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .stdin(Stdio::null())
        .output()
        .expect("xdev-run starts");
    (out, t.elapsed())
}

/// Not a test of its own: the body of a rank when re-executed by `run_role`.
#[test]
fn child() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let config = bootstrap::config_from_env().unwrap();
    let b = Bootstrap::from_env().unwrap();
    assert_eq!((b.rank(), b.size()), (config.rank, config.size));
    assert_eq!(b.job(), config.job);
    match role.as_str() {
        "allgather" => {
            assert_eq!(bootstrap::device_from_env().as_deref(), Some("shm"));
            let all = b.allgather(&(b.rank() as u32).to_le_bytes()).unwrap();
            let ranks: Vec<u32> = all
                .iter()
                .map(|v| u32::from_le_bytes(v[..].try_into().unwrap()))
                .collect();
            assert_eq!(ranks, (0..b.size() as u32).collect::<Vec<_>>());
            b.put(
                &format!("ep/{}", b.rank()),
                format!("seg-{}", b.rank()).as_bytes(),
            )
            .unwrap();
            b.barrier().unwrap();
            let next = (b.rank() + 1) % b.size();
            let v = b
                .get(&format!("ep/{next}"), Duration::from_secs(5))
                .unwrap();
            assert_eq!(v, format!("seg-{next}").as_bytes());
            println!("rank {} ok", b.rank());
        }
        "death" => {
            // Rank 1 dies (no goodbye); rank 0 must learn of it promptly.
            b.barrier().unwrap();
            if b.rank() == 1 {
                std::process::exit(0);
            }
            let t = Instant::now();
            loop {
                let d = b.departures().unwrap();
                if let Some(d) = d.first() {
                    assert_eq!((d.rank, d.clean), (1, false));
                    break;
                }
                assert!(t.elapsed() < Duration::from_secs(5), "death not reported");
                std::thread::sleep(Duration::from_millis(1));
            }
            println!("death seen after {:?}", t.elapsed());
            assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        }
        "psm2-leak" => {
            // A psm rank that crashes after PSM2 made its segment: what
            // the psm device stores, and the segment PSM2 would leave.
            let epid = psm2_test_epid(b.rank());
            b.put(
                &format!("{}{}", bootstrap::PSM2_EPID_KEY, b.rank()),
                &epid.to_le_bytes(),
            )
            .unwrap();
            std::fs::write(psm2_segment(epid), b"x").unwrap();
            b.barrier().unwrap();
            std::process::abort();
        }
        "psm2-forge" => {
            // Rank 1 stores a record in rank 0's name (rank 0 stores
            // none), naming a segment that is neither's.
            if b.rank() == 1 {
                let victim = std::env::var("XDEV_TEST_VICTIM").unwrap();
                let victim = u64::from_str_radix(&victim, 16).unwrap();
                b.put(
                    &format!("{}0", bootstrap::PSM2_EPID_KEY),
                    &victim.to_le_bytes(),
                )
                .unwrap();
            }
            b.barrier().unwrap();
        }
        other => panic!("unknown role {other}"),
    }
}

/// An epid no real PSM2 endpoint of this host has (a high marker, the
/// launching test's pid, the rank).
fn psm2_test_epid(rank: usize) -> u64 {
    let pid = std::env::var("XDEV_TEST_PARENT")
        .ok()
        .and_then(|p| p.parse::<u64>().ok())
        .unwrap_or_else(|| u64::from(std::process::id()));
    0xfe00_0000_0000_0000 | pid << 8 | rank as u64
}

fn psm2_segment(epid: u64) -> String {
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    format!("/dev/shm/psm2_shm.{uid}{epid:016x}0")
}

#[test]
fn keep_going_lets_the_others_finish_and_reports_the_first_failure() {
    let (out, _) = run(&[
        "-n",
        "3",
        "--keep-going",
        "--",
        "sh",
        "-c",
        "if [ $XDEV_RANK = 1 ]; then exit 7; fi; sleep 1; echo survivor-$XDEV_RANK",
    ]);
    let (stdout, err) = (String::from_utf8_lossy(&out.stdout), stderr(&out));
    assert_eq!(code(&out), 7, "{err}");
    assert!(
        stdout.contains("survivor-0") && stdout.contains("survivor-2"),
        "{stdout}"
    );
    assert!(
        err.contains("rank 1 exited with status 7; the others go on"),
        "{err}"
    );
    assert!(err.contains("the first failure: rank 1"), "{err}");
    // Without the option the survivors are stopped.
    let (out, _) = run(&[
        "-n",
        "3",
        "--",
        "sh",
        "-c",
        "if [ $XDEV_RANK = 1 ]; then exit 7; fi; sleep 1; echo survivor-$XDEV_RANK",
    ]);
    assert_eq!(code(&out), 7);
    assert!(!String::from_utf8_lossy(&out.stdout).contains("survivor"));
}

#[test]
fn psm2_segments_of_crashed_ranks_are_removed() {
    let me = std::process::id().to_string();
    let stranger = psm2_segment(0xfd00_0000_0000_0000 | u64::from(std::process::id()) << 8);
    std::fs::write(&stranger, b"x").unwrap();
    let exe = std::env::current_exe().unwrap();
    let out = Command::new(LAUNCHER)
        .args(["-n", "2", "--keep-going", "--timeout", "15", "--"])
        .arg(exe)
        .args(["child", "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, "psm2-leak")
        .env("XDEV_TEST_PARENT", &me)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_ne!(code(&out), 0, "the ranks abort");
    for rank in 0..2 {
        let seg = psm2_segment(psm2_test_epid(rank));
        assert!(
            !std::path::Path::new(&seg).exists(),
            "{seg} left behind: {}",
            stderr(&out)
        );
    }
    assert!(std::path::Path::new(&stranger).exists(), "not the job's");
    std::fs::remove_file(stranger).unwrap();
}

/// Issue 21: a rank that stores another rank's PSM2 record cannot make the
/// launcher's sweep (of `run_job` and of `xdev-run`) remove a segment that
/// is not its own, even one that looks abandoned.
#[test]
fn a_psm2_record_put_by_another_rank_is_ignored() {
    let epid = 0xfc00_0000_0000_0000 | u64::from(std::process::id()) << 8;
    let victim = psm2_segment(epid);
    let exe = std::env::current_exe().unwrap();
    let args = ["child", "--exact", "--nocapture", "--test-threads=1"];
    let victim_hex = format!("{epid:x}");
    let make = || {
        let f = std::fs::File::create(&victim).unwrap();
        let old = std::time::SystemTime::now() - Duration::from_secs(3600);
        f.set_modified(old).unwrap();
    };
    make();
    let st = xdev::devkit::launch::run_job(
        2,
        &exe,
        &args,
        &[(ROLE, "psm2-forge"), ("XDEV_TEST_VICTIM", &victim_hex)],
    )
    .unwrap();
    assert!(st.success(), "{st:?}");
    let kept_by_run_job = std::path::Path::new(&victim).exists();
    make();
    let out = Command::new(LAUNCHER)
        .args(["-n", "2", "--timeout", "15", "--"])
        .arg(&exe)
        .args(args)
        .env(ROLE, "psm2-forge")
        .env("XDEV_TEST_VICTIM", &victim_hex)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let kept_by_xdev_run = std::path::Path::new(&victim).exists();
    let _ = std::fs::remove_file(&victim);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(
        kept_by_run_job,
        "run_job removed a segment on a forged record"
    );
    assert!(
        kept_by_xdev_run,
        "xdev-run removed a segment on a forged record"
    );
}

#[test]
fn all_ranks_succeed() {
    let (out, _) = run(&[
        "-n",
        "3",
        "--",
        "sh",
        "-c",
        "test \"$XDEV_SIZE\" = 3 && exit 0",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
}

#[test]
fn environment_is_set_per_rank() {
    let (out, _) = run(&[
        "-n",
        "2",
        "--device",
        "shm",
        "--",
        "sh",
        "-c",
        "test \"$XDEV_DEVICE\" = shm && test ${#XDEV_SECRET} = 64 && test -n \"$XDEV_JOB\" \
         && case $XDEV_BOOTSTRAP in 127.0.0.1:*) ;; *) exit 3;; esac \
         && test \"$XDEV_RANK\" -lt 2",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    // Without --device, XDEV_DEVICE is not passed on from the launcher's environment.
    let out = Command::new(LAUNCHER)
        .args(["-n", "1", "--", "sh", "-c", "test -z \"$XDEV_DEVICE\""])
        .env("XDEV_DEVICE", "stale")
        .output()
        .unwrap();
    assert_eq!(code(&out), 0, "{}", stderr(&out));
}

#[test]
fn a_failing_rank_stops_the_others() {
    let (out, took) = run(&[
        "-n",
        "3",
        "--",
        "sh",
        "-c",
        "if [ $XDEV_RANK = 1 ]; then exit 7; fi; sleep 30",
    ]);
    assert_eq!(code(&out), 7, "{}", stderr(&out));
    assert!(took < Duration::from_secs(10), "took {took:?}");
    let err = stderr(&out);
    assert!(err.contains("rank 1 exited with status 7"), "{err}");
}

#[test]
fn a_rank_killed_by_a_signal_gives_128_plus_signal() {
    let (out, took) = run(&[
        "-n",
        "2",
        "--",
        "sh",
        "-c",
        "if [ $XDEV_RANK = 0 ]; then kill -KILL $$; fi; sleep 30",
    ]);
    assert_eq!(code(&out), 128 + 9, "{}", stderr(&out));
    assert!(took < Duration::from_secs(10), "took {took:?}");
    assert!(
        stderr(&out).contains("rank 0 was killed by signal 9"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn ranks_that_ignore_sigterm_are_killed() {
    let (out, took) = run(&[
        "-n",
        "2",
        "--",
        "sh",
        "-c",
        // Rank 0 fails once rank 1 has surely set its trap.
        "trap '' TERM; if [ $XDEV_RANK = 0 ]; then sleep 0.3; exit 3; fi; sleep 30",
    ]);
    assert_eq!(code(&out), 3, "{}", stderr(&out));
    // SIGTERM was ignored, so SIGKILL came after the 2 s grace.
    assert!(took >= Duration::from_secs(2), "took {took:?}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
}

#[test]
fn timeout_stops_everything() {
    let (out, took) = run(&["-n", "2", "--timeout", "0.5", "--", "sleep", "30"]);
    assert_eq!(code(&out), 124, "{}", stderr(&out));
    assert!(took < Duration::from_secs(10), "took {took:?}");
    assert!(stderr(&out).contains("timeout"), "{}", stderr(&out));
}

#[test]
fn label_prefixes_each_line() {
    let (out, _) = run(&[
        "-n",
        "2",
        "--label",
        "--",
        "sh",
        "-c",
        "echo hello $XDEV_RANK; echo second; printf partial; echo oops >&2",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    for r in 0..2 {
        for line in [
            format!("[{r}] hello {r}"),
            format!("[{r}] second"),
            format!("[{r}] partial"),
        ] {
            assert!(
                stdout.lines().any(|l| l == line),
                "{line:?} missing in {stdout:?}"
            );
        }
        assert!(stderr(&out).lines().any(|l| l == format!("[{r}] oops")));
    }
    assert!(stdout
        .lines()
        .all(|l| l.starts_with("[0] ") || l.starts_with("[1] ")));
}

#[test]
fn usage_errors_and_missing_programs() {
    assert_eq!(code(&run(&["--", "true"]).0), 2, "-n is required");
    assert_eq!(code(&run(&["-n", "0", "--", "true"]).0), 2);
    assert_eq!(code(&run(&["-n", "2"]).0), 2, "a program is required");
    assert_eq!(code(&run(&["-n", "2", "--bogus", "true"]).0), 2);
    let (help, _) = run(&["--help"]);
    assert_eq!(code(&help), 0);
    assert!(String::from_utf8_lossy(&help.stdout).contains("--serve"));
    let (out, _) = run(&["-n", "2", "--", "/nonexistent/program"]);
    assert_eq!(code(&out), 127, "{}", stderr(&out));
}

#[test]
fn ranks_exchange_through_the_bootstrap() {
    let (out, _) = run_role("allgather", 3, &["--device", "shm", "--label"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(code(&out), 0, "{stdout}\n{}", stderr(&out));
    for r in 0..3 {
        let prefix = format!("[{r}] ");
        let said = format!("rank {r} ok");
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with(&prefix) && l.contains(&said)),
            "{stdout}"
        );
    }
}

#[test]
fn a_dead_rank_is_reported_to_the_others() {
    let (out, _) = run_role("death", 2, &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(code(&out), 0, "{stdout}\n{}", stderr(&out));
    assert!(stdout.contains("death seen after"), "{stdout}");
}

#[test]
fn serve_mode_prints_the_environment_and_waits_for_the_ranks() {
    use std::io::{BufRead, BufReader};
    let mut serve = Command::new(LAUNCHER)
        .args(["--serve", "-n", "2", "--timeout", "15"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(serve.stdout.take().unwrap()).lines();
    let mut env = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        if line.starts_with('#') {
            break;
        }
        let kv = line.strip_prefix("export ").expect("export lines");
        let (k, v) = kv.split_once('=').unwrap();
        env.push((k.to_string(), v.trim_matches('\'').to_string()));
    }
    let names: Vec<&str> = env.iter().map(|(k, _)| k.as_str()).collect();
    for var in ["XDEV_BOOTSTRAP", "XDEV_SECRET", "XDEV_JOB", "XDEV_SIZE"] {
        assert!(names.contains(&var), "{var} missing from {names:?}");
    }
    // Start the two ranks "by hand", as a scheduler would.
    let me = std::env::current_exe().unwrap();
    let ranks: Vec<_> = (0..2)
        .map(|r| {
            Command::new(&me)
                .args(["child", "--exact", "--nocapture", "--test-threads=1"])
                .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
                .env("XDEV_RANK", r.to_string())
                .env("XDEV_DEVICE", "shm")
                .env(ROLE, "allgather")
                .stdout(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for r in ranks {
        let out = r.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
    // The service exits once both ranks have come and gone.
    let status = serve.wait().unwrap();
    assert_eq!(status.code(), Some(0));
}
