//! A small safe layer over the libibverbs bindings of `ibvx-sys`: what an
//! RC-based messaging layer or benchmark needs, and nothing more.
//!
//! | type | wraps | holds (so it is destroyed first) |
//! |------|-------|----------------------------------|
//! | [`Context`] | `ibv_context` (open device; ports, GIDs) | - |
//! | [`ProtectionDomain`] | `ibv_pd` | its `Context` |
//! | [`MemoryRegion`] | `ibv_mr` + the buffer (owned, or borrowed for `'buf`) | its `ProtectionDomain` |
//! | [`CompletionChannel`] | `ibv_comp_channel` | its `Context` |
//! | [`CompletionQueue`] | `ibv_cq` | its `Context` and channel |
//! | [`QueuePair`] | `ibv_qp` (RC) | its `ProtectionDomain` and both CQs |
//!
//! Handles are reference counted (`Arc`) where objects are shared (contexts,
//! domains, channels, CQs), so the C objects are always destroyed in a valid
//! order: a QP before its CQs and PD, an MR before its PD, a CQ before its
//! channel, everything before the device is closed. A [`Sge`] borrows its
//! region, so a work request can only name registered memory that is still
//! alive when it is posted, and the device validates keys and bounds.
//! But the device reads and writes that memory until the request
//! *completes*, long after the borrow has ended: nothing in the types stops
//! the caller from handing the bytes to other code meanwhile (or a peer
//! from writing a range it was never granted). So the posting calls,
//! [`QueuePair::post_send`] and [`QueuePair::post_recv`], are `unsafe`, with
//! the contract stated there; what the device does with the bytes is
//! described at [`MemoryRegion`].
//!
//! Every failure is an [`Error`] that reads as one line: a missing library
//! (`verbs not available: ...`), no device, an unknown device name, a bad
//! port or GID index, a failed registration, a refused QP transition (with
//! the transition and errno), or a failed work completion (with
//! `ibv_wc_status_str`).
//!
//! A typical RC connection:
//!
//! ```no_run
//! use ibvx::verbs::*;
//!
//! # fn main() -> Result<()> {
//! let ctx = Context::open(None)?; // first device
//! let local = ctx.port_address(1, None)?; // LID, GID (RoCE), MTU
//! let pd = ProtectionDomain::new(&ctx)?;
//! let cq = CompletionQueue::new(&ctx, 256, None)?;
//! let qp = QueuePair::new_rc(&pd, &cq, &cq, QpCaps::default(), false)?;
//! qp.modify_to_init(&InitAttr { port: 1, ..InitAttr::default() })?;
//! let mut mr = MemoryRegion::alloc(&pd, 4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
//! // SAFETY: `mr` is this function's own region and outlives the QP's
//! // use of it (the QP is dropped first, below); the receive only uses its
//! // second half, which nothing else touches.
//! unsafe { qp.post_recv(1, &[mr.sge(2048, 2048)])? };
//! // ... exchange (qp.qp_num(), psn, local.lid, local.gid) with the peer ...
//! # let remote = RemoteQp { qpn: 0, psn: 0, lid: 0, gid: None };
//! qp.connect(&local, &remote, local.active_mtu, 0x1234)?;
//! mr.write(0, b"hello");
//! // SAFETY: as above; the first five bytes are not written again before
//! // the send's completion is polled below.
//! unsafe {
//!     qp.post_send(&SendRequest {
//!         wr_id: 2,
//!         op: SendOp::Send,
//!         sges: &[mr.sge(0, 5)],
//!         flags: SendFlags::SIGNALED,
//!     })?
//! };
//! let mut wcs = [WorkCompletion::default(); 4];
//! let n = cq.poll(&mut wcs)?;
//! for wc in &wcs[..n] {
//!     wc.ok()?;
//! }
//! drop(qp); // the device is done with `mr`
//! drop(mr);
//! # Ok(())
//! # }
//! ```

mod cq;
mod device;
mod error;
mod mr;
mod pd;
mod qp;

pub use cq::{status_str, CompletionChannel, CompletionQueue, CqId, WcOpcode, WorkCompletion};
pub use device::{
    device_list, Context, DeviceInfo, Gid, GidType, LinkLayer, Mtu, PortAddress, PortAttr,
    PortState,
};
pub use error::{Error, Result, Transition};
pub use mr::{Access, MemoryRegion, RemoteAddr, Sge};
pub use pd::ProtectionDomain;
pub use qp::{
    random_psn, AddressVector, GlobalRoute, InitAttr, QpCaps, QpState, QueuePair, RemoteQp,
    RtrAttr, RtsAttr, SendFlags, SendOp, SendRequest, RECV_LIST,
};
