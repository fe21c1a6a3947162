//! The registration cache's public face on a real device: leases and
//! buffers are registered, page-aligned chunks of their size class, zeroed
//! on every lease (a reused chunk never shows its last user's bytes), kept
//! idle within the limits, and refused with a typed error beyond the pinned
//! budget.
//!
//! The lookups and registrations that yield keys (`find`, `register`,
//! `grant_remote_write`, a lease's registration) are private to the crate
//! (issue 21): the tests that carry RDMA writes through them, including the
//! stale-registration stress, are unit tests now
//! (`ibvx/src/ibv/regcache/rxe_tests.rs`, run with the lib's `ibv::` tests).
//!
//! Needs an RDMA device (soft-RoCE is enough; see ci/softroce-vm.sh).
//! Without one each test prints "skipped: ..." and returns, unless
//! `IBVX_REQUIRE_RDMA=1`, which makes that a failure (see `common` for the
//! environment).
#![cfg(feature = "ibv")]

mod common;

use common::open;
use ibvx::ibv::{CacheLimits, CacheStats, Lease, RegistrationCache};
use ibvx::verbs::*;

fn bytes(l: &Lease, len: usize) -> &[u8] {
    // SAFETY: the lease owns the chunk (at least `len` bytes here) and no
    // work request uses it: nothing outside the crate can post one into it.
    unsafe { std::slice::from_raw_parts(l.as_ptr(), len) }
}

fn check_books(s: CacheStats) {
    assert_eq!(
        s.pinned_bytes,
        s.leased_bytes + s.idle_bytes + s.transient_bytes + s.leaked_bytes,
        "{s:?}"
    );
    assert_eq!(s.leaked_bytes, 0, "{s:?}");
}

#[test]
fn leases_and_buffers_are_registered_zeroed_chunks() {
    let Some(ctx) = open() else { return };
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let cache = RegistrationCache::new(&pd, Access::LOCAL_WRITE, CacheLimits::default());
    assert_eq!(cache.limits(), CacheLimits::default());

    // A lease: a registered, zeroed, page-aligned chunk of its size class.
    let mut src = cache.lease(100).unwrap();
    assert_eq!(src.len(), 4096);
    assert!(!src.is_empty());
    assert_eq!(src.as_ptr() as usize % 4096, 0);
    assert!(bytes(&src, 4096).iter().all(|&b| b == 0));

    // A buffer: exactly `len` bytes, its storage is the lease.
    let mut buf = cache.buffer(5000).unwrap();
    assert_eq!(buf.len(), 5000);
    let lease = buf.storage().unwrap().downcast_ref::<Lease>().unwrap();
    assert_eq!(lease.len(), 8192);
    buf.fill(0x33);
    let s = cache.stats();
    assert_eq!((s.misses, s.leased_bytes), (2, 4096 + 8192));

    // Dropped leases go idle, still registered: the next lease of the class
    // is a hit on the same chunk, zeroed again.
    // SAFETY: the lease owns the chunk; nothing else uses it.
    unsafe { std::ptr::write_bytes(src.as_mut_ptr(), 0xa5, 4096) };
    let addr = src.as_ptr();
    drop(src);
    let again = cache.lease(1).unwrap();
    assert_eq!(again.as_ptr(), addr);
    assert!(bytes(&again, 4096).iter().all(|&b| b == 0), "zeroed again");
    let s = cache.stats();
    assert_eq!((s.hits, s.idle_chunks), (1, 0), "{s:?}");

    // The budget refuses with a typed error.
    let small = RegistrationCache::new(
        &pd,
        Access::LOCAL_WRITE,
        CacheLimits {
            max_pinned_bytes: 8192,
            ..CacheLimits::default()
        },
    );
    let _a = small.lease(8192).unwrap();
    let e = small.lease(1).unwrap_err();
    assert!(matches!(e, Error::Budget { .. }), "{e}");
    println!("{e}");
    drop((buf, again));
    check_books(cache.stats());
}

/// A small deterministic generator (no dependency needed).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

#[test]
fn reused_chunks_never_show_their_last_users_bytes() {
    let Some(ctx) = open() else { return };
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let limits = CacheLimits {
        max_idle_chunks: 6,
        max_idle_bytes: 1 << 20,
        max_pinned_bytes: 64 << 20,
        ..CacheLimits::default()
    };
    let cache = RegistrationCache::new(&pd, Access::LOCAL_WRITE, limits);
    let mut rng = Lcg(0x1234_5678);
    const N: usize = 200;
    for i in 0..N {
        let len = 1usize << (12 + rng.next() % 7); // 4 KiB .. 256 KiB
        let mut buf = cache.buffer(len).unwrap();
        assert!(buf.iter().all(|&b| b == 0), "iteration {i}: stale bytes");
        for (j, b) in buf.iter_mut().enumerate() {
            *b = (i * 31 + j * 7) as u8 | 1;
        }
        drop(buf);
        let s = cache.stats();
        assert!(
            s.idle_chunks <= limits.max_idle_chunks && s.idle_bytes <= limits.max_idle_bytes,
            "{s:?}"
        );
    }
    let s = cache.stats();
    println!("{N} iterations: {s:?}");
    assert_eq!(s.hits + s.misses, N as u64);
    assert!(s.hits > 0, "{s:?}");
    assert_eq!(s.leased_bytes, 0);
    check_books(s);
}
