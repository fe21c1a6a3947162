//! The data check (`--check`): the pattern each side writes, and reading
//! it back.

use ibvx::verbs::MemoryRegion;

use super::CHECK_REGION;
use crate::pingpong::error::PingpongError;

/// Byte `j` of message `iter` from the side with `seed` (`--check`).
#[inline]
pub fn pattern(seed: u8, iter: u64, j: usize) -> u8 {
    (iter as u8).wrapping_mul(31).wrapping_add(seed)
        ^ (j as u8).wrapping_mul(7)
        ^ ((j >> 8) as u8).wrapping_mul(13)
}

pub(super) fn fill(mr: &mut MemoryRegion<'_>, offset: usize, len: usize, seed: u8, iter: u64) {
    mr.fill(offset, len, |j| pattern(seed, iter, j));
}

/// Checks that `len` bytes at `offset` hold message `iter` of the side with
/// `seed`. Runs once per message with `--check`: it allocates nothing, and
/// `what` (the context of the error) is only formatted on a mismatch.
pub(super) fn verify(
    mr: &MemoryRegion<'_>,
    offset: usize,
    len: usize,
    seed: u8,
    iter: u64,
    what: impl Fn() -> String,
) -> Result<(), PingpongError> {
    check_pattern(|at, out| mr.read(offset + at, out), len, seed, iter, what)
}

/// [`verify`] over any source of bytes: `read(at, out)` fills `out` with
/// the bytes at `at`; they are compared in chunks of a stack buffer.
pub(super) fn check_pattern(
    mut read: impl FnMut(usize, &mut [u8]),
    len: usize,
    seed: u8,
    iter: u64,
    what: impl Fn() -> String,
) -> Result<(), PingpongError> {
    let mut buf = [0u8; 4096];
    let mut done = 0;
    while done < len {
        let n = buf.len().min(len - done);
        read(done, &mut buf[..n]);
        if let Some(k) = (0..n).find(|&k| buf[k] != pattern(seed, iter, done + k)) {
            let j = done + k;
            return Err(PingpongError::DataCheck(format!(
                "{}: byte {j} of message {iter} is {:#04x}, expected {:#04x}",
                what(),
                buf[k],
                pattern(seed, iter, j)
            )));
        }
        done += n;
    }
    Ok(())
}

/// Slots of the `--check` bandwidth test for `size`-byte messages and a
/// window of `window` writes.
pub fn check_slots(window: u32, size: usize) -> usize {
    (window as usize).clamp(1, (CHECK_REGION / size.max(1)).max(1))
}
