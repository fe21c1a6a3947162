//! The operations of the hybrid device: what [`xdev::devkit::Face`] calls, with
//! arguments it has checked.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use xdev::devkit::{Face, Seat, SendTo, Transport};
use xdev::{Buffer, Context, Error, Pattern, Peeked, Request, Result, Source, Status};

use super::held::HeldRecv;
use super::lend::lend_and_wait;
use super::route::Route;
use super::{lock, HybridDevice, HybridEngine};

impl Face for HybridDevice {
    type Engine = HybridEngine;
    fn engine(&self) -> &Arc<HybridEngine> {
        &self.inner
    }
}

impl Transport for HybridEngine {
    const NAME: &'static str = "hybrid";

    fn seat(&self) -> Seat<'_> {
        Seat::new(self.rank, self.size, &self.tracker, &self.closed)
    }

    fn blocking_send(self: &Arc<Self>, buf: &[u8], to: SendTo) -> Result<()> {
        let (dest, tag, cx, sync) = to.parts();
        HybridEngine::blocking_send(self, buf, dest, tag, cx, sync)
    }

    fn start_send(self: &Arc<Self>, buf: Buffer, to: SendTo) -> Request {
        let (dest, tag, cx, sync) = to.parts();
        self.isend(buf, dest, tag, cx, sync)
    }

    fn recv_into(self: &Arc<Self>, buf: &mut [u8], pattern: Pattern) -> Result<Status> {
        let Pattern {
            source,
            tag,
            context,
        } = pattern;
        if self.remote.is_none() {
            // One host: no receive is ever held; the device's own blocking path.
            let src = match source {
                Source::Rank(s) => Source::Rank(self.reach(s).1),
                Source::Any => Source::Any,
            };
            return self
                .local_map
                .result(self.local.recv(buf, src, tag, context));
        }
        // SAFETY: `buf` is exclusively borrowed for this call, which waits
        // for the receive.
        unsafe {
            lend_and_wait(buf.as_mut_ptr(), buf.len(), |b| {
                self.irecv(b, source, tag, context)
            })
        }
    }

    fn start_recv(self: &Arc<Self>, buf: Buffer, pattern: Pattern) -> Request {
        self.irecv(buf, pattern.source, pattern.tag, pattern.context)
    }

    fn probe(&self, pattern: Pattern, block: bool) -> Result<Option<Status>> {
        if !block {
            return self.iprobe(pattern);
        }
        let Pattern {
            source,
            tag,
            context,
        } = pattern;
        match (source, &self.remote) {
            (Source::Rank(s), _) => {
                let (dev, r, map) = self.reach(s);
                map.result(dev.probe(Source::Rank(r), tag, context))
            }
            (Source::Any, None) => {
                self.local_map
                    .result(self.local.probe(Source::Any, tag, context))
            }
            (Source::Any, Some(_)) => self.poll_until(|_| self.iprobe(pattern).transpose()),
        }
        .map(Some)
    }

    fn peek(&self) -> Result<Option<Peeked>> {
        Ok(self.poll_until(|h| match h.tracker.pop_completed() {
            Some(p) => Some(Some(p)),
            None if h.tracker.outstanding() == 0 => Some(None),
            None => None,
        }))
    }

    fn finish(&self) -> Result<()> {
        if self.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let local = self.local.finish();
        let remote = self.remote.as_ref().map_or(Ok(()), |r| r.finish());
        // Receives still held end like those the devices had: closed.
        let held: Vec<(Context, HeldRecv)> = {
            let mut held = lock(&self.held);
            held.queues
                .drain()
                .flat_map(|(c, q)| q.into_iter().map(move |r| (c, r)))
                .collect()
        };
        for (context, r) in held {
            let env = self.failed_recv_env(context);
            self.tracker
                .complete_returning(&r.core, r.buf, Status::failed(env, Error::Closed));
        }
        local.map_err(|e| self.local_map.error(e))?;
        remote
    }
}

impl HybridEngine {
    /// `iprobe`: every device that may hold a match, once, without blocking.
    fn iprobe(&self, pattern: Pattern) -> Result<Option<Status>> {
        let Pattern {
            source,
            tag,
            context,
        } = pattern;
        self.advance_all();
        let both = [Route::Local(0), Route::Remote];
        let routes: &[Route] = match source {
            Source::Rank(s) => std::slice::from_ref(&self.routes[s]),
            Source::Any if self.remote.is_some() => &both,
            Source::Any => &both[..1],
        };
        for &route in routes {
            let (dev, map) = self.device(route);
            let src = match (source, route) {
                (Source::Rank(_), Route::Local(i)) => Source::Rank(i),
                _ => source,
            };
            if let Some(st) = dev.iprobe(src, tag, context).map_err(|e| map.error(e))? {
                return Ok(Some(map.status(st)));
            }
        }
        Ok(None)
    }
}
