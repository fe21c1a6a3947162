//! A matched queue with its table of outstanding requests.

use std::ffi::c_int;
use std::mem::MaybeUninit;
use std::ops::{Deref, DerefMut};
use std::time::Duration;

use psm_sys::ffi::*;
use xdev::Result;

use super::queue::{MatchedQueue, MqStatus, MqTag, Selector};

mod lent;
mod table;

pub use lent::{LentTest, StatusSlot};
use table::Table;

// Keys travel through PSM2 as the request's context pointer: 64 bits of
// index and generation. (libpsm2 exists for x86_64 only.)
const _: () = assert!(usize::BITS == 64, "PSM2 request keys need 64-bit pointers");

/// Names one outstanding request of a [`TrackedQueue`]: its table (the
/// top bit: the lent table), its slot there and the slot's generation (31
/// bits), so a key stays unique after its request is gone and the slot
/// reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RequestKey(u64);

/// The top bit of a key: it names a lent receive (see `tracked/lent.rs`).
const LENT_BIT: u64 = 1 << 63;
/// The generations a slot goes through before its keys repeat.
const GENERATIONS: u32 = 1 << 31;

impl RequestKey {
    #[inline]
    fn new(index: usize, generation: u32) -> RequestKey {
        RequestKey(u64::from(generation % GENERATIONS) << 32 | index as u64)
    }

    #[inline]
    fn index(self) -> usize {
        (self.0 & u64::from(u32::MAX)) as usize
    }

    #[inline]
    fn generation(self) -> u32 {
        ((self.0 & !LENT_BIT) >> 32) as u32
    }

    /// Whether the key names a lent receive
    /// ([`irecv_lent`](TrackedQueue::irecv_lent)).
    #[inline]
    pub fn is_lent(self) -> bool {
        self.0 & LENT_BIT != 0
    }

    /// The key of the request a status of
    /// [`collect`](TrackedQueue::collect) reports (its PSM2 context).
    #[inline]
    pub fn of(st: &MqStatus) -> RequestKey {
        RequestKey(st.context as u64)
    }

    /// The key as a number (e.g. a request's token).
    #[inline]
    pub fn to_u64(self) -> u64 {
        self.0
    }

    /// The key of [`to_u64`](Self::to_u64)'s number. A number that names no
    /// outstanding request names none in the table either.
    #[inline]
    pub fn from_u64(v: u64) -> RequestKey {
        RequestKey(v)
    }
}

/// A [`MatchedQueue`] and the tables of its outstanding non-blocking
/// requests: each with its owner's payload `T` (what completes it: a
/// request, the memory it uses...), and the lent receives, each with its
/// payload `L` (see [`irecv_lent`](Self::irecv_lent)).
///
/// The table holds every PSM2 request handle from its post until PSM2 frees
/// it (a completion, a test, a cancel), so none is used afterwards (PSM2
/// reuses handles at once). Dropping the queue finalizes it and closes the
/// endpoint, forced, *then* drops the payloads: PSM2 lets go of every
/// request's memory in the close, so memory a payload owns may be what a
/// request used. [`close`](Self::close) does the same gracefully and hands
/// the payloads back.
pub struct TrackedQueue<T, L = ()> {
    /// Dropped first (field order), before the payloads.
    mq: MatchedQueue,
    slots: Table<T, false>,
    lent: Table<L, true>,
}

impl<T, L> TrackedQueue<T, L> {
    /// Tracks the requests of `mq`.
    pub fn new(mq: MatchedQueue) -> Self {
        TrackedQueue {
            mq,
            slots: Table::new(),
            lent: Table::new(),
        }
    }

    /// Enters `req` under `key`, which [`next_key`](Self::next_key) gave
    /// with nothing entered or freed since, and returns it.
    #[inline(always)]
    fn insert(
        &mut self,
        key: RequestKey,
        req: psm2_mq_req_t,
        recv: bool,
        payload: T,
    ) -> RequestKey {
        let index = self.slots.claim();
        debug_assert_eq!(index, key.index(), "the slot next_key named");
        self.slots.fill(index, req, recv, payload);
        key
    }

    /// The next key `insert` hands out, as a context for PSM2 (the request
    /// does not exist yet when it is posted): the key the next
    /// [`isend`](Self::isend) or [`irecv`](Self::irecv) returns, so that
    /// its payload can name it before the post.
    #[inline]
    pub fn next_key(&self) -> RequestKey {
        self.slots.next_key()
    }

    /// Posts a send of `len` bytes at `buf` to `peer` (`psm2_mq_isend2`;
    /// with `sync`, complete only once a receive matched it), tracked with
    /// `payload` (dropped at once if the post fails).
    ///
    /// # Safety
    /// `buf` must be valid for reads of `len` bytes and not be written until
    /// the request leaves the table: returned by
    /// [`collect`](Self::collect) or
    /// [`test`](Self::test), or the queue closed or dropped. (Memory the
    /// payload owns qualifies, if moving the payload does not move it.)
    #[inline]
    pub unsafe fn isend(
        &mut self,
        peer: usize,
        tag: MqTag,
        (buf, len): (*const u8, usize),
        sync: bool,
        payload: T,
    ) -> Result<RequestKey> {
        let key = self.next_key();
        // SAFETY: the caller's contract covers the post's; the request is
        // entered in the table at once.
        let req = unsafe {
            self.mq
                .post_send(peer, sync, tag, (buf, len), key.0 as usize)?
        };
        Ok(self.insert(key, req, false, payload))
    }

    /// Posts a send as [`isend`](Self::isend) does, then tests it once
    /// (`psm2_mq_test2`): a send PSM2 completed inside the post (an eager
    /// send it has copied out) never enters the table, and its status is
    /// returned as `Err`. Otherwise `track` makes the payload, which enters
    /// the table under the returned key, and a value of the caller's, which
    /// is returned with the key.
    ///
    /// # Safety
    /// As [`isend`](Self::isend); when this returns `Err` (the status),
    /// PSM2 no longer uses `buf`.
    #[inline]
    pub unsafe fn isend_unless_done<X>(
        &mut self,
        peer: usize,
        tag: MqTag,
        (buf, len): (*const u8, usize),
        sync: bool,
        track: impl FnOnce(RequestKey) -> (T, X),
    ) -> Result<Result<(RequestKey, X), MqStatus>> {
        let key = self.next_key();
        // SAFETY: the caller's contract covers the post's; the request is
        // tested at once, and entered in the table if it is still live.
        let req = unsafe {
            self.mq
                .post_send(peer, sync, tag, (buf, len), key.0 as usize)?
        };
        // SAFETY: req is the live request just posted (nobody else can
        // reach it: `&mut self`).
        if let Some(st) = unsafe { self.test_live(req) } {
            return Ok(Err(st));
        }
        let (payload, x) = track(key);
        Ok(Ok((self.insert(key, req, false, payload), x)))
    }

    /// Posts a receive of up to `len` bytes at `buf` for what `sel` matches
    /// (`psm2_mq_irecv2`), tracked with `payload` (handed back with the
    /// error if the post fails).
    ///
    /// # Safety
    /// `buf` must be valid for writes of `len` bytes and not be otherwise
    /// accessed until the request leaves the table: returned by
    /// [`collect`](Self::collect), [`test`](Self::test) or
    /// [`cancel`](Self::cancel), or the queue closed or dropped.
    #[inline(always)]
    pub unsafe fn irecv(
        &mut self,
        sel: &Selector,
        (buf, len): (*mut u8, usize),
        payload: T,
    ) -> std::result::Result<RequestKey, (xdev::Error, T)> {
        let key = self.next_key();
        // SAFETY: as in `isend`.
        match unsafe { self.mq.post_recv(sel, buf, len, key.0 as usize) } {
            Ok(req) => Ok(self.insert(key, req, true, payload)),
            Err(e) => Err((e, payload)),
        }
    }

    /// Takes up to a batch of completed requests off PSM2's completion
    /// queue into `batch` (`psm2_mq_ipeek_dequeue_multi`: PSM2 frees each
    /// request once its status is copied, one call for the batch where
    /// `psm2_mq_ipeek2` and `psm2_mq_test2` are two per request). Returns
    /// whether the batch came back full: then more may be waiting. PSM2
    /// polls inside the call when its completion queue is empty, and only
    /// then: calling this until it returns `false` both collects and makes
    /// progress. Each status's payload is then taken with
    /// [`take_completed`](Self::take_completed).
    #[inline]
    pub fn collect(&mut self, batch: &mut CompletionBatch) -> bool {
        let (mq, psm) = self.mq.raw();
        let mut count: c_int = BATCH as c_int;
        // SAFETY: the queue is open; `copy_status` writes index `i` of the
        // array for each `i` below `count` (BATCH, the array's length), and
        // never unwinds; count is a valid in/out pointer.
        let e = unsafe {
            (psm.psm2_mq_ipeek_dequeue_multi)(
                mq,
                batch.statuses.as_mut_ptr().cast(),
                Some(copy_status),
                &mut count,
            )
        };
        // `count` is the number of statuses written (PSM2_OK: all of them;
        // PSM2_MQ_NO_COMPLETIONS: fewer). `copy_status` never fails, so the
        // error return that puts its code in `count` cannot happen; clamp
        // anyway.
        batch.len = usize::try_from(count).unwrap_or(0).min(BATCH);
        e == psm2_error::PSM2_OK && batch.len == BATCH
    }

    /// The key and payload of the request a status of
    /// [`collect`](Self::collect) reports, which leaves the table (PSM2 has
    /// freed its handle). `None` for a request the table does not hold.
    #[inline]
    pub fn take_completed(&mut self, st: &MqStatus) -> Option<(RequestKey, T)> {
        let key = RequestKey(st.context as u64);
        // Every request of this queue that PSM2 can report is in a table:
        // a scope or a blocking receive frees its own before it gives the
        // queue back. A lent one is taken by `take_completed_lent`.
        self.slots.remove(key).map(|p| (key, p))
    }

    /// Request `key`'s payload and status if it has completed
    /// (`psm2_mq_test2` on its handle, which frees it). `None` if it has
    /// not, or if `key` names no outstanding request. Does not poll.
    #[inline]
    pub fn test(&mut self, key: RequestKey) -> Option<(T, MqStatus)> {
        let req = self.slots.live(key)?.req;
        // SAFETY: req is live: it is in the table.
        let st = unsafe { self.test_live(req) }?;
        Some((self.slots.remove(key)?, st))
    }

    /// `psm2_mq_test2` on `req`: its status if it has completed (PSM2 then
    /// freed it), else `None` (it is still live).
    ///
    /// # Safety
    /// `req` is a live request of this queue: not freed by PSM2 yet.
    #[inline(always)]
    unsafe fn test_live(&self, mut req: psm2_mq_req_t) -> Option<MqStatus> {
        let (_, psm) = self.mq.raw();
        let mut st = MaybeUninit::<psm2_mq_status2_t>::zeroed();
        // SAFETY: req is live (the caller's contract); test2 frees it only
        // when it returns PSM2_OK, with the status filled.
        if unsafe { (psm.psm2_mq_test2)(&mut req, st.as_mut_ptr()) } != psm2_error::PSM2_OK {
            return None;
        }
        // SAFETY: zero-initialised (plain data), then filled by PSM2.
        Some(MqStatus::from_raw(unsafe { st.assume_init_ref() }))
    }

    /// Cancels receive `key` if PSM2 has not matched it yet
    /// (`psm2_mq_cancel`, then `psm2_mq_wait2`, which frees it): its
    /// payload; its memory is no longer PSM2's. `None` if it had matched
    /// (it completes as usual), is a send (PSM2 cancels receives only), or
    /// `key` names no outstanding request.
    pub fn cancel(&mut self, key: RequestKey) -> Option<T> {
        let e = self.slots.live(key)?;
        if !e.recv {
            return None;
        }
        let req = e.req;
        // SAFETY: req is a live receive request of this queue (in the table).
        if unsafe { self.cancel_live(req) } {
            self.slots.remove(key)
        } else {
            None
        }
    }

    /// `psm2_mq_cancel` on `req`, then (cancelled) `psm2_mq_wait2`, which
    /// frees it: whether it was cancelled (else PSM2 had matched it, and it
    /// is still live).
    ///
    /// # Safety
    /// `req` is a live receive request of this queue: not freed by PSM2 yet.
    unsafe fn cancel_live(&self, mut req: psm2_mq_req_t) -> bool {
        let (_, psm) = self.mq.raw();
        // SAFETY: req is a live receive request of this queue (the caller's
        // contract).
        if unsafe { (psm.psm2_mq_cancel)(&mut req) } != psm2_error::PSM2_OK {
            return false;
        }
        let mut st = MaybeUninit::<psm2_mq_status2_t>::zeroed();
        // SAFETY: a cancelled request must be returned with test or wait
        // (psm2_mq.h); wait2 frees it.
        unsafe { (psm.psm2_mq_wait2)(&mut req, st.as_mut_ptr()) };
        true
    }

    /// The payload of outstanding request `key`.
    #[inline]
    pub fn get(&self, key: RequestKey) -> Option<&T> {
        self.slots.live(key)?.payload.as_ref()
    }

    /// The payload of outstanding request `key`, to change (say, to one
    /// that drops the completion).
    #[inline]
    pub fn get_mut(&mut self, key: RequestKey) -> Option<&mut T> {
        self.slots.payload_mut(key)
    }

    /// Every outstanding request's key and payload.
    pub fn iter(&self) -> impl Iterator<Item = (RequestKey, &T)> {
        self.slots.iter()
    }

    /// How many requests are outstanding (in both tables).
    pub fn len(&self) -> usize {
        self.slots.len() + self.lent.len()
    }

    /// Whether no request is outstanding.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Finalizes the queue and closes the endpoint at once (forced, as the
    /// queue's drop does), then hands back the payloads of the requests
    /// still outstanding (those of the lent receives second): PSM2 no
    /// longer touches their memory.
    pub fn close_now(self) -> (Vec<T>, Vec<L>) {
        let TrackedQueue {
            mq, slots, lent, ..
        } = self;
        drop(mq);
        (slots.into_payloads(), lent.into_payloads())
    }

    /// Finalizes the queue and closes the endpoint gracefully (up to
    /// `timeout`, forced if that fails), then hands back the payloads of the
    /// requests still outstanding (those of the lent receives second):
    /// PSM2 no longer touches their memory.
    pub fn close(self, timeout: Duration) -> (Vec<T>, Vec<L>) {
        let TrackedQueue {
            mq, slots, lent, ..
        } = self;
        mq.close(timeout);
        (slots.into_payloads(), lent.into_payloads())
    }
}

/// How many completions [`TrackedQueue::collect`] takes per call.
const BATCH: usize = 32;

/// The statuses of one [`TrackedQueue::collect`] call.
pub struct CompletionBatch {
    statuses: [MaybeUninit<MqStatus>; BATCH],
    len: usize,
}

impl CompletionBatch {
    /// An empty batch.
    #[inline]
    pub fn new() -> Self {
        CompletionBatch {
            statuses: [MaybeUninit::uninit(); BATCH],
            len: 0,
        }
    }

    /// The statuses the last `collect` wrote, in completion order.
    #[inline]
    pub fn statuses(&self) -> &[MqStatus] {
        // SAFETY: `collect` set `len` to the number of leading entries PSM2
        // had `copy_status` write (at most BATCH).
        unsafe { std::slice::from_raw_parts(self.statuses.as_ptr().cast(), self.len) }
    }
}

impl Default for CompletionBatch {
    fn default() -> Self {
        Self::new()
    }
}

/// `psm2_mq_ipeek_dequeue_multi`'s callback: copies the status of completed
/// request `req` to entry `i` of the batch, as `psm2_mq_test2` would fill a
/// `psm2_mq_status2_t` (peer, tag, the sender's length, the bytes received,
/// the error code, the context). Returns 1: stored, go on.
///
/// # Safety
/// PSM2 calls it with a valid request and the array and index of the call
/// (`i` below the count it was given).
unsafe extern "C" fn copy_status(
    req: *mut psm2_mq_req_user,
    array: *mut core::ffi::c_void,
    i: c_int,
) -> c_int {
    // SAFETY: the caller's contract: `req` is valid for reads during the
    // call.
    let r = unsafe { &*req };
    // SAFETY: every bit pattern of the union is a valid [u32; 4].
    let t = unsafe { r.tag.tag };
    let st = MqStatus::from_parts(
        r.peer as usize,
        [t[0], t[1], t[2]],
        (r.send_msglen, r.recv_msglen),
        r.error_code,
        r.context as usize,
    );
    // SAFETY: the caller's contract: `array` is the batch's array of BATCH
    // entries and `i` (non-negative, below BATCH) one of them.
    unsafe {
        array
            .cast::<MaybeUninit<MqStatus>>()
            .add(i as usize)
            .write(MaybeUninit::new(st))
    };
    1
}

impl<T, L> Deref for TrackedQueue<T, L> {
    type Target = MatchedQueue;

    #[inline]
    fn deref(&self) -> &MatchedQueue {
        &self.mq
    }
}

/// The queue's own calls (blocking send and receive, probe, scopes) are
/// sound beside tracked requests: each frees its own requests before it
/// returns. (Swapping the queue for another is impossible: a process has at
/// most one.)
impl<T, L> DerefMut for TrackedQueue<T, L> {
    #[inline]
    fn deref_mut(&mut self) -> &mut MatchedQueue {
        &mut self.mq
    }
}

// SAFETY: the tables hold PSM2 handles (raw pointers) that may move between
// threads with the queue they belong to (see `MatchedQueue`'s `Send`), and
// payloads of `Send` types.
unsafe impl<T: Send, L: Send> Send for TrackedQueue<T, L> {}
