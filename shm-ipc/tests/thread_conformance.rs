//! The xdev conformance suite on the thread device with 1, 2, 4 and 64 ranks
//! (64 ranks on this 2-core machine checks that oversubscribed waits sleep
//! rather than livelock).

use std::sync::Mutex;
use std::time::Duration;

use shm_ipc::ThreadWorld;
use xdev::conformance::{run_case, Watchdog};

/// Cases run one at a time: they measure memory and time of the process.
static SERIAL: Mutex<()> = Mutex::new(());

fn run(n: usize, case: &str) {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let _dog = Watchdog::arm(
        format!("{case} on {n} thread ranks"),
        Duration::from_secs(300),
    );
    for (rank, r) in ThreadWorld::new(n)
        .run(|dev| run_case(dev, case))
        .into_iter()
        .enumerate()
    {
        if let Err(f) = r {
            panic!("rank {rank}: {f}");
        }
    }
}

mod one_rank {
    xdev::conformance_tests!(|case| super::run(1, case));
}

mod two_ranks {
    xdev::conformance_tests!(|case| super::run(2, case));
}

mod four_ranks {
    xdev::conformance_tests!(|case| super::run(4, case));
}

mod sixty_four_ranks {
    xdev::conformance_tests!(|case| super::run(64, case));
}
