//! The producing end of a ring: room, the two message forms, publication,
//! and the `waiting` flag's half of the handshake.

use std::ptr;

use super::*;

/// The producing end. Only one producer may exist per ring.
#[derive(Debug)]
pub struct Producer {
    /// The ring, its lifetime erased: [`Producer::new`]'s contract keeps it.
    pub(super) ring: RingRef<'static>,
    pub(super) head: u64,
    pub(super) tail_cache: u64,
    /// What we last stored in the ring's `waiting` word.
    pub(super) waiting: bool,
    /// The ring's [`max_payload`](RingRef::max_payload), checked on every
    /// push (worked out once).
    pub(super) max_payload: usize,
}

impl Producer {
    /// The producer of a fresh ring.
    ///
    /// # Safety
    /// The ring's memory must outlive the producer, and no other producer may
    /// exist for it.
    pub unsafe fn new(ring: RingRef<'_>) -> Producer {
        Producer {
            ring: ring.detach(),
            head: 0,
            tail_cache: 0,
            waiting: false,
            max_payload: ring.max_payload(),
        }
    }

    /// The ring.
    pub fn ring(&self) -> RingRef<'_> {
        self.ring
    }

    /// The consumer's position as this producer last read it (what a full
    /// ring was full against): [`RingRef::consumer_position`] differs from
    /// it once the consumer has freed something since.
    pub fn consumer_position_seen(&self) -> u64 {
        self.tail_cache
    }

    /// Whether a message of `len` bytes fits now, however it goes (long,
    /// with its padding), refreshing the consumer's position if needed.
    ///
    /// # Errors
    /// [`RingError::BadTail`] if the consumer's position read from the ring
    /// is one it cannot have published (behind the last one seen, or past
    /// this producer's head): the ring is corrupt. Nothing is changed then,
    /// and a later call reads the position again.
    pub fn has_room(&mut self, len: usize) -> Result<bool, RingError> {
        self.has_slots(slots_for(len) + 1)
    }

    /// Whether `k` slots from the head are free now (see
    /// [`has_room`](Producer::has_room) for the errors).
    #[inline]
    fn has_slots(&mut self, k: u64) -> Result<bool, RingError> {
        let n = self.ring.nslots as u64;
        // No underflow: tail_cache <= head always (it only takes validated
        // values, and head only grows).
        if self.head + k - self.tail_cache <= n {
            return Ok(true);
        }
        // Acquire pairs with the consumer's Release store of tail: its zeroing
        // of the freed slots happens before our reuse.
        let tail = self.ring.tail().load(Ordering::Acquire);
        // A real consumer's position only grows (and coherence keeps our
        // loads of it in order), and never passes what we published.
        if tail < self.tail_cache || tail > self.head {
            return Err(RingError::BadTail {
                tail,
                head: self.head,
            });
        }
        self.tail_cache = tail;
        Ok(self.head + k - tail <= n)
    }

    /// Appends a message: `Ok(false)` (and nothing written) if the ring
    /// lacks room. `header.len` is set from `payload`. It goes short if
    /// [`is_short`] says so, else long.
    ///
    /// # Errors
    /// [`RingError::BadTail`] (nothing written) if the consumer's position is
    /// corrupt, see [`has_room`](Producer::has_room).
    ///
    /// # Panics
    /// If `payload` exceeds [`RingRef::max_payload`] or `header.kind` is not
    /// below [`KIND_SHORT`] (a caller bug).
    #[inline]
    pub fn try_push(&mut self, header: &Header, payload: &[u8]) -> Result<bool, RingError> {
        assert!(
            payload.len() <= self.max_payload && header.kind < KIND_SHORT,
            "message too large for ring, or a kind the ring reserves"
        );
        let pushed = if is_short(header, payload.len()) {
            self.push_short(header, payload)?
        } else {
            self.push_long(header, payload)?
        };
        if pushed {
            self.claim_ahead();
        }
        Ok(pushed)
    }

    /// A short message: one slot.
    #[inline(always)]
    fn push_short(&mut self, header: &Header, payload: &[u8]) -> Result<bool, RingError> {
        // On a line's first slot it also owns the second (see below).
        let line_start = self.head & 1 == 0;
        if !self.has_slots(1 + u64::from(line_start))? {
            return Ok(false);
        }
        let slot = self.ring.slot(self.head);
        #[cfg(loom)]
        self.ring.touch(self.head, 1, true);
        if line_start {
            // The second half of the line may start a message next (a
            // short one, or a padding entry): its first word, which may be
            // stale payload (the consumer zeroes only the line starts of a
            // long message's continuation), is zeroed here, in the line we
            // write anyway. Relaxed: ordered before the consumer's read of
            // it by our publication below.
            self.ring.seq(self.head + 1).store(0, Ordering::Relaxed);
        }
        // SAFETY: slot `head` is free (has_slots) and the producer's until
        // published; every offset lies inside it (the payload is at most
        // SHORT_INLINE bytes, see `is_short`).
        unsafe {
            ptr::write(slot.add(OFF_KIND), header.kind | KIND_SHORT);
            ptr::write(slot.add(OFF_FLAGS), header.flags);
            ptr::write(slot.add(OFF_SHORT_LEN), payload.len() as u8);
            ptr::write_unaligned(slot.add(OFF_TAG) as *mut i32, header.tag);
            ptr::write_unaligned(slot.add(OFF_CONTEXT) as *mut u32, header.context);
            copy_small(payload.as_ptr(), slot.add(OFF_SHORT_PAYLOAD), payload.len());
        }
        self.publish(1);
        Ok(true)
    }

    /// A long message: a padding entry first if the head is not on a line,
    /// then the header's two slots and the payload's continuation slots.
    #[inline(always)]
    fn push_long(&mut self, header: &Header, payload: &[u8]) -> Result<bool, RingError> {
        let pad = self.head & 1;
        let k = slots_for(payload.len());
        if !self.has_slots(pad + k)? {
            return Ok(false);
        }
        // The message's first slot: past the padding entry, if any.
        let at = self.head + pad;
        let first = payload.len().min(INLINE);
        let slot = self.ring.slot(at);
        let second = self.ring.slot(at + 1);
        #[cfg(loom)]
        self.ring.touch(self.head, pad + k, true);
        // SAFETY: slots head..at+k are free (has_slots) and owned by the
        // producer until published; `at` is even, so the message's first
        // two slots lie side by side in one line (never split by the wrap:
        // nslots is even); the rest is inside the slot area (wrapping
        // handled by `write_wrapped`).
        //
        // The continuation slots first, the first line last: every store to
        // the line a waiting consumer polls (header, inline payload, then
        // `seq`) comes in one burst, so that line leaves the consumer once
        // per message. Written header first, a consumer that polls between
        // the header and the publication (while the continuation's line is
        // still on its way to us) takes the line back, and the publication
        // waits for it a second time (measured: osu_bw 64 B +2-8%).
        unsafe {
            if pad == 1 {
                ptr::write(self.ring.slot(self.head).add(OFF_KIND), KIND_PAD);
            }
            if payload.len() > first {
                self.write_wrapped(at + 2, &payload[first..]);
            }
        }
        // Relaxed: the zero word that makes the second slot's first word
        // never look published (see the module docs), ordered before any
        // reader by the publication below. With the first line's other
        // stores, after the continuation's (a store to the first line
        // before those cost osu_latency 32-64 B about 30%: the line went to
        // us, back to the polling consumer, and to us again).
        self.ring.seq(at + 1).store(0, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe {
            ptr::write_unaligned(second.add(OFF_AUX) as *mut u64, header.aux);
            copy_small(payload.as_ptr(), second.add(OFF_INLINE), first);
            ptr::write(slot.add(OFF_KIND), header.kind);
            ptr::write(slot.add(OFF_FLAGS), header.flags);
            ptr::write_unaligned(slot.add(OFF_TAG) as *mut i32, header.tag);
            ptr::write_unaligned(slot.add(OFF_CONTEXT) as *mut u32, header.context);
            ptr::write_unaligned(slot.add(OFF_LEN) as *mut u32, payload.len() as u32);
            ptr::write_unaligned(slot.add(OFF_COOKIE) as *mut u64, header.cookie);
        }
        // The message is published first, then its padding entry: a
        // consumer (or a waiter's `has_message`) that finds the padding
        // published finds the message behind it too, so one word at the
        // consumer's position still says whether a message is there (a
        // producer that dies between the two leaves neither looking
        // published).
        self.ring.seq(at).store(at + 1, Ordering::Release);
        if pad == 1 {
            self.ring
                .seq(self.head)
                .store(self.head + 1, Ordering::Release);
        }
        self.head = at + k;
        Ok(true)
    }

    /// Publishes the entry at the head, of `k` slots, and moves past it.
    #[inline(always)]
    fn publish(&mut self, k: u64) {
        // Release: publication (pairs with the consumer's Acquire load of
        // seq). A sleeping consumer is covered by the doorbell the caller
        // rings next: its fence after this store is the publisher's half of
        // the doorbell argument (see `crate::doorbell`), so no SeqCst here.
        self.ring
            .seq(self.head)
            .store(self.head + 1, Ordering::Release);
        self.head += k;
    }

    /// Asks for write ownership of the line [`CLAIM_AHEAD`] slots past the
    /// head, if that slot is known free: the consumer read it last, so the
    /// first store there waits for a cross-core transfer, and every later
    /// store waits behind it in the store buffer. Started now, the transfer
    /// overlaps the messages in between instead (what a producer with an
    /// empty store buffer gets for free). A hint: no effect on what the
    /// ring holds.
    #[inline]
    fn claim_ahead(&self) {
        #[cfg(all(target_arch = "x86_64", not(loom)))]
        {
            let at = self.head + CLAIM_AHEAD;
            if at + 1 - self.tail_cache <= self.ring.nslots as u64 {
                // SAFETY: `slot` stays inside the ring's mapping for every
                // position; `prefetchw` reads and writes nothing (and is a
                // no-op where the CPU lacks it: it sits in the NOP space).
                unsafe {
                    std::arch::asm!(
                        "prefetchw [{0}]",
                        in(reg) self.ring.slot(at),
                        options(nostack, preserves_flags, readonly)
                    );
                }
            }
        }
    }

    /// # Safety
    /// The slots from `pos` covering `data` must be free and owned by the
    /// producer.
    unsafe fn write_wrapped(&self, pos: u64, data: &[u8]) {
        let area = self.ring.area();
        let size = self.ring.nslots * SLOT;
        let off = (pos as usize & (self.ring.nslots - 1)) * SLOT;
        let n1 = data.len().min(size - off);
        // SAFETY: off + n1 <= size and the remainder (< size/2) starts at 0.
        unsafe {
            ptr::copy_nonoverlapping(data.as_ptr(), area.add(off), n1);
            ptr::copy_nonoverlapping(data.as_ptr().add(n1), area, data.len() - n1);
        }
    }

    /// Tells the consumer whether the producer waits for room: while the
    /// flag is set, every [`Consumer::pop`] reports it (and its caller rings
    /// the producer's doorbell).
    ///
    /// The guarantee: after `set_waiting(true)`, a re-check of room
    /// ([`try_push`](Producer::try_push), [`has_room`](Producer::has_room))
    /// that finds none is followed by a `pop` that reports the flag. So a
    /// producer that flags, re-checks and then sleeps until rung (with the
    /// doorbell's own re-check) cannot miss the room being freed.
    ///
    /// Only a change is written (and fenced): calling it on every retry is
    /// free.
    pub fn set_waiting(&mut self, waiting: bool) {
        if waiting == self.waiting {
            return;
        }
        self.waiting = waiting;
        // Relaxed: the fence below orders the store. Clearing needs no
        // ordering: a consumer that still sees the flag only rings a
        // doorbell for nothing.
        self.ring.waiting().store(waiting as u32, Ordering::Relaxed);
        if waiting {
            // Store-buffer handshake, producer's half: our flag store before
            // our next load of `tail` (the re-check). Paired with the fence
            // in `Consumer::pop` between its `tail` store and its load of the
            // flag: either our re-check sees the freed room, or that pop sees
            // the flag. Heavy (`membarrier`) so that pop's half is free.
            heavy_fence();
        }
    }
}
