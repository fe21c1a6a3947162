//! Reliable-connected queue pairs: creation, state transitions, posting.

use std::ffi::c_int;
use std::fmt;
use std::ptr::{self, NonNull};

use ibvx_sys as sys;

use super::cq::CompletionQueue;
use super::device::{Gid, Mtu, PortAddress};
use super::error::{errno_error, Error, Result, Transition};
use super::mr::{Access, RemoteAddr, Sge};
use super::pd::ProtectionDomain;

/// Queue sizes of a QP. [`QueuePair::new_rc`] takes the wanted values and
/// [`QueuePair::caps`] reports what the provider granted (at least as much).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Outstanding send work requests.
    pub max_send_wr: u32,
    /// Outstanding receive work requests.
    pub max_recv_wr: u32,
    /// Scatter/gather entries per send request.
    pub max_send_sge: u32,
    /// Scatter/gather entries per receive request.
    pub max_recv_sge: u32,
    /// Largest inline send (bytes).
    pub max_inline_data: u32,
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps {
            max_send_wr: 128,
            max_recv_wr: 128,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        }
    }
}

/// RESET to INIT parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InitAttr {
    /// Port number (1-based).
    pub port: u8,
    /// P_Key table index.
    pub pkey_index: u16,
    /// What peers may do to this QP's memory regions (RDMA write/read/atomic).
    pub access: Access,
}

impl Default for InitAttr {
    fn default() -> Self {
        InitAttr {
            port: 1,
            pkey_index: 0,
            access: Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
        }
    }
}

/// The global route header of an address vector (needed on RoCE).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GlobalRoute {
    /// Destination GID.
    pub dgid: Gid,
    /// Local GID table index used as the source GID.
    pub sgid_index: u8,
    /// Hop limit (perftest uses 0xff; 1 keeps RoCE traffic in the subnet).
    pub hop_limit: u8,
    /// Traffic class.
    pub traffic_class: u8,
    /// Flow label.
    pub flow_label: u32,
}

/// Where the peer is: the address vector of an RC connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddressVector {
    /// Destination LID (0 on RoCE).
    pub dlid: u16,
    /// Service level.
    pub sl: u8,
    /// Source path bits.
    pub src_path_bits: u8,
    /// Static rate (0 = port rate).
    pub static_rate: u8,
    /// Local port number.
    pub port: u8,
    /// Global route header; required on RoCE.
    pub grh: Option<GlobalRoute>,
}

/// INIT to RTR parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtrAttr {
    /// Path MTU (at most the smaller of both ports' active MTU).
    pub path_mtu: Mtu,
    /// The peer's QP number.
    pub dest_qpn: u32,
    /// First packet sequence number expected from the peer (its send PSN).
    pub rq_psn: u32,
    /// Incoming RDMA reads/atomics this QP serves at once.
    pub max_dest_rd_atomic: u8,
    /// Minimum RNR NAK timer (encoded, 12 = 0.64 ms).
    pub min_rnr_timer: u8,
    /// The peer's address.
    pub av: AddressVector,
}

/// RTR to RTS parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtsAttr {
    /// First packet sequence number this QP sends.
    pub sq_psn: u32,
    /// Local ACK timeout (4.096 us * 2^timeout; 14 = 67 ms).
    pub timeout: u8,
    /// Transport retries before an error completion.
    pub retry_cnt: u8,
    /// RNR retries (7 = forever).
    pub rnr_retry: u8,
    /// Outstanding RDMA reads/atomics this QP initiates.
    pub max_rd_atomic: u8,
}

impl Default for RtsAttr {
    fn default() -> Self {
        RtsAttr {
            sq_psn: 0,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 1,
        }
    }
}

/// A random first packet sequence number (24 bits), so that a packet of
/// an earlier connection is not taken for one of this one.
pub fn random_psn() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    // RandomState is seeded randomly per process (and differs per call);
    // the clock adds entropy across calls in one thread.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    (h.finish() & 0xff_ffff) as u32
}

/// What a connection needs to know about the peer's QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteQp {
    /// The peer's QP number.
    pub qpn: u32,
    /// The peer's first send PSN.
    pub psn: u32,
    /// The peer's LID (0 on RoCE).
    pub lid: u16,
    /// The peer's GID (required when the local port uses a GRH).
    pub gid: Option<Gid>,
}

/// QP state (`ibv_qp_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpState {
    /// Reset.
    Reset,
    /// Initialized.
    Init,
    /// Ready to receive.
    Rtr,
    /// Ready to send.
    Rts,
    /// Send queue drained.
    Sqd,
    /// Send queue error.
    Sqe,
    /// Error.
    Error,
    /// Any other value.
    Other(u32),
}

/// Flags of a send work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SendFlags(u32);

impl SendFlags {
    /// No flag: unsignaled, not inline.
    pub const NONE: SendFlags = SendFlags(0);
    /// Generate a completion for this request.
    pub const SIGNALED: SendFlags = SendFlags(sys::IBV_SEND_SIGNALED);
    /// Copy the data into the work request at post time (the buffers may be
    /// reused at once); at most [`QpCaps::max_inline_data`] bytes.
    pub const INLINE: SendFlags = SendFlags(sys::IBV_SEND_INLINE);
    /// Set the solicited-event bit (wakes `req_notify(true)` waiters).
    pub const SOLICITED: SendFlags = SendFlags(sys::IBV_SEND_SOLICITED);
    /// Wait for earlier RDMA reads/atomics before processing this request.
    pub const FENCE: SendFlags = SendFlags(sys::IBV_SEND_FENCE);

    /// Whether every flag of `other` is set.
    pub fn contains(self, other: SendFlags) -> bool {
        self.0 & other.0 == other.0
    }

    /// These flags with `other` added when `on`.
    pub fn with(self, other: SendFlags, on: bool) -> SendFlags {
        if on {
            SendFlags(self.0 | other.0)
        } else {
            self
        }
    }
}

impl std::ops::BitOr for SendFlags {
    type Output = SendFlags;
    fn bitor(self, rhs: SendFlags) -> SendFlags {
        SendFlags(self.0 | rhs.0)
    }
}

/// The operation of a send work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// Send: consumes a receive request at the peer.
    Send,
    /// Send with 32 bits of immediate data (delivered in the peer's
    /// receive completion).
    SendWithImm(u32),
    /// RDMA write into the peer's memory; the peer sees no completion.
    RdmaWrite(RemoteAddr),
    /// RDMA write that also consumes a receive request at the peer and
    /// delivers the immediate data in its completion.
    RdmaWriteWithImm(RemoteAddr, u32),
}

/// A send work request. The scatter/gather entries borrow their memory
/// regions, which therefore stay registered while the request is built and
/// posted.
#[derive(Debug, Clone, Copy)]
pub struct SendRequest<'a> {
    /// Returned in the work completion.
    pub wr_id: u64,
    /// What to do.
    pub op: SendOp,
    /// The local data (may be empty for a zero-byte message).
    pub sges: &'a [Sge<'a>],
    /// Signaled, inline, solicited, fence.
    pub flags: SendFlags,
}

/// A reliable-connected queue pair (`ibv_qp`).
///
/// It holds its protection domain and both completion queues, so those are
/// destroyed only after the QP; dropping the QP destroys it (outstanding
/// work requests are flushed by the device).
pub struct QueuePair {
    raw: NonNull<sys::ibv_qp>,
    qpn: u32,
    caps: QpCaps,
    // Dropped after `QueuePair::drop` destroys the QP.
    pd: ProtectionDomain,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
}

// SAFETY: posting and modifying are thread safe in libibverbs (providers
// lock their queues); the fields are immutable.
unsafe impl Send for QueuePair {}
// SAFETY: as above.
unsafe impl Sync for QueuePair {}

impl fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QueuePair")
            .field("qpn", &format_args!("{:#x}", self.qpn))
            .field("caps", &self.caps)
            .finish()
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: created by ibv_create_qp and destroyed once; the CQs and PD
        // it uses are still alive (fields, dropped after this).
        let rc = unsafe { (self.pd.context().verbs().ibv_destroy_qp)(self.raw.as_ptr()) };
        if rc != 0 {
            tracing::error!(qpn = self.qpn, error = %errno_error(rc), "ibv_destroy_qp failed");
        }
    }
}

impl QueuePair {
    /// Creates an RC QP on `pd` whose send and receive completions go to
    /// `send_cq` and `recv_cq` (which may be the same queue). With
    /// `sq_sig_all`, every send generates a completion regardless of
    /// [`SendFlags::SIGNALED`]. The QP starts in the RESET state.
    pub fn new_rc(
        pd: &ProtectionDomain,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        caps: QpCaps,
        sq_sig_all: bool,
    ) -> Result<QueuePair> {
        let mut init = sys::ibv_qp_init_attr {
            send_cq: send_cq.as_raw(),
            recv_cq: recv_cq.as_raw(),
            srq: ptr::null_mut(),
            cap: sys::ibv_qp_cap {
                max_send_wr: caps.max_send_wr,
                max_recv_wr: caps.max_recv_wr,
                max_send_sge: caps.max_send_sge,
                max_recv_sge: caps.max_recv_sge,
                max_inline_data: caps.max_inline_data,
            },
            qp_type: sys::IBV_QPT_RC,
            sq_sig_all: c_int::from(sq_sig_all),
            ..Default::default()
        };
        let verbs = pd.context().verbs();
        // SAFETY: live PD and CQs of the same context; valid attributes.
        let raw = unsafe { (verbs.ibv_create_qp)(pd.as_raw(), &mut init) };
        let raw = NonNull::new(raw).ok_or_else(|| Error::last_os("ibv_create_qp"))?;
        // SAFETY: live QP; plain field read.
        let qpn = unsafe { (*raw.as_ptr()).qp_num };
        let c = init.cap;
        Ok(QueuePair {
            raw,
            qpn,
            caps: QpCaps {
                max_send_wr: c.max_send_wr,
                max_recv_wr: c.max_recv_wr,
                max_send_sge: c.max_send_sge,
                max_recv_sge: c.max_recv_sge,
                max_inline_data: c.max_inline_data,
            },
            pd: pd.clone(),
            send_cq: send_cq.clone(),
            recv_cq: recv_cq.clone(),
        })
    }

    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        self.qpn
    }

    /// The queue sizes the provider granted.
    pub fn caps(&self) -> QpCaps {
        self.caps
    }

    /// The protection domain.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    /// The send completion queue.
    pub fn send_cq(&self) -> &CompletionQueue {
        &self.send_cq
    }

    /// The receive completion queue.
    pub fn recv_cq(&self) -> &CompletionQueue {
        &self.recv_cq
    }

    /// The raw `ibv_qp`, valid while the QP lives.
    pub fn as_raw(&self) -> *mut sys::ibv_qp {
        self.raw.as_ptr()
    }

    fn modify(&self, attr: &mut sys::ibv_qp_attr, mask: u32, transition: Transition) -> Result<()> {
        let verbs = self.pd.context().verbs();
        // SAFETY: live QP; `attr` is valid for the fields named in `mask`.
        let rc = unsafe { (verbs.ibv_modify_qp)(self.as_raw(), attr, mask as c_int) };
        if rc != 0 {
            return Err(Error::QpTransition {
                qpn: self.qpn,
                transition,
                source: errno_error(rc),
            });
        }
        Ok(())
    }

    /// RESET to INIT.
    pub fn modify_to_init(&self, a: &InitAttr) -> Result<()> {
        let mut attr = sys::ibv_qp_attr {
            qp_state: sys::IBV_QPS_INIT,
            pkey_index: a.pkey_index,
            port_num: a.port,
            qp_access_flags: a.access.bits(),
            ..Default::default()
        };
        let mask = sys::IBV_QP_STATE
            | sys::IBV_QP_PKEY_INDEX
            | sys::IBV_QP_PORT
            | sys::IBV_QP_ACCESS_FLAGS;
        self.modify(&mut attr, mask, Transition::ResetToInit)
    }

    /// INIT to RTR.
    pub fn modify_to_rtr(&self, a: &RtrAttr) -> Result<()> {
        let grh = a.av.grh.unwrap_or(GlobalRoute {
            dgid: Gid::default(),
            sgid_index: 0,
            hop_limit: 0,
            traffic_class: 0,
            flow_label: 0,
        });
        let mut attr = sys::ibv_qp_attr {
            qp_state: sys::IBV_QPS_RTR,
            path_mtu: a.path_mtu.raw(),
            dest_qp_num: a.dest_qpn,
            rq_psn: a.rq_psn,
            max_dest_rd_atomic: a.max_dest_rd_atomic,
            min_rnr_timer: a.min_rnr_timer,
            ah_attr: sys::ibv_ah_attr {
                grh: sys::ibv_global_route {
                    dgid: grh.dgid.to_raw(),
                    flow_label: grh.flow_label,
                    sgid_index: grh.sgid_index,
                    hop_limit: grh.hop_limit,
                    traffic_class: grh.traffic_class,
                },
                dlid: a.av.dlid,
                sl: a.av.sl,
                src_path_bits: a.av.src_path_bits,
                static_rate: a.av.static_rate,
                is_global: u8::from(a.av.grh.is_some()),
                port_num: a.av.port,
            },
            ..Default::default()
        };
        let mask = sys::IBV_QP_STATE
            | sys::IBV_QP_AV
            | sys::IBV_QP_PATH_MTU
            | sys::IBV_QP_DEST_QPN
            | sys::IBV_QP_RQ_PSN
            | sys::IBV_QP_MAX_DEST_RD_ATOMIC
            | sys::IBV_QP_MIN_RNR_TIMER;
        self.modify(&mut attr, mask, Transition::InitToRtr)
    }

    /// RTR to RTS.
    pub fn modify_to_rts(&self, a: &RtsAttr) -> Result<()> {
        let mut attr = sys::ibv_qp_attr {
            qp_state: sys::IBV_QPS_RTS,
            sq_psn: a.sq_psn,
            timeout: a.timeout,
            retry_cnt: a.retry_cnt,
            rnr_retry: a.rnr_retry,
            max_rd_atomic: a.max_rd_atomic,
            ..Default::default()
        };
        let mask = sys::IBV_QP_STATE
            | sys::IBV_QP_TIMEOUT
            | sys::IBV_QP_RETRY_CNT
            | sys::IBV_QP_RNR_RETRY
            | sys::IBV_QP_SQ_PSN
            | sys::IBV_QP_MAX_QP_RD_ATOMIC;
        self.modify(&mut attr, mask, Transition::RtrToRts)
    }

    /// Moves the QP to the ERROR state: outstanding work requests complete
    /// with a flush error.
    pub fn modify_to_error(&self) -> Result<()> {
        let mut attr = sys::ibv_qp_attr {
            qp_state: sys::IBV_QPS_ERR,
            ..Default::default()
        };
        self.modify(&mut attr, sys::IBV_QP_STATE, Transition::ToError)
    }

    /// Connects an INIT-state QP to `remote` (INIT to RTR to RTS) with the
    /// conventional RC parameters (perftest's and ibv_rc_pingpong's):
    /// min RNR timer 12, ACK timeout 14, 7 retries, RNR retry 7, one
    /// outstanding RDMA read each way, hop limit 0xff. `local` is this
    /// side's port (its GID index is the source GID); `sq_psn` is the PSN
    /// this side sends first (the peer's `rq_psn`).
    pub fn connect(
        &self,
        local: &PortAddress,
        remote: &RemoteQp,
        path_mtu: Mtu,
        sq_psn: u32,
    ) -> Result<()> {
        self.connect_with(
            local,
            remote,
            path_mtu,
            &RtsAttr {
                sq_psn,
                ..RtsAttr::default()
            },
        )
    }

    /// [`QueuePair::connect`] with the RTS parameters (timeouts and
    /// retries) given by `rts`.
    pub fn connect_with(
        &self,
        local: &PortAddress,
        remote: &RemoteQp,
        path_mtu: Mtu,
        rts: &RtsAttr,
    ) -> Result<()> {
        let grh = match (local.gid, remote.gid) {
            (Some((index, _)), Some(dgid)) => Some(GlobalRoute {
                dgid,
                sgid_index: u8::try_from(index)
                    .map_err(|_| Error::InvalidArgument(format!("GID index {index} > 255")))?,
                hop_limit: 0xff,
                traffic_class: 0,
                flow_label: 0,
            }),
            (Some(_), None) => {
                return Err(Error::InvalidArgument(
                    "the local port uses a GRH but the peer sent no GID".into(),
                ))
            }
            (None, _) => None,
        };
        self.modify_to_rtr(&RtrAttr {
            path_mtu,
            dest_qpn: remote.qpn,
            rq_psn: remote.psn,
            max_dest_rd_atomic: 1,
            min_rnr_timer: 12,
            av: AddressVector {
                dlid: remote.lid,
                sl: 0,
                src_path_bits: 0,
                static_rate: 0,
                port: local.port,
                grh,
            },
        })?;
        self.modify_to_rts(rts)
    }

    /// The current state (`ibv_query_qp`).
    pub fn state(&self) -> Result<QpState> {
        let mut attr = sys::ibv_qp_attr::default();
        let mut init = sys::ibv_qp_init_attr::default();
        let verbs = self.pd.context().verbs();
        // SAFETY: live QP, valid out-parameters.
        let rc = unsafe {
            (verbs.ibv_query_qp)(
                self.as_raw(),
                &mut attr,
                sys::IBV_QP_STATE as c_int,
                &mut init,
            )
        };
        if rc != 0 {
            return Err(Error::from_rc("ibv_query_qp", rc));
        }
        Ok(match attr.qp_state {
            sys::IBV_QPS_RESET => QpState::Reset,
            sys::IBV_QPS_INIT => QpState::Init,
            sys::IBV_QPS_RTR => QpState::Rtr,
            sys::IBV_QPS_RTS => QpState::Rts,
            sys::IBV_QPS_SQD => QpState::Sqd,
            sys::IBV_QPS_SQE => QpState::Sqe,
            sys::IBV_QPS_ERR => QpState::Error,
            v => QpState::Other(v),
        })
    }

    /// Posts one send work request.
    ///
    /// An inline request may carry at most [`QpCaps::max_inline_data`]
    /// bytes: its data is copied at post time, so its buffers may be reused
    /// at once. Otherwise the device reads the buffers until the request
    /// completes.
    ///
    /// The [`Sge`]s borrow their regions only until this call returns, while
    /// the device reads (and, for an RDMA write, a peer receives) the bytes
    /// until the request completes. Nothing in the types ties the memory to
    /// that moment, so posting is `unsafe`; a safe call no longer compiles:
    ///
    /// ```compile_fail,E0133
    /// # use ibvx::verbs::{MemoryRegion, QueuePair, SendFlags, SendOp, SendRequest};
    /// fn send(qp: &QueuePair, mr: &MemoryRegion<'_>) -> ibvx::verbs::Result<()> {
    ///     qp.post_send(&SendRequest { // needs `unsafe`
    ///         wr_id: 1,
    ///         op: SendOp::Send,
    ///         sges: &[mr.sge(0, 64)],
    ///         flags: SendFlags::SIGNALED,
    ///     })
    /// }
    /// ```
    ///
    /// # Safety
    /// Unless the request is inline, until its work completion has been
    /// polled from the send completion queue (or the QP has been destroyed,
    /// or moved to the error state and the request's flush completion
    /// polled; with an unsignaled request, until a later signaled request of
    /// the same QP has completed):
    ///
    /// - every byte the entries of `wr.sges` name must stay mapped and
    ///   registered under the entry's lkey, and be memory the caller owns
    ///   (or has borrowed) for that whole time: it must not be freed, reused
    ///   or handed to other code (as a `&mut [u8]`, a lease, a buffer) that
    ///   does not expect the device to read it. The caller may change the
    ///   bytes only through raw-pointer accesses (as [`MemoryRegion::write`]
    ///   does), which only changes what is sent;
    /// - for [`SendOp::RdmaWrite`] and [`SendOp::RdmaWriteWithImm`], the
    ///   remote range (the address and the total length of the entries)
    ///   must be memory the peer granted to this write (its rkey): the
    ///   peer's device only checks that the range lies in *some* region of
    ///   that rkey.
    ///
    /// [`MemoryRegion::write`]: super::MemoryRegion::write
    #[inline]
    pub unsafe fn post_send(&self, wr: &SendRequest<'_>) -> Result<()> {
        if wr.flags.contains(SendFlags::INLINE) {
            let total: u64 = wr.sges.iter().map(|s| u64::from(s.len())).sum();
            if total > u64::from(self.caps.max_inline_data) {
                return Err(Error::InvalidArgument(format!(
                    "inline send of {total} bytes exceeds the QP's max_inline_data of {}",
                    self.caps.max_inline_data
                )));
            }
        }
        let num_sge = c_int::try_from(wr.sges.len())
            .map_err(|_| Error::InvalidArgument("too many scatter/gather entries".into()))?;
        let mut raw = sys::ibv_send_wr {
            wr_id: wr.wr_id,
            next: ptr::null_mut(),
            // The provider only reads the list; `Sge` is a transparent
            // `ibv_sge`.
            sg_list: wr.sges.as_ptr().cast_mut().cast(),
            num_sge,
            send_flags: wr.flags.0,
            ..Default::default()
        };
        match wr.op {
            SendOp::Send => raw.opcode = sys::IBV_WR_SEND,
            SendOp::SendWithImm(imm) => {
                raw.opcode = sys::IBV_WR_SEND_WITH_IMM;
                raw.__bindgen_anon_1.imm_data = imm.to_be();
            }
            SendOp::RdmaWrite(dst) => {
                raw.opcode = sys::IBV_WR_RDMA_WRITE;
                raw.wr.rdma = sys::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
                    remote_addr: dst.addr,
                    rkey: dst.rkey,
                };
            }
            SendOp::RdmaWriteWithImm(dst, imm) => {
                raw.opcode = sys::IBV_WR_RDMA_WRITE_WITH_IMM;
                raw.__bindgen_anon_1.imm_data = imm.to_be();
                raw.wr.rdma = sys::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
                    remote_addr: dst.addr,
                    rkey: dst.rkey,
                };
            }
        }
        let mut bad: *mut sys::ibv_send_wr = ptr::null_mut();
        // SAFETY: live QP; `raw` is a valid one-element list whose entries
        // lie in live registered regions (each `Sge` borrows its region for
        // this call, and this fn's contract keeps the memory registered and
        // the caller's until the request completes); inline data (copied by
        // the provider now) is within those regions and within the QP's
        // inline limit (checked above).
        let rc = unsafe { sys::ibv_post_send(self.as_raw(), &mut raw, &mut bad) };
        if rc != 0 {
            return Err(Error::from_rc("ibv_post_send", rc));
        }
        Ok(())
    }

    /// Posts one receive work request into `sges` (all in live regions
    /// registered with [`Access::LOCAL_WRITE`]). The device writes the
    /// buffers when a message arrives, which may be long after this call
    /// returns and the entries' borrows of their regions have ended; so
    /// posting is `unsafe`, and a safe call no longer compiles:
    ///
    /// ```compile_fail,E0133
    /// # use ibvx::verbs::{MemoryRegion, QueuePair};
    /// fn recv(qp: &QueuePair, mr: &MemoryRegion<'_>) -> ibvx::verbs::Result<()> {
    ///     qp.post_recv(1, &[mr.sge(0, 64)]) // needs `unsafe`
    /// }
    /// ```
    ///
    /// # Safety
    /// Until the request's work completion has been polled from the receive
    /// completion queue (or the QP has been destroyed, or moved to the error
    /// state and the request's flush completion polled), every byte the
    /// entries of `sges` name must stay mapped and registered under the
    /// entry's lkey, and be memory the caller owns for that whole time and
    /// keeps to itself: no reference (`&[u8]` or `&mut [u8]`) to it may
    /// exist, and it must not be freed, reused, or handed to other code (a
    /// lease, a buffer) that does not expect the device to write it. The
    /// caller may read it only through raw pointers
    /// ([`MemoryRegion::read`], [`MemoryRegion::load_u8`]), which see
    /// whatever the device has written so far.
    ///
    /// [`MemoryRegion::read`]: super::MemoryRegion::read
    /// [`MemoryRegion::load_u8`]: super::MemoryRegion::load_u8
    #[inline]
    pub unsafe fn post_recv(&self, wr_id: u64, sges: &[Sge<'_>]) -> Result<()> {
        let num_sge = c_int::try_from(sges.len())
            .map_err(|_| Error::InvalidArgument("too many scatter/gather entries".into()))?;
        let mut raw = sys::ibv_recv_wr {
            wr_id,
            next: ptr::null_mut(),
            sg_list: sges.as_ptr().cast_mut().cast(),
            num_sge,
        };
        let mut bad: *mut sys::ibv_recv_wr = ptr::null_mut();
        // SAFETY: live QP; a valid one-element list over live registered
        // regions (the device validates the lkeys and bounds), which this
        // fn's contract keeps registered and the caller's alone until the
        // request completes.
        let rc = unsafe { sys::ibv_post_recv(self.as_raw(), &mut raw, &mut bad) };
        if rc != 0 {
            return Err(Error::from_rc("ibv_post_recv", rc));
        }
        Ok(())
    }

    /// Posts receive work requests `(wr_id, entry)`, one scatter/gather
    /// entry each, as linked lists of up to [`RECV_LIST`] requests: one
    /// provider call (one doorbell) per list instead of one per request.
    /// On an error the requests before the failed one are posted (the
    /// error says nothing of how many: a caller fails the queue pair).
    ///
    /// # Safety
    /// As [`post_recv`](Self::post_recv), for every entry.
    pub unsafe fn post_recv_list<'a>(
        &self,
        reqs: impl IntoIterator<Item = (u64, Sge<'a>)>,
    ) -> Result<()> {
        let mut sges = [Sge::from_parts(0, 0, 0); RECV_LIST];
        let mut wrs = [sys::ibv_recv_wr {
            wr_id: 0,
            next: ptr::null_mut(),
            sg_list: ptr::null_mut(),
            num_sge: 1,
        }; RECV_LIST];
        let mut it = reqs.into_iter().peekable();
        while it.peek().is_some() {
            let mut n = 0;
            while n < RECV_LIST {
                let Some((wr_id, sge)) = it.next() else {
                    break;
                };
                sges[n] = sge;
                wrs[n].wr_id = wr_id;
                n += 1;
            }
            let base = wrs.as_mut_ptr();
            for (i, wr) in wrs[..n].iter_mut().enumerate() {
                wr.sg_list = ptr::addr_of_mut!(sges[i]).cast();
                wr.next = if i + 1 < n {
                    // SAFETY: i + 1 < n <= RECV_LIST: inside `wrs`.
                    unsafe { base.add(i + 1) }
                } else {
                    ptr::null_mut()
                };
            }
            let mut bad: *mut sys::ibv_recv_wr = ptr::null_mut();
            // SAFETY: live QP; `wrs[..n]` is a valid list (each `next` points
            // to the following element, the last to null) whose entries
            // point into `sges`, all alive for this call, over live
            // registered regions that this fn's contract keeps registered
            // and the caller's alone until each request completes.
            let rc = unsafe { sys::ibv_post_recv(self.as_raw(), base, &mut bad) };
            if rc != 0 {
                return Err(Error::from_rc("ibv_post_recv", rc));
            }
        }
        Ok(())
    }
}

/// Most receive requests [`QueuePair::post_recv_list`] links into one call.
pub const RECV_LIST: usize = 32;

#[cfg(test)]
mod tests;
