//! Rust equivalents of the `static inline` functions and function-like
//! macros of verbs.h (rdma-core 44) that have no exported symbol, each
//! mirroring the header's body statement by statement.
//!
//! The data-path functions call through the provider's
//! `ibv_context::ops` table exactly like the header. The header calls the
//! op unconditionally (a NULL op would crash); here a NULL op panics
//! instead, which no provider-created object triggers.

use std::ffi::{c_int, c_uint, c_void};
use std::mem::{offset_of, size_of};
use std::ptr;

use crate::bindings::*;
use crate::{Verbs, IBV_ACCESS_OPTIONAL_RANGE, VERBS_ABI_IS_EXTENDED};

/// `ibv_post_send(qp, wr, bad_wr)`: `qp->context->ops.post_send(qp, wr, bad_wr)`.
///
/// Returns 0 or an errno value; on failure `*bad_wr` points at the first
/// work request that was not posted.
///
/// # Safety
/// `qp` must point to a live QP returned by `ibv_create_qp` (so that
/// `qp->context` is its live device context); `wr` must be a valid,
/// NULL-terminated list of work requests whose scatter/gather entries
/// describe registered memory; `bad_wr` must be valid for a write. These are
/// the C function's requirements, which the provider relies on.
#[inline]
pub unsafe fn ibv_post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad_wr: *mut *mut ibv_send_wr,
) -> c_int {
    // SAFETY: the caller guarantees `qp` and `qp->context` point to live
    // objects, so both reads are of initialised memory; the op is copied out
    // without creating references.
    let op = unsafe { (*(*qp).context).ops.post_send };
    let op = op.expect("ibv_post_send: context ops.post_send is NULL");
    // SAFETY: `op` is the provider's post_send for this QP's context, called
    // with the caller's arguments exactly as verbs.h does.
    unsafe { op(qp, wr, bad_wr) }
}

/// `ibv_post_recv(qp, wr, bad_wr)`: `qp->context->ops.post_recv(qp, wr, bad_wr)`.
///
/// Returns 0 or an errno value; on failure `*bad_wr` points at the first
/// work request that was not posted.
///
/// # Safety
/// As for [`ibv_post_send`]: `qp` a live QP (not attached to an SRQ), `wr`
/// a valid NULL-terminated list over registered memory, `bad_wr` writable.
#[inline]
pub unsafe fn ibv_post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    // SAFETY: the caller guarantees `qp` and `qp->context` are live; plain
    // field reads through raw pointers.
    let op = unsafe { (*(*qp).context).ops.post_recv };
    let op = op.expect("ibv_post_recv: context ops.post_recv is NULL");
    // SAFETY: the provider's post_recv for this QP's context, called with the
    // caller's arguments exactly as verbs.h does.
    unsafe { op(qp, wr, bad_wr) }
}

/// `ibv_post_srq_recv(srq, recv_wr, bad_recv_wr)`:
/// `srq->context->ops.post_srq_recv(srq, recv_wr, bad_recv_wr)`.
///
/// # Safety
/// `srq` must point to a live SRQ returned by `ibv_create_srq`; `recv_wr`
/// a valid NULL-terminated list over registered memory; `bad_recv_wr`
/// writable.
#[inline]
pub unsafe fn ibv_post_srq_recv(
    srq: *mut ibv_srq,
    recv_wr: *mut ibv_recv_wr,
    bad_recv_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    // SAFETY: the caller guarantees `srq` and `srq->context` are live; plain
    // field reads through raw pointers.
    let op = unsafe { (*(*srq).context).ops.post_srq_recv };
    let op = op.expect("ibv_post_srq_recv: context ops.post_srq_recv is NULL");
    // SAFETY: the provider's post_srq_recv for this SRQ's context, called
    // with the caller's arguments exactly as verbs.h does.
    unsafe { op(srq, recv_wr, bad_recv_wr) }
}

/// `ibv_poll_cq(cq, num_entries, wc)`: `cq->context->ops.poll_cq(cq, num_entries, wc)`.
///
/// Returns the number of completions written to `wc` (0 if the CQ is
/// empty) or a negative value on error.
///
/// # Safety
/// `cq` must point to a live CQ returned by `ibv_create_cq`; `wc` must be
/// valid for writes of `num_entries` [`ibv_wc`] values. Concurrent polling
/// of one CQ follows the provider's locking (CQs are thread-safe unless
/// created single-threaded).
#[inline]
pub unsafe fn ibv_poll_cq(cq: *mut ibv_cq, num_entries: c_int, wc: *mut ibv_wc) -> c_int {
    // SAFETY: the caller guarantees `cq` and `cq->context` are live; plain
    // field reads through raw pointers.
    let op = unsafe { (*(*cq).context).ops.poll_cq };
    let op = op.expect("ibv_poll_cq: context ops.poll_cq is NULL");
    // SAFETY: the provider's poll_cq for this CQ's context; `wc` has room for
    // `num_entries` entries per the caller's contract.
    unsafe { op(cq, num_entries, wc) }
}

/// `ibv_req_notify_cq(cq, solicited_only)`:
/// `cq->context->ops.req_notify_cq(cq, solicited_only)`.
///
/// Arms the CQ so that the next completion (the next solicited one if
/// `solicited_only != 0`) raises an event on its completion channel.
/// Returns 0 or an errno value.
///
/// # Safety
/// `cq` must point to a live CQ returned by `ibv_create_cq`.
#[inline]
pub unsafe fn ibv_req_notify_cq(cq: *mut ibv_cq, solicited_only: c_int) -> c_int {
    // SAFETY: the caller guarantees `cq` and `cq->context` are live; plain
    // field reads through raw pointers.
    let op = unsafe { (*(*cq).context).ops.req_notify_cq };
    let op = op.expect("ibv_req_notify_cq: context ops.req_notify_cq is NULL");
    // SAFETY: the provider's req_notify_cq for this CQ's context.
    unsafe { op(cq, solicited_only) }
}

/// `verbs_get_ctx(ctx)`: the [`verbs_context`] that embeds `ctx`, or NULL
/// if `ctx->abi_compat` is not [`VERBS_ABI_IS_EXTENDED`] (a legacy context).
///
/// # Safety
/// `ctx` must point to a live `ibv_context` (from `ibv_open_device`). If its
/// `abi_compat` says it is extended, it must really be the `context` field
/// of a `verbs_context`, as libibverbs guarantees.
pub unsafe fn verbs_get_ctx(ctx: *mut ibv_context) -> *mut verbs_context {
    // SAFETY: `ctx` is live per the caller's contract.
    if unsafe { (*ctx).abi_compat } != VERBS_ABI_IS_EXTENDED {
        return ptr::null_mut();
    }
    // container_of(ctx, struct verbs_context, context), open-coded as in
    // verbs.h.
    // SAFETY: an extended context is the `context` field of a
    // `verbs_context`, so stepping back by that field's offset stays inside
    // the same allocation and lands on the start of the `verbs_context`.
    unsafe {
        ctx.cast::<u8>()
            .sub(offset_of!(verbs_context, context))
            .cast::<verbs_context>()
    }
}

/// Signature of `verbs_context::query_port` (the extended port query).
type ExtQueryPort = unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr, usize) -> c_int;

/// `verbs_get_ctx_op(ctx, query_port)`: the extended `query_port` op, if the
/// context is extended, its `sz` covers that field, and the op is set.
///
/// # Safety
/// As for [`verbs_get_ctx`].
unsafe fn verbs_ctx_query_port(ctx: *mut ibv_context) -> Option<ExtQueryPort> {
    // SAFETY: forwarded contract.
    let vctx = unsafe { verbs_get_ctx(ctx) };
    if vctx.is_null() {
        return None;
    }
    // SAFETY: `vctx` points to a live `verbs_context` (see `verbs_get_ctx`).
    // `sz` and `context` are the last fields and exist in every version of
    // the struct; `query_port` is read only if `sz` says the (possibly
    // older, smaller) struct the library allocated reaches back to it.
    unsafe {
        if (*vctx).sz < size_of::<verbs_context>() - offset_of!(verbs_context, query_port) {
            return None;
        }
        (*vctx).query_port
    }
}

/// The body of `___ibv_query_port`, with the exported compat function passed
/// in (so tests can substitute it).
///
/// # Safety
/// As for [`Verbs::query_port`].
unsafe fn query_port_with(
    compat: unsafe extern "C" fn(*mut ibv_context, u8, *mut _compat_ibv_port_attr) -> c_int,
    context: *mut ibv_context,
    port_num: u8,
    port_attr: *mut ibv_port_attr,
) -> c_int {
    // SAFETY: forwarded contract (`context` is a live device context).
    match unsafe { verbs_ctx_query_port(context) } {
        None => {
            // SAFETY: `port_attr` is valid for a write of one ibv_port_attr,
            // and all-zero bytes are a valid ibv_port_attr (plain integers).
            unsafe { ptr::write_bytes(port_attr, 0, 1) };
            // SAFETY: the compat layout is a prefix of ibv_port_attr, so the
            // zeroed full-size buffer is large enough, as the header assumes
            // when it casts the same pointer.
            unsafe { compat(context, port_num, port_attr.cast()) }
        }
        // SAFETY: the context's own extended query, told the size of the
        // caller's buffer exactly like the header (`sizeof(*port_attr)`).
        Some(query_port) => unsafe {
            query_port(context, port_num, port_attr, size_of::<ibv_port_attr>())
        },
    }
}

/// The body of `__ibv_reg_mr`, with the two exports passed in (so tests can
/// substitute them).
///
/// # Safety
/// As for [`Verbs::reg_mr`].
unsafe fn reg_mr_with(
    reg_mr: unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr,
    reg_mr_iova2: unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, u64, c_uint) -> *mut ibv_mr,
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    access: c_uint,
) -> *mut ibv_mr {
    if access & IBV_ACCESS_OPTIONAL_RANGE == 0 {
        // SAFETY: forwarded contract; the `(int)access` cast of the header.
        unsafe { reg_mr(pd, addr, length, access as c_int) }
    } else {
        // SAFETY: forwarded contract; iova = `(uintptr_t)addr` as in the header.
        unsafe { reg_mr_iova2(pd, addr, length, addr as usize as u64, access) }
    }
}

impl Verbs {
    /// `ibv_query_port(context, port_num, port_attr)` as the verbs.h macro
    /// (`___ibv_query_port`) does it: through the extended
    /// `verbs_context::query_port(context, port_num, port_attr,
    /// sizeof(*port_attr))` when the context provides it, otherwise zero
    /// `*port_attr` and call the exported compat `ibv_query_port`. Fills the
    /// full current [`ibv_port_attr`] (including `link_layer`, `flags`).
    ///
    /// Returns 0 or an errno value.
    ///
    /// # Safety
    /// `context` must be a live context from this library's
    /// `ibv_open_device`; `port_attr` must be valid for a write of one
    /// [`ibv_port_attr`].
    pub unsafe fn query_port(
        &self,
        context: *mut ibv_context,
        port_num: u8,
        port_attr: *mut ibv_port_attr,
    ) -> c_int {
        // SAFETY: forwarded contract.
        unsafe { query_port_with(self.ibv_query_port, context, port_num, port_attr) }
    }

    /// `ibv_reg_mr(pd, addr, length, access)` as the verbs.h macro does it:
    /// the exported `ibv_reg_mr` when `access` has no bit in
    /// [`IBV_ACCESS_OPTIONAL_RANGE`], otherwise `ibv_reg_mr_iova2(pd, addr,
    /// length, addr, access)`. (The macro decides at compile time with
    /// `__builtin_constant_p` and falls back to `ibv_reg_mr_iova2` for
    /// non-constant flags; both exports register the same region, so
    /// testing the bits at run time is equivalent.)
    ///
    /// Returns NULL with errno set on failure.
    ///
    /// # Safety
    /// `pd` must be a live protection domain from this library; `addr` ..
    /// `addr + length` must stay mapped until the MR is deregistered.
    pub unsafe fn reg_mr(
        &self,
        pd: *mut ibv_pd,
        addr: *mut c_void,
        length: usize,
        access: c_uint,
    ) -> *mut ibv_mr {
        // SAFETY: forwarded contract.
        unsafe {
            reg_mr_with(
                self.ibv_reg_mr,
                self.ibv_reg_mr_iova2,
                pd,
                addr,
                length,
                access,
            )
        }
    }

    /// `ibv_query_gid_ex(context, port_num, gid_index, entry, flags)` as the
    /// verbs.h inline does it: `_ibv_query_gid_ex(..., sizeof(*entry))`.
    /// The entry carries the GID type (IB, RoCE v1, RoCE v2) and netdev.
    ///
    /// Returns 0 or an errno value.
    ///
    /// # Safety
    /// `context` must be a live context from this library; `entry` must be
    /// valid for a write of one [`ibv_gid_entry`].
    pub unsafe fn query_gid_ex(
        &self,
        context: *mut ibv_context,
        port_num: u32,
        gid_index: u32,
        entry: *mut ibv_gid_entry,
        flags: u32,
    ) -> c_int {
        // SAFETY: forwarded contract; the size is that of the caller's entry.
        unsafe {
            (self._ibv_query_gid_ex)(
                context,
                port_num,
                gid_index,
                entry,
                flags,
                size_of::<ibv_gid_entry>(),
            )
        }
    }
}

#[cfg(test)]
mod tests;
