//! The send side: a message into the pair's ring (eager while credit
//! lasts, else a rendezvous start the medium publishes), and the backlog of
//! sends that wait for room.

use std::sync::atomic::Ordering;

use xdev::devkit::target::Pending;
use xdev::devkit::CoreRef;
use xdev::{Error, Rank, Status};

use super::{gone_error, Engine, Local, Medium, Outgoing, Publication, Sent};
use crate::ring::Header;
use crate::wire::{ENTRY_CHARGE, FLAG_SYNC, KIND_EAGER, KIND_RNDV};

impl<M: Medium> Engine<M> {
    /// Whether `charge` more eager bytes to `dest` stay within its credit.
    fn has_credit(&self, l: &mut Local<M>, dest: Rank, charge: u64) -> bool {
        let credit = self.credit_bytes;
        if l.eager_sent[dest] + charge - l.freed_seen[dest] <= credit {
            return true;
        }
        // The counter is the receiver's to write: never trust it beyond
        // what we sent, nor let it go backwards.
        let seen = self.m.returned_credit(dest);
        l.freed_seen[dest] = seen.clamp(l.freed_seen[dest], l.eager_sent[dest]);
        l.eager_sent[dest] + charge - l.freed_seen[dest] <= credit
    }

    /// Whether a message of `len` bytes to `dest` goes eager: within the
    /// eager limit, and `len` more eager bytes stay within its credit.
    #[inline(always)]
    pub(crate) fn eager_fits(&self, l: &mut Local<M>, dest: Rank, len: usize) -> bool {
        len <= self.eager_max && self.has_credit(l, dest, len as u64 + ENTRY_CHARGE)
    }

    /// Tries to put one message into the destination's ring. `request`: the
    /// send's request (`None`: a blocking send). An eager send that does
    /// not wait goes through [`push_eager`](Self::push_eager).
    pub(crate) fn push(
        &self,
        l: &mut Local<M>,
        out: &Outgoing<'_>,
        request: Option<&CoreRef>,
    ) -> Sent<M::Waiter> {
        let dest = out.dest;
        let eager = self.eager_fits(l, dest, out.data.len());
        if eager && !out.sync {
            return self.push_eager(l, dest, (out.tag, out.context), out.data);
        }
        // The send waits for its receiver: a synchronous one, or a
        // rendezvous.
        if !eager && !M::may_start_rndv(self, l, dest) {
            // The receiver holds a window's worth of ours: wait (in order,
            // like a full ring) until one finishes.
            return Sent::Full;
        }
        if l.gone[dest] {
            return Sent::Refused(gone_error(l, dest));
        }
        if self.closing.load(Ordering::Acquire) {
            // finish() waits for the sends in the engine under this lock
            // after setting `closing`.
            return Sent::Refused(Error::Closed);
        }
        let header = Header {
            kind: if eager { KIND_EAGER } else { KIND_RNDV },
            flags: if out.sync { FLAG_SYNC } else { 0 },
            tag: out.tag,
            context: out.context,
            aux: out.data.len() as u64,
            ..Header::default()
        };
        // A rendezvous start carries the sender's buffer address.
        let addr = (out.data.as_ptr() as u64).to_le_bytes();
        let payload = if eager { out.data } else { &addr[..] };
        M::publish(
            self,
            l,
            Publication {
                out,
                header,
                payload,
                request,
            },
        )
    }

    /// An eager send of `data` to `dest` with `tag` and `context` (the
    /// caller found it [`eager_fits`](Self::eager_fits)), pushed now or not
    /// at all: `Full` when it finds no room (nothing pushed), `Refused`
    /// when `dest` has gone. `push` for a send that does not wait, taking
    /// scalars: the
    /// header is built here from registers and never read back from memory.
    /// Built from a struct the caller had just written, the header's
    /// 8-byte read of the tag and context spanned two 4-byte stores, and
    /// such a read waits until every older store has reached the cache,
    /// the previous message's ring slot included, whose line the receiver
    /// holds (80% of `push`'s samples, shm rate at 8 B).
    #[inline(always)]
    pub(crate) fn push_eager(
        &self,
        l: &mut Local<M>,
        dest: Rank,
        (tag, context): (xdev::Tag, xdev::Context),
        data: &[u8],
    ) -> Sent<M::Waiter> {
        if l.gone[dest] {
            return Sent::Refused(gone_error(l, dest));
        }
        let header = Header {
            kind: KIND_EAGER,
            flags: 0,
            tag,
            context,
            aux: data.len() as u64,
            ..Header::default()
        };
        match self.push_message(l, dest, &header, data) {
            Ok(true) => Sent::Complete,
            Ok(false) => Sent::Full,
            Err(e) => Sent::Refused(e),
        }
    }

    /// Pushes a message made by `push` into `dest`'s ring, charges eager
    /// data against the credit and wakes `dest`. Inlined into `push`, its
    /// one caller on the per-message path.
    #[inline]
    pub(crate) fn push_message(
        &self,
        l: &mut Local<M>,
        dest: Rank,
        header: &Header,
        payload: &[u8],
    ) -> xdev::Result<bool> {
        if !self.try_push(l, dest, header, payload)? {
            return Ok(false);
        }
        if header.kind == KIND_EAGER {
            l.eager_sent[dest] += header.aux + ENTRY_CHARGE;
        }
        self.wake(dest);
        Ok(true)
    }

    /// Tries to start a queued send. Returns whether it left the queue.
    pub(crate) fn push_pending(&self, l: &mut Local<M>, dest: Rank, p: &Pending) -> bool {
        // SAFETY: the request owns its buffer until completed, and it is not
        // completed before this send is pushed (complete) or answered.
        let data = unsafe { std::slice::from_raw_parts(p.core.buffer_ptr(), p.core.buffer_len()) };
        let out = Outgoing {
            dest,
            tag: p.tag,
            context: p.context,
            data,
            sync: p.sync,
        };
        match self.push(l, &out, Some(&p.core)) {
            Sent::Full => false,
            Sent::Complete => {
                self.tracker
                    .complete(&p.core, Status::ok(out.env(), data.len()));
                true
            }
            Sent::Refused(e) => {
                self.tracker.complete(&p.core, Status::failed(out.env(), e));
                true
            }
            Sent::Waiting(_) => true,
        }
    }

    pub(crate) fn flush_backlogs(&self, l: &mut Local<M>) -> bool {
        let mut any = false;
        for d in 0..l.backlog.len() {
            while let Some(p) = l.backlog[d].pop_front() {
                if self.push_pending(l, d, &p) {
                    any = true;
                    l.backlog_total -= 1;
                } else {
                    l.backlog[d].push_front(p);
                    break;
                }
            }
        }
        any
    }
}
