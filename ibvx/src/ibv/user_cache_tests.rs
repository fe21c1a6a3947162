//! The registration cache for user buffers over a real RDMA device
//! (soft-RoCE in the VM suite): a `Buffer` sent again stays registered, a
//! freed and reallocated one never sends stale data, and many distinct
//! buffers stay within the pinned budget with nothing lost. Without an
//! RDMA device they say `skipped: ...`.

use xdev::{Buffer, Device, Source, TagSel};

use super::device_tests::{job, pattern, unavailable};

const LEN: usize = 256 * 1024;

/// Receives messages `tags` from rank 0, each `LEN` bytes of its pattern.
fn receive_patterns(b: &super::IbvDevice, tags: std::ops::Range<usize>) {
    let mut buf = vec![0u8; LEN];
    for i in tags {
        let st = b
            .recv(&mut buf, Source::Rank(0), TagSel::Tag(i as i32), 0)
            .unwrap();
        assert_eq!(st.count, LEN);
        assert!(buf == pattern(i, LEN), "message {i}: stale or corrupt data");
    }
}

/// Sends `buf` to rank 1 once per tag in `tags`, filled with that tag's
/// pattern each time; checks that the user table registered it once for
/// all of them, and that dropping it then ends the entry.
fn send_again_then_drop(a: &super::IbvDevice, mut buf: Buffer, tags: std::ops::Range<usize>) {
    let rounds = tags.len() as u64;
    for i in tags {
        buf.copy_from_slice(&pattern(i, LEN));
        let c = a.isend(buf, 1, i as i32, 0).wait();
        assert!(c.status.error.is_none(), "{:?}", c.status);
        buf = c.buf;
    }
    let st = a.cache().stats();
    assert_eq!(st.user_misses, 1, "registered once: {st:?}");
    assert_eq!(st.user_hits, rounds - 1, "{st:?}");
    drop(buf);
    assert_eq!(
        a.cache().stats().user_entries,
        0,
        "dropping it ends the entry"
    );
}

/// One buffer sent again and again (new contents each time) is registered
/// once; fresh buffers, dropped after each send (malloc hands the same
/// address back), are each registered anew and arrive with their own bytes.
#[test]
fn a_reused_buffer_stays_registered_and_a_reallocated_one_sends_its_own_data() {
    if unavailable().is_some() {
        return;
    }
    let j = job(2, &[]);
    let (a, b) = (&j.devs[0], &j.devs[1]);
    const ROUNDS: usize = 40;
    let mut addrs = std::collections::HashSet::new();
    std::thread::scope(|s| {
        s.spawn(|| receive_patterns(b, 0..2 * ROUNDS));
        send_again_then_drop(a, Buffer::zeroed(LEN), 0..ROUNDS);
        for i in ROUNDS..2 * ROUNDS {
            let v = pattern(i, LEN);
            addrs.insert(v.as_ptr() as usize);
            let c = a.isend(Buffer::from(v), 1, i as i32, 0).wait();
            assert!(c.status.error.is_none(), "{:?}", c.status);
        }
    });
    let st = a.cache().stats();
    assert_eq!(st.user_misses, 1 + ROUNDS as u64, "{st:?}");
    assert_eq!(st.user_entries, 0, "{st:?}");
    println!(
        "{} fresh buffers at {} distinct addresses; cache {st:?}",
        ROUNDS,
        addrs.len()
    );
    for d in &j.devs {
        d.finish().unwrap();
    }
}

/// A buffer of foreign storage (page-aligned, as OSU's benchmarks make
/// them) sent again and again is registered once too, and dropping it ends
/// the entry before its memory goes; a leased buffer never enters the user
/// table (its chunk is registered already).
#[test]
fn a_reused_page_aligned_buffer_stays_registered_and_a_lease_is_not_adopted() {
    if unavailable().is_some() {
        return;
    }
    let j = job(2, &[]);
    let (a, b) = (&j.devs[0], &j.devs[1]);
    const ROUNDS: usize = 20;
    std::thread::scope(|s| {
        s.spawn(|| receive_patterns(b, 0..ROUNDS + 1));
        let aligned = Buffer::zeroed_page_aligned(LEN);
        assert_eq!(aligned.as_ptr() as usize % xdev::PageAligned::PAGE, 0);
        send_again_then_drop(a, aligned, 0..ROUNDS);
        let mut leased = a.alloc_buffer(LEN).unwrap();
        leased.copy_from_slice(&pattern(ROUNDS, LEN));
        let c = a.isend(leased, 1, ROUNDS as i32, 0).wait();
        assert!(c.status.error.is_none(), "{:?}", c.status);
        let after = a.cache().stats();
        assert_eq!(
            (after.user_misses, after.user_entries),
            (1, 0),
            "a lease is not a user entry: {after:?}"
        );
    });
    for d in &j.devs {
        d.finish().unwrap();
    }
}

/// Sixteen live buffers of 256 KiB sent round-robin with a pinned budget of
/// 1 MiB: the cache stays within the budget (evicting least recently used
/// entries) and every message arrives intact.
#[test]
fn many_distinct_buffers_past_the_pinned_budget_stay_bounded_and_lose_nothing() {
    if unavailable().is_some() {
        return;
    }
    let budget = 1usize << 20;
    let j = job(2, &[("max_pinned_bytes", "1048576")]);
    let (a, b) = (&j.devs[0], &j.devs[1]);
    const BUFFERS: usize = 16;
    const SENDS: usize = 3 * BUFFERS;
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut buf = vec![0u8; LEN];
            for i in 0..SENDS {
                let st = b
                    .recv(&mut buf, Source::Rank(0), TagSel::Tag(i as i32), 0)
                    .unwrap();
                assert_eq!(st.count, LEN);
                assert!(buf == pattern(i, LEN), "message {i}: stale or corrupt data");
            }
        });
        let mut bufs: Vec<Option<Buffer>> =
            (0..BUFFERS).map(|_| Some(Buffer::zeroed(LEN))).collect();
        let mut max_pinned = 0;
        for i in 0..SENDS {
            let mut buf = bufs[i % BUFFERS].take().expect("returned");
            buf.copy_from_slice(&pattern(i, LEN));
            let c = a.isend(buf, 1, i as i32, 0).wait();
            assert!(c.status.error.is_none(), "send {i}: {:?}", c.status);
            bufs[i % BUFFERS] = Some(c.buf);
            max_pinned = max_pinned.max(a.cache().stats().pinned_bytes);
        }
        let st = a.cache().stats();
        assert!(
            max_pinned <= budget,
            "pinned {max_pinned} > {budget}: {st:?}"
        );
        assert!(st.user_evictions > 0, "the budget made room: {st:?}");
        assert!(st.user_entries < BUFFERS, "{st:?}");
        println!("{SENDS} sends from {BUFFERS} buffers, most pinned {max_pinned}; cache {st:?}");
    });
    for d in &j.devs {
        d.finish().unwrap();
    }
}

/// `Device::alloc_buffer` through `Arc<dyn Device>` gives leased memory
/// (its storage is the cache's lease), usable for a rendezvous.
#[test]
fn alloc_buffer_through_dyn_device_is_leased_memory() {
    if unavailable().is_some() {
        return;
    }
    let mut j = job(2, &[]);
    let b_dev = j.devs.pop().unwrap();
    let a: std::sync::Arc<dyn Device> = std::sync::Arc::new(j.devs.pop().unwrap());
    let mut buf = a.alloc_buffer(LEN).unwrap();
    assert!(buf.storage().is_some_and(|s| s.is::<super::Lease>()));
    buf.copy_from_slice(&pattern(3, LEN));
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut got = vec![0u8; LEN];
            b_dev
                .recv(&mut got, Source::Rank(0), TagSel::Tag(1), 0)
                .unwrap();
            assert!(got == pattern(3, LEN));
        });
        let c = a.isend(buf, 1, 1, 0).wait();
        assert!(c.status.error.is_none(), "{:?}", c.status);
    });
    a.finish().unwrap();
    b_dev.finish().unwrap();
}
