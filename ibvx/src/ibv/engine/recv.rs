//! The receive side: incoming frames by kind, receives posted against the
//! unexpected queue, and delivery into a matched receive.

use std::ptr;

use xdev::matching::{Posted, PostedId};
use xdev::target::Target;
use xdev::{Envelope, Error, Pattern, Rank, Source, Status};

use super::rendezvous::registration_error;
use super::{rndv_window, Control, Engine, Local, Stage, Unexpected};
use crate::ibv::wire::{self, Body, FLAG_FAILED, FLAG_SYNC};
use crate::verbs::RemoteAddr;

impl Engine {
    /// Handles one frame from `src` and says what kind it was. Errors are
    /// protocol violations.
    pub(super) fn on_frame(
        &self,
        l: &mut Local,
        src: Rank,
        frame: &[u8],
    ) -> std::result::Result<wire::Kind, String> {
        let (head, body) =
            wire::decode(frame, self.fab.opts.eager_limit).map_err(|e| e.to_string())?;
        let kind = body.kind();
        let depth = self.fab.opts.recv_depth;
        let window = self.fab.opts.eager_window as u64;
        {
            let p = &mut l.peers[src];
            p.credits += u32::from(head.slots);
            p.window += u64::from(head.bytes);
            if p.credits > depth || p.window > window {
                return Err(format!(
                    "returned more credit than it was given ({} slots of {depth}, {} bytes of {window})",
                    p.credits, p.window
                ));
            }
        }
        let env = Envelope {
            source: src,
            tag: head.tag,
            context: head.context,
        };
        match body {
            Body::Eager(payload) => {
                let n = payload.len() as u64;
                if l.peers[src].held_bytes + n > window {
                    return Err(format!("eager data beyond its window of {window} bytes"));
                }
                let sync = (head.flags & FLAG_SYNC != 0).then_some(head.id);
                if let Some((_, t)) = l.matching.take_posted(&env) {
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
            }
            Body::RndzStart { len } => {
                let len = usize::try_from(len)
                    .ok()
                    .filter(|&n| n <= isize::MAX as usize)
                    .ok_or_else(|| format!("rendezvous length {len} too large"))?;
                l.peers[src].rndv_in += 1;
                if l.peers[src].rndv_in > rndv_window() {
                    return Err(format!(
                        "more than {} unfinished rendezvous sends",
                        rndv_window()
                    ));
                }
                if let Some((_, t)) = l.matching.take_posted(&env) {
                    self.reply(l, env, head.id, len, t);
                } else {
                    l.matching
                        .push_unexpected(env, Unexpected::Start { id: head.id, len });
                }
            }
            Body::RndzReply {
                rid,
                addr,
                len,
                rkey,
            } => {
                let id = head.id;
                let s = l
                    .sends
                    .get_mut(&id)
                    .filter(|s| s.dest == src && s.stage == Stage::AwaitReply)
                    .ok_or_else(|| format!("RNDZ_REPLY for unknown send {id}"))?;
                if len > s.len as u64 {
                    return Err(format!(
                        "RNDZ_REPLY grants {len} bytes for a {}-byte message",
                        s.len
                    ));
                }
                if head.flags & FLAG_FAILED != 0 {
                    let e = Error::transport(
                        format!("rendezvous send to rank {src}"),
                        std::io::Error::other("the receiver could not register its buffer"),
                    );
                    self.complete_send(l, id, Err(e));
                } else if len == 0 {
                    self.complete_send(l, id, Ok(()));
                } else {
                    let len = len as usize;
                    // SAFETY: the send's buffer stays alive and unmoved until
                    // the send is removed, which drops this registration first.
                    match unsafe { self.fab.cache.register(s.data.cast_mut(), len) } {
                        Ok(reg) => {
                            s.reg = Some(reg);
                            s.stage = Stage::Writing { posted: false };
                            let dst = RemoteAddr { addr, rkey };
                            self.push_control(l, src, Control::WriteEnd { id, rid, dst, len });
                        }
                        Err(e) => {
                            self.complete_send(l, id, Err(registration_error(e)));
                            self.push_control(l, src, Control::EndFailed { rid });
                        }
                    }
                }
            }
            Body::RndzEnd => {
                let rid = head.id;
                if !l.incoming.get(&rid).is_some_and(|i| i.src == src) {
                    return Err(format!("RNDZ_END for unknown receive {rid}"));
                }
                let inc = l.incoming.remove(&rid).expect("present");
                Self::rendezvous_in_ended(l, src);
                let st = if head.flags & FLAG_FAILED != 0 {
                    let e = Error::transport(
                        format!("rendezvous receive from rank {src}"),
                        std::io::Error::other("the sender could not register its buffer"),
                    );
                    Status::failed(inc.env, e)
                } else {
                    Status::received(inc.env, inc.len, inc.cap)
                };
                self.complete_target(l, inc.target, st);
            }
            Body::Ack => {
                let id = head.id;
                if !l
                    .sends
                    .get(&id)
                    .is_some_and(|s| s.dest == src && s.stage == Stage::AwaitAck)
                {
                    return Err(format!("ACK for unknown send {id}"));
                }
                self.complete_send(l, id, Ok(()));
            }
            Body::Credit => {}
        }
        Ok(kind)
    }

    /// Delivers a message taken from the unexpected queue into `t`.
    pub(super) fn deliver(&self, l: &mut Local, env: Envelope, msg: Unexpected, t: Target) {
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
    pub(super) fn copy_into(&self, l: &mut Local, env: Envelope, data: &[u8], t: Target) {
        let (dst, cap) = t.dst();
        let n = data.len().min(cap);
        if n > 0 {
            // SAFETY: `dst` is the receive's buffer of `cap` bytes, owned by
            // its request or borrowed by its waiting blocking call; `data` is
            // a different buffer (a receive slot, a copy or the sender's).
            unsafe { ptr::copy_nonoverlapping(data.as_ptr(), dst, n) };
        }
        self.complete_target(l, t, Status::received(env, data.len(), cap));
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
                    self.deliver(l, env, msg, t);
                } else {
                    let env = Envelope {
                        source: s,
                        tag: -1,
                        context: pattern.context,
                    };
                    let e = Self::gone_error(l, s).expect("gone");
                    self.complete_target(l, t, Status::failed(env, e));
                }
                return;
            }
        }
        match l.matching.post(pattern, t) {
            Posted::Matched { env, msg, recv } => self.deliver(l, env, msg, recv),
            Posted::Queued(id) => queued(id),
        }
    }
}
