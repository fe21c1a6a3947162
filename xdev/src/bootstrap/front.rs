//! [`Bootstrap`]: one handle over the three backends (xdev-run's TCP
//! service, PMIx, PMI), chosen from the environment by [`Launcher`].

use std::collections::HashMap;
use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::client::Tcp;
use super::pmi::{self, Wire};
use super::{pidwatch, pmix, Departure, JobEnv, Launcher, Secret};
use crate::{Config, Error, Rank, Result};

/// A rank's handle on the bootstrap of its job: rank, size and job identity,
/// a key-value store, a barrier, an allgather and departure notices, over
/// whichever launcher started the process (see the [module
/// documentation](super)).
///
/// All methods take `&self` and the handle is `Send + Sync`, so the threads of
/// a rank (and a device's progress thread) can share it. Collectives
/// (`barrier`, `allgather`) from one rank are serialized and must be called in
/// the same order by every rank.
///
/// Under `xdev-run`, dropping the handle says goodbye to the service, which
/// tells the other ranks that this one left cleanly ([`Departure::clean`]); a
/// process that dies or exits without dropping it is reported as an unclean
/// departure. Under PMIx and PMI, departures are the ranks on this host
/// whose processes exited (the ranks watch each other's pids from the first
/// allgather on) and, under PMIx, what the server's events report.
pub struct Bootstrap {
    backend: Backend,
    rank: Rank,
    size: usize,
    job: String,
}

enum Backend {
    Tcp(Tcp),
    Pmix(Arc<pmix::Session>),
    Pmi(Arc<pmi::Session>),
}

/// What this process has put through a fence-based backend (PMIx, PMI):
/// read back by its own `get`s without a round trip.
static OWN_PUTS: Mutex<Option<HashMap<String, Vec<u8>>>> = Mutex::new(None);
/// Numbers the allgathers of a fence-based backend: every rank runs them in
/// the same order, so the same number names the same collective.
static COLLECTIVES: AtomicU64 = AtomicU64::new(0);
/// Serializes the collectives of the process's fence-based handles.
static COLLECTIVE: Mutex<()> = Mutex::new(());

/// What a fence-based allgather read: every rank's contribution, and every
/// rank's pid record when this allgather published them.
type Gathered = (Vec<Vec<u8>>, Option<Vec<Vec<u8>>>);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn timed_out(what: String) -> Error {
    Error::transport(what, io::Error::new(io::ErrorKind::TimedOut, "timed out"))
}

impl Bootstrap {
    fn from_backend(backend: Backend) -> Bootstrap {
        let (rank, size, job) = match &backend {
            Backend::Tcp(t) => (t.rank(), t.size(), t.job().to_owned()),
            Backend::Pmix(s) => (s.rank(), s.size(), s.job().to_owned()),
            Backend::Pmi(s) => (s.rank(), s.size(), s.job().to_owned()),
        };
        Bootstrap {
            backend,
            rank,
            size,
            job,
        }
    }

    /// Runs `f` on the connection to the TCP service (tests of its options).
    #[cfg(test)]
    pub(crate) fn with_stream_for_tests<R>(&self, f: impl FnOnce(&std::net::TcpStream) -> R) -> R {
        match &self.backend {
            Backend::Tcp(t) => t.with_stream_for_tests(f),
            _ => panic!("not a TCP bootstrap"),
        }
    }

    /// Connects to xdev's TCP bootstrap service at `addr` as `rank` of the
    /// `size`-rank job `job`, proving knowledge of `secret`.
    ///
    /// Connection attempts are retried for up to
    /// [`CONNECT_TIMEOUT`](super::CONNECT_TIMEOUT) (the service may start
    /// after the ranks). Fails with [`Error::Config`] when the service
    /// refuses the rank (wrong secret, wrong job or size, rank out of range
    /// or already claimed; the message says which), with [`Error::Protocol`]
    /// naming [`SERVICE`](super::SERVICE) when the peer does not speak the
    /// protocol or cannot prove it knows the secret, and with
    /// [`Error::Transport`] when it cannot be reached.
    pub fn connect<A: ToSocketAddrs>(
        addr: A,
        rank: Rank,
        size: usize,
        job: &str,
        secret: &Secret,
    ) -> Result<Bootstrap> {
        Tcp::connect(addr, rank, size, job, secret).map(|t| Self::from_backend(Backend::Tcp(t)))
    }

    /// Opens the bootstrap of the launcher that started this process
    /// ([`Launcher::from_env`]): xdev-run's service, PMIx or PMI. Fails with
    /// [`Error::Config`] when no launcher is recognised (the message names
    /// the ways to start a job) or a variable is missing or malformed.
    pub fn from_env() -> Result<Bootstrap> {
        match Launcher::from_env()? {
            Launcher::XdevRun => Self::from_job_env(&JobEnv::from_env()?),
            Launcher::Pmix => Ok(Self::from_backend(Backend::Pmix(pmix::session()?))),
            Launcher::Pmi1 => Ok(Self::from_backend(Backend::Pmi(pmi::session(Wire::Pmi1)?))),
            Launcher::Pmi2 => Ok(Self::from_backend(Backend::Pmi(pmi::session(Wire::Pmi2)?))),
        }
    }

    /// Opens the bootstrap for `config` like [`from_env`](Self::from_env),
    /// after checking that the launcher names the same rank, size and job
    /// (what a device's `open(config)` does).
    pub fn for_config(config: &Config) -> Result<Bootstrap> {
        if Launcher::from_env()? == Launcher::XdevRun {
            return Self::for_config_in(&JobEnv::from_env()?, config);
        }
        let boot = Self::from_env()?;
        if (boot.rank, boot.size, &boot.job) != (config.rank, config.size, &config.job) {
            return Err(Error::Config(format!(
                "the launcher says rank {} of {} in job {:?}, the config rank {} of {} in {:?}",
                boot.rank, boot.size, boot.job, config.rank, config.size, config.job
            )));
        }
        Ok(boot)
    }

    /// [`for_config`](Self::for_config) with already parsed xdev-run
    /// variables (TCP service).
    pub fn for_config_in(env: &JobEnv, config: &Config) -> Result<Bootstrap> {
        let c = &env.config;
        if (c.rank, c.size, &c.job) != (config.rank, config.size, &config.job) {
            return Err(Error::Config(format!(
                "the environment says rank {} of {} in job {:?}, the config rank {} of {} in {:?}",
                c.rank, c.size, c.job, config.rank, config.size, config.job
            )));
        }
        Self::from_job_env(env)
    }

    /// Connects to the TCP service with already parsed xdev-run variables.
    pub fn from_job_env(env: &JobEnv) -> Result<Bootstrap> {
        Tcp::from_job_env(env).map(|t| Self::from_backend(Backend::Tcp(t)))
    }

    /// Checks that this handle is for `config`'s rank, size and job (what a
    /// device's `with_bootstrap(config, boot)` does).
    pub fn check_config(&self, config: &Config) -> Result<()> {
        if (self.rank(), self.size(), self.job()) != (config.rank, config.size, &config.job[..]) {
            return Err(Error::Config(
                "the bootstrap connection is for another rank, size or job".into(),
            ));
        }
        Ok(())
    }

    /// This rank.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// Number of ranks in the job.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The job identity: xdev-run's job name, the PMIx namespace or the PMI
    /// job (kvs) name.
    pub fn job(&self) -> &str {
        &self.job
    }

    /// The launcher whose bootstrap this is.
    pub fn launcher(&self) -> Launcher {
        match &self.backend {
            Backend::Tcp(_) => Launcher::XdevRun,
            Backend::Pmix(_) => Launcher::Pmix,
            Backend::Pmi(s) => match s.wire() {
                Wire::Pmi1 => Launcher::Pmi1,
                Wire::Pmi2 => Launcher::Pmi2,
            },
        }
    }

    /// The TCP service's address (`None` under PMIx or PMI).
    pub fn service_addr(&self) -> Option<SocketAddr> {
        match &self.backend {
            Backend::Tcp(t) => Some(t.service_addr()),
            _ => None,
        }
    }

    /// Rank, size and job as a [`Config`] (no options).
    pub fn config(&self) -> Config {
        Config::new(self.rank, self.size, self.job.clone())
    }

    /// Stores `value` under `key` (replacing an earlier value this rank
    /// put).
    ///
    /// Who may replace whose key depends on the launcher: under xdev-run a
    /// key belongs to the rank that first put it, and another rank's put of
    /// it fails with [`Error::Protocol`]; under PMIx each rank's value is
    /// filed under that rank; under PMI-1 and PMI-2 any rank can replace
    /// any key. Records that must be tied to their maker go through
    /// [`allgather`](Self::allgather), which checks that on every launcher
    /// (SECURITY.md, "Records and the launchers' key stores").
    ///
    /// Under xdev-run it returns once the service holds it, so a rank that
    /// learns of it afterwards can `get` it. Under PMIx and PMI the value is
    /// published to the other ranks by the next collective
    /// ([`barrier`](Self::barrier) or [`allgather`](Self::allgather)) of
    /// every rank; until then only this process sees it.
    ///
    /// Keys are at most [`wire::MAX_KEY_LEN`](crate::devkit::wire::MAX_KEY_LEN)
    /// bytes ([`Error::Config`]), values at most
    /// [`wire::MAX_VALUE_LEN`](crate::devkit::wire::MAX_VALUE_LEN) bytes, and the
    /// TCP store is bounded ([`Error::ResourceExhausted`]).
    pub fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        if let Backend::Tcp(t) = &self.backend {
            return t.put(key, value);
        }
        if key.len() > super::wire::MAX_KEY_LEN {
            return Err(Error::Config(format!(
                "bootstrap key of {} bytes is longer than {}",
                key.len(),
                super::wire::MAX_KEY_LEN
            )));
        }
        if value.len() > super::wire::MAX_VALUE_LEN {
            return Err(Error::Config(format!(
                "bootstrap value of {} bytes is longer than {}",
                value.len(),
                super::wire::MAX_VALUE_LEN
            )));
        }
        match &self.backend {
            Backend::Pmix(s) => s.put(key, value)?,
            Backend::Pmi(s) => s.put(key, value)?,
            Backend::Tcp(_) => unreachable!("handled above"),
        }
        lock(&OWN_PUTS)
            .get_or_insert_with(HashMap::new)
            .insert(key.to_owned(), value.to_vec());
        Ok(())
    }

    /// Fetches the value of `key`, waiting until it is visible here or
    /// `timeout` has passed; a timeout is an [`Error::Transport`] whose source
    /// has kind [`io::ErrorKind::TimedOut`], and leaves the handle usable.
    /// (Under PMIx and PMI another rank's value is visible after the
    /// collective that follows its `put`.) Under PMIx, a key that several
    /// ranks put with different values fails with [`Error::Protocol`]
    /// rather than answering with one of them.
    pub fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        if let Backend::Tcp(t) = &self.backend {
            return t.get(key, timeout);
        }
        let deadline = Instant::now().checked_add(timeout);
        let mut pause = Duration::from_millis(1);
        loop {
            if let Some(v) = lock(&OWN_PUTS).as_ref().and_then(|m| m.get(key)) {
                return Ok(v.clone());
            }
            let found = match &self.backend {
                Backend::Pmix(s) => s.get_any(key)?,
                Backend::Pmi(s) => s.get(key)?,
                Backend::Tcp(_) => unreachable!("handled above"),
            };
            if let Some(v) = found {
                return Ok(v);
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return Err(timed_out(format!(
                    "bootstrap: get({key:?}) timed out after {timeout:?}: no rank has published it"
                )));
            }
            let left = deadline.map_or(pause, |d| d - now);
            std::thread::sleep(pause.min(left));
            pause = (pause * 2).min(Duration::from_millis(100));
        }
    }

    /// Waits until every rank has entered the barrier. Under xdev-run it
    /// fails with [`Error::PeerLost`] if a rank that has not entered it
    /// leaves the job; under PMIx and PMI the launcher decides what a dead
    /// rank does to a fence (they usually end the job).
    pub fn barrier(&self) -> Result<()> {
        match &self.backend {
            Backend::Tcp(t) => t.barrier(),
            Backend::Pmix(s) => {
                let _order = lock(&COLLECTIVE);
                s.fence()
            }
            Backend::Pmi(s) => {
                let _order = lock(&COLLECTIVE);
                s.fence()
            }
        }
    }

    /// Contributes `value` (at most
    /// [`wire::MAX_VALUE_LEN`](crate::devkit::wire::MAX_VALUE_LEN) bytes) and
    /// returns every rank's contribution in rank order. Fails like
    /// [`barrier`](Self::barrier).
    pub fn allgather(&self, value: &[u8]) -> Result<Vec<Vec<u8>>> {
        if let Backend::Tcp(t) = &self.backend {
            return t.allgather(value);
        }
        if value.len() > super::wire::MAX_VALUE_LEN {
            return Err(Error::Config(format!(
                "allgather value of {} bytes is longer than {}",
                value.len(),
                super::wire::MAX_VALUE_LEN
            )));
        }
        let _order = lock(&COLLECTIVE);
        let n = COLLECTIVES.fetch_add(1, Ordering::Relaxed);
        // The process's first allgather also publishes what the ranks on a
        // host need to watch each other's processes (see `pidwatch`).
        let watch = (!pidwatch::started()).then(pidwatch::my_record);
        let (all, records) = match &self.backend {
            Backend::Pmix(s) => self.allgather_pmix(s, n, value, watch.as_deref())?,
            Backend::Pmi(s) => self.allgather_pmi(s, n, value, watch.as_deref())?,
            Backend::Tcp(_) => unreachable!("handled above"),
        };
        if let (Some(mine), Some(records)) = (watch, records) {
            pidwatch::start(pidwatch::peers_to_watch(self.rank, &mine, &records));
        }
        Ok(all)
    }

    /// Allgather `n` over PMIx: each rank puts its contribution (and, with
    /// `watch`, its pid record) under its own name, fences, and reads every
    /// rank's; returns the contributions and the records read.
    fn allgather_pmix(
        &self,
        s: &pmix::Session,
        n: u64,
        value: &[u8],
        watch: Option<&[u8]>,
    ) -> Result<Gathered> {
        let key = format!("ag.{n}");
        s.put(&key, value)?;
        if let Some(mine) = watch {
            s.put("pid", mine)?;
        }
        s.fence()?;
        let all = (0..self.size)
            .map(|r| {
                s.get_from(r as u32, &key, false)?
                    .ok_or_else(|| missing_part(r, n))
            })
            .collect::<Result<Vec<_>>>()?;
        let records = watch.map(|_| {
            (0..self.size)
                .map(|r| {
                    s.get_from(r as u32, "pid", true)
                        .ok()
                        .flatten()
                        .unwrap_or_default()
                })
                .collect::<Vec<_>>()
        });
        Ok((all, records))
    }

    /// Allgather `n` over PMI: each rank puts its contribution (and, with
    /// `watch`, its pid record) under a key naming its rank, fences, reads
    /// every rank's, and checks that its own were not replaced; returns the
    /// contributions and the records read.
    fn allgather_pmi(
        &self,
        s: &pmi::Session,
        n: u64,
        value: &[u8],
        watch: Option<&[u8]>,
    ) -> Result<Gathered> {
        s.put(&format!("ag.{n}.{}", self.rank), value)?;
        if let Some(mine) = watch {
            s.put(&format!("pid.{}", self.rank), mine)?;
        }
        s.fence()?;
        let all = (0..self.size)
            .map(|r| {
                s.get(&format!("ag.{n}.{r}"))?
                    .ok_or_else(|| missing_part(r, n))
            })
            .collect::<Result<Vec<_>>>()?;
        let records = watch.map(|_| {
            (0..self.size)
                .map(|r| {
                    s.get(&format!("pid.{r}"))
                        .ok()
                        .flatten()
                        .unwrap_or_default()
                })
                .collect::<Vec<_>>()
        });
        // PMI keys are not tied to their putter: any rank can put
        // `ag.N.R`. The rank that owns a record is the one that can
        // tell it was replaced, so it checks what the store now
        // holds before anyone may use it (see `owned_record_intact`).
        owned_record_intact(self.rank, &format!("ag.{n}.{}", self.rank), value, &all)?;
        if let (Some(mine), Some(records)) = (watch, &records) {
            owned_record_intact(self.rank, &format!("pid.{}", self.rank), mine, records)?;
        }
        Ok((all, records))
    }

    /// The ranks known to have gone, in the order they were reported: under
    /// xdev-run the ranks whose connection to the service closed (processes
    /// that exited, were killed, or dropped their handle); under PMIx and
    /// PMI the ranks on this host whose processes exited (seen from the
    /// first [`allgather`](Self::allgather) on) and, under PMIx, the
    /// processes the server's events reported.
    ///
    /// This reads a list kept up to date in the background; it sends
    /// nothing and takes one uncontended lock, so it is cheap enough to poll
    /// from a progress loop. Under xdev-run it fails once this rank's own
    /// connection to the service is lost.
    pub fn departed(&self) -> Result<Vec<Rank>> {
        Ok(self.departures()?.into_iter().map(|d| d.rank).collect())
    }

    /// Like [`departed`](Self::departed), saying for each rank whether it
    /// left cleanly.
    pub fn departures(&self) -> Result<Vec<Departure>> {
        match &self.backend {
            Backend::Tcp(t) => t.departures(),
            Backend::Pmix(s) => {
                let mut all = s.departures();
                for d in pidwatch::departures() {
                    if !all.iter().any(|x| x.rank == d.rank) {
                        all.push(d);
                    }
                }
                Ok(all)
            }
            Backend::Pmi(_) => Ok(pidwatch::departures()),
        }
    }
}

/// Checks that the store's value of this rank's record `key` (read after
/// the fence, `read[me]`) is what this rank put. Under PMI any rank can put
/// any key, and a later put replaces an earlier one; a rank that finds its
/// own record replaced fails here, before it enters the next collective,
/// so the ranks that read the replaced record cannot pass that collective
/// (every device enters one after it connected and before any message).
fn owned_record_intact(me: Rank, key: &str, put: &[u8], read: &[Vec<u8>]) -> Result<()> {
    if read.get(me).is_some_and(|v| v[..] == *put) {
        return Ok(());
    }
    Err(Error::Protocol {
        rank: me,
        what: format!(
            "this rank's bootstrap record {key:?} was replaced after it was put: another \
             process of the job poses as rank {me}, and the job cannot go on"
        ),
    })
}

fn missing_part(rank: Rank, n: u64) -> Error {
    Error::Protocol {
        rank,
        what: format!("rank {rank}'s part of allgather {n} is missing after the fence"),
    }
}

impl std::fmt::Debug for Bootstrap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("Bootstrap");
        d.field("rank", &self.rank)
            .field("size", &self.size)
            .field("job", &self.job)
            .field("launcher", &self.launcher());
        if let Some(a) = self.service_addr() {
            d.field("service", &a);
        }
        d.finish_non_exhaustive()
    }
}
