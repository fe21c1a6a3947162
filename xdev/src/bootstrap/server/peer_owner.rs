//! Whose socket a connection from this host comes from, read from
//! `/proc/net/tcp` and `tcp6`: a connection by another user is closed at
//! once (see [`ServerOptions::max_pending_handshakes`](super::ServerOptions::max_pending_handshakes)).

use std::net::SocketAddr;

/// An IPv4-mapped IPv6 address as IPv4; others unchanged.
pub(super) fn canonical(ip: std::net::IpAddr) -> std::net::IpAddr {
    match ip {
        std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, std::net::IpAddr::V4),
        v4 => v4,
    }
}

/// Whether a connection from `peer` to this service's `local` end may take
/// a handshake slot: not if its socket is on this host and owned by another
/// user (or, for a loopback peer, cannot be found at all).
pub(super) fn peer_allowed(local: SocketAddr, peer: SocketAddr) -> bool {
    match local_owner(local, peer) {
        Owner::Uid(uid) => {
            // SAFETY: geteuid has no preconditions.
            uid == unsafe { libc::geteuid() }
        }
        Owner::NotLocal => !canonical(peer.ip()).is_loopback(),
        Owner::Unknown => true,
    }
}

/// Who owns the socket at the other end of a connection.
#[derive(Debug, PartialEq, Eq)]
enum Owner {
    /// A socket of this host owned by this uid.
    Uid(u32),
    /// No socket of this host (network namespace) is that end.
    NotLocal,
    /// The socket tables cannot be read.
    Unknown,
}

/// Looks the socket whose local end is `peer` and whose remote end is
/// `local` up in `/proc/net/tcp` and `/proc/net/tcp6`.
fn local_owner(local: SocketAddr, peer: SocketAddr) -> Owner {
    let mut readable = false;
    for (file, v6) in [("/proc/net/tcp", false), ("/proc/net/tcp6", true)] {
        let (Some(want_local), Some(want_remote)) =
            (proc_net_addr(peer, v6), proc_net_addr(local, v6))
        else {
            continue;
        };
        let Ok(table) = std::fs::read_to_string(file) else {
            continue;
        };
        readable = true;
        if let Some(uid) = find_owner(&table, &want_local, &want_remote) {
            return Owner::Uid(uid);
        }
    }
    if readable {
        Owner::NotLocal
    } else {
        Owner::Unknown
    }
}

/// The uid of the socket with local end `local` and remote end `remote`
/// (as [`proc_net_addr`] writes them) in a `/proc/net/tcp*` table, leaving
/// out TIME_WAIT entries (which have no owner).
fn find_owner(table: &str, local: &str, remote: &str) -> Option<u32> {
    table.lines().skip(1).find_map(|line| {
        let f: Vec<&str> = line.split_ascii_whitespace().collect();
        if f.len() < 8 || f[3] == "06" {
            return None;
        }
        (f[1].eq_ignore_ascii_case(local) && f[2].eq_ignore_ascii_case(remote))
            .then(|| f[7].parse().ok())
            .flatten()
    })
}

/// `addr` as `/proc/net/tcp` (`v6` false) or `tcp6` writes it: each 32-bit
/// word of the address in hex as the host reads it, a colon, the port in 4
/// hex digits. `None` if the address has no form in that table.
fn proc_net_addr(addr: SocketAddr, v6: bool) -> Option<String> {
    let words: Vec<[u8; 4]> = match (canonical(addr.ip()), v6) {
        (std::net::IpAddr::V4(ip), false) => vec![ip.octets()],
        (std::net::IpAddr::V4(ip), true) => chunks(ip.to_ipv6_mapped().octets()),
        (std::net::IpAddr::V6(ip), true) => chunks(ip.octets()),
        (std::net::IpAddr::V6(_), false) => return None,
    };
    let mut s: String = words
        .iter()
        .map(|w| format!("{:08X}", u32::from_ne_bytes(*w)))
        .collect();
    s.push_str(&format!(":{:04X}", addr.port()));
    Some(s)
}

fn chunks(b: [u8; 16]) -> Vec<[u8; 4]> {
    b.chunks_exact(4)
        .map(|c| [c[0], c[1], c[2], c[3]])
        .collect()
}

#[cfg(test)]
mod tests;
