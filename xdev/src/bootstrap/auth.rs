//! Challenge-response authentication of a bootstrap connection with
//! HMAC-SHA256 under the per-job secret.
//!
//! The service sends a fresh nonce `ns`; the client answers with its own nonce
//! `nc` and `HMAC(secret, "xdev-bootstrap-v1/client" | ns | nc | rank | size |
//! job)`; the service checks it in constant time and answers with
//! `HMAC(secret, "xdev-bootstrap-v1/server" | ns | nc | rank | size | job)`,
//! which the client checks in turn. Integers are u32 little endian, the job is
//! prefixed by its u32 length. The secret never travels; the distinct labels
//! keep one side's answer from being reflected as the other's, and the fresh
//! nonces keep an old answer from being replayed.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::wire::{MAC_LEN, NONCE_LEN};
use super::Secret;
use crate::{Error, Result};

type HmacSha256 = Hmac<Sha256>;

const CLIENT_LABEL: &[u8] = b"xdev-bootstrap-v1/client";
const SERVER_LABEL: &[u8] = b"xdev-bootstrap-v1/server";

/// The identity a handshake proves.
pub(crate) struct Claim<'a> {
    pub server_nonce: &'a [u8; NONCE_LEN],
    pub client_nonce: &'a [u8; NONCE_LEN],
    pub rank: u32,
    pub size: u32,
    pub job: &'a str,
}

fn keyed(secret: &Secret, label: &[u8], c: &Claim<'_>) -> HmacSha256 {
    // HMAC accepts keys of any length, so this cannot fail.
    let mut m = <HmacSha256 as Mac>::new_from_slice(secret.as_bytes())
        .expect("HMAC takes keys of any length");
    m.update(label);
    m.update(c.server_nonce);
    m.update(c.client_nonce);
    m.update(&c.rank.to_le_bytes());
    m.update(&c.size.to_le_bytes());
    m.update(&(c.job.len() as u32).to_le_bytes());
    m.update(c.job.as_bytes());
    m
}

fn tag(m: HmacSha256) -> [u8; MAC_LEN] {
    let mut out = [0u8; MAC_LEN];
    out.copy_from_slice(&m.finalize().into_bytes());
    out
}

/// The client's proof.
pub(crate) fn client_mac(secret: &Secret, c: &Claim<'_>) -> [u8; MAC_LEN] {
    tag(keyed(secret, CLIENT_LABEL, c))
}

/// Checks the client's proof in constant time.
pub(crate) fn verify_client(secret: &Secret, c: &Claim<'_>, mac: &[u8; MAC_LEN]) -> bool {
    keyed(secret, CLIENT_LABEL, c).verify_slice(mac).is_ok()
}

/// The service's proof.
pub(crate) fn server_mac(secret: &Secret, c: &Claim<'_>) -> [u8; MAC_LEN] {
    tag(keyed(secret, SERVER_LABEL, c))
}

/// Checks the service's proof in constant time.
pub(crate) fn verify_server(secret: &Secret, c: &Claim<'_>, mac: &[u8; MAC_LEN]) -> bool {
    keyed(secret, SERVER_LABEL, c).verify_slice(mac).is_ok()
}

/// `N` bytes from the operating system's random number generator.
pub(crate) fn random<const N: usize>() -> Result<[u8; N]> {
    let mut b = [0u8; N];
    getrandom::fill(&mut b).map_err(|e| {
        Error::transport(
            "bootstrap: reading the OS random number generator",
            std::io::Error::other(e.to_string()),
        )
    })?;
    Ok(b)
}

#[cfg(test)]
mod tests;
