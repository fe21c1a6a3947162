//! The thread device's lent receives (`engine/lend.rs`) at the edges of a
//! lease: a handle dropped while a rendezvous copy into its buffer is still
//! to come, the device dropped under such a copy, and a relay.
//!
//! The set-up for both: rank 1 has one receive queued (tag 9, never sent),
//! so the next receive is posted behind it; a 1 MiB message with tag 1 is
//! already waiting as unexpected, so that receive matches it as it is
//! posted, and its copy is left to the next progress (a posting call does
//! not copy). A third receive (tag 2) is queued after it.

use std::any::Any;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use shm_ipc::ThreadDevice;

use xdev::devkit::conformance::Watchdog;
use xdev::devkit::{Completion, CoreRef, RequestKind, Tracker};
use xdev::{
    Buffer, BufferStorage, Config, Device, Error, Request, Source, TagSel, ANY_SOURCE, ANY_TAG,
};

const LEN: usize = 1 << 20;

fn open(job: &str, rank: usize) -> ThreadDevice {
    ThreadDevice::open(&Config::new(rank, 2, job)).expect("open")
}

fn payload() -> Vec<u8> {
    (0..LEN).map(|i| (i % 251) as u8).collect()
}

/// Memory that records what it held when it was freed.
struct Watched {
    mem: Vec<u8>,
    at_free: Arc<Mutex<Option<Vec<u8>>>>,
}

// SAFETY: the memory is a `Vec` this storage owns for its whole life.
unsafe impl BufferStorage for Watched {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.mem.as_mut_ptr()
    }
    fn capacity(&self) -> usize {
        self.mem.len()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        *self.at_free.lock().unwrap() = Some(std::mem::take(&mut self.mem));
    }
}

/// The set-up above: the receives (tag 9, tag 1 into `buf`, tag 2) and
/// the sender's request.
fn receives_behind_one(
    dev0: &ThreadDevice,
    dev1: &ThreadDevice,
    buf: Buffer,
) -> (Request, Request, Request, Request) {
    let send = dev0.isend(Buffer::from(payload()), 1, 1, 0);
    // The rendezvous start becomes unexpected at rank 1.
    while dev1
        .iprobe(Source::Rank(0), TagSel::Tag(1), 0)
        .unwrap()
        .is_none()
    {}
    let first = dev1.irecv(Buffer::zeroed(8), Source::Rank(0), TagSel::Tag(9), 0);
    let matched = dev1.irecv(buf, Source::Rank(0), TagSel::Tag(1), 0);
    let after = dev1.irecv(Buffer::zeroed(16), Source::Rank(0), TagSel::Tag(2), 0);
    (first, matched, after, send)
}

/// A lent receive whose handle is dropped after it matched a rendezvous
/// but before the copy: the device keeps the buffer until the copy is
/// done (the memory holds the message when it is freed), and the receive
/// queued after it is untouched (its posted id is not the dropped one's).
#[test]
fn a_dropped_lent_receive_keeps_its_buffer_until_its_copy_ends() {
    let _dog = Watchdog::arm("dropped lent receive", Duration::from_secs(60));
    let job = format!("lent-drop-{}", std::process::id());
    let (dev0, dev1) = (open(&job, 0), open(&job, 1));
    let at_free = Arc::new(Mutex::new(None));
    let watched = Watched {
        mem: vec![0; LEN],
        at_free: at_free.clone(),
    };
    let buf = Buffer::from_storage(Box::new(watched), LEN);
    let (first, matched, after, send) = receives_behind_one(&dev0, &dev1, buf);
    drop(matched);
    assert!(
        at_free.lock().unwrap().is_none(),
        "freed while its copy was still to come"
    );
    // Rank 1's progress does the copy; the sender's request then ends.
    let mut send = Some(send);
    while let Some(r) = send.take() {
        dev1.iprobe(ANY_SOURCE, ANY_TAG, 0).unwrap();
        if let Err(r) = r.test() {
            send = Some(r);
        }
    }
    let mem = at_free
        .lock()
        .unwrap()
        .take()
        .expect("freed once the copy ended");
    assert!(mem == payload(), "the copy did not land before the free");
    // The receive queued after the dropped one still takes its message.
    dev0.send(b"after", 1, 2, 0).unwrap();
    let c = after.wait();
    assert!(c.status.error.is_none(), "{:?}", c.status);
    assert_eq!(&c.buf[..5], b"after");
    assert!(first.cancel());
    assert!(first.wait().status.cancelled);
    dev0.finish().unwrap();
    dev1.finish().unwrap();
}

/// The device dropped while a lent receive's rendezvous copy is still to
/// come: the waits end (the engine closed with the device); the queued
/// receives end `Closed` with their buffers, the matched one `Closed`
/// with an empty buffer (its own is leaked: nothing may free memory a copy
/// was promised into). The sender learns that the receiver went.
#[test]
fn a_lent_receive_whose_device_goes_before_its_copy_ends_closed() {
    let _dog = Watchdog::arm("device dropped under a lent copy", Duration::from_secs(60));
    let job = format!("lent-close-{}", std::process::id());
    let (dev0, dev1) = (open(&job, 0), open(&job, 1));
    let (first, matched, after, send) = receives_behind_one(&dev0, &dev1, Buffer::zeroed(LEN));
    drop(dev1);
    let closed = |r: Request, len: usize| {
        let c = r.wait();
        assert!(
            matches!(c.status.error.as_deref(), Some(Error::Closed)),
            "{:?}",
            c.status
        );
        assert_eq!(c.buf.len(), len);
    };
    closed(first, 8);
    closed(matched, 0);
    closed(after, 16);
    let s = send.wait();
    assert!(
        matches!(
            s.status.error.as_deref(),
            Some(Error::PeerLost { rank: 1, .. })
        ),
        "{:?}",
        s.status
    );
    dev0.finish().unwrap();
}

type Seen = Arc<Mutex<Option<Completion>>>;

/// Relays `below` into a request of a tracker of its own, as a layered
/// device does; what the relay's hook was given lands in the returned slot.
fn relay(below: Request) -> (Tracker, CoreRef, Seen) {
    let tracker = Tracker::new();
    let outer = tracker.start_relay(RequestKind::Recv);
    let seen = Seen::default();
    let into = Arc::clone(&seen);
    outer.relay(below, Box::new(move |c| *into.lock().unwrap() = Some(c)));
    (tracker, outer, seen)
}

/// What the relay's hook was given, taken (`what` names it when it was
/// not given yet).
fn relayed(seen: &Seen, what: &str) -> Completion {
    seen.lock().unwrap().take().expect(what)
}

/// Lent receives relayed by a layered device (`Lender::hold_lent`): one
/// that already ended hands its completion over at once; one still queued
/// becomes a held request, completed through its core when its message
/// comes, or cancelled through that core (the cancel finds it by the
/// posted id its slot kept).
#[test]
fn relayed_lent_receives_end_through_their_held_core() {
    let _dog = Watchdog::arm("relayed lent receives", Duration::from_secs(60));
    let job = format!("lent-relay-{}", std::process::id());
    let (dev0, dev1) = (open(&job, 0), open(&job, 1));
    let queued = dev1.irecv(Buffer::zeroed(8), Source::Rank(0), TagSel::Tag(1), 0);
    let to_cancel = dev1.irecv(Buffer::zeroed(8), Source::Rank(0), TagSel::Tag(2), 0);
    let ended = dev1.irecv(Buffer::zeroed(8), Source::Rank(0), TagSel::Tag(3), 0);
    dev0.send(b"three", 1, 3, 0).unwrap();
    dev1.iprobe(ANY_SOURCE, ANY_TAG, 0).unwrap();
    let (_t1, _outer1, seen1) = relay(queued);
    let (_t2, outer2, seen2) = relay(to_cancel);
    let (_t3, _outer3, seen3) = relay(ended);

    let c = relayed(&seen3, "an ended receive relays at once");
    assert!(c.status.error.is_none(), "{:?}", c.status);
    assert_eq!(&c.buf[..5], b"three");

    assert!(seen2.lock().unwrap().is_none());
    let (core, engine) = outer2.relayed_to().expect("held below");
    assert!(engine.cancel(core), "the held receive is still queued");
    let c = relayed(&seen2, "the cancel completes it");
    assert!(c.status.cancelled, "{:?}", c.status);
    assert_eq!(c.buf.len(), 8);

    assert!(seen1.lock().unwrap().is_none());
    dev0.send(b"one", 1, 1, 0).unwrap();
    dev1.iprobe(ANY_SOURCE, ANY_TAG, 0).unwrap();
    let c = relayed(&seen1, "completed through its core");
    assert!(c.status.error.is_none(), "{:?}", c.status);
    assert_eq!(&c.buf[..3], b"one");
    dev0.finish().unwrap();
    dev1.finish().unwrap();
}
