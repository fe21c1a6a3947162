//! The operations of the psm device: what [`xdev::devkit::Face`] calls, with
//! arguments it has checked.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use xdev::devkit::{RequestKind, Seat, SendTo, Transport};
use xdev::{Buffer, Envelope, Pattern, Peeked, Request, Result, Source, Status};

use super::engine::{lost, PsmEngine, Slot};
use super::lend::LentState;
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
        // Lent out (see `lend.rs`): the handle owns the buffer, the queue's
        // table holds the receive until the handle ends the lease.
        let req = eng.lend_recv(&mut l, buf, &pattern);
        drop(l);
        req
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
        eng.block_until(true, |eng, l| {
            found = eng.peek_lent(l).or_else(|| eng.tracker.pop_completed());
            Ok(found.is_some() || (eng.tracker.outstanding() == 0 && !eng.lent_outstanding(l)))
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
        eng.close_queue(false);
        r
    }
}

impl PsmEngine {
    /// Closes the queue (`finish`, or the device's drop with `forced`):
    /// a graceful close first takes back the receives PSM2 has not matched
    /// and lets the others finish, a forced one lets go of everything at
    /// once; what is still outstanding after the close can no longer
    /// complete, and its held requests end with `Closed` (lent ones find
    /// the queue closed).
    pub(super) fn close_queue(&self, forced: bool) {
        let mut l = self.lock();
        let Some(mut q) = l.queue.take() else {
            return;
        };
        // A forced close lets go of every buffer at once; a graceful one
        // first cancels the receives that have not matched (they would
        // never finish), and lets those that had matched finish.
        let stopped = if forced {
            q.close_now().0
        } else {
            let lent: Vec<_> = q
                .lent_iter()
                .filter(|(_, s)| s.state != LentState::Dropped)
                .map(|(k, _)| k)
                .collect();
            for k in lent {
                q.cancel_lent(k);
            }
            q.close(setup::PSM_TIMEOUT).0
        };
        for s in stopped {
            if let Slot::Send { core, .. } = s {
                self.tracker.complete(&core, self.closed());
            }
        }
        // PSM2 let go of every request: a held lent receive ends here, a
        // dropped one's buffer is freed, and one lent out ends when its
        // handle finds the queue closed.
        for (_, core) in l.held.drain() {
            self.tracker.complete(&core, self.closed());
        }
        l.dropped.clear();
    }

    /// The envelope of a receive for `pattern` that failed before it
    /// matched: this rank, no tag.
    pub(super) fn recv_env(&self, pattern: &Pattern) -> Envelope {
        Envelope::untagged(self.rank, pattern.context)
    }
}
