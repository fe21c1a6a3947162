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
//! head matches) costs a few hash probes of small integer keys and no
//! allocation once the buckets exist. Emptied buckets and contexts are kept
//! for reuse but swept once they outnumber the live ones by a bounded slack
//! (see [`MatchingEngine::with_sweep_slack`]), and storage that has become
//! mostly empty is shrunk, so memory follows the live queue lengths.

use std::collections::hash_map::{Entry, HashMap};
use std::collections::VecDeque;
use std::fmt;
use std::hash::{BuildHasherDefault, Hash, Hasher};

use crate::{Context, Envelope, Pattern, Rank, Source, Tag, TagSel};

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
    pub fn from_raw(raw: u64) -> Self {
        PostedId(raw)
    }
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
/// See the [module documentation](self) for the rules.
pub struct MatchingEngine<M, R> {
    /// Per-context queues. Contexts whose queues are empty are kept (so a
    /// context in steady use does not reallocate) but swept once they
    /// outnumber the live ones by more than `slack`.
    contexts: FxMap<Context, Ctx<M, R>>,
    /// How many entries of `contexts` are empty.
    empty_contexts: usize,
    /// Where each queued posted receive lives, by posting sequence number
    /// (= its [`PostedId`]). Its length is the posted-queue length.
    ids: PostIndex,
    /// Sequence number of the next arriving (unexpected) message.
    next_arrival: u64,
    /// Sequence number of the next queued posted receive.
    next_post: u64,
    /// Total number of unexpected messages.
    unexpected_len: usize,
    /// How many empty contexts, empty buckets (per context) and stale log
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
            .field("contexts", &(self.contexts.len() - self.empty_contexts))
            .finish()
    }
}

impl<M, R> MatchingEngine<M, R> {
    /// An engine with both queues empty. Does not allocate.
    pub fn new() -> Self {
        Self::with_sweep_slack(DEFAULT_SWEEP_SLACK)
    }

    /// Like [`new`](Self::new), with a different bound on retained empty
    /// storage: empty per-source buckets and empty contexts are kept for reuse
    /// (so steady traffic does not reallocate) until they outnumber the live
    /// ones by more than `slack`; stale entries of the arrival index likewise.
    /// `new` uses 32. Smaller values use less memory after bursts over many
    /// sources and contexts, at the price of more frequent sweeps; 0 is valid
    /// (and exercises the sweeps constantly, for testing).
    pub fn with_sweep_slack(slack: usize) -> Self {
        MatchingEngine {
            contexts: FxMap::default(),
            empty_contexts: 0,
            ids: PostIndex::default(),
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
        match self.take_posted(&env) {
            Some((pattern, recv)) => Delivered::Matched { recv, pattern, msg },
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
    pub fn take_posted(&mut self, env: &Envelope) -> Option<(Pattern, R)> {
        if self.ids.is_empty() {
            return None;
        }
        let ctx = self.contexts.get_mut(&env.context)?;
        let p = ctx.take_posted(env.source, env.tag)?;
        let now_empty = ctx.is_empty();
        self.forget_id(p.seq);
        self.note_ctx_removal(now_empty);
        Some((p.pattern, p.recv))
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

    /// Posts a receive: the earliest-arrived matching unexpected message is
    /// removed and returned together with `recv`; if none matches, the
    /// receive is queued and its id returned.
    pub fn post(&mut self, pattern: Pattern, recv: R) -> Posted<M, R> {
        if let Some((env, msg)) = self.take(&pattern) {
            return Posted::Matched { env, msg, recv };
        }
        let seq = self.next_post;
        // 2^64 posts cannot happen; wrapping only rules out a panic.
        self.next_post = seq.wrapping_add(1);
        let entry = PostedRecv { seq, pattern, recv };
        let ctx = self.ctx_for_push(pattern.context);
        match pattern.source {
            Source::Any => ctx.wild.push_back(entry),
            Source::Rank(r) => ctx.posted.push(r, entry),
        }
        self.ids.push(seq, pattern.context, pattern.source);
        Posted::Queued(PostedId(seq))
    }

    /// Earliest unexpected message matching `pattern`, without removing it
    /// (probe).
    pub fn probe(&self, pattern: &Pattern) -> Option<(Envelope, &M)> {
        if self.unexpected_len == 0 {
            return None;
        }
        let ctx = self.contexts.get(&pattern.context)?;
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
    pub fn take(&mut self, pattern: &Pattern) -> Option<(Envelope, M)> {
        if self.unexpected_len == 0 {
            return None;
        }
        let ctx = self.contexts.get_mut(&pattern.context)?;
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
    pub fn cancel(&mut self, id: PostedId) -> Option<R> {
        let (context, source) = self.ids.get(id.0)?;
        let ctx = self.contexts.get_mut(&context)?;
        let by_seq = |q: &VecDeque<PostedRecv<R>>| q.binary_search_by_key(&id.0, |p| p.seq).ok();
        let entry = match source {
            Source::Any => {
                let i = by_seq(&ctx.wild)?;
                let e = ctx.wild.remove(i)?;
                shrink_deque(&mut ctx.wild);
                e
            }
            Source::Rank(r) => ctx.posted.remove_in(r, by_seq)?,
        };
        let now_empty = ctx.is_empty();
        self.forget_id(id.0);
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
        if self.ids.is_empty() {
            return Vec::new();
        }
        // Decide, in posting order, without touching the queues.
        let doomed: Vec<u64> = {
            let mut all: Vec<&PostedRecv<R>> = Vec::with_capacity(self.ids.len());
            for ctx in self.contexts.values() {
                all.extend(ctx.wild.iter());
                all.extend(ctx.posted.map.values().flatten());
            }
            all.sort_unstable_by_key(|p| p.seq);
            all.into_iter()
                .filter(|p| pred(&p.pattern, &p.recv))
                .map(|p| p.seq)
                .collect()
        };
        if doomed.is_empty() {
            return Vec::new();
        }
        // `doomed` is sorted, being in posting order.
        let is_doomed = |p: &PostedRecv<R>| doomed.binary_search(&p.seq).is_ok();
        let mut out = Vec::with_capacity(doomed.len());
        for ctx in self.contexts.values_mut() {
            extract_where(&mut ctx.wild, is_doomed, &mut out);
            ctx.posted.extract_where(is_doomed, &mut out);
        }
        out.sort_unstable_by_key(|p| p.seq);
        for p in &out {
            self.ids.kill(p.seq);
        }
        self.ids.tidy(self.slack);
        self.sweep_contexts();
        out.into_iter().map(|p| p.recv).collect()
    }

    /// Removes every unexpected message (e.g. at close), in arrival order.
    pub fn drain_unexpected(&mut self) -> Vec<(Envelope, M)> {
        if self.unexpected_len == 0 {
            return Vec::new();
        }
        let mut all = Vec::with_capacity(self.unexpected_len);
        for (&context, ctx) in self.contexts.iter_mut() {
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
    pub fn posted_len(&self) -> usize {
        self.ids.len()
    }

    /// Number of queued unexpected messages.
    pub fn unexpected_len(&self) -> usize {
        self.unexpected_len
    }

    /// Whether both queues are empty.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty() && self.unexpected_len == 0
    }

    /// The queues of context `c`, created if absent, for adding an entry.
    fn ctx_for_push(&mut self, c: Context) -> &mut Ctx<M, R> {
        match self.contexts.entry(c) {
            Entry::Occupied(o) => {
                let ctx = o.into_mut();
                if ctx.is_empty() {
                    self.empty_contexts -= 1;
                }
                ctx
            }
            Entry::Vacant(v) => v.insert(Ctx::new(self.slack)),
        }
    }

    /// Bookkeeping after one entry was removed from a context's queues.
    fn note_ctx_removal(&mut self, now_empty: bool) {
        if now_empty {
            self.empty_contexts += 1;
            let live = self.contexts.len() - self.empty_contexts;
            if self.empty_contexts > live + self.slack {
                self.sweep_contexts();
            }
        }
    }

    /// Drops every empty context.
    fn sweep_contexts(&mut self) {
        self.contexts.retain(|_, ctx| !ctx.is_empty());
        self.empty_contexts = 0;
        shrink_map(&mut self.contexts);
    }

    /// Forgets the id of a posted receive that left the queue.
    fn forget_id(&mut self, seq: u64) {
        self.ids.kill(seq);
        self.ids.tidy(self.slack);
    }
}

/// The sweep slack of [`MatchingEngine::new`].
const DEFAULT_SWEEP_SLACK: usize = 32;
/// Deques and maps with at most this capacity are never shrunk.
const SHRINK_MIN: usize = 64;

/// A queued unexpected message (its source and context are its bucket's).
struct Unexpected<M> {
    seq: u64,
    tag: Tag,
    msg: M,
}

/// A queued posted receive.
struct PostedRecv<R> {
    seq: u64,
    pattern: Pattern,
    recv: R,
}

/// Entries ordered by a global sequence number.
trait Sequenced {
    fn seq(&self) -> u64;
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

/// Index and sequence number of the first entry of `q` satisfying `ok`,
/// looking only at entries with a sequence number below `before`.
#[inline]
fn first_match<E: Sequenced>(
    q: &VecDeque<E>,
    before: u64,
    mut ok: impl FnMut(&E) -> bool,
) -> Option<(usize, u64)> {
    q.iter()
        .enumerate()
        .take_while(|(_, e)| e.seq() < before)
        .find(|(_, e)| ok(e))
        .map(|(i, e)| (i, e.seq()))
}

/// Moves the entries of `q` satisfying `f` to `out`, keeping the order of
/// the others.
fn extract_where<E>(q: &mut VecDeque<E>, mut f: impl FnMut(&E) -> bool, out: &mut Vec<E>) {
    for _ in 0..q.len() {
        if let Some(e) = q.pop_front() {
            if f(&e) {
                out.push(e);
            } else {
                q.push_back(e);
            }
        }
    }
    shrink_deque(q);
}

/// Gives back the memory of a deque that has become mostly empty.
#[inline]
fn shrink_deque<E>(q: &mut VecDeque<E>) {
    if q.capacity() > SHRINK_MIN && q.len() * 4 < q.capacity() {
        q.shrink_to(q.len() * 2);
    }
}

/// Gives back the memory of a map that has become mostly empty.
#[inline]
fn shrink_map<K: Eq + Hash, V>(m: &mut FxMap<K, V>) {
    if m.capacity() > SHRINK_MIN && m.len() * 4 < m.capacity() {
        m.shrink_to(m.len() * 2);
    }
}

/// Where a queued posted receive lives.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Loc {
    seq: u64,
    context: Context,
    source: Source,
    /// False once the receive left the queue (lazy deletion).
    live: bool,
}

/// The locations of the queued posted receives, in posting order, i.e. by
/// id. Searched by bisection: for the short queues of the common case this
/// is cheaper than hashing, and matching in posting order (the usual case)
/// only ever touches the front.
#[derive(Default)]
struct PostIndex {
    locs: VecDeque<Loc>,
    /// Number of entries of `locs` that are not live.
    dead: usize,
}

impl PostIndex {
    fn len(&self) -> usize {
        self.locs.len() - self.dead
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Records a new receive (with the highest sequence number so far).
    fn push(&mut self, seq: u64, context: Context, source: Source) {
        self.locs.push_back(Loc {
            seq,
            context,
            source,
            live: true,
        });
    }

    /// Position of the live entry for `seq`.
    fn find(&self, seq: u64) -> Option<usize> {
        // Receives usually match in posting order: the front first.
        let i = if self.locs.front().is_some_and(|l| l.seq == seq) {
            0
        } else {
            self.locs.binary_search_by_key(&seq, |l| l.seq).ok()?
        };
        self.locs.get(i)?.live.then_some(i)
    }

    /// Where the receive with id `seq` lives, if still queued.
    fn get(&self, seq: u64) -> Option<(Context, Source)> {
        let l = self.locs.get(self.find(seq)?)?;
        Some((l.context, l.source))
    }

    /// Marks the receive `seq` as gone; [`tidy`](Self::tidy) must follow.
    fn kill(&mut self, seq: u64) {
        if let Some(l) = self.find(seq).and_then(|i| self.locs.get_mut(i)) {
            l.live = false;
            self.dead += 1;
        }
    }

    /// Drops dead entries at the front, and all of them once they outnumber
    /// the live ones by more than `slack`.
    fn tidy(&mut self, slack: usize) {
        while self.locs.front().is_some_and(|l| !l.live) {
            self.locs.pop_front();
            self.dead -= 1;
        }
        if self.dead > self.len() + slack {
            self.locs.retain(|l| l.live);
            self.dead = 0;
        }
        shrink_deque(&mut self.locs);
    }
}

/// FIFO buckets keyed by source rank, each in sequence order.
struct Buckets<E> {
    map: FxMap<Rank, VecDeque<E>>,
    /// How many buckets of `map` are empty (kept for reuse until swept).
    empty: usize,
    /// Total number of entries over all buckets.
    len: usize,
    /// Empty buckets tolerated beyond the live ones before a sweep.
    slack: usize,
}

impl<E: Sequenced> Buckets<E> {
    fn new(slack: usize) -> Self {
        Buckets {
            map: FxMap::default(),
            empty: 0,
            len: 0,
            slack,
        }
    }

    /// Appends `e` (which must carry the highest sequence number so far) to
    /// bucket `key`.
    fn push(&mut self, key: Rank, e: E) {
        match self.map.entry(key) {
            Entry::Occupied(o) => {
                let b = o.into_mut();
                if b.is_empty() {
                    self.empty -= 1;
                }
                b.push_back(e);
            }
            Entry::Vacant(v) => v.insert(VecDeque::new()).push_back(e),
        }
        self.len += 1;
    }

    /// Removes the entry of bucket `key` at the index `pick` chooses.
    fn remove_in(
        &mut self,
        key: Rank,
        pick: impl FnOnce(&VecDeque<E>) -> Option<usize>,
    ) -> Option<E> {
        if self.len == 0 {
            return None;
        }
        let b = self.map.get_mut(&key)?;
        let e = b.remove(pick(b)?)?;
        let now_empty = b.is_empty();
        shrink_deque(b);
        self.note_removed(now_empty);
        Some(e)
    }

    /// Bookkeeping after one entry was removed from a bucket.
    fn note_removed(&mut self, now_empty: bool) {
        self.len -= 1;
        if now_empty {
            self.empty += 1;
            let live = self.map.len() - self.empty;
            if self.empty > live + self.slack {
                self.sweep();
            }
        }
    }

    /// Moves the entries satisfying `f` to `out`, in no particular order.
    fn extract_where(&mut self, mut f: impl FnMut(&E) -> bool, out: &mut Vec<E>) {
        let mut emptied = 0;
        for b in self.map.values_mut() {
            let before = b.len();
            if before == 0 {
                continue;
            }
            extract_where(b, &mut f, out);
            self.len -= before - b.len();
            if b.is_empty() {
                emptied += 1;
            }
        }
        self.empty += emptied;
        let live = self.map.len() - self.empty;
        if self.empty > live + self.slack {
            self.sweep();
        }
    }

    /// Drops every empty bucket.
    fn sweep(&mut self) {
        self.map.retain(|_, b| !b.is_empty());
        self.empty = 0;
        shrink_map(&mut self.map);
    }

    /// Moves every entry out, with its key, leaving no buckets.
    fn drain_each(&mut self, mut f: impl FnMut(Rank, E)) {
        for (key, b) in self.map.drain() {
            b.into_iter().for_each(|e| f(key, e));
        }
        shrink_map(&mut self.map);
        self.empty = 0;
        self.len = 0;
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
    wild: VecDeque<PostedRecv<R>>,
}

/// Index in its bucket of the still-queued message a log entry refers to;
/// `None` if the entry is stale.
#[inline]
fn live_index<M>(map: &FxMap<Rank, VecDeque<Unexpected<M>>>, l: &LogEntry) -> Option<usize> {
    map.get(&l.source)?
        .binary_search_by_key(&l.seq, |u| u.seq)
        .ok()
}

impl<M, R> Ctx<M, R> {
    fn new(slack: usize) -> Self {
        Ctx {
            unexpected: Buckets::new(slack),
            log: VecDeque::new(),
            stale: 0,
            posted: Buckets::new(slack),
            wild: VecDeque::new(),
        }
    }

    fn is_empty(&self) -> bool {
        self.unexpected.len == 0 && self.posted.len == 0 && self.wild.is_empty()
    }

    /// Queues an unexpected message (with the highest arrival number so far).
    fn push_unexpected(&mut self, env: Envelope, seq: u64, msg: M) {
        self.unexpected.push(
            env.source,
            Unexpected {
                seq,
                tag: env.tag,
                msg,
            },
        );
        self.log.push_back(LogEntry {
            seq,
            source: env.source,
            tag: env.tag,
        });
    }

    /// Removes the earliest-posted receive accepting a message from `source`
    /// with `tag`: the earlier of the first match in `source`'s bucket and the
    /// first match in the wildcard list.
    fn take_posted(&mut self, source: Rank, tag: Tag) -> Option<PostedRecv<R>> {
        let posted = &mut self.posted;
        let wild = &mut self.wild;
        let bucket = if posted.len == 0 {
            None
        } else {
            posted.map.get_mut(&source)
        };
        let accepts = |p: &PostedRecv<R>| tag_ok(p.pattern.tag, tag);
        let specific = bucket
            .as_deref()
            .and_then(|b| first_match(b, u64::MAX, accepts));
        let before = specific.map_or(u64::MAX, |(_, seq)| seq);
        if let Some((i, _)) = first_match(wild, before, accepts) {
            let e = wild.remove(i);
            shrink_deque(wild);
            return e;
        }
        let (i, _) = specific?;
        let b = bucket?;
        let e = b.remove(i)?;
        let now_empty = b.is_empty();
        shrink_deque(b);
        posted.note_removed(now_empty);
        Some(e)
    }

    /// Position in the log, source and index in its bucket of the
    /// earliest-arrived queued message with a tag accepted by `tag`.
    fn find_in_log(&self, tag: TagSel) -> Option<(usize, Rank, usize)> {
        let map = &self.unexpected.map;
        self.log
            .iter()
            .enumerate()
            .filter(|(_, l)| tag_ok(tag, l.tag))
            .find_map(|(i, l)| Some((i, l.source, live_index(map, l)?)))
    }

    /// The earliest-arrived unexpected message accepted by `source` and `tag`:
    /// its source and entry.
    fn find_unexpected(&self, source: Source, tag: TagSel) -> Option<(Rank, &Unexpected<M>)> {
        if self.unexpected.len == 0 {
            return None;
        }
        let (r, i) = match source {
            Source::Rank(r) => {
                let b = self.unexpected.map.get(&r)?;
                (r, first_match(b, u64::MAX, |u| tag_ok(tag, u.tag))?.0)
            }
            Source::Any => {
                let (_, r, i) = self.find_in_log(tag)?;
                (r, i)
            }
        };
        Some((r, self.unexpected.map.get(&r)?.get(i)?))
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
                    match live_index(&self.unexpected.map, &l) {
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
        } else if self.stale > self.unexpected.len + self.unexpected.slack {
            let map = &self.unexpected.map;
            self.log.retain(|l| live_index(map, l).is_some());
            self.stale = 0;
            shrink_deque(&mut self.log);
        } else {
            shrink_deque(&mut self.log);
        }
    }

    /// Empties the log (when no unexpected message is left).
    fn clear_log(&mut self) {
        self.log.clear();
        self.stale = 0;
        shrink_deque(&mut self.log);
    }
}

/// Map with the fast non-cryptographic [`FxHasher`], for keys that are
/// small integers chosen by the job or the device (ranks, contexts, request
/// ids), not by an adversary. Transports use it for their per-message maps.
pub type FxMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;

/// The Fx hash (as used by rustc): one rotate, xor and multiply per word.
#[derive(Default, Clone, Copy)]
pub struct FxHasher {
    hash: u64,
}

impl FxHasher {
    const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

    #[inline]
    fn add(&mut self, word: u64) {
        self.hash = (self.hash.rotate_left(5) ^ word).wrapping_mul(Self::SEED);
    }
}

impl Hasher for FxHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
    }

    #[inline]
    fn write_u8(&mut self, n: u8) {
        self.add(n.into());
    }

    #[inline]
    fn write_u32(&mut self, n: u32) {
        self.add(n.into());
    }

    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }

    #[inline]
    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        // The multiply mixes into the high bits; the table indexes with the
        // low ones.
        self.hash.rotate_left(26)
    }
}

#[cfg(test)]
mod tests {
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
        assert!(e.contexts.len() <= DEFAULT_SWEEP_SLACK + 1);
        for ctx in e.contexts.values() {
            assert!(ctx.unexpected.map.len() <= DEFAULT_SWEEP_SLACK + 1);
            assert!(ctx.posted.map.len() <= DEFAULT_SWEEP_SLACK + 1);
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
        let ctx_buckets: usize = e.contexts.values().map(|c| c.unexpected.map.len()).sum();
        assert!(ctx_buckets <= DEFAULT_SWEEP_SLACK + 1);
        assert!(e
            .contexts
            .values()
            .all(|c| c.unexpected.map.capacity() <= 4 * SHRINK_MIN));
        // A long queue in one bucket gives its memory back.
        for i in 0..10_000u32 {
            let _ = queued_id(e.post(pat(R0, TagSel::Any, 0), i));
        }
        for i in 0..10_000u32 {
            assert_eq!(matched_recv(e.deliver(env(0, 1, 0), i)), (i, i));
        }
        assert!(e.ids.locs.capacity() <= SHRINK_MIN);
        assert!(e
            .contexts
            .values()
            .flat_map(|c| c.posted.map.values())
            .all(|b| b.capacity() <= SHRINK_MIN));
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
            let ctx = &e.contexts[&0];
            assert_eq!(ctx.log.len(), ctx.unexpected.len + ctx.stale);
            assert!(ctx.log.len() <= 2 + ctx.unexpected.len + DEFAULT_SWEEP_SLACK);
        }
        // The survivor is still found through the (compacted) log.
        assert_eq!(
            e.take(&pat(Source::Any, TagSel::Any, 0)),
            Some((env(0, 1, 0), 0))
        );
        assert!(e.contexts[&0].log.is_empty());
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
        assert_eq!(e.contexts[&0].stale, 3);
        assert_eq!(
            e.probe(&pat(Source::Any, TagSel::Tag(1), 0))
                .map(|(_, m)| *m),
            Some(4)
        );
        assert_eq!(
            e.take(&pat(Source::Any, TagSel::Tag(1), 0)).map(|(_, m)| m),
            Some(4)
        );
        assert_eq!(
            e.contexts[&0].stale, 0,
            "stale entries at the front are dropped"
        );
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
        assert_eq!(e.contexts.len(), 1);
        assert_eq!(e.empty_contexts, 1);
        assert_eq!(
            e.contexts
                .values()
                .map(|c| c.unexpected.map.len())
                .sum::<usize>(),
            1
        );
    }

    impl<M, R> MatchingEngine<M, R> {
        /// Checks every internal invariant (test builds only).
        fn check_invariants(&self) {
            let live = |n: usize, empty: usize| n.checked_sub(empty).expect("empty <= len");
            let mut unexpected = 0;
            let mut posted = 0;
            let mut empty_contexts = 0;
            for (&c, ctx) in &self.contexts {
                empty_contexts += usize::from(ctx.is_empty());
                // Unexpected buckets: sorted, counted, indexed by the log.
                let u = &ctx.unexpected;
                let mut n = 0;
                for b in u.map.values() {
                    assert!(b.iter().zip(b.iter().skip(1)).all(|(x, y)| x.seq < y.seq));
                    n += b.len();
                }
                assert_eq!(n, u.len);
                assert_eq!(u.empty, u.map.values().filter(|b| b.is_empty()).count());
                assert!(u.empty <= live(u.map.len(), u.empty) + self.slack);
                assert_eq!(ctx.log.len(), u.len + ctx.stale);
                assert!(ctx.stale <= u.len + self.slack);
                let log = &ctx.log;
                assert!(log
                    .iter()
                    .zip(log.iter().skip(1))
                    .all(|(x, y)| x.seq < y.seq));
                let live_entries = log.iter().filter(|l| {
                    let Some(i) = live_index(&u.map, l) else {
                        return false;
                    };
                    assert_eq!(u.map[&l.source][i].tag, l.tag);
                    true
                });
                assert_eq!(live_entries.count(), u.len);
                unexpected += u.len;
                // Posted receives: sorted, in the right place, with ids.
                let p = &ctx.posted;
                let mut n = 0;
                for (&r, b) in &p.map {
                    assert!(b.iter().zip(b.iter().skip(1)).all(|(x, y)| x.seq < y.seq));
                    for e in b {
                        assert_eq!(e.pattern.source, Source::Rank(r));
                        assert_eq!(e.pattern.context, c);
                        assert_eq!(self.ids.get(e.seq), Some((c, e.pattern.source)));
                    }
                    n += b.len();
                }
                assert_eq!(n, p.len);
                assert_eq!(p.empty, p.map.values().filter(|b| b.is_empty()).count());
                assert!(p.empty <= live(p.map.len(), p.empty) + self.slack);
                let w = &ctx.wild;
                assert!(w.iter().zip(w.iter().skip(1)).all(|(x, y)| x.seq < y.seq));
                for e in w {
                    assert_eq!(e.pattern.source, Source::Any);
                    assert_eq!(e.pattern.context, c);
                    assert_eq!(self.ids.get(e.seq), Some((c, Source::Any)));
                }
                posted += p.len + w.len();
            }
            assert_eq!(unexpected, self.unexpected_len);
            assert_eq!(posted, self.ids.len());
            let locs = &self.ids.locs;
            assert!(locs
                .iter()
                .zip(locs.iter().skip(1))
                .all(|(x, y)| x.seq < y.seq));
            assert_eq!(self.ids.dead, locs.iter().filter(|l| !l.live).count());
            assert!(locs.front().map_or(true, |l| l.live));
            assert!(self.ids.dead <= self.ids.len() + self.slack);
            assert_eq!(empty_contexts, self.empty_contexts);
            assert!(empty_contexts <= live(self.contexts.len(), empty_contexts) + self.slack);
        }
    }

    mod invariants {
        use super::*;
        use proptest::prelude::*;

        fn pattern(s: u8, t: u8, c: u8) -> Pattern {
            let source = match s % 4 {
                0 => Source::Any,
                _ => Source::Rank(usize::from(s % 7)),
            };
            let tag = match t % 3 {
                0 => TagSel::Any,
                _ => TagSel::Tag(Tag::from(t % 2)),
            };
            Pattern::new(source, tag, Context::from(c % 3))
        }

        proptest! {
            #![proptest_config(ProptestConfig {
                cases: 300,
                failure_persistence: None,
                ..ProptestConfig::default()
            })]

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
                        0..=6 => {
                            let env = env(usize::from(s % 7), Tag::from(t % 2), Context::from(c % 3));
                            let _ = e.deliver(env, i);
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

    #[test]
    fn fx_hasher_hashes_bytes() {
        let mut a = FxHasher::default();
        a.write(b"0123456789");
        let mut b = FxHasher::default();
        b.write(b"0123456788");
        assert_ne!(a.finish(), b.finish());
        let mut c = FxHasher::default();
        c.write_u8(1);
        assert_ne!(c.finish(), 0);
    }
}
