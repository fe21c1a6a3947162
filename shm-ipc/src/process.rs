//! The process device (`shm`): ranks are processes on one host, talking
//! through job-private shared memory.
//!
//! Set-up goes through the [bootstrap](xdev::bootstrap): every rank creates
//! its [inbox segment](crate::segment) (one ring per sender, its doorbell,
//! its state word and the eager credit it returns), publishes the name, its
//! pid and a probe address with an allgather, maps every peer's inbox, starts
//! a [`PeerWatch`] on the peers' pids, and after a barrier unlinks its own
//! segment. Then:
//!
//! * **Eager** (payload up to `eager_limit`): the payload is written into the
//!   receiver's ring by the sender and copied out by the receiver. Up to 24
//!   bytes it is one cache line. Synchronous eager sends are acknowledged
//!   (`ACK`) when matched.
//! * **Rendezvous** (larger, or when eager credit runs out): the ring carries a
//!   `RendezvousStart` (the sender's buffer address and length). Once matched,
//!   the receiver copies straight from the sender's memory with
//!   `process_vm_readv` (CMA, one copy) and answers `FIN`, which completes the
//!   send. Where ptrace rules forbid CMA, or where CMA is slower than copying
//!   (see [`CmaMode::Auto`]), the receiver answers `PULL` instead and the
//!   sender streams the data through the same ring in fragments of
//!   `fragment_bytes` (a pipelined copy: several fragments are in flight while
//!   the receiver copies earlier ones out, each core doing one copy). The
//!   choice is made at run time: a probe and a calibration at start-up
//!   ([`ProcessDevice::rendezvous`]), and any later `EPERM` from a peer
//!   switches that peer to the pipelined path.
//! * **Order** holds across both paths because every message of a pair, eager
//!   or rendezvous, goes through the pair's one ring and is matched in ring
//!   order; replies (`ACK`, `FIN`, `PULL`) and fragments are not matched.
//! * **Flow control**: a full ring never drops or overwrites. Sends wait in a
//!   per-destination backlog (their buffers stay owned by their requests),
//!   replies in a per-destination control queue, fragments in the stream
//!   queue. Unexpected eager data is bounded per sender by `credit_bytes`
//!   (enforced by the sender, checked by the receiver).
//! * **Dead peers**: the [`PeerWatch`] thread notices a peer's exit at once
//!   (pidfd), a peer that finishes marks its state word; either way every
//!   rank's waits are woken, requests involving the peer fail with
//!   [`Error::PeerLost`], new operations to it fail at once, and what it sent
//!   before is still delivered.
//! * **Hostile peers**: everything read from shared memory is validated
//!   (ring headers, reply ids, fragment offsets, credit counters, segment
//!   headers); a violation fails that peer with [`Error::Protocol`] and its
//!   ring is not read again. Rendezvous addresses are only ever used in
//!   `process_vm_readv` on the sender's address space, checked by the kernel.
//!
//! Waits spin briefly, then sleep on the rank's [`Doorbell`](crate::Doorbell)
//! (a futex in its inbox); publishers wake it only when a sleeper is armed.

use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
#[cfg(test)]
use std::sync::atomic::AtomicU64;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use xdev::bootstrap::Bootstrap;
use xdev::matching::{MatchingEngine, Posted, PostedId};
use xdev::registry::{Entry, Placement};
use xdev::{
    check_recv, check_send, Buffer, Config, Context, Device, Envelope, Error, Pattern, Peeked,
    Progress, Rank, Registry, Request, RequestCore, RequestKind, Result, Source, Status, Tag,
    TagSel, Tracker,
};

use crate::doorbell::Backoff;
use crate::futex::Scope;
use crate::liveness::PeerWatch;
use crate::lock::{RankGuard, RankLock};
use crate::ring::{Consumer, Header, Incoming, Producer, INLINE};
use crate::segment::{self, state, Inbox, InboxLayout};
use xdev::target::{
    cancelled, lost, unpost, BlockingRecv, BlockingSend, Pending, SendOwner, Target,
};

const KIND_EAGER: u8 = 1;
const KIND_RNDV: u8 = 2;
const KIND_ACK: u8 = 3;
const KIND_FIN: u8 = 4;
const KIND_PULL: u8 = 5;
const KIND_DATA: u8 = 6;
/// Receiver to sender: write the tail of your rendezvous data into my
/// buffer (cookie: the send; aux: where; context: where the tail starts, in
/// pages), while I read the head (a split CMA copy).
const KIND_WRITE: u8 = 7;
/// Sender to receiver: the tail is written (or, with `FLAG_FAILED`, was
/// not: read it yourself).
const KIND_WROTE: u8 = 8;
/// The unit of a split point.
const SPLIT_PAGE: usize = 4096;
const FLAG_SYNC: u8 = 1;
/// On `FIN`: the receiver could not read the data (the send fails).
const FLAG_FAILED: u8 = 2;

/// Bytes charged against eager credit per message besides its payload.
const ENTRY_CHARGE: u64 = 64;

/// How rendezvous data moves.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum CmaMode {
    /// Use `process_vm_readv` where the kernel allows it and it is fast
    /// enough here: at start-up the device times a 1 MiB CMA copy against a
    /// 1 MiB `memcpy` ([`crate::cma::calibrate`]) and uses CMA only if it
    /// reaches [`CMA_MIN_SPEED`] of the copy's speed. (The pipelined copy
    /// through the segment runs both cores at about `memcpy` speed; under
    /// virtualization CMA's page pinning can make it several times slower:
    /// on the 2-core test VM CMA reached about 0.2 of `memcpy` and the
    /// pipelined path was 2.3 times faster at 4 MiB.) Default.
    Auto,
    /// Use CMA whenever the kernel allows it (one copy, the sender's core
    /// stays free, the sender need not make progress).
    On,
    /// Never use CMA: always the pipelined copy through the segment.
    Off,
}

/// With `cma=auto`, CMA is used only if its measured speed is at least this
/// fraction of `memcpy`'s.
pub const CMA_MIN_SPEED: f64 = 0.5;

impl std::str::FromStr for CmaMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(CmaMode::Auto),
            "on" => Ok(CmaMode::On),
            "off" => Ok(CmaMode::Off),
            _ => Err(format!("cma must be auto, on or off, not {s:?}")),
        }
    }
}

/// The rendezvous path found at start-up (see [`ProcessDevice::rendezvous`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RendezvousPath {
    /// One copy with `process_vm_readv`.
    Cma,
    /// Fragments through the ring (two copies, pipelined), and why.
    Pipelined(String),
}

/// Tunables of the process device. Every field can be set through
/// [`Config::options`] under the same name; all ranks must agree on
/// `ring_bytes` and `credit_bytes`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessOptions {
    /// Largest payload sent eagerly (default 16 KiB, capped by the ring).
    ///
    /// Chosen by `xdev-bench --device shm --test latency --option
    /// eager_limit=N` for N = 4, 8, 16 and 32 KiB on the 2-core test machine
    /// (rendezvous by the pipelined copy, the default path there): eager
    /// beats rendezvous at 8 KiB (0.44 vs 0.82 us) and at 16 KiB (0.67 vs
    /// 1.10 us); 32 KiB cannot be eager with the default 64 KiB rings (one
    /// message carries at most 32,728 bytes), and raising the limit to that
    /// changed nothing measurable at 16 KiB.
    pub eager_limit: usize,
    /// Bytes per pair ring (default as the thread device: 64 KiB up to 22
    /// ranks, then 32 MiB / n², at least 8 KiB). Each rank's inbox holds
    /// `size` rings.
    pub ring_bytes: usize,
    /// Eager bytes (plus 64 per message) a sender may have unreceived at one
    /// receiver before it switches to rendezvous (default 4 × `ring_bytes`).
    pub credit_bytes: usize,
    /// CMA use (default `auto`).
    pub cma: CmaMode,
    /// Fragment size of the pipelined rendezvous (default a quarter of the
    /// ring, so that several fragments are in flight).
    pub fragment_bytes: usize,
    /// Rendezvous sends a rank has started towards one destination and not
    /// yet seen finished (default 65,536; a held header costs the receiver
    /// about 100 bytes). More wait in the sender's queue to that
    /// destination, in order, and later sends to it (of any context) wait
    /// behind them. A receiver so holds at most this many of one sender's
    /// rendezvous headers, matched or not; a sender that exceeds it breaks
    /// the protocol (`Error::Protocol`), which bounds what a hostile peer
    /// can make a receiver keep.
    pub rndv_window: usize,
    /// CMA copies of at least this many bytes are split with the sender
    /// (default 64 KiB; 0: never): the receiver reads the first half while
    /// the sender writes the second half into the receiver's buffer
    /// (`process_vm_writev`), so both cores copy. A one-way stream then
    /// runs at about two copies' speed instead of one. Not done while the
    /// receiver has rendezvous sends of its own out to that sender (a
    /// two-way exchange, where both cores already copy). Measured here at
    /// 32, 64 and 128 KiB: the split wins one-way from 32 KiB (latency 5.0
    /// vs 7.3 us, bw 11.4 vs 7.3 GB/s at 32 KiB).
    pub cma_split_bytes: usize,
}

impl ProcessOptions {
    /// Defaults for a world of `size` ranks.
    pub fn for_size(size: usize) -> Self {
        let t = crate::ThreadOptions::for_size(size);
        ProcessOptions {
            eager_limit: 16 << 10,
            ring_bytes: t.ring_bytes,
            credit_bytes: t.credit_bytes,
            cma: CmaMode::Auto,
            fragment_bytes: t.ring_bytes / 4,
            rndv_window: 65_536,
            cma_split_bytes: 64 << 10,
        }
    }

    /// Defaults for `config.size`, overridden by its options.
    pub fn from_config(config: &Config) -> Result<Self> {
        let d = Self::for_size(config.size);
        let ring_bytes: usize = config.option("ring_bytes", d.ring_bytes)?;
        if !(4096..=(1 << 30)).contains(&ring_bytes) {
            return Err(Error::Config(
                "ring_bytes must be between 4 KiB and 1 GiB".into(),
            ));
        }
        let cma = match config.options.get("cma") {
            None => d.cma,
            Some(v) => v.parse().map_err(Error::Config)?,
        };
        let o = ProcessOptions {
            eager_limit: config.option("eager_limit", d.eager_limit)?,
            ring_bytes,
            credit_bytes: config.option("credit_bytes", 4 * ring_bytes)?,
            cma,
            fragment_bytes: config.option("fragment_bytes", ring_bytes / 4)?,
            rndv_window: config.option("rndv_window", d.rndv_window)?,
            cma_split_bytes: config.option("cma_split_bytes", d.cma_split_bytes)?,
        };
        if o.rndv_window == 0 {
            return Err(Error::Config("rndv_window must be at least 1".into()));
        }
        if o.fragment_bytes < INLINE {
            return Err(Error::Config(format!(
                "fragment_bytes must be at least {INLINE}"
            )));
        }
        Ok(o)
    }

    fn nslots(&self) -> usize {
        (self.ring_bytes / crate::ring::SLOT).next_power_of_two()
    }
}

/// What each rank publishes through the bootstrap at start-up.
///
/// Encoded as `XSP1`, then little-endian pid (u32), slots per ring (u32),
/// credit bytes (u64), probe address (u64), probe value (u64), name length
/// (u16) and the inbox reference. [`PeerInfo::decode`] accepts exactly that and
/// nothing else.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerInfo {
    /// The rank's process id.
    pub pid: u32,
    /// Slots per ring.
    pub nslots: u32,
    /// Eager credit per pair.
    pub credit_bytes: u64,
    /// Address of an 8-byte probe value (CMA check).
    pub probe_addr: u64,
    /// The probe value.
    pub probe_value: u64,
    /// Where to fetch the inbox's descriptor: an abstract Unix socket name
    /// (see [`crate::segment::valid_ref`]).
    pub segment: String,
}

const INFO_MAGIC: &[u8; 4] = b"XSP1";
const INFO_FIXED: usize = 4 + 4 + 4 + 8 + 8 + 8 + 2;

impl PeerInfo {
    /// The wire form.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(INFO_FIXED + self.segment.len());
        v.extend_from_slice(INFO_MAGIC);
        v.extend_from_slice(&self.pid.to_le_bytes());
        v.extend_from_slice(&self.nslots.to_le_bytes());
        v.extend_from_slice(&self.credit_bytes.to_le_bytes());
        v.extend_from_slice(&self.probe_addr.to_le_bytes());
        v.extend_from_slice(&self.probe_value.to_le_bytes());
        v.extend_from_slice(&(self.segment.len() as u16).to_le_bytes());
        v.extend_from_slice(self.segment.as_bytes());
        v
    }

    /// Parses the wire form; rejects anything malformed (wrong magic or
    /// length, an inbox reference that is not well formed).
    pub fn decode(b: &[u8]) -> std::result::Result<PeerInfo, String> {
        if b.len() < INFO_FIXED || &b[..4] != INFO_MAGIC {
            return Err(format!("bad peer record ({} bytes)", b.len()));
        }
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        let name_len = u16::from_le_bytes([b[36], b[37]]) as usize;
        if b.len() != INFO_FIXED + name_len {
            return Err(format!(
                "peer record is {} bytes, its name length says {}",
                b.len(),
                INFO_FIXED + name_len
            ));
        }
        let segment = std::str::from_utf8(&b[INFO_FIXED..])
            .map_err(|_| "inbox reference is not UTF-8".to_string())?
            .to_string();
        if !segment::valid_ref(&segment) {
            return Err(format!("invalid inbox reference {segment:?}"));
        }
        let nslots = u32_at(8);
        if !nslots.is_power_of_two() || nslots < 4 {
            return Err(format!("invalid ring size {nslots}"));
        }
        if u32_at(4) == 0 {
            return Err("pid 0".into());
        }
        Ok(PeerInfo {
            pid: u32_at(4),
            nslots,
            credit_bytes: u64_at(12),
            probe_addr: u64_at(20),
            probe_value: u64_at(28),
            segment,
        })
    }
}

/// Everything fixed after start-up, shared by the engine and the watch thread.
struct Shared {
    rank: Rank,
    size: usize,
    opts: ProcessOptions,
    eager_max: usize,
    fragment: usize,
    mine: Inbox,
    /// Every rank's inbox (`None` at our own index: use `mine`).
    peers: Vec<Option<Inbox>>,
    pids: Vec<u32>,
    /// Set by the watch thread when a peer's process has exited.
    exited: Box<[AtomicBool]>,
}

impl Shared {
    fn inbox(&self, r: Rank) -> &Inbox {
        self.peers[r].as_ref().unwrap_or(&self.mine)
    }

    fn gone(&self, r: Rank) -> bool {
        self.exited[r].load(Ordering::Acquire)
            || self.inbox(r).state(Ordering::Acquire) != state::OPEN
    }

    fn wake(&self, r: Rank) {
        self.inbox(r).doorbell().ring(Scope::Shared);
    }
}

/// A message the receiver keeps before a receive matches it.
enum Unexpected {
    Eager { data: Vec<u8>, sync: Option<u64> },
    Rndv { id: u64, addr: u64, len: usize },
}

impl Unexpected {
    fn len(&self) -> usize {
        match self {
            Unexpected::Eager { data, .. } => data.len(),
            Unexpected::Rndv { len, .. } => *len,
        }
    }
}

/// A send that waits for the receiver.
struct OutSend {
    dest: Rank,
    env: Envelope,
    data: *const u8,
    len: usize,
    owner: SendOwner,
    /// Bytes already streamed (pipelined rendezvous), once `PULL`ed.
    streamed: Option<usize>,
    /// A rendezvous (counted in `Local::rndv_out`), not a synchronous eager
    /// send.
    rndv: bool,
    /// Its tail was written into the receiver (`KIND_WRITE`).
    wrote: bool,
}

// SAFETY: `data` is only read (by this rank, under its lock, or by the
// receiver through CMA) while the send's buffer is guaranteed alive: owned by
// its request, or borrowed by a blocking send that waits for completion.
unsafe impl Send for OutSend {}
// SAFETY: as above; OutSend is only accessed under the rank lock.
unsafe impl Sync for OutSend {}

/// A split CMA copy under way: we read the head, the sender writes the
/// tail.
struct SplitStart {
    /// The sender's send id.
    id: u64,
    /// The sender's buffer (for reading the tail ourselves if it could
    /// not write it).
    addr: u64,
    len: usize,
    /// Where the tail starts.
    half: usize,
    /// Our read of the head failed: the receive fails, once the sender is
    /// done with our buffer.
    head_failed: Option<Error>,
}

/// A split copy's receive, completed at the sender's `KIND_WROTE`.
struct SplitRecv {
    start: SplitStart,
    target: Target,
    env: Envelope,
}

/// A pipelined rendezvous being received.
struct InStream {
    target: Target,
    env: Envelope,
    len: usize,
    got: usize,
}

/// One rank's private protocol state, behind the rank lock.
///
/// A producer's waiting-for-room flag, once set (by a backlog, a reply, a
/// stream or a blocking send that found its ring full), is never cleared:
/// clearing it safely would need a count of every kind of waiter on that
/// ring, and a flag set for nothing only costs the consumer a doorbell ring
/// per pop, which wakes us only while we sleep.
struct Local {
    consumers: Vec<Consumer>,
    producers: Vec<Producer>,
    matching: MatchingEngine<Unexpected, Target>,
    backlog: Vec<VecDeque<Pending>>,
    backlog_total: usize,
    /// Replies waiting for ring room, per destination.
    control: Vec<VecDeque<Header>>,
    control_total: usize,
    /// Sends waiting for a reply, by id.
    sends: HashMap<u64, OutSend>,
    next_id: u64,
    /// Ids being streamed, per destination, in order.
    streams_out: Vec<VecDeque<u64>>,
    streams_total: usize,
    streams_in: HashMap<(Rank, u64), InStream>,
    /// CMA copies matched inside posting calls, for the next progress.
    copies: VecDeque<PendingCopy>,
    /// Split CMA copies waiting for the sender's `KIND_WROTE`, by (sender,
    /// send id).
    splits: HashMap<(Rank, u64), SplitRecv>,
    /// Split copies that completed (for tests and diagnostics).
    splits_done: u64,
    /// Set while a posting call (`irecv`) works under the lock: CMA copies
    /// into requests are then deferred (see [`Outcome::Copy`]).
    defer_copies: bool,
    eager_sent: Vec<u64>,
    freed_seen: Vec<u64>,
    freed_local: Vec<u64>,
    /// Eager bytes (with charges) read from each sender's ring.
    eager_recv: Vec<u64>,
    /// Whether CMA reads from each peer are allowed.
    cma: Vec<bool>,
    departures_seen: u64,
    events: u64,
    gone: Vec<bool>,
    /// Why each gone peer is gone (what its operations fail with).
    gone_why: Vec<Option<Error>>,
    /// Peers whose ring is no longer read (protocol violation).
    broken: Vec<bool>,
    /// Payload buffers of unexpected eager messages already delivered, for
    /// the next ones (at most [`SPARE_PAYLOADS`], each at most `eager_limit`).
    spare_payloads: Vec<Vec<u8>>,
    /// Our unfinished rendezvous sends per destination (at most
    /// `rndv_window`).
    rndv_out: Vec<usize>,
    /// Each sender's rendezvous headers we read and have not finished
    /// (answered with `FIN`, or streamed to the end): at most `rndv_window`.
    rndv_in: Vec<usize>,
}

/// Payload buffers a rank keeps for unexpected eager messages.
const SPARE_PAYLOADS: usize = 64;

/// Messages one `drain` of a ring handles at most, so that a peer that keeps
/// its ring full cannot keep this rank from its other rings and its caller.
const DRAIN_BUDGET: usize = 256;

/// The engine of one rank: shared by the device handle and its requests.
struct Engine {
    sh: Arc<Shared>,
    tracker: Arc<Tracker>,
    local: RankLock<Local>,
    closing: AtomicBool,
    closed: AtomicBool,
    watch: Mutex<Option<PeerWatch>>,
    rendezvous: RendezvousPath,
    _boot: Bootstrap,
    _probe: Box<u64>,
    /// Held while peers may CMA-read this process (see
    /// [`PtracerGrant`](crate::cma::PtracerGrant)): from start-up until the
    /// rendezvous path is chosen (kept only if it is CMA), then until
    /// `finish`.
    ptracer: Mutex<Option<crate::cma::PtracerGrant>>,
}

/// One message to send.
#[derive(Copy, Clone)]
struct Outgoing<'a> {
    dest: Rank,
    tag: Tag,
    context: Context,
    data: &'a [u8],
    sync: bool,
    /// Send only as a plain eager message (else report `Full`): the
    /// caller has no request yet to own a send that waits for a reply.
    eager_only: bool,
}

enum Sent {
    /// Eager, not synchronous: the buffer may be reused.
    Complete,
    /// Registered in `sends`, waiting for a reply.
    Waiting,
    /// No room in the ring: nothing was sent.
    Full,
    /// Refused (the device is closing).
    Refused(Error),
}

/// The outcome of delivering a matched message.
enum Outcome {
    Done(Status),
    /// A pipelined rendezvous: data will arrive in fragments.
    Stream {
        id: u64,
        len: usize,
    },
    /// A CMA rendezvous matched inside a posting call: the copy is left to
    /// the next progress ([`PendingCopy`]), so that the caller goes on
    /// posting (its peer may be waiting for its sends) instead of copying.
    Copy {
        id: u64,
        addr: u64,
        len: usize,
    },
    /// A split CMA copy (see [`SplitRecv`]): the head is read, the tail
    /// comes from the sender.
    Split(SplitStart),
}

/// A matched CMA rendezvous whose copy waits for the next progress (see
/// [`Outcome::Copy`]). Its target is always a request, whose core owns the
/// buffer until it completes.
struct PendingCopy {
    env: Envelope,
    id: u64,
    addr: u64,
    len: usize,
    target: Target,
}

/// What a direct non-blocking receive leaves to its caller (`irecv`).
enum Deferred {
    Stream {
        env: Envelope,
        id: u64,
        len: usize,
    },
    Copy {
        env: Envelope,
        id: u64,
        addr: u64,
        len: usize,
    },
}

/// A receive that can complete straight from the ring (the caller's buffer).
struct Direct<'a> {
    pattern: Pattern,
    buf: &'a mut [u8],
    status: Option<Status>,
    stream: Option<Arc<BlockingRecv>>,
    /// For a blocking receive: its `Unpost` guard's slot, which a stream
    /// into `buf` is recorded in the moment it is registered (so that an
    /// unwind between then and the caller's own bookkeeping still takes it
    /// out of the engine).
    guard: Option<&'a Queued>,
    /// For a non-blocking receive: a rendezvous that matched is not
    /// started here but left to the caller (`irecv`), which streams it into
    /// its request or leaves its copy to the next progress.
    deferred: Option<Deferred>,
    defer_streams: bool,
}

impl<'a> Direct<'a> {
    fn new(pattern: Pattern, buf: &'a mut [u8], defer_streams: bool) -> Self {
        Direct {
            pattern,
            buf,
            status: None,
            stream: None,
            guard: None,
            deferred: None,
            defer_streams,
        }
    }

    fn resolved(&self) -> bool {
        self.status.is_some() || self.stream.is_some() || self.deferred.is_some()
    }
}

/// The owner of a send that `push` never asks for (an `eager_only` send
/// completes at once or is not sent).
fn unreachable_owner() -> SendOwner {
    unreachable!("an eager-only send never waits for a reply")
}

/// Takes a blocking receive out of the engine when its call ends, even by
/// unwinding, so that the device never keeps a pointer into a buffer whose
/// borrow ended.
struct Unpost<'e> {
    engine: &'e Engine,
    queued: Queued,
}

/// A blocking receive queued in the engine (as a posted receive, or as a
/// stream when `None`), for its `Unpost` guard.
type Queued = std::cell::RefCell<Option<(Arc<BlockingRecv>, Option<PostedId>)>>;

impl Drop for Unpost<'_> {
    fn drop(&mut self) {
        if let Some((b, id)) = self.queued.get_mut().take() {
            let mut l = self.engine.lock();
            if let Some(id) = id {
                l.matching.cancel(id);
            }
            if !b.is_done() {
                let abandoned: Vec<(Rank, u64)> = l
                    .streams_in
                    .iter()
                    .filter(|(_, s)| s.target.is(&b))
                    .map(|(k, _)| *k)
                    .collect();
                for k in abandoned {
                    l.streams_in.remove(&k);
                    Engine::stream_ended(&mut l, k.0);
                }
                // A split copy cannot be abandoned: its sender may be
                // writing into the slice. Wait until it answered or left.
                if l.splits.values().any(|sp| sp.target.is(&b)) {
                    drop(l);
                    let _ = self.engine.block_until(
                        false,
                        |eng, l| {
                            eng.progress_locked(l, None);
                            Ok(!l.splits.values().any(|sp| sp.target.is(&b)))
                        },
                        || b.is_done(),
                    );
                }
            }
        }
    }
}

/// Settles a blocking send on every exit, an unwind included: from the
/// moment the send is published until its reply, the receiver may read the
/// caller's buffer (by CMA, or through our pipelined copy), so the call
/// must not return before then. Dropped while the send is unsettled, it
/// waits for the reply or the receiver's departure.
struct SettleSend<'e> {
    engine: &'e Engine,
    waiter: std::cell::RefCell<Option<Arc<BlockingSend>>>,
}

impl Drop for SettleSend<'_> {
    fn drop(&mut self) {
        let Some(w) = self.waiter.get_mut().take() else {
            return;
        };
        if w.is_done() {
            return;
        }
        let _ = self.engine.block_until(
            false,
            |eng, l| {
                if !w.is_done() {
                    eng.progress_locked(l, None);
                }
                Ok(w.is_done())
            },
            || w.is_done(),
        );
    }
}

/// What operations involving gone peer `s` fail with.
fn gone_error(l: &Local, s: Rank) -> Error {
    l.gone_why[s]
        .clone()
        .unwrap_or_else(|| lost(s, "peer finished or died"))
}

impl Engine {
    fn lock(&self) -> RankGuard<'_, Local> {
        self.local.lock()
    }

    fn check_open(&self) -> Result<()> {
        if self.closing.load(Ordering::Acquire) {
            Err(Error::Closed)
        } else {
            Ok(())
        }
    }

    /// Pushes into `d`'s ring. A ring whose consumer position is impossible
    /// (written by a broken or hostile peer) is a protocol violation: the
    /// peer is failed and its error returned.
    fn try_push(&self, l: &mut Local, d: Rank, h: &Header, payload: &[u8]) -> Result<bool> {
        match l.producers[d].try_push(h, payload) {
            Ok(pushed) => Ok(pushed),
            Err(e) => {
                self.violation(l, d, format!("its ring's consumer position: {e}"));
                Err(gone_error(l, d))
            }
        }
    }

    // ------------------------------------------------------------ replies

    /// Sends a reply (`ACK`, `FIN`, `PULL`) to `dest`, queueing it if its
    /// ring is full. Replies to a gone peer are dropped.
    fn reply(&self, l: &mut Local, dest: Rank, kind: u8, flags: u8, id: u64) {
        let h = Header {
            kind,
            flags,
            cookie: id,
            ..Header::default()
        };
        self.control(l, dest, h);
    }

    /// Sends a payload-less control message to `dest`, in order with the
    /// others.
    fn control(&self, l: &mut Local, dest: Rank, h: Header) {
        if l.gone[dest] {
            return;
        }
        if l.control[dest].is_empty() {
            match self.try_push(l, dest, &h, &[]) {
                Ok(true) => {
                    self.sh.wake(dest);
                    return;
                }
                Ok(false) => {}
                Err(_) => return,
            }
        }
        l.control[dest].push_back(h);
        l.control_total += 1;
        l.producers[dest].set_waiting(true);
    }

    fn flush_control(&self, l: &mut Local) -> bool {
        let mut any = false;
        for d in 0..self.sh.size {
            let mut pushed = false;
            while let Some(&h) = l.control[d].front() {
                if self.try_push(l, d, &h, &[]) != Ok(true) {
                    break;
                }
                l.control[d].pop_front();
                l.control_total -= 1;
                pushed = true;
            }
            if pushed {
                any = true;
                self.sh.wake(d);
            }
        }
        any
    }

    // ------------------------------------------------------------ receiving

    /// Returns eager credit for `len` payload bytes to sender `s`.
    fn credit(&self, l: &mut Local, s: Rank, len: u64) {
        l.freed_local[s] += len + ENTRY_CHARGE;
        // Release: the sender that sees the credit may reuse it; nothing else
        // is published by it.
        self.sh
            .mine
            .set_freed(s, l.freed_local[s], Ordering::Release);
    }

    /// The receiver side of a rendezvous once matched: one CMA copy and
    /// `FIN`, or a `PULL` for the pipelined path, or left to `copy_now`
    /// (while a posting call works, or to split it: `copy_now` knows the
    /// target).
    #[allow(clippy::too_many_arguments)]
    fn rendezvous(
        &self,
        l: &mut Local,
        env: Envelope,
        id: u64,
        addr: u64,
        len: usize,
        dst: *mut u8,
        cap: usize,
    ) -> Outcome {
        let s = env.source;
        let n = len.min(cap);
        if n > 0 && !l.gone[s] && l.cma[s] && (l.defer_copies || self.splits(n, len)) {
            return Outcome::Copy { id, addr, len };
        }
        self.transfer(l, env, id, addr, len, dst, cap, false)
    }

    /// [`Engine::cma_transfer`], and a rendezvous finished here (FIN sent,
    /// or failed) leaves the sender's window. A stream leaves it when it
    /// ends, a split copy at its `KIND_WROTE` (`stream_ended`).
    #[allow(clippy::too_many_arguments)]
    fn transfer(
        &self,
        l: &mut Local,
        env: Envelope,
        id: u64,
        addr: u64,
        len: usize,
        dst: *mut u8,
        cap: usize,
        split: bool,
    ) -> Outcome {
        let out = self.cma_transfer(l, env, id, addr, len, dst, cap, split);
        if let Outcome::Done(_) = out {
            Self::stream_ended(l, env.source);
        }
        out
    }

    /// A rendezvous transfer into a receive ended (complete, abandoned by
    /// its receive, or failed).
    fn stream_ended(l: &mut Local, s: Rank) {
        l.rndv_in[s] = l.rndv_in[s].saturating_sub(1);
    }

    /// Whether a CMA copy of `n` of a rendezvous's `len` bytes is worth
    /// splitting with its sender (`cma_split_bytes`).
    fn splits(&self, n: usize, len: usize) -> bool {
        let min = self.sh.opts.cma_split_bytes;
        min > 0 && n == len && n >= min.max(2 * SPLIT_PAGE)
    }

    /// Whether a CMA call on peer `s` may be made now: it has not departed
    /// (as far as we know, by its state word, or by the watch) and its
    /// process has not exited, asked of its pidfd right before the call.
    /// CMA names a process by pid: after an exit the pid may be reaped and
    /// given to an unrelated process, which a call by pid would then read
    /// or write (issue 21); a pidfd stays bound to the process it was opened
    /// for. Every CMA call on a peer asks this first.
    fn may_copy_with(&self, l: &Local, s: Rank) -> bool {
        if l.gone[s] || self.sh.gone(s) {
            return false;
        }
        self.watch
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .is_some_and(|w| !w.has_exited(s))
    }

    /// The receiver's side of a matched rendezvous: nothing to copy (`FIN`),
    /// the CMA copy (split with the sender if `split` and large enough), or
    /// a `PULL` for the pipelined path if CMA is not (or no longer) allowed.
    #[allow(clippy::too_many_arguments)]
    fn cma_transfer(
        &self,
        l: &mut Local,
        env: Envelope,
        id: u64,
        addr: u64,
        len: usize,
        dst: *mut u8,
        cap: usize,
        split: bool,
    ) -> Outcome {
        let s = env.source;
        if !self.may_copy_with(l, s) {
            // A sender that left cannot have finished with this send
            // outstanding: it died (or claims to have left; either way we
            // copy nothing from a departed peer).
            return Outcome::Done(Status::failed(env, lost(s, "sender died")));
        }
        let n = len.min(cap);
        if n == 0 {
            self.reply(l, s, KIND_FIN, 0, id);
            return Outcome::Done(Status::received(env, len, cap));
        }
        // Only while we have no rendezvous of our own out to the sender:
        // otherwise its core is already copying our data (a two-way
        // exchange), and a split only adds messages (measured: osu_bibw
        // 10% slower at 64-256 KiB with it).
        if l.cma[s] && split && l.rndv_out[s] == 0 && self.splits(n, len) {
            // The sender writes [half, n) while we read [0, half): both
            // cores copy. It answers KIND_WROTE after its write, and gets our
            // FIN after our read (in this order in its ring: WRITE first).
            let half = (n / 2) / SPLIT_PAGE * SPLIT_PAGE;
            let h = Header {
                kind: KIND_WRITE,
                cookie: id,
                aux: dst as u64 + half as u64,
                context: (half / SPLIT_PAGE) as u32,
                ..Header::default()
            };
            self.control(l, s, h);
            // SAFETY: dst is valid for cap >= n > half bytes and ours: the
            // sender writes only [half, n).
            let head = unsafe { std::slice::from_raw_parts_mut(dst, half) };
            let head_failed = match crate::cma::read_remote(self.sh.pids[s], addr, head) {
                Ok(()) => {
                    self.reply(l, s, KIND_FIN, 0, id);
                    None
                }
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
                    Some(lost(s, "sender process is gone"))
                }
                Err(e) => {
                    self.reply(l, s, KIND_FIN, FLAG_FAILED, id);
                    let what = format!("rendezvous source {addr:#x}+{half} unreadable: {e}");
                    Some(Error::Protocol { rank: s, what })
                }
            };
            return Outcome::Split(SplitStart {
                id,
                addr,
                len,
                half,
                head_failed,
            });
        }
        if l.cma[s] {
            // SAFETY: dst is valid for cap >= n bytes and exclusively ours
            // (a matched target's buffer or the caller's slice).
            let out = unsafe { std::slice::from_raw_parts_mut(dst, n) };
            match crate::cma::read_remote(self.sh.pids[s], addr, out) {
                Ok(()) => {
                    self.reply(l, s, KIND_FIN, 0, id);
                    return Outcome::Done(Status::received(env, len, cap));
                }
                Err(e) if matches!(e.raw_os_error(), Some(libc::EPERM | libc::ENOSYS)) => {
                    l.cma[s] = false;
                }
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
                    return Outcome::Done(Status::failed(env, lost(s, "sender process is gone")));
                }
                Err(e) => {
                    self.reply(l, s, KIND_FIN, FLAG_FAILED, id);
                    let what = format!("rendezvous source {addr:#x}+{len} unreadable: {e}");
                    return Outcome::Done(Status::failed(env, Error::Protocol { rank: s, what }));
                }
            }
        }
        self.reply(l, s, KIND_PULL, 0, id);
        Outcome::Stream { id, len }
    }

    /// Delivers the message at the head of `s`'s ring into `dst`.
    fn deliver_from_ring(
        &self,
        l: &mut Local,
        s: Rank,
        msg: &Incoming,
        dst: *mut u8,
        cap: usize,
    ) -> Outcome {
        let h = msg.header;
        let env = Envelope {
            source: s,
            tag: h.tag,
            context: h.context,
        };
        if h.kind == KIND_EAGER {
            // SAFETY: dst is valid for cap bytes and nobody else writes it now.
            let out = unsafe { std::slice::from_raw_parts_mut(dst, cap) };
            l.consumers[s].copy_payload(msg, out);
            self.credit(l, s, h.len as u64);
            if h.flags & FLAG_SYNC != 0 {
                self.reply(l, s, KIND_ACK, 0, h.cookie);
            }
            return Outcome::Done(Status::received(env, h.len as usize, cap));
        }
        let (id, addr, len) = self.rndv_fields(l, s, msg);
        self.rendezvous(l, env, id, addr, len, dst, cap)
    }

    fn rndv_fields(&self, l: &Local, s: Rank, msg: &Incoming) -> (u64, u64, usize) {
        let mut a = [0u8; 8];
        l.consumers[s].copy_payload(msg, &mut a);
        (
            msg.header.cookie,
            u64::from_le_bytes(a),
            msg.header.aux as usize,
        )
    }

    fn deliver_unexpected(
        &self,
        l: &mut Local,
        env: Envelope,
        u: Unexpected,
        dst: *mut u8,
        cap: usize,
    ) -> Outcome {
        match u {
            Unexpected::Eager { data, sync } => {
                let n = data.len().min(cap);
                // SAFETY: dst is valid for cap >= n bytes and exclusively ours.
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, n) };
                self.credit(l, env.source, data.len() as u64);
                if let Some(id) = sync {
                    self.reply(l, env.source, KIND_ACK, 0, id);
                }
                let st = Status::received(env, data.len(), cap);
                if l.spare_payloads.len() < SPARE_PAYLOADS {
                    l.spare_payloads.push(data);
                }
                Outcome::Done(st)
            }
            Unexpected::Rndv { id, addr, len } => self.rendezvous(l, env, id, addr, len, dst, cap),
        }
    }

    fn start_stream(&self, l: &mut Local, env: Envelope, id: u64, len: usize, target: Target) {
        l.streams_in.insert(
            (env.source, id),
            InStream {
                target,
                env,
                len,
                got: 0,
            },
        );
    }

    /// Finishes a delivery to a queued target.
    fn settle(&self, l: &mut Local, env: Envelope, out: Outcome, target: Target) {
        match out {
            Outcome::Done(st) => self.complete_target(target, st),
            Outcome::Stream { id, len } => self.start_stream(l, env, id, len, target),
            Outcome::Split(start) => Self::hold_split(l, env, start, target),
            Outcome::Copy { id, addr, len } => {
                let c = PendingCopy {
                    env,
                    id,
                    addr,
                    len,
                    target,
                };
                if matches!(c.target, Target::Request(_)) {
                    l.copies.push_back(c);
                } else {
                    // A blocking receive (another thread's): now.
                    self.copy_now(l, c);
                }
            }
        }
    }

    /// Keeps a split copy's receive until the sender's `KIND_WROTE`.
    fn hold_split(l: &mut Local, env: Envelope, start: SplitStart, target: Target) {
        let key = (env.source, start.id);
        l.splits.insert(key, SplitRecv { start, target, env });
    }

    /// Does a deferred CMA copy (or whatever its rendezvous turns into now)
    /// and settles its target.
    fn copy_now(&self, l: &mut Local, c: PendingCopy) {
        let (dst, cap) = c.target.dst();
        // A request's buffer stays with its core until it completes; a
        // blocking receive's `Unpost` guard waits for a split copy into its
        // slice to end (see `Unpost`): the sender may write into either.
        let out = self.transfer(l, c.env, c.id, c.addr, c.len, dst, cap, true);
        self.settle(l, c.env, out, c.target);
    }

    /// Does the CMA copies left by posting calls.
    fn flush_copies(&self, l: &mut Local) -> bool {
        let mut any = false;
        while let Some(c) = l.copies.pop_front() {
            self.copy_now(l, c);
            any = true;
        }
        any
    }

    /// Finishes a delivery to a direct receive.
    fn settle_direct(&self, l: &mut Local, env: Envelope, out: Outcome, d: &mut Direct<'_>) {
        match out {
            Outcome::Done(st) => d.status = Some(st),
            Outcome::Stream { id, len } if d.defer_streams => {
                d.deferred = Some(Deferred::Stream { env, id, len })
            }
            Outcome::Copy { id, addr, len } if d.defer_streams => {
                d.deferred = Some(Deferred::Copy { env, id, addr, len })
            }
            Outcome::Copy { id, addr, len } => {
                // A blocking receive: copy into its slice now (split with
                // the sender if large: its guard then waits for the sender).
                let (p, n) = (d.buf.as_mut_ptr(), d.buf.len());
                let out = self.transfer(l, env, id, addr, len, p, n, true);
                self.settle_direct(l, env, out, d);
            }
            Outcome::Split(start) => {
                let b = BlockingRecv::new(d.buf);
                Self::hold_split(l, env, start, Target::Blocking(b.clone()));
                if let Some(g) = d.guard {
                    *g.borrow_mut() = Some((b.clone(), None));
                }
                d.stream = Some(b);
                #[cfg(test)]
                if tests::PANIC_AFTER_STREAM.with(|p| p.replace(false)) {
                    panic!("injected: unwinding out of a blocking receive being split");
                }
            }
            Outcome::Stream { id, len } => {
                let b = BlockingRecv::new(d.buf);
                self.start_stream(l, env, id, len, Target::Blocking(b.clone()));
                if let Some(g) = d.guard {
                    *g.borrow_mut() = Some((b.clone(), None));
                }
                d.stream = Some(b);
                #[cfg(test)]
                if tests::PANIC_AFTER_STREAM.with(|p| p.replace(false)) {
                    panic!("injected: unwinding out of a blocking receive being streamed");
                }
            }
        }
    }

    /// Completes `d` from the unexpected queue if a queued message matches.
    fn direct_from_unexpected(&self, l: &mut Local, d: &mut Direct<'_>) -> bool {
        if l.matching.unexpected_len() == 0 {
            return false;
        }
        let Some((env, u)) = l.matching.take(&d.pattern) else {
            return false;
        };
        let out = self.deliver_unexpected(l, env, u, d.buf.as_mut_ptr(), d.buf.len());
        self.settle_direct(l, env, out, d);
        true
    }

    fn complete_target(&self, t: Target, st: Status) {
        t.complete(&self.tracker, st);
    }

    fn complete_send(&self, l: &mut Local, e: OutSend, result: Result<()>) {
        if e.rndv {
            l.rndv_out[e.dest] -= 1;
        }
        e.owner.complete(&self.tracker, e.env, e.len, result);
    }

    /// Handles a reply or fragment from `s`. Returns a protocol violation.
    fn control_message(&self, l: &mut Local, s: Rank, msg: &Incoming) -> Result<(), String> {
        let h = msg.header;
        match h.kind {
            KIND_ACK | KIND_FIN => {
                let e = match l.sends.remove(&h.cookie) {
                    Some(e) if e.dest == s && e.streamed.is_none() => e,
                    Some(e) => {
                        l.sends.insert(h.cookie, e);
                        return Err(format!("reply for send {} it does not hold", h.cookie));
                    }
                    None => return Err(format!("reply for unknown send {}", h.cookie)),
                };
                let r = if h.flags & FLAG_FAILED != 0 {
                    Err(Error::Protocol {
                        rank: self.sh.rank,
                        what: format!("rank {s} could not read the rendezvous data"),
                    })
                } else {
                    Ok(())
                };
                self.complete_send(l, e, r);
            }
            KIND_PULL => {
                match l.sends.get_mut(&h.cookie) {
                    Some(e) if e.dest == s && e.streamed.is_none() && e.len > 0 => {
                        e.streamed = Some(0);
                    }
                    _ => return Err(format!("PULL for send {} it does not hold", h.cookie)),
                }
                l.streams_out[s].push_back(h.cookie);
                l.streams_total += 1;
            }
            KIND_WRITE => {
                // The receiver asks for the tail of our send in its buffer.
                let half = h.context as usize * SPLIT_PAGE;
                let e = match l.sends.get_mut(&h.cookie) {
                    Some(e)
                        if e.dest == s
                            && e.rndv
                            && e.streamed.is_none()
                            && !e.wrote
                            && half > 0
                            && half < e.len =>
                    {
                        e
                    }
                    _ => return Err(format!("WRITE for send {} it cannot ask for", h.cookie)),
                };
                e.wrote = true;
                let (data, len) = (e.data, e.len);
                if !self.may_copy_with(l, s) {
                    // A departed receiver's request is dropped, not served:
                    // its receive is gone with it, and its pid may be
                    // another process's by now. The send completes with its
                    // FIN, or fails with the peer.
                    return Ok(());
                }
                // SAFETY: the send's buffer is valid for len bytes until the
                // send completes (owned by its request, or borrowed by a
                // blocking send that waits for its reply), and half < len.
                let tail = unsafe { std::slice::from_raw_parts(data.add(half), len - half) };
                // Only rank s's memory is written, where it asked: a
                // hostile receiver can only misplace our data in itself.
                let flags = match crate::cma::write_remote(self.sh.pids[s], h.aux, tail) {
                    Ok(()) => 0,
                    Err(_) => FLAG_FAILED,
                };
                self.reply(l, s, KIND_WROTE, flags, h.cookie);
            }
            KIND_WROTE => {
                let Some(sp) = l.splits.remove(&(s, h.cookie)) else {
                    return Err(format!("WROTE for receive {} it was not asked", h.cookie));
                };
                Self::stream_ended(l, s);
                let (dst, cap) = sp.target.dst();
                let st = if let Some(e) = sp.start.head_failed {
                    Status::failed(sp.env, e)
                } else if h.flags & FLAG_FAILED != 0 && !self.may_copy_with(l, s) {
                    // It could not write, and has left since: nothing more
                    // is read from it.
                    Status::failed(sp.env, lost(s, "sender process is gone"))
                } else if h.flags & FLAG_FAILED != 0 {
                    // It could not write: read the tail ourselves.
                    // SAFETY: dst is valid for cap >= len > half bytes and
                    // ours again (the sender is done with it).
                    let tail = unsafe {
                        std::slice::from_raw_parts_mut(
                            dst.add(sp.start.half),
                            sp.start.len - sp.start.half,
                        )
                    };
                    let from = sp.start.addr + sp.start.half as u64;
                    match crate::cma::read_remote(self.sh.pids[s], from, tail) {
                        Ok(()) => Status::received(sp.env, sp.start.len, cap),
                        Err(e) => {
                            let what = format!("rendezvous source {from:#x} unreadable: {e}");
                            Status::failed(sp.env, Error::Protocol { rank: s, what })
                        }
                    }
                } else {
                    Status::received(sp.env, sp.start.len, cap)
                };
                l.splits_done += 1;
                self.complete_target(sp.target, st);
            }
            KIND_DATA => {
                let key = (s, h.cookie);
                let Some(st) = l.streams_in.get_mut(&key) else {
                    return Ok(()); // an abandoned stream (its receive ended)
                };
                let off = h.aux as usize;
                let n = h.len as usize;
                if off != st.got || n == 0 || off + n > st.len {
                    return Err(format!(
                        "fragment {off}+{n} of a {}-byte stream at {}",
                        st.len, st.got
                    ));
                }
                let (dst, cap) = st.target.dst();
                if off < cap {
                    let k = n.min(cap - off);
                    // SAFETY: dst is valid for cap bytes, off + k <= cap, and the
                    // target is exclusively ours until completed.
                    let out = unsafe { std::slice::from_raw_parts_mut(dst.add(off), k) };
                    l.consumers[s].copy_payload(msg, out);
                }
                st.got += n;
                if st.got == st.len {
                    let st = l.streams_in.remove(&key).expect("present");
                    Self::stream_ended(l, s);
                    let status = Status::received(st.env, st.len, cap);
                    self.complete_target(st.target, status);
                }
            }
            k => return Err(format!("unknown message kind {k}")),
        }
        Ok(())
    }

    /// Processes the messages waiting in the ring from `s`. With `direct`,
    /// stops as soon as that receive is resolved.
    /// With `leave_unmatched`, stops at the first message that no posted
    /// receive takes and leaves it in the ring (see `irecv`).
    fn drain(
        &self,
        l: &mut Local,
        s: Rank,
        mut direct: Option<&mut Direct<'_>>,
        leave_unmatched: bool,
    ) -> bool {
        let mut any = false;
        for _ in 0..DRAIN_BUDGET {
            if l.broken[s] || direct.as_ref().is_some_and(|d| d.resolved()) {
                return any;
            }
            let msg = match l.consumers[s].peek() {
                None => return any,
                Some(Ok(m)) => m,
                Some(Err(e)) => {
                    self.violation(l, s, e.to_string());
                    return true;
                }
            };
            let processed_before = any;
            any = true;
            let h = msg.header;
            if h.kind == KIND_EAGER || h.kind == KIND_RNDV {
                if h.kind == KIND_EAGER {
                    l.eager_recv[s] += h.len as u64 + ENTRY_CHARGE;
                    if l.eager_recv[s] - l.freed_local[s] > self.sh.opts.credit_bytes as u64 {
                        self.violation(l, s, "eager data beyond its credit".into());
                        return true;
                    }
                } else if h.len != 8 {
                    self.violation(l, s, format!("rendezvous start of {} bytes", h.len));
                    return true;
                } else {
                    l.rndv_in[s] += 1;
                    if l.rndv_in[s] > self.sh.opts.rndv_window {
                        let what = format!(
                            "more than {} unfinished rendezvous sends",
                            self.sh.opts.rndv_window
                        );
                        self.violation(l, s, what);
                        return true;
                    }
                }
                if h.tag < 0 {
                    // No send can carry one (`check_send`): a buggy or
                    // hostile peer, as the ibv device's wire decoding says.
                    self.violation(l, s, format!("negative tag {}", h.tag));
                    return true;
                }
                let env = Envelope {
                    source: s,
                    tag: h.tag,
                    context: h.context,
                };
                let direct_hit = match direct.as_deref_mut() {
                    Some(d) if l.matching.posted_len() == 0 && d.pattern.matches(&env) => Some(d),
                    _ => None,
                };
                if let Some(d) = direct_hit {
                    let out = self.deliver_from_ring(l, s, &msg, d.buf.as_mut_ptr(), d.buf.len());
                    self.settle_direct(l, env, out, d);
                } else if let Some((_, target)) = l.matching.take_posted(&env) {
                    let (p, n) = target.dst();
                    let out = self.deliver_from_ring(l, s, &msg, p, n);
                    self.settle(l, env, out, target);
                } else {
                    if leave_unmatched {
                        // Not consumed: its credit charge is taken again
                        // when it is read for real.
                        if h.kind == KIND_EAGER {
                            l.eager_recv[s] -= h.len as u64 + ENTRY_CHARGE;
                        } else {
                            l.rndv_in[s] -= 1;
                        }
                        return processed_before;
                    }
                    let u = if h.kind == KIND_EAGER {
                        // A buffer kept from an earlier unexpected message:
                        // no allocation in steady state.
                        let mut data = l.spare_payloads.pop().unwrap_or_default();
                        data.clear();
                        data.resize(h.len as usize, 0);
                        l.consumers[s].copy_payload(&msg, &mut data);
                        let sync = (h.flags & FLAG_SYNC != 0).then_some(h.cookie);
                        Unexpected::Eager { data, sync }
                    } else {
                        let (id, addr, len) = self.rndv_fields(l, s, &msg);
                        Unexpected::Rndv { id, addr, len }
                    };
                    l.matching.push_unexpected(env, u);
                }
            } else if let Err(what) = self.control_message(l, s, &msg) {
                self.violation(l, s, what);
                return true;
            }
            if l.consumers[s].pop(&msg) {
                self.sh.wake(s);
            }
        }
        any
    }

    /// A peer broke the protocol: stop reading its ring, fail what involves it.
    fn violation(&self, l: &mut Local, s: Rank, what: String) {
        l.broken[s] = true;
        if !l.gone[s] {
            self.fail_peer(l, s, Error::Protocol { rank: s, what });
        }
    }

    // ------------------------------------------------------------ sending

    /// Tries to put one message into the destination's ring.
    fn push(&self, l: &mut Local, out: &Outgoing<'_>, owner: impl FnOnce() -> SendOwner) -> Sent {
        let Outgoing {
            dest,
            tag,
            context,
            data,
            sync,
            eager_only,
        } = *out;
        let credit = self.sh.opts.credit_bytes as u64;
        let charge = data.len() as u64 + ENTRY_CHARGE;
        let mut eager = data.len() <= self.sh.eager_max;
        if eager && l.eager_sent[dest] + charge - l.freed_seen[dest] > credit {
            // Acquire pairs with the receiver's Release store of its credit.
            // The counter is the receiver's to write: never trust it beyond
            // what we sent, nor let it go backwards.
            let seen = self.sh.inbox(dest).freed(self.sh.rank, Ordering::Acquire);
            l.freed_seen[dest] = seen.clamp(l.freed_seen[dest], l.eager_sent[dest]);
            eager = l.eager_sent[dest] + charge - l.freed_seen[dest] <= credit;
        }
        let waits = sync || !eager;
        if waits && eager_only {
            return Sent::Full;
        }
        if !eager && l.rndv_out[dest] >= self.sh.opts.rndv_window {
            // The receiver holds a window's worth of ours: wait (in order,
            // like a full ring) until one finishes.
            return Sent::Full;
        }
        if l.gone[dest] {
            return Sent::Refused(gone_error(l, dest));
        }
        if waits && self.closing.load(Ordering::Acquire) {
            // finish() checks `sends` under this lock after setting `closing`.
            return Sent::Refused(Error::Closed);
        }
        let id = l.next_id;
        let mut header = Header {
            kind: if eager { KIND_EAGER } else { KIND_RNDV },
            flags: if sync { FLAG_SYNC } else { 0 },
            tag,
            context,
            cookie: id,
            aux: data.len() as u64,
            ..Header::default()
        };
        let addr = (data.as_ptr() as u64).to_le_bytes();
        let payload = if eager { data } else { &addr[..] };
        if !eager {
            header.flags = 0;
        }
        match self.try_push(l, dest, &header, payload) {
            Ok(true) => {}
            Ok(false) => return Sent::Full,
            Err(e) => return Sent::Refused(e),
        }
        if eager {
            l.eager_sent[dest] += charge;
        } else {
            l.rndv_out[dest] += 1;
        }
        self.sh.wake(dest);
        if !waits {
            return Sent::Complete;
        }
        l.next_id += 1;
        l.sends.insert(
            id,
            OutSend {
                dest,
                env: Envelope {
                    source: dest,
                    tag,
                    context,
                },
                data: data.as_ptr(),
                len: data.len(),
                owner: owner(),
                streamed: None,
                rndv: !eager,
                wrote: false,
            },
        );
        Sent::Waiting
    }

    fn push_pending(&self, l: &mut Local, dest: Rank, p: &Pending) -> bool {
        // SAFETY: the request owns its buffer until completed, and it is not
        // completed before this send is pushed (complete) or answered.
        let data = unsafe { std::slice::from_raw_parts(p.core.buffer_ptr(), p.core.buffer_len()) };
        let out = Outgoing {
            dest,
            tag: p.tag,
            context: p.context,
            data,
            sync: p.sync,
            eager_only: false,
        };
        let env = Envelope {
            source: dest,
            tag: p.tag,
            context: p.context,
        };
        match self.push(l, &out, || SendOwner::Request(p.core.clone())) {
            Sent::Full => false,
            Sent::Complete => {
                self.tracker.complete(&p.core, Status::ok(env, data.len()));
                true
            }
            Sent::Refused(e) => {
                self.tracker.complete(&p.core, Status::failed(env, e));
                true
            }
            Sent::Waiting => true,
        }
    }

    fn flush_backlogs(&self, l: &mut Local) -> bool {
        let mut any = false;
        for d in 0..l.backlog.len() {
            while let Some(p) = l.backlog[d].pop_front() {
                if self.push_pending(l, d, &p) {
                    any = true;
                    l.backlog_total -= 1;
                } else {
                    l.backlog[d].push_front(p);
                    break;
                }
            }
        }
        any
    }

    /// Pushes fragments of `PULL`ed sends while their rings have room.
    fn flush_streams(&self, l: &mut Local) -> bool {
        let mut any = false;
        let frag = self.sh.fragment;
        for d in 0..self.sh.size {
            let mut pushed = false;
            'stream: while let Some(&id) = l.streams_out[d].front() {
                let Some(e) = l.sends.get(&id) else {
                    l.streams_out[d].pop_front();
                    l.streams_total -= 1;
                    continue;
                };
                let (data, len) = (e.data, e.len);
                let mut off = e.streamed.unwrap_or(0);
                while off < len {
                    let n = frag.min(len - off);
                    let h = Header {
                        kind: KIND_DATA,
                        cookie: id,
                        aux: off as u64,
                        ..Header::default()
                    };
                    // SAFETY: the send's buffer is valid for len bytes until
                    // the send completes (owned by its request, or borrowed by
                    // a blocking send that waits for completion).
                    let chunk = unsafe { std::slice::from_raw_parts(data.add(off), n) };
                    match self.try_push(l, d, &h, chunk) {
                        Ok(true) => {}
                        Ok(false) => {
                            if let Some(e) = l.sends.get_mut(&id) {
                                e.streamed = Some(off);
                            }
                            l.producers[d].set_waiting(true);
                            break 'stream;
                        }
                        // The peer was failed: its streams are gone.
                        Err(_) => break 'stream,
                    }
                    pushed = true;
                    off += n;
                }
                let e = l.sends.remove(&id).expect("present");
                self.complete_send(l, e, Ok(()));
                l.streams_out[d].pop_front();
                l.streams_total -= 1;
            }
            if pushed {
                any = true;
                self.sh.wake(d);
            }
        }
        any
    }

    // ------------------------------------------------------------ progress

    /// One round of progress: departures, all rings, then replies, streams
    /// and backlogs. Counts `events`.
    fn progress_locked(&self, l: &mut Local, mut direct: Option<&mut Direct<'_>>) -> bool {
        let mut any = false;
        let dep = self.sh.mine.departures().load(Ordering::Acquire);
        if dep != l.departures_seen {
            l.departures_seen = dep;
            any |= self.handle_departures(l);
        }
        let first = match direct.as_ref().map(|d| d.pattern.source) {
            Some(Source::Rank(s)) => s,
            _ => self.sh.rank,
        };
        let n = self.sh.size;
        for k in 0..n {
            any |= self.drain(l, (first + k) % n, direct.as_deref_mut(), false);
        }
        if !l.copies.is_empty() {
            any |= self.flush_copies(l);
        }
        if l.control_total > 0 {
            any |= self.flush_control(l);
        }
        if l.streams_total > 0 {
            any |= self.flush_streams(l);
        }
        if l.backlog_total > 0 {
            any |= self.flush_backlogs(l);
        }
        if any {
            l.events += 1;
            // Other threads of this rank may sleep on requests we completed.
            self.sh.mine.doorbell().ring(Scope::Shared);
        }
        any
    }

    fn handle_departures(&self, l: &mut Local) -> bool {
        let mut any = false;
        for d in 0..self.sh.size {
            if l.gone[d] || d == self.sh.rank || !self.sh.gone(d) {
                continue;
            }
            any = true;
            // What it sent before leaving is still deliverable, all of it,
            // whatever the per-call budget: it lies within a ring's worth of
            // slots from where we are now (a producer is never further
            // ahead). Nothing after that is read, now or later: a live peer
            // that only claims to have left and keeps refilling its ring
            // cannot keep us here (issue 21).
            let end = l.consumers[d]
                .position()
                .saturating_add(self.sh.mine.ring(d).nslots() as u64);
            l.consumers[d].stop_at(end);
            while self.drain(l, d, None, false) {}
            if !l.gone[d] {
                self.fail_peer(l, d, lost(d, "peer finished or died"));
            }
        }
        any
    }

    /// Fails everything that involves `d` with `err` and marks it gone.
    fn fail_peer(&self, l: &mut Local, d: Rank, err: Error) {
        l.gone[d] = true;
        l.gone_why[d] = Some(err.clone());
        l.rndv_in[d] = 0;
        for t in l
            .matching
            .remove_posted_where(|p, _| p.source == Source::Rank(d))
        {
            let env = Envelope {
                source: d,
                tag: -1,
                context: 0,
            };
            self.complete_target(t, Status::failed(env, err.clone()));
        }
        for p in std::mem::take(&mut l.backlog[d]) {
            l.backlog_total -= 1;
            let env = Envelope {
                source: d,
                tag: p.tag,
                context: p.context,
            };
            self.tracker
                .complete(&p.core, Status::failed(env, err.clone()));
        }
        let ids: Vec<u64> = l
            .sends
            .iter()
            .filter(|(_, e)| e.dest == d)
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            let e = l.sends.remove(&id).expect("present");
            self.complete_send(l, e, Err(err.clone()));
        }
        l.streams_total -= l.streams_out[d].len();
        l.streams_out[d].clear();
        l.control_total -= l.control[d].len();
        l.control[d].clear();
        let keys: Vec<(Rank, u64)> = l.splits.keys().filter(|k| k.0 == d).copied().collect();
        for k in keys {
            let sp = l.splits.remove(&k).expect("present");
            self.complete_target(sp.target, Status::failed(sp.env, err.clone()));
        }
        let keys: Vec<(Rank, u64)> = l.streams_in.keys().filter(|k| k.0 == d).copied().collect();
        for k in keys {
            let st = l.streams_in.remove(&k).expect("present");
            self.complete_target(st.target, Status::failed(st.env, err.clone()));
        }
        // Unexpected rendezvous starts from it fail when matched (l.gone).
    }

    /// A lock-free hint that a step may find something.
    fn worth_a_step(&self, departures_seen: u64) -> bool {
        self.sh.mine.departures().load(Ordering::Relaxed) != departures_seen
            || (0..self.sh.size).any(|s| self.sh.mine.ring(s).has_message())
    }

    /// Calls `done` (which makes progress itself) until it says done,
    /// spinning then sleeping while nothing happens. With `until_closed`, a
    /// closed device ends the wait with [`Error::Closed`].
    fn block_until(
        &self,
        until_closed: bool,
        mut done: impl FnMut(&Self, &mut Local) -> Result<bool>,
        ready: impl Fn() -> bool,
    ) -> Result<()> {
        let mut backoff = Backoff::new();
        loop {
            let (busy, queued, seen) = {
                let mut l = self.lock();
                let before = l.events;
                if done(self, &mut l)? {
                    return Ok(());
                }
                let queued = l.backlog_total + l.control_total + l.streams_total > 0;
                (l.events != before, queued, l.departures_seen)
            };
            if until_closed && self.closed.load(Ordering::Acquire) {
                return Err(Error::Closed);
            }
            if busy {
                backoff.reset();
                continue;
            }
            let mut sleep = false;
            while !ready() && !self.worth_a_step(seen) {
                if !backoff.snooze() {
                    sleep = true;
                    break;
                }
                if queued {
                    break;
                }
            }
            if sleep {
                // Short sleeps while this rank's queues wait for room: the
                // sleeper's re-check does not look at their rings, so a
                // consumer's wake-up on freed room can come before we sleep
                // and be missed. (A blocking send waiting for room re-checks
                // its ring in `ready`, and needs no short sleep.)
                let t = if queued {
                    Duration::from_millis(1)
                } else {
                    Duration::from_millis(50)
                };
                self.sh
                    .mine
                    .doorbell()
                    .sleep(t, Scope::Shared, || ready() || self.worth_a_step(seen));
            }
        }
    }

    // ------------------------------------------------------------ operations

    fn blocking_send(
        &self,
        buf: &[u8],
        dest: Rank,
        tag: Tag,
        context: Context,
        sync: bool,
    ) -> Result<()> {
        check_send(dest, tag, self.sh.size)?;
        self.check_open()?;
        if dest != self.sh.rank && self.sh.gone(dest) {
            return Err(lost(dest, "peer finished or died"));
        }
        // Holds the reply's waiter from the moment the send is published
        // (allocated only when it must wait for one).
        let settle = SettleSend {
            engine: self,
            waiter: Default::default(),
        };
        // While the ring is full: the consumer position it was full against.
        let full_at = Cell::new(None);
        let ring = self.sh.inbox(dest).ring(self.sh.rank);
        self.block_until(
            true,
            |eng, l| {
                if !l.backlog[dest].is_empty() {
                    eng.progress_locked(l, None);
                    if !l.backlog[dest].is_empty() {
                        return Ok(false); // keep order behind queued isends
                    }
                }
                if l.gone[dest] {
                    return Err(gone_error(l, dest));
                }
                let out = Outgoing {
                    dest,
                    tag,
                    context,
                    data: buf,
                    sync,
                    eager_only: false,
                };
                let sent = eng.push(l, &out, || {
                    let w = BlockingSend::new();
                    *settle.waiter.borrow_mut() = Some(w.clone());
                    SendOwner::Blocking(w)
                });
                full_at.set(None);
                match sent {
                    Sent::Complete | Sent::Waiting => Ok(true),
                    Sent::Refused(e) => Err(e),
                    Sent::Full => {
                        // Flag first, then note what the ring was full
                        // against: `ready` re-checks it after the doorbell
                        // is armed, and a pop that frees room rings us.
                        l.producers[dest].set_waiting(true);
                        full_at.set(Some(l.producers[dest].consumer_position_seen()));
                        eng.progress_locked(l, None);
                        Ok(false)
                    }
                }
            },
            || full_at.get().is_some_and(|t| ring.consumer_position() != t),
        )?;
        let Some(waiter) = settle.waiter.borrow().clone() else {
            return Ok(()); // eager: the buffer may be reused
        };
        #[cfg(test)]
        if tests::PANIC_AFTER_PUBLISH.with(|p| p.replace(false)) {
            panic!("injected: unwinding out of a published blocking send");
        }
        // The receiver may read `buf` until the reply comes or it is gone:
        // this wait ignores our own closing (finish() waits for it instead).
        let _ = self.block_until(
            false,
            |eng, l| {
                if !waiter.is_done() {
                    eng.progress_locked(l, None);
                }
                Ok(waiter.is_done())
            },
            || waiter.is_done(),
        );
        waiter.outcome()
    }

    fn start_send(
        self: &Arc<Self>,
        buf: Buffer,
        dest: Rank,
        tag: Tag,
        context: Context,
        sync: bool,
    ) -> Request {
        let env = Envelope {
            source: dest,
            tag,
            context,
        };
        let rejected = check_send(dest, tag, self.sh.size)
            .and_then(|_| self.check_open())
            .and_then(|_| {
                if dest != self.sh.rank && self.sh.gone(dest) {
                    Err(lost(dest, "peer finished or died"))
                } else {
                    Ok(())
                }
            });
        if let Err(e) = rejected {
            let core = self
                .tracker
                .rejected(RequestKind::Send, buf, Status::failed(env, e));
            return Request::new(core, self.clone());
        }
        if !sync && buf.len() <= self.sh.eager_max {
            // The common small send: into the ring first, then a request
            // born complete (no request core to publish, no locked
            // instruction after the ring push).
            let mut l = self.lock();
            if !l.gone[dest] && l.backlog[dest].is_empty() {
                let out = Outgoing {
                    dest,
                    tag,
                    context,
                    data: &buf,
                    sync,
                    eager_only: true,
                };
                if let Sent::Complete = self.push(&mut l, &out, unreachable_owner) {
                    drop(l);
                    let len = buf.len();
                    return self
                        .tracker
                        .completed(RequestKind::Send, buf, Status::ok(env, len));
                }
            }
        }
        let core = self.tracker.start(RequestKind::Send, buf);
        let p = Pending {
            core: core.clone(),
            tag,
            context,
            sync,
        };
        let mut l = self.lock();
        if self.closing.load(Ordering::Acquire) {
            // `finish` may be past its wait for queued sends (see `irecv`).
            self.tracker
                .complete(&core, Status::failed(env, Error::Closed));
        } else if l.gone[dest] {
            let err = gone_error(&l, dest);
            self.tracker.complete(&core, Status::failed(env, err));
        } else if !(l.backlog[dest].is_empty() && self.push_pending(&mut l, dest, &p)) {
            l.backlog[dest].push_back(p);
            l.backlog_total += 1;
            // Never cleared (see `Local`).
            l.producers[dest].set_waiting(true);
        }
        drop(l);
        Request::new(core, self.clone())
    }

    fn recv_into(&self, buf: &mut [u8], pattern: Pattern) -> Result<Status> {
        check_recv(pattern.source, pattern.tag, self.sh.size)?;
        self.check_open()?;
        // The guard first: everything that can lend `buf` to the engine
        // records itself in it the moment it does.
        let unpost = Unpost {
            engine: self,
            queued: Default::default(),
        };
        let queued = &unpost.queued;
        let mut direct = Direct::new(pattern, buf, false);
        direct.guard = Some(queued);
        let r = self.block_until(
            true,
            |eng, l| {
                if let Some((b, _)) = &*queued.borrow() {
                    eng.progress_locked(l, None);
                    return Ok(b.is_done());
                }
                if l.matching.posted_len() == 0 {
                    if !eng.direct_from_unexpected(l, &mut direct) {
                        eng.progress_locked(l, Some(&mut direct));
                        // Progress may have queued a match as unexpected (a
                        // departed peer's ring is drained to its end).
                        if !direct.resolved() {
                            eng.direct_from_unexpected(l, &mut direct);
                        }
                    }
                    if direct.status.is_some() {
                        return Ok(true);
                    }
                    if let Some(b) = direct.stream.take() {
                        *queued.borrow_mut() = Some((b, None));
                        return Ok(false);
                    }
                    if let Source::Rank(s) = pattern.source {
                        if l.gone[s] && s != eng.sh.rank {
                            return Err(gone_error(l, s));
                        }
                    }
                    if l.matching.posted_len() == 0 {
                        return Ok(false);
                    }
                }
                // Other receives are posted: queue behind them to keep order.
                let b = BlockingRecv::new(direct.buf);
                match l.matching.post(pattern, Target::Blocking(b.clone())) {
                    Posted::Matched { env, msg, recv } => {
                        let (p, n) = recv.dst();
                        let out = eng.deliver_unexpected(l, env, msg, p, n);
                        eng.settle(l, env, out, recv);
                        let done = b.is_done();
                        *queued.borrow_mut() = Some((b, None));
                        Ok(done)
                    }
                    Posted::Queued(id) => {
                        *queued.borrow_mut() = Some((b, Some(id)));
                        Ok(false)
                    }
                }
            },
            || queued.borrow().as_ref().is_some_and(|(b, _)| b.is_done()),
        );
        // Never read a queued entry's outcome while it can still be written:
        // dropping `unpost` takes it out of the engine first.
        let queued_recv = queued.borrow().as_ref().map(|(b, _)| b.clone());
        let direct_status = direct.status.take();
        drop(unpost);
        if let Some(b) = queued_recv {
            if b.is_done() {
                return b.outcome();
            }
            r?;
            return Err(Error::Closed);
        }
        r?;
        direct_status
            .map(|s| s.into_result())
            .unwrap_or(Err(Error::Closed))
    }

    fn probe_once(&self, l: &mut Local, pattern: &Pattern) -> Option<Status> {
        self.progress_locked(l, None);
        l.matching
            .probe(pattern)
            .map(|(env, u)| Status::ok(env, u.len()))
    }

    fn finish(&self) -> Result<()> {
        if self.closing.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        // Our sends (requests and blocking ones) and our replies must be
        // through: a peer that got our data must not see us leave before
        // our FIN/ACK.
        let r = self.block_until(
            false,
            |eng, l| {
                eng.progress_locked(l, None);
                Ok(eng.tracker.outstanding_sends() == 0
                    && l.copies.is_empty()
                    && l.splits.is_empty()
                    && l.sends.is_empty()
                    && l.backlog_total == 0
                    && l.control_total == 0)
            },
            || false,
        );
        let mut l = self.lock();
        for t in l.matching.remove_posted_where(|_, _| true) {
            let env = Envelope {
                source: self.sh.rank,
                tag: -1,
                context: 0,
            };
            self.complete_target(t, Status::failed(env, Error::Closed));
        }
        for (_, st) in std::mem::take(&mut l.streams_in) {
            self.complete_target(st.target, Status::failed(st.env, Error::Closed));
        }
        l.matching.drain_unexpected();
        drop(l);
        self.depart(state::CLOSED);
        // No more reads of our memory are needed.
        drop(
            self.ptracer
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take(),
        );
        r
    }

    fn depart(&self, st: u32) {
        self.closed.store(true, Ordering::Release);
        self.sh.mine.set_state(st, Ordering::Release);
        for r in 0..self.sh.size {
            let inbox = self.sh.inbox(r);
            inbox.departures().fetch_add(1, Ordering::AcqRel);
            inbox.doorbell().wake_all(Scope::Shared);
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        drop(self.watch.lock().unwrap_or_else(|p| p.into_inner()).take());
        if !self.closed.load(Ordering::Acquire) {
            self.depart(state::DEAD);
        }
        // A peer may still be reading a rendezvous buffer with CMA (it does
        // not know yet that we are gone): leak those buffers rather than free
        // memory another process is copying from.
        let mut l = self.lock();
        for (_, e) in l.sends.drain() {
            if let SendOwner::Request(core) = e.owner {
                std::mem::forget(core);
            }
        }
        // Likewise a sender may still be writing the tail of a split copy
        // into a receive's buffer.
        for (_, sp) in l.splits.drain() {
            std::mem::forget(sp.target);
        }
    }
}

impl Progress for Engine {
    fn progress(&self) {
        if let Some(mut l) = self.local.try_lock() {
            self.progress_locked(&mut l, None);
        }
    }

    fn wait(&self, core: &RequestCore) {
        let _ = self.block_until(
            true,
            |eng, l| {
                if !core.is_done() {
                    eng.progress_locked(l, None);
                }
                Ok(core.is_done())
            },
            || core.is_done(),
        );
        // A closed device completes every request it holds (receives fail with
        // Closed); spin out the tiny window before that completion lands.
        while !core.is_done() {
            std::thread::yield_now();
        }
    }

    fn cancel(&self, core: &xdev::CoreRef) -> bool {
        let t = unpost(&mut self.lock().matching, core);
        t.map(|t| self.complete_target(t, cancelled())).is_some()
    }
}

/// One rank of a job whose ranks are processes on this host: an xdev
/// [`Device`] over job-private shared memory.
pub struct ProcessDevice {
    engine: Arc<Engine>,
}

impl ProcessDevice {
    /// Opens the device for `config` with the bootstrap service named by the
    /// environment (`XDEV_BOOTSTRAP`, `XDEV_SECRET`; `xdev-run` sets them).
    /// The environment's rank, size and job must match `config`.
    pub fn open(config: &Config) -> Result<ProcessDevice> {
        Self::with_bootstrap(config, Bootstrap::for_config(config)?)
    }

    /// Opens the device for `config` over an already connected bootstrap
    /// (collective: every rank of the job must call it).
    pub fn with_bootstrap(config: &Config, boot: Bootstrap) -> Result<ProcessDevice> {
        config.validate()?;
        boot.check_config(config)?;
        let opts = ProcessOptions::from_config(config)?;
        let opts_cma = opts.cma;
        crate::doorbell::init_fences();
        let (rank, size) = (config.rank, config.size);
        let cma_wanted = opts.cma != CmaMode::Off;
        // Lets sibling ranks read our buffers under Yama ptrace_scope 1
        // (their CMA probe of us comes next); harmless where Yama is absent.
        let grant = cma_wanted.then(crate::cma::PtracerGrant::take);
        let layout = InboxLayout {
            size,
            nslots: opts.nslots(),
        };
        let mut mine = Inbox::create(rank, layout)?;
        // Our inbox's descriptor goes to the job's other ranks over a Unix
        // socket named in our bootstrap record (see segment.rs).
        let offer = crate::fd_pass::FdOffer::listen()
            .map_err(|e| Error::transport("listening to hand out the inbox", e))?;
        let mut rnd = [0u8; 8];
        let _ = getrandom::fill(&mut rnd);
        let probe = Box::new(u64::from_le_bytes(rnd) | 1);
        let info = PeerInfo {
            pid: std::process::id(),
            nslots: layout.nslots as u32,
            credit_bytes: opts.credit_bytes as u64,
            probe_addr: &*probe as *const u64 as u64,
            probe_value: *probe,
            segment: offer.name().to_string(),
        };
        let all = boot.allgather(&info.encode())?;
        let mut infos = Vec::with_capacity(size);
        for (r, b) in all.iter().enumerate() {
            let i = PeerInfo::decode(b).map_err(|what| Error::Protocol { rank: r, what })?;
            if i.nslots != info.nslots || i.credit_bytes != info.credit_bytes {
                return Err(Error::Config(format!(
                    "rank {r} uses ring_bytes/credit_bytes different from rank {rank}'s"
                )));
            }
            // (Ranks that are threads of this process, as tests make them,
            // share its pid; the kernel's check of each hand-over still
            // holds for them.)
            let twice = infos.iter().position(|o: &PeerInfo| o.pid == i.pid);
            if let Some(o) = twice.filter(|_| i.pid != std::process::id()) {
                return Err(Error::Protocol {
                    rank: r,
                    what: format!(
                        "ranks {o} and {r} both name process {}: one record was put by a \
                         process posing as another rank",
                        i.pid
                    ),
                });
            }
            infos.push(i);
        }
        // Each sender gets our control and notice pages and its own ring.
        let mut handouts = Vec::with_capacity(size - 1);
        for (r, i) in infos.iter().enumerate().filter(|&(r, _)| r != rank) {
            let fds = mine
                .share_with(r)
                .expect("our own inbox")
                .map_err(|e| Error::transport("duplicating the inbox descriptors", e))?;
            handouts.push((i.pid, fds));
        }
        let server = offer.serve(handouts);
        let mut peers = Vec::with_capacity(size);
        for (r, i) in infos.iter().enumerate() {
            peers.push(if r == rank {
                None
            } else {
                // The serving process must be the one the record names (the
                // kernel says who serves), and the inbox's header must name it.
                let fds =
                    crate::fd_pass::take(&i.segment, segment::SHARED_FDS, i.pid).map_err(|e| {
                        match e.kind() {
                            std::io::ErrorKind::PermissionDenied => Error::Protocol {
                                rank: r,
                                what: format!("rank {r}'s record: {e}"),
                            },
                            _ => Error::transport(format!("receiving rank {r}'s inbox"), e),
                        }
                    })?;
                Some(Inbox::attach(fds, r, rank, i.pid, layout)?)
            });
        }
        // Every rank we know of took our inbox, each checked by the kernel's
        // account of its process, before we enter the barrier: a rank whose
        // record another process replaced never gets through both checks
        // (it or we refuse), so nobody passes the barrier and no message
        // goes anywhere (SECURITY.md, "Whom a rank trusts").
        server
            .join()
            .map_err(|_| {
                Error::transport("handing out the inbox", std::io::Error::other("panicked"))
            })?
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::PermissionDenied => Error::Protocol {
                    rank,
                    what: format!("handing out rank {rank}'s inbox: {e}"),
                },
                _ => Error::transport("handing out the inbox", e),
            })?;
        // Everyone has attached every inbox: our descriptors can go.
        boot.barrier()?;
        mine.close_descriptors();
        let pids: Vec<u32> = infos.iter().map(|i| i.pid).collect();
        let sh = Arc::new(Shared {
            rank,
            size,
            eager_max: opts
                .eager_limit
                .min(crate::ring::max_payload_for(layout.nslots)),
            fragment: opts
                .fragment_bytes
                .min(crate::ring::max_payload_for(layout.nslots)),
            opts,
            mine,
            peers,
            pids: pids.clone(),
            exited: (0..size).map(|_| AtomicBool::new(false)).collect(),
        });
        let watched: Vec<(Rank, u32)> = (0..size)
            .filter(|&r| r != rank)
            .map(|r| (r, pids[r]))
            .collect();
        let w = sh.clone();
        let watch = PeerWatch::start(watched, move |r| {
            w.exited[r].store(true, Ordering::Release);
            w.mine.departures().fetch_add(1, Ordering::AcqRel);
            w.mine.doorbell().wake_all(Scope::Shared);
        })
        .map_err(|e| Error::transport("starting the peer watch", e))?;
        let rendezvous = if !cma_wanted {
            RendezvousPath::Pipelined("disabled by option cma=off".into())
        } else {
            let p = (rank + 1) % size;
            let mut got = [0u8; 8];
            match crate::cma::read_remote(pids[p], infos[p].probe_addr, &mut got) {
                Ok(()) if u64::from_le_bytes(got) == infos[p].probe_value => {
                    match (opts_cma, crate::cma::calibrate()) {
                        (CmaMode::Auto, Some(speed)) if speed < CMA_MIN_SPEED => {
                            RendezvousPath::Pipelined(format!(
                                "CMA runs at {:.2} of memcpy's speed here (below {CMA_MIN_SPEED}; \
                                 cma=on forces it)",
                                speed
                            ))
                        }
                        _ => RendezvousPath::Cma,
                    }
                }
                Ok(()) => {
                    RendezvousPath::Pipelined(format!("CMA probe of rank {p} read the wrong value"))
                }
                Err(e) => RendezvousPath::Pipelined(format!(
                    "process_vm_readv from rank {p} refused: {e}"
                )),
            }
        };
        let cma_ok = rendezvous == RendezvousPath::Cma;
        // Not using CMA: nobody needs to attach to us (peers that chose CMA
        // get EPERM and fall back to the pipelined copy for us).
        let grant = if cma_ok { grant } else { None };
        let n = size;
        let local = Local {
            // SAFETY: each ring lives in a mapping held by `sh` (kept alive by
            // the engine for as long as Local); this rank is the only consumer
            // of the rings in its own inbox and the only producer of its ring
            // in every peer's inbox.
            consumers: (0..n)
                .map(|s| unsafe { Consumer::new(sh.mine.ring(s)) })
                .collect(),
            // SAFETY: as above.
            producers: (0..n)
                .map(|d| unsafe { Producer::new(sh.inbox(d).ring(rank)) })
                .collect(),
            matching: MatchingEngine::new(),
            backlog: (0..n).map(|_| VecDeque::new()).collect(),
            backlog_total: 0,
            control: (0..n).map(|_| VecDeque::new()).collect(),
            control_total: 0,
            sends: HashMap::new(),
            next_id: 1,
            streams_out: (0..n).map(|_| VecDeque::new()).collect(),
            streams_total: 0,
            streams_in: HashMap::new(),
            copies: VecDeque::new(),
            splits: HashMap::new(),
            splits_done: 0,
            defer_copies: false,
            spare_payloads: Vec::new(),
            rndv_out: vec![0; n],
            rndv_in: vec![0; n],
            eager_sent: vec![0; n],
            freed_seen: vec![0; n],
            freed_local: vec![0; n],
            eager_recv: vec![0; n],
            cma: vec![cma_ok; n],
            departures_seen: 0,
            events: 0,
            gone: vec![false; n],
            gone_why: vec![None; n],
            broken: vec![false; n],
        };
        Ok(ProcessDevice {
            engine: Arc::new(Engine {
                sh,
                tracker: Arc::new(Tracker::new()),
                local: RankLock::new(local),
                closing: AtomicBool::new(false),
                closed: AtomicBool::new(false),
                watch: Mutex::new(Some(watch)),
                rendezvous,
                _boot: boot,
                _probe: probe,
                ptracer: Mutex::new(grant),
            }),
        })
    }

    /// The options in force.
    pub fn options(&self) -> &ProcessOptions {
        &self.engine.sh.opts
    }

    /// How rendezvous data moves, as found at start-up: CMA, or the
    /// pipelined copy and why. (A later `EPERM` from a peer also switches
    /// that peer to the pipelined path.)
    pub fn rendezvous(&self) -> &RendezvousPath {
        &self.engine.rendezvous
    }
}

impl Device for ProcessDevice {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn id(&self) -> Rank {
        self.engine.sh.rank
    }

    fn size(&self) -> usize {
        self.engine.sh.size
    }

    fn send(&self, buf: &[u8], dest: Rank, tag: Tag, context: Context) -> Result<()> {
        self.engine.blocking_send(buf, dest, tag, context, false)
    }

    fn ssend(&self, buf: &[u8], dest: Rank, tag: Tag, context: Context) -> Result<()> {
        self.engine.blocking_send(buf, dest, tag, context, true)
    }

    fn recv(
        &self,
        buf: &mut [u8],
        source: Source,
        tag: TagSel,
        context: Context,
    ) -> Result<Status> {
        self.engine
            .recv_into(buf, Pattern::new(source, tag, context))
    }

    fn isend(&self, buf: Buffer, dest: Rank, tag: Tag, context: Context) -> Request {
        self.engine.start_send(buf, dest, tag, context, false)
    }

    fn issend(&self, buf: Buffer, dest: Rank, tag: Tag, context: Context) -> Request {
        self.engine.start_send(buf, dest, tag, context, true)
    }

    fn irecv(&self, buf: Buffer, source: Source, tag: TagSel, context: Context) -> Request {
        let eng = &self.engine;
        let pattern = Pattern::new(source, tag, context);
        if let Err(e) = check_recv(source, tag, eng.sh.size).and_then(|_| eng.check_open()) {
            let env = Envelope {
                source: eng.sh.rank,
                tag: -1,
                context,
            };
            let core = eng
                .tracker
                .rejected(RequestKind::Recv, buf, Status::failed(env, e));
            return Request::new(core, eng.clone());
        }
        let mut l = eng.lock();
        if eng.closing.load(Ordering::Acquire) {
            // `finish` began after our first check; it sets `closing` before
            // it empties the queues under this lock, so nothing posted now
            // would be completed.
            drop(l);
            let env = Envelope {
                source: eng.sh.rank,
                tag: -1,
                context,
            };
            let core =
                eng.tracker
                    .rejected(RequestKind::Recv, buf, Status::failed(env, Error::Closed));
            return Request::new(core, eng.clone());
        }
        // A rendezvous this call matches is not copied here (see
        // `Outcome::Copy`): the caller may have sends to post that its peer
        // is waiting for. Every exit below clears the flag.
        l.defer_copies = true;
        // The common case first: nothing else is posted (so this receive
        // may take the first match) and the message is already here, in the
        // unexpected queue or at the head of its sender's ring. An eager
        // message is copied straight into `buf` and the request is born
        // complete; a pipelined one streams into the request made for it.
        let mut buf = buf;
        if l.matching.posted_len() == 0 {
            let mut direct = Direct::new(pattern, &mut buf, true);
            if !eng.direct_from_unexpected(&mut l, &mut direct) {
                if let Source::Rank(s) = source {
                    if s != eng.sh.rank && !l.gone[s] {
                        eng.drain(&mut l, s, Some(&mut direct), true);
                    }
                }
            }
            let (status, deferred) = (direct.status, direct.deferred);
            if let Some(status) = status {
                l.defer_copies = false;
                drop(l);
                return eng.tracker.completed(RequestKind::Recv, buf, status);
            }
            if let Some(deferred) = deferred {
                // (The pool's lock is a leaf: taking it under ours is fine.)
                let core = eng.tracker.start(RequestKind::Recv, buf);
                let target = Target::Request(core.clone());
                match deferred {
                    Deferred::Stream { env, id, len } => {
                        eng.start_stream(&mut l, env, id, len, target)
                    }
                    Deferred::Copy { env, id, addr, len } => l.copies.push_back(PendingCopy {
                        env,
                        id,
                        addr,
                        len,
                        target,
                    }),
                }
                l.defer_copies = false;
                drop(l);
                return Request::new(core, eng.clone());
            }
        }
        let core = eng.tracker.start(RequestKind::Recv, buf);
        match l.matching.post(pattern, Target::Request(core.clone())) {
            Posted::Matched { env, msg, recv } => {
                let (p, n) = recv.dst();
                let out = eng.deliver_unexpected(&mut l, env, msg, p, n);
                eng.settle(&mut l, env, out, recv);
            }
            Posted::Queued(id) => {
                core.set_token(id.as_u64());
                // A receive naming a peer that already left fails at once
                // (after what it sent has been drained).
                if let Source::Rank(s) = source {
                    let leave_unmatched = !l.gone[s];
                    eng.drain(&mut l, s, None, leave_unmatched);
                    if l.gone[s] && s != eng.sh.rank && !core.is_done() {
                        if let Some(t) = l.matching.cancel(id) {
                            let env = Envelope {
                                source: s,
                                tag: -1,
                                context,
                            };
                            let err = gone_error(&l, s);
                            eng.complete_target(t, Status::failed(env, err));
                        }
                    }
                }
            }
        }
        l.defer_copies = false;
        drop(l);
        Request::new(core, eng.clone())
    }

    fn probe(&self, source: Source, tag: TagSel, context: Context) -> Result<Status> {
        let eng = &self.engine;
        check_recv(source, tag, eng.sh.size)?;
        eng.check_open()?;
        let pattern = Pattern::new(source, tag, context);
        let mut found = None;
        eng.block_until(
            true,
            |eng, l| {
                found = eng.probe_once(l, &pattern);
                if found.is_none() {
                    if let Source::Rank(s) = source {
                        if l.gone[s] && s != eng.sh.rank {
                            return Err(gone_error(l, s));
                        }
                    }
                }
                Ok(found.is_some())
            },
            || false,
        )?;
        found.ok_or(Error::Closed)
    }

    fn iprobe(&self, source: Source, tag: TagSel, context: Context) -> Result<Option<Status>> {
        let eng = &self.engine;
        check_recv(source, tag, eng.sh.size)?;
        eng.check_open()?;
        let pattern = Pattern::new(source, tag, context);
        let mut l = eng.lock();
        Ok(eng.probe_once(&mut l, &pattern))
    }

    fn peek(&self) -> Result<Option<Peeked>> {
        let eng = &self.engine;
        let mut found = None;
        eng.block_until(
            true,
            |eng, l| {
                eng.progress_locked(l, None);
                found = eng.tracker.pop_completed();
                Ok(found.is_some() || eng.tracker.outstanding() == 0)
            },
            || false,
        )?;
        Ok(found.or_else(|| eng.tracker.pop_completed()))
    }

    fn progress(&self) {
        xdev::Progress::progress(&*self.engine)
    }

    fn finish(&self) -> Result<()> {
        self.engine.finish()
    }
}

/// Adds the `shm` device to `registry`.
pub fn register(registry: &mut Registry) {
    registry.register(Entry {
        name: "shm",
        description: "ranks as processes on one host; shared-memory rings, CMA rendezvous",
        placement: Placement::Processes,
        open: |cfg| Ok(Arc::new(ProcessDevice::open(cfg)?) as Arc<dyn Device>),
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use xdev::bootstrap::{BootstrapServer, Secret};

    /// Two ranks of one job as two devices in this process (threads).
    fn pair(options: &[(&str, &str)]) -> (ProcessDevice, ProcessDevice) {
        static JOBS: AtomicU64 = AtomicU64::new(0);
        let job = format!(
            "unit-{}-{}",
            std::process::id(),
            JOBS.fetch_add(1, Ordering::Relaxed)
        );
        let secret = Secret::generate().unwrap();
        let server =
            BootstrapServer::start("127.0.0.1:0".parse().unwrap(), 2, &job, secret.clone())
                .unwrap();
        let addr = server.addr();
        let mut devs: Vec<ProcessDevice> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|rank| {
                    let (job, secret) = (job.clone(), secret.clone());
                    s.spawn(move || {
                        let boot = Bootstrap::connect(addr, rank, 2, &job, &secret).unwrap();
                        let mut cfg = Config::new(rank, 2, job);
                        for (k, v) in options {
                            cfg = cfg.with(k, v);
                        }
                        ProcessDevice::with_bootstrap(&cfg, boot).unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        std::mem::forget(server); // lives as long as the test process
        let d1 = devs.pop().unwrap();
        (devs.pop().unwrap(), d1)
    }

    /// Rank 1 pushes a raw entry into its ring to rank 0, bypassing its
    /// protocol (a buggy or hostile peer).
    fn raw_push(from: &ProcessDevice, to: Rank, h: Header, payload: &[u8]) -> bool {
        let mut l = from.engine.lock();
        let ok = l.producers[to].try_push(&h, payload).unwrap();
        from.engine.sh.wake(to);
        ok
    }

    fn recv_from_1(d0: &ProcessDevice) -> Result<Status> {
        let mut buf = [0u8; 256];
        d0.recv(&mut buf, Source::Rank(1), TagSel::Any, 1)
    }

    fn assert_violation(d0: &ProcessDevice, needle: &str) {
        match recv_from_1(d0) {
            Err(Error::Protocol { rank: 1, what }) => assert!(what.contains(needle), "{what}"),
            other => panic!("expected a protocol violation by rank 1, got {other:?}"),
        }
        // Rank 1 is cut off; rank 0 itself still works.
        d0.send(b"self", 0, 5, 1).unwrap();
        let mut b = [0u8; 4];
        d0.recv(&mut b, Source::Rank(0), TagSel::Tag(5), 1).unwrap();
        assert_eq!(&b, b"self");
        // New operations involving rank 1 fail with the same cause.
        assert!(matches!(
            d0.send(b"x", 1, 0, 1),
            Err(Error::Protocol { rank: 1, .. })
        ));
        let r = d0
            .irecv(Buffer::zeroed(4), Source::Rank(1), TagSel::Any, 1)
            .wait();
        assert!(matches!(
            r.status.error,
            Some(Error::Protocol { rank: 1, .. })
        ));
    }

    #[test]
    fn an_irecv_leaves_its_cma_copy_to_the_next_progress() {
        // A posting call that copied a large message it matched would keep
        // its caller from posting the sends its peer waits for (measured:
        // osu_bibw at 1 MiB went from 5.0 to 10.7 GB/s without it).
        let (d0, d1) = pair(&[("cma", "on")]);
        assert_eq!(d0.rendezvous(), &RendezvousPath::Cma);
        let big: Vec<u8> = (0..1_000_000u32).map(|i| (i % 253) as u8).collect();
        for (round, probe_first) in [(0, false), (1, true), (2, false)] {
            let send = d1.isend(Buffer::from(big.clone()), 0, 5, 3);
            if probe_first {
                // In the unexpected queue rather than the ring.
                while d0
                    .iprobe(Source::Rank(1), TagSel::Tag(5), 3)
                    .unwrap()
                    .is_none()
                {}
            } else {
                while !d0.engine.sh.mine.ring(1).has_message() {}
            }
            // Round 2: another receive is posted first (the queued path).
            let other = (round == 2)
                .then(|| d0.irecv(Buffer::zeroed(8), Source::Rank(1), TagSel::Tag(6), 3));
            let r = d0.irecv(
                Buffer::zeroed(big.len()),
                Source::Rank(1),
                TagSel::Tag(5),
                3,
            );
            assert_eq!(d0.engine.lock().copies.len(), 1, "round {round}");
            let Err(r) = r.take_if_done() else {
                panic!("round {round}: copied inside irecv");
            };
            // (The sender writes half of it: it must make progress too.)
            let got = std::thread::scope(|s| {
                s.spawn(|| assert!(send.wait().status.error.is_none()));
                r.wait()
            });
            assert!(got.status.error.is_none(), "{:?}", got.status);
            assert!(got.buf[..] == big[..], "round {round}: wrong bytes");
            if let Some(o) = other {
                assert!(d1.send(&[7; 8], 0, 6, 3).is_ok());
                assert!(o.wait().status.error.is_none());
            }
        }
        d0.finish().unwrap();
        d1.finish().unwrap();
    }

    #[test]
    fn finish_does_the_copies_left_by_irecv() {
        let (d0, d1) = pair(&[("cma", "on")]);
        let big = vec![0xA5u8; 300_000];
        let send = d1.isend(Buffer::from(big.clone()), 0, 5, 3);
        while !d0.engine.sh.mine.ring(1).has_message() {}
        let r = d0.irecv(
            Buffer::zeroed(big.len()),
            Source::Rank(1),
            TagSel::Tag(5),
            3,
        );
        let Err(r) = r.take_if_done() else {
            panic!("copied inside irecv");
        };
        std::thread::scope(|s| {
            s.spawn(|| d1.finish().unwrap());
            d0.finish().unwrap();
        });
        let got = r.wait();
        assert!(got.status.error.is_none(), "{:?}", got.status);
        assert!(got.buf[..] == big[..]);
        assert!(send.wait().status.error.is_none());
    }

    #[test]
    fn an_irecv_takes_messages_already_here_and_streams_pipelined_ones() {
        // cma=off: a large message goes by the pipelined copy. Each kind
        // arrives before its receive is posted, once still in the ring and
        // once already moved to the unexpected queue (by a probe).
        let (d0, d1) = pair(&[("cma", "off"), ("eager_limit", "1024")]);
        let big: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        for (round, probe_first) in [(0, false), (1, true)] {
            let small = d1.isend(Buffer::from(vec![round as u8; 100]), 0, 1, 9);
            let large = d1.isend(Buffer::from(big.clone()), 0, 2, 9);
            assert!(small.wait().status.error.is_none());
            let (small_st, large_buf) = std::thread::scope(|s| {
                s.spawn(|| {
                    // Give rank 0 the large message (it streams as rank 0
                    // asks for fragments).
                    while !d1.engine.lock().sends.is_empty() || !large_done(&d1) {
                        d1.progress();
                    }
                });
                if probe_first {
                    while d0
                        .iprobe(Source::Rank(1), TagSel::Tag(2), 9)
                        .unwrap()
                        .is_none()
                    {}
                } else {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                let small = d0
                    .irecv(Buffer::zeroed(100), Source::Rank(1), TagSel::Tag(1), 9)
                    .wait();
                let large = d0
                    .irecv(
                        Buffer::zeroed(big.len()),
                        Source::Rank(1),
                        TagSel::Tag(2),
                        9,
                    )
                    .wait();
                (small, large)
            });
            assert!(small_st.status.error.is_none(), "{:?}", small_st.status);
            assert_eq!(&small_st.buf[..], &[round as u8; 100][..]);
            assert!(large_buf.status.error.is_none(), "{:?}", large_buf.status);
            assert_eq!(large_buf.status.count, big.len());
            assert!(large_buf.buf[..] == big[..], "round {round}: wrong bytes");
            drop(large);
        }
        d0.finish().unwrap();
        d1.finish().unwrap();
    }

    fn large_done(d: &ProcessDevice) -> bool {
        d.engine.tracker.outstanding_sends() == 0
    }

    #[test]
    fn finish_racing_with_posts_leaves_no_request_behind() {
        for i in 0..200 {
            let (d0, d1) = pair(&[]);
            let go = std::sync::Barrier::new(3);
            let posted = std::thread::scope(|s| {
                let poster = |tag: i32| {
                    let (d0, go) = (&d0, &go);
                    move || {
                        let mut reqs = Vec::new();
                        go.wait();
                        loop {
                            let r =
                                d0.irecv(Buffer::zeroed(8), Source::Rank(1), TagSel::Tag(tag), 0);
                            match r.test() {
                                Ok(c) if c.status.error == Some(Error::Closed) => break,
                                Ok(c) => panic!("unexpected completion {:?}", c.status),
                                Err(r) => reqs.push(r),
                            }
                        }
                        reqs
                    }
                };
                let a = s.spawn(poster(1));
                let b = s.spawn(poster(2));
                go.wait();
                let _ = d0.finish();
                let mut all = a.join().unwrap();
                all.extend(b.join().unwrap());
                all
            });
            for mut r in posted {
                let t = std::time::Instant::now();
                loop {
                    match r.test() {
                        Ok(_) => break,
                        Err(back) => r = back,
                    }
                    assert!(
                        t.elapsed() < std::time::Duration::from_secs(5),
                        "iteration {i}: a request posted during finish never completed"
                    );
                    std::thread::yield_now();
                }
            }
            let _ = d1.finish();
        }
    }

    /// Clears CAP_SYS_PTRACE from this process's effective and permitted
    /// capabilities (raw capget/capset: async-signal-safe, for a forked
    /// child).
    fn drop_cap_sys_ptrace() {
        #[repr(C)]
        struct Header {
            version: u32,
            pid: i32,
        }
        #[repr(C)]
        #[derive(Copy, Clone, Default)]
        struct Data {
            effective: u32,
            permitted: u32,
            inheritable: u32,
        }
        const VERSION_3: u32 = 0x2008_0522;
        const CAP_SYS_PTRACE: u32 = 19;
        let mut h = Header {
            version: VERSION_3,
            pid: 0,
        };
        let mut d = [Data::default(); 2];
        // SAFETY: header and two data records, as version 3 of the
        // capability ABI wants; the kernel writes only `d`.
        unsafe {
            libc::syscall(libc::SYS_capget, &mut h as *mut Header, d.as_mut_ptr());
        }
        // Effective only: Yama asks whether the tracer is capable (the
        // effective set), while the commoncap check wants the tracee's
        // permitted set to be a subset of the tracer's permitted set, which
        // a child that also dropped it from its permitted set would fail
        // whatever Yama says (root parent, full permitted set).
        d[0].effective &= !(1 << CAP_SYS_PTRACE);
        // SAFETY: as above; the kernel only reads `d`.
        unsafe {
            libc::syscall(libc::SYS_capset, &mut h as *mut Header, d.as_ptr());
        }
    }

    #[test]
    fn ptrace_is_allowed_only_while_cma_is_used() {
        // Yama (ptrace_scope 1) is what PR_SET_PTRACER talks to: without it
        // any same-user process may attach whatever we do.
        match std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope") {
            Err(_) => {
                println!(
                    "skipped: no Yama LSM in this kernel, PR_SET_PTRACER has no effect \
                     (the VM suite runs this with ptrace_scope 1)"
                );
                return;
            }
            Ok(s) if s.trim() != "1" => {
                println!("skipped: Yama ptrace_scope is {}, not 1", s.trim());
                return;
            }
            Ok(_) => {}
        }
        let secret = Box::new(0x5eed_cafe_u64);
        let addr = &*secret as *const u64 as u64;
        // A child (not an ancestor of us) reads 8 bytes of ours by CMA.
        let child_reads = || -> bool {
            // SAFETY: the child only makes a system call and `_exit`s, both
            // async-signal-safe, as required after fork in a threaded process.
            let pid = unsafe { libc::fork() };
            assert!(pid >= 0, "fork failed");
            if pid == 0 {
                // Root's CAP_SYS_PTRACE passes Yama's check whatever we
                // declared: drop it, as an ordinary same-user process.
                drop_cap_sys_ptrace();
                let mut got = 0u64;
                let local = libc::iovec {
                    iov_base: (&mut got as *mut u64).cast(),
                    iov_len: 8,
                };
                let remote = libc::iovec {
                    iov_base: addr as *mut libc::c_void,
                    iov_len: 8,
                };
                // SAFETY: the local iovec points at our own `got`; the remote
                // one is checked by the kernel.
                let n =
                    unsafe { libc::process_vm_readv(libc::getppid(), &local, 1, &remote, 1, 0) };
                let code = if n == 8 && got == 0x5eed_cafe { 0 } else { 1 };
                // SAFETY: ends the forked child without running anything else.
                unsafe { libc::_exit(code) };
            }
            let mut status = 0;
            // SAFETY: waits for our own child.
            unsafe { libc::waitpid(pid, &mut status, 0) };
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0
        };
        assert!(!child_reads(), "no grant yet: a child cannot attach");
        let (d0, d1) = pair(&[("cma", "on")]);
        assert_eq!(d0.rendezvous(), &RendezvousPath::Cma);
        assert!(child_reads(), "CMA in use: siblings may read us");
        d0.finish().unwrap();
        assert!(child_reads(), "one device still uses CMA");
        d1.finish().unwrap();
        assert!(!child_reads(), "both finished: the grant is gone");
        let (d0, d1) = pair(&[("cma", "off")]);
        assert!(!child_reads(), "cma=off never opens us");
        drop((d0, d1));
        drop(secret);
    }

    thread_local! {
        /// Makes the next blocking send of this thread panic right after
        /// it is published (fault injection for the unwind test).
        pub(super) static PANIC_AFTER_PUBLISH: std::cell::Cell<bool> =
            const { std::cell::Cell::new(false) };
        /// Makes the next pipelined transfer into a blocking receive of
        /// this thread panic right after it is registered.
        pub(super) static PANIC_AFTER_STREAM: std::cell::Cell<bool> =
            const { std::cell::Cell::new(false) };
    }

    #[test]
    fn a_blocking_recv_that_unwinds_is_written_no_more() {
        let (d0, d1) = pair(&[("cma", "off"), ("eager_limit", "1024")]);
        let data = vec![0x5au8; 200_000];
        let send = d1.isend(Buffer::from(data), 0, 4, 0);
        let mut block = vec![0u8; 200_000];
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            PANIC_AFTER_STREAM.with(|p| p.set(true));
            d0.recv(&mut block, Source::Rank(1), TagSel::Tag(4), 0)
        }));
        assert!(unwound.is_err(), "the injected panic unwound the receive");
        // The caller owns its block again: nothing may write it now, even
        // as both engines go on (the sender streams to an abandoned id).
        block.fill(0xaa);
        let t = std::time::Instant::now();
        while t.elapsed() < std::time::Duration::from_millis(300) {
            d0.progress();
            d1.progress();
        }
        assert!(
            block.iter().all(|&b| b == 0xaa),
            "written after the receive unwound"
        );
        drop(send);
        drop((d0, d1));
    }

    #[test]
    fn a_blocking_recv_that_unwinds_waits_for_the_sender_writing_into_it() {
        // A split copy: the sender writes the second half into the
        // receiver's slice. The receive unwinds right after it asked; its
        // guard must wait until the sender is done, so that the caller's
        // block is written no more once it has it back.
        let (d0, d1) = pair(&[("cma", "on")]);
        let data = vec![0x5au8; 1 << 20];
        let mut block = vec![0u8; 1 << 20];
        std::thread::scope(|s| {
            let sender = s.spawn(|| {
                let send = d1.isend(Buffer::from(data.clone()), 0, 4, 0);
                assert!(send.wait().status.error.is_none());
            });
            let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                PANIC_AFTER_STREAM.with(|p| p.set(true));
                d0.recv(&mut block, Source::Rank(1), TagSel::Tag(4), 0)
            }));
            assert!(unwound.is_err(), "the injected panic unwound the receive");
            assert!(d0.engine.lock().splits.is_empty(), "the guard waited");
            // Both halves landed before the guard let go.
            assert!(block.iter().all(|&b| b == 0x5a));
            block.fill(0xaa);
            sender.join().unwrap();
        });
        let t = std::time::Instant::now();
        while t.elapsed() < std::time::Duration::from_millis(100) {
            d0.progress();
            d1.progress();
        }
        assert!(block.iter().all(|&b| b == 0xaa), "written after the guard");
    }

    #[test]
    fn a_blocking_send_that_unwinds_still_waits_for_its_receiver() {
        // cma=off: the pipelined copy reads the sender's buffer as the
        // receiver asks for fragments, long after the send was published.
        let (d0, d1) = pair(&[("cma", "off"), ("eager_limit", "1024")]);
        let want: Vec<u8> = (0..65_536u32).map(|i| (i * 7 % 251) as u8).collect();
        let got = std::thread::scope(|s| {
            let receiver = s.spawn(|| {
                std::thread::sleep(std::time::Duration::from_millis(50));
                let mut buf = vec![0u8; 65_536];
                let st = d0.recv(&mut buf, Source::Rank(1), TagSel::Tag(3), 0);
                (st, buf)
            });
            let mut block = want.clone();
            let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                PANIC_AFTER_PUBLISH.with(|p| p.set(true));
                d1.send(&block, 0, 3, 0)
            }));
            assert!(unwound.is_err(), "the injected panic unwound the send");
            // The caller reuses its block at once: had the send returned
            // before the receiver was done, the engine (driven below) would
            // stream these bytes.
            block.fill(0xee);
            while !receiver.is_finished() {
                d1.progress();
            }
            receiver.join().unwrap()
        });
        let (st, buf) = got;
        assert_eq!(st.unwrap().count, 65_536);
        assert!(buf == want, "the receiver got the reused block's bytes");
        d0.finish().unwrap();
        d1.finish().unwrap();
    }

    fn rss() -> usize {
        let s = std::fs::read_to_string("/proc/self/statm").unwrap();
        let pages: usize = s.split_whitespace().nth(1).unwrap().parse().unwrap();
        pages * 4096
    }

    #[test]
    fn a_large_receive_is_copied_by_both_sides_and_lands_whole() {
        // Measured: osu_bw 4 MiB 4.9 -> 10.1-11.0 GB/s, 256 KiB 10.0 ->
        // 16.9-19.4 GB/s with the split (cma_split_bytes=0 against the
        // default, one size at a time, three alternating rounds).
        let (d0, d1) = pair(&[("cma", "on")]);
        for len in [128 << 10, (1 << 20) + 4097, 3 << 20] {
            let data: Vec<u8> = (0..len as u32).map(|i| (i % 249) as u8).collect();
            let recv = d0.irecv(Buffer::zeroed(len), Source::Rank(1), TagSel::Tag(8), 4);
            let send = d1.isend(Buffer::from(data.clone()), 0, 8, 4);
            std::thread::scope(|s| {
                s.spawn(|| assert!(send.wait().status.error.is_none()));
                let got = recv.wait();
                assert!(got.status.error.is_none(), "{:?}", got.status);
                assert_eq!(got.status.count, len);
                assert!(got.buf[..] == data[..], "{len}: wrong bytes");
            });
        }
        assert_eq!(d0.engine.lock().splits_done, 3, "every copy was split");
        // A blocking receive is split too (its guard waits for the sender).
        let data = vec![0x77u8; 1 << 20];
        std::thread::scope(|s| {
            s.spawn(|| d1.send(&data, 0, 9, 4).unwrap());
            let mut buf = vec![0u8; 1 << 20];
            d0.recv(&mut buf, Source::Rank(1), TagSel::Tag(9), 4)
                .unwrap();
            assert!(buf == data);
        });
        assert_eq!(d0.engine.lock().splits_done, 4);
        // Below the threshold, or with it off, nothing is split.
        let (d2, d3) = pair(&[("cma", "on"), ("cma_split_bytes", "0")]);
        let recv = d2.irecv(Buffer::zeroed(1 << 20), Source::Rank(1), TagSel::Tag(8), 4);
        let send = d3.isend(Buffer::from(vec![5u8; 1 << 20]), 0, 8, 4);
        std::thread::scope(|s| {
            s.spawn(|| assert!(send.wait().status.error.is_none()));
            assert!(recv.wait().buf.iter().all(|&b| b == 5));
        });
        assert_eq!(d2.engine.lock().splits_done, 0);
    }

    #[test]
    fn a_write_request_for_a_send_not_held_is_a_violation() {
        // A hostile receiver asks for the tail of a send that does not
        // exist (or asks twice): the sender fails it, writes nothing.
        let (d0, d1) = pair(&[("cma", "on")]);
        let h = Header {
            kind: KIND_WRITE,
            cookie: 12345,
            aux: 0x1000,
            context: 1,
            ..Header::default()
        };
        assert!(raw_push(&d0, 1, h, &[]));
        d1.progress();
        let l = d1.engine.lock();
        assert!(l.broken[0], "the asking rank was failed");
        drop(l);
        let e = d1.send(&[1; 8], 0, 1, 1).unwrap_err();
        assert!(
            matches!(&e, Error::Protocol { rank: 0, what } if what.contains("WRITE")),
            "{e:?}"
        );
        // And a WROTE for a receive never split is one too.
        let (d2, d3) = pair(&[("cma", "on")]);
        let h = Header {
            kind: KIND_WROTE,
            cookie: 7,
            ..Header::default()
        };
        assert!(raw_push(&d3, 0, h, &[]));
        d2.progress();
        assert!(d2.engine.lock().broken[1]);
    }

    #[test]
    fn a_departed_receivers_write_request_is_not_served() {
        // Issue 21: a KIND_WRITE was served while draining a peer already
        // known to have left, by pid: with the pid recycled, the sender
        // wrote into an unrelated process. Here the "receiver" is this very
        // process, so a write that happens lands in `target`.
        let (d0, d1) = pair(&[("cma", "on")]);
        let len = 256 << 10;
        let send = d1.isend(Buffer::from(vec![0xAB; len]), 0, 5, 2);
        let id = {
            let l = d1.engine.lock();
            assert_eq!(l.sends.len(), 1, "a rendezvous waits for rank 0");
            *l.sends.keys().next().unwrap()
        };
        let mut target = vec![0u8; len];
        let half = len / 2;
        let h = Header {
            kind: KIND_WRITE,
            cookie: id,
            aux: target.as_mut_ptr() as u64 + half as u64,
            context: (half / SPLIT_PAGE) as u32,
            ..Header::default()
        };
        // Rank 0 asks for the tail, then leaves before rank 1 gets to it.
        assert!(raw_push(&d0, 1, h, &[]));
        d0.engine.depart(state::DEAD);
        for _ in 0..10 {
            d1.progress();
        }
        assert!(
            std::hint::black_box(&target).iter().all(|&b| b == 0),
            "the departed rank's request was served"
        );
        assert!(!d1.engine.lock().broken[0], "a valid request, dropped");
        let st = send.wait().status;
        assert!(
            matches!(st.error, Some(Error::PeerLost { rank: 0, .. })),
            "{st:?}"
        );
    }

    #[test]
    fn a_departed_senders_rendezvous_is_not_read() {
        // The read side of the same gap: a rendezvous matched while
        // draining a sender that has left is not copied from its pid.
        let (d0, d1) = pair(&[("cma", "on"), ("cma_split_bytes", "0")]);
        let len = 256 << 10;
        let recv = d0.irecv(Buffer::zeroed(len), Source::Rank(1), TagSel::Tag(5), 2);
        let _send = d1.isend(Buffer::from(vec![0xAB; len]), 0, 5, 2);
        // It leaves with its send outstanding.
        d1.engine.depart(state::DEAD);
        let done = recv.wait();
        assert!(
            matches!(done.status.error, Some(Error::PeerLost { rank: 1, .. })),
            "{:?}",
            done.status
        );
        assert!(
            done.buf.iter().all(|&b| b == 0),
            "read from a departed sender"
        );
    }

    #[test]
    fn a_flood_of_rendezvous_headers_is_bounded_at_the_receiver() {
        // A hostile sender writes rendezvous starts straight into its ring,
        // far beyond the window, keeping it full; the receiver keeps at most
        // the window's worth, then fails that sender, and its memory stays
        // flat.
        let (d0, d1) = pair(&[("rndv_window", "256")]);
        let rss_before = rss();
        let mut pushed = 0u64;
        let t = std::time::Instant::now();
        while t.elapsed() < std::time::Duration::from_secs(2) && pushed < 200_000 {
            let h = Header {
                kind: KIND_RNDV,
                tag: 1,
                context: 3,
                len: 8,
                cookie: pushed,
                aux: 1 << 20,
                ..Header::default()
            };
            if raw_push(&d1, 0, h, &0x1000u64.to_le_bytes()) {
                pushed += 1;
            } else {
                d0.progress();
            }
            let l = d0.engine.lock();
            assert!(
                l.matching.unexpected_len() <= 256,
                "held {}",
                l.matching.unexpected_len()
            );
            if l.broken[1] {
                break;
            }
        }
        d0.progress();
        {
            let l = d0.engine.lock();
            assert!(
                l.broken[1],
                "the flooding sender was failed after {pushed} headers"
            );
            assert!(l.matching.unexpected_len() <= 256);
        }
        let e = recv_from_1(&d0).unwrap_err();
        assert!(
            matches!(&e, Error::Protocol { rank: 1, what } if what.contains("unfinished rendezvous")),
            "{e:?}"
        );
        let grown = rss().saturating_sub(rss_before);
        assert!(grown < 8 << 20, "receiver grew by {grown} bytes");
    }

    #[test]
    fn a_sender_beyond_its_rendezvous_window_waits_and_loses_nothing() {
        let (d0, d1) = pair(&[("rndv_window", "16"), ("eager_limit", "1024")]);
        let n = 200u32;
        let sends: Vec<Request> = (0..n)
            .map(|i| d1.isend(Buffer::from(vec![i as u8; 4096]), 0, 5, 2))
            .collect();
        assert!(d1.engine.lock().rndv_out[0] <= 16, "the window holds");
        for i in 0..n {
            let mut buf = vec![0u8; 4096];
            let st = std::thread::scope(|s| {
                let h = s.spawn(|| d0.recv(&mut buf, Source::Rank(1), TagSel::Tag(5), 2));
                while !h.is_finished() {
                    d1.progress();
                }
                h.join().unwrap()
            });
            assert_eq!(st.unwrap().count, 4096);
            assert!(
                buf.iter().all(|&b| b == i as u8),
                "message {i} out of order or wrong"
            );
            assert!(d0.engine.lock().rndv_in[1] <= 16);
        }
        for r in sends {
            assert!(r.wait().status.error.is_none());
        }
        assert_eq!(d1.engine.lock().rndv_out[0], 0);
        assert_eq!(d0.engine.lock().rndv_in[1], 0);
    }

    #[test]
    fn one_drain_takes_at_most_its_budget() {
        let (d0, d1) = pair(&[]);
        for i in 0..600u32 {
            let h = Header {
                kind: KIND_EAGER,
                tag: 1,
                context: 3,
                len: 4,
                ..Header::default()
            };
            assert!(raw_push(&d1, 0, h, &i.to_le_bytes()), "ring full at {i}");
        }
        {
            let mut l = d0.engine.lock();
            d0.engine.drain(&mut l, 1, None, false);
            assert_eq!(l.matching.unexpected_len(), DRAIN_BUDGET);
        }
        // The rest comes with later rounds, in order.
        for i in 0..600u32 {
            let mut b = [0u8; 4];
            d0.recv(&mut b, Source::Rank(1), TagSel::Tag(1), 3).unwrap();
            assert_eq!(u32::from_le_bytes(b), i);
        }
    }

    #[test]
    fn a_peer_that_claims_to_have_left_and_keeps_sending_is_drained_boundedly() {
        // Issue 21: a live peer that marks itself departed and keeps its ring
        // full kept the receiver in one drain loop ("departed peers are
        // drained whole"): millions of messages inside one iprobe.
        use std::sync::atomic::AtomicUsize;
        let (d0, d1) = pair(&[("ring_bytes", "4096")]);
        let nslots = d0.engine.sh.mine.ring(1).nslots();
        // It says it finished (state word, departures counter, doorbell)...
        d1.engine.depart(state::CLOSED);
        // ... and keeps the ring full of replies nobody waits for (ignored,
        // not violations: fragments of an abandoned stream).
        const CAP: usize = 100_000;
        let pushed = AtomicUsize::new(0);
        let stop = AtomicBool::new(false);
        let full = AtomicBool::new(false);
        let during = std::thread::scope(|s| {
            s.spawn(|| {
                let h = Header {
                    kind: KIND_DATA,
                    cookie: 0xdead,
                    ..Header::default()
                };
                while !stop.load(Ordering::Relaxed) && pushed.load(Ordering::Relaxed) < CAP {
                    if raw_push(&d1, 0, h, &[]) {
                        pushed.fetch_add(1, Ordering::Relaxed);
                    } else {
                        full.store(true, Ordering::Relaxed);
                        std::thread::yield_now();
                    }
                }
            });
            while !full.load(Ordering::Relaxed) {
                std::thread::yield_now();
            }
            let before = pushed.load(Ordering::Relaxed);
            let r = d0.iprobe(Source::Any, TagSel::Any, 0);
            let during = pushed.load(Ordering::Relaxed) - before;
            stop.store(true, Ordering::Relaxed);
            assert!(matches!(r, Ok(None)), "{r:?}");
            during
        });
        // The ring was full when the iprobe began: it took what was there
        // (at most a ring's worth) and whatever arrived in between, bounded.
        let bound = 2 * nslots + DRAIN_BUDGET;
        assert!(
            during <= bound,
            "one iprobe let the peer push {during} more messages (bound {bound})"
        );
        // Later progress does not read its ring on either.
        let before = pushed.load(Ordering::Relaxed);
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                let h = Header {
                    kind: KIND_DATA,
                    cookie: 0xdead,
                    ..Header::default()
                };
                while !stop.load(Ordering::Relaxed) {
                    if raw_push(&d1, 0, h, &[]) {
                        pushed.fetch_add(1, Ordering::Relaxed);
                    } else {
                        std::thread::yield_now();
                    }
                }
            });
            for _ in 0..100 {
                let _ = d0.iprobe(Source::Any, TagSel::Any, 0);
            }
            stop.store(true, Ordering::Relaxed);
        });
        let after = pushed.load(Ordering::Relaxed) - before;
        assert!(after <= bound, "100 iprobes let it push {after} more");
    }

    #[test]
    fn a_negative_tag_is_a_violation() {
        let (d0, d1) = pair(&[]);
        let h = Header {
            kind: KIND_EAGER,
            tag: -5,
            context: 1,
            len: 4,
            ..Header::default()
        };
        assert!(raw_push(&d1, 0, h, &[1, 2, 3, 4]));
        let e = recv_from_1(&d0).unwrap_err();
        assert!(
            matches!(&e, Error::Protocol { rank: 1, what } if what.contains("negative tag -5")),
            "{e:?}"
        );
        // Sends refuse one at the source, blocking or not.
        assert!(matches!(
            d1.send(b"x", 0, -1, 1),
            Err(Error::InvalidTag(-1))
        ));
        let r = d1.isend(Buffer::from(vec![0u8; 1]), 0, -1, 1).wait();
        assert!(matches!(r.status.error, Some(Error::InvalidTag(-1))));
    }

    #[test]
    fn unknown_kind_is_a_violation() {
        let (d0, d1) = pair(&[]);
        let h = Header {
            kind: 99,
            ..Header::default()
        };
        assert!(raw_push(&d1, 0, h, &[]));
        assert_violation(&d0, "unknown message kind 99");
    }

    #[test]
    fn reply_for_unknown_send_is_a_violation() {
        let (d0, d1) = pair(&[]);
        let h = Header {
            kind: KIND_FIN,
            cookie: 12345,
            ..Header::default()
        };
        assert!(raw_push(&d1, 0, h, &[]));
        assert_violation(&d0, "unknown send 12345");
    }

    #[test]
    fn malformed_rendezvous_start_is_a_violation() {
        let (d0, d1) = pair(&[]);
        let h = Header {
            kind: KIND_RNDV,
            aux: 1 << 20,
            ..Header::default()
        };
        assert!(raw_push(&d1, 0, h, &[0u8; 3]));
        assert_violation(&d0, "rendezvous start of 3 bytes");
    }

    #[test]
    fn eager_data_beyond_credit_is_a_violation() {
        let (d0, d1) = pair(&[("ring_bytes", "4096"), ("credit_bytes", "4096")]);
        let h = Header {
            kind: KIND_EAGER,
            tag: 3,
            context: 1,
            ..Header::default()
        };
        // Nothing is received, so all of it is unexpected data held by rank 0.
        let mut pushed = 0;
        while pushed < 200 {
            if raw_push(&d1, 0, h, &[7u8; 500]) {
                pushed += 1;
            } else {
                // Let rank 0 drain its ring into its unexpected queue.
                let _ = d0.iprobe(Source::Rank(1), TagSel::Tag(99), 1);
            }
            if d0.engine.lock().broken[1] {
                break;
            }
        }
        assert!(pushed < 200, "rank 0 kept accepting uncredited data");
        let _ = d0.iprobe(Source::Any, TagSel::Any, 1);
        assert!(d0.engine.lock().broken[1]);
    }

    #[test]
    fn unreadable_rendezvous_source_fails_that_receive_only() {
        // CMA forced: the default may choose the pipelined path here.
        let (d0, d1) = pair(&[("cma", "on")]);
        assert_eq!(d0.rendezvous(), &RendezvousPath::Cma);
        let h = Header {
            kind: KIND_RNDV,
            tag: 4,
            context: 1,
            cookie: 1,
            aux: 100,
            ..Header::default()
        };
        assert!(raw_push(&d1, 0, h, &8u64.to_le_bytes()));
        match recv_from_1(&d0) {
            Err(Error::Protocol { rank: 1, what }) => {
                assert!(what.contains("unreadable"), "{what}")
            }
            other => panic!("expected an unreadable source, got {other:?}"),
        }
        // Not a ring violation: rank 1 may still talk to rank 0.
        d1.send(b"ok", 0, 6, 1).unwrap();
        let mut b = [0u8; 2];
        d0.recv(&mut b, Source::Rank(1), TagSel::Tag(6), 1).unwrap();
        assert_eq!(&b, b"ok");
    }

    #[test]
    fn fragment_out_of_place_is_a_violation() {
        let (d0, d1) = pair(&[("cma", "off")]);
        let r = d0.irecv(Buffer::zeroed(100), Source::Rank(1), TagSel::Tag(4), 1);
        let start = Header {
            kind: KIND_RNDV,
            tag: 4,
            context: 1,
            cookie: 5,
            aux: 100,
            ..Header::default()
        };
        assert!(raw_push(&d1, 0, start, &0u64.to_le_bytes()));
        let _ = d0.iprobe(Source::Any, TagSel::Any, 1); // matches, answers PULL
        let data = Header {
            kind: KIND_DATA,
            cookie: 5,
            aux: 50, // the stream is at 0
            ..Header::default()
        };
        assert!(raw_push(&d1, 0, data, &[1u8; 10]));
        let done = r.wait();
        match done.status.error {
            Some(Error::Protocol { rank: 1, what }) => assert!(what.contains("fragment"), "{what}"),
            other => panic!("expected a protocol violation, got {other:?}"),
        }
    }

    #[test]
    fn impossible_consumer_position_is_a_violation() {
        let (d0, d1) = pair(&[("ring_bytes", "4096")]);
        // Rank 1 owns the ring from rank 0 in its inbox; it writes a
        // consumer position past anything rank 0 published.
        let ring = d1.engine.sh.mine.ring(0);
        // SAFETY: the tail word is the first 8 bytes of the ring, inside the
        // mapping, 8-aligned; a plain write is what a hostile peer could do
        // (nothing else touches it now).
        unsafe { std::ptr::write_volatile(ring.base_ptr() as *mut u64, u64::MAX) };
        // Rank 0 reads the position only once its ring looks full: three
        // 1000-byte messages fit in 64 slots, the fourth does not.
        let msg = [1u8; 1000];
        for _ in 0..3 {
            d0.send(&msg, 1, 0, 1).unwrap();
        }
        match d0.send(&msg, 1, 0, 1) {
            Err(Error::Protocol { rank: 1, what }) => {
                assert!(what.contains("consumer position"), "{what}")
            }
            other => panic!("expected a protocol violation by rank 1, got {other:?}"),
        }
        // Rank 1 is cut off for good.
        assert!(matches!(
            d0.send(b"x", 1, 0, 1),
            Err(Error::Protocol { rank: 1, .. })
        ));
    }

    #[test]
    fn peer_info_roundtrip_and_rejects() {
        let i = PeerInfo {
            pid: 42,
            nslots: 1024,
            credit_bytes: 1 << 18,
            probe_addr: 0xdead_beef,
            probe_value: 7,
            segment: "xdev-fd-0123456789abcdef0123456789abcdef".into(),
        };
        assert_eq!(PeerInfo::decode(&i.encode()).unwrap(), i);
        let mut b = i.encode();
        b.push(0);
        assert!(PeerInfo::decode(&b).is_err());
        let bad = PeerInfo {
            segment: "xdev-fd-../x".into(),
            ..i.clone()
        };
        assert!(PeerInfo::decode(&bad.encode()).is_err());
        let bad = PeerInfo { nslots: 1000, ..i };
        assert!(PeerInfo::decode(&bad.encode()).is_err());
    }
}
