//! The bootstrap service: a listener thread plus one thread per connection,
//! blocking I/O, all state under one lock that is never held across socket
//! I/O.
//!
//! This file holds the public face ([`BootstrapServer`], its options and
//! status) and the state every part works on; the parts are
//! [`accept`] (the accept loop and the handshake slots), [`peer_owner`]
//! (whose socket a connection from this host comes from), [`handshake`],
//! [`connection`] (one connection's thread: its handshake, then its
//! requests), [`store`] (put, get and cancel), [`collective`] (barrier and
//! allgather) and [`departure`].

mod accept;
mod collective;
mod connection;
mod departure;
mod handshake;
mod peer_owner;
mod store;

use std::collections::HashMap;
use std::io::Write;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use self::accept::accept_loop;
use super::wire::{self, Failure, FailureKind, Message};
use super::{Departure, Secret};
use crate::{Error, Rank, Result};

/// Limits of a [`BootstrapServer`]; [`Default`] gives the documented values.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// Bytes of keys, values and in-flight allgather contributions the
    /// service holds at most (default 64 MiB). A request that would go beyond
    /// fails with [`Error::ResourceExhausted`].
    pub max_store_bytes: usize,
    /// Connections that may be in their handshake at once (default 32).
    ///
    /// A connection from this host by another user (its socket's owner, as
    /// `/proc/net/tcp` and `tcp6` show it, differs from this process's
    /// effective uid) is closed at once and takes no slot. When all slots
    /// are taken, a new connection evicts a handshake that has not yet sent
    /// its `Auth` (of the peer address holding the most slots, the oldest
    /// of those), so connections that stay silent cannot hold a real rank
    /// off; if every slot holds an `Auth` being checked, the new connection
    /// waits in the listen backlog.
    pub max_pending_handshakes: usize,
    /// Time a new connection has to complete its handshake (default 5 s).
    pub handshake_timeout: Duration,
    /// Time a write to a rank may block before that rank's connection is
    /// dropped (default 30 s).
    pub write_timeout: Duration,
    /// `get`s one rank may have waiting at once (default 1024).
    pub max_waiting_gets: usize,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            max_store_bytes: 64 << 20,
            max_pending_handshakes: 32,
            handshake_timeout: Duration::from_secs(5),
            write_timeout: Duration::from_secs(30),
            max_waiting_gets: 1024,
        }
    }
}

/// A snapshot of the service's view of the job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerStatus {
    /// Number of ranks in the job.
    pub size: usize,
    /// Ranks connected now.
    pub connected: Vec<Rank>,
    /// Ranks whose connection has closed, in rank order.
    pub departed: Vec<Departure>,
    /// Bytes of the store in use.
    pub store_bytes: usize,
}

impl ServerStatus {
    /// Whether every rank has connected and then disconnected.
    pub fn finished(&self) -> bool {
        self.departed.len() == self.size
    }
}

/// A running bootstrap service for one job.
///
/// It accepts at most one authenticated connection per rank (a rank cannot be
/// claimed twice, even after its connection closed), serves it on its own
/// thread, and stops when dropped or [`shutdown`](Self::shutdown).
pub struct BootstrapServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

struct Shared {
    size: usize,
    job: String,
    secret: Secret,
    opts: ServerOptions,
    stop: AtomicBool,
    /// An eventfd written when the service stops, to wake the accept loop
    /// from its `poll`.
    wake: std::os::fd::OwnedFd,
    /// Handshake threads running (those of evicted connections included
    /// until they notice), at most twice the slots.
    handshakes: AtomicUsize,
    /// The connections holding a handshake slot.
    pending: Mutex<HashMap<u64, Pending>>,
    state: Mutex<State>,
    changed: Condvar,
    conns: Mutex<Conns>,
}

/// Every socket the service holds (to shut them down) and every thread.
#[derive(Default)]
struct Conns {
    next_id: u64,
    sockets: HashMap<u64, TcpStream>,
    threads: Vec<JoinHandle<()>>,
}

/// A connection in its handshake, holding a slot.
struct Pending {
    /// To shut it down when it is evicted.
    stream: TcpStream,
    source: std::net::IpAddr,
    since: Instant,
    /// Set once its `Auth` has arrived: no longer evictable.
    heard: Arc<AtomicBool>,
}

/// The sending half of an authenticated connection.
struct Conn {
    writer: Mutex<TcpStream>,
}

impl Conn {
    /// Writes one frame (`head`, then `payload`). A failed or timed-out write
    /// leaves the stream unusable, so the connection is shut down; its reader
    /// thread then records the departure.
    fn send(&self, head: &[u8], payload: Option<&[u8]>) {
        let mut w = lock(&self.writer);
        let r = w
            .write_all(head)
            .and_then(|()| payload.map_or(Ok(()), |p| w.write_all(p)));
        if r.is_err() {
            let _ = w.shutdown(Shutdown::Both);
        }
    }
}

enum Slot {
    Free,
    Live { conn: Arc<Conn>, goodbye: bool },
    Gone { clean: bool },
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum CollKind {
    Barrier,
    Allgather,
}

impl CollKind {
    fn name(self) -> &'static str {
        match self {
            CollKind::Barrier => "barrier",
            CollKind::Allgather => "allgather",
        }
    }
}

/// The collective in progress: who has contributed what under which id.
struct Coll {
    kind: Option<CollKind>,
    parts: Vec<Option<(u32, Arc<[u8]>)>>,
    count: usize,
    bytes: usize,
}

struct State {
    slots: Vec<Slot>,
    /// Each key with the rank that first put it (its owner) and its value.
    store: HashMap<String, (Rank, Arc<[u8]>)>,
    used: usize,
    /// Waiting gets by key, and by (rank, id) for cancellation.
    waiters: HashMap<String, Vec<(Rank, u32)>>,
    waiting: HashMap<(Rank, u32), String>,
    waiting_per_rank: Vec<usize>,
    coll: Coll,
}

/// A frame to send once the state lock is released.
struct Out {
    to: Arc<Conn>,
    head: Vec<u8>,
    payload: Option<Arc<[u8]>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn frame(msg: &Message) -> Vec<u8> {
    // Everything the service sends is within the limits by construction.
    wire::encode(msg).expect("service messages are within the wire limits")
}

fn failed(id: u32, kind: FailureKind, rank: Rank, text: String) -> Vec<u8> {
    frame(&Message::Failed {
        id,
        failure: Failure {
            kind,
            rank: rank as u32,
            text,
        },
    })
}

impl State {
    fn live(&self, rank: Rank) -> Option<Arc<Conn>> {
        match &self.slots[rank] {
            Slot::Live { conn, .. } => Some(conn.clone()),
            _ => None,
        }
    }

    fn reply(&self, out: &mut Vec<Out>, rank: Rank, head: Vec<u8>, payload: Option<Arc<[u8]>>) {
        if let Some(to) = self.live(rank) {
            out.push(Out { to, head, payload });
        }
    }

    /// Answers request `id` of `rank` with a failure of `kind`, blaming `who`.
    fn refuse(
        &self,
        out: &mut Vec<Out>,
        rank: Rank,
        id: u32,
        kind: FailureKind,
        who: Rank,
        text: String,
    ) {
        self.reply(out, rank, failed(id, kind, who, text), None);
    }
}

fn send_all(out: Vec<Out>) {
    for o in out {
        o.to.send(&o.head, o.payload.as_deref());
    }
}

impl BootstrapServer {
    /// Runs `f` on the accepted socket whose peer is `peer` (tests).
    #[cfg(test)]
    pub(crate) fn with_socket_for_tests<R>(
        &self,
        peer: SocketAddr,
        f: impl FnOnce(&TcpStream) -> R,
    ) -> Option<R> {
        let conns = lock(&self.shared.conns);
        let s = conns
            .sockets
            .values()
            .find(|s| s.peer_addr().ok() == Some(peer))?;
        Some(f(s))
    }

    /// Starts a service for `size` ranks of job `job`, listening on `bind`
    /// (port 0 picks a free port, see [`addr`](Self::addr)), with the default
    /// [`ServerOptions`].
    pub fn start(bind: SocketAddr, size: usize, job: &str, secret: Secret) -> Result<Self> {
        Self::start_with(bind, size, job, secret, ServerOptions::default())
    }

    /// Like [`start`](Self::start) with explicit limits.
    pub fn start_with(
        bind: SocketAddr,
        size: usize,
        job: &str,
        secret: Secret,
        opts: ServerOptions,
    ) -> Result<Self> {
        if size == 0 || size > u32::MAX as usize {
            return Err(Error::Config(format!(
                "bootstrap: job size {size} is outside 1..={}",
                u32::MAX
            )));
        }
        if job.is_empty() || job.len() > wire::MAX_JOB_LEN {
            return Err(Error::Config(format!(
                "bootstrap: job identity must be 1..={} bytes long",
                wire::MAX_JOB_LEN
            )));
        }
        if opts.max_pending_handshakes == 0 || opts.handshake_timeout.is_zero() {
            return Err(Error::Config(
                "bootstrap: max_pending_handshakes and handshake_timeout must be positive".into(),
            ));
        }
        let listener = TcpListener::bind(bind)
            .map_err(|e| Error::transport(format!("bootstrap: binding {bind}"), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::transport("bootstrap: reading the bound address", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::transport("bootstrap: configuring the listener", e))?;
        let wake = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
        )
        .map_err(|e| {
            Error::transport(
                "bootstrap: creating the listener's wake-up eventfd",
                std::io::Error::from(e),
            )
        })?;
        let shared = Arc::new(Shared {
            size,
            job: job.to_owned(),
            secret,
            opts,
            stop: AtomicBool::new(false),
            wake,
            handshakes: AtomicUsize::new(0),
            pending: Mutex::new(HashMap::new()),
            state: Mutex::new(State {
                slots: (0..size).map(|_| Slot::Free).collect(),
                store: HashMap::new(),
                used: 0,
                waiters: HashMap::new(),
                waiting: HashMap::new(),
                waiting_per_rank: vec![0; size],
                coll: Coll {
                    kind: None,
                    parts: vec![None; size],
                    count: 0,
                    bytes: 0,
                },
            }),
            changed: Condvar::new(),
            conns: Mutex::new(Conns::default()),
        });
        let sh = shared.clone();
        let acceptor = thread::Builder::new()
            .name("xdev-bootstrap-accept".into())
            .spawn(move || accept_loop(&sh, &listener))
            .map_err(|e| Error::transport("bootstrap: starting the listener thread", e))?;
        Ok(BootstrapServer {
            addr,
            shared,
            acceptor: Some(acceptor),
        })
    }

    /// The address the service listens on (with the real port when bound to
    /// port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The job size.
    pub fn size(&self) -> usize {
        self.shared.size
    }

    /// The job identity.
    pub fn job(&self) -> &str {
        &self.shared.job
    }

    /// The store's entries whose key starts with `prefix` (what ranks
    /// `put`), each as (key, the rank that put it, value), for the
    /// launcher's clean-up after the job. A key belongs to the rank that
    /// first put it (no other rank can replace it), so a consumer can check
    /// that a record about rank R was put by R itself.
    pub fn stored(&self, prefix: &str) -> Vec<(String, Rank, Vec<u8>)> {
        let st = lock(&self.shared.state);
        st.store
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(k, (owner, v))| (k.clone(), *owner, v.to_vec()))
            .collect()
    }

    /// What the service knows about the ranks now.
    pub fn status(&self) -> ServerStatus {
        status_of(&self.shared, &lock(&self.shared.state))
    }

    /// Waits until every rank has connected and disconnected, or `timeout`
    /// passes (`None`: no limit). Returns whether the job finished.
    pub fn wait_finished(&self, timeout: Option<Duration>) -> bool {
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        let mut st = lock(&self.shared.state);
        loop {
            if st.slots.iter().all(|s| matches!(s, Slot::Gone { .. })) {
                return true;
            }
            st = match deadline {
                None => self
                    .shared
                    .changed
                    .wait(st)
                    .unwrap_or_else(|e| e.into_inner()),
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return false;
                    }
                    self.shared
                        .changed
                        .wait_timeout(st, left)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            };
        }
    }

    /// Stops listening, closes every connection and joins every thread.
    /// Ranks still connected see their connection close.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop's poll (after the flag, which it checks
        // once awake). A failed write leaves it to its timeout.
        let _ = rustix::io::write(&self.shared.wake, &1u64.to_ne_bytes());
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
        let threads = {
            let mut conns = lock(&self.shared.conns);
            for s in conns.sockets.values() {
                let _ = s.shutdown(Shutdown::Both);
            }
            std::mem::take(&mut conns.threads)
        };
        for t in threads {
            let _ = t.join();
        }
    }
}

impl Drop for BootstrapServer {
    fn drop(&mut self) {
        self.stop();
    }
}

impl std::fmt::Debug for BootstrapServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BootstrapServer")
            .field("addr", &self.addr)
            .field("size", &self.shared.size)
            .field("job", &self.shared.job)
            .finish_non_exhaustive()
    }
}

fn status_of(shared: &Shared, st: &State) -> ServerStatus {
    let mut connected = Vec::new();
    let mut departed = Vec::new();
    for (rank, s) in st.slots.iter().enumerate() {
        match s {
            Slot::Free => {}
            Slot::Live { .. } => connected.push(rank),
            Slot::Gone { clean } => departed.push(Departure {
                rank,
                clean: *clean,
            }),
        }
    }
    ServerStatus {
        size: shared.size,
        connected,
        departed,
        store_bytes: st.used,
    }
}
