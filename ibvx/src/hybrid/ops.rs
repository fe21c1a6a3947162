//! The xdev face of the hybrid device.

use std::sync::atomic::Ordering;

use xdev::{
    check_recv, Buffer, Context, Device, Error, Peeked, Rank, Request, Result, Source, Status, Tag,
    TagSel,
};

use super::held::HeldRecv;
use super::lend::lend_and_wait;
use super::route::Route;
use super::{lock, HybridDevice};

impl Device for HybridDevice {
    fn name(&self) -> &'static str {
        "hybrid"
    }

    fn id(&self) -> Rank {
        self.inner.rank
    }

    fn size(&self) -> usize {
        self.inner.size
    }

    fn send(&self, buf: &[u8], dest: Rank, tag: Tag, context: Context) -> Result<()> {
        self.inner.blocking_send(buf, dest, tag, context, false)
    }

    fn ssend(&self, buf: &[u8], dest: Rank, tag: Tag, context: Context) -> Result<()> {
        self.inner.blocking_send(buf, dest, tag, context, true)
    }

    fn recv(
        &self,
        buf: &mut [u8],
        source: Source,
        tag: TagSel,
        context: Context,
    ) -> Result<Status> {
        let h = &self.inner;
        check_recv(source, tag, h.size)?;
        h.check_open()?;
        if h.remote.is_none() {
            // One host: no receive is ever held; the device's own blocking path.
            let src = match source {
                Source::Rank(s) => Source::Rank(h.reach(s).1),
                Source::Any => Source::Any,
            };
            return h.local_map.result(h.local.recv(buf, src, tag, context));
        }
        // SAFETY: `buf` is exclusively borrowed for this call, which waits
        // for the receive.
        unsafe {
            lend_and_wait(buf.as_mut_ptr(), buf.len(), |b| {
                h.irecv(b, source, tag, context)
            })
        }
    }

    fn isend(&self, buf: Buffer, dest: Rank, tag: Tag, context: Context) -> Request {
        self.inner.isend(buf, dest, tag, context, false)
    }

    fn issend(&self, buf: Buffer, dest: Rank, tag: Tag, context: Context) -> Request {
        self.inner.isend(buf, dest, tag, context, true)
    }

    fn irecv(&self, buf: Buffer, source: Source, tag: TagSel, context: Context) -> Request {
        self.inner.irecv(buf, source, tag, context)
    }

    fn probe(&self, source: Source, tag: TagSel, context: Context) -> Result<Status> {
        let h = &self.inner;
        check_recv(source, tag, h.size)?;
        h.check_open()?;
        match (source, &h.remote) {
            (Source::Rank(s), _) => {
                let (dev, r, map) = h.reach(s);
                map.result(dev.probe(Source::Rank(r), tag, context))
            }
            (Source::Any, None) => h.local_map.result(h.local.probe(Source::Any, tag, context)),
            (Source::Any, Some(_)) => {
                h.poll_until(|_| self.iprobe(source, tag, context).transpose())
            }
        }
    }

    fn iprobe(&self, source: Source, tag: TagSel, context: Context) -> Result<Option<Status>> {
        let h = &self.inner;
        check_recv(source, tag, h.size)?;
        h.check_open()?;
        h.advance_all();
        let both = [Route::Local(0), Route::Remote];
        let routes: &[Route] = match source {
            Source::Rank(s) => std::slice::from_ref(&h.routes[s]),
            Source::Any if h.remote.is_some() => &both,
            Source::Any => &both[..1],
        };
        for &route in routes {
            let (dev, map) = h.device(route);
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

    fn peek(&self) -> Result<Option<Peeked>> {
        let h = &self.inner;
        Ok(h.poll_until(|h| match h.tracker.pop_completed() {
            Some(p) => Some(Some(p)),
            None if h.tracker.outstanding() == 0 => Some(None),
            None => None,
        }))
    }

    fn progress(&self) {
        self.inner.poll();
    }

    fn finish(&self) -> Result<()> {
        let h = &self.inner;
        if h.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let local = h.local.finish();
        let remote = h.remote.as_ref().map_or(Ok(()), |r| r.finish());
        // Receives still held end like those the devices had: closed.
        let held: Vec<(Context, HeldRecv)> = {
            let mut held = lock(&h.held);
            held.queues
                .drain()
                .flat_map(|(c, q)| q.into_iter().map(move |r| (c, r)))
                .collect()
        };
        for (context, r) in held {
            let env = h.failed_recv_env(context);
            h.tracker
                .complete_returning(&r.core, r.buf, Status::failed(env, Error::Closed));
        }
        local.map_err(|e| h.local_map.error(e))?;
        remote
    }
}
