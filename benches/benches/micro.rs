//! Criterion micro-benchmarks of the pieces on every message's path: the
//! matching engine with short and long queues, the eager ring (enqueue,
//! dequeue), and the decoders of what peers send (the shm device's bootstrap
//! record, a bootstrap frame). Run with `cargo bench -p xdev-bench`.
//!
//! The registration cache has its own benchmark (`benches/regcache.rs`): it
//! needs an RDMA device.

// criterion's macros generate undocumented public functions.
#![allow(missing_docs)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use shm_ipc::process::PeerInfo;
use shm_ipc::ring::{Consumer, Header, HeapRing, Producer};
use xdev::devkit::matching::{Delivered, MatchingEngine};
use xdev::devkit::wire::{decode, encode, Message};
use xdev::{Envelope, Pattern, Source, TagSel};

/// Deliver one message against `depth` posted receives where only the last
/// posted one matches (a long posted queue), then post it again.
fn matching_posted(c: &mut Criterion) {
    let mut g = c.benchmark_group("matching/posted_queue");
    for depth in [1usize, 16, 1024] {
        let mut m: MatchingEngine<u64, u64> = MatchingEngine::new();
        for t in 0..depth as i32 {
            let _ = m.post(Pattern::new(Source::Rank(1), TagSel::Tag(t), 7), t as u64);
        }
        let last = depth as i32 - 1;
        let env = Envelope {
            source: 1,
            tag: last,
            context: 7,
        };
        g.bench_with_input(BenchmarkId::from_parameter(depth), &depth, |b, _| {
            b.iter(|| {
                match m.deliver(black_box(env), 0) {
                    Delivered::Matched { recv, .. } => black_box(recv),
                    _ => panic!("no match"),
                };
                let _ = m.post(Pattern::new(Source::Rank(1), TagSel::Tag(last), 7), 0);
            })
        });
    }
    g.finish();
}

/// osu_bibw's receive side: post a window of 64 receives from one source,
/// then deliver its 64 messages in order (each matches the head of its
/// source's queue). Reported per window.
fn matching_window(c: &mut Criterion) {
    let mut g = c.benchmark_group("matching/posted_window");
    let mut m: MatchingEngine<u64, u64> = MatchingEngine::new();
    let env = Envelope {
        source: 1,
        tag: 4,
        context: 7,
    };
    let pattern = Pattern::new(Source::Rank(1), TagSel::Tag(4), 7);
    g.bench_function("64", |b| {
        b.iter(|| {
            for i in 0..64u64 {
                let _ = m.post(black_box(pattern), i);
            }
            for _ in 0..64 {
                match m.take_posted(black_box(&env)) {
                    Some(recv) => black_box(recv),
                    None => panic!("no match"),
                };
            }
        })
    });
    g.finish();
}

/// Take the newest of `depth` unexpected messages with an ANY_SOURCE receive
/// (a long unexpected queue), then queue it again.
fn matching_unexpected(c: &mut Criterion) {
    let mut g = c.benchmark_group("matching/unexpected_queue");
    for depth in [1usize, 16, 1024] {
        let mut m: MatchingEngine<u64, u64> = MatchingEngine::new();
        for t in 0..depth as i32 {
            let env = Envelope {
                source: (t % 4) as usize,
                tag: t,
                context: 7,
            };
            m.push_unexpected(env, t as u64);
        }
        let last = depth as i32 - 1;
        let pattern = Pattern::new(Source::Any, TagSel::Tag(last), 7);
        g.bench_with_input(BenchmarkId::from_parameter(depth), &depth, |b, _| {
            b.iter(|| {
                let (env, msg) = m.take(black_box(&pattern)).expect("queued");
                m.push_unexpected(env, msg);
            })
        });
    }
    g.finish();
}

/// One message through a ring in one thread: push, peek, copy out, pop.
fn ring(c: &mut Criterion) {
    let mut g = c.benchmark_group("ring/enqueue_dequeue");
    let ring = HeapRing::new(1024);
    // SAFETY: the ring outlives both ends (dropped at the end of this
    // function) and each end is the only one of its kind.
    let (mut p, mut q) = unsafe { (Producer::new(ring.view()), Consumer::new(ring.view())) };
    for len in [8usize, 24, 256, 4096] {
        let payload = vec![7u8; len];
        let mut out = vec![0u8; len];
        let h = Header {
            kind: 1,
            tag: 3,
            context: 7,
            ..Header::default()
        };
        g.bench_with_input(BenchmarkId::from_parameter(len), &len, |b, _| {
            b.iter(|| {
                assert!(p.try_push(&h, black_box(&payload)).unwrap());
                let msg = q.peek().unwrap().unwrap();
                q.copy_payload(&msg, &mut out);
                q.pop(&msg);
                black_box(&out);
            })
        });
    }
    g.finish();
    // The ends are plain views: the ring is freed only after them.
    let _ = (p, q);
    drop(ring);
}

/// Encode and decode what peers exchange at start-up and in the bootstrap.
fn headers(c: &mut Criterion) {
    let info = PeerInfo {
        pid: 4242,
        nslots: 1024,
        credit_bytes: 1 << 18,
        probe_addr: 0x7fff_0000_1000,
        probe_value: 0x1234_5678,
        segment: "/xdev-job-1-0123456789abcdef0123456789abcdef".into(),
    };
    let bytes = info.encode();
    c.bench_function("headers/peer_info_encode", |b| {
        b.iter(|| black_box(&info).encode())
    });
    c.bench_function("headers/peer_info_decode", |b| {
        b.iter(|| PeerInfo::decode(black_box(&bytes)).unwrap())
    });
    let put = Message::Put {
        id: 9,
        key: "segment/3".into(),
        value: vec![1u8; 64],
    };
    let frame = encode(&put).unwrap();
    c.bench_function("headers/bootstrap_put_encode", |b| {
        b.iter(|| encode(black_box(&put)).unwrap())
    });
    c.bench_function("headers/bootstrap_put_decode", |b| {
        b.iter(|| decode(black_box(&frame[4..]), 1).unwrap())
    });
}

criterion_group!(
    benches,
    matching_posted,
    matching_window,
    matching_unexpected,
    ring,
    headers
);
criterion_main!(benches);
