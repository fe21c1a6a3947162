//! The blocking calls (`send`, `ssend`, `recv`): the caller's memory is
//! PSM2's until the request completes, and the [`Settle`] guard makes sure of
//! it on every exit, an unwind included.

use std::cell::Cell;

use xdev::{Context, Error, Pattern, Rank, Result, Source, Status, Tag};

use super::engine::{lost, PsmEngine, Slot};
use super::layer::RequestKey;

/// Settles a blocking call's PSM2 request when the call ends before its
/// own wait did (an unwind): a receive is cancelled, and either way the
/// request is waited for, since PSM2 reads a send's buffer and writes a
/// receive's until it completes. A send to a peer that left is handed to
/// the queue as abandoned, as the call's own wait does.
///
/// (The device's unwind guard; `Settle` in every device.)
struct Settle<'e> {
    engine: &'e PsmEngine,
    key: RequestKey,
    recv: bool,
    dest: Option<Rank>,
    settled: Cell<bool>,
}

impl Drop for Settle<'_> {
    fn drop(&mut self) {
        if self.settled.get() {
            return;
        }
        let (key, dest) = (self.key, self.dest);
        if self.recv && self.engine.cancel_blocking(key) {
            return; // cancelled: PSM2 let go of the memory
        }
        let _ = self.engine.block_until(false, |eng, l| {
            if l.queue.is_none() {
                return Ok(true); // closed: PSM2 let go
            }
            if eng.take_completion(l, key).is_some() {
                return Ok(true);
            }
            if let Some(d) = dest {
                if l.gone[d] {
                    abandon(l, key);
                    return Ok(true);
                }
            }
            Ok(false)
        });
    }
}

/// Leaves blocking request `key` to the queue: its completion is dropped.
fn abandon(l: &mut super::engine::Inner, key: RequestKey) {
    if let Some(s) = l.queue.as_mut().and_then(|q| q.get_mut(key)) {
        *s = Slot::Abandoned;
    }
}

impl PsmEngine {
    /// Cancels blocking receive `key` if PSM2 has not matched it: true if
    /// it is gone (or the queue closed).
    fn cancel_blocking(&self, key: RequestKey) -> bool {
        let mut l = self.lock();
        match l.queue.as_mut() {
            Some(q) => q.cancel(key).is_some(),
            None => true,
        }
    }

    pub(super) fn blocking_send(
        &self,
        data: &[u8],
        dest: Rank,
        t: Tag,
        ctx: Context,
        sync: bool,
    ) -> Result<()> {
        let Some(key) = self.post_blocking_send(data, (dest, t, ctx), sync)? else {
            return Ok(()); // done already
        };
        // From here PSM2 may read `data` until the request completes: on any
        // exit, an unwind included, the guard settles it first.
        let settle = Settle {
            engine: self,
            key,
            recv: false,
            dest: Some(dest),
            settled: Cell::new(false),
        };
        #[cfg(test)]
        if super::tests::PANIC_AFTER_PUBLISH.with(|p| p.replace(false)) {
            panic!("injected: unwinding out of a published blocking send");
        }
        let mut result = Ok(());
        let waited = self.block_until(false, |eng, l| {
            if l.queue.is_none() {
                return Err(Error::Closed); // closed under us: PSM2 let go
            }
            if let Some(st) = eng.take_completion(l, key) {
                if !st.is_ok() {
                    result = Err(st.error("send"));
                }
                return Ok(true);
            }
            if l.gone[dest] {
                // PSM2 cannot cancel a send. A departed peer no longer reads
                // it; PSM2 keeps the pointer, but a send's buffer is only
                // ever read, and only on the peer's behalf.
                abandon(l, key);
                return Err(lost(dest));
            }
            Ok(false)
        });
        // Every end of that wait settled the request (completed, left to
        // the queue as abandoned, or let go by a closed endpoint).
        settle.settled.set(true);
        waited?;
        result
    }

    /// Starts blocking send `data` to `dest`: the request the call must
    /// wait for, or `None` if the send is done already (an eager send, or
    /// a send to this rank from a copy).
    fn post_blocking_send(
        &self,
        data: &[u8],
        (dest, t, ctx): (Rank, Tag, Context),
        sync: bool,
    ) -> Result<Option<RequestKey>> {
        let mut l = self.lock();
        if l.queue.is_none() {
            return Err(Error::Closed);
        }
        if l.gone[dest] {
            return Err(lost(dest));
        }
        if dest == self.rank && !sync {
            let copy: Box<[u8]> = data.into();
            let at = (copy.as_ptr(), copy.len());
            let slot = Slot::SelfCopy(copy);
            // SAFETY: the copy is the request's payload: it lives on the
            // heap (moving the box does not move it) until the request
            // leaves the queue, and nothing writes it.
            unsafe { self.post_send(&mut l, at, (dest, t, ctx), false, slot) }?;
            return Ok(None);
        }
        if self.sends_eagerly(dest, data.len(), sync) {
            // Below PSM2's rendezvous threshold a send completes locally
            // at once: psm2_mq_send2 returns when `data` may be reused,
            // with no request to track.
            return self.send_eager(&mut l, data, (dest, t, ctx)).map(|_| None);
        }
        let at = (data.as_ptr(), data.len());
        // SAFETY: `data` is borrowed for the whole blocking call (our only
        // caller), which returns only once the request left the queue, or
        // was left to it as abandoned (its peer is gone: a send's buffer is
        // only ever read, and only on the peer's behalf); on an unwind
        // `Settle` does the same first.
        unsafe { self.post_send(&mut l, at, (dest, t, ctx), sync, Slot::Blocking) }.map(Some)
    }

    pub(super) fn blocking_recv(&self, buf: &mut [u8], p: Pattern) -> Result<Status> {
        let cap = buf.len();
        let key = {
            let mut l = self.lock();
            if let Source::Rank(s) = p.source {
                if l.gone[s] {
                    return Err(lost(s));
                }
            }
            // SAFETY: `buf` is borrowed mutably for this call, which returns
            // only once the request completed or was cancelled (or the
            // endpoint closed); on an unwind `Settle` does the same first.
            unsafe { self.post_recv(&mut l, (buf.as_mut_ptr(), cap), &p, Slot::Blocking) }
                .map_err(|(e, _)| e)?
        };
        // From here PSM2 may write `buf` until the request completes or is
        // cancelled: on any exit, an unwind included, the guard settles it.
        let settle = Settle {
            engine: self,
            key,
            recv: true,
            dest: None,
            settled: Cell::new(false),
        };
        #[cfg(test)]
        if super::tests::PANIC_AFTER_PUBLISH.with(|p| p.replace(false)) {
            panic!("injected: unwinding out of a posted blocking receive");
        }
        let mut status = None;
        let waited = self.block_until(false, |eng, l| {
            if l.queue.is_none() {
                return Err(Error::Closed); // closed under us: PSM2 let go
            }
            if let Some(st) = eng.take_completion(l, key) {
                let source = l.queue.as_ref().and_then(|q| q.peer_of(&st));
                status = Some(eng.recv_status(source, &st, Some(cap)));
                return Ok(true);
            }
            if let Source::Rank(s) = p.source {
                if l.gone[s] && l.queue.as_mut().and_then(|q| q.cancel(key)).is_some() {
                    return Err(lost(s));
                }
            }
            Ok(false)
        });
        settle.settled.set(true);
        waited?;
        status.expect("set when done").into_result()
    }
}
