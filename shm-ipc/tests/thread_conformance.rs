//! The xdev conformance suite on the thread device with 1, 2, 4 and 64 ranks,
//! and with 3 ranks on tiny rings (flow-control paths). 64 ranks on this
//! 2-core machine check that oversubscribed waits sleep rather than livelock.

use std::sync::Mutex;
use std::time::Duration;

use shm_ipc::ThreadWorld;
use xdev::devkit::conformance::{run_case, Watchdog};

/// Cases run one at a time: they measure memory and time of the process.
static SERIAL: Mutex<()> = Mutex::new(());

fn run(n: usize, case: &str) {
    run_in(ThreadWorld::new(n), n, case)
}

/// Rings of 4 KiB, a 1 KiB eager limit and 4 KiB of credit: full rings,
/// backlogs and credit-driven rendezvous happen all the time.
fn run_tiny(n: usize, case: &str) {
    let world = ThreadWorld::new(n)
        .option("ring_bytes", 4096)
        .option("eager_limit", 1024)
        .option("credit_bytes", 4096);
    run_in(world, n, case)
}

fn run_in(world: ThreadWorld, n: usize, case: &str) {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let _dog = Watchdog::arm(
        format!("{case} on {n} thread ranks"),
        Duration::from_secs(300),
    );
    for (rank, r) in world.run(|dev| run_case(dev, case)).into_iter().enumerate() {
        if let Err(f) = r {
            panic!("rank {rank}: {f}");
        }
    }
}

mod one_rank {
    xdev::devkit::conformance_tests!(|case| super::run(1, case));
}

mod two_ranks {
    xdev::devkit::conformance_tests!(|case| super::run(2, case));
}

mod four_ranks {
    xdev::devkit::conformance_tests!(|case| super::run(4, case));
}

mod sixty_four_ranks {
    xdev::devkit::conformance_tests!(|case| super::run(64, case));
}

mod three_ranks_tiny_rings {
    xdev::devkit::conformance_tests!(|case| super::run_tiny(3, case));
}
