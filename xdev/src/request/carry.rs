//! What a request whose handle holds its buffer keeps in that buffer's
//! out-of-line tail ([`Carry`]), so that the handle itself is the buffer's
//! two words.
//!
//! Why: a [`Request`](super::Request) is returned by value from a call
//! through `&dyn Device`, which no caller can inline. A value of more than
//! two words comes back through memory: the device writes it field by field
//! and the caller reads it back in 16-byte words to store it (into its
//! vector of requests), a load that spans two of the device's stores and so
//! waits until every older store has reached the cache (a profile of the
//! psm device's receive rate found 16.7% of all samples, both ranks
//! counted, on that one load after `irecv` returned a 72-byte request). Two
//! scalar words come back in two registers: nothing is read back. (Two
//! words as an enum do not: rustc returns such an enum through memory, so
//! [`Request`](super::Request) keeps its shape as a raw address and a
//! pointer, see `handle.rs`.)
//!
//! A buffer's tail is made once per buffer and owned by it, so what a
//! request keeps there costs two or three stores to a line the caller's
//! thread already holds, and no allocation.

use std::fmt;
use std::mem::ManuallyDrop;
use std::ptr::NonNull;

use super::{Completion, Lender, RequestId};
use crate::{Buffer, Envelope, Status};

/// A lent request's lease: the device's token and the device, reached
/// through an uncounted pointer (the contract of
/// [`Request::lent`](super::Request::lent) keeps it alive while the lease
/// is open).
pub(crate) type Lease = (u64, NonNull<dyn Lender>);

/// The state of a request that the handle carries in its buffer's tail:
/// its id, and either its status (born complete) or its lease (lent).
pub(crate) struct Carry {
    /// The request's id (as `peek` would report it).
    pub(crate) id: RequestId,
    /// The lease of a lent request; `None`: the request was born complete.
    pub(crate) lease: Option<Lease>,
    /// A request born complete: its status, until `wait` takes it.
    pub(crate) status: Option<Status>,
}

impl Carry {
    /// The carry of a buffer no request holds yet.
    pub(crate) fn new() -> Self {
        Carry {
            id: RequestId(0),
            lease: None,
            status: None,
        }
    }

    /// The status of a request born complete, taken once by its wait.
    /// (Total: a carry whose status was already taken, which the handle's
    /// one wait never finds, gives an empty successful status.)
    #[inline]
    pub(crate) fn take_status(&mut self) -> Status {
        self.status
            .take()
            .unwrap_or_else(|| Status::ok(Envelope::untagged(0, 0), 0))
    }
}

/// A request whose handle holds its buffer: born complete (its status in
/// the buffer's carry) or lent (its lease in the carry; the device may be
/// using the memory, so the buffer is never handed out before the lease
/// ends). Two words: the buffer.
pub(crate) struct Owned {
    pub(super) buf: ManuallyDrop<Buffer>,
}

impl Owned {
    /// A request born complete with `status`.
    #[inline(always)]
    pub(crate) fn done(id: RequestId, mut buf: Buffer, status: Status) -> Self {
        let c = buf.carry_mut();
        c.id = id;
        c.lease = None;
        c.status = Some(status);
        Owned {
            buf: ManuallyDrop::new(buf),
        }
    }

    /// A request lent out by `engine` as operation `token`.
    ///
    /// # Safety
    /// See [`Request::lent`](super::Request::lent).
    #[inline(always)]
    pub(crate) unsafe fn lent(
        id: RequestId,
        token: u64,
        mut buf: Buffer,
        engine: NonNull<dyn Lender>,
    ) -> Self {
        let c = buf.carry_mut();
        c.id = id;
        c.lease = Some((token, engine));
        Owned {
            buf: ManuallyDrop::new(buf),
        }
    }

    /// The request a [`Request`](super::Request)'s words name (see
    /// `Request::from_inner`): its carry says which shape it is.
    #[inline(always)]
    pub(crate) fn from_buffer(buf: Buffer) -> Self {
        Owned {
            buf: ManuallyDrop::new(buf),
        }
    }

    #[inline(always)]
    pub(crate) fn id(&self) -> RequestId {
        self.buf.carry().id
    }

    /// The lease, if the request is lent.
    #[inline(always)]
    pub(crate) fn lease(&self) -> Option<Lease> {
        self.buf.carry().lease
    }

    /// The buffer, without `Owned`'s drop (which would end a lease).
    #[inline(always)]
    pub(crate) fn into_buffer(self) -> Buffer {
        let mut this = ManuallyDrop::new(self);
        // SAFETY: `this` is never dropped, and its buffer is taken once.
        unsafe { ManuallyDrop::take(&mut this.buf) }
    }

    /// The completion of a request born complete.
    #[inline(always)]
    pub(crate) fn into_completion(self) -> Completion {
        let mut buf = self.into_buffer();
        let status = buf.carry_mut().take_status();
        Completion { buf, status }
    }
}

impl Drop for Owned {
    fn drop(&mut self) {
        // SAFETY: dropped once; the buffer is not used again here.
        let buf = unsafe { ManuallyDrop::take(&mut self.buf) };
        if let Some((token, engine)) = buf.carry().lease {
            // SAFETY: the lease is open (it ends here), so the device keeps
            // the engine alive. The device takes the buffer (it may still
            // be writing it).
            let keep = unsafe { engine.as_ref() }.drop_lent(token, buf);
            drop(keep);
        }
    }
}

impl fmt::Debug for Owned {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = self.buf.carry();
        let mut d = f.debug_struct("Request");
        d.field("id", &c.id);
        match c.lease {
            Some((token, _)) => d.field("lent", &token),
            None => d.field("status", &c.status),
        };
        d.field("len", &self.buf.len()).finish()
    }
}
