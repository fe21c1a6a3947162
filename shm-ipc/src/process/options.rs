//! The process device's options: [`ProcessOptions`], [`CmaMode`], and the
//! [`RendezvousPath`] found at start-up.

use xdev::devkit::{OptionSpec, Options};
use xdev::{Config, Error, Result};

use crate::ring::INLINE;

/// How rendezvous data moves.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum CmaMode {
    /// Use `process_vm_readv` where the kernel allows it and it is fast
    /// enough here: at start-up rank 0 times a 1 MiB CMA copy and the
    /// pipelined copy of 1 MiB one way with both cores (its thread copies
    /// `fragment_bytes` pieces into a ring-sized buffer, a helper on the
    /// next rank's cores copies them out), and the job uses CMA only if it
    /// reaches [`CMA_MIN_SPEED`] of the pipelined copy's speed. (The
    /// pipelined path costs two copies per byte, one per core, CMA one:
    /// below half the speed, CMA loses one way and both ways. Under
    /// virtualization CMA's page pinning can make it several times slower:
    /// on one 2-core VM it reached about 0.2 of `memcpy`, and the pipelined
    /// path was 2.3 times faster at 4 MiB.) Default.
    Auto,
    /// Use CMA whenever the kernel allows it (one copy, the sender's core
    /// stays free, the sender need not make progress).
    On,
    /// Never use CMA: always the pipelined copy through the segment.
    Off,
}

/// With `cma=auto`, CMA is used only if its measured speed is at least this
/// fraction of the pipelined copy's (one way, both cores; see
/// [`CmaMode::Auto`]).
pub const CMA_MIN_SPEED: f64 = 0.5;

impl std::str::FromStr for CmaMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(CmaMode::Auto),
            "on" => Ok(CmaMode::On),
            "off" => Ok(CmaMode::Off),
            _ => Err(format!("cma must be auto, on or off, not {s:?}")),
        }
    }
}

/// The rendezvous path found at start-up (see [`ProcessDevice::rendezvous`](super::ProcessDevice::rendezvous)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RendezvousPath {
    /// One copy with `process_vm_readv`.
    Cma,
    /// Fragments through the ring (two copies, pipelined), and why.
    Pipelined(String),
}

/// Tunables of the process device. Every field can be set through
/// [`Config::options`] under the same name; all ranks must agree on
/// `ring_bytes` and `credit_bytes`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessOptions {
    /// Largest payload sent eagerly (default 16 KiB, capped by the ring).
    ///
    /// Chosen by `xdev-bench --device shm --test latency --option
    /// eager_limit=N` for N = 4, 8, 16 and 32 KiB on the 2-core test machine
    /// (rendezvous by the pipelined copy, the default path there): eager
    /// beats rendezvous at 8 KiB (0.44 vs 0.82 us) and at 16 KiB (0.67 vs
    /// 1.10 us); 32 KiB cannot be eager with the default 64 KiB rings (one
    /// message carries at most 32,728 bytes), and raising the limit to that
    /// changed nothing measurable at 16 KiB.
    pub eager_limit: usize,
    /// Bytes per pair ring (default as the thread device: 64 KiB up to 22
    /// ranks, then 32 MiB / n², at least 8 KiB). Each rank's inbox holds
    /// `size` rings.
    pub ring_bytes: usize,
    /// Eager bytes (plus 64 per message) a sender may have unreceived at one
    /// receiver before it switches to rendezvous (default 4 × `ring_bytes`).
    pub credit_bytes: usize,
    /// CMA use (default `auto`).
    pub cma: CmaMode,
    /// Fragment size of the pipelined rendezvous (default a quarter of the
    /// ring, so that several fragments are in flight).
    pub fragment_bytes: usize,
    /// Rendezvous sends a rank has started towards one destination and not
    /// yet seen finished (default 65,536; a held header costs the receiver
    /// about 100 bytes). More wait in the sender's queue to that
    /// destination, in order, and later sends to it (of any context) wait
    /// behind them. A receiver so holds at most this many of one sender's
    /// rendezvous headers, matched or not; a sender that exceeds it breaks
    /// the protocol (`Error::Protocol`), which bounds what a hostile peer
    /// can make a receiver keep.
    pub rndv_window: usize,
    /// CMA copies of at least this many bytes are split with the sender
    /// (default 64 KiB; 0: never): the receiver reads the first half while
    /// the sender writes the second half into the receiver's buffer
    /// (`process_vm_writev`), so both cores copy. A one-way stream then
    /// runs at about two copies' speed instead of one. Not done while the
    /// receiver has rendezvous sends of its own out to that sender (a
    /// two-way exchange, where both cores already copy). Measured here at
    /// 32, 64 and 128 KiB: the split wins one-way from 32 KiB (latency 5.0
    /// vs 7.3 us, bw 11.4 vs 7.3 GB/s at 32 KiB).
    pub cma_split_bytes: usize,
    /// Rendezvous messages shorter than this take the pipelined copy even
    /// where CMA is used (default 256 KiB with `cma=auto`, 0 with `cma=on`,
    /// which forces CMA for every rendezvous).
    /// A CMA copy pays a system call and the pinning of the pages, which
    /// the pipelined copy's two cores overlap: measured here
    /// (`xdev-bench --device shm --option cma=on|off`, each twice), the
    /// pipelined copy is ahead below 256 KiB (bw 19.0-21.0 against 5.8-6.7
    /// GB/s at 32 KiB, 20.8-22.0 against 10.0-12.4 at 64 KiB; bibw 21.8-22.0
    /// against 12.1-12.9 at 32 KiB, 13.8-14.1 against 8.5-11.8 at 128 KiB;
    /// latency 2.2 against 5.5-7.7 us at 32 KiB, 5.7 against 9.4-13.2 at
    /// 128 KiB), and CMA from 256 KiB (bw 18.6-23.6 against 12.7-13.0,
    /// bibw 19.5-21.1 against 12.1-12.9 GB/s).
    pub cma_min_bytes: usize,
    /// Copy a rendezvous whose send buffer lies in the sender's shared
    /// arena (xdev's page-aligned buffers from 256 KiB, see
    /// `xdev::devkit::shared_arena`) from the sender's pages mapped here,
    /// with non-temporal stores, instead of by CMA (default on; used only
    /// where CMA is, and for copies CMA would make: from `cma_min_bytes`).
    /// The kernel's copy runs at `memcpy`'s speed; the streaming copy skips
    /// reading the destination first: measured with both cores copying,
    /// 1.5-1.9x `memcpy` at 512 KiB-1 MiB (see the report's per-path
    /// table for osu_bibw).
    pub mapped: bool,
}

impl ProcessOptions {
    /// Defaults for a world of `size` ranks.
    pub fn for_size(size: usize) -> Self {
        let t = crate::ThreadOptions::for_size(size);
        ProcessOptions {
            eager_limit: 16 << 10,
            ring_bytes: t.ring_bytes,
            credit_bytes: t.credit_bytes,
            cma: CmaMode::Auto,
            fragment_bytes: t.ring_bytes / 4,
            rndv_window: 65_536,
            cma_split_bytes: 64 << 10,
            cma_min_bytes: 256 << 10,
            mapped: true,
        }
    }

    /// The options the `shm` device knows.
    pub const KEYS: &'static [OptionSpec] = &[
        OptionSpec::new(
            "eager_limit",
            "a byte count",
            "largest payload sent eagerly (16 KiB)",
        ),
        crate::engine::RING_BYTES_SPEC,
        crate::engine::CREDIT_BYTES_SPEC,
        OptionSpec::new(
            "cma",
            "one of auto, on, off",
            "rendezvous by process_vm_readv: auto (timed at start-up), on, off",
        ),
        OptionSpec::new(
            "fragment_bytes",
            "a byte count",
            "fragment of the pipelined rendezvous (ring_bytes / 4)",
        ),
        OptionSpec::new(
            "rndv_window",
            "a count",
            "rendezvous sends in flight to one destination (65,536)",
        ),
        OptionSpec::new(
            "cma_split_bytes",
            "a byte count",
            "CMA copies this large are split with the sender (64 KiB; 0: never)",
        ),
        OptionSpec::new(
            "cma_min_bytes",
            "a byte count",
            "shorter rendezvous take the pipelined copy (256 KiB; with cma=on 0)",
        ),
        OptionSpec::new(
            "mapped",
            "true or false",
            "copy from the sender's shared arena mapped here where CMA is used (true)",
        ),
    ];

    /// Defaults for `config.size`, overridden by its options; an option the
    /// device does not know ([`KEYS`](Self::KEYS)) or one that does not parse
    /// is an error.
    pub fn from_config(config: &Config) -> Result<Self> {
        let opts = Options::new("shm", Self::KEYS, config)?;
        let d = Self::for_size(config.size);
        let ring_bytes = crate::engine::ring_bytes_option(&opts, d.ring_bytes)?;
        let cma = opts.get("cma", d.cma)?;
        // `cma=on` forces CMA for every rendezvous unless told otherwise.
        let min_default = match cma {
            CmaMode::On => 0,
            CmaMode::Auto | CmaMode::Off => d.cma_min_bytes,
        };
        let o = ProcessOptions {
            eager_limit: opts.get("eager_limit", d.eager_limit)?,
            ring_bytes,
            credit_bytes: opts.get("credit_bytes", 4 * ring_bytes)?,
            cma,
            fragment_bytes: opts.get("fragment_bytes", ring_bytes / 4)?,
            rndv_window: opts.get("rndv_window", d.rndv_window)?,
            cma_split_bytes: opts.get("cma_split_bytes", d.cma_split_bytes)?,
            cma_min_bytes: opts.get("cma_min_bytes", min_default)?,
            mapped: opts.get("mapped", d.mapped)?,
        };
        if o.rndv_window == 0 {
            return Err(Error::Config("rndv_window must be at least 1".into()));
        }
        if o.fragment_bytes < INLINE {
            return Err(Error::Config(format!(
                "fragment_bytes must be at least {INLINE}"
            )));
        }
        Ok(o)
    }

    /// The slot count of every ring these options make (what a rank
    /// publishes in its record, and its peers check).
    pub fn nslots(&self) -> usize {
        crate::ring::slots_for_bytes(self.ring_bytes)
    }
}
