//! [`Face`]: the one [`Device`](crate::Device) implementation, over a
//! [`Transport`].
//!
//! Every device of the workspace is a face over its transport's engine.
//! The face checks the arguments (rank, tag, an open device) and turns a
//! refused non-blocking operation into a request that is born complete
//! with the error and gives its buffer back; the transport sees only
//! operations whose arguments are valid, and keeps its own protocol
//! (eager and rendezvous paths, matching, progress, blocking) behind the
//! small set of calls below. A device's own extras (options, leased
//! memory, statistics) stay methods of its device type.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::{
    check_recv, check_send, Buffer, Context, Envelope, Error, Pattern, Peeked, Progress, Rank,
    Request, Result, Source, Status, Tag, TagSel, Tracker,
};

/// Where a send goes and how it completes: what `send`, `ssend`, `isend`
/// and `issend` hand a transport.
///
/// Two words, so that it travels in two registers into a transport's
/// `start_send` (which is not inlined into the face for every engine). As a
/// three-word struct it went through memory: the face wrote the tag and the
/// context as two 4-byte stores and the engine read them back as one
/// 8-byte load, which cannot be forwarded from two stores and so waited
/// until every older store had reached the cache, the previous message's
/// stores to the peer's lines included (85% of the psm device's
/// `start_send` samples at 8 B).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct SendTo {
    /// The destination rank, with [`SYNC`] set for `ssend`/`issend`.
    dest_sync: usize,
    /// The tag (low 32 bits) and the context (high 32 bits).
    label: u64,
}

/// The bit of [`SendTo::dest_sync`] that marks a synchronous send; no
/// job has a rank this large.
const SYNC: usize = 1 << (usize::BITS - 1);

impl SendTo {
    /// A send to `dest` with `tag` in `context` (`sync`: `ssend`/`issend`).
    ///
    /// A `dest` of 2^63 (2^31 on a 32-bit target) or more, which is no
    /// rank of any job, is kept as `usize::MAX >> 1`: still out of range.
    #[inline]
    pub fn new(dest: Rank, tag: Tag, context: Context, sync: bool) -> Self {
        let dest = dest.min(!SYNC);
        SendTo {
            dest_sync: dest | if sync { SYNC } else { 0 },
            label: u64::from(tag as u32) | (u64::from(context) << 32),
        }
    }

    /// The destination rank.
    #[inline]
    pub fn dest(self) -> Rank {
        self.dest_sync & !SYNC
    }

    /// The message's tag.
    #[inline]
    pub fn tag(self) -> Tag {
        self.label as u32 as Tag
    }

    /// The message's context.
    #[inline]
    pub fn context(self) -> Context {
        (self.label >> 32) as Context
    }

    /// `ssend`/`issend`: complete only once the receiver matched it.
    #[inline]
    pub fn sync(self) -> bool {
        self.dest_sync & SYNC != 0
    }

    /// Destination, tag, context and sync, in that order.
    #[inline]
    pub fn parts(self) -> (Rank, Tag, Context, bool) {
        (self.dest(), self.tag(), self.context(), self.sync())
    }

    /// The envelope of the send's status (its destination in `source`, as
    /// every device reports a send).
    #[inline]
    pub fn envelope(&self) -> Envelope {
        Envelope {
            source: self.dest(),
            tag: self.tag(),
            context: self.context(),
        }
    }
}

impl std::fmt::Debug for SendTo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendTo")
            .field("dest", &self.dest())
            .field("tag", &self.tag())
            .field("context", &self.context())
            .field("sync", &self.sync())
            .finish()
    }
}

/// What the face needs of every engine whatever its transport: this rank,
/// the job's size, the tracker whose requests the engine completes, and the
/// flag `finish` sets when it begins.
#[derive(Clone, Copy)]
pub struct Seat<'e> {
    /// This rank.
    pub rank: Rank,
    /// The number of ranks in the job.
    pub size: usize,
    /// The tracker whose requests this engine completes.
    pub tracker: &'e Tracker,
    closing: &'e AtomicBool,
}

impl<'e> Seat<'e> {
    /// An engine's seat (`closing`: set once `finish` began).
    #[inline]
    pub fn new(rank: Rank, size: usize, tracker: &'e Tracker, closing: &'e AtomicBool) -> Self {
        Seat {
            rank,
            size,
            tracker,
            closing,
        }
    }

    /// `Err(Error::Closed)` once `finish` began.
    #[inline]
    pub fn check_open(&self) -> Result<()> {
        if self.closing.load(Ordering::Acquire) {
            Err(Error::Closed)
        } else {
            Ok(())
        }
    }
}

/// What a transport's engine implements to be a device ([`Face`]).
///
/// Every call gets arguments the face has checked: a destination and a
/// source within the job, tags within `0..=TAG_UB`, and the engine was
/// open when the call began (a `finish` racing with the call is the
/// engine's to handle, under its own lock).
pub trait Transport: Progress + Sized + 'static {
    /// The device's name, as the registry knows it.
    const NAME: &'static str;
    /// This rank's place in the job, its tracker and its closing flag.
    fn seat(&self) -> Seat<'_>;
    /// Sends `buf` and returns once it may be reused (`sync`: once the
    /// receiver matched it).
    fn blocking_send(self: &Arc<Self>, buf: &[u8], to: SendTo) -> Result<()>;
    /// Starts sending `buf`, which moves into the request.
    fn start_send(self: &Arc<Self>, buf: Buffer, to: SendTo) -> Request;
    /// Receives the first message that matches `pattern` into `buf`.
    fn recv_into(self: &Arc<Self>, buf: &mut [u8], pattern: Pattern) -> Result<Status>;
    /// Starts a receive into `buf`, which moves into the request.
    fn start_recv(self: &Arc<Self>, buf: Buffer, pattern: Pattern) -> Request;
    /// Starts one send per buffer of `bufs` (drained, in order) to `to`,
    /// appending the requests to `out` in order. The default starts each
    /// with [`start_send`](Transport::start_send); an engine may take its
    /// lock once for the window.
    fn start_send_many(
        self: &Arc<Self>,
        bufs: &mut Vec<Buffer>,
        to: SendTo,
        out: &mut Vec<Request>,
    ) {
        start_each(bufs, out, |buf| self.start_send(buf, to))
    }
    /// Starts one receive per buffer of `bufs` (drained, in order) for
    /// `pattern`, appending the requests to `out` in order; as
    /// [`start_send_many`](Transport::start_send_many) otherwise.
    fn start_recv_many(
        self: &Arc<Self>,
        bufs: &mut Vec<Buffer>,
        pattern: Pattern,
        out: &mut Vec<Request>,
    ) {
        start_each(bufs, out, |buf| self.start_recv(buf, pattern))
    }
    /// The status of the first message that matches `pattern`, without
    /// receiving it; `block`: wait for one (then `None` only if the engine
    /// closed meanwhile).
    fn probe(&self, pattern: Pattern, block: bool) -> Result<Option<Status>>;
    /// See [`Device::peek`](crate::Device::peek).
    fn peek(&self) -> Result<Option<Peeked>>;
    /// See [`Device::finish`](crate::Device::finish).
    fn finish(&self) -> Result<()>;
    /// See [`Device::alloc_buffer`](crate::Device::alloc_buffer).
    fn alloc_buffer(&self, len: usize) -> Result<Buffer> {
        Ok(Buffer::zeroed(len))
    }
}

/// A device type that is a face over a transport's engine: every such
/// type is a [`Device`](crate::Device) through the one implementation
/// below, so a device crate writes its engine and this, nothing more.
///
/// ```ignore
/// pub struct MyDevice { engine: Arc<MyEngine> }
/// impl xdev::Face for MyDevice {
///     type Engine = MyEngine;
///     fn engine(&self) -> &Arc<MyEngine> { &self.engine }
/// }
/// ```
pub trait Face: Send + Sync {
    /// The transport's engine.
    type Engine: Transport;
    /// The engine (shared with the requests it made).
    fn engine(&self) -> &Arc<Self::Engine>;
}

/// Starts one request per buffer of `bufs` with `start`, in order, and
/// appends them to `out` (`bufs` is left empty, its allocation kept): the
/// one-by-one form of the window calls, for their defaults and for an
/// engine's own window under its lock.
#[inline]
pub fn start_each(
    bufs: &mut Vec<Buffer>,
    out: &mut Vec<Request>,
    start: impl FnMut(Buffer) -> Request,
) {
    out.reserve(bufs.len());
    out.extend(bufs.drain(..).map(start));
}

/// A request that failed before it started: complete at once with `e`, its
/// buffer given back through the handle as usual.
fn refused<T: Transport>(engine: &Arc<T>, buf: Buffer, env: Envelope, e: Error) -> Request {
    engine.seat().tracker.completed(buf, Status::failed(env, e))
}

/// Every buffer of `bufs` (drained) as a request refused with `e`.
fn refuse_all<T: Transport>(
    engine: &Arc<T>,
    bufs: &mut Vec<Buffer>,
    env: Envelope,
    e: &Error,
    out: &mut Vec<Request>,
) {
    start_each(bufs, out, |buf| refused(engine, buf, env, e.clone()))
}

impl<D: Face> crate::Device for D {
    fn name(&self) -> &'static str {
        D::Engine::NAME
    }

    fn id(&self) -> Rank {
        self.engine().seat().rank
    }

    fn size(&self) -> usize {
        self.engine().seat().size
    }

    fn send(&self, buf: &[u8], dest: Rank, tag: Tag, context: Context) -> Result<()> {
        blocking_send(self, buf, (dest, tag, context, false))
    }

    fn ssend(&self, buf: &[u8], dest: Rank, tag: Tag, context: Context) -> Result<()> {
        blocking_send(self, buf, (dest, tag, context, true))
    }

    fn recv(
        &self,
        buf: &mut [u8],
        source: Source,
        tag: TagSel,
        context: Context,
    ) -> Result<Status> {
        recv_checks(self.engine(), source, tag)?;
        self.engine()
            .recv_into(buf, Pattern::new(source, tag, context))
    }

    fn isend(&self, buf: Buffer, dest: Rank, tag: Tag, context: Context) -> Request {
        start_send(self, buf, (dest, tag, context, false))
    }

    fn issend(&self, buf: Buffer, dest: Rank, tag: Tag, context: Context) -> Request {
        start_send(self, buf, (dest, tag, context, true))
    }

    fn irecv(&self, buf: Buffer, source: Source, tag: TagSel, context: Context) -> Request {
        let engine = self.engine();
        if let Err((env, e)) = recv_checked(engine, source, tag, context) {
            return refused(engine, buf, env, e);
        }
        engine.start_recv(buf, Pattern::new(source, tag, context))
    }

    fn isend_many(
        &self,
        bufs: &mut Vec<Buffer>,
        dest: Rank,
        tag: Tag,
        context: Context,
        out: &mut Vec<Request>,
    ) {
        let engine = self.engine();
        if let Err((env, e)) = send_checked(engine, dest, tag, context) {
            refuse_all(engine, bufs, env, &e, out);
            return;
        }
        engine.start_send_many(bufs, SendTo::new(dest, tag, context, false), out)
    }

    fn irecv_many(
        &self,
        bufs: &mut Vec<Buffer>,
        source: Source,
        tag: TagSel,
        context: Context,
        out: &mut Vec<Request>,
    ) {
        let engine = self.engine();
        if let Err((env, e)) = recv_checked(engine, source, tag, context) {
            refuse_all(engine, bufs, env, &e, out);
            return;
        }
        engine.start_recv_many(bufs, Pattern::new(source, tag, context), out)
    }

    fn probe(&self, source: Source, tag: TagSel, context: Context) -> Result<Status> {
        recv_checks(self.engine(), source, tag)?;
        self.engine()
            .probe(Pattern::new(source, tag, context), true)?
            .ok_or_else(|| Error::Closed)
    }

    fn iprobe(&self, source: Source, tag: TagSel, context: Context) -> Result<Option<Status>> {
        recv_checks(self.engine(), source, tag)?;
        self.engine()
            .probe(Pattern::new(source, tag, context), false)
    }

    fn peek(&self) -> Result<Option<Peeked>> {
        self.engine().peek()
    }

    fn progress(&self) {
        Progress::progress(&**self.engine())
    }

    fn finish(&self) -> Result<()> {
        self.engine().finish()
    }

    fn alloc_buffer(&self, len: usize) -> Result<Buffer> {
        self.engine().alloc_buffer(len)
    }
}

/// A send's destination, tag, context and sync flag as the caller gave
/// them: checked before they are packed into a [`SendTo`] (which keeps no
/// rank a job can never have), so that a refusal names the rank given.
type SendArgs = (Rank, Tag, Context, bool);

/// `send` and `ssend`: checked, then sent by the engine.
fn blocking_send<D: Face + ?Sized>(dev: &D, buf: &[u8], to: SendArgs) -> Result<()> {
    let (dest, tag, context, sync) = to;
    send_checks(dev.engine(), dest, tag)?;
    dev.engine()
        .blocking_send(buf, SendTo::new(dest, tag, context, sync))
}

/// `isend` and `issend`: checked, then started by the engine. Always
/// inlined into the face's `isend`, so that an engine whose `start_send`
/// is inlined too is one call from the user.
#[inline(always)]
fn start_send<D: Face + ?Sized>(dev: &D, buf: Buffer, to: SendArgs) -> Request {
    let (dest, tag, context, sync) = to;
    let engine = dev.engine();
    if let Err((env, e)) = send_checked(engine, dest, tag, context) {
        return refused(engine, buf, env, e);
    }
    engine.start_send(buf, SendTo::new(dest, tag, context, sync))
}

/// The checks of a send (blocking, non-blocking, a window): a valid rank
/// and tag, an open device.
#[inline]
fn send_checks<T: Transport>(engine: &Arc<T>, dest: Rank, tag: Tag) -> Result<()> {
    check_send(dest, tag, engine.seat().size)?;
    engine.seat().check_open()
}

/// [`send_checks`] for a non-blocking send (one or a window): a refusal
/// comes with the envelope of its status (the rank and tag as given, as
/// every device reports a send).
#[inline]
fn send_checked<T: Transport>(
    engine: &Arc<T>,
    dest: Rank,
    tag: Tag,
    context: Context,
) -> std::result::Result<(), (Envelope, Error)> {
    send_checks(engine, dest, tag).map_err(|e| {
        let env = Envelope {
            source: dest,
            tag,
            context,
        };
        (env, e)
    })
}

/// The checks of a receive or a probe: a valid source and tag, an open
/// device.
#[inline]
fn recv_checks<T: Transport>(engine: &Arc<T>, source: Source, tag: TagSel) -> Result<()> {
    check_recv(source, tag, engine.seat().size)?;
    engine.seat().check_open()
}

/// [`recv_checks`] for a non-blocking receive (one or a window): a refusal
/// comes with the envelope of its status (this rank, no tag).
#[inline]
fn recv_checked<T: Transport>(
    engine: &Arc<T>,
    source: Source,
    tag: TagSel,
    context: Context,
) -> std::result::Result<(), (Envelope, Error)> {
    recv_checks(engine, source, tag).map_err(|e| {
        let env = Envelope::untagged(engine.seat().rank, context);
        (env, e)
    })
}

#[cfg(test)]
mod tests;
