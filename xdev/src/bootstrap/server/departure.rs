//! A rank's departure: its waiting gets withdrawn, the collective it can
//! no longer enter failed, and every other rank told.

use super::{frame, CollKind, Out, Slot, State};
use crate::bootstrap::wire::{FailureKind, Message};
use crate::bootstrap::Departure;
use crate::Rank;

impl State {
    pub(super) fn depart(&mut self, rank: Rank) -> (Departure, Vec<Out>) {
        let mut out = Vec::new();
        let clean = matches!(self.slots[rank], Slot::Live { goodbye: true, .. });
        self.slots[rank] = Slot::Gone { clean };
        let ids: Vec<u32> = self
            .waiting
            .keys()
            .filter(|(r, _)| *r == rank)
            .map(|&(_, id)| id)
            .collect();
        for id in ids {
            self.cancel(rank, id);
        }
        if self.coll.count > 0 && self.coll.parts[rank].is_none() {
            let kind = self.coll.kind.map_or("collective", CollKind::name);
            let text = format!("rank {rank} left the job before entering the {kind}");
            self.fail_collective(&mut out, FailureKind::PeerLost, rank, &text);
        }
        let notice = frame(&Message::Departed {
            rank: rank as u32,
            clean,
        });
        for r in 0..self.slots.len() {
            if r != rank {
                self.reply(&mut out, r, notice.clone(), None);
            }
        }
        (Departure { rank, clean }, out)
    }
}
