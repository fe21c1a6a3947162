//! Addressing vocabulary shared by every device: ranks, tags, contexts,
//! receive selectors and the status of a completed operation.

use crate::Error;

/// A process (or thread) index inside a job, `0..size`.
pub type Rank = usize;

/// A user message tag. Valid tags are `0..=TAG_UB`; negative values are
/// rejected with [`Error::InvalidTag`].
pub type Tag = i32;

/// The largest valid tag (as MPI's `MPI_TAG_UB`).
pub const TAG_UB: Tag = i32::MAX;

/// A communication context (communicator id). Contexts never take wildcards.
pub type Context = u32;

/// Which sender a receive or probe accepts.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    /// Any sender (`MPI_ANY_SOURCE`).
    Any,
    /// Exactly this rank.
    Rank(Rank),
}

/// Accept a message from any sender.
pub const ANY_SOURCE: Source = Source::Any;

impl From<Rank> for Source {
    fn from(r: Rank) -> Self {
        Source::Rank(r)
    }
}

/// Which tag a receive or probe accepts.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum TagSel {
    /// Any tag (`MPI_ANY_TAG`).
    Any,
    /// Exactly this tag.
    Tag(Tag),
}

/// Accept a message with any tag.
pub const ANY_TAG: TagSel = TagSel::Any;

impl From<Tag> for TagSel {
    fn from(t: Tag) -> Self {
        TagSel::Tag(t)
    }
}

/// The matching key a message carries: who sent it, with which tag, in which
/// context.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Envelope {
    /// Sending rank.
    pub source: Rank,
    /// Message tag.
    pub tag: Tag,
    /// Communication context.
    pub context: Context,
}

impl Envelope {
    /// The envelope of an operation that ended with no message to name
    /// (failed before it matched, cancelled, closed): `source` (usually
    /// this rank, or the peer that failed), no tag (-1), `context`.
    ///
    /// ```
    /// use xdev::{Envelope, Error, Status};
    /// let env = Envelope::untagged(3, 7);
    /// assert_eq!((env.source, env.tag, env.context), (3, -1, 7));
    /// let st = Status::closed(3);
    /// assert_eq!((st.source, st.tag, st.context), (3, -1, 0));
    /// assert!(matches!(st.error.as_deref(), Some(Error::Closed)));
    /// ```
    #[inline]
    pub const fn untagged(source: Rank, context: Context) -> Self {
        Envelope {
            source,
            tag: -1,
            context,
        }
    }
}

/// What a receive or probe accepts: a source and tag (each possibly a
/// wildcard) in one exact context.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Pattern {
    /// Accepted sender.
    pub source: Source,
    /// Accepted tag.
    pub tag: TagSel,
    /// Required context (never a wildcard).
    pub context: Context,
}

impl Pattern {
    /// Builds a pattern.
    pub fn new(source: Source, tag: TagSel, context: Context) -> Self {
        Pattern {
            source,
            tag,
            context,
        }
    }

    /// Whether a message with envelope `env` satisfies this pattern.
    #[inline]
    pub fn matches(&self, env: &Envelope) -> bool {
        self.context == env.context
            && match self.source {
                Source::Any => true,
                Source::Rank(r) => r == env.source,
            }
            && match self.tag {
                TagSel::Any => true,
                TagSel::Tag(t) => t == env.tag,
            }
    }
}

/// The outcome of a receive, probe or send.
///
/// For a receive, `count` is the number of bytes delivered into the buffer and
/// `message_len` the length the sender sent; they differ only when the message
/// was truncated, in which case `error` is [`Error::Truncated`].
//
// Six words, the error boxed inside. A four-word `Copy` status with the
// error beside it (in the completion) was built and measured (commit
// 70f03f8): the message rate at 8 B fell by 8-15% on thread and shm,
// because the copies of the smaller status and completion on the way to
// the caller became wide reloads of freshly written narrow stores (store
// forwarding fails), so it was reverted.
#[derive(Clone, Debug, PartialEq)]
pub struct Status {
    /// The sender (for a send: the destination).
    pub source: Rank,
    /// The message tag.
    pub tag: Tag,
    /// The message context.
    pub context: Context,
    /// Bytes delivered into the receive buffer (for a send: bytes sent).
    pub count: usize,
    /// The full length of the message as sent.
    pub message_len: usize,
    /// Whether the operation was cancelled before it matched.
    pub cancelled: bool,
    /// The error that ended the operation, if any: boxed, out of line, so
    /// that the status of a successful operation stays six words (match it
    /// with `status.error.as_deref()`).
    pub error: Option<Box<Error>>,
}

impl Status {
    /// A successful status for a message with envelope `env` and `len` bytes.
    #[inline]
    pub fn ok(env: Envelope, len: usize) -> Self {
        Status {
            source: env.source,
            tag: env.tag,
            context: env.context,
            count: len,
            message_len: len,
            cancelled: false,
            error: None,
        }
    }

    /// The status of a receive of a `message_len`-byte message into a
    /// `capacity`-byte buffer: truncated (with the error set) when it does not
    /// fit.
    #[inline]
    pub fn received(env: Envelope, message_len: usize, capacity: usize) -> Self {
        let mut st = Status::ok(env, message_len.min(capacity));
        st.message_len = message_len;
        if message_len > capacity {
            st.error = Some(Box::new(Error::Truncated {
                sender: env.source,
                tag: env.tag,
                message_len,
                capacity,
            }));
        }
        st
    }

    /// The status of an operation that failed with `error` before any data
    /// moved.
    pub fn failed(env: Envelope, error: Error) -> Self {
        Status {
            source: env.source,
            tag: env.tag,
            context: env.context,
            count: 0,
            message_len: 0,
            cancelled: false,
            error: Some(Box::new(error)),
        }
    }

    /// The status of an operation its device's close ended
    /// ([`Error::Closed`]): `source`'s envelope (the closing rank, or
    /// `usize::MAX` for none), no tag, context 0.
    pub fn closed(source: Rank) -> Self {
        Status::failed(Envelope::untagged(source, 0), Error::Closed)
    }

    /// The status of a receive cancelled before it matched.
    pub fn cancelled(pattern: Pattern) -> Self {
        Status {
            source: match pattern.source {
                Source::Any => usize::MAX,
                Source::Rank(r) => r,
            },
            tag: match pattern.tag {
                TagSel::Any => -1,
                TagSel::Tag(t) => t,
            },
            context: pattern.context,
            count: 0,
            message_len: 0,
            cancelled: true,
            error: None,
        }
    }

    /// The envelope of the message this status describes.
    #[inline]
    pub fn envelope(&self) -> Envelope {
        Envelope {
            source: self.source,
            tag: self.tag,
            context: self.context,
        }
    }

    /// `Ok(self)` when no error is set, else the error.
    #[inline]
    pub fn into_result(self) -> Result<Status, Error> {
        match self.error {
            Some(e) => Err(*e),
            None => Ok(self),
        }
    }
}
