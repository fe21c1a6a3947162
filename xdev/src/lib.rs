//! `xdev` is the device contract of the stack: a deliberately small
//! point-to-point messaging trait ([`Device`]) in the manner of MPJ Express and
//! FastMPJ's `xdev`, with tag and context matching, wildcards, blocking and
//! non-blocking operations, synchronous sends, probe and peek, the device
//! [`registry`] and the [`bootstrap`] a process opens its device from.
//!
//! Two surfaces: the crate root is what a runtime *uses* (the stable one);
//! [`devkit`] is what a device *author* needs (the face, the request
//! bookkeeping, the matching engine, the conformance suite), documented
//! there with its own stability rule.
//!
//! It is not a transport: it moves no bytes itself and holds no verbs, PSM2 or
//! shared-memory code. Nor is it an MPI: there are no collectives, datatypes
//! or communicator management; contexts are plain ids a runtime allocates.

pub mod bootstrap;
mod buffer;
mod conformance;
mod device;
pub mod devkit;
mod error;
mod face;
mod launch;
mod lock;
mod matching;
mod options;
pub mod registry;
mod request;
mod sync;
mod target;
mod types;

pub use buffer::aligned::PageAligned;
pub use buffer::{Attachment, Buffer, BufferId, BufferStorage};
pub use device::{Config, Device};
pub use error::{BadOption, Error, Result, UnknownOption};
pub use registry::Registry;
pub use request::{Failed, Peeked, Request, RequestId};

// The implementor items, for this crate's own modules; their public path is
// `devkit`.
pub(crate) use device::{check_recv, check_send};
pub(crate) use options::OptionSpec;
pub(crate) use request::{CoreRef, Progress, RequestCore, RequestKind, Tracker};
pub use types::{
    Context, Envelope, Pattern, Rank, Source, Status, Tag, TagSel, ANY_SOURCE, ANY_TAG, TAG_UB,
};
