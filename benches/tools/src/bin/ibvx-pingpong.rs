//! `ibvx-pingpong`: send/recv latency, RDMA-write latency and RDMA-write
//! bandwidth between two processes over an RC queue pair, in perftest's
//! table layout; talks to another `ibvx-pingpong` or (with `--perftest`) to
//! perftest's `ib_send_lat`, `ib_write_lat` and `ib_write_bw`. See `--help`
//! and the `xdev_tools::pingpong` module.
//!
//! Exit status: 0 on success, 1 when the run fails (one line on stderr),
//! 2 for bad arguments.

use std::process::ExitCode;

use xdev_tools::pingpong::{parse, run, Command, HELP};

fn main() -> ExitCode {
    xdev_tools::init_tracing("ibvx-pingpong");
    let opts = match parse(std::env::args().skip(1)) {
        Ok(Command::Run(o)) => o,
        Ok(Command::Help) => {
            println!("{HELP}");
            return ExitCode::SUCCESS;
        }
        Ok(Command::Version) => {
            println!("ibvx-pingpong {}", env!("CARGO_PKG_VERSION"));
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("ibvx-pingpong: {e}");
            return ExitCode::from(2);
        }
    };
    match run(&opts, &mut std::io::stdout().lock()) {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ibvx-pingpong: error: {e}");
            ExitCode::FAILURE
        }
    }
}
