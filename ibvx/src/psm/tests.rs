//! Unit tests of the psm device (one-rank jobs in this process).

use std::time::Duration;

use super::*;
use xdev::bootstrap::Bootstrap;
use xdev::bootstrap::{BootstrapServer, Secret};
use xdev::{Buffer, Device};
use xdev::{Config, Source, TagSel};

/// Held by every test of this binary that opens the process's one PSM2
/// endpoint.
pub(crate) static ONE_ENDPOINT: std::sync::Mutex<()> = std::sync::Mutex::new(());

thread_local! {
    /// Makes the next blocking call of this thread panic right after
    /// its PSM2 request is posted (fault injection for the unwind test).
    pub(super) static PANIC_AFTER_PUBLISH: std::cell::Cell<bool> =
        const { std::cell::Cell::new(false) };
}

/// A one-rank psm job in this process (PSM2 allows one endpoint per
/// process: the tests take turns through [`ONE_ENDPOINT`]).
fn solo() -> Option<PsmDevice> {
    static JOBS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = JOBS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let job = format!("psm-unit-{}-{n}", std::process::id());
    let secret = Secret::generate().unwrap();
    let server =
        BootstrapServer::start("127.0.0.1:0".parse().unwrap(), 1, &job, secret.clone()).unwrap();
    let boot = Bootstrap::connect(server.addr(), 0, 1, &job, &secret).unwrap();
    std::mem::forget(server);
    match PsmDevice::with_bootstrap(&Config::new(0, 1, job), boot) {
        Ok(d) => Some(d),
        Err(e) => {
            println!("skipped: no PSM2 endpoint here: {e}");
            None
        }
    }
}

#[test]
fn a_blocking_send_that_unwinds_leaves_psm2_nothing_of_the_callers_memory() {
    let _one = ONE_ENDPOINT.lock().unwrap_or_else(|p| p.into_inner());
    let Some(dev) = solo() else {
        return;
    };
    // A synchronous self-send goes through PSM2 (its self device) and
    // completes only once a receive matched it: it unwinds right after
    // it is posted; the caller reuses its block at once.
    let want: Vec<u8> = (0..(1u32 << 20)).map(|i| (i % 253) as u8).collect();
    let got = std::thread::scope(|s| {
        let receiver = s.spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            let mut buf = vec![0u8; want.len()];
            let st = dev.recv(&mut buf, Source::Rank(0), TagSel::Tag(3), 0);
            (st, buf)
        });
        let mut block = want.clone();
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            PANIC_AFTER_PUBLISH.with(|p| p.set(true));
            dev.ssend(&block, 0, 3, 0)
        }));
        assert!(unwound.is_err(), "the injected panic unwound the send");
        block.fill(0xee);
        receiver.join().unwrap()
    });
    let (st, buf) = got;
    assert_eq!(st.unwrap().count, want.len());
    assert!(buf == want, "the receiver got the reused block's bytes");
}

#[test]
fn a_blocking_receive_that_unwinds_is_cancelled() {
    let _one = ONE_ENDPOINT.lock().unwrap_or_else(|p| p.into_inner());
    let Some(dev) = solo() else {
        return;
    };
    // A blocking receive that unwinds once posted is cancelled: a later
    // message goes elsewhere, not into the caller's old block.
    let mut block = vec![0u8; 64];
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        PANIC_AFTER_PUBLISH.with(|p| p.set(true));
        dev.recv(&mut block, Source::Rank(0), TagSel::Tag(4), 0)
    }));
    assert!(unwound.is_err(), "the injected panic unwound the receive");
    block.fill(0xaa);
    let r = dev.irecv(Buffer::zeroed(64), Source::Rank(0), TagSel::Tag(4), 0);
    dev.ssend(&[0x55; 64], 0, 4, 0).unwrap();
    let c = r.wait();
    assert!(c.status.error.is_none(), "{:?}", c.status);
    assert!(c.buf.iter().all(|&x| x == 0x55));
    assert!(
        block.iter().all(|&x| x == 0xaa),
        "the cancelled receive was written"
    );
}

#[test]
fn receives_posted_during_finish_all_complete() {
    let _one = ONE_ENDPOINT.lock().unwrap_or_else(|p| p.into_inner());
    let Some(dev) = solo() else {
        return;
    };
    // `finish` racing with receives posted from other threads: each
    // completes (Closed at the latest), and none reaches the closed
    // endpoint.
    xdev::devkit::conformance::finish_while_posting(
        &dev,
        0,
        Duration::from_millis(5),
        Duration::from_secs(10),
        "psm",
    )
    .unwrap();
}

#[test]
fn a_receive_of_a_message_already_here_completes_at_its_wait() {
    let _one = ONE_ENDPOINT.lock().unwrap_or_else(|p| p.into_inner());
    let Some(dev) = solo() else {
        return;
    };
    // The receive posted after the send finds the message inside
    // `psm2_mq_irecv2`. It is not tested after its post (a receive posted
    // ahead of its message, the common case, would pay for a failed test),
    // so it is lent out in flight, and its wait tests it.
    // (Whether the eager self-send itself ends at once is PSM2's business.)
    let send = dev.isend(Buffer::from(vec![0x3c; 96]), 0, 9, 0);
    let recv = dev.irecv(Buffer::zeroed(128), Source::Rank(0), TagSel::Tag(9), 0);
    assert!(!recv.was_born_complete(), "a posted receive is in flight");
    let (buf, st) = recv.wait_ok().unwrap();
    assert_eq!((st.source, st.tag, st.count), (0, 9, 96));
    assert!(buf[..96].iter().all(|&x| x == 0x3c));
    assert!(buf[96..].iter().all(|&x| x == 0));
    let (sent, st) = send.wait_ok().unwrap();
    assert_eq!((st.count, sent.len()), (96, 96));
    // A receive with nothing to match stays in flight, and is cancelled.
    let pending = dev.irecv(Buffer::zeroed(8), Source::Rank(0), TagSel::Tag(10), 0);
    assert!(!pending.is_complete());
    assert!(pending.cancel());
    assert!(pending.wait().status.cancelled);
}

#[test]
fn the_raw_queue_is_refused_once_the_device_finished() {
    let _one = ONE_ENDPOINT.lock().unwrap_or_else(|p| p.into_inner());
    let Some(dev) = solo() else {
        return;
    };
    // SAFETY: no operation of the device is outstanding while the raw
    // handles are used, and the closure sends nothing.
    let raw = unsafe { dev.raw_handles() };
    let peers = raw.with_queue(|q| Ok(q.endpoint().peers()));
    assert_eq!(peers.unwrap(), 1, "open: the queue is lent");
    dev.finish().unwrap();
    let after = raw.with_queue(|_| -> xdev::Result<()> { panic!("lent a closed queue") });
    assert!(matches!(after, Err(xdev::Error::Closed)), "{after:?}");
}

#[test]
fn a_lent_receive_dropped_unwaited_takes_no_message() {
    let _one = ONE_ENDPOINT.lock().unwrap_or_else(|p| p.into_inner());
    let Some(dev) = solo() else {
        return;
    };
    // Receives are lent out: the handle owns the buffer. Dropping one that
    // has not matched hands its buffer to the device, which cancels it in
    // PSM2 first: the next message goes to the next receive.
    let dropped = dev.irecv(Buffer::zeroed(64), Source::Rank(0), TagSel::Tag(11), 0);
    drop(dropped);
    assert_eq!(dev.engine.lock().leases, 0, "the drop ended its lease");
    let mut r = dev.irecv(Buffer::zeroed(64), Source::Rank(0), TagSel::Tag(11), 0);
    dev.ssend(&[0x5a; 64], 0, 11, 0).unwrap();
    // (Bounded: had the dropped receive stayed posted, it took the
    // message and this one never completes.)
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let c = loop {
        match r.test() {
            Ok(c) => break c,
            Err(back) => r = back,
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the message went to the dropped receive"
        );
    };
    let (buf, st) = c.into_result().unwrap();
    assert_eq!((st.source, st.tag, st.count), (0, 11, 64));
    assert!(buf.iter().all(|&x| x == 0x5a));
    // One dropped after it matched (its message in PSM2's hands already):
    // the device keeps the buffer until PSM2 completed it; then nothing is
    // left behind.
    let matched = dev.irecv(Buffer::zeroed(64), Source::Rank(0), TagSel::Tag(12), 0);
    let send = dev.isend(Buffer::from(vec![0x11; 64]), 0, 12, 0);
    drop(matched);
    send.wait_ok().unwrap();
    dev.finish().unwrap();
    let l = dev.engine.lock();
    assert_eq!((l.leases, l.keep.is_some(), l.ended.len()), (0, false, 0));
}

#[test]
fn lent_receives_keep_the_engine_and_end_closed_when_the_device_goes() {
    let _one = ONE_ENDPOINT.lock().unwrap_or_else(|p| p.into_inner());
    let Some(dev) = solo() else {
        return;
    };
    let engine = std::sync::Arc::downgrade(&dev.engine);
    // Two receives that never match, one of them forgotten: the engine
    // holds itself (once, not per request) while their leases are open.
    let pending = dev.irecv(Buffer::zeroed(32), Source::Rank(0), TagSel::Tag(13), 0);
    let forgotten = dev.irecv(Buffer::zeroed(32), Source::Rank(0), TagSel::Tag(13), 0);
    assert_eq!(
        engine.strong_count(),
        2,
        "the device's, and the leases' one"
    );
    std::mem::forget(forgotten);
    drop(dev);
    // The device's drop closed the endpoint: the wait ends at once with
    // `Closed`, its buffer back, and the engine's memory is still there
    // for the forgotten handle (leaked with it, never freed under it).
    let c = pending.wait();
    assert!(
        matches!(c.status.error.as_deref(), Some(xdev::Error::Closed)),
        "{:?}",
        c.status
    );
    assert_eq!(c.buf.len(), 32);
    assert_eq!(engine.strong_count(), 1, "kept for the forgotten lease");
}

#[test]
fn a_lent_receive_is_peeked_once_and_tested() {
    let _one = ONE_ENDPOINT.lock().unwrap_or_else(|p| p.into_inner());
    let Some(dev) = solo() else {
        return;
    };
    let r = dev.irecv(Buffer::zeroed(16), Source::Rank(0), TagSel::Tag(14), 0);
    assert!(!r.was_born_complete());
    assert!(!r.is_complete());
    dev.send(&[7; 16], 0, 14, 0).unwrap();
    let seen = dev.peek().unwrap().expect("the receive completed");
    assert_eq!((seen.id, seen.status.count), (r.id(), 16));
    assert!(dev.peek().unwrap().is_none(), "reported once");
    assert!(r.is_complete());
    let (buf, _) = r.test().expect("complete").into_result().unwrap();
    assert_eq!(&buf[..], &[7; 16]);
}

/// A relay of `below` into a request of a tracker of its own, whose hook
/// keeps the completion: the tracker, the relaying request, and where the
/// completion lands.
type Relayed = (
    xdev::devkit::Tracker,
    xdev::devkit::CoreRef,
    std::sync::Arc<std::sync::Mutex<Option<xdev::devkit::Completion>>>,
);

fn relay_into_hook(below: xdev::Request) -> Relayed {
    let tracker = xdev::devkit::Tracker::new();
    let outer = tracker.start_relay(xdev::devkit::RequestKind::Recv);
    let seen: std::sync::Arc<std::sync::Mutex<Option<xdev::devkit::Completion>>> =
        std::sync::Arc::default();
    let into = std::sync::Arc::clone(&seen);
    outer.relay(
        below,
        Box::new(move |c| {
            *into.lock().unwrap() = Some(c);
        }),
    );
    (tracker, outer, seen)
}

/// Asserts that `c` ended with `Closed` and brought back its `len`-byte
/// buffer.
fn assert_closed_with_buffer(c: &xdev::devkit::Completion, len: usize) {
    assert!(
        matches!(c.status.error.as_deref(), Some(xdev::Error::Closed)),
        "{:?}",
        c.status
    );
    assert_eq!(c.buf.len(), len);
}

#[test]
fn a_lent_receive_relayed_after_the_device_went_ends_closed_with_its_buffer() {
    let _one = ONE_ENDPOINT.lock().unwrap_or_else(|p| p.into_inner());
    let Some(dev) = solo() else {
        return;
    };
    let engine = std::sync::Arc::downgrade(&dev.engine);
    let pending = dev.irecv(Buffer::zeroed(24), Source::Rank(0), TagSel::Tag(15), 0);
    drop(dev);
    // Relaying holds the lent receive first: the queue is closed, so it is
    // held born complete with `Closed` and its buffer, and the hook runs
    // at once; the lease ends, and with it the engine.
    let (_tracker, outer, seen) = relay_into_hook(pending);
    let c = seen
        .lock()
        .unwrap()
        .take()
        .expect("the hook ran at the relay");
    assert_closed_with_buffer(&c, 24);
    assert!(outer.relayed_to().is_none(), "nothing below to wait for");
    assert_eq!(engine.strong_count(), 0, "the last lease let the engine go");
}

#[test]
fn a_held_receive_in_flight_ends_closed_when_the_device_goes() {
    let _one = ONE_ENDPOINT.lock().unwrap_or_else(|p| p.into_inner());
    let Some(dev) = solo() else {
        return;
    };
    // Relayed while the device is open, the lent receive becomes a held
    // one (a core in the queue's table); the device's drop (a forced
    // close, which lets go of the buffers without cancelling first) then
    // completes it with `Closed` and hands its buffer to the hook.
    let pending = dev.irecv(Buffer::zeroed(40), Source::Rank(0), TagSel::Tag(16), 0);
    let (_tracker, outer, seen) = relay_into_hook(pending);
    assert!(outer.relayed_to().is_some(), "held below, in flight");
    assert!(seen.lock().unwrap().is_none(), "not complete yet");
    drop(dev);
    let c = seen.lock().unwrap().take().expect("the close completed it");
    assert_closed_with_buffer(&c, 40);
}
