//! Property tests of the bootstrap frame decoder: random and mutated byte
//! streams never make it panic, whatever it accepts re-encodes to the same
//! bytes, and hostile lengths are refused without allocating them (checked
//! with a counting allocator).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::Cursor;

use proptest::prelude::*;
use xdev::devkit::wire::{
    self, Failure, FailureKind, Message, MAX_FRAME_LEN, MAX_HANDSHAKE_FRAME_LEN, MAX_JOB_LEN,
    MAX_KEY_LEN, MAX_TEXT_LEN,
};
use xdev::Error;

/// Records the largest single allocation made by the current thread while
/// tracking is on.
struct Counting;

thread_local! {
    static TRACKING: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    let _ = TRACKING.try_with(|t| {
        if t.get() {
            let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
        }
    });
}

// SAFETY: every method forwards to the system allocator with the same
// arguments; the bookkeeping only touches const-initialized thread-locals,
// which never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: forwarded unchanged; the caller upholds `alloc`'s contract.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: forwarded unchanged; the caller upholds the contract.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: forwarded unchanged; the caller upholds the contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged; `ptr` came from this allocator, i.e.
        // from `System`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Runs `f` and returns its result with the largest allocation it made.
fn largest_alloc<T>(f: impl FnOnce() -> T) -> (T, usize) {
    LARGEST.with(|l| l.set(0));
    TRACKING.with(|t| t.set(true));
    let r = f();
    TRACKING.with(|t| t.set(false));
    (r, LARGEST.with(Cell::get))
}

/// Decodes frames from `bytes` until the stream ends or an error; checks that
/// every accepted frame re-encodes to exactly its bytes. Returns how many
/// frames were accepted and the final outcome.
fn drain(bytes: &[u8], max_len: usize) -> (usize, Result<(), Error>) {
    let mut cur = Cursor::new(bytes);
    let mut n = 0;
    loop {
        let start = cur.position() as usize;
        match wire::read_message(&mut cur, max_len, 3) {
            Ok(None) => return (n, Ok(())),
            Ok(Some(m)) => {
                let end = cur.position() as usize;
                let again = wire::encode(&m).expect("a decoded message re-encodes");
                assert_eq!(again, &bytes[start..end], "decoding is canonical: {m:?}");
                n += 1;
            }
            Err(e) => {
                assert!(
                    matches!(e, Error::Protocol { rank: 3, .. }),
                    "slices fail with protocol errors only: {e:?}"
                );
                return (n, Err(e));
            }
        }
    }
}

fn text(max: usize) -> impl Strategy<Value = String> {
    proptest::collection::vec(any::<char>(), 0..8)
        .prop_map(move |cs| {
            let mut s: String = cs.into_iter().collect();
            while s.len() > max {
                s.pop();
            }
            s
        })
        .boxed()
}

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        text(MAX_KEY_LEN),
        Just("k".repeat(MAX_KEY_LEN)),
        "[a-z/0-9]{0,40}"
    ]
}

fn bytes() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(any::<u8>(), 0..300)
}

fn failure() -> impl Strategy<Value = Failure> {
    (
        prop_oneof![
            Just(FailureKind::ResourceExhausted),
            Just(FailureKind::PeerLost),
            Just(FailureKind::Protocol),
            Just(FailureKind::Config),
        ],
        any::<u32>(),
        text(MAX_TEXT_LEN),
    )
        .prop_map(|(kind, rank, text)| Failure { kind, rank, text })
}

fn message() -> impl Strategy<Value = Message> {
    prop_oneof![
        (any::<u16>(), any::<[u8; 32]>())
            .prop_map(|(version, nonce)| Message::Challenge { version, nonce }),
        (
            any::<u16>(),
            any::<u32>(),
            any::<u32>(),
            any::<[u8; 32]>(),
            any::<[u8; 32]>(),
            text(MAX_JOB_LEN)
        )
            .prop_map(|(version, rank, size, nonce, mac, job)| Message::Auth {
                version,
                rank,
                size,
                nonce,
                mac,
                job
            }),
        any::<[u8; 32]>().prop_map(|mac| Message::Welcome { mac }),
        text(MAX_TEXT_LEN).prop_map(|reason| Message::Refused { reason }),
        (any::<u32>(), key(), bytes()).prop_map(|(id, key, value)| Message::Put { id, key, value }),
        (any::<u32>(), key()).prop_map(|(id, key)| Message::Get { id, key }),
        any::<u32>().prop_map(|id| Message::Cancel { id }),
        any::<u32>().prop_map(|id| Message::Barrier { id }),
        (any::<u32>(), bytes()).prop_map(|(id, value)| Message::Allgather { id, value }),
        Just(Message::Goodbye),
        any::<u32>().prop_map(|id| Message::Done { id }),
        (any::<u32>(), bytes()).prop_map(|(id, value)| Message::Value { id, value }),
        (any::<u32>(), any::<u32>(), any::<u32>(), bytes()).prop_map(
            |(id, index, count, value)| Message::Gathered {
                id,
                index,
                count,
                value
            }
        ),
        (any::<u32>(), failure()).prop_map(|(id, failure)| Message::Failed { id, failure }),
        (any::<u32>(), any::<bool>()).prop_map(|(rank, clean)| Message::Departed { rank, clean }),
    ]
}

#[derive(Clone, Debug)]
enum Mutation {
    Flip(usize, u8),
    Insert(usize, u8),
    Remove(usize),
    Truncate(usize),
    /// Overwrite a 4-byte little-endian word (e.g. a length field).
    Word(usize, u32),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 1..=255u8).prop_map(|(i, x)| Mutation::Flip(i, x)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, x)| Mutation::Insert(i, x)),
        any::<usize>().prop_map(Mutation::Remove),
        any::<usize>().prop_map(Mutation::Truncate),
        (
            any::<usize>(),
            prop_oneof![
                any::<u32>(),
                Just(u32::MAX),
                Just(MAX_FRAME_LEN as u32 + 1),
                0..64u32
            ]
        )
            .prop_map(|(i, x)| Mutation::Word(i, x)),
    ]
}

fn apply(bytes: &mut Vec<u8>, m: &Mutation) {
    if bytes.is_empty() {
        return;
    }
    let n = bytes.len();
    match *m {
        Mutation::Flip(i, x) => bytes[i % n] ^= x,
        Mutation::Insert(i, x) => bytes.insert(i % (n + 1), x),
        Mutation::Remove(i) => {
            bytes.remove(i % n);
        }
        Mutation::Truncate(i) => bytes.truncate(i % n),
        Mutation::Word(i, x) => {
            let at = i % n;
            for (k, b) in x.to_le_bytes().iter().enumerate() {
                if let Some(slot) = bytes.get_mut(at + k) {
                    *slot = *b;
                }
            }
        }
    }
}

/// Headroom for the decoder's own small allocations (error texts, strings).
const SLACK: usize = 4096;
/// First allocation for a frame body (see `wire`).
const INITIAL_BODY: usize = 64 * 1024;

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn messages_roundtrip(msgs in proptest::collection::vec(message(), 1..6)) {
        let mut stream = Vec::new();
        for m in &msgs {
            stream.extend(wire::encode(m).unwrap());
        }
        let mut cur = Cursor::new(&stream[..]);
        for m in &msgs {
            let got = wire::read_message(&mut cur, MAX_FRAME_LEN, 0).unwrap();
            prop_assert_eq!(got.as_ref(), Some(m));
        }
        prop_assert_eq!(wire::read_message(&mut cur, MAX_FRAME_LEN, 0).unwrap(), None);
    }

    #[test]
    fn random_streams_never_panic_and_allocate_little(
        bytes in proptest::collection::vec(any::<u8>(), 0..4096),
        handshake in any::<bool>(),
    ) {
        let max = if handshake { MAX_HANDSHAKE_FRAME_LEN } else { MAX_FRAME_LEN };
        let (_, largest) = largest_alloc(|| drain(&bytes, max));
        // The body grows with the bytes that actually arrive.
        prop_assert!(largest <= INITIAL_BODY + SLACK, "allocated {largest} for {} bytes", bytes.len());
    }

    #[test]
    fn random_bodies_never_panic(body in proptest::collection::vec(any::<u8>(), 0..512)) {
        if let Ok(m) = wire::decode(&body, 0) {
            let frame = wire::encode(&m).unwrap();
            prop_assert_eq!(&frame[4..], &body[..]);
        }
    }

    #[test]
    fn mutated_streams_never_panic(
        msgs in proptest::collection::vec(message(), 1..5),
        mutations in proptest::collection::vec(mutation(), 1..6),
    ) {
        let mut stream = Vec::new();
        for m in &msgs {
            stream.extend(wire::encode(m).unwrap());
        }
        for m in &mutations {
            apply(&mut stream, m);
        }
        let (_, largest) = largest_alloc(|| drain(&stream, MAX_FRAME_LEN));
        prop_assert!(largest <= INITIAL_BODY + SLACK, "allocated {largest}");
    }

    #[test]
    fn oversize_lengths_are_refused_before_reading_or_allocating(
        len in (MAX_FRAME_LEN as u32 + 1)..=u32::MAX,
        tail in proptest::collection::vec(any::<u8>(), 0..64),
    ) {
        let mut stream = len.to_le_bytes().to_vec();
        stream.extend(tail);
        let mut cur = Cursor::new(&stream[..]);
        let (r, largest) = largest_alloc(|| wire::read_message(&mut cur, MAX_FRAME_LEN, 9));
        let is_protocol_error = matches!(r, Err(Error::Protocol { rank: 9, .. }));
        prop_assert!(is_protocol_error, "{:?}", r);
        prop_assert_eq!(cur.position(), 4, "nothing past the length is read");
        prop_assert!(largest <= SLACK, "allocated {}", largest);
    }

    #[test]
    fn handshake_limit_applies_before_authentication(
        len in (MAX_HANDSHAKE_FRAME_LEN as u32 + 1)..=(MAX_FRAME_LEN as u32),
    ) {
        let stream = len.to_le_bytes();
        let mut cur = Cursor::new(&stream[..]);
        let (r, largest) = largest_alloc(|| wire::read_message(&mut cur, MAX_HANDSHAKE_FRAME_LEN, 0));
        prop_assert!(r.is_err());
        prop_assert!(largest <= SLACK, "allocated {}", largest);
    }
}

#[test]
fn a_full_frame_is_allocated_only_as_its_bytes_arrive() {
    // A frame announcing the maximum length whose body stops after 10 bytes:
    // the decoder must not have reserved the whole megabyte.
    let mut stream = (MAX_FRAME_LEN as u32).to_le_bytes().to_vec();
    stream.extend([0x10; 10]);
    let (r, largest) =
        largest_alloc(|| wire::read_message(&mut Cursor::new(&stream[..]), MAX_FRAME_LEN, 0));
    assert!(matches!(r, Err(Error::Protocol { .. })), "{r:?}");
    assert!(largest <= INITIAL_BODY + SLACK, "allocated {largest}");
    // And a complete maximal frame decodes.
    let m = Message::Value {
        id: 1,
        value: vec![7; wire::MAX_VALUE_LEN],
    };
    let frame = wire::encode(&m).unwrap();
    assert!(frame.len() - 4 <= MAX_FRAME_LEN);
    assert_eq!(
        wire::read_message(&mut Cursor::new(&frame[..]), MAX_FRAME_LEN, 0).unwrap(),
        Some(m)
    );
}
