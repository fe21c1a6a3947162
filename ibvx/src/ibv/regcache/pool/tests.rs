//! The cache's bookkeeping (size classes, hits, LRU, idle limits, the
//! pinned budget, lookups, transient registrations) against a fake
//! registrar: real `mmap`ed chunks, fake keys, no RDMA device.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use proptest::prelude::*;

use super::*;

/// A registrar that hands out unique keys and records what is registered.
#[derive(Default)]
struct Fake {
    next_key: AtomicU32,
    /// Live registrations: start address -> (length, lkey).
    live: Mutex<BTreeMap<usize, (usize, u32)>>,
    registers: AtomicUsize,
    fail_register: AtomicBool,
    fail_dereg: AtomicBool,
}

struct FakeRegion {
    addr: usize,
}

impl Registrar for Fake {
    type Region = FakeRegion;

    unsafe fn register(
        &self,
        ptr: NonNull<u8>,
        len: usize,
        _exposure: Exposure,
    ) -> verbs::Result<(FakeRegion, Keys)> {
        if self.fail_register.load(Ordering::SeqCst) {
            return Err(verbs::Error::Registration {
                len,
                source: io::Error::from_raw_os_error(libc::ENOMEM),
                hint: "",
            });
        }
        // SAFETY: the contract says the range is mapped; touching both ends
        // checks that the pool only registers mapped memory.
        unsafe {
            ptr::read_volatile(ptr.as_ptr());
            ptr::read_volatile(ptr.as_ptr().add(len - 1));
        }
        self.registers.fetch_add(1, Ordering::SeqCst);
        let key = self.next_key.fetch_add(1, Ordering::SeqCst) + 1;
        let addr = ptr.as_ptr() as usize;
        let old = self.live.lock().unwrap().insert(addr, (len, key));
        assert!(old.is_none(), "{addr:#x} registered twice");
        Ok((
            FakeRegion { addr },
            Keys {
                lkey: key,
                rkey: key | 0x8000_0000,
            },
        ))
    }

    fn deregister(&self, region: FakeRegion) -> verbs::Result<()> {
        if self.fail_dereg.load(Ordering::SeqCst) {
            return Err(verbs::Error::from_rc("ibv_dereg_mr", libc::EBUSY));
        }
        let gone = self.live.lock().unwrap().remove(&region.addr);
        assert!(gone.is_some(), "{:#x} deregistered twice", region.addr);
        Ok(())
    }
}

const K: usize = 1024;

fn pool(max_idle_chunks: usize, max_idle_bytes: usize, max_pinned_bytes: usize) -> Arc<Pool<Fake>> {
    Pool::new(
        Fake::default(),
        CacheLimits {
            max_idle_chunks,
            max_idle_bytes,
            max_pinned_bytes,
            ..CacheLimits::default()
        },
    )
}

fn fake(p: &Pool<Fake>) -> &Fake {
    &p.shared.registrar
}

fn live(p: &Pool<Fake>) -> usize {
    fake(p).live.lock().unwrap().len()
}

fn addr(l: &PoolLease<Fake>) -> usize {
    l.chunk.ptr.as_ptr() as usize
}

fn found(p: &Pool<Fake>, ptr: usize, len: usize) -> Option<usize> {
    p.find(ptr as *const u8, len).map(|r| r.addr())
}

/// pinned == leased + idle + transient + user + leaked when no stray handle
/// lives.
fn check_accounting(p: &Pool<Fake>) {
    let s = p.stats();
    assert_eq!(
        s.pinned_bytes,
        s.leased_bytes + s.idle_bytes + s.transient_bytes + s.user_bytes + s.leaked_bytes,
        "{s:?}"
    );
}

#[test]
fn size_classes_are_powers_of_two_from_4k() {
    assert_eq!(class_of(0), Some(4 * K));
    assert_eq!(class_of(1), Some(4 * K));
    assert_eq!(class_of(4 * K), Some(4 * K));
    assert_eq!(class_of(4 * K + 1), Some(8 * K));
    assert_eq!(class_of(64 * K), Some(64 * K));
    assert_eq!(class_of(3 << 20), Some(4 << 20));
    assert_eq!(class_of(usize::MAX), None);
    assert_eq!(pages_spanned(4096, 1), Some(4096));
    assert_eq!(pages_spanned(4095, 2), Some(8192));
    assert_eq!(pages_spanned(usize::MAX - 10, 100), None);

    let p = pool(8, 1 << 20, 1 << 20);
    for (len, class) in [(0, 4 * K), (1, 4 * K), (5000, 8 * K), (40000, 64 * K)] {
        let l = p.lease(len).unwrap();
        assert_eq!(l.chunk.len, class);
        assert_eq!(addr(&l) % MIN_CHUNK, 0, "page aligned");
    }
    let e = p.lease(usize::MAX).unwrap_err();
    assert!(matches!(e, verbs::Error::InvalidArgument(_)), "{e}");
    check_accounting(&p);
}

#[test]
fn a_dropped_lease_is_a_hit_with_the_same_keys_and_zeroed() {
    let p = pool(8, 1 << 20, 1 << 20);
    let l = p.lease(10_000).unwrap();
    let (a, keys) = (addr(&l), l.chunk.keys);
    // SAFETY: the lease owns the chunk's 16 KiB.
    unsafe { ptr::write_bytes(l.chunk.ptr.as_ptr(), 0xAB, l.chunk.len) };
    drop(l);
    let s = p.stats();
    assert_eq!(
        (s.hits, s.misses, s.idle_chunks, s.idle_bytes),
        (0, 1, 1, 16 * K)
    );
    assert_eq!(s.leased_bytes, 0);

    let l = p.lease(9_000).unwrap();
    assert_eq!((addr(&l), l.chunk.keys), (a, keys));
    // SAFETY: the lease owns the chunk's bytes.
    let bytes = unsafe { std::slice::from_raw_parts(l.chunk.ptr.as_ptr(), l.chunk.len) };
    assert!(bytes.iter().all(|&b| b == 0), "a hit is zeroed again");
    let s = p.stats();
    assert_eq!(
        (s.hits, s.misses, s.idle_chunks, s.leased_bytes),
        (1, 1, 0, 16 * K)
    );
    assert_eq!(
        fake(&p).registers.load(Ordering::SeqCst),
        1,
        "no second registration"
    );
    // A different class is a miss.
    let m = p.lease(4 * K).unwrap();
    assert_ne!(addr(&m), a);
    assert_eq!(p.stats().misses, 2);
    check_accounting(&p);
}

#[test]
fn idle_chunks_are_evicted_least_recently_used_first() {
    let p = pool(2, 1 << 20, 1 << 20);
    let (a, b, c) = (
        p.lease(0).unwrap(),
        p.lease(5000).unwrap(),
        p.lease(10_000).unwrap(),
    );
    let (aa, ba, ca) = (addr(&a), addr(&b), addr(&c));
    drop(a);
    drop(b);
    assert_eq!(p.stats().evictions, 0);
    // Reusing `a` makes it the most recently used: idle order is now b, a.
    let a = p.lease(1).unwrap();
    assert_eq!(addr(&a), aa);
    drop(a);
    drop(c); // three idle, limit two: b goes.
    let s = p.stats();
    assert_eq!((s.evictions, s.idle_chunks), (1, 2));
    assert_eq!(found(&p, ba, 1), None);
    assert_eq!(found(&p, aa, 1), Some(aa));
    assert_eq!(found(&p, ca, 1), Some(ca));
    assert!(
        !fake(&p).live.lock().unwrap().contains_key(&ba),
        "evicted = deregistered"
    );
    assert_eq!(live(&p), 2);
    check_accounting(&p);
}

#[test]
fn a_hit_takes_the_most_recently_used_chunk_of_its_class() {
    let p = pool(8, 1 << 20, 1 << 20);
    let (x, y) = (p.lease(100).unwrap(), p.lease(200).unwrap());
    let ya = addr(&y);
    drop(x);
    drop(y);
    assert_eq!(addr(&p.lease(300).unwrap()), ya);
}

#[test]
fn idle_bytes_are_bounded() {
    let p = pool(100, 12 * K, 1 << 20);
    let (a, b, c) = (
        p.lease(0).unwrap(),
        p.lease(8 * K).unwrap(),
        p.lease(0).unwrap(),
    );
    let aa = addr(&a);
    drop(a);
    drop(b);
    drop(c); // 16 KiB idle > 12 KiB: the oldest (a, 4 KiB) goes.
    let s = p.stats();
    assert_eq!((s.evictions, s.idle_chunks, s.idle_bytes), (1, 2, 12 * K));
    assert_eq!(found(&p, aa, 1), None);
    // A chunk larger than the idle budget is not kept at all.
    let big = p.lease(32 * K).unwrap();
    let big_addr = addr(&big);
    drop(big);
    assert_eq!(found(&p, big_addr, 1), None);
    assert!(p.stats().idle_bytes <= 12 * K);
    check_accounting(&p);
}

#[test]
fn zero_idle_limits_keep_nothing() {
    let p = pool(0, 1 << 20, 1 << 20);
    drop(p.lease(0).unwrap());
    let s = p.stats();
    assert_eq!((s.idle_chunks, s.pinned_bytes, s.evictions), (0, 0, 1));
    assert_eq!(live(&p), 0);
}

#[test]
fn the_pinned_budget_refuses_with_a_typed_error_and_leaks_nothing() {
    let p = pool(8, 1 << 20, 16 * K);
    let a = p.lease(8 * K).unwrap();
    let b = p.lease(8 * K).unwrap();
    let before = p.stats();
    let e = p.lease(0).unwrap_err();
    match e {
        verbs::Error::Budget {
            requested,
            pinned,
            limit,
            ..
        } => assert_eq!((requested, pinned, limit), (4 * K, 16 * K, 16 * K)),
        e => panic!("{e}"),
    }
    assert!(!e_line(&p.lease(0).unwrap_err()).contains('\n'));
    assert_eq!(p.stats(), before, "a refusal changes nothing");
    assert_eq!(live(&p), 2);
    // Leased chunks are never evicted to make room; idle ones are.
    drop(b);
    let c = p.lease(0).unwrap();
    let s = p.stats();
    assert_eq!((s.evictions, s.misses, s.pinned_bytes), (1, 3, 12 * K));
    assert_eq!(found(&p, addr(&a), 8 * K), Some(addr(&a)));
    drop(c);
    // More than the whole budget fails at once, without evicting anything.
    let idle = p.stats().idle_chunks;
    assert!(matches!(p.lease(32 * K), Err(verbs::Error::Budget { .. })));
    assert_eq!(p.stats().idle_chunks, idle);
    drop(a);
    check_accounting(&p);
}

fn e_line(e: &verbs::Error) -> String {
    e.to_string()
}

#[test]
fn a_zero_budget_refuses_everything() {
    let p = pool(8, 1 << 20, 0);
    assert!(matches!(p.lease(0), Err(verbs::Error::Budget { .. })));
    let mut v = vec![1u8; 100];
    // SAFETY: `v` outlives every registration (none is made).
    let r = unsafe { p.register(v.as_mut_ptr(), v.len(), Exposure::Local) };
    assert!(matches!(r, Err(verbs::Error::Budget { .. })));
    assert_eq!(live(&p), 0);
}

#[test]
fn leased_chunks_are_never_evicted() {
    let p = pool(0, 0, 8 * K);
    let a = p.lease(0).unwrap();
    let b = p.lease(0).unwrap();
    assert!(matches!(p.lease(0), Err(verbs::Error::Budget { .. })));
    let mut v = vec![0u8; 10];
    // SAFETY: `v` outlives the attempt.
    assert!(unsafe { p.register(v.as_mut_ptr(), 10, Exposure::Local) }.is_err());
    for l in [&a, &b] {
        let r = p.find(l.chunk.ptr.as_ptr(), 4 * K).unwrap();
        assert_eq!(r.keys(), l.chunk.keys);
    }
    assert_eq!(p.stats().evictions, 0);
    assert_eq!(live(&p), 2);
}

#[test]
fn a_failed_registration_releases_its_reservation() {
    let p = pool(8, 1 << 20, 1 << 20);
    fake(&p).fail_register.store(true, Ordering::SeqCst);
    let e = p.lease(0).unwrap_err();
    assert!(matches!(e, verbs::Error::Registration { .. }), "{e}");
    let mut v = vec![0u8; 100];
    // SAFETY: `v` outlives the attempt.
    let e = unsafe { p.register(v.as_mut_ptr(), 100, Exposure::Local) }.unwrap_err();
    assert!(matches!(e, verbs::Error::Registration { .. }), "{e}");
    let s = p.stats();
    assert_eq!(
        (s.pinned_bytes, s.misses, s.transient, s.leased_bytes),
        (0, 0, 0, 0)
    );
    fake(&p).fail_register.store(false, Ordering::SeqCst);
    drop(p.lease(0).unwrap());
    assert_eq!(p.stats().misses, 1);
}

#[test]
fn find_inside_outside_and_straddling() {
    let p = pool(8, 1 << 20, 1 << 20);
    let a = p.lease(8 * K).unwrap();
    let b = p.lease(8 * K).unwrap();
    let (aa, ba) = (addr(&a), addr(&b));
    assert_eq!(found(&p, aa, 8 * K), Some(aa), "whole chunk");
    assert_eq!(found(&p, aa, 0), Some(aa), "empty range at the start");
    assert_eq!(found(&p, aa + 100, 200), Some(aa));
    assert_eq!(found(&p, aa + 8 * K - 1, 1), Some(aa), "last byte");
    assert_eq!(found(&p, ba + 4 * K, 4 * K), Some(ba));
    // Straddling the end of a chunk (into whatever lies after it, maybe the
    // other chunk) is a miss.
    assert_eq!(found(&p, aa + 8 * K - 1, 2), None);
    assert_eq!(found(&p, ba + 1, 8 * K), None);
    assert_eq!(found(&p, aa, 8 * K + 1), None);
    // Foreign memory, null, and overflowing ranges.
    let v = Box::new([0u8; 64]);
    assert_eq!(found(&p, v.as_ptr() as usize, 64), None);
    assert_eq!(found(&p, 0, 1), None);
    assert_eq!(found(&p, usize::MAX - 4, 10), None);
    let s = p.stats();
    assert_eq!((s.find_hits, s.find_misses), (5, 6));
    // Idle chunks are found too; evicted ones are not.
    drop(a);
    assert_eq!(found(&p, aa + 1, 1), Some(aa));
    let q = pool(0, 0, 1 << 20);
    let c = q.lease(0).unwrap();
    let ca = addr(&c);
    drop(c);
    assert_eq!(found(&q, ca, 1), None);
}

fn user_pool(entries: usize, user_bytes: usize, pinned: usize) -> Arc<Pool<Fake>> {
    Pool::new(
        Fake::default(),
        CacheLimits {
            max_pinned_bytes: pinned,
            max_user_entries: entries,
            max_user_bytes: user_bytes,
            ..CacheLimits::default()
        },
    )
}

/// Registers user buffer `id` (a page-aligned slice of `mem`).
fn user(p: &Pool<Fake>, id: u64, mem: &mut [u8]) -> Reg<Fake> {
    // SAFETY: every test keeps `mem` alive until the pool is dropped.
    unsafe { p.register_user(id, mem.as_mut_ptr(), mem.len()) }.unwrap()
}

#[test]
fn user_buffers_stay_registered_and_are_evicted_least_recently_used() {
    let p = user_pool(2, 1 << 20, 1 << 20);
    let mut mem = vec![0u8; 3 * 8 * K];
    let (a, rest) = mem.split_at_mut(8 * K);
    let (b, c) = rest.split_at_mut(8 * K);
    let ka = user(&p, 1, a).keys();
    let kb = user(&p, 2, b).keys();
    assert_eq!(user(&p, 1, a).keys(), ka, "the same buffer again: a hit");
    let s = p.stats();
    assert_eq!((s.user_hits, s.user_misses, s.user_entries), (1, 2, 2));
    // A third buffer evicts the least recently used one: b.
    user(&p, 3, c);
    let s = p.stats();
    assert_eq!((s.user_entries, s.user_evictions), (2, 1), "{s:?}");
    assert_eq!(live(&p), 2, "the evicted registration ended");
    assert_ne!(user(&p, 2, b).keys(), kb, "b registered again");
    assert_eq!(p.stats().user_evictions, 2, "a was the least recently used");
    assert_ne!(user(&p, 1, a).keys(), ka, "a registered again");
    check_accounting(&p);
}

#[test]
fn a_forgotten_user_buffer_is_deregistered_once_no_operation_holds_it() {
    let p = user_pool(8, 1 << 20, 1 << 20);
    let mut mem = vec![0u8; 8 * K];
    let held = user(&p, 7, &mut mem);
    p.forget_user(7);
    assert_eq!(live(&p), 1, "an operation still holds it");
    assert_eq!(p.stats().user_entries, 0);
    drop(held);
    assert_eq!(live(&p), 0);
    let s = p.stats();
    assert_eq!((s.pinned_bytes, s.user_bytes), (0, 0), "{s:?}");
    // The same address under a new identity is a miss, never the old keys.
    let again = user(&p, 8, &mut mem);
    assert_eq!(p.stats().user_misses, 2);
    assert_eq!(again.addr(), mem.as_ptr() as usize);
}

#[test]
fn user_entries_are_bounded_in_bytes_and_give_way_to_the_pinned_budget() {
    let p = user_pool(64, 16 * K, 32 * K);
    let mut mem = vec![0u8; 64 * K];
    for (i, part) in mem.chunks_mut(8 * K).enumerate() {
        user(&p, i as u64 + 1, part);
        let s = p.stats();
        assert!(s.user_bytes <= 16 * K, "{s:?}");
        assert!(s.pinned_bytes <= 32 * K, "{s:?}");
    }
    assert!(p.stats().user_entries >= 1);
    // A lease needs the budget: user entries make room.
    let l = p.lease(32 * K).unwrap();
    let s = p.stats();
    assert_eq!((s.pinned_bytes, s.user_entries), (32 * K, 0), "{s:?}");
    drop(l);
    // Larger than max_user_bytes: registered for one operation only.
    let mut big = vec![0u8; 40 * K];
    let r = user(&p, 99, &mut big[..20 * K]);
    let s = p.stats();
    assert_eq!(s.transient, 1, "{s:?}");
    drop(r);
    check_accounting(&p);
}

#[test]
fn foreign_memory_gets_a_transient_registration_that_is_never_cached() {
    let p = pool(8, 1 << 20, 1 << 20);
    let mut v = vec![7u8; 10_000];
    let va = v.as_mut_ptr();
    // SAFETY: `v` outlives `r` (dropped below, before `v`).
    let r = unsafe { p.register(va, v.len(), Exposure::Local) }.unwrap();
    assert!(matches!(r, Reg::Transient(_)));
    assert_eq!((r.addr(), r.len()), (va as usize, 10_000));
    let pages = pages_spanned(va as usize, 10_000).unwrap();
    let s = p.stats();
    assert_eq!(
        (s.transient, s.transient_bytes, s.pinned_bytes),
        (1, pages, pages)
    );
    assert_eq!(
        found(&p, va as usize, 1),
        None,
        "transient registrations are not cached"
    );
    let r2 = r.clone();
    drop(r);
    assert_eq!(live(&p), 1, "a clone keeps it registered");
    drop(r2);
    assert_eq!(live(&p), 0);
    let s = p.stats();
    assert_eq!((s.transient_bytes, s.pinned_bytes), (0, 0));
    // SAFETY: `v` outlives the registration.
    let again = unsafe { p.register(va, 100, Exposure::Local) }.unwrap();
    assert_ne!(
        again.keys(),
        Keys {
            lkey: 1,
            rkey: 1 | 0x8000_0000
        },
        "a fresh registration"
    );
    assert_eq!(p.stats().transient, 2);
    drop(again);

    // A range inside a chunk is a hit, with no verbs call.
    let l = p.lease(100).unwrap();
    let n = fake(&p).registers.load(Ordering::SeqCst);
    // SAFETY: the chunk stays mapped while `l` lives.
    let r = unsafe { p.register(l.chunk.ptr.as_ptr().add(10), 50, Exposure::Local) }.unwrap();
    assert!(matches!(r, Reg::Cached(_)));
    assert_eq!(r.keys(), l.chunk.keys);
    assert_eq!(fake(&p).registers.load(Ordering::SeqCst), n);

    // Bad input is an error, not a panic.
    // SAFETY: nothing is registered for these.
    unsafe {
        assert!(matches!(
            p.register(ptr::null_mut(), 10, Exposure::Local),
            Err(verbs::Error::InvalidArgument(_))
        ));
        assert!(matches!(
            p.register(va, 0, Exposure::Local),
            Err(verbs::Error::InvalidArgument(_))
        ));
        assert!(matches!(
            p.register(usize::MAX as *mut u8, 10, Exposure::Local),
            Err(verbs::Error::InvalidArgument(_))
        ));
    }
    drop(v);
    check_accounting(&p);
}

#[test]
fn transient_registrations_evict_idle_chunks_for_room() {
    let p = pool(8, 1 << 20, 16 * K);
    drop(p.lease(8 * K).unwrap());
    drop(p.lease(0).unwrap());
    let keep = p.lease(0).unwrap(); // the 4 KiB hit; 8 KiB idle, 4 KiB leased
    let mut v = vec![0u8; 2 * 4096]; // spans 2 or 3 pages
                                     // SAFETY: `v` outlives `r`.
    let r = unsafe { p.register(v.as_mut_ptr(), v.len(), Exposure::Local) }.unwrap();
    let s = p.stats();
    assert_eq!(s.evictions, 1);
    assert!(s.pinned_bytes <= 16 * K, "{s:?}");
    // Now nothing is idle and the budget is full: refused.
    let mut w = vec![0u8; 8 * K];
    // SAFETY: `w` outlives the attempt.
    let e = unsafe { p.register(w.as_mut_ptr(), w.len(), Exposure::Local) }.unwrap_err();
    assert!(matches!(e, verbs::Error::Budget { .. }), "{e}");
    drop(r);
    drop(keep);
    check_accounting(&p);
}

#[test]
fn a_registration_keeps_an_evicted_chunk_registered_and_mapped() {
    let p = pool(0, 0, 1 << 20);
    let l = p.lease(0).unwrap();
    let r = Reg::Cached(l.chunk.clone());
    let a = addr(&l);
    drop(l); // idle limit 0: evicted at once, but `r` still holds it
    assert_eq!(found(&p, a, 1), None, "out of the table");
    assert_eq!(live(&p), 1, "still registered");
    assert_eq!(p.stats().pinned_bytes, 4 * K, "still pinned");
    // SAFETY: `r` keeps the chunk mapped.
    unsafe { ptr::read_volatile(r.addr() as *const u8) };
    drop(r);
    assert_eq!((live(&p), p.stats().pinned_bytes), (0, 0));
}

#[test]
fn a_failed_deregistration_leaks_the_chunk_instead_of_freeing_it() {
    let p = pool(0, 0, 1 << 20);
    let l = p.lease(0).unwrap();
    let a = addr(&l);
    // SAFETY: the lease owns the chunk.
    unsafe { (a as *mut u8).write(42) };
    fake(&p).fail_dereg.store(true, Ordering::SeqCst);
    drop(l);
    let s = p.stats();
    assert_eq!(
        (s.leaked_bytes, s.pinned_bytes, s.idle_chunks),
        (4 * K, 4 * K, 0)
    );
    // SAFETY: leaked, so still mapped (the point of the test).
    assert_eq!(unsafe { ptr::read_volatile(a as *const u8) }, 42);
    // The leaked bytes stay counted against the budget.
    fake(&p).fail_dereg.store(false, Ordering::SeqCst);
    check_accounting(&p);
}

#[test]
fn dropping_the_pool_deregisters_idle_chunks_and_leases_outlive_it() {
    let p = pool(8, 1 << 20, 1 << 20);
    let reg = {
        let q = p.clone();
        drop(q.lease(0).unwrap());
        q.lease(8 * K).unwrap()
    };
    let shared = p.shared.clone();
    drop(p);
    // The lease keeps the pool alive, so nothing was deregistered yet.
    assert_eq!(shared.registrar.live.lock().unwrap().len(), 2);
    drop(reg);
    assert_eq!(shared.registrar.live.lock().unwrap().len(), 0);
    assert_eq!(shared.pinned.load(Ordering::SeqCst), 0);
}

#[test]
fn concurrent_leases_finds_and_drops_keep_the_books_straight() {
    let p = pool(4, 64 * K, 256 * K);
    std::thread::scope(|s| {
        for t in 0..4usize {
            let p = &p;
            s.spawn(move || {
                let mut held = Vec::new();
                for i in 0..500usize {
                    let len = ((i * 7 + t * 13) % 5) * 3000;
                    match p.lease(len) {
                        Ok(l) => {
                            let a = addr(&l);
                            assert_eq!(found(p, a + 1, 10), Some(a));
                            // SAFETY: the lease owns the chunk.
                            unsafe { (a as *mut u8).write(t as u8) };
                            held.push(l);
                        }
                        Err(verbs::Error::Budget { .. }) => {}
                        Err(e) => panic!("{e}"),
                    }
                    if !held.is_empty() && (held.len() > 3 || i % 3 == 0) {
                        drop(held.swap_remove(i % held.len()));
                    }
                }
            });
        }
    });
    let s = p.stats();
    assert_eq!(s.leased_bytes, 0);
    assert!(s.idle_chunks <= 4 && s.idle_bytes <= 64 * K, "{s:?}");
    assert_eq!(live(&p), s.idle_chunks);
    check_accounting(&p);
}

// ---------------------------------------------------------------------------
// The model: a straightforward simulation of the documented rules.

#[derive(Debug, Clone)]
enum Op {
    Lease(usize),
    Drop(usize),
    Find {
        target: usize,
        offset: usize,
        len: usize,
    },
    Transient(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0usize..40_000).prop_map(Op::Lease),
        3 => any::<usize>().prop_map(Op::Drop),
        3 => (any::<usize>(), 0usize..40_000, 0usize..9000)
            .prop_map(|(target, offset, len)| Op::Find { target, offset, len }),
        1 => (1usize..30_000).prop_map(Op::Transient),
    ]
}

#[derive(Clone, Copy, Debug)]
struct ModelChunk {
    addr: usize,
    len: usize,
    keys: Keys,
}

#[derive(Default)]
struct Model {
    idle: Vec<ModelChunk>, // least recently used first
    hits: u64,
    misses: u64,
    evictions: u64,
}

impl Model {
    fn idle_bytes(&self) -> usize {
        self.idle.iter().map(|c| c.len).sum()
    }

    /// Evicts for room as the pool does; false if the budget still refuses.
    fn reserve(&mut self, n: usize, leased: usize, limits: &CacheLimits) -> bool {
        if n > limits.max_pinned_bytes {
            return false;
        }
        while leased + self.idle_bytes() + n > limits.max_pinned_bytes && !self.idle.is_empty() {
            self.idle.remove(0);
            self.evictions += 1;
        }
        leased + self.idle_bytes() + n <= limits.max_pinned_bytes
    }
}

fn limits() -> impl Strategy<Value = CacheLimits> {
    (
        0usize..5,
        prop_oneof![Just(0), Just(16 * K), Just(48 * K)],
        prop_oneof![Just(32 * K), Just(64 * K), Just(128 * K)],
    )
        .prop_map(|(c, b, p)| CacheLimits {
            max_idle_chunks: c,
            max_idle_bytes: b,
            max_pinned_bytes: p,
            ..CacheLimits::default()
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn random_sequences_match_the_model(limits in limits(), ops in proptest::collection::vec(op(), 1..80)) {
        let p = Pool::new(Fake::default(), limits);
        let mut m = Model::default();
        let mut leased: Vec<(ModelChunk, PoolLease<Fake>)> = Vec::new();
        let mut seen: Vec<usize> = Vec::new();
        for op in ops {
            let leased_bytes: usize = leased.iter().map(|(c, _)| c.len).sum();
            match op {
                Op::Lease(len) => {
                    let class = class_of(len).unwrap();
                    let got = p.lease(len);
                    if let Some(i) = m.idle.iter().rposition(|c| c.len == class) {
                        let want = m.idle.remove(i);
                        m.hits += 1;
                        let l = got.unwrap();
                        prop_assert_eq!((addr(&l), l.chunk.keys), (want.addr, want.keys));
                        leased.push((want, l));
                    } else if m.reserve(class, leased_bytes, &limits) {
                        let l = got.unwrap();
                        m.misses += 1;
                        let c = ModelChunk { addr: addr(&l), len: class, keys: l.chunk.keys };
                        prop_assert!(m.idle.iter().chain(leased.iter().map(|(c, _)| c)).all(|o| o.addr != c.addr));
                        seen.push(c.addr);
                        leased.push((c, l));
                    } else {
                        let refused = matches!(got, Err(verbs::Error::Budget { .. }));
                        prop_assert!(refused);
                    }
                }
                Op::Drop(i) if !leased.is_empty() => {
                    let (c, l) = leased.remove(i % leased.len());
                    drop(l);
                    m.idle.push(c);
                    while m.idle.len() > limits.max_idle_chunks || m.idle_bytes() > limits.max_idle_bytes {
                        m.idle.remove(0);
                        m.evictions += 1;
                    }
                }
                Op::Drop(_) => {}
                Op::Find { target, offset, len } if !seen.is_empty() => {
                    let start = seen[target % seen.len()] + offset;
                    let want = m.idle.iter().chain(leased.iter().map(|(c, _)| c))
                        .find(|c| start >= c.addr && start < c.addr + c.len && start + len <= c.addr + c.len)
                        .map(|c| (c.addr, c.keys));
                    let got = p.find(start as *const u8, len).map(|r| (r.addr(), r.keys()));
                    prop_assert_eq!(got, want);
                }
                Op::Find { .. } => {}
                Op::Transient(len) => {
                    let mut v = vec![0u8; len];
                    let pages = pages_spanned(v.as_ptr() as usize, len).unwrap();
                    // A Vec is never inside a chunk (chunks are our own mappings).
                    // SAFETY: `v` outlives the registration, dropped at the end of this arm.
                    let got = unsafe { p.register(v.as_mut_ptr(), len, Exposure::Local) };
                    if m.reserve(pages, leased_bytes, &limits) {
                        let r = got.unwrap();
                        prop_assert!(matches!(r, Reg::Transient(_)));
                        prop_assert!(p.find(v.as_ptr(), len).is_none());
                        prop_assert_eq!(p.stats().transient_bytes, pages);
                    } else {
                        let refused = matches!(got, Err(verbs::Error::Budget { .. }));
                        prop_assert!(refused);
                    }
                }
            }
            let s = p.stats();
            let leased_bytes: usize = leased.iter().map(|(c, _)| c.len).sum();
            prop_assert_eq!((s.hits, s.misses, s.evictions), (m.hits, m.misses, m.evictions));
            prop_assert_eq!((s.idle_chunks, s.idle_bytes), (m.idle.len(), m.idle_bytes()));
            prop_assert_eq!(s.leased_bytes, leased_bytes);
            prop_assert_eq!(s.transient_bytes, 0);
            prop_assert_eq!(s.pinned_bytes, leased_bytes + m.idle_bytes());
            prop_assert!(s.pinned_bytes <= limits.max_pinned_bytes);
            prop_assert_eq!(live(&p), m.idle.len() + leased.len());
        }
        drop(leased);
        prop_assert_eq!(live(&p), p.stats().idle_chunks);
    }
}
