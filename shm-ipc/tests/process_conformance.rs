//! The xdev conformance suite on the `shm` process device with 2, 4 and 16
//! processes (16 on this 2-core machine checks that oversubscribed waits
//! sleep), with 2 and 4 processes forcing CMA rendezvous (`cma=on`; the
//! default may pick the pipelined copy where CMA is slow), and with 3
//! processes on tiny rings with CMA disabled (full rings, backlogs,
//! credit-driven rendezvous and the pipelined copy). Each case is a fresh
//! job: the test serves the bootstrap and starts `shm-rank` processes.

mod common;

use common::run_job;

fn run(n: usize, case: &str) {
    run_job(n, &["conformance", case]);
}

fn run_cma(n: usize, case: &str) {
    run_job(n, &["conformance", case, "cma=on"]);
}

fn run_tiny(n: usize, case: &str) {
    run_job(
        n,
        &[
            "conformance",
            case,
            "ring_bytes=4096",
            "eager_limit=1024",
            "credit_bytes=4096",
            "fragment_bytes=1000",
            "cma=off",
        ],
    );
}

mod two_processes {
    xdev::devkit::conformance_tests!(|case| super::run(2, case));
}

mod four_processes {
    xdev::devkit::conformance_tests!(|case| super::run(4, case));
}

mod two_processes_cma {
    xdev::devkit::conformance_tests!(|case| super::run_cma(2, case));
}

mod four_processes_cma {
    xdev::devkit::conformance_tests!(|case| super::run_cma(4, case));
}

mod sixteen_processes {
    xdev::devkit::conformance_tests!(|case| super::run(16, case));
}

mod three_processes_tiny_rings_no_cma {
    xdev::devkit::conformance_tests!(|case| super::run_tiny(3, case));
}
