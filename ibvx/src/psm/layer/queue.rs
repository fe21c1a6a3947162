//! A PSM2 matched queue: tags, selectors, statuses, blocking calls, probes
//! and scopes of non-blocking requests.

use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::ptr;
use std::time::Duration;

use psm_sys::ffi::*;
use psm_sys::Psm2;
use xdev::{Error, Result};

use super::endpoint::Endpoint;
use super::library::psm_error;

/// A PSM2 tag: 96 bits as three words (PSM2's `tag0`, `tag1`, `tag2`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MqTag(pub [u32; 3]);

impl MqTag {
    #[inline]
    fn raw(self) -> psm2_mq_tag_t {
        let [a, b, c] = self.0;
        psm2_mq_tag_t { tag: [a, b, c, 0] }
    }
}

/// What a receive or probe matches: messages from peer `from` (any peer if
/// `None`) whose tag equals `tag` in the bits set in `mask`.
#[derive(Clone, Copy, Debug)]
pub struct Selector {
    /// The sending peer's index on the endpoint, or any.
    pub from: Option<usize>,
    /// The tag to compare.
    pub tag: MqTag,
    /// The tag bits compared (PSM2's tag selector).
    pub mask: MqTag,
}

/// The status of a completed request or a probed message.
#[derive(Clone, Copy, Debug)]
pub struct MqStatus {
    /// The sender's endpoint address (see [`MatchedQueue::peer_of`]).
    peer: usize,
    tag: [u32; 3],
    msg_length: u32,
    nbytes: u32,
    code: u32,
    pub(super) context: usize,
}

impl MqStatus {
    /// The status PSM2 filled in `st`, read field by field.
    ///
    /// Each field is a load of its own width, made where it is used (the
    /// message path reads five; one that went into an `MqStatus` whole, or
    /// volatile reads of every field, kept all eight alive on the stack).
    /// Never a copy of the struct: PSM2 has just written it with narrow
    /// stores, and a wide load across two of them cannot be forwarded from
    /// the store buffer (it waits until every older store has reached the
    /// cache).
    #[inline(always)]
    pub(super) fn from_raw(st: &psm2_mq_status2_t) -> MqStatus {
        // SAFETY: every bit pattern of the union is a valid [u32; 4].
        let t = unsafe { st.msg_tag.tag };
        MqStatus {
            peer: st.msg_peer as usize,
            tag: [t[0], t[1], t[2]],
            msg_length: st.msg_length,
            nbytes: st.nbytes,
            code: st.error_code.0,
            context: st.context as usize,
        }
    }

    /// A status from the fields of a completed request (what
    /// `psm2_mq_test2` copies out of it).
    #[inline]
    pub(super) fn from_parts(
        peer: usize,
        tag: [u32; 3],
        (msg_length, nbytes): (u32, u32),
        code: u32,
        context: usize,
    ) -> MqStatus {
        MqStatus {
            peer,
            tag,
            msg_length,
            nbytes,
            code,
            context,
        }
    }

    /// The message's tag.
    #[inline]
    pub fn tag(&self) -> MqTag {
        MqTag(self.tag)
    }

    /// Bytes PSM2 moved (delivered into a receive buffer).
    #[inline]
    pub fn nbytes(&self) -> u32 {
        self.nbytes
    }

    /// The message length PSM2 reports (for a truncated rendezvous message
    /// in shm mode, the receive buffer's length: `psm_sys`'s docs).
    pub fn msg_length(&self) -> u32 {
        self.msg_length
    }

    /// Whether the request ended without error.
    #[inline]
    pub fn is_ok(&self) -> bool {
        self.code == psm2_error::PSM2_OK.0
    }

    /// Whether a receive ended truncated (`PSM2_MQ_TRUNCATION`).
    #[inline]
    pub fn is_truncated(&self) -> bool {
        self.code == psm2_error::PSM2_MQ_TRUNCATION.0
    }

    /// This status's error code as the error of `call` (meaningful when
    /// not [`is_ok`](Self::is_ok)).
    pub fn error(&self, call: &str) -> Error {
        match Psm2::load() {
            Ok(psm) => psm_error(psm, call, psm2_error(self.code)),
            Err(e) => Error::Config(e.to_string()),
        }
    }
}

/// The context of requests no table tracks (blocking receives, scopes):
/// a key no [`TrackedQueue`](super::TrackedQueue) hands out.
const UNTRACKED: usize = usize::MAX;

/// A message length as PSM2 takes it (`u32`).
#[inline]
pub fn msg_len(len: usize) -> Result<u32> {
    u32::try_from(len)
        .map_err(|_| Error::ResourceExhausted("PSM2 messages are limited to 4 GiB".into()))
}

/// The error of a receive or probe from `from`, a peer that is not
/// connected (out of line: the message path only tests for it).
#[cold]
#[inline(never)]
fn not_connected(from: Option<usize>) -> Error {
    Error::Config(format!("PSM2 peer {from:?} is not connected"))
}

/// The matched queue (MQ) of an [`Endpoint`], which it owns: on drop the
/// queue is finalized, then the endpoint closed (forced).
///
/// At most one exists in a process (it holds the one endpoint). Not `Sync`:
/// PSM2 calls on one queue must not run concurrently, so every operation
/// takes `&mut self` or runs on the one thread that holds it.
pub struct MatchedQueue {
    /// Null once finalized.
    raw: psm2_mq_t,
    /// The endpoint's library's function table (one load on every call).
    psm: &'static Psm2,
    ep: Endpoint,
    /// Request handles of [`Scope`]s, kept for the next one's capacity.
    spare: Vec<psm2_mq_req_t>,
}

// SAFETY: as for `Endpoint`: the handles may move between threads, and no
// two calls on them overlap (not `Sync`; mutation through `&mut self`).
unsafe impl Send for MatchedQueue {}

impl MatchedQueue {
    /// Creates the queue of `ep` (`psm2_mq_init`, with the ordering mask
    /// PSM2 documents as reserved). On failure `ep` is closed.
    pub fn new(ep: Endpoint) -> Result<MatchedQueue> {
        let psm = ep.library().psm();
        let mut raw: psm2_mq_t = ptr::null_mut();
        // SAFETY: the endpoint is open; no options; raw is a valid out-pointer.
        let e = unsafe {
            (psm.psm2_mq_init)(ep.raw(), PSM2_MQ_ORDERMASK_ALL, ptr::null(), 0, &mut raw)
        };
        if e != psm2_error::PSM2_OK {
            return Err(psm_error(psm, "psm2_mq_init", e));
        }
        Ok(MatchedQueue {
            raw,
            psm,
            ep,
            spare: Vec::new(),
        })
    }

    #[inline]
    fn psm(&self) -> &'static Psm2 {
        self.psm
    }

    /// Sets the size from which PSM2's shm device sends by rendezvous
    /// (`PSM2_MQ_RNDV_SHM_SZ`).
    pub fn set_rndv_shm_bytes(&mut self, bytes: u32) -> Result<()> {
        let psm = self.psm();
        // SAFETY: the queue is open; the option takes a u32 read through the
        // pointer during the call.
        let e = unsafe {
            (psm.psm2_mq_setopt)(
                self.raw,
                PSM2_MQ_RNDV_SHM_SZ as i32,
                (&bytes as *const u32).cast(),
            )
        };
        if e != psm2_error::PSM2_OK {
            return Err(psm_error(psm, "psm2_mq_setopt(PSM2_MQ_RNDV_SHM_SZ)", e));
        }
        Ok(())
    }

    /// The endpoint.
    pub fn endpoint(&self) -> &Endpoint {
        &self.ep
    }

    /// The endpoint, to connect peers.
    pub fn endpoint_mut(&mut self) -> &mut Endpoint {
        &mut self.ep
    }

    /// Makes progress ([`Endpoint::poll`]).
    #[inline]
    pub fn poll(&self) {
        self.ep.poll();
    }

    /// The index of the peer that sent the message of `st`, if it is a
    /// connected peer.
    #[inline]
    pub fn peer_of(&self, st: &MqStatus) -> Option<usize> {
        self.ep.peer_at(st.peer)
    }

    #[inline]
    fn dest(&self, peer: usize) -> Result<psm2_epaddr_t> {
        self.ep
            .addr(peer)
            .ok_or_else(|| Error::Config(format!("PSM2 peer {peer} is not connected")))
    }

    /// The source address of `from` (PSM2's any-address for `None`), or
    /// `None` if that peer is not connected.
    #[inline]
    fn source(&self, from: Option<usize>) -> Option<psm2_epaddr_t> {
        match from {
            Some(p) => self.ep.addr(p),
            None => Some(PSM2_MQ_ANY_ADDR),
        }
    }

    /// Sends `buf` to `peer` and returns once `buf` may be reused
    /// (`psm2_mq_send2`; below the rendezvous size that is at once).
    #[inline]
    pub fn send(&mut self, peer: usize, tag: MqTag, buf: &[u8]) -> Result<()> {
        let dest = self.dest(peer)?;
        let len = msg_len(buf.len())?;
        let mut stag = tag.raw();
        let psm = self.psm();
        // SAFETY: the queue is open and dest connected; PSM2 reads `buf`
        // only during the call (it returns once `buf` may be reused).
        let e =
            unsafe { (psm.psm2_mq_send2)(self.raw, dest, 0, &mut stag, buf.as_ptr().cast(), len) };
        if e != psm2_error::PSM2_OK {
            return Err(psm_error(psm, "psm2_mq_send2", e));
        }
        Ok(())
    }

    /// Receives into `buf` the first message `sel` matches, waiting for it
    /// (`psm2_mq_irecv2` + `psm2_mq_wait2`).
    #[inline]
    pub fn recv(&mut self, sel: &Selector, buf: &mut [u8]) -> Result<MqStatus> {
        // SAFETY: `buf` is borrowed for this whole call, and the request is
        // waited for (freed) before the call returns.
        let req = unsafe { self.post_recv(sel, buf.as_mut_ptr(), buf.len(), UNTRACKED)? };
        // SAFETY: req is a live request of this queue, waited for once.
        Ok(unsafe { self.wait(req) })
    }

    /// The status of the first unexpected message `sel` matches, if one has
    /// arrived (`psm2_mq_iprobe2`; the message stays queued). `None` too if
    /// `sel` names a peer that is not connected.
    pub fn iprobe(&mut self, sel: &Selector) -> Option<MqStatus> {
        let src = self.source(sel.from)?;
        let (mut rtag, mut mask) = (sel.tag.raw(), sel.mask.raw());
        let mut st = MaybeUninit::<psm2_mq_status2_t>::zeroed();
        // SAFETY: the queue is open; tags and status are valid for the call.
        let e = unsafe {
            (self.psm().psm2_mq_iprobe2)(self.raw, src, &mut rtag, &mut mask, st.as_mut_ptr())
        };
        if e != psm2_error::PSM2_OK {
            return None;
        }
        // SAFETY: zero-initialised (plain data), then filled by PSM2.
        Some(MqStatus::from_raw(unsafe { st.assume_init_ref() }))
    }

    /// Runs `f` with a [`Scope`] of non-blocking requests on this queue,
    /// and waits for every request of the scope before returning, also when
    /// `f` unwinds: the memory of each is borrowed for `'env`, which outlives
    /// this call (as in `std::thread::scope`).
    pub fn scope<'env, R>(&mut self, f: impl FnOnce(&mut Scope<'_, 'env>) -> R) -> R {
        let pending = std::mem::take(&mut self.spare);
        let mut scope = Scope {
            q: self,
            pending,
            _env: PhantomData,
        };
        f(&mut scope)
    }

    /// Posts a send of `len` bytes at `buf` to `peer` (`psm2_mq_isend2`,
    /// `PSM2_MQ_FLAG_SENDSYNC` if `sync`: complete only once matched), with
    /// `context` as the request's context.
    ///
    /// # Safety
    /// `buf` must be valid for reads of `len` bytes and not be written until
    /// the returned request is freed (completed by test or wait) or the
    /// queue is finalized.
    #[inline]
    pub(super) unsafe fn post_send(
        &mut self,
        peer: usize,
        sync: bool,
        tag: MqTag,
        (buf, len): (*const u8, usize),
        context: usize,
    ) -> Result<psm2_mq_req_t> {
        let dest = self.dest(peer)?;
        let len = msg_len(len)?;
        let mut stag = tag.raw();
        let flags = if sync { PSM2_MQ_FLAG_SENDSYNC } else { 0 };
        let mut req: psm2_mq_req_t = ptr::null_mut();
        let psm = self.psm();
        // SAFETY: the queue is open and dest connected; the caller keeps
        // `buf` readable until the request is freed; the context is a plain
        // number PSM2 only hands back.
        let e = unsafe {
            (psm.psm2_mq_isend2)(
                self.raw,
                dest,
                flags,
                &mut stag,
                buf.cast(),
                len,
                context as *mut _,
                &mut req,
            )
        };
        if e != psm2_error::PSM2_OK {
            return Err(psm_error(psm, "psm2_mq_isend2", e));
        }
        Ok(req)
    }

    /// Posts a receive of up to `len` bytes at `buf` for what `sel` matches
    /// (`psm2_mq_irecv2`), with `context` as the request's context.
    ///
    /// # Safety
    /// `buf` must be valid for writes of `len` bytes and not be otherwise
    /// accessed until the returned request is freed (completed by test or
    /// wait, or cancelled and then waited) or the queue is finalized.
    #[inline(always)]
    pub(super) unsafe fn post_recv(
        &mut self,
        sel: &Selector,
        buf: *mut u8,
        len: usize,
        context: usize,
    ) -> Result<psm2_mq_req_t> {
        let Some(src) = self.source(sel.from) else {
            return Err(not_connected(sel.from));
        };
        let len = msg_len(len)?;
        let (mut rtag, mut mask) = (sel.tag.raw(), sel.mask.raw());
        let mut req: psm2_mq_req_t = ptr::null_mut();
        let psm = self.psm();
        // SAFETY: the queue is open, src connected or any; the caller keeps
        // `buf` writable and unused until the request is freed; tags and the
        // out-pointer are valid for the call.
        let e = unsafe {
            (psm.psm2_mq_irecv2)(
                self.raw,
                src,
                &mut rtag,
                &mut mask,
                0,
                buf.cast(),
                len,
                context as *mut _,
                &mut req,
            )
        };
        if e != psm2_error::PSM2_OK {
            return Err(psm_error(psm, "psm2_mq_irecv2", e));
        }
        Ok(req)
    }

    /// Waits for request `req` and frees it (`psm2_mq_wait2`, which polls
    /// inside PSM2 and returns only once the request is complete).
    ///
    /// # Safety
    /// `req` must be a live request of this queue: posted here and not yet
    /// freed by a test, wait or the queue's finalization.
    #[inline]
    pub(super) unsafe fn wait(&mut self, mut req: psm2_mq_req_t) -> MqStatus {
        let mut st = MaybeUninit::<psm2_mq_status2_t>::zeroed();
        // SAFETY: req is live (the caller's contract); wait2 completes and
        // frees it and fills the status.
        unsafe { (self.psm().psm2_mq_wait2)(&mut req, st.as_mut_ptr()) };
        // SAFETY: zero-initialised (plain data), then filled by PSM2.
        MqStatus::from_raw(unsafe { st.assume_init_ref() })
    }

    /// The raw queue and function table, for the request table.
    #[inline]
    pub(super) fn raw(&self) -> (psm2_mq_t, &'static Psm2) {
        (self.raw, self.psm())
    }

    /// Finalizes the queue and closes the endpoint gracefully (up to
    /// `timeout`, forced if that fails). Requests that had matched finish
    /// inside the close; after it PSM2 touches none of their memory.
    pub(super) fn close(mut self, timeout: Duration) {
        self.finalize();
        self.ep.close(timeout);
    }

    fn finalize(&mut self) {
        if self.raw.is_null() {
            return;
        }
        let raw = std::mem::replace(&mut self.raw, ptr::null_mut());
        // SAFETY: the queue is open, and this is its last use (raw is null
        // from here on).
        unsafe { (self.psm().psm2_mq_finalize)(raw) };
    }
}

impl Drop for MatchedQueue {
    fn drop(&mut self) {
        // The endpoint (a field) is closed, forced, right after this.
        self.finalize();
    }
}

/// Non-blocking requests on a [`MatchedQueue`] whose memory is borrowed for
/// `'env` ([`MatchedQueue::scope`]): every request is waited for before the
/// scope ends, so none outlives its memory. Requests are not tracked one by
/// one: [`wait_all`](Self::wait_all) waits for those posted so far.
pub struct Scope<'q, 'env> {
    q: &'q mut MatchedQueue,
    pending: Vec<psm2_mq_req_t>,
    /// Invariant in `'env`, so a scope cannot be made to take shorter
    /// borrows.
    _env: PhantomData<&'env mut &'env ()>,
}

impl<'env> Scope<'_, 'env> {
    /// Posts a send of `buf` to `peer` (`psm2_mq_isend2`).
    #[inline]
    pub fn isend(&mut self, peer: usize, tag: MqTag, buf: &'env [u8]) -> Result<()> {
        // SAFETY: `buf` is borrowed for 'env, which outlives the scope; the
        // scope waits for the request before it ends.
        let req = unsafe {
            self.q
                .post_send(peer, false, tag, (buf.as_ptr(), buf.len()), UNTRACKED)?
        };
        self.pending.push(req);
        Ok(())
    }

    /// Posts a receive into `buf` for what `sel` matches (`psm2_mq_irecv2`).
    #[inline]
    pub fn irecv(&mut self, sel: &Selector, buf: &'env mut [u8]) -> Result<()> {
        // SAFETY: `buf` is borrowed mutably for 'env, which outlives the
        // scope; the scope waits for the request before it ends.
        let req = unsafe {
            self.q
                .post_recv(sel, buf.as_mut_ptr(), buf.len(), UNTRACKED)?
        };
        self.pending.push(req);
        Ok(())
    }

    /// Waits for every request posted so far; the first failed status is
    /// the error (a truncated receive is not one).
    #[inline]
    pub fn wait_all(&mut self) -> Result<()> {
        let mut result = Ok(());
        for req in self.pending.drain(..) {
            // SAFETY: each pending request is live, posted on this queue and
            // waited for once (drained).
            let st = unsafe { self.q.wait(req) };
            if result.is_ok() && !st.is_ok() && !st.is_truncated() {
                result = Err(st.error("psm2_mq_wait2"));
            }
        }
        result
    }
}

impl Drop for Scope<'_, '_> {
    fn drop(&mut self) {
        let _ = self.wait_all();
        self.q.spare = std::mem::take(&mut self.pending);
    }
}
