//! Loom model of the ring's memory orderings (`shm_ipc::ring`).
//!
//! Run with
//! `RUSTFLAGS="--cfg loom" cargo test -p shm-ipc --release --test ring_loom`
//! (use a separate `CARGO_TARGET_DIR`: the cfg rebuilds everything). The
//! preemption bound defaults to 3; `LOOM_MAX_PREEMPTIONS` overrides it.
//!
//! In this build the ring's shared words (`tail`, `waiting`, the slots' `seq`)
//! are loom atomics in a side table and every access to a slot's plain bytes
//! is recorded on a loom cell (see the `shadow` module of `ring.rs`); the
//! push/peek/copy/pop code under test is the real one.

#![cfg(loom)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use loom::thread;
use shm_ipc::ring::{self, Consumer, Header, HeapRing, Producer, INLINE, SLOT};

/// Runs `f` under loom with the preemption bound defaulting to 3, and says
/// how many executions loom explored.
fn model(name: &str, f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    if b.preemption_bound.is_none() {
        b.preemption_bound = Some(3);
    }
    let runs = Arc::new(AtomicUsize::new(0));
    let count = runs.clone();
    b.check(move || {
        count.fetch_add(1, Ordering::Relaxed);
        f();
    });
    println!(
        "{name}: {} executions (preemption bound {:?})",
        runs.load(Ordering::Relaxed),
        b.preemption_bound
    );
}

/// Payload lengths of the model's messages in an 8-slot ring: a short one
/// (slot 0); a long one of four slots after a padding entry (padding at 1,
/// the message at 2-5); a long one of four slots again (6-9), which wraps
/// to slots 0-1 and needs the consumer to have freed the first two messages
/// (the ring-full path).
const LENS: [usize; 3] = [10, INLINE + SLOT - 10, INLINE + 26];

fn message(i: usize) -> (Header, Vec<u8>) {
    let len = LENS[i];
    let header = Header {
        kind: 1 + i as u8,
        flags: 0x80 | i as u8,
        tag: -(i as i32) - 1,
        context: 0xC0_0000 + i as u32,
        len: len as u32,
        // The first short (no cookie, aux its length), the others long.
        cookie: if i == 0 { 0 } else { 0xDEAD_0000 + i as u64 },
        aux: len as u64,
    };
    // Every byte tells its message and position apart.
    let payload = (0..len)
        .map(|j| (j as u8).wrapping_mul(7) ^ (i as u8 + 1) << 5)
        .collect();
    (header, payload)
}

fn pair() -> (Arc<HeapRing>, Producer, Consumer) {
    let r = Arc::new(HeapRing::new(8));
    let v = r.view();
    assert_eq!(v.nslots(), 8);
    assert!(LENS.iter().all(|&l| l <= v.max_payload()));
    let (h0, _) = message(0);
    assert!(ring::is_short(&h0, LENS[0]));
    assert_eq!(
        LENS[1..]
            .iter()
            .map(|&l| ring::slots_for(l))
            .collect::<Vec<_>>(),
        [4, 4]
    );
    // SAFETY: each end is moved into one thread together with a clone of
    // the Arc, so the memory outlives both; there is one of each.
    unsafe { (r.clone(), Producer::new(v), Consumer::new(v)) }
}

/// Executions in which the producer found the ring full (plain std atomic:
/// bookkeeping outside the model).
static FULL: AtomicUsize = AtomicUsize::new(0);

/// Pushes the model's messages, yielding while the ring is full.
fn produce(mut p: Producer) {
    let mut full = false;
    for i in 0..LENS.len() {
        let (h, data) = message(i);
        while !p.try_push(&h, &data).expect("tail valid") {
            full = true;
            thread::yield_now();
        }
    }
    if full {
        FULL.fetch_add(1, Ordering::Relaxed);
    }
}

/// Receives the model's messages in order and checks every header field and
/// payload byte against what the producer wrote.
fn consume(c: &mut Consumer) {
    for i in 0..LENS.len() {
        let (want_h, want) = message(i);
        let m = loop {
            match c.peek() {
                None => thread::yield_now(),
                Some(m) => break m.expect("ring entry valid"),
            }
        };
        assert_eq!(m.header, want_h, "header of message {i}");
        let mut got = vec![0u8; want.len()];
        assert_eq!(c.copy_payload(&m, &mut got), want.len());
        assert_eq!(got, want, "payload of message {i}");
        c.pop(&m);
    }
    assert!(c.peek().is_none(), "nothing past the last message");
}

/// Producer and consumer on two threads: a short message, a long one after
/// a padding entry, and a long one after padding again that wraps and must
/// wait for room (the producer spins on a full ring until the consumer
/// frees the first message).
///
/// What this catches: the consumer checks every header field and payload
/// byte it received, and loom reports any access to a slot's bytes that the
/// ring's orderings do not order after the previous conflicting access.
///
/// Weakened-ordering experiment (done by hand, not committed), each change
/// alone in `ring.rs`:
/// - the publication store in `Producer::try_push`, `SeqCst` -> `Relaxed`:
///   fails, "Causality violation: Concurrent read and write accesses" (the
///   consumer reads a header whose writes it is not ordered after);
/// - the `seq` load in `Consumer::peek`, `Acquire` -> `Relaxed`: fails, same;
/// - the `tail` store in `Consumer::pop`, `Release` -> `Relaxed`: fails,
///   "Concurrent write accesses to `UnsafeCell`" (the producer reuses a slot
///   the consumer's last accesses are not ordered before);
/// - the `tail` load in `Producer::has_room`, `Acquire` -> `Relaxed`: fails,
///   same;
/// - the publication store `SeqCst` -> `Release`: passes (publication needs
///   only `Release`; `SeqCst` is there for the doorbell's argument).
///
/// With the cell tracking switched off, the `Relaxed` publication store
/// passed even the exhaustive exploration (4,114 executions): loom runs one
/// thread at a time on real memory, so by the time it lets the consumer see
/// `seq` the bytes are there, and comparing them alone proves nothing about
/// orderings. The cells are what make the model see the payload.
#[test]
fn push_wrap_and_full_ring() {
    model("push_wrap_and_full_ring", || {
        let (r, p, mut c) = pair();
        let keep = r.clone();
        let t = thread::spawn(move || {
            let _keep = keep;
            produce(p);
        });
        consume(&mut c);
        t.join().unwrap();
        drop(r);
    });
    let full = FULL.load(Ordering::Relaxed);
    println!("push_wrap_and_full_ring: the producer met a full ring in {full} executions");
    assert!(full > 0, "the model never took the ring-full path");
}

/// The `waiting` flag handshake, with a sleeper that trusts it fully: the
/// producer fills the ring, flags that it waits, re-checks for room, then
/// sleeps until the consumer's `pop` reports the flag and rings.
///
/// The handshake is the store-buffer pattern (producer: store `waiting`,
/// load `tail`; consumer: store `tail`, load `waiting`), with a fence on each
/// side (`Producer::set_waiting`, `Consumer::pop`; `fence(SeqCst)` in this
/// build): either the producer's re-check sees the freed room, or the pop
/// reports the flag. A lost wake-up would leave the producer asleep and loom
/// would report a deadlock. (Before the fences, loom found exactly that; the
/// fence in `pop` alone is not enough either.)
#[test]
fn waiting_flag_handshake() {
    use loom::sync::{Condvar, Mutex};
    model("waiting_flag_handshake", || {
        let (r, mut p, mut c) = pair();
        let bell = Arc::new((Mutex::new(false), Condvar::new()));
        let (keep, pbell) = (r.clone(), bell.clone());
        let t = thread::spawn(move || {
            let _keep = keep;
            let big = vec![7u8; INLINE + 1];
            let push =
                |p: &mut Producer, data: &[u8]| p.try_push(&Header::default(), data).unwrap();
            assert!(push(&mut p, &big));
            assert!(push(&mut p, &big));
            if !push(&mut p, b"x") {
                p.set_waiting(true);
                if !push(&mut p, b"x") {
                    let (m, cv) = &*pbell;
                    let mut rung = m.lock().unwrap();
                    while !*rung {
                        rung = cv.wait(rung).unwrap();
                    }
                    drop(rung);
                    assert!(push(&mut p, b"x"), "rung without room");
                }
                p.set_waiting(false);
            }
        });
        for _ in 0..2 {
            let m = loop {
                match c.peek() {
                    None => thread::yield_now(),
                    Some(m) => break m.unwrap(),
                }
            };
            if c.pop(&m) {
                let (m, cv) = &*bell;
                *m.lock().unwrap() = true;
                cv.notify_one();
            }
        }
        t.join().unwrap();
        assert!(c.peek().is_some());
    });
}
