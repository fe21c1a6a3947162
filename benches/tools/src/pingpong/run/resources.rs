//! The verbs objects of a run: device, queue pair, completion queues and
//! the two memory regions, with the receives of `send_lat` posted.

use ibvx::verbs::{
    Access, CompletionChannel, CompletionQueue, Context, InitAttr, MemoryRegion, PortAddress,
    ProtectionDomain, QpCaps, QueuePair,
};

use super::{CHECK_REGION, RECV_WR_ID};
use crate::pingpong::error::PingpongError;
use crate::pingpong::options::{Options, TestKind};

/// The verbs objects of a run.
pub(super) struct Resources {
    pub(super) local: PortAddress,
    pub(super) qp: QueuePair,
    pub(super) send_cq: CompletionQueue,
    pub(super) recv_cq: CompletionQueue,
    pub(super) send_mr: MemoryRegion<'static>,
    pub(super) recv_mr: MemoryRegion<'static>,
    pub(super) psn: u32,
    pub(super) inline_max: u32,
    pub(super) device: String,
}

impl Resources {
    /// Whether `size`-byte messages are sent inline.
    pub(super) fn inline(&self, size: usize) -> bool {
        self.inline_max > 0 && size <= self.inline_max as usize
    }
}

/// The lengths of the send and the receive region, and the access the
/// receive region grants: what the test and this side's role need.
fn region_lens(o: &Options) -> (usize, usize, Access) {
    let max = o.max_size();
    let rw = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    match (o.test, o.is_client()) {
        (TestKind::SendLat, _) => (max, max, Access::LOCAL_WRITE),
        (TestKind::WriteLat, _) => (max, max, rw),
        (TestKind::WriteBw, true) => (if o.check { max.max(CHECK_REGION) } else { max }, 4096, rw),
        (TestKind::WriteBw, false) => (
            4096,
            if o.check {
                max.max(CHECK_REGION)
            } else {
                max.max(8192)
            },
            rw,
        ),
    }
}

pub(super) fn setup(o: &Options) -> Result<Resources, PingpongError> {
    let ctx = Context::open(o.ib_dev.as_deref())?;
    let local = ctx.port_address(o.ib_port, o.gid_index)?;
    let pd = ProtectionDomain::new(&ctx)?;
    let channels = if o.events {
        Some((CompletionChannel::new(&ctx)?, CompletionChannel::new(&ctx)?))
    } else {
        None
    };
    let (send_len, recv_len, recv_access) = region_lens(o);
    let send_mr = MemoryRegion::alloc(&pd, send_len, Access::LOCAL_WRITE)?;
    let recv_mr = MemoryRegion::alloc(&pd, recv_len, recv_access)?;
    let max_wr = ctx.max_qp_wr().max(1);
    let send_wr = match o.test {
        TestKind::WriteBw => o.window() + 1,
        _ => 16,
    }
    .min(max_wr);
    let recv_wr = match o.test {
        TestKind::SendLat => o.rx_depth,
        _ => 16,
    }
    .min(max_wr);
    let send_cq = CompletionQueue::new(&ctx, send_wr + 1, channels.as_ref().map(|c| &c.0))?;
    let recv_cq = CompletionQueue::new(&ctx, recv_wr + 1, channels.as_ref().map(|c| &c.1))?;
    let caps = QpCaps {
        max_send_wr: send_wr,
        max_recv_wr: recv_wr,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: o.inline_size,
    };
    let qp = QueuePair::new_rc(&pd, &send_cq, &recv_cq, caps, false).map_err(|e| {
        if o.inline_size > 0 {
            PingpongError::Setup(format!(
                "{e} (with --inline-size {}; the device may allow less)",
                o.inline_size
            ))
        } else {
            e.into()
        }
    })?;
    qp.modify_to_init(&InitAttr {
        port: o.ib_port,
        pkey_index: 0,
        access: Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
    })?;
    let inline_max = o.inline_size.min(qp.caps().max_inline_data);
    if o.test == TestKind::SendLat {
        for _ in 0..recv_wr {
            // SAFETY: `recv_mr` is the tool's own region, moved into the
            // `Resources` with the QP and dropped after it (field order),
            // and only ever read through its raw-pointer accessors
            // (`verify`), never lent out. Like perftest, every receive
            // targets the whole region: the peer sends its next message only
            // after ours, so one receive at a time is written.
            unsafe { qp.post_recv(RECV_WR_ID, &[recv_mr.sge(0, recv_mr.len())])? };
        }
    }
    Ok(Resources {
        local,
        qp,
        send_cq,
        recv_cq,
        send_mr,
        recv_mr,
        psn: ibvx::verbs::random_psn(),
        inline_max,
        device: ctx.name().to_string(),
    })
}
