//! The xdev conformance suite on the `psm` device with 2 and 4 processes on
//! this host (PSM2's shm-only mode here: no Omni-Path hardware). Skipped,
//! saying why, where libpsm2 is not installed.

use std::sync::Mutex;
use std::time::Duration;

use xdev::launch::LocalJob;

static SERIAL: Mutex<()> = Mutex::new(());

fn run(n: usize, case: &str) {
    if let Err(e) = psm_sys::Psm2::load() {
        println!("skipped: {e}");
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let job = LocalJob::start(
        n,
        env!("CARGO_BIN_EXE_xdev-rank"),
        &["conformance", case],
        &[("XDEV_DEVICE", "psm")],
    )
    .expect("start job");
    let exits = job.wait(Duration::from_secs(300)).expect("job ends");
    let failures = xdev::launch::failures(&exits);
    assert!(failures.is_empty(), "{failures}");
    // Honest about the mode it ran in.
    let shm_only = !std::path::Path::new("/dev/hfi1_0").exists();
    if shm_only {
        assert!(
            exits[0].stderr.contains("shm-only mode"),
            "{}",
            exits[0].stderr
        );
    }
}

mod two_processes {
    xdev::conformance_tests!(|case| super::run(2, case));
}

mod four_processes {
    xdev::conformance_tests!(|case| super::run(4, case));
}
