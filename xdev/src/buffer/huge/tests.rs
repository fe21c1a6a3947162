use super::*;
use crate::BufferStorage;
use crate::PageAligned;

/// The bytes of a block, read through its storage.
fn bytes(b: &mut PageAligned) -> &[u8] {
    let (p, n) = (b.as_mut_ptr(), b.capacity());
    // SAFETY: the storage owns `n` initialised bytes at `p` while `b` lives.
    unsafe { std::slice::from_raw_parts(p, n) }
}

#[test]
fn large_blocks_are_huge_aligned_zeroed_and_writable() {
    if !enabled() {
        println!("skipped: XDEV_HUGE_PAGES=0 turns huge-page backing off");
        return;
    }
    for len in [
        MIN_BYTES,
        MIN_BYTES + 1,
        700 << 10,
        1 << 20,
        HUGE_PAGE,
        3 << 20,
    ] {
        let mut b = PageAligned::zeroed(len);
        assert!(b.huge_backed(), "{len}");
        let at = b.as_mut_ptr() as usize;
        assert_eq!(at % PageAligned::PAGE, 0, "{len}");
        if len >= HUGE_PAGE {
            assert_eq!(at % HUGE_PAGE, 0, "a mapping of its own: {len}");
        }
        assert!(bytes(&mut b).iter().all(|&x| x == 0), "{len}");
        // SAFETY: the block owns `len` writable bytes.
        unsafe { b.as_mut_ptr().write_bytes(0xA5, len) };
        assert!(bytes(&mut b).iter().all(|&x| x == 0xA5), "{len}");
    }
    // Below the threshold: the heap, as before.
    assert!(!PageAligned::zeroed(MIN_BYTES - 1).huge_backed());
    assert!(!PageAligned::zeroed(0).huge_backed());
}

#[test]
fn a_block_used_and_given_back_comes_back_zeroed() {
    if !enabled() {
        println!("skipped: XDEV_HUGE_PAGES=0 turns huge-page backing off");
        return;
    }
    let len = 300 << 10;
    let mut first = PageAligned::zeroed(len);
    // SAFETY: the block owns `len` writable bytes.
    unsafe { first.as_mut_ptr().write_bytes(0x5A, len) };
    drop(first);
    // Other tests share the process's arena: take blocks of this size until
    // the dirty one comes back (it is on top of its free list unless another
    // test took it meanwhile); every one of them must read as zeros.
    for _ in 0..16 {
        let mut b = PageAligned::zeroed(len);
        assert!(bytes(&mut b)[..len].iter().all(|&x| x == 0));
    }
}

#[test]
fn the_arena_stops_at_its_limit_and_reuses_what_it_mapped() {
    let mut a = Arena::new();
    let class = 0; // 256 KiB: eight blocks per chunk
    let limit = HUGE_PAGE;
    let mut taken = Vec::new();
    for i in 0..HUGE_PAGE / CLASSES[class] {
        let Some((addr, dirty)) = a.take(class, limit) else {
            println!("skipped: mmap refused a 2 MiB mapping");
            return;
        };
        assert!(!dirty, "block {i} of a fresh chunk is clean");
        assert_eq!(addr % CLASSES[class], 0);
        taken.push(addr);
    }
    assert_eq!(a.mapped(), HUGE_PAGE);
    taken.sort_unstable();
    taken.dedup();
    assert_eq!(
        taken.len(),
        HUGE_PAGE / CLASSES[class],
        "eight distinct blocks"
    );
    assert_eq!(taken[7] - taken[0], 7 * CLASSES[class], "one chunk");
    assert_eq!(
        a.take(class, limit),
        None,
        "past the limit: the heap's turn"
    );
    a.give_back(class, taken[3]);
    assert_eq!(
        a.take(class, limit),
        Some((taken[3], true)),
        "reused, marked used"
    );
    assert_eq!(a.mapped(), HUGE_PAGE, "no second chunk");
    // Another size class maps its own chunk, within a higher limit.
    assert!(a.take(2, 2 * HUGE_PAGE).is_some());
    assert_eq!(a.mapped(), 2 * HUGE_PAGE);
}
