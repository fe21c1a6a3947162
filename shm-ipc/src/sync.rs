//! The atomics the ring's shared words use: `std`'s, or loom's in the
//! `--cfg loom` build that model-checks the ring (`tests/ring_loom.rs`).
//! Nothing else in the crate goes through this shim.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
