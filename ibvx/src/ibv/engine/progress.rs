//! Progress and sleeping: polling both completion queues, receive and send
//! completions, departures from the bootstrap, waking waiters, and the
//! blocking wait (spin, then sleep on the completion channel or the
//! condition variable).

use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::MutexGuard;
use std::time::{Duration, Instant};

use xdev::devkit::target::{cancelled, lost, unpost};
use xdev::devkit::{Progress, RequestCore};
use xdev::{Error, Rank, Result};

#[cfg(test)]
use super::WR_RAW;
use super::{Dest, IbvEngine, Local, POLL_BATCH, WR_KIND, WR_SLOT, WR_UNSIG, WR_WRITE};
use crate::ibv::wire;
use crate::verbs::WorkCompletion;

/// A blocking wait polls the send CQ on every this many passes (and on
/// its first, and whenever a pass found something): send completions only
/// free send slots and send-queue room, or finish sends that wait for
/// them, and each poll is a locked provider call.
const SEND_POLL_EVERY: u32 = 8;
/// A blocking wait looks at its condition after a pass that moved
/// something, and on every this many passes (another thread's progress
/// may have met it).
const LOOK_EVERY: u32 = 64;
/// Longest sleep of a wait (departures are checked at least this often).
const SLEEP: Duration = Duration::from_millis(20);
/// How often a busy rank looks at the bootstrap's departure list.
const DEPARTURE_CHECK: Duration = Duration::from_millis(20);
/// Calls of a busy wait between two looks at the clock for departures (the
/// clock is a system call in a virtual machine without a stable TSC). Not
/// more: `Request::test` in a loop with a 1 ms sleep calls this once per
/// test, and 65,536 made a departed peer go unnoticed for over a minute
/// (the VM suite's `qp_in_error_state_fails_only_its_peer`).
const DEPARTURE_POLLS: u32 = 4_096;
/// Empty polls of an idle wait before its first yield, back to back (a
/// reply usually comes well within them, and a yield is a system call).
pub(super) const QUIET_POLLS: u32 = 16_384;
/// Empty polls of an idle wait before it sleeps (the sleep-after-spin rule
/// that keeps an oversubscribed host moving); between [`QUIET_POLLS`] and
/// this, a spin-loop hint between polls and a yield every 64.
pub(super) const SPIN_POLLS: u32 = QUIET_POLLS + 3_000;

/// What an idle wait does after an empty poll.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum IdleStep {
    /// Poll again at once.
    Poll,
    /// A spin-loop hint (`pause`), then poll.
    Pause,
    /// Give the core away once (`sched_yield`), then poll.
    Yield,
    /// Arm the completion queues and sleep (the sleep-after-spin rule).
    Sleep,
}

/// The spin policy of [`IbvEngine::block_until`], by count of empty polls
/// (no clock: reading it is a system call in the soft-RoCE guest): the
/// first [`QUIET_POLLS`] back to back, then a spin-loop hint between polls
/// and a yield every 64, and from [`SPIN_POLLS`] on, sleep.
///
/// No `pause` while quiet: under qemu TCG a `pause` leaves the translated
/// code (it took three quarters of the spinning wait's own samples). A
/// quiet poll is so several times cheaper than a poll with `pause` (and a
/// wait's pass only polls the receive CQ), so the quiet count is 16 times
/// the old 1,024 polls with `pause`: with a count too small, a cheaper poll
/// reaches the yields and the sleep sooner, raising the system calls per
/// message. A policy by time (the clock read every 2,048 polls, 500 us
/// quiet, 5 ms to the sleep) was tried: its clock reads and yields made
/// 3.61 calls per message in the VM suite's strace count (1.57x perftest).
#[derive(Debug, Default)]
pub(super) struct Spin {
    idle: u32,
}

impl Spin {
    /// Something happened: the next empty poll starts a new idle spell.
    pub(super) fn reset(&mut self) {
        self.idle = 0;
    }

    /// The step after one more empty poll.
    pub(super) fn step(&mut self) -> IdleStep {
        self.idle = self.idle.saturating_add(1);
        let idle = self.idle;
        if idle >= SPIN_POLLS {
            IdleStep::Sleep
        } else if idle <= QUIET_POLLS {
            IdleStep::Poll
        } else if (idle - QUIET_POLLS) % 64 == 0 {
            IdleStep::Yield
        } else {
            IdleStep::Pause
        }
    }
}

fn wr_error(wc: &WorkCompletion, peer: Rank, what: &str) -> Error {
    let status = wc.status();
    tracing::warn!(
        peer,
        status = wc.status_str(),
        vendor_err = wc.vendor_err(),
        "{what}: work completion error; the queue pair is in the error state"
    );
    if status == ibvx_sys::IBV_WC_RETRY_EXC_ERR || status == ibvx_sys::IBV_WC_RNR_RETRY_EXC_ERR {
        lost(
            peer,
            &format!("{what}: {} (peer unreachable)", wc.status_str()),
        )
    } else {
        Error::transport(
            format!("{what} to rank {peer}"),
            std::io::Error::other(format!(
                "{} (vendor error {:#x})",
                wc.status_str(),
                wc.vendor_err()
            )),
        )
    }
}

impl IbvEngine {
    /// Polls both completion queues and moves queued work; true if anything
    /// happened.
    pub(super) fn progress_locked(&self, l: &mut Local) -> bool {
        self.progress_polling(l, true, 0)
    }

    /// [`progress_locked`](Self::progress_locked), polling the send CQ only
    /// with `poll_send` (a blocking wait polls it every [`SEND_POLL_EVERY`]
    /// passes: see `block_until`); the first `polled` receive completions
    /// are already in `l.wcs` (the wait's own poll found them).
    ///
    /// Receive slots handled in one pass are re-posted at the start of the
    /// next (or at once in a burst of [`POLL_BATCH`]), so that re-posting
    /// them is not between a message's arrival and the caller's next step
    /// (a reply, in a pingpong). The credit they return goes out in that
    /// next pass, with the message or `CREDIT` that carries it.
    pub(super) fn progress_polling(&self, l: &mut Local, poll_send: bool, polled: usize) -> bool {
        let before = l.events;
        let mut polled = polled;
        let reposted = !l.reposts.is_empty();
        if reposted {
            self.repost_all(l);
        }
        let mut wcs = std::mem::take(&mut l.wcs);
        loop {
            let n = if polled > 0 {
                std::mem::take(&mut polled)
            } else {
                self.fab.recv_cq.poll(&mut wcs).unwrap_or(0)
            };
            for wc in &wcs[..n] {
                self.on_recv_completion(l, wc);
            }
            if n == POLL_BATCH && !l.reposts.is_empty() {
                self.repost_all(l);
            }
            let m = if poll_send {
                self.fab.send_cq.poll(&mut wcs).unwrap_or(0)
            } else {
                0
            };
            for wc in &wcs[..m] {
                self.on_send_completion(l, wc);
            }
            l.events += (n + m) as u64;
            if n < POLL_BATCH && m < POLL_BATCH {
                break;
            }
        }
        l.wcs = wcs;
        let any = l.events != before;
        if any || reposted {
            // Completions return credits, send slots and send-queue room,
            // and re-posted slots are credit owed: what waited for them
            // (queued messages, credit owed to peers) goes now. Nothing
            // else frees these resources.
            for d in 0..self.fab.size {
                if d == self.fab.rank {
                    continue;
                }
                let p = &l.peers[d];
                if !p.control.is_empty() || !p.backlog.is_empty() {
                    self.flush_peer(l, d);
                }
                let p = &l.peers[d];
                if p.owed_slots > 0 || p.owed_bytes > 0 {
                    self.return_credit(l, d);
                }
            }
        }
        if any {
            self.notify(l);
        }
        any
    }

    pub(super) fn on_recv_completion(&self, l: &mut Local, wc: &WorkCompletion) {
        let src = (wc.wr_id() >> 32) as Rank;
        let slot = wc.wr_id() as u32;
        if src >= self.fab.size || src == self.fab.rank {
            return; // not ours (cannot happen)
        }
        if !wc.is_success() {
            // Flushes after we failed the peer are expected; anything else
            // (the queue pair entered the error state) fails it now.
            if l.peers[src].gone.is_none() {
                let e = wr_error(wc, src, "receive");
                self.fail_peer(l, src, e);
            }
            return;
        }
        if l.peers[src].gone.is_some() {
            return; // its queue pair is in the error state
        }
        let off = self.fab.recv_offset(src, slot);
        let len = (wc.byte_len() as usize).min(self.fab.slot_len);
        // SAFETY: slot (src, slot) is not posted (its completion is being
        // handled), so neither the NIC nor a peer writes it until `repost`
        // below; the range is inside the receive region.
        let frame = unsafe {
            std::slice::from_raw_parts(self.fab.recv_mr.as_mut_ptr().add(off).cast_const(), len)
        };
        match self.on_frame(l, src, frame) {
            Ok(kind) => {
                if l.peers[src].gone.is_none() {
                    // Re-posted with the batch, at the start of the next
                    // pass, and the credit owed goes then (progress_polling).
                    l.reposts.push((src, slot, kind != wire::Kind::Credit));
                }
            }
            Err(what) => {
                let e = Error::Protocol { rank: src, what };
                self.fail_peer(l, src, e);
            }
        }
    }

    pub(super) fn on_send_completion(&self, l: &mut Local, wc: &WorkCompletion) {
        let id = wc.wr_id();
        let (dest, completes) = match id & WR_KIND {
            WR_SLOT => {
                let slot = (id & !WR_KIND) as u32;
                let u = l.slot_use[slot as usize];
                l.slot_use[slot as usize] = (0, None);
                l.free_slots.push(slot);
                u
            }
            WR_WRITE => {
                // A failed write ends its send at once (later requests of
                // the queue pair are flushed, not executed); a successful
                // one waits for its RNDZ_END.
                let send = id & !WR_KIND;
                let Some(s) = l.sends.get(&send) else {
                    return; // already failed by an earlier write
                };
                (s.dest, (!wc.is_success()).then_some(send))
            }
            WR_UNSIG => {
                // Only a flush (the queue pair failed) completes an
                // unsignalled send; nothing waits for it, and its slot is
                // free since it was posted (inline).
                let dest = (id & !WR_KIND) as Rank;
                if dest < self.fab.size && !wc.is_success() && l.peers[dest].gone.is_none() {
                    self.fail_peer(l, dest, wr_error(wc, dest, "send"));
                }
                return;
            }
            #[cfg(test)]
            WR_RAW => {
                let dest = (id & !WR_KIND) as Rank;
                l.raw_write = Some(if wc.is_success() {
                    Ok(())
                } else {
                    Err(wr_error(wc, dest, "raw RDMA write").to_string())
                });
                Self::sq_completed(l, dest);
                if !wc.is_success() && l.peers[dest].gone.is_none() {
                    self.fail_peer(l, dest, wr_error(wc, dest, "raw RDMA write"));
                }
                return;
            }
            _ => return,
        };
        Self::sq_completed(l, dest);
        let result = if wc.is_success() {
            Ok(())
        } else {
            let e = l.peers[dest]
                .gone
                .clone()
                .unwrap_or_else(|| wr_error(wc, dest, "send"));
            if l.peers[dest].gone.is_none() {
                self.fail_peer(l, dest, e.clone());
            }
            Err(e)
        };
        if let Some(send) = completes {
            self.complete_send(l, send, result);
        }
    }

    /// Makes progress until `done` (called under the lock after progress)
    /// says so: spins a while, then sleeps on the completion channel (one
    /// thread) or the condition variable (the others). With
    /// `until_closed`, a closed device ends the wait with `Closed`.
    pub(super) fn block_until(
        &self,
        until_closed: bool,
        done: impl FnMut(&Self, &mut Local) -> Result<bool>,
    ) -> Result<()> {
        self.wait_locked(self.lock(), until_closed, done).1
    }

    /// [`block_until`](Self::block_until) from the engine lock `l` the
    /// caller holds, which it gets back (held) with the outcome: a caller
    /// that posted under the lock and reads its result under it saves a
    /// lock and an unlock on each side of the wait.
    pub(super) fn wait_locked<'a>(
        &'a self,
        mut l: MutexGuard<'a, Local>,
        until_closed: bool,
        mut done: impl FnMut(&Self, &mut Local) -> Result<bool>,
    ) -> (MutexGuard<'a, Local>, Result<()>) {
        let mut spin = Spin::default();
        let mut pass = 0u32;
        loop {
            // Most passes only poll the receive CQ here; the full pass (the
            // send CQ too, re-posts) only when that found something, or
            // every SEND_POLL_EVERY passes. Under qemu TCG every call and
            // return of a pass costs, and nothing else is done there.
            let moved = if pass % SEND_POLL_EVERY != 0 && l.reposts.is_empty() {
                let n = self.fab.recv_cq.poll(&mut l.wcs).unwrap_or(0);
                n > 0 && self.progress_polling(&mut l, false, n)
            } else {
                self.progress_polling(&mut l, true, 0)
            };
            // `done` changes with this thread's progress, or (rarely) with
            // another thread's: looked at after progress, and every
            // LOOK_EVERY passes.
            let look = moved || pass % LOOK_EVERY == 0;
            pass = if moved { 0 } else { pass.wrapping_add(1) };
            self.check_departures(&mut l, false);
            if look {
                match done(self, &mut l) {
                    Ok(false) => {}
                    r => return (l, r.map(drop)),
                }
            }
            if until_closed && self.closed.load(Ordering::Acquire) {
                return (l, Err(Error::Closed));
            }
            if moved {
                spin.reset();
            }
            let step = spin.step();
            if step != IdleStep::Sleep {
                drop(l);
                match step {
                    IdleStep::Yield => std::thread::yield_now(),
                    IdleStep::Pause => std::hint::spin_loop(),
                    _ => {}
                }
                l = self.lock();
                continue;
            }
            if !self.sleeper.swap(true, Ordering::AcqRel) {
                // Arm, then look once more: a completion that arrived
                // before arming raises no event.
                let armed = self.fab.send_cq.req_notify(false).is_ok()
                    && self.fab.recv_cq.req_notify(false).is_ok();
                let moved = self.progress_locked(&mut l);
                let finished = match done(self, &mut l) {
                    Ok(false) => None,
                    r => Some(r.map(drop)),
                };
                // Not sleeping after all: the sleeper's role goes back.
                if finished.is_some() || !armed || moved {
                    self.sleeper.store(false, Ordering::Release);
                    match finished {
                        Some(r) => return (l, r),
                        None => continue,
                    }
                }
                drop(l);
                self.sleep_on_channel();
                self.sleeper.store(false, Ordering::Release);
                l = self.lock();
                // Others may be waiting for what the channel announced.
                if l.cond_waiters > 0 {
                    self.cond.notify_all();
                }
            } else {
                l.cond_waiters += 1;
                l = self
                    .cond
                    .wait_timeout(l, SLEEP)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
                l.cond_waiters -= 1;
            }
            self.check_departures(&mut l, true);
        }
    }

    /// Applies the bootstrap's departure notices (at most every
    /// [`DEPARTURE_CHECK`] unless `now`).
    #[inline]
    pub(super) fn check_departures(&self, l: &mut Local, now: bool) {
        if !now {
            // The clock is read every DEPARTURE_POLLS calls only: a busy
            // wait calls this on every poll, and reading the clock can be a
            // system call (in a virtual machine, it often is). Inlined: a
            // call per pass costs under qemu TCG.
            l.departure_polls += 1;
            if l.departure_polls < DEPARTURE_POLLS {
                return;
            }
            l.departure_polls = 0;
        }
        self.apply_departures(l, now);
    }

    #[inline(never)]
    fn apply_departures(&self, l: &mut Local, now: bool) {
        if !now && l.last_departure_check.elapsed() < DEPARTURE_CHECK {
            return;
        }
        l.last_departure_check = Instant::now();
        let Ok(deps) = self.boot.departures() else {
            return;
        };
        if deps.len() == l.departures_seen {
            return;
        }
        l.departures_seen = deps.len();
        // What departed peers sent before leaving is delivered first.
        self.progress_locked(l);
        for d in deps {
            if d.rank < self.fab.size && l.peers[d.rank].gone.is_none() && d.rank != self.fab.rank {
                let why = if d.clean {
                    "peer finished"
                } else {
                    "peer process died or lost its connection"
                };
                self.fail_peer(l, d.rank, lost(d.rank, why));
            }
        }
        self.notify(l);
    }

    /// Wakes threads waiting for something to complete (`l` is the locked
    /// state: waiters register there before they sleep).
    pub(super) fn notify(&self, l: &Local) {
        if l.cond_waiters > 0 {
            self.cond.notify_all();
        }
        if self.sleeper.load(Ordering::Acquire) {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a valid u64 to our eventfd.
            unsafe {
                libc::write(
                    self.wake.as_raw_fd(),
                    (&one as *const u64).cast(),
                    std::mem::size_of::<u64>(),
                )
            };
        }
    }

    /// Sleeps on the completion channel and the wake-up eventfd; the
    /// caller holds the sleeper role and has armed both queues.
    pub(super) fn sleep_on_channel(&self) {
        let mut fds = [
            libc::pollfd {
                fd: self.fab.channel.fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two valid pollfds.
        unsafe { libc::poll(fds.as_mut_ptr(), 2, SLEEP.as_millis() as libc::c_int) };
        if fds[0].revents & libc::POLLIN != 0 {
            // Take (and acknowledge) every pending event without blocking.
            while let Ok(Some(_)) = self.fab.channel.get_event(Some(Duration::ZERO)) {}
        }
        if fds[1].revents & libc::POLLIN != 0 {
            let mut v: u64 = 0;
            // SAFETY: reads 8 bytes into a valid u64 from our non-blocking eventfd.
            unsafe {
                libc::read(
                    self.wake.as_raw_fd(),
                    (&mut v as *mut u64).cast(),
                    std::mem::size_of::<u64>(),
                )
            };
        }
    }
}

impl Progress for IbvEngine {
    fn progress(&self) {
        if let Ok(mut l) = self.local.try_lock() {
            self.progress_locked(&mut l);
            self.check_departures(&mut l, false);
        }
    }

    fn wait(&self, core: &RequestCore) {
        let _ = self.block_until(true, |_, _| Ok(core.is_done()));
        // A closed device completes every request it holds; spin out the
        // tiny window before that completion lands.
        while !core.is_done() {
            std::thread::yield_now();
        }
    }

    fn cancel(&self, core: &xdev::devkit::CoreRef) -> bool {
        let mut l = self.lock();
        let t = unpost(&mut l.matching, core);
        t.map(|t| self.complete_target(&mut l, Dest::Recv(t), cancelled()))
            .is_some()
    }
}

#[cfg(test)]
mod tests;
