//! Wire-up: host keys and host groups, the group's loopback bootstrap
//! service and its record, and opening the two devices
//! ([`HybridDevice::with_bootstrap`]).

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use shm_ipc::ProcessDevice;
use xdev::bootstrap::{Bootstrap, BootstrapServer, Secret};
use xdev::devkit::Tracker;
use xdev::{Config, Device, Error, Rank, Result};

use super::held::Held;
use super::route::{RankMap, Route};
use super::{HybridDevice, HybridEngine, HybridOptions};
#[cfg(feature = "ibv")]
use crate::IbvDevice;
#[cfg(feature = "psm")]
use crate::PsmDevice;

/// Host groups from every rank's host key: for each rank, the index of its
/// host (in order of first appearance).
pub(super) fn host_indices(keys: &[Vec<u8>]) -> Vec<usize> {
    let mut seen: Vec<&[u8]> = Vec::new();
    keys.iter()
        .map(|k| match seen.iter().position(|s| *s == &k[..]) {
            Some(i) => i,
            None => {
                seen.push(k);
                seen.len() - 1
            }
        })
        .collect()
}

/// This process's host key: boot id and host name, or a block of ranks
/// when hosts are simulated.
pub(super) fn host_key(simulate: Option<usize>, rank: Rank, size: usize) -> Result<Vec<u8>> {
    if let Some(n) = simulate {
        let block = rank * n.min(size) / size;
        return Ok(format!("simulated-host-{block}").into_bytes());
    }
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .map(|s| s.trim().to_string())
            .map_err(|e| Error::transport(format!("hybrid: reading {p}"), e))
    };
    let boot_id = read("/proc/sys/kernel/random/boot_id")?;
    let host = read("/proc/sys/kernel/hostname")?;
    Ok(format!("{boot_id}/{host}").into_bytes())
}

/// Reads a host group's service record (`ADDR SECRET`, as its lowest rank
/// `leader` published it); a malformed record is a protocol error of
/// `leader`, a malformed secret a configuration error.
pub(super) fn parse_service(record: &[u8], leader: Rank) -> Result<(SocketAddr, Secret)> {
    let bad = || Error::Protocol {
        rank: leader,
        what: "malformed host-group service address".into(),
    };
    let text = std::str::from_utf8(record).map_err(|_| bad())?;
    let (a, s) = text.split_once(' ').ok_or_else(bad)?;
    let addr: SocketAddr = a.parse().map_err(|_| bad())?;
    Ok((addr, Secret::from_hex(s)?))
}

fn open_remote(name: &str, config: &Config, boot: Bootstrap) -> Result<Arc<dyn Device>> {
    Ok(match name {
        #[cfg(feature = "ibv")]
        "ibv" => Arc::new(IbvDevice::with_bootstrap(config, boot)?),
        #[cfg(feature = "psm")]
        "psm" => Arc::new(PsmDevice::with_bootstrap(config, boot)?),
        #[cfg(not(feature = "ibv"))]
        "ibv" => return Err(not_built(name)),
        #[cfg(not(feature = "psm"))]
        "psm" => return Err(not_built(name)),
        _ => Arc::new(ProcessDevice::with_bootstrap(config, boot)?),
    })
}

/// The error of `remote=NAME` when ibvx was built without that device.
#[cfg(not(all(feature = "ibv", feature = "psm")))]
pub(super) fn not_built(name: &str) -> Error {
    Error::Config(format!(
        "hybrid: remote={name} needs ibvx's `{name}` feature, which this build leaves out"
    ))
}

/// This rank's host group, found from every rank's host key.
struct HostGroup {
    /// How many hosts the job spans.
    hosts: usize,
    /// This rank's host (hosts are numbered in order of first appearance).
    host: usize,
    /// The job ranks of the group, lowest first; a rank's index here is its
    /// rank in the group's shared-memory device.
    ranks: Vec<Rank>,
    /// This rank's index in `ranks`.
    index: usize,
    /// Which device reaches each rank of the job.
    routes: Vec<Route>,
}

impl HostGroup {
    /// Gathers every rank's host key through the job's bootstrap
    /// (collective) and groups the ranks by host.
    fn gather(
        boot: &Bootstrap,
        opts: &HybridOptions,
        rank: Rank,
        size: usize,
    ) -> Result<HostGroup> {
        let keys = boot.allgather(&host_key(opts.simulate_hosts, rank, size)?)?;
        if keys.len() != size {
            return Err(Error::Protocol {
                rank: xdev::bootstrap::SERVICE,
                what: format!(
                    "allgather returned {} host keys for {size} ranks",
                    keys.len()
                ),
            });
        }
        let host_of = host_indices(&keys);
        let hosts = host_of.iter().max().map_or(1, |m| m + 1);
        let my_host = host_of[rank];
        let group: Vec<Rank> = (0..size).filter(|&r| host_of[r] == my_host).collect();
        let routes: Vec<Route> = (0..size)
            .map(|r| match group.iter().position(|&g| g == r) {
                Some(i) => Route::Local(i),
                None => Route::Remote,
            })
            .collect();
        let index = group
            .iter()
            .position(|&g| g == rank)
            .expect("a rank is in its group");
        Ok(HostGroup {
            hosts,
            host: my_host,
            ranks: group,
            index,
            routes,
        })
    }
}

/// Opens the host group's shared-memory device over the group's own
/// bootstrap service; returns the service if this rank runs it.
fn open_local(
    config: &Config,
    boot: &Bootstrap,
    opts: &HybridOptions,
    host_group: &HostGroup,
) -> Result<(Option<BootstrapServer>, Arc<dyn Device>)> {
    let (my_host, group, index) = (host_group.host, &host_group.ranks, host_group.index);
    // The host group's own bootstrap service, run by its lowest rank,
    // which tells its group the address and secret through an allgather
    // (a collective: under PMI and PMIx a value is published by the next
    // collective, so a put then get would wait for nothing).
    let local_job = format!("{}.host{my_host}", config.job);
    let (service, record) = if index == 0 {
        let secret = Secret::generate()?;
        let server = BootstrapServer::start(
            SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            group.len(),
            &local_job,
            secret.clone(),
        )?;
        let record = format!("{} {}", server.addr(), secret.to_hex()).into_bytes();
        (Some(server), record)
    } else {
        (None, Vec::new())
    };
    let records = boot.allgather(&record)?;
    let leader = records.get(group[0]).ok_or_else(|| Error::Protocol {
        rank: xdev::bootstrap::SERVICE,
        what: "allgather returned too few host-group records".into(),
    })?;
    let (addr, secret) = parse_service(leader, group[0])?;
    let local_boot = Bootstrap::connect(addr, index, group.len(), &local_job, &secret)?;
    let local_config = opts
        .local_options
        .iter()
        .fold(Config::new(index, group.len(), &local_job), |c, (k, v)| {
            c.with(k, v)
        });
    let local: Arc<dyn Device> =
        Arc::new(ProcessDevice::with_bootstrap(&local_config, local_boot)?);
    Ok((service, local))
}

impl HybridDevice {
    /// Opens the device with the bootstrap service named by the environment
    /// (`xdev-run` sets it). Collective.
    pub fn open(config: &Config) -> Result<HybridDevice> {
        // Options first (with the `local.` and `remote.` ones, checked by
        // the devices they go to): a bad one fails before any connection.
        HybridOptions::from_config(config)?;
        Self::with_bootstrap(config, Bootstrap::for_config(config)?)
    }

    /// Opens the device over a connected bootstrap (collective: every rank
    /// of the job calls it).
    pub fn with_bootstrap(config: &Config, boot: Bootstrap) -> Result<HybridDevice> {
        config.validate()?;
        boot.check_config(config)?;
        let opts = HybridOptions::from_config(config)?;
        let (rank, size) = (config.rank, config.size);
        let host_group = HostGroup::gather(&boot, &opts, rank, size)?;
        let (service, local) = open_local(config, &boot, &opts, &host_group)?;
        let HostGroup {
            hosts,
            host: my_host,
            ranks: group,
            routes,
            ..
        } = host_group;

        let (remote, boot) = if hosts > 1 {
            let remote_config = opts
                .remote_options
                .iter()
                .fold(Config::new(rank, size, &config.job), |c, (k, v)| {
                    c.with(k, v)
                });
            (Some(open_remote(&opts.remote, &remote_config, boot)?), None)
        } else {
            (None, Some(boot))
        };
        let description = format!(
            "hybrid: rank {rank} of {size} on host {my_host} of {hosts} ({} ranks here through shm{})",
            group.len(),
            match &remote {
                Some(_) => format!(", the others through {}", opts.remote),
                None => String::new(),
            }
        );
        Ok(HybridDevice {
            inner: Arc::new(HybridEngine {
                rank,
                size,
                routes,
                local,
                local_map: RankMap {
                    to_job: Some(group.into()),
                    size,
                },
                remote_map: RankMap { to_job: None, size },
                remote,
                tracker: Arc::new(Tracker::new()),
                held: Mutex::new(Held::default()),
                closed: AtomicBool::new(false),
            }),
            _local_service: service,
            _boot: boot,
            description,
        })
    }

    /// Where this rank runs and which device reaches whom.
    pub fn description(&self) -> &str {
        &self.description
    }

    /// Whether `rank` is reached through shared memory (same host).
    pub fn is_local(&self, rank: Rank) -> bool {
        matches!(self.inner.routes.get(rank), Some(Route::Local(_)))
    }
}
