//! The accept loop and the handshake slots: who may take a slot, and which
//! silent handshake a new connection evicts when all are taken.

use std::collections::HashMap;
use std::net::{Shutdown, TcpListener};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use super::connection::run_connection;
use super::peer_owner::{canonical, peer_allowed};
use super::{lock, Pending, Shared};

pub(super) fn accept_loop(shared: &Arc<Shared>, listener: &TcpListener) {
    let idle = Duration::from_millis(5);
    let max = shared.opts.max_pending_handshakes;
    while !shared.stop.load(Ordering::SeqCst) {
        let threads = shared.handshakes.load(Ordering::SeqCst);
        let room = {
            let p = lock(&shared.pending);
            p.len() < max || p.values().any(|c| !c.heard.load(Ordering::SeqCst))
        };
        if threads >= max.saturating_mul(2) || !room {
            thread::sleep(idle);
            continue;
        }
        let (stream, peer) = match listener.accept() {
            Ok(a) => a,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                // Nothing to accept: sleep until a connection comes or the
                // service stops (no timer waking the launcher's process
                // every few milliseconds while its ranks run).
                wait_for_connection(listener, &shared.wake);
                continue;
            }
            Err(_) => {
                // A transient failure such as running out of descriptors:
                // wait and retry.
                thread::sleep(idle);
                continue;
            }
        };
        // Another user's connection from this host: closed at once.
        let local = stream.local_addr().ok();
        if !local.is_some_and(|l| peer_allowed(l, peer)) {
            continue;
        }
        let Ok((registered, slot)) = stream
            .set_nonblocking(false)
            .and_then(|()| crate::bootstrap::keepalive::watch_peer(&stream))
            .and_then(|()| Ok((stream.try_clone()?, stream.try_clone()?)))
        else {
            continue;
        };
        let heard = Arc::new(AtomicBool::new(false));
        let id = {
            let mut conns = lock(&shared.conns);
            conns.next_id += 1;
            conns.next_id - 1
        };
        // Not under the connections' lock: this may wait for a slot.
        if !take_slot(
            shared,
            id,
            Pending {
                stream: slot,
                source: canonical(peer.ip()),
                since: Instant::now(),
                heard: heard.clone(),
            },
        ) {
            break;
        }
        let mut conns = lock(&shared.conns);
        if shared.stop.load(Ordering::SeqCst) {
            lock(&shared.pending).remove(&id);
            break;
        }
        conns.sockets.insert(id, registered);
        shared.handshakes.fetch_add(1, Ordering::SeqCst);
        let sh = shared.clone();
        match thread::Builder::new()
            .name("xdev-bootstrap-conn".into())
            .spawn(move || run_connection(&sh, id, stream, &heard))
        {
            Ok(h) => {
                conns.threads.retain(|t| !t.is_finished());
                conns.threads.push(h);
            }
            Err(_) => {
                shared.handshakes.fetch_sub(1, Ordering::SeqCst);
                lock(&shared.pending).remove(&id);
                conns.sockets.remove(&id);
            }
        }
    }
}

/// Registers connection `id` as holding a handshake slot, evicting a
/// silent one when all are taken (see
/// Blocks until `listener` has a connection to accept or `wake` was
/// signalled (the service stops), at most [`LONGEST_IDLE`].
fn wait_for_connection(listener: &TcpListener, wake: &OwnedFd) {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let mut fds = [
        PollFd::new(listener, PollFlags::IN),
        PollFd::new(wake, PollFlags::IN),
    ];
    let longest = Timespec {
        tv_sec: LONGEST_IDLE.as_secs() as i64,
        tv_nsec: 0,
    };
    // An error (EINTR) only ends this wait early: the loop checks again.
    let _ = poll(&mut fds, Some(&longest));
}

/// The longest an idle accept loop sleeps before it looks at the stop flag
/// again (a safety net: stopping wakes it at once).
const LONGEST_IDLE: Duration = Duration::from_secs(1);

/// [`ServerOptions::max_pending_handshakes`]); waits while no slot can be
/// had. Returns false if the service stops meanwhile.
fn take_slot(shared: &Shared, id: u64, conn: Pending) -> bool {
    let max = shared.opts.max_pending_handshakes;
    loop {
        {
            let mut p = lock(&shared.pending);
            if p.len() >= max {
                if let Some(victim) = eviction_victim(&p) {
                    if let Some(v) = p.remove(&victim) {
                        let _ = v.stream.shutdown(Shutdown::Both);
                    }
                }
            }
            if p.len() < max {
                p.insert(id, conn);
                return true;
            }
        }
        if shared.stop.load(Ordering::SeqCst) {
            return false;
        }
        thread::sleep(Duration::from_millis(5));
    }
}

/// The handshake to evict for a new connection: one that has not sent its
/// `Auth`, of the source address holding the most slots (so one peer
/// cannot push out the others), the oldest of those.
fn eviction_victim(pending: &HashMap<u64, Pending>) -> Option<u64> {
    let mut per_source: HashMap<std::net::IpAddr, usize> = HashMap::new();
    for c in pending.values() {
        *per_source.entry(c.source).or_default() += 1;
    }
    pending
        .iter()
        .filter(|(_, c)| !c.heard.load(Ordering::SeqCst))
        .max_by_key(|(_, c)| (per_source[&c.source], std::cmp::Reverse(c.since)))
        .map(|(&id, _)| id)
}
