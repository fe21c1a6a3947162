//! Cycle-counter timestamps (as perftest's `get_cycles`), calibrated
//! against the monotonic clock.

use std::time::{Duration, Instant};

/// The time-stamp counter: one instruction, no system call (perftest's
/// `get_cycles`). Elsewhere than x86-64, nanoseconds since an arbitrary
/// start.
#[inline(always)]
pub fn cycles() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `rdtsc` only reads the time-stamp counter; every x86-64
        // CPU has it.
        unsafe { core::arch::x86_64::_rdtsc() }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        use std::sync::OnceLock;
        static START: OnceLock<Instant> = OnceLock::new();
        START.get_or_init(Instant::now).elapsed().as_nanos() as u64
    }
}

/// Converts cycles to time: started once, it measures the counter's rate
/// against `Instant` over everything that happened since.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    t0: Instant,
    c0: u64,
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock {
    /// Starts the calibration.
    pub fn new() -> Clock {
        Clock {
            t0: Instant::now(),
            c0: cycles(),
        }
    }

    /// Cycles per microsecond, measured over at least 20 ms (waits for the
    /// rest when called earlier).
    pub fn cycles_per_us(&self) -> f64 {
        let min = Duration::from_millis(20);
        let e = self.t0.elapsed();
        if e < min {
            std::thread::sleep(min - e);
        }
        let c = cycles();
        let us = self.t0.elapsed().as_secs_f64() * 1e6;
        (c.wrapping_sub(self.c0)) as f64 / us
    }
}

#[cfg(test)]
mod tests;
