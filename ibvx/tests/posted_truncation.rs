//! A rendezvous-size message into a smaller receive posted before it was
//! sent must report the truncation with the sender's length, on every
//! multi-process device that runs here. (libpsm2 itself does not report it
//! for such messages; the psm device carries the length in its tag.)

use std::time::Duration;

use xdev::launch::LocalJob;

fn run(device: &str) {
    let job = LocalJob::start(
        2,
        env!("CARGO_BIN_EXE_xdev-rank"),
        &["posted-truncation"],
        &[("XDEV_DEVICE", device)],
    )
    .expect("start job");
    let exits = job.wait(Duration::from_secs(120)).expect("job ends");
    for (r, e) in exits.iter().enumerate() {
        assert!(e.success, "{device} rank {r}: {}{}", e.stdout, e.stderr);
    }
}

#[test]
fn shm() {
    run("shm");
}

#[test]
fn psm() {
    if let Err(e) = psm_sys::Psm2::load() {
        println!("skipped: {e}");
        return;
    }
    run("psm");
}
