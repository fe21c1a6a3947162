//! The registration cache on a real device: leases, lookups and transient
//! registrations really register (their keys carry RDMA writes between two
//! RC QPs of one device), and a stress loop shows that no stale
//! registration is ever returned (leased chunks are reused with their
//! registration, foreign memory freed and reallocated at the same address
//! is registered afresh each time).
//!
//! Unit tests (the lookups and registrations are private to the crate);
//! they were `tests/regcache_rxe.rs`. Need an RDMA device (soft-RoCE is
//! enough; see ci/softroce-vm.sh). Without one each test prints
//! "skipped: ..." and returns, unless `IBVX_REQUIRE_RDMA=1`, which makes
//! that a failure. `RXE_DEVICE` picks the device (default: the first),
//! `RXE_GID_INDEX` the GID (default: the layer's choice).

use std::time::{Duration, Instant};

use super::{CacheLimits, Lease, Registration, RegistrationCache};
use crate::verbs::*;

const TIMEOUT: Duration = Duration::from_secs(20);
/// The device port the tests use.
const PORT: u8 = 1;

fn access() -> Access {
    Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ
}

/// The device to test on, or `None` (after printing why the test is
/// skipped) when there is none or libibverbs is missing.
fn open() -> Option<Context> {
    match Context::open(std::env::var("RXE_DEVICE").ok().as_deref()) {
        Ok(c) => Some(c),
        Err(e @ (Error::NoDevice { .. } | Error::Unavailable(_))) => {
            if std::env::var("IBVX_REQUIRE_RDMA").as_deref() == Ok("1") {
                panic!("IBVX_REQUIRE_RDMA=1 but: {e}");
            }
            println!("skipped: no RDMA device (runs in ci/vm-suite.sh) [{e}]");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

/// Two RC QPs of one device connected to each other; `a` writes into `b`.
struct Pair {
    a: QueuePair,
    _b: QueuePair,
    cq_a: CompletionQueue,
}

fn pair(ctx: &Context, pd: &ProtectionDomain) -> Pair {
    let gid_index = std::env::var("RXE_GID_INDEX")
        .ok()
        .map(|v| v.parse().expect("RXE_GID_INDEX"));
    let local = ctx.port_address(PORT, gid_index).unwrap();
    let cq_a = CompletionQueue::new(ctx, 16, None).unwrap();
    let cq_b = CompletionQueue::new(ctx, 16, None).unwrap();
    let a = QueuePair::new_rc(pd, &cq_a, &cq_a, QpCaps::default(), false).unwrap();
    let b = QueuePair::new_rc(pd, &cq_b, &cq_b, QpCaps::default(), false).unwrap();
    for qp in [&a, &b] {
        qp.modify_to_init(&InitAttr {
            port: PORT,
            ..InitAttr::default()
        })
        .unwrap();
    }
    let gid = local.gid.map(|(_, g)| g);
    let remote = |qp: &QueuePair, psn| RemoteQp {
        qpn: qp.qp_num(),
        psn,
        lid: local.lid,
        gid,
    };
    a.connect(&local, &remote(&b, 0x200), local.active_mtu, 0x100)
        .unwrap();
    b.connect(&local, &remote(&a, 0x100), local.active_mtu, 0x200)
        .unwrap();
    Pair { a, _b: b, cq_a }
}

/// RDMA-writes `[src, src + len)` (registered by `sreg`) to `dst` (in
/// `dreg`) and waits for the completion.
fn rdma_write(
    p: &Pair,
    sreg: &Registration,
    src: *const u8,
    dreg: &Registration,
    dst: *const u8,
    len: usize,
) {
    // SAFETY: every caller holds the source and the destination (leases,
    // buffers or `Vec`s of the test, registered by `sreg` and `dreg`) and
    // touches neither until this returns, after the write's completion was
    // polled; `dreg` grants remote write (the test's cache is made with
    // `access()`), and the write stays inside it (`remote` checks the
    // start, the caller the length).
    unsafe {
        p.a.post_send(&SendRequest {
            wr_id: 7,
            op: SendOp::RdmaWrite(dreg.remote(dst)),
            sges: &[sreg.sge(src, len)],
            flags: SendFlags::SIGNALED,
        })
    }
    .unwrap();
    let deadline = Instant::now() + TIMEOUT;
    let mut wcs = [WorkCompletion::default(); 1];
    while p.cq_a.poll(&mut wcs).unwrap() == 0 {
        assert!(Instant::now() < deadline, "no completion for the write");
    }
    wcs[0].ok().unwrap();
}

fn bytes(l: &Lease, len: usize) -> &[u8] {
    // SAFETY: the lease owns the chunk; the RDMA write into it completed
    // before this is called, and no other request is outstanding.
    unsafe { std::slice::from_raw_parts(l.as_ptr(), len) }
}

fn check_books(cache: &RegistrationCache) {
    let s = cache.stats();
    assert_eq!(
        s.pinned_bytes,
        s.leased_bytes + s.idle_bytes + s.transient_bytes + s.leaked_bytes,
        "{s:?}"
    );
    assert_eq!(s.leaked_bytes, 0, "{s:?}");
}

#[test]
fn leases_finds_and_transient_registrations_really_register() {
    let Some(ctx) = open() else { return };
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let cache = RegistrationCache::new(&pd, access(), CacheLimits::default());
    let p = pair(&ctx, &pd);

    // A lease: a registered, zeroed, page-aligned chunk.
    let src = cache.lease(100).unwrap();
    assert_eq!(src.len(), 4096);
    assert_eq!(src.as_ptr() as usize % 4096, 0);
    assert!(bytes(&src, 4096).iter().all(|&b| b == 0));
    let sreg = src.registration();
    assert!(sreg.is_cached());
    let hit = cache.find(src.as_ptr().wrapping_add(10), 50).unwrap();
    assert_eq!((hit.lkey(), hit.rkey()), (sreg.lkey(), sreg.rkey()));

    // A buffer: exactly `len` bytes, its storage is the lease.
    let mut buf = cache.buffer(5000).unwrap();
    assert_eq!(buf.len(), 5000);
    let lease = buf.storage().unwrap().downcast_ref::<Lease>().unwrap();
    assert_eq!(lease.len(), 8192);
    let dreg = lease.registration();
    buf.fill(0);
    let s = cache.stats();
    assert_eq!((s.misses, s.leased_bytes), (2, 4096 + 8192));

    // Chunk -> chunk through the cache's keys.
    let mut src = src;
    // SAFETY: the lease owns the chunk; nothing is outstanding.
    unsafe { std::ptr::copy_nonoverlapping(b"cached".as_ptr(), src.as_mut_ptr(), 6) };
    rdma_write(&p, &sreg, src.as_ptr(), &dreg, buf.as_ptr(), 6);
    assert_eq!(&buf[..6], b"cached");

    // Foreign memory -> chunk through a transient registration.
    let mut v = vec![0x5au8; 3000];
    // SAFETY: `v` outlives `treg`.
    let treg = unsafe { cache.register(v.as_mut_ptr(), v.len()) }.unwrap();
    assert!(!treg.is_cached());
    assert!(cache.find(v.as_ptr(), 1).is_none(), "never cached");
    rdma_write(
        &p,
        &treg,
        v.as_ptr(),
        &dreg,
        buf.as_ptr().wrapping_add(100),
        3000,
    );
    assert!(buf[100..3100].iter().all(|&b| b == 0x5a));
    let s = cache.stats();
    assert_eq!(s.transient, 1);
    assert!(s.transient_bytes >= 4096, "{s:?}");
    drop(treg);
    assert_eq!(cache.stats().transient_bytes, 0, "deregistered on drop");
    drop(v);

    // A range inside a leased chunk is a hit without a new registration.
    // SAFETY: the chunk stays leased (mapped) while `inner` lives.
    let inner = unsafe { cache.register(buf.as_mut_ptr().wrapping_add(8), 16) }.unwrap();
    assert!(inner.is_cached());
    assert_eq!(inner.lkey(), dreg.lkey());
    assert_eq!(cache.stats().transient, 1);

    // Dropped leases go idle, still registered: the next lease is a hit
    // with the same keys.
    let (addr, lkey) = (src.as_ptr(), sreg.lkey());
    drop(src);
    drop(sreg);
    let again = cache.lease(1).unwrap();
    assert_eq!((again.as_ptr(), again.registration().lkey()), (addr, lkey));
    assert!(bytes(&again, 4096).iter().all(|&b| b == 0), "zeroed again");
    assert_eq!(cache.stats().hits, 1);

    the_budget_refuses_with_a_typed_error(&pd);
    drop((inner, dreg, buf, again));
    check_books(&cache);
}

/// A second cache on `pd` with room for one 8 KiB chunk refuses the next
/// lease with [`Error::Budget`].
fn the_budget_refuses_with_a_typed_error(pd: &ProtectionDomain) {
    let small = RegistrationCache::new(
        pd,
        access(),
        CacheLimits {
            max_pinned_bytes: 8192,
            ..CacheLimits::default()
        },
    );
    let _a = small.lease(8192).unwrap();
    let e = small.lease(1).unwrap_err();
    assert!(matches!(e, Error::Budget { .. }), "{e}");
    println!("{e}");
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
fn no_stale_registration_under_reuse() {
    let Some(ctx) = open() else { return };
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let limits = CacheLimits {
        max_idle_chunks: 6,
        max_idle_bytes: 1 << 20,
        max_pinned_bytes: 64 << 20,
        ..CacheLimits::default()
    };
    let cache = RegistrationCache::new(&pd, access(), limits);
    let p = pair(&ctx, &pd);
    let dst = cache.lease(1 << 20).unwrap();
    let dreg = dst.registration();
    let mut rng = Lcg(0x1234_5678);
    let mut foreign_addrs = std::collections::HashSet::new();
    const N: usize = 200;

    for i in 0..N {
        // A leased chunk of a random size class, filled with this
        // iteration's pattern.
        let len = 1usize << (12 + rng.next() % 7); // 4 KiB .. 256 KiB
        write_from_a_cached_chunk(&cache, &p, &dst, &dreg, i, len);
        // Foreign memory: a 1 MiB Vec (glibc mmaps the first; after a free
        // it may raise its mmap threshold and use the heap; either way the
        // next one usually lands at the same address). Each time it is registered
        // afresh, and once dropped, find() never returns it.
        let addr = write_from_foreign_memory(&cache, &p, &dst, &dreg, i, &mut rng);
        foreign_addrs.insert(addr);
    }
    let s = cache.stats();
    println!(
        "{N} iterations: {s:?}; the 1 MiB Vec landed at {} distinct addresses",
        foreign_addrs.len()
    );
    assert_eq!(s.transient, N as u64);
    assert_eq!(s.hits + s.misses, N as u64 + 1);
    assert!(s.hits > 0, "{s:?}");
    assert!(s.idle_chunks <= limits.max_idle_chunks && s.idle_bytes <= limits.max_idle_bytes);
    assert_eq!(s.leased_bytes, 1 << 20);
    check_books(&cache);
    drop((dreg, dst));
    assert_eq!(cache.stats().leased_bytes, 0);
    check_books(&cache);
}

/// Bytes of each RDMA write that `no_stale_registration_under_reuse` checks.
const CHECK: usize = 64 << 10;

/// Leases a `len`-byte chunk filled with iteration `i`'s pattern: find()
/// must hit with the chunk's own keys, and an RDMA write through them must
/// carry this pattern.
fn write_from_a_cached_chunk(
    cache: &RegistrationCache,
    p: &Pair,
    dst: &Lease,
    dreg: &Registration,
    i: usize,
    len: usize,
) {
    let mut buf = cache.buffer(len).unwrap();
    let pat = |j: usize| (i * 31 + j * 7) as u8;
    for (j, b) in buf.iter_mut().enumerate() {
        *b = pat(j);
    }
    let reg = buf
        .storage()
        .unwrap()
        .downcast_ref::<Lease>()
        .unwrap()
        .registration();
    let hit = cache
        .find(buf.as_ptr(), len)
        .expect("a leased chunk is found");
    assert!(hit.is_cached());
    assert_eq!((hit.lkey(), hit.rkey()), (reg.lkey(), reg.rkey()));
    let n = len.min(CHECK);
    rdma_write(p, &hit, buf.as_ptr(), dreg, dst.as_ptr(), n);
    let got = bytes(dst, n);
    assert!(
        got.iter().enumerate().all(|(j, &b)| b == pat(j)),
        "iteration {i}: stale data from a cached chunk"
    );
    drop((hit, reg, buf));
}

/// Registers a fresh 1 MiB Vec (transiently), RDMA-writes a random part of
/// it and checks it arrived and that find() never returns it; its address.
fn write_from_foreign_memory(
    cache: &RegistrationCache,
    p: &Pair,
    dst: &Lease,
    dreg: &Registration,
    i: usize,
    rng: &mut Lcg,
) -> usize {
    let mut v: Vec<u8> = (0..1usize << 20).map(|j| (i * 13 + j * 3) as u8).collect();
    let addr = v.as_ptr() as usize;
    assert!(cache.find(v.as_ptr(), 1).is_none());
    // SAFETY: `v` outlives `treg`.
    let treg = unsafe { cache.register(v.as_mut_ptr(), v.len()) }.unwrap();
    assert!(!treg.is_cached());
    let off = (rng.next() as usize % ((1 << 20) - CHECK)) & !7;
    rdma_write(
        p,
        &treg,
        v.as_ptr().wrapping_add(off),
        dreg,
        dst.as_ptr(),
        CHECK,
    );
    assert!(
        bytes(dst, CHECK) == &v[off..off + CHECK],
        "iteration {i}: stale data from foreign memory"
    );
    drop(treg);
    let s = cache.stats();
    assert_eq!(s.transient_bytes, 0, "{s:?}");
    assert!(
        cache.find(v.as_ptr(), 1).is_none(),
        "a dropped transient is not cached"
    );
    drop(v);
    addr
}
