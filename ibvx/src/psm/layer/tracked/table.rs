//! The shape both of a [`TrackedQueue`](super::TrackedQueue)'s tables
//! share: PSM2 requests in slots, each named by a [`RequestKey`] of its
//! table, slot and the slot's generation, so that a key stays unique after
//! its request is gone and the slot reused.

use std::ptr;

use psm_sys::ffi::psm2_mq_req_t;

use super::{RequestKey, LENT_BIT};

/// One slot: a live PSM2 request and its payload, or free.
pub(super) struct Entry<P> {
    pub(super) generation: u32,
    /// PSM2's handle; meaningful while `payload` is `Some`.
    pub(super) req: psm2_mq_req_t,
    /// Whether the request is a receive (PSM2 cancels receives only).
    pub(super) recv: bool,
    pub(super) payload: Option<P>,
}

/// A table of requests whose keys have the top bit set if `LENT` (the
/// lent table), clear if not (known when compiled, so that telling a key's
/// table costs no load).
pub(super) struct Table<P, const LENT: bool> {
    entries: Vec<Entry<P>>,
    free: Vec<usize>,
}

impl<P, const LENT: bool> Table<P, LENT> {
    /// The top bit of this table's keys.
    const FLAG: u64 = if LENT { LENT_BIT } else { 0 };

    /// An empty table.
    pub(super) fn new() -> Self {
        Table {
            entries: Vec::new(),
            free: Vec::new(),
        }
    }

    /// Whether `key` is one of this table's (by its top bit).
    #[inline(always)]
    fn owns(&self, key: RequestKey) -> bool {
        key.is_lent() == LENT
    }

    /// The key of slot `index` as it is now.
    #[inline(always)]
    pub(super) fn key(&self, index: usize) -> RequestKey {
        RequestKey(Self::FLAG | RequestKey::new(index, self.entries[index].generation).0)
    }

    /// The key the next [`claim`](Self::claim) gives.
    #[inline(always)]
    pub(super) fn next_key(&self) -> RequestKey {
        match self.free.last() {
            Some(&i) => self.key(i),
            None => RequestKey(Self::FLAG | RequestKey::new(self.entries.len(), 0).0),
        }
    }

    /// A free slot, taken: the one [`next_key`](Self::next_key) named.
    /// [`fill`](Self::fill) enters a request in it, or
    /// [`unclaim`](Self::unclaim) gives it back.
    #[inline(always)]
    pub(super) fn claim(&mut self) -> usize {
        match self.free.pop() {
            Some(i) => i,
            None => {
                self.entries.push(Entry {
                    generation: 0,
                    req: ptr::null_mut(),
                    recv: false,
                    payload: None,
                });
                self.entries.len() - 1
            }
        }
    }

    /// Enters `req` with `payload` in claimed slot `index`.
    #[inline(always)]
    pub(super) fn fill(&mut self, index: usize, req: psm2_mq_req_t, recv: bool, payload: P) {
        let e = &mut self.entries[index];
        e.req = req;
        e.recv = recv;
        e.payload = Some(payload);
    }

    /// Gives claimed slot `index` back unfilled (its post failed).
    #[inline(always)]
    pub(super) fn unclaim(&mut self, index: usize) {
        self.free.push(index);
    }

    /// The slot of live request `key`.
    #[inline(always)]
    pub(super) fn live(&self, key: RequestKey) -> Option<&Entry<P>> {
        if !self.owns(key) {
            return None;
        }
        self.entries
            .get(key.index())
            .filter(|e| e.generation == key.generation() && e.payload.is_some())
    }

    /// The payload of live request `key`, to change.
    #[inline]
    pub(super) fn payload_mut(&mut self, key: RequestKey) -> Option<&mut P> {
        if !self.owns(key) {
            return None;
        }
        let e = self.entries.get_mut(key.index())?;
        if e.generation != key.generation() {
            return None;
        }
        e.payload.as_mut()
    }

    /// Frees the slot of `key` (its request is gone): the payload.
    #[inline(always)]
    pub(super) fn remove(&mut self, key: RequestKey) -> Option<P> {
        if !self.owns(key) {
            return None;
        }
        let e = self.entries.get_mut(key.index())?;
        if e.generation != key.generation() {
            return None;
        }
        let payload = e.payload.take()?;
        e.req = ptr::null_mut();
        e.generation = next_generation(e.generation);
        self.free.push(key.index());
        Some(payload)
    }

    /// Frees slot `index`, which [`live`](Self::live) found for a key just
    /// now (nothing can have changed it since: `&mut self`), with what
    /// `pick` read from its payload first (which is then dropped in place).
    /// `None` if it is not live after all.
    #[inline(always)]
    pub(super) fn take_live<R>(&mut self, index: usize, pick: impl FnOnce(&P) -> R) -> Option<R> {
        let e = self.entries.get_mut(index)?;
        let picked = pick(e.payload.as_ref()?);
        e.payload = None;
        e.req = ptr::null_mut();
        e.generation = next_generation(e.generation);
        self.free.push(index);
        Some(picked)
    }

    /// Every outstanding request's key and payload.
    pub(super) fn iter(&self) -> impl Iterator<Item = (RequestKey, &P)> {
        self.entries
            .iter()
            .enumerate()
            .filter_map(move |(i, e)| e.payload.as_ref().map(|p| (self.key(i), p)))
    }

    /// How many requests are outstanding.
    pub(super) fn len(&self) -> usize {
        self.entries.len() - self.free.len()
    }

    /// The payloads still outstanding (the queue was closed: PSM2 let go
    /// of every request).
    pub(super) fn into_payloads(self) -> Vec<P> {
        self.entries.into_iter().filter_map(|e| e.payload).collect()
    }
}

/// The next generation of a slot whose request is gone.
#[inline(always)]
fn next_generation(g: u32) -> u32 {
    (g + 1) % super::GENERATIONS
}
