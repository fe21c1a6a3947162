//! The spin policy of a blocking wait, without a device.

use super::{idle_step, IdleStep, QUIET_POLLS, SPIN_POLLS};

#[test]
fn no_yield_in_the_quiet_polls() {
    for idle in 1..=QUIET_POLLS {
        assert_eq!(idle_step(idle), IdleStep::Pause, "empty poll {idle}");
    }
}

#[test]
fn after_the_quiet_polls_a_yield_every_64_then_sleep() {
    let mut yields = 0;
    for idle in QUIET_POLLS + 1..SPIN_POLLS {
        match idle_step(idle) {
            IdleStep::Yield => yields += 1,
            IdleStep::Pause => {}
            other => panic!("empty poll {idle}: {other:?}"),
        }
    }
    let span = SPIN_POLLS - QUIET_POLLS - 1;
    assert!(
        yields >= span / 64 && yields <= span / 64 + 1,
        "{yields} yields in {span} polls"
    );
    // The sleep-after-spin rule: a wait that stays idle always sleeps.
    assert_eq!(idle_step(SPIN_POLLS), IdleStep::Sleep);
    assert_eq!(idle_step(u32::MAX), IdleStep::Sleep);
}
