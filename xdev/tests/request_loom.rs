//! Loom model of the request core's protocol (`xdev/src/request.rs`,
//! `request/pool.rs`, `request/tracker.rs`): the real code, with its atomics
//! and cells taken from loom (`xdev/src/sync.rs`). Loom runs every
//! interleaving of the threads below (and every value a weak memory order
//! lets a load see); its `UnsafeCell` fails the model on any access of a
//! core's buffer, status or hook that is not ordered after the last write
//! by another thread.
//!
//! What it checks, each against a completion on another thread:
//! - a handle waiting for its request gets the completer's buffer and
//!   status, and the core goes back to a pool (this thread's stash or its
//!   tracker's sweep) and is reused without racing the completer;
//! - `peek` (`Tracker::pop_completed`) reports a completion at most once and
//!   reads its status without racing the handle that consumes it, nor the
//!   reset and completion of the core's next request;
//! - a relayed request (a layered device's) whose hook is installed while
//!   the request below completes gets the completion exactly once, whoever
//!   wins the race between the hook and the claim.
//!
//! Run with
//! `RUSTFLAGS="--cfg loom" cargo test -p ibvx-xdev --release --test request_loom`.
#![cfg(loom)]

use std::sync::Arc;

use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::thread;

use xdev::devkit::{Completion, CoreRef, Progress, RequestCore, RequestKind, Tracker};
use xdev::{Buffer, Envelope, Request, Status};

/// A device with nothing to progress: its waits yield to the other loom
/// threads until the request is done.
struct Spin;

impl Progress for Spin {
    fn progress(&self) {
        thread::yield_now();
    }

    fn wait(&self, core: &RequestCore) {
        while !core.is_done() {
            thread::yield_now();
        }
    }

    fn cancel(&self, _: &CoreRef) -> bool {
        false
    }
}

fn env(tag: i32) -> Envelope {
    Envelope {
        source: 1,
        tag,
        context: 0,
    }
}

#[test]
fn a_waiting_handle_gets_the_completion_and_the_core_is_reused() {
    loom::model(|| {
        let t = Arc::new(Tracker::new());
        let spin = Arc::new(Spin);
        let (core, handle) = t.start_request(RequestKind::Recv, Buffer::zeroed(4), &spin);
        let req = handle.into_request();
        let device = t.clone();
        let completer = thread::spawn(move || {
            assert!(device.complete(&core, Status::ok(env(7), 4)));
            // The device lets go of its reference after the completion, as
            // an engine's queue does.
            drop(core);
        });
        let c = req.wait();
        assert!(c.status.error.is_none());
        assert_eq!((c.status.tag, c.status.count, c.buf.len()), (7, 4, 4));
        // The next request of this thread, possibly on the same core (from
        // this thread's stash, or from a sweep once the completer let go),
        // while the completer may still be dropping its reference.
        let (next, handle) = t.start_request(RequestKind::Send, c.buf, &spin);
        assert!(t.complete(&next, Status::ok(env(8), 4)));
        drop(next);
        let c = handle.into_request().wait();
        assert_eq!((c.status.tag, c.buf.len()), (8, 4));
        completer.join().unwrap();
    });
}

#[test]
fn peek_reports_a_completion_at_most_once_and_never_races_its_reuse() {
    loom::model(|| {
        let t = Arc::new(Tracker::new());
        let spin = Arc::new(Spin);
        let (core, handle) = t.start_request(RequestKind::Recv, Buffer::zeroed(1), &spin);
        assert!(t.complete(&core, Status::ok(env(3), 1)));
        drop(core);
        let req = handle.into_request();
        let id = req.id();
        let peeker = t.clone();
        let peek = thread::spawn(move || peeker.pop_completed().map(|p| (p.id, p.status.tag)));
        let c = req.wait();
        assert_eq!(c.status.tag, 3);
        // The core goes to this thread's stash and straight into the next
        // request, reset and completed while `peek` may be looking at it.
        let (next, handle) = t.start_request(RequestKind::Recv, c.buf, &spin);
        assert!(t.complete(&next, Status::ok(env(4), 1)));
        drop(next);
        let req = handle.into_request();
        let next_id = req.id();
        let peeked = peek.join().unwrap();
        // Either request may have been reported (the second one's handle is
        // live and done too), each with its own status, and only once.
        match peeked {
            None => {}
            Some((pid, tag)) if pid == id => assert_eq!(tag, 3),
            Some((pid, tag)) => assert_eq!((pid, tag), (next_id, 4)),
        }
        let c = req.wait();
        assert_eq!(c.status.tag, 4);
        if let Some((pid, _)) = peeked {
            if pid == next_id {
                // Reported once: a second look finds nothing.
                assert!(t.pop_completed().is_none());
            }
        }
    });
}

#[test]
fn a_relay_hook_gets_the_completion_below_exactly_once() {
    loom::model(|| {
        let below = Arc::new(Tracker::new());
        let spin = Arc::new(Spin);
        let upper = Arc::new(Tracker::new());
        let (core, handle) = below.start_request(RequestKind::Recv, Buffer::zeroed(2), &spin);
        let relayed = upper.start_relay(RequestKind::Recv);
        let req = Request::new(relayed.clone(), Arc::new(Spin));
        let device = below.clone();
        let completer = thread::spawn(move || {
            assert!(device.complete(&core, Status::ok(env(5), 2)));
            drop(core);
        });
        let runs = Arc::new(AtomicUsize::new(0));
        let (up, up_core, hook_runs) = (upper.clone(), relayed.clone(), runs.clone());
        relayed.relay(
            handle.into_request(),
            Box::new(move |c: Completion| {
                hook_runs.fetch_add(1, Ordering::Relaxed);
                assert!(up.complete_returning(&up_core, c.buf, c.status));
            }),
        );
        drop(relayed);
        let c = req.wait();
        assert_eq!((c.status.tag, c.buf.len()), (5, 2));
        completer.join().unwrap();
        assert_eq!(runs.load(Ordering::Relaxed), 1);
    });
}
