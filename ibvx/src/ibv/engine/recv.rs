//! The receive side: incoming frames by kind, receives posted against the
//! unexpected queue, and delivery into a matched receive.

use std::ptr;

use xdev::devkit::matching::{Posted, PostedId};
use xdev::devkit::target::Target;
use xdev::{Envelope, Pattern, Rank, Source, Status};

use super::{Control, Dest, FirstRecv, IbvEngine, Local, Stage, Unexpected};
use crate::ibv::wire::{self, Body, Header, FLAG_SYNC};
use crate::verbs::RemoteAddr;

impl IbvEngine {
    /// Handles one frame from `src` and says what kind it was. Errors are
    /// protocol violations.
    #[inline]
    pub(super) fn on_frame(
        &self,
        l: &mut Local,
        src: Rank,
        frame: &[u8],
    ) -> std::result::Result<wire::Kind, String> {
        let (head, body) =
            wire::decode(frame, self.fab.opts.eager_limit).map_err(|e| e.to_string())?;
        let kind = body.kind();
        self.accept_credit(l, src, &head)?;
        let env = Envelope {
            source: src,
            tag: head.tag,
            context: head.context,
        };
        match body {
            Body::Eager(payload) => self.on_eager(l, env, &head, payload)?,
            Body::RndzStart { len } => self.on_rndz_start(l, env, &head, len)?,
            Body::RndzReply {
                rid,
                addr,
                len,
                rkey,
            } => self.on_rndz_reply(l, src, &head, rid, len, RemoteAddr { addr, rkey })?,
            Body::RndzEnd => self.on_rndz_end(l, src, &head)?,
            Body::Ack => self.on_ack(l, src, &head)?,
            Body::Credit => {}
        }
        Ok(kind)
    }

    /// Eager data: into a posted receive that matches, else held
    /// unexpected (within the sender's byte window).
    #[inline]
    fn on_eager(
        &self,
        l: &mut Local,
        env: Envelope,
        head: &Header,
        payload: &[u8],
    ) -> std::result::Result<(), String> {
        let src = env.source;
        let window = self.fab.opts.eager_window as u64;
        let n = payload.len() as u64;
        if l.peers[src].held_bytes + n > window {
            return Err(format!("eager data beyond its window of {window} bytes"));
        }
        let sync = (head.flags & FLAG_SYNC != 0).then_some(head.id);
        if let Some(t) = Self::take_posted(l, &env) {
            self.copy_into(l, env, payload, t);
            l.peers[src].owed_bytes += n;
            if let Some(id) = sync {
                self.push_control(l, src, Control::Ack { id });
            }
        } else {
            l.peers[src].held_bytes += n;
            let data = payload.to_vec();
            l.matching
                .push_unexpected(env, Unexpected::Eager { data, sync });
        }
        Ok(())
    }

    /// `ACK`: a synchronous eager send was matched.
    fn on_ack(&self, l: &mut Local, src: Rank, head: &Header) -> std::result::Result<(), String> {
        let id = head.id;
        if !l
            .sends
            .get(&id)
            .is_some_and(|s| s.dest == src && s.stage == Stage::AwaitAck)
        {
            return Err(format!("ACK for unknown send {id}"));
        }
        self.complete_send(l, id, Ok(()));
        Ok(())
    }

    /// Delivers a message taken from the unexpected queue into `t`.
    pub(super) fn deliver(&self, l: &mut Local, env: Envelope, msg: Unexpected, t: Dest) {
        match msg {
            Unexpected::Eager { data, sync } => {
                self.copy_into(l, env, &data, t);
                let p = &mut l.peers[env.source];
                p.held_bytes -= data.len() as u64;
                p.owed_bytes += data.len() as u64;
                if let Some(id) = sync {
                    self.push_control(l, env.source, Control::Ack { id });
                } else {
                    self.return_credit(l, env.source);
                }
            }
            Unexpected::Local { data, sync } => {
                self.copy_into(l, env, &data, t);
                if let Some(id) = sync {
                    self.complete_send(l, id, Ok(()));
                }
            }
            Unexpected::Start { id, len } => {
                if let Some(e) = Self::gone_error(l, env.source) {
                    self.complete_target(l, t, Status::failed(env, e));
                } else {
                    self.reply(l, env, id, len, t);
                }
            }
        }
    }

    /// Copies a message into a matched receive and completes it.
    #[inline]
    pub(super) fn copy_into(&self, l: &mut Local, env: Envelope, data: &[u8], t: Dest) {
        let (dst, cap) = t.dst(l);
        let n = data.len().min(cap);
        if n > 0 {
            // SAFETY: `dst` is the receive's buffer of `cap` bytes, owned by
            // its request or borrowed by its waiting blocking call (which
            // takes its receive out of the engine before it returns); `data`
            // is a different buffer (a receive slot, a copy or the sender's).
            unsafe { ptr::copy_nonoverlapping(data.as_ptr(), dst, n) };
        }
        self.complete_target(l, t, Status::received(env, data.len(), cap));
    }

    /// The earliest posted receive that matches `env`, taken out: the
    /// first slot's (see `Local::first`), else the matching engine's.
    #[inline]
    pub(super) fn take_posted(l: &mut Local, env: &Envelope) -> Option<Dest> {
        if let Some(f) = l.first.as_mut() {
            if f.is_posted() && f.pattern.matches(env) {
                f.matched = true;
                return Some(Dest::First);
            }
        }
        l.matching.take_posted(env).map(Dest::Recv)
    }

    /// Posts the receive of a blocking call into the first slot (see
    /// `Local::first`) if the slot is free and no other receive is posted,
    /// delivering a matching unexpected message at once; false (nothing
    /// done) otherwise, and the caller posts with [`post`](Self::post).
    ///
    /// After true the slot is the caller's: it must take it back
    /// (`FirstGuard`) before `dst` stops being valid for `cap` bytes.
    pub(super) fn post_first(
        &self,
        l: &mut Local,
        pattern: Pattern,
        dst: *mut u8,
        cap: usize,
    ) -> bool {
        if l.first.is_some() || l.matching.posted_len() != 0 || self.post_to_gone(l, pattern) {
            return false;
        }
        let taken = l.matching.take(&pattern);
        l.first = Some(FirstRecv {
            pattern,
            dst,
            cap,
            matched: taken.is_some(),
            status: None,
        });
        if let Some((env, msg)) = taken {
            self.deliver(l, env, msg, Dest::First);
        }
        true
    }

    /// Whether `pattern` names a peer that is gone (`post` then delivers
    /// what it sent before leaving, or fails the receive).
    fn post_to_gone(&self, l: &Local, pattern: Pattern) -> bool {
        matches!(pattern.source, Source::Rank(s) if s != self.fab.rank && l.peers[s].gone.is_some())
    }

    /// Posts receive `t`: delivers a matching unexpected message, or queues
    /// it (`queued` gets its id), or fails it if its source is gone.
    pub(super) fn post(
        &self,
        l: &mut Local,
        pattern: Pattern,
        t: Target,
        queued: impl FnOnce(PostedId),
    ) {
        if let Source::Rank(s) = pattern.source {
            if s != self.fab.rank && l.peers[s].gone.is_some() {
                // What it sent before leaving is still deliverable.
                if let Some((env, msg)) = l.matching.take(&pattern) {
                    self.deliver(l, env, msg, Dest::Recv(t));
                } else {
                    let env = Envelope::untagged(s, pattern.context);
                    let e = Self::gone_error(l, s).expect("gone");
                    self.complete_target(l, Dest::Recv(t), Status::failed(env, e));
                }
                return;
            }
        }
        match l.matching.post(pattern, t) {
            Posted::Matched { env, msg, recv } => self.deliver(l, env, msg, Dest::Recv(recv)),
            Posted::Queued(id) => queued(id),
        }
    }
}
