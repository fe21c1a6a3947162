//! Routing: which device reaches a rank, how its rank numbers map to the
//! job's, and relaying a request started on a device below to the request
//! this layer hands out (sends go straight through).

use std::sync::Arc;

use xdev::devkit::{Completion, RequestKind};
use xdev::{Buffer, Context, Device, Envelope, Error, Rank, Request, Result, Status, Tag};

use super::lend::lend_and_wait;
use super::HybridEngine;

/// Which device reaches a rank.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum Route {
    /// Same host: shared memory, under this index in the host group.
    Local(Rank),
    /// Another host: the network device (same rank numbers as the job).
    Remote,
}

/// Rank numbers in a status or error from the local device are indices in
/// the host group; this maps them to job ranks.
#[derive(Clone)]
pub(super) struct RankMap {
    /// Group index to job rank, or `None` for the network device (whose
    /// ranks are the job's).
    pub(super) to_job: Option<Arc<[Rank]>>,
    pub(super) size: usize,
}

impl RankMap {
    pub(super) fn rank(&self, r: Rank) -> Rank {
        match &self.to_job {
            Some(m) => m.get(r).copied().unwrap_or(r),
            None => r,
        }
    }

    pub(super) fn error(&self, e: Error) -> Error {
        if self.to_job.is_none() {
            return e;
        }
        match e {
            Error::Truncated {
                sender,
                tag,
                message_len,
                capacity,
            } => Error::Truncated {
                sender: self.rank(sender),
                tag,
                message_len,
                capacity,
            },
            Error::InvalidRank { rank, .. } => Error::InvalidRank {
                rank: self.rank(rank),
                size: self.size,
            },
            Error::PeerLost { rank, reason } => Error::PeerLost {
                rank: self.rank(rank),
                reason,
            },
            Error::Protocol { rank, what } => Error::Protocol {
                rank: self.rank(rank),
                what,
            },
            other => other,
        }
    }

    pub(super) fn result(&self, r: Result<Status>) -> Result<Status> {
        r.map(|st| self.status(st)).map_err(|e| self.error(e))
    }

    pub(super) fn status(&self, mut st: Status) -> Status {
        if self.to_job.is_some() {
            st.source = self.rank(st.source);
            st.error = st.error.map(|e| Box::new(self.error(*e)));
        }
        st
    }
}

impl HybridEngine {
    /// The device for `route`, and how its ranks map to the job's.
    pub(super) fn device(&self, route: Route) -> (&dyn Device, &RankMap) {
        match (route, &self.remote) {
            (Route::Remote, Some(r)) => (&**r, &self.remote_map),
            _ => (&*self.local, &self.local_map),
        }
    }

    /// The device reaching `rank` and the rank's number there.
    pub(super) fn reach(&self, rank: Rank) -> (&dyn Device, Rank, &RankMap) {
        let route = self.routes[rank];
        let (dev, map) = self.device(route);
        match route {
            Route::Local(i) => (dev, i, map),
            Route::Remote => (dev, rank, map),
        }
    }

    /// The envelope of a receive that fails before it matched (as every
    /// device: this rank, no tag).
    pub(super) fn failed_recv_env(&self, context: Context) -> Envelope {
        Envelope::untagged(self.rank, context)
    }

    pub(super) fn request(self: &Arc<Self>, core: xdev::devkit::CoreRef) -> Request {
        Request::new(core, self.clone())
    }

    /// Starts a request on `dev` with `buf` (by `start`) and relays `outer`
    /// (started without a buffer) to it: its completion completes `outer`
    /// with the buffer (ranks mapped by `map`).
    pub(super) fn relay(
        &self,
        outer: &xdev::devkit::CoreRef,
        buf: Buffer,
        dev: &dyn Device,
        map: &RankMap,
        start: impl FnOnce(&dyn Device, Buffer) -> Request,
    ) {
        let (tracker, done, map) = (self.tracker.clone(), outer.clone(), map.clone());
        // The hook runs on whichever thread completes the request below,
        // possibly under that device's locks: it takes only the tracker's
        // lock, which is never held across a call into a device.
        outer.relay(
            start(dev, buf),
            Box::new(move |c: Completion| {
                tracker.complete_returning(&done, c.buf, map.status(c.status));
            }),
        );
    }

    /// The request for `below`, just started on a device below: born
    /// complete if it already is (a small send that went out, a message
    /// that was already there), else relayed.
    pub(super) fn forward(
        self: &Arc<Self>,
        kind: RequestKind,
        below: Request,
        map: &RankMap,
    ) -> Request {
        match below.take_if_done() {
            Ok(c) => self.tracker.completed(c.buf, map.status(c.status)),
            Err(below) => {
                let core = self.tracker.start_relay(kind);
                let (tracker, done, map) = (self.tracker.clone(), core.clone(), map.clone());
                core.relay(
                    below,
                    Box::new(move |c: Completion| {
                        tracker.complete_returning(&done, c.buf, map.status(c.status));
                    }),
                );
                self.request(core)
            }
        }
    }

    pub(super) fn isend(
        self: &Arc<Self>,
        buf: Buffer,
        dest: Rank,
        tag: Tag,
        context: Context,
        sync: bool,
    ) -> Request {
        let (dev, d, map) = self.reach(dest);
        let below = if sync {
            dev.issend(buf, d, tag, context)
        } else {
            dev.isend(buf, d, tag, context)
        };
        self.forward(RequestKind::Send, below, map)
    }

    /// `send`/`ssend`. With two devices, a send blocked inside one of them
    /// would starve the other, so it runs as a request this layer waits for.
    pub(super) fn blocking_send(
        self: &Arc<Self>,
        buf: &[u8],
        dest: Rank,
        tag: Tag,
        context: Context,
        sync: bool,
    ) -> Result<()> {
        if self.remote.is_none() {
            let (dev, d, map) = self.reach(dest);
            let r = if sync {
                dev.ssend(buf, d, tag, context)
            } else {
                dev.send(buf, d, tag, context)
            };
            return r.map_err(|e| map.error(e));
        }
        // SAFETY: `buf` is borrowed for this call, which waits for the send;
        // a device only reads a send's buffer.
        unsafe {
            lend_and_wait(buf.as_ptr().cast_mut(), buf.len(), |b| {
                self.isend(b, dest, tag, context, sync)
            })
        }
        .map(drop)
    }
}
