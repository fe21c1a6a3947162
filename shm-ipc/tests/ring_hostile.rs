//! Property tests: the peer at the other end of a ring may be buggy or
//! hostile and write anything anywhere in the ring's memory (control block,
//! `tail`, `seq` words, headers, payload). Whatever it writes, our end never
//! panics (run these in a debug build too, for integer overflow), never
//! touches memory outside the ring (guard bytes around it), and fails only
//! with the `RingError` the situation calls for; the worst left is garbage
//! payload bytes.
//!
//! - A hostile producer against our consumer: the consumer either decodes a
//!   header whose payload fits the ring (and copies stay bounded) or reports
//!   `Corrupt`.
//! - A hostile consumer against our producer: every push has exactly the
//!   outcome a model of the protocol predicts from the `tail` word it finds,
//!   `BadTail` when that word is impossible.

use std::alloc::Layout;
use std::ptr::NonNull;

use proptest::prelude::*;
use shm_ipc::ring::{self, Consumer, Header, Producer, RingError, RingRef};

const GUARD: usize = 256;
const GUARD_BYTE: u8 = 0xEE;

/// Zeroed ring memory between guard bytes.
struct Guarded {
    ptr: NonNull<u8>,
    layout: Layout,
    nslots: usize,
}

impl Guarded {
    fn new(nslots: usize) -> Guarded {
        let layout = Layout::from_size_align(ring::bytes_for(nslots) + 2 * GUARD, 64).unwrap();
        // SAFETY: non-zero size.
        let ptr = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) }).unwrap();
        let g = Guarded {
            ptr,
            layout,
            nslots,
        };
        let n = layout.size();
        g.with_all(|all| {
            all[..GUARD].fill(GUARD_BYTE);
            all[n - GUARD..].fill(GUARD_BYTE);
        });
        g
    }

    /// Runs `f` on the whole allocation. Callers never nest this or call
    /// into the ring from `f`: the test is single-threaded, so the slice is
    /// the only access while it lives.
    fn with_all<R>(&self, f: impl FnOnce(&mut [u8]) -> R) -> R {
        // SAFETY: the allocation is ours and nothing else accesses it while
        // the slice lives (see above).
        f(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) })
    }

    /// Runs `f` on the ring's memory (what the peer can write).
    fn with_ring<R>(&self, f: impl FnOnce(&mut [u8]) -> R) -> R {
        let n = ring::bytes_for(self.nslots);
        self.with_all(|all| f(&mut all[GUARD..GUARD + n]))
    }

    fn view(&self) -> RingRef<'_> {
        // SAFETY: GUARD is a multiple of 64, so the ring is 64-aligned, in
        // bounds and zeroed; nslots is a power of two >= 4; `self` outlives
        // every view in these tests.
        unsafe {
            RingRef::from_raw(
                NonNull::new(self.ptr.as_ptr().add(GUARD)).unwrap(),
                self.nslots,
            )
        }
    }

    fn guards_intact(&self) -> bool {
        self.with_all(|all| {
            let n = all.len();
            all[..GUARD]
                .iter()
                .chain(&all[n - GUARD..])
                .all(|&b| b == GUARD_BYTE)
        })
    }

    /// The peer writes `bytes` at `offset` (wrapping around the ring's memory).
    fn scribble(&self, offset: usize, bytes: &[u8]) {
        self.with_ring(|mem| {
            let n = mem.len();
            for (i, b) in bytes.iter().enumerate() {
                mem[(offset + i) % n] = *b;
            }
        })
    }

    fn write_u64(&self, offset: usize, v: u64) {
        self.with_ring(|mem| mem[offset..offset + 8].copy_from_slice(&v.to_le_bytes()))
    }

    fn read_u64(&self, offset: usize) -> u64 {
        self.with_ring(|mem| u64::from_le_bytes(mem[offset..offset + 8].try_into().unwrap()))
    }

    /// Makes the slot at position `pos` look published (its `seq`, the
    /// slot's first word, = pos + 1), with header length `len` if given.
    fn publish(&self, pos: u64, len: Option<u32>) {
        let slot = ring::CONTROL + (pos as usize & (self.nslots - 1)) * ring::SLOT;
        self.write_u64(slot, pos + 1);
        if let Some(len) = len {
            // A long message's length field: offset 20 of the slot (the
            // ring's fixed layout; the kind byte, at 8, is whatever is there,
            // so the entry may also read as short or as padding).
            self.with_ring(|mem| mem[slot + 20..slot + 24].copy_from_slice(&len.to_le_bytes()));
        }
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

fn ring_size() -> impl Strategy<Value = usize> {
    prop::sample::select(vec![8usize, 16, 32])
}

/// Writes anywhere in the ring: (offset, bytes), offsets wrapping.
fn scribbles() -> impl Strategy<Value = Vec<(usize, Vec<u8>)>> {
    prop::collection::vec(
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..600)),
        0..6,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// A hostile producer: our consumer, at a position reached by real
    /// traffic, walks whatever the peer wrote.
    #[test]
    fn consumer_survives_hostile_producer_memory(
        nslots in ring_size(),
        warmup in prop::collection::vec(0usize..1000, 0..12),
        writes in scribbles(),
        tail_word in prop::option::of(prop_oneof![Just(u64::MAX), any::<u64>()]),
        published in prop::bool::weighted(0.8),
        chain in prop::bool::weighted(0.7),
        // Lengths for the published entries (None: whatever is there); many
        // fit, so the walk goes on through hostile but plausible entries.
        lens in prop::collection::vec(
            prop::option::of(prop_oneof![3 => 0u32..500, 1 => any::<u32>()]),
            9,
        ),
        cap in 0usize..1100,
    ) {
        let g = Guarded::new(nslots);
        let v = g.view();
        let max = v.max_payload();
        // SAFETY: `g` outlives both ends; one of each.
        let (mut p, mut c) = unsafe { (Producer::new(v), Consumer::new(v)) };
        // Real traffic first, so the attack meets the consumer anywhere in
        // the ring.
        // (Empty ones go short, the others long, padded at odd positions.)
        for len in warmup {
            let data = vec![0x5A; len % (max + 1)];
            prop_assert_eq!(p.try_push(&Header::default(), &data), Ok(true));
            let m = c.peek().unwrap().unwrap();
            c.pop(&m);
        }
        let mut pos = c.position();
        for (off, bytes) in &writes {
            g.scribble(*off, bytes);
        }
        if let Some(t) = tail_word {
            // The consumer's own word: only `has_message` reads it back.
            g.write_u64(0, t);
        }
        if published {
            g.publish(pos, lens[0]);
        }
        let mut dst = vec![0u8; cap];
        for next_len in &lens[1..] {
            let _ = v.has_message(); // reads the scribbled tail word
            match c.peek() {
                None => break,
                Some(Err(RingError::Corrupt { len })) => {
                    // Past a short slot, or past the ring's limit.
                    prop_assert!(len as usize > ring::SHORT_INLINE);
                    break;
                }
                Some(Err(RingError::Misplaced { .. })) => break,
                Some(Err(e)) => prop_assert!(false, "the consumer reported {}", e),
                Some(Ok(m)) => {
                    let len = m.header.len as usize;
                    prop_assert!(len <= max);
                    let n = c.copy_payload(&m, &mut dst);
                    prop_assert_eq!(n, len.min(cap));
                    c.pop(&m);
                    pos = c.position();
                    if chain {
                        // Keep feeding it hostile entries at its position.
                        g.publish(pos, *next_len);
                    }
                }
            }
        }
        prop_assert!(g.guards_intact());
    }
}

/// One step of the producer test.
#[derive(Clone, Debug)]
enum Op {
    /// Push a message of `len % (max_payload + 1)` bytes.
    Push(usize),
    /// The peer writes anywhere.
    Scribble(usize, Vec<u8>),
    /// The peer writes a tail a real consumer could write: within
    /// `tail_seen..=head`, picked by the value.
    TailValid(u64),
    /// The peer writes this tail, whatever it is.
    TailAny(u64),
    /// The peer moves the tail back by this much from the last one seen.
    TailBack(u64),
    /// Our producer flags (or clears) that it waits for room.
    Waiting(bool),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => any::<usize>().prop_map(Op::Push),
        1 => (any::<usize>(), prop::collection::vec(any::<u8>(), 1..300))
            .prop_map(|(o, b)| Op::Scribble(o, b)),
        4 => any::<u64>().prop_map(Op::TailValid),
        1 => any::<u64>().prop_map(Op::TailAny),
        1 => (1u64..8).prop_map(Op::TailBack),
        1 => any::<bool>().prop_map(Op::Waiting),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// A hostile consumer: every push of our producer has the outcome the
    /// protocol predicts from the tail word it will find.
    #[test]
    fn producer_survives_hostile_consumer_memory(
        nslots in ring_size(),
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let g = Guarded::new(nslots);
        let v = g.view();
        let n = nslots as u64;
        let max = v.max_payload();
        // SAFETY: `g` outlives the producer; it is the only one.
        let mut p = unsafe { Producer::new(v) };
        // The model: our head, and the consumer position the producer last
        // accepted.
        let (mut head, mut seen) = (0u64, 0u64);
        for op in ops {
            match op {
                Op::Push(len) => {
                    let len = len % (max + 1);
                    // An empty message goes short (no cookie, aux 0 = its
                    // length); the others long, after a padding entry at an
                    // odd position.
                    let short = len == 0;
                    let pad = if short { 0 } else { head & 1 };
                    let k = if short { 1 } else { pad + ring::slots_for(len) };
                    // A short message on a line's first slot also needs
                    // the second (it zeroes its first word).
                    let room = if short { 2 - (head & 1) } else { k };
                    let want = if head + room - seen <= n {
                        Ok(true)
                    } else {
                        let tail = g.read_u64(0);
                        if tail < seen || tail > head {
                            Err(RingError::BadTail { tail, head })
                        } else {
                            seen = tail;
                            Ok(head + room - tail <= n)
                        }
                    };
                    let h = Header { tag: head as i32, ..Header::default() };
                    let got = p.try_push(&h, &vec![0xA5; len]);
                    prop_assert_eq!(&got, &want);
                    if got == Ok(true) {
                        // Published at `head` (and past the padding),
                        // whatever the peer wrote there before.
                        for at in head..=head + pad {
                            let slot = ring::CONTROL + (at % n) as usize * ring::SLOT;
                            prop_assert_eq!(g.read_u64(slot), at + 1);
                        }
                        head += k;
                    }
                }
                Op::Scribble(off, bytes) => g.scribble(off, &bytes),
                Op::TailValid(x) => g.write_u64(0, seen + x % (head - seen + 1)),
                Op::TailAny(t) => g.write_u64(0, t),
                Op::TailBack(d) => g.write_u64(0, seen.saturating_sub(d)),
                Op::Waiting(w) => p.set_waiting(w),
            }
        }
        prop_assert!(g.guards_intact());
    }
}
