//! The spin policy of a blocking wait, without a device.

use super::{IdleStep, Spin, QUIET_POLLS, SPIN_POLLS};

#[test]
fn the_quiet_polls_go_back_to_back() {
    let mut spin = Spin::default();
    for idle in 1..=QUIET_POLLS {
        assert_eq!(spin.step(), IdleStep::Poll, "empty poll {idle}");
    }
}

#[test]
fn after_the_quiet_polls_a_yield_every_64_then_sleep() {
    let mut spin = Spin::default();
    for _ in 1..=QUIET_POLLS {
        spin.step();
    }
    let (mut yields, mut pauses) = (0, 0);
    for idle in QUIET_POLLS + 1..SPIN_POLLS {
        match spin.step() {
            IdleStep::Yield => yields += 1,
            IdleStep::Pause => pauses += 1,
            other => panic!("empty poll {idle}: {other:?}"),
        }
    }
    let span = SPIN_POLLS - QUIET_POLLS - 1;
    assert_eq!(yields, span / 64, "{yields} yields in {span} polls");
    assert_eq!(yields + pauses, span);
    // The sleep-after-spin rule: a wait that stays idle always sleeps.
    assert_eq!(spin.step(), IdleStep::Sleep);
    for _ in 0..10 {
        assert_eq!(spin.step(), IdleStep::Sleep);
    }
    spin.reset();
    assert_eq!(spin.step(), IdleStep::Poll, "after something happened");
}

#[test]
fn a_wait_idle_forever_keeps_sleeping() {
    let mut spin = Spin { idle: u32::MAX - 1 };
    assert_eq!(spin.step(), IdleStep::Sleep);
    assert_eq!(spin.step(), IdleStep::Sleep);
}
