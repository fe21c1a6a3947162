//! The process device's control messages: the replies and fragments that
//! are not matched (`ACK`, `FIN`, `PULL`, `DATA`, `WRITE`, `WROTE`), one
//! handler per kind, and the queue of replies that wait for ring room.

use xdev::devkit::target::lost;
use xdev::{Error, Rank, Status};

use super::medium::{Eng, Loc, ProcessMedium};
use crate::ring::{Header, Incoming};
use crate::wire::{
    FLAG_FAILED, FLAG_MAPPED, KIND_ACK, KIND_DATA, KIND_FIN, KIND_PULL, KIND_WRITE, KIND_WROTE,
    SPLIT_PAGE,
};

/// What a handler returns: `Err` is a protocol violation by the peer.
type Handled = Result<(), String>;

impl ProcessMedium {
    /// Sends a reply (`ACK`, `FIN`, `PULL`) to `dest`, queueing it if its
    /// ring is full. Replies to a gone peer are dropped.
    pub(super) fn reply(e: &Eng, l: &mut Loc, dest: Rank, kind: u8, flags: u8, id: u64) {
        let h = Header {
            kind,
            flags,
            cookie: id,
            ..Header::default()
        };
        Self::control(e, l, dest, h);
    }

    /// Sends a payload-less control message to `dest`, in order with the
    /// others.
    pub(super) fn control(e: &Eng, l: &mut Loc, dest: Rank, h: Header) {
        if l.gone[dest] {
            return;
        }
        if l.m.control[dest].is_empty() {
            match e.try_push(l, dest, &h, &[]) {
                Ok(true) => {
                    e.wake(dest);
                    return;
                }
                Ok(false) => {}
                Err(_) => return,
            }
        }
        l.m.control[dest].push_back(h);
        l.m.control_total += 1;
        e.producer(l, dest).set_waiting(true);
    }

    pub(super) fn flush_control(e: &Eng, l: &mut Loc) -> bool {
        let mut any = false;
        for d in 0..e.size {
            let mut pushed = false;
            while let Some(&h) = l.m.control[d].front() {
                if e.try_push(l, d, &h, &[]) != Ok(true) {
                    break;
                }
                l.m.control[d].pop_front();
                l.m.control_total -= 1;
                pushed = true;
            }
            if pushed {
                any = true;
                e.wake(d);
            }
        }
        any
    }

    /// Handles a reply or fragment from `s`.
    pub(super) fn control_message(e: &Eng, l: &mut Loc, s: Rank, msg: &Incoming) -> Handled {
        let h = msg.header;
        match h.kind {
            KIND_ACK | KIND_FIN => Self::on_reply(e, l, s, &h),
            KIND_PULL => Self::on_pull(l, s, &h),
            KIND_WRITE => Self::on_write(e, l, s, &h),
            KIND_WROTE => Self::on_wrote(e, l, s, &h),
            KIND_DATA => Self::on_data(e, l, s, msg),
            k => Err(format!("unknown message kind {k}")),
        }
    }

    /// `ACK` or `FIN`: the receiver is done with a send of ours.
    fn on_reply(e: &Eng, l: &mut Loc, s: Rank, h: &Header) -> Handled {
        let send = match l.m.sends.remove(&h.cookie) {
            Some(send) if send.dest == s && send.streamed.is_none() => send,
            Some(send) => {
                l.m.sends.insert(h.cookie, send);
                return Err(format!("reply for send {} it does not hold", h.cookie));
            }
            None => return Err(format!("reply for unknown send {}", h.cookie)),
        };
        let r = if h.flags & FLAG_FAILED != 0 {
            Err(Error::Protocol {
                rank: e.rank,
                what: format!("rank {s} could not read the rendezvous data"),
            })
        } else {
            Ok(())
        };
        Self::complete_send(e, l, send, r);
        Ok(())
    }

    /// `PULL`: stream a send of ours through the ring.
    fn on_pull(l: &mut Loc, s: Rank, h: &Header) -> Handled {
        match l.m.sends.get_mut(&h.cookie) {
            Some(send) if send.dest == s && send.streamed.is_none() && send.len > 0 => {
                send.streamed = Some(0);
            }
            _ => return Err(format!("PULL for send {} it does not hold", h.cookie)),
        }
        l.m.streams_out[s].push_back(h.cookie);
        l.m.streams_total += 1;
        Ok(())
    }

    /// `WRITE`: the receiver asks for the tail of our send in its buffer.
    fn on_write(e: &Eng, l: &mut Loc, s: Rank, h: &Header) -> Handled {
        let half = h.context as usize * SPLIT_PAGE;
        let send = match l.m.sends.get_mut(&h.cookie) {
            Some(send)
                if send.dest == s
                    && send.rndv
                    && send.streamed.is_none()
                    && !send.wrote
                    && half > 0
                    && half < send.len =>
            {
                send
            }
            _ => return Err(format!("WRITE for send {} it cannot ask for", h.cookie)),
        };
        send.wrote = true;
        let (data, len) = (send.data, send.len);
        if !Self::may_copy_with(e, l, s) {
            // A departed receiver's request is dropped, not served: its
            // receive is gone with it, and its pid may be another process's
            // by now. The send completes with its FIN, or fails with the peer.
            return Ok(());
        }
        // SAFETY: the send's buffer is valid for len bytes until the send
        // completes (owned by its request, or borrowed by a blocking send
        // that waits for its reply), and half < len.
        let tail = unsafe { std::slice::from_raw_parts(data.add(half), len - half) };
        // Only rank s's memory is written, where it asked: a hostile
        // receiver can only misplace our data in itself.
        let written = if h.flags & FLAG_MAPPED != 0 {
            // Into its shared arena, through our mapping of it; if that
            // fails, the receiver reads the tail itself.
            Self::mapped_write(e, l, s, (h.tag, h.aux), tail)
        } else {
            crate::cma::write_remote(e.m.sh.pids[s], h.aux, tail).is_ok()
        };
        let flags = if written { 0 } else { FLAG_FAILED };
        Self::reply(e, l, s, KIND_WROTE, flags, h.cookie);
        Ok(())
    }

    /// `WROTE`: the sender wrote (or could not write) the tail of a split
    /// copy into our receive.
    fn on_wrote(e: &Eng, l: &mut Loc, s: Rank, h: &Header) -> Handled {
        let Some(sp) = l.m.splits.remove(&(s, h.cookie)) else {
            return Err(format!("WROTE for receive {} it was not asked", h.cookie));
        };
        Self::stream_ended(l, s);
        let (dst, cap) = sp.target.dst();
        let st = if let Some(err) = sp.start.head_failed {
            Status::failed(sp.env, err)
        } else if h.flags & FLAG_FAILED != 0 && !Self::may_copy_with(e, l, s) {
            // It could not write, and has left since: nothing more is read
            // from it.
            Status::failed(sp.env, lost(s, "sender process is gone"))
        } else if h.flags & FLAG_FAILED != 0 {
            // It could not write: read the tail ourselves.
            // SAFETY: dst is valid for cap >= len > half bytes and ours
            // again (the sender is done with it).
            let tail = unsafe {
                std::slice::from_raw_parts_mut(dst.add(sp.start.half), sp.start.len - sp.start.half)
            };
            // The peer chose both numbers: past the end of memory, the
            // mapped span is refused and the address fails to read (an
            // error for this receive, not an overflow).
            let half = sp.start.half as u64;
            let from = sp.start.addr.wrapping_add(half);
            let at = sp
                .start
                .mapped
                .and_then(|(fd, o)| Some((fd, o.checked_add(half)?)));
            let read = if Self::mapped_copy(e, l, s, at, tail) {
                Ok(())
            } else {
                crate::cma::read_remote(e.m.sh.pids[s], from, tail)
            };
            match read {
                Ok(()) => Status::received(sp.env, sp.start.len, cap),
                Err(err) => {
                    let what = format!("rendezvous source {from:#x} unreadable: {err}");
                    Status::failed(sp.env, Error::Protocol { rank: s, what })
                }
            }
        } else {
            Status::received(sp.env, sp.start.len, cap)
        };
        l.m.splits_done += 1;
        e.complete_target(l, sp.target, st);
        Ok(())
    }

    /// `DATA`: a fragment of a pipelined rendezvous into one of our
    /// receives.
    fn on_data(e: &Eng, l: &mut Loc, s: Rank, msg: &Incoming) -> Handled {
        let h = msg.header;
        let key = (s, h.cookie);
        let Some(st) = l.m.streams_in.get(&key) else {
            return Ok(()); // an abandoned stream (its receive ended)
        };
        let off = h.aux as usize;
        let n = h.len as usize;
        if off != st.got || n == 0 || off + n > st.len {
            return Err(format!(
                "fragment {off}+{n} of a {}-byte stream at {}",
                st.len, st.got
            ));
        }
        let (dst, cap) = st.target.dst();
        if off < cap {
            let k = n.min(cap - off);
            // SAFETY: dst is valid for cap bytes, off + k <= cap, and the
            // target is exclusively ours until completed.
            let out = unsafe { std::slice::from_raw_parts_mut(dst.add(off), k) };
            Eng::consumer_of(l, s).copy_payload(msg, out);
        }
        let st = l.m.streams_in.get_mut(&key).expect("present");
        st.got += n;
        if st.got == st.len {
            let st = l.m.streams_in.remove(&key).expect("present");
            Self::stream_ended(l, s);
            let status = Status::received(st.env, st.len, cap);
            e.complete_target(l, st.target, status);
        }
        Ok(())
    }
}
