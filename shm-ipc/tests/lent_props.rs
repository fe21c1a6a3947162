//! Property test of the shm engine's posted receives (lent out, see
//! `engine/lend.rs`) on the thread device: random sequences of receives
//! posted (by tag or any tag), eager and rendezvous sends, cancels, tests,
//! waits and dropped handles, each checked against a model of MPI
//! matching: a message goes to the earliest-posted receive still waiting
//! that matches it, else it waits as unexpected for the first receive that
//! matches; a cancel succeeds exactly on a receive not matched yet. Slots
//! and posted ids are reused across the sequence, so a receive answered
//! for another's, a cancel or drop that takes the wrong receive, or a
//! reused slot's stale status shows up as a mismatch.
//!
//! One thread drives both ranks; after each send, rank 1 makes progress
//! (`iprobe`), so that each message has met the receives posted so far
//! before the next operation.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};

use std::time::Duration;

use proptest::prelude::*;
use shm_ipc::ThreadDevice;
use xdev::devkit::conformance::Watchdog;
use xdev::devkit::Completion;
use xdev::{Buffer, Config, Device, Request, Source, TagSel, ANY_SOURCE, ANY_TAG};

/// A receive buffer holds any message of the test.
const CAP: usize = 16 << 10;
/// A rendezvous message (above the default eager limit of 4 KiB).
const LARGE: usize = 8 << 10;

#[derive(Clone, Debug)]
enum Op {
    /// A receive for `Some(tag)` or any tag.
    Post(Option<i32>),
    /// A message with `tag`, eager or rendezvous.
    Send {
        tag: i32,
        large: bool,
    },
    Cancel(usize),
    Drop(usize),
    Test(usize),
    Wait(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => prop::option::weighted(0.8, 0..3i32).prop_map(Op::Post),
        4 => (0..3i32, prop::bool::weighted(0.4)).prop_map(|(tag, large)| Op::Send { tag, large }),
        1 => any::<usize>().prop_map(Op::Cancel),
        1 => any::<usize>().prop_map(Op::Drop),
        1 => any::<usize>().prop_map(Op::Test),
        2 => any::<usize>().prop_map(Op::Wait),
    ]
}

/// A message as the model knows it: its number (its first 8 bytes), tag
/// and length.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Msg {
    id: u64,
    tag: i32,
    len: usize,
}

#[derive(Debug, PartialEq)]
enum State {
    Posted,
    Matched(Msg),
    Cancelled,
}

struct Recv {
    tag: Option<i32>,
    state: State,
    handle: Request,
}

fn matches(want: Option<i32>, tag: i32) -> bool {
    want.map_or(true, |t| t == tag)
}

fn payload(m: Msg) -> Vec<u8> {
    let mut v = vec![(m.id % 251) as u8; m.len];
    v[..8].copy_from_slice(&m.id.to_le_bytes());
    v
}

/// Checks a receive's completion against the model's state for it.
fn check_completion(state: &State, c: Completion) -> Result<(), TestCaseError> {
    match state {
        State::Matched(m) => {
            prop_assert!(c.status.error.is_none(), "{:?}", c.status);
            prop_assert_eq!((c.status.tag, c.status.count), (m.tag, m.len));
            prop_assert_eq!(&c.buf[..m.len], &payload(*m)[..]);
        }
        State::Cancelled => prop_assert!(c.status.cancelled, "{:?}", c.status),
        State::Posted => prop_assert!(false, "a receive the model has open ended"),
    }
    Ok(())
}

/// Waits for a receive and checks its end.
fn check_end(r: Recv) -> Result<(), TestCaseError> {
    check_completion(&r.state, r.handle.wait())
}

static JOBS: AtomicUsize = AtomicUsize::new(0);

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let job = format!(
        "lent-props-{}-{}",
        std::process::id(),
        JOBS.fetch_add(1, Ordering::Relaxed)
    );
    let dev0 = ThreadDevice::open(&Config::new(0, 2, &job)).expect("open");
    let dev1 = ThreadDevice::open(&Config::new(1, 2, &job)).expect("open");
    let mut recvs: Vec<Recv> = Vec::new();
    let mut unexpected: VecDeque<Msg> = VecDeque::new();
    let mut sends = Vec::new();
    let mut next_id = 0u64;
    for op in ops {
        match op {
            Op::Post(tag) => {
                let sel = tag.map_or(TagSel::Any, TagSel::Tag);
                let handle = dev1.irecv(Buffer::zeroed(CAP), Source::Rank(0), sel, 0);
                let state = match unexpected.iter().position(|m| matches(tag, m.tag)) {
                    Some(i) => State::Matched(unexpected.remove(i).expect("present")),
                    None => State::Posted,
                };
                recvs.push(Recv { tag, state, handle });
            }
            Op::Send { tag, large } => {
                let m = Msg {
                    id: next_id,
                    tag,
                    len: if large { LARGE } else { 8 },
                };
                next_id += 1;
                if large {
                    sends.push(dev0.isend(Buffer::from(payload(m)), 1, tag, 0));
                } else {
                    dev0.send(&payload(m), 1, tag, 0).expect("eager send");
                }
                dev1.iprobe(ANY_SOURCE, ANY_TAG, 0).expect("progress");
                let taker = recvs
                    .iter_mut()
                    .find(|r| r.state == State::Posted && matches(r.tag, tag));
                match taker {
                    Some(r) => r.state = State::Matched(m),
                    None => unexpected.push_back(m),
                }
            }
            Op::Cancel(i) if !recvs.is_empty() => {
                let n = recvs.len();
                let r = &mut recvs[i % n];
                let open = r.state == State::Posted;
                prop_assert_eq!(r.handle.cancel(), open, "cancel of {:?}", r.state);
                if open {
                    r.state = State::Cancelled;
                }
            }
            Op::Drop(i) if !recvs.is_empty() => {
                // A posted receive dropped is taken out of the queue; a
                // matched one's message is gone with it.
                drop(recvs.remove(i % recvs.len()));
            }
            Op::Test(i) if !recvs.is_empty() => {
                let at = i % recvs.len();
                let r = recvs.remove(at);
                match r.handle.test() {
                    Ok(c) => check_completion(&r.state, c)?,
                    Err(handle) => {
                        prop_assert!(r.state == State::Posted, "not done: {:?}", r.state);
                        recvs.insert(at, Recv { handle, ..r });
                    }
                }
            }
            Op::Wait(i) if !recvs.is_empty() => {
                let at = i % recvs.len();
                if recvs[at].state != State::Posted {
                    check_end(recvs.remove(at))?;
                }
            }
            _ => {}
        }
    }
    // The rest: open receives cancel, unexpected messages are received.
    for mut r in recvs {
        if r.state == State::Posted {
            prop_assert!(r.handle.cancel(), "an open receive would not cancel");
            r.state = State::Cancelled;
        }
        check_end(r)?;
    }
    for m in unexpected {
        let handle = dev1.irecv(Buffer::zeroed(CAP), Source::Rank(0), TagSel::Tag(m.tag), 0);
        check_end(Recv {
            tag: Some(m.tag),
            state: State::Matched(m),
            handle,
        })?;
    }
    // A rendezvous ends once rank 1 copied it (a copy left by a posting
    // call is done by rank 1's next progress).
    for mut s in sends {
        let c = loop {
            match s.test() {
                Ok(c) => break c,
                Err(r) => s = r,
            }
            dev1.iprobe(ANY_SOURCE, ANY_TAG, 0).expect("progress");
        };
        prop_assert!(c.status.error.is_none(), "{:?}", c.status);
    }
    dev0.finish().expect("finish");
    dev1.finish().expect("finish");
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn posted_receives_match_cancel_and_end_as_the_model_says(
        ops in prop::collection::vec(op(), 1..80)
    ) {
        // A wait the model expects to end but the device never ends (a
        // receive answered for another) fails here instead of hanging.
        let _dog = Watchdog::arm("lent receives against the model", Duration::from_secs(60));
        run(ops)?;
    }
}
