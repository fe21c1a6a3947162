//! The `hybrid` device: shared memory between the ranks of one host, a
//! network device (verbs by default) between hosts, behind one xdev device.
//!
//! # How it is put together
//!
//! At open, the ranks tell each other which host they run on (the kernel's
//! boot id and the host name, through the job's bootstrap) and split into
//! host groups. Each group opens a [`ProcessDevice`] (`shm`) of its own, with
//! a private bootstrap service run by the group's lowest rank on loopback
//! (its address and a fresh secret travel through the job's bootstrap). When
//! the job spans more than one host, every rank also opens the network
//! device over the whole job (`remote=ibv`, or `psm`, or `shm` for tests).
//! A message to a rank of the same host goes through shared memory; any
//! other through the network device. Both keep their own matching; this
//! layer adds none for messages with a named source.
//!
//! # Receives from any source
//!
//! A receive with [`ANY_SOURCE`](xdev::ANY_SOURCE) could be matched by either
//! device, so it is *held* here until a message for it is known: it is then
//! bound to that message's sender and tag with a probe of the device that
//! holds the message, and posted there (a probe sees only messages no posted
//! receive took, and a receive naming the sender and tag matches that
//! device's earliest such message, so the bound receive gets exactly the
//! probed one). Receives in the same context posted after a held one are
//! held behind it, in order, so MPI's rule holds: a message goes to the
//! earliest posted receive that matches it. Posting and binding happen under
//! one lock, so no other thread's receive can take a probed message first.
//! Blocking receives go the same way, with the caller's buffer lent to the
//! request for the length of the call.
//!
//! A wait that involves both devices (a held receive, `peek`, a probe from
//! any source) polls both, then sleeps in steps of at most
//! [`MAX_POLL_SLEEP`]: the two devices have no common wake-up event. A wait
//! on a request that went to one device is that device's own wait (which
//! sleeps on its doorbell or completion channel).

use std::any::Any;
use std::collections::VecDeque;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use shm_ipc::doorbell::Backoff;
use shm_ipc::ProcessDevice;
use xdev::bootstrap::{Bootstrap, BootstrapServer, Secret};
use xdev::matching::FxMap;
use xdev::registry::{Entry, Placement};
use xdev::{
    check_recv, check_send, Buffer, BufferStorage, Completion, Config, Context, Device, Envelope,
    Error, Pattern, Peeked, Progress, Rank, Request, RequestCore, RequestKind, Result, Source,
    Status, Tag, TagSel, Tracker,
};

use crate::{IbvDevice, PsmDevice};

/// The longest sleep between two polls of a wait that involves both devices.
pub const MAX_POLL_SLEEP: Duration = Duration::from_micros(200);

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

/// Which device reaches a rank.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Route {
    /// Same host: shared memory, under this index in the host group.
    Local(Rank),
    /// Another host: the network device (same rank numbers as the job).
    Remote,
}

/// Host groups from every rank's host key: for each rank, the index of its
/// host (in order of first appearance).
fn host_indices(keys: &[Vec<u8>]) -> Vec<usize> {
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
fn host_key(simulate: Option<usize>, rank: Rank, size: usize) -> Result<Vec<u8>> {
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
fn parse_service(record: &[u8], leader: Rank) -> Result<(SocketAddr, Secret)> {
    let bad = || Error::Protocol {
        rank: leader,
        what: "malformed host-group service address".into(),
    };
    let text = std::str::from_utf8(record).map_err(|_| bad())?;
    let (a, s) = text.split_once(' ').ok_or_else(bad)?;
    let addr: SocketAddr = a.parse().map_err(|_| bad())?;
    Ok((addr, Secret::from_hex(s)?))
}

/// Rank numbers in a status or error from the local device are indices in
/// the host group; this maps them to job ranks.
#[derive(Clone)]
struct RankMap {
    /// Group index to job rank, or `None` for the network device (whose
    /// ranks are the job's).
    to_job: Option<Arc<[Rank]>>,
    size: usize,
}

impl RankMap {
    fn rank(&self, r: Rank) -> Rank {
        match &self.to_job {
            Some(m) => m.get(r).copied().unwrap_or(r),
            None => r,
        }
    }

    fn error(&self, e: Error) -> Error {
        if self.to_job.is_none() {
            return e;
        }
        match e {
            Error::Truncated {
                sender,
                tag,
                message_len,
                capacity,
            } => Error::Truncated {
                sender: self.rank(sender),
                tag,
                message_len,
                capacity,
            },
            Error::InvalidRank { rank, .. } => Error::InvalidRank {
                rank: self.rank(rank),
                size: self.size,
            },
            Error::PeerLost { rank, reason } => Error::PeerLost {
                rank: self.rank(rank),
                reason,
            },
            Error::Protocol { rank, what } => Error::Protocol {
                rank: self.rank(rank),
                what,
            },
            other => other,
        }
    }

    fn result(&self, r: Result<Status>) -> Result<Status> {
        r.map(|st| self.status(st)).map_err(|e| self.error(e))
    }

    fn status(&self, mut st: Status) -> Status {
        if self.to_job.is_some() {
            st.source = self.rank(st.source);
            st.error = st.error.map(|e| self.error(e));
        }
        st
    }
}

/// A receive not yet given to a device (see the module documentation).
struct HeldRecv {
    core: xdev::CoreRef,
    /// The receive's buffer, until the receive is relayed to a device.
    buf: Buffer,
    source: Source,
    tag: TagSel,
}

/// Held receives per context, in posting order.
#[derive(Default)]
struct Held {
    queues: FxMap<Context, VecDeque<HeldRecv>>,
    /// Which device a wildcard looks at first (alternates, so that neither
    /// starves the other).
    remote_first: bool,
}

struct Hybrid {
    rank: Rank,
    size: usize,
    routes: Vec<Route>,
    local: Arc<dyn Device>,
    local_map: RankMap,
    /// The network device's ranks are the job's.
    remote_map: RankMap,
    remote: Option<Arc<dyn Device>>,
    tracker: Arc<Tracker>,
    /// Held receives. Every receive is posted to a device under this lock.
    held: Mutex<Held>,
    closed: AtomicBool,
}

/// The hybrid xdev device (see the module documentation).
pub struct HybridDevice {
    inner: Arc<Hybrid>,
    /// The host group's bootstrap service, on the group's lowest rank. Only
    /// needed while the group's shared-memory device opens; kept so that
    /// ranks still reading their last reply are not cut off.
    _local_service: Option<BootstrapServer>,
    /// The job's bootstrap when no network device took it (one host).
    _boot: Option<Bootstrap>,
    description: String,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock only means a panic elsewhere; the data stays sound.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn open_remote(name: &str, config: &Config, boot: Bootstrap) -> Result<Arc<dyn Device>> {
    Ok(match name {
        "ibv" => Arc::new(IbvDevice::with_bootstrap(config, boot)?),
        "psm" => Arc::new(PsmDevice::with_bootstrap(config, boot)?),
        _ => Arc::new(ProcessDevice::with_bootstrap(config, boot)?),
    })
}

impl HybridDevice {
    /// Opens the device with the bootstrap service named by the environment
    /// (`xdev-run` sets it). Collective.
    pub fn open(config: &Config) -> Result<HybridDevice> {
        Self::with_bootstrap(config, Bootstrap::for_config(config)?)
    }

    /// Opens the device over a connected bootstrap (collective: every rank
    /// of the job calls it).
    pub fn with_bootstrap(config: &Config, boot: Bootstrap) -> Result<HybridDevice> {
        config.validate()?;
        boot.check_config(config)?;
        let opts = HybridOptions::from_config(config)?;
        let (rank, size) = (config.rank, config.size);
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
            inner: Arc::new(Hybrid {
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

impl Hybrid {
    fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            Err(Error::Closed)
        } else {
            Ok(())
        }
    }

    /// The device for `route`, and how its ranks map to the job's.
    fn device(&self, route: Route) -> (&dyn Device, &RankMap) {
        match (route, &self.remote) {
            (Route::Remote, Some(r)) => (&**r, &self.remote_map),
            _ => (&*self.local, &self.local_map),
        }
    }

    /// The device reaching `rank` and the rank's number there.
    fn reach(&self, rank: Rank) -> (&dyn Device, Rank, &RankMap) {
        let route = self.routes[rank];
        let (dev, map) = self.device(route);
        match route {
            Route::Local(i) => (dev, i, map),
            Route::Remote => (dev, rank, map),
        }
    }

    /// The envelope of a receive that fails before it matched (as every
    /// device: this rank, no tag).
    fn failed_recv_env(&self, context: Context) -> Envelope {
        Envelope {
            source: self.rank,
            tag: -1,
            context,
        }
    }

    fn request(self: &Arc<Self>, core: xdev::CoreRef) -> Request {
        Request::new(core, self.clone())
    }

    fn rejected(
        self: &Arc<Self>,
        kind: RequestKind,
        buf: Buffer,
        env: Envelope,
        e: Error,
    ) -> Request {
        let core = self.tracker.rejected(kind, buf, Status::failed(env, e));
        self.request(core)
    }

    /// Starts a request on `dev` with `buf` (by `start`) and relays `outer`
    /// (started without a buffer) to it: its completion completes `outer`
    /// with the buffer (ranks mapped by `map`).
    fn relay(
        &self,
        outer: &xdev::CoreRef,
        buf: Buffer,
        dev: &dyn Device,
        map: &RankMap,
        start: impl FnOnce(&dyn Device, Buffer) -> Request,
    ) {
        let (tracker, done, map) = (self.tracker.clone(), outer.clone(), map.clone());
        // The hook runs on whichever thread completes the request below,
        // possibly under that device's locks: it takes only the tracker's
        // lock, which is never held across a call into a device.
        outer.relay(
            start(dev, buf),
            Box::new(move |c: Completion| {
                tracker.complete_returning(&done, c.buf, map.status(c.status));
            }),
        );
    }

    /// Whether a receive in `context` must be held (see the module docs).
    fn must_hold(&self, held: &Held, source: Source, context: Context) -> bool {
        self.remote.is_some() && (source == Source::Any || held.queues.contains_key(&context))
    }

    /// Posts a receive for `core` into `buf` to the device reaching `source`
    /// (a rank).
    fn post_named(
        &self,
        core: &xdev::CoreRef,
        buf: Buffer,
        source: Rank,
        tag: TagSel,
        context: Context,
    ) {
        let (dev, r, map) = self.reach(source);
        self.relay(core, buf, dev, map, |d, b| {
            d.irecv(b, Source::Rank(r), tag, context)
        });
    }

    /// Gives the held receives of `context` to devices, in order, as far as
    /// a wildcard at the head can be bound to a message.
    fn advance(&self, held: &mut Held, context: Context) {
        let Some(queue) = held.queues.get_mut(&context) else {
            return;
        };
        while let Some(head) = queue.pop_front() {
            let HeldRecv {
                core,
                buf,
                source,
                tag,
            } = head;
            match source {
                Source::Rank(s) => self.post_named(&core, buf, s, tag, context),
                Source::Any => {
                    let order = if held.remote_first {
                        [Route::Remote, Route::Local(0)]
                    } else {
                        [Route::Local(0), Route::Remote]
                    };
                    let mut buf = Some(buf);
                    for route in order {
                        let (dev, map) = self.device(route);
                        match dev.iprobe(Source::Any, tag, context) {
                            Ok(None) => continue,
                            Ok(Some(st)) => {
                                // Bind to the probed message: its sender and tag.
                                let b = buf.take().expect("bound once");
                                self.relay(&core, b, dev, map, |d, b| {
                                    d.irecv(
                                        b,
                                        Source::Rank(st.source),
                                        TagSel::Tag(st.tag),
                                        context,
                                    )
                                });
                            }
                            Err(e) => {
                                let env = self.failed_recv_env(context);
                                let b = buf.take().expect("bound once");
                                self.tracker
                                    .complete_returning(&core, b, Status::failed(env, e));
                            }
                        }
                        break;
                    }
                    if let Some(buf) = buf {
                        // No message for it yet: it stays at the head.
                        queue.push_front(HeldRecv {
                            core,
                            buf,
                            source,
                            tag,
                        });
                        return;
                    }
                    held.remote_first = !held.remote_first;
                }
            }
        }
        held.queues.remove(&context);
    }

    fn advance_all(&self) {
        let mut held = lock(&self.held);
        if held.queues.is_empty() {
            return;
        }
        let contexts: Vec<Context> = held.queues.keys().copied().collect();
        for c in contexts {
            self.advance(&mut held, c);
        }
    }

    /// One round of progress on both devices and the held receives.
    fn poll(&self) {
        self.advance_all();
        self.local.progress();
        if let Some(r) = &self.remote {
            r.progress();
        }
    }

    /// Polls until `done` says so: spins, yields, then sleeps in growing
    /// steps up to [`MAX_POLL_SLEEP`].
    fn poll_until<T>(&self, mut done: impl FnMut(&Self) -> Option<T>) -> T {
        let mut backoff = Backoff::new();
        let mut sleep = Duration::from_micros(10);
        loop {
            if let Some(v) = done(self) {
                return v;
            }
            self.poll();
            if let Some(v) = done(self) {
                return v;
            }
            if !backoff.snooze() {
                std::thread::sleep(sleep);
                sleep = (sleep * 2).min(MAX_POLL_SLEEP);
            }
        }
    }

    fn irecv(
        self: &Arc<Self>,
        buf: Buffer,
        source: Source,
        tag: TagSel,
        context: Context,
    ) -> Request {
        let env = self.failed_recv_env(context);
        if let Err(e) = check_recv(source, tag, self.size).and_then(|_| self.check_open()) {
            return self.rejected(RequestKind::Recv, buf, env, e);
        }
        let mut held = lock(&self.held);
        if self.must_hold(&held, source, context) {
            let core = self.tracker.start_relay(RequestKind::Recv);
            held.queues.entry(context).or_default().push_back(HeldRecv {
                core: core.clone(),
                buf,
                source,
                tag,
            });
            self.advance(&mut held, context);
            drop(held);
            return self.request(core);
        }
        // Nothing held: the receive goes straight down (still under the
        // lock, so that a receive held after it cannot overtake it).
        let (dev, r, map) = match source {
            Source::Rank(s) => {
                let (dev, r, map) = self.reach(s);
                (dev, Source::Rank(r), map)
            }
            // One host: every source is local.
            Source::Any => (&*self.local, Source::Any, &self.local_map),
        };
        let below = dev.irecv(buf, r, tag, context);
        let request = self.forward(RequestKind::Recv, below, map);
        drop(held);
        request
    }

    /// The request for `below`, just started on a device below: born
    /// complete if it already is (a small send that went out, a message
    /// that was already there), else relayed.
    fn forward(self: &Arc<Self>, kind: RequestKind, below: Request, map: &RankMap) -> Request {
        match below.take_if_done() {
            Ok(c) => self.tracker.completed(kind, c.buf, map.status(c.status)),
            Err(below) => {
                let core = self.tracker.start_relay(kind);
                let (tracker, done, map) = (self.tracker.clone(), core.clone(), map.clone());
                core.relay(
                    below,
                    Box::new(move |c: Completion| {
                        tracker.complete_returning(&done, c.buf, map.status(c.status));
                    }),
                );
                self.request(core)
            }
        }
    }

    fn isend(
        self: &Arc<Self>,
        buf: Buffer,
        dest: Rank,
        tag: Tag,
        context: Context,
        sync: bool,
    ) -> Request {
        // As every device: a failed send's status names its destination.
        let env = Envelope {
            source: dest,
            tag,
            context,
        };
        if let Err(e) = check_send(dest, tag, self.size).and_then(|_| self.check_open()) {
            return self.rejected(RequestKind::Send, buf, env, e);
        }
        let (dev, d, map) = self.reach(dest);
        let below = if sync {
            dev.issend(buf, d, tag, context)
        } else {
            dev.isend(buf, d, tag, context)
        };
        self.forward(RequestKind::Send, below, map)
    }

    /// `send`/`ssend`. With two devices, a send blocked inside one of them
    /// would starve the other, so it runs as a request this layer waits for.
    fn blocking_send(
        self: &Arc<Self>,
        buf: &[u8],
        dest: Rank,
        tag: Tag,
        context: Context,
        sync: bool,
    ) -> Result<()> {
        check_send(dest, tag, self.size)?;
        self.check_open()?;
        if self.remote.is_none() {
            let (dev, d, map) = self.reach(dest);
            let r = if sync {
                dev.ssend(buf, d, tag, context)
            } else {
                dev.send(buf, d, tag, context)
            };
            return r.map_err(|e| map.error(e));
        }
        // SAFETY: `buf` is borrowed for this call, which waits for the send;
        // a device only reads a send's buffer.
        unsafe {
            lend_and_wait(buf.as_ptr().cast_mut(), buf.len(), |b| {
                self.isend(b, dest, tag, context, sync)
            })
        }
        .map(drop)
    }
}

impl Progress for Hybrid {
    fn progress(&self) {
        self.poll();
    }

    fn wait(&self, core: &RequestCore) {
        if self.remote.is_none() {
            // One device: its own wait (which sleeps on its doorbell).
            if let Some((c, engine)) = core.relayed_to() {
                engine.wait(c);
            }
        }
        // Two devices: a wait inside one would starve the other (a peer may
        // need this rank to drain a ring of the other device before it can
        // send what this request waits for), so poll both.
        self.poll_until(|_| core.is_done().then_some(()));
    }

    fn cancel(&self, core: &xdev::CoreRef) -> bool {
        if core.kind() != RequestKind::Recv || core.is_done() {
            return false;
        }
        // Under the held lock: a held receive is relayed only under it.
        let mut held = lock(&self.held);
        if let Some((c, engine)) = core.relayed_to() {
            drop(held);
            return engine.cancel(c);
        }
        for (&context, queue) in held.queues.iter_mut() {
            if let Some(i) = queue
                .iter()
                .position(|h| xdev::CoreRef::ptr_eq(&h.core, core))
            {
                let h = queue.remove(i).expect("position is in range");
                let st = Status::cancelled(Pattern::new(h.source, h.tag, context));
                self.tracker.complete_returning(core, h.buf, st);
                // Receives held behind it may be free to go now.
                self.advance(&mut held, context);
                return true;
            }
        }
        false
    }
}

/// The caller's buffer of a blocking send or receive, lent to a request
/// that the call waits for before it returns.
struct Lent {
    ptr: *mut u8,
    len: usize,
}

impl Lent {
    /// A buffer over `len` bytes at `ptr`, owned by the caller.
    ///
    /// # Safety
    /// The memory must stay valid, and untouched by anyone but the device,
    /// until the request given the buffer has completed and the buffer is
    /// dropped; the caller must not return (nor unwind) before then. For a
    /// send the memory may be shared (devices only read a send's buffer).
    unsafe fn buffer(ptr: *mut u8, len: usize) -> Buffer {
        Buffer::from_storage(Box::new(Lent { ptr, len }), len)
    }
}

// SAFETY: `Lent` is only an address range into memory borrowed for the
// whole call that created it (see `Lent::buffer`).
unsafe impl Send for Lent {}
// SAFETY: as above; `Lent` hands out no references itself.
unsafe impl Sync for Lent {}

// SAFETY: `ptr` is the start of `len` bytes that outlive this object: only
// `Lent::buffer` creates it, whose contract is that the caller waits for the
// request that owns the buffer (aborting rather than unwinding before then,
// see `AbortIfLent`). A receive's memory is an exclusive borrow; a send's may
// be shared, and devices only read it.
unsafe impl BufferStorage for Lent {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }

    fn capacity(&self) -> usize {
        self.len
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Aborts the process if dropped while armed: a blocking call that unwinds
/// (a panic inside a device) before its request completed cannot give the
/// caller back memory a device may still use.
struct AbortIfLent(bool);

impl Drop for AbortIfLent {
    fn drop(&mut self) {
        if self.0 {
            eprintln!("hybrid: a blocking call unwound with its buffer still lent; aborting");
            std::process::abort();
        }
    }
}

/// Lends `len` bytes at `ptr` to the request `start` makes, waits for it,
/// and returns its status (its error, if any, as the error).
///
/// # Safety
/// As [`Lent::buffer`]: the memory is the caller's for the whole call, and
/// exclusively so unless the request is a send.
unsafe fn lend_and_wait(
    ptr: *mut u8,
    len: usize,
    start: impl FnOnce(Buffer) -> Request,
) -> Result<Status> {
    // SAFETY: this function returns only after the request completed and its
    // buffer was dropped, and aborts instead of unwinding before that.
    let lent = unsafe { Lent::buffer(ptr, len) };
    let mut armed = AbortIfLent(true);
    let mut c = start(lent).wait();
    drop(c.buf);
    armed.0 = false;
    match c.status.error.take() {
        Some(e) => Err(e),
        None => Ok(c.status),
    }
}

impl Device for HybridDevice {
    fn name(&self) -> &'static str {
        "hybrid"
    }

    fn id(&self) -> Rank {
        self.inner.rank
    }

    fn size(&self) -> usize {
        self.inner.size
    }

    fn send(&self, buf: &[u8], dest: Rank, tag: Tag, context: Context) -> Result<()> {
        self.inner.blocking_send(buf, dest, tag, context, false)
    }

    fn ssend(&self, buf: &[u8], dest: Rank, tag: Tag, context: Context) -> Result<()> {
        self.inner.blocking_send(buf, dest, tag, context, true)
    }

    fn recv(
        &self,
        buf: &mut [u8],
        source: Source,
        tag: TagSel,
        context: Context,
    ) -> Result<Status> {
        let h = &self.inner;
        check_recv(source, tag, h.size)?;
        h.check_open()?;
        if h.remote.is_none() {
            // One host: no receive is ever held; the device's own blocking path.
            let src = match source {
                Source::Rank(s) => Source::Rank(h.reach(s).1),
                Source::Any => Source::Any,
            };
            return h.local_map.result(h.local.recv(buf, src, tag, context));
        }
        // SAFETY: `buf` is exclusively borrowed for this call, which waits
        // for the receive.
        unsafe {
            lend_and_wait(buf.as_mut_ptr(), buf.len(), |b| {
                h.irecv(b, source, tag, context)
            })
        }
    }

    fn isend(&self, buf: Buffer, dest: Rank, tag: Tag, context: Context) -> Request {
        self.inner.isend(buf, dest, tag, context, false)
    }

    fn issend(&self, buf: Buffer, dest: Rank, tag: Tag, context: Context) -> Request {
        self.inner.isend(buf, dest, tag, context, true)
    }

    fn irecv(&self, buf: Buffer, source: Source, tag: TagSel, context: Context) -> Request {
        self.inner.irecv(buf, source, tag, context)
    }

    fn probe(&self, source: Source, tag: TagSel, context: Context) -> Result<Status> {
        let h = &self.inner;
        check_recv(source, tag, h.size)?;
        h.check_open()?;
        match (source, &h.remote) {
            (Source::Rank(s), _) => {
                let (dev, r, map) = h.reach(s);
                map.result(dev.probe(Source::Rank(r), tag, context))
            }
            (Source::Any, None) => h.local_map.result(h.local.probe(Source::Any, tag, context)),
            (Source::Any, Some(_)) => {
                h.poll_until(|_| self.iprobe(source, tag, context).transpose())
            }
        }
    }

    fn iprobe(&self, source: Source, tag: TagSel, context: Context) -> Result<Option<Status>> {
        let h = &self.inner;
        check_recv(source, tag, h.size)?;
        h.check_open()?;
        h.advance_all();
        let both = [Route::Local(0), Route::Remote];
        let routes: &[Route] = match source {
            Source::Rank(s) => std::slice::from_ref(&h.routes[s]),
            Source::Any if h.remote.is_some() => &both,
            Source::Any => &both[..1],
        };
        for &route in routes {
            let (dev, map) = h.device(route);
            let src = match (source, route) {
                (Source::Rank(_), Route::Local(i)) => Source::Rank(i),
                _ => source,
            };
            if let Some(st) = dev.iprobe(src, tag, context).map_err(|e| map.error(e))? {
                return Ok(Some(map.status(st)));
            }
        }
        Ok(None)
    }

    fn peek(&self) -> Result<Option<Peeked>> {
        let h = &self.inner;
        Ok(h.poll_until(|h| match h.tracker.pop_completed() {
            Some(p) => Some(Some(p)),
            None if h.tracker.outstanding() == 0 => Some(None),
            None => None,
        }))
    }

    fn progress(&self) {
        self.inner.poll();
    }

    fn finish(&self) -> Result<()> {
        let h = &self.inner;
        if h.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let local = h.local.finish();
        let remote = h.remote.as_ref().map_or(Ok(()), |r| r.finish());
        // Receives still held end like those the devices had: closed.
        let held: Vec<(Context, HeldRecv)> = {
            let mut held = lock(&h.held);
            held.queues
                .drain()
                .flat_map(|(c, q)| q.into_iter().map(move |r| (c, r)))
                .collect()
        };
        for (context, r) in held {
            let env = h.failed_recv_env(context);
            h.tracker
                .complete_returning(&r.core, r.buf, Status::failed(env, Error::Closed));
        }
        local.map_err(|e| h.local_map.error(e))?;
        remote
    }
}

impl std::fmt::Debug for HybridDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.description)
    }
}

/// Registers `hybrid` in `registry`.
pub fn register(registry: &mut xdev::Registry) {
    registry.register(Entry {
        name: "hybrid",
        description: "shared memory inside a host, verbs (or remote=psm|shm) between hosts",
        placement: Placement::Processes,
        open: |cfg| Ok(Arc::new(HybridDevice::open(cfg)?) as Arc<dyn Device>),
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(opts: &[&str]) -> Config {
        Config::new(0, 4, "j").with_assignments(opts).unwrap()
    }

    #[test]
    fn options_split_by_prefix_and_check_the_remote() {
        let o = HybridOptions::from_config(&config(&[
            "remote=psm",
            "local.eager_limit=1024",
            "remote.eager_limit=4096",
            "simulate_hosts=2",
        ]))
        .unwrap();
        assert_eq!(o.remote, "psm");
        assert_eq!(o.simulate_hosts, Some(2));
        assert_eq!(o.local_options, vec![("eager_limit".into(), "1024".into())]);
        assert_eq!(
            o.remote_options,
            vec![("eager_limit".into(), "4096".into())]
        );
        assert_eq!(
            HybridOptions::from_config(&config(&[])).unwrap().remote,
            "ibv"
        );
        assert!(matches!(
            HybridOptions::from_config(&config(&["remote=tcp"])),
            Err(Error::Config(_))
        ));
        assert!(matches!(
            HybridOptions::from_config(&config(&["simulate_hosts=0"])),
            Err(Error::Config(_))
        ));
    }

    #[test]
    fn hosts_group_by_key_in_order_of_appearance() {
        let keys: Vec<Vec<u8>> = ["b", "a", "b", "c", "a"]
            .iter()
            .map(|k| k.as_bytes().to_vec())
            .collect();
        assert_eq!(host_indices(&keys), vec![0, 1, 0, 2, 1]);
        let sim: Vec<_> = (0..4).map(|r| host_key(Some(2), r, 4).unwrap()).collect();
        assert_eq!(host_indices(&sim), vec![0, 0, 1, 1]);
        let real = host_key(None, 0, 1).unwrap();
        assert!(real.len() > 36, "boot id and host name: {real:?}");
    }

    #[test]
    fn service_records_parse_or_blame_the_leader() {
        let secret = Secret::generate().unwrap();
        let good = format!("127.0.0.1:4000 {}", secret.to_hex());
        let (addr, s) = parse_service(good.as_bytes(), 2).unwrap();
        assert_eq!((addr.port(), s), (4000, secret));
        for bad in [&b"127.0.0.1:4000"[..], b"nowhere 00", b"\xff\xfe"] {
            assert!(
                matches!(parse_service(bad, 2), Err(Error::Protocol { rank: 2, .. })),
                "{bad:?}"
            );
        }
        assert!(matches!(
            parse_service(b"127.0.0.1:4000 zz", 2),
            Err(Error::Config(_))
        ));
    }

    #[test]
    fn local_ranks_map_to_job_ranks() {
        let map = RankMap {
            to_job: Some(vec![2, 3].into()),
            size: 4,
        };
        let env = Envelope {
            source: 1,
            tag: 5,
            context: 0,
        };
        let st = map.status(Status::received(env, 10, 4));
        assert_eq!(st.source, 3);
        assert!(matches!(st.error, Some(Error::Truncated { sender: 3, .. })));
        assert!(matches!(
            map.error(Error::PeerLost {
                rank: 0,
                reason: "x".into()
            }),
            Error::PeerLost { rank: 2, .. }
        ));
        // A cancelled receive's `usize::MAX` source is not a rank.
        assert_eq!(
            map.status(Status::cancelled(Pattern::new(Source::Any, TagSel::Any, 0)))
                .source,
            usize::MAX
        );
    }
}
