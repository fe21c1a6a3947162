use super::*;

#[test]
fn mpi_versions() {
    assert_eq!(
        version_of("mpirun.openmpi (OpenRTE) 4.1.4\n\nReport bugs").as_deref(),
        Some("mpirun.openmpi (OpenRTE) 4.1.4")
    );
    assert_eq!(
        version_of("HYDRA build details:\n    Version:      4.0.2\n").as_deref(),
        Some("version 4.0.2")
    );
    assert_eq!(version_of(""), None);
}

#[test]
fn an_absent_mpi_is_not_measured_with_the_install_command() {
    let missing = Mpi {
        name: "Nope MPI",
        series: "Nope",
        mpicc: "mpicc.surely-not-installed",
        mpirun: "mpirun.surely-not-installed",
        run_args: &[],
        over_psm2: false,
    };
    let e = measure_mpi(&missing, Path::new("/nonexistent"), 8, 1, true).unwrap_err();
    assert!(
        e.contains("not installed") && e.contains(MPI_INSTALL),
        "{e}"
    );
}

#[test]
fn captured_runs_report_failures_and_time_limits() {
    let mut seen = Vec::new();
    let (out, r) = run_captured(
        Command::new("sh").args(["-c", "echo a; echo b"]),
        Duration::from_secs(30),
        |l| seen.push(l.to_string()),
    );
    assert_eq!((out.as_str(), r), ("a\nb\n", Ok(())));
    assert_eq!(seen, ["a", "b"]);
    let (out, r) = run_captured(
        Command::new("sh").args(["-c", "echo partial; exit 3"]),
        Duration::from_secs(30),
        |_| {},
    );
    assert_eq!(out, "partial\n", "what a failed run printed is kept");
    let e = r.unwrap_err();
    assert!(e.contains("exit status: 3"), "{e}");
    let (_, r) = run_captured(
        Command::new("sleep").arg("30"),
        Duration::from_millis(300),
        |_| {},
    );
    let e = r.unwrap_err();
    assert!(e.contains("stopped after"), "{e}");
}
