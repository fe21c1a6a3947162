//! Per-source FIFO buckets: the storage under each context's unexpected and
//! posted queues.
//!
//! Ranks are dense (below the world size), so a bucket is found by indexing
//! a vector, with no hashing on the per-message path. A rank at or above
//! [`DENSE_RANKS`] (a world that large, or a device that passes other
//! numbers) goes to a hash map instead, so a large number never makes the
//! vector large. Emptied buckets keep their storage for reuse until they
//! outnumber the live ones by the slack; then a sweep frees it.

use std::collections::VecDeque;

use super::fifo::Fifo;
use super::FxMap;
use crate::Rank;

/// Ranks below this have a slot in the dense vector (32 bytes each, up to
/// the highest rank seen); higher ones live in a hash map.
pub(super) const DENSE_RANKS: usize = 1 << 16;
/// Deques and maps with at most this capacity are never shrunk.
pub(super) const SHRINK_MIN: usize = 64;

/// Entries ordered by a global sequence number.
pub(super) trait Sequenced {
    fn seq(&self) -> u64;
}

/// FIFO buckets keyed by source rank, each in sequence order.
pub(super) struct Buckets<E> {
    /// Bucket `r` for every rank `r` below [`DENSE_RANKS`] seen so far.
    pub(super) dense: Vec<Fifo<E>>,
    /// Buckets of higher ranks.
    pub(super) sparse: FxMap<Rank, Fifo<E>>,
    /// Buckets holding entries.
    pub(super) live: usize,
    /// Keys of buckets that became empty while holding storage since the
    /// last sweep (a key may repeat, or be live again by now).
    pub(super) idle: Vec<Rank>,
    /// Total number of entries over all buckets.
    pub(super) len: usize,
    /// Idle buckets tolerated beyond the live ones before a sweep.
    pub(super) slack: usize,
}

/// Whether an empty bucket still holds storage (a sparse bucket always
/// does: its map entry).
#[inline]
fn holds<E>(key: Rank, b: &Fifo<E>) -> bool {
    key >= DENSE_RANKS || b.capacity() > 0
}

impl<E: Sequenced> Buckets<E> {
    pub(super) fn new(slack: usize) -> Self {
        Buckets {
            dense: Vec::new(),
            sparse: FxMap::default(),
            live: 0,
            idle: Vec::new(),
            len: 0,
            slack,
        }
    }

    /// Bucket `key`, if it exists.
    #[inline]
    pub(super) fn get(&self, key: Rank) -> Option<&Fifo<E>> {
        if key < DENSE_RANKS {
            self.dense.get(key)
        } else {
            self.sparse.get(&key)
        }
    }

    /// Bucket `key` for a change, if it exists.
    #[inline]
    pub(super) fn get_mut(&mut self, key: Rank) -> Option<&mut Fifo<E>> {
        if key < DENSE_RANKS {
            self.dense.get_mut(key)
        } else {
            self.sparse.get_mut(&key)
        }
    }

    /// Appends the entry `make` makes (which must carry the highest sequence
    /// number so far) to bucket `key`. It is made once its place is known,
    /// so that it is written there and not first built elsewhere and moved
    /// in (see [`MatchingEngine::post_with`](super::MatchingEngine::post_with)).
    #[inline(always)]
    pub(super) fn push(&mut self, key: Rank, make: impl FnOnce() -> E) {
        let b = if key < DENSE_RANKS {
            if key >= self.dense.len() {
                self.dense.resize_with(key + 1, Fifo::new);
            }
            &mut self.dense[key]
        } else {
            self.sparse.entry(key).or_default()
        };
        self.live += usize::from(b.is_empty());
        b.push_with(make);
        self.len += 1;
    }

    /// Removes the entry of bucket `key` at the index `pick` chooses.
    #[inline(always)]
    pub(super) fn remove_in(
        &mut self,
        key: Rank,
        pick: impl FnOnce(&Fifo<E>) -> Option<usize>,
    ) -> Option<E> {
        self.remove_with(key, pick, |b, i| b.remove(i))
    }

    /// Removes the entry of bucket `key` at the index `pick` chooses with
    /// `take` (which takes it out of the bucket: what it makes of it).
    /// Inlined, so that a caller that drops the entry
    /// ([`Fifo::drop_at`]) reads only what its drop needs, instead of
    /// having it copied out first.
    #[inline(always)]
    pub(super) fn remove_with<X>(
        &mut self,
        key: Rank,
        pick: impl FnOnce(&Fifo<E>) -> Option<usize>,
        take: impl FnOnce(&mut Fifo<E>, usize) -> Option<X>,
    ) -> Option<X> {
        if self.len == 0 {
            return None;
        }
        let b = self.get_mut(key)?;
        let i = pick(b)?;
        let x = take(b, i)?;
        self.note_removed(key);
        Some(x)
    }

    /// Bookkeeping after one entry was removed from bucket `key`.
    #[inline]
    fn note_removed(&mut self, key: Rank) {
        self.len -= 1;
        let Some(b) = self.get_mut(key) else {
            return;
        };
        shrink_fifo(b);
        if b.is_empty() {
            let held = holds(key, b);
            self.live -= 1;
            if held {
                self.note_idle(key);
            }
        }
    }

    /// Records that bucket `key` became empty while holding storage, and
    /// sweeps once the idle ones outnumber the live ones by the slack.
    #[inline]
    fn note_idle(&mut self, key: Rank) {
        self.idle.push(key);
        if self.idle.len() > self.live + self.slack {
            self.tidy();
        }
    }

    /// Drops repeated and no longer idle keys from `idle`, then frees the
    /// idle buckets if there are still too many. Amortized constant time
    /// per idle key: `idle` is at least `slack + 1` longer than the live
    /// count when this runs.
    #[cold]
    fn tidy(&mut self) {
        let mut idle = std::mem::take(&mut self.idle);
        idle.sort_unstable();
        idle.dedup();
        idle.retain(|&k| self.get(k).is_some_and(|b| b.is_empty() && holds(k, b)));
        self.idle = idle;
        if self.idle.len() > self.live + self.slack {
            self.sweep();
        }
    }

    /// Moves the entries satisfying `f` to `out`, in no particular order.
    pub(super) fn extract_where(&mut self, mut f: impl FnMut(&E) -> bool, out: &mut Vec<E>) {
        let mut idled = Vec::new();
        let (mut emptied, mut removed) = (0, 0);
        for (key, b) in self.iter_mut() {
            let before = b.len();
            if before == 0 {
                continue;
            }
            b.extract_where(&mut f, out);
            shrink_fifo(b);
            removed += before - b.len();
            if b.is_empty() {
                emptied += 1;
                if holds(key, b) {
                    idled.push(key);
                }
            }
        }
        self.len -= removed;
        self.live -= emptied;
        self.idle.extend(idled);
        if self.idle.len() > self.live + self.slack {
            self.tidy();
        }
    }

    /// Frees the storage of every idle bucket.
    fn sweep(&mut self) {
        for k in std::mem::take(&mut self.idle) {
            if k < DENSE_RANKS {
                if let Some(b) = self.dense.get_mut(k).filter(|b| b.is_empty()) {
                    *b = Fifo::new();
                }
            } else if self.sparse.get(&k).is_some_and(|b| b.is_empty()) {
                self.sparse.remove(&k);
            }
        }
        shrink_map(&mut self.sparse);
    }

    /// Moves every entry out, with its key, leaving no buckets.
    pub(super) fn drain_each(&mut self, mut f: impl FnMut(Rank, E)) {
        for (key, b) in std::mem::take(&mut self.dense).into_iter().enumerate() {
            b.into_entries().for_each(|e| f(key, e));
        }
        for (key, b) in self.sparse.drain() {
            b.into_entries().for_each(|e| f(key, e));
        }
        shrink_map(&mut self.sparse);
        self.idle = Vec::new();
        self.live = 0;
        self.len = 0;
    }

    /// Every bucket with its key (empty ones included), dense ones first.
    pub(super) fn iter(&self) -> impl Iterator<Item = (Rank, &Fifo<E>)> {
        let dense = self.dense.iter().enumerate();
        dense.chain(self.sparse.iter().map(|(&k, b)| (k, b)))
    }

    /// Every bucket with its key, for a change.
    fn iter_mut(&mut self) -> impl Iterator<Item = (Rank, &mut Fifo<E>)> {
        let dense = self.dense.iter_mut().enumerate();
        dense.chain(self.sparse.iter_mut().map(|(&k, b)| (k, b)))
    }
}

/// Index and sequence number of the first entry of `q` satisfying `ok`,
/// looking only at entries with a sequence number below `before`.
#[inline]
pub(super) fn first_match<E: Sequenced>(
    q: &Fifo<E>,
    before: u64,
    mut ok: impl FnMut(&E) -> bool,
) -> Option<(usize, u64)> {
    q.iter()
        .enumerate()
        .take_while(|(_, e)| e.seq() < before)
        .find(|(_, e)| ok(e))
        .map(|(i, e)| (i, e.seq()))
}

/// The capacity to shrink storage of `len` entries and capacity `cap` to,
/// if it has become mostly empty (under a quarter full, and larger than
/// [`SHRINK_MIN`]): twice its length. The one rule for every queue, map
/// and vector of the engine.
#[inline]
pub(super) fn shrunk_capacity(len: usize, cap: usize) -> Option<usize> {
    (cap > SHRINK_MIN && len * 4 < cap).then_some(len * 2)
}

/// Gives back the memory of a deque that has become mostly empty.
#[inline]
pub(super) fn shrink_deque<E>(q: &mut VecDeque<E>) {
    if let Some(c) = shrunk_capacity(q.len(), q.capacity()) {
        q.shrink_to(c);
    }
}

/// Gives back the memory of a queue that has become mostly empty.
#[inline]
pub(super) fn shrink_fifo<E>(q: &mut Fifo<E>) {
    if let Some(c) = shrunk_capacity(q.len(), q.capacity()) {
        q.shrink_to(c);
    }
}

/// Gives back the memory of a map that has become mostly empty.
#[inline]
pub(super) fn shrink_map<K: Eq + std::hash::Hash, V>(m: &mut FxMap<K, V>) {
    if let Some(c) = shrunk_capacity(m.len(), m.capacity()) {
        m.shrink_to(c);
    }
}
