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
