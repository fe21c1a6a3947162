//! A safe layer over libpsm2, in the style of `rustix` or `io-uring`: thin
//! typed handles above the committed raw bindings of `psm_sys`, each owning
//! its PSM2 resource and releasing it on drop. The `psm` device and the
//! raw-PSM2 benchmark are written against it; every `unsafe` PSM2 call of
//! this crate is here, each with the reason it is sound.
//!
//! * [`Library`]: libpsm2 loaded and `psm2_init` run, once per process
//!   ([`Library::get`]), its [`PsmMode`], job keys, and the process's one
//!   endpoint slot ([`EndpointSlot`]: PSM2 allows one endpoint per process).
//! * [`Endpoint`]: an open endpoint (closed on drop), the peers it connected
//!   to by index, and progress ([`Endpoint::poll`]).
//! * [`MatchedQueue`]: the endpoint's matched queue (finalized on drop, then
//!   the endpoint closed): blocking [`send`](MatchedQueue::send) and
//!   [`recv`](MatchedQueue::recv), [`iprobe`](MatchedQueue::iprobe), and
//!   non-blocking requests inside a [`scope`](MatchedQueue::scope) that waits
//!   for all of them before it returns.
//! * [`TrackedQueue`]: a matched queue with its table of outstanding
//!   requests, each carrying its owner's payload and named by a
//!   [`RequestKey`]: non-blocking sends and receives, completions
//!   ([`collect`](TrackedQueue::collect) and [`take_completed`](TrackedQueue::take_completed),
//!   [`test`](TrackedQueue::test)), cancellation; and a second, leaner
//!   table of lent receives ([`irecv_lent`](TrackedQueue::irecv_lent),
//!   [`test_lent`](TrackedQueue::test_lent) into the caller's
//!   [`StatusSlot`]), which a key's top bit tells apart. The tables own
//!   every PSM2 request handle, so none is used after PSM2 freed it;
//!   closing the queue hands back the payloads of what was still
//!   outstanding.
//!
//! Three calls stay `unsafe`: [`TrackedQueue::isend`],
//! [`TrackedQueue::irecv`] and [`TrackedQueue::irecv_lent`], since PSM2 reads or writes their memory until the
//! request completes, which the borrow checker cannot follow across calls
//! (as `verbs::QueuePair::post_send`). A [`MatchedQueue::scope`] makes the
//! same requests safe by borrowing the memory for the whole scope.
//!
//! Tags are three 32-bit words ([`MqTag`]); a receive or probe selects by
//! [`Selector`] (peer or any, tag, mask). Failures are [`xdev::Error`]s:
//! PSM2's codes as [`Error::Transport`](xdev::Error::Transport) naming the
//! call, with PSM2's description as the source ([`Psm2Error`]).

mod endpoint;
mod library;
mod queue;
mod tracked;

pub use endpoint::Endpoint;
pub use library::{EndpointSlot, JobKey, Library, Psm2Error, PsmMode};
pub use queue::{msg_len, MatchedQueue, MqStatus, MqTag, Scope, Selector};
pub use tracked::{CompletionBatch, LentTest, RequestKey, StatusSlot, TrackedQueue};

#[cfg(test)]
mod tests;
