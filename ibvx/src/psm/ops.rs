//! The operations of the psm device: what [`xdev::devkit::Face`] calls, with
//! arguments it has checked.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use xdev::devkit::{RequestKind, Seat, SendTo, Transport};
use xdev::{Buffer, Envelope, Error, Pattern, Peeked, Rank, Request, Result, Source, Status};

use super::engine::{lost, Inner, PsmEngine, Slot};
use super::layer::RequestKey;
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
        // Posted from the buffer before any request core exists, then tested
        // once: an eager send PSM2 has already copied out ends here, born
        // complete (no pooled core, no reference count, no engine in the
        // handle). Until a core owns it, the buffer is held in a
        // `ManuallyDrop`: should anything unwind while PSM2 may still read
        // it, it leaks instead of being freed. The table's entry is a
        // placeholder (`Abandoned`) until the core exists.
        let buf = std::mem::ManuallyDrop::new(buf);
        let (at, len) = (buf.as_ptr(), buf.len());
        // SAFETY: the buffer's memory stays put and unwritten until the
        // request leaves the queue: it is given back only once the test
        // below found the request complete (it then left the table), and
        // otherwise moves (by value, its memory unmoved) into the core that
        // the entry holds from then on; an unwind leaks it, or aborts while
        // it moves into the core (`abort_on_unwind`).
        let posted = unsafe {
            eng.post_send(
                &mut l,
                (at, len),
                (dest, tag, context),
                sync,
                Slot::Abandoned,
            )
        };
        let key = match posted {
            Ok(key) => key,
            Err(e) => {
                drop(l);
                // The post failed: PSM2 never had the buffer.
                return reject(std::mem::ManuallyDrop::into_inner(buf), e);
            }
        };
        // (The queue is open: the post just used it, under this lock.)
        if let Some((_, st)) = l.queue.as_mut().and_then(|q| q.test(key)) {
            drop(l);
            let status = PsmEngine::send_status(&st, env, len);
            return eng
                .tracker
                .completed(std::mem::ManuallyDrop::into_inner(buf), status);
        }
        eng.into_request(&mut l, key, RequestKind::Send, buf, Some((env, len)), None)
    }

    fn start_recv(self: &Arc<Self>, buf: Buffer, pattern: Pattern) -> Request {
        let eng = self;
        let env = Envelope {
            source: eng.rank,
            tag: -1,
            context: pattern.context,
        };
        let reject = |buf, e| eng.tracker.completed(buf, Status::failed(env, e));
        let mut l = eng.lock();
        let source = match pattern.source {
            Source::Rank(s) => Some(s),
            Source::Any => None,
        };
        if let Some(s) = source.filter(|&s| l.gone[s]) {
            drop(l);
            return reject(buf, lost(s));
        }
        // As in `start_send`: posted from the buffer, tested once (a message
        // already here is received inside `psm2_mq_irecv2`), and given a
        // core only if it is still in flight.
        let mut buf = std::mem::ManuallyDrop::new(buf);
        let at = (buf.as_mut_ptr(), buf.len());
        // SAFETY: the buffer's memory is not otherwise touched until the
        // request leaves the queue: it is given back only once the test
        // below found the request complete (it then left the table), and
        // otherwise moves (by value, its memory unmoved) into the core that
        // the entry holds from then on; an unwind leaks it, or aborts while
        // it moves into the core (`abort_on_unwind`).
        let key = match unsafe { eng.post_recv(&mut l, at, &pattern, Slot::Abandoned) } {
            Ok(key) => key,
            Err(e) => {
                drop(l);
                return reject(std::mem::ManuallyDrop::into_inner(buf), e);
            }
        };
        let done = l
            .queue
            .as_mut()
            .and_then(|q| q.test(key).map(|(_, st)| (q.peer_of(&st), st)));
        if let Some((peer, st)) = done {
            let status = eng.recv_status(peer, &st, Some(at.1));
            drop(l);
            return eng
                .tracker
                .completed(std::mem::ManuallyDrop::into_inner(buf), status);
        }
        eng.into_request(&mut l, key, RequestKind::Recv, buf, None, source)
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
                .filter(|(_, s)| matches!(s, Slot::Request { send: None, .. }))
                .map(|(k, _)| k)
                .collect();
            ended.extend(recvs.into_iter().filter_map(|k| q.cancel(k)));
            // Receives that had matched finish inside the close; what is
            // still outstanding can no longer complete.
            ended.extend(q.close(setup::PSM_TIMEOUT));
        }
        for s in ended {
            if let Slot::Request { core, .. } = s {
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
    /// The request of an operation still in flight after its post and one
    /// test: `buf`, which PSM2 may still use under `key`, moves into a new
    /// request core, which the table's entry (a placeholder until now)
    /// holds from then on. The caller holds the engine's lock (`l`).
    ///
    /// The device's reference and the handle are made together, with plain
    /// stores (`Tracker::start_request`): a clone and `Request::new` would
    /// be two locked instructions per request in flight. The key is the
    /// core's token (for `cancel`).
    fn into_request(
        self: &Arc<Self>,
        l: &mut Inner,
        key: RequestKey,
        kind: RequestKind,
        buf: std::mem::ManuallyDrop<Buffer>,
        send: Option<(Envelope, usize)>,
        source: Option<Rank>,
    ) -> Request {
        let (core, handle) = xdev::devkit::abort_on_unwind(
            "moving a buffer PSM2 may still use into its request",
            || {
                self.tracker.start_request(
                    kind,
                    std::mem::ManuallyDrop::into_inner(buf),
                    self.clone(),
                )
            },
        );
        core.set_token(key.to_u64());
        if let Some(slot) = l.queue.as_mut().and_then(|q| q.get_mut(key)) {
            *slot = Slot::Request { core, send, source };
        }
        handle.into_request()
    }
}
