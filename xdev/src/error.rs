//! The one error type of the xdev contract.

use std::sync::Arc;

use crate::{Rank, Tag};

/// Errors reported by xdev devices, on the request they affect.
///
/// `Error` is `Clone` so that a [`Status`](crate::Status) can carry it and
/// several requests can report the same underlying transport failure.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The message was longer than the receive buffer. The first `capacity`
    /// bytes were delivered; the device stays usable.
    #[error("message truncated: {message_len} bytes from rank {sender} (tag {tag}) do not fit a {capacity}-byte buffer; {capacity} bytes delivered")]
    Truncated {
        /// Sender of the message.
        sender: Rank,
        /// Tag of the message.
        tag: Tag,
        /// Length of the message as sent.
        message_len: usize,
        /// Size of the receive buffer, i.e. the bytes delivered.
        capacity: usize,
    },
    /// A rank outside `0..size` was named.
    #[error("invalid rank {rank}: the job has {size} ranks")]
    InvalidRank {
        /// The rank given.
        rank: Rank,
        /// The job size.
        size: usize,
    },
    /// A tag outside `0..=TAG_UB` was given.
    #[error("invalid tag {0}: tags must be in 0..=TAG_UB")]
    InvalidTag(Tag),
    /// The peer died or became unreachable; operations involving it fail.
    #[error("peer rank {rank} lost: {reason}")]
    PeerLost {
        /// The lost rank.
        rank: Rank,
        /// What was observed.
        reason: String,
    },
    /// The device was finished (or is finishing) and accepts no operations.
    #[error("device closed")]
    Closed,
    /// A bounded resource (pool, queue, registration, memory) ran out.
    #[error("resource exhausted: {0}")]
    ResourceExhausted(String),
    /// The configuration is invalid or incomplete.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A device was opened with an option key it does not know (a
    /// misspelling, or an option of another device).
    #[error("device {device:?} has no option {key:?}; its options are: {}", known.join(", "))]
    UnknownOption {
        /// The device.
        device: &'static str,
        /// The key given.
        key: String,
        /// The keys the device knows (a key ending in `.` is a prefix).
        known: Vec<&'static str>,
    },
    /// An option's value does not parse as the option's type.
    #[error("option {key}={value:?} of device {device:?} is not {expected}")]
    BadOption {
        /// The device.
        device: &'static str,
        /// The key.
        key: String,
        /// The value given.
        value: String,
        /// The form the value must take, e.g. "a byte count".
        expected: &'static str,
    },
    /// No device of that name is registered.
    #[error("unknown device {0:?}")]
    UnknownDevice(String),
    /// The underlying transport failed.
    #[error("transport error: {context}")]
    Transport {
        /// What the device was doing.
        context: String,
        /// The underlying cause.
        #[source]
        source: Arc<dyn std::error::Error + Send + Sync>,
    },
    /// A peer sent something that does not decode (a corrupted or hostile peer).
    #[error("protocol violation by rank {rank}: {what}")]
    Protocol {
        /// The offending rank.
        rank: Rank,
        /// What was wrong.
        what: String,
    },
}

impl Error {
    /// Wraps a transport failure with a description of what was being done.
    pub fn transport(
        context: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Error::Transport {
            context: context.into(),
            source: Arc::new(source),
        }
    }
}

impl PartialEq for Error {
    /// Errors compare by kind and fields; transport causes compare by their
    /// display text.
    fn eq(&self, other: &Self) -> bool {
        self.to_string() == other.to_string()
            && std::mem::discriminant(self) == std::mem::discriminant(other)
    }
}

/// Shorthand for results carrying an xdev [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
