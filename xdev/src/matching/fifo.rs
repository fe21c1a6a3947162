//! [`Fifo`]: the queue under every bucket of posted receives and unexpected
//! messages, whose entries are written where they are stored and taken from
//! there.
//!
//! A `VecDeque` takes a new entry by value in a call of its own
//! (`push_back` is not inlined into the engines), so the entry is first
//! built on the caller's stack, field by field, then copied into the deque
//! in 16-byte words. Each such load spans several of the narrow stores just
//! made, which the processor cannot forward: it waits until they, and every
//! older store (a ring's, whose line the peer holds), reach the cache. On
//! the shm device's osu_bibw at 8 B that one load held 73% of the samples
//! of `push_back`, and the copies of a matched receive on its way out of
//! `remove` a quarter of `drain`'s.
//!
//! Here the storage holds `None` in every slot past the live entries, and a
//! push fills the next one with `Option::get_or_insert_with`: on that path
//! the slot is known to be `None`, so nothing is dropped between building
//! the entry and storing it, and it is built in its slot. A take reads the
//! slot once, and [`MatchingEngine::drop_posted_at`] drops a receive in
//! its slot, so an engine that read what it needs by reference
//! ([`MatchingEngine::find_posted`]) never has it copied out.
//!
//! Measured with both (xdev-bench, 24 rounds of the binaries in rotated
//! order, median ratio to the `VecDeque` build): osu_bibw at 1-8 B 1.17 on
//! shm and 1.11-1.13 on thread; message rate, osu_bw and latency unchanged
//! (0.98-1.01). Either alone gained nothing (0.98-1.02).
//!
//! [`MatchingEngine::drop_posted_at`]: super::MatchingEngine::drop_posted_at
//! [`MatchingEngine::find_posted`]: super::MatchingEngine::find_posted
//!
//! Entries before `head` have been taken (`None`); those from `head` to
//! `tail` are live (`Some`); the rest are `None`. Taking the last live entry
//! starts the queue over at slot 0 (the common case: a window of receives
//! posted, then matched in order). A push that finds no slot left compacts
//! when at least half of the slots were taken, and grows the storage
//! otherwise: it grows only when more than half of it is live, so it stays
//! within four times the most entries live at once, and compaction moves at
//! most one entry per entry taken.

use std::cmp::Ordering;

/// A FIFO queue with removal at any position (see the module docs).
pub(super) struct Fifo<E> {
    slots: Vec<Option<E>>,
    head: usize,
    tail: usize,
}

impl<E> Default for Fifo<E> {
    fn default() -> Self {
        Fifo::new()
    }
}

impl<E> Fifo<E> {
    /// An empty queue (allocates nothing).
    pub(super) const fn new() -> Self {
        Fifo {
            slots: Vec::new(),
            head: 0,
            tail: 0,
        }
    }

    /// The live entries.
    #[inline]
    pub(super) fn len(&self) -> usize {
        self.tail - self.head
    }

    /// Whether no entry is live.
    #[inline]
    pub(super) fn is_empty(&self) -> bool {
        self.head == self.tail
    }

    /// The entries the storage holds without growing.
    #[inline]
    pub(super) fn capacity(&self) -> usize {
        self.slots.capacity()
    }

    /// Appends the entry `make` makes, built in its slot.
    #[inline(always)]
    pub(super) fn push_with(&mut self, make: impl FnOnce() -> E) {
        if self.tail == self.slots.len() {
            self.make_room();
        }
        self.slots[self.tail].get_or_insert_with(make);
        self.tail += 1;
    }

    /// Frees a slot past `tail`: by compaction if at least half of the
    /// slots were taken, else by growing the storage (to twice its size).
    #[cold]
    fn make_room(&mut self) {
        if self.head > 0 && self.head * 2 >= self.tail {
            self.compact();
        } else {
            let grown = (self.slots.len() * 2).max(4);
            self.slots.resize_with(grown, || None);
        }
    }

    /// Moves the live entries to the front.
    fn compact(&mut self) {
        self.slots[..self.tail].rotate_left(self.head);
        self.tail -= self.head;
        self.head = 0;
    }

    /// Removes the first entry.
    #[inline(always)]
    pub(super) fn pop_front(&mut self) -> Option<E> {
        if self.head == self.tail {
            return None;
        }
        let e = self.slots[self.head].take();
        self.head += 1;
        if self.head == self.tail {
            self.head = 0;
            self.tail = 0;
        }
        e
    }

    /// Drops the entry at index `i` (0: the first), keeping the order of
    /// the others: `None` if there is none. Always inlined, so that only
    /// its drop reads it: the entry is never copied out.
    #[inline(always)]
    pub(super) fn drop_at(&mut self, i: usize) -> Option<()> {
        self.remove(i).map(drop)
    }

    /// Removes the entry at index `i` (0: the first), keeping the order of
    /// the others.
    #[inline(always)]
    pub(super) fn remove(&mut self, i: usize) -> Option<E> {
        if i == 0 {
            return self.pop_front();
        }
        self.remove_later(i)
    }

    /// [`remove`](Self::remove) of an entry after the first.
    fn remove_later(&mut self, i: usize) -> Option<E> {
        let at = self.head.checked_add(i).filter(|&at| at < self.tail)?;
        let e = self.slots[at].take();
        self.slots[at..self.tail].rotate_left(1);
        self.tail -= 1;
        e
    }

    /// The entry at index `i`.
    #[inline]
    pub(super) fn get(&self, i: usize) -> Option<&E> {
        self.live().get(i)?.as_ref()
    }

    /// The live slots.
    #[inline]
    fn live(&self) -> &[Option<E>] {
        &self.slots[self.head..self.tail]
    }

    /// The live entries, first to last.
    #[inline]
    pub(super) fn iter(&self) -> impl Iterator<Item = &E> {
        self.live().iter().flatten()
    }

    /// The index of the entry whose key `f` gives as `key`, the entries
    /// being sorted by that key (as `slice::binary_search_by_key`).
    pub(super) fn binary_search_by_key<K: Ord>(
        &self,
        key: &K,
        f: impl Fn(&E) -> K,
    ) -> Result<usize, usize> {
        self.live().binary_search_by(|s| match s {
            Some(e) => f(e).cmp(key),
            // Unreachable (live slots are `Some`); sorts after everything.
            None => Ordering::Greater,
        })
    }

    /// Shrinks the storage to at least `cap` entries (and the live ones).
    pub(super) fn shrink_to(&mut self, cap: usize) {
        self.compact();
        self.slots.truncate(self.tail.max(cap));
        self.slots.shrink_to(cap);
    }

    /// Moves the entries satisfying `f` to `out`, keeping the order of the
    /// others.
    pub(super) fn extract_where(&mut self, mut f: impl FnMut(&E) -> bool, out: &mut Vec<E>) {
        let mut kept = self.head;
        for i in self.head..self.tail {
            let Some(e) = self.slots[i].take() else {
                continue;
            };
            if f(&e) {
                out.push(e);
            } else {
                // Slot `kept` (at most `i`) was taken already: it is `None`.
                self.slots[kept] = Some(e);
                kept += 1;
            }
        }
        self.tail = kept;
        if self.head == self.tail {
            self.head = 0;
            self.tail = 0;
        }
    }

    /// The live entries, by value, first to last.
    pub(super) fn into_entries(self) -> impl Iterator<Item = E> {
        self.slots.into_iter().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::Fifo;
    use std::collections::VecDeque;

    /// A random walk of pushes, pops, removals and shrinks, checked step by
    /// step against `VecDeque`, with the storage bound of the module docs.
    #[test]
    fn behaves_like_a_deque_within_its_storage_bound() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let (mut f, mut d) = (Fifo::new(), VecDeque::new());
        let mut peak = 0;
        for step in 0..200_000u64 {
            // Phases that grow and shrink the queue, so both the emptying
            // and the compaction paths run.
            let growing = (step / 5_000) % 2 == 0;
            match next() % 10 {
                0..=4 if growing => {
                    f.push_with(|| step);
                    d.push_back(step);
                }
                0..=1 => {
                    f.push_with(|| step);
                    d.push_back(step);
                }
                2..=6 => assert_eq!(f.pop_front(), d.pop_front()),
                7 => {
                    let i = (next() % (d.len() as u64 + 2)) as usize;
                    assert_eq!(f.remove(i), d.remove(i));
                }
                8 => {
                    let i = (next() % (d.len() as u64 + 2)) as usize;
                    assert_eq!(f.drop_at(i), d.remove(i).map(drop));
                }
                _ => {
                    if next() % 64 == 0 {
                        f.shrink_to(f.len() * 2);
                    }
                }
            }
            peak = peak.max(d.len());
            assert_eq!(f.len(), d.len());
            assert_eq!(f.is_empty(), d.is_empty());
            assert!(f.iter().eq(d.iter()));
            let i = (next() % (d.len() as u64 + 1)) as usize;
            assert_eq!(f.get(i), d.get(i));
            let k = next() % (step + 2);
            assert_eq!(
                f.binary_search_by_key(&k, |&e| e),
                d.binary_search_by_key(&k, |&e| e)
            );
            // The storage grows only when more than half of it is live, so
            // it stays within four times the most entries ever live (a
            // `Vec` allocates at least four).
            assert!(
                f.capacity() <= 4 * peak.max(1),
                "capacity {} for at most {peak} live entries",
                f.capacity()
            );
        }
    }

    #[test]
    fn extract_where_keeps_the_order_of_what_stays() {
        let mut f = Fifo::new();
        for i in 0..10u32 {
            f.push_with(|| i);
        }
        assert_eq!(f.pop_front(), Some(0));
        let mut out = Vec::new();
        f.extract_where(|&e| e % 3 == 0, &mut out);
        assert_eq!(out, [3, 6, 9]);
        assert!(f.iter().copied().eq([1, 2, 4, 5, 7, 8]));
        assert!(f.into_entries().eq([1, 2, 4, 5, 7, 8]));
    }

    #[test]
    fn taking_the_last_entry_reuses_the_storage_from_its_start() {
        let mut f = Fifo::new();
        for i in 0..64u32 {
            f.push_with(|| i);
        }
        let cap = f.capacity();
        for i in 0..64u32 {
            assert_eq!(f.pop_front(), Some(i));
        }
        assert!(f.is_empty());
        assert_eq!((f.head, f.tail), (0, 0));
        for i in 0..64u32 {
            f.push_with(|| i);
        }
        assert_eq!(f.capacity(), cap, "a second window needs no new storage");
    }
}
