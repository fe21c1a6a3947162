//! Choosing a device by name at run time (MPJ's `Device.newInstance(name)`).
//!
//! `xdev` knows no device: each device crate exports a `register` function
//! that adds its constructors, and the crate that assembles a runtime (the
//! benchmarks, a launcher, an MPI layer) builds a [`Registry`] from the crates
//! it links. No crate cycle is needed.

use std::fmt;
use std::sync::Arc;

use crate::{Config, Device, Error, OptionSpec, Result};

/// Opens a device for one rank.
pub type Constructor = fn(&Config) -> Result<Arc<dyn Device>>;

/// How a registered device runs.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Ranks are threads of one process.
    Threads,
    /// Ranks are processes started by a launcher (`xdev-run`).
    Processes,
}

/// One registered device.
#[derive(Clone)]
pub struct Entry {
    /// Registry name.
    pub name: &'static str,
    /// One-line description.
    pub description: &'static str,
    /// Threads or processes.
    pub placement: Placement,
    /// The options the device knows; opening it with any other key fails
    /// with [`Error::UnknownOption`].
    pub options: &'static [OptionSpec],
    /// The constructor.
    pub open: Constructor,
}

impl fmt::Debug for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Entry")
            .field("name", &self.name)
            .field("placement", &self.placement)
            .finish()
    }
}

/// Device constructors by name.
#[derive(Clone, Debug, Default)]
pub struct Registry {
    entries: Vec<Entry>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) a device.
    pub fn register(&mut self, entry: Entry) {
        self.entries.retain(|e| e.name != entry.name);
        self.entries.push(entry);
    }

    /// Opens device `name` for the rank described by `config`.
    pub fn open(&self, name: &str, config: &Config) -> Result<Arc<dyn Device>> {
        config.validate()?;
        let e = self
            .get(name)
            .ok_or_else(|| Error::UnknownDevice(name.to_string()))?;
        let _span = tracing::debug_span!("open", device = name).entered();
        match (e.open)(config) {
            Ok(dev) => {
                tracing::info!(
                    device = name,
                    rank = dev.id(),
                    size = dev.size(),
                    "device open"
                );
                Ok(dev)
            }
            Err(err) => {
                tracing::warn!(device = name, error = %err, "device open failed");
                Err(err)
            }
        }
    }

    /// The entry for `name`.
    pub fn get(&self, name: &str) -> Option<&Entry> {
        self.entries.iter().find(|e| e.name == name)
    }

    /// All entries, in registration order.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }
}
