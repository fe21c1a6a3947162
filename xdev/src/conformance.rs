//! The conformance suite: collective test cases that every rank of a device
//! runs, checking the xdev contract end to end (matching order, probe,
//! truncation, synchronous sends, zero-byte and 64 MiB messages, flow control
//! under 10,000 outstanding sends, contexts, cancel, peek, errors, threads,
//! and all-to-all traffic).
//!
//! A device runs it with a few lines: [`conformance_tests!`](crate::conformance_tests)
//! expands to one `#[test]` per case, each calling a function that starts the
//! device's ranks and calls [`run_case`] on every rank.
//!
//! The suite uses contexts from [`SUITE_CONTEXT_BASE`] upwards and assumes
//! nothing else uses them. Cases need at least two ranks where they say so and
//! degrade to a self-check on one rank.

mod race;
pub use race::finish_while_posting;

use std::fmt;
use std::time::{Duration, Instant};

use crate::{
    Buffer, Context, Device, Error, Rank, Request, Source, Status, TagSel, ANY_SOURCE, ANY_TAG,
};

/// First context the suite uses.
pub const SUITE_CONTEXT_BASE: Context = 0x7000_0000;
const BARRIER_CONTEXT: Context = 0x7FFF_FFFF;
/// A size that is above every device's eager threshold (rendezvous path).
const LARGE: usize = 1 << 20;

/// A failed conformance check.
#[derive(Debug, Clone)]
pub struct Failure {
    /// The case.
    pub case: &'static str,
    /// The rank that saw it.
    pub rank: Rank,
    /// What was wrong.
    pub message: String,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "conformance case {} failed on rank {}: {}",
            self.case, self.rank, self.message
        )
    }
}

impl std::error::Error for Failure {}

type CaseResult = Result<(), String>;

/// A conformance case: run collectively by every rank.
pub type CaseFn = fn(&dyn Device) -> CaseResult;

/// All cases, by name, in the order `run_all` runs them.
pub const CASES: &[(&str, CaseFn)] = &[
    ("errors", errors),
    ("zero_byte_messages", zero_byte_messages),
    ("self_send", self_send),
    ("ordering_under_wildcards", ordering_under_wildcards),
    ("probe_then_recv", probe_then_recv),
    ("truncation", truncation),
    ("ssend_semantics", ssend_semantics),
    ("cancel", cancel),
    ("peek_wait_any", peek_wait_any),
    ("many_contexts", many_contexts),
    ("concurrent_threads", concurrent_threads),
    ("all_to_all", all_to_all),
    ("large_64mib", large_64mib),
    ("many_outstanding_isends", many_outstanding_isends),
    ("window_calls", window_calls),
];

/// Runs case `name` on this rank (every rank must call it).
pub fn run_case(dev: &dyn Device, name: &str) -> Result<(), Failure> {
    let (case, f) = CASES
        .iter()
        .find(|(n, _)| *n == name)
        .copied()
        .ok_or_else(|| Failure {
            case: "lookup",
            rank: dev.id(),
            message: format!("no conformance case named {name:?}"),
        })?;
    let fail = |message| Failure {
        case,
        rank: dev.id(),
        message,
    };
    barrier(dev).map_err(|e| fail(format!("entry barrier: {e}")))?;
    f(dev).map_err(fail)?;
    barrier(dev).map_err(|e| fail(format!("exit barrier: {e}")))
}

/// Runs every case in order on this rank.
pub fn run_all(dev: &dyn Device) -> Result<(), Failure> {
    CASES.iter().try_for_each(|(n, _)| run_case(dev, n))
}

/// Expands to one `#[test]` per conformance case; each calls `$runner(name)`,
/// which must run [`run_case`] on every rank of a fresh device world and
/// panic on failure.
///
/// Its public path is `xdev::devkit::conformance_tests!`; `#[macro_export]`
/// also puts it at the crate root, hidden there.
#[doc(hidden)]
#[macro_export]
macro_rules! conformance_tests {
    ($runner:expr) => {
        $crate::conformance_tests!(@cases $runner;
            errors zero_byte_messages self_send ordering_under_wildcards probe_then_recv
            truncation ssend_semantics cancel peek_wait_any many_contexts concurrent_threads
            all_to_all large_64mib many_outstanding_isends window_calls);
    };
    (@cases $runner:expr; $($case:ident)*) => {
        $(
            #[test]
            fn $case() {
                ($runner)(stringify!($case));
            }
        )*
        #[test]
        fn conformance_list_is_complete() {
            let listed: &[&str] = &[$(stringify!($case)),*];
            let all: Vec<&str> = $crate::devkit::conformance::CASES.iter().map(|c| c.0).collect();
            assert_eq!(listed, &all[..], "conformance_tests! must list every case");
        }
    };
}

/// Aborts the process if not dropped within a deadline: a hung conformance
/// case fails loudly instead of stalling CI.
pub struct Watchdog {
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Watchdog {
    /// Arms a watchdog for `what`.
    pub fn arm(what: impl Into<String>, limit: Duration) -> Watchdog {
        use std::sync::atomic::{AtomicBool, Ordering};
        let done = std::sync::Arc::new(AtomicBool::new(false));
        let d = done.clone();
        let what = what.into();
        std::thread::spawn(move || {
            let start = Instant::now();
            while start.elapsed() < limit {
                std::thread::sleep(Duration::from_millis(50));
                if d.load(Ordering::Relaxed) {
                    return;
                }
            }
            tracing::error!("watchdog: {what} did not finish within {limit:?}; aborting");
            std::process::abort();
        });
        Watchdog { done }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.done.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A dissemination barrier over the device itself, on a reserved context.
pub fn barrier(dev: &dyn Device) -> crate::Result<()> {
    let (me, n) = (dev.id(), dev.size());
    let mut k = 1;
    let mut round = 0;
    while k < n {
        dev.send(&[], (me + k) % n, round, BARRIER_CONTEXT)?;
        dev.recv(
            &mut [],
            Source::Rank((me + n - k) % n),
            TagSel::Tag(round),
            BARRIER_CONTEXT,
        )?;
        k *= 2;
        round += 1;
    }
    Ok(())
}

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(format!($($fmt)+));
        }
    };
}

// After `ensure!`, which it uses.
mod window;
use window::window_calls;

fn ctx(case: u32, sub: u32) -> Context {
    SUITE_CONTEXT_BASE + case * 0x1_0000 + sub
}

/// Turns an error into a failure message prefixed with `what`.
fn e(what: &str) -> impl FnOnce(Error) -> String + '_ {
    move |err| format!("{what}: {err}")
}

/// Fills `buf` with a pattern derived from `seed` and each 8-byte offset.
pub fn fill(buf: &mut [u8], seed: u64) {
    for (i, chunk) in buf.chunks_mut(8).enumerate() {
        let w = pattern_word(seed, i as u64).to_le_bytes();
        chunk.copy_from_slice(&w[..chunk.len()]);
    }
}

/// Checks a buffer filled by [`fill`]; returns the first wrong offset.
pub fn check(buf: &[u8], seed: u64) -> Result<(), usize> {
    for (i, chunk) in buf.chunks(8).enumerate() {
        let w = pattern_word(seed, i as u64).to_le_bytes();
        if chunk != &w[..chunk.len()] {
            let off = chunk.iter().zip(w).position(|(a, b)| *a != b).unwrap_or(0);
            return Err(i * 8 + off);
        }
    }
    Ok(())
}

fn pattern_word(seed: u64, i: u64) -> u64 {
    let x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i.wrapping_mul(0xD1B5_4A32_D192_ED03);
    x ^ (x >> 29)
}

fn patterned(len: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill(&mut v, seed);
    v
}

fn checked(buf: &[u8], seed: u64, what: &str) -> CaseResult {
    check(buf, seed).map_err(|off| format!("{what}: payload differs at byte {off}"))
}

fn wait_ok(r: Request, what: &str) -> Result<(Buffer, Status), String> {
    r.wait()
        .into_result()
        .map_err(|err| format!("{what}: {err}"))
}

fn other(dev: &dyn Device) -> Option<Rank> {
    (dev.size() > 1).then_some(1 - dev.id().min(1))
}

// ---------------------------------------------------------------- cases

fn errors(dev: &dyn Device) -> CaseResult {
    let n = dev.size();
    let c = ctx(0, 0);
    match dev.send(b"x", n, 0, c) {
        Err(Error::InvalidRank { rank, size }) => ensure!(rank == n && size == n, "wrong fields"),
        other => return Err(format!("send to rank {n} gave {other:?}, want InvalidRank")),
    }
    match dev.send(b"x", 0, -5, c) {
        Err(Error::InvalidTag(-5)) => {}
        other => return Err(format!("send with tag -5 gave {other:?}, want InvalidTag")),
    }
    match dev.recv(&mut [0; 4], Source::Rank(n + 3), ANY_TAG, c) {
        Err(Error::InvalidRank { .. }) => {}
        other => return Err(format!("recv from rank {} gave {other:?}", n + 3)),
    }
    match dev.iprobe(ANY_SOURCE, TagSel::Tag(-1), c) {
        Err(Error::InvalidTag(-1)) => {}
        other => return Err(format!("iprobe with tag -1 gave {other:?}")),
    }
    // Non-blocking: the error lands on the request and the buffer comes back.
    let comp = dev.isend(Buffer::from(vec![9u8; 3]), n + 1, 0, c).wait();
    ensure!(
        matches!(
            comp.status.error.as_deref(),
            Some(Error::InvalidRank { .. })
        ),
        "isend to an invalid rank: status {:?}",
        comp.status
    );
    ensure!(comp.buf[..] == [9, 9, 9], "isend error lost the buffer");
    let comp = dev
        .irecv(Buffer::zeroed(2), ANY_SOURCE, TagSel::Tag(-2), c)
        .wait();
    ensure!(
        matches!(comp.status.error.as_deref(), Some(Error::InvalidTag(-2))) && comp.buf.len() == 2,
        "irecv with an invalid tag: {:?}",
        comp.status
    );
    // Still usable afterwards.
    let me = dev.id();
    dev.send(b"ok", me, 1, c)
        .map_err(e("self send after errors"))?;
    let mut b = [0u8; 2];
    dev.recv(&mut b, Source::Rank(me), TagSel::Tag(1), c)
        .map_err(e("self recv after errors"))?;
    ensure!(&b == b"ok", "payload after errors");
    Ok(())
}

fn zero_byte_messages(dev: &dyn Device) -> CaseResult {
    let c = ctx(1, 0);
    let Some(peer) = other(dev) else {
        return self_zero(dev, c);
    };
    if dev.id() > 1 {
        return Ok(());
    }
    if dev.id() == 0 {
        dev.send(&[], peer, 1, c).map_err(e("send 0"))?;
        wait_ok(dev.isend(Buffer::zeroed(0), peer, 2, c), "isend 0")?;
        dev.ssend(&[], peer, 3, c).map_err(e("ssend 0"))?;
    } else {
        let st = dev
            .probe(Source::Rank(peer), TagSel::Tag(1), c)
            .map_err(e("probe"))?;
        ensure!(
            st.count == 0 && st.message_len == 0,
            "probe of empty message: {st:?}"
        );
        let st = dev
            .recv(&mut [], Source::Rank(peer), TagSel::Tag(1), c)
            .map_err(e("recv"))?;
        ensure!(
            st.count == 0 && st.source == peer && st.tag == 1,
            "status {st:?}"
        );
        let (b, st) = wait_ok(
            dev.irecv(Buffer::zeroed(10), ANY_SOURCE, ANY_TAG, c),
            "irecv",
        )?;
        ensure!(
            st.count == 0 && st.tag == 2 && b.len() == 10,
            "irecv status {st:?}"
        );
        let st = dev
            .recv(&mut [7; 4], ANY_SOURCE, TagSel::Tag(3), c)
            .map_err(e("recv"))?;
        ensure!(st.count == 0, "ssend 0 received {st:?}");
    }
    Ok(())
}

fn self_zero(dev: &dyn Device, c: Context) -> CaseResult {
    dev.send(&[], 0, 1, c).map_err(e("self send 0"))?;
    let st = dev
        .recv(&mut [], Source::Rank(0), TagSel::Tag(1), c)
        .map_err(e("recv"))?;
    ensure!(st.count == 0, "status {st:?}");
    Ok(())
}

fn self_send(dev: &dyn Device) -> CaseResult {
    let me = dev.id();
    let c = ctx(2, 0);
    // Eager through a blocking send.
    dev.send(b"hello me", me, 5, c).map_err(e("send"))?;
    let mut b = [0u8; 8];
    let st = dev
        .recv(&mut b, Source::Rank(me), TagSel::Tag(5), c)
        .map_err(e("recv"))?;
    ensure!(
        &b == b"hello me" && st.source == me && st.count == 8,
        "eager self: {st:?}"
    );
    // Large: isend first, then receive (a blocking large self-send would be an
    // unsafe program under MPI rules).
    let s = dev.isend(Buffer::from(patterned(LARGE, 77)), me, 6, c);
    let mut big = vec![0u8; LARGE];
    dev.recv(&mut big, ANY_SOURCE, TagSel::Tag(6), c)
        .map_err(e("large recv"))?;
    checked(&big, 77, "large self")?;
    wait_ok(s, "large self isend")?;
    // Synchronous to self with the receive posted first.
    let r = dev.irecv(Buffer::zeroed(4), Source::Rank(me), TagSel::Tag(7), c);
    dev.ssend(&[1, 2, 3, 4], me, 7, c)
        .map_err(e("self ssend"))?;
    let (b, _) = wait_ok(r, "self irecv")?;
    ensure!(b[..] == [1, 2, 3, 4], "self ssend payload");
    Ok(())
}

fn ordering_under_wildcards(dev: &dyn Device) -> CaseResult {
    const M: u64 = 200;
    let (me, n) = (dev.id(), dev.size());
    let c = ctx(3, 0);
    if me != 0 {
        // Blocking and non-blocking sends alternate (a device may take
        // different paths for each, and for small and large messages; the
        // large ones are non-blocking, so later small ones start while
        // they are still in flight): none may overtake another.
        let mut pending = Vec::new();
        for i in 0..M {
            let size = if i % 50 == 7 { LARGE / 4 } else { 16 };
            let mut v = patterned(size, i);
            v[..8].copy_from_slice(&i.to_le_bytes());
            let tag = (i % 3) as i32;
            if i % 2 == 1 {
                pending.push(dev.isend(Buffer::from(v), 0, tag, c));
            } else {
                dev.send(&v, 0, tag, c).map_err(e("send"))?;
            }
        }
        for r in pending {
            wait_ok(r, "isend")?;
        }
    } else {
        let mut next = vec![0u64; n];
        let mut buf = vec![0u8; LARGE / 4];
        for _ in 0..(n as u64 - 1) * M {
            let st = dev
                .recv(&mut buf, ANY_SOURCE, ANY_TAG, c)
                .map_err(e("recv"))?;
            let i = u64::from_le_bytes(buf[..8].try_into().unwrap());
            ensure!(
                i == next[st.source],
                "from rank {}: got message {i}, expected {} (overtaking)",
                st.source,
                next[st.source]
            );
            ensure!(st.tag == (i % 3) as i32, "tag {} for message {i}", st.tag);
            next[st.source] += 1;
        }
    }
    barrier(dev).map_err(|e| e.to_string())?;
    let Some(peer) = other(dev) else {
        return Ok(());
    };
    let c2 = ctx(3, 1);
    if me == 1 {
        // Tags 5, 6, 5: a receive for 6 skips the first 5; ANY_TAG then takes
        // the earliest remaining.
        for (k, t) in [5, 6, 5].into_iter().enumerate() {
            dev.send(&[k as u8], peer, t, c2).map_err(e("send"))?;
        }
        barrier(dev).map_err(|e| e.to_string())?;
        // Two messages for two posted wildcard receives.
        dev.send(&[10], peer, 7, c2).map_err(e("send"))?;
        dev.send(&[11], peer, 7, c2).map_err(e("send"))?;
    } else if me == 0 {
        let mut b = [0u8; 1];
        dev.recv(&mut b, Source::Rank(peer), TagSel::Tag(6), c2)
            .map_err(e("recv 6"))?;
        ensure!(b[0] == 1, "tag 6 matched message {}", b[0]);
        dev.recv(&mut b, Source::Rank(peer), ANY_TAG, c2)
            .map_err(e("recv any"))?;
        ensure!(
            b[0] == 0,
            "ANY_TAG took message {}, want the earliest (0)",
            b[0]
        );
        dev.recv(&mut b, ANY_SOURCE, ANY_TAG, c2)
            .map_err(e("recv any"))?;
        ensure!(b[0] == 2, "third message {}", b[0]);
        let first = dev.irecv(Buffer::zeroed(1), ANY_SOURCE, TagSel::Tag(7), c2);
        let second = dev.irecv(Buffer::zeroed(1), ANY_SOURCE, ANY_TAG, c2);
        barrier(dev).map_err(|e| e.to_string())?;
        let (b1, _) = wait_ok(first, "first posted")?;
        let (b2, _) = wait_ok(second, "second posted")?;
        ensure!(
            b1[0] == 10 && b2[0] == 11,
            "posted receives matched {} {}",
            b1[0],
            b2[0]
        );
    } else {
        barrier(dev).map_err(|e| e.to_string())?;
    }
    Ok(())
}

fn probe_then_recv(dev: &dyn Device) -> CaseResult {
    let c = ctx(4, 0);
    let me = dev.id();
    match dev
        .iprobe(ANY_SOURCE, ANY_TAG, ctx(4, 9))
        .map_err(e("iprobe"))?
    {
        None => {}
        Some(st) => return Err(format!("iprobe on an unused context found {st:?}")),
    }
    let Some(peer) = other(dev) else {
        return Ok(());
    };
    if me == 1 {
        for (t, len) in [(11, 100usize), (12, LARGE)] {
            dev.send(&patterned(len, t as u64), peer, t, c)
                .map_err(e("send"))?;
        }
    } else if me == 0 {
        for expect in [(11, 100usize), (12, LARGE)] {
            let st = dev.probe(ANY_SOURCE, ANY_TAG, c).map_err(e("probe"))?;
            ensure!(
                (st.tag, st.count, st.source) == (expect.0, expect.1, peer),
                "probe gave {st:?}, want tag {} len {}",
                expect.0,
                expect.1
            );
            // Probing again finds the same message.
            let again = loop {
                if let Some(s) = dev
                    .iprobe(Source::Rank(peer), TagSel::Tag(st.tag), c)
                    .map_err(e("iprobe"))?
                {
                    break s;
                }
            };
            ensure!(again.count == st.count, "second probe differs");
            let mut buf = vec![0u8; st.count];
            let got = dev
                .recv(&mut buf, Source::Rank(st.source), TagSel::Tag(st.tag), c)
                .map_err(e("recv"))?;
            ensure!(got.count == st.count, "recv count {}", got.count);
            checked(&buf, st.tag as u64, "probed message")?;
        }
        ensure!(
            dev.iprobe(ANY_SOURCE, ANY_TAG, c)
                .map_err(e("iprobe"))?
                .is_none(),
            "iprobe after receiving everything found a message"
        );
    }
    Ok(())
}

fn truncation(dev: &dyn Device) -> CaseResult {
    let c = ctx(5, 0);
    let me = dev.id();
    let peer = other(dev).unwrap_or(me);
    if me > 1 {
        return Ok(());
    }
    let sender = dev.size() == 1 || me == 1;
    let receiver = dev.size() == 1 || me == 0;
    let mut sends = Vec::new();
    if sender {
        for (t, len) in [(1, 100usize), (2, LARGE), (3, 50), (4, 4096), (5, 8)] {
            sends.push(dev.isend(Buffer::from(patterned(len, t)), peer, t as i32, c));
        }
    }
    if receiver {
        for (t, cap, len) in [(1, 10usize, 100usize), (2, 1000, LARGE)] {
            let mut b = vec![0u8; cap];
            match dev.recv(&mut b, ANY_SOURCE, TagSel::Tag(t), c) {
                Err(Error::Truncated {
                    message_len,
                    capacity,
                    tag,
                    ..
                }) => ensure!(
                    message_len == len && capacity == cap && tag == t,
                    "truncation fields {message_len} {capacity} {tag}"
                ),
                other => return Err(format!("recv of {len} into {cap} gave {other:?}")),
            }
            checked(&b, t as u64, "bytes that fit")?;
        }
        // Non-blocking truncation reports through the status.
        let comp = dev
            .irecv(Buffer::zeroed(20), ANY_SOURCE, TagSel::Tag(3), c)
            .wait();
        ensure!(
            comp.status.count == 20
                && comp.status.message_len == 50
                && matches!(comp.status.error.as_deref(), Some(Error::Truncated { .. })),
            "irecv truncation status {:?}",
            comp.status
        );
        checked(&comp.buf, 3, "irecv bytes that fit")?;
        // The device stays usable: exact and larger buffers work.
        let mut b = vec![0u8; 4096];
        dev.recv(&mut b, ANY_SOURCE, TagSel::Tag(4), c)
            .map_err(e("exact recv"))?;
        checked(&b, 4, "exact")?;
        let st = dev
            .recv(&mut b, ANY_SOURCE, TagSel::Tag(5), c)
            .map_err(e("recv"))?;
        ensure!(st.count == 8 && st.error.is_none(), "short message {st:?}");
        checked(&b[..8], 5, "short")?;
    }
    for s in sends {
        wait_ok(s, "sender side of a truncated message")?;
    }
    Ok(())
}

fn ssend_semantics(dev: &dyn Device) -> CaseResult {
    let c = ctx(6, 0);
    let go = ctx(6, 1);
    let after = ctx(6, 2);
    let me = dev.id();
    let Some(peer) = other(dev) else {
        return Ok(());
    };
    for len in [8usize, LARGE] {
        if me == 1 {
            let r = dev.issend(Buffer::from(patterned(len, 1)), peer, 1, c);
            std::thread::sleep(Duration::from_millis(30));
            let r = match r.test() {
                Ok(_) => {
                    return Err(format!(
                        "issend of {len} bytes completed before the receive"
                    ))
                }
                Err(r) => r,
            };
            dev.send(&[], peer, 0, go).map_err(e("go"))?;
            wait_ok(r, "issend")?;
            // Blocking ssend: the receiver checks that nothing sent after it
            // arrived before it matched.
            dev.ssend(&patterned(len, 2), peer, 2, c)
                .map_err(e("ssend"))?;
            dev.send(&[1], peer, 3, after).map_err(e("after"))?;
        } else if me == 0 {
            dev.recv(&mut [], Source::Rank(peer), TagSel::Tag(0), go)
                .map_err(e("go"))?;
            let mut b = vec![0u8; len];
            dev.recv(&mut b, Source::Rank(peer), TagSel::Tag(1), c)
                .map_err(e("recv"))?;
            checked(&b, 1, "issend payload")?;
            std::thread::sleep(Duration::from_millis(50));
            let early = dev
                .iprobe(Source::Rank(peer), ANY_TAG, after)
                .map_err(e("iprobe"))?;
            ensure!(
                early.is_none(),
                "ssend of {len} bytes returned before its receive matched"
            );
            dev.recv(&mut b, Source::Rank(peer), TagSel::Tag(2), c)
                .map_err(e("recv"))?;
            checked(&b, 2, "ssend payload")?;
            dev.recv(&mut [0], Source::Rank(peer), TagSel::Tag(3), after)
                .map_err(e("after"))?;
        }
    }
    Ok(())
}

fn cancel(dev: &dyn Device) -> CaseResult {
    let c = ctx(7, 0);
    let me = dev.id();
    let r = dev.irecv(Buffer::from(vec![3u8; 16]), ANY_SOURCE, TagSel::Tag(99), c);
    ensure!(r.cancel(), "cancel of an unmatched receive refused");
    let comp = r.wait();
    ensure!(
        comp.status.cancelled && comp.status.error.is_none(),
        "status {:?}",
        comp.status
    );
    ensure!(
        comp.buf[..] == [3u8; 16],
        "cancelled receive's buffer changed"
    );
    // A message sent afterwards goes to the next receive, not the cancelled one.
    let r = dev.irecv(Buffer::zeroed(4), Source::Rank(me), TagSel::Tag(99), c);
    dev.send(&[4, 3, 2, 1], me, 99, c).map_err(e("send"))?;
    let (b, st) = wait_ok(r, "receive after cancel")?;
    ensure!(
        b[..] == [4, 3, 2, 1] && !st.cancelled,
        "after cancel: {st:?}"
    );
    // Matched receives and sends are not cancelled.
    let s = dev.isend(Buffer::from(vec![1u8]), me, 98, c);
    let r = dev.irecv(Buffer::zeroed(1), Source::Rank(me), TagSel::Tag(98), c);
    let (_, _) = wait_ok(s, "send")?;
    let comp = r.wait();
    ensure!(
        !comp.status.cancelled && comp.buf[0] == 1,
        "matched receive reported cancelled"
    );
    Ok(())
}

fn peek_wait_any(dev: &dyn Device) -> CaseResult {
    let c = ctx(8, 0);
    let me = dev.id();
    ensure!(
        dev.peek().map_err(e("peek"))?.is_none(),
        "peek with nothing outstanding"
    );
    let Some(peer) = other(dev) else {
        return Ok(());
    };
    if me == 0 {
        // A request born complete is in hand, never outstanding: peek does
        // not report it (one still in flight is reported, then waited).
        let early = dev.isend(Buffer::from(vec![9u8; 4]), peer, 9, c);
        if early.was_born_complete() {
            ensure!(
                dev.peek().map_err(e("peek"))?.is_none(),
                "peek reported a request born complete"
            );
        }
        wait_ok(early, "early send")?;
        let reqs: Vec<Request> = (1..=3)
            .map(|t| dev.irecv(Buffer::zeroed(4), Source::Rank(peer), TagSel::Tag(t), c))
            .collect();
        dev.send(&[], peer, 0, ctx(8, 1)).map_err(e("go"))?;
        let p = dev.peek().map_err(e("peek"))?.ok_or("peek gave None")?;
        ensure!(
            p.id == reqs[1].id() && p.status.tag == 2,
            "peek reported {:?}",
            p
        );
        dev.send(&[], peer, 0, ctx(8, 1)).map_err(e("go"))?;
        let mut seen = vec![p.id];
        while seen.len() < 3 {
            let p = dev.peek().map_err(e("peek"))?.ok_or("peek gave None")?;
            ensure!(!seen.contains(&p.id), "peek reported {:?} twice", p.id);
            seen.push(p.id);
        }
        for (i, r) in reqs.into_iter().enumerate() {
            let (b, st) = wait_ok(r, "peeked request")?;
            ensure!(
                st.tag == i as i32 + 1 && b[0] == i as u8 + 1,
                "payload {}",
                b[0]
            );
        }
    } else if me == 1 {
        dev.recv(&mut [], Source::Rank(peer), ANY_TAG, ctx(8, 1))
            .map_err(e("go"))?;
        dev.send(&[2; 4], peer, 2, c).map_err(e("send"))?;
        dev.recv(&mut [], Source::Rank(peer), ANY_TAG, ctx(8, 1))
            .map_err(e("go"))?;
        dev.send(&[1; 4], peer, 1, c).map_err(e("send"))?;
        dev.send(&[3; 4], peer, 3, c).map_err(e("send"))?;
        let mut early = [0u8; 4];
        dev.recv(&mut early, Source::Rank(peer), TagSel::Tag(9), c)
            .map_err(e("early"))?;
        ensure!(early == [9; 4], "early payload {early:?}");
    }
    Ok(())
}

fn many_contexts(dev: &dyn Device) -> CaseResult {
    const K: u32 = 300;
    let (me, n) = (dev.id(), dev.size());
    let to = (me + 1) % n;
    let from = (me + n - 1) % n;
    let sends: Vec<Request> = (0..K)
        .map(|k| dev.isend(Buffer::from(k.to_le_bytes().to_vec()), to, 1, ctx(9, k)))
        .collect();
    // Receive in reverse context order, with wildcards: contexts keep them apart.
    for k in (0..K).rev() {
        let mut b = [0u8; 4];
        let st = dev
            .recv(&mut b, ANY_SOURCE, ANY_TAG, ctx(9, k))
            .map_err(e("recv"))?;
        ensure!(
            u32::from_le_bytes(b) == k && st.source == from && st.context == ctx(9, k),
            "context {k} received payload {} from {}",
            u32::from_le_bytes(b),
            st.source
        );
    }
    for s in sends {
        wait_ok(s, "isend")?;
    }
    Ok(())
}

fn concurrent_threads(dev: &dyn Device) -> CaseResult {
    const T: i32 = 4;
    const M: u64 = 50;
    let (me, n) = (dev.id(), dev.size());
    let to = (me + 1) % n;
    let from = (me + n - 1) % n;
    let c = ctx(10, 0);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..T)
            .map(|t| {
                s.spawn(move || -> CaseResult {
                    for i in 0..M {
                        let len = if i % 10 == 3 { LARGE / 8 } else { 24 };
                        let seed = (t as u64) << 32 | i;
                        let r = dev.isend(Buffer::from(patterned(len, seed)), to, t, c);
                        let mut b = vec![0u8; len];
                        dev.recv(&mut b, Source::Rank(from), TagSel::Tag(t), c)
                            .map_err(e("recv"))?;
                        checked(&b, seed, "threaded message")?;
                        wait_ok(r, "isend")?;
                    }
                    Ok(())
                })
            })
            .collect();
        handles
            .into_iter()
            .try_for_each(|h| h.join().map_err(|_| "thread panicked".to_string())?)
    })
}

fn all_to_all(dev: &dyn Device) -> CaseResult {
    let (me, n) = (dev.id(), dev.size());
    let c = ctx(11, 0);
    for len in [64usize, 64 << 10] {
        let recvs: Vec<(Rank, Request)> = (0..n)
            .map(|src| {
                (
                    src,
                    dev.irecv(
                        Buffer::zeroed(len),
                        Source::Rank(src),
                        TagSel::Tag(len as i32),
                        c,
                    ),
                )
            })
            .collect();
        let sends: Vec<Request> = (0..n)
            .map(|k| (me + k) % n)
            .map(|dst| {
                let seed = (me * 1000 + dst) as u64;
                dev.isend(Buffer::from(patterned(len, seed)), dst, len as i32, c)
            })
            .collect();
        for (src, r) in recvs {
            let (b, st) = wait_ok(r, "all-to-all receive")?;
            ensure!(st.source == src && st.count == len, "status {st:?}");
            checked(&b, (src * 1000 + me) as u64, "all-to-all payload")?;
        }
        for s in sends {
            wait_ok(s, "all-to-all send")?;
        }
    }
    Ok(())
}

fn large_64mib(dev: &dyn Device) -> CaseResult {
    const LEN: usize = 64 << 20;
    let c = ctx(12, 0);
    let me = dev.id();
    let peer = other(dev).unwrap_or(me);
    if me > 1 {
        return Ok(());
    }
    let mut buf = vec![0u8; LEN];
    if me == 0 || dev.size() == 1 {
        let s = dev.isend(Buffer::from(patterned(LEN, 640)), peer, 1, c);
        if dev.size() == 1 {
            dev.recv(&mut buf, ANY_SOURCE, TagSel::Tag(1), c)
                .map_err(e("recv"))?;
            checked(&buf, 640, "64 MiB self")?;
        }
        wait_ok(s, "64 MiB isend")?;
        if dev.size() > 1 {
            let (b, st) = wait_ok(
                dev.irecv(Buffer::from(buf), Source::Rank(peer), TagSel::Tag(2), c),
                "64 MiB irecv",
            )?;
            ensure!(st.count == LEN, "count {}", st.count);
            checked(&b, 641, "64 MiB back")?;
        }
    } else {
        let st = dev
            .recv(&mut buf, Source::Rank(peer), TagSel::Tag(1), c)
            .map_err(e("recv"))?;
        ensure!(st.count == LEN, "count {}", st.count);
        checked(&buf, 640, "64 MiB")?;
        fill(&mut buf, 641);
        dev.send(&buf, peer, 2, c).map_err(e("send back"))?;
    }
    Ok(())
}

fn rss_bytes() -> Option<usize> {
    let s = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: usize = s.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf has no memory-safety preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * page.max(4096) as usize)
}

fn many_outstanding_isends(dev: &dyn Device) -> CaseResult {
    const COUNT: usize = 10_000;
    const LEN: usize = 8 << 10;
    /// What a device may buffer for a slow receiver beyond the user's own
    /// send buffers.
    const DEVICE_ALLOWANCE: usize = 64 << 20;
    let c = ctx(13, 0);
    let note = ctx(13, 1);
    let me = dev.id();
    let Some(peer) = other(dev) else {
        return Ok(());
    };
    // Who shares this process? User send buffers count only there.
    let pid = std::process::id();
    let mut peer_pid = [0u8; 4];
    if me <= 1 {
        let r = dev.irecv(Buffer::zeroed(4), Source::Rank(peer), TagSel::Tag(0), note);
        dev.send(&pid.to_le_bytes(), peer, 0, note)
            .map_err(e("pid"))?;
        let (b, _) = wait_ok(r, "pid")?;
        peer_pid.copy_from_slice(&b);
    }
    let same_process = u32::from_le_bytes(peer_pid) == pid;
    if me == 1 {
        let reqs: Vec<Request> = (0..COUNT)
            .map(|i| {
                let mut v = vec![0u8; LEN];
                v[..8].copy_from_slice(&(i as u64).to_le_bytes());
                v[LEN - 1] = i as u8;
                dev.isend(Buffer::from(v), peer, (i % 7) as i32, c)
            })
            .collect();
        // All posted without the receiver receiving anything: tell it.
        dev.send(&[], peer, 1, note).map_err(e("posted note"))?;
        for r in reqs {
            wait_ok(r, "outstanding isend")?;
        }
    } else if me == 0 {
        let before = rss_bytes();
        dev.recv(&mut [], Source::Rank(peer), TagSel::Tag(1), note)
            .map_err(e("note"))?;
        std::thread::sleep(Duration::from_millis(200)); // a slow receiver
        if let (Some(b), Some(a)) = (before, rss_bytes()) {
            let user = if same_process { COUNT * LEN } else { 0 };
            let grown = a.saturating_sub(b);
            ensure!(
                grown <= user + DEVICE_ALLOWANCE,
                "memory grew by {} MiB for {COUNT} unreceived sends (allowed {} MiB)",
                grown >> 20,
                (user + DEVICE_ALLOWANCE) >> 20
            );
        }
        let mut b = vec![0u8; LEN];
        for i in 0..COUNT {
            let st = dev
                .recv(&mut b, Source::Rank(peer), ANY_TAG, c)
                .map_err(e("recv"))?;
            let got = u64::from_le_bytes(b[..8].try_into().unwrap());
            ensure!(
                got == i as u64 && b[LEN - 1] == i as u8 && st.tag == (i % 7) as i32,
                "message {i}: got {got}"
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
