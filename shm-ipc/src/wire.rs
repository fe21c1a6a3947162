//! The messages of the shared-memory devices, as their ring headers carry
//! them: one place for the kinds and flags of both devices, and the limits
//! of the engine that reads them.
//!
//! Every message of a pair, whatever its kind, goes through the pair's one
//! ring, in order. The thread device uses only `EAGER` and `RNDV` (its
//! rendezvous is a hand-off between threads); the process device uses them
//! all. A header's fields by kind:
//!
//! | kind | tag, context | cookie | aux | payload |
//! |---|---|---|---|---|
//! | `EAGER` | the envelope | the send's id (synchronous sends) | length | the data |
//! | `RNDV` | the envelope | the send's id (thread: its hand-off) | length | the sender's buffer address, 8 bytes |
//! | `ACK`, `FIN`, `PULL` | - | the send's id | - | - |
//! | `DATA` | - | the send's id | offset | a fragment |
//! | `WRITE` | context: where the tail starts, in [`SPLIT_PAGE`]s | the send's id | the receiver's address of the tail | - |
//! | `WROTE` | - | the send's id | - | - |

/// A message whose data follows in the ring (up to the eager limit).
pub(crate) const KIND_EAGER: u8 = 1;
/// A rendezvous start: the data stays with the sender until the receiver
/// takes it.
pub(crate) const KIND_RNDV: u8 = 2;
/// Receiver to sender: a synchronous eager send was matched.
pub(crate) const KIND_ACK: u8 = 3;
/// Receiver to sender: the rendezvous data was copied (or, with
/// [`FLAG_FAILED`], could not be read): the send is complete.
pub(crate) const KIND_FIN: u8 = 4;
/// Receiver to sender: stream the rendezvous data through the ring
/// (the pipelined copy).
pub(crate) const KIND_PULL: u8 = 5;
/// Sender to receiver: one fragment of a pulled rendezvous.
pub(crate) const KIND_DATA: u8 = 6;
/// Receiver to sender: write the tail of your rendezvous data into my
/// buffer (cookie: the send; aux: where; context: where the tail starts, in
/// pages), while I read the head (a split CMA copy).
pub(crate) const KIND_WRITE: u8 = 7;
/// Sender to receiver: the tail is written (or, with `FLAG_FAILED`, was
/// not: read it yourself).
pub(crate) const KIND_WROTE: u8 = 8;

/// On `EAGER` and (thread device) `RNDV`: a synchronous send.
pub(crate) const FLAG_SYNC: u8 = 1;
/// On `FIN`: the receiver could not read the data (the send fails); on
/// `WROTE`: the sender could not write the tail.
pub(crate) const FLAG_FAILED: u8 = 2;
/// On `RNDV` (process device): the sender has receives posted that name
/// the receiver, so it waits for data from it (a two-way exchange) and
/// will be copying that; the receiver does not ask it to write half of
/// this message (no split copy), which would make the two cores wait for
/// each other instead of copying side by side.
pub(crate) const FLAG_EXPECTING: u8 = 4;
/// On `RNDV` (process device): the send buffer lies in the sender's shared
/// arena, and the start carries two more words, the arena's descriptor
/// number in the sender and the buffer's offset in it (see
/// `process/mapped.rs`).
pub(crate) const FLAG_MAPPED: u8 = 8;
/// Bytes of a rendezvous start with [`FLAG_MAPPED`]: the sender's buffer
/// address, its arena descriptor and its offset there.
pub(crate) const RNDV_MAPPED_BYTES: usize = 24;

/// Bytes of a rendezvous start with `flags`: the sender's buffer address
/// (8), and with [`FLAG_MAPPED`] its arena descriptor and offset too.
#[inline]
pub(crate) fn rndv_start_bytes(flags: u8) -> usize {
    if flags & FLAG_MAPPED != 0 {
        RNDV_MAPPED_BYTES
    } else {
        8
    }
}

/// The unit of a split point.
pub(crate) const SPLIT_PAGE: usize = 4096;

/// Bytes charged against eager credit per message besides its payload (the
/// cost of an unexpected-queue entry).
pub(crate) const ENTRY_CHARGE: u64 = 64;

/// Payload buffers a rank keeps for unexpected eager messages (at most
/// `eager_limit` bytes each).
pub(crate) const SPARE_PAYLOADS: usize = 64;

/// Messages one drain of one ring processes at most, so that a peer that
/// keeps its ring full cannot keep this rank from its other rings and its
/// caller.
pub(crate) const DRAIN_BUDGET: usize = 256;
