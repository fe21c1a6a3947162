//! The handle's side of lent requests, against a device that records what
//! the handle asked of it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::super::{RequestKind, Tracker};
use super::*;
use crate::{Envelope, RequestId, Status};

/// A lending device with one operation: it records each call, keeps the
/// buffers handed to it, and holds itself while the lease is open.
#[derive(Default)]
struct Desk {
    calls: Mutex<Vec<(&'static str, u64)>>,
    handed: Mutex<Vec<Buffer>>,
    keep: Mutex<Option<Arc<Desk>>>,
    done: AtomicBool,
    cancels: AtomicBool,
}

impl Desk {
    /// A desk that holds itself (as a device does while a lease is open).
    fn open() -> Arc<Desk> {
        let d = Arc::new(Desk::default());
        *d.keep.lock().unwrap() = Some(d.clone());
        d
    }

    fn call(&self, what: &'static str, token: u64) {
        self.calls.lock().unwrap().push((what, token));
    }

    fn calls(&self) -> Vec<(&'static str, u64)> {
        self.calls.lock().unwrap().clone()
    }

    fn end(&self) -> KeepAlive {
        self.keep
            .lock()
            .unwrap()
            .take()
            .map(|d| d as Arc<dyn Lender>)
    }

    /// A request lent out under `token` with `bytes`.
    fn lend(self: &Arc<Self>, token: u64, bytes: &[u8]) -> Request {
        // SAFETY: the desk holds itself (`keep`) until a call that ends the
        // lease hands that reference back.
        unsafe {
            Request::lent(
                RequestId(40 + token),
                token,
                Buffer::from(bytes.to_vec()),
                &**self,
            )
        }
    }
}

fn status(token: u64, len: usize) -> Status {
    let env = Envelope {
        source: token as usize,
        tag: 3,
        context: 0,
    };
    Status::ok(env, len)
}

impl Lender for Desk {
    fn test_lent(&self, token: u64) -> bool {
        self.call("test", token);
        self.done.load(Ordering::Relaxed)
    }
    fn wait_lent(&self, token: u64, buf: Buffer, keep: &mut KeepAlive) -> Completion {
        self.call("wait", token);
        *keep = self.end();
        let len = buf.len();
        Completion {
            buf,
            status: status(token, len),
        }
    }
    fn cancel_lent(&self, token: u64) -> bool {
        self.call("cancel", token);
        self.cancels.load(Ordering::Relaxed)
    }
    fn drop_lent(&self, token: u64, buf: Buffer) -> KeepAlive {
        self.call("drop", token);
        self.handed.lock().unwrap().push(buf);
        self.end()
    }
    fn hold_lent(&self, token: u64, buf: Buffer) -> (Request, KeepAlive) {
        self.call("hold", token);
        let len = buf.len();
        (
            Tracker::new().completed(buf, status(token, len)),
            self.end(),
        )
    }
}

#[test]
fn a_lent_request_waits_through_its_device_and_lets_it_go_after() {
    let desk = Desk::open();
    let req = desk.lend(7, b"abc");
    assert_eq!(req.id(), RequestId(47));
    assert!(!req.was_born_complete());
    assert_eq!(Arc::strong_count(&desk), 2, "the desk holds itself");
    let c = req.wait();
    assert_eq!(
        (&c.buf[..], c.status.source, c.status.count),
        (&b"abc"[..], 7, 3)
    );
    assert_eq!(desk.calls(), [("wait", 7)]);
    assert_eq!(Arc::strong_count(&desk), 1, "the keep-alive was dropped");
}

#[test]
fn dropping_a_lent_request_hands_its_buffer_to_its_device() {
    let desk = Desk::open();
    drop(desk.lend(8, b"held"));
    assert_eq!(desk.calls(), [("drop", 8)]);
    let handed = desk.handed.lock().unwrap();
    assert_eq!(handed.len(), 1);
    assert_eq!(&handed[0][..], b"held", "the device has the buffer");
    assert_eq!(Arc::strong_count(&desk), 1);
}

#[test]
fn an_unwind_drops_a_lent_request_into_its_device() {
    let desk = Desk::open();
    let req = desk.lend(9, b"x");
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        let _req = req;
        panic!("unwinding with a request in hand");
    }));
    assert!(r.is_err());
    assert_eq!(desk.calls(), [("drop", 9)]);
    assert_eq!(desk.handed.lock().unwrap().len(), 1);
}

#[test]
fn test_and_cancel_ask_the_device() {
    let desk = Desk::open();
    let req = desk.lend(5, b"t");
    assert!(!req.is_complete());
    let req = req.test().expect_err("not done");
    assert!(!req.cancel(), "the device says it did not cancel");
    desk.cancels.store(true, Ordering::Relaxed);
    assert!(req.cancel());
    let req = req
        .take_if_done()
        .expect_err("cannot tell without the device");
    desk.done.store(true, Ordering::Relaxed);
    let c = req.test().expect("done");
    assert_eq!(&c.buf[..], b"t");
    assert_eq!(
        desk.calls(),
        [
            ("test", 5),
            ("test", 5),
            ("cancel", 5),
            ("cancel", 5),
            ("test", 5),
            ("wait", 5)
        ]
    );
}

#[test]
fn a_relayed_lent_request_is_held_first() {
    let desk = Desk::open();
    let outer_t = Arc::new(Tracker::new());
    let outer = outer_t.start_relay(RequestKind::Recv);
    let got = Arc::new(Mutex::new(None));
    let g = got.clone();
    outer.relay(
        desk.lend(6, b"relay"),
        Box::new(move |c: Completion| *g.lock().unwrap() = Some(c)),
    );
    assert_eq!(desk.calls(), [("hold", 6)]);
    let c = got.lock().unwrap().take().expect("the hook ran");
    assert_eq!((&c.buf[..], c.status.source), (&b"relay"[..], 6));
    assert_eq!(Arc::strong_count(&desk), 1);
}

#[test]
fn an_unposted_lent_request_gives_its_buffer_back_without_its_device() {
    let desk = Desk::open();
    let req = desk.lend(11, b"back");
    let ptr = {
        let super::super::handle::Inner::Own(l) = &*req.view() else {
            panic!("a lent request")
        };
        l.buf.as_ptr()
    };
    // SAFETY: the desk never started operation 11.
    let buf = unsafe { req.take_back_unposted() };
    assert_eq!(&buf[..], b"back");
    assert_eq!(buf.as_ptr(), ptr, "the same memory, unmoved");
    assert!(desk.calls().is_empty(), "no call reached the device");
    assert!(desk.handed.lock().unwrap().is_empty());
    // The lease it never opened stays the device's to end.
    assert_eq!(Arc::strong_count(&desk), 2);
    drop(desk.end());
}

#[test]
fn taking_back_a_request_that_is_not_lent_waits_for_it() {
    let buf = Buffer::from(b"done".to_vec());
    let req = Tracker::new().completed(buf, status(3, 4));
    // SAFETY: not a lent request: no engine is involved.
    let buf = unsafe { req.take_back_unposted() };
    assert_eq!(&buf[..], b"done");
}

/// A buffer that came back from a lent request and then went into a
/// request born complete carries no lease any more: dropping that request
/// calls no device.
#[test]
fn a_buffer_back_from_a_lease_carries_no_lease_into_its_next_request() {
    let desk = Desk::open();
    desk.done.store(true, Ordering::Relaxed);
    let c = desk.lend(12, b"once").wait();
    assert_eq!(desk.calls(), [("wait", 12)]);
    let t = Tracker::new();
    let born = t.completed(c.buf, Status::ok(Envelope::untagged(0, 0), 4));
    assert!(born.was_born_complete());
    assert!(born.is_complete());
    assert!(!born.cancel(), "nothing to cancel, and no device asked");
    drop(born);
    assert_eq!(
        desk.calls(),
        [("wait", 12)],
        "no call after the lease ended"
    );
}
