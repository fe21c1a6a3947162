//! The consuming end of a ring: validated decoding of both forms and the
//! padding entry, payload copies that never leave the ring, and release.

use std::ptr;

use super::*;

/// A message at the head of the ring, validated.
#[derive(Copy, Clone, Debug)]
pub struct Incoming {
    /// Its header (`len` validated against the ring).
    pub header: Header,
    /// It went short (one slot).
    pub(super) short: bool,
    /// Slots before it: 1 if a padding entry precedes it, else 0.
    pub(super) pad: u64,
}

impl Incoming {
    /// Its position relative to the consumer's: where its first slot is.
    #[inline(always)]
    fn start(&self, tail: u64) -> u64 {
        tail + self.pad
    }
}

/// The consuming end. Only one consumer may exist per ring.
#[derive(Debug)]
pub struct Consumer {
    /// The ring, its lifetime erased: [`Consumer::new`]'s contract keeps it.
    pub(super) ring: RingRef<'static>,
    pub(super) tail: u64,
    /// No message starting here or later is read (see
    /// [`Consumer::stop_at`]).
    pub(super) end: u64,
    /// The ring's [`max_payload`](RingRef::max_payload), checked on every
    /// message (worked out once).
    pub(super) max_payload: usize,
}

impl Consumer {
    /// The consumer of a fresh ring.
    ///
    /// # Safety
    /// The ring's memory must outlive the consumer, and no other consumer may
    /// exist for it.
    pub unsafe fn new(ring: RingRef<'_>) -> Consumer {
        Consumer {
            ring: ring.detach(),
            tail: 0,
            end: u64::MAX,
            max_payload: ring.max_payload(),
        }
    }

    /// The consumer's position: the slot its next message starts at.
    pub fn position(&self) -> u64 {
        self.tail
    }

    /// Reads no message that starts at position `end` or later: [`peek`]
    /// says there is none. For a producer that has left, whose messages all
    /// lie within a ring's worth of slots from the position at which its
    /// departure was seen, so that one that only claims to have left cannot
    /// keep its consumer reading. A later call can only lower the limit.
    ///
    /// [`peek`]: Consumer::peek
    pub fn stop_at(&mut self, end: u64) {
        self.end = self.end.min(end);
    }

    /// The message at the head, if one is published.
    #[inline]
    pub fn peek(&self) -> Option<Result<Incoming, RingError>> {
        let at = self.tail;
        if !self.published(at) {
            return None;
        }
        let slot = self.ring.slot(at);
        #[cfg(loom)]
        self.ring.touch(at, 1, false);
        // SAFETY: the slot is published and not reused by the producer until
        // we advance tail; reads are within it. A hostile peer in another
        // process may still scribble here: every field is plain data, and
        // the kind and the length are read once, volatile, so what is
        // validated is what decides the form and sizes the copies (no second
        // fetch from the shared memory).
        let kind = unsafe { ptr::read_volatile(slot.add(OFF_KIND)) };
        if kind == KIND_PAD {
            return self.peek_long(at + 1, 1);
        }
        if kind & KIND_SHORT == 0 {
            return self.peek_long(at, 0);
        }
        // SAFETY: as above.
        let (len, header) = unsafe {
            let len = ptr::read_volatile(slot.add(OFF_SHORT_LEN));
            let header = Header {
                kind: kind & !KIND_SHORT,
                flags: ptr::read_volatile(slot.add(OFF_FLAGS)),
                tag: ptr::read_unaligned(slot.add(OFF_TAG) as *const i32),
                context: ptr::read_unaligned(slot.add(OFF_CONTEXT) as *const u32),
                len: u32::from(len),
                cookie: 0,
                aux: u64::from(len),
            };
            (len, header)
        };
        if usize::from(len) > SHORT_INLINE {
            return Some(Err(RingError::Corrupt {
                len: u32::from(len),
            }));
        }
        Some(Ok(Incoming {
            header,
            short: true,
            pad: 0,
        }))
    }

    /// Whether an entry is published at `at`, before the consumer's limit.
    #[inline(always)]
    fn published(&self, at: u64) -> bool {
        // Acquire pairs with the producer's publication store.
        at < self.end && self.ring.seq(at).load(Ordering::Acquire) == at + 1
    }

    /// [`peek`](Consumer::peek) of a long message at `at`, `pad` slots past
    /// the tail (after a padding entry: then it must be published and
    /// long, and start a line).
    #[inline(always)]
    fn peek_long(&self, at: u64, pad: u64) -> Option<Result<Incoming, RingError>> {
        if pad == 1 && !self.published(at) {
            return None;
        }
        let slot = self.ring.slot(at);
        let second = self.ring.slot(at + 1);
        #[cfg(loom)]
        self.ring.touch(at, 2, false);
        // SAFETY: as in `peek`: slots `at` and `at + 1` are published (the
        // second with the first) and inside the ring; plain data only, the
        // kind and the length read once.
        let header = unsafe {
            Header {
                kind: ptr::read_volatile(slot.add(OFF_KIND)),
                flags: ptr::read_volatile(slot.add(OFF_FLAGS)),
                tag: ptr::read_unaligned(slot.add(OFF_TAG) as *const i32),
                context: ptr::read_unaligned(slot.add(OFF_CONTEXT) as *const u32),
                len: ptr::read_volatile(slot.add(OFF_LEN) as *const u32),
                cookie: ptr::read_unaligned(slot.add(OFF_COOKIE) as *const u64),
                aux: ptr::read_unaligned(second.add(OFF_AUX) as *const u64),
            }
        };
        if pad == 1 && (header.kind & KIND_SHORT != 0 || at & 1 != 0) {
            // A padding entry our producer writes only before a long
            // message, at an odd position.
            return Some(Err(RingError::Misplaced { at: at - 1 }));
        }
        if header.len as usize > self.max_payload {
            return Some(Err(RingError::Corrupt { len: header.len }));
        }
        Some(Ok(Incoming {
            header,
            short: false,
            pad,
        }))
    }

    /// Copies the head message's payload (its first `dst.len()` bytes at
    /// most) into `dst`; returns the bytes copied.
    ///
    /// `msg` should come from [`peek`](Consumer::peek) at this position; an
    /// `Incoming` made up by the caller still never reads outside the ring
    /// (its length is capped at [`RingRef::max_payload`]), it only copies
    /// garbage.
    #[inline]
    pub fn copy_payload(&self, msg: &Incoming, dst: &mut [u8]) -> usize {
        let at = msg.start(self.tail);
        if msg.short {
            let len = (msg.header.len as usize).min(SHORT_INLINE).min(dst.len());
            #[cfg(loom)]
            self.ring.touch(at, 1, false);
            // SAFETY: len <= SHORT_INLINE bytes after OFF_SHORT_PAYLOAD lie
            // inside slot `at`, and dst.len() >= len.
            unsafe {
                copy_small(
                    self.ring.slot(at).add(OFF_SHORT_PAYLOAD),
                    dst.as_mut_ptr(),
                    len,
                )
            };
            return len;
        }
        let len = self.payload_len(msg).min(dst.len());
        let first = len.min(INLINE);
        let second = self.ring.slot(at + 1);
        #[cfg(loom)]
        self.ring.touch(at, slots_for(len), false);
        // SAFETY: len <= max_payload = INLINE + (nslots/2 - 3) * SLOT and
        // dst.len() >= len. The first `first` <= INLINE bytes lie in the
        // second slot after its zero and aux words. The rest (rest = len -
        // first < size/2) starts at the third slot's offset off <= size -
        // SLOT: n1 <= size - off bytes from off stay inside the area, and
        // the remaining rest - n1 < size bytes from the area's start too.
        // Every tail position and every len are checked against a byte
        // model in the unit tests.
        unsafe {
            copy_small(second.add(OFF_INLINE), dst.as_mut_ptr(), first);
            if len > first {
                let area = self.ring.area();
                let size = self.ring.nslots * SLOT;
                let off = ((at + 2) as usize & (self.ring.nslots - 1)) * SLOT;
                let rest = len - first;
                let n1 = rest.min(size - off);
                ptr::copy_nonoverlapping(area.add(off), dst.as_mut_ptr().add(first), n1);
                ptr::copy_nonoverlapping(area, dst.as_mut_ptr().add(first + n1), rest - n1);
            }
        }
        len
    }

    /// Releases the head message. Returns true when the producer has flagged
    /// that it waits for room (the caller then rings its doorbell); see
    /// [`Producer::set_waiting`] for why the flag is never missed.
    #[inline]
    pub fn pop(&mut self, msg: &Incoming) -> bool {
        // At most nslots/2 slots, whatever `msg` says (see copy_payload).
        let at = msg.start(self.tail);
        let k = if msg.short {
            1
        } else {
            slots_for(self.payload_len(msg))
        };
        // The zeroing writes the first word of every continuation slot that
        // starts a line, which is payload memory: one store per line. (The
        // first slot's word is a header `seq`, which no later position can
        // equal; a long message's second slot starts with the zero its
        // producer wrote; and a second half-line starts a message only
        // after a short message in its first half, whose producer zeroed
        // it: see the module docs.)
        #[cfg(loom)]
        self.ring.touch(at + 2, k.saturating_sub(2), true);
        for p in ((at + 2).min(at + k)..at + k).step_by(2) {
            // Relaxed: ordered before the producer's reuse by the Release
            // store of tail below.
            self.ring.seq(p).store(0, Ordering::Relaxed);
        }
        self.tail = at + k;
        self.read_ahead();
        // Release: our reads of the message and the zeroing above happen
        // before the producer's Acquire load of tail and its reuse.
        self.ring.tail().store(self.tail, Ordering::Release);
        // Store-buffer handshake, consumer's half: our `tail` store before
        // our load of the flag (pairs with the heavy fence in
        // `Producer::set_waiting`). Light: a compiler fence when the
        // producer's side is a `membarrier`, so pops stay fence-free.
        light_fence();
        // Relaxed: the fence above orders it; the flag publishes no data
        // (the caller only rings a doorbell, which has its own fences).
        self.ring.waiting().load(Ordering::Relaxed) != 0
    }

    /// Starts reading the line [`READ_AHEAD`] slots past the new tail: when
    /// the producer is ahead (a window of messages), its transfer overlaps
    /// the messages in between instead of stalling the poll that reaches
    /// it. A hint: no effect on what the consumer reads.
    #[inline]
    fn read_ahead(&self) {
        #[cfg(all(target_arch = "x86_64", not(loom)))]
        // SAFETY: `slot` stays inside the ring's memory for every position;
        // a prefetch reads nothing architecturally.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                self.ring.slot(self.tail + READ_AHEAD) as *const i8,
            );
        }
    }

    /// A long `msg`'s payload length, capped at what the ring can hold (a
    /// no-op for a message from `peek`, which rejects larger ones).
    #[inline]
    fn payload_len(&self, msg: &Incoming) -> usize {
        (msg.header.len as usize).min(self.max_payload)
    }
}
