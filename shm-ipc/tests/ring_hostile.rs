//! Property test: whatever a hostile or corrupted peer writes into a ring's
//! memory, the consumer either reports `Corrupt` or decodes a header whose
//! payload fits the ring; copies stay inside the ring and never panic.

use proptest::prelude::*;
use shm_ipc::ring::{self, Consumer, HeapRing, RingError};

fn scribble(r: &HeapRing, bytes: &[u8], tail_slot_seq: Option<u64>) {
    let v = r.view();
    let n = ring::bytes_for(v.nslots());
    // SAFETY: the HeapRing owns bytes_for(nslots) bytes at this address and
    // no producer or consumer thread touches it concurrently in this test.
    let mem = unsafe { std::slice::from_raw_parts_mut(ring_base(r), n) };
    for (i, b) in bytes.iter().enumerate() {
        mem[(ring::CONTROL + i) % n] = *b;
    }
    // Keep the control block's tail at 0 so the consumer looks at slot 0,
    // and optionally make slot 0 look published.
    mem[..8].copy_from_slice(&0u64.to_le_bytes());
    if let Some(seq) = tail_slot_seq {
        mem[ring::CONTROL..ring::CONTROL + 8].copy_from_slice(&seq.to_le_bytes());
    }
}

fn ring_base(r: &HeapRing) -> *mut u8 {
    r.view().base_ptr()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn hostile_ring_memory_is_rejected_or_bounded(
        bytes in proptest::collection::vec(any::<u8>(), 0..4096),
        published in any::<bool>(),
        cap in 0usize..3000,
    ) {
        let r = HeapRing::new(16);
        scribble(&r, &bytes, published.then_some(1));
        // SAFETY: `r` outlives the consumer; it is the only consumer.
        let mut c = unsafe { Consumer::new(r.view()) };
        let mut dst = vec![0u8; cap];
        // Walk a few entries: each is either rejected or stays in bounds.
        for _ in 0..4 {
            match c.peek() {
                None => break,
                Some(Err(RingError::Corrupt { len })) => {
                    prop_assert!(len as usize > r.view().max_payload());
                    break;
                }
                Some(Err(e)) => prop_assert!(false, "the consumer reported {e}"),
                Some(Ok(m)) => {
                    prop_assert!(m.header.len as usize <= r.view().max_payload());
                    let n = c.copy_payload(&m, &mut dst);
                    prop_assert!(n <= cap && n <= m.header.len as usize);
                    c.pop(&m);
                }
            }
        }
    }
}
