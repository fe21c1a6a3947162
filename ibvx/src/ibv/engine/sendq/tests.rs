use super::SendQueue;

/// A model of the hardware queue: `posted` requests, each signalled or
/// not; completing the oldest signalled one retires it and everything
/// posted before it.
struct Model {
    outstanding: Vec<bool>,
}

impl Model {
    fn complete_oldest_signaled(&mut self) -> bool {
        match self.outstanding.iter().position(|&s| s) {
            Some(i) => {
                self.outstanding.drain(..=i);
                true
            }
            None => false,
        }
    }
}

#[test]
fn the_queue_never_overflows_and_room_always_returns() {
    for depth in [24u32, 40, 144, 1040] {
        for every in [1u32, 2, 6, 16, 64, 1000] {
            let mut q = SendQueue::new(depth, every);
            let mut hw = Model {
                outstanding: Vec::new(),
            };
            let mut unsignaled_posts = 0u32;
            // A pseudo-random mix of posts (some required to signal) and
            // completions, as a long run would see them.
            let mut x = 0x9e37_79b9u32 ^ depth ^ every;
            for step in 0..20_000u32 {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                if x % 3 != 0 && q.has_room(1) {
                    let signaled = q.must_signal(x % 11 == 0);
                    q.posted(signaled);
                    hw.outstanding.push(signaled);
                    unsignaled_posts += u32::from(!signaled);
                    assert!(
                        hw.outstanding.len() as u32 <= depth,
                        "overflow: depth {depth}, every {every}, step {step}"
                    );
                } else if hw.complete_oldest_signaled() {
                    q.completed();
                }
                assert_eq!(
                    q.free() + hw.outstanding.len() as u32,
                    depth,
                    "room and the queue disagree (depth {depth}, every {every}, step {step})"
                );
            }
            // Drained: at most every - 1 trailing unsignalled requests keep
            // their entries, and a multi-request post still fits.
            while hw.complete_oldest_signaled() {
                q.completed();
            }
            assert!(depth - q.free() < depth / 4, "room lost: {}", q.free());
            assert!(q.has_room(2));
            if every > 1 {
                assert!(unsignaled_posts > 0, "every {every}: nothing unsignalled");
            }
        }
    }
}

#[test]
fn required_requests_are_signaled_and_runs_are_bounded() {
    let mut q = SendQueue::new(144, 16);
    assert!(q.must_signal(true));
    let mut run = 0;
    for _ in 0..1000 {
        let s = q.must_signal(false);
        q.posted(s);
        if s {
            run = 0;
            q.completed(); // at once: this test is about the runs
        } else {
            run += 1;
        }
        assert!(run < 16, "more than 15 unsignalled requests in a row");
    }
    // every is at most a quarter of the depth
    let mut q = SendQueue::new(24, 100);
    for _ in 0..5 {
        assert!(!q.must_signal(false));
        q.posted(false);
    }
    assert!(q.must_signal(false));
}
