//! Unit tests of the safe PSM2 layer: request keys, and one endpoint of
//! this process connected to itself (PSM2's `self` device).

use std::time::Duration;

use super::*;

#[test]
fn request_keys_carry_slot_and_generation() {
    let k = RequestKey::from_u64(7 << 32 | 3);
    assert_eq!(k.to_u64(), 7 << 32 | 3);
    assert_ne!(
        RequestKey::from_u64(3),
        k,
        "another generation, another key"
    );
}

/// A queue on this process's endpoint, connected to itself as peer 0, or
/// `None` (saying why) where PSM2 is unavailable. Holds the test lock of
/// the one endpoint a process may have.
fn solo_queue() -> Option<(std::sync::MutexGuard<'static, ()>, MatchedQueue)> {
    let guard = crate::psm::tests::ONE_ENDPOINT
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let lib = match Library::get() {
        Ok(l) => l,
        Err(e) => {
            println!("skipped: {e}");
            return None;
        }
    };
    let slot = lib.reserve_endpoint().expect("the test lock is held");
    assert!(
        lib.reserve_endpoint().is_err(),
        "a second endpoint slot while one is held"
    );
    let mut mq = MatchedQueue::new(Endpoint::open(slot, &lib.job_key()).ok()?).unwrap();
    let me = mq.endpoint().epid();
    mq.endpoint_mut()
        .connect(&[me], Duration::from_secs(30))
        .unwrap();
    assert_eq!(mq.endpoint().peers(), 1);
    Some((guard, mq))
}

/// `isend_unless_done` of `data` to `peer` with tag `[t, 1, 2]`, for a
/// send that must never enter the table: its `track` fails the test (`what`
/// names the send).
///
/// # Safety
/// As [`TrackedQueue::isend_unless_done`]: `data` outlives the request.
unsafe fn isend_untracked(
    q: &mut TrackedQueue<&'static str>,
    peer: usize,
    t: u32,
    data: &[u8],
    what: &str,
) -> xdev::Result<Result<(RequestKey, ()), MqStatus>> {
    let at = (data.as_ptr(), data.len());
    // SAFETY: the caller's contract.
    unsafe {
        q.isend_unless_done(peer, MqTag([t, 1, 2]), at, false, |_| {
            panic!("{what} made a payload")
        })
    }
}

fn exact(t: u32) -> Selector {
    Selector {
        from: Some(0),
        tag: MqTag([t, 1, 2]),
        mask: MqTag([u32::MAX; 3]),
    }
}

/// Sends `out` to itself (tag `[t, 1, 2]`) into `inp` in a scope, a receive
/// and a send both waited for.
fn to_itself(mq: &mut MatchedQueue, t: u32, out: &[u8], inp: &mut [u8]) {
    mq.scope(|s| {
        s.irecv(&exact(t), inp)?;
        s.isend(0, MqTag([t, 1, 2]), out)?;
        s.wait_all()
    })
    .unwrap();
}

#[test]
fn a_queue_talks_to_itself_and_owns_its_requests() {
    let Some((_guard, mut mq)) = solo_queue() else {
        return;
    };
    // A scope: a receive and a send of its own, both waited for.
    let (out, mut inp) = (vec![7u8; 100], vec![0u8; 100]);
    to_itself(&mut mq, 5, &out, &mut inp);
    assert_eq!(inp, out);
    assert!(mq.iprobe(&exact(5)).is_none());

    let mut q: TrackedQueue<_> = TrackedQueue::new(mq);
    let mut buf = vec![0u8; 16];
    // SAFETY: `buf` outlives the request, which is cancelled below before
    // `buf` is read.
    let r = unsafe { q.irecv(&exact(9), (buf.as_mut_ptr(), buf.len()), "recv") }.unwrap();
    assert_eq!(q.get(r), Some(&"recv"));
    assert_eq!(q.cancel(r), Some("recv"), "unmatched: cancelled");
    assert_eq!(q.cancel(r), None, "the key names nothing any more");
    assert!(q.test(r).is_none());

    // The slot is reused under a new generation: the old key stays dead.
    // SAFETY: `buf` outlives the request, completed below before it is read.
    let r2 = unsafe { q.irecv(&exact(9), (buf.as_mut_ptr(), buf.len()), "again") }.unwrap();
    assert_ne!(r2, r);
    assert!(q.get(r).is_none());
    let data = [3u8; 16];
    // SAFETY: `data` outlives the request, completed below.
    let s = unsafe { q.isend(0, MqTag([9, 1, 2]), (data.as_ptr(), 16), false, "send") }.unwrap();
    let mut seen = Vec::new();
    let mut batch = CompletionBatch::new();
    while seen.len() < 2 {
        let more = q.collect(&mut batch);
        for st in batch.statuses() {
            assert!(st.is_ok());
            seen.push(q.take_completed(st).expect("both are in the table"));
        }
        assert!(!more, "two completions fill no batch");
    }
    seen.sort_by_key(|(_, p)| *p);
    assert_eq!(seen, vec![(r2, "again"), (s, "send")]);
    assert_eq!(buf, data);
    assert!(q.is_empty());

    // Closing hands back what is outstanding.
    // SAFETY: `buf` outlives the queue, which is closed below.
    unsafe { q.irecv(&exact(11), (buf.as_mut_ptr(), buf.len()), "left") }.unwrap();
    assert_eq!(q.len(), 1);
    let (left, lent) = q.close(Duration::from_secs(1));
    assert_eq!((left, lent), (vec!["left"], vec![]));
    let lib = Library::get().unwrap();
    drop(lib.reserve_endpoint().expect("the close released the slot"));
}

#[test]
fn a_send_done_inside_its_post_never_enters_the_table() {
    let Some((_guard, mq)) = solo_queue() else {
        return;
    };
    let mut q: TrackedQueue<_> = TrackedQueue::new(mq);
    let data = [5u8; 24];
    // An eager send to itself: PSM2 copies it out inside the post, so the
    // test there ends it, and `track` is never called.
    // SAFETY: `data` outlives the call; when it returns the status, PSM2
    // no longer reads `data`.
    let done =
        unsafe { isend_untracked(&mut q, 0, 4, &data, "a send done inside its post") }.unwrap();
    let st = done.expect_err("an eager send ends inside its post");
    assert!(st.is_ok());
    assert!(q.is_empty(), "no table entry for it");
    // It arrives whole. (The other branch, a send still in flight after
    // its post entering the table under `next_key`, needs a second
    // process: PSM2's self device completes every send inside the post.
    // The conformance cases `ssend_semantics` and `large_64mib` take it.)
    let mut buf = [0u8; 24];
    let st = q.recv(&exact(4), &mut buf).unwrap();
    assert_eq!((st.nbytes(), buf), (24, data));
    assert!(q.is_empty());
}

#[test]
fn completions_come_in_batches_until_none_is_left() {
    // 40 receives, then 40 sends that match them: 80 completions, more
    // than two batches' worth. The buffers are declared before the queue,
    // so that they outlive it even if an assertion unwinds with requests
    // outstanding (the queue's drop closes the endpoint first).
    let mut bufs = vec![[0u8; 8]; 40];
    let data: Vec<[u8; 8]> = (0..40u8).map(|i| [i; 8]).collect();
    let Some((_guard, mq)) = solo_queue() else {
        return;
    };
    let mut q: TrackedQueue<_> = TrackedQueue::new(mq);
    let mut want = Vec::new();
    for (i, b) in bufs.iter_mut().enumerate() {
        // SAFETY: `bufs` outlives the queue (declared first), and every
        // request is collected below before it is read.
        let k = unsafe { q.irecv(&exact(100 + i as u32), (b.as_mut_ptr(), 8), i) }.unwrap();
        want.push((k, i));
    }
    for (i, d) in data.iter().enumerate() {
        let t = MqTag([100 + i as u32, 1, 2]);
        // SAFETY: `data` outlives the queue (declared first).
        let k = unsafe { q.isend(0, t, (d.as_ptr(), 8), false, 40 + i) }.unwrap();
        want.push((k, 40 + i));
    }
    let (mut seen, mut full_batches) = (Vec::new(), 0);
    let mut batch = CompletionBatch::new();
    while seen.len() < want.len() {
        let more = q.collect(&mut batch);
        full_batches += usize::from(more);
        assert!(batch.statuses().len() <= 32);
        for st in batch.statuses() {
            assert!(st.is_ok());
            seen.push(q.take_completed(st).expect("every one is in the table"));
        }
    }
    assert!(
        full_batches >= 2,
        "80 completions took {full_batches} full batches"
    );
    seen.sort_by_key(|&(k, p)| (p, k.to_u64()));
    want.sort_by_key(|&(k, p)| (p, k.to_u64()));
    assert_eq!(seen, want, "each request reported once, with its payload");
    assert!(q.is_empty());
    assert_eq!(bufs, data);
}

#[test]
fn a_post_that_fails_gives_its_payload_back_and_tracks_nothing() {
    // Declared before the queue, so they outlive it whatever happens.
    let (mut buf, data) = ([0u8; 8], [1u8; 8]);
    let Some((_guard, mq)) = solo_queue() else {
        return;
    };
    let mut q: TrackedQueue<_> = TrackedQueue::new(mq);
    // Peer 5 is not connected: PSM2 never sees either post.
    let from_5 = Selector {
        from: Some(5),
        ..exact(3)
    };
    // SAFETY: `buf` outlives the queue; the post fails, so PSM2 never has
    // it anyway.
    let r = unsafe { q.irecv(&from_5, (buf.as_mut_ptr(), 8), "recv") };
    let (e, payload) = r.expect_err("a receive from a peer not connected");
    assert!(matches!(e, xdev::Error::Config(_)), "{e:?}");
    assert_eq!(payload, "recv", "the payload comes back with the error");
    // SAFETY: as above.
    let s = unsafe { isend_untracked(&mut q, 5, 3, &data, "a send whose post failed") };
    assert!(matches!(s, Err(xdev::Error::Config(_))), "{s:?}");
    assert!(q.is_empty(), "neither post entered the table");
}

#[test]
fn a_lent_post_that_fails_gives_its_payload_and_its_slot_back() {
    // Declared before the queue, so it outlives it whatever happens.
    let mut buf = [0u8; 8];
    let Some((_guard, mq)) = solo_queue() else {
        return;
    };
    let mut q: TrackedQueue<(), &str> = TrackedQueue::new(mq);
    let from_5 = Selector {
        from: Some(5),
        ..exact(3)
    };
    // SAFETY: `buf` outlives the queue; the post fails, so PSM2 never has
    // it.
    let r = unsafe { q.irecv_lent(&from_5, (buf.as_mut_ptr(), 8), "lent") };
    let (e, payload) = r.expect_err("a receive from a peer not connected");
    assert!(
        matches!(e, xdev::Error::Config(ref m) if m.contains("Some(5)")),
        "{e:?}"
    );
    assert_eq!(payload, "lent", "the payload comes back with the error");
    assert!(q.is_empty(), "the post entered no table");
    // The slot it claimed went back unused: the next lent receive gets
    // slot 0 in its first generation.
    // SAFETY: `buf` outlives the queue, which is closed below before `buf`
    // is read.
    let k = unsafe { q.irecv_lent(&exact(3), (buf.as_mut_ptr(), 8), "next") }.unwrap();
    assert_eq!(k.to_u64(), 1 << 63);
    assert_eq!(q.len(), 1);
    let (_, lent) = q.close(Duration::from_secs(1));
    assert_eq!(lent, vec!["next"]);
}

#[test]
fn an_eager_send_to_a_peer_not_connected_is_refused_and_sends_nothing() {
    let Some((_guard, mut mq)) = solo_queue() else {
        return;
    };
    // `send` is the eager path the device's `isend` takes for a short
    // message to another rank; a peer with no address is refused before
    // PSM2 sees the buffer.
    let data = [4u8; 8];
    let e = mq
        .send(5, MqTag([13, 1, 2]), &data)
        .expect_err("peer 5 is not connected");
    assert!(
        matches!(e, xdev::Error::Config(ref m) if m.contains("peer 5")),
        "{e:?}"
    );
    assert!(mq.iprobe(&exact(13)).is_none(), "nothing was sent");
    // The queue is unharmed: a message to itself still goes through.
    let mut inp = [0u8; 8];
    to_itself(&mut mq, 13, &data, &mut inp);
    assert_eq!(inp, data);
}

#[test]
fn lent_receives_have_a_table_of_their_own() {
    // Declared before the queue, so they outlive it whatever happens.
    let (mut a, mut b, mut c) = ([0u8; 8], [0u8; 8], [0u8; 8]);
    let (one, two) = ([1u8; 8], [2u8; 8]);
    let Some((_guard, mq)) = solo_queue() else {
        return;
    };
    let mut q: TrackedQueue<&str, &str> = TrackedQueue::new(mq);
    // SAFETY: the buffers outlive the queue (declared first), and are read
    // only once their request left the table.
    let held = unsafe { q.irecv(&exact(20), (a.as_mut_ptr(), 8), "tracked") }.unwrap();
    // SAFETY: the buffers outlive the queue (declared first), and are read
    // only once their request left the table.
    let lent = unsafe { q.irecv_lent(&exact(21), (b.as_mut_ptr(), 8), "lent") }.unwrap();
    assert!(lent.is_lent() && !held.is_lent());
    assert_eq!(
        held.to_u64() & !(1 << 63),
        lent.to_u64() & !(1 << 63),
        "slot 0, generation 0 of each"
    );
    // Each table answers only for its own keys.
    assert_eq!((q.get(lent), q.lent(held)), (None, None));
    assert_eq!((q.cancel(lent), q.cancel_lent(held)), (None, None));
    assert!(matches!(
        q.test_lent(held, &mut StatusSlot::new(), |_| ()),
        LentTest::Unknown
    ));
    assert_eq!(
        (q.get(held), q.lent(lent)),
        (Some(&"tracked"), Some(&"lent"))
    );
    assert_eq!(q.len(), 2);

    // Not matched yet: pending; once a send matches it, done, with its status.
    assert!(matches!(
        q.test_lent(lent, &mut StatusSlot::new(), |_| ()),
        LentTest::Pending
    ));
    q.send(0, MqTag([21, 1, 2]), &one).unwrap();
    q.poll();
    let mut slot = StatusSlot::new();
    match q.test_lent(lent, &mut slot, |p| *p) {
        LentTest::Done(p) => {
            assert_eq!(p, "lent");
            let st = slot.status();
            assert_eq!((st.nbytes(), st.tag()), (8, MqTag([21, 1, 2])));
        }
        LentTest::Pending => panic!("a matched eager receive is done after a poll"),
        LentTest::Unknown => panic!("the key named it"),
    }
    assert_eq!(b, one);
    assert!(
        matches!(q.test_lent(lent, &mut slot, |_| ()), LentTest::Unknown),
        "it left the table"
    );

    // The slot is reused under a new generation; a collecting round takes a
    // lent completion only through `take_completed_lent`.
    // SAFETY: the buffers outlive the queue (declared first), and are read
    // only once their request left the table.
    let again = unsafe { q.irecv_lent(&exact(22), (c.as_mut_ptr(), 8), "again") }.unwrap();
    assert!(again.is_lent() && again != lent);
    assert!(q.lent(lent).is_none());
    q.send(0, MqTag([22, 1, 2]), &two).unwrap();
    let mut batch = CompletionBatch::new();
    let mut taken = None;
    while taken.is_none() {
        q.collect(&mut batch);
        for st in batch.statuses() {
            assert!(RequestKey::of(st).is_lent());
            assert!(q.take_completed(st).is_none(), "not the tracked table's");
            taken = q.take_completed_lent(st);
        }
    }
    assert_eq!(taken, Some((again, "again")));
    assert_eq!(c, two);

    // An unmatched lent receive is cancelled; closing hands back the rest
    // of both tables.
    // SAFETY: the buffers outlive the queue (declared first), and are read
    // only once their request left the table.
    let gone = unsafe { q.irecv_lent(&exact(23), (c.as_mut_ptr(), 8), "cancelled") }.unwrap();
    assert_eq!(q.cancel_lent(gone), Some("cancelled"));
    assert_eq!(q.cancel_lent(gone), None);
    // SAFETY: the buffers outlive the queue (declared first), and are read
    // only once their request left the table.
    unsafe { q.irecv_lent(&exact(24), (b.as_mut_ptr(), 8), "left") }.unwrap();
    assert_eq!(
        q.lent_iter().map(|(_, p)| *p).collect::<Vec<_>>(),
        vec!["left"]
    );
    assert_eq!(q.len(), 2);
    let (left, lent_left) = q.close(Duration::from_secs(1));
    assert_eq!((left, lent_left), (vec!["tracked"], vec!["left"]));
}
