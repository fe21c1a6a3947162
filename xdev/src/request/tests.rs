use super::handle::Inner;
use super::*;
use crate::Envelope;
use std::sync::Mutex;

struct Inert;
impl Progress for Inert {
    fn progress(&self) {}
    fn wait(&self, core: &RequestCore) {
        while !core.is_done() {
            std::thread::yield_now();
        }
    }
    fn cancel(&self, _: &CoreRef) -> bool {
        false
    }
}

/// An engine that counts its progress calls and does nothing else.
struct Counting(AtomicU64);
impl Progress for Counting {
    fn progress(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    fn wait(&self, _: &RequestCore) {}
    fn cancel(&self, _: &CoreRef) -> bool {
        false
    }
}

fn env() -> Envelope {
    Envelope {
        source: 1,
        tag: 2,
        context: 3,
    }
}

#[test]
fn completion_returns_buffer_and_counts() {
    let t = Tracker::new();
    let core = t.start(RequestKind::Send, Buffer::from(vec![5u8; 4]));
    assert_eq!((t.outstanding(), t.outstanding_sends()), (1, 1));
    let req = Request::new(core.clone(), Arc::new(Inert));
    let req = req.test().expect_err("not complete yet");
    assert!(t.complete(&core, Status::ok(env(), 4)));
    assert!(
        !t.complete(&core, Status::ok(env(), 0)),
        "second completion refused"
    );
    assert_eq!((t.outstanding(), t.outstanding_sends()), (0, 0));
    let c = req.wait();
    assert_eq!(&c.buf[..], &[5, 5, 5, 5]);
    assert_eq!(c.status.count, 4);
    // Consumed by wait: peek no longer reports it.
    assert!(t.pop_completed().is_none());
}

#[test]
fn a_request_born_complete_carries_its_completion_and_is_never_peeked() {
    let t = Tracker::new();
    let early = t.completed(Buffer::from(vec![7u8; 3]), Status::ok(env(), 3));
    let dropped = t.completed(Buffer::zeroed(1), Status::ok(env(), 1));
    assert_ne!(early.id(), dropped.id(), "ids are unique");
    drop(dropped);
    assert!(early.was_born_complete());
    assert_eq!(t.outstanding(), 0, "born complete: never outstanding");
    assert!(
        t.pop_completed().is_none(),
        "peek reports only requests that were in flight"
    );
    assert_eq!(t.pool.lock().all.len(), 0, "no pooled core was taken");
    assert!(!early.cancel(), "nothing to cancel");
    let c = early.test().expect("complete at once");
    assert_eq!((&c.buf[..], c.status.count), (&[7u8, 7, 7][..], 3));
    // An in-flight request's id never meets a born-complete one's.
    let core = t.start(RequestKind::Recv, Buffer::zeroed(2));
    let r = Request::new(core.clone(), Arc::new(Inert));
    assert!(!r.was_born_complete());
    assert!(r.id() < t.completed(Buffer::zeroed(0), Status::ok(env(), 0)).id());
    t.complete(&core, Status::ok(env(), 2));
    assert_eq!(r.wait().buf.len(), 2);
}

#[test]
fn wait_ok_gives_the_buffer_back_with_the_error() {
    let t = Tracker::new();
    let env = env();
    let st = Status::received(env, 9, 4);
    let r = t.completed(Buffer::from(vec![1u8; 4]), st);
    let failed = r.wait_ok().expect_err("truncated");
    assert!(matches!(
        failed.error,
        crate::Error::Truncated { message_len: 9, .. }
    ));
    assert_eq!((&failed.buf[..], failed.status.count), (&[1u8; 4][..], 4));
    assert!(failed.status.error.is_none(), "the error moved out");
    let ok = t.completed(Buffer::zeroed(3), Status::ok(env, 3));
    let (buf, st) = ok.wait_ok().expect("ok");
    assert_eq!((buf.len(), st.count), (3, 3));
}

#[test]
fn take_if_done_gives_only_a_done_request_and_drives_nothing() {
    let t = Tracker::new();
    let engine = Arc::new(Counting(AtomicU64::new(0)));
    let core = t.start(RequestKind::Recv, Buffer::zeroed(2));
    let r = Request::new(core.clone(), engine.clone());
    let r = r.take_if_done().expect_err("not done");
    assert_eq!(engine.0.load(Ordering::Relaxed), 0, "no progress driven");
    t.complete(&core, Status::ok(env(), 2));
    assert_eq!(r.take_if_done().expect("done").status.count, 2);
}

#[test]
fn peek_reports_live_handles_once() {
    let t = Tracker::new();
    let a = Request::new(
        t.start(RequestKind::Recv, Buffer::zeroed(1)),
        Arc::new(Inert),
    );
    let b_core = t.start(RequestKind::Recv, Buffer::zeroed(1));
    drop(Request::new(b_core.clone(), Arc::new(Inert)));
    t.complete(&b_core, Status::ok(env(), 1));
    assert!(
        t.pop_completed().is_none(),
        "dropped handle is not peekable"
    );
    let Inner::InFlight(held) = &*a.view() else {
        panic!("started, not born complete");
    };
    let a_core = held.core.clone();
    t.complete(&a_core, Status::ok(env(), 1));
    assert_eq!(t.pop_completed().map(|p| p.id), Some(a.id()));
    assert!(t.pop_completed().is_none(), "reported once");
    assert_eq!(a.wait().status.count, 1);
}

#[test]
fn forgotten_handle_keeps_memory_alive() {
    let t = Tracker::new();
    let core = t.start(RequestKind::Recv, Buffer::zeroed(8));
    std::mem::forget(Request::new(core.clone(), Arc::new(Inert)));
    // The device can still write: the core (and buffer) is alive.
    // SAFETY: the core owns an 8-byte buffer and nobody else writes it.
    unsafe { core.buffer_ptr().write_bytes(1, 8) };
    assert!(t.complete(&core, Status::ok(env(), 8)));
}

#[test]
fn relayed_request_returns_buffer_through_the_outer_one() {
    let outer_t = Arc::new(Tracker::new());
    let inner_t = Tracker::new();
    let outer = outer_t.start_relay(RequestKind::Recv);
    assert!(outer.buffer_ptr().is_null());
    let handle = Request::new(outer.clone(), Arc::new(Inert));
    let inner_core = inner_t.start(RequestKind::Recv, Buffer::from(vec![0u8; 4]));
    let inner = Request::new(inner_core.clone(), Arc::new(Inert));
    let (t, o) = (outer_t.clone(), outer.clone());
    outer.relay(
        inner,
        Box::new(move |c: Completion| {
            let mut st = c.status;
            st.source = 7;
            t.complete_returning(&o, c.buf, st);
        }),
    );
    assert!(CoreRef::ptr_eq(
        &outer.relayed_to().expect("relayed").0,
        &inner_core
    ));
    assert!(!outer.is_done());
    // SAFETY: the inner core owns the 4-byte buffer; nothing else writes it.
    unsafe { inner_core.buffer_ptr().write_bytes(9, 4) };
    assert!(inner_t.complete(&inner_core, Status::ok(env(), 4)));
    assert!(
        outer.is_done(),
        "the hook ran before the inner request was done"
    );
    assert!(inner_t.pop_completed().is_none(), "inner is not peekable");
    assert_eq!(outer_t.pop_completed().map(|p| p.id), Some(handle.id()));
    let c = handle.wait();
    assert_eq!((&c.buf[..], c.status.source), (&[9u8; 4][..], 7));
    assert_eq!(outer_t.outstanding(), 0);
}

#[test]
fn hook_on_a_completed_request_runs_at_once() {
    let t = Tracker::new();
    let core = t.start(RequestKind::Send, Buffer::from(vec![3u8; 2]));
    t.complete(&core, Status::ok(env(), 2));
    let got = Arc::new(Mutex::new(None));
    let g = got.clone();
    core.on_complete(Box::new(move |c| *g.lock().unwrap() = Some(c)));
    let c = got.lock().unwrap().take().expect("hook ran");
    assert_eq!((&c.buf[..], c.status.count), (&[3u8, 3][..], 2));
}

#[test]
fn a_tracker_refuses_requests_it_did_not_start() {
    // The review's reproduction: another tracker completing a device's
    // request would hand its buffer out while the device writes it.
    let device = Tracker::new();
    let core = device.start(RequestKind::Recv, Buffer::zeroed(64));
    let stranger = Tracker::new();
    assert!(!stranger.started(&core));
    assert!(!stranger.complete(&core, Status::ok(env(), 0)));
    assert!(!stranger.complete_returning(&core, Buffer::zeroed(1), Status::ok(env(), 0)));
    assert!(
        !core.is_done(),
        "a refused completion leaves the request alone"
    );
    assert!(device.complete(&core, Status::ok(env(), 64)));
}

#[test]
fn complete_returning_refuses_a_request_that_owns_a_buffer() {
    let t = Tracker::new();
    let core = t.start(RequestKind::Recv, Buffer::zeroed(8));
    assert!(!t.complete_returning(&core, Buffer::zeroed(8), Status::ok(env(), 0)));
    assert!(!core.is_done());
    assert!(t.complete(&core, Status::ok(env(), 8)));
}

/// A `Progress` whose `wait` returns at once, done or not.
struct Liar;
impl Progress for Liar {
    fn progress(&self) {}
    fn wait(&self, _: &RequestCore) {}
    fn cancel(&self, _: &CoreRef) -> bool {
        false
    }
}

#[test]
fn wait_returns_the_buffer_only_once_done_whatever_the_engine_says() {
    let t = Arc::new(Tracker::new());
    let core = t.start(RequestKind::Recv, Buffer::zeroed(16));
    let handle = Request::new(core.clone(), Arc::new(Liar));
    let (t2, c2) = (t.clone(), core.clone());
    let completer = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(50));
        // SAFETY: the request is incomplete, so it still owns its
        // 16-byte buffer, and only this thread writes it.
        unsafe { c2.buffer_ptr().write_bytes(5, 16) };
        t2.complete(&c2, Status::ok(env(), 16));
    });
    let c = handle.wait();
    assert!(core.is_done());
    assert_eq!(&c.buf[..], &[5u8; 16][..]);
    completer.join().unwrap();
}

#[test]
fn threads_share_trackers_through_their_stashes() {
    // Four threads start, complete and wait requests on three trackers
    // in turn (more than one stash each), born complete or not, while a
    // fifth peeks: every buffer comes back with its own bytes, ids stay
    // unique per tracker, nothing stays outstanding, and the pools stay
    // within what the stashes and the requests in flight explain.
    let trackers: Vec<Tracker> = (0..3).map(|_| Tracker::new()).collect();
    let stop = AtomicBool::new(false);
    let ids = Mutex::new(vec![std::collections::HashSet::new(); 3]);
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                for t in &trackers {
                    let _ = t.pop_completed();
                }
            }
        });
        let workers: Vec<_> = (0..4u8)
            .map(|w| {
                let (trackers, ids) = (&trackers, &ids);
                s.spawn(move || {
                    let mut mine = vec![Vec::new(); 3];
                    for i in 0..20_000u32 {
                        let k = (i % 3) as usize;
                        let t = &trackers[k];
                        let bytes = vec![w ^ i as u8; 1 + (i % 5) as usize];
                        let r = if i % 2 == 0 {
                            t.completed(Buffer::from(bytes.clone()), Status::ok(env(), bytes.len()))
                        } else {
                            let core = t.start(RequestKind::Recv, Buffer::from(bytes.clone()));
                            let r = Request::new(core.clone(), Arc::new(Inert));
                            assert!(t.complete(&core, Status::ok(env(), bytes.len())));
                            r
                        };
                        mine[k].push(r.id());
                        let c = r.wait();
                        assert_eq!(&c.buf[..], &bytes[..]);
                        assert_eq!(c.status.count, bytes.len());
                    }
                    let mut all = ids.lock().unwrap();
                    for (k, v) in mine.into_iter().enumerate() {
                        for id in v {
                            assert!(all[k].insert(id), "id {id:?} given twice");
                        }
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
    });
    for t in &trackers {
        assert_eq!(t.outstanding(), 0);
        let n = t.pool.lock().all.len();
        assert!(n <= 5 * pool::STASH_BATCH * 2, "pool grew to {n}");
    }
}

#[test]
fn cores_are_reused_and_the_pool_stays_small() {
    let t = Tracker::new();
    let mut first = None;
    for _ in 0..10_000 {
        let core = t.start(RequestKind::Send, Buffer::zeroed(0));
        first.get_or_insert(CoreRef::as_ptr(&core));
        let r = Request::new(core.clone(), Arc::new(Inert));
        t.complete(&core, Status::ok(env(), 0));
        drop(core);
        drop(r.wait());
    }
    let pool = t.pool.lock();
    assert!(pool.all.len() <= 32, "pool grew to {}", pool.all.len());
    assert!(pool.all.iter().any(|c| Some(CoreRef::as_ptr(c)) == first));
}

#[test]
fn a_core_still_held_by_the_device_is_not_reused() {
    let t = Tracker::new();
    let held = t.start(RequestKind::Recv, Buffer::zeroed(4));
    // The handle is dropped, but the device still holds the core.
    drop(Request::new(held.clone(), Arc::new(Inert)));
    for _ in 0..100 {
        let c = t.start(RequestKind::Recv, Buffer::zeroed(4));
        assert!(!CoreRef::ptr_eq(&c, &held));
        let r = Request::new(c.clone(), Arc::new(Inert));
        t.complete(&c, Status::ok(env(), 4));
        drop(c);
        drop(r.wait());
    }
    assert!(!held.is_done());
    assert_eq!(t.outstanding(), 1);
    assert!(t.complete(&held, Status::ok(env(), 4)));
    assert_eq!(t.outstanding(), 0);
}

#[test]
#[should_panic(expected = "exactly one handle")]
fn a_core_has_one_handle() {
    let t = Tracker::new();
    let core = t.start(RequestKind::Recv, Buffer::zeroed(4));
    let _a = Request::new(core.clone(), Arc::new(Inert));
    let _b = Request::new(core, Arc::new(Inert));
}

/// The handle a device moves through its posting path is one word, and
/// dropped before it becomes a request it is a dropped request: `peek`
/// never reports the completion, and the core is reused once the device
/// lets go of it.
#[test]
fn a_handle_is_small_and_dropping_it_drops_the_request() {
    assert_eq!(std::mem::size_of::<Handle>(), std::mem::size_of::<usize>());
    assert!(std::mem::size_of::<Handle>() < std::mem::size_of::<Request>());
    let t = Tracker::new();
    let (core, handle) = t.start_request(RequestKind::Recv, Buffer::zeroed(2), &Arc::new(Inert));
    drop(handle);
    assert_eq!(core.count(), 2, "the pool's and the device's");
    assert!(t.complete(&core, Status::ok(env(), 2)));
    assert!(t.pop_completed().is_none(), "no handle, nothing to report");
    let first = core.id();
    drop(core);
    // The core is free again: the next request may take it, with a new id.
    let (next, handle) = t.start_request(RequestKind::Recv, Buffer::zeroed(1), &Arc::new(Inert));
    let r = handle.into_request();
    assert_ne!(next.id(), first);
    assert!(t.complete(&next, Status::ok(env(), 1)));
    assert_eq!(r.wait().status.count, 1);
}

#[test]
fn start_request_is_start_plus_a_handle() {
    let t = Tracker::new();
    let (core, r) = t.start_request(RequestKind::Recv, Buffer::zeroed(3), &Arc::new(Inert));
    let r = r.into_request();
    assert!(!r.was_born_complete());
    assert_eq!(r.id(), core.id());
    assert_eq!(core.count(), 3, "the pool's, the device's and the handle's");
    assert_eq!(t.outstanding(), 1);
    assert!(t.complete(&core, Status::ok(env(), 3)));
    assert_eq!(t.pop_completed().map(|p| p.id), Some(r.id()), "peekable");
    assert_eq!(r.wait().buf.len(), 3);
    drop(core);
    assert_eq!(t.outstanding(), 0);
    // Dropped early: the device's reference keeps the core until it
    // completes, and the pool reuses it after.
    let (core, r) = t.start_request(RequestKind::Send, Buffer::zeroed(1), &Arc::new(Inert));
    let r = r.into_request();
    drop(r);
    assert_eq!(core.count(), 2);
    t.complete(&core, Status::ok(env(), 1));
    assert!(t.pop_completed().is_none(), "no handle, nothing to report");
}

#[test]
fn a_reused_core_reports_only_its_own_status() {
    let t = Tracker::new();
    let mut used = std::collections::HashSet::new();
    for _ in 0..100 {
        let (core, r) = t.start_request(RequestKind::Recv, Buffer::zeroed(2), &Arc::new(Inert));
        let r = r.into_request();
        used.insert(CoreRef::as_ptr(&core) as usize);
        assert!(t.complete(&core, Status::failed(env(), crate::Error::Closed)));
        drop(core);
        assert!(r.wait().status.error.is_some());
    }
    // The cores come back with the failed statuses still in them (a reset
    // leaves the status for the completion to overwrite).
    let mut reused = 0;
    for _ in 0..100 {
        let (core, r) = t.start_request(RequestKind::Recv, Buffer::zeroed(2), &Arc::new(Inert));
        let r = r.into_request();
        reused += usize::from(used.contains(&(CoreRef::as_ptr(&core) as usize)));
        assert!(t.pop_completed().is_none(), "not done, nothing to report");
        let r = r.take_if_done().expect_err("in flight");
        assert!(t.complete(&core, Status::ok(env(), 2)));
        let peeked = t.pop_completed().expect("done, reported once");
        assert!(peeked.status.error.is_none() && peeked.status.count == 2);
        drop(core);
        let c = r.wait();
        assert!(c.status.error.is_none() && c.status.count == 2);
    }
    assert!(reused > 0, "no core was reused");
}

#[test]
fn a_consumed_core_goes_back_to_this_threads_stash_and_ids_stay_unique() {
    let t = Tracker::new();
    let mut ids = std::collections::HashSet::new();
    let mut last = None;
    for i in 0..1000 {
        let (core, r) = t.start_request(RequestKind::Recv, Buffer::zeroed(1), &Arc::new(Inert));
        let r = r.into_request();
        assert!(ids.insert(r.id()), "id {:?} handed out twice", r.id());
        if i > 0 {
            // The core the previous handle consumed came straight back.
            assert_eq!(Some(CoreRef::as_ptr(&core)), last);
        }
        last = Some(CoreRef::as_ptr(&core));
        assert!(t.complete(&core, Status::ok(env(), 1)));
        // The device lets go first; the handle's wait then keeps the core.
        drop(core);
        assert_eq!(r.wait().status.count, 1);
    }
    // A core the device still holds is not kept: it goes back by its count.
    let (core, r) = t.start_request(RequestKind::Recv, Buffer::zeroed(1), &Arc::new(Inert));
    let r = r.into_request();
    assert!(t.complete(&core, Status::ok(env(), 1)));
    drop(r.wait());
    assert_eq!(core.count(), 2, "the pool's and the device's");
    let (next, r2) = t.start_request(RequestKind::Recv, Buffer::zeroed(1), &Arc::new(Inert));
    let r2 = r2.into_request();
    assert!(!CoreRef::ptr_eq(&next, &core));
    assert!(ids.insert(r2.id()));
    drop(core);
    let n = t.pool.lock().all.len();
    assert!(
        n <= pool::STASH_BATCH,
        "one refill served every request, pool has {n}"
    );
}

#[test]
fn a_consumed_core_is_kept_only_by_its_own_trackers_stash() {
    // Two devices used from one thread: the stash in front is the other
    // tracker's when a handle is consumed, so its core must not go there.
    let (a, b) = (Tracker::new(), Tracker::new());
    let mut ids = std::collections::HashSet::new();
    for _ in 0..200 {
        for (t, other) in [(&a, &b), (&b, &a)] {
            let (core, r) = t.start_request(RequestKind::Send, Buffer::zeroed(1), &Arc::new(Inert));
            let r = r.into_request();
            // Bring the other tracker's stash to the front.
            let (oc, or) =
                other.start_request(RequestKind::Send, Buffer::zeroed(1), &Arc::new(Inert));
            let or = or.into_request();
            assert!(t.started(&core) && other.started(&oc));
            assert!(ids.insert((t as *const Tracker as usize, r.id())));
            assert!(t.complete(&core, Status::ok(env(), 1)));
            assert!(other.complete(&oc, Status::ok(env(), 1)));
            drop((core, oc));
            assert_eq!(r.wait().status.count, 1);
            assert_eq!(or.wait().status.count, 1);
        }
    }
}

#[test]
fn a_send_failed_while_its_memory_may_be_read_returns_a_copy_and_keeps_the_original() {
    let t = Tracker::new();
    let core = t.start(RequestKind::Send, Buffer::from(vec![1u8, 2, 3, 4]));
    let at = core.buffer_ptr();
    let req = Request::new(core.clone(), Arc::new(Inert));
    let st = Status::failed(
        env(),
        crate::Error::PeerLost {
            rank: 1,
            reason: "left".into(),
        },
    );
    let kept = t
        .complete_keeping(&core, st)
        .expect("this call completed it");
    // The device keeps the memory the transport may still read...
    assert_eq!(
        (kept.as_ptr(), &kept[..]),
        (at as *const u8, &[1u8, 2, 3, 4][..])
    );
    // ...and the handle gets the data back, in other memory, with the error.
    let c = req.wait();
    assert_eq!(&c.buf[..], &[1, 2, 3, 4]);
    assert_ne!(c.buf.as_ptr(), at as *const u8);
    assert!(matches!(
        c.status.error.as_deref(),
        Some(crate::Error::PeerLost { rank: 1, .. })
    ));
    // A request already complete is not completed (or copied) again.
    assert!(t.complete_keeping(&core, Status::ok(env(), 4)).is_none());
    // Nor is one another tracker started.
    let other = Tracker::new().start(RequestKind::Send, Buffer::from(vec![9u8]));
    assert!(t.complete_keeping(&other, Status::ok(env(), 1)).is_none());
    // Nor a receive, whose memory may be being written: it stays in flight.
    let recv = t.start(RequestKind::Recv, Buffer::from(vec![0u8; 4]));
    assert!(t.complete_keeping(&recv, Status::ok(env(), 4)).is_none());
    assert!(!recv.is_done());
}

#[test]
fn a_kept_send_relayed_gives_its_hook_the_copy() {
    let t = Tracker::new();
    let core = t.start(RequestKind::Send, Buffer::from(vec![5u8, 6, 7]));
    let at = core.buffer_ptr();
    let got = Arc::new(Mutex::new(None));
    let g = got.clone();
    core.on_complete(Box::new(move |c| *g.lock().unwrap() = Some(c)));
    let kept = t
        .complete_keeping(&core, Status::ok(env(), 3))
        .expect("this call completed it");
    assert_eq!(kept.as_ptr(), at as *const u8);
    let c = got.lock().unwrap().take().expect("the hook ran");
    assert_eq!(&c.buf[..], &[5, 6, 7]);
    assert_ne!(c.buf.as_ptr(), at as *const u8, "the hook got the copy");
}

/// `peek` on one thread while another completes, consumes and at once
/// reuses cores (through its stash): every status `peek` reports is the one
/// its request was completed with (each request's tag is made from its
/// id), and no request is reported twice. A peek that read the status of a
/// core already reset for its next request would report another request's
/// tag, or a status being written; the loom model
/// (`tests/request_loom.rs`) checks the same rule in every interleaving.
///
/// The rounds start once the peeking thread runs, and go on past
/// `ROUNDS` until it has reported `REPORTS` requests (or 10 s have passed):
/// 20,000 rounds take about 2 ms, and without that the peeking thread often
/// started after the last one and the test checked nothing.
#[test]
fn peek_beside_a_thread_that_reuses_cores_reports_each_request_its_own_status() {
    const ROUNDS: usize = 20_000;
    const REPORTS: usize = 100;
    let tag_of = |id: RequestId| (id.0 % 1_000_003) as i32;
    let t = Arc::new(Tracker::new());
    let done = Arc::new(AtomicBool::new(false));
    let reports = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Arc::new(std::sync::Barrier::new(2));
    let peeker = {
        let (t, done, reports, started) =
            (t.clone(), done.clone(), reports.clone(), started.clone());
        std::thread::spawn(move || {
            started.wait();
            let mut seen = std::collections::HashSet::new();
            while !done.load(Ordering::Acquire) {
                if let Some(p) = t.pop_completed() {
                    assert_eq!(p.status.tag, tag_of(p.id), "request {:?}", p.id);
                    assert!(seen.insert(p.id), "{:?} reported twice", p.id);
                    reports.store(seen.len(), Ordering::Relaxed);
                }
            }
            seen.len()
        })
    };
    started.wait();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut buf = Buffer::zeroed(8);
    let mut round = 0;
    while round < ROUNDS
        || (reports.load(Ordering::Relaxed) < REPORTS && std::time::Instant::now() < deadline)
    {
        round += 1;
        let (core, handle) = t.start_request(RequestKind::Recv, buf, &Arc::new(Inert));
        let req = handle.into_request();
        let env = Envelope {
            tag: tag_of(req.id()),
            ..env()
        };
        assert!(t.complete(&core, Status::ok(env, 8)));
        drop(core);
        let c = req.wait();
        assert_eq!(c.status.tag, env.tag);
        buf = c.buf;
    }
    done.store(true, Ordering::Release);
    let reported = peeker.join().expect("the peeking thread");
    assert!(
        reported > 0,
        "peek reported nothing in {round} rounds: nothing was checked"
    );
}

/// An engine whose wait completes the one core it was given, counting its
/// waits.
struct Completer {
    t: Tracker,
    core: Mutex<Option<CoreRef>>,
    waits: AtomicU64,
}

impl Completer {
    fn new() -> Arc<Self> {
        Arc::new(Completer {
            t: Tracker::new(),
            core: Mutex::new(None),
            waits: AtomicU64::new(0),
        })
    }
}

impl Progress for Completer {
    fn progress(&self) {}
    fn wait(&self, _: &RequestCore) {
        self.waits.fetch_add(1, Ordering::Relaxed);
        if let Some(c) = self.core.lock().unwrap().take() {
            let len = c.buffer_len();
            assert!(self.t.complete(&c, Status::ok(env(), len)));
        }
    }
    fn cancel(&self, _: &CoreRef) -> bool {
        false
    }
}

/// A started request counts no reference to its engine: its core keeps a
/// weak one, which the handle upgrades when it must wait, and lets go with
/// the handle. A core reused by another engine of the same tracker is
/// bound to that one.
#[test]
fn a_request_counts_no_reference_to_its_engine() {
    let engine = Completer::new();
    let (core, h) = engine
        .t
        .start_request(RequestKind::Recv, Buffer::zeroed(2), &engine);
    assert_eq!(Arc::strong_count(&engine), 1, "the handle counts none");
    assert_eq!(Arc::weak_count(&engine), 1, "the core's");
    *engine.core.lock().unwrap() = Some(core);
    let c = h.into_request().wait();
    assert_eq!((c.status.count, c.buf.len()), (2, 2));
    assert_eq!(engine.waits.load(Ordering::Relaxed), 1, "the wait drove it");
    assert_eq!(Arc::strong_count(&engine), 1, "let go with the handle");
    // A done request needs no engine at all.
    let (core, h) = engine
        .t
        .start_request(RequestKind::Recv, Buffer::zeroed(1), &engine);
    assert!(engine.t.complete(&core, Status::ok(env(), 1)));
    drop(core);
    assert_eq!(h.into_request().wait().status.count, 1);
    assert_eq!(engine.waits.load(Ordering::Relaxed), 1, "no wait needed");
    // The same tracker's core (from this thread's stash) under another
    // engine: its handle drives that one.
    let other = Arc::new(Counting(AtomicU64::new(0)));
    let (core, h) = engine
        .t
        .start_request(RequestKind::Send, Buffer::zeroed(1), &other);
    let r = h.into_request();
    let r = r.test().expect_err("not done");
    assert_eq!(other.0.load(Ordering::Relaxed), 1, "the test drove `other`");
    assert!(engine.t.complete(&core, Status::ok(env(), 1)));
    assert_eq!(r.wait().status.count, 1);
    assert_eq!(engine.waits.load(Ordering::Relaxed), 1);
}

/// Once its engine is gone (its device dropped), a request the engine never
/// completed ends at once with `Closed` and an empty buffer: `test` says
/// complete, `cancel` cancels nothing, `wait` returns. Its own buffer stays
/// in the core for whoever still holds it.
#[test]
fn a_request_outliving_its_engine_ends_closed_without_its_buffer() {
    let engine = Completer::new();
    let (core, h) = engine
        .t
        .start_request(RequestKind::Recv, Buffer::from(vec![7u8; 3]), &engine);
    let r = h.into_request();
    drop(engine);
    assert!(!r.cancel(), "nothing to cancel it");
    let c = r.test().expect("nothing will drive it: complete");
    assert!(matches!(
        c.status.error.as_deref(),
        Some(crate::Error::Closed)
    ));
    assert!(c.buf.is_empty(), "the buffer is not handed out");
    assert!(!core.is_done());
    assert_eq!(core.buffer_len(), 3, "it stays in the core");
    // A request done before its engine went gives its completion as ever.
    let engine = Completer::new();
    let (core, h) = engine
        .t
        .start_request(RequestKind::Recv, Buffer::from(vec![1u8; 2]), &engine);
    assert!(engine.t.complete(&core, Status::ok(env(), 2)));
    drop(engine);
    let c = h.into_request().wait();
    assert_eq!((c.status.count, &c.buf[..]), (2, &[1u8, 1][..]));
}

/// A request relayed after the engine below is gone (its device dropped):
/// nothing will complete it below, so the relay hands the hook `Closed` at
/// once, with an empty buffer, and records nothing to wait for.
#[test]
fn a_relay_over_a_gone_engine_hands_its_hook_closed() {
    let upper = Tracker::new();
    let below = Completer::new();
    let (core, h) = below
        .t
        .start_request(RequestKind::Recv, Buffer::from(vec![3u8; 4]), &below);
    drop(below);
    let outer = upper.start_relay(RequestKind::Recv);
    let got = Arc::new(Mutex::new(None));
    let g = got.clone();
    outer.relay(
        h.into_request(),
        Box::new(move |c: Completion| *g.lock().unwrap() = Some(c)),
    );
    let c = got.lock().unwrap().take().expect("the hook ran at once");
    assert!(matches!(
        c.status.error.as_deref(),
        Some(crate::Error::Closed)
    ));
    assert!(c.buf.is_empty());
    assert!(outer.relayed_to().is_none(), "nothing below to wait for");
    assert_eq!(core.buffer_len(), 4, "the buffer stays in the core below");
}

/// Every request is two words (so a call returns it in two registers; see
/// `carry.rs`), whatever its shape.
#[test]
fn a_request_is_two_words() {
    assert_eq!(
        std::mem::size_of::<Request>(),
        2 * std::mem::size_of::<usize>()
    );
}

/// A born-complete request keeps its status in its buffer's carry until
/// `wait` takes it; the buffer then goes on to another request, which
/// carries its own.
#[test]
fn a_born_complete_status_travels_with_its_buffer_and_is_replaced() {
    let t = Tracker::new();
    let mut status = Status::ok(env(), 3);
    status.tag = 9;
    let r = t.completed(Buffer::from(&b"abc"[..]), status);
    assert!(r.was_born_complete());
    let first = r.id();
    let c = r.wait();
    assert_eq!(
        (c.status.tag, c.status.count, &c.buf[..]),
        (9, 3, &b"abc"[..])
    );
    let again = t.completed(c.buf, Status::ok(env(), 1));
    assert_ne!(again.id(), first, "a new id");
    let c = again.wait();
    assert_eq!((c.status.tag, c.status.count), (env().tag, 1));
}
