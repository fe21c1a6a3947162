//! The bootstrap client a rank opens: one TCP connection, a background reader
//! thread that routes replies to waiting callers and records departure
//! notices, and requests tagged with ids so threads can share the handle.

use std::collections::HashMap;
use std::io::{self, BufReader, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::auth::{self, Claim};
use super::wire::{
    self, Message, MAX_FRAME_LEN, MAX_HANDSHAKE_FRAME_LEN, NONCE_LEN, PROTOCOL_VERSION,
};
use super::{JobEnv, Secret, SERVICE, XDEV_BOOTSTRAP, XDEV_SECRET};
use crate::{Error, Rank, Result};

/// How long [`Bootstrap::connect`](super::Bootstrap::connect) keeps retrying to reach the service (it
/// may not be listening yet when ranks are started by hand) and waits for the
/// handshake.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a write to the service may block before the connection is
/// considered lost.
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// How long dropping a [`Bootstrap`](super::Bootstrap) waits for the service to close the
/// connection after `Goodbye` before closing it outright.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// A rank whose bootstrap connection has closed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Departure {
    /// The rank.
    pub rank: Rank,
    /// Whether it left cleanly (its [`Bootstrap`](super::Bootstrap) was dropped, sending a
    /// goodbye) rather than dying or losing its connection.
    pub clean: bool,
}

/// A rank's connection to the TCP bootstrap service of its job (`xdev-run`).
///
/// All methods take `&self` and the handle is `Send + Sync`, so the threads of
/// a rank (and a device's progress thread) can share it. Point requests
/// (`put`, `get`) from several threads proceed concurrently; collectives
/// (`barrier`, `allgather`) from one rank are serialized and must be called in
/// the same order by every rank.
///
/// Dropping the handle says goodbye to the service, which tells the other
/// ranks that this one left cleanly ([`Departure::clean`]); a process that
/// dies or exits without dropping it is reported as an unclean departure.
pub(crate) struct Tcp {
    rank: Rank,
    size: usize,
    job: String,
    peer: SocketAddr,
    shared: Arc<Shared>,
    writer: Mutex<TcpStream>,
    collective: Mutex<()>,
    next_id: AtomicU32,
    reader: Option<JoinHandle<()>>,
}

struct Shared {
    state: Mutex<State>,
    cond: Condvar,
}

struct State {
    size: usize,
    pending: HashMap<u32, Pending>,
    departures: Vec<Departure>,
    /// Set once the connection is gone; every later request fails with it.
    lost: Option<Error>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Put,
    Get,
    Barrier,
    Allgather,
}

enum Pending {
    Waiting(Kind),
    Gathering {
        parts: Vec<Option<Vec<u8>>>,
        got: usize,
    },
    Done(Result<Reply>),
}

enum Reply {
    Done,
    Value(Vec<u8>),
    Gathered(Vec<Vec<u8>>),
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn service_error(what: impl Into<String>) -> Error {
    Error::Protocol {
        rank: SERVICE,
        what: what.into(),
    }
}

fn timed_out(what: String) -> Error {
    Error::transport(what, io::Error::new(io::ErrorKind::TimedOut, "timed out"))
}

impl Tcp {
    /// Runs `f` on the connection to the service (tests of its options).
    #[cfg(test)]
    pub(crate) fn with_stream_for_tests<R>(&self, f: impl FnOnce(&TcpStream) -> R) -> R {
        f(&self.writer.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Connects to the service at `addr` as `rank` of the `size`-rank job
    /// `job`, proving knowledge of `secret`.
    ///
    /// Connection attempts are retried for up to [`CONNECT_TIMEOUT`] (the
    /// service may start after the ranks). Fails with [`Error::Config`] when
    /// the service refuses the rank (wrong secret, wrong job or size, rank out
    /// of range or already claimed; the message says which), with
    /// [`Error::Protocol`] naming [`SERVICE`](super::SERVICE) when the peer
    /// does not speak the protocol or cannot prove it knows the secret, and
    /// with [`Error::Transport`] when it cannot be reached.
    pub fn connect<A: ToSocketAddrs>(
        addr: A,
        rank: Rank,
        size: usize,
        job: &str,
        secret: &Secret,
    ) -> Result<Tcp> {
        check_rank_and_size(rank, size)?;
        let addrs = resolve(addr)?;
        let deadline = Instant::now() + CONNECT_TIMEOUT;
        let (stream, peer) = connect_any(&addrs, deadline)?;
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(100));
        let setup = |e| setup_failed(peer, e);
        stream.set_nodelay(true).map_err(setup)?;
        super::keepalive::watch_peer(&stream).map_err(setup)?;
        stream.set_read_timeout(Some(left)).map_err(setup)?;
        stream.set_write_timeout(Some(left)).map_err(setup)?;

        handshake(&stream, peer, rank, size, job, secret)?;
        stream.set_read_timeout(None).map_err(setup)?;
        stream
            .set_write_timeout(Some(WRITE_TIMEOUT))
            .map_err(setup)?;

        let (shared, reader) = start_reader(&stream, peer, rank, size)?;
        Ok(Tcp {
            rank,
            size,
            job: job.to_owned(),
            peer,
            shared,
            writer: Mutex::new(stream),
            collective: Mutex::new(()),
            next_id: AtomicU32::new(1),
            reader: Some(reader),
        })
    }

    /// Connects with already parsed variables.
    pub fn from_job_env(env: &JobEnv) -> Result<Tcp> {
        let addr = env.bootstrap.as_deref().ok_or_else(|| {
            Error::Config(format!(
                "{XDEV_BOOTSTRAP} is not set: it must name the bootstrap service as host:port"
            ))
        })?;
        let secret = env.secret.as_ref().ok_or_else(|| {
            Error::Config(format!(
                "{XDEV_SECRET} is not set: it must hold the job secret (64 hex digits)"
            ))
        })?;
        let c = &env.config;
        Self::connect(addr, c.rank, c.size, &c.job, secret)
    }

    /// This rank.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// Number of ranks in the job.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The job identity.
    pub fn job(&self) -> &str {
        &self.job
    }

    /// The service's address.
    pub fn service_addr(&self) -> SocketAddr {
        self.peer
    }

    /// Stores `value` under `key` (replacing an earlier value this rank
    /// put) and returns once the service holds it, so a rank that learns of
    /// it afterwards (for example after a [`barrier`](Self::barrier)) can
    /// `get` it.
    ///
    /// A key belongs to the rank that first put it: a put of a key another
    /// rank put first fails with [`Error::Protocol`] naming this rank, and
    /// the value stays the owner's.
    ///
    /// Keys are at most [`wire::MAX_KEY_LEN`] bytes ([`Error::Config`]),
    /// values at most [`wire::MAX_VALUE_LEN`] bytes, and the store is
    /// bounded ([`Error::ResourceExhausted`]).
    pub fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        let id = self.id();
        let frame = wire::encode(&Message::Put {
            id,
            key: key.to_owned(),
            value: value.to_vec(),
        })?;
        match self.call(id, Kind::Put, &frame, None)? {
            Some(Reply::Done) => Ok(()),
            _ => Err(service_error("unexpected reply to put")),
        }
    }

    /// Fetches the value of `key`, waiting until some rank has put it or
    /// `timeout` has passed; a timeout is an [`Error::Transport`] whose source
    /// has kind [`io::ErrorKind::TimedOut`], and leaves the handle usable.
    pub fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let id = self.id();
        let frame = wire::encode(&Message::Get {
            id,
            key: key.to_owned(),
        })?;
        let deadline = Instant::now().checked_add(timeout);
        match self.call(id, Kind::Get, &frame, deadline)? {
            Some(Reply::Value(v)) => Ok(v),
            Some(_) => Err(service_error("unexpected reply to get")),
            None => {
                // Withdraw the request; a value crossing this on the wire is
                // ignored by the reader (its id is no longer pending).
                if let Ok(cancel) = wire::encode(&Message::Cancel { id }) {
                    let _ = self.send(&cancel);
                }
                Err(timed_out(format!(
                    "bootstrap: get({key:?}) timed out after {timeout:?}: no rank has put it"
                )))
            }
        }
    }

    /// Waits until every rank has entered the barrier. Fails with
    /// [`Error::PeerLost`] if a rank that has not entered it leaves the job.
    pub fn barrier(&self) -> Result<()> {
        let _order = lock(&self.collective);
        let id = self.id();
        let frame = wire::encode(&Message::Barrier { id })?;
        match self.call(id, Kind::Barrier, &frame, None)? {
            Some(Reply::Done) => Ok(()),
            _ => Err(service_error("unexpected reply to barrier")),
        }
    }

    /// Contributes `value` (at most [`wire::MAX_VALUE_LEN`] bytes) and returns
    /// every rank's contribution in rank order. Fails like
    /// [`barrier`](Self::barrier).
    pub fn allgather(&self, value: &[u8]) -> Result<Vec<Vec<u8>>> {
        let _order = lock(&self.collective);
        let id = self.id();
        let frame = wire::encode(&Message::Allgather {
            id,
            value: value.to_vec(),
        })?;
        match self.call(id, Kind::Allgather, &frame, None)? {
            Some(Reply::Gathered(v)) => Ok(v),
            _ => Err(service_error("unexpected reply to allgather")),
        }
    }

    /// The ranks whose bootstrap connection has closed, in the order the
    /// service reported them, saying for each whether it left cleanly.
    pub fn departures(&self) -> Result<Vec<Departure>> {
        let st = lock(&self.shared.state);
        match &st.lost {
            Some(e) => Err(e.clone()),
            None => Ok(st.departures.clone()),
        }
    }

    fn id(&self) -> u32 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn send(&self, frame: &[u8]) -> Result<()> {
        let mut w = lock(&self.writer);
        w.write_all(frame).map_err(|e| {
            // A partial write leaves the stream unusable.
            let _ = w.shutdown(Shutdown::Both);
            Error::transport(format!("bootstrap: writing to {}", self.peer), e)
        })
    }

    /// Sends a request and waits for its reply; `Ok(None)` when `deadline`
    /// passed first (the request is then no longer pending).
    fn call(
        &self,
        id: u32,
        kind: Kind,
        frame: &[u8],
        deadline: Option<Instant>,
    ) -> Result<Option<Reply>> {
        {
            let mut st = lock(&self.shared.state);
            if let Some(e) = &st.lost {
                return Err(e.clone());
            }
            st.pending.insert(id, Pending::Waiting(kind));
        }
        if let Err(e) = self.send(frame) {
            lock(&self.shared.state).pending.remove(&id);
            return Err(e);
        }
        let mut st = lock(&self.shared.state);
        loop {
            if matches!(st.pending.get(&id), Some(Pending::Done(_))) {
                let Some(Pending::Done(r)) = st.pending.remove(&id) else {
                    unreachable!("checked just above");
                };
                return r.map(Some);
            }
            if let Some(e) = &st.lost {
                let e = e.clone();
                st.pending.remove(&id);
                return Err(e);
            }
            st = match deadline {
                None => self.shared.cond.wait(st).unwrap_or_else(|e| e.into_inner()),
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        st.pending.remove(&id);
                        return Ok(None);
                    }
                    self.shared
                        .cond
                        .wait_timeout(st, left)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            };
        }
    }
}

impl Drop for Tcp {
    fn drop(&mut self) {
        if let Ok(bye) = wire::encode(&Message::Goodbye) {
            let _ = self.send(&bye);
        }
        let _ = lock(&self.writer).shutdown(Shutdown::Write);
        // The service answers our end of stream by closing its side, which
        // ends the reader thread; don't wait long for a silent service.
        {
            let deadline = Instant::now() + CLOSE_GRACE;
            let mut st = lock(&self.shared.state);
            while st.lost.is_none() {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                st = self
                    .shared
                    .cond
                    .wait_timeout(st, left)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
        let _ = lock(&self.writer).shutdown(Shutdown::Both);
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

impl std::fmt::Debug for Tcp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tcp")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("job", &self.job)
            .field("service", &self.peer)
            .finish_non_exhaustive()
    }
}

/// Checks a job size and rank before any connection is made.
fn check_rank_and_size(rank: Rank, size: usize) -> Result<()> {
    if size == 0 || size > u32::MAX as usize {
        return Err(Error::Config(format!(
            "bootstrap: job size {size} is outside 1..={}",
            u32::MAX
        )));
    }
    if rank > u32::MAX as usize {
        return Err(Error::InvalidRank { rank, size });
    }
    Ok(())
}

/// The addresses the service's address resolves to (at least one).
fn resolve<A: ToSocketAddrs>(addr: A) -> Result<Vec<SocketAddr>> {
    let addrs: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| Error::transport("bootstrap: resolving the service address", e))?
        .collect();
    if addrs.is_empty() {
        return Err(Error::Config(
            "bootstrap: the service address resolves to nothing".into(),
        ));
    }
    Ok(addrs)
}

/// The error for a failure to configure the connection to `peer`.
fn setup_failed(peer: SocketAddr, e: io::Error) -> Error {
    Error::transport(
        format!("bootstrap: configuring the connection to {peer}"),
        e,
    )
}

/// Runs the client's side of the handshake on `stream`: answers the
/// service's challenge with this rank's claim and checks that the service's
/// `Welcome` proves it knows the secret.
fn handshake(
    stream: &TcpStream,
    peer: SocketAddr,
    rank: Rank,
    size: usize,
    job: &str,
    secret: &Secret,
) -> Result<()> {
    let mut s = stream;
    let server_nonce = read_challenge(&mut s, peer)?;
    let client_nonce = auth::random()?;
    let claim = Claim {
        server_nonce: &server_nonce,
        client_nonce: &client_nonce,
        rank: rank as u32,
        size: size as u32,
        job,
    };
    wire::write_message(
        &mut s,
        &Message::Auth {
            version: PROTOCOL_VERSION,
            rank: rank as u32,
            size: size as u32,
            nonce: client_nonce,
            mac: auth::client_mac(secret, &claim),
            job: job.to_owned(),
        },
    )?;
    read_welcome(&mut s, peer, secret, &claim)
}

/// Reads the service's `Challenge` and returns its nonce.
fn read_challenge(s: &mut &TcpStream, peer: SocketAddr) -> Result<[u8; NONCE_LEN]> {
    match wire::read_message(s, MAX_HANDSHAKE_FRAME_LEN, SERVICE)? {
        Some(Message::Challenge { version, nonce }) if version == PROTOCOL_VERSION => Ok(nonce),
        Some(Message::Challenge { version, .. }) => Err(service_error(format!(
            "the bootstrap service at {peer} speaks protocol version {version}, not {PROTOCOL_VERSION}"
        ))),
        Some(other) => Err(service_error(format!(
            "the bootstrap service at {peer} sent {} instead of a challenge",
            other.name()
        ))),
        None => Err(Error::transport(
            format!("bootstrap: {peer} closed the connection before the handshake"),
            io::Error::from(io::ErrorKind::UnexpectedEof),
        )),
    }
}

/// Reads the service's answer to the claim: a `Welcome` whose MAC proves it
/// knows the secret, or the reason it refused.
fn read_welcome(
    s: &mut &TcpStream,
    peer: SocketAddr,
    secret: &Secret,
    claim: &Claim<'_>,
) -> Result<()> {
    let (rank, job) = (claim.rank, claim.job);
    match wire::read_message(s, MAX_HANDSHAKE_FRAME_LEN, SERVICE)? {
        Some(Message::Welcome { mac }) => {
            if !auth::verify_server(secret, claim, &mac) {
                return Err(service_error(format!(
                    "the bootstrap service at {peer} could not prove it knows the job secret"
                )));
            }
            Ok(())
        }
        Some(Message::Refused { reason }) => Err(Error::Config(format!(
            "bootstrap service at {peer} refused rank {rank} of job {job:?}: {reason}"
        ))),
        Some(other) => Err(service_error(format!(
            "the bootstrap service at {peer} answered the handshake with {}",
            other.name()
        ))),
        None => Err(Error::transport(
            format!("bootstrap: {peer} closed the connection during the handshake"),
            io::Error::from(io::ErrorKind::UnexpectedEof),
        )),
    }
}

/// Starts the thread that reads what the service sends on `stream`, with
/// the state it shares with the handle.
fn start_reader(
    stream: &TcpStream,
    peer: SocketAddr,
    rank: Rank,
    size: usize,
) -> Result<(Arc<Shared>, JoinHandle<()>)> {
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            size,
            pending: HashMap::new(),
            departures: Vec::new(),
            lost: None,
        }),
        cond: Condvar::new(),
    });
    let read_half = stream.try_clone().map_err(|e| setup_failed(peer, e))?;
    let sh = shared.clone();
    let reader = thread::Builder::new()
        .name(format!("xdev-bootstrap-{rank}"))
        .spawn(move || reader_loop(&sh, read_half))
        .map_err(|e| Error::transport("bootstrap: starting the reader thread", e))?;
    Ok((shared, reader))
}

/// Tries every address until one accepts, retrying until `deadline`.
fn connect_any(addrs: &[SocketAddr], deadline: Instant) -> Result<(TcpStream, SocketAddr)> {
    loop {
        let mut last = None;
        for &a in addrs {
            let left = deadline.saturating_duration_since(Instant::now());
            let attempt = left
                .min(Duration::from_secs(2))
                .max(Duration::from_millis(10));
            match TcpStream::connect_timeout(&a, attempt) {
                Ok(s) => return Ok((s, a)),
                Err(e) => last = Some((a, e)),
            }
        }
        if Instant::now() >= deadline {
            let (a, e) = last.expect("at least one address was tried");
            return Err(Error::transport(
                format!(
                    "bootstrap: cannot reach the service at {a} (tried for {CONNECT_TIMEOUT:?})"
                ),
                e,
            ));
        }
        thread::sleep(Duration::from_millis(50));
    }
}

fn reader_loop(shared: &Shared, stream: TcpStream) {
    let mut r = BufReader::new(stream);
    let err = loop {
        match wire::read_message(&mut r, MAX_FRAME_LEN, SERVICE) {
            Ok(Some(msg)) => {
                if let Err(e) = dispatch(shared, msg) {
                    break e;
                }
            }
            Ok(None) => {
                break Error::transport(
                    "bootstrap: the service closed the connection",
                    io::Error::from(io::ErrorKind::ConnectionAborted),
                )
            }
            Err(e) => break e,
        }
    };
    let _ = r.get_ref().shutdown(Shutdown::Both);
    let mut st = lock(&shared.state);
    st.lost.get_or_insert(err);
    drop(st);
    shared.cond.notify_all();
}

/// Routes one message from the service. An error means the service broke the
/// protocol; the connection is then dropped.
fn dispatch(shared: &Shared, msg: Message) -> Result<()> {
    let mut st = lock(&shared.state);
    let (id, result) = match msg {
        Message::Departed { rank, clean } => return st.record_departure(rank, clean),
        Message::Done { id } => (id, Ok(Reply::Done)),
        Message::Value { id, value } => (id, Ok(Reply::Value(value))),
        Message::Failed { id, failure } => (id, Err(failure.into_error())),
        Message::Gathered {
            id,
            index,
            count,
            value,
        } => {
            if st.gather_part(id, index, count, value)? {
                drop(st);
                shared.cond.notify_all();
            }
            return Ok(());
        }
        other => {
            return Err(service_error(format!(
                "the service sent {} after the handshake",
                other.name()
            )))
        }
    };
    let Some(entry) = st.pending.get_mut(&id) else {
        // A reply to a request that timed out (a get) — nobody waits for it.
        return Ok(());
    };
    let fits = match (&*entry, &result) {
        (Pending::Waiting(_), Err(_)) | (Pending::Gathering { .. }, Err(_)) => true,
        (Pending::Waiting(k), Ok(Reply::Done)) => matches!(k, Kind::Put | Kind::Barrier),
        (Pending::Waiting(k), Ok(Reply::Value(_))) => *k == Kind::Get,
        _ => false,
    };
    if !fits {
        return Err(service_error(format!(
            "reply of the wrong kind for request {id}"
        )));
    }
    *entry = Pending::Done(result);
    drop(st);
    shared.cond.notify_all();
    Ok(())
}

impl State {
    /// Records the service's notice that `rank` has left (once per rank).
    fn record_departure(&mut self, rank: u32, clean: bool) -> Result<()> {
        let size = self.size;
        let rank = rank as usize;
        if rank >= size {
            return Err(service_error(format!(
                "departure notice for rank {rank} of a {size}-rank job"
            )));
        }
        if !self.departures.iter().any(|d| d.rank == rank) {
            self.departures.push(Departure { rank, clean });
        }
        Ok(())
    }

    /// Files part `index` of `count` of allgather `id`; returns whether the
    /// allgather is now complete (its caller is then to be woken).
    fn gather_part(&mut self, id: u32, index: u32, count: u32, value: Vec<u8>) -> Result<bool> {
        let size = self.size;
        let (index, count) = (index as usize, count as usize);
        if count != size || index >= count {
            return Err(service_error(format!(
                "allgather part {index} of {count} in a {size}-rank job"
            )));
        }
        let entry = match self.pending.get_mut(&id) {
            None => return Ok(false),
            Some(e) => e,
        };
        if matches!(entry, Pending::Waiting(Kind::Allgather)) {
            *entry = Pending::Gathering {
                parts: vec![None; size],
                got: 0,
            };
        }
        let Pending::Gathering { parts, got } = entry else {
            return Err(service_error(
                "allgather data for a request that is not an allgather",
            ));
        };
        if parts[index].is_some() {
            return Err(service_error(format!("allgather part {index} sent twice")));
        }
        parts[index] = Some(value);
        *got += 1;
        if *got < size {
            return Ok(false);
        }
        let all = std::mem::take(parts).into_iter().flatten().collect();
        *entry = Pending::Done(Ok(Reply::Gathered(all)));
        Ok(true)
    }
}
