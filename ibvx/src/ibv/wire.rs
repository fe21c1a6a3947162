//! The IBVX wire format: the header every message between two ranks starts
//! with, and its validating decoder.
//!
//! Every message is one RC `SEND` into a pre-posted receive slot. It starts
//! with a 24-byte common header (little-endian):
//!
//! | offset | field | meaning |
//! |--------|-------|---------|
//! | 0 | `kind` u8 | [`Kind`] |
//! | 1 | `flags` u8 | [`FLAG_SYNC`] (eager), [`FLAG_FAILED`] (reply, end) |
//! | 2 | `slots` u16 | receive slots the sender re-posted for the receiver (credit) |
//! | 4 | `bytes` u32 | unexpected-eager bytes the sender freed (credit) |
//! | 8 | `tag` i32 | xdev tag (eager, rendezvous start) |
//! | 12 | `context` u32 | xdev context |
//! | 16 | `id` u64 | the sender's send id (eager-sync, start, reply, ack) or the receiver's receive id (end) |
//!
//! followed by a kind-specific body: the payload (`EAGER`), the message
//! length (`RNDZ_START`, 8 bytes), or the receive id, address, granted
//! length and rkey (`RNDZ_REPLY`, 32 bytes). The source rank is not on the
//! wire: it is the queue pair the message arrived on, so a peer cannot
//! speak for another.
//!
//! [`decode`] checks everything a peer controls before the engine uses it:
//! the kind, unknown flag bits, the frame length for the kind, the payload
//! length against the eager limit, and the tag's sign. What needs state (ids
//! the receiver offered, lengths against the send) is checked by the engine.

use xdev::{Context, Tag};

/// Bytes of the common header.
pub const HEADER_LEN: usize = 24;
/// Bytes of the largest control message (`RNDZ_REPLY`).
pub const MAX_CONTROL_LEN: usize = HEADER_LEN + 32;

/// Eager: the receiver acknowledges the match (`ACK`), for `ssend`.
pub const FLAG_SYNC: u8 = 1;
/// Reply or end: the rendezvous failed on the sending side of this message
/// (the buffer could not be registered); no data moves.
pub const FLAG_FAILED: u8 = 2;

/// Message kinds.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Header plus payload.
    Eager = 1,
    /// `RNDZ_START`: a message of `len` bytes waits at the sender.
    RndzStart = 2,
    /// `RNDZ_REPLY`: the receiver matched it; write `len` bytes at `addr`
    /// with `rkey`.
    RndzReply = 3,
    /// `RNDZ_END`: the data is written (it follows the RDMA write on the
    /// same queue pair, so it arrives after the data).
    RndzEnd = 4,
    /// The receiver matched a synchronous eager message.
    Ack = 5,
    /// Credit only.
    Credit = 6,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Eager,
            2 => Kind::RndzStart,
            3 => Kind::RndzReply,
            4 => Kind::RndzEnd,
            5 => Kind::Ack,
            6 => Kind::Credit,
            _ => return None,
        })
    }

    /// The flag bits this kind defines.
    pub fn allowed_flags(self) -> u8 {
        match self {
            Kind::Eager => FLAG_SYNC,
            Kind::RndzReply | Kind::RndzEnd => FLAG_FAILED,
            _ => 0,
        }
    }

    /// Total frame length of a message of this kind without payload.
    pub fn frame_len(self) -> usize {
        match self {
            Kind::RndzStart => HEADER_LEN + 8,
            Kind::RndzReply => MAX_CONTROL_LEN,
            _ => HEADER_LEN,
        }
    }
}

/// The common header.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub struct Header {
    /// Flag bits.
    pub flags: u8,
    /// Receive slots returned.
    pub slots: u16,
    /// Eager bytes returned.
    pub bytes: u32,
    /// xdev tag.
    pub tag: Tag,
    /// xdev context.
    pub context: Context,
    /// Send or receive id (see the module docs).
    pub id: u64,
}

/// The kind-specific part of a message.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Body<'a> {
    /// Eager payload.
    Eager(&'a [u8]),
    /// Rendezvous start: the message length.
    RndzStart {
        /// Message length.
        len: u64,
    },
    /// Rendezvous reply.
    RndzReply {
        /// The receiver's id for `RNDZ_END`.
        rid: u64,
        /// Where to write.
        addr: u64,
        /// Bytes to write (at most the message length).
        len: u64,
        /// Remote key of the receive buffer.
        rkey: u32,
    },
    /// Rendezvous end.
    RndzEnd,
    /// Synchronous-send acknowledgement.
    Ack,
    /// Credit return.
    Credit,
}

impl Body<'_> {
    /// The kind of this body.
    pub fn kind(&self) -> Kind {
        match self {
            Body::Eager(_) => Kind::Eager,
            Body::RndzStart { .. } => Kind::RndzStart,
            Body::RndzReply { .. } => Kind::RndzReply,
            Body::RndzEnd => Kind::RndzEnd,
            Body::Ack => Kind::Ack,
            Body::Credit => Kind::Credit,
        }
    }
}

/// Why a frame was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Shorter than the header or than its kind needs.
    #[error("{kind} frame of {len} bytes (needs {need})")]
    Short {
        /// Kind name (or "any").
        kind: &'static str,
        /// Bytes received.
        len: usize,
        /// Bytes needed.
        need: usize,
    },
    /// Control frames have a fixed length.
    #[error("{kind} frame of {len} bytes (exactly {want} expected)")]
    Long {
        /// Kind name.
        kind: &'static str,
        /// Bytes received.
        len: usize,
        /// Bytes expected.
        want: usize,
    },
    /// Unknown kind byte.
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    /// Flag bits that this kind does not define.
    #[error("flags {flags:#x} are not valid for {kind}")]
    Flags {
        /// Kind name.
        kind: &'static str,
        /// The flags byte.
        flags: u8,
    },
    /// Eager payload over the negotiated limit.
    #[error("eager payload of {len} bytes exceeds the limit of {limit}")]
    TooLarge {
        /// Payload bytes.
        len: usize,
        /// The eager limit.
        limit: usize,
    },
    /// A negative tag.
    #[error("negative tag {0}")]
    Tag(Tag),
}

fn name(kind: Kind) -> &'static str {
    match kind {
        Kind::Eager => "EAGER",
        Kind::RndzStart => "RNDZ_START",
        Kind::RndzReply => "RNDZ_REPLY",
        Kind::RndzEnd => "RNDZ_END",
        Kind::Ack => "ACK",
        Kind::Credit => "CREDIT",
    }
}

fn u16_at(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}
fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"))
}

/// Writes `head` and `body` (without an eager payload, which the caller
/// copies right after the header) into `out`; returns the bytes written
/// (the header plus the fixed body). `out` must hold
/// [`MAX_CONTROL_LEN`] bytes.
#[inline]
pub fn encode(head: &Header, body: &Body<'_>, out: &mut [u8]) -> usize {
    let kind = body.kind();
    out[0] = kind as u8;
    out[1] = head.flags;
    out[2..4].copy_from_slice(&head.slots.to_le_bytes());
    out[4..8].copy_from_slice(&head.bytes.to_le_bytes());
    out[8..12].copy_from_slice(&head.tag.to_le_bytes());
    out[12..16].copy_from_slice(&head.context.to_le_bytes());
    out[16..24].copy_from_slice(&head.id.to_le_bytes());
    match *body {
        Body::RndzStart { len } => out[24..32].copy_from_slice(&len.to_le_bytes()),
        Body::RndzReply {
            rid,
            addr,
            len,
            rkey,
        } => {
            out[24..32].copy_from_slice(&rid.to_le_bytes());
            out[32..40].copy_from_slice(&addr.to_le_bytes());
            out[40..48].copy_from_slice(&len.to_le_bytes());
            out[48..52].copy_from_slice(&rkey.to_le_bytes());
            out[52..56].fill(0);
        }
        _ => {}
    }
    kind.frame_len()
}

/// Decodes and validates one received frame (`frame` is exactly the bytes
/// the completion reported). `eager_limit` is the largest eager payload.
#[inline]
pub fn decode(frame: &[u8], eager_limit: usize) -> Result<(Header, Body<'_>), WireError> {
    if frame.len() < HEADER_LEN {
        return Err(WireError::Short {
            kind: "any",
            len: frame.len(),
            need: HEADER_LEN,
        });
    }
    let kind = Kind::from_u8(frame[0]).ok_or(WireError::UnknownKind(frame[0]))?;
    let head = Header {
        flags: frame[1],
        slots: u16_at(frame, 2),
        bytes: u32_at(frame, 4),
        tag: u32_at(frame, 8) as i32,
        context: u32_at(frame, 12),
        id: u64_at(frame, 16),
    };
    if head.flags & !kind.allowed_flags() != 0 {
        return Err(WireError::Flags {
            kind: name(kind),
            flags: head.flags,
        });
    }
    let need = kind.frame_len();
    if frame.len() < need {
        return Err(WireError::Short {
            kind: name(kind),
            len: frame.len(),
            need,
        });
    }
    if kind != Kind::Eager && frame.len() != need {
        return Err(WireError::Long {
            kind: name(kind),
            len: frame.len(),
            want: need,
        });
    }
    if matches!(kind, Kind::Eager | Kind::RndzStart) && head.tag < 0 {
        return Err(WireError::Tag(head.tag));
    }
    let body = match kind {
        Kind::Eager => {
            let payload = &frame[HEADER_LEN..];
            if payload.len() > eager_limit {
                return Err(WireError::TooLarge {
                    len: payload.len(),
                    limit: eager_limit,
                });
            }
            Body::Eager(payload)
        }
        Kind::RndzStart => Body::RndzStart {
            len: u64_at(frame, 24),
        },
        Kind::RndzReply => Body::RndzReply {
            rid: u64_at(frame, 24),
            addr: u64_at(frame, 32),
            len: u64_at(frame, 40),
            rkey: u32_at(frame, 48),
        },
        Kind::RndzEnd => Body::RndzEnd,
        Kind::Ack => Body::Ack,
        Kind::Credit => Body::Credit,
    };
    Ok((head, body))
}

#[cfg(test)]
mod tests;
