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
    /// misspelling, or an option of another device). Boxed, so that every
    /// `Error` (and the [`Status`](crate::Status) that carries one) stays
    /// small.
    #[error("device {:?} has no option {:?}; its options are: {}", .0.device, .0.key, .0.known.join(", "))]
    UnknownOption(Box<UnknownOption>),
    /// An option's value does not parse as the option's type (boxed, as
    /// above).
    #[error("option {}={:?} of device {:?} is not {}", .0.key, .0.value, .0.device, .0.expected)]
    BadOption(Box<BadOption>),
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

/// What [`Error::UnknownOption`] reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownOption {
    /// The device.
    pub device: &'static str,
    /// The key given.
    pub key: String,
    /// The keys the device knows (a key ending in `.` is a prefix).
    pub known: Vec<&'static str>,
}

/// What [`Error::BadOption`] reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BadOption {
    /// The device.
    pub device: &'static str,
    /// The key.
    pub key: String,
    /// The value given.
    pub value: String,
    /// The form the value must take, e.g. "a byte count".
    pub expected: &'static str,
}

#[cfg(test)]
mod tests {
    /// Statuses move with each message, several times between the device
    /// and the caller: a status keeps its error out of line (a box, only
    /// made when an operation fails), so a successful one is six words
    /// (callgrind, 8 B receives: 60 instructions fewer per receive on the
    /// thread device, 23 on psm, than with the error inline at ten). An
    /// error keeps large payloads boxed too: it is moved whole wherever an
    /// operation fails.
    #[test]
    fn errors_and_statuses_stay_small() {
        assert!(std::mem::size_of::<super::Error>() <= 40);
        assert!(std::mem::size_of::<crate::Status>() <= 48);
        assert!(std::mem::size_of::<crate::request::Completion>() <= 80);
        // A request born complete carries its id, buffer and status.
        assert!(std::mem::size_of::<crate::Request>() <= 88);
    }
}
