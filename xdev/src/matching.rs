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
use std::hash::{BuildHasherDefault, Hash};

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
/// See the [module documentation](crate::devkit::matching) for the rules.
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

/// Map with the fast non-cryptographic Fx hash of `rustc-hash` (the one
/// rustc uses), for keys that are small integers chosen by the job or the
/// device (ranks, contexts, request ids), not by an adversary. Transports use
/// it for their per-message maps. `benches/benches/hasher.rs` measures it
/// against the hand-copied hasher it replaced.
pub type FxMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;

pub use rustc_hash::FxHasher;

#[cfg(test)]
mod tests;
