//! A single-producer single-consumer message ring over raw memory (private
//! heap memory for the thread device, a shared mapping for the process
//! device).
//!
//! Layout: a 128-byte control block (the consumer's `tail` on its own cache
//! line, then the producer's "waiting for space" flag on another), followed
//! by `nslots` 32-byte slots, two to a cache line. A message is one of:
//!
//! - **short**: one slot, a 20-byte header and up to [`SHORT_INLINE`]
//!   payload bytes. Eager data of up to 12 bytes with no cookie (the
//!   per-message traffic of a small-message stream) travels this way, so two
//!   such messages share a cache line: a consumer behind its producer (a
//!   window of sends) takes two messages per line it pulls, and the producer
//!   claims one line per two messages (what Open MPI's vader gets by packing
//!   its fast box);
//! - **long**: whole lines (an even number of slots), starting on a line
//!   (an odd position, left by an odd number of short messages, is first
//!   filled with a one-slot *padding* entry): the first slot holds the full
//!   header, the second a zero word, the `aux` word and the first [`INLINE`]
//!   payload bytes, and the following slots hold the rest of the payload
//!   contiguously (wrapping at the end of the ring; a last half line stays
//!   unused). So a long message of up to 16 bytes is one cache line, and a
//!   stream of long messages needs no padding.
//!
//! Publication is one `Release` store of the first slot's `seq` word (the
//! absolute slot position + 1) after everything else of the message is
//! written (the continuation slots first, then the second slot, then the
//! first slot's header and inline payload); a padding entry is published
//! the same way right after the message it precedes, so that whenever the
//! word at the consumer's position says published, a whole message is
//! there. The consumer's `Acquire`
//! load of `seq` makes them visible (the doorbell's fences order it against
//! a sleeper, see [`crate::doorbell`]). Stale data can never look published:
//! the first word of a slot is either a `seq` (a position + 1 of an earlier
//! lap, never the one the consumer waits for, since positions only grow), or
//! zero: a long message's second slot starts with a zero word its producer
//! writes; the consumer zeroes the first word of every *continuation* slot
//! that starts a line (there it is payload, which could hold any value)
//! before it releases the slots by storing `tail` (`Release`), and the
//! producer reads `tail` with `Acquire` before reusing them; and a second
//! half-line, which can start a message only right after a short message in
//! its first half (long messages start lines), is zeroed by the producer of
//! that short message, in the line it writes anyway (it then needs both
//! slots free). One zeroing store per line, as with 64-byte slots. A message within its first
//! line is not written back at all: the consumer's only access to that line
//! is the read, so the producer's next write there takes the line back from
//! a reader, not from a writer (half the cross-core transfers per small
//! message).
//!
//! A producer that finds the ring full may flag that it waits for room
//! ([`Producer::set_waiting`]); [`Consumer::pop`] then reports the flag so
//! that its caller wakes the producer. The flag is reliable: the handshake
//! (producer: store the flag, fence, re-read `tail`; consumer: store `tail`,
//! fence, read the flag) is the store-buffer pattern with a fence on both
//! sides, so a producer whose re-check after flagging finds no room is
//! always reported by the pop that frees it. The fences are the doorbell's
//! asymmetric pair (see [`crate::doorbell`]): free on the consumer's side
//! (every pop), a `membarrier` on the producer's (only when it starts
//! waiting).
//!
//! Everything read from the ring is validated before use, since the peer
//! may be buggy or hostile and write anything anywhere in the ring: a header
//! whose length could not fit the ring is reported as [`RingError::Corrupt`],
//! a consumer position the consumer could not have published as
//! [`RingError::BadTail`], and payload copies never leave the ring's memory.
//! The worst a scribbling peer gets is such an error or garbage payload
//! bytes: never an out-of-bounds access, a panic or an endless loop here.
//!
//! The orderings are model-checked with loom: `tests/ring_loom.rs`, built
//! with `RUSTFLAGS="--cfg loom"`. In that build the shared words come from a
//! side table instead of the raw memory (see the `shadow` module); the
//! push/peek/copy/pop code is the same.

use std::alloc::Layout;
use std::marker::PhantomData;
use std::ptr::{self, NonNull};

use crate::sync::{heavy_fence, light_fence, AtomicU32, AtomicU64, Ordering};

/// Bytes per slot (half a cache line).
pub const SLOT: usize = 32;
/// Bytes of a long message's header: its first slot, and the zero and
/// `aux` words of its second.
pub const HEADER: usize = 48;
/// Payload bytes a long message carries in its first line (after its
/// header, in its second slot).
pub const INLINE: usize = 2 * SLOT - HEADER;
/// Payload bytes a short message carries (in its one slot).
pub const SHORT_INLINE: usize = SLOT - OFF_SHORT_PAYLOAD;
/// The bit of the kind byte that marks a short message or a padding entry:
/// the kinds a caller pushes are below it.
pub const KIND_SHORT: u8 = 0x80;
/// The kind byte of a padding entry (a short entry no caller can push).
const KIND_PAD: u8 = 0xFF;

/// How far past its head the producer claims a slot's line (see
/// `Producer::claim_ahead`), in 32-byte slots: two lines. One to four lines
/// measured alike on this machine (rate at 8 B, 3 alternating runs, with
/// 64-byte slots); two covers a slower transfer.
/// x86_64 only (elsewhere the claim is a no-op).
#[cfg_attr(any(loom, not(target_arch = "x86_64")), allow(dead_code))]
const CLAIM_AHEAD: u64 = 4;

/// How far past its tail the consumer starts reading (see
/// `Consumer::read_ahead`), in 32-byte slots: four lines, where four
/// one-line messages of the 64-byte slots this was measured with started. Measured against one (the earlier choice, made on 8-byte messages
/// only, before the producer wrote a message's first slot last) and eight,
/// 4 alternating rounds of `xdev-bench --device thread --device shm --test
/// bw|bibw|rate` at 8 and 64 B: osu_bw 64 B +17-25% (464/417 -> 542/523
/// MB/s, thread/shm), bibw 8 B +4-10%, rate 8 B +4-6%; eight gave less at
/// 64 B. In `xdev-bench report` runs the change is within noise. A slot
/// read ahead of the producer is only a hint: a line pulled too early costs
/// the producer a transfer, which is why this stays short. x86_64 only,
/// like `CLAIM_AHEAD`.
#[cfg_attr(any(loom, not(target_arch = "x86_64")), allow(dead_code))]
const READ_AHEAD: u64 = 8;
/// Bytes of the control block before the slots.
pub const CONTROL: usize = 128;

// Both forms: the first slot.
const OFF_KIND: usize = 8;
const OFF_FLAGS: usize = 9;
const OFF_TAG: usize = 12;
const OFF_CONTEXT: usize = 16;
// A short message: its length (one byte) and payload.
const OFF_SHORT_LEN: usize = 10;
const OFF_SHORT_PAYLOAD: usize = 20;
// A long message: in the first slot,
const OFF_LEN: usize = 20;
const OFF_COOKIE: usize = 24;
// and in the second (after its zero word).
const OFF_AUX: usize = 8;
const OFF_INLINE: usize = HEADER - SLOT;
// (The loom build keeps `waiting` in its side table.)
#[cfg_attr(loom, allow(dead_code))]
const OFF_WAITING: usize = 64;

/// The fixed fields of a message.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Header {
    /// Message kind (device-defined).
    pub kind: u8,
    /// Kind-specific flags.
    pub flags: u8,
    /// User tag.
    pub tag: i32,
    /// User context.
    pub context: u32,
    /// Payload bytes that follow in the ring.
    pub len: u32,
    /// Device-defined cookie (a handle for replies).
    pub cookie: u64,
    /// Device-defined extra word (for example the full length of a
    /// rendezvous message).
    pub aux: u64,
}

impl Header {
    /// The matching envelope of this message from `source`.
    #[inline]
    pub fn envelope(&self, source: xdev::Rank) -> xdev::Envelope {
        xdev::Envelope {
            source,
            tag: self.tag,
            context: self.context,
        }
    }
}

/// A malformed ring entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RingError {
    /// The header claims more payload than the ring can carry.
    Corrupt {
        /// The claimed payload length.
        len: u32,
    },
    /// A padding entry not followed by a long message on a line (our
    /// producer writes one only there).
    Misplaced {
        /// The padding entry's position.
        at: u64,
    },
    /// The consumer's position (the ring's `tail` word) went backwards or
    /// past the producer's head: the producer cannot tell which slots are
    /// free.
    BadTail {
        /// The position read from the ring.
        tail: u64,
        /// The producer's position.
        head: u64,
    },
}

impl std::fmt::Display for RingError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RingError::Corrupt { len } => write!(f, "ring entry claims {len} payload bytes"),
            RingError::Misplaced { at } => {
                write!(f, "ring padding at {at} precedes no long message")
            }
            RingError::BadTail { tail, head } => {
                write!(
                    f,
                    "ring consumer position {tail} impossible (producer at {head})"
                )
            }
        }
    }
}

impl std::error::Error for RingError {}

/// The fewest slots a ring has (a long message with its padding takes up to
/// half the ring, and at least three slots).
pub const MIN_SLOTS: usize = 8;
/// The most slots a ring has (1 GiB of slots): a message's length, at most
/// half the ring, then fits the header's 32-bit field with room to spare.
pub const MAX_SLOTS: usize = 1 << 25;

/// Whether a ring may have `nslots` slots: a power of two from
/// [`MIN_SLOTS`] to [`MAX_SLOTS`].
pub const fn valid_nslots(nslots: usize) -> bool {
    nslots.is_power_of_two() && nslots >= MIN_SLOTS && nslots <= MAX_SLOTS
}

/// Bytes of memory a ring of `nslots` slots needs.
pub fn bytes_for(nslots: usize) -> usize {
    CONTROL + nslots * SLOT
}

/// A view of ring memory: base address and slot count. It does not own the
/// memory, but borrows it for `'a` (a [`HeapRing`] or a mapping), so safe code
/// cannot keep a view past the ring's life; see [`Producer::new`] and
/// [`Consumer::new`] for the ends, which outlive any borrow by contract.
///
/// ```compile_fail,E0505
/// use shm_ipc::ring::HeapRing;
///
/// let ring = HeapRing::new(8);
/// let view = ring.view();
/// drop(ring); // the memory goes while `view` still points at it
/// view.has_message();
/// ```
#[derive(Copy, Clone, Debug)]
pub struct RingRef<'a> {
    base: NonNull<u8>,
    nslots: usize,
    _ring: PhantomData<&'a [u8]>,
    /// Loom build only: the side table holding the shared words.
    #[cfg(loom)]
    shadow: NonNull<shadow::Shadow>,
}

// SAFETY: RingRef is an address and a size; all access through it goes through
// the Producer/Consumer protocol, whose shared words are atomics.
unsafe impl Send for RingRef<'_> {}
// SAFETY: as above.
unsafe impl Sync for RingRef<'_> {}

impl<'a> RingRef<'a> {
    /// A view of `bytes_for(nslots)` bytes at `base`.
    ///
    /// # Safety
    /// `base` must be 64-byte aligned and valid for reads and writes of
    /// `bytes_for(nslots)` bytes for all of `'a`, and zeroed before first use.
    ///
    /// # Panics
    /// In every build, if `nslots` is not [valid](valid_nslots) or `base` not
    /// 64-byte aligned: the slot arithmetic relies on both, and a caller's
    /// mistake there must not become an access outside the memory.
    pub unsafe fn from_raw(base: NonNull<u8>, nslots: usize) -> RingRef<'a> {
        assert!(valid_nslots(nslots), "a ring cannot have {nslots} slots");
        assert_eq!(base.as_ptr() as usize % 64, 0, "ring memory misaligned");
        // SAFETY: the caller's contract, and the two checks just made.
        unsafe { Self::from_checked(base, nslots) }
    }

    /// [`from_raw`](Self::from_raw) without its checks, for a ring whose
    /// slot count and memory were checked once when its mapping was made
    /// (an inbox's rings: `InboxLayout::check` and `mmap`'s page
    /// alignment), so that a view made per poll costs no assertion.
    ///
    /// # Safety
    /// As [`from_raw`](Self::from_raw), and `nslots` is
    /// [valid](valid_nslots) and `base` 64-byte aligned (checked in debug
    /// builds).
    #[inline]
    pub unsafe fn from_checked(base: NonNull<u8>, nslots: usize) -> RingRef<'a> {
        debug_assert!(valid_nslots(nslots), "a ring cannot have {nslots} slots");
        debug_assert_eq!(base.as_ptr() as usize % 64, 0, "ring memory misaligned");
        RingRef {
            base,
            nslots,
            _ring: PhantomData,
            #[cfg(loom)]
            shadow: shadow::none(),
        }
    }

    /// The same view with its lifetime erased, for the ring's ends, whose
    /// `unsafe` constructors require the memory to outlive them.
    fn detach(self) -> RingRef<'static> {
        RingRef {
            base: self.base,
            nslots: self.nslots,
            #[cfg(loom)]
            shadow: self.shadow,
            _ring: PhantomData,
        }
    }

    /// Start of the ring's memory (for the owner of a mapping, and tests).
    pub fn base_ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Number of slots.
    pub fn nslots(&self) -> usize {
        self.nslots
    }

    /// The largest payload one message may carry (see [`max_payload_for`]).
    pub fn max_payload(&self) -> usize {
        max_payload_for(self.nslots)
    }

    /// Whether a message is published at the consumer's position: a
    /// lock-free hint for waiters (exact only on the consumer's own thread).
    #[inline]
    pub fn has_message(&self) -> bool {
        // Relaxed: a hint; a stale tail only makes the answer stale. The word
        // is in shared memory, so it may hold anything: wrapping, not `+`.
        let t = self.tail().load(Ordering::Relaxed);
        self.seq(t).load(Ordering::Acquire) == t.wrapping_add(1)
    }

    /// The consumer's position as last published: a lock-free hint for a
    /// producer that waits for room (it re-checks with
    /// [`Producer::try_push`]). Compare with
    /// [`Producer::consumer_position_seen`].
    #[inline]
    pub fn consumer_position(&self) -> u64 {
        // Relaxed: a hint; the ordering that matters for a sleeping waiter
        // comes from the doorbell's fences around it.
        self.tail().load(Ordering::Relaxed)
    }

    #[cfg(not(loom))]
    fn tail(&self) -> &AtomicU64 {
        // SAFETY: the control block starts at `base` (aligned, in bounds per
        // from_raw) and the tail word is only accessed atomically.
        unsafe { &*(self.base.as_ptr() as *const AtomicU64) }
    }

    #[cfg(not(loom))]
    fn waiting(&self) -> &AtomicU32 {
        // SAFETY: offset 64 is inside the 128-byte control block, 4-aligned,
        // and only accessed atomically.
        unsafe { &*(self.base.as_ptr().add(OFF_WAITING) as *const AtomicU32) }
    }

    fn slot(&self, pos: u64) -> *mut u8 {
        let i = (pos as usize) & (self.nslots - 1);
        // SAFETY: i < nslots, so the slot lies inside the mapping.
        unsafe { self.base.as_ptr().add(CONTROL + i * SLOT) }
    }

    #[cfg(not(loom))]
    fn seq(&self, pos: u64) -> &AtomicU64 {
        // SAFETY: every slot starts 64-aligned and its first word is accessed
        // atomically by both sides whenever they may race on it.
        unsafe { &*(self.slot(pos) as *const AtomicU64) }
    }

    #[cfg(loom)]
    fn shadow(&self) -> &shadow::Shadow {
        // SAFETY: the shadow belongs to the HeapRing this view came from,
        // which outlives its views like the memory does (same rule as `base`).
        unsafe { self.shadow.as_ref() }
    }

    #[cfg(loom)]
    fn tail(&self) -> &AtomicU64 {
        &self.shadow().tail
    }

    #[cfg(loom)]
    fn waiting(&self) -> &AtomicU32 {
        &self.shadow().waiting
    }

    #[cfg(loom)]
    fn seq(&self, pos: u64) -> &AtomicU64 {
        &self.shadow().seq[pos as usize & (self.nslots - 1)]
    }

    /// Loom build only: records an access to the plain bytes of the `k`
    /// slots from `pos` (see the `shadow` module).
    #[cfg(loom)]
    fn touch(&self, pos: u64, k: u64, write: bool) {
        for p in pos..pos + k {
            let cell = &self.shadow().bytes[p as usize & (self.nslots - 1)];
            if write {
                cell.with_mut(|_| ());
            } else {
                cell.with(|_| ());
            }
        }
    }

    fn area(&self) -> *mut u8 {
        // SAFETY: CONTROL is within the mapping.
        unsafe { self.base.as_ptr().add(CONTROL) }
    }
}

/// The slot count of a ring given `ring_bytes` bytes of slots (the devices'
/// `ring_bytes` option): rounded up to a power of two.
pub fn slots_for_bytes(ring_bytes: usize) -> usize {
    (ring_bytes / SLOT).next_power_of_two()
}

/// The largest payload one message may carry in a ring of `nslots` slots:
/// half the ring (a slot more with its padding), so that a message always
/// fits once the consumer catches up.
pub fn max_payload_for(nslots: usize) -> usize {
    INLINE + (nslots / 2 - 2) * SLOT
}

/// Slots a long message with `len` payload bytes occupies: whole lines (an
/// even count), so that the next long one starts on a line with no padding
/// (its padding, if it needs one, not counted).
pub fn slots_for(len: usize) -> u64 {
    (2 + len.saturating_sub(INLINE).div_ceil(SLOT) as u64).next_multiple_of(2)
}

/// Whether a message goes short (one slot): eager-like data of at most
/// [`SHORT_INLINE`] bytes whose header carries nothing a short slot drops
/// (no cookie, `aux` its length).
#[inline(always)]
pub fn is_short(header: &Header, len: usize) -> bool {
    len <= SHORT_INLINE && header.cookie == 0 && header.aux == len as u64
}

/// The producing end. Only one producer may exist per ring.
#[derive(Debug)]
pub struct Producer {
    /// The ring, its lifetime erased: [`Producer::new`]'s contract keeps it.
    ring: RingRef<'static>,
    head: u64,
    tail_cache: u64,
    /// What we last stored in the ring's `waiting` word.
    waiting: bool,
    /// The ring's [`max_payload`](RingRef::max_payload), checked on every
    /// push (worked out once).
    max_payload: usize,
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

/// A message at the head of the ring, validated.
#[derive(Copy, Clone, Debug)]
pub struct Incoming {
    /// Its header (`len` validated against the ring).
    pub header: Header,
    /// It went short (one slot).
    short: bool,
    /// Slots before it: 1 if a padding entry precedes it, else 0.
    pad: u64,
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
    ring: RingRef<'static>,
    tail: u64,
    /// No message starting here or later is read (see
    /// [`Consumer::stop_at`]).
    end: u64,
    /// The ring's [`max_payload`](RingRef::max_payload), checked on every
    /// message (worked out once).
    max_payload: usize,
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

/// Copies `n` bytes from `src` to `dst`, inline for the sizes a first slot
/// carries (at most [`INLINE`]): two overlapping word moves, where a call
/// to `memcpy` for an 8-byte payload costs both sides of every small
/// message a call and the library's size dispatch.
///
/// # Safety
/// As [`ptr::copy_nonoverlapping`]`(src, dst, n)`.
#[inline(always)]
unsafe fn copy_small(src: *const u8, dst: *mut u8, n: usize) {
    // SAFETY: the caller's contract; every access below lies within the
    // first `n` bytes of both ranges (8 <= n <= 16 reads and writes
    // [0, 8) and [n - 8, n); 4 <= n < 8 likewise with 4-byte words).
    unsafe {
        if (8..=16).contains(&n) {
            let a = ptr::read_unaligned(src as *const u64);
            let b = ptr::read_unaligned(src.add(n - 8) as *const u64);
            ptr::write_unaligned(dst as *mut u64, a);
            ptr::write_unaligned(dst.add(n - 8) as *mut u64, b);
        } else if (4..8).contains(&n) {
            let a = ptr::read_unaligned(src as *const u32);
            let b = ptr::read_unaligned(src.add(n - 4) as *const u32);
            ptr::write_unaligned(dst as *mut u32, a);
            ptr::write_unaligned(dst.add(n - 4) as *mut u32, b);
        } else if n < 4 {
            for i in 0..n {
                *dst.add(i) = *src.add(i);
            }
        } else {
            ptr::copy_nonoverlapping(src, dst, n);
        }
    }
}

/// Ring memory on the heap (for rings between threads of one process).
pub struct HeapRing {
    ptr: NonNull<u8>,
    layout: Layout,
    nslots: usize,
    #[cfg(loom)]
    shadow: Box<shadow::Shadow>,
}

// SAFETY: HeapRing owns a plain allocation; concurrent use goes through
// Producer/Consumer, whose shared words are atomics.
unsafe impl Send for HeapRing {}
// SAFETY: as above.
unsafe impl Sync for HeapRing {}

impl HeapRing {
    /// A zeroed ring of `nslots` slots (rounded up to a power of two, from
    /// [`MIN_SLOTS`] to [`MAX_SLOTS`]).
    pub fn new(nslots: usize) -> HeapRing {
        let nslots = nslots.clamp(MIN_SLOTS, MAX_SLOTS).next_power_of_two();
        let layout = Layout::from_size_align(bytes_for(nslots), 64).expect("ring layout");
        // SAFETY: layout has non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        HeapRing {
            ptr,
            layout,
            nslots,
            #[cfg(loom)]
            shadow: Box::new(shadow::Shadow::new(nslots)),
        }
    }

    /// A view of the ring, borrowed from it.
    pub fn view(&self) -> RingRef<'_> {
        // SAFETY: the allocation is 64-aligned, zeroed, of bytes_for(nslots)
        // bytes, and nslots is a power of two >= 4.
        #[cfg(not(loom))]
        let view = unsafe { RingRef::from_raw(self.ptr, self.nslots) };
        // The loom build's view also carries the side table (from_raw has none).
        #[cfg(loom)]
        let view = RingRef {
            base: self.ptr,
            nslots: self.nslots,
            shadow: NonNull::from(&*self.shadow),
            _ring: PhantomData,
        };
        view
    }
}

impl Drop for HeapRing {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// The loom build's home for the shared words.
///
/// Loom's atomics are objects of its model, not views of raw memory, so the
/// `tail`, `waiting` and per-slot `seq` words cannot be cast from the ring's
/// bytes as in the real build: in a `--cfg loom` build they live in this side
/// table, created with the [`HeapRing`], and `RingRef::tail`/`waiting`/`seq`
/// resolve to it. Everything else (push, peek, copy, pop, with their
/// orderings) is the real code on the real memory.
///
/// Loom does not see plain memory either, and it runs one thread at a time on
/// real memory, so a payload read that no ordering protects would still find
/// the right bytes. Each slot therefore also has a loom `UnsafeCell<()>`
/// that the code touches where it writes (push, and pop's zeroing) or reads
/// (peek, copy) that slot's bytes: loom then panics with a "causality
/// violation" on any access not ordered after the previous conflicting one by
/// the ring's atomics.
#[cfg(loom)]
mod shadow {
    use std::ptr::NonNull;

    use loom::cell::UnsafeCell;

    use crate::sync::{AtomicU32, AtomicU64};

    pub(super) struct Shadow {
        pub(super) tail: AtomicU64,
        pub(super) waiting: AtomicU32,
        pub(super) seq: Box<[AtomicU64]>,
        pub(super) bytes: Box<[UnsafeCell<()>]>,
    }

    impl Shadow {
        /// Zeroed words for a fresh ring of `nslots` slots.
        pub(super) fn new(nslots: usize) -> Shadow {
            Shadow {
                tail: AtomicU64::new(0),
                waiting: AtomicU32::new(0),
                seq: (0..nslots).map(|_| AtomicU64::new(0)).collect(),
                bytes: (0..nslots).map(|_| UnsafeCell::new(())).collect(),
            }
        }
    }

    /// `RingRef::from_raw` in a loom build: raw memory has no side table.
    pub(super) fn none() -> NonNull<Shadow> {
        panic!("loom models build rings with HeapRing (RingRef::from_raw has no loom side table)")
    }
}

#[cfg(test)]
mod tests;
