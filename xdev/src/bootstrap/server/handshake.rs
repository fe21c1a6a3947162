//! The handshake of a new connection: the service's challenge, the
//! client's `Auth` read under an overall deadline, the checks of its claim,
//! and the registration of the rank it proves.

use std::io::{self, Read};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::{lock, status_of, Conn, Shared, Slot};
use crate::bootstrap::auth::{self, Claim};
use crate::bootstrap::wire::{
    self, Message, MAC_LEN, MAX_HANDSHAKE_FRAME_LEN, NONCE_LEN, PROTOCOL_VERSION,
};
use crate::bootstrap::{Departure, SERVICE};
use crate::Rank;

fn refuse(mut stream: &TcpStream, reason: &str) {
    let _ = wire::write_message(
        &mut stream,
        &Message::Refused {
            reason: reason.to_owned(),
        },
    );
}

/// Runs the handshake; on success the rank is registered as live and has been
/// sent `Welcome` and the departures so far.
pub(super) fn handshake(
    shared: &Shared,
    stream: &TcpStream,
    heard: &AtomicBool,
) -> Option<(Rank, Arc<Conn>)> {
    let opts = &shared.opts;
    let deadline = Instant::now() + opts.handshake_timeout;
    let server_nonce = send_challenge(shared, stream)?;
    let Message::Auth {
        version,
        rank,
        size,
        nonce: client_nonce,
        mac,
        job,
    } = read_auth(stream, deadline, heard)?
    else {
        unreachable!("read_auth returns an Auth or nothing");
    };
    let claim = Claim {
        server_nonce: &server_nonce,
        client_nonce: &client_nonce,
        rank,
        size,
        job: &job,
    };
    let rank = check_claim(shared, stream, version, &claim, &mac)?;
    let conn = register(shared, stream, rank, &claim)?;
    Some((rank, conn))
}

/// Sends the `Challenge` with a fresh nonce, which it returns.
fn send_challenge(shared: &Shared, stream: &TcpStream) -> Option<[u8; NONCE_LEN]> {
    let opts = &shared.opts;
    stream.set_nodelay(true).ok()?;
    stream
        .set_write_timeout(Some(opts.handshake_timeout))
        .ok()?;
    let server_nonce = auth::random().ok()?;
    let mut w = stream;
    wire::write_message(
        &mut w,
        &Message::Challenge {
            version: PROTOCOL_VERSION,
            nonce: server_nonce,
        },
    )
    .ok()?;
    Some(server_nonce)
}

/// Reads the client's `Auth` by `deadline`, marking the connection `heard`
/// (no longer evictable) once it has arrived; anything else is refused.
/// Returns that `Auth`, no other message.
fn read_auth(stream: &TcpStream, deadline: Instant, heard: &AtomicBool) -> Option<Message> {
    let mut r = DeadlineReader { stream, deadline };
    match wire::read_message(&mut r, MAX_HANDSHAKE_FRAME_LEN, SERVICE) {
        Ok(Some(auth @ Message::Auth { .. })) => {
            heard.store(true, Ordering::SeqCst);
            Some(auth)
        }
        Ok(Some(other)) => {
            refuse(stream, &format!("expected Auth, got {}", other.name()));
            None
        }
        Ok(None) => None,
        Err(e) => {
            refuse(stream, &e.to_string());
            None
        }
    }
}

/// Checks the protocol version, the proof of the secret, the job, its size
/// and the rank's range, refusing the connection at the first that fails;
/// returns the rank claimed.
fn check_claim(
    shared: &Shared,
    stream: &TcpStream,
    version: u16,
    claim: &Claim<'_>,
    mac: &[u8; MAC_LEN],
) -> Option<Rank> {
    let (size, job) = (claim.size, claim.job);
    if version != PROTOCOL_VERSION {
        refuse(
            stream,
            &format!("protocol version {version} is not supported (this service speaks {PROTOCOL_VERSION})"),
        );
        return None;
    }
    if !auth::verify_client(&shared.secret, claim, mac) {
        refuse(stream, "authentication failed: wrong job secret");
        return None;
    }
    if job != shared.job {
        refuse(
            stream,
            &format!(
                "wrong job: this service serves job {:?}, not {job:?}",
                shared.job
            ),
        );
        return None;
    }
    if size as usize != shared.size {
        refuse(
            stream,
            &format!(
                "wrong job size: the job has {} ranks, not {size}",
                shared.size
            ),
        );
        return None;
    }
    let rank = claim.rank as usize;
    if rank >= shared.size {
        refuse(
            stream,
            &format!(
                "rank {rank} is out of range: the job has ranks 0..{}",
                shared.size
            ),
        );
        return None;
    }
    Some(rank)
}

/// Registers `rank` as live unless it was claimed before, then sends it
/// `Welcome` and the departures so far.
fn register(
    shared: &Shared,
    stream: &TcpStream,
    rank: Rank,
    claim: &Claim<'_>,
) -> Option<Arc<Conn>> {
    let opts = &shared.opts;
    stream.set_read_timeout(None).ok()?;
    stream.set_write_timeout(Some(opts.write_timeout)).ok()?;
    let conn = Arc::new(Conn {
        writer: Mutex::new(stream.try_clone().ok()?),
    });
    // Hold the writer while registering so that no notice sent by another
    // thread can overtake the Welcome.
    let mut writer = lock(&conn.writer);
    let departed: Vec<Departure> = {
        let mut st = lock(&shared.state);
        if !matches!(st.slots[rank], Slot::Free) {
            drop(st);
            refuse(
                stream,
                &format!("rank {rank} is already claimed in this job"),
            );
            return None;
        }
        st.slots[rank] = Slot::Live {
            conn: conn.clone(),
            goodbye: false,
        };
        status_of(shared, &st).departed
    };
    shared.changed.notify_all();
    let welcome = Message::Welcome {
        mac: auth::server_mac(&shared.secret, claim),
    };
    // A failed write shows up as a closed connection in `serve`.
    let _ = wire::write_message(&mut *writer, &welcome);
    for d in departed {
        let _ = wire::write_message(
            &mut *writer,
            &Message::Departed {
                rank: d.rank as u32,
                clean: d.clean,
            },
        );
    }
    drop(writer);
    Some(conn)
}

/// Reads from a stream with an overall deadline (not just a per-read
/// timeout), so a client trickling bytes cannot hold a handshake slot.
struct DeadlineReader<'a> {
    stream: &'a TcpStream,
    deadline: Instant,
}

impl Read for DeadlineReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "bootstrap handshake deadline passed",
            ));
        }
        self.stream.set_read_timeout(Some(left))?;
        let mut s = self.stream;
        s.read(buf)
    }
}
