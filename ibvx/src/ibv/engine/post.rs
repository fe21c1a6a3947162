//! Posting work requests: messages and frames from the send slots, the
//! RDMA write of a rendezvous send and its `RNDZ_END`, queued protocol
//! messages, and receive slots re-posted.

use xdev::{Error, Rank, Result};

use super::{Control, IbvEngine, Local, Stage, MAX_WRITE, WR_SLOT, WR_UNSIG, WR_WRITE};
use crate::ibv::wire::{self, Body, Header, FLAG_FAILED, MAX_CONTROL_LEN};
use crate::verbs::{RemoteAddr, SendFlags, SendOp, SendRequest};

impl IbvEngine {
    /// Posts one message to `dest` from a send slot, with the credit owed
    /// to it. The caller checked [`can_post`](Self::can_post). `completes`
    /// is the send that this message's completion finishes.
    #[inline]
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
    ///
    /// An inline frame that completes no send is posted unsignalled (unless
    /// the send queue's signalling period is up, see `sendq`): the provider
    /// copied it into the work request, so its slot is free again at once,
    /// and no completion is polled for it.
    #[inline]
    pub(super) fn post_frame(
        &self,
        l: &mut Local,
        dest: Rank,
        head: &[u8],
        payload: &[u8],
        completes: Option<u64>,
    ) -> Result<()> {
        let slot = l.free_slots.pop().expect("caller checked for a free slot");
        let off = slot as usize * self.fab.slot_len;
        l.send_mr.write(off, head);
        l.send_mr.write(off + head.len(), payload);
        let total = head.len() + payload.len();
        let inline = total <= self.fab.inline_max;
        let signaled = l.peers[dest].sq.must_signal(!inline || completes.is_some());
        let wr_id = if signaled {
            l.slot_use[slot as usize] = (dest, completes);
            WR_SLOT | u64::from(slot)
        } else {
            WR_UNSIG | dest as u64
        };
        let flags = SendFlags::NONE
            .with(SendFlags::SIGNALED, signaled)
            .with(SendFlags::INLINE, inline);
        let qp = self.fab.qps[dest].as_ref().expect("no QP to self");
        // SAFETY: the range is inside send slot `slot` of `send_mr`, which
        // the engine owns and which outlives the QPs (dropped first with the
        // fabric). An inline request is copied by the provider during this
        // call. Otherwise the request is signalled, its slot was taken off
        // `free_slots` above and goes back only when this request's
        // completion is polled (`on_send_completion`), so nothing writes it
        // meanwhile. No reference to the slot exists (the engine copies in
        // with `write`).
        let r = unsafe {
            qp.post_send(&SendRequest {
                wr_id,
                op: SendOp::Send,
                sges: &[l.send_mr.sge(off, total)],
                flags,
            })
        };
        if let Err(e) = r {
            // Nothing was posted: give the slot back.
            l.free_slots.push(slot);
            let err = Error::transport(format!("post a send to rank {dest}"), e);
            self.fail_peer(l, dest, err.clone());
            return Err(err);
        }
        l.peers[dest].credits -= 1;
        Self::sq_posted(l, dest, signaled);
        if !signaled {
            // Inline: the provider holds its own copy.
            l.free_slots.push(slot);
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
            l.peers[dest].sq.posted(true);
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

    /// Re-posts the receive slots of `l.reposts` (those whose completions
    /// one poll handled), one list per peer, and counts them as credit owed
    /// to their peers.
    pub(super) fn repost_all(&self, l: &mut Local) {
        let mut reposts = std::mem::take(&mut l.reposts);
        let mut slots = std::mem::take(&mut l.repost_slots);
        // Grouped by peer, in order within a peer.
        reposts.sort_by_key(|&(src, _, _)| src);
        for group in reposts.chunk_by(|a, b| a.0 == b.0) {
            let src = group[0].0;
            if l.peers[src].gone.is_some() {
                continue; // its queue pair is in the error state
            }
            slots.clear();
            slots.extend(group.iter().map(|&(_, slot, _)| slot));
            match self.fab.post_recv_slots(src, &slots) {
                Ok(()) => {
                    let p = &mut l.peers[src];
                    p.owed_slots += group.len() as u32;
                    p.owed_by_data += group.iter().filter(|r| r.2).count() as u32;
                }
                Err(e) => {
                    let err = Error::transport(format!("re-post receives for rank {src}"), e);
                    self.fail_peer(l, src, err);
                }
            }
        }
        reposts.clear();
        l.reposts = reposts;
        l.repost_slots = slots;
    }
}
