//! Errors of the pingpong tool; each displays as one line.

use std::io;

use ibvx::verbs;

/// Why a pingpong run failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PingpongError {
    /// A verbs error outside the measured loop (device, port, GID, setup).
    #[error(transparent)]
    Verbs(#[from] verbs::Error),

    /// A verbs error during a run (e.g. a failed work completion).
    #[error("{context}: {source}")]
    Run {
        /// Where it happened (test, size, iteration).
        context: String,
        /// The verbs error.
        source: verbs::Error,
    },

    /// The client could not reach the server.
    #[error("cannot connect to {addr}: {detail}")]
    Connect {
        /// `host:port`.
        addr: String,
        /// What went wrong.
        detail: String,
    },

    /// An I/O error on the control connection.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        source: io::Error,
    },

    /// Nothing happened in time.
    #[error("timed out after {secs} s {what}")]
    Timeout {
        /// What was awaited.
        what: String,
        /// The limit, in seconds.
        secs: f64,
    },

    /// The peer went away (TCP connection closed or lost).
    #[error("peer disconnected: {detail}")]
    PeerGone {
        /// What was seen.
        detail: String,
    },

    /// Server and client options differ (detected by this side).
    #[error("{0}")]
    Mismatch(String),

    /// The server refused the run (and said why).
    #[error("the server refused the run: {0}")]
    Rejected(String),

    /// The peer does not speak the expected protocol.
    #[error("protocol error: {0}")]
    Protocol(String),

    /// Received data differs from the pattern the peer wrote.
    #[error("data check failed: {0}")]
    DataCheck(String),

    /// Options that cannot work together with the device or the peer.
    #[error("{0}")]
    Setup(String),
}
