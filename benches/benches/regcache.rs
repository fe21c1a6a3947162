//! Criterion benchmarks of the registration cache (`ibvx::ibv::regcache`):
//! a hit (`find` of a leased 64 KiB or 4 MiB chunk; `lease` + drop of an
//! idle chunk, which includes zeroing it) against a miss (`register` of a
//! `Vec`'s memory: `ibv_reg_mr` + `ibv_dereg_mr`).
//!
//! Needs an RDMA device (soft-RoCE is enough). Without one it prints
//! `skipped: no RDMA device (...)` and exits 0. Run with
//! `cargo bench -p xdev-bench --bench regcache`; `RXE_DEVICE` picks a device
//! (default: the first).

// Benchmark binaries have no public API to document.
#![allow(missing_docs)]

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput};
use ibvx::ibv::regcache::{CacheLimits, RegistrationCache};
use ibvx::verbs::{Access, Context, ProtectionDomain};

const SIZES: [(usize, &str); 2] = [(64 << 10, "64KiB"), (4 << 20, "4MiB")];

fn hits(c: &mut Criterion, cache: &RegistrationCache) {
    let mut g = c.benchmark_group("regcache/hit_find");
    for (len, name) in SIZES {
        let buf = cache.buffer(len).expect("lease");
        let ptr = buf.as_ptr();
        g.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| black_box(cache.find(black_box(ptr), black_box(len))).is_some())
        });
    }
    g.finish();

    let mut g = c.benchmark_group("regcache/hit_lease_drop");
    for (len, name) in [(4 << 10, "4KiB"), (64 << 10, "64KiB")] {
        drop(cache.lease(len).expect("lease")); // one idle chunk of the class
        g.throughput(Throughput::Bytes(len as u64));
        g.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| drop(black_box(cache.lease(black_box(len)).expect("lease"))))
        });
    }
    g.finish();
}

fn misses(c: &mut Criterion, cache: &RegistrationCache) {
    let mut g = c.benchmark_group("regcache/miss_register");
    for (len, name) in SIZES {
        let mut v = vec![1u8; len];
        let ptr = v.as_mut_ptr();
        g.throughput(Throughput::Bytes(len as u64));
        g.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| {
                // SAFETY: `v` outlives the registration, dropped at once.
                let r = unsafe { cache.register(black_box(ptr), len) }.expect("register");
                assert!(!r.is_cached());
                drop(black_box(r));
            })
        });
        drop(v);
    }
    g.finish();
}

fn main() {
    let ctx = match Context::open(std::env::var("RXE_DEVICE").ok().as_deref()) {
        Ok(ctx) => ctx,
        Err(e) => {
            println!("skipped: no RDMA device ({e})");
            return;
        }
    };
    let pd = ProtectionDomain::new(&ctx).expect("ibv_alloc_pd");
    let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    let cache = RegistrationCache::new(&pd, access, CacheLimits::default());
    let mut c = Criterion::default().configure_from_args();
    hits(&mut c, &cache);
    misses(&mut c, &cache);
    c.final_summary();
    println!("{:?}", cache.stats());
}
