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
//!
//! # Layout
//!
//! This file holds the state (the fabric, per-peer and per-send records,
//! everything behind the engine lock), completing sends and receives, and
//! failing a peer. The parts, each an `impl IbvEngine` that imports only from
//! here: `send` (credits, the send backlog, `CREDIT`, starting a send),
//! `post` (work requests: frames from send slots, RDMA writes and
//! `RNDZ_END`, receive slots re-posted in lists, one per peer and poll),
//! `sendq` (send-queue room; small inline frames go unsignalled, with a
//! signalled request at least every [`SIGNAL_EVERY`]), `recv` (frames decoded and
//! dispatched by kind, matching, delivery), `rendezvous` (`RNDZ_START`,
//! `RNDZ_REPLY`, `RNDZ_END` and the grant), `progress` (completions,
//! departures, waking and the blocking wait) and `ops` (what the device
//! calls, with the guards of its blocking calls).

use std::collections::VecDeque;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::AtomicBool;
#[cfg(test)]
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use xdev::bootstrap::Bootstrap;
use xdev::devkit::matching::{FxMap, MatchingEngine};
use xdev::devkit::target::{SendOwner, Target};
use xdev::devkit::{SendTo, Tracker};
use xdev::{BufferId, Context, Envelope, Error, Pattern, Rank, Result, Source, Status, Tag};

use super::options::IbvOptions;
use super::regcache::{Registration, RegistrationCache};
use crate::verbs::{
    CompletionChannel, CompletionQueue, MemoryRegion, QueuePair, RemoteAddr, WorkCompletion,
};
use sendq::SendQueue;

mod ops;
mod post;
mod progress;
mod recv;
mod rendezvous;
mod send;
mod sendq;
#[cfg(test)]
mod test_hooks;

/// Work request ids on the send queue: kind in the top byte.
const WR_SLOT: u64 = 1 << 56;
const WR_WRITE: u64 = 2 << 56;
/// A raw RDMA write posted by a test (`write_raw`).
#[cfg(test)]
const WR_RAW: u64 = 3 << 56;
/// An unsignalled send (the peer in the low bits): its completion only
/// comes as a flush, when the queue pair failed.
const WR_UNSIG: u64 = 4 << 56;
/// Signal at least every this many send requests of a queue pair (at most
/// a quarter of its send queue; see `sendq`).
const SIGNAL_EVERY: u32 = 16;

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

    /// Posts receive slots `slots` of peer `p` on its queue pair, linked
    /// into lists (one provider call per [`RECV_LIST`](crate::verbs::RECV_LIST)
    /// slots); the work request id of slot `s` is `p << 32 | s`.
    ///
    /// The caller must not post a slot that is already posted: a slot is
    /// posted once at start-up and re-posted only after its completion was
    /// handled (`IbvEngine::repost_all`).
    pub(crate) fn post_recv_slots(&self, p: Rank, slots: &[u32]) -> crate::verbs::Result<()> {
        let qp = self.qps[p].as_ref().expect("no QP to self");
        let reqs = slots.iter().map(|&slot| {
            (
                ((p as u64) << 32) | u64::from(slot),
                self.recv_mr.sge(self.recv_offset(p, slot), self.slot_len),
            )
        });
        // SAFETY: each slot is `slot_len` bytes of `recv_mr`, which the
        // fabric owns and which outlives every QP (`qps` is dropped first,
        // destroying them). No slot is posted now (see above), and nothing
        // else uses one until its completion: the engine reads a slot only
        // in `on_recv_completion`, after the NIC is done with it, and never
        // hands out references to it.
        unsafe { qp.post_recv_list(reqs) }
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
    /// The identity of the user buffer the send owns, when the cache may
    /// keep its memory registered (it carries the cache's token).
    user: Option<BufferId>,
}

// SAFETY: `data` points into the send's buffer, owned by its request (held
// in `owner`) or borrowed by a blocking call that waits until the send is
// removed from the engine; it is only used under the engine lock.
unsafe impl Send for OutSend {}

/// One message to send.
#[derive(Copy, Clone)]
struct Outgoing<'a> {
    to: SendTo,
    data: &'a [u8],
    /// See [`OutSend::user`].
    user: Option<BufferId>,
}

/// A rendezvous receive waiting for `RNDZ_END`: the peer may write `target`
/// through `reg` until then; dropping the entry deregisters `reg`, which
/// ends the grant.
struct Incoming {
    src: Rank,
    env: Envelope,
    len: usize,
    cap: usize,
    target: Dest,
    _reg: Registration,
}

/// Where a matched message goes: a receive of the matching engine (a
/// request, or a blocking receive queued behind others), or the blocking
/// receive in the first slot (`Local::first`).
///
/// A `Dest` is handed out once per receive (taken off its queue or its
/// slot) and completed once, by [`IbvEngine::complete_target`] (or held by
/// an [`Incoming`] entry until then).
enum Dest {
    Recv(Target),
    First,
}

impl Dest {
    /// The buffer to deliver into (see [`Target::dst`]; the first slot's
    /// buffer is borrowed by its waiting call, which takes the slot back
    /// before it returns).
    fn dst(&self, l: &Local) -> (*mut u8, usize) {
        match self {
            Dest::Recv(t) => t.dst(),
            Dest::First => l
                .first
                .as_ref()
                .map_or((std::ptr::null_mut(), 0), |f| (f.dst, f.cap)),
        }
    }
}

/// The blocking receive in the first slot: its call's buffer, and its
/// outcome, kept by the engine (no shared completion state to allocate or
/// lock per message). The slot is the call's from `post_first` until the
/// call takes it back (`FirstGuard`), whatever happened meanwhile.
struct FirstRecv {
    pattern: Pattern,
    /// The calling thread's buffer (borrowed while the call waits).
    dst: *mut u8,
    cap: usize,
    /// Taken by a message (a `Dest::First` is out: delivered, or held by an
    /// `Incoming` entry while the peer writes).
    matched: bool,
    /// The outcome, once completed (exactly once).
    status: Option<Status>,
}

impl FirstRecv {
    /// Still waiting for a message (matches before any receive in
    /// `matching`).
    fn is_posted(&self) -> bool {
        !self.matched && self.status.is_none()
    }
}

// SAFETY: `dst` is only an address: the engine writes through it under its
// lock while the slot is occupied, and the call that borrows the buffer
// takes the slot back (stopping any writer first) before it returns.
unsafe impl Send for FirstRecv {}

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
    /// Room on its QP's send queue.
    sq: SendQueue,
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
    /// A blocking receive posted while no other receive was posted: the
    /// earliest posted receive, so matched before any in `matching`, and
    /// kept out of it (queueing a receive there and taking it back costs
    /// hash look-ups and queue bookkeeping per message). Its outcome is
    /// kept here too, until its call takes the slot back.
    first: Option<FirstRecv>,
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
    /// Receive slots whose completions were handled in this poll, to be
    /// re-posted together (peer, slot, whether data used it).
    reposts: Vec<(Rank, u32, bool)>,
    /// Slots of one peer being re-posted (scratch for `repost_all`).
    repost_slots: Vec<u32>,
    /// Send requests posted unsignalled (tests).
    #[cfg(test)]
    unsignaled_posts: u64,
    /// The last remote-write grant this rank sent (tests).
    #[cfg(test)]
    last_grant: Option<RemoteAddr>,
    /// The outcome of the last `write_raw` (tests).
    #[cfg(test)]
    raw_write: Option<std::result::Result<(), String>>,
}

/// The engine of one rank, shared by the device handle and its requests.
pub struct IbvEngine {
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

impl IbvEngine {
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
                sq: SendQueue::new(fab.opts.sq_depth(), SIGNAL_EVERY),
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
        Ok(IbvEngine {
            tracker: Arc::new(Tracker::new()),
            local: Mutex::new(Local {
                matching: MatchingEngine::new(),
                first: None,
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
                reposts: Vec::with_capacity(POLL_BATCH),
                repost_slots: Vec::with_capacity(POLL_BATCH),
                #[cfg(test)]
                unsignaled_posts: 0,
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

    pub(crate) fn options(&self) -> &IbvOptions {
        &self.fab.opts
    }

    pub(crate) fn cache(&self) -> &RegistrationCache {
        &self.fab.cache
    }

    fn lock(&self) -> MutexGuard<'_, Local> {
        self.local.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records a send request posted to `dest` (see `sendq`).
    fn sq_posted(l: &mut Local, dest: Rank, signaled: bool) {
        l.peers[dest].sq.posted(signaled);
        #[cfg(test)]
        {
            l.unsignaled_posts += u64::from(!signaled);
        }
    }

    /// Records a signalled send request of `dest` completed.
    fn sq_completed(l: &mut Local, dest: Rank) {
        l.peers[dest].sq.completed();
    }

    fn gone_error(l: &Local, p: Rank) -> Option<Error> {
        l.peers[p].gone.clone()
    }

    /// Completes send `id` (removing it) with `r`.
    fn complete_send(&self, l: &mut Local, id: u64, r: Result<()>) {
        let Some(mut s) = l.sends.remove(&id) else {
            return;
        };
        // The registration ends before the owner may get its buffer back.
        drop(s.reg.take());
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

    #[inline]
    fn complete_target(&self, l: &mut Local, t: Dest, st: Status) {
        l.events += 1;
        match t {
            Dest::Recv(t) => t.complete(&self.tracker, st),
            Dest::First => {
                if let Some(f) = l.first.as_mut() {
                    debug_assert!(f.status.is_none(), "the first slot completed twice");
                    f.status = Some(st);
                }
            }
        }
    }

    /// Stops the peer that is writing by rendezvous into the receive `into`
    /// picks, if any, by failing it (its writes are over once it has failed:
    /// see `fail_peer`): for a blocking call taking its receive back before
    /// its buffer goes away.
    fn stop_writer_into(&self, l: &mut Local, into: impl Fn(&Dest) -> bool) {
        let writer = l.incoming.values().find(|i| into(&i.target)).map(|i| i.src);
        if let Some(src) = writer {
            self.fail_peer(l, src, Error::Closed);
        }
    }

    /// Completes the first slot's receive with `st` if it is still posted
    /// (not matched) and `which` accepts its pattern.
    fn fail_first_if(&self, l: &mut Local, which: impl FnOnce(&Pattern) -> bool, st: Status) {
        if l.first
            .as_ref()
            .is_some_and(|f| f.is_posted() && which(&f.pattern))
        {
            self.complete_target(l, Dest::First, st);
        }
    }

    /// Fails everything that involves `d` with `err`; its queue pair goes to
    /// the error state, so it can no longer read or write our memory.
    fn fail_peer(&self, l: &mut Local, d: Rank, err: Error) {
        tracing::warn!(peer = d, error = %err, "peer lost");
        if d == self.fab.rank || l.peers[d].gone.is_some() {
            return;
        }
        l.events += 1;
        l.peers[d].gone = Some(err.clone());
        l.peers[d].rndv_in = 0;
        if let Some(qp) = &self.fab.qps[d] {
            if let Err(e) = qp.modify_to_error() {
                tracing::error!(peer = d, error = %e, "cannot move the queue pair to the error state");
            }
        }
        let env = Envelope::untagged(d, 0);
        self.fail_first_if(
            l,
            |p| p.source == Source::Rank(d),
            Status::failed(env, err.clone()),
        );
        let posted = l
            .matching
            .remove_posted_where(|p, _| p.source == Source::Rank(d));
        for t in posted {
            self.complete_target(l, Dest::Recv(t), Status::failed(env, err.clone()));
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
}

impl Drop for IbvEngine {
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
