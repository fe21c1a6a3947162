//! Criterion benchmarks of the registration cache
//! (`ibvx::ibv::RegistrationCache`), through its public face: a hit (a
//! `lease` and drop of an idle chunk, which includes zeroing it) against a
//! miss (the same with no idle chunk kept: `mmap`, `ibv_reg_mr`, then
//! `ibv_dereg_mr`, `munmap`).
//!
//! The lookups and transient registrations (`find`, `register`) are private
//! to ibvx since issue 21 (they hand out keys of memory that may be leased
//! to someone else), so they are no longer benchmarked from here.
//!
//! Needs an RDMA device (soft-RoCE is enough). Without one it prints
//! `skipped: no RDMA device (...)` and exits 0. Run with
//! `cargo bench -p xdev-bench --bench regcache`; `RXE_DEVICE` picks a device
//! (default: the first).

// Benchmark binaries have no public API to document.
#![allow(missing_docs)]

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput};
use ibvx::ibv::{CacheLimits, RegistrationCache};
use ibvx::verbs::{Access, Context, ProtectionDomain};

const SIZES: [(usize, &str); 3] = [(4 << 10, "4KiB"), (64 << 10, "64KiB"), (4 << 20, "4MiB")];

fn lease_drop(c: &mut Criterion, group: &str, cache: &RegistrationCache) {
    let mut g = c.benchmark_group(group);
    for (len, name) in SIZES {
        drop(cache.lease(len).expect("lease")); // an idle chunk of the class, if kept
        g.throughput(Throughput::Bytes(len as u64));
        g.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| drop(black_box(cache.lease(black_box(len)).expect("lease"))))
        });
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
    // What the ibv device uses: chunks for local access only.
    let access = Access::LOCAL_WRITE;
    let cache = RegistrationCache::new(&pd, access, CacheLimits::default());
    let uncached = RegistrationCache::new(
        &pd,
        access,
        CacheLimits {
            max_idle_chunks: 0,
            ..CacheLimits::default()
        },
    );
    let mut c = Criterion::default().configure_from_args();
    lease_drop(&mut c, "regcache/hit_lease_drop", &cache);
    lease_drop(&mut c, "regcache/miss_lease_drop", &uncached);
    c.final_summary();
    println!("cached: {:?}", cache.stats());
    println!("uncached: {:?}", uncached.stats());
}
