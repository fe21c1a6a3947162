//! The [`Device`] trait: the whole contract a transport offers a runtime.

use std::collections::BTreeMap;

use crate::{
    Buffer, Context, Error, Peeked, Rank, Request, Result, Source, Status, Tag, TagSel, TAG_UB,
};

/// How to open a device: who this process (or thread) is in which job, plus
/// device-specific options.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Config {
    /// This rank, `0..size`.
    pub rank: Rank,
    /// Number of ranks in the job.
    pub size: usize,
    /// Job identity: ranks with the same job id form one world.
    pub job: String,
    /// Device-specific options (`key=value`). Each device declares the keys
    /// it knows (its registry [`Entry::options`](crate::registry::Entry::options));
    /// opening it with any other key fails with
    /// [`Error::UnknownOption`], and a value that does not parse with
    /// [`Error::BadOption`].
    pub options: BTreeMap<String, String>,
}

impl Config {
    /// A config for `rank` of `size` in job `job`.
    pub fn new(rank: Rank, size: usize, job: impl Into<String>) -> Self {
        Config {
            rank,
            size,
            job: job.into(),
            options: BTreeMap::new(),
        }
    }

    /// Adds an option.
    pub fn with(mut self, key: &str, value: impl ToString) -> Self {
        self.options.insert(key.to_string(), value.to_string());
        self
    }

    /// Adds an option written `KEY=VALUE` (as on a command line).
    pub fn with_assignment(self, assignment: &str) -> Result<Self> {
        let (k, v) = assignment
            .split_once('=')
            .ok_or_else(|| Error::Config(format!("option {assignment:?} is not KEY=VALUE")))?;
        Ok(self.with(k, v))
    }

    /// Adds options written `KEY=VALUE`, in order (a later one wins).
    pub fn with_assignments<S: AsRef<str>>(
        self,
        assignments: impl IntoIterator<Item = S>,
    ) -> Result<Self> {
        assignments
            .into_iter()
            .try_fold(self, |c, a| c.with_assignment(a.as_ref()))
    }

    /// Checks `rank < size` and `size > 0`.
    pub fn validate(&self) -> Result<()> {
        if self.size == 0 {
            return Err(Error::Config("size must be at least 1".into()));
        }
        if self.rank >= self.size {
            return Err(Error::InvalidRank {
                rank: self.rank,
                size: self.size,
            });
        }
        Ok(())
    }
}

/// A point-to-point messaging device (the MPJ Express / FastMPJ `xdev`
/// contract).
///
/// Matching follows MPI: a receive names a source (or [`ANY_SOURCE`](crate::ANY_SOURCE)),
/// a tag (or [`ANY_TAG`](crate::ANY_TAG)) and an exact context; messages from
/// one sender that match the same receive arrive in send order, and a receive
/// matches the earliest eligible message.
///
/// Blocking calls borrow their buffer for the duration of the call.
/// Non-blocking calls take ownership of a [`Buffer`] and give it back through
/// the completed [`Request`]; errors detected at once (an invalid rank or tag,
/// a closed device) complete the request immediately with the error in its
/// status, so the buffer is never lost. Complete every request before the
/// device goes (`finish`, then drop it): a request does not keep its device
/// open, and one still in flight when the last handle to the device is
/// dropped ends with [`Error::Closed`] and an empty buffer (its own buffer
/// stays with whatever may still use it, and is freed with it).
///
/// All methods take `&self`: a device is shared by the threads of its rank.
pub trait Device: Send + Sync {
    /// The device's registry name (`"thread"`, `"shm"`, `"ibv"`, ...).
    fn name(&self) -> &'static str;
    /// This rank.
    fn id(&self) -> Rank;
    /// Number of ranks.
    fn size(&self) -> usize;

    /// Sends `buf` to `dest`; returns when `buf` may be reused.
    fn send(&self, buf: &[u8], dest: Rank, tag: Tag, context: Context) -> Result<()>;
    /// Synchronous send: returns only once the receiver has matched the
    /// message, whatever its size.
    fn ssend(&self, buf: &[u8], dest: Rank, tag: Tag, context: Context) -> Result<()>;
    /// Receives a matching message into `buf`. A message longer than `buf`
    /// delivers its first `buf.len()` bytes and fails with
    /// [`Error::Truncated`].
    fn recv(&self, buf: &mut [u8], source: Source, tag: TagSel, context: Context)
        -> Result<Status>;

    /// Starts a send of the whole buffer.
    fn isend(&self, buf: Buffer, dest: Rank, tag: Tag, context: Context) -> Request;
    /// Starts a synchronous send: it completes only once matched.
    fn issend(&self, buf: Buffer, dest: Rank, tag: Tag, context: Context) -> Request;
    /// Starts a receive into the whole buffer.
    fn irecv(&self, buf: Buffer, source: Source, tag: TagSel, context: Context) -> Request;

    /// Starts a send of each buffer of `bufs` to `dest` with `tag` in
    /// `context`, in order (their messages match in that order), and
    /// appends the requests to `out` in the same order. `bufs` is left
    /// empty with its allocation kept, so a loop of windows allocates
    /// nothing. Each request is what [`isend`](Device::isend) of its buffer
    /// would return (an invalid argument fails every one, each with its
    /// buffer); the default makes exactly those calls, and a device may
    /// check the arguments and take its lock once for the window instead.
    fn isend_many(
        &self,
        bufs: &mut Vec<Buffer>,
        dest: Rank,
        tag: Tag,
        context: Context,
        out: &mut Vec<Request>,
    ) {
        crate::face::start_each(bufs, out, |buf| self.isend(buf, dest, tag, context))
    }
    /// Starts a receive into each buffer of `bufs`, in order (messages that
    /// all match go to them in that order), and appends the requests to
    /// `out` in the same order; as [`isend_many`](Device::isend_many) for
    /// `bufs`, errors and the default.
    fn irecv_many(
        &self,
        bufs: &mut Vec<Buffer>,
        source: Source,
        tag: TagSel,
        context: Context,
        out: &mut Vec<Request>,
    ) {
        crate::face::start_each(bufs, out, |buf| self.irecv(buf, source, tag, context))
    }

    /// Blocks until a matching message is available and describes it without
    /// receiving it (`count` is its full length).
    fn probe(&self, source: Source, tag: TagSel, context: Context) -> Result<Status>;
    /// Like [`probe`](Device::probe) without blocking: `None` if no matching
    /// message is available now.
    fn iprobe(&self, source: Source, tag: TagSel, context: Context) -> Result<Option<Status>>;
    /// Blocks until one of this device's outstanding requests (whose handle is
    /// still held and unconsumed) completes, and says which. Each completion
    /// is reported once. `None` when nothing is outstanding.
    ///
    /// A request born complete (its operation ended inside the call that
    /// started it, [`Request::was_born_complete`]: an eager `isend` whose
    /// data already left, an `irecv` whose message was already there, a
    /// refused call) is complete in the caller's hand and never outstanding,
    /// so `peek` does not report it: a wait-any over a set of requests tests
    /// them first (as MPJ Express's `Waitany` does), then peeks.
    fn peek(&self) -> Result<Option<Peeked>>;

    /// Advances the device's protocols once without blocking (completions,
    /// credits, queued sends). Waits, tests and probes already do this; a
    /// device layered over others (the hybrid device) calls it to keep each
    /// one moving while it waits on several. The default does nothing, for
    /// devices whose progress needs no caller.
    fn progress(&self) {}

    /// A zero-filled buffer of `len` bytes in memory this device moves
    /// best (for example memory it has registered with a NIC, so that a
    /// large transfer from or into it needs no registration). Any buffer
    /// works with any device; this one is only faster here. The default is
    /// [`Buffer::zeroed`]; errors are [`Error::ResourceExhausted`](crate::Error::ResourceExhausted)
    /// when the device's memory is used up.
    fn alloc_buffer(&self, len: usize) -> Result<Buffer> {
        Ok(Buffer::zeroed(len))
    }

    /// Waits for this rank's outstanding sends (failing those to dead peers
    /// rather than hanging), then closes the device: later calls fail with
    /// [`Error::Closed`]. Idempotent.
    fn finish(&self) -> Result<()>;
}

/// Checks a destination rank and tag for a send.
#[inline]
pub fn check_send(dest: Rank, tag: Tag, size: usize) -> Result<()> {
    if dest >= size {
        return Err(Error::InvalidRank { rank: dest, size });
    }
    check_tag(tag)
}

/// Checks a tag (`0..=TAG_UB`).
#[inline]
pub fn check_tag(tag: Tag) -> Result<()> {
    if !(0..=TAG_UB).contains(&tag) {
        return Err(Error::InvalidTag(tag));
    }
    Ok(())
}

/// Checks a receive selector.
#[inline]
pub fn check_recv(source: Source, tag: TagSel, size: usize) -> Result<()> {
    if let Source::Rank(r) = source {
        if r >= size {
            return Err(Error::InvalidRank { rank: r, size });
        }
    }
    if let TagSel::Tag(t) = tag {
        check_tag(t)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
