//! Waiting for completions, with a deadline and a watch on the peer.

use std::time::Duration;

use ibvx::verbs::{CompletionQueue, WorkCompletion};

use crate::pingpong::clock::cycles;
use crate::pingpong::error::PingpongError;
use crate::pingpong::net::Link;

/// Deadline and peer watch of one measured phase.
pub(super) struct Watch {
    pub(super) deadline: u64,
    pub(super) next_peek: u64,
    pub(super) peek_every: u64,
    pub(super) timeout: Duration,
}

impl Watch {
    pub(super) fn new(cycles_per_us: f64, timeout: Duration) -> Watch {
        let now = cycles();
        let peek_every = (cycles_per_us * 50_000.0) as u64; // 50 ms
        Watch {
            deadline: now.saturating_add((timeout.as_secs_f64() * 1e6 * cycles_per_us) as u64),
            next_peek: now + peek_every,
            peek_every,
            timeout,
        }
    }

    /// Fails when the phase has run out of time or the peer has gone.
    #[cold]
    pub(super) fn check(
        &mut self,
        link: &Link,
        what: &dyn Fn() -> String,
    ) -> Result<(), PingpongError> {
        let now = cycles();
        if now >= self.deadline {
            return Err(PingpongError::Timeout {
                what: what(),
                secs: self.timeout.as_secs_f64(),
            });
        }
        if now >= self.next_peek {
            self.next_peek = now + self.peek_every;
            if let Some(why) = link.peer_gone() {
                return Err(PingpongError::PeerGone {
                    detail: format!("{why} ({})", what()),
                });
            }
        }
        Ok(())
    }
}

/// A failed verbs call during a run; reported as the peer's departure when
/// the control connection shows it has gone.
pub(super) fn run_error(link: &Link, context: String, e: ibvx::verbs::Error) -> PingpongError {
    match link.peer_gone() {
        Some(why) => PingpongError::PeerGone {
            detail: format!("{why} ({context}: {e})"),
        },
        None => PingpongError::Run { context, source: e },
    }
}

/// Waits for one completion on `cq` (polling, or sleeping on its channel
/// with `events`), checking the watch, and checks its status.
pub(super) fn wait_wc(
    cq: &CompletionQueue,
    events: bool,
    w: &mut Watch,
    link: &Link,
    what: &dyn Fn() -> String,
) -> Result<WorkCompletion, PingpongError> {
    wait_wc_idle(cq, events, None, w, link, what)
}

/// [`wait_wc`], sleeping `idle` between empty polls when given (for waits
/// that are not measured: a spinning process would take a CPU from the
/// kernel's soft-RoCE work on a small machine).
pub(super) fn wait_wc_idle(
    cq: &CompletionQueue,
    events: bool,
    idle: Option<Duration>,
    w: &mut Watch,
    link: &Link,
    what: &dyn Fn() -> String,
) -> Result<WorkCompletion, PingpongError> {
    let mut wc = [WorkCompletion::default()];
    let mut spins = 0u32;
    loop {
        if poll_armed(cq, &mut wc, events, link, what)? == 1 {
            wc[0].ok().map_err(|e| run_error(link, what(), e))?;
            return Ok(wc[0]);
        }
        if events {
            wait_armed(cq, w, link, what)?;
        } else if let Some(pause) = idle {
            std::thread::sleep(pause);
            w.check(link, what)?;
        } else {
            spins = spins.wrapping_add(1);
            if spins % 1024 == 0 {
                w.check(link, what)?;
            }
        }
    }
}

/// Polls `cq` into `wcs` and returns how many completions it took. With
/// `events`, an empty poll arms the queue and polls once more: a completion
/// that arrived before the arming raises no event, so only after a second
/// empty poll may the caller sleep ([`wait_armed`]).
#[inline]
pub(super) fn poll_armed(
    cq: &CompletionQueue,
    wcs: &mut [WorkCompletion],
    events: bool,
    link: &Link,
    what: &dyn Fn() -> String,
) -> Result<usize, PingpongError> {
    let n = cq.poll(wcs).map_err(|e| run_error(link, what(), e))?;
    if n > 0 || !events {
        return Ok(n);
    }
    cq.req_notify(false)
        .map_err(|e| run_error(link, what(), e))?;
    cq.poll(wcs).map_err(|e| run_error(link, what(), e))
}

/// Sleeps on the channel of `cq` (armed by [`poll_armed`]) for up to 50 ms,
/// checking the watch when no event came.
pub(super) fn wait_armed(
    cq: &CompletionQueue,
    w: &mut Watch,
    link: &Link,
    what: &dyn Fn() -> String,
) -> Result<(), PingpongError> {
    let woke = cq
        .wait_event(Some(Duration::from_millis(50)))
        .map_err(|e| run_error(link, what(), e))?;
    if !woke {
        w.check(link, what)?;
    }
    Ok(())
}
