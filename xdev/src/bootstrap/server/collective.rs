//! The collectives: barrier and allgather, one at a time, completed when
//! every rank has entered and failed when a rank that has not leaves.

use std::sync::Arc;

use super::{frame, CollKind, Out, Slot, State};
use crate::bootstrap::wire::{self, FailureKind, Message};
use crate::Rank;

impl State {
    /// Fails every contribution of the collective in progress and resets it.
    pub(super) fn fail_collective(
        &mut self,
        out: &mut Vec<Out>,
        kind: FailureKind,
        rank: Rank,
        text: &str,
    ) {
        let parts = std::mem::take(&mut self.coll.parts);
        self.coll.parts = vec![None; parts.len()];
        self.used -= self.coll.bytes;
        self.coll.bytes = 0;
        self.coll.count = 0;
        self.coll.kind = None;
        for (r, part) in parts.into_iter().enumerate() {
            if let Some((id, _)) = part {
                self.refuse(out, r, id, kind, rank, text.to_owned());
            }
        }
    }

    /// Enters `rank`'s request `id` into the collective of `kind` with its
    /// contribution `data` (empty for a barrier), completing the collective
    /// when it is the last.
    pub(super) fn arrive(
        &mut self,
        limit: usize,
        rank: Rank,
        id: u32,
        kind: CollKind,
        data: Vec<u8>,
    ) -> Vec<Out> {
        let mut out = Vec::new();
        if self.refuse_arrival(&mut out, limit, rank, id, kind, data.len()) {
            return out;
        }
        self.used += data.len();
        self.coll.bytes += data.len();
        self.coll.kind = Some(kind);
        self.coll.parts[rank] = Some((id, data.into()));
        self.coll.count += 1;
        if self.coll.count < self.slots.len() {
            return out;
        }
        self.complete_collective(&mut out, kind);
        out
    }

    /// Refuses an arrival that cannot join the collective in progress (a
    /// rank that has not entered it has left, the rank is in it already, the
    /// ranks are in the other kind, or the contribution of `len` bytes does
    /// not fit); returns whether it did.
    fn refuse_arrival(
        &mut self,
        out: &mut Vec<Out>,
        limit: usize,
        rank: Rank,
        id: u32,
        kind: CollKind,
        len: usize,
    ) -> bool {
        let size = self.slots.len();
        let gone = (0..size)
            .find(|&d| matches!(self.slots[d], Slot::Gone { .. }) && self.coll.parts[d].is_none());
        if let Some(d) = gone {
            let text = format!(
                "rank {d} has left the job, so the {} cannot complete",
                kind.name()
            );
            self.fail_collective(out, FailureKind::PeerLost, d, &text);
            self.refuse(out, rank, id, FailureKind::PeerLost, d, text);
            return true;
        }
        if self.coll.parts[rank].is_some() {
            let text = format!("rank {rank} entered a collective it is already in (request {id})");
            self.refuse(out, rank, id, FailureKind::Protocol, rank, text);
            return true;
        }
        if let Some(current) = self.coll.kind.filter(|&k| k != kind) {
            let text = format!(
                "rank {rank} called {} while other ranks are in {}",
                kind.name(),
                current.name()
            );
            self.fail_collective(out, FailureKind::Protocol, rank, &text);
            self.refuse(out, rank, id, FailureKind::Protocol, rank, text);
            return true;
        }
        if self.used + len > limit {
            let text = format!(
                "bootstrap store full: {} of {limit} bytes in use, a {}-byte contribution does not fit",
                self.used,
                len
            );
            self.refuse(out, rank, id, FailureKind::ResourceExhausted, rank, text);
            return true;
        }
        false
    }

    /// Answers every rank of the collective every rank has entered (a
    /// barrier's `Done`, or each contribution of an allgather) and resets it.
    fn complete_collective(&mut self, out: &mut Vec<Out>, kind: CollKind) {
        let size = self.slots.len();
        let parts: Vec<(u32, Arc<[u8]>)> = std::mem::take(&mut self.coll.parts)
            .into_iter()
            .map(|p| p.expect("every rank contributed"))
            .collect();
        self.coll.parts = vec![None; size];
        self.used -= self.coll.bytes;
        self.coll.bytes = 0;
        self.coll.count = 0;
        self.coll.kind = None;
        for (r, (rid, _)) in parts.iter().enumerate() {
            match kind {
                CollKind::Barrier => {
                    self.reply(out, r, frame(&Message::Done { id: *rid }), None);
                }
                CollKind::Allgather => {
                    for (i, (_, v)) in parts.iter().enumerate() {
                        let head = wire::gathered_head(*rid, i as u32, size as u32, v.len())
                            .expect("contributions are within limits");
                        self.reply(out, r, head, Some(v.clone()));
                    }
                }
            }
        }
    }
}
