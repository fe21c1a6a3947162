//! Credits and the send backlog: whether a message may go now (slot
//! credits, the byte window, send slots, send-queue room), sends queued per
//! peer in order and flushed as resources return, `CREDIT` messages, and the
//! start of a send (eager at once, queued, or to ourselves by copy).

use std::ptr;

use xdev::devkit::target::SendOwner;
use xdev::{Context, Envelope, Rank, Result, Tag};

use super::{
    rndv_window, Control, IbvEngine, Local, OutSend, Outgoing, Peer, Stage, Unexpected, MAX_WRITE,
};
use crate::ibv::wire::{Body, Header, FLAG_SYNC};

impl IbvEngine {
    /// Whether a message to `dest` can be posted now (`credit_only`: a
    /// `CREDIT`, which may use the last credit).
    #[inline]
    pub(super) fn can_post(&self, l: &Local, dest: Rank, wrs: u32, credit_only: bool) -> bool {
        let p = &l.peers[dest];
        let need = if credit_only { 1 } else { 2 };
        p.gone.is_none() && p.credits >= need && p.sq.has_room(wrs) && !l.free_slots.is_empty()
    }

    /// Whether a `len`-byte message to `dest` goes eager: within the eager
    /// limit and the peer's byte window (else it is a rendezvous).
    #[inline]
    pub(super) fn goes_eager(&self, l: &Local, dest: Rank, len: usize) -> bool {
        len <= self.fab.opts.eager_limit && l.peers[dest].window >= len as u64
    }

    /// Posts an eager message and charges it to the peer's byte window.
    #[inline]
    pub(super) fn post_eager(
        &self,
        l: &mut Local,
        dest: Rank,
        head: Header,
        data: &[u8],
    ) -> Result<()> {
        self.post_message(l, dest, head, Body::Eager(data), None)?;
        l.peers[dest].window -= data.len() as u64;
        Ok(())
    }

    /// Tries to send queued send `id` (eager or rendezvous start); false if
    /// resources are short (it stays queued).
    pub(super) fn try_send(&self, l: &mut Local, id: u64) -> bool {
        let s = l.sends.get(&id).expect("queued send");
        let dest = s.dest;
        if !self.can_post(l, dest, 1, false) {
            return false;
        }
        let eager = self.goes_eager(l, dest, s.len);
        if !eager && l.peers[dest].rndv_out >= rndv_window() {
            return false; // waits for one of ours to finish
        }
        let head = Header {
            tag: s.tag,
            context: s.context,
            id,
            flags: if eager && s.sync { FLAG_SYNC } else { 0 },
            ..Header::default()
        };
        let (data, len, sync) = (s.data, s.len, s.sync);
        let r = if eager {
            // SAFETY: the send's buffer is alive (see OutSend) and `len` is its length.
            let payload = unsafe { std::slice::from_raw_parts(data, len) };
            self.post_eager(l, dest, head, payload)
        } else {
            self.post_message(l, dest, head, Body::RndzStart { len: len as u64 }, None)
        };
        if r.is_err() {
            return true; // the send failed with its peer
        }
        if eager {
            if sync {
                l.sends.get_mut(&id).expect("present").stage = Stage::AwaitAck;
            } else {
                self.complete_send(l, id, Ok(()));
            }
        } else {
            l.sends.get_mut(&id).expect("present").stage = Stage::AwaitReply;
            l.peers[dest].rndv_out += 1;
        }
        true
    }

    /// Posts queued protocol messages and sends to `dest`, in order, while
    /// resources last.
    pub(super) fn flush_peer(&self, l: &mut Local, dest: Rank) {
        while let Some(c) = l.peers[dest].control.front() {
            let wrs = match c {
                Control::WriteEnd { len, .. } => 1 + len.div_ceil(MAX_WRITE) as u32,
                _ => 1,
            };
            if !self.can_post(l, dest, wrs, false) {
                return;
            }
            let c = l.peers[dest].control.pop_front().expect("present");
            self.post_control(l, dest, c);
            if l.peers[dest].gone.is_some() {
                return;
            }
        }
        while let Some(&id) = l.peers[dest].backlog.front() {
            if !self.try_send(l, id) {
                return;
            }
            l.peers[dest].backlog.pop_front();
            if l.peers[dest].gone.is_some() {
                return;
            }
        }
    }

    pub(super) fn push_control(&self, l: &mut Local, dest: Rank, c: Control) {
        if l.peers[dest].gone.is_some() {
            return;
        }
        l.peers[dest].control.push_back(c);
        self.flush_peer(l, dest);
    }

    /// Starts a send (after argument checks). Returns false when it
    /// completed at once without calling `owner` (the caller completes it),
    /// true when `owner` was called: the engine completes the owner (maybe
    /// already did).
    pub(super) fn start(
        &self,
        l: &mut Local,
        out: Outgoing<'_>,
        owner: impl FnOnce() -> SendOwner,
    ) -> Result<bool> {
        let Outgoing { to, data, user } = out;
        let (dest, tag, context, sync) = to.parts();
        if dest == self.fab.rank {
            return Ok(self.send_local(l, tag, context, data, sync, owner));
        }
        if let Some(e) = Self::gone_error(l, dest) {
            return Err(e);
        }
        // Fast path: an eager send straight from the caller's buffer.
        if !sync
            && l.peers[dest].backlog.is_empty()
            && self.goes_eager(l, dest, data.len())
            && self.can_post(l, dest, 1, false)
        {
            let head = Header {
                tag,
                context,
                ..Header::default()
            };
            self.post_eager(l, dest, head, data)?;
            return Ok(false);
        }
        let id = l.next_id;
        l.next_id += 1;
        l.sends.insert(
            id,
            OutSend {
                dest,
                tag,
                context,
                data: data.as_ptr(),
                len: data.len(),
                sync,
                stage: Stage::Queued,
                owner: owner(),
                reg: None,
                user,
            },
        );
        // Behind any send already waiting for this peer, to keep order.
        l.peers[dest].backlog.push_back(id);
        self.flush_peer(l, dest);
        Ok(true)
    }

    /// A send to ourselves: delivered by copy.
    pub(super) fn send_local(
        &self,
        l: &mut Local,
        tag: Tag,
        context: Context,
        data: &[u8],
        sync: bool,
        owner: impl FnOnce() -> SendOwner,
    ) -> bool {
        let env = Envelope {
            source: self.fab.rank,
            tag,
            context,
        };
        if let Some(t) = Self::take_posted(l, &env) {
            self.copy_into(l, env, data, t);
            return false;
        }
        let sync_id = sync.then(|| {
            let id = l.next_id;
            l.next_id += 1;
            l.sends.insert(
                id,
                OutSend {
                    dest: self.fab.rank,
                    tag,
                    context,
                    data: ptr::null(),
                    len: data.len(),
                    sync,
                    stage: Stage::LocalUnmatched,
                    owner: owner(),
                    reg: None,
                    user: None,
                },
            );
            id
        });
        l.matching.push_unexpected(
            env,
            Unexpected::Local {
                data: data.to_vec(),
                sync: sync_id,
            },
        );
        sync_id.is_some()
    }

    /// Takes the credit a frame from `src` returns (slots and eager
    /// bytes); more than it was given is a protocol violation.
    #[inline]
    pub(super) fn accept_credit(
        &self,
        l: &mut Local,
        src: Rank,
        head: &Header,
    ) -> std::result::Result<(), String> {
        let depth = self.fab.opts.recv_depth;
        let window = self.fab.opts.eager_window as u64;
        let p = &mut l.peers[src];
        p.credits += u32::from(head.slots);
        p.window += u64::from(head.bytes);
        if p.credits > depth || p.window > window {
            return Err(format!(
                "returned more credit than it was given ({} slots of {depth}, {} bytes of {window})",
                p.credits, p.window
            ));
        }
        Ok(())
    }

    /// Sends a `CREDIT` to `dest` if enough is owed and nothing else is
    /// going there to carry it.
    #[inline]
    pub(super) fn return_credit(&self, l: &mut Local, dest: Rank) {
        if !self.owes_enough(&l.peers[dest]) || l.peers[dest].gone.is_some() {
            return;
        }
        let p = &l.peers[dest];
        if !p.control.is_empty() || !p.backlog.is_empty() {
            self.flush_peer(l, dest);
        }
        let still = self.owes_enough(&l.peers[dest]);
        if still && self.can_post(l, dest, 1, true) {
            let _ = self.post_message(l, dest, Header::default(), Body::Credit, None);
        }
    }

    /// Whether enough is owed to `p` to send a `CREDIT` on its own: a
    /// quarter of its slots used by data, half its byte window, or half its
    /// slots of any kind. The last rule returns the slots the peer's own
    /// `CREDIT` messages used, which nothing else would return while no data
    /// goes its way: without it a peer whose credits went into `CREDIT`
    /// messages could be left with one credit and a reply it cannot send.
    /// Each `CREDIT` it triggers returns at least half the slots and uses
    /// one, so `CREDIT`s cannot bounce back and forth for long.
    #[inline]
    pub(super) fn owes_enough(&self, p: &Peer) -> bool {
        let depth = self.fab.opts.recv_depth;
        p.owed_by_data >= (depth / 4).max(1)
            || p.owed_slots * 2 >= depth
            || p.owed_bytes * 2 >= self.fab.opts.eager_window as u64
    }
}
