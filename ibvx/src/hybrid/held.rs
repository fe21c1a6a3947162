//! Receives: held receives from any source, bound to a probed message and
//! posted to the device that holds it (see the module documentation of
//! [`hybrid`](super)).

use std::collections::VecDeque;
use std::sync::Arc;

use xdev::devkit::matching::FxMap;
use xdev::devkit::RequestKind;
use xdev::{Buffer, Context, Rank, Request, Source, Status, TagSel};

use super::route::Route;
use super::{lock, HybridEngine};

/// A receive not yet given to a device (see the module documentation).
pub(super) struct HeldRecv {
    pub(super) core: xdev::devkit::CoreRef,
    /// The receive's buffer, until the receive is relayed to a device.
    pub(super) buf: Buffer,
    pub(super) source: Source,
    pub(super) tag: TagSel,
}

/// Held receives per context, in posting order.
#[derive(Default)]
pub(super) struct Held {
    pub(super) queues: FxMap<Context, VecDeque<HeldRecv>>,
    /// Which device a wildcard looks at first (alternates, so that neither
    /// starves the other).
    pub(super) remote_first: bool,
}

impl HybridEngine {
    /// Whether a receive in `context` must be held (see the module docs).
    pub(super) fn must_hold(&self, held: &Held, source: Source, context: Context) -> bool {
        self.remote.is_some() && (source == Source::Any || held.queues.contains_key(&context))
    }

    /// Posts a receive for `core` into `buf` to the device reaching `source`
    /// (a rank).
    pub(super) fn post_named(
        &self,
        core: &xdev::devkit::CoreRef,
        buf: Buffer,
        source: Rank,
        tag: TagSel,
        context: Context,
    ) {
        let (dev, r, map) = self.reach(source);
        self.relay(core, buf, dev, map, |d, b| {
            d.irecv(b, Source::Rank(r), tag, context)
        });
    }

    /// Gives the held receives of `context` to devices, in order, as far as
    /// a wildcard at the head can be bound to a message.
    pub(super) fn advance(&self, held: &mut Held, context: Context) {
        let Some(queue) = held.queues.get_mut(&context) else {
            return;
        };
        while let Some(head) = queue.pop_front() {
            let HeldRecv {
                core,
                buf,
                source,
                tag,
            } = head;
            match source {
                Source::Rank(s) => self.post_named(&core, buf, s, tag, context),
                Source::Any => {
                    let order = if held.remote_first {
                        [Route::Remote, Route::Local(0)]
                    } else {
                        [Route::Local(0), Route::Remote]
                    };
                    let mut buf = Some(buf);
                    for route in order {
                        let (dev, map) = self.device(route);
                        match dev.iprobe(Source::Any, tag, context) {
                            Ok(None) => continue,
                            Ok(Some(st)) => {
                                // Bind to the probed message: its sender and tag.
                                let b = buf.take().expect("bound once");
                                self.relay(&core, b, dev, map, |d, b| {
                                    d.irecv(
                                        b,
                                        Source::Rank(st.source),
                                        TagSel::Tag(st.tag),
                                        context,
                                    )
                                });
                            }
                            Err(e) => {
                                let env = self.failed_recv_env(context);
                                let b = buf.take().expect("bound once");
                                self.tracker
                                    .complete_returning(&core, b, Status::failed(env, e));
                            }
                        }
                        break;
                    }
                    if let Some(buf) = buf {
                        // No message for it yet: it stays at the head.
                        queue.push_front(HeldRecv {
                            core,
                            buf,
                            source,
                            tag,
                        });
                        return;
                    }
                    held.remote_first = !held.remote_first;
                }
            }
        }
        held.queues.remove(&context);
    }

    pub(super) fn advance_all(&self) {
        let mut held = lock(&self.held);
        if held.queues.is_empty() {
            return;
        }
        let contexts: Vec<Context> = held.queues.keys().copied().collect();
        for c in contexts {
            self.advance(&mut held, c);
        }
    }

    pub(super) fn irecv(
        self: &Arc<Self>,
        buf: Buffer,
        source: Source,
        tag: TagSel,
        context: Context,
    ) -> Request {
        let mut held = lock(&self.held);
        if self.must_hold(&held, source, context) {
            let core = self.tracker.start_relay(RequestKind::Recv);
            held.queues.entry(context).or_default().push_back(HeldRecv {
                core: core.clone(),
                buf,
                source,
                tag,
            });
            self.advance(&mut held, context);
            drop(held);
            return self.request(core);
        }
        // Nothing held: the receive goes straight down (still under the
        // lock, so that a receive held after it cannot overtake it).
        let (dev, r, map) = match source {
            Source::Rank(s) => {
                let (dev, r, map) = self.reach(s);
                (dev, Source::Rank(r), map)
            }
            // One host: every source is local.
            Source::Any => (&*self.local, Source::Any, &self.local_map),
        };
        let below = dev.irecv(buf, r, tag, context);
        let request = self.forward(RequestKind::Recv, below, map);
        drop(held);
        request
    }
}
