//! The `ibv` device's options, read from the job's configuration (the keys
//! and defaults are in the [`ibv`](super) module docs).

use xdev::devkit::{OptionSpec, Options};
use xdev::{Config, Error, Result};

use super::wire;

/// Configuration of the `ibv` device (see the module docs for the keys).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IbvOptions {
    /// RDMA device name (`None`: the first one).
    pub device: Option<String>,
    /// Port number.
    pub port: u8,
    /// GID table index (`None`: automatic).
    pub gid_index: Option<u32>,
    /// Largest eager payload in bytes.
    pub eager_limit: usize,
    /// Receive slots posted per peer.
    pub recv_depth: u32,
    /// Send slots shared by all peers.
    pub send_slots: usize,
    /// Unexpected eager bytes one peer may leave at this rank.
    pub eager_window: usize,
    /// Largest inline send.
    pub inline: u32,
    /// Registered memory the cache keeps for reuse.
    pub reg_cache_idle_bytes: usize,
    /// Registered user memory at once.
    pub max_pinned_bytes: usize,
}

impl Default for IbvOptions {
    fn default() -> Self {
        IbvOptions {
            device: None,
            port: 1,
            gid_index: None,
            eager_limit: 8192,
            recv_depth: 64,
            send_slots: 256,
            eager_window: 1 << 20,
            inline: 64,
            reg_cache_idle_bytes: 64 << 20,
            max_pinned_bytes: 1 << 30,
        }
    }
}

impl IbvOptions {
    /// The options the `ibv` device knows.
    pub const KEYS: &'static [OptionSpec] = &[
        OptionSpec::new(
            "ibv_device",
            "an RDMA device name",
            "RDMA device (the first one)",
        ),
        OptionSpec::new("ibv_port", "a port number, 1..=255", "port number (1)"),
        OptionSpec::new(
            "ibv_gid_index",
            "an integer",
            "GID table index (negative: chosen automatically)",
        ),
        OptionSpec::new(
            "eager_limit",
            "a byte count",
            "largest eager payload (8 KiB, at most 1 MiB)",
        ),
        OptionSpec::new(
            "recv_depth",
            "a count, 4..=4096",
            "receive slots posted per peer (64)",
        ),
        OptionSpec::new(
            "send_slots",
            "a count, 4..=65536",
            "send slots shared by all peers (256)",
        ),
        OptionSpec::new(
            "eager_window",
            "a byte count",
            "unexpected eager bytes one peer may leave at this rank (1 MiB)",
        ),
        OptionSpec::new("inline", "a byte count", "largest inline send (64)"),
        OptionSpec::new(
            "reg_cache_idle_bytes",
            "a byte count",
            "registered memory the cache keeps for reuse (64 MiB)",
        ),
        OptionSpec::new(
            "max_pinned_bytes",
            "a byte count",
            "registered user memory at once (1 GiB)",
        ),
    ];

    /// Reads the options from `config`, validating them; an option the
    /// device does not know ([`KEYS`](Self::KEYS)) or one that does not parse
    /// is an error.
    pub fn from_config(config: &Config) -> Result<IbvOptions> {
        let c = Options::new("ibv", Self::KEYS, config)?;
        let d = IbvOptions::default();
        let device: String = c.get("ibv_device", String::new())?;
        let gid: i64 = c.get("ibv_gid_index", -1)?;
        let o = IbvOptions {
            device: (!device.is_empty()).then_some(device),
            port: c.get("ibv_port", d.port)?,
            gid_index: u32::try_from(gid).ok(),
            eager_limit: c.get("eager_limit", d.eager_limit)?,
            recv_depth: c.get("recv_depth", d.recv_depth)?,
            send_slots: c.get("send_slots", d.send_slots)?,
            eager_window: c.get("eager_window", d.eager_window)?,
            inline: c.get("inline", d.inline)?,
            reg_cache_idle_bytes: c.get("reg_cache_idle_bytes", d.reg_cache_idle_bytes)?,
            max_pinned_bytes: c.get("max_pinned_bytes", d.max_pinned_bytes)?,
        };
        let bad = |what: String| Err(Error::Config(what));
        if o.recv_depth < 4 || o.recv_depth > 4096 {
            return bad(format!("recv_depth {} must be in 4..=4096", o.recv_depth));
        }
        if o.send_slots < 4 || o.send_slots > 65536 {
            return bad(format!("send_slots {} must be in 4..=65536", o.send_slots));
        }
        if o.eager_limit > 1 << 20 {
            return bad(format!(
                "eager_limit {} must be at most 1 MiB",
                o.eager_limit
            ));
        }
        if o.eager_window < o.eager_limit || o.eager_window > u32::MAX as usize {
            return bad(format!(
                "eager_window {} must be at least eager_limit ({}) and below 4 GiB",
                o.eager_window, o.eager_limit
            ));
        }
        if o.max_pinned_bytes == 0 {
            return bad("max_pinned_bytes must be positive".into());
        }
        Ok(o)
    }

    /// Send work requests per queue pair: every credit, plus the writes
    /// and ends of rendezvous sends.
    pub(crate) fn sq_depth(&self) -> u32 {
        self.recv_depth * 2 + 16
    }

    /// Bytes of one send or receive slot.
    pub(crate) fn slot_len(&self) -> usize {
        (wire::HEADER_LEN + self.eager_limit)
            .max(wire::MAX_CONTROL_LEN)
            .next_multiple_of(64)
    }
}

#[cfg(test)]
mod tests;
