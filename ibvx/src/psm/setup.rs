//! The psm device's wire-up ([`PsmDevice::with_bootstrap`]): the job key,
//! the endpoint and its matched queue, the records every rank publishes
//! through the bootstrap, the connections, and the barrier that ends it.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use xdev::bootstrap::Bootstrap;
use xdev::devkit::Tracker;
use xdev::{Config, Error, Rank, Result};

use super::engine::{Inner, KeyMap, PsmEngine};
use super::layer::{Endpoint, JobKey, Library, MatchedQueue, PsmMode, TrackedQueue};
use super::{PsmDevice, DEFAULT_RNDV_SHM_BYTES, PSM2_EPID_KEY};

/// Time allowed for `psm2_ep_connect` and a graceful `psm2_ep_close`.
pub(super) const PSM_TIMEOUT: Duration = Duration::from_secs(30);

/// What each rank publishes in the allgather of the wire-up: its PSM2 epid
/// (8 bytes, little-endian), then its host's identity (the kernel's boot
/// id, empty if unknown).
struct EndpointRecord {
    epid: u64,
    host: Vec<u8>,
}

impl EndpointRecord {
    fn encode(&self) -> Vec<u8> {
        let mut b = self.epid.to_le_bytes().to_vec();
        b.extend_from_slice(&self.host);
        b
    }

    fn decode(rank: Rank, b: &[u8]) -> Result<EndpointRecord> {
        let Some((id, host)) = b.split_first_chunk::<8>() else {
            return Err(Error::Protocol {
                rank,
                what: "PSM2 endpoint record shorter than an epid".into(),
            });
        };
        Ok(EndpointRecord {
            epid: u64::from_le_bytes(*id),
            host: host.to_vec(),
        })
    }
}

/// This host's identity: the kernel's boot id (empty if unreadable).
fn host_identity() -> String {
    let id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    id.trim().to_string()
}

/// Rank 0's job key, for every rank (the first record of an allgather).
fn share_job_key(lib: &Library, boot: &Bootstrap, rank: Rank) -> Result<JobKey> {
    let key = if rank == 0 {
        lib.job_key()
    } else {
        JobKey([0; 16])
    };
    let keys = boot.allgather(&key.0)?;
    let first = keys[0].get(..16).and_then(|k| <[u8; 16]>::try_from(k).ok());
    first.map(JobKey).ok_or_else(|| Error::Protocol {
        rank: 0,
        what: "PSM2 job key is not 16 bytes".into(),
    })
}

/// Publishes this rank's epid and gathers every rank's, checking that in
/// shm-only mode all are on this host (connecting to an epid shm cannot
/// reach crashes libpsm2: psm_sys docs).
fn exchange_records(lib: &Library, boot: &Bootstrap, epid: u64) -> Result<Vec<u64>> {
    let host = host_identity();
    let mine = EndpointRecord {
        epid,
        host: host.as_bytes().to_vec(),
    };
    // For the launcher: PSM2 names its shared-memory segments after the
    // epid, and a crashed rank leaves them (see `PSM2_EPID_KEY`).
    boot.put(
        &format!("{PSM2_EPID_KEY}{}", boot.rank()),
        &epid.to_le_bytes(),
    )?;
    let all = boot.allgather(&mine.encode())?;
    let mut epids = Vec::with_capacity(all.len());
    for (r, b) in all.iter().enumerate() {
        let rec = EndpointRecord::decode(r, b)?;
        if *lib.mode() == PsmMode::ShmOnly && (host.is_empty() || rec.host != host.as_bytes()) {
            return Err(Error::Config(format!(
                "PSM2 shm-only mode needs every rank on this host; rank {r} is not \
                 (or its host is unknown)"
            )));
        }
        epids.push(rec.epid);
    }
    Ok(epids)
}

/// The bootstrap's barrier, polling PSM2 meanwhile: PSM2 completes a peer's
/// connection only while we poll, so polling goes on until everyone has
/// connected.
fn barrier_polling(mq: &MatchedQueue, boot: &Bootstrap) -> Result<()> {
    std::thread::scope(|s| {
        let b = s.spawn(|| boot.barrier());
        while !b.is_finished() {
            mq.poll();
            std::thread::sleep(Duration::from_micros(50));
        }
        b.join().unwrap_or(Err(Error::Closed))
    })
}

impl PsmDevice {
    /// Opens the device with the bootstrap service named by the environment
    /// (`xdev-run` sets it). The environment's rank, size and job must match
    /// `config`.
    pub fn open(config: &Config) -> Result<PsmDevice> {
        // Options first: a bad one fails before any connection.
        xdev::devkit::Options::new("psm", super::PSM_OPTIONS, config)?
            .get::<u32>("rndv_shm_bytes", DEFAULT_RNDV_SHM_BYTES)?;
        Self::with_bootstrap(config, Bootstrap::for_config(config)?)
    }

    /// Opens the device over a connected bootstrap (collective).
    pub fn with_bootstrap(config: &Config, boot: Bootstrap) -> Result<PsmDevice> {
        config.validate()?;
        let options = xdev::devkit::Options::new("psm", super::PSM_OPTIONS, config)?;
        let rndv: u32 = options.get("rndv_shm_bytes", DEFAULT_RNDV_SHM_BYTES)?;
        let lib = Library::get()?;
        // Before any collective step: a second device in this process fails
        // here, cleanly.
        let slot = lib.reserve_endpoint()?;
        let (rank, size) = (config.rank, config.size);
        let key = share_job_key(lib, &boot, rank)?;
        // From here on, a failure drops the queue: it is finalized and the
        // endpoint closed, and the slot released.
        let mut mq = MatchedQueue::new(Endpoint::open(slot, &key)?)?;
        mq.set_rndv_shm_bytes(rndv)?;
        let epids = exchange_records(lib, &boot, mq.endpoint().epid())?;
        mq.endpoint_mut().connect(&epids, PSM_TIMEOUT)?;
        barrier_polling(&mq, &boot)?;
        Ok(PsmDevice {
            engine: Arc::new(PsmEngine {
                lib,
                rank,
                size,
                eager_max: rndv as usize,
                inner: shm_ipc::biased::BiasedLock::new(Inner {
                    queue: Some(TrackedQueue::new(mq)),
                    done: KeyMap::default(),
                    batch: Box::default(),
                    gone: vec![false; size],
                    departures_seen: 0,
                    kept: Vec::new(),
                    ended: KeyMap::default(),
                    held: KeyMap::default(),
                    dropped: KeyMap::default(),
                    leases: 0,
                    keep: None,
                }),
                tracker: Arc::new(Tracker::new()),
                closing: AtomicBool::new(false),
                boot,
            }),
        })
    }
}
