//! The hybrid device's options.

use xdev::devkit::{OptionSpec, Options};
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
    /// The options the `hybrid` device knows.
    pub const KEYS: &'static [OptionSpec] = &[
        OptionSpec::new(
            "remote",
            "one of ibv, psm, shm",
            "the device between hosts (ibv)",
        ),
        OptionSpec::new(
            "simulate_hosts",
            "a count, at least 1",
            "pretend the job runs on this many hosts (tests on one machine)",
        ),
        OptionSpec::new(
            "local.",
            "local.KEY=VALUE",
            "an option of the shared-memory device, checked by it",
        ),
        OptionSpec::new(
            "remote.",
            "remote.KEY=VALUE",
            "an option of the device between hosts, checked by it",
        ),
    ];

    /// Reads the options from `config`; an option the device does not know
    /// ([`KEYS`](Self::KEYS)) or one that does not parse is an error (the
    /// `local.` and `remote.` ones are checked by the devices they go to).
    pub fn from_config(config: &Config) -> Result<HybridOptions> {
        let o = Options::new("hybrid", Self::KEYS, config)?;
        let remote = o.get("remote", "ibv".to_string())?;
        if !["ibv", "psm", "shm"].contains(&remote.as_str()) {
            return Err(Error::Config(format!(
                "hybrid: remote={remote:?} is not one of ibv, psm, shm"
            )));
        }
        let simulate_hosts = o.get_opt::<usize>("simulate_hosts")?;
        if simulate_hosts == Some(0) {
            return Err(Error::Config(
                "hybrid: simulate_hosts must be at least 1".into(),
            ));
        }
        let opts = HybridOptions {
            remote,
            simulate_hosts,
            local_options: o.prefixed("local."),
            remote_options: o.prefixed("remote."),
        };
        // The devices the prefixed options go to check them now, so that a
        // bad one fails before any connection.
        let sub = |options: &[(String, String)]| {
            let mut c = Config::new(config.rank, config.size, config.job.clone());
            c.options.extend(options.iter().cloned());
            c
        };
        shm_ipc::ProcessOptions::from_config(&sub(&opts.local_options))?;
        let remote = sub(&opts.remote_options);
        match opts.remote.as_str() {
            #[cfg(feature = "ibv")]
            "ibv" => crate::IbvOptions::from_config(&remote).map(|_| ())?,
            #[cfg(feature = "psm")]
            "psm" => Options::new("psm", crate::psm::PSM_OPTIONS, &remote)?
                .get::<u32>("rndv_shm_bytes", 0)
                .map(|_| ())?,
            // A device this build leaves out fails here, before any
            // connection, as its open would.
            #[cfg(not(feature = "ibv"))]
            "ibv" => return Err(super::setup::not_built("ibv")),
            #[cfg(not(feature = "psm"))]
            "psm" => return Err(super::setup::not_built("psm")),
            _ => shm_ipc::ProcessOptions::from_config(&remote).map(|_| ())?,
        }
        Ok(opts)
    }
}
