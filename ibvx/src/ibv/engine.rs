//! The IBVX protocol engine of one rank: eager messages through pre-posted
//! receive slots with credit-based flow control, rendezvous by RDMA write,
//! synchronous sends, self-sends, the progress engine and failure handling.
//!
//! # Flow control
//!
//! Each peer has `recv_depth` receive slots posted for us. We hold one
//! *slot credit* per slot; every message we send to the peer uses one. A data
//! message (eager, rendezvous start) or a protocol reply needs two credits,
//! an explicit `CREDIT` message one: the last credit is kept for returning
//! credits, so two ranks that both ran out can always tell each other about
//! re-posted slots. Every message carries the slots and bytes we owe the
//! peer (piggybacked credit); a `CREDIT` message goes out on its own once a
//! quarter of the peer's slots used by data, half its slots of any kind, or
//! half its byte window are owed and nothing else is going there.
//!
//! Unexpected eager data is bounded by a per-peer *byte window*: an eager
//! message is charged against it by the sender and the receiver returns the
//! bytes once a receive consumed the message. A sender without byte credit
//! sends a rendezvous start instead (a 32-byte header), so a slow receiver
//! holds at most `eager_window` unexpected bytes per peer plus small headers.
//!
//! # Ownership of memory the NIC touches
//!
//! A send's data is only read by the NIC while its request (which owns the
//! buffer) or its blocking call (which borrows it and waits) is alive: the
//! request completes only after the completion of the last work request
//! that reads it, or after the queue pair was moved to the error state and
//! its work requests flushed. A receive buffer is exposed to a peer's RDMA
//! write (by its rkey) only between `RNDZ_REPLY` and `RNDZ_END`; before the
//! receive completes otherwise, the peer's queue pair is moved to the error
//! state, after which the peer cannot write any more.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use xdev::bootstrap::Bootstrap;
use xdev::matching::{FxMap, MatchingEngine, Posted, PostedId};
use xdev::target::{cancelled, lost, unpost, BlockingRecv, BlockingSend, SendOwner, Target};
use xdev::{
    check_recv, check_send, Buffer, Context, Envelope, Error, Pattern, Peeked, Progress, Rank,
    Request, RequestCore, RequestKind, Result, Source, Status, Tag, Tracker,
};

use super::regcache::{Registration, RegistrationCache};
use super::wire::{self, Body, Header, FLAG_FAILED, FLAG_SYNC, MAX_CONTROL_LEN};
use super::IbvOptions;
use crate::verbs::{
    CompletionChannel, CompletionQueue, MemoryRegion, QueuePair, RemoteAddr, SendFlags, SendOp,
    SendRequest, WorkCompletion,
};

/// Work request ids on the send queue: kind in the top byte.
const WR_SLOT: u64 = 1 << 56;
const WR_WRITE: u64 = 2 << 56;
/// A raw RDMA write posted by a test (`write_raw`).
#[cfg(test)]
const WR_RAW: u64 = 3 << 56;

#[cfg(test)]
thread_local! {
    /// Makes the next blocking send of this thread panic right after it is
    /// published (fault injection for the unwind test).
    pub(crate) static PANIC_AFTER_PUBLISH: std::cell::Cell<bool> =
        const { std::cell::Cell::new(false) };
}
const WR_KIND: u64 = 0xff << 56;
/// Largest single RDMA write (longer messages are split).
const MAX_WRITE: usize = 1 << 30;
/// Rendezvous sends a rank has started (`RNDZ_START` posted) towards one
/// peer and not yet seen finished. More wait in that peer's backlog, in
/// order, and sends behind them too. A receiver so holds at most this many
/// of one sender's rendezvous starts, matched or not, and fails a sender
/// that exceeds it (`Error::Protocol`): a start is re-posted at once, so
/// without this bound a hostile or careless sender could make a receiver
/// keep any number of them. A held start costs about 100 bytes.
const RNDV_WINDOW: usize = 65_536;

/// [`RNDV_WINDOW`], or a smaller one a test set.
fn rndv_window() -> usize {
    #[cfg(test)]
    {
        let w = RNDV_WINDOW_FOR_TESTS.load(Ordering::Relaxed);
        if w > 0 {
            return w;
        }
    }
    RNDV_WINDOW
}

/// A smaller rendezvous window for tests (0: the real one).
#[cfg(test)]
pub(crate) static RNDV_WINDOW_FOR_TESTS: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(0);
/// Completions taken per poll.
const POLL_BATCH: usize = 32;
/// Polls of an idle wait before it sleeps.
const SPIN_POLLS: u32 = 4_000;
/// Longest sleep of a wait (departures are checked at least this often).
const SLEEP: Duration = Duration::from_millis(20);
/// How often a busy rank looks at the bootstrap's departure list.
const DEPARTURE_CHECK: Duration = Duration::from_millis(20);
/// Calls of a busy wait between two looks at the clock for departures.
const DEPARTURE_POLLS: u32 = 256;

/// Verbs resources fixed after start-up.
pub(crate) struct Fabric {
    pub(crate) rank: Rank,
    pub(crate) size: usize,
    pub(crate) opts: IbvOptions,
    /// Bytes of one send or receive slot.
    pub(crate) slot_len: usize,
    /// Largest inline send the QPs accept.
    pub(crate) inline_max: usize,
    /// One RC QP per peer (`None` at our own index).
    pub(crate) qps: Vec<Option<QueuePair>>,
    pub(crate) send_cq: CompletionQueue,
    pub(crate) recv_cq: CompletionQueue,
    pub(crate) channel: CompletionChannel,
    /// `size * recv_depth` receive slots, slot `(p, i)` at `(p * depth + i) * slot_len`.
    pub(crate) recv_mr: MemoryRegion<'static>,
    pub(crate) cache: RegistrationCache,
}

impl Fabric {
    /// Byte offset of receive slot `slot` of peer `p` in `recv_mr`.
    fn recv_offset(&self, p: Rank, slot: u32) -> usize {
        (p * self.opts.recv_depth as usize + slot as usize) * self.slot_len
    }

    /// Posts receive slot `slot` of peer `p` on its queue pair; the work
    /// request id is `p << 32 | slot`.
    ///
    /// The caller must not post a slot that is already posted: a slot is
    /// posted once at start-up and re-posted only after its completion was
    /// handled (`Engine::repost`).
    pub(crate) fn post_recv_slot(&self, p: Rank, slot: u32) -> crate::verbs::Result<()> {
        let qp = self.qps[p].as_ref().expect("no QP to self");
        let sge = self.recv_mr.sge(self.recv_offset(p, slot), self.slot_len);
        // SAFETY: the slot is `slot_len` bytes of `recv_mr`, which the
        // fabric owns and which outlives every QP (`qps` is dropped first,
        // destroying them). Slot (p, slot) is not posted now (see above),
        // and nothing else uses it until its completion: the engine reads a
        // slot only in `on_recv_completion`, after the NIC is done with it,
        // and never hands out references to it.
        unsafe { qp.post_recv(((p as u64) << 32) | u64::from(slot), &[sge]) }
    }
}

/// A message a receive has not matched yet.
enum Unexpected {
    /// Eager data from a peer (its bytes are returned to the sender's window
    /// when consumed); `sync` is the sender's id to acknowledge.
    Eager { data: Vec<u8>, sync: Option<u64> },
    /// A rendezvous start: the data waits at the sender.
    Start { id: u64, len: usize },
    /// A self-send (copied); `sync` is our own send waiting for the match.
    Local { data: Vec<u8>, sync: Option<u64> },
}

impl Unexpected {
    fn len(&self) -> usize {
        match self {
            Unexpected::Eager { data, .. } | Unexpected::Local { data, .. } => data.len(),
            Unexpected::Start { len, .. } => *len,
        }
    }
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Stage {
    /// In its destination's backlog.
    Queued,
    /// Eager synchronous: waiting for `ACK`.
    AwaitAck,
    /// `RNDZ_START` sent: waiting for `RNDZ_REPLY`.
    AwaitReply,
    /// Replied to: the write and `RNDZ_END` are queued (`posted` false) or
    /// posted (completes with the `RNDZ_END` work completion).
    Writing { posted: bool },
    /// A synchronous self-send waiting for a receive.
    LocalUnmatched,
}

/// A send that could not complete at once.
struct OutSend {
    dest: Rank,
    tag: Tag,
    context: Context,
    data: *const u8,
    len: usize,
    sync: bool,
    stage: Stage,
    owner: SendOwner,
    reg: Option<Registration>,
}

// SAFETY: `data` points into the send's buffer, owned by its request (held
// in `owner`) or borrowed by a blocking call that waits until the send is
// removed from the engine; it is only used under the engine lock.
unsafe impl Send for OutSend {}

/// One message to send.
#[derive(Copy, Clone)]
struct Outgoing<'a> {
    dest: Rank,
    tag: Tag,
    context: Context,
    data: &'a [u8],
    sync: bool,
}

/// A rendezvous receive waiting for `RNDZ_END`: the peer may write `target`
/// through `reg` until then; dropping the entry deregisters `reg`, which
/// ends the grant.
struct Incoming {
    src: Rank,
    env: Envelope,
    len: usize,
    cap: usize,
    target: Target,
    _reg: Registration,
}

/// Protocol messages waiting for credits, a send slot or send-queue room.
enum Control {
    Reply {
        id: u64,
        rid: u64,
        dst: RemoteAddr,
        len: u64,
        failed: bool,
    },
    Ack {
        id: u64,
    },
    /// Write send `id`'s data to `dst` and then send `RNDZ_END` for `rid`.
    WriteEnd {
        id: u64,
        rid: u64,
        dst: RemoteAddr,
        len: usize,
    },
    /// Tell the receiver `rid` that no data will come.
    EndFailed {
        rid: u64,
    },
}

/// Our side of the connection to one peer.
struct Peer {
    /// Receive slots the peer has posted for us that we may use.
    credits: u32,
    /// Unexpected-eager bytes we may still send it.
    window: u64,
    /// Slots we re-posted for it and have not reported.
    owed_slots: u32,
    /// Of those, slots its data and protocol messages used (not its
    /// `CREDIT`s): a quarter of its slots used by data makes us send a
    /// `CREDIT`; slots of its `CREDIT`s only once half its slots are owed
    /// (see `owes_enough`), so credit messages do not bounce back and forth.
    owed_by_data: u32,
    /// Eager bytes of its messages we consumed and have not reported.
    owed_bytes: u64,
    /// Eager bytes it sent that we hold unexpected.
    held_bytes: u64,
    /// Send work requests we may still post on its QP.
    sq_free: u32,
    /// Data sends waiting, in order.
    backlog: VecDeque<u64>,
    control: VecDeque<Control>,
    /// Why operations involving it fail, once it is gone.
    gone: Option<Error>,
    /// Our rendezvous sends to it that started and have not finished (at
    /// most [`RNDV_WINDOW`]).
    rndv_out: usize,
    /// Its rendezvous starts we read and have not finished (answered with
    /// a zero-length or failed grant, or ended by its `RNDZ_END`).
    rndv_in: usize,
}

/// One rank's protocol state, behind the engine lock.
struct Local {
    matching: MatchingEngine<Unexpected, Target>,
    peers: Vec<Peer>,
    sends: FxMap<u64, OutSend>,
    incoming: FxMap<u64, Incoming>,
    next_id: u64,
    /// The send slots (`send_slots * slot_len` bytes).
    send_mr: MemoryRegion<'static>,
    free_slots: Vec<u32>,
    /// Per send slot: its destination and the send it completes, if any.
    slot_use: Vec<(Rank, Option<u64>)>,
    events: u64,
    last_departure_check: Instant,
    /// Calls of `check_departures` since the clock was last read.
    departure_polls: u32,
    departures_seen: usize,
    wcs: Vec<WorkCompletion>,
    /// Threads waiting on the condition variable (only then is it
    /// signalled: `notify_all` is a system call even with no waiter).
    cond_waiters: usize,
    /// The last remote-write grant this rank sent (tests).
    #[cfg(test)]
    last_grant: Option<RemoteAddr>,
    /// The outcome of the last `write_raw` (tests).
    #[cfg(test)]
    raw_write: Option<std::result::Result<(), String>>,
}

/// The engine of one rank, shared by the device handle and its requests.
pub(crate) struct Engine {
    fab: Fabric,
    tracker: Arc<Tracker>,
    local: Mutex<Local>,
    /// Waiters that are not the sleeper wait here.
    cond: Condvar,
    /// Whether a thread sleeps on the completion channel (then `wake` is
    /// written when something completes).
    sleeper: AtomicBool,
    wake: OwnedFd,
    closing: AtomicBool,
    closed: AtomicBool,
    boot: Bootstrap,
}

fn wr_error(wc: &WorkCompletion, peer: Rank, what: &str) -> Error {
    let status = wc.status();
    if status == ibvx_sys::IBV_WC_RETRY_EXC_ERR || status == ibvx_sys::IBV_WC_RNR_RETRY_EXC_ERR {
        lost(
            peer,
            &format!("{what}: {} (peer unreachable)", wc.status_str()),
        )
    } else {
        Error::transport(
            format!("{what} to rank {peer}"),
            std::io::Error::other(format!(
                "{} (vendor error {:#x})",
                wc.status_str(),
                wc.vendor_err()
            )),
        )
    }
}

fn registration_error(e: crate::verbs::Error) -> Error {
    Error::ResourceExhausted(format!("memory registration failed: {e}"))
}

impl Engine {
    pub(crate) fn new(
        fab: Fabric,
        send_mr: MemoryRegion<'static>,
        boot: Bootstrap,
    ) -> Result<Self> {
        let n = fab.size;
        let depth = fab.opts.recv_depth;
        let peers = (0..n)
            .map(|_| Peer {
                credits: depth,
                window: fab.opts.eager_window as u64,
                owed_slots: 0,
                owed_by_data: 0,
                owed_bytes: 0,
                held_bytes: 0,
                sq_free: fab.opts.sq_depth(),
                backlog: VecDeque::new(),
                control: VecDeque::new(),
                gone: None,
                rndv_out: 0,
                rndv_in: 0,
            })
            .collect();
        let slots = fab.opts.send_slots as u32;
        // SAFETY: plain eventfd creation; the fd is owned below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(Error::transport("eventfd", std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` is a fresh descriptor owned by nobody else.
        let wake = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Engine {
            tracker: Arc::new(Tracker::new()),
            local: Mutex::new(Local {
                matching: MatchingEngine::new(),
                peers,
                sends: FxMap::default(),
                incoming: FxMap::default(),
                next_id: 1,
                send_mr,
                free_slots: (0..slots).rev().collect(),
                slot_use: vec![(0, None); slots as usize],
                events: 0,
                last_departure_check: Instant::now(),
                departure_polls: 0,
                departures_seen: 0,
                wcs: vec![WorkCompletion::default(); POLL_BATCH],
                cond_waiters: 0,
                #[cfg(test)]
                last_grant: None,
                #[cfg(test)]
                raw_write: None,
            }),
            fab,
            cond: Condvar::new(),
            sleeper: AtomicBool::new(false),
            wake,
            closing: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            boot,
        })
    }

    pub(crate) fn rank(&self) -> Rank {
        self.fab.rank
    }

    pub(crate) fn size(&self) -> usize {
        self.fab.size
    }

    /// Sends `frame` to `peer` as it is, as a hostile or broken peer would
    /// (no credit accounting of its content).
    #[cfg(test)]
    pub(crate) fn post_raw(&self, peer: Rank, frame: &[u8]) {
        let mut l = self.lock();
        assert!(
            self.can_post(&l, peer, 1, true),
            "no credit to post a raw frame"
        );
        self.post_frame(&mut l, peer, frame, &[], None)
            .expect("post a raw frame");
    }

    /// Whether a raw frame to `peer` may be posted now (a credit).
    #[cfg(test)]
    pub(crate) fn has_credit(&self, peer: Rank) -> bool {
        let l = self.lock();
        self.can_post(&l, peer, 1, true)
    }

    /// `peer`'s unfinished rendezvous starts we hold, and ours to it.
    #[cfg(test)]
    pub(crate) fn rendezvous_counts(&self, peer: Rank) -> (usize, usize) {
        let l = self.lock();
        (l.peers[peer].rndv_in, l.peers[peer].rndv_out)
    }

    /// The last remote-write grant this rank sent in an `RNDZ_REPLY`.
    #[cfg(test)]
    pub(crate) fn last_grant(&self) -> Option<RemoteAddr> {
        self.lock().last_grant
    }

    /// RDMA-writes `data` to `dst` at `peer` behind the protocol's back, as
    /// a peer that kept an old key would, and waits for the completion: its
    /// status, or the work completion's error.
    #[cfg(test)]
    pub(crate) fn write_raw(
        &self,
        peer: Rank,
        dst: RemoteAddr,
        data: &[u8],
    ) -> std::result::Result<(), String> {
        let mut src = self
            .fab
            .cache
            .lease(data.len())
            .map_err(|e| e.to_string())?;
        // SAFETY: the lease's chunk is ours, at least data.len() bytes.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), src.as_mut_ptr(), data.len()) };
        let reg = src.registration();
        {
            let mut l = self.lock();
            l.raw_write = None;
            let qp = self.fab.qps[peer].as_ref().expect("a peer");
            // SAFETY: the source is our own lease `src`, which stays leased
            // (and `reg` registered) until this function returns, after the
            // write's completion was seen below, or on a timeout, which
            // fails the test. The remote side is what this test hook is
            // for: `dst` is a range of the peer that the test checks stays
            // unwritten (a stale or local-only rkey), or a range it granted.
            unsafe {
                qp.post_send(&SendRequest {
                    wr_id: WR_RAW | peer as u64,
                    op: SendOp::RdmaWrite(dst),
                    sges: &[reg.sge(src.as_ptr(), data.len())],
                    flags: SendFlags::SIGNALED,
                })
            }
            .map_err(|e| e.to_string())?;
            l.peers[peer].sq_free -= 1;
        }
        let t = Instant::now();
        loop {
            {
                let mut l = self.lock();
                self.progress_locked(&mut l);
                if let Some(r) = l.raw_write.take() {
                    return r;
                }
            }
            if t.elapsed() > Duration::from_secs(30) {
                return Err("no completion for the raw write".into());
            }
            std::thread::yield_now();
        }
    }

    /// Moves the queue pair to `peer` to the error state behind the
    /// engine's back, as a fault would.
    #[cfg(test)]
    pub(crate) fn inject_qp_error(&self, peer: Rank) {
        self.fab.qps[peer]
            .as_ref()
            .expect("a peer")
            .modify_to_error()
            .expect("modify to error");
    }

    pub(crate) fn options(&self) -> &IbvOptions {
        &self.fab.opts
    }

    pub(crate) fn cache(&self) -> &RegistrationCache {
        &self.fab.cache
    }

    fn lock(&self) -> MutexGuard<'_, Local> {
        self.local.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn check_open(&self) -> Result<()> {
        if self.closing.load(Ordering::Acquire) {
            Err(Error::Closed)
        } else {
            Ok(())
        }
    }

    fn gone_error(l: &Local, p: Rank) -> Option<Error> {
        l.peers[p].gone.clone()
    }

    // ------------------------------------------------------------ sending

    /// Whether a message to `dest` can be posted now (`credit_only`: a
    /// `CREDIT`, which may use the last credit).
    fn can_post(&self, l: &Local, dest: Rank, wrs: u32, credit_only: bool) -> bool {
        let p = &l.peers[dest];
        let need = if credit_only { 1 } else { 2 };
        p.gone.is_none() && p.credits >= need && p.sq_free >= wrs && !l.free_slots.is_empty()
    }

    /// Posts one message to `dest` from a send slot, with the credit owed
    /// to it. The caller checked [`can_post`](Self::can_post). `completes`
    /// is the send that this message's completion finishes.
    fn post_message(
        &self,
        l: &mut Local,
        dest: Rank,
        mut head: Header,
        body: Body<'_>,
        completes: Option<u64>,
    ) -> Result<()> {
        let peer = &mut l.peers[dest];
        head.slots = peer.owed_slots.min(u32::from(u16::MAX)) as u16;
        peer.owed_slots -= u32::from(head.slots);
        peer.owed_by_data = peer.owed_by_data.min(peer.owed_slots);
        head.bytes = peer.owed_bytes.min(u64::from(u32::MAX)) as u32;
        peer.owed_bytes -= u64::from(head.bytes);
        let mut hdr = [0u8; MAX_CONTROL_LEN];
        let n = wire::encode(&head, &body, &mut hdr);
        let payload = match body {
            Body::Eager(payload) => payload,
            _ => &[],
        };
        self.post_frame(l, dest, &hdr[..n], payload, completes)
    }

    /// Copies `head` and `payload` into a free send slot and sends them to
    /// `dest`, using one credit and one send-queue entry. The caller checked
    /// [`can_post`](Self::can_post).
    fn post_frame(
        &self,
        l: &mut Local,
        dest: Rank,
        head: &[u8],
        payload: &[u8],
        completes: Option<u64>,
    ) -> Result<()> {
        let slot = l.free_slots.pop().expect("caller checked for a free slot");
        let peer = &mut l.peers[dest];
        peer.credits -= 1;
        peer.sq_free -= 1;
        let off = slot as usize * self.fab.slot_len;
        l.send_mr.write(off, head);
        l.send_mr.write(off + head.len(), payload);
        let total = head.len() + payload.len();
        l.slot_use[slot as usize] = (dest, completes);
        let flags = SendFlags::SIGNALED.with(SendFlags::INLINE, total <= self.fab.inline_max);
        let qp = self.fab.qps[dest].as_ref().expect("no QP to self");
        // SAFETY: the range is inside send slot `slot` of `send_mr`, which
        // the engine owns and which outlives the QPs (dropped first with the
        // fabric). The slot was taken off `free_slots` above and goes back
        // only when this request's completion is polled
        // (`on_send_completion`), so nothing writes it meanwhile; no
        // reference to it exists (the engine copies in with `write`).
        let r = unsafe {
            qp.post_send(&SendRequest {
                wr_id: WR_SLOT | u64::from(slot),
                op: SendOp::Send,
                sges: &[l.send_mr.sge(off, total)],
                flags,
            })
        };
        if let Err(e) = r {
            // Nothing was posted: give the slot and the send room back.
            l.free_slots.push(slot);
            l.peers[dest].sq_free += 1;
            let err = Error::transport(format!("post a send to rank {dest}"), e);
            self.fail_peer(l, dest, err.clone());
            return Err(err);
        }
        Ok(())
    }

    /// Whether a `len`-byte message to `dest` goes eager: within the eager
    /// limit and the peer's byte window (else it is a rendezvous).
    fn goes_eager(&self, l: &Local, dest: Rank, len: usize) -> bool {
        len <= self.fab.opts.eager_limit && l.peers[dest].window >= len as u64
    }

    /// Posts an eager message and charges it to the peer's byte window.
    fn post_eager(&self, l: &mut Local, dest: Rank, head: Header, data: &[u8]) -> Result<()> {
        self.post_message(l, dest, head, Body::Eager(data), None)?;
        l.peers[dest].window -= data.len() as u64;
        Ok(())
    }

    /// Tries to send queued send `id` (eager or rendezvous start); false if
    /// resources are short (it stays queued).
    fn try_send(&self, l: &mut Local, id: u64) -> bool {
        let s = l.sends.get(&id).expect("queued send");
        let dest = s.dest;
        if !self.can_post(l, dest, 1, false) {
            return false;
        }
        let eager = self.goes_eager(l, dest, s.len);
        if !eager && l.peers[dest].rndv_out >= rndv_window() {
            return false; // waits for one of ours to finish
        }
        let head = Header {
            tag: s.tag,
            context: s.context,
            id,
            flags: if eager && s.sync { FLAG_SYNC } else { 0 },
            ..Header::default()
        };
        let (data, len, sync) = (s.data, s.len, s.sync);
        let r = if eager {
            // SAFETY: the send's buffer is alive (see OutSend) and `len` is its length.
            let payload = unsafe { std::slice::from_raw_parts(data, len) };
            self.post_eager(l, dest, head, payload)
        } else {
            self.post_message(l, dest, head, Body::RndzStart { len: len as u64 }, None)
        };
        if r.is_err() {
            return true; // the send failed with its peer
        }
        if eager {
            if sync {
                l.sends.get_mut(&id).expect("present").stage = Stage::AwaitAck;
            } else {
                self.complete_send(l, id, Ok(()));
            }
        } else {
            l.sends.get_mut(&id).expect("present").stage = Stage::AwaitReply;
            l.peers[dest].rndv_out += 1;
        }
        true
    }

    /// Posts queued protocol messages and sends to `dest`, in order, while
    /// resources last.
    fn flush_peer(&self, l: &mut Local, dest: Rank) {
        while let Some(c) = l.peers[dest].control.front() {
            let wrs = match c {
                Control::WriteEnd { len, .. } => 1 + len.div_ceil(MAX_WRITE) as u32,
                _ => 1,
            };
            if !self.can_post(l, dest, wrs, false) {
                return;
            }
            let c = l.peers[dest].control.pop_front().expect("present");
            self.post_control(l, dest, c);
            if l.peers[dest].gone.is_some() {
                return;
            }
        }
        while let Some(&id) = l.peers[dest].backlog.front() {
            if !self.try_send(l, id) {
                return;
            }
            l.peers[dest].backlog.pop_front();
            if l.peers[dest].gone.is_some() {
                return;
            }
        }
    }

    fn post_control(&self, l: &mut Local, dest: Rank, c: Control) {
        let _ = match c {
            Control::Reply {
                id,
                rid,
                dst,
                len,
                failed,
            } => {
                let head = Header {
                    id,
                    flags: if failed { FLAG_FAILED } else { 0 },
                    ..Header::default()
                };
                let body = Body::RndzReply {
                    rid,
                    addr: dst.addr,
                    len,
                    rkey: dst.rkey,
                };
                self.post_message(l, dest, head, body, None)
            }
            Control::Ack { id } => self.post_message(
                l,
                dest,
                Header {
                    id,
                    ..Header::default()
                },
                Body::Ack,
                None,
            ),
            Control::EndFailed { rid } => {
                let head = Header {
                    id: rid,
                    flags: FLAG_FAILED,
                    ..Header::default()
                };
                self.post_message(l, dest, head, Body::RndzEnd, None)
            }
            Control::WriteEnd { id, rid, dst, len } => {
                self.post_write_end(l, dest, id, rid, dst, len)
            }
        };
    }

    /// RDMA-writes send `id`'s data into the peer's buffer, then `RNDZ_END`
    /// (which, on the same RC queue pair, arrives after the data).
    fn post_write_end(
        &self,
        l: &mut Local,
        dest: Rank,
        id: u64,
        rid: u64,
        dst: RemoteAddr,
        len: usize,
    ) -> Result<()> {
        let qp = self.fab.qps[dest].as_ref().expect("no QP to self");
        let s = l.sends.get(&id).expect("send being written");
        let reg = s.reg.as_ref().expect("registered before the write");
        let mut off = 0;
        while off < len {
            let n = (len - off).min(MAX_WRITE);
            // SAFETY: `data + off .. + n` is inside the send's buffer (len is
            // at most its length, checked when the reply arrived).
            let src = unsafe { s.data.add(off) };
            // SAFETY: the source is inside the send's buffer, registered by
            // `reg` (held by the send until it is removed from the engine).
            // The buffer is owned by the send's request or borrowed by a
            // blocking call, and neither gets it back before the send
            // completes: after the completion of its `RNDZ_END` (posted
            // after these writes on the same RC send queue, so it completes
            // last) or of a failed write (the QP is then in the error state
            // and later writes are flushed, not executed); a dropped engine
            // leaks the buffers of sends still writing. The data is only
            // read. The destination `dst .. dst + len` is the range the peer
            // granted to this send in its `RNDZ_REPLY` (`len` is the granted
            // length, checked against the send's when the reply arrived),
            // and its rkey is of a registration of exactly that range.
            let r = unsafe {
                qp.post_send(&SendRequest {
                    wr_id: WR_WRITE | id,
                    op: SendOp::RdmaWrite(dst.offset(off as u64)),
                    sges: &[reg.sge(src, n)],
                    flags: SendFlags::SIGNALED,
                })
            };
            if let Err(e) = r {
                // Writes already posted flush once the peer fails (below),
                // and their completions complete the send; with none
                // posted it completes now.
                let err = Error::transport(format!("post an RDMA write to rank {dest}"), e);
                if off == 0 {
                    self.complete_send(l, id, Err(err.clone()));
                } else if let Some(s) = l.sends.get_mut(&id) {
                    s.stage = Stage::Writing { posted: true };
                }
                self.fail_peer(l, dest, err.clone());
                return Err(err);
            }
            l.peers[dest].sq_free -= 1;
            off += n;
        }
        let head = Header {
            id: rid,
            ..Header::default()
        };
        if let Some(s) = l.sends.get_mut(&id) {
            s.stage = Stage::Writing { posted: true };
        }
        self.post_message(l, dest, head, Body::RndzEnd, Some(id))
    }

    fn push_control(&self, l: &mut Local, dest: Rank, c: Control) {
        if l.peers[dest].gone.is_some() {
            return;
        }
        l.peers[dest].control.push_back(c);
        self.flush_peer(l, dest);
    }

    /// Completes send `id` (removing it) with `r`.
    fn complete_send(&self, l: &mut Local, id: u64, r: Result<()>) {
        let Some(s) = l.sends.remove(&id) else {
            return;
        };
        if matches!(s.stage, Stage::AwaitReply | Stage::Writing { .. }) {
            let p = &mut l.peers[s.dest];
            p.rndv_out = p.rndv_out.saturating_sub(1);
        }
        l.events += 1;
        let env = Envelope {
            source: s.dest,
            tag: s.tag,
            context: s.context,
        };
        s.owner.complete(&self.tracker, env, s.len, r);
    }

    fn complete_target(&self, l: &mut Local, t: Target, st: Status) {
        l.events += 1;
        t.complete(&self.tracker, st);
    }

    /// Starts a send (after argument checks). Returns false when it
    /// completed at once without calling `owner` (the caller completes it),
    /// true when `owner` was called: the engine completes the owner (maybe
    /// already did).
    fn start(
        &self,
        l: &mut Local,
        out: Outgoing<'_>,
        owner: impl FnOnce() -> SendOwner,
    ) -> Result<bool> {
        let Outgoing {
            dest,
            tag,
            context,
            data,
            sync,
        } = out;
        if dest == self.fab.rank {
            return Ok(self.send_local(l, tag, context, data, sync, owner));
        }
        if let Some(e) = Self::gone_error(l, dest) {
            return Err(e);
        }
        // Fast path: an eager send straight from the caller's buffer.
        if !sync
            && l.peers[dest].backlog.is_empty()
            && self.goes_eager(l, dest, data.len())
            && self.can_post(l, dest, 1, false)
        {
            let head = Header {
                tag,
                context,
                ..Header::default()
            };
            self.post_eager(l, dest, head, data)?;
            return Ok(false);
        }
        let id = l.next_id;
        l.next_id += 1;
        l.sends.insert(
            id,
            OutSend {
                dest,
                tag,
                context,
                data: data.as_ptr(),
                len: data.len(),
                sync,
                stage: Stage::Queued,
                owner: owner(),
                reg: None,
            },
        );
        // Behind any send already waiting for this peer, to keep order.
        l.peers[dest].backlog.push_back(id);
        self.flush_peer(l, dest);
        Ok(true)
    }

    /// A send to ourselves: delivered by copy.
    fn send_local(
        &self,
        l: &mut Local,
        tag: Tag,
        context: Context,
        data: &[u8],
        sync: bool,
        owner: impl FnOnce() -> SendOwner,
    ) -> bool {
        let env = Envelope {
            source: self.fab.rank,
            tag,
            context,
        };
        if let Some((_, t)) = l.matching.take_posted(&env) {
            self.copy_into(l, env, data, t);
            return false;
        }
        let sync_id = sync.then(|| {
            let id = l.next_id;
            l.next_id += 1;
            l.sends.insert(
                id,
                OutSend {
                    dest: self.fab.rank,
                    tag,
                    context,
                    data: ptr::null(),
                    len: data.len(),
                    sync,
                    stage: Stage::LocalUnmatched,
                    owner: owner(),
                    reg: None,
                },
            );
            id
        });
        l.matching.push_unexpected(
            env,
            Unexpected::Local {
                data: data.to_vec(),
                sync: sync_id,
            },
        );
        sync_id.is_some()
    }

    /// Copies a message into a matched receive and completes it.
    fn copy_into(&self, l: &mut Local, env: Envelope, data: &[u8], t: Target) {
        let (dst, cap) = t.dst();
        let n = data.len().min(cap);
        if n > 0 {
            // SAFETY: `dst` is the receive's buffer of `cap` bytes, owned by
            // its request or borrowed by its waiting blocking call; `data` is
            // a different buffer (a receive slot, a copy or the sender's).
            unsafe { ptr::copy_nonoverlapping(data.as_ptr(), dst, n) };
        }
        self.complete_target(l, t, Status::received(env, data.len(), cap));
    }

    // ------------------------------------------------------------ receiving

    /// Delivers a message taken from the unexpected queue into `t`.
    fn deliver(&self, l: &mut Local, env: Envelope, msg: Unexpected, t: Target) {
        match msg {
            Unexpected::Eager { data, sync } => {
                self.copy_into(l, env, &data, t);
                let p = &mut l.peers[env.source];
                p.held_bytes -= data.len() as u64;
                p.owed_bytes += data.len() as u64;
                if let Some(id) = sync {
                    self.push_control(l, env.source, Control::Ack { id });
                } else {
                    self.return_credit(l, env.source);
                }
            }
            Unexpected::Local { data, sync } => {
                self.copy_into(l, env, &data, t);
                if let Some(id) = sync {
                    self.complete_send(l, id, Ok(()));
                }
            }
            Unexpected::Start { id, len } => {
                if let Some(e) = Self::gone_error(l, env.source) {
                    self.complete_target(l, t, Status::failed(env, e));
                } else {
                    self.reply(l, env, id, len, t);
                }
            }
        }
    }

    /// One of `src`'s rendezvous starts is finished on our side.
    fn rendezvous_in_ended(l: &mut Local, src: Rank) {
        let p = &mut l.peers[src];
        p.rndv_in = p.rndv_in.saturating_sub(1);
    }

    /// Answers a matched rendezvous start: registers the receive buffer and
    /// sends its address and key (or a zero-length grant).
    fn reply(&self, l: &mut Local, env: Envelope, id: u64, len: usize, t: Target) {
        let (dst, cap) = t.dst();
        let grant = len.min(cap);
        let src = env.source;
        let none = RemoteAddr::default();
        if grant == 0 {
            let c = Control::Reply {
                id,
                rid: 0,
                dst: none,
                len: 0,
                failed: false,
            };
            self.push_control(l, src, c);
            Self::rendezvous_in_ended(l, src);
            self.complete_target(l, t, Status::received(env, len, cap));
            return;
        }
        // A registration of exactly the granted range, for this receive
        // only: dropped with the `Incoming` entry (at RNDZ_END, or when the
        // receive fails or the peer goes), which deregisters it, so the
        // rkey the peer got writes nothing afterwards (the cache's own
        // chunks grant no remote access at all).
        // SAFETY: the receive's buffer stays alive and in place until the
        // `Incoming` entry (which holds the registration) is removed: it is
        // owned by the request held in the entry, or borrowed by a blocking
        // call that removes the entry before it returns.
        match unsafe { self.fab.cache.grant_remote_write(dst, grant) } {
            Ok(reg) => {
                let rid = l.next_id;
                l.next_id += 1;
                let remote = reg.remote(dst);
                #[cfg(test)]
                {
                    l.last_grant = Some(remote);
                }
                l.incoming.insert(
                    rid,
                    Incoming {
                        src,
                        env,
                        len,
                        cap,
                        target: t,
                        _reg: reg,
                    },
                );
                let c = Control::Reply {
                    id,
                    rid,
                    dst: remote,
                    len: grant as u64,
                    failed: false,
                };
                self.push_control(l, src, c);
            }
            Err(e) => {
                let c = Control::Reply {
                    id,
                    rid: 0,
                    dst: none,
                    len: 0,
                    failed: true,
                };
                self.push_control(l, src, c);
                Self::rendezvous_in_ended(l, src);
                self.complete_target(l, t, Status::failed(env, registration_error(e)));
            }
        }
    }

    /// Handles one frame from `src` and says what kind it was. Errors are
    /// protocol violations.
    fn on_frame(
        &self,
        l: &mut Local,
        src: Rank,
        frame: &[u8],
    ) -> std::result::Result<wire::Kind, String> {
        let (head, body) =
            wire::decode(frame, self.fab.opts.eager_limit).map_err(|e| e.to_string())?;
        let kind = body.kind();
        let depth = self.fab.opts.recv_depth;
        let window = self.fab.opts.eager_window as u64;
        {
            let p = &mut l.peers[src];
            p.credits += u32::from(head.slots);
            p.window += u64::from(head.bytes);
            if p.credits > depth || p.window > window {
                return Err(format!(
                    "returned more credit than it was given ({} slots of {depth}, {} bytes of {window})",
                    p.credits, p.window
                ));
            }
        }
        let env = Envelope {
            source: src,
            tag: head.tag,
            context: head.context,
        };
        match body {
            Body::Eager(payload) => {
                let n = payload.len() as u64;
                if l.peers[src].held_bytes + n > window {
                    return Err(format!("eager data beyond its window of {window} bytes"));
                }
                let sync = (head.flags & FLAG_SYNC != 0).then_some(head.id);
                if let Some((_, t)) = l.matching.take_posted(&env) {
                    self.copy_into(l, env, payload, t);
                    l.peers[src].owed_bytes += n;
                    if let Some(id) = sync {
                        self.push_control(l, src, Control::Ack { id });
                    }
                } else {
                    l.peers[src].held_bytes += n;
                    let data = payload.to_vec();
                    l.matching
                        .push_unexpected(env, Unexpected::Eager { data, sync });
                }
            }
            Body::RndzStart { len } => {
                let len = usize::try_from(len)
                    .ok()
                    .filter(|&n| n <= isize::MAX as usize)
                    .ok_or_else(|| format!("rendezvous length {len} too large"))?;
                l.peers[src].rndv_in += 1;
                if l.peers[src].rndv_in > rndv_window() {
                    return Err(format!(
                        "more than {} unfinished rendezvous sends",
                        rndv_window()
                    ));
                }
                if let Some((_, t)) = l.matching.take_posted(&env) {
                    self.reply(l, env, head.id, len, t);
                } else {
                    l.matching
                        .push_unexpected(env, Unexpected::Start { id: head.id, len });
                }
            }
            Body::RndzReply {
                rid,
                addr,
                len,
                rkey,
            } => {
                let id = head.id;
                let s = l
                    .sends
                    .get_mut(&id)
                    .filter(|s| s.dest == src && s.stage == Stage::AwaitReply)
                    .ok_or_else(|| format!("RNDZ_REPLY for unknown send {id}"))?;
                if len > s.len as u64 {
                    return Err(format!(
                        "RNDZ_REPLY grants {len} bytes for a {}-byte message",
                        s.len
                    ));
                }
                if head.flags & FLAG_FAILED != 0 {
                    let e = Error::transport(
                        format!("rendezvous send to rank {src}"),
                        std::io::Error::other("the receiver could not register its buffer"),
                    );
                    self.complete_send(l, id, Err(e));
                } else if len == 0 {
                    self.complete_send(l, id, Ok(()));
                } else {
                    let len = len as usize;
                    // SAFETY: the send's buffer stays alive and unmoved until
                    // the send is removed, which drops this registration first.
                    match unsafe { self.fab.cache.register(s.data.cast_mut(), len) } {
                        Ok(reg) => {
                            s.reg = Some(reg);
                            s.stage = Stage::Writing { posted: false };
                            let dst = RemoteAddr { addr, rkey };
                            self.push_control(l, src, Control::WriteEnd { id, rid, dst, len });
                        }
                        Err(e) => {
                            self.complete_send(l, id, Err(registration_error(e)));
                            self.push_control(l, src, Control::EndFailed { rid });
                        }
                    }
                }
            }
            Body::RndzEnd => {
                let rid = head.id;
                if !l.incoming.get(&rid).is_some_and(|i| i.src == src) {
                    return Err(format!("RNDZ_END for unknown receive {rid}"));
                }
                let inc = l.incoming.remove(&rid).expect("present");
                Self::rendezvous_in_ended(l, src);
                let st = if head.flags & FLAG_FAILED != 0 {
                    let e = Error::transport(
                        format!("rendezvous receive from rank {src}"),
                        std::io::Error::other("the sender could not register its buffer"),
                    );
                    Status::failed(inc.env, e)
                } else {
                    Status::received(inc.env, inc.len, inc.cap)
                };
                self.complete_target(l, inc.target, st);
            }
            Body::Ack => {
                let id = head.id;
                if !l
                    .sends
                    .get(&id)
                    .is_some_and(|s| s.dest == src && s.stage == Stage::AwaitAck)
                {
                    return Err(format!("ACK for unknown send {id}"));
                }
                self.complete_send(l, id, Ok(()));
            }
            Body::Credit => {}
        }
        Ok(kind)
    }

    /// Sends a `CREDIT` to `dest` if enough is owed and nothing else is
    /// going there to carry it.
    fn return_credit(&self, l: &mut Local, dest: Rank) {
        if !self.owes_enough(&l.peers[dest]) || l.peers[dest].gone.is_some() {
            return;
        }
        let p = &l.peers[dest];
        if !p.control.is_empty() || !p.backlog.is_empty() {
            self.flush_peer(l, dest);
        }
        let still = self.owes_enough(&l.peers[dest]);
        if still && self.can_post(l, dest, 1, true) {
            let _ = self.post_message(l, dest, Header::default(), Body::Credit, None);
        }
    }

    /// Whether enough is owed to `p` to send a `CREDIT` on its own: a
    /// quarter of its slots used by data, half its byte window, or half its
    /// slots of any kind. The last rule returns the slots the peer's own
    /// `CREDIT` messages used, which nothing else would return while no data
    /// goes its way: without it a peer whose credits went into `CREDIT`
    /// messages could be left with one credit and a reply it cannot send.
    /// Each `CREDIT` it triggers returns at least half the slots and uses
    /// one, so `CREDIT`s cannot bounce back and forth for long.
    fn owes_enough(&self, p: &Peer) -> bool {
        let depth = self.fab.opts.recv_depth;
        p.owed_by_data >= (depth / 4).max(1)
            || p.owed_slots * 2 >= depth
            || p.owed_bytes * 2 >= self.fab.opts.eager_window as u64
    }

    fn repost(&self, l: &mut Local, src: Rank, slot: u32, by_data: bool) {
        match self.fab.post_recv_slot(src, slot) {
            Ok(()) => {
                let p = &mut l.peers[src];
                p.owed_slots += 1;
                p.owed_by_data += u32::from(by_data);
            }
            Err(e) => {
                let err = Error::transport(format!("re-post a receive for rank {src}"), e);
                self.fail_peer(l, src, err);
            }
        }
    }

    // ------------------------------------------------------------ progress

    /// Polls both completion queues and moves queued work; true if anything
    /// happened.
    fn progress_locked(&self, l: &mut Local) -> bool {
        let before = l.events;
        let mut wcs = std::mem::take(&mut l.wcs);
        loop {
            let n = self.fab.recv_cq.poll(&mut wcs).unwrap_or(0);
            for wc in &wcs[..n] {
                self.on_recv_completion(l, wc);
            }
            let m = self.fab.send_cq.poll(&mut wcs).unwrap_or(0);
            for wc in &wcs[..m] {
                self.on_send_completion(l, wc);
            }
            l.events += (n + m) as u64;
            if n < POLL_BATCH && m < POLL_BATCH {
                break;
            }
        }
        l.wcs = wcs;
        let any = l.events != before;
        if any {
            // Completions return credits, send slots and send-queue room:
            // what waited for them (queued messages, credit owed to peers)
            // goes now. Nothing else frees these resources.
            for d in 0..self.fab.size {
                if d == self.fab.rank {
                    continue;
                }
                let p = &l.peers[d];
                if !p.control.is_empty() || !p.backlog.is_empty() {
                    self.flush_peer(l, d);
                }
                let p = &l.peers[d];
                if p.owed_slots > 0 || p.owed_bytes > 0 {
                    self.return_credit(l, d);
                }
            }
        }
        if any {
            self.notify(l);
        }
        any
    }

    fn on_recv_completion(&self, l: &mut Local, wc: &WorkCompletion) {
        let src = (wc.wr_id() >> 32) as Rank;
        let slot = wc.wr_id() as u32;
        if src >= self.fab.size || src == self.fab.rank {
            return; // not ours (cannot happen)
        }
        if !wc.is_success() {
            // Flushes after we failed the peer are expected; anything else
            // (the queue pair entered the error state) fails it now.
            if l.peers[src].gone.is_none() {
                let e = wr_error(wc, src, "receive");
                self.fail_peer(l, src, e);
            }
            return;
        }
        if l.peers[src].gone.is_some() {
            return; // its queue pair is in the error state
        }
        let off = self.fab.recv_offset(src, slot);
        let len = (wc.byte_len() as usize).min(self.fab.slot_len);
        // SAFETY: slot (src, slot) is not posted (its completion is being
        // handled), so neither the NIC nor a peer writes it until `repost`
        // below; the range is inside the receive region.
        let frame = unsafe {
            std::slice::from_raw_parts(self.fab.recv_mr.as_mut_ptr().add(off).cast_const(), len)
        };
        match self.on_frame(l, src, frame) {
            Ok(kind) => {
                if l.peers[src].gone.is_none() {
                    // The credit owed goes with the batch (progress_locked).
                    self.repost(l, src, slot, kind != wire::Kind::Credit);
                }
            }
            Err(what) => {
                let e = Error::Protocol { rank: src, what };
                self.fail_peer(l, src, e);
            }
        }
    }

    fn on_send_completion(&self, l: &mut Local, wc: &WorkCompletion) {
        let id = wc.wr_id();
        let (dest, completes) = match id & WR_KIND {
            WR_SLOT => {
                let slot = (id & !WR_KIND) as u32;
                let u = l.slot_use[slot as usize];
                l.slot_use[slot as usize] = (0, None);
                l.free_slots.push(slot);
                u
            }
            WR_WRITE => {
                // A failed write ends its send at once (later requests of
                // the queue pair are flushed, not executed); a successful
                // one waits for its RNDZ_END.
                let send = id & !WR_KIND;
                let Some(s) = l.sends.get(&send) else {
                    return; // already failed by an earlier write
                };
                (s.dest, (!wc.is_success()).then_some(send))
            }
            #[cfg(test)]
            WR_RAW => {
                let dest = (id & !WR_KIND) as Rank;
                l.raw_write = Some(if wc.is_success() {
                    Ok(())
                } else {
                    Err(wr_error(wc, dest, "raw RDMA write").to_string())
                });
                l.peers[dest].sq_free += 1;
                if !wc.is_success() && l.peers[dest].gone.is_none() {
                    self.fail_peer(l, dest, wr_error(wc, dest, "raw RDMA write"));
                }
                return;
            }
            _ => return,
        };
        l.peers[dest].sq_free += 1;
        let result = if wc.is_success() {
            Ok(())
        } else {
            let e = l.peers[dest]
                .gone
                .clone()
                .unwrap_or_else(|| wr_error(wc, dest, "send"));
            if l.peers[dest].gone.is_none() {
                self.fail_peer(l, dest, e.clone());
            }
            Err(e)
        };
        if let Some(send) = completes {
            self.complete_send(l, send, result);
        }
    }

    /// Fails everything that involves `d` with `err`; its queue pair goes to
    /// the error state, so it can no longer read or write our memory.
    fn fail_peer(&self, l: &mut Local, d: Rank, err: Error) {
        if d == self.fab.rank || l.peers[d].gone.is_some() {
            return;
        }
        l.events += 1;
        l.peers[d].gone = Some(err.clone());
        l.peers[d].rndv_in = 0;
        if let Some(qp) = &self.fab.qps[d] {
            if let Err(e) = qp.modify_to_error() {
                eprintln!("ibvx: cannot move the queue pair of rank {d} to the error state: {e}");
            }
        }
        let env = Envelope {
            source: d,
            tag: -1,
            context: 0,
        };
        for t in l
            .matching
            .remove_posted_where(|p, _| p.source == Source::Rank(d))
        {
            self.complete_target(l, t, Status::failed(env, err.clone()));
        }
        let queued: Vec<u64> = l.peers[d].backlog.drain(..).collect();
        let control: Vec<Control> = l.peers[d].control.drain(..).collect();
        for id in queued {
            self.complete_send(l, id, Err(err.clone()));
        }
        for c in control {
            if let Control::WriteEnd { id, .. } = c {
                self.complete_send(l, id, Err(err.clone()));
            }
        }
        // Sends waiting for the peer; those with posted work requests
        // complete when the requests flush.
        let waiting: Vec<u64> = l
            .sends
            .iter()
            .filter(|(_, s)| s.dest == d && !matches!(s.stage, Stage::Writing { posted: true }))
            .map(|(&id, _)| id)
            .collect();
        for id in waiting {
            self.complete_send(l, id, Err(err.clone()));
        }
        let rids: Vec<u64> = l
            .incoming
            .iter()
            .filter(|(_, i)| i.src == d)
            .map(|(&r, _)| r)
            .collect();
        for rid in rids {
            let inc = l.incoming.remove(&rid).expect("present");
            self.complete_target(l, inc.target, Status::failed(inc.env, err.clone()));
        }
        // Unexpected rendezvous starts from it fail when matched; its eager
        // messages are still delivered.
    }

    /// Applies the bootstrap's departure notices (at most every
    /// [`DEPARTURE_CHECK`] unless `now`).
    fn check_departures(&self, l: &mut Local, now: bool) {
        if !now {
            // The clock is read every DEPARTURE_POLLS calls only: a busy
            // wait calls this on every poll, and reading the clock can be a
            // system call (in a virtual machine, it often is).
            l.departure_polls += 1;
            if l.departure_polls < DEPARTURE_POLLS {
                return;
            }
            l.departure_polls = 0;
            if l.last_departure_check.elapsed() < DEPARTURE_CHECK {
                return;
            }
        }
        l.last_departure_check = Instant::now();
        let Ok(deps) = self.boot.departures() else {
            return;
        };
        if deps.len() == l.departures_seen {
            return;
        }
        l.departures_seen = deps.len();
        // What departed peers sent before leaving is delivered first.
        self.progress_locked(l);
        for d in deps {
            if d.rank < self.fab.size && l.peers[d.rank].gone.is_none() && d.rank != self.fab.rank {
                let why = if d.clean {
                    "peer finished"
                } else {
                    "peer process died or lost its connection"
                };
                self.fail_peer(l, d.rank, lost(d.rank, why));
            }
        }
        self.notify(l);
    }

    /// Wakes threads waiting for something to complete (`l` is the locked
    /// state: waiters register there before they sleep).
    fn notify(&self, l: &Local) {
        if l.cond_waiters > 0 {
            self.cond.notify_all();
        }
        if self.sleeper.load(Ordering::Acquire) {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a valid u64 to our eventfd.
            unsafe {
                libc::write(
                    self.wake.as_raw_fd(),
                    (&one as *const u64).cast(),
                    std::mem::size_of::<u64>(),
                )
            };
        }
    }

    /// Sleeps on the completion channel and the wake-up eventfd; the
    /// caller holds the sleeper role and has armed both queues.
    fn sleep_on_channel(&self) {
        let mut fds = [
            libc::pollfd {
                fd: self.fab.channel.fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two valid pollfds.
        unsafe { libc::poll(fds.as_mut_ptr(), 2, SLEEP.as_millis() as libc::c_int) };
        if fds[0].revents & libc::POLLIN != 0 {
            // Take (and acknowledge) every pending event without blocking.
            while let Ok(Some(_)) = self.fab.channel.get_event(Some(Duration::ZERO)) {}
        }
        if fds[1].revents & libc::POLLIN != 0 {
            let mut v: u64 = 0;
            // SAFETY: reads 8 bytes into a valid u64 from our non-blocking eventfd.
            unsafe {
                libc::read(
                    self.wake.as_raw_fd(),
                    (&mut v as *mut u64).cast(),
                    std::mem::size_of::<u64>(),
                )
            };
        }
    }

    /// Makes progress until `done` (called under the lock after progress)
    /// says so: spins a while, then sleeps on the completion channel (one
    /// thread) or the condition variable (the others). With
    /// `until_closed`, a closed device ends the wait with `Closed`.
    fn block_until(
        &self,
        until_closed: bool,
        mut done: impl FnMut(&Self, &mut Local) -> Result<bool>,
    ) -> Result<()> {
        let mut idle = 0u32;
        let mut l = self.lock();
        loop {
            let moved = self.progress_locked(&mut l);
            self.check_departures(&mut l, false);
            if done(self, &mut l)? {
                return Ok(());
            }
            if until_closed && self.closed.load(Ordering::Acquire) {
                return Err(Error::Closed);
            }
            if moved {
                idle = 0;
            }
            if idle < SPIN_POLLS {
                idle += 1;
                drop(l);
                if idle % 64 == 0 {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
                l = self.lock();
                continue;
            }
            if !self.sleeper.swap(true, Ordering::AcqRel) {
                // Arm, then look once more: a completion that arrived
                // before arming raises no event.
                let armed = self.fab.send_cq.req_notify(false).is_ok()
                    && self.fab.recv_cq.req_notify(false).is_ok();
                let moved = self.progress_locked(&mut l);
                if !armed || moved || done(self, &mut l)? {
                    self.sleeper.store(false, Ordering::Release);
                    continue;
                }
                drop(l);
                self.sleep_on_channel();
                self.sleeper.store(false, Ordering::Release);
                l = self.lock();
                // Others may be waiting for what the channel announced.
                if l.cond_waiters > 0 {
                    self.cond.notify_all();
                }
            } else {
                l.cond_waiters += 1;
                l = self
                    .cond
                    .wait_timeout(l, SLEEP)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
                l.cond_waiters -= 1;
            }
            self.check_departures(&mut l, true);
        }
    }

    // ------------------------------------------------------------ operations

    pub(crate) fn blocking_send(
        &self,
        buf: &[u8],
        dest: Rank,
        tag: Tag,
        context: Context,
        sync: bool,
    ) -> Result<()> {
        check_send(dest, tag, self.fab.size)?;
        self.check_open()?;
        // Made before the send is published: on any exit, an unwind
        // included, it waits until the NIC and the peer are done with `buf`.
        let settle = SettleSend {
            engine: self,
            waiter: Default::default(),
        };
        let mut l = self.lock();
        if self.closing.load(Ordering::Acquire) {
            // `finish` may be past its wait for our sends.
            return Err(Error::Closed);
        }
        let out = Outgoing {
            dest,
            tag,
            context,
            data: buf,
            sync,
        };
        let started = self.start(&mut l, out, || {
            let w = BlockingSend::new();
            *settle.waiter.borrow_mut() = Some(w.clone());
            SendOwner::Blocking(w)
        })?;
        if !started {
            return Ok(());
        }
        drop(l);
        let w = settle
            .waiter
            .borrow()
            .clone()
            .expect("a send in the engine has its waiter");
        #[cfg(test)]
        if PANIC_AFTER_PUBLISH.with(|p| p.replace(false)) {
            panic!("injected: unwinding out of a published blocking send");
        }
        // The NIC or the peer may read `buf` until the send is out of the
        // engine: this wait ignores our own closing (finish waits for it).
        let _ = self.block_until(false, |_, _| Ok(w.is_done()));
        w.outcome()
    }

    pub(crate) fn start_send(
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
        if let Err(e) = check_send(dest, tag, self.fab.size).and_then(|_| self.check_open()) {
            let core = self
                .tracker
                .rejected(RequestKind::Send, buf, Status::failed(env, e));
            return Request::new(core, self.clone());
        }
        let core = self.tracker.start(RequestKind::Send, buf);
        // SAFETY: the request owns the buffer; it is neither moved nor freed
        // while the core lives, and the engine keeps the core while it
        // holds the pointer.
        let data = unsafe { std::slice::from_raw_parts(core.buffer_ptr(), core.buffer_len()) };
        let mut l = self.lock();
        if self.closing.load(Ordering::Acquire) {
            // `finish` began after our first check (it sets `closing`
            // before it waits and empties the queues under this lock).
            drop(l);
            self.tracker
                .complete(&core, Status::failed(env, Error::Closed));
            return Request::new(core, self.clone());
        }
        let out = Outgoing {
            dest,
            tag,
            context,
            data,
            sync,
        };
        match self.start(&mut l, out, || SendOwner::Request(core.clone())) {
            Ok(true) => {}
            Ok(false) => {
                self.tracker.complete(&core, Status::ok(env, data.len()));
            }
            Err(e) => {
                self.tracker.complete(&core, Status::failed(env, e));
            }
        }
        drop(l);
        Request::new(core, self.clone())
    }

    pub(crate) fn start_recv(self: &Arc<Self>, buf: Buffer, pattern: Pattern) -> Request {
        let env = Envelope {
            source: self.fab.rank,
            tag: -1,
            context: pattern.context,
        };
        if let Err(e) =
            check_recv(pattern.source, pattern.tag, self.fab.size).and_then(|_| self.check_open())
        {
            let core = self
                .tracker
                .rejected(RequestKind::Recv, buf, Status::failed(env, e));
            return Request::new(core, self.clone());
        }
        let core = self.tracker.start(RequestKind::Recv, buf);
        let mut l = self.lock();
        if self.closing.load(Ordering::Acquire) {
            // `finish` began after our first check: it empties the posted
            // queue under this lock, so nothing posted now would complete.
            drop(l);
            self.tracker
                .complete(&core, Status::failed(env, Error::Closed));
            return Request::new(core, self.clone());
        }
        self.post(&mut l, pattern, Target::Request(core.clone()), |id| {
            core.set_token(id.as_u64())
        });
        drop(l);
        Request::new(core, self.clone())
    }

    /// Posts receive `t`: delivers a matching unexpected message, or queues
    /// it (`queued` gets its id), or fails it if its source is gone.
    fn post(&self, l: &mut Local, pattern: Pattern, t: Target, queued: impl FnOnce(PostedId)) {
        if let Source::Rank(s) = pattern.source {
            if s != self.fab.rank && l.peers[s].gone.is_some() {
                // What it sent before leaving is still deliverable.
                if let Some((env, msg)) = l.matching.take(&pattern) {
                    self.deliver(l, env, msg, t);
                } else {
                    let env = Envelope {
                        source: s,
                        tag: -1,
                        context: pattern.context,
                    };
                    let e = Self::gone_error(l, s).expect("gone");
                    self.complete_target(l, t, Status::failed(env, e));
                }
                return;
            }
        }
        match l.matching.post(pattern, t) {
            Posted::Matched { env, msg, recv } => self.deliver(l, env, msg, recv),
            Posted::Queued(id) => queued(id),
        }
    }

    pub(crate) fn recv_into(&self, buf: &mut [u8], pattern: Pattern) -> Result<Status> {
        check_recv(pattern.source, pattern.tag, self.fab.size)?;
        self.check_open()?;
        let b = BlockingRecv::new(buf);
        // Made before the receive is posted: on any exit, an unwind
        // included, it takes the receive back out of the engine (and stops
        // a peer writing into `buf`).
        let mut guard = Unpost {
            engine: self,
            recv: &b,
            id: None,
        };
        {
            let mut l = self.lock();
            if self.closing.load(Ordering::Acquire) {
                return Err(Error::Closed);
            }
            self.post(&mut l, pattern, Target::Blocking(b.clone()), |p| {
                guard.id = Some(p)
            });
        }
        let r = if b.is_done() {
            Ok(())
        } else {
            self.block_until(true, |_, _| Ok(b.is_done()))
        };
        drop(guard);
        if b.is_done() {
            return b.outcome();
        }
        r?;
        Err(Error::Closed)
    }

    pub(crate) fn probe(&self, pattern: Pattern, block: bool) -> Result<Option<Status>> {
        check_recv(pattern.source, pattern.tag, self.fab.size)?;
        self.check_open()?;
        let mut found = None;
        let mut look = |_: &Self, l: &mut Local| -> Result<bool> {
            found = l
                .matching
                .probe(&pattern)
                .map(|(env, u)| Status::ok(env, u.len()));
            if found.is_none() {
                if let Source::Rank(s) = pattern.source {
                    if let Some(e) = Self::gone_error(l, s) {
                        return Err(e);
                    }
                }
            }
            Ok(found.is_some() || !block)
        };
        if block {
            self.block_until(true, &mut look)?;
        } else {
            let mut l = self.lock();
            self.progress_locked(&mut l);
            self.check_departures(&mut l, false);
            look(self, &mut l)?;
        }
        Ok(found)
    }

    pub(crate) fn peek(&self) -> Result<Option<Peeked>> {
        let mut found = None;
        self.block_until(true, |eng, _| {
            found = eng.tracker.pop_completed();
            Ok(found.is_some() || eng.tracker.outstanding() == 0)
        })?;
        Ok(found.or_else(|| self.tracker.pop_completed()))
    }

    pub(crate) fn finish(&self) -> Result<()> {
        if self.closing.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        // Our sends, our replies and the rendezvous receives peers are
        // writing must be through before we stop.
        let r = self.block_until(false, |eng, l| {
            Ok(eng.tracker.outstanding_sends() == 0
                && l.sends.is_empty()
                && l.peers
                    .iter()
                    .all(|p| p.control.is_empty() && p.backlog.is_empty())
                && l.incoming.is_empty())
        });
        let mut l = self.lock();
        let env = Envelope {
            source: self.fab.rank,
            tag: -1,
            context: 0,
        };
        for t in l.matching.remove_posted_where(|_, _| true) {
            self.complete_target(&mut l, t, Status::failed(env, Error::Closed));
        }
        l.matching.drain_unexpected();
        self.closed.store(true, Ordering::Release);
        self.notify(&l);
        r
    }
}

/// Settles a blocking send on every exit, an unwind included: once the send
/// is published the NIC may read the caller's buffer (an eager send from
/// it, an RDMA write) until its completion, so a call that unwinds waits
/// for that here.
struct SettleSend<'e> {
    engine: &'e Engine,
    waiter: std::cell::RefCell<Option<Arc<BlockingSend>>>,
}

impl Drop for SettleSend<'_> {
    fn drop(&mut self) {
        if let Some(w) = self.waiter.get_mut().take() {
            if !w.is_done() {
                let _ = self.engine.block_until(false, |_, _| Ok(w.is_done()));
            }
        }
    }
}

/// Takes a blocking receive out of the engine when its call ends, even by
/// unwinding, so that the engine never keeps a pointer into a buffer whose
/// borrow ended.
struct Unpost<'e> {
    engine: &'e Engine,
    recv: &'e Arc<BlockingRecv>,
    id: Option<PostedId>,
}

impl Drop for Unpost<'_> {
    fn drop(&mut self) {
        if self.recv.is_done() {
            return;
        }
        let eng = self.engine;
        let mut l = eng.lock();
        if let Some(id) = self.id {
            l.matching.cancel(id);
        }
        // A peer granted our buffer must stop writing it before we return.
        let writer = l
            .incoming
            .values()
            .find(|i| i.target.is(self.recv))
            .map(|i| i.src);
        if let Some(src) = writer {
            eng.fail_peer(&mut l, src, Error::Closed);
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Sends whose data a peer or the NIC may still read (the device was
        // dropped without finish while a peer was slow): keep their buffers
        // rather than free memory that may be in use.
        let l = self.local.get_mut().unwrap_or_else(|p| p.into_inner());
        for (_, s) in l.sends.drain() {
            if let SendOwner::Request(core) = s.owner {
                if matches!(s.stage, Stage::Writing { posted: true }) {
                    std::mem::forget(core);
                }
            }
        }
        for (_, inc) in l.incoming.drain() {
            std::mem::forget(inc.target);
        }
    }
}

impl Progress for Engine {
    fn progress(&self) {
        if let Ok(mut l) = self.local.try_lock() {
            self.progress_locked(&mut l);
            self.check_departures(&mut l, false);
        }
    }

    fn wait(&self, core: &RequestCore) {
        let _ = self.block_until(true, |_, _| Ok(core.is_done()));
        // A closed device completes every request it holds; spin out the
        // tiny window before that completion lands.
        while !core.is_done() {
            std::thread::yield_now();
        }
    }

    fn cancel(&self, core: &xdev::CoreRef) -> bool {
        let mut l = self.lock();
        let t = unpost(&mut l.matching, core);
        t.map(|t| self.complete_target(&mut l, t, cancelled()))
            .is_some()
    }
}
