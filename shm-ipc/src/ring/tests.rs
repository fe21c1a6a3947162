use super::*;

fn pair(nslots: usize) -> (HeapRing, Producer, Consumer) {
    let r = HeapRing::new(nslots);
    // SAFETY: `r` is returned alongside and outlives both ends in each
    // test (moving a HeapRing does not move its memory).
    let (p, c) = unsafe { (Producer::new(r.view()), Consumer::new(r.view())) };
    (r, p, c)
}

fn recv(c: &mut Consumer) -> Option<(Header, Vec<u8>)> {
    let m = c.peek()?.unwrap();
    let mut v = vec![0u8; m.header.len as usize];
    c.copy_payload(&m, &mut v);
    c.pop(&m);
    Some((m.header, v))
}

#[test]
fn small_copies_move_exactly_their_bytes() {
    let src: Vec<u8> = (1..=40).collect();
    for n in 0..=32 {
        let mut dst = vec![0xEEu8; 40];
        // SAFETY: both buffers hold 40 >= n bytes and do not overlap.
        unsafe { copy_small(src.as_ptr(), dst.as_mut_ptr(), n) };
        assert_eq!(&dst[..n], &src[..n], "n = {n}");
        assert!(dst[n..].iter().all(|&b| b == 0xEE), "wrote past {n}");
    }
}

/// An eager-like header for `len` bytes: short if `len` is small enough.
fn eager(len: usize) -> Header {
    Header {
        kind: 1,
        tag: 9,
        context: 3,
        aux: len as u64,
        ..Header::default()
    }
}

#[test]
fn small_eager_data_is_one_slot_and_the_rest_a_line_or_more() {
    for len in 0..=SHORT_INLINE {
        assert!(is_short(&eager(len), len), "{len}");
    }
    assert!(!is_short(&eager(SHORT_INLINE + 1), SHORT_INLINE + 1));
    // What a short slot cannot carry: a cookie, an aux word of its own.
    let mut h = eager(4);
    h.cookie = 1;
    assert!(!is_short(&h, 4));
    assert!(!is_short(&eager(5), 4));
    assert_eq!(slots_for(0), 2);
    assert_eq!(slots_for(INLINE), 2);
    assert_eq!(slots_for(INLINE + 1), 4);
    assert_eq!(slots_for(INLINE + 2 * SLOT), 4);
    assert_eq!(slots_for(INLINE + 2 * SLOT + 1), 6);
    // Two short messages share a line; a long one after a single short
    // message is padded to the next line, and takes whole lines.
    let (_r, mut p, mut c) = pair(32);
    for (len, head) in [
        (8, 1),
        (20, 6),
        (12, 7),
        (0, 8),
        (20, 12),
        (4, 13),
        (40, 18),
    ] {
        let h = if len <= SHORT_INLINE {
            eager(len)
        } else {
            Header::default()
        };
        assert_eq!(p.try_push(&h, &vec![7u8; len]), Ok(true));
        assert_eq!(p.head, head, "after a message of {len} bytes");
    }
    for len in [8, 20, 12, 0, 20, 4, 40] {
        let (_, v) = recv(&mut c).expect("pushed");
        assert_eq!(v, vec![7u8; len]);
    }
    assert_eq!(c.tail, 18);
    assert!(c.peek().is_none());
}

#[test]
fn fifo_with_wrap_and_full_ring() {
    let (_r, mut p, mut c) = pair(16);
    let max = p.ring().max_payload();
    let mut sent = std::collections::VecDeque::new();
    let mut seed = 1u64;
    for round in 0..2000 {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        // Every third message small and eager-like (so short), the others
        // of any length with a cookie (so long, padded where they follow
        // an odd number of short ones).
        let small = round % 3 == 0;
        let len = if small {
            (seed >> 33) as usize % (SHORT_INLINE + 1)
        } else {
            (seed >> 33) as usize % (max + 1)
        };
        let payload: Vec<u8> = (0..len).map(|i| (i as u64 ^ seed) as u8).collect();
        let h = Header {
            kind: 1,
            tag: round,
            context: 7,
            cookie: if small { 0 } else { seed },
            aux: if small { len as u64 } else { seed >> 7 },
            ..Header::default()
        };
        while !p.try_push(&h, &payload).unwrap() {
            let (gh, gp) = recv(&mut c).expect("full ring must have a message");
            let (eh, ep): (Header, Vec<u8>) = sent.pop_front().unwrap();
            assert_eq!((gh, gp), (eh, ep));
        }
        let mut h = h;
        h.len = len as u32;
        sent.push_back((h, payload));
    }
    while let Some((gh, gp)) = recv(&mut c) {
        assert_eq!((gh, gp), sent.pop_front().unwrap());
    }
    assert!(sent.is_empty());
}

#[test]
fn payload_bytes_never_look_published() {
    // Fill payload slots with words equal to future sequence numbers; after
    // consumption the consumer must not mistake them for messages.
    let (_r, mut p, mut c) = pair(16);
    let mut payload = vec![0u8; INLINE + 3 * SLOT];
    for (i, w) in payload.chunks_mut(8).enumerate() {
        w.copy_from_slice(&(i as u64 + 2).to_le_bytes());
    }
    assert!(p.try_push(&Header::default(), &payload).unwrap());
    assert!(recv(&mut c).is_some());
    assert!(c.peek().is_none(), "stale payload read as a message");
}

#[test]
fn corrupt_length_is_reported() {
    let (r, mut p, c) = pair(8);
    // Long (no aux of its length).
    assert!(p.try_push(&Header::default(), b"x").unwrap());
    // Scribble an impossible length, as a hostile peer could.
    // SAFETY: offset OFF_LEN of slot 0 is inside the ring allocation.
    unsafe { ptr::write_unaligned(r.view().slot(0).add(OFF_LEN) as *mut u32, u32::MAX) };
    assert_eq!(
        c.peek().unwrap().unwrap_err(),
        RingError::Corrupt { len: u32::MAX }
    );
    // Short: its one-byte length past what a slot holds.
    let (r, mut p, c) = pair(8);
    assert!(p.try_push(&eager(1), b"x").unwrap());
    // SAFETY: offset OFF_SHORT_LEN of slot 0 is inside the ring allocation.
    unsafe { ptr::write(r.view().slot(0).add(OFF_SHORT_LEN), 200) };
    assert_eq!(
        c.peek().unwrap().unwrap_err(),
        RingError::Corrupt { len: 200 }
    );
}

#[test]
fn padding_before_anything_but_a_long_message_on_a_line_is_reported() {
    // A short message, then a long one (padded): the padding at 1.
    let pushed = || {
        let (r, mut p, mut c) = pair(8);
        assert!(p.try_push(&eager(1), b"x").unwrap());
        assert!(p.try_push(&Header::default(), b"yz").unwrap());
        assert_eq!(p.head, 4);
        assert_eq!(recv(&mut c).unwrap().1, b"x");
        (r, p, c)
    };
    let (r, _p, c) = pushed();
    // The long message made short: a padding entry before a short one.
    // SAFETY: slot 2 is inside the ring allocation.
    unsafe { ptr::write(r.view().slot(2).add(OFF_KIND), KIND_SHORT | 1) };
    assert_eq!(
        c.peek().unwrap().unwrap_err(),
        RingError::Misplaced { at: 1 }
    );
    // Two padding entries in a row (the second at an even position).
    let (r, _p, c) = pushed();
    // SAFETY: as above.
    unsafe { ptr::write(r.view().slot(2).add(OFF_KIND), KIND_PAD) };
    assert_eq!(
        c.peek().unwrap().unwrap_err(),
        RingError::Misplaced { at: 1 }
    );
    // Untouched, the padding is skipped.
    let (_r, _p, mut c) = pushed();
    assert_eq!(recv(&mut c).unwrap().1, b"yz");
    assert_eq!(c.tail, 4);
}

#[test]
fn corrupt_tail_is_reported() {
    let (r, mut p, _c) = pair(8);
    let set_tail = |t: u64| {
        // SAFETY: the tail word is the first 8 bytes of the ring
        // allocation; nothing accesses it concurrently in this test.
        unsafe { ptr::write(r.view().base_ptr() as *mut u64, t) }
    };
    let short = |p: &mut Producer| p.try_push(&eager(1), b"x");
    let long = |p: &mut Producer| p.try_push(&Header::default(), &[0u8; INLINE + 1]);
    for _ in 0..8 {
        assert_eq!(short(&mut p), Ok(true));
    }
    // Full ring (head 8): the tail is read, and must lie in 0..=8.
    for bad in [9, u64::MAX] {
        set_tail(bad);
        assert_eq!(
            short(&mut p),
            Err(RingError::BadTail { tail: bad, head: 8 })
        );
    }
    set_tail(2);
    assert_eq!(short(&mut p), Ok(true));
    // Head 9, tail seen at 2: a tail of 1 went backwards (a long message,
    // padded, needs 5 slots: the tail is read again).
    set_tail(1);
    assert_eq!(long(&mut p), Err(RingError::BadTail { tail: 1, head: 9 }));
    set_tail(5);
    assert_eq!(long(&mut p), Ok(false));
    set_tail(6);
    assert_eq!(long(&mut p), Ok(true));
    assert_eq!(p.head, 14);
}

/// Ring memory with guard bytes on both sides, to see accesses that
/// leave it.
struct Guarded {
    ptr: NonNull<u8>,
    layout: Layout,
    nslots: usize,
}

const GUARD: usize = 256;
const GUARD_BYTE: u8 = 0xEE;

impl Guarded {
    fn new(nslots: usize) -> Guarded {
        let layout = Layout::from_size_align(bytes_for(nslots) + 2 * GUARD, 64).unwrap();
        // SAFETY: non-zero size.
        let ptr = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) }).unwrap();
        let g = Guarded {
            ptr,
            layout,
            nslots,
        };
        g.all()[..GUARD].fill(GUARD_BYTE);
        g.all()[GUARD + bytes_for(nslots)..].fill(GUARD_BYTE);
        g
    }

    #[allow(clippy::mut_from_ref)]
    fn all(&self) -> &mut [u8] {
        // SAFETY: the allocation; the tests never hold two of these
        // slices, or one across a ring call.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }

    /// The slot area.
    #[allow(clippy::mut_from_ref)]
    fn area(&self) -> &mut [u8] {
        let start = GUARD + CONTROL;
        &mut self.all()[start..start + self.nslots * SLOT]
    }

    fn view(&self) -> RingRef<'_> {
        // SAFETY: GUARD is a multiple of 64, so the ring is 64-aligned,
        // inside the allocation, and zeroed; nslots is a power of two >= 4.
        unsafe {
            RingRef::from_raw(
                NonNull::new(self.ptr.as_ptr().add(GUARD)).unwrap(),
                self.nslots,
            )
        }
    }

    fn assert_guards(&self) {
        let all = self.all();
        let n = all.len();
        assert!(
            all[..GUARD].iter().all(|&b| b == GUARD_BYTE),
            "write before the ring"
        );
        assert!(
            all[n - GUARD..].iter().all(|&b| b == GUARD_BYTE),
            "write after the ring"
        );
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// Area offset of payload byte `j` of a message whose first slot is at
/// position `pos`, short or long (the layout the module docs describe,
/// spelled out with safe arithmetic).
fn payload_offset(nslots: usize, pos: u64, short: bool, j: usize) -> usize {
    let size = nslots * SLOT;
    let at = |p: u64| (p as usize % nslots) * SLOT;
    if short {
        at(pos) + OFF_SHORT_PAYLOAD + j
    } else if j < INLINE {
        at(pos + 1) + OFF_INLINE + j
    } else {
        (at(pos + 2) + (j - INLINE)) % size
    }
}

/// Positions to try: two laps, and a few far ones.
fn positions(nslots: usize) -> impl Iterator<Item = u64> {
    (0..2 * nslots as u64).chain([1 << 40, (1 << 40) + nslots as u64 - 1])
}

/// The forms a message at a given position can take for the consumer: short,
/// long, or long after a padding entry (only where that entry is at an odd
/// position).
#[derive(Copy, Clone, Debug, PartialEq)]
enum Form {
    Short,
    Long,
    Padded,
}

#[test]
fn consumer_copies_stay_in_the_ring_for_every_length_and_position() {
    for nslots in [8, 16] {
        let g = Guarded::new(nslots);
        let v = g.view();
        for tail in positions(nslots) {
            for form in [Form::Short, Form::Long, Form::Padded] {
                if form == Form::Padded && tail % 2 == 0 {
                    continue;
                }
                let max = if form == Form::Short {
                    SHORT_INLINE
                } else {
                    v.max_payload()
                };
                for len in 0..=max {
                    consume_one(&g, tail, form, len);
                }
            }
        }
    }
}

/// Writes a message of `form` and `len` bytes at `tail` into pattern
/// memory, then peeks, copies (with three capacities) and pops it, checking
/// the bytes, the new tail, the zeroed words and the guards.
fn consume_one(g: &Guarded, tail: u64, form: Form, len: usize) {
    let nslots = g.nslots;
    let v = g.view();
    // Pattern bytes never equal the guard byte.
    for (i, b) in g.area().iter_mut().enumerate() {
        *b = (i % 200) as u8;
    }
    let at_slot = |p: u64| (p as usize % nslots) * SLOT;
    let start = if form == Form::Padded { tail + 1 } else { tail };
    let area = g.area();
    if form == Form::Padded {
        let s = at_slot(tail);
        area[s..s + 8].copy_from_slice(&(tail + 1).to_le_bytes());
        area[s + OFF_KIND] = KIND_PAD;
    }
    let s = at_slot(start);
    area[s..s + 8].copy_from_slice(&(start + 1).to_le_bytes());
    if form == Form::Short {
        area[s + OFF_KIND] = KIND_SHORT | 1;
        area[s + OFF_SHORT_LEN] = len as u8;
    } else {
        area[s + OFF_KIND] = 1;
        area[s + OFF_LEN..s + OFF_LEN + 4].copy_from_slice(&(len as u32).to_le_bytes());
    }
    let short = form == Form::Short;
    let want: Vec<u8> = (0..len)
        .map(|j| g.area()[payload_offset(nslots, start, short, j)])
        .collect();
    let mut c = Consumer {
        ring: v.detach(),
        tail,
        end: u64::MAX,
        max_payload: v.max_payload(),
    };
    let m = c.peek().expect("published").expect("valid");
    let what = format!("{nslots} slots, tail {tail}, {form:?}, len {len}");
    assert_eq!(m.header.len as usize, len, "{what}");
    for cap in [len, len / 2, len + 7] {
        let mut dst = vec![GUARD_BYTE; cap];
        let n = c.copy_payload(&m, &mut dst);
        assert_eq!(n, len.min(cap));
        assert_eq!(dst[..n], want[..n], "{what}");
        assert!(dst[n..].iter().all(|&b| b == GUARD_BYTE));
    }
    c.pop(&m);
    let k = if short { 1 } else { slots_for(len) };
    assert_eq!(c.tail, start + k, "{what}");
    // Continuation slots that start a line (payload in the first word) are
    // zeroed, the others keep their payload (a short message's producer
    // zeroes one before a message can start there); the first keeps its
    // header's seq, which no later position can take for published, and a
    // long message's second slot what its producer wrote there (the
    // pattern, in this test: nothing wrote it).
    assert_eq!(v.seq(start).load(Ordering::Relaxed), start + 1);
    for p in (start + 2).min(c.tail)..c.tail {
        let word = v.seq(p).load(Ordering::Relaxed);
        // (Lines as the message's producer laid them out: from its start,
        // which only this test puts at an odd position.)
        if (p - start) % 2 == 0 {
            assert_eq!(word, 0, "{what}");
        } else {
            let s = at_slot(p);
            assert_eq!(word.to_le_bytes(), g.area()[s..s + 8], "{what}");
        }
    }
    g.assert_guards();
}

#[test]
fn made_up_messages_stay_in_the_ring() {
    // An Incoming that did not come from peek: capped, never outside.
    let g = Guarded::new(8);
    for (short, pad) in [(false, 0), (false, 1), (true, 0)] {
        let mut c = Consumer {
            ring: g.view().detach(),
            tail: 7 - pad,
            end: u64::MAX,
            max_payload: g.view().max_payload(),
        };
        let m = Incoming {
            header: Header {
                len: u32::MAX,
                ..Header::default()
            },
            short,
            pad,
        };
        let mut dst = vec![0u8; 4096];
        let max = if short {
            SHORT_INLINE
        } else {
            g.view().max_payload()
        };
        assert_eq!(c.copy_payload(&m, &mut dst), max);
        c.pop(&m);
        let k = if short { 1 } else { slots_for(max) };
        assert_eq!(c.tail, 7 + k);
        g.assert_guards();
    }
}

#[test]
fn producer_writes_stay_in_the_ring_for_every_length_and_position() {
    for nslots in [8, 16] {
        let g = Guarded::new(nslots);
        let v = g.view();
        for head in positions(nslots) {
            for len in 0..=v.max_payload() {
                produce_one(&g, head, len, false);
                if len <= SHORT_INLINE {
                    produce_one(&g, head, len, true);
                }
            }
        }
    }
}

/// Pushes a message of `len` bytes at `head` (short, or long with a cookie)
/// over pattern memory and compares every byte of the ring with what the
/// layout says.
fn produce_one(g: &Guarded, head: u64, len: usize, short: bool) {
    let nslots = g.nslots;
    let v = g.view();
    for (i, b) in g.area().iter_mut().enumerate() {
        *b = (i % 200) as u8;
    }
    let mut want = g.area().to_vec();
    let payload: Vec<u8> = (0..len).map(|j| 200 + (j % 37) as u8).collect();
    let h = Header {
        kind: 1,
        flags: 2,
        tag: -3,
        context: 4,
        len: 0,
        cookie: if short { 0 } else { 5 },
        aux: if short { len as u64 } else { 6 },
    };
    let mut p = Producer {
        ring: v.detach(),
        head,
        tail_cache: head,
        waiting: false,
        max_payload: v.max_payload(),
    };
    assert_eq!(p.try_push(&h, &payload), Ok(true));
    let pad = if short { 0 } else { head & 1 };
    let start = head + pad;
    let k = if short { 1 } else { slots_for(len) };
    assert_eq!(p.head, start + k);
    // The expected bytes, field by field.
    let at_slot = |p: u64| (p as usize % nslots) * SLOT;
    let mut put = |slot: usize, off: usize, bytes: &[u8]| {
        want[slot + off..slot + off + bytes.len()].copy_from_slice(bytes)
    };
    if pad == 1 {
        put(at_slot(head), 0, &(head + 1).to_le_bytes());
        put(at_slot(head), OFF_KIND, &[KIND_PAD]);
    }
    let s = at_slot(start);
    put(s, 0, &(start + 1).to_le_bytes());
    put(s, OFF_FLAGS, &[2]);
    put(s, OFF_TAG, &(-3i32).to_le_bytes());
    put(s, OFF_CONTEXT, &4u32.to_le_bytes());
    if short {
        put(s, OFF_KIND, &[KIND_SHORT | 1]);
        put(s, OFF_SHORT_LEN, &[len as u8]);
        if start % 2 == 0 {
            // The line's second half, zeroed for the message that may
            // start there.
            put(at_slot(start + 1), 0, &0u64.to_le_bytes());
        }
    } else {
        put(s, OFF_KIND, &[1]);
        put(s, OFF_LEN, &(len as u32).to_le_bytes());
        put(s, OFF_COOKIE, &5u64.to_le_bytes());
        let second = at_slot(start + 1);
        put(second, 0, &0u64.to_le_bytes());
        put(second, OFF_AUX, &6u64.to_le_bytes());
    }
    for (j, &b) in payload.iter().enumerate() {
        want[payload_offset(nslots, start, short, j)] = b;
    }
    assert!(
        g.area() == want,
        "{nslots} slots, head {head}, len {len}, short {short}"
    );
    g.assert_guards();
}

#[test]
fn threads_transfer_in_order() {
    let (r, mut p, mut c) = pair(64);
    let r = std::sync::Arc::new(r);
    let keep = r.clone();
    let h = std::thread::spawn(move || {
        let _keep = keep;
        for i in 0u32..100_000 {
            let len = (i % 300) as usize;
            let payload = vec![i as u8; len];
            // Every other message eager-like: short when small.
            let hd = Header {
                tag: i as i32,
                aux: if i % 2 == 0 { len as u64 } else { u64::MAX },
                ..Header::default()
            };
            while !p.try_push(&hd, &payload).unwrap() {
                std::hint::spin_loop();
            }
        }
    });
    let mut i = 0u32;
    while i < 100_000 {
        if let Some((h, v)) = recv(&mut c) {
            assert_eq!(h.tag, i as i32);
            assert_eq!(v.len(), (i % 300) as usize);
            assert!(v.iter().all(|&b| b == i as u8));
            i += 1;
        }
    }
    h.join().unwrap();
}

#[test]
fn every_ring_size_the_devices_accept_gives_a_valid_slot_count() {
    // `engine::ring_bytes_option` accepts 4 KiB to 1 GiB; both ends of a
    // shm record and the thread device's rings derive their slot count from
    // it through `slots_for_bytes`, and a ring refuses an invalid count.
    for bytes in [4096, 4097, 6000, 65536, 3 << 20, 1 << 30] {
        let n = slots_for_bytes(bytes);
        assert!(valid_nslots(n), "{bytes} bytes: {n} slots");
        assert!(n >= bytes / SLOT, "{bytes} bytes: {n} slots");
    }
}

#[test]
#[should_panic(expected = "a kind the ring reserves")]
fn a_kind_the_ring_reserves_is_refused() {
    // The short bit marks short messages and padding: a caller's kind with
    // it would be read as one of those.
    let (_r, mut p, _c) = pair(8);
    let h = Header {
        kind: KIND_SHORT | 1,
        ..Header::default()
    };
    let _ = p.try_push(&h, b"x");
}
