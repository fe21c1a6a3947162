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

#[test]
fn small_message_is_one_slot() {
    assert_eq!(slots_for(0), 1);
    assert_eq!(slots_for(INLINE), 1);
    assert_eq!(slots_for(INLINE + 1), 2);
    assert_eq!(slots_for(INLINE + SLOT), 2);
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
        let len = (seed >> 33) as usize % (max + 1);
        let payload: Vec<u8> = (0..len).map(|i| (i as u64 ^ seed) as u8).collect();
        let h = Header {
            kind: 1,
            tag: round,
            context: 7,
            cookie: seed,
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
    let (_r, mut p, mut c) = pair(8);
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
    assert!(p.try_push(&Header::default(), b"x").unwrap());
    // Scribble an impossible length, as a hostile peer could.
    // SAFETY: offset OFF_LEN of slot 0 is inside the ring allocation.
    unsafe { ptr::write_unaligned(r.view().slot(0).add(OFF_LEN) as *mut u32, u32::MAX) };
    assert_eq!(
        c.peek().unwrap().unwrap_err(),
        RingError::Corrupt { len: u32::MAX }
    );
}

#[test]
fn corrupt_tail_is_reported() {
    let (r, mut p, _c) = pair(4);
    let set_tail = |t: u64| {
        // SAFETY: the tail word is the first 8 bytes of the ring
        // allocation; nothing accesses it concurrently in this test.
        unsafe { ptr::write(r.view().base_ptr() as *mut u64, t) }
    };
    let big = [0u8; INLINE + 1];
    assert_eq!(p.try_push(&Header::default(), &big), Ok(true));
    assert_eq!(p.try_push(&Header::default(), &big), Ok(true));
    // Full ring (head 4): the tail is read, and must lie in 0..=4.
    for bad in [5, u64::MAX] {
        set_tail(bad);
        assert_eq!(
            p.try_push(&Header::default(), b"x"),
            Err(RingError::BadTail { tail: bad, head: 4 })
        );
    }
    set_tail(2);
    assert_eq!(p.try_push(&Header::default(), b"x"), Ok(true));
    // Head 5, tail seen at 2: a tail of 1 went backwards.
    set_tail(1);
    assert_eq!(
        p.try_push(&Header::default(), &big),
        Err(RingError::BadTail { tail: 1, head: 5 })
    );
    set_tail(5);
    assert_eq!(p.try_push(&Header::default(), &big), Ok(true));
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
/// position `pos` (the layout the module docs describe, spelled out with
/// safe arithmetic).
fn payload_offset(nslots: usize, pos: u64, j: usize) -> usize {
    let size = nslots * SLOT;
    let first = (pos as usize % nslots) * SLOT;
    if j < INLINE {
        first + HEADER + j
    } else {
        (first + SLOT + (j - INLINE)) % size
    }
}

/// Positions to try: two laps, and a few far ones.
fn positions(nslots: usize) -> impl Iterator<Item = u64> {
    (0..2 * nslots as u64).chain([1 << 40, (1 << 40) + nslots as u64 - 1])
}

#[test]
fn consumer_copies_stay_in_the_ring_for_every_length_and_position() {
    for nslots in [4, 8, 16] {
        let g = Guarded::new(nslots);
        let v = g.view();
        for tail in positions(nslots) {
            for len in 0..=v.max_payload() {
                // Pattern bytes never equal the guard byte.
                for (i, b) in g.area().iter_mut().enumerate() {
                    *b = (i % 200) as u8;
                }
                let slot = (tail as usize % nslots) * SLOT;
                let area = g.area();
                area[slot..slot + 8].copy_from_slice(&(tail + 1).to_le_bytes());
                area[slot + OFF_LEN..slot + OFF_LEN + 4]
                    .copy_from_slice(&(len as u32).to_le_bytes());
                let want: Vec<u8> = (0..len)
                    .map(|j| g.area()[payload_offset(nslots, tail, j)])
                    .collect();
                let mut c = Consumer {
                    ring: v.detach(),
                    tail,
                    end: u64::MAX,
                    max_payload: v.max_payload(),
                };
                let m = c.peek().expect("published").expect("valid");
                assert_eq!(m.header.len as usize, len);
                for cap in [len, len / 2, len + 7] {
                    let mut dst = vec![GUARD_BYTE; cap];
                    let n = c.copy_payload(&m, &mut dst);
                    assert_eq!(n, len.min(cap));
                    assert_eq!(
                        dst[..n],
                        want[..n],
                        "{nslots} slots, tail {tail}, len {len}"
                    );
                    assert!(dst[n..].iter().all(|&b| b == GUARD_BYTE));
                }
                c.pop(&m);
                assert_eq!(c.tail, tail + slots_for(len));
                // Continuation slots (payload in the first word) are zeroed;
                // the first keeps its header's seq, which no later position
                // can take for published.
                assert_eq!(v.seq(tail).load(Ordering::Relaxed), tail + 1);
                for p in tail + 1..c.tail {
                    assert_eq!(v.seq(p).load(Ordering::Relaxed), 0);
                }
                g.assert_guards();
            }
        }
    }
}

#[test]
fn made_up_messages_stay_in_the_ring() {
    // An Incoming that did not come from peek: capped, never outside.
    let g = Guarded::new(4);
    let mut c = Consumer {
        ring: g.view().detach(),
        tail: 3,
        end: u64::MAX,
        max_payload: g.view().max_payload(),
    };
    let m = Incoming {
        header: Header {
            len: u32::MAX,
            ..Header::default()
        },
    };
    let mut dst = vec![0u8; 4096];
    assert_eq!(c.copy_payload(&m, &mut dst), g.view().max_payload());
    c.pop(&m);
    assert_eq!(c.tail, 3 + slots_for(g.view().max_payload()));
    g.assert_guards();
}

#[test]
fn producer_writes_stay_in_the_ring_for_every_length_and_position() {
    for nslots in [4, 8, 16] {
        let g = Guarded::new(nslots);
        let v = g.view();
        for head in positions(nslots) {
            for len in 0..=v.max_payload() {
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
                    cookie: 5,
                    aux: 6,
                };
                let mut p = Producer {
                    ring: v.detach(),
                    head,
                    tail_cache: head,
                    waiting: false,
                    max_payload: v.max_payload(),
                };
                assert_eq!(p.try_push(&h, &payload), Ok(true));
                assert_eq!(p.head, head + slots_for(len));
                // The expected bytes, field by field.
                let s = (head as usize % nslots) * SLOT;
                let mut put = |off: usize, bytes: &[u8]| {
                    want[s + off..s + off + bytes.len()].copy_from_slice(bytes)
                };
                put(0, &(head + 1).to_le_bytes());
                put(OFF_KIND, &[1]);
                put(OFF_FLAGS, &[2]);
                put(OFF_TAG, &(-3i32).to_le_bytes());
                put(OFF_CONTEXT, &4u32.to_le_bytes());
                put(OFF_LEN, &(len as u32).to_le_bytes());
                put(OFF_COOKIE, &5u64.to_le_bytes());
                put(OFF_AUX, &6u64.to_le_bytes());
                for (j, &b) in payload.iter().enumerate() {
                    want[payload_offset(nslots, head, j)] = b;
                }
                assert!(g.area() == want, "{nslots} slots, head {head}, len {len}");
                g.assert_guards();
            }
        }
    }
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
            let hd = Header {
                tag: i as i32,
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
