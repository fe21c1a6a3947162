//! The atomics and fences the ring's shared words use: `std`'s (and the
//! doorbell's fence pair), or loom's in the `--cfg loom` build that
//! model-checks the ring and the biased lock (`tests/ring_loom.rs`,
//! `tests/biased_loom.rs`). Nothing else in the crate goes through this
//! shim.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

#[cfg(not(loom))]
pub(crate) use crate::doorbell::{heavy_fence, heavy_fence_strict, init_fences, light_fence};

/// Loom's fences are symmetric: there is no mode to fix.
#[cfg(loom)]
pub(crate) fn init_fences() {}

/// Loom has no `membarrier`: both halves of the handshake are the symmetric
/// form, `fence(SeqCst)`, which the doorbell also falls back to.
#[cfg(loom)]
pub(crate) fn light_fence() {
    loom::sync::atomic::fence(Ordering::SeqCst);
}

/// See [`light_fence`].
#[cfg(loom)]
pub(crate) fn heavy_fence() {
    loom::sync::atomic::fence(Ordering::SeqCst);
}

/// See [`light_fence`].
#[cfg(loom)]
pub(crate) fn heavy_fence_strict() {
    loom::sync::atomic::fence(Ordering::SeqCst);
}
