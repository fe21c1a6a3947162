use super::buckets::SHRINK_MIN;
use super::*;

type Engine = MatchingEngine<&'static str, u32>;

fn env(source: Rank, tag: Tag, context: Context) -> Envelope {
    Envelope {
        source,
        tag,
        context,
    }
}

fn pat(source: Source, tag: TagSel, context: Context) -> Pattern {
    Pattern::new(source, tag, context)
}

fn queued_id<M, R>(p: Posted<M, R>) -> PostedId {
    match p {
        Posted::Queued(id) => id,
        Posted::Matched { .. } => panic!("expected the receive to queue"),
    }
}

fn matched_recv<M, R>(d: Delivered<M, R>) -> (R, M) {
    match d {
        Delivered::Matched { recv, msg, .. } => (recv, msg),
        Delivered::Queued => panic!("expected the message to match"),
    }
}

fn matched_msg<M, R>(p: Posted<M, R>) -> (Envelope, M) {
    match p {
        Posted::Matched { env, msg, .. } => (env, msg),
        Posted::Queued(_) => panic!("expected the receive to match"),
    }
}

const R0: Source = Source::Rank(0);
const R1: Source = Source::Rank(1);
const T5: TagSel = TagSel::Tag(5);
const T6: TagSel = TagSel::Tag(6);

#[test]
fn empty_engine() {
    let mut e = Engine::new();
    assert!(e.is_empty());
    assert_eq!(e.posted_len(), 0);
    assert_eq!(e.unexpected_len(), 0);
    assert!(e.probe(&pat(Source::Any, TagSel::Any, 0)).is_none());
    assert!(e.take(&pat(Source::Any, TagSel::Any, 0)).is_none());
    assert!(e.drain_unexpected().is_empty());
    assert!(e.remove_posted_where(|_, _| true).is_empty());
    assert!(e.cancel(PostedId(0)).is_none());
    assert!(format!("{e:?}").contains("MatchingEngine"));
}

#[test]
fn message_matches_earliest_posted_receive() {
    let mut e = Engine::new();
    let _ = queued_id(e.post(pat(R0, T6, 0), 1));
    let _ = queued_id(e.post(pat(R0, T5, 0), 2));
    let _ = queued_id(e.post(pat(Source::Any, T5, 0), 3));
    let _ = queued_id(e.post(pat(R0, TagSel::Any, 0), 4));
    let d = e.deliver(env(0, 5, 0), "a");
    assert_eq!(
        d,
        Delivered::Matched {
            recv: 2,
            pattern: pat(R0, T5, 0),
            msg: "a"
        }
    );
    assert_eq!(matched_recv(e.deliver(env(0, 5, 0), "b")), (3, "b"));
    assert_eq!(matched_recv(e.deliver(env(0, 5, 0), "c")), (4, "c"));
    assert_eq!(e.deliver(env(0, 5, 0), "d"), Delivered::Queued);
    assert_eq!(e.posted_len(), 1);
    assert_eq!(e.unexpected_len(), 1);
}

#[test]
fn wildcard_receive_posted_first_wins_over_later_specific() {
    let mut e = Engine::new();
    let _ = queued_id(e.post(pat(Source::Any, TagSel::Any, 0), 1));
    let _ = queued_id(e.post(pat(R1, T5, 0), 2));
    assert_eq!(matched_recv(e.deliver(env(1, 5, 0), "x")), (1, "x"));
    assert_eq!(matched_recv(e.deliver(env(1, 5, 0), "y")), (2, "y"));
    assert!(e.is_empty());
}

#[test]
fn receive_matches_earliest_arrived_message() {
    let mut e = Engine::new();
    assert_eq!(e.deliver(env(1, 6, 0), "a"), Delivered::Queued);
    assert_eq!(e.deliver(env(0, 5, 0), "b"), Delivered::Queued);
    assert_eq!(e.deliver(env(1, 5, 0), "c"), Delivered::Queued);
    assert_eq!(e.deliver(env(0, 5, 0), "d"), Delivered::Queued);
    assert_eq!(
        matched_msg(e.post(pat(Source::Any, T5, 0), 1)),
        (env(0, 5, 0), "b")
    );
    assert_eq!(
        matched_msg(e.post(pat(R1, TagSel::Any, 0), 2)),
        (env(1, 6, 0), "a")
    );
    assert_eq!(
        e.post(pat(Source::Any, TagSel::Any, 0), 3),
        Posted::Matched {
            env: env(1, 5, 0),
            msg: "c",
            recv: 3
        }
    );
    assert_eq!(matched_msg(e.post(pat(R0, T5, 0), 4)), (env(0, 5, 0), "d"));
    assert!(e.is_empty());
}

#[test]
fn non_overtaking_under_any_source_and_any_tag() {
    // Messages from one sender are received in send order whatever the
    // wildcards, interleaved with another sender's.
    let mut e = MatchingEngine::<u32, u32>::new();
    for i in 0..10u32 {
        let _ = e.deliver(env(0, (i % 3) as Tag, 7), i);
        let _ = e.deliver(env(1, (i % 2) as Tag, 7), 100 + i);
    }
    let mut from0 = Vec::new();
    let mut from1 = Vec::new();
    for k in 0..20u32 {
        // Alternately any/any (takes the globally earliest) and
        // rank 1/any: each pair consumes one message of each sender.
        let p = if k % 2 == 0 {
            pat(Source::Any, TagSel::Any, 7)
        } else {
            pat(R1, TagSel::Any, 7)
        };
        let (env, m) = matched_msg(e.post(p, k));
        if env.source == 0 {
            from0.push(m);
        } else {
            from1.push(m);
        }
    }
    assert_eq!(from0, (0..10).collect::<Vec<_>>());
    assert_eq!(from1, (100..110).collect::<Vec<_>>());

    // The other direction: receives posted first, then messages arrive.
    for k in 0..6u32 {
        let p = if k % 2 == 0 {
            pat(Source::Any, TagSel::Any, 7)
        } else {
            pat(R0, TagSel::Any, 7)
        };
        let _ = queued_id(e.post(p, k));
    }
    let got: Vec<_> = (0..6u32)
        .map(|i| matched_recv(e.deliver(env(0, i as Tag, 7), i)))
        .collect();
    assert_eq!(got, (0..6u32).map(|i| (i, i)).collect::<Vec<_>>());
}

#[test]
fn any_source_takes_earliest_across_sources() {
    let mut e = MatchingEngine::<u32, u32>::new();
    for (i, s) in [3usize, 1, 2, 1, 3, 0].into_iter().enumerate() {
        let _ = e.deliver(env(s, 5, 0), i as u32);
    }
    let order: Vec<u32> = (0..6)
        .map(|_| {
            e.take(&pat(Source::Any, T5, 0))
                .map(|(_, m)| m)
                .unwrap_or(99)
        })
        .collect();
    assert_eq!(order, vec![0, 1, 2, 3, 4, 5]);
}

#[test]
fn context_isolation() {
    let mut e = Engine::new();
    let _ = queued_id(e.post(pat(Source::Any, TagSel::Any, 1), 1));
    assert_eq!(e.deliver(env(0, 5, 2), "c2"), Delivered::Queued);
    assert!(e.probe(&pat(Source::Any, TagSel::Any, 1)).is_none());
    assert!(e.take(&pat(R0, T5, 3)).is_none());
    assert_eq!(matched_recv(e.deliver(env(0, 5, 1), "c1")), (1, "c1"));
    assert_eq!(matched_msg(e.post(pat(R0, T5, 2), 2)), (env(0, 5, 2), "c2"));
    assert!(e.is_empty());
}

#[test]
fn cancel_queued_and_matched() {
    let mut e = Engine::new();
    let a = queued_id(e.post(pat(R0, T5, 0), 1));
    let b = queued_id(e.post(pat(Source::Any, T5, 0), 2));
    let c = queued_id(e.post(pat(R0, T5, 0), 3));
    assert_ne!(a, b);
    assert_eq!(e.cancel(a), Some(1));
    assert_eq!(e.cancel(a), None, "cancelling twice");
    assert_eq!(matched_recv(e.deliver(env(0, 5, 0), "m")), (2, "m"));
    assert_eq!(e.cancel(b), None, "already matched");
    assert_eq!(e.posted_len(), 1);
    assert_eq!(e.cancel(c), Some(3));
    assert_eq!(e.cancel(PostedId(12345)), None, "never existed");
    assert!(e.is_empty());
    // Ids are not reused.
    let d = queued_id(e.post(pat(R0, T5, 0), 4));
    assert!(![a, b, c].contains(&d));
    assert_eq!(d.as_u64(), 3);
}

#[test]
fn cancel_wildcard_in_the_middle_keeps_order() {
    let mut e = Engine::new();
    let ids: Vec<_> = (0..5)
        .map(|k| queued_id(e.post(pat(Source::Any, TagSel::Any, 0), k)))
        .collect();
    assert_eq!(e.cancel(ids[2]), Some(2));
    let got: Vec<u32> = (0..4)
        .map(|_| matched_recv(e.deliver(env(9, 9, 0), "m")).0)
        .collect();
    assert_eq!(got, vec![0, 1, 3, 4]);
}

#[test]
fn remove_posted_where_in_posting_order() {
    let mut e = Engine::new();
    let _ = queued_id(e.post(pat(R1, T5, 0), 1));
    let _ = queued_id(e.post(pat(Source::Any, T5, 0), 2));
    let _ = queued_id(e.post(pat(R0, T5, 1), 3));
    let _ = queued_id(e.post(pat(R1, TagSel::Any, 1), 4));
    let _ = queued_id(e.post(pat(R1, T6, 0), 5));
    let mut seen = Vec::new();
    let removed = e.remove_posted_where(|p, r| {
        seen.push(*r);
        p.source == R1
    });
    assert_eq!(seen, vec![1, 2, 3, 4, 5], "pred is called in posting order");
    assert_eq!(removed, vec![1, 4, 5]);
    assert_eq!(e.posted_len(), 2);
    // The remaining receives keep their order and stay cancellable.
    assert_eq!(matched_recv(e.deliver(env(0, 5, 1), "x")), (3, "x"));
    assert_eq!(e.remove_posted_where(|_, _| true), vec![2]);
    assert!(e.is_empty());
}

#[test]
fn remove_posted_where_survives_a_panicking_predicate() {
    let mut e = Engine::new();
    let a = queued_id(e.post(pat(R0, T5, 0), 1));
    let _ = queued_id(e.post(pat(Source::Any, T5, 1), 2));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        e.remove_posted_where(|_, r| if *r == 2 { panic!("boom") } else { true })
    }));
    assert!(r.is_err());
    assert_eq!(e.posted_len(), 2);
    assert_eq!(e.cancel(a), Some(1));
    assert_eq!(matched_recv(e.deliver(env(4, 5, 1), "m")), (2, "m"));
    assert!(e.is_empty());
}

#[test]
fn remove_posted_where_keeps_ids_valid() {
    let mut e = Engine::new();
    let a = queued_id(e.post(pat(R0, T5, 0), 1));
    let b = queued_id(e.post(pat(Source::Any, T5, 0), 2));
    assert!(e.remove_posted_where(|_, _| false).is_empty());
    assert_eq!(e.cancel(b), Some(2));
    assert_eq!(e.cancel(a), Some(1));
    assert!(e.is_empty());
}

#[test]
fn find_posted_names_what_take_posted_takes_until_the_queues_change() {
    let mut e = Engine::new();
    let first = queued_id(e.post(pat(R1, TagSel::Tag(4), 0), 10));
    let _ = queued_id(e.post(pat(Source::Any, TagSel::Any, 0), 11));
    let _ = queued_id(e.post(pat(R1, TagSel::Tag(4), 0), 12));
    let m = env(1, 4, 0);
    let (at, &r) = e.find_posted(&m).expect("posted");
    assert_eq!(r, 10);
    // The queues change: the place names nothing any more (its index now
    // holds another receive).
    assert_eq!(e.cancel(first), Some(10));
    assert!(!e.drop_posted_at(at));
    assert_eq!(e.take_posted_at(at), None);
    assert_eq!(e.posted_len(), 2);
    // The wildcard receive is now the earliest; dropping it in place leaves
    // the later specific one.
    let (at, &r) = e.find_posted(&m).expect("posted");
    assert_eq!(r, 11);
    assert!(e.drop_posted_at(at));
    assert_eq!(e.posted_len(), 1);
    assert_eq!(e.find_posted(&env(1, 5, 0)).map(|(_, &r)| r), None);
    assert_eq!(e.take_posted(&m), Some(12));
    assert!(e.is_empty());
    e.check_invariants();
}

#[test]
fn probe_does_not_remove_and_take_does() {
    let mut e = Engine::new();
    let _ = e.deliver(env(0, 5, 0), "a");
    let _ = e.deliver(env(1, 5, 0), "b");
    assert_eq!(
        e.probe(&pat(Source::Any, T5, 0)),
        Some((env(0, 5, 0), &"a"))
    );
    assert_eq!(
        e.probe(&pat(Source::Any, T5, 0)),
        Some((env(0, 5, 0), &"a"))
    );
    assert_eq!(
        e.probe(&pat(R1, TagSel::Any, 0)),
        Some((env(1, 5, 0), &"b"))
    );
    assert_eq!(e.probe(&pat(R1, T6, 0)), None);
    assert_eq!(e.unexpected_len(), 2);
    assert_eq!(e.take(&pat(R1, T5, 0)), Some((env(1, 5, 0), "b")));
    assert_eq!(e.take(&pat(R1, T5, 0)), None);
    assert_eq!(e.unexpected_len(), 1);
    assert_eq!(
        e.take(&pat(Source::Any, TagSel::Any, 0)),
        Some((env(0, 5, 0), "a"))
    );
    assert!(e.is_empty());
}

#[test]
fn drain_unexpected_in_arrival_order() {
    let mut e = MatchingEngine::<u32, ()>::new();
    let envs = [env(2, 1, 0), env(0, 1, 1), env(2, 3, 0), env(1, 1, 0)];
    for (i, v) in envs.iter().enumerate() {
        let _ = e.deliver(*v, i as u32);
    }
    let _ = queued_id(e.post(pat(R0, T5, 4), ()));
    let drained = e.drain_unexpected();
    assert_eq!(
        drained,
        envs.iter()
            .copied()
            .zip(0..)
            .collect::<Vec<(Envelope, u32)>>()
    );
    assert_eq!(e.unexpected_len(), 0);
    assert_eq!(e.posted_len(), 1);
}

#[test]
fn zero_length_payloads_are_just_payloads() {
    let mut e = MatchingEngine::<Vec<u8>, u32>::new();
    let _ = e.deliver(env(0, 0, 0), Vec::new());
    let _ = e.deliver(env(0, 0, 0), vec![1]);
    assert_eq!(
        matched_msg(e.post(pat(R0, TagSel::Tag(0), 0), 1)).1,
        Vec::<u8>::new()
    );
    assert_eq!(
        matched_msg(e.post(pat(R0, TagSel::Tag(0), 0), 2)).1,
        vec![1]
    );
    let mut u = MatchingEngine::<(), ()>::new();
    assert_eq!(u.deliver(env(0, 0, 0), ()), Delivered::Queued);
    assert_eq!(u.probe(&pat(R0, TagSel::Any, 0)), Some((env(0, 0, 0), &())));
}

#[test]
fn memory_is_bounded_after_many_sources_and_contexts() {
    let mut e = MatchingEngine::<u32, u32>::new();
    for i in 0..10_000usize {
        let c = (i % 1000) as Context;
        let _ = e.deliver(env(i, 1, c), 0);
        assert!(e.take(&pat(Source::Rank(i), TagSel::Any, c)).is_some());
        let _ = queued_id(e.post(pat(Source::Rank(i), TagSel::Any, c), 0));
        assert_eq!(matched_recv(e.deliver(env(i, 1, c), 0)).0, 0);
    }
    assert!(e.is_empty());
    assert!(e.ctxs.len() <= DEFAULT_SWEEP_SLACK + 1);
    for ctx in &e.ctxs {
        assert!(ctx.unexpected.idle.len() <= DEFAULT_SWEEP_SLACK + 1);
        assert!(ctx.posted.idle.len() <= DEFAULT_SWEEP_SLACK + 1);
    }
    // Many sources in one context.
    for i in 0..10_000usize {
        let _ = e.deliver(env(i, 1, 0), 0);
    }
    assert_eq!(e.unexpected_len(), 10_000);
    for _ in 0..10_000 {
        assert!(e.take(&pat(Source::Any, TagSel::Any, 0)).is_some());
    }
    assert!(e.is_empty());
    // What is left: at most the slack's worth of buckets holding storage,
    // and one empty header per rank up to the highest (10,000 x 32 bytes).
    let holding: usize = e
        .ctxs
        .iter()
        .flat_map(|c| c.unexpected.iter())
        .filter(|(_, b)| b.capacity() > 0)
        .count();
    assert!(
        holding <= DEFAULT_SWEEP_SLACK + 1,
        "{holding} buckets hold storage"
    );
    assert!(e.ctxs.iter().all(|c| c.unexpected.dense.len() <= 10_000));
    // A long queue in one bucket gives its memory back.
    for i in 0..10_000u32 {
        let _ = queued_id(e.post(pat(R0, TagSel::Any, 0), i));
    }
    for i in 0..10_000u32 {
        assert_eq!(matched_recv(e.deliver(env(0, 1, 0), i)), (i, i));
    }
    assert!(e
        .ctxs
        .iter()
        .flat_map(|c| c.posted.iter())
        .all(|(_, b)| b.capacity() <= SHRINK_MIN));
}

#[test]
fn ranks_beyond_the_dense_range_are_hashed() {
    // A rank far above any world this machine runs (and above DENSE_RANKS)
    // costs a map entry, not a vector that long.
    let big = DENSE_RANKS * 1000 + 7;
    let mut e = MatchingEngine::<u32, u32>::new();
    let _ = e.deliver(env(big, 1, 0), 5);
    let _ = queued_id(e.post(pat(Source::Rank(big + 1), TagSel::Any, 0), 9));
    assert!(e.ctx(0).unexpected.dense.is_empty());
    assert!(e.ctx(0).posted.dense.is_empty());
    assert_eq!(
        e.take(&pat(Source::Rank(big), TagSel::Any, 0)),
        Some((env(big, 1, 0), 5))
    );
    assert_eq!(matched_recv(e.deliver(env(big + 1, 3, 0), 1)), (9, 1));
    assert!(e.is_empty());
    e.check_invariants();
}

#[test]
fn cancel_finds_receives_in_any_context_and_bucket() {
    let mut e = MatchingEngine::<u32, u32>::new();
    let ids: Vec<PostedId> = (0..30u32)
        .map(|i| {
            let source = match i % 3 {
                0 => Source::Any,
                1 => Source::Rank(i as usize),
                _ => Source::Rank(DENSE_RANKS + i as usize),
            };
            queued_id(e.post(pat(source, TagSel::Tag(i as Tag), i % 4), i))
        })
        .collect();
    for (i, id) in ids.iter().enumerate().rev() {
        assert_eq!(e.cancel(*id), Some(i as u32));
        assert_eq!(e.cancel(*id), None, "a cancelled id is gone");
        e.check_invariants();
    }
    assert!(e.is_empty());
}

#[test]
fn arrival_log_stays_bounded() {
    // One message stays queued forever while many others from another
    // source are received by specific-source receives: their log entries
    // go stale and must be compacted away.
    let mut e = MatchingEngine::<u32, u32>::new();
    let _ = e.deliver(env(0, 1, 0), 0);
    for i in 0..1000 {
        let _ = e.deliver(env(1, 1, 0), i);
        let _ = e.deliver(env(1, 2, 0), i);
        assert_eq!(e.take(&pat(R1, TagSel::Tag(2), 0)).map(|(_, m)| m), Some(i));
        assert_eq!(e.take(&pat(R1, TagSel::Any, 0)).map(|(_, m)| m), Some(i));
        let ctx = e.ctx(0);
        assert_eq!(ctx.log.len(), ctx.unexpected.len + ctx.stale);
        assert!(ctx.log.len() <= 2 + ctx.unexpected.len + DEFAULT_SWEEP_SLACK);
    }
    // The survivor is still found through the (compacted) log.
    assert_eq!(
        e.take(&pat(Source::Any, TagSel::Any, 0)),
        Some((env(0, 1, 0), 0))
    );
    assert!(e.ctx(0).log.is_empty());
}

#[test]
fn any_source_take_skips_stale_entries() {
    let mut e = MatchingEngine::<u32, u32>::new();
    for i in 0..6 {
        let _ = e.deliver(env(i as Rank % 3, 1 + (i % 2) as Tag, 0), i);
    }
    // Remove the first three by specific-source receives.
    assert_eq!(e.take(&pat(R0, TagSel::Any, 0)).map(|(_, m)| m), Some(0));
    assert_eq!(e.take(&pat(R1, TagSel::Any, 0)).map(|(_, m)| m), Some(1));
    assert_eq!(
        e.take(&pat(Source::Rank(2), TagSel::Any, 0))
            .map(|(_, m)| m),
        Some(2)
    );
    assert_eq!(e.ctx(0).stale, 3);
    assert_eq!(
        e.probe(&pat(Source::Any, TagSel::Tag(1), 0))
            .map(|(_, m)| *m),
        Some(4)
    );
    assert_eq!(
        e.take(&pat(Source::Any, TagSel::Tag(1), 0)).map(|(_, m)| m),
        Some(4)
    );
    assert_eq!(e.ctx(0).stale, 0, "stale entries at the front are dropped");
    assert_eq!(
        e.take(&pat(Source::Any, TagSel::Any, 0)).map(|(_, m)| m),
        Some(3)
    );
    assert_eq!(
        e.take(&pat(Source::Any, TagSel::Any, 0)).map(|(_, m)| m),
        Some(5)
    );
    assert!(e.is_empty());
}

#[test]
fn steady_state_keeps_buckets() {
    // Alternating empty/non-empty queues on one pair reuses the bucket.
    let mut e = MatchingEngine::<u32, u32>::new();
    for i in 0..100 {
        let _ = e.deliver(env(3, 1, 2), i);
        assert_eq!(e.take(&pat(R0, TagSel::Any, 2)), None);
        assert!(e.take(&pat(Source::Rank(3), TagSel::Any, 2)).is_some());
    }
    assert_eq!(e.ctxs.len(), 1);
    assert_eq!(e.empty_contexts, 1);
    // Bucket 3 kept its storage (no allocation per message), and is the
    // only one on the idle list (listed once: the list is tidied).
    let u = &e.ctx(2).unexpected;
    assert!(u.get(3).is_some_and(|b| b.capacity() > 0));
    assert!(u.idle.iter().all(|&k| k == 3));
    assert!(u.idle.len() <= DEFAULT_SWEEP_SLACK + 1);
}

impl<M, R> MatchingEngine<M, R> {
    /// The queues of context `c` (test builds only).
    fn ctx(&self, c: Context) -> &Ctx<M, R> {
        &self.ctxs[self.index[&c]]
    }

    /// Checks every internal invariant (test builds only).
    fn check_invariants(&self) {
        let live = |n: usize, empty: usize| n.checked_sub(empty).expect("empty <= len");
        let mut unexpected = 0;
        let mut posted = 0;
        let mut empty_contexts = 0;
        let mut seqs = Vec::new();
        assert_eq!(self.index.len(), self.ctxs.len());
        for (at, ctx) in self.ctxs.iter().enumerate() {
            assert_eq!(self.index[&ctx.context], at);
            empty_contexts += usize::from(ctx.is_empty());
            // Unexpected buckets: sorted, counted, indexed by the log.
            let u = &ctx.unexpected;
            u.check_invariants(self.slack);
            for (_, b) in u.iter() {
                assert!(b.iter().zip(b.iter().skip(1)).all(|(x, y)| x.seq < y.seq));
            }
            assert_eq!(ctx.log.len(), u.len + ctx.stale);
            assert!(ctx.stale <= u.len + self.slack);
            let log = &ctx.log;
            assert!(log
                .iter()
                .zip(log.iter().skip(1))
                .all(|(x, y)| x.seq < y.seq));
            let live_entries = log.iter().filter(|l| {
                let Some(i) = live_index(u, l) else {
                    return false;
                };
                assert_eq!(u.get(l.source).unwrap().get(i).unwrap().tag, l.tag);
                true
            });
            assert_eq!(live_entries.count(), u.len);
            unexpected += u.len;
            // Posted receives: sorted, counted, ids unique.
            let p = &ctx.posted;
            p.check_invariants(self.slack);
            for (_, b) in p.iter() {
                assert!(b.iter().zip(b.iter().skip(1)).all(|(x, y)| x.seq < y.seq));
                seqs.extend(b.iter().map(|e| e.seq));
            }
            let w = &ctx.wild;
            assert!(w.iter().zip(w.iter().skip(1)).all(|(x, y)| x.seq < y.seq));
            seqs.extend(w.iter().map(|e| e.seq));
            posted += p.len + w.len();
        }
        assert_eq!(unexpected, self.unexpected_len);
        assert_eq!(posted, self.posted_len);
        seqs.sort_unstable();
        seqs.dedup();
        assert_eq!(seqs.len(), posted, "posted ids are unique");
        assert!(seqs.iter().all(|&s| s < self.next_post));
        assert_eq!(empty_contexts, self.empty_contexts);
        assert!(empty_contexts <= live(self.ctxs.len(), empty_contexts) + self.slack);
    }
}

impl<E: Sequenced> Buckets<E> {
    /// Checks the bucket set's own invariants (test builds only).
    fn check_invariants(&self, slack: usize) {
        let n: usize = self.iter().map(|(_, b)| b.len()).sum();
        assert_eq!(n, self.len);
        let nonempty = self.iter().filter(|(_, b)| !b.is_empty()).count();
        assert_eq!(nonempty, self.live);
        assert!(self.dense.len() <= DENSE_RANKS);
        assert!(self.sparse.keys().all(|&k| k >= DENSE_RANKS));
        // Every bucket that is empty and holds storage is on the idle list,
        // which stays within the slack of the live count.
        for (k, b) in self.iter() {
            if b.is_empty() && (k >= DENSE_RANKS || b.capacity() > 0) {
                assert!(self.idle.contains(&k), "idle bucket {k} not listed");
            }
        }
        assert!(self.idle.len() <= self.live + slack);
    }
}

/// The property tests' settings: 300 cases, no regression files.
/// The property tests' ranks: 0-4, and two at or above the dense range
/// (hashed buckets), the first on its boundary.
fn rank(s: u8) -> Rank {
    match s % 7 {
        5 => DENSE_RANKS,
        6 => DENSE_RANKS * 3 + 1,
        r => usize::from(r),
    }
}

/// The property tests' patterns: a wildcard source one time in five, a
/// wildcard tag one time in three, over three tags and three contexts.
fn pattern(s: u8, t: u8, c: u8) -> Pattern {
    let source = if s % 5 == 0 {
        Source::Any
    } else {
        Source::Rank(rank(s))
    };
    let tag = if t % 3 == 0 {
        TagSel::Any
    } else {
        TagSel::Tag(Tag::from(t % 3))
    };
    Pattern::new(source, tag, Context::from(c % 3))
}

fn config() -> proptest::prelude::ProptestConfig {
    proptest::prelude::ProptestConfig {
        cases: 300,
        failure_persistence: None,
        ..Default::default()
    }
}

mod invariants {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(config())]

        /// Random operations keep every internal invariant.
        #[test]
        fn hold_after_every_operation(
            slack in 0usize..4,
            ops in prop::collection::vec((0u8..20, any::<u8>(), any::<u8>(), any::<u8>()), 0..400),
        ) {
            let mut e = MatchingEngine::<u32, u32>::with_sweep_slack(slack);
            let mut ids = Vec::new();
            for (i, (kind, s, t, c)) in ops.into_iter().enumerate() {
                let i = i as u32;
                match kind {
                    0..=5 => {
                        let env = env(rank(s), Tag::from(t % 3), Context::from(c % 3));
                        let _ = e.deliver(env, i);
                    }
                    6 => {
                        // `deliver` in two steps, the receive dropped in place.
                        let env = env(rank(s), Tag::from(t % 3), Context::from(c % 3));
                        match e.find_posted(&env).map(|(at, _)| at) {
                            Some(at) => prop_assert!(e.drop_posted_at(at)),
                            None => e.push_unexpected(env, i),
                        }
                    }
                    7..=13 => {
                        if let Posted::Queued(id) = e.post(pattern(s, t, c), i) {
                            ids.push(id);
                        }
                    }
                    14 => {
                        let _ = e.probe(&pattern(s, t, c));
                    }
                    15..=16 => {
                        let _ = e.take(&pattern(s, t, c));
                    }
                    17 => {
                        if !ids.is_empty() {
                            let _ = e.cancel(ids[usize::from(s) % ids.len()]);
                        }
                    }
                    18 => {
                        let p = pattern(s, t, c);
                        let _ = e.remove_posted_where(|q, r| q.source == p.source || r % 3 == 0);
                    }
                    _ => {
                        if s % 4 == 0 {
                            let _ = e.drain_unexpected();
                        }
                    }
                }
                e.check_invariants();
            }
        }
    }
}

/// MPI's matching rules written the obvious way (two lists in order, full
/// scans), for comparison with the engine.
#[derive(Default)]
struct Reference {
    /// (id, pattern, handle) in posting order.
    posted: Vec<(u64, Pattern, u32)>,
    /// (envelope, payload) in arrival order.
    unexpected: Vec<(Envelope, u32)>,
}

impl Reference {
    fn deliver(&mut self, env: Envelope, msg: u32) -> Option<(Pattern, u32, u32)> {
        match self.posted.iter().position(|(_, p, _)| p.matches(&env)) {
            Some(i) => {
                let (_, p, r) = self.posted.remove(i);
                Some((p, r, msg))
            }
            None => {
                self.unexpected.push((env, msg));
                None
            }
        }
    }

    fn take(&mut self, p: &Pattern) -> Option<(Envelope, u32)> {
        let i = self.unexpected.iter().position(|(e, _)| p.matches(e))?;
        Some(self.unexpected.remove(i))
    }

    fn probe(&self, p: &Pattern) -> Option<(Envelope, u32)> {
        self.unexpected.iter().find(|(e, _)| p.matches(e)).copied()
    }

    fn cancel(&mut self, id: u64) -> Option<u32> {
        let i = self.posted.iter().position(|(x, _, _)| *x == id)?;
        Some(self.posted.remove(i).2)
    }
}

mod against_reference {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(config())]

        /// Every operation gives what the reference gives, in any mix of
        /// sources (dense and hashed), tags, contexts and wildcards.
        #[test]
        fn the_engine_matches_as_the_reference_does(
            slack in 0usize..3,
            ops in prop::collection::vec((0u8..12, any::<u8>(), any::<u8>(), any::<u8>()), 0..300),
        ) {
            let mut e = MatchingEngine::<u32, u32>::with_sweep_slack(slack);
            let mut r = Reference::default();
            let mut ids = Vec::new();
            for (i, (kind, s, t, c)) in ops.into_iter().enumerate() {
                let i = i as u32;
                match kind {
                    0..=4 => {
                        let env = env(rank(s), Tag::from(t % 3), Context::from(c % 3));
                        let got = match e.deliver(env, i) {
                            Delivered::Matched { recv, pattern, msg } => Some((pattern, recv, msg)),
                            Delivered::Queued => None,
                        };
                        prop_assert_eq!(got, r.deliver(env, i));
                    }
                    5..=8 => {
                        let p = pattern(s, t, c);
                        match e.post(p, i) {
                            Posted::Matched { env, msg, recv } => {
                                prop_assert_eq!(recv, i);
                                prop_assert_eq!(Some((env, msg)), r.take(&p));
                            }
                            Posted::Queued(id) => {
                                prop_assert_eq!(r.probe(&p), None);
                                r.posted.push((id.as_u64(), p, i));
                                ids.push(id);
                            }
                        }
                    }
                    9 => {
                        let p = pattern(s, t, c);
                        prop_assert_eq!(e.probe(&p).map(|(env, m)| (env, *m)), r.probe(&p));
                        prop_assert_eq!(e.take(&p), r.take(&p));
                    }
                    10 => {
                        if !ids.is_empty() {
                            let id = ids[usize::from(s) % ids.len()];
                            prop_assert_eq!(e.cancel(id), r.cancel(id.as_u64()));
                        }
                    }
                    _ => {
                        let dead = rank(s);
                        let gone = e.remove_posted_where(|p, _| p.source == Source::Rank(dead));
                        let mut want = Vec::new();
                        r.posted.retain(|(_, p, h)| {
                            let doomed = p.source == Source::Rank(dead);
                            if doomed {
                                want.push(*h);
                            }
                            !doomed
                        });
                        prop_assert_eq!(gone, want);
                    }
                }
                prop_assert_eq!(e.posted_len(), r.posted.len());
                prop_assert_eq!(e.unexpected_len(), r.unexpected.len());
            }
            let drained: Vec<(Envelope, u32)> = e.drain_unexpected();
            prop_assert_eq!(drained, r.unexpected);
        }
    }
}

#[test]
fn fx_hasher_hashes_bytes() {
    use std::hash::Hasher;
    let mut a = FxHasher::default();
    a.write(b"0123456789");
    let mut b = FxHasher::default();
    b.write(b"0123456788");
    assert_ne!(a.finish(), b.finish());
    let mut c = FxHasher::default();
    c.write_u8(1);
    assert_ne!(c.finish(), 0);
}

#[test]
fn posted_from_says_whether_a_receive_names_the_source() {
    let mut m = Engine::new();
    assert!(!m.posted_from(1));
    // A wildcard receive names no source.
    let any = queued_id(m.post(pat(Source::Any, TagSel::Any, 4), 1));
    assert!(!m.posted_from(1));
    // One naming rank 1, in another context.
    let one = queued_id(m.post(pat(R1, TagSel::Tag(3), 9), 2));
    assert!(m.posted_from(1));
    assert!(!m.posted_from(0));
    // Matched or cancelled, it no longer counts.
    assert_eq!(m.cancel(one), Some(2));
    assert!(!m.posted_from(1));
    let _ = queued_id(m.post(pat(R1, TagSel::Tag(3), 9), 3));
    let (recv, _) = matched_recv(m.deliver(env(1, 3, 9), "x"));
    assert_eq!(recv, 3);
    assert!(!m.posted_from(1));
    assert_eq!(m.cancel(any), Some(1));
}
