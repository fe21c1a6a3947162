use super::*;

#[test]
fn a_hung_job_is_killed_and_reported_with_its_output() {
    let job = LocalJob::start(2, "sh", &["-c", "echo started; exec sleep 30"], &[]).unwrap();
    let t = Instant::now();
    match job.wait(Duration::from_secs(2)) {
        Err(Error::Transport { context, .. }) => {
            assert!(context.contains("timed out"), "{context}");
            assert!(context.contains("rank 1: started"), "{context}");
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(10), "not killed");
}

#[test]
fn run_job_returns_the_first_failure_and_stops_the_others() {
    let t = Instant::now();
    let st = run_job(
        3,
        "sh",
        &[
            "-c",
            "if [ $XDEV_RANK = 1 ]; then exit 7; fi; exec sleep 30",
        ],
        &[],
    )
    .unwrap();
    assert_eq!(st.code(), Some(7));
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "the others were not stopped"
    );
    let st = run_job(
        2,
        "sh",
        &["-c", "test $XDEV_SIZE = 2 && test -n \"$V\""],
        &[("V", "x")],
    )
    .unwrap();
    assert!(st.success());
}

#[test]
fn failures_lists_only_the_failed_ranks() {
    let job =
        LocalJob::start(2, "sh", &["-c", "echo out$XDEV_RANK; exit $XDEV_RANK"], &[]).unwrap();
    let exits = job.wait(Duration::from_secs(30)).unwrap();
    assert_eq!(failures(&exits), "rank 1: out1\n");
}

/// The context switches a thread of this process made of its own accord,
/// from `/proc/self/task/TID/status`.
fn voluntary_switches(tid: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("a voluntary_ctxt_switches line")
}

/// The thread of this process named `name` (its first 15 bytes).
fn thread_named(name: &str) -> Option<String> {
    std::fs::read_dir("/proc/self/task").ok()?.find_map(|e| {
        let tid = e.ok()?.file_name().into_string().ok()?;
        let comm = std::fs::read_to_string(format!("/proc/self/task/{tid}/comm")).ok()?;
        (comm.trim_end() == &name[..name.len().min(15)]).then_some(tid)
    })
}

#[test]
fn the_launcher_and_its_service_sleep_while_the_ranks_run() {
    // Ranks that run for 0.6 s. A launcher that polled its children, or an
    // accept loop that polled its listener, every 5 ms would wake about
    // 120 times meanwhile; waiting on pidfds and in poll, they wake a few
    // times (each exit, the ranks' connections).
    // "PID/task/TID"
    let me = std::fs::read_link("/proc/thread-self").unwrap();
    let me = me.file_name().unwrap().to_string_lossy().into_owned();
    let watcher = std::thread::spawn(|| {
        std::thread::sleep(Duration::from_millis(150));
        let tid = thread_named("xdev-bootstrap-accept").expect("the accept thread runs");
        let first = voluntary_switches(&tid);
        std::thread::sleep(Duration::from_millis(300));
        voluntary_switches(&tid) - first
    });
    let before = voluntary_switches(&me);
    let st = run_job(2, "sleep", &["0.6"], &[]).unwrap();
    let launcher = voluntary_switches(&me) - before;
    let acceptor = watcher.join().unwrap();
    assert!(st.success());
    assert!(launcher <= 20, "the launcher woke {launcher} times");
    assert!(
        acceptor <= 10,
        "the accept loop woke {acceptor} times in 0.3 s"
    );
}

#[test]
fn a_local_job_is_waited_for_without_a_timer() {
    let me = std::fs::read_link("/proc/thread-self").unwrap();
    let me = me.file_name().unwrap().to_string_lossy().into_owned();
    let job = LocalJob::start(2, "sleep", &["0.6"], &[]).unwrap();
    let before = voluntary_switches(&me);
    let exits = job.wait(Duration::from_secs(30)).unwrap();
    let woke = voluntary_switches(&me) - before;
    assert!(exits.iter().all(|e| e.success));
    // A 5 ms poll of the children would wake about 120 times.
    assert!(woke <= 20, "the waiting thread woke {woke} times");
}
