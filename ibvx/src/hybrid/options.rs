//! The hybrid device's options.

use xdev::{Config, Error, Result};

/// Options of the hybrid device (`Config` options).
///
/// - `remote=ibv|psm|shm`: the device between hosts (default `ibv`).
/// - `simulate_hosts=N`: pretend the job runs on `N` hosts, ranks split in
///   contiguous blocks (for tests on one machine; default: the real hosts).
/// - `local.KEY=VALUE`, `remote.KEY=VALUE`: options for the shared-memory and
///   the network device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HybridOptions {
    /// Registry name of the device between hosts.
    pub remote: String,
    /// Host count to simulate, if any.
    pub simulate_hosts: Option<usize>,
    /// Options for the shared-memory device.
    pub local_options: Vec<(String, String)>,
    /// Options for the network device.
    pub remote_options: Vec<(String, String)>,
}

impl HybridOptions {
    /// Reads the options from `config`.
    pub fn from_config(config: &Config) -> Result<HybridOptions> {
        let remote = config.option("remote", "ibv".to_string())?;
        if !["ibv", "psm", "shm"].contains(&remote.as_str()) {
            return Err(Error::Config(format!(
                "hybrid: remote={remote:?} is not one of ibv, psm, shm"
            )));
        }
        let simulate_hosts = match config.options.get("simulate_hosts") {
            None => None,
            Some(_) => {
                let n: usize = config.option("simulate_hosts", 1)?;
                if n == 0 {
                    return Err(Error::Config(
                        "hybrid: simulate_hosts must be at least 1".into(),
                    ));
                }
                Some(n)
            }
        };
        let prefixed = |p: &str| -> Vec<(String, String)> {
            config
                .options
                .iter()
                .filter_map(|(k, v)| k.strip_prefix(p).map(|k| (k.to_string(), v.clone())))
                .collect()
        };
        Ok(HybridOptions {
            remote,
            simulate_hosts,
            local_options: prefixed("local."),
            remote_options: prefixed("remote."),
        })
    }
}
