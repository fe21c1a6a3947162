//! The verbs layer's error type.

use std::fmt;
use std::io;

/// A QP state transition, named in [`Error::QpTransition`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// RESET to INIT (port, P_Key index, access flags).
    ResetToInit,
    /// INIT to RTR, ready to receive (path MTU, destination QPN, receive PSN, address vector).
    InitToRtr,
    /// RTR to RTS, ready to send (send PSN, timeouts, retry counts).
    RtrToRts,
    /// Any state to ERROR (flushes outstanding work requests).
    ToError,
}

impl fmt::Display for Transition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Transition::ResetToInit => "RESET->INIT",
            Transition::InitToRtr => "INIT->RTR",
            Transition::RtrToRts => "RTR->RTS",
            Transition::ToError => "->ERROR",
        })
    }
}

/// Everything that can go wrong in [`crate::verbs`]. Each variant displays as
/// one line that names what failed and why.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// libibverbs could not be loaded: displays as `verbs not available: ...`.
    #[error(transparent)]
    Unavailable(#[from] ibvx_sys::LoadError),

    /// The device list is empty (or could not be read).
    #[error("no RDMA device found{}", if .reason.is_empty() { String::new() } else { format!(" ({})", .reason) })]
    NoDevice {
        /// Why the list is empty when known (e.g. no kernel RDMA support), else empty.
        reason: String,
    },

    /// No device has the requested name.
    #[error("RDMA device {name:?} not found (available: {})", if .available.is_empty() { "none".to_string() } else { .available.join(", ") })]
    DeviceNotFound {
        /// The name asked for.
        name: String,
        /// The names of the devices that exist.
        available: Vec<String>,
    },

    /// The port number does not exist on the device, or cannot be queried.
    #[error("bad port {port} on {device}: {reason}")]
    BadPort {
        /// Device name.
        device: String,
        /// Port number asked for.
        port: u8,
        /// Why it cannot be used.
        reason: String,
    },

    /// The GID index is out of range, cannot be queried, or holds an
    /// all-zero (unset) GID.
    #[error("bad GID index {index} on {device} port {port}: {reason}")]
    BadGidIndex {
        /// Device name.
        device: String,
        /// Port number.
        port: u8,
        /// GID table index asked for.
        index: u32,
        /// Why it cannot be used.
        reason: String,
    },

    /// `ibv_reg_mr` failed.
    #[error("memory registration of {len} bytes failed: {source}{hint}")]
    Registration {
        /// Length of the buffer.
        len: usize,
        /// The errno reported by libibverbs.
        source: io::Error,
        /// Extra advice (e.g. about `ulimit -l`), possibly empty.
        hint: &'static str,
    },

    /// `ibv_modify_qp` refused a state transition.
    #[error("QP {qpn:#x}: transition {transition} failed: {source}")]
    QpTransition {
        /// The QP number.
        qpn: u32,
        /// Which transition.
        transition: Transition,
        /// The errno reported by libibverbs.
        source: io::Error,
    },

    /// A work completion carried an error status.
    #[error("work completion error: {status_str} (status {status}, wr_id {wr_id:#x}, QP {qp_num:#x}, vendor error {vendor_err:#x})")]
    WorkCompletion {
        /// `ibv_wc_status_str(status)`.
        status_str: String,
        /// The raw `ibv_wc_status`.
        status: u32,
        /// The work request id of the failed request.
        wr_id: u64,
        /// The local QP number.
        qp_num: u32,
        /// The provider's vendor error code.
        vendor_err: u32,
    },

    /// Another verbs call failed with an errno.
    #[error("{call} failed: {source}")]
    Verbs {
        /// The libibverbs function.
        call: &'static str,
        /// The errno it reported.
        source: io::Error,
    },

    /// A bounded resource would be exceeded (the registration cache's
    /// pinned-memory budget), even after releasing what could be released.
    #[error("{what} of {requested} bytes refused: {pinned} bytes already pinned, limit {limit}")]
    Budget {
        /// What was asked for (e.g. `registration cache lease`).
        what: &'static str,
        /// Bytes asked for.
        requested: usize,
        /// Bytes pinned when the request was refused.
        pinned: usize,
        /// The limit.
        limit: usize,
    },

    /// A caller error detected before calling libibverbs.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// `Error::Verbs` from a call that reports failure through `errno`.
    pub(crate) fn last_os(call: &'static str) -> Self {
        Error::Verbs {
            call,
            source: io::Error::last_os_error(),
        }
    }

    /// `Error::Verbs` from a call that returns an errno value (or a negative one).
    pub(crate) fn from_rc(call: &'static str, rc: i32) -> Self {
        Error::Verbs {
            call,
            source: errno_error(rc),
        }
    }
}

/// An `io::Error` for a return code that is an errno value, possibly
/// negated (providers differ), or -1 with `errno` set.
pub(crate) fn errno_error(rc: i32) -> io::Error {
    if rc == -1 {
        let e = io::Error::last_os_error();
        if e.raw_os_error().is_some_and(|n| n != 0) {
            return e;
        }
    }
    io::Error::from_raw_os_error(rc.saturating_abs())
}

#[cfg(test)]
mod tests;
