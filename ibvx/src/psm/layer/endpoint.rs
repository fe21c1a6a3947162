//! A PSM2 endpoint: open, connect, poll, close.

use std::ptr;
use std::time::Duration;

use psm_sys::ffi::*;
use xdev::devkit::matching::FxMap;
use xdev::Result;

use super::library::{describe, psm_error, EndpointSlot, JobKey, Library};

/// An open PSM2 endpoint, closed on drop (forced), with the peers it
/// connected to, numbered in the order of [`Endpoint::connect`].
///
/// It holds the process's [`EndpointSlot`], so at most one exists at a time.
/// Not `Sync`: PSM2 calls on one endpoint must not run concurrently.
pub struct Endpoint {
    lib: &'static Library,
    /// Null once closed.
    raw: psm2_ep_t,
    epid: psm2_epid_t,
    /// Address of each connected peer, by index.
    peers: Vec<psm2_epaddr_t>,
    /// Index of each peer by address (statuses name the sender by address).
    index: FxMap<usize, usize>,
    /// Released after the close (field drops run after `Drop::drop`).
    _slot: EndpointSlot,
}

// SAFETY: PSM2 endpoint handles may be used from any thread as long as calls
// on one endpoint do not overlap; `Endpoint` is not `Sync` and every call
// goes through it (or the matched queue that owns it), so they cannot.
unsafe impl Send for Endpoint {}

fn timeout_ns(t: Duration) -> i64 {
    i64::try_from(t.as_nanos()).unwrap_or(i64::MAX)
}

impl Endpoint {
    /// Opens the endpoint of this process for job `key`, with PSM2's
    /// default options (`psm2_ep_open`).
    pub fn open(slot: EndpointSlot, key: &JobKey) -> Result<Endpoint> {
        let lib = slot.library();
        let psm = lib.psm();
        let mut opts = std::mem::MaybeUninit::<psm2_ep_open_opts>::zeroed();
        // SAFETY: opts is valid for writes of one psm2_ep_open_opts.
        let e = unsafe { (psm.psm2_ep_open_opts_get_defaults)(opts.as_mut_ptr()) };
        if e != psm2_error::PSM2_OK {
            return Err(psm_error(psm, "psm2_ep_open_opts_get_defaults", e));
        }
        // SAFETY: zero-initialised, then filled by PSM2 (integers only).
        let opts = unsafe { opts.assume_init() };
        let mut raw: psm2_ep_t = ptr::null_mut();
        let mut epid: psm2_epid_t = 0;
        // SAFETY: a 16-byte key, options and out-pointers valid for the call;
        // the slot proves no other endpoint is open in this process.
        let e = unsafe { (psm.psm2_ep_open)(key.0.as_ptr(), &opts, &mut raw, &mut epid) };
        if e != psm2_error::PSM2_OK {
            return Err(psm_error(psm, "psm2_ep_open", e));
        }
        Ok(Endpoint {
            lib,
            raw,
            epid,
            peers: Vec::new(),
            index: FxMap::default(),
            _slot: slot,
        })
    }

    /// The library this endpoint belongs to.
    pub fn library(&self) -> &'static Library {
        self.lib
    }

    /// PSM2's id of this endpoint (what peers connect to).
    pub fn epid(&self) -> u64 {
        self.epid
    }

    /// The raw handle, for the matched queue.
    #[inline]
    pub(super) fn raw(&self) -> psm2_ep_t {
        self.raw
    }

    /// Connects to `epids` (`psm2_ep_connect`, this endpoint's own included
    /// if listed); they become peers `n..n + epids.len()` after the `n`
    /// connected before. On failure the error names each index PSM2 could
    /// not reach (as "rank i"), and no peer is added.
    ///
    /// PSM2 completes a connection only while both sides poll: a peer's
    /// [`Endpoint::poll`] must keep running until every side has connected.
    ///
    /// Beware of libpsm2: in shm-only mode, connecting to an epid no live
    /// shm endpoint has crashes the process (SIGSEGV inside libpsm2, see
    /// `psm_sys`'s docs); check that every peer is on this host first.
    pub fn connect(&mut self, epids: &[u64], timeout: Duration) -> Result<()> {
        let psm = self.lib.psm();
        let n = epids.len();
        let count = i32::try_from(n)
            .map_err(|_| xdev::Error::Config("too many PSM2 peers to connect".into()))?;
        let mut errors = vec![psm2_error::PSM2_OK; n];
        let mut addrs: Vec<psm2_epaddr_t> = vec![ptr::null_mut(); n];
        // SAFETY: the endpoint is open; n epids in, n errors and epaddrs out;
        // no mask (all are connected).
        let e = unsafe {
            (psm.psm2_ep_connect)(
                self.raw,
                count,
                epids.as_ptr(),
                ptr::null(),
                errors.as_mut_ptr(),
                addrs.as_mut_ptr(),
                timeout_ns(timeout),
            )
        };
        if e != psm2_error::PSM2_OK {
            let per_peer: Vec<String> = errors
                .iter()
                .enumerate()
                .filter(|(_, e)| **e != psm2_error::PSM2_OK)
                .map(|(r, e)| format!("rank {r}: {}", describe(psm, *e)))
                .collect();
            let call = format!("psm2_ep_connect ({})", per_peer.join(", "));
            return Err(psm_error(psm, &call, e));
        }
        for a in addrs {
            self.index.entry(a as usize).or_insert(self.peers.len());
            self.peers.push(a);
        }
        Ok(())
    }

    /// How many peers are connected.
    pub fn peers(&self) -> usize {
        self.peers.len()
    }

    /// The address of peer `i`, if connected.
    #[inline]
    pub(super) fn addr(&self, i: usize) -> Option<psm2_epaddr_t> {
        self.peers.get(i).copied()
    }

    /// The index of the peer at address `addr` (from a status).
    #[inline]
    pub(super) fn peer_at(&self, addr: usize) -> Option<usize> {
        self.index.get(&addr).copied()
    }

    /// Makes progress (`psm2_poll`): PSM2 moves data and completes requests
    /// and connections only inside its calls.
    #[inline]
    pub fn poll(&self) {
        // SAFETY: the endpoint is open (closing consumes it); `Endpoint` is
        // not `Sync`, so no other PSM2 call on it overlaps this one.
        unsafe { (self.lib.psm().psm2_poll)(self.raw) };
    }

    /// Closes gracefully (`PSM2_EP_CLOSE_GRACEFUL`, up to `timeout`), forced
    /// if that fails. The queue on it must be finalized first.
    pub(super) fn close(&mut self, timeout: Duration) {
        if self.raw.is_null() {
            return;
        }
        let psm = self.lib.psm();
        let raw = std::mem::replace(&mut self.raw, ptr::null_mut());
        // SAFETY: the endpoint is open and its queue finalized; nothing uses
        // it after this (raw is now null: every later call is skipped, and
        // the owner is being consumed).
        let e =
            unsafe { (psm.psm2_ep_close)(raw, PSM2_EP_CLOSE_GRACEFUL as i32, timeout_ns(timeout)) };
        if e != psm2_error::PSM2_OK {
            // SAFETY: as above; a graceful close that failed is forced.
            unsafe { (psm.psm2_ep_close)(raw, PSM2_EP_CLOSE_FORCE as i32, 0) };
        }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        if self.raw.is_null() {
            return;
        }
        // SAFETY: the endpoint is open and this is its last use; a forced
        // close makes PSM2 let go of every request on it at once.
        unsafe { (self.lib.psm().psm2_ep_close)(self.raw, PSM2_EP_CLOSE_FORCE as i32, 0) };
    }
}
