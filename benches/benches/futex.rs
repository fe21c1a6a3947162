#![allow(missing_docs)]
//! The doorbell's futex wake with no sleeper (what a publisher pays when a
//! peer is armed but already awake) through `rustix`, as shm-ipc now calls
//! it, against the `libc::syscall(SYS_futex, ...)` it replaced.

use std::hint::black_box;
use std::sync::atomic::AtomicU32;

use criterion::{criterion_group, criterion_main, Criterion};

fn futex(c: &mut Criterion) {
    let word = AtomicU32::new(0);
    let mut g = c.benchmark_group("futex_wake_private");
    g.bench_function("libc_syscall", |b| {
        b.iter(|| {
            // SAFETY: `word` is a live, aligned 32-bit atomic; FUTEX_WAKE
            // only uses its address as a key.
            black_box(unsafe {
                libc::syscall(
                    libc::SYS_futex,
                    word.as_ptr(),
                    libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
                    1,
                )
            })
        })
    });
    g.bench_function("rustix", |b| {
        b.iter(|| {
            black_box(rustix::thread::futex::wake(
                &word,
                rustix::thread::futex::Flags::PRIVATE,
                1,
            ))
        })
    });
    g.bench_function("shm_ipc_futex_wake", |b| {
        b.iter(|| shm_ipc::futex::wake(&word, 1, shm_ipc::futex::Scope::Private))
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(std::time::Duration::from_millis(500))
        .measurement_time(std::time::Duration::from_secs(2));
    targets = futex
}
criterion_main!(benches);
