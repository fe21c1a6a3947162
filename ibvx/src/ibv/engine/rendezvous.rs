//! Rendezvous: a sender's `RNDZ_START` taken in, the grant of a matched one
//! (a remote-write registration of exactly the granted range, sent in
//! `RNDZ_REPLY`), the `RNDZ_REPLY` taken in by the sender (its buffer
//! registered, the write and `RNDZ_END` queued), the `RNDZ_END` that ends the
//! receive, and the count of a sender's unfinished starts.

use xdev::{Envelope, Error, Rank, Status};

use super::{rndv_window, Control, Dest, IbvEngine, Incoming, Local, Stage, Unexpected};
use crate::ibv::wire::{Header, FLAG_FAILED};
use crate::verbs::RemoteAddr;

fn registration_error(e: crate::verbs::Error) -> Error {
    Error::ResourceExhausted(format!("memory registration failed: {e}"))
}

impl IbvEngine {
    /// `RNDZ_START`: a sender's rendezvous, answered at once if a posted
    /// receive matches, else held unexpected (within the rendezvous window).
    pub(super) fn on_rndz_start(
        &self,
        l: &mut Local,
        env: Envelope,
        head: &Header,
        len: u64,
    ) -> std::result::Result<(), String> {
        let src = env.source;
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
        if let Some(t) = Self::take_posted(l, &env) {
            self.reply(l, env, head.id, len, t);
        } else {
            l.matching
                .push_unexpected(env, Unexpected::Start { id: head.id, len });
        }
        Ok(())
    }

    /// `RNDZ_REPLY` to one of our sends: registers its buffer and queues the
    /// RDMA write to `dst` and the `RNDZ_END` (or ends the send when the
    /// grant is empty or failed).
    pub(super) fn on_rndz_reply(
        &self,
        l: &mut Local,
        src: Rank,
        head: &Header,
        rid: u64,
        len: u64,
        dst: RemoteAddr,
    ) -> std::result::Result<(), String> {
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
            let reg = match s.user {
                // SAFETY: the send owns user buffer `id` (its request holds
                // it until the send is removed, which drops this
                // registration first), and `data`/`len` are its whole
                // memory (a send sends its whole buffer).
                Some(id) => unsafe { self.fab.cache.register_user(id, s.data.cast_mut(), s.len) },
                // SAFETY: the send's buffer stays alive and unmoved until
                // the send is removed, which drops this registration first.
                None => unsafe { self.fab.cache.register(s.data.cast_mut(), len) },
            };
            match reg {
                Ok(reg) => {
                    s.reg = Some(reg);
                    s.stage = Stage::Writing { posted: false };
                    self.push_control(l, src, Control::WriteEnd { id, rid, dst, len });
                }
                Err(e) => {
                    self.complete_send(l, id, Err(registration_error(e)));
                    self.push_control(l, src, Control::EndFailed { rid });
                }
            }
        }
        Ok(())
    }

    /// `RNDZ_END`: the sender's data is in our receive (or failed); the
    /// receive completes and its grant is dropped.
    pub(super) fn on_rndz_end(
        &self,
        l: &mut Local,
        src: Rank,
        head: &Header,
    ) -> std::result::Result<(), String> {
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
        Ok(())
    }

    /// One of `src`'s rendezvous starts is finished on our side.
    pub(super) fn rendezvous_in_ended(l: &mut Local, src: Rank) {
        let p = &mut l.peers[src];
        p.rndv_in = p.rndv_in.saturating_sub(1);
    }

    /// Answers a matched rendezvous start: registers the receive buffer and
    /// sends its address and key (or a zero-length grant).
    pub(super) fn reply(&self, l: &mut Local, env: Envelope, id: u64, len: usize, t: Dest) {
        let (dst, cap) = t.dst(l);
        let grant = len.min(cap);
        let src = env.source;
        let none = RemoteAddr::default();
        if grant == 0 {
            let c = Control::Reply {
                id,
                rid: 0,
                dst: none,
                len: 0,
                failed: false,
            };
            self.push_control(l, src, c);
            Self::rendezvous_in_ended(l, src);
            self.complete_target(l, t, Status::received(env, len, cap));
            return;
        }
        // A registration of exactly the granted range, for this receive
        // only: dropped with the `Incoming` entry (at RNDZ_END, or when the
        // receive fails or the peer goes), which deregisters it, so the
        // rkey the peer got writes nothing afterwards (the cache's own
        // chunks grant no remote access at all).
        // SAFETY: the receive's buffer stays alive and in place until the
        // `Incoming` entry (which holds the registration) is removed: it is
        // owned by the request held in the entry, or borrowed by a blocking
        // call that removes the entry before it returns.
        match unsafe { self.fab.cache.grant_remote_write(dst, grant) } {
            Ok(reg) => {
                let rid = l.next_id;
                l.next_id += 1;
                let remote = reg.remote(dst);
                #[cfg(test)]
                {
                    l.last_grant = Some(remote);
                }
                l.incoming.insert(
                    rid,
                    Incoming {
                        src,
                        env,
                        len,
                        cap,
                        target: t,
                        _reg: reg,
                    },
                );
                let c = Control::Reply {
                    id,
                    rid,
                    dst: remote,
                    len: grant as u64,
                    failed: false,
                };
                self.push_control(l, src, c);
            }
            Err(e) => {
                let c = Control::Reply {
                    id,
                    rid: 0,
                    dst: none,
                    len: 0,
                    failed: true,
                };
                self.push_control(l, src, c);
                Self::rendezvous_in_ended(l, src);
                self.complete_target(l, t, Status::failed(env, registration_error(e)));
            }
        }
    }
}
