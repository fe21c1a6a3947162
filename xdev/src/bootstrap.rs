//! The bootstrap service (PMI-like): how the processes of one job learn who
//! they are and exchange the endpoint information their device needs (segment
//! names, queue-pair numbers, GIDs, rkeys, PSM2 endpoint ids) before any
//! device traffic flows, and how they learn that a peer's process has gone.
//!
//! [`Bootstrap`] is one handle over three backends, chosen from the
//! environment by [`Launcher::from_env`] in this order:
//!
//! | launcher | backend | recognised by |
//! |---|---|---|
//! | `xdev-run` (or `xdev-run --serve`) | xdev's TCP service (below) | [`XDEV_BOOTSTRAP`] or [`XDEV_RANK`] |
//! | `srun --mpi=pmix`, Open MPI's `mpirun` | PMIx (`libpmix.so.2`, loaded at run time) | [`PMIX_RANK`] and [`PMIX_NAMESPACE`] |
//! | MPICH's `mpirun.mpich` (Hydra) | PMI-1 over the socket in [`PMI_FD`] | [`PMI_FD`] |
//! | `srun --mpi=pmi2` | PMI-2 over the socket in [`PMI_FD`] | [`PMI_FD`] and [`PMI_JOBID`] |
//!
//! With none of them, [`config_from_env`] and [`Bootstrap::from_env`] fail at
//! once with [`Error::Config`] and [`NO_LAUNCHER`], which names the three ways
//! to start a job. Under PMIx and PMI, rank, size and job identity (the PMIx
//! namespace, the PMI job name) come from the launcher, a `put` is published
//! by the next collective (a PMI fence), departures are the ranks on this
//! host seen to exit (the ranks watch each other's pids from the first
//! allgather on) plus, under PMIx, what PMIx events report, and the process
//! keeps one connection to the
//! launcher, closed at exit.
//!
//! xdev's own service is a small authenticated TCP service with a key-value
//! store, a barrier and an allgather, run by the launcher (`xdev-run`, or
//! `xdev-run --serve` for ranks started by hand or by a batch scheduler),
//! plus the client every multi-process device opens from the environment. It
//! is not a data path
//! (values are small and go through one central server), not a process
//! manager (the launcher starts and kills processes) and not a secure channel:
//! the handshake proves knowledge of the job secret, but the traffic after it
//! is neither encrypted nor integrity-protected, so it is meant for loopback
//! or a trusted cluster network.
//!
//! # Environment
//!
//! The launcher sets, for every rank it starts:
//!
//! | variable | meaning |
//! |---|---|
//! | [`XDEV_RANK`] | this process's rank, `0..XDEV_SIZE` |
//! | [`XDEV_SIZE`] | number of ranks in the job |
//! | [`XDEV_JOB`] | job identity (printable, at most [`wire::MAX_JOB_LEN`] bytes) |
//! | [`XDEV_BOOTSTRAP`] | `host:port` of the bootstrap service |
//! | [`XDEV_SECRET`] | the per-job secret: 32 random bytes as 64 hex digits |
//! | [`XDEV_DEVICE`] | device name chosen with `xdev-run --device` (optional) |
//!
//! [`config_from_env`] turns the first three into a [`Config`] (under
//! xdev-run; the launcher's own variables otherwise); [`device_from_env`]
//! reads the device name (`XDEV_DEVICE` under every launcher);
//! [`Bootstrap::from_env`] connects with all five. Missing or malformed
//! variables are [`Error::Config`] errors that name the variable.
//!
//! # Service
//!
//! * Keys are UTF-8 strings of at most [`wire::MAX_KEY_LEN`] (256) bytes,
//!   values at most [`wire::MAX_VALUE_LEN`] (1 MiB). A key belongs to
//!   the rank that first put it: that rank's later `put` replaces the value,
//!   another rank's `put` of it is refused ([`Error::Protocol`]); a `get` waits until some rank has put the
//!   key or its timeout passes.
//! * The store (keys, values and allgather contributions in flight) is bounded
//!   by [`ServerOptions::max_store_bytes`], 64 MiB by default; beyond it a
//!   request fails with [`Error::ResourceExhausted`].
//! * `barrier` and `allgather` are collective over all ranks; they fail with
//!   [`Error::PeerLost`] once a rank that has not contributed has left.
//! * The service uses blocking I/O on std threads: one listener thread and
//!   one thread per connection (so at most `size` plus
//!   [`ServerOptions::max_pending_handshakes`] connection threads). Its state
//!   sits under one lock that is never held across socket I/O, and a rank
//!   that stops reading is dropped after [`ServerOptions::write_timeout`].
//! * When a rank's connection closes (its process exited, was killed, or
//!   dropped its [`Bootstrap`]), every other rank is told; a [`Bootstrap`]
//!   records these notices in the background and [`Bootstrap::departed`]
//!   reads them without any network traffic, so a device can poll it to
//!   detect dead peers within a round trip of the loopback.
//!
//! # Security
//!
//! A client proves knowledge of the secret by HMAC-SHA256 challenge-response
//! (see [`wire`](crate::devkit::wire) for the frames): the service sends a fresh nonce, the client
//! MACs it with its own nonce, rank, size and job; the service checks the MAC
//! in constant time, then checks the job and size and that the rank is in
//! range and not yet claimed (each rank can be claimed once per job), and
//! proves its own knowledge of the secret back. The secret never travels.
//! Every frame is length-prefixed and decoded strictly with bounded
//! allocation; a connection that sends anything malformed is closed. The
//! service holds at most `size` authenticated connections plus
//! [`ServerOptions::max_pending_handshakes`] connections in their handshake,
//! each of which must finish within [`ServerOptions::handshake_timeout`].
//!
//! ```no_run
//! use xdev::bootstrap::Bootstrap;
//!
//! let boot = Bootstrap::from_env()?;
//! boot.put(&format!("segment/{}", boot.rank()), b"/xdev-shm-1234-0")?;
//! let all = boot.allgather(&(boot.rank() as u32).to_le_bytes())?;
//! assert_eq!(all.len(), boot.size());
//! boot.barrier()?;
//! if !boot.departed()?.is_empty() {
//!     // some peer's process has gone
//! }
//! # Ok::<(), xdev::Error>(())
//! ```

mod auth;
mod client;
mod front;
pub(crate) mod keepalive;
mod pidwatch;
mod pmi;
mod pmix;
mod server;
mod shm_names;
pub(crate) mod wire;

pub use client::{Departure, CONNECT_TIMEOUT};
pub use front::Bootstrap;
pub use pmi::{PMI_FD, PMI_JOBID, PMI_RANK, PMI_SIZE, XDEV_PMI};
pub use pmix::{PMIX_NAMESPACE, PMIX_RANK, XDEV_PMIX_LIBRARY};
pub use server::{BootstrapServer, ServerOptions, ServerStatus};
pub use shm_names::{is_xdev_shm_name, remove_job_shm, remove_psm2_shm, shm_prefix, PSM2_EPID_KEY};

use std::fmt;

use crate::{Config, Error, Rank, Result};

/// Environment variable: this process's rank.
pub const XDEV_RANK: &str = "XDEV_RANK";
/// Environment variable: the number of ranks.
pub const XDEV_SIZE: &str = "XDEV_SIZE";
/// Environment variable: the job identity.
pub const XDEV_JOB: &str = "XDEV_JOB";
/// Environment variable: `host:port` of the bootstrap service.
pub const XDEV_BOOTSTRAP: &str = "XDEV_BOOTSTRAP";
/// Environment variable: the per-job secret, 64 hex digits.
pub const XDEV_SECRET: &str = "XDEV_SECRET";
/// Environment variable: the device name chosen by the launcher (optional).
pub const XDEV_DEVICE: &str = "XDEV_DEVICE";

/// The rank named in [`Error::Protocol`] when the offender is the bootstrap
/// service itself or a connection that has not yet proved a rank.
pub const SERVICE: Rank = Rank::MAX;

/// A per-job secret: 32 bytes, shared by the service and the ranks of one
/// job, written in the environment as 64 hex digits. `Debug` does not show it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret([u8; 32]);

impl Secret {
    /// A fresh secret from the operating system's random number generator.
    pub fn generate() -> Result<Secret> {
        auth::random().map(Secret)
    }

    /// A secret from raw bytes.
    pub fn from_bytes(bytes: [u8; 32]) -> Secret {
        Secret(bytes)
    }

    /// The raw bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Parses 64 hex digits (either case), as in [`XDEV_SECRET`].
    pub fn from_hex(hex: &str) -> Result<Secret> {
        let hex = hex.trim();
        let bad = || {
            Error::Config(format!(
                "{XDEV_SECRET} must be 64 hex digits (32 bytes), got {} characters",
                hex.len()
            ))
        };
        if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad());
        }
        let mut out = [0u8; 32];
        hex::decode_to_slice(hex, &mut out).map_err(|_| bad())?;
        Ok(Secret(out))
    }

    /// The secret as 64 lower-case hex digits.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// Everything the launcher puts in a rank's environment, parsed.
#[derive(Clone, Debug)]
pub struct JobEnv {
    /// Rank, size and job identity ([`XDEV_RANK`], [`XDEV_SIZE`], [`XDEV_JOB`]).
    pub config: Config,
    /// [`XDEV_BOOTSTRAP`], if set.
    pub bootstrap: Option<String>,
    /// [`XDEV_SECRET`], if set.
    pub secret: Option<Secret>,
    /// [`XDEV_DEVICE`], if set and not empty.
    pub device: Option<String>,
}

impl JobEnv {
    /// Reads the process environment.
    pub fn from_env() -> Result<JobEnv> {
        Self::from_lookup(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    }

    /// Reads the variables through `lookup` (name → value), e.g. from a map
    /// in tests. Rank, size and job are required; the rest are optional here
    /// and checked by whoever needs them.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<JobEnv> {
        let need = |name: &str| {
            lookup(name).ok_or_else(|| {
                Error::Config(format!(
                    "{name} is not set (xdev-run sets it; when starting ranks by hand, \
                     export the lines printed by `xdev-run --serve` and set {XDEV_RANK} per process)"
                ))
            })
        };
        let number = |name: &str| -> Result<usize> {
            let v = need(name)?;
            v.trim()
                .parse()
                .map_err(|_| Error::Config(format!("{name}={v:?} is not a non-negative integer")))
        };
        let size = number(XDEV_SIZE)?;
        if size == 0 || size > u32::MAX as usize {
            return Err(Error::Config(format!(
                "{XDEV_SIZE}={size} is out of range: a job has 1..={} ranks",
                u32::MAX
            )));
        }
        let rank = number(XDEV_RANK)?;
        if rank >= size {
            return Err(Error::Config(format!(
                "{XDEV_RANK}={rank} is out of range for {XDEV_SIZE}={size} (ranks are 0..{size})"
            )));
        }
        let job = need(XDEV_JOB)?;
        if job.is_empty() || job.len() > wire::MAX_JOB_LEN {
            return Err(Error::Config(format!(
                "{XDEV_JOB} must be 1..={} bytes long, got {}",
                wire::MAX_JOB_LEN,
                job.len()
            )));
        }
        let secret = lookup(XDEV_SECRET)
            .map(|s| Secret::from_hex(&s))
            .transpose()?;
        Ok(JobEnv {
            config: Config::new(rank, size, job),
            bootstrap: lookup(XDEV_BOOTSTRAP).filter(|s| !s.is_empty()),
            secret,
            device: lookup(XDEV_DEVICE).filter(|s| !s.is_empty()),
        })
    }
}

/// The launcher that started this process, as its environment says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    /// `xdev-run` (or `xdev-run --serve`): [`XDEV_BOOTSTRAP`] or
    /// [`XDEV_RANK`] is set; xdev's TCP service.
    XdevRun,
    /// A PMIx launcher (`srun --mpi=pmix`, Open MPI's `mpirun`):
    /// [`PMIX_RANK`] and [`PMIX_NAMESPACE`] are set.
    Pmix,
    /// A PMI-1 launcher (MPICH's Hydra `mpirun.mpich`): [`PMI_FD`] is set.
    Pmi1,
    /// A PMI-2 launcher (`srun --mpi=pmi2`): [`PMI_FD`] and [`PMI_JOBID`]
    /// are set.
    Pmi2,
}

/// The error of a process that no known launcher started.
pub const NO_LAUNCHER: &str = "this process was not started by a launcher xdev knows \
(none of XDEV_BOOTSTRAP, PMIX_RANK and PMIX_NAMESPACE, or PMI_FD is set). Start the job \
with xdev-run (`xdev-run -n N --device NAME -- PROGRAM`), with a PMIx launcher \
(`srun --mpi=pmix -n N PROGRAM`, or `mpirun.openmpi -np N PROGRAM`), or with a PMI \
launcher (`mpirun.mpich -np N PROGRAM`, or `srun --mpi=pmi2 -n N PROGRAM`)";

impl Launcher {
    /// The launcher the variables read through `lookup` name, in this
    /// order: xdev-run ([`XDEV_BOOTSTRAP`] or [`XDEV_RANK`]), PMIx
    /// ([`PMIX_RANK`] and [`PMIX_NAMESPACE`]), PMI ([`PMI_FD`]; PMI-2 when
    /// [`PMI_JOBID`] is set too, as Slurm's pmi2 plugin does, or as
    /// [`XDEV_PMI`] says). Otherwise [`Error::Config`] with [`NO_LAUNCHER`].
    pub fn detect(lookup: impl Fn(&str) -> Option<String>) -> Result<Launcher> {
        let set = |n: &str| lookup(n).is_some_and(|v| !v.is_empty());
        if set(XDEV_BOOTSTRAP) || set(XDEV_RANK) {
            return Ok(Launcher::XdevRun);
        }
        if set(PMIX_RANK) && set(PMIX_NAMESPACE) {
            return Ok(Launcher::Pmix);
        }
        if set(PMI_FD) {
            return match lookup(XDEV_PMI).as_deref().map(str::trim) {
                Some("1") => Ok(Launcher::Pmi1),
                Some("2") => Ok(Launcher::Pmi2),
                Some(v) if !v.is_empty() => Err(Error::Config(format!(
                    "{XDEV_PMI}={v:?}: it must be 1 or 2"
                ))),
                _ if set(PMI_JOBID) => Ok(Launcher::Pmi2),
                _ => Ok(Launcher::Pmi1),
            };
        }
        if set(PMI_RANK) || set(PMI_SIZE) {
            return Err(Error::Config(format!(
                "{PMI_RANK}/{PMI_SIZE} are set but {PMI_FD} is not: xdev speaks PMI over the \
                 socket a launcher passes in {PMI_FD} only. {NO_LAUNCHER}"
            )));
        }
        Err(Error::Config(NO_LAUNCHER.into()))
    }

    /// [`detect`](Self::detect) on the process environment.
    pub fn from_env() -> Result<Launcher> {
        Self::detect(|n| std::env::var_os(n).map(|v| v.to_string_lossy().into_owned()))
    }
}

/// Rank, size and job identity of this process as a [`Config`] with no
/// options, from the launcher that started it ([`Launcher::from_env`]):
/// [`XDEV_RANK`], [`XDEV_SIZE`] and [`XDEV_JOB`] under xdev-run; PMIx's
/// rank, job size and namespace; PMI's rank, size and job (kvs) name. Fails
/// with [`Error::Config`] naming the missing or malformed variable, or
/// [`NO_LAUNCHER`]. Under PMIx and PMI this opens the process's connection
/// to the launcher (kept for the bootstrap that follows).
pub fn config_from_env() -> Result<Config> {
    match Launcher::from_env()? {
        Launcher::XdevRun => JobEnv::from_env().map(|e| e.config),
        _ => Bootstrap::from_env().map(|b| b.config()),
    }
}

/// The device name from [`XDEV_DEVICE`], if set and not empty.
pub fn device_from_env() -> Option<String> {
    std::env::var(XDEV_DEVICE).ok().filter(|s| !s.is_empty())
}

#[cfg(test)]
mod tests;
