//! Completion channels, completion queues and work completions.

use std::ffi::{c_int, c_void, CStr};
use std::fmt;
use std::os::fd::RawFd;
use std::ptr::{self, NonNull};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ibvx_sys as sys;
use ibvx_sys::Verbs;

use super::device::Context;
use super::error::{Error, Result};

/// A completion channel (`ibv_comp_channel`): the file descriptor on which
/// armed completion queues signal events. Cheap to clone; CQs attached to
/// it hold a clone, so it is destroyed after them.
#[derive(Clone)]
pub struct CompletionChannel {
    inner: Arc<ChannelInner>,
}

struct ChannelInner {
    raw: NonNull<sys::ibv_comp_channel>,
    ctx: Context,
}

// SAFETY: the channel is a file descriptor plus libibverbs bookkeeping,
// usable from any thread.
unsafe impl Send for ChannelInner {}
// SAFETY: as above; `get_event` may run concurrently (the kernel hands each
// event to one reader).
unsafe impl Sync for ChannelInner {}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        // SAFETY: created by ibv_create_comp_channel, destroyed once, after
        // every CQ using it (they hold a clone).
        unsafe { (self.ctx.verbs().ibv_destroy_comp_channel)(self.raw.as_ptr()) };
    }
}

impl fmt::Debug for CompletionChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionChannel")
            .field("fd", &self.fd())
            .finish()
    }
}

/// Identifies the completion queue an event was for (compare with
/// [`CompletionQueue::id`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CqId(usize);

impl CompletionChannel {
    /// Creates a completion channel on `ctx`.
    pub fn new(ctx: &Context) -> Result<CompletionChannel> {
        // SAFETY: live context.
        let raw = unsafe { (ctx.verbs().ibv_create_comp_channel)(ctx.as_raw()) };
        let raw = NonNull::new(raw).ok_or_else(|| Error::last_os("ibv_create_comp_channel"))?;
        Ok(CompletionChannel {
            inner: Arc::new(ChannelInner {
                raw,
                ctx: ctx.clone(),
            }),
        })
    }

    /// The channel's file descriptor (readable when an event is pending).
    pub fn fd(&self) -> RawFd {
        // SAFETY: live channel; plain field read.
        unsafe { (*self.inner.raw.as_ptr()).fd }
    }

    /// The raw `ibv_comp_channel`, valid while the channel lives.
    pub fn as_raw(&self) -> *mut sys::ibv_comp_channel {
        self.inner.raw.as_ptr()
    }

    /// Waits up to `timeout` (forever with `None`) for a completion event,
    /// takes it (`ibv_get_cq_event`) and acknowledges it at once
    /// (`ibv_ack_cq_events`), so that destroying a CQ never blocks on
    /// unacknowledged events. Returns the CQ the event was for, or `None`
    /// on timeout. The CQ must be re-armed with
    /// [`CompletionQueue::req_notify`] to get the next event.
    pub fn get_event(&self, timeout: Option<Duration>) -> Result<Option<CqId>> {
        if !wait_readable(self.fd(), timeout)? {
            return Ok(None);
        }
        let verbs = self.inner.ctx.verbs();
        let mut cq: *mut sys::ibv_cq = ptr::null_mut();
        let mut cq_ctx: *mut c_void = ptr::null_mut();
        // SAFETY: live channel with a pending event (the fd is readable);
        // valid out-parameters.
        let rc = unsafe { (verbs.ibv_get_cq_event)(self.as_raw(), &mut cq, &mut cq_ctx) };
        if rc != 0 {
            return Err(Error::last_os("ibv_get_cq_event"));
        }
        // SAFETY: `cq` is the live CQ the event was for (a CQ cannot be
        // destroyed while it has unacknowledged events); one event is acked.
        unsafe { (verbs.ibv_ack_cq_events)(cq, 1) };
        Ok(Some(CqId(cq as usize)))
    }
}

/// Waits until `fd` is readable, up to `timeout`; false on timeout.
fn wait_readable(fd: RawFd, timeout: Option<Duration>) -> Result<bool> {
    let deadline = timeout.map(|t| Instant::now() + t);
    loop {
        let ms: c_int = match deadline {
            None => -1,
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                // Round up so that a short timeout still waits.
                c_int::try_from(left.as_micros().div_ceil(1000)).unwrap_or(c_int::MAX)
            }
        };
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n > 0 {
            return Ok(true);
        }
        if n == 0 {
            return Ok(false);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(Error::Verbs {
                call: "poll(completion channel)",
                source: e,
            });
        }
    }
}

/// A completion queue (`ibv_cq`). Cheap to clone (reference counted); queue
/// pairs hold a clone of their CQs, so a CQ is destroyed after its QPs.
#[derive(Clone)]
pub struct CompletionQueue {
    inner: Arc<CqInner>,
}

struct CqInner {
    raw: NonNull<sys::ibv_cq>,
    capacity: u32,
    // Declared after `raw`: dropped after the CQ is destroyed.
    channel: Option<CompletionChannel>,
    ctx: Context,
}

// SAFETY: CQs are thread safe in libibverbs (providers lock polling unless
// the CQ was created single-threaded, which this layer never does).
unsafe impl Send for CqInner {}
// SAFETY: as above.
unsafe impl Sync for CqInner {}

impl Drop for CqInner {
    fn drop(&mut self) {
        // SAFETY: created by ibv_create_cq, destroyed once, after every QP
        // using it (they hold a clone); events are acked as they are taken.
        unsafe { (self.ctx.verbs().ibv_destroy_cq)(self.raw.as_ptr()) };
    }
}

impl fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("capacity", &self.inner.capacity)
            .field("events", &self.inner.channel.is_some())
            .finish()
    }
}

impl CompletionQueue {
    /// Creates a CQ with room for at least `entries` completions, attached to
    /// `channel` for event-driven completion (or polled only, with `None`).
    pub fn new(
        ctx: &Context,
        entries: u32,
        channel: Option<&CompletionChannel>,
    ) -> Result<CompletionQueue> {
        let cqe = c_int::try_from(entries.max(1))
            .map_err(|_| Error::InvalidArgument(format!("{entries} CQ entries")))?;
        let ch = channel.map_or(ptr::null_mut(), CompletionChannel::as_raw);
        // SAFETY: live context; `ch` is NULL or a live channel of the same
        // context (kept alive by the clone stored below).
        let raw = unsafe { (ctx.verbs().ibv_create_cq)(ctx.as_raw(), cqe, ptr::null_mut(), ch, 0) };
        let raw = NonNull::new(raw).ok_or_else(|| Error::last_os("ibv_create_cq"))?;
        // SAFETY: live CQ; plain field read of the actual size.
        let capacity = u32::try_from(unsafe { (*raw.as_ptr()).cqe }).unwrap_or(entries);
        Ok(CompletionQueue {
            inner: Arc::new(CqInner {
                raw,
                capacity,
                channel: channel.cloned(),
                ctx: ctx.clone(),
            }),
        })
    }

    /// Number of completions the queue can hold.
    pub fn capacity(&self) -> u32 {
        self.inner.capacity
    }

    /// This queue's identity, as reported by [`CompletionChannel::get_event`].
    pub fn id(&self) -> CqId {
        CqId(self.inner.raw.as_ptr() as usize)
    }

    /// The completion channel, if the queue has one.
    pub fn channel(&self) -> Option<&CompletionChannel> {
        self.inner.channel.as_ref()
    }

    /// The raw `ibv_cq`, valid while the queue lives.
    pub fn as_raw(&self) -> *mut sys::ibv_cq {
        self.inner.raw.as_ptr()
    }

    /// Takes up to `wcs.len()` completions into `wcs` and returns how many
    /// (0 when the queue is empty). Completions with an error status are
    /// returned like any other; see [`WorkCompletion::ok`].
    #[inline]
    pub fn poll(&self, wcs: &mut [WorkCompletion]) -> Result<usize> {
        let n = c_int::try_from(wcs.len()).unwrap_or(c_int::MAX);
        // SAFETY: live CQ; `WorkCompletion` is a transparent `ibv_wc`, and
        // `wcs` has room for `n` of them.
        let rc = unsafe { sys::ibv_poll_cq(self.as_raw(), n, wcs.as_mut_ptr().cast()) };
        usize::try_from(rc).map_err(|_| Error::from_rc("ibv_poll_cq", rc))
    }

    /// Arms the queue: the next completion (the next solicited one with
    /// `solicited_only`) raises an event on its channel.
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        // SAFETY: live CQ.
        let rc = unsafe { sys::ibv_req_notify_cq(self.as_raw(), c_int::from(solicited_only)) };
        if rc != 0 {
            return Err(Error::from_rc("ibv_req_notify_cq", rc));
        }
        Ok(())
    }

    /// Blocks until an event for this queue arrives on its channel (taking
    /// and acknowledging it), up to `timeout` (forever with `None`); false on
    /// timeout. Events for other queues sharing the channel are taken and
    /// acknowledged too. Arm the queue with [`CompletionQueue::req_notify`]
    /// first, and poll it afterwards.
    pub fn wait_event(&self, timeout: Option<Duration>) -> Result<bool> {
        let channel = self.inner.channel.as_ref().ok_or_else(|| {
            Error::InvalidArgument("the completion queue has no completion channel".into())
        })?;
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            match channel.get_event(left)? {
                None => return Ok(false),
                Some(id) if id == self.id() => return Ok(true),
                Some(_) => {}
            }
        }
    }
}

/// A work completion (`ibv_wc`), layout compatible with it.
#[derive(Clone, Copy, Default)]
#[repr(transparent)]
pub struct WorkCompletion(sys::ibv_wc);

/// The opcode of a successful work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcOpcode {
    /// A send (or send with immediate) completed.
    Send,
    /// An RDMA write (or write with immediate) completed.
    RdmaWrite,
    /// An RDMA read completed.
    RdmaRead,
    /// An atomic compare-and-swap completed.
    CompSwap,
    /// An atomic fetch-and-add completed.
    FetchAdd,
    /// A receive completed (a send from the peer arrived).
    Recv,
    /// A receive was consumed by an RDMA write with immediate from the peer.
    RecvRdmaWithImm,
    /// Any other value.
    Other(u32),
}

impl WorkCompletion {
    /// The work request id given when posting.
    #[inline]
    pub fn wr_id(&self) -> u64 {
        self.0.wr_id
    }

    /// The raw `ibv_wc_status` (0 = success).
    #[inline]
    pub fn status(&self) -> u32 {
        self.0.status
    }

    /// Whether the work request succeeded.
    #[inline]
    pub fn is_success(&self) -> bool {
        self.0.status == sys::IBV_WC_SUCCESS
    }

    /// The opcode (meaningful only on success).
    pub fn opcode(&self) -> WcOpcode {
        match self.0.opcode {
            sys::IBV_WC_SEND => WcOpcode::Send,
            sys::IBV_WC_RDMA_WRITE => WcOpcode::RdmaWrite,
            sys::IBV_WC_RDMA_READ => WcOpcode::RdmaRead,
            sys::IBV_WC_COMP_SWAP => WcOpcode::CompSwap,
            sys::IBV_WC_FETCH_ADD => WcOpcode::FetchAdd,
            sys::IBV_WC_RECV => WcOpcode::Recv,
            sys::IBV_WC_RECV_RDMA_WITH_IMM => WcOpcode::RecvRdmaWithImm,
            v => WcOpcode::Other(v),
        }
    }

    /// Bytes received (receives only).
    #[inline]
    pub fn byte_len(&self) -> u32 {
        self.0.byte_len
    }

    /// The immediate data (host byte order), if the completion carries one.
    pub fn imm_data(&self) -> Option<u32> {
        (self.0.wc_flags & sys::IBV_WC_WITH_IMM != 0)
            // SAFETY: with IBV_WC_WITH_IMM the union holds imm_data; any
            // bit pattern is a valid u32.
            .then(|| u32::from_be(unsafe { self.0.__bindgen_anon_1.imm_data }))
    }

    /// The local QP number.
    pub fn qp_num(&self) -> u32 {
        self.0.qp_num
    }

    /// The provider's vendor error code.
    pub fn vendor_err(&self) -> u32 {
        self.0.vendor_err
    }

    /// `ibv_wc_status_str` of the status.
    pub fn status_str(&self) -> String {
        status_str(self.0.status)
    }

    /// `Ok(self)` on success, else [`Error::WorkCompletion`] naming the status.
    #[inline]
    pub fn ok(&self) -> Result<&Self> {
        if self.is_success() {
            Ok(self)
        } else {
            Err(Error::WorkCompletion {
                status_str: self.status_str(),
                status: self.0.status,
                wr_id: self.0.wr_id,
                qp_num: self.0.qp_num,
                vendor_err: self.0.vendor_err,
            })
        }
    }
}

/// `ibv_wc_status_str(status)`, or `status N` without libibverbs.
pub fn status_str(status: u32) -> String {
    match Verbs::load() {
        Ok(verbs) => {
            // SAFETY: a static-string lookup by enum value; never NULL.
            let p = unsafe { (verbs.ibv_wc_status_str)(status) };
            if p.is_null() {
                format!("status {status}")
            } else {
                // SAFETY: a NUL-terminated static string.
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            }
        }
        Err(_) => format!("status {status}"),
    }
}

impl fmt::Debug for WorkCompletion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkCompletion")
            .field("wr_id", &self.0.wr_id)
            .field("status", &self.0.status)
            .field("opcode", &self.opcode())
            .field("byte_len", &self.0.byte_len)
            .field("imm_data", &self.imm_data())
            .field("qp_num", &self.0.qp_num)
            .finish()
    }
}

#[cfg(test)]
mod tests;
