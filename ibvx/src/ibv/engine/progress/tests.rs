//! The spin policy of a blocking wait, without a device (a fake clock).

use std::cell::Cell;
use std::time::{Duration, Instant};

use super::{IdleStep, Spin, CLOCK_POLLS, MAX_POLLS, QUIET, SPIN, YIELD_POLLS};

/// Runs `polls` empty polls with a clock that advances `per_poll` each poll;
/// returns the steps and how often the clock was read.
fn run(spin: &mut Spin, polls: u32, per_poll: Duration, t: &Cell<Instant>) -> (Vec<IdleStep>, u32) {
    let reads = Cell::new(0);
    let steps = (0..polls)
        .map(|_| {
            t.set(t.get() + per_poll);
            spin.step(|| {
                reads.set(reads.get() + 1);
                t.get()
            })
        })
        .collect();
    (steps, reads.get())
}

#[test]
fn quiet_polls_go_back_to_back_and_read_the_clock_rarely() {
    let t = Cell::new(Instant::now());
    let mut spin = Spin::default();
    // 10 ns polls: 10 * CLOCK_POLLS of them stay within QUIET.
    let (steps, reads) = run(&mut spin, 10 * CLOCK_POLLS, Duration::from_nanos(10), &t);
    assert!(steps.iter().all(|&s| s == IdleStep::Poll), "{steps:?}");
    assert_eq!(reads, 10);
}

#[test]
fn the_yields_and_the_sleep_come_by_time_not_by_polls() {
    for per_poll in [Duration::from_nanos(50), Duration::from_micros(2)] {
        let t = Cell::new(Instant::now());
        let start = t.get();
        let mut spin = Spin::default();
        let mut first_yield = None;
        let mut polls = 0u32;
        loop {
            polls += 1;
            t.set(t.get() + per_poll);
            match spin.step(|| t.get()) {
                IdleStep::Yield => {
                    first_yield.get_or_insert(t.get() - start);
                }
                IdleStep::Sleep => break,
                IdleStep::Pause => assert!(first_yield.is_some(), "a pause before the yields"),
                IdleStep::Poll => assert!(first_yield.is_none(), "a plain poll after the yields"),
            }
            assert!(polls <= MAX_POLLS, "never slept");
        }
        let slack = per_poll * CLOCK_POLLS * 2;
        let y = first_yield.expect("yielded before sleeping");
        assert!(y >= QUIET && y <= QUIET + slack, "first yield after {y:?}");
        let slept = t.get() - start;
        assert!(
            slept >= SPIN && slept <= SPIN + slack,
            "slept after {slept:?}"
        );
        assert_eq!(polls % YIELD_POLLS, 0, "slept between two yields");
    }
}

#[test]
fn a_wait_that_stays_idle_keeps_sleeping_until_something_happens() {
    let t = Cell::new(Instant::now());
    let mut spin = Spin::default();
    let (steps, _) = run(&mut spin, MAX_POLLS, Duration::from_micros(1), &t);
    assert_eq!(steps.last(), Some(&IdleStep::Sleep));
    // The sleep-after-spin rule: once asleep, every idle step sleeps.
    assert_eq!(
        spin.step(|| unreachable!("no clock once asleep")),
        IdleStep::Sleep
    );
    spin.reset();
    assert_eq!(spin.step(|| t.get()), IdleStep::Poll);
}

#[test]
fn a_stopped_clock_still_ends_in_sleep() {
    let t = Cell::new(Instant::now());
    let mut spin = Spin::default();
    let (steps, _) = run(&mut spin, MAX_POLLS, Duration::ZERO, &t);
    assert_eq!(steps.last(), Some(&IdleStep::Sleep));
}
