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
//! there. The consumer's `Acquire` load of `seq` makes them visible (the doorbell's fences order it against
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
//! slots free). One zeroing store per line, as with 64-byte slots. A
//! message within its first line is not written back at all: the consumer's only access to that line
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
/// one-line messages of the 64-byte slots this was measured with started.
/// Measured against one (the earlier choice, made on 8-byte messages
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

/// The fewest slots a ring has: room for a long message of at least
/// [`INLINE`] payload bytes with its padding in half the ring (see
/// [`max_payload_for`]).
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

mod consumer;
mod producer;

pub use consumer::{Consumer, Incoming};
pub use producer::Producer;

#[cfg(test)]
mod tests;
