#![allow(missing_docs)]

//! The Fx hash of `rustc-hash` against the copy `xdev::matching` carried
//! before (kept here as the baseline): the per-message maps of the engines
//! (request ids to sends in flight, contexts to queues), insert, look-up and
//! remove of 64 live keys, as a stream of messages does.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};

/// The copy xdev held until it took `rustc-hash` (rustc's Fx hash before
/// rustc-hash 2: one rotate, xor and multiply per word).
#[derive(Default, Clone, Copy)]
struct CopiedFx {
    hash: u64,
}

impl CopiedFx {
    const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;
    #[inline]
    fn add(&mut self, word: u64) {
        self.hash = (self.hash.rotate_left(5) ^ word).wrapping_mul(Self::SEED);
    }
}

impl Hasher for CopiedFx {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
    }
    #[inline]
    fn write_u32(&mut self, n: u32) {
        self.add(n.into());
    }
    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }
    #[inline]
    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }
    #[inline]
    fn finish(&self) -> u64 {
        self.hash.rotate_left(26)
    }
}

type Copied<K, V> = HashMap<K, V, BuildHasherDefault<CopiedFx>>;
type Crate<K, V> = rustc_hash::FxHashMap<K, V>;

/// 64 sends in flight by request id (sequential ids, as the engines make
/// them): each message inserts the next id and removes the oldest.
fn window<M: Default + MapOps<u64>>(m: &mut M, next: &mut u64) {
    for _ in 0..64 {
        m.put(*next);
        black_box(m.has(*next - 32));
        m.take(*next - 64);
        *next += 1;
    }
}

/// Look-ups by (context, source) pair, as a per-context queue map is read.
fn pairs<M: Default + MapOps<(u32, usize)>>(m: &M) -> usize {
    let mut hits = 0;
    for c in 0..8u32 {
        for s in 0..16usize {
            hits += usize::from(m.has((c, s)));
        }
    }
    hits
}

trait MapOps<K> {
    fn put(&mut self, k: K);
    fn has(&self, k: K) -> bool;
    fn take(&mut self, k: K);
}

macro_rules! ops {
    ($t:ident) => {
        impl<K: std::hash::Hash + Eq> MapOps<K> for $t<K, u64> {
            fn put(&mut self, k: K) {
                self.insert(k, 1);
            }
            fn has(&self, k: K) -> bool {
                self.contains_key(&k)
            }
            fn take(&mut self, k: K) {
                self.remove(&k);
            }
        }
    };
}
ops!(Copied);
ops!(Crate);

fn hasher(c: &mut Criterion) {
    let mut g = c.benchmark_group("fxhash");
    g.bench_function("u64_window/copied", |b| {
        let mut m = Copied::<u64, u64>::default();
        let mut next = 64;
        b.iter(|| window(&mut m, &mut next))
    });
    g.bench_function("u64_window/rustc-hash", |b| {
        let mut m = Crate::<u64, u64>::default();
        let mut next = 64;
        b.iter(|| window(&mut m, &mut next))
    });
    let mut copied = Copied::<(u32, usize), u64>::default();
    let mut krate = Crate::<(u32, usize), u64>::default();
    for c in 0..8u32 {
        for s in (0..16usize).step_by(2) {
            copied.put((c, s));
            krate.put((c, s));
        }
    }
    g.bench_function("pair_lookup/copied", |b| b.iter(|| pairs(&copied)));
    g.bench_function("pair_lookup/rustc-hash", |b| b.iter(|| pairs(&krate)));
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(std::time::Duration::from_millis(500))
        .measurement_time(std::time::Duration::from_secs(2));
    targets = hasher
}
criterion_main!(benches);
