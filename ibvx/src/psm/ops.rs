//! The operations of the psm device: what [`xdev::devkit::Face`] calls, with
//! arguments it has checked.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use xdev::devkit::{CoreRef, RequestKind, Seat, SendTo, Transport};
use xdev::{Buffer, Envelope, Error, Pattern, Peeked, Request, Result, Source, Status};

use super::engine::{lost, PsmEngine, Slot};
use super::setup;

impl Transport for PsmEngine {
    const NAME: &'static str = "psm";

    fn seat(&self) -> Seat<'_> {
        Seat::new(self.rank, self.size, &self.tracker, &self.closing)
    }

    fn blocking_send(self: &Arc<Self>, buf: &[u8], to: SendTo) -> Result<()> {
        let (dest, tag, cx, sync) = to.parts();
        PsmEngine::blocking_send(self, buf, dest, tag, cx, sync)
    }

    fn recv_into(self: &Arc<Self>, buf: &mut [u8], pattern: Pattern) -> Result<Status> {
        self.blocking_recv(buf, pattern)
    }

    fn start_send(self: &Arc<Self>, buf: Buffer, to: SendTo) -> Request {
        let (dest, tag, context, sync) = to.parts();
        let eng = self;
        let env = to.envelope();
        let reject = |buf, e| eng.tracker.completed(buf, Status::failed(env, e));
        let mut l = eng.lock();
        if l.gone[dest] {
            drop(l);
            return reject(buf, lost(dest));
        }
        if eng.sends_eagerly(dest, buf.len(), sync) {
            // Over once `psm2_mq_send2` returns, as the blocking send: born
            // complete, with no PSM2 request to post, test and free.
            let sent = eng.send_eager(&mut l, &buf, (dest, tag, context));
            drop(l);
            return match sent {
                Ok(()) => {
                    let len = buf.len();
                    eng.tracker.completed(buf, Status::ok(env, len))
                }
                Err(e) => reject(buf, e),
            };
        }
        // Any other send (to this rank, synchronous, or a rendezvous) is
        // posted from the buffer before any request core exists, and tested
        // inside the post: one PSM2 completed there (an eager send to this
        // rank, which PSM2's self device copies out in the post) ends there,
        // born complete (no pooled core, no table entry, no engine in
        // the handle). Until a core owns it, the buffer is held in a
        // `ManuallyDrop`: should anything unwind while PSM2 may still read
        // it, it leaks instead of being freed.
        let (at, len) = (buf.as_ptr(), buf.len());
        let mut held = Some(std::mem::ManuallyDrop::new(buf));
        let track = || {
            // The send is still in flight: its buffer moves (by value, its
            // memory unmoved) into a new core, which the table's entry holds
            // from now on; an unwind while it moves aborts. (A send's token
            // stays unset: only receives are cancelled.)
            let (core, handle) = xdev::devkit::abort_on_unwind(
                "moving a buffer PSM2 may still read into its request",
                || {
                    let buf = held.take().map(std::mem::ManuallyDrop::into_inner);
                    let buf = buf.expect("the buffer is held until it moves here");
                    eng.tracker.start_request(RequestKind::Send, buf, eng)
                },
            );
            (Slot::Send { core, env, len }, handle)
        };
        // SAFETY: the buffer's memory stays put and unwritten until the
        // request leaves the queue: it is given back below only when the
        // post's test found the request complete (it never entered the
        // table), and otherwise `track` moves it (its memory unmoved) into
        // the core the table's entry holds; an unwind before that leaks it.
        let posted = unsafe {
            eng.post_send_unless_done(&mut l, (at, len), (dest, tag, context), sync, track)
        };
        drop(l);
        let given_back = || {
            let buf = held.map(std::mem::ManuallyDrop::into_inner);
            buf.expect("a send that did not start keeps its buffer here")
        };
        match posted {
            Ok(Ok(handle)) => handle.into_request(),
            Ok(Err(st)) => {
                let status = PsmEngine::send_status(&st, env, len);
                eng.tracker.completed(given_back(), status)
            }
            // The post failed: PSM2 never had the buffer.
            Err(e) => reject(given_back(), e),
        }
    }

    fn start_recv(self: &Arc<Self>, buf: Buffer, pattern: Pattern) -> Request {
        let eng = self;
        let mut l = eng.lock();
        let source = match pattern.source {
            Source::Rank(s) => Some(s),
            Source::Any => None,
        };
        if let Some(s) = source.filter(|&s| l.gone[s]) {
            drop(l);
            let status = Status::failed(eng.recv_env(&pattern), lost(s));
            return eng.tracker.completed(buf, status);
        }
        // The core owns the buffer before PSM2 sees it, and the table's
        // entry holds the core from the post until PSM2 is done with the
        // memory: no placeholder, no test after the post (a receive whose
        // message is already here completes inside the post, and the
        // request's wait collects it without polling PSM2).
        let (core, handle) = eng.tracker.start_request(RequestKind::Recv, buf, eng);
        let Some(q) = l.queue.as_mut() else {
            drop(l);
            eng.fail_unposted(&core, &pattern, Error::Closed);
            return handle.into_request();
        };
        core.set_token(q.next_key().to_u64());
        let at = (core.buffer_ptr(), core.buffer_len());
        // SAFETY: the buffer is the core's, and the core is the entry's
        // payload: it stays alive, and its buffer out of safe code's reach
        // (a core lends no buffer), until the request leaves the queue.
        let posted = unsafe { eng.post_recv(&mut l, at, &pattern, Slot::Recv { core, source }) };
        drop(l);
        if let Err((e, Slot::Recv { core, .. })) = posted {
            // The post failed: PSM2 never had the buffer.
            eng.fail_unposted(&core, &pattern, e);
        }
        handle.into_request()
    }

    fn probe(&self, pattern: Pattern, block: bool) -> Result<Option<Status>> {
        let eng = self;
        if !block {
            let mut l = eng.lock();
            eng.progress_locked(&mut l);
            return Ok(eng.iprobe_locked(&mut l, &pattern));
        }
        let mut found = None;
        eng.block_until(true, |eng, l| {
            found = eng.iprobe_locked(l, &pattern);
            if found.is_none() {
                if let Source::Rank(s) = pattern.source {
                    if l.gone[s] {
                        return Err(lost(s));
                    }
                }
            }
            Ok(found.is_some())
        })?;
        Ok(found)
    }

    fn peek(&self) -> Result<Option<Peeked>> {
        let eng = self;
        let mut found = None;
        eng.block_until(true, |eng, _| {
            found = eng.tracker.pop_completed();
            Ok(found.is_some() || eng.tracker.outstanding() == 0)
        })?;
        Ok(found.or_else(|| eng.tracker.pop_completed()))
    }

    fn finish(&self) -> Result<()> {
        let eng = self;
        if eng.closing.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        // Our sends first (those to departed peers fail and stay kept).
        let r = eng.block_until(true, |eng, l| {
            eng.check_departures(l);
            Ok(eng.tracker.outstanding_sends() == 0)
        });
        let mut l = eng.lock();
        let mut ended = Vec::new();
        if let Some(mut q) = l.queue.take() {
            // Posted receives PSM2 has not matched go back to it before the
            // close (they end with Closed below, with the rest).
            let recvs: Vec<_> = q
                .iter()
                .filter(|(_, s)| matches!(s, Slot::Recv { .. }))
                .map(|(k, _)| k)
                .collect();
            ended.extend(recvs.into_iter().filter_map(|k| q.cancel(k)));
            // Receives that had matched finish inside the close; what is
            // still outstanding can no longer complete.
            ended.extend(q.close(setup::PSM_TIMEOUT));
        }
        for s in ended {
            if let Slot::Send { core, .. } | Slot::Recv { core, .. } = s {
                let env = Envelope {
                    source: eng.rank,
                    tag: -1,
                    context: 0,
                };
                eng.tracker
                    .complete(&core, Status::failed(env, Error::Closed));
            }
        }
        drop(l);
        r
    }
}

impl PsmEngine {
    /// Fails receive `core`, which was never posted (the queue closed, or
    /// the post failed): its handle gets the buffer back with `e`.
    fn fail_unposted(&self, core: &CoreRef, pattern: &Pattern, e: Error) {
        self.tracker
            .complete(core, Status::failed(self.recv_env(pattern), e));
    }

    /// The envelope of a receive for `pattern` that failed before it
    /// matched: this rank, no tag.
    fn recv_env(&self, pattern: &Pattern) -> Envelope {
        Envelope {
            source: self.rank,
            tag: -1,
            context: pattern.context,
        }
    }
}
