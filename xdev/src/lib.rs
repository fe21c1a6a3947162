//! `xdev` is the device contract of the stack: a deliberately small
//! point-to-point messaging trait ([`Device`]) in the manner of MPJ Express and
//! FastMPJ's `xdev`, with tag and context matching, wildcards, blocking and
//! non-blocking operations, synchronous sends, probe and peek. It also holds
//! what every transport reuses: the [`matching`] engine, the request
//! bookkeeping ([`Tracker`]), the device [`registry`], and the
//! [`conformance`] suite every device must pass.
//!
//! It is not a transport: it moves no bytes itself and holds no verbs, PSM2 or
//! shared-memory code. Nor is it an MPI: there are no collectives, datatypes
//! or communicator management; contexts are plain ids a runtime allocates.

pub mod bootstrap;
mod buffer;
pub mod conformance;
mod device;
mod error;
pub mod face;
pub mod launch;
pub mod lock;
pub mod matching;
pub mod registry;
mod request;
pub mod target;
mod types;

pub use buffer::{Attachment, Buffer, BufferId, BufferStorage};
pub use device::{check_recv, check_send, check_tag, Config, Device};
pub use error::{Error, Result};
pub use face::{Face, Seat, SendTo, Transport};
pub use registry::Registry;
pub use request::{
    Completion, CoreRef, Failed, Peeked, Progress, Request, RequestCore, RequestId, RequestKind,
    Tracker,
};
pub use types::{
    Context, Envelope, Pattern, Rank, Source, Status, Tag, TagSel, ANY_SOURCE, ANY_TAG, TAG_UB,
};
