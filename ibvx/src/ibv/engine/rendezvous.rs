//! The receive side of a rendezvous: the grant of a matched `RNDZ_START`
//! (a remote-write registration of exactly the granted range, sent in
//! `RNDZ_REPLY`) and the count of a sender's unfinished starts.

use xdev::target::Target;
use xdev::{Envelope, Error, Rank, Status};

use super::{Control, Engine, Incoming, Local};
use crate::verbs::RemoteAddr;

pub(super) fn registration_error(e: crate::verbs::Error) -> Error {
    Error::ResourceExhausted(format!("memory registration failed: {e}"))
}

impl Engine {
    /// One of `src`'s rendezvous starts is finished on our side.
    pub(super) fn rendezvous_in_ended(l: &mut Local, src: Rank) {
        let p = &mut l.peers[src];
        p.rndv_in = p.rndv_in.saturating_sub(1);
    }

    /// Answers a matched rendezvous start: registers the receive buffer and
    /// sends its address and key (or a zero-length grant).
    pub(super) fn reply(&self, l: &mut Local, env: Envelope, id: u64, len: usize, t: Target) {
        let (dst, cap) = t.dst();
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
