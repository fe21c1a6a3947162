//! Progress and waiting: polling both devices, and the request hooks
//! (wait, cancel) of the requests this layer hands out.

use std::time::Duration;

use shm_ipc::doorbell::Backoff;
use xdev::devkit::{Progress, RequestCore, RequestKind};
use xdev::{Pattern, Status};

use super::{lock, HybridEngine, MAX_POLL_SLEEP};

impl HybridEngine {
    /// One round of progress on both devices and the held receives.
    pub(super) fn poll(&self) {
        self.advance_all();
        self.local.progress();
        if let Some(r) = &self.remote {
            r.progress();
        }
    }

    /// Polls until `done` says so: spins, yields, then sleeps in growing
    /// steps up to [`MAX_POLL_SLEEP`].
    pub(super) fn poll_until<T>(&self, mut done: impl FnMut(&Self) -> Option<T>) -> T {
        let mut backoff = Backoff::new();
        let mut sleep = Duration::from_micros(10);
        loop {
            if let Some(v) = done(self) {
                return v;
            }
            self.poll();
            if let Some(v) = done(self) {
                return v;
            }
            if !backoff.snooze() {
                std::thread::sleep(sleep);
                sleep = (sleep * 2).min(MAX_POLL_SLEEP);
            }
        }
    }
}

impl Progress for HybridEngine {
    fn progress(&self) {
        self.poll();
    }

    fn wait(&self, core: &RequestCore) {
        if self.remote.is_none() {
            // One device: its own wait (which sleeps on its doorbell).
            if let Some((c, engine)) = core.relayed_to() {
                engine.wait(c);
            }
        }
        // Two devices: a wait inside one would starve the other (a peer may
        // need this rank to drain a ring of the other device before it can
        // send what this request waits for), so poll both.
        self.poll_until(|_| core.is_done().then_some(()));
    }

    fn cancel(&self, core: &xdev::devkit::CoreRef) -> bool {
        if core.kind() != RequestKind::Recv || core.is_done() {
            return false;
        }
        // Under the held lock: a held receive is relayed only under it.
        let mut held = lock(&self.held);
        if let Some((c, engine)) = core.relayed_to() {
            drop(held);
            return engine.cancel(c);
        }
        for (&context, queue) in held.queues.iter_mut() {
            if let Some(i) = queue
                .iter()
                .position(|h| xdev::devkit::CoreRef::ptr_eq(&h.core, core))
            {
                let h = queue.remove(i).expect("position is in range");
                let st = Status::cancelled(Pattern::new(h.source, h.tag, context));
                self.tracker.complete_returning(core, h.buf, st);
                // Receives held behind it may be free to go now.
                self.advance(&mut held, context);
                return true;
            }
        }
        false
    }
}
