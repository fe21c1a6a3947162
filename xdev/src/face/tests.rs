use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;
use crate::{Device, RequestCore, TAG_UB};

/// A transport that counts the calls that reach it and completes every
/// operation at once (the face's checks are what is under test here; the
/// devices' own behaviour is the conformance suite's).
#[derive(Default)]
struct Counting {
    tracker: Tracker,
    calls: AtomicUsize,
    closed: std::sync::atomic::AtomicBool,
}

impl Progress for Counting {
    fn progress(&self) {}
    fn wait(&self, _: &RequestCore) {}
    fn cancel(&self, _: &crate::CoreRef) -> bool {
        false
    }
}

impl Transport for Counting {
    const NAME: &'static str = "counting";
    fn seat(&self) -> Seat<'_> {
        Seat::new(0, 2, &self.tracker, &self.closed)
    }
    fn blocking_send(self: &Arc<Self>, _: &[u8], _: SendTo) -> Result<()> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
    fn start_send(self: &Arc<Self>, buf: Buffer, to: SendTo) -> Request {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let env = to.envelope();
        let n = buf.len();
        self.tracker.completed(buf, Status::ok(env, n))
    }
    fn recv_into(self: &Arc<Self>, _: &mut [u8], p: Pattern) -> Result<Status> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let env = Envelope {
            source: 1,
            tag: 0,
            context: p.context,
        };
        Ok(Status::ok(env, 0))
    }
    fn start_recv(self: &Arc<Self>, buf: Buffer, p: Pattern) -> Request {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let env = Envelope {
            source: 1,
            tag: 0,
            context: p.context,
        };
        self.tracker.completed(buf, Status::ok(env, 0))
    }
    fn probe(&self, _: Pattern, _: bool) -> Result<Option<Status>> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        Ok(None)
    }
    fn peek(&self) -> Result<Option<Peeked>> {
        Ok(None)
    }
    fn finish(&self) -> Result<()> {
        self.closed.store(true, Ordering::Relaxed);
        Ok(())
    }
}

struct CountingDevice {
    engine: Arc<Counting>,
}

impl Face for CountingDevice {
    type Engine = Counting;
    fn engine(&self) -> &Arc<Counting> {
        &self.engine
    }
}

fn device() -> CountingDevice {
    CountingDevice {
        engine: Arc::new(Counting::default()),
    }
}

#[test]
fn invalid_arguments_never_reach_the_transport_and_give_the_buffer_back() {
    let face = device();
    let calls = || face.engine.calls.load(Ordering::Relaxed);
    assert!(matches!(
        face.send(b"x", 2, 0, 0),
        Err(Error::InvalidRank { rank: 2, size: 2 })
    ));
    assert!(matches!(
        face.ssend(b"x", 1, -1, 0),
        Err(Error::InvalidTag(-1))
    ));
    let mut b = [0u8; 4];
    assert!(matches!(
        face.recv(&mut b, Source::Rank(5), TagSel::Any, 0),
        Err(Error::InvalidRank { rank: 5, .. })
    ));
    assert!(face.iprobe(Source::Any, TagSel::Tag(-2), 0).is_err());
    let done = face.isend(Buffer::from(vec![7u8; 3]), 9, 0, 3).wait();
    assert!(matches!(
        done.status.error.as_deref(),
        Some(Error::InvalidRank { rank: 9, .. })
    ));
    assert_eq!(done.buf.len(), 3, "the refused send's buffer comes back");
    let done = face
        .irecv(Buffer::zeroed(8), Source::Any, TagSel::Tag(-3), 3)
        .wait();
    assert!(matches!(
        done.status.error.as_deref(),
        Some(Error::InvalidTag(-3))
    ));
    assert_eq!(done.buf.len(), 8);
    assert_eq!(calls(), 0, "nothing invalid reached the transport");

    // Valid arguments do, each once.
    face.send(b"x", 1, 0, 0).unwrap();
    face.recv(&mut b, Source::Any, TagSel::Any, 0).unwrap();
    assert!(face
        .iprobe(Source::Rank(1), TagSel::Tag(0), 0)
        .unwrap()
        .is_none());
    face.irecv(Buffer::zeroed(1), Source::Any, TagSel::Any, 0)
        .wait();
    assert_eq!(calls(), 4);
    assert_eq!(face.name(), "counting");
}

#[test]
fn after_finish_operations_fail_with_closed_before_the_transport() {
    let face = device();
    face.finish().unwrap();
    assert!(matches!(face.send(b"x", 1, 0, 0), Err(Error::Closed)));
    assert!(matches!(
        face.probe(Source::Any, TagSel::Any, 0),
        Err(Error::Closed)
    ));
    let done = face.issend(Buffer::from(vec![1u8]), 1, 0, 0).wait();
    assert!(matches!(done.status.error.as_deref(), Some(Error::Closed)));
    assert_eq!(done.buf.len(), 1);
    assert_eq!(face.engine.calls.load(Ordering::Relaxed), 0);
}

#[test]
fn a_send_target_is_two_words_and_gives_back_what_it_was_made_of() {
    assert_eq!(
        std::mem::size_of::<SendTo>(),
        2 * std::mem::size_of::<usize>()
    );
    for (dest, tag, context, sync) in [
        (0, 0, 0, false),
        (1, TAG_UB, u32::MAX, true),
        (7, -1, 0x8000_0000, false),
        (usize::MAX >> 1, i32::MIN, 1, true),
    ] {
        let to = SendTo::new(dest, tag, context, sync);
        assert_eq!(to.parts(), (dest, tag, context, sync), "{to:?}");
        assert_eq!(
            to.envelope(),
            Envelope {
                source: dest,
                tag,
                context
            }
        );
    }
    // A rank no job has stays out of range, and does not become a sync flag.
    let to = SendTo::new(usize::MAX, 0, 0, false);
    assert!(!to.sync());
    assert!(to.dest() >= usize::MAX >> 1);
    let face = device();
    let done = face.isend(Buffer::from(vec![1u8]), usize::MAX, 0, 0).wait();
    assert!(matches!(
        done.status.error.as_deref(),
        Some(Error::InvalidRank { .. })
    ));
    // The face checks the rank as given, before packing it: the error and
    // the refused request's envelope name it exactly.
    assert!(matches!(
        done.status.error.as_deref(),
        Some(Error::InvalidRank {
            rank: usize::MAX,
            ..
        })
    ));
    assert_eq!(done.status.source, usize::MAX);
    assert!(matches!(
        face.send(b"x", usize::MAX, 0, 0),
        Err(Error::InvalidRank {
            rank: usize::MAX,
            ..
        })
    ));
}
