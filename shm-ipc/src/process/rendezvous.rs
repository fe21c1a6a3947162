//! The process device's rendezvous: the receiver's CMA copy (whole, or
//! split with the sender, who writes the tail), copies left by posting calls
//! to the next progress, and the pipelined stream through the ring where CMA
//! is not allowed or not worth it.

use std::sync::Arc;

use xdev::devkit::shared_arena;
use xdev::devkit::target::{lost, BlockingRecv, BlockingSend, SendOwner, Target};
use xdev::{Envelope, Error, Rank, Result, Status};

use super::medium::{Eng, Loc, ProcessMedium};
use crate::engine::{Direct, Outcome, Publication, Sent};
use crate::ring::Header;
use crate::wire::{
    FLAG_EXPECTING, FLAG_FAILED, FLAG_MAPPED, KIND_DATA, KIND_FIN, KIND_PULL, KIND_RNDV,
    KIND_WRITE, RNDV_MAPPED_BYTES, SPLIT_PAGE,
};

/// A send that waits for the receiver.
pub(super) struct OutSend {
    pub(super) dest: Rank,
    pub(super) env: Envelope,
    pub(super) data: *const u8,
    pub(super) len: usize,
    pub(super) owner: SendOwner,
    /// Bytes already streamed (pipelined rendezvous), once `PULL`ed.
    pub(super) streamed: Option<usize>,
    /// A rendezvous (counted in `ProcessState::rndv_out`), not a synchronous
    /// eager send.
    pub(super) rndv: bool,
    /// Its tail was written into the receiver (`KIND_WRITE`).
    pub(super) wrote: bool,
}

// SAFETY: `data` is only read (by this rank, under its lock, or by the
// receiver through CMA) while the send's buffer is guaranteed alive: owned by
// its request, or borrowed by a blocking send that waits for completion.
unsafe impl Send for OutSend {}
// SAFETY: as above; OutSend is only accessed under the rank lock.
unsafe impl Sync for OutSend {}

/// A rendezvous start as the receiver keeps it: the sender's send id and
/// buffer address, whether the sender may be asked to write half of it
/// (a split copy; not while it expects data itself, `FLAG_EXPECTING`), and
/// where the buffer lies in the sender's shared arena, if it does
/// (`FLAG_MAPPED`: its descriptor number there, the offset).
#[derive(Copy, Clone, Debug)]
pub struct RndvStart {
    pub(super) id: u64,
    pub(super) addr: u64,
    pub(super) may_split: bool,
    pub(super) mapped: Option<(i32, u64)>,
}

/// A split CMA copy under way: we read the head, the sender writes the
/// tail.
pub struct SplitStart {
    /// The sender's send id.
    pub(super) id: u64,
    /// The sender's buffer (for reading the tail ourselves if it could
    /// not write it), and where it lies in its shared arena, if it does.
    pub(super) addr: u64,
    pub(super) mapped: Option<(i32, u64)>,
    pub(super) len: usize,
    /// Where the tail starts.
    pub(super) half: usize,
    /// Our read of the head failed: the receive fails, once the sender is
    /// done with our buffer.
    pub(super) head_failed: Option<Error>,
}

/// A split copy's receive, completed at the sender's `KIND_WROTE`.
pub(super) struct SplitRecv {
    pub(super) start: SplitStart,
    pub(super) target: Target,
    pub(super) env: Envelope,
}

/// A pipelined rendezvous being received.
pub(super) struct InStream {
    pub(super) target: Target,
    pub(super) env: Envelope,
    pub(super) len: usize,
    pub(super) got: usize,
}

/// A matched rendezvous whose transfer goes on.
pub enum Later {
    /// A pipelined rendezvous: data will arrive in fragments.
    Stream { id: u64, len: usize },
    /// A CMA rendezvous matched inside a posting call: the copy is left to
    /// the next progress ([`PendingCopy`]), so that the caller goes on
    /// posting (its peer may be waiting for its sends) instead of copying.
    /// (Also a copy large enough to split: the split needs its target.)
    Copy { start: RndvStart, len: usize },
    /// A split CMA copy (see [`SplitRecv`]): the head is read, the tail
    /// comes from the sender.
    Split(SplitStart),
}

/// A matched CMA rendezvous whose copy waits for the next progress (see
/// [`Later::Copy`]). Its target is always a request, whose core owns the
/// buffer until it completes.
pub(super) struct PendingCopy {
    env: Envelope,
    start: RndvStart,
    len: usize,
    target: Target,
}

impl ProcessMedium {
    /// The receiver side of a rendezvous once matched: one CMA copy and
    /// `FIN`, or a `PULL` for the pipelined path, or left to `copy_now`
    /// (while a posting call works, or to split it: `copy_now` knows the
    /// target).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn start_rendezvous(
        e: &Eng,
        l: &mut Loc,
        env: Envelope,
        len: usize,
        r: RndvStart,
        dst: *mut u8,
        cap: usize,
    ) -> Outcome<Later> {
        let s = env.source;
        let n = len.min(cap);
        if n > 0
            && !l.gone[s]
            && Self::by_cma(e, l, s, n)
            && (l.defer_copies || Self::splits(e, l, s, &r, n, len))
        {
            return Outcome::Later(Later::Copy { start: r, len });
        }
        Self::transfer(e, l, env, (r, len), dst, cap, false)
    }

    /// [`ProcessMedium::cma_transfer`], and a rendezvous finished here (FIN
    /// sent, or failed) leaves the sender's window. A stream leaves it when
    /// it ends, a split copy at its `KIND_WROTE` (`stream_ended`).
    fn transfer(
        e: &Eng,
        l: &mut Loc,
        env: Envelope,
        rndv: (RndvStart, usize),
        dst: *mut u8,
        cap: usize,
        split: bool,
    ) -> Outcome<Later> {
        let out = Self::cma_transfer(e, l, env, rndv, dst, cap, split);
        if let Outcome::Done(_) = out {
            Self::stream_ended(l, env.source);
        }
        out
    }

    /// A rendezvous transfer into a receive ended (complete, abandoned by
    /// its receive, or failed).
    pub(super) fn stream_ended(l: &mut Loc, s: Rank) {
        l.m.rndv_in[s] = l.m.rndv_in[s].saturating_sub(1);
    }

    /// Whether the CMA copy of `n` of the `len` bytes of `r`, from `s`, is
    /// split with its sender: a whole message of at least `cma_split_bytes`,
    /// and a sender whose core is free for it. In a two-way exchange it is
    /// busy with data of its own: while our own rendezvous to it is out (its
    /// core is copying our data; measured: osu_bibw 10% slower at 64-256 KiB
    /// with a split) or when its `RNDV` says it waits for data from us
    /// (`FLAG_EXPECTING`). Both say what held when the header was sent; the
    /// sender's idle word
    /// ([`Inbox::idle`](crate::segment::Inbox::idle)) says what holds now,
    /// and wins when it says idle: at the end of an osu_bibw window the rank
    /// that finished its receives first waits for the other's last copies,
    /// and can write half of each (traced at 256 KiB: the faster rank idled
    /// a median 260 us of every 2.2 ms window).
    fn splits(e: &Eng, l: &Loc, s: Rank, r: &RndvStart, n: usize, len: usize) -> bool {
        let min = e.m.sh.opts.cma_split_bytes;
        let free = (r.may_split && l.m.rndv_out[s] == 0) || e.m.sh.inbox(s).idle();
        Self::by_cma(e, l, s, n) && free && min > 0 && n == len && n >= min.max(2 * SPLIT_PAGE)
    }

    /// Whether `n` bytes from `s` are copied by CMA: CMA is used with `s`,
    /// and the copy is at least `cma_min_bytes` (shorter ones take the
    /// pipelined copy, which is faster there: see
    /// [`ProcessOptions::cma_min_bytes`](super::ProcessOptions::cma_min_bytes)).
    #[inline]
    fn by_cma(e: &Eng, l: &Loc, s: Rank, n: usize) -> bool {
        l.m.cma[s] && n >= e.m.sh.opts.cma_min_bytes
    }

    /// Publishes whether this rank is idle for receiving: no receive posted,
    /// no rendezvous copy, split or stream of its own under way
    /// ([`Inbox::set_idle`](crate::segment::Inbox::set_idle)), when that
    /// changed. Called after each progress round and before each rendezvous
    /// header we send, so a peer that reads our header finds us busy if our
    /// receives were posted first (as osu_bibw posts them).
    pub(super) fn publish_idle(e: &Eng, l: &mut Loc) {
        let idle = l.matching.posted_len() == 0
            && l.m.copies.is_empty()
            && l.m.splits.is_empty()
            && l.m.streams_in.is_empty();
        if idle != l.m.idle_published {
            e.m.sh.mine.set_idle(idle);
            l.m.idle_published = idle;
        }
    }

    /// Whether a CMA call on peer `s` may be made now: it has not departed
    /// (as far as we know, by its state word, or by the watch) and its
    /// process has not exited, asked of its pidfd right before the call.
    /// CMA names a process by pid: after an exit the pid may be reaped and
    /// given to an unrelated process, which a call by pid would then read
    /// or write (issue 21); a pidfd stays bound to the process it was opened
    /// for. Every CMA call on a peer asks this first.
    pub(super) fn may_copy_with(e: &Eng, l: &Loc, s: Rank) -> bool {
        if l.gone[s] || e.m.sh.gone(s) {
            return false;
        }
        e.m.watch
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .is_some_and(|w| !w.has_exited(s))
    }

    /// The receiver's side of a matched rendezvous: nothing to copy (`FIN`),
    /// the CMA copy (split with the sender if `split` and large enough), or
    /// a `PULL` for the pipelined path if CMA is not (or no longer) allowed.
    fn cma_transfer(
        e: &Eng,
        l: &mut Loc,
        env: Envelope,
        (r, len): (RndvStart, usize),
        dst: *mut u8,
        cap: usize,
        split: bool,
    ) -> Outcome<Later> {
        let s = env.source;
        let RndvStart { id, addr, .. } = r;
        // A sender that left cannot have finished with this send
        // outstanding: it died (or claims to have left; either way we copy
        // nothing from a departed peer). Its process is asked (a system
        // call) only when we are about to copy from it by CMA: the
        // pipelined path takes the data from the ring.
        let n = len.min(cap);
        let cma = Self::by_cma(e, l, s, n);
        let departed = if cma {
            !Self::may_copy_with(e, l, s)
        } else {
            l.gone[s] || e.m.sh.gone(s)
        };
        if departed {
            return Outcome::Done(Status::failed(env, lost(s, "sender died")));
        }
        if n == 0 {
            Self::reply(e, l, s, KIND_FIN, 0, id);
            return Outcome::Done(Status::received(env, len, cap));
        }
        if split && Self::splits(e, l, s, &r, n, len) {
            return Outcome::Later(Later::Split(Self::split_copy(e, l, s, (r, len), dst, n)));
        }
        if cma {
            // SAFETY: dst is valid for cap >= n bytes and exclusively ours
            // (a matched target's buffer or the caller's slice).
            let out = unsafe { std::slice::from_raw_parts_mut(dst, n) };
            if Self::mapped_copy(e, l, s, r.mapped, out) {
                Self::reply(e, l, s, KIND_FIN, 0, id);
                return Outcome::Done(Status::received(env, len, cap));
            }
            match crate::cma::read_remote(e.m.sh.pids[s], addr, out) {
                Ok(()) => {
                    Self::reply(e, l, s, KIND_FIN, 0, id);
                    return Outcome::Done(Status::received(env, len, cap));
                }
                Err(err) if matches!(err.raw_os_error(), Some(libc::EPERM | libc::ENOSYS)) => {
                    tracing::info!(peer = s, error = %err, "shm: CMA refused; rendezvous from this peer falls back to the pipelined copy");
                    l.m.cma[s] = false;
                }
                Err(err) if err.raw_os_error() == Some(libc::ESRCH) => {
                    return Outcome::Done(Status::failed(env, lost(s, "sender process is gone")));
                }
                Err(err) => {
                    Self::reply(e, l, s, KIND_FIN, FLAG_FAILED, id);
                    let what = format!("rendezvous source {addr:#x}+{len} unreadable: {err}");
                    return Outcome::Done(Status::failed(env, Error::Protocol { rank: s, what }));
                }
            }
        }
        Self::reply(e, l, s, KIND_PULL, 0, id);
        l.m.pulls_sent += 1;
        Outcome::Later(Later::Stream { id, len })
    }

    /// Starts a split copy of `n` bytes from `s` into `dst`: the sender
    /// writes [half, n) while we read [0, half), so both cores copy. It
    /// answers KIND_WROTE after its write, and gets our FIN after our read
    /// (in this order in its ring: WRITE first).
    fn split_copy(
        e: &Eng,
        l: &mut Loc,
        s: Rank,
        (r, len): (RndvStart, usize),
        dst: *mut u8,
        n: usize,
    ) -> SplitStart {
        let RndvStart { id, addr, .. } = r;
        let half = (n / 2) / SPLIT_PAGE * SPLIT_PAGE;
        let mut h = Header {
            kind: KIND_WRITE,
            cookie: id,
            aux: dst as u64 + half as u64,
            context: (half / SPLIT_PAGE) as u32,
            ..Header::default()
        };
        // SAFETY: dst is valid for n > half bytes (only its address range
        // is looked at here).
        let tail = unsafe { std::slice::from_raw_parts(dst.add(half), n - half) };
        Self::ask_mapped_write(l, s, &mut h, tail);
        Self::control(e, l, s, h);
        // SAFETY: dst is valid for cap >= n > half bytes and ours: the
        // sender writes only [half, n).
        let head = unsafe { std::slice::from_raw_parts_mut(dst, half) };
        // From the sender's mapped arena where it can, else by CMA.
        let read = if Self::mapped_copy(e, l, s, r.mapped, head) {
            Ok(())
        } else {
            crate::cma::read_remote(e.m.sh.pids[s], addr, head)
        };
        let head_failed = match read {
            Ok(()) => {
                Self::reply(e, l, s, KIND_FIN, 0, id);
                None
            }
            Err(err) if err.raw_os_error() == Some(libc::ESRCH) => {
                Some(lost(s, "sender process is gone"))
            }
            Err(err) => {
                Self::reply(e, l, s, KIND_FIN, FLAG_FAILED, id);
                let what = format!("rendezvous source {addr:#x}+{half} unreadable: {err}");
                Some(Error::Protocol { rank: s, what })
            }
        };
        SplitStart {
            id,
            addr,
            mapped: r.mapped,
            len,
            half,
            head_failed,
        }
    }

    fn start_stream(l: &mut Loc, env: Envelope, id: u64, len: usize, target: Target) {
        let st = InStream {
            target,
            env,
            len,
            got: 0,
        };
        l.m.streams_in.insert((env.source, id), st);
    }

    /// Goes on with a rendezvous for a queued target.
    pub(super) fn settle_later(e: &Eng, l: &mut Loc, env: Envelope, x: Later, target: Target) {
        match x {
            Later::Stream { id, len } => Self::start_stream(l, env, id, len, target),
            Later::Split(start) => Self::hold_split(l, env, start, target),
            Later::Copy { start, len } => {
                let c = PendingCopy {
                    env,
                    start,
                    len,
                    target,
                };
                if !c.target.is_blocking() {
                    // A request's (held or lent): at the next progress.
                    l.m.copies.push_back(c);
                } else {
                    // A blocking receive (another thread's): now.
                    Self::copy_now(e, l, c);
                }
            }
        }
    }

    /// Keeps a split copy's receive until the sender's `KIND_WROTE`.
    fn hold_split(l: &mut Loc, env: Envelope, start: SplitStart, target: Target) {
        let key = (env.source, start.id);
        l.m.splits.insert(key, SplitRecv { start, target, env });
    }

    /// Does a deferred CMA copy (or whatever its rendezvous turns into now)
    /// and settles its target.
    fn copy_now(e: &Eng, l: &mut Loc, c: PendingCopy) {
        let (dst, cap) = c.target.dst();
        // A request's buffer stays with its core until it completes; a
        // blocking receive's `Unpost` guard waits for a split copy into its
        // slice to end (see `abandon`): the sender may write into either.
        let out = Self::transfer(e, l, c.env, (c.start, c.len), dst, cap, true);
        e.settle(l, c.env, out, c.target);
    }

    /// Does the CMA copies left by posting calls.
    pub(super) fn flush_copies(e: &Eng, l: &mut Loc) -> bool {
        let mut any = false;
        while let Some(c) = l.m.copies.pop_front() {
            Self::copy_now(e, l, c);
            any = true;
        }
        any
    }

    /// Goes on with a rendezvous into a blocking receive's own buffer.
    pub(super) fn continue_blocking(
        e: &Eng,
        l: &mut Loc,
        env: Envelope,
        x: Later,
        d: &mut Direct<'_, Later>,
    ) {
        let b = match x {
            Later::Copy { start, len } => {
                // Copy into its slice now (split with the sender if large:
                // its guard then waits for the sender).
                let (p, n) = (d.buf.as_mut_ptr(), d.buf.len());
                let out = Self::transfer(e, l, env, (start, len), p, n, true);
                return e.settle_direct(l, env, out, d);
            }
            Later::Split(start) => {
                let b = BlockingRecv::new(d.buf);
                Self::hold_split(l, env, start, Target::Blocking(b.clone()));
                b
            }
            Later::Stream { id, len } => {
                let b = BlockingRecv::new(d.buf);
                Self::start_stream(l, env, id, len, Target::Blocking(b.clone()));
                b
            }
        };
        if let Some(g) = d.guard {
            *g.borrow_mut() = Some((b.clone(), None));
        }
        d.stream = Some(b);
        #[cfg(test)]
        if super::tests::PANIC_AFTER_STREAM.with(|p| p.replace(false)) {
            panic!("injected: unwinding out of a blocking receive being streamed or split");
        }
    }

    /// Registers a send that waits for a reply (`ACK`, `FIN`, `PULL`).
    pub(super) fn publish_send(
        e: &Eng,
        l: &mut Loc,
        p: Publication<'_>,
    ) -> Sent<Arc<BlockingSend>> {
        let Publication {
            out,
            mut header,
            payload,
            request,
        } = p;
        let id = l.m.next_id;
        header.cookie = id;
        let rndv = header.kind == KIND_RNDV;
        let mut start = [0u8; RNDV_MAPPED_BYTES];
        let mut payload = payload;
        if rndv {
            Self::publish_idle(e, l);
            // A rendezvous is synchronous anyway (no FLAG_SYNC); what the
            // receiver needs to know is whether we expect data from it.
            header.flags = if l.matching.posted_from(out.dest) {
                FLAG_EXPECTING
            } else {
                0
            };
            // And where the buffer lies in our shared arena, if it does.
            if let Some(span) = shared_arena::span_of(out.data) {
                start[..8].copy_from_slice(&payload[..8]);
                start[8..16].copy_from_slice(&(span.fd as u64).to_le_bytes());
                start[16..].copy_from_slice(&span.offset.to_le_bytes());
                header.flags |= FLAG_MAPPED;
                payload = &start[..];
            }
        }
        match e.push_message(l, out.dest, &header, payload) {
            Ok(true) => {}
            Ok(false) => return Sent::Full,
            Err(err) => return Sent::Refused(err),
        }
        if rndv {
            l.m.rndv_out[out.dest] += 1;
        }
        l.m.next_id += 1;
        let (owner, waiter) = match request {
            Some(core) => (SendOwner::Request(core.clone()), None),
            None => {
                let w = BlockingSend::new();
                (SendOwner::Blocking(w.clone()), Some(w))
            }
        };
        let send = OutSend {
            dest: out.dest,
            env: out.env(),
            data: out.data.as_ptr(),
            len: out.data.len(),
            owner,
            streamed: None,
            rndv,
            wrote: false,
        };
        l.m.sends.insert(id, send);
        Sent::Waiting(waiter)
    }

    /// Waits until a blocking send's waiter is done; this wait ignores our
    /// own closing (finish() waits for it instead).
    pub(super) fn wait_done(e: &Eng, w: &Arc<BlockingSend>) {
        if w.is_done() {
            return;
        }
        let _ = e.wait_until(false, || w.is_done());
    }

    /// Pushes fragments of `PULL`ed sends while their rings have room.
    pub(super) fn flush_streams(e: &Eng, l: &mut Loc) -> bool {
        let mut any = false;
        for d in 0..e.size {
            if Self::stream_to(e, l, d) {
                any = true;
                e.wake(d);
            }
        }
        any
    }

    /// Pushes fragments of the sends `PULL`ed by `d`; returns whether any
    /// went.
    fn stream_to(e: &Eng, l: &mut Loc, d: Rank) -> bool {
        let frag = e.m.sh.fragment;
        let mut pushed = false;
        while let Some(&id) = l.m.streams_out[d].front() {
            let Some(s) = l.m.sends.get(&id) else {
                l.m.streams_out[d].pop_front();
                l.m.streams_total -= 1;
                continue;
            };
            let (data, len) = (s.data, s.len);
            let mut off = s.streamed.unwrap_or(0);
            while off < len {
                let n = frag.min(len - off);
                let h = Header {
                    kind: KIND_DATA,
                    cookie: id,
                    aux: off as u64,
                    ..Header::default()
                };
                // SAFETY: the send's buffer is valid for len bytes until
                // the send completes (owned by its request, or borrowed by
                // a blocking send that waits for completion).
                let chunk = unsafe { std::slice::from_raw_parts(data.add(off), n) };
                match e.try_push(l, d, &h, chunk) {
                    Ok(true) => {}
                    Ok(false) => {
                        if let Some(s) = l.m.sends.get_mut(&id) {
                            s.streamed = Some(off);
                        }
                        e.producer(l, d).set_waiting(true);
                        return pushed;
                    }
                    // The peer was failed: its streams are gone.
                    Err(_) => return pushed,
                }
                pushed = true;
                off += n;
            }
            let s = l.m.sends.remove(&id).expect("present");
            Self::complete_send(e, l, s, Ok(()));
            l.m.streams_out[d].pop_front();
            l.m.streams_total -= 1;
        }
        pushed
    }

    pub(super) fn complete_send(e: &Eng, l: &mut Loc, s: OutSend, result: Result<()>) {
        if s.rndv {
            l.m.rndv_out[s.dest] -= 1;
        }
        s.owner.complete(&e.tracker, s.env, s.len, result);
    }
}
