//! The bootstrap service: a listener thread plus one thread per connection,
//! blocking I/O, all state under one lock that is never held across socket
//! I/O.

use std::collections::HashMap;
use std::io::{self, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::auth::{self, Claim};
use super::wire::{
    self, Failure, FailureKind, Message, MAX_FRAME_LEN, MAX_HANDSHAKE_FRAME_LEN, PROTOCOL_VERSION,
};
use super::{Departure, Secret, SERVICE};
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

    /// Stores `value` under `key` for `rank`. A key belongs to the rank that
    /// first put it: its owner may replace the value, any other rank's put
    /// is refused with a protocol failure blaming that rank (so no rank can
    /// pose as another through a record the others read).
    fn put(&mut self, limit: usize, rank: Rank, id: u32, key: String, value: Vec<u8>) -> Vec<Out> {
        let mut out = Vec::new();
        if let Some(&(owner, _)) = self.store.get(&key).filter(|(owner, _)| *owner != rank) {
            let text = format!(
                "rank {rank} put key {key:?}, which rank {owner} put first: a key belongs to the rank that first put it"
            );
            self.refuse(&mut out, rank, id, FailureKind::Protocol, rank, text);
            return out;
        }
        let old = self.store.get(&key).map_or(0, |(_, v)| key.len() + v.len());
        let add = key.len() + value.len();
        if self.used - old + add > limit {
            let text = format!(
                "bootstrap store full: {} of {limit} bytes in use, a {add}-byte entry does not fit",
                self.used
            );
            self.refuse(
                &mut out,
                rank,
                id,
                FailureKind::ResourceExhausted,
                rank,
                text,
            );
            return out;
        }
        self.used = self.used - old + add;
        let value: Arc<[u8]> = value.into();
        for (r, wid) in self.waiters.remove(&key).unwrap_or_default() {
            self.waiting.remove(&(r, wid));
            self.waiting_per_rank[r] -= 1;
            let head = wire::value_head(wid, value.len()).expect("stored values are within limits");
            self.reply(&mut out, r, head, Some(value.clone()));
        }
        self.store.insert(key, (rank, value));
        self.reply(&mut out, rank, frame(&Message::Done { id }), None);
        out
    }

    fn get(&mut self, max_waiting: usize, rank: Rank, id: u32, key: String) -> Vec<Out> {
        let mut out = Vec::new();
        if let Some((_, v)) = self.store.get(&key) {
            let head = wire::value_head(id, v.len()).expect("stored values are within limits");
            let v = v.clone();
            self.reply(&mut out, rank, head, Some(v));
        } else if self.waiting.contains_key(&(rank, id)) {
            let text = format!("request id {id} is already waiting");
            self.refuse(&mut out, rank, id, FailureKind::Protocol, rank, text);
        } else if self.waiting_per_rank[rank] >= max_waiting {
            let text = format!("rank {rank} already has {max_waiting} gets waiting");
            self.refuse(
                &mut out,
                rank,
                id,
                FailureKind::ResourceExhausted,
                rank,
                text,
            );
        } else {
            self.waiters
                .entry(key.clone())
                .or_default()
                .push((rank, id));
            self.waiting.insert((rank, id), key);
            self.waiting_per_rank[rank] += 1;
        }
        out
    }

    fn cancel(&mut self, rank: Rank, id: u32) {
        if let Some(key) = self.waiting.remove(&(rank, id)) {
            self.waiting_per_rank[rank] -= 1;
            if let Some(list) = self.waiters.get_mut(&key) {
                list.retain(|&w| w != (rank, id));
                if list.is_empty() {
                    self.waiters.remove(&key);
                }
            }
        }
    }

    /// Fails every contribution of the collective in progress and resets it.
    fn fail_collective(&mut self, out: &mut Vec<Out>, kind: FailureKind, rank: Rank, text: &str) {
        let parts = std::mem::take(&mut self.coll.parts);
        self.coll.parts = vec![None; parts.len()];
        self.used -= self.coll.bytes;
        self.coll.bytes = 0;
        self.coll.count = 0;
        self.coll.kind = None;
        for (r, part) in parts.into_iter().enumerate() {
            if let Some((id, _)) = part {
                self.refuse(out, r, id, kind, rank, text.to_owned());
            }
        }
    }

    fn arrive(
        &mut self,
        limit: usize,
        rank: Rank,
        id: u32,
        kind: CollKind,
        data: Vec<u8>,
    ) -> Vec<Out> {
        let mut out = Vec::new();
        let size = self.slots.len();
        let gone = (0..size)
            .find(|&d| matches!(self.slots[d], Slot::Gone { .. }) && self.coll.parts[d].is_none());
        if let Some(d) = gone {
            let text = format!(
                "rank {d} has left the job, so the {} cannot complete",
                kind.name()
            );
            self.fail_collective(&mut out, FailureKind::PeerLost, d, &text);
            self.refuse(&mut out, rank, id, FailureKind::PeerLost, d, text);
            return out;
        }
        if self.coll.parts[rank].is_some() {
            let text = format!("rank {rank} entered a collective it is already in (request {id})");
            self.refuse(&mut out, rank, id, FailureKind::Protocol, rank, text);
            return out;
        }
        if let Some(current) = self.coll.kind.filter(|&k| k != kind) {
            let text = format!(
                "rank {rank} called {} while other ranks are in {}",
                kind.name(),
                current.name()
            );
            self.fail_collective(&mut out, FailureKind::Protocol, rank, &text);
            self.refuse(&mut out, rank, id, FailureKind::Protocol, rank, text);
            return out;
        }
        if self.used + data.len() > limit {
            let text = format!(
                "bootstrap store full: {} of {limit} bytes in use, a {}-byte contribution does not fit",
                self.used,
                data.len()
            );
            self.refuse(
                &mut out,
                rank,
                id,
                FailureKind::ResourceExhausted,
                rank,
                text,
            );
            return out;
        }
        self.used += data.len();
        self.coll.bytes += data.len();
        self.coll.kind = Some(kind);
        self.coll.parts[rank] = Some((id, data.into()));
        self.coll.count += 1;
        if self.coll.count < size {
            return out;
        }
        // Complete: every rank contributed.
        let parts: Vec<(u32, Arc<[u8]>)> = std::mem::take(&mut self.coll.parts)
            .into_iter()
            .map(|p| p.expect("every rank contributed"))
            .collect();
        self.coll.parts = vec![None; size];
        self.used -= self.coll.bytes;
        self.coll.bytes = 0;
        self.coll.count = 0;
        self.coll.kind = None;
        for (r, (rid, _)) in parts.iter().enumerate() {
            match kind {
                CollKind::Barrier => {
                    self.reply(&mut out, r, frame(&Message::Done { id: *rid }), None);
                }
                CollKind::Allgather => {
                    for (i, (_, v)) in parts.iter().enumerate() {
                        let head = wire::gathered_head(*rid, i as u32, size as u32, v.len())
                            .expect("contributions are within limits");
                        self.reply(&mut out, r, head, Some(v.clone()));
                    }
                }
            }
        }
        out
    }

    fn depart(&mut self, rank: Rank) -> (Departure, Vec<Out>) {
        let mut out = Vec::new();
        let clean = matches!(self.slots[rank], Slot::Live { goodbye: true, .. });
        self.slots[rank] = Slot::Gone { clean };
        let ids: Vec<u32> = self
            .waiting
            .keys()
            .filter(|(r, _)| *r == rank)
            .map(|&(_, id)| id)
            .collect();
        for id in ids {
            self.cancel(rank, id);
        }
        if self.coll.count > 0 && self.coll.parts[rank].is_none() {
            let kind = self.coll.kind.map_or("collective", CollKind::name);
            let text = format!("rank {rank} left the job before entering the {kind}");
            self.fail_collective(&mut out, FailureKind::PeerLost, rank, &text);
        }
        let notice = frame(&Message::Departed {
            rank: rank as u32,
            clean,
        });
        for r in 0..self.slots.len() {
            if r != rank {
                self.reply(&mut out, r, notice.clone(), None);
            }
        }
        (Departure { rank, clean }, out)
    }
}

fn send_all(out: Vec<Out>) {
    for o in out {
        o.to.send(&o.head, o.payload.as_deref());
    }
}

/// Reads from a stream with an overall deadline (not just a per-read
/// timeout), so a client trickling bytes cannot hold a handshake slot.
struct DeadlineReader<'a> {
    stream: &'a TcpStream,
    deadline: Instant,
}

impl Read for DeadlineReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "bootstrap handshake deadline passed",
            ));
        }
        self.stream.set_read_timeout(Some(left))?;
        let mut s = self.stream;
        s.read(buf)
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
        let shared = Arc::new(Shared {
            size,
            job: job.to_owned(),
            secret,
            opts,
            stop: AtomicBool::new(false),
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

fn accept_loop(shared: &Arc<Shared>, listener: &TcpListener) {
    let idle = Duration::from_millis(5);
    let max = shared.opts.max_pending_handshakes;
    while !shared.stop.load(Ordering::SeqCst) {
        let threads = shared.handshakes.load(Ordering::SeqCst);
        let room = {
            let p = lock(&shared.pending);
            p.len() < max || p.values().any(|c| !c.heard.load(Ordering::SeqCst))
        };
        if threads >= max.saturating_mul(2) || !room {
            thread::sleep(idle);
            continue;
        }
        let (stream, peer) = match listener.accept() {
            Ok(a) => a,
            Err(_) => {
                // WouldBlock (nothing to accept) or a transient failure such
                // as running out of descriptors: wait and retry.
                thread::sleep(idle);
                continue;
            }
        };
        // Another user's connection from this host: closed at once.
        let local = stream.local_addr().ok();
        if !local.is_some_and(|l| peer_allowed(l, peer)) {
            continue;
        }
        let Ok((registered, slot)) = stream
            .set_nonblocking(false)
            .and_then(|()| super::keepalive::watch_peer(&stream))
            .and_then(|()| Ok((stream.try_clone()?, stream.try_clone()?)))
        else {
            continue;
        };
        let heard = Arc::new(AtomicBool::new(false));
        let id = {
            let mut conns = lock(&shared.conns);
            conns.next_id += 1;
            conns.next_id - 1
        };
        // Not under the connections' lock: this may wait for a slot.
        if !take_slot(
            shared,
            id,
            Pending {
                stream: slot,
                source: canonical(peer.ip()),
                since: Instant::now(),
                heard: heard.clone(),
            },
        ) {
            break;
        }
        let mut conns = lock(&shared.conns);
        if shared.stop.load(Ordering::SeqCst) {
            lock(&shared.pending).remove(&id);
            break;
        }
        conns.sockets.insert(id, registered);
        shared.handshakes.fetch_add(1, Ordering::SeqCst);
        let sh = shared.clone();
        match thread::Builder::new()
            .name("xdev-bootstrap-conn".into())
            .spawn(move || run_connection(&sh, id, stream, &heard))
        {
            Ok(h) => {
                conns.threads.retain(|t| !t.is_finished());
                conns.threads.push(h);
            }
            Err(_) => {
                shared.handshakes.fetch_sub(1, Ordering::SeqCst);
                lock(&shared.pending).remove(&id);
                conns.sockets.remove(&id);
            }
        }
    }
}

/// Registers connection `id` as holding a handshake slot, evicting a
/// silent one when all are taken (see
/// [`ServerOptions::max_pending_handshakes`]); waits while no slot can be
/// had. Returns false if the service stops meanwhile.
fn take_slot(shared: &Shared, id: u64, conn: Pending) -> bool {
    let max = shared.opts.max_pending_handshakes;
    loop {
        {
            let mut p = lock(&shared.pending);
            if p.len() >= max {
                if let Some(victim) = eviction_victim(&p) {
                    if let Some(v) = p.remove(&victim) {
                        let _ = v.stream.shutdown(Shutdown::Both);
                    }
                }
            }
            if p.len() < max {
                p.insert(id, conn);
                return true;
            }
        }
        if shared.stop.load(Ordering::SeqCst) {
            return false;
        }
        thread::sleep(Duration::from_millis(5));
    }
}

/// The handshake to evict for a new connection: one that has not sent its
/// `Auth`, of the source address holding the most slots (so one peer
/// cannot push out the others), the oldest of those.
fn eviction_victim(pending: &HashMap<u64, Pending>) -> Option<u64> {
    let mut per_source: HashMap<std::net::IpAddr, usize> = HashMap::new();
    for c in pending.values() {
        *per_source.entry(c.source).or_default() += 1;
    }
    pending
        .iter()
        .filter(|(_, c)| !c.heard.load(Ordering::SeqCst))
        .max_by_key(|(_, c)| (per_source[&c.source], std::cmp::Reverse(c.since)))
        .map(|(&id, _)| id)
}

/// An IPv4-mapped IPv6 address as IPv4; others unchanged.
fn canonical(ip: std::net::IpAddr) -> std::net::IpAddr {
    match ip {
        std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, std::net::IpAddr::V4),
        v4 => v4,
    }
}

/// Whether a connection from `peer` to this service's `local` end may take
/// a handshake slot: not if its socket is on this host and owned by another
/// user (or, for a loopback peer, cannot be found at all).
fn peer_allowed(local: SocketAddr, peer: SocketAddr) -> bool {
    match local_owner(local, peer) {
        Owner::Uid(uid) => {
            // SAFETY: geteuid has no preconditions.
            uid == unsafe { libc::geteuid() }
        }
        Owner::NotLocal => !canonical(peer.ip()).is_loopback(),
        Owner::Unknown => true,
    }
}

/// Who owns the socket at the other end of a connection.
#[derive(Debug, PartialEq, Eq)]
enum Owner {
    /// A socket of this host owned by this uid.
    Uid(u32),
    /// No socket of this host (network namespace) is that end.
    NotLocal,
    /// The socket tables cannot be read.
    Unknown,
}

/// Looks the socket whose local end is `peer` and whose remote end is
/// `local` up in `/proc/net/tcp` and `/proc/net/tcp6`.
fn local_owner(local: SocketAddr, peer: SocketAddr) -> Owner {
    let mut readable = false;
    for (file, v6) in [("/proc/net/tcp", false), ("/proc/net/tcp6", true)] {
        let (Some(want_local), Some(want_remote)) =
            (proc_net_addr(peer, v6), proc_net_addr(local, v6))
        else {
            continue;
        };
        let Ok(table) = std::fs::read_to_string(file) else {
            continue;
        };
        readable = true;
        if let Some(uid) = find_owner(&table, &want_local, &want_remote) {
            return Owner::Uid(uid);
        }
    }
    if readable {
        Owner::NotLocal
    } else {
        Owner::Unknown
    }
}

/// The uid of the socket with local end `local` and remote end `remote`
/// (as [`proc_net_addr`] writes them) in a `/proc/net/tcp*` table, leaving
/// out TIME_WAIT entries (which have no owner).
fn find_owner(table: &str, local: &str, remote: &str) -> Option<u32> {
    table.lines().skip(1).find_map(|line| {
        let f: Vec<&str> = line.split_ascii_whitespace().collect();
        if f.len() < 8 || f[3] == "06" {
            return None;
        }
        (f[1].eq_ignore_ascii_case(local) && f[2].eq_ignore_ascii_case(remote))
            .then(|| f[7].parse().ok())
            .flatten()
    })
}

/// `addr` as `/proc/net/tcp` (`v6` false) or `tcp6` writes it: each 32-bit
/// word of the address in hex as the host reads it, a colon, the port in 4
/// hex digits. `None` if the address has no form in that table.
fn proc_net_addr(addr: SocketAddr, v6: bool) -> Option<String> {
    let words: Vec<[u8; 4]> = match (canonical(addr.ip()), v6) {
        (std::net::IpAddr::V4(ip), false) => vec![ip.octets()],
        (std::net::IpAddr::V4(ip), true) => chunks(ip.to_ipv6_mapped().octets()),
        (std::net::IpAddr::V6(ip), true) => chunks(ip.octets()),
        (std::net::IpAddr::V6(_), false) => return None,
    };
    let mut s: String = words
        .iter()
        .map(|w| format!("{:08X}", u32::from_ne_bytes(*w)))
        .collect();
    s.push_str(&format!(":{:04X}", addr.port()));
    Some(s)
}

fn chunks(b: [u8; 16]) -> Vec<[u8; 4]> {
    b.chunks_exact(4)
        .map(|c| [c[0], c[1], c[2], c[3]])
        .collect()
}

fn run_connection(shared: &Arc<Shared>, id: u64, stream: TcpStream, heard: &AtomicBool) {
    let accepted = handshake(shared, &stream, heard);
    lock(&shared.pending).remove(&id);
    shared.handshakes.fetch_sub(1, Ordering::SeqCst);
    if let Some((rank, conn)) = accepted {
        serve(shared, rank, &conn, &stream);
    }
    let _ = stream.shutdown(Shutdown::Both);
    lock(&shared.conns).sockets.remove(&id);
}

fn refuse(mut stream: &TcpStream, reason: &str) {
    let _ = wire::write_message(
        &mut stream,
        &Message::Refused {
            reason: reason.to_owned(),
        },
    );
}

/// Runs the handshake; on success the rank is registered as live and has been
/// sent `Welcome` and the departures so far.
fn handshake(shared: &Shared, stream: &TcpStream, heard: &AtomicBool) -> Option<(Rank, Arc<Conn>)> {
    let opts = &shared.opts;
    let deadline = Instant::now() + opts.handshake_timeout;
    stream.set_nodelay(true).ok()?;
    stream
        .set_write_timeout(Some(opts.handshake_timeout))
        .ok()?;
    let server_nonce = auth::random().ok()?;
    let mut w = stream;
    wire::write_message(
        &mut w,
        &Message::Challenge {
            version: PROTOCOL_VERSION,
            nonce: server_nonce,
        },
    )
    .ok()?;
    let mut r = DeadlineReader { stream, deadline };
    let (version, rank, size, client_nonce, mac, job) =
        match wire::read_message(&mut r, MAX_HANDSHAKE_FRAME_LEN, SERVICE) {
            Ok(Some(Message::Auth {
                version,
                rank,
                size,
                nonce,
                mac,
                job,
            })) => {
                heard.store(true, Ordering::SeqCst);
                (version, rank, size, nonce, mac, job)
            }
            Ok(Some(other)) => {
                refuse(stream, &format!("expected Auth, got {}", other.name()));
                return None;
            }
            Ok(None) => return None,
            Err(e) => {
                refuse(stream, &e.to_string());
                return None;
            }
        };
    if version != PROTOCOL_VERSION {
        refuse(
            stream,
            &format!("protocol version {version} is not supported (this service speaks {PROTOCOL_VERSION})"),
        );
        return None;
    }
    let claim = Claim {
        server_nonce: &server_nonce,
        client_nonce: &client_nonce,
        rank,
        size,
        job: &job,
    };
    if !auth::verify_client(&shared.secret, &claim, &mac) {
        refuse(stream, "authentication failed: wrong job secret");
        return None;
    }
    if job != shared.job {
        refuse(
            stream,
            &format!(
                "wrong job: this service serves job {:?}, not {job:?}",
                shared.job
            ),
        );
        return None;
    }
    if size as usize != shared.size {
        refuse(
            stream,
            &format!(
                "wrong job size: the job has {} ranks, not {size}",
                shared.size
            ),
        );
        return None;
    }
    let rank = rank as usize;
    if rank >= shared.size {
        refuse(
            stream,
            &format!(
                "rank {rank} is out of range: the job has ranks 0..{}",
                shared.size
            ),
        );
        return None;
    }
    stream.set_read_timeout(None).ok()?;
    stream.set_write_timeout(Some(opts.write_timeout)).ok()?;
    let conn = Arc::new(Conn {
        writer: Mutex::new(stream.try_clone().ok()?),
    });
    // Hold the writer while registering so that no notice sent by another
    // thread can overtake the Welcome.
    let mut writer = lock(&conn.writer);
    let departed: Vec<Departure> = {
        let mut st = lock(&shared.state);
        if !matches!(st.slots[rank], Slot::Free) {
            drop(st);
            refuse(
                stream,
                &format!("rank {rank} is already claimed in this job"),
            );
            return None;
        }
        st.slots[rank] = Slot::Live {
            conn: conn.clone(),
            goodbye: false,
        };
        status_of(shared, &st).departed
    };
    shared.changed.notify_all();
    let welcome = Message::Welcome {
        mac: auth::server_mac(&shared.secret, &claim),
    };
    // A failed write shows up as a closed connection in `serve`.
    let _ = wire::write_message(&mut *writer, &welcome);
    for d in departed {
        let _ = wire::write_message(
            &mut *writer,
            &Message::Departed {
                rank: d.rank as u32,
                clean: d.clean,
            },
        );
    }
    drop(writer);
    Some((rank, conn))
}

/// Serves an authenticated rank until its connection closes or misbehaves,
/// then records its departure and tells the others.
fn serve(shared: &Shared, rank: Rank, conn: &Arc<Conn>, stream: &TcpStream) {
    let limit = shared.opts.max_store_bytes;
    let mut reader = BufReader::new(stream);
    loop {
        let msg = match wire::read_message(&mut reader, MAX_FRAME_LEN, rank) {
            Ok(Some(m)) => m,
            // End of stream, I/O failure or a malformed frame: the
            // connection is closed either way.
            Ok(None) | Err(_) => break,
        };
        let out = {
            let mut st = lock(&shared.state);
            match msg {
                Message::Put { id, key, value } => st.put(limit, rank, id, key, value),
                Message::Get { id, key } => st.get(shared.opts.max_waiting_gets, rank, id, key),
                Message::Cancel { id } => {
                    st.cancel(rank, id);
                    Vec::new()
                }
                Message::Barrier { id } => {
                    st.arrive(limit, rank, id, CollKind::Barrier, Vec::new())
                }
                Message::Allgather { id, value } => {
                    st.arrive(limit, rank, id, CollKind::Allgather, value)
                }
                Message::Goodbye => {
                    st.slots[rank] = Slot::Live {
                        conn: conn.clone(),
                        goodbye: true,
                    };
                    Vec::new()
                }
                // A service-to-client message from a client: a protocol
                // violation, which closes the connection.
                _ => break,
            }
        };
        send_all(out);
    }
    let _ = stream.shutdown(Shutdown::Both);
    let out = {
        let mut st = lock(&shared.state);
        st.depart(rank).1
    };
    shared.changed.notify_all();
    send_all(out);
}

#[cfg(test)]
mod tests;
