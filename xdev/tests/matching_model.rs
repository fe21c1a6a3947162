//! Property test: the matching engine against a reference model that keeps
//! both queues as plain vectors in arrival / posting order and matches by
//! linear scan, over random operation sequences on small value domains (so
//! that matches, wildcards and collisions are frequent).

use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;
use xdev::devkit::matching::{Delivered, MatchingEngine, Posted, PostedId};
use xdev::{Envelope, Pattern, Source, TagSel};

/// Payloads and receive handles are unique integers.
type Msg = u64;
type Recv = u64;

#[derive(Clone, Debug)]
enum Op {
    Deliver(Envelope),
    Post(Pattern),
    Probe(Pattern),
    Take(Pattern),
    /// Cancel the `n`-th id ever returned (modulo their number; some have
    /// matched or were cancelled since). A no-op while none was issued.
    Cancel(usize),
    /// Remove posted receives selected by [`Filter`].
    RemoveWhere(Filter),
    DrainUnexpected,
}

#[derive(Clone, Debug)]
enum Filter {
    Source(Source),
    Context(u32),
    OddRecv,
    All,
}

impl Filter {
    fn select(&self, p: &Pattern, r: &Recv) -> bool {
        match *self {
            Filter::Source(s) => p.source == s,
            Filter::Context(c) => p.context == c,
            Filter::OddRecv => r % 2 == 1,
            Filter::All => true,
        }
    }
}

/// Value domains of one test run.
#[derive(Clone, Copy, Debug)]
struct Domain {
    sources: usize,
    tags: i32,
    contexts: u32,
}

impl Domain {
    fn envelope(self, s: u16, t: u16, c: u16) -> Envelope {
        Envelope {
            source: usize::from(s) % self.sources,
            tag: i32::from(t) % self.tags,
            context: u32::from(c) % self.contexts,
        }
    }

    /// A pattern; a third of sources and tags are wildcards.
    fn pattern(self, s: u16, t: u16, c: u16) -> Pattern {
        let source = match s % 3 {
            0 => Source::Any,
            _ => Source::Rank(usize::from(s / 3) % self.sources),
        };
        let tag = match t % 3 {
            0 => TagSel::Any,
            _ => TagSel::Tag(i32::from(t / 3) % self.tags),
        };
        Pattern::new(source, tag, u32::from(c) % self.contexts)
    }

    fn filter(self, k: u16, a: u16) -> Filter {
        match k % 5 {
            0 => Filter::Source(Source::Rank(usize::from(a) % self.sources)),
            1 => Filter::Source(Source::Any),
            2 => Filter::Context(u32::from(a) % self.contexts),
            3 => Filter::OddRecv,
            _ => Filter::All,
        }
    }

    /// Decodes one operation from raw numbers (cheap to generate and shrink,
    /// unlike a tree of strategies).
    fn op(self, (kind, a, b, c): (u8, u16, u16, u16)) -> Op {
        match kind {
            0..=7 => Op::Deliver(self.envelope(a, b, c)),
            8..=15 => Op::Post(self.pattern(a, b, c)),
            16..=17 => Op::Probe(self.pattern(a, b, c)),
            18..=20 => Op::Take(self.pattern(a, b, c)),
            21..=23 => Op::Cancel(usize::from(a)),
            24 => Op::RemoveWhere(self.filter(a, b)),
            _ => Op::DrainUnexpected,
        }
    }

    /// Sequences of up to `max` operations.
    fn ops(self, max: usize) -> impl Strategy<Value = Vec<Op>> {
        prop::collection::vec((0u8..26, any::<u16>(), any::<u16>(), any::<u16>()), 0..max)
            .prop_map(move |raw| raw.into_iter().map(|r| self.op(r)).collect())
    }
}

/// The reference model: two vectors scanned linearly.
#[derive(Default)]
struct Model {
    /// Unexpected messages in arrival order.
    unexpected: Vec<(Envelope, Msg)>,
    /// Posted receives in posting order.
    posted: Vec<(Pattern, Recv)>,
}

impl Model {
    fn deliver(&mut self, env: Envelope, msg: Msg) -> Option<(Recv, Pattern, Msg)> {
        match self.posted.iter().position(|(p, _)| p.matches(&env)) {
            Some(i) => {
                let (p, r) = self.posted.remove(i);
                Some((r, p, msg))
            }
            None => {
                self.unexpected.push((env, msg));
                None
            }
        }
    }

    fn probe(&self, p: &Pattern) -> Option<(Envelope, Msg)> {
        self.unexpected.iter().find(|(e, _)| p.matches(e)).copied()
    }

    fn take(&mut self, p: &Pattern) -> Option<(Envelope, Msg)> {
        let i = self.unexpected.iter().position(|(e, _)| p.matches(e))?;
        Some(self.unexpected.remove(i))
    }

    /// `Some(matched)` or `None` when queued.
    fn post(&mut self, p: Pattern, r: Recv) -> Option<(Envelope, Msg, Recv)> {
        match self.take(&p) {
            Some((e, m)) => Some((e, m, r)),
            None => {
                self.posted.push((p, r));
                None
            }
        }
    }

    fn cancel(&mut self, r: Recv) -> Option<Recv> {
        let i = self.posted.iter().position(|(_, x)| *x == r)?;
        Some(self.posted.remove(i).1)
    }

    fn remove_where(&mut self, f: &Filter) -> Vec<Recv> {
        let (gone, kept) = self.posted.drain(..).partition(|(p, r)| f.select(p, r));
        self.posted = kept;
        gone.into_iter().map(|(_, r): (Pattern, Recv)| r).collect()
    }
}

fn run(slack: usize, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut engine = MatchingEngine::<Msg, Recv>::with_sweep_slack(slack);
    let mut model = Model::default();
    // Every id the engine handed out, with the receive it was issued for.
    let mut issued: Vec<(PostedId, Recv)> = Vec::new();
    let mut next = 0u64;
    for op in ops {
        next += 1;
        match op {
            Op::Deliver(env) => {
                let got = match engine.deliver(env, next) {
                    Delivered::Matched { recv, pattern, msg } => Some((recv, pattern, msg)),
                    Delivered::Queued => None,
                };
                prop_assert_eq!(got, model.deliver(env, next), "deliver {:?}", env);
            }
            Op::Post(p) => {
                let got = match engine.post(p, next) {
                    Posted::Matched { env, msg, recv } => Some((env, msg, recv)),
                    Posted::Queued(id) => {
                        prop_assert!(issued.iter().all(|(old, _)| *old != id), "id reused");
                        issued.push((id, next));
                        None
                    }
                };
                prop_assert_eq!(got, model.post(p, next), "post {:?}", p);
            }
            Op::Probe(p) => {
                let got = engine.probe(&p).map(|(e, m)| (e, *m));
                prop_assert_eq!(got, model.probe(&p), "probe {:?}", p);
            }
            Op::Take(p) => {
                prop_assert_eq!(engine.take(&p), model.take(&p), "take {:?}", p);
            }
            Op::Cancel(n) => {
                // Ids can only be obtained from the engine, so with none
                // issued yet there is nothing to cancel.
                if !issued.is_empty() {
                    let (id, recv) = issued[n % issued.len()];
                    prop_assert_eq!(engine.cancel(id), model.cancel(recv), "cancel {:?}", id);
                }
            }
            Op::RemoveWhere(f) => {
                let got = engine.remove_posted_where(|p, r| f.select(p, r));
                prop_assert_eq!(got, model.remove_where(&f), "remove_posted_where {:?}", f);
            }
            Op::DrainUnexpected => {
                let want = std::mem::take(&mut model.unexpected);
                prop_assert_eq!(engine.drain_unexpected(), want, "drain_unexpected");
            }
        }
        prop_assert_eq!(engine.posted_len(), model.posted.len());
        prop_assert_eq!(engine.unexpected_len(), model.unexpected.len());
        prop_assert_eq!(
            engine.is_empty(),
            model.posted.is_empty() && model.unexpected.is_empty()
        );
    }
    // Whatever is left comes out in order.
    prop_assert_eq!(
        engine.remove_posted_where(|_, _| true),
        model.remove_where(&Filter::All)
    );
    prop_assert_eq!(
        engine.drain_unexpected(),
        std::mem::take(&mut model.unexpected)
    );
    prop_assert!(engine.is_empty());
    Ok(())
}

const SMALL: Domain = Domain {
    sources: 3,
    tags: 3,
    contexts: 2,
};

/// More sources and contexts: buckets and contexts empty out and are swept.
const WIDE: Domain = Domain {
    sources: 12,
    tags: 2,
    contexts: 4,
};

/// Sweep slacks to run with: 0 and 1 sweep empty buckets, empty contexts and
/// stale index entries almost constantly; 32 is the default.
fn slack() -> impl Strategy<Value = usize> {
    prop_oneof![Just(0), Just(1), Just(3), Just(32)]
}

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config(1000))]

    #[test]
    fn engine_matches_model_small_domains(
        slack in slack(),
        ops in SMALL.ops(300),
    ) {
        run(slack, ops)?;
    }

    #[test]
    fn engine_matches_model_wide_domains(
        slack in slack(),
        ops in WIDE.ops(600),
    ) {
        run(slack, ops)?;
    }
}
