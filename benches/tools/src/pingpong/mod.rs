//! The engine of `ibvx-pingpong`: verbs latency and bandwidth between two
//! processes, at the level of `ibv_rc_pingpong` and perftest.
//!
//! Three tests over one RC queue pair, each mirroring perftest's loop so the
//! numbers compare one to one:
//!
//! - `send_lat` ([`TestKind::SendLat`]): send/receive pingpong; every send
//!   is signaled and awaited (perftest's `ib_send_lat`).
//! - `write_lat` ([`TestKind::WriteLat`]): RDMA-write pingpong; each side
//!   polls the last byte of its region for the peer's iteration count
//!   (`ib_write_lat`).
//! - `write_bw` ([`TestKind::WriteBw`]): the client keeps a window of RDMA
//!   writes outstanding (`ib_write_bw`).
//!
//! Latency samples are half the time between consecutive posts (one round
//! trip), taken with the cycle counter; `t_typical` is the median after
//! perftest drops the two largest samples ([`stats::latency_stats`]).
//! Bandwidth is in MiB/s, which perftest labels MB/sec
//! ([`stats::bw_stats`]).
//!
//! The two sides meet over TCP (the server listens, default port 18515).
//! With another `ibvx-pingpong` they speak the native protocol of [`wire`],
//! which carries the test parameters so that mismatched options are refused
//! at the handshake, and synchronizes before every size. With `--perftest`
//! the client speaks perftest's own exchange ([`perftest`]); a server
//! recognizes either protocol from the client's first bytes. Every wait has
//! a limit (`--timeout`), and a peer that goes away mid-run is noticed on
//! the TCP connection (and through failed completions).
//!
//! ```no_run
//! use xdev_tools::pingpong::{parse, run, Command};
//!
//! let Command::Run(opts) = parse(["--test", "write_lat", "-s", "8", "10.77.0.1"]).unwrap() else {
//!     unreachable!()
//! };
//! let rows = run(&opts, &mut std::io::stdout()).unwrap();
//! println!("{} sizes measured", rows.len());
//! ```

mod clock;
mod error;
mod net;
mod options;
pub mod perftest;
mod run;
pub mod stats;
pub mod wire;

pub use clock::{cycles, Clock};
pub use error::PingpongError;
pub use net::Link;
pub use options::{
    all_sizes, parse, parse_bytes, Command, Options, TestKind, ALL_MAX_SIZE, DEFAULT_PORT, HELP,
    MAX_SIZE,
};
pub use run::{check_slots, pattern, run, PeerKind, Row, RowStats, CHECK_REGION};
