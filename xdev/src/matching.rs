//! Software tag matching: the posted-receive queue and the unexpected-message
//! queue that every transport without hardware tag matching shares.
//!
//! [`MatchingEngine`] implements MPI's matching rules on [`Envelope`]s and
//! [`Pattern`]s: an arriving message matches the *earliest-posted* matching
//! receive, a newly posted receive matches the *earliest-arrived* matching
//! unexpected message, and contexts never mix. Provided the caller delivers
//! each sender's messages in that sender's send order, this gives MPI's
//! non-overtaking guarantee, also under `ANY_SOURCE` and `ANY_TAG`.
//!
//! It is a plain data structure meant to be used under a transport's lock: it
//! does no I/O, spawns no threads, contains no `unsafe` and never blocks. It
//! does not interpret payloads (`M`, e.g. an eager buffer or a rendezvous
//! descriptor) or receive handles (`R`, e.g. a request slot); moving the data
//! and completing requests is the caller's business.
//!
//! # Design
//!
//! Every queued entry carries a global sequence number (arrival order for
//! messages, posting order for receives; the latter is also the
//! [`PostedId`]). Per context, unexpected messages sit in per-source FIFO
//! buckets plus an arrival-order index used by `ANY_SOURCE` searches, and
//! posted receives sit in per-source FIFO buckets plus one FIFO of
//! `ANY_SOURCE` receives; an arriving message compares the first match in
//! its source's bucket with the first earlier match in the wildcard FIFO.
//! So long queues spread over many senders do not turn every match into a
//! scan of everything, while the common case (empty or near-empty queues,
//! head matches) costs no hashing and no allocation once the buckets exist:
//! the context used last is tried first, and buckets are found by indexing
//! a vector by rank (ranks are dense; see `buckets` for the few above
//! 65,536, which are hashed). Cancelling a posted receive searches for it
//! rather than keeping an index every post would pay for. Emptied buckets
//! and contexts are kept for reuse but swept once they outnumber the live
//! ones by a bounded slack (see [`MatchingEngine::with_sweep_slack`]), and
//! storage that has become mostly empty is shrunk, so memory follows the
//! live queue lengths (plus, per context in use, one 32-byte bucket header
//! per rank up to the highest that sent or was named).

use std::collections::HashMap;
use std::collections::VecDeque;
use std::fmt;
use std::hash::BuildHasherDefault;

use crate::{Context, Envelope, Pattern, Rank, Source, Tag, TagSel};

mod buckets;
mod fifo;

#[cfg(test)]
use buckets::DENSE_RANKS;
use buckets::{first_match, shrink_deque, shrink_fifo, shrink_map, shrunk_capacity};
use buckets::{Buckets, Sequenced};
use fifo::Fifo;

/// Identifies a queued posted receive, for cancellation.
///
/// Ids are never reused by the engine that issued them, so cancelling an id
/// whose receive already matched is harmless (it returns `None`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct PostedId(u64);

impl PostedId {
    /// The raw id (the receive's posting sequence number), e.g. for logging.
    pub fn as_u64(self) -> u64 {
        self.0
    }

    /// Rebuilds an id from [`as_u64`](Self::as_u64) (for transports that keep
    /// it in a request's cookie).
    pub const fn from_raw(raw: u64) -> Self {
        PostedId(raw)
    }
}

/// Where a queued posted receive is: what [`find_posted`] returns, to take
/// or drop that receive with [`take_posted_at`] or [`drop_posted_at`].
/// It names the receive until the queues change; after that those calls
/// find nothing (the receive's posting number is checked).
///
/// [`find_posted`]: MatchingEngine::find_posted
/// [`take_posted_at`]: MatchingEngine::take_posted_at
/// [`drop_posted_at`]: MatchingEngine::drop_posted_at
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PostedAt {
    /// The context's slot.
    ctx: usize,
    /// The source's bucket, or `None` for the wildcard queue.
    source: Option<Rank>,
    /// The index in that queue.
    index: usize,
    /// The receive's posting number.
    seq: u64,
}

/// Outcome of delivering an arriving message.
#[must_use]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Delivered<M, R> {
    /// The message matched the earliest-posted matching receive, which has
    /// been removed from the posted queue.
    Matched {
        /// The matched receive's handle.
        recv: R,
        /// The pattern the receive was posted with.
        pattern: Pattern,
        /// The message, handed back to the caller.
        msg: M,
    },
    /// No posted receive matched; the message is queued as unexpected.
    Queued,
}

/// Outcome of posting a receive.
#[must_use]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Posted<M, R> {
    /// The receive matched the earliest-arrived matching unexpected message,
    /// which has been removed from the unexpected queue.
    Matched {
        /// The envelope of the matched message.
        env: Envelope,
        /// The matched message.
        msg: M,
        /// The receive handle, handed back to the caller.
        recv: R,
    },
    /// No unexpected message matched; the receive is queued under this id.
    Queued(PostedId),
}

/// A posted-receive queue plus an unexpected-message queue with MPI matching
/// rules. `M` is the payload of an unexpected message, `R` the handle of a
/// posted receive.
///
/// See the [module documentation](crate::devkit::matching) for the rules.
pub struct MatchingEngine<M, R> {
    /// Per-context queues, in no particular order. Contexts whose queues
    /// are empty are kept (so a context in steady use does not reallocate)
    /// but swept once they outnumber the live ones by more than `slack`.
    ctxs: Vec<Ctx<M, R>>,
    /// Where each context of `ctxs` is.
    index: FxMap<Context, usize>,
    /// The slot of `ctxs` used last: tried before `index` (a hint, checked
    /// against the slot's own context).
    hot: usize,
    /// How many entries of `ctxs` are empty.
    empty_contexts: usize,
    /// Number of queued posted receives.
    posted_len: usize,
    /// Sequence number of the next arriving (unexpected) message.
    next_arrival: u64,
    /// Sequence number of the next queued posted receive.
    next_post: u64,
    /// Total number of unexpected messages.
    unexpected_len: usize,
    /// How many empty contexts, idle buckets (per context) and stale log
    /// entries (per context) are tolerated beyond the live ones before they
    /// are swept.
    slack: usize,
}

impl<M, R> Default for MatchingEngine<M, R> {
    fn default() -> Self {
        Self::new()
    }
}

impl<M, R> fmt::Debug for MatchingEngine<M, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MatchingEngine")
            .field("posted_len", &self.posted_len())
            .field("unexpected_len", &self.unexpected_len)
            .field("contexts", &(self.ctxs.len() - self.empty_contexts))
            .finish()
    }
}

impl<M, R> MatchingEngine<M, R> {
    /// An engine with both queues empty. Does not allocate.
    pub fn new() -> Self {
        Self::with_sweep_slack(DEFAULT_SWEEP_SLACK)
    }

    /// Like [`new`](Self::new), with a different bound on retained empty
    /// storage: emptied per-source buckets and empty contexts are kept for
    /// reuse (so steady traffic does not reallocate) until they outnumber
    /// the live ones by more than `slack`; stale entries of the arrival
    /// index likewise. `new` uses 32. Smaller values use less memory after
    /// bursts over many sources and contexts, at the price of more frequent
    /// sweeps; 0 is valid (and exercises the sweeps constantly, for
    /// testing).
    pub fn with_sweep_slack(slack: usize) -> Self {
        MatchingEngine {
            ctxs: Vec::new(),
            index: FxMap::default(),
            hot: 0,
            empty_contexts: 0,
            posted_len: 0,
            next_arrival: 0,
            next_post: 0,
            unexpected_len: 0,
            slack,
        }
    }

    /// Matches an arriving message against the posted receives: the
    /// earliest-posted matching receive is removed and returned together with
    /// the message; if none matches, the message is queued as unexpected.
    ///
    /// Call this for each sender's messages in that sender's send order.
    pub fn deliver(&mut self, env: Envelope, msg: M) -> Delivered<M, R> {
        let at = self.find_posted(&env).map(|(at, _)| at);
        let taken =
            at.and_then(|at| Some((at.source, self.remove_posted_at(at, |q, i| q.remove(i))?)));
        match taken {
            Some((from, p)) => {
                let source = match from {
                    Some(r) => Source::Rank(r),
                    None => Source::Any,
                };
                let pattern = Pattern::new(source, p.tag, env.context);
                Delivered::Matched {
                    recv: p.recv,
                    pattern,
                    msg,
                }
            }
            None => {
                self.push_unexpected(env, msg);
                Delivered::Queued
            }
        }
    }

    /// The first half of [`deliver`](Self::deliver): removes and returns the
    /// earliest-posted receive matching an arriving message, if any. A
    /// transport uses it to move the payload straight into the receive buffer
    /// before it has built an unexpected-message payload; when it returns
    /// `None`, the message must be passed to
    /// [`push_unexpected`](Self::push_unexpected) before the next arrival.
    ///
    /// Only the receive comes back, not the pattern it was posted with.
    #[inline(always)]
    pub fn take_posted(&mut self, env: &Envelope) -> Option<R> {
        let (at, _) = self.find_posted(env)?;
        self.take_posted_at(at)
    }

    /// The receive [`take_posted`](Self::take_posted) would take for an
    /// arrival with `env`, left in its queue: where it is, and the receive.
    ///
    /// For an engine that needs only a few words of the receive (its
    /// buffer, its slot in the engine's table) and can then drop it where it
    /// is ([`drop_posted_at`](Self::drop_posted_at)). Taken out by value, a
    /// receive of more than two words is copied on through memory in 16-byte
    /// words that span the narrower stores which wrote it, and each such
    /// load waits for those stores to reach the cache: on the shm device's
    /// osu_bibw at 8 B, about 40% of `drain`'s samples sat on such copies of
    /// the matched receive.
    #[inline(always)]
    pub fn find_posted(&self, env: &Envelope) -> Option<(PostedAt, &R)> {
        if self.posted_len == 0 {
            return None;
        }
        let at = self.find_slot(env.context)?;
        let (source, index, p) = self.ctxs[at].find_posted(env.source, env.tag)?;
        let place = PostedAt {
            ctx: at,
            source,
            index,
            seq: p.seq,
        };
        Some((place, &p.recv))
    }

    /// Removes the receive at `at` (from [`find_posted`](Self::find_posted),
    /// the queues unchanged since) and returns it; `None` if the queues
    /// changed and it is no longer there.
    #[inline(always)]
    pub fn take_posted_at(&mut self, at: PostedAt) -> Option<R> {
        self.remove_posted_at(at, |q, i| q.remove(i))
            .map(|p| p.recv)
    }

    /// [`take_posted_at`](Self::take_posted_at), dropping the receive where
    /// it is (never copied out). Returns whether it was there.
    #[inline(always)]
    pub fn drop_posted_at(&mut self, at: PostedAt) -> bool {
        self.remove_posted_at(at, |q, i| q.drop_at(i)).is_some()
    }

    /// The entry at `at`, taken out of its queue by `take`, with the
    /// bookkeeping of a removal.
    #[inline(always)]
    fn remove_posted_at<X>(
        &mut self,
        at: PostedAt,
        take: impl FnOnce(&mut Fifo<PostedRecv<R>>, usize) -> Option<X>,
    ) -> Option<X> {
        let ctx = self.ctxs.get_mut(at.ctx)?;
        let taken = ctx.remove_posted(at.source, at.index, at.seq, take)?;
        let now_empty = ctx.is_empty();
        self.hot = at.ctx;
        self.posted_len -= 1;
        self.note_ctx_removal(now_empty);
        Some(taken)
    }

    /// The second half of [`deliver`](Self::deliver): queues an arriving
    /// message that [`take_posted`](Self::take_posted) found no receive for.
    pub fn push_unexpected(&mut self, env: Envelope, msg: M) {
        let seq = self.next_arrival;
        // 2^64 arrivals cannot happen; wrapping only rules out a panic.
        self.next_arrival = seq.wrapping_add(1);
        self.ctx_for_push(env.context)
            .push_unexpected(env, seq, msg);
        self.unexpected_len += 1;
    }

    /// The id the next receive queued by [`post`](Self::post) gets. An
    /// engine can store it as the request's cancel token before it moves the
    /// request's only device reference into the queue; if `post` matches
    /// instead, the receive is not queued and that token must be cleared.
    pub fn next_posted_id(&self) -> PostedId {
        PostedId(self.next_post)
    }

    /// Posts a receive: the earliest-arrived matching unexpected message is
    /// removed and returned together with `recv`; if none matches, the
    /// receive is queued and its id returned.
    #[inline]
    pub fn post(&mut self, pattern: Pattern, recv: R) -> Posted<M, R> {
        self.post_with(pattern, move || recv)
    }

    /// [`post`](Self::post) of the receive `make` makes, made where it goes:
    /// into its queue's slot, or into [`Posted::Matched`].
    ///
    /// An engine's per-message receive path posts through this. A receive
    /// built by the caller and handed down by value is written to the stack
    /// field by field, then moved into the queue in 16-byte words: each such
    /// load spans several of those narrow stores, which the processor cannot
    /// forward, so it waits until they (and every older store, such as the
    /// ring's, whose lines the peer holds) reach the cache. Made here, from
    /// its parts in registers, it is written once, in place. Measured on the
    /// shm device's osu_bibw at 8 B, where each side posts its window before
    /// the other's messages come: that one reload held 41% of the profile
    /// samples of `irecv` (17% of the rank's), and posting this way
    /// removed it.
    #[inline(always)]
    pub fn post_with(&mut self, pattern: Pattern, make: impl FnOnce() -> R) -> Posted<M, R> {
        if let Some((env, msg)) = self.take(&pattern) {
            return Posted::Matched {
                env,
                msg,
                recv: make(),
            };
        }
        let seq = self.next_post;
        // 2^64 posts cannot happen; wrapping only rules out a panic.
        self.next_post = seq.wrapping_add(1);
        let tag = pattern.tag;
        let entry = move || PostedRecv {
            seq,
            tag,
            recv: make(),
        };
        let ctx = self.ctx_for_push(pattern.context);
        match pattern.source {
            Source::Any => ctx.wild.push_with(entry),
            Source::Rank(r) => ctx.posted.push(r, entry),
        }
        self.posted_len += 1;
        Posted::Queued(PostedId(seq))
    }

    /// Earliest unexpected message matching `pattern`, without removing it
    /// (probe).
    pub fn probe(&self, pattern: &Pattern) -> Option<(Envelope, &M)> {
        if self.unexpected_len == 0 {
            return None;
        }
        let ctx = &self.ctxs[self.find_slot(pattern.context)?];
        let (source, u) = ctx.find_unexpected(pattern.source, pattern.tag)?;
        let env = Envelope {
            source,
            tag: u.tag,
            context: pattern.context,
        };
        Some((env, &u.msg))
    }

    /// Removes and returns the earliest unexpected message matching `pattern`
    /// (used by blocking receives that never queue).
    ///
    /// The check for an empty unexpected queue is inlined into every caller
    /// (`post` among them): a receive posted ahead of its message, the
    /// common case of a window of receives, then pays no call for it.
    #[inline(always)]
    pub fn take(&mut self, pattern: &Pattern) -> Option<(Envelope, M)> {
        if self.unexpected_len == 0 {
            return None;
        }
        self.take_queued(pattern)
    }

    /// [`take`](Self::take) once some unexpected message is queued.
    fn take_queued(&mut self, pattern: &Pattern) -> Option<(Envelope, M)> {
        let at = self.slot_of(pattern.context)?;
        let ctx = &mut self.ctxs[at];
        let (source, u) = ctx.take_unexpected(pattern.source, pattern.tag)?;
        let now_empty = ctx.is_empty();
        self.unexpected_len -= 1;
        self.note_ctx_removal(now_empty);
        let env = Envelope {
            source,
            tag: u.tag,
            context: pattern.context,
        };
        Some((env, u.msg))
    }

    /// Removes a still-queued posted receive. None if it already matched or
    /// never existed.
    ///
    /// Not on the per-message path: it searches every context's wildcard
    /// queue and per-source buckets (by bisection, each being in posting
    /// order), rather than keeping an index that every post and match would
    /// pay for.
    pub fn cancel(&mut self, id: PostedId) -> Option<R> {
        if self.posted_len == 0 {
            return None;
        }
        let by_seq = |q: &Fifo<PostedRecv<R>>| q.binary_search_by_key(&id.0, |p| p.seq).ok();
        let (at, entry) = self.ctxs.iter_mut().enumerate().find_map(|(at, ctx)| {
            if let Some(i) = by_seq(&ctx.wild) {
                let e = ctx.wild.remove(i)?;
                shrink_fifo(&mut ctx.wild);
                return Some((at, e));
            }
            if ctx.posted.len == 0 {
                return None;
            }
            let (key, i) = ctx.posted.iter().find_map(|(k, b)| Some((k, by_seq(b)?)))?;
            Some((at, ctx.posted.remove_in(key, |_| Some(i))?))
        })?;
        let now_empty = self.ctxs[at].is_empty();
        self.posted_len -= 1;
        self.note_ctx_removal(now_empty);
        Some(entry.recv)
    }

    /// Removes every posted receive for which `pred(pattern, recv)` is true,
    /// in posting order (used to fail receives naming a dead peer, or all on
    /// close).
    ///
    /// `pred` is called once per queued receive, in posting order, before
    /// anything is removed (so a panicking `pred` leaves the engine intact).
    pub fn remove_posted_where(&mut self, mut pred: impl FnMut(&Pattern, &R) -> bool) -> Vec<R> {
        if self.posted_len == 0 {
            return Vec::new();
        }
        // Decide, in posting order, without touching the queues.
        let doomed: Vec<u64> = {
            let mut all: Vec<(Pattern, &PostedRecv<R>)> = Vec::with_capacity(self.posted_len);
            for ctx in &self.ctxs {
                let c = ctx.context;
                let wild = ctx.wild.iter();
                all.extend(wild.map(|p| (Pattern::new(Source::Any, p.tag, c), p)));
                for (r, b) in ctx.posted.iter() {
                    all.extend(
                        b.iter()
                            .map(|p| (Pattern::new(Source::Rank(r), p.tag, c), p)),
                    );
                }
            }
            all.sort_unstable_by_key(|(_, p)| p.seq);
            all.into_iter()
                .filter(|(pattern, p)| pred(pattern, &p.recv))
                .map(|(_, p)| p.seq)
                .collect()
        };
        if doomed.is_empty() {
            return Vec::new();
        }
        // `doomed` is sorted, being in posting order.
        let is_doomed = |p: &PostedRecv<R>| doomed.binary_search(&p.seq).is_ok();
        let mut out = Vec::with_capacity(doomed.len());
        for ctx in self.ctxs.iter_mut() {
            ctx.wild.extract_where(is_doomed, &mut out);
            shrink_fifo(&mut ctx.wild);
            ctx.posted.extract_where(is_doomed, &mut out);
        }
        out.sort_unstable_by_key(|p| p.seq);
        self.posted_len -= out.len();
        self.sweep_contexts();
        out.into_iter().map(|p| p.recv).collect()
    }

    /// Removes every unexpected message (e.g. at close), in arrival order.
    pub fn drain_unexpected(&mut self) -> Vec<(Envelope, M)> {
        if self.unexpected_len == 0 {
            return Vec::new();
        }
        let mut all = Vec::with_capacity(self.unexpected_len);
        for ctx in self.ctxs.iter_mut() {
            let context = ctx.context;
            ctx.clear_log();
            ctx.unexpected.drain_each(|source, u| {
                let env = Envelope {
                    source,
                    tag: u.tag,
                    context,
                };
                all.push((u.seq, env, u.msg));
            });
        }
        all.sort_unstable_by_key(|m| m.0);
        self.unexpected_len = 0;
        self.sweep_contexts();
        all.into_iter().map(|(_, env, msg)| (env, msg)).collect()
    }

    /// Number of queued posted receives.
    #[inline]
    pub fn posted_len(&self) -> usize {
        self.posted_len
    }

    /// Whether a receive naming `source` is queued (in any context):
    /// whether this rank waits for data from that rank. Receives with
    /// `Source::Any` are not counted.
    pub fn posted_from(&self, source: Rank) -> bool {
        self.posted_len > 0
            && self
                .ctxs
                .iter()
                .any(|c| c.posted.get(source).is_some_and(|b| !b.is_empty()))
    }

    /// Number of queued unexpected messages.
    pub fn unexpected_len(&self) -> usize {
        self.unexpected_len
    }

    /// Whether both queues are empty.
    pub fn is_empty(&self) -> bool {
        self.posted_len == 0 && self.unexpected_len == 0
    }

    /// The slot of context `c`, if it has one (the hot slot first).
    #[inline]
    fn find_slot(&self, c: Context) -> Option<usize> {
        if self.ctxs.get(self.hot).is_some_and(|x| x.context == c) {
            return Some(self.hot);
        }
        self.index.get(&c).copied()
    }

    /// [`find_slot`](Self::find_slot), remembering the slot as the hot one.
    #[inline]
    fn slot_of(&mut self, c: Context) -> Option<usize> {
        let at = self.find_slot(c)?;
        self.hot = at;
        Some(at)
    }

    /// The queues of context `c`, created if absent, for adding an entry.
    #[inline]
    fn ctx_for_push(&mut self, c: Context) -> &mut Ctx<M, R> {
        let at = match self.slot_of(c) {
            Some(at) => {
                if self.ctxs[at].is_empty() {
                    self.empty_contexts -= 1;
                }
                at
            }
            None => {
                let at = self.ctxs.len();
                self.ctxs.push(Ctx::new(c, self.slack));
                self.index.insert(c, at);
                self.hot = at;
                at
            }
        };
        &mut self.ctxs[at]
    }

    /// Bookkeeping after one entry was removed from a context's queues.
    #[inline]
    fn note_ctx_removal(&mut self, now_empty: bool) {
        if now_empty {
            self.empty_contexts += 1;
            let live = self.ctxs.len() - self.empty_contexts;
            if self.empty_contexts > live + self.slack {
                self.sweep_contexts();
            }
        }
    }

    /// Drops every empty context.
    #[cold]
    fn sweep_contexts(&mut self) {
        self.ctxs.retain(|ctx| !ctx.is_empty());
        if let Some(c) = shrunk_capacity(self.ctxs.len(), self.ctxs.capacity()) {
            self.ctxs.shrink_to(c);
        }
        self.index.clear();
        for (at, ctx) in self.ctxs.iter().enumerate() {
            self.index.insert(ctx.context, at);
        }
        shrink_map(&mut self.index);
        self.empty_contexts = 0;
        self.hot = 0;
    }
}

/// The sweep slack of [`MatchingEngine::new`].
const DEFAULT_SWEEP_SLACK: usize = 32;

/// A queued unexpected message (its source and context are its bucket's).
struct Unexpected<M> {
    seq: u64,
    tag: Tag,
    msg: M,
}

/// A queued posted receive (its source and context are where it is queued:
/// a source's bucket or the wildcard queue, of its context's queues). Kept
/// small, since a match moves it out of its queue.
struct PostedRecv<R> {
    seq: u64,
    tag: TagSel,
    recv: R,
}

impl<M> Sequenced for Unexpected<M> {
    fn seq(&self) -> u64 {
        self.seq
    }
}

impl<R> Sequenced for PostedRecv<R> {
    fn seq(&self) -> u64 {
        self.seq
    }
}

/// Whether a tag selector accepts `tag`.
#[inline]
fn tag_ok(sel: TagSel, tag: Tag) -> bool {
    match sel {
        TagSel::Any => true,
        TagSel::Tag(t) => t == tag,
    }
}

/// One entry of a context's arrival log.
#[derive(Clone, Copy)]
struct LogEntry {
    seq: u64,
    source: Rank,
    tag: Tag,
}

/// The queues of one context.
struct Ctx<M, R> {
    /// The context these queues belong to.
    context: Context,
    /// Unexpected messages by source.
    unexpected: Buckets<Unexpected<M>>,
    /// Every unexpected message of the context in arrival order, for
    /// `Source::Any` searches. Messages removed other than through the log
    /// leave a stale entry behind (lazy deletion): `log.len() ==
    /// unexpected.len + stale`.
    log: VecDeque<LogEntry>,
    /// Number of stale entries in `log`.
    stale: usize,
    /// Posted receives naming a specific source, by source.
    posted: Buckets<PostedRecv<R>>,
    /// Posted receives with `Source::Any`, in posting order.
    wild: Fifo<PostedRecv<R>>,
}

/// Index in its bucket of the still-queued message a log entry refers to;
/// `None` if the entry is stale.
#[inline]
fn live_index<M>(unexpected: &Buckets<Unexpected<M>>, l: &LogEntry) -> Option<usize> {
    unexpected
        .get(l.source)?
        .binary_search_by_key(&l.seq, |u| u.seq)
        .ok()
}

impl<M, R> Ctx<M, R> {
    fn new(context: Context, slack: usize) -> Self {
        Ctx {
            context,
            unexpected: Buckets::new(slack),
            log: VecDeque::new(),
            stale: 0,
            posted: Buckets::new(slack),
            wild: Fifo::new(),
        }
    }

    #[inline]
    fn is_empty(&self) -> bool {
        self.unexpected.len == 0 && self.posted.len == 0 && self.wild.is_empty()
    }

    /// Queues an unexpected message (with the highest arrival number so far).
    fn push_unexpected(&mut self, env: Envelope, seq: u64, msg: M) {
        self.unexpected.push(env.source, || Unexpected {
            seq,
            tag: env.tag,
            msg,
        });
        self.log.push_back(LogEntry {
            seq,
            source: env.source,
            tag: env.tag,
        });
    }

    /// The earliest-posted receive accepting a message from `source` with
    /// `tag`: the earlier of the first match in `source`'s bucket and the
    /// first match in the wildcard queue. Its queue (`None`: the wildcard
    /// one), its index there, and the entry.
    #[inline(always)]
    fn find_posted(&self, source: Rank, tag: Tag) -> Option<(Option<Rank>, usize, &PostedRecv<R>)> {
        let accepts = |p: &PostedRecv<R>| tag_ok(p.tag, tag);
        let specific = match self.posted.len {
            0 => None,
            _ => self
                .posted
                .get(source)
                .and_then(|b| first_match(b, u64::MAX, accepts)),
        };
        if !self.wild.is_empty() {
            let before = specific.map_or(u64::MAX, |(_, seq)| seq);
            if let Some((i, _)) = first_match(&self.wild, before, accepts) {
                return Some((None, i, self.wild.get(i)?));
            }
        }
        let (i, _) = specific?;
        Some((Some(source), i, self.posted.get(source)?.get(i)?))
    }

    /// Takes the posted receive at index `index` of `source`'s bucket
    /// (`None`: of the wildcard queue) out with `take`, if it is the one
    /// posted as `seq`.
    #[inline(always)]
    fn remove_posted<X>(
        &mut self,
        source: Option<Rank>,
        index: usize,
        seq: u64,
        take: impl FnOnce(&mut Fifo<PostedRecv<R>>, usize) -> Option<X>,
    ) -> Option<X> {
        let here = |q: &Fifo<PostedRecv<R>>| q.get(index).is_some_and(|p| p.seq == seq);
        match source {
            None => {
                if !here(&self.wild) {
                    return None;
                }
                let x = take(&mut self.wild, index)?;
                shrink_fifo(&mut self.wild);
                Some(x)
            }
            Some(r) => self
                .posted
                .remove_with(r, |b| here(b).then_some(index), take),
        }
    }

    /// Position in the log, source and index in its bucket of the
    /// earliest-arrived queued message with a tag accepted by `tag`.
    fn find_in_log(&self, tag: TagSel) -> Option<(usize, Rank, usize)> {
        let unexpected = &self.unexpected;
        self.log
            .iter()
            .enumerate()
            .filter(|(_, l)| tag_ok(tag, l.tag))
            .find_map(|(i, l)| Some((i, l.source, live_index(unexpected, l)?)))
    }

    /// The earliest-arrived unexpected message accepted by `source` and `tag`:
    /// its source and entry.
    fn find_unexpected(&self, source: Source, tag: TagSel) -> Option<(Rank, &Unexpected<M>)> {
        if self.unexpected.len == 0 {
            return None;
        }
        let (r, i) = match source {
            Source::Rank(r) => {
                let b = self.unexpected.get(r)?;
                (r, first_match(b, u64::MAX, |u| tag_ok(tag, u.tag))?.0)
            }
            Source::Any => {
                let (_, r, i) = self.find_in_log(tag)?;
                (r, i)
            }
        };
        Some((r, self.unexpected.get(r)?.get(i)?))
    }

    /// Removes the earliest-arrived unexpected message accepted by `source`
    /// and `tag`, with its source.
    fn take_unexpected(&mut self, source: Source, tag: TagSel) -> Option<(Rank, Unexpected<M>)> {
        if self.unexpected.len == 0 {
            return None;
        }
        match source {
            Source::Rank(r) => {
                let u = self.unexpected.remove_in(r, |b| {
                    first_match(b, u64::MAX, |u| tag_ok(tag, u.tag)).map(|(i, _)| i)
                })?;
                self.note_removed_outside_log();
                Some((r, u))
            }
            Source::Any => {
                // Scan the log in arrival order, dropping stale entries met at
                // its front on the way.
                let mut i = 0;
                let (at, r, j) = loop {
                    let l = *self.log.get(i)?;
                    let wanted = tag_ok(tag, l.tag);
                    if i > 0 && !wanted {
                        i += 1;
                        continue;
                    }
                    match live_index(&self.unexpected, &l) {
                        Some(j) if wanted => break (i, l.source, j),
                        Some(_) => i += 1,
                        None if i == 0 => {
                            self.log.pop_front();
                            self.stale -= 1;
                        }
                        None => i += 1,
                    }
                };
                let u = self.unexpected.remove_in(r, |_| Some(j))?;
                self.log.remove(at);
                self.tidy_log();
                Some((r, u))
            }
        }
    }

    /// Log bookkeeping after a message was removed other than through the
    /// log: its entry went stale.
    fn note_removed_outside_log(&mut self) {
        self.stale += 1;
        self.tidy_log();
    }

    /// Keeps stale log entries bounded by the live ones plus the slack
    /// (amortized: a compaction follows at least `slack + 1` removals).
    fn tidy_log(&mut self) {
        if self.unexpected.len == 0 {
            self.clear_log();
        } else if self.stale > self.unexpected.len + self.slack() {
            let unexpected = &self.unexpected;
            self.log.retain(|l| live_index(unexpected, l).is_some());
            self.stale = 0;
            shrink_deque(&mut self.log);
        } else {
            shrink_deque(&mut self.log);
        }
    }

    /// The sweep slack (the same for both bucket sets).
    fn slack(&self) -> usize {
        self.unexpected.slack
    }

    /// Empties the log (when no unexpected message is left).
    fn clear_log(&mut self) {
        self.log.clear();
        self.stale = 0;
        shrink_deque(&mut self.log);
    }
}

/// Map with the fast non-cryptographic Fx hash of `rustc-hash` (the one
/// rustc uses), for keys that are small integers chosen by the job or the
/// device (ranks, contexts, request ids), not by an adversary. Transports use
/// it for their per-message maps. `benches/benches/hasher.rs` measures it
/// against the hand-copied hasher it replaced.
pub type FxMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;

pub use rustc_hash::FxHasher;

#[cfg(test)]
mod tests;
