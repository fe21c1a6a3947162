//! The PSM2 device (`psm`): xdev over Omni-Path PSM2's matched queues (MQ),
//! as FastMPJ's psmdev did for Java.
//!
//! PSM2 does the matching and the protocols (eager, rendezvous, its shm and
//! hfi transports); this device only maps xdev onto it, with no second
//! matching layer:
//!
//! * **Tags.** PSM2's 96-bit tag carries the xdev tag (`tag0`), the context
//!   (`tag1`) and the message length (`tag2`, never matched: PSM2 does not
//!   report the sender's length of a truncated rendezvous message, and xdev
//!   must). A receive selects the tag exactly unless `ANY_TAG`, the context
//!   always, and the source by endpoint address (`PSM2_MQ_ANY_ADDR` for
//!   `ANY_SOURCE`); the sender's rank comes back from the status's
//!   `msg_peer`. PSM2's MQ keeps MPI's ordering rules.
//! * **Operations.** `isend`/`irecv` are `psm2_mq_isend2`/`psm2_mq_irecv2`
//!   with the request's buffer; `ssend` uses `PSM2_MQ_FLAG_SENDSYNC` (done
//!   only once matched); `probe` is `psm2_mq_iprobe2` in a progress loop;
//!   cancel is `psm2_mq_cancel` (receives only, as in PSM2); completions are
//!   collected with `psm2_mq_ipeek2` + `psm2_mq_test2` by every progress call.
//!   Truncation is PSM2's: the bytes that fit are delivered and the status
//!   reports the sender's length.
//! * **Start-up** goes through the bootstrap: rank 0's job key (a PSM2 UUID)
//!   is shared, every rank opens its endpoint, the epids are allgathered and
//!   every rank connects to all (itself included).
//! * **Shm-only mode.** Without an Omni-Path hfi unit (no `/dev/hfi1_*`),
//!   `psm2_init` fails with `PSM2_INTERNAL_ERR` yet leaves a library that
//!   runs PSM2's `self` and `shm` devices (see `psm_sys`'s docs). The device
//!   needs `PSM2_DEVICES=self,shm`: a program linking this crate sets it
//!   before `main` (from the ELF initializers, while no thread exists that
//!   could read the environment; a user's value is kept). The device says
//!   so on stderr once and in [`PsmDevice::mode`], and refuses a job whose
//!   ranks are not all on this host. With hardware, nothing is overridden.
//! * **Never crash at finish**: `psm2_finalize` is never called (after the
//!   failed init it crashes; with hardware, process exit releases the
//!   library), endpoints are closed with `psm2_ep_close`, and only one
//!   endpoint exists per process (PSM2's rule): a second open fails cleanly.
//! * **Waits** poll PSM2, then yield, then sleep in short steps: PSM2's shm
//!   device offers no wake-up event to block on.
//! * **Peers that leave** are learnt from the bootstrap (its departure
//!   notices): new operations to them fail at once with
//!   [`Error::PeerLost`], as do receives naming them (cancelled in PSM2). A
//!   send PSM2 has already taken cannot be cancelled; its buffer stays with
//!   the device (never freed while PSM2 might read it) and the request fails.
//!
//! # Layout
//!
//! * [`layer`]: the safe PSM2 layer (library, endpoint, matched queue, the
//!   table of outstanding requests); every PSM2 call of the device is there.
//! * `setup`: the wire-up ([`PsmDevice::with_bootstrap`]) and its records.
//! * `engine`: the state under one lock, progress, departures, cancel and
//!   waiting; `blocking`: the blocking calls and their unwind guard
//!   (`Settle`).
//! * this file: the face ([`Device`] for [`PsmDevice`]), and [`RawPsm`] for
//!   the raw-PSM2 benchmark.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use xdev::registry::{Entry, Placement};
use xdev::{
    check_recv, check_send, Buffer, Context, Device, Envelope, Error, Pattern, Peeked, Rank,
    Registry, Request, RequestKind, Result, Source, Status, Tag, TagSel,
};

mod blocking;
mod engine;
pub mod layer;
mod setup;

use engine::{lost, Engine, Slot};
pub use layer::PsmMode;

/// Bootstrap key prefix (then the rank) under which each rank stores its
/// PSM2 epid (8 bytes, little-endian), so that `xdev-run` can remove the
/// `/dev/shm/psm2_shm.*` segments of ranks that crashed.
pub const PSM2_EPID_KEY: &str = xdev::bootstrap::PSM2_EPID_KEY;

/// Default of the `rndv_shm_bytes` option: the message size from which
/// PSM2's shm device uses rendezvous instead of eager copies. PSM2 buffers
/// unexpected eager messages without bound, so this bounds what a slow
/// receiver holds per message to an envelope for anything larger (10,000
/// unreceived 8 KiB sends would otherwise take 80 MiB at the receiver).
pub const DEFAULT_RNDV_SHM_BYTES: u32 = 4096;

/// One rank over PSM2's matched queues: an xdev [`Device`].
pub struct PsmDevice {
    engine: Arc<Engine>,
}

impl PsmDevice {
    /// How PSM2 runs in this process (hardware, or shm-only).
    pub fn mode(&self) -> &PsmMode {
        self.engine.lib.mode()
    }

    /// The device's own PSM2 matched queue, for benchmarks that compare the
    /// device with raw PSM2 calls on the same endpoint ([`RawPsm`]).
    ///
    /// # Safety
    /// Memory safety does not depend on it (the [`layer`] keeps every
    /// request sound), but the device's correctness does: while the caller
    /// uses the queue, no operation of this device may be outstanding (the
    /// device's progress would collect what the caller's traffic completes,
    /// and the caller's could match the device's receives), and the caller
    /// must use only contexts (the middle tag word) the device's users do
    /// not use.
    pub unsafe fn raw_handles(&self) -> RawPsm {
        RawPsm {
            engine: self.engine.clone(),
        }
    }
}

/// The matched queue of an open [`PsmDevice`] (see
/// [`PsmDevice::raw_handles`]), for raw PSM2 traffic beside the device.
pub struct RawPsm {
    engine: Arc<Engine>,
}

impl RawPsm {
    /// Runs `f` on the device's matched queue, holding the device's lock
    /// meanwhile (so `f` must not call the device: it would wait for
    /// itself). Fails with [`Error::Closed`] once the device finished.
    pub fn with_queue<R>(
        &self,
        f: impl FnOnce(&mut layer::MatchedQueue) -> Result<R>,
    ) -> Result<R> {
        let mut l = self.engine.lock();
        let q = l.queue.as_mut().ok_or(Error::Closed)?;
        f(q)
    }

    /// This rank (its peer index on the queue).
    pub fn rank(&self) -> Rank {
        self.engine.rank
    }
}

impl Device for PsmDevice {
    fn name(&self) -> &'static str {
        "psm"
    }

    fn id(&self) -> Rank {
        self.engine.rank
    }

    fn size(&self) -> usize {
        self.engine.size
    }

    fn send(&self, buf: &[u8], dest: Rank, tag: Tag, context: Context) -> Result<()> {
        self.engine.blocking_send(buf, dest, tag, context, false)
    }

    fn ssend(&self, buf: &[u8], dest: Rank, tag: Tag, context: Context) -> Result<()> {
        self.engine.blocking_send(buf, dest, tag, context, true)
    }

    fn recv(
        &self,
        buf: &mut [u8],
        source: Source,
        tag: TagSel,
        context: Context,
    ) -> Result<Status> {
        self.engine
            .blocking_recv(buf, Pattern::new(source, tag, context))
    }

    fn isend(&self, buf: Buffer, dest: Rank, tag: Tag, context: Context) -> Request {
        self.start_send(buf, dest, tag, context, false)
    }

    fn issend(&self, buf: Buffer, dest: Rank, tag: Tag, context: Context) -> Request {
        self.start_send(buf, dest, tag, context, true)
    }

    fn irecv(&self, buf: Buffer, source: Source, tag: TagSel, context: Context) -> Request {
        self.start_recv(buf, Pattern::new(source, tag, context))
    }

    fn probe(&self, source: Source, tag: TagSel, context: Context) -> Result<Status> {
        let eng = &self.engine;
        check_recv(source, tag, eng.size)?;
        eng.check_open()?;
        let p = Pattern::new(source, tag, context);
        let mut found = None;
        eng.block_until(true, |eng, l| {
            found = eng.iprobe_locked(l, &p);
            if found.is_none() {
                if let Source::Rank(s) = source {
                    if l.gone[s] {
                        return Err(lost(s));
                    }
                }
            }
            Ok(found.is_some())
        })?;
        found.ok_or(Error::Closed)
    }

    fn iprobe(&self, source: Source, tag: TagSel, context: Context) -> Result<Option<Status>> {
        let eng = &self.engine;
        check_recv(source, tag, eng.size)?;
        eng.check_open()?;
        let mut l = eng.lock();
        eng.progress_locked(&mut l);
        Ok(eng.iprobe_locked(&mut l, &Pattern::new(source, tag, context)))
    }

    fn peek(&self) -> Result<Option<Peeked>> {
        let eng = &self.engine;
        let mut found = None;
        eng.block_until(true, |eng, _| {
            found = eng.tracker.pop_completed();
            Ok(found.is_some() || eng.tracker.outstanding() == 0)
        })?;
        Ok(found.or_else(|| eng.tracker.pop_completed()))
    }

    fn progress(&self) {
        xdev::Progress::progress(&*self.engine)
    }

    fn finish(&self) -> Result<()> {
        self.finish_engine()
    }
}

impl PsmDevice {
    fn start_send(
        &self,
        buf: Buffer,
        dest: Rank,
        tag: Tag,
        context: Context,
        sync: bool,
    ) -> Request {
        let eng = &self.engine;
        let env = Envelope {
            source: dest,
            tag,
            context,
        };
        let reject = |buf, e| {
            let core = eng
                .tracker
                .rejected(RequestKind::Send, buf, Status::failed(env, e));
            Request::new(core, eng.clone())
        };
        if let Err(e) = check_send(dest, tag, eng.size).and_then(|_| eng.check_open()) {
            return reject(buf, e);
        }
        let mut l = eng.lock();
        if l.gone[dest] {
            drop(l);
            return reject(buf, lost(dest));
        }
        let core = eng.tracker.start(RequestKind::Send, buf);
        let (at, len) = (core.buffer_ptr(), core.buffer_len());
        let slot = Slot::Request {
            core: core.clone(),
            send: Some((env, len)),
            source: None,
        };
        // SAFETY: the core owns its buffer until completed; it is completed
        // only when the request left the queue (or its buffer is kept
        // forever: `Inner::kept`), and the slot holds a reference to it.
        let posted = unsafe { eng.post_send(&mut l, (at, len), (dest, tag, context), sync, slot) };
        if let Err(e) = posted {
            eng.tracker.complete(&core, Status::failed(env, e));
        }
        drop(l);
        Request::new(core, eng.clone())
    }

    fn start_recv(&self, buf: Buffer, pattern: Pattern) -> Request {
        let eng = &self.engine;
        let env = Envelope {
            source: eng.rank,
            tag: -1,
            context: pattern.context,
        };
        let reject = |buf, e| {
            let core = eng
                .tracker
                .rejected(RequestKind::Recv, buf, Status::failed(env, e));
            Request::new(core, eng.clone())
        };
        let checked = check_recv(pattern.source, pattern.tag, eng.size);
        if let Err(e) = checked.and_then(|_| eng.check_open()) {
            return reject(buf, e);
        }
        let mut l = eng.lock();
        let source = match pattern.source {
            Source::Rank(s) => Some(s),
            Source::Any => None,
        };
        if let Some(s) = source.filter(|&s| l.gone[s]) {
            drop(l);
            return reject(buf, lost(s));
        }
        let core = eng.tracker.start(RequestKind::Recv, buf);
        let at = (core.buffer_ptr(), core.buffer_len());
        let slot = Slot::Request {
            core: core.clone(),
            send: None,
            source,
        };
        // SAFETY: the core owns its buffer, which nothing touches until the
        // core is completed: only once the request left the queue (a
        // completion, a cancel, the close), and the slot holds a reference.
        match unsafe { eng.post_recv(&mut l, at, &pattern, slot) } {
            Ok(key) => core.set_token(key.to_u64()),
            Err(e) => {
                eng.tracker.complete(&core, Status::failed(env, e));
            }
        }
        drop(l);
        Request::new(core, eng.clone())
    }

    fn finish_engine(&self) -> Result<()> {
        let eng = &self.engine;
        if eng.closing.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        // Our sends first (those to departed peers fail and stay kept).
        let r = eng.block_until(true, |eng, l| {
            eng.check_departures(l);
            Ok(eng.tracker.outstanding_sends() == 0)
        });
        let mut l = eng.lock();
        let mut ended = Vec::new();
        if let Some(mut q) = l.queue.take() {
            // Posted receives PSM2 has not matched go back to it before the
            // close (they end with Closed below, with the rest).
            let recvs: Vec<_> = q
                .iter()
                .filter(|(_, s)| matches!(s, Slot::Request { send: None, .. }))
                .map(|(k, _)| k)
                .collect();
            ended.extend(recvs.into_iter().filter_map(|k| q.cancel(k)));
            // Receives that had matched finish inside the close; what is
            // still outstanding can no longer complete.
            ended.extend(q.close(setup::PSM_TIMEOUT));
        }
        for s in ended {
            if let Slot::Request { core, .. } = s {
                let env = Envelope {
                    source: eng.rank,
                    tag: -1,
                    context: 0,
                };
                eng.tracker
                    .complete(&core, Status::failed(env, Error::Closed));
            }
        }
        drop(l);
        r
    }
}

/// Adds the `psm` device to `registry`.
pub fn register(registry: &mut Registry) {
    registry.register(Entry {
        name: "psm",
        description: "Omni-Path PSM2 matched queues (shm-only mode without hfi hardware)",
        placement: Placement::Processes,
        open: |cfg| Ok(Arc::new(PsmDevice::open(cfg)?) as Arc<dyn Device>),
    });
}

#[cfg(test)]
mod tests;
