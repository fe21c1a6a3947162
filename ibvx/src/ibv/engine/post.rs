//! Posting work requests: messages and frames from the send slots, the
//! RDMA write of a rendezvous send and its `RNDZ_END`, queued protocol
//! messages, and receive slots re-posted.

use xdev::{Error, Rank, Result};

use super::{Control, IbvEngine, Local, Stage, MAX_WRITE, WR_SLOT, WR_WRITE};
use crate::ibv::wire::{self, Body, Header, FLAG_FAILED, MAX_CONTROL_LEN};
use crate::verbs::{RemoteAddr, SendFlags, SendOp, SendRequest};

impl IbvEngine {
    /// Posts one message to `dest` from a send slot, with the credit owed
    /// to it. The caller checked [`can_post`](Self::can_post). `completes`
    /// is the send that this message's completion finishes.
    pub(super) fn post_message(
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
    pub(super) fn post_frame(
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

    pub(super) fn post_control(&self, l: &mut Local, dest: Rank, c: Control) {
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
    pub(super) fn post_write_end(
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

    pub(super) fn repost(&self, l: &mut Local, src: Rank, slot: u32, by_data: bool) {
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
}
