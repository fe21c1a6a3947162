//! The operations the device calls: blocking and nonblocking sends and
//! receives, probes, `peek` and `finish`, and the guards that keep a
//! blocking call's buffer out of the engine once the call ends.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use xdev::devkit::matching::PostedId;
use xdev::devkit::target::{BlockingRecv, BlockingSend, SendOwner, Target};
use xdev::devkit::{RequestKind, Seat, SendTo, Transport};
use xdev::{Buffer, Envelope, Error, Pattern, Peeked, Request, Result, Source, Status};

#[cfg(test)]
use super::PANIC_AFTER_PUBLISH;
use super::{Dest, IbvEngine, Local, Outgoing};

impl Transport for IbvEngine {
    const NAME: &'static str = "ibv";

    fn seat(&self) -> Seat<'_> {
        Seat::new(self.fab.rank, self.fab.size, &self.tracker, &self.closing)
    }

    fn blocking_send(self: &Arc<Self>, buf: &[u8], to: SendTo) -> Result<()> {
        // Made before the send is published: on any exit, an unwind
        // included, it waits until the NIC and the peer are done with `buf`.
        let settle = SettleSend {
            engine: self,
            waiter: Default::default(),
        };
        let mut l = self.lock();
        if self.closing.load(Ordering::Acquire) {
            // `finish` may be past its wait for our sends.
            return Err(Error::Closed);
        }
        let out = Outgoing {
            to,
            data: buf,
            user: None,
        };
        let started = self.start(&mut l, out, || {
            let w = BlockingSend::new();
            *settle.waiter.borrow_mut() = Some(w.clone());
            SendOwner::Blocking(w)
        })?;
        if !started {
            return Ok(());
        }
        drop(l);
        let w = settle
            .waiter
            .borrow()
            .clone()
            .expect("a send in the engine has its waiter");
        #[cfg(test)]
        if PANIC_AFTER_PUBLISH.with(|p| p.replace(false)) {
            panic!("injected: unwinding out of a published blocking send");
        }
        // The NIC or the peer may read `buf` until the send is out of the
        // engine: this wait ignores our own closing (finish waits for it).
        let _ = self.block_until(false, |_, _| Ok(w.is_done()));
        w.outcome()
    }

    fn start_send(self: &Arc<Self>, mut buf: Buffer, to: SendTo) -> Request {
        let env = to.envelope();
        // A buffer that may go by rendezvous stays registered between sends
        // while it lives (its token ends the entry when it is released).
        let user = (buf.len() > self.fab.opts.eager_limit && self.fab.cache.adopt(&mut buf))
            .then(|| buf.id());
        // The device's reference and the handle at once, with plain stores
        // (`Request::new` would be a locked compare-exchange per request).
        let (core, handle) = self.tracker.start_request(RequestKind::Send, buf, self);
        // SAFETY: the request owns the buffer; it is neither moved nor freed
        // while the core lives, and the engine keeps the core while it
        // holds the pointer.
        let data = unsafe { std::slice::from_raw_parts(core.buffer_ptr(), core.buffer_len()) };
        let mut l = self.lock();
        if self.closing.load(Ordering::Acquire) {
            // `finish` began after our first check (it sets `closing`
            // before it waits and empties the queues under this lock).
            drop(l);
            self.tracker
                .complete(&core, Status::failed(env, Error::Closed));
            return handle.into_request();
        }
        let out = Outgoing { to, data, user };
        match self.start(&mut l, out, || SendOwner::Request(core.clone())) {
            Ok(true) => {}
            Ok(false) => {
                self.tracker.complete(&core, Status::ok(env, data.len()));
            }
            Err(e) => {
                self.tracker.complete(&core, Status::failed(env, e));
            }
        }
        drop(l);
        handle.into_request()
    }

    fn start_recv(self: &Arc<Self>, buf: Buffer, pattern: Pattern) -> Request {
        let env = Envelope::untagged(self.fab.rank, pattern.context);
        let (core, handle) = self.tracker.start_request(RequestKind::Recv, buf, self);
        let mut l = self.lock();
        if self.closing.load(Ordering::Acquire) {
            // `finish` began after our first check: it empties the posted
            // queue under this lock, so nothing posted now would complete.
            drop(l);
            self.tracker
                .complete(&core, Status::failed(env, Error::Closed));
            return handle.into_request();
        }
        self.post(&mut l, pattern, Target::Request(core.clone()), |id| {
            core.set_token(id.as_u64())
        });
        drop(l);
        handle.into_request()
    }

    fn recv_into(self: &Arc<Self>, buf: &mut [u8], pattern: Pattern) -> Result<Status> {
        // Made before the lock is taken (it locks on an unwind, after the
        // lock's own guard is gone): the first slot is taken back from the
        // engine on any exit once it is ours.
        let mut first = FirstGuard {
            engine: self,
            ours: false,
        };
        let mut l = self.lock();
        if self.closing.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        first.ours = self.post_first(&mut l, pattern, buf.as_mut_ptr(), buf.len());
        if first.ours {
            let done =
                |_: &Self, l: &mut Local| Ok(l.first.as_ref().is_some_and(|f| f.status.is_some()));
            let (mut l, r) = self.wait_locked(l, true, done);
            return match first.take_back(&mut l) {
                Some(st) => st.into_result(),
                None => r.and(Err(Error::Closed)),
            };
        }
        drop(l);
        // Another receive is posted: this one queues behind it, with its
        // completion state shared with the engine.
        let b = BlockingRecv::new(buf);
        // Made before the receive is posted: on any exit, an unwind
        // included, it takes the receive back out of the engine (and stops
        // a peer writing into `buf`).
        let mut guard = Unpost {
            engine: self,
            recv: &b,
            id: None,
        };
        {
            let mut l = self.lock();
            if self.closing.load(Ordering::Acquire) {
                return Err(Error::Closed);
            }
            self.post(&mut l, pattern, Target::Blocking(b.clone()), |p| {
                guard.id = Some(p)
            });
        }
        let r = if b.is_done() {
            Ok(())
        } else {
            self.block_until(true, |_, _| Ok(b.is_done()))
        };
        drop(guard);
        if b.is_done() {
            return b.outcome();
        }
        r?;
        Err(Error::Closed)
    }

    fn probe(&self, pattern: Pattern, block: bool) -> Result<Option<Status>> {
        let mut found = None;
        let mut look = |_: &Self, l: &mut Local| -> Result<bool> {
            found = l
                .matching
                .probe(&pattern)
                .map(|(env, u)| Status::ok(env, u.len()));
            if found.is_none() {
                if let Source::Rank(s) = pattern.source {
                    if let Some(e) = Self::gone_error(l, s) {
                        return Err(e);
                    }
                }
            }
            Ok(found.is_some() || !block)
        };
        if block {
            self.block_until(true, &mut look)?;
        } else {
            let mut l = self.lock();
            self.progress_locked(&mut l);
            self.check_departures(&mut l, false);
            look(self, &mut l)?;
        }
        Ok(found)
    }

    fn peek(&self) -> Result<Option<Peeked>> {
        let mut found = None;
        self.block_until(true, |eng, _| {
            found = eng.tracker.pop_completed();
            Ok(found.is_some() || eng.tracker.outstanding() == 0)
        })?;
        Ok(found.or_else(|| self.tracker.pop_completed()))
    }

    fn finish(&self) -> Result<()> {
        if self.closing.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        // Our sends, our replies and the rendezvous receives peers are
        // writing must be through before we stop.
        let r = self.block_until(false, |eng, l| {
            Ok(eng.tracker.outstanding_sends() == 0
                && l.sends.is_empty()
                && l.peers
                    .iter()
                    .all(|p| p.control.is_empty() && p.backlog.is_empty())
                && l.incoming.is_empty())
        });
        let mut l = self.lock();
        let env = Envelope::untagged(self.fab.rank, 0);
        self.fail_first_if(&mut l, |_| true, Status::failed(env, Error::Closed));
        let posted = l.matching.remove_posted_where(|_, _| true);
        for t in posted {
            self.complete_target(&mut l, Dest::Recv(t), Status::failed(env, Error::Closed));
        }
        l.matching.drain_unexpected();
        self.closed.store(true, Ordering::Release);
        self.notify(&l);
        r
    }

    fn alloc_buffer(&self, len: usize) -> Result<Buffer> {
        self.fab
            .cache
            .buffer(len)
            .map_err(|e| Error::ResourceExhausted(format!("registered buffer of {len} bytes: {e}")))
    }
}

/// Settles a blocking send on every exit, an unwind included: once the send
/// is published the NIC may read the caller's buffer (an eager send from
/// it, an RDMA write) until its completion, so a call that unwinds waits
/// for that here.
struct SettleSend<'e> {
    engine: &'e IbvEngine,
    waiter: std::cell::RefCell<Option<Arc<BlockingSend>>>,
}

impl Drop for SettleSend<'_> {
    fn drop(&mut self) {
        if let Some(w) = self.waiter.get_mut().take() {
            if !w.is_done() {
                let _ = self.engine.block_until(false, |_, _| Ok(w.is_done()));
            }
        }
    }
}

/// Takes a blocking receive out of the engine when its call ends, even by
/// unwinding, so that the engine never keeps a pointer into a buffer whose
/// borrow ended.
struct Unpost<'e> {
    engine: &'e IbvEngine,
    recv: &'e Arc<BlockingRecv>,
    id: Option<PostedId>,
}

impl Drop for Unpost<'_> {
    fn drop(&mut self) {
        if self.recv.is_done() {
            return;
        }
        let eng = self.engine;
        let mut l = eng.lock();
        if let Some(id) = self.id {
            l.matching.cancel(id);
        }
        // A peer granted our buffer must stop writing it before we return.
        eng.stop_writer_into(&mut l, |d| matches!(d, Dest::Recv(t) if t.is(self.recv)));
    }
}

/// The first slot's receive belongs to its blocking call (`ours`) until the
/// call takes it back, on every exit, an unwind included: a peer granted
/// the buffer is stopped first, so nothing writes the buffer after the
/// call returns.
struct FirstGuard<'e> {
    engine: &'e IbvEngine,
    ours: bool,
}

impl FirstGuard<'_> {
    /// Takes the slot back (under the engine lock `l`): its outcome, if it
    /// completed. A receive still posted is simply removed; one a peer is
    /// writing into by rendezvous fails that peer, which stops it.
    fn take_back(&mut self, l: &mut Local) -> Option<Status> {
        if !std::mem::take(&mut self.ours) {
            return None;
        }
        if l.first
            .as_ref()
            .is_some_and(|f| f.matched && f.status.is_none())
        {
            self.engine
                .stop_writer_into(l, |d| matches!(d, Dest::First));
        }
        l.first.take().and_then(|f| f.status)
    }
}

impl Drop for FirstGuard<'_> {
    fn drop(&mut self) {
        if self.ours {
            let eng = self.engine;
            let mut l = eng.lock();
            self.take_back(&mut l);
        }
    }
}
