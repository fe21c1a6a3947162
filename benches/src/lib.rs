//! `xdev-bench` is the stack's OSU-style benchmark harness: pingpong latency
//! and windowed bandwidth over any xdev [`Device`](xdev::Device), printed in the OSU
//! Micro-Benchmarks layout (or as JSON lines), next to **floors** measured in
//! the same run: the one-way hand-off of a cache line between the two ranks'
//! cores (two pinned threads, or for devices whose ranks are processes, the
//! two rank processes through a shared mapping: [`process`]), and
//! single-thread `memcpy` bandwidth over the same working set.
//!
//! It is not a timed test suite: nothing here asserts a speed. The figures are
//! ratios read side by side (value / floor).
//!
//! The library holds the whole tool; the `xdev-bench` binary only dispatches:
//!
//! - the measurements: the OSU loops ([`latency`], [`bandwidth`], ...), the
//!   floors ([`cache_line_floor`], [`memcpy_floor`], ...; between rank
//!   processes [`process`]), raw PSM2 ([`psm_raw`]) and the OSU layout
//!   ([`osu`]);
//! - the command line ([`cli`]), the rigs the ranks run on (`rig`: threads
//!   of this process, or this process as one rank of a job), the tests of a
//!   run printed as tables (`suite`);
//! - a run started by hand ([`orchestrate`]), which starts process devices'
//!   ranks by re-executing itself ([`launch`]), and one such rank ([`rank`]);
//! - the comparison report ([`report`], drawn with [`plot`]).

mod benchmarks;
pub mod cli;
mod floors;
pub mod launch;
pub mod orchestrate;
pub mod osu;
pub mod plot;
pub mod process;
pub mod psm_raw;
pub mod rank;
pub mod report;
mod rig;
mod suite;

pub(crate) use benchmarks::timed;
pub use benchmarks::{
    bandwidth, bandwidth_iterations, bibandwidth, bibandwidth_window, large_warm_up, latency,
    latency_iterations, mbw_pairs, message_rate, multi_bandwidth, sizes, BENCH_CONTEXT,
    WARM_UP_BYTES, WINDOW,
};
pub use floors::{
    cache_line_floor, memcpy_floor, parallel_memcpy_floor, rate_floor, HandoffLine, FLOOR_BUDGET,
};
