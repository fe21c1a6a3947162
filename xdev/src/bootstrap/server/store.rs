//! The store: `put` (a key belongs to the rank that first put it), `get`
//! (waiting until some rank puts the key) and `cancel` of a waiting get.

use std::sync::Arc;

use super::{frame, Out, State};
use crate::bootstrap::wire::{self, FailureKind, Message};
use crate::Rank;

impl State {
    /// Stores `value` under `key` for `rank`. A key belongs to the rank that
    /// first put it: its owner may replace the value, any other rank's put
    /// is refused with a protocol failure blaming that rank (so no rank can
    /// pose as another through a record the others read).
    pub(super) fn put(
        &mut self,
        limit: usize,
        rank: Rank,
        id: u32,
        key: String,
        value: Vec<u8>,
    ) -> Vec<Out> {
        let mut out = Vec::new();
        if let Some(&(owner, _)) = self.store.get(&key).filter(|(owner, _)| *owner != rank) {
            let text = format!(
                "rank {rank} put key {key:?}, which rank {owner} put first: a key belongs to the rank that first put it"
            );
            self.refuse(&mut out, rank, id, FailureKind::Protocol, rank, text);
            return out;
        }
        let old = self.store.get(&key).map_or(0, |(_, v)| key.len() + v.len());
        let add = key.len() + value.len();
        if self.used - old + add > limit {
            let text = format!(
                "bootstrap store full: {} of {limit} bytes in use, a {add}-byte entry does not fit",
                self.used
            );
            self.refuse(
                &mut out,
                rank,
                id,
                FailureKind::ResourceExhausted,
                rank,
                text,
            );
            return out;
        }
        self.used = self.used - old + add;
        let value: Arc<[u8]> = value.into();
        for (r, wid) in self.waiters.remove(&key).unwrap_or_default() {
            self.waiting.remove(&(r, wid));
            self.waiting_per_rank[r] -= 1;
            let head = wire::value_head(wid, value.len()).expect("stored values are within limits");
            self.reply(&mut out, r, head, Some(value.clone()));
        }
        self.store.insert(key, (rank, value));
        self.reply(&mut out, rank, frame(&Message::Done { id }), None);
        out
    }

    pub(super) fn get(&mut self, max_waiting: usize, rank: Rank, id: u32, key: String) -> Vec<Out> {
        let mut out = Vec::new();
        if let Some((_, v)) = self.store.get(&key) {
            let head = wire::value_head(id, v.len()).expect("stored values are within limits");
            let v = v.clone();
            self.reply(&mut out, rank, head, Some(v));
        } else if self.waiting.contains_key(&(rank, id)) {
            let text = format!("request id {id} is already waiting");
            self.refuse(&mut out, rank, id, FailureKind::Protocol, rank, text);
        } else if self.waiting_per_rank[rank] >= max_waiting {
            let text = format!("rank {rank} already has {max_waiting} gets waiting");
            self.refuse(
                &mut out,
                rank,
                id,
                FailureKind::ResourceExhausted,
                rank,
                text,
            );
        } else {
            self.waiters
                .entry(key.clone())
                .or_default()
                .push((rank, id));
            self.waiting.insert((rank, id), key);
            self.waiting_per_rank[rank] += 1;
        }
        out
    }

    pub(super) fn cancel(&mut self, rank: Rank, id: u32) {
        if let Some(key) = self.waiting.remove(&(rank, id)) {
            self.waiting_per_rank[rank] -= 1;
            if let Some(list) = self.waiters.get_mut(&key) {
                list.retain(|&w| w != (rank, id));
                if list.is_empty() {
                    self.waiters.remove(&key);
                }
            }
        }
    }
}
