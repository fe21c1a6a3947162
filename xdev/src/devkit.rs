//! The device-author surface: what a crate needs to *implement* a
//! [`Device`](crate::Device), kept apart from what a runtime needs to *use*
//! one (the crate root: [`Device`](crate::Device), [`Buffer`](crate::Buffer),
//! [`Request`](crate::Request), [`Status`](crate::Status),
//! [`Error`](crate::Error), [`Config`](crate::Config),
//! [`Registry`](crate::Registry), the bootstrap front for opening from the
//! environment, and the constants).
//!
//! This module is the one public path to these items; they are not
//! re-exported anywhere else.
//!
//! # What a device author finds here
//!
//! - [`Face`], [`Transport`], [`Seat`], [`SendTo`]: implement `Face` for the
//!   device type and `Transport` for its engine, and the blanket
//!   `impl Device for D: Face` does the argument checks and the refused-call
//!   requests.
//! - [`Tracker`], [`RequestCore`], [`CoreRef`], [`Completion`],
//!   [`CompletionHook`], [`Progress`], [`RequestKind`]: the request
//!   bookkeeping every engine uses (starting, completing and relaying
//!   requests, and the hooks a [`Request`](crate::Request) calls).
//! - [`matching`]: the posted-receive and unexpected-message queues.
//! - [`target`]: where a matched message goes and who waits for a send.
//! - [`lock`]: [`RankLock`](lock::RankLock), the spin-then-yield lock of a
//!   rank's protocol state.
//! - [`shared_arena`]: buffers a peer process can map, for copies in user
//!   space between processes.
//! - [`wire`] and [`keepalive`]: the bootstrap service's frame format and the
//!   TCP keep-alive of its connections, for tests and other implementations
//!   of the service.
//! - [`Options`], [`OptionSpec`]: the typed layer every device reads its
//!   [`Config::options`](crate::Config::options) through: declared keys, an
//!   error naming them for any other key, an error naming the key and the
//!   expected form for a value that does not parse.
//! - [`conformance`] and [`conformance_tests!`](crate::devkit::conformance_tests):
//!   the suite every device must pass; [`launch`]: local multi-process jobs
//!   with the bootstrap served in-process, for the tests of multi-process
//!   devices and for launchers.
//! - [`check_send`], [`check_recv`], [`check_tag`]: the argument checks the
//!   face applies, for devices that do not go through it.
//!
//! # Stability
//!
//! The user surface at the crate root is the stable one a runtime depends
//! on. This module follows the engines: its items change when the engines
//! need it (a new hook, a new field of [`SendTo`], a new conformance case),
//! in any release that bumps the minor version while the crates are 0.x.
//! The devices of this workspace (`shm-ipc`, `ibvx`) are released in
//! lockstep with `xdev` (exact `=` versions), so they always match; an
//! out-of-tree device should pin `xdev` with `=` too.

pub use crate::device::{check_recv, check_send, check_tag};
pub use crate::face::{start_each, Face, Seat, SendTo, Transport};
pub use crate::options::{OptionSpec, Options};
pub use crate::request::{
    abort_on_unwind, Completion, CompletionHook, CoreRef, Handle, KeepAlive, Lender, Progress,
    RequestCore, RequestKind, Tracker,
};

// The modules below are private at the crate root; each is re-exported here
// whole (a glob of its public items), so this is their only public path.

pub mod matching {
    //! The posted-receive and unexpected-message queues with MPI matching
    //! rules (per-context, per-source buckets plus sequence numbers for
    //! wildcards). Knows nothing of transports.
    pub use crate::matching::*;
}

pub mod target {
    //! What engines that use [`matching`](super::matching) share: where a
    //! matched message goes, who waits for a send in flight, and the receive
    //! cancel.
    pub use crate::target::*;
}

pub mod shared_arena {
    //! The shared arena: page-aligned buffers of 256 KiB and more in a
    //! sealed `memfd` that peer processes may map, once a device
    //! turns it on ([`share_with_peers`]); [`span_of`] says where a slice
    //! lies in it, for a rendezvous header.
    pub use crate::buffer::shared::{share_with_peers, span_of, SharedSpan, DEFAULT_SHARED_MIB};
}

pub mod lock {
    //! `RankLock`, the spin-then-yield lock of a rank's protocol state.
    pub use crate::lock::*;
}

pub mod conformance {
    //! The conformance suite every device must pass, and the device-agnostic
    //! fault checks the devices' own tests share. Turn it into `#[test]`s
    //! with [`conformance_tests!`](crate::devkit::conformance_tests).
    pub use crate::conformance::*;
}

pub mod launch {
    //! Local multi-process jobs: `rank_command` (the environment contract
    //! shared with `xdev-run`), `LocalJob` (ranks as child processes with the
    //! bootstrap served in-process, for the tests of multi-process devices)
    //! and `run_job`.
    pub use crate::launch::*;
}

pub mod wire {
    //! The bootstrap service's frames: length-prefixed, strictly decoded
    //! messages of the handshake and of the key-value store, for tests and
    //! other implementations of the service.
    pub use crate::bootstrap::wire::*;
}

pub mod keepalive {
    //! TCP keep-alive on the bootstrap service's connections, so a peer's
    //! host that vanishes is noticed.
    pub use crate::bootstrap::keepalive::*;
}

#[doc(inline)]
pub use crate::conformance_tests;
