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

use std::ffi::{c_void, CStr};
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use shm_ipc::doorbell::Backoff;
use shm_ipc::lock::{RankGuard, RankLock};
use std::time::{Duration, Instant};

use psm_sys::ffi::*;
use psm_sys::Psm2;
use xdev::bootstrap::Bootstrap;
use xdev::registry::{Entry, Placement};
use xdev::{
    check_recv, check_send, Buffer, Config, Context, Device, Envelope, Error, Pattern, Peeked,
    Progress, Rank, Registry, Request, RequestCore, RequestKind, Result, Source, Status, Tag,
    TagSel, Tracker,
};

/// How PSM2 runs in this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PsmMode {
    /// `psm2_init` succeeded: PSM2's default devices, hardware included.
    Hardware,
    /// No hfi unit: only PSM2's `self` and `shm` devices (ranks on one host).
    ShmOnly,
}

/// Process-wide PSM2 state: the library, how `psm2_init` went, and whether
/// the process's one endpoint is taken.
struct Library {
    psm: &'static Psm2,
    mode: PsmMode,
}

static ENDPOINT_TAKEN: AtomicBool = AtomicBool::new(false);

fn describe(psm: &Psm2, e: psm2_error_t) -> String {
    // SAFETY: psm2_error_get_string accepts any code and returns a static
    // NUL-terminated string or NULL.
    let s = unsafe { (psm.psm2_error_get_string)(e) };
    if s.is_null() {
        format!("PSM2 error {}", e.0)
    } else {
        // SAFETY: non-null, NUL-terminated and static (above).
        let t = unsafe { CStr::from_ptr(s) };
        format!("{} (PSM2 error {})", t.to_string_lossy(), e.0)
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct PsmError(String);

fn psm_err(psm: &Psm2, what: &str, e: psm2_error_t) -> Error {
    Error::transport(what.to_string(), PsmError(describe(psm, e)))
}

fn hfi_present() -> bool {
    std::fs::read_dir("/dev")
        .map(|d| {
            d.flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with("hfi1_"))
        })
        .unwrap_or(false)
}

/// Sets `PSM2_DEVICES=self,shm` when the user did not set it and this host
/// has no hfi unit: PSM2 reads it in `psm2_ep_open`, and without it probes
/// the missing unit and crashes (psm_sys docs). It runs from the ELF
/// initializers, before `main`, when no other thread exists that could read
/// the environment concurrently (which makes `setenv` unsound later).
extern "C" fn psm2_devices_at_start() {
    if hfi_present() {
        return;
    }
    // SAFETY: called only by the dynamic loader / C runtime while running
    // the initializers, before main: the process has one thread. Both
    // strings are NUL-terminated; overwrite = 0 keeps a user's value.
    unsafe { libc::setenv(c"PSM2_DEVICES".as_ptr(), c"self,shm".as_ptr(), 0) };
}

/// Runs [`psm2_devices_at_start`] before `main`.
#[used]
#[link_section = ".init_array"]
static PSM2_DEVICES_AT_START: extern "C" fn() = psm2_devices_at_start;

/// Bootstrap key prefix (then the rank) under which each rank stores its
/// PSM2 epid (8 bytes, little-endian), so that `xdev-run` can remove the
/// `/dev/shm/psm2_shm.*` segments of ranks that crashed.
pub const PSM2_EPID_KEY: &str = xdev::bootstrap::PSM2_EPID_KEY;

/// Loads libpsm2 and runs `psm2_init` once per process.
fn library() -> Result<&'static Library> {
    static LIB: std::sync::OnceLock<std::result::Result<Library, Error>> =
        std::sync::OnceLock::new();
    LIB.get_or_init(|| {
        let psm = Psm2::load().map_err(|e| Error::Config(e.to_string()))?;
        let hfi = hfi_present();
        if !hfi && std::env::var_os("PSM2_DEVICES").is_none() {
            // `psm2_devices_at_start` sets it before main; only a program
            // that cleared it since gets here. Setting it now could race
            // other threads' reads of the environment: refuse instead.
            return Err(Error::Config(
                "PSM2_DEVICES is not set and this host has no Omni-Path hfi unit: \
                 set PSM2_DEVICES=self,shm (PSM2 crashes probing the missing unit)"
                    .into(),
            ));
        }
        // SAFETY: a global (NULL endpoint) handler may be registered before
        // psm2_init; the sentinel makes PSM2 return errors instead of exiting.
        unsafe { (psm.psm2_error_register_handler)(ptr::null_mut(), errhandler_no_handler()) };
        let (mut major, mut minor) = (PSM2_VERNO_MAJOR as i32, PSM2_VERNO_MINOR as i32);
        // SAFETY: both out-pointers are valid.
        let e = unsafe { (psm.psm2_init)(&mut major, &mut minor) };
        let mode = if e == psm2_error::PSM2_OK {
            PsmMode::Hardware
        } else if e == psm2_error::PSM2_INTERNAL_ERR && !hfi {
            eprintln!(
                "xdev psm: no Omni-Path hfi unit on this host: PSM2 runs in shm-only mode \
                 (PSM2_DEVICES={}); all ranks must share this host",
                std::env::var("PSM2_DEVICES").unwrap_or_default()
            );
            PsmMode::ShmOnly
        } else {
            return Err(psm_err(psm, "psm2_init", e));
        };
        Ok(Library { psm, mode })
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// Settles a blocking call's PSM2 request when the call ends before its
/// own wait did (an unwind): a receive is cancelled, and either way the
/// request is waited for, since PSM2 reads a send's buffer and writes a
/// receive's until it completes. A send to a peer that left is handed to
/// `live` as abandoned, as the call's own wait does.
struct Settle<'e> {
    engine: &'e Engine,
    key: Key,
    req: psm2_mq_req_t,
    recv: bool,
    dest: Option<Rank>,
    settled: std::cell::Cell<bool>,
}

impl Drop for Settle<'_> {
    fn drop(&mut self) {
        if self.settled.get() {
            return;
        }
        let (key, req, dest) = (self.key, self.req, self.dest);
        if self.recv {
            self.engine.cancel_req(req);
        }
        let _ = self.engine.block_until(false, |eng, l| {
            if !l.open {
                return Ok(true); // closed: PSM2 let go
            }
            if eng.take_completion(l, key, req).is_some() {
                return Ok(true);
            }
            if let Some(d) = dest {
                if l.gone[d] {
                    l.live.insert(key, Slot::Abandoned);
                    return Ok(true);
                }
            }
            Ok(false)
        });
    }
}

/// Marks the keys of requests a blocking call waits for: they are not in
/// `live` (the call holds the handle), and a collecting
/// progress round that completes one leaves its status in `done`.
const BLOCKING: Key = 1 << (usize::BITS - 1);

/// The maps below are on every message's path, where SipHash's cost shows;
/// our request keys are sequential integers.
type KeyMap<V> = xdev::matching::FxMap<Key, V>;

/// Our id of an outstanding PSM2 request, passed to PSM2 as the request's
/// context and read back from its completion status. (PSM2 reuses request
/// handles as soon as they are freed, so handles cannot be keys.)
type Key = usize;

/// What an outstanding PSM2 request belongs to.
enum Slot {
    /// A non-blocking request; completed through the tracker.
    Request {
        core: xdev::CoreRef,
        /// PSM2's handle (for cancel; valid while the slot is live).
        req: psm2_mq_req_t,
        /// For sends, the envelope (source = destination) and length.
        send: Option<(Envelope, usize)>,
        /// For receives, the source it names (to fail it if that peer leaves).
        source: Option<Rank>,
    },
    /// Its call gave up (peer gone); the status is dropped on completion.
    Abandoned,
    /// A blocking send to this rank itself, sent from a copy: PSM2's `self`
    /// device completes a send only when a receive matches it, so the
    /// blocking call returns once the copy is taken (as an eager send
    /// would), and the copy is dropped when PSM2 completes the send.
    SelfCopy(#[allow(dead_code)] Box<[u8]>),
}

struct Inner {
    ep: psm2_ep_t,
    mq: psm2_mq_t,
    addrs: Vec<psm2_epaddr_t>,
    live: KeyMap<Slot>,
    next_key: Key,
    done: KeyMap<psm2_mq_status2_t>,
    gone: Vec<bool>,
    departures_seen: usize,
    /// Send buffers PSM2 may still read (their peer left first): never freed.
    kept: Vec<xdev::CoreRef>,
    open: bool,
}

// SAFETY: the PSM2 handles are used only under the engine's mutex (PSM2 MQ
// calls on one MQ must not run concurrently), and the raw status contexts are
// never dereferenced.
unsafe impl Send for Inner {}

struct Engine {
    lib: &'static Library,
    rank: Rank,
    size: usize,
    /// Rank of each endpoint address (statuses name the sender by address).
    ranks_by_addr: KeyMap<Rank>,
    /// Sends shorter than this are eager in PSM2 (its shm rendezvous
    /// threshold, `rndv_shm_bytes`).
    eager_max: usize,
    inner: RankLock<Inner>,
    tracker: Arc<Tracker>,
    closing: AtomicBool,
    boot: Bootstrap,
}

/// The PSM2 tag of a message: the xdev tag, the context, and the message's
/// length. The length is never matched on (receives mask it out); it is
/// there because PSM2 does not report the sender's length of a truncated
/// rendezvous message (libpsm2 11.2.185 in shm mode completes such a receive
/// with `msg_length` equal to the receive buffer and no error), and the xdev
/// contract needs it to report truncation. The source is matched by endpoint
/// address instead, and read back from the status's `msg_peer`.
fn tag(tag: Tag, context: Context, len: u32) -> psm2_mq_tag_t {
    psm2_mq_tag_t {
        tag: [tag as u32, context, len, 0],
    }
}

/// What a receive or probe of `p` selects, as PSM2 takes it: the source's
/// endpoint address (`addrs` by rank; any for `ANY_SOURCE`), then the tag
/// and its selector: the tag exactly unless `ANY_TAG`, the context always,
/// never the length word.
fn selector(addrs: &[psm2_epaddr_t], p: &Pattern) -> (psm2_epaddr_t, psm2_mq_tag_t, psm2_mq_tag_t) {
    let src = match p.source {
        Source::Rank(s) => addrs[s],
        Source::Any => PSM2_MQ_ANY_ADDR,
    };
    let (t, tmask) = match p.tag {
        TagSel::Tag(t) => (t, u32::MAX),
        TagSel::Any => (0, 0),
    };
    (
        src,
        tag(t, p.context, 0),
        psm2_mq_tag_t {
            tag: [tmask, u32::MAX, 0, 0],
        },
    )
}

fn lost(rank: Rank) -> Error {
    Error::PeerLost {
        rank,
        reason: "its process left the job".into(),
    }
}

impl Engine {
    fn lock(&self) -> RankGuard<'_, Inner> {
        self.inner.lock()
    }

    fn psm(&self) -> &'static Psm2 {
        self.lib.psm
    }

    fn check_open(&self) -> Result<()> {
        if self.closing.load(Ordering::Acquire) {
            Err(Error::Closed)
        } else {
            Ok(())
        }
    }

    /// The xdev status of a completed receive into `cap` bytes, or of a
    /// probed message (`cap` = `None`).
    fn recv_status(&self, st: &psm2_mq_status2_t, cap: Option<usize>) -> Status {
        // SAFETY: every bit pattern of the union is a valid [u32; 4].
        let t = unsafe { st.msg_tag.tag };
        let source = self.ranks_by_addr.get(&(st.msg_peer as usize)).copied();
        let env = Envelope {
            source: source.unwrap_or(usize::MAX),
            tag: t[0] as i32,
            context: t[1],
        };
        let Some(source) = source else {
            let what = "a message from an endpoint that is not in the job".to_string();
            return Status::failed(
                env,
                Error::Protocol {
                    rank: usize::MAX,
                    what,
                },
            );
        };
        if st.error_code != psm2_error::PSM2_OK && st.error_code != psm2_error::PSM2_MQ_TRUNCATION {
            return Status::failed(env, psm_err(self.psm(), "receive", st.error_code));
        }
        let len = t[2] as usize;
        let Some(cap) = cap else {
            return Status::ok(env, len);
        };
        if (st.nbytes as usize) != len.min(cap) {
            let what = format!("message says {len} bytes, PSM2 delivered {}", st.nbytes);
            return Status::failed(env, Error::Protocol { rank: source, what });
        }
        Status::received(env, len, cap)
    }

    fn send_status(&self, st: &psm2_mq_status2_t, env: Envelope, len: usize) -> Status {
        if st.error_code == psm2_error::PSM2_OK {
            Status::ok(env, len)
        } else {
            Status::failed(env, psm_err(self.psm(), "send", st.error_code))
        }
    }

    /// Polls PSM2 and completes what finished. Returns whether anything did.
    fn progress_locked(&self, l: &mut Inner) -> bool {
        if !l.open {
            return false;
        }
        let psm = self.psm();
        // SAFETY: the endpoint is open (l.open).
        unsafe { (psm.psm2_poll)(l.ep) };
        let mut any = false;
        loop {
            let mut req: psm2_mq_req_t = ptr::null_mut();
            // SAFETY: mq is open; req is a valid out-pointer; no status wanted.
            let e = unsafe { (psm.psm2_mq_ipeek2)(l.mq, &mut req, ptr::null_mut()) };
            if e != psm2_error::PSM2_OK {
                break;
            }
            any = true;
            let mut st = std::mem::MaybeUninit::<psm2_mq_status2_t>::zeroed();
            // SAFETY: req is a completed request from ipeek; test2 frees it
            // and fills the status.
            unsafe { (psm.psm2_mq_test2)(&mut req, st.as_mut_ptr()) };
            // SAFETY: zero-initialised, then filled by PSM2.
            let st = unsafe { st.assume_init() };
            let key = st.context as Key;
            if key & BLOCKING != 0 {
                // A blocking call's request: hand its status over (unless
                // the call gave up on it, see Slot::Abandoned).
                if l.live.remove(&key).is_none() {
                    l.done.insert(key, st);
                }
                continue;
            }
            match l.live.remove(&key) {
                Some(Slot::Request { core, send, .. }) => {
                    let status = match send {
                        Some((env, len)) => self.send_status(&st, env, len),
                        None => self.recv_status(&st, Some(core.buffer_len())),
                    };
                    self.tracker.complete(&core, status);
                }
                Some(Slot::Abandoned | Slot::SelfCopy(_)) | None => {}
            }
        }
        any
    }

    /// Applies the bootstrap's departure notices: receives naming a departed
    /// peer are cancelled and fail; sends to it fail and their buffers stay
    /// with the device (PSM2 cannot cancel a send it has taken); later
    /// operations to it fail at once.
    fn check_departures(&self, l: &mut Inner) {
        let Ok(departed) = self.boot.departed() else {
            return;
        };
        if departed.len() == l.departures_seen {
            return;
        }
        l.departures_seen = departed.len();
        for d in departed {
            if d >= self.size || l.gone[d] || d == self.rank {
                continue;
            }
            l.gone[d] = true;
            let (mut recvs, mut sends) = (Vec::new(), Vec::new());
            for (k, s) in &l.live {
                match s {
                    Slot::Request {
                        send: Some((env, _)),
                        ..
                    } if env.source == d => sends.push(*k),
                    Slot::Request {
                        source: Some(s), ..
                    } if *s == d => recvs.push(*k),
                    _ => {}
                }
            }
            for k in recvs {
                if let Some(core) = self.cancel_recv(l, k) {
                    let env = Envelope {
                        source: d,
                        tag: -1,
                        context: 0,
                    };
                    self.tracker.complete(&core, Status::failed(env, lost(d)));
                }
            }
            for k in sends {
                if let Some(Slot::Request {
                    core,
                    send: Some((env, _)),
                    ..
                }) = l.live.remove(&k)
                {
                    self.tracker.complete(&core, Status::failed(env, lost(d)));
                    l.kept.push(core);
                    l.live.insert(k, Slot::Abandoned);
                }
            }
        }
    }

    /// Cancels the posted non-blocking receive `key` if PSM2 has not
    /// matched it yet: it is then returned to PSM2, and its slot removed;
    /// returns its request (to complete).
    fn cancel_recv(&self, l: &mut Inner, key: Key) -> Option<xdev::CoreRef> {
        let Some(&Slot::Request {
            req, send: None, ..
        }) = l.live.get(&key)
        else {
            return None;
        };
        if !self.cancel_req(req) {
            return None;
        }
        match l.live.remove(&key) {
            Some(Slot::Request { core, .. }) => Some(core),
            _ => None,
        }
    }

    /// Cancels live receive request `req` (PSM2's handle); true if it had
    /// not matched yet (it is then returned to PSM2 and gone).
    fn cancel_req(&self, req: psm2_mq_req_t) -> bool {
        let psm = self.psm();
        let mut req = req;
        // SAFETY: req is a live receive request of this MQ.
        if unsafe { (psm.psm2_mq_cancel)(&mut req) } != psm2_error::PSM2_OK {
            return false;
        }
        let mut st = std::mem::MaybeUninit::<psm2_mq_status2_t>::zeroed();
        // SAFETY: a cancelled request must be returned with test/wait (psm2_mq.h).
        unsafe { (psm.psm2_mq_wait2)(&mut req, st.as_mut_ptr()) };
        true
    }

    /// Polls until `done` says so: PSM2 polls between the spins and yields
    /// of a [`Backoff`], then sleeps in steps of up to 1 ms (PSM2's shm
    /// device has no wake-up event).
    ///
    /// With `collect`, every round also collects all of PSM2's completions
    /// (`progress_locked`); without it, `done` makes its own progress (see
    /// `take_completion`), the fast path of a blocking call.
    fn block_until(
        &self,
        collect: bool,
        mut done: impl FnMut(&Self, &mut Inner) -> Result<bool>,
    ) -> Result<()> {
        let mut backoff = Backoff::new();
        let mut idle: u32 = 0;
        // Sleeps since the last progress: each one longer, up to 1 ms.
        let mut sleeps: u32 = 0;
        let mut last_departure_check: Option<Instant> = None;
        loop {
            {
                let mut l = self.lock();
                let any = collect && self.progress_locked(&mut l);
                // Departures are checked once a wait has been idle a while,
                // then every 5 ms (reading the clock only on that slow path).
                if idle > 0 && idle % 64 == 0 {
                    let now = Instant::now();
                    if last_departure_check
                        .map_or(true, |t| now.duration_since(t) > Duration::from_millis(5))
                    {
                        self.check_departures(&mut l);
                        last_departure_check = Some(now);
                    }
                }
                if done(self, &mut l)? {
                    return Ok(());
                }
                if any {
                    idle = 0;
                    sleeps = 0;
                    backoff.reset();
                    continue;
                }
            }
            idle = idle.saturating_add(1);
            if !backoff.snooze() {
                sleeps = sleeps.saturating_add(1);
                let step = u64::from(sleeps.min(20)) * 50;
                std::thread::sleep(Duration::from_micros(step.max(20)));
            }
        }
    }

    /// The completion of blocking request `key`, if it has completed: taken
    /// from `done` when a collecting round got it first, else polled for
    /// and tested directly (`psm2_mq_test2` on its handle, which only
    /// `done`'s absence proves is still live: both happen under the lock).
    fn take_completion(
        &self,
        l: &mut Inner,
        key: Key,
        req: psm2_mq_req_t,
    ) -> Option<psm2_mq_status2_t> {
        if !l.done.is_empty() {
            if let Some(st) = l.done.remove(&key) {
                return Some(st);
            }
        }
        let psm = self.psm();
        let mut req = req;
        // SAFETY: the endpoint is open (callers check l.open first).
        unsafe { (psm.psm2_poll)(l.ep) };
        let mut st = std::mem::MaybeUninit::<psm2_mq_status2_t>::zeroed();
        // SAFETY: req is live (not in `done`, not yet tested); test2 frees it
        // only when it returns PSM2_OK, with the status filled.
        if unsafe { (psm.psm2_mq_test2)(&mut req, st.as_mut_ptr()) } != psm2_error::PSM2_OK {
            return None;
        }
        // SAFETY: filled by PSM2 on success.
        Some(unsafe { st.assume_init() })
    }

    /// A fresh key, marked [`BLOCKING`] for a blocking call's request.
    fn new_key(l: &mut Inner, blocking: bool) -> Key {
        let key = l.next_key | if blocking { BLOCKING } else { 0 };
        l.next_key += 1;
        key
    }

    fn post_send(
        &self,
        l: &mut Inner,
        data: &[u8],
        (dest, t, context): (Rank, Tag, Context),
        sync: bool,
        blocking: bool,
    ) -> Result<(Key, psm2_mq_req_t)> {
        if !l.open {
            // `finish` closed the endpoint after the caller's first check.
            return Err(Error::Closed);
        }
        let len = psm_len(data.len())?;
        let mut stag = tag(t, context, len);
        let mut req: psm2_mq_req_t = ptr::null_mut();
        let key = Self::new_key(l, blocking);
        let flags = if sync { PSM2_MQ_FLAG_SENDSYNC } else { 0 };
        // SAFETY: data stays valid and unmodified until the request completes
        // (owned by a request core, or borrowed by a blocking call that waits
        // for completion or leaves it to the device, see Slot::Abandoned).
        let e = unsafe {
            (self.psm().psm2_mq_isend2)(
                l.mq,
                l.addrs[dest],
                flags,
                &mut stag,
                data.as_ptr().cast::<c_void>(),
                len,
                key as *mut c_void,
                &mut req,
            )
        };
        if e != psm2_error::PSM2_OK {
            return Err(psm_err(self.psm(), "psm2_mq_isend2", e));
        }
        Ok((key, req))
    }

    fn post_recv(
        &self,
        l: &mut Inner,
        buf: *mut u8,
        cap: usize,
        p: &Pattern,
        blocking: bool,
    ) -> Result<(Key, psm2_mq_req_t)> {
        if !l.open {
            // `finish` closed the endpoint after the caller's first check.
            return Err(Error::Closed);
        }
        let len = psm_len(cap)?;
        let (src, mut rtag, mut sel) = selector(&l.addrs, p);
        let mut req: psm2_mq_req_t = ptr::null_mut();
        let key = Self::new_key(l, blocking);
        // SAFETY: buf is valid for cap bytes until the request completes or is
        // cancelled (see post_send); tags and out-pointer are valid.
        let e = unsafe {
            (self.psm().psm2_mq_irecv2)(
                l.mq,
                src,
                &mut rtag,
                &mut sel,
                0,
                buf.cast::<c_void>(),
                len,
                key as *mut c_void,
                &mut req,
            )
        };
        if e != psm2_error::PSM2_OK {
            return Err(psm_err(self.psm(), "psm2_mq_irecv2", e));
        }
        Ok((key, req))
    }

    fn blocking_send(
        &self,
        data: &[u8],
        dest: Rank,
        t: Tag,
        ctx: Context,
        sync: bool,
    ) -> Result<()> {
        check_send(dest, t, self.size)?;
        self.check_open()?;
        let key = {
            let mut l = self.lock();
            if !l.open {
                return Err(Error::Closed);
            }
            if l.gone[dest] {
                return Err(lost(dest));
            }
            if dest == self.rank && !sync {
                let copy: Box<[u8]> = data.into();
                let (key, _) = self.post_send(&mut l, &copy, (dest, t, ctx), false, false)?;
                l.live.insert(key, Slot::SelfCopy(copy));
                return Ok(());
            }
            if !sync && data.len() < self.eager_max {
                // Below PSM2's rendezvous threshold a send completes locally
                // at once: psm2_mq_send2 returns when `data` may be reused,
                // with no request to track.
                let mut stag = tag(t, ctx, data.len() as u32);
                // SAFETY: mq and the address are open; PSM2 reads `data`
                // only during the call.
                let e = unsafe {
                    (self.psm().psm2_mq_send2)(
                        l.mq,
                        l.addrs[dest],
                        0,
                        &mut stag,
                        data.as_ptr().cast::<c_void>(),
                        data.len() as u32,
                    )
                };
                return if e == psm2_error::PSM2_OK {
                    Ok(())
                } else {
                    Err(psm_err(self.psm(), "psm2_mq_send2", e))
                };
            }
            self.post_send(&mut l, data, (dest, t, ctx), sync, true)?
        };
        let (key, req) = key;
        // From here PSM2 may read `data` until the request completes: on any
        // exit, an unwind included, the guard settles it first.
        let settle = Settle {
            engine: self,
            key,
            req,
            recv: false,
            dest: Some(dest),
            settled: std::cell::Cell::new(false),
        };
        #[cfg(test)]
        if tests::PANIC_AFTER_PUBLISH.with(|p| p.replace(false)) {
            panic!("injected: unwinding out of a published blocking send");
        }
        let mut result = Ok(());
        let waited = self.block_until(false, |eng, l| {
            if !l.open {
                return Err(Error::Closed); // closed under us: PSM2 let go
            }
            if let Some(st) = eng.take_completion(l, key, req) {
                if st.error_code != psm2_error::PSM2_OK {
                    result = Err(psm_err(self.psm(), "send", st.error_code));
                }
                return Ok(true);
            }
            if l.gone[dest] {
                // PSM2 cannot cancel a send. A departed peer no longer reads
                // it; PSM2 keeps the pointer, but a send's buffer is only
                // ever read, and only on the peer's behalf.
                l.live.insert(key, Slot::Abandoned);
                return Err(lost(dest));
            }
            Ok(false)
        });
        // Every end of that wait settled the request (completed, handed to
        // `live` as abandoned, or let go by a closed endpoint).
        settle.settled.set(true);
        waited?;
        result
    }

    fn blocking_recv(&self, buf: &mut [u8], p: Pattern) -> Result<Status> {
        check_recv(p.source, p.tag, self.size)?;
        self.check_open()?;
        let cap = buf.len();
        let key = {
            let mut l = self.lock();
            if let Source::Rank(s) = p.source {
                if l.gone[s] {
                    return Err(lost(s));
                }
            }
            self.post_recv(&mut l, buf.as_mut_ptr(), cap, &p, true)?
        };
        let (key, req) = key;
        // From here PSM2 may write `buf` until the request completes or is
        // cancelled: on any exit, an unwind included, the guard settles it.
        let settle = Settle {
            engine: self,
            key,
            req,
            recv: true,
            dest: None,
            settled: std::cell::Cell::new(false),
        };
        #[cfg(test)]
        if tests::PANIC_AFTER_PUBLISH.with(|p| p.replace(false)) {
            panic!("injected: unwinding out of a posted blocking receive");
        }
        let mut status = None;
        // Whatever ends this wait, the receive is complete or cancelled (or
        // the endpoint closed) before `buf`'s borrow ends.
        let waited = self.block_until(false, |eng, l| {
            if !l.open {
                return Err(Error::Closed); // closed under us: PSM2 let go
            }
            if let Some(st) = eng.take_completion(l, key, req) {
                status = Some(eng.recv_status(&st, Some(cap)));
                return Ok(true);
            }
            if let Source::Rank(s) = p.source {
                if l.gone[s] && eng.cancel_req(req) {
                    return Err(lost(s));
                }
            }
            Ok(false)
        });
        settle.settled.set(true);
        waited?;
        status.expect("set when done").into_result()
    }
}

impl Progress for Engine {
    fn progress(&self) {
        if let Some(mut l) = self.inner.try_lock() {
            self.progress_locked(&mut l);
        }
    }

    fn wait(&self, core: &RequestCore) {
        let _ = self.block_until(true, |_, _| Ok(core.is_done()));
    }

    fn cancel(&self, core: &xdev::CoreRef) -> bool {
        if core.kind() != RequestKind::Recv || core.is_done() {
            return false;
        }
        let mut l = self.lock();
        let key = core.token() as Key;
        if !matches!(l.live.get(&key), Some(Slot::Request { core: c, .. }) if xdev::CoreRef::ptr_eq(c, core))
        {
            return false;
        }
        if self.cancel_recv(&mut l, key).is_none() {
            return false;
        }
        drop(l);
        let st = Status::cancelled(Pattern::new(Source::Any, TagSel::Any, 0));
        self.tracker.complete(core, st);
        true
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let mut l = self.lock();
        if l.open {
            // Unfinished device: force-close so PSM2 lets go of every buffer
            // before the request cores (and their buffers) are dropped.
            // SAFETY: the endpoint is open; nothing else uses it (we hold the
            // only engine reference).
            unsafe {
                (self.psm().psm2_mq_finalize)(l.mq);
                (self.psm().psm2_ep_close)(l.ep, PSM2_EP_CLOSE_FORCE as i32, 0);
            }
            l.open = false;
            ENDPOINT_TAKEN.store(false, Ordering::Release);
        }
    }
}

/// One rank over PSM2's matched queues: an xdev [`Device`].
pub struct PsmDevice {
    engine: Arc<Engine>,
}

/// Default of the `rndv_shm_bytes` option: the message size from which
/// PSM2's shm device uses rendezvous instead of eager copies. PSM2 buffers
/// unexpected eager messages without bound, so this bounds what a slow
/// receiver holds per message to an envelope for anything larger (10,000
/// unreceived 8 KiB sends would otherwise take 80 MiB at the receiver).
pub const DEFAULT_RNDV_SHM_BYTES: u32 = 4096;

/// Seconds allowed for `psm2_ep_connect` and a graceful `psm2_ep_close`.
const PSM_TIMEOUT_NS: i64 = 30_000_000_000;

impl PsmDevice {
    /// Opens the device with the bootstrap service named by the environment
    /// (`xdev-run` sets it). The environment's rank, size and job must match
    /// `config`.
    pub fn open(config: &Config) -> Result<PsmDevice> {
        Self::with_bootstrap(config, Bootstrap::for_config(config)?)
    }

    /// Opens the device over a connected bootstrap (collective).
    pub fn with_bootstrap(config: &Config, boot: Bootstrap) -> Result<PsmDevice> {
        config.validate()?;
        let lib = library()?;
        let psm = lib.psm;
        if ENDPOINT_TAKEN.swap(true, Ordering::AcqRel) {
            return Err(Error::Config(
                "PSM2 allows one endpoint per process, and this process has one open".into(),
            ));
        }
        let release = Release;
        let (rank, size) = (config.rank, config.size);
        // Rank 0's job key for everyone.
        let mut key: psm2_uuid_t = [0; 16];
        if rank == 0 {
            // SAFETY: key is a 16-byte buffer, as psm2_uuid_t requires.
            unsafe { (psm.psm2_uuid_generate)(key.as_mut_ptr()) };
        }
        let keys = boot.allgather(&key)?;
        key.copy_from_slice(keys[0].get(..16).ok_or_else(|| Error::Protocol {
            rank: 0,
            what: "PSM2 job key is not 16 bytes".into(),
        })?);
        let mut opts = std::mem::MaybeUninit::<psm2_ep_open_opts>::zeroed();
        // SAFETY: opts is valid for writes of one psm2_ep_open_opts.
        let e = unsafe { (psm.psm2_ep_open_opts_get_defaults)(opts.as_mut_ptr()) };
        if e != psm2_error::PSM2_OK {
            return Err(psm_err(psm, "psm2_ep_open_opts_get_defaults", e));
        }
        // SAFETY: zero-initialised, then filled by PSM2 (integers only).
        let opts = unsafe { opts.assume_init() };
        let mut ep: psm2_ep_t = ptr::null_mut();
        let mut epid: psm2_epid_t = 0;
        // SAFETY: key, options and out-pointers are valid for the call.
        let e = unsafe { (psm.psm2_ep_open)(key.as_ptr(), &opts, &mut ep, &mut epid) };
        if e != psm2_error::PSM2_OK {
            return Err(psm_err(psm, "psm2_ep_open", e));
        }
        let close_ep = |ep| {
            // SAFETY: ep is an open endpoint that nothing else uses.
            unsafe { (psm.psm2_ep_close)(ep, PSM2_EP_CLOSE_FORCE as i32, 0) };
        };
        let mut mq: psm2_mq_t = ptr::null_mut();
        // SAFETY: ep is open; no options; mq is a valid out-pointer.
        let e = unsafe { (psm.psm2_mq_init)(ep, PSM2_MQ_ORDERMASK_ALL, ptr::null(), 0, &mut mq) };
        if e != psm2_error::PSM2_OK {
            close_ep(ep);
            return Err(psm_err(psm, "psm2_mq_init", e));
        }
        let rndv: u32 = config.option("rndv_shm_bytes", DEFAULT_RNDV_SHM_BYTES)?;
        // SAFETY: mq is open; the option takes a u32 read through the pointer.
        let e = unsafe {
            (psm.psm2_mq_setopt)(mq, PSM2_MQ_RNDV_SHM_SZ as i32, (&rndv as *const u32).cast())
        };
        if e != psm2_error::PSM2_OK {
            // SAFETY: mq and ep are open and unused elsewhere.
            unsafe { (psm.psm2_mq_finalize)(mq) };
            close_ep(ep);
            return Err(psm_err(psm, "psm2_mq_setopt(PSM2_MQ_RNDV_SHM_SZ)", e));
        }
        let fail = |err: Error| {
            // SAFETY: mq and ep are open and unused elsewhere.
            unsafe { (psm.psm2_mq_finalize)(mq) };
            close_ep(ep);
            err
        };
        // Each rank's epid and host identity (the kernel's boot id).
        let host = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
        let mut record = epid.to_le_bytes().to_vec();
        record.extend_from_slice(host.trim().as_bytes());
        // For the launcher: PSM2 names its shared-memory segments after the
        // epid, and a crashed rank leaves them (see `PSM2_EPID_KEY`).
        boot.put(
            &format!("{PSM2_EPID_KEY}{}", boot.rank()),
            &epid.to_le_bytes(),
        )
        .map_err(fail)?;
        let all = boot.allgather(&record).map_err(fail)?;
        let mut epids = Vec::with_capacity(size);
        for (r, b) in all.iter().enumerate() {
            if b.len() < 8 {
                return Err(fail(Error::Protocol {
                    rank: r,
                    what: "PSM2 endpoint record shorter than an epid".into(),
                }));
            }
            let id: [u8; 8] = b[..8].try_into().expect("8 bytes");
            epids.push(u64::from_le_bytes(id));
            // Connecting to an epid shm cannot reach crashes libpsm2 (psm_sys
            // docs): in shm-only mode all ranks must be on this host.
            if lib.mode == PsmMode::ShmOnly
                && (host.is_empty() || b[8..] != *host.trim().as_bytes())
            {
                return Err(fail(Error::Config(format!(
                    "PSM2 shm-only mode needs every rank on this host; rank {r} is not \
                     (or its host is unknown)"
                ))));
            }
        }
        let mut errors = vec![psm2_error::PSM2_OK; size];
        let mut addrs: Vec<psm2_epaddr_t> = vec![ptr::null_mut(); size];
        // SAFETY: size epids in, size errors and epaddrs out; no mask.
        let e = unsafe {
            (psm.psm2_ep_connect)(
                ep,
                size as i32,
                epids.as_ptr(),
                ptr::null(),
                errors.as_mut_ptr(),
                addrs.as_mut_ptr(),
                PSM_TIMEOUT_NS,
            )
        };
        if e != psm2_error::PSM2_OK {
            let per_rank: Vec<String> = errors
                .iter()
                .enumerate()
                .filter(|(_, e)| **e != psm2_error::PSM2_OK)
                .map(|(r, e)| format!("rank {r}: {}", describe(psm, *e)))
                .collect();
            return Err(fail(psm_err(
                psm,
                &format!("psm2_ep_connect ({})", per_rank.join(", ")),
                e,
            )));
        }
        // PSM2 completes a peer's connection only while we poll: keep polling
        // until everyone has connected.
        let barrier = std::thread::scope(|s| {
            let b = s.spawn(|| boot.barrier());
            while !b.is_finished() {
                // SAFETY: the endpoint is open; only this thread uses it now.
                unsafe { (psm.psm2_poll)(ep) };
                std::thread::sleep(Duration::from_micros(50));
            }
            b.join().unwrap_or(Err(Error::Closed))
        });
        barrier.map_err(fail)?;
        std::mem::forget(release);
        Ok(PsmDevice {
            engine: Arc::new(Engine {
                lib,
                rank,
                size,
                ranks_by_addr: addrs
                    .iter()
                    .enumerate()
                    .map(|(r, a)| (*a as usize, r))
                    .collect(),
                eager_max: rndv as usize,
                inner: RankLock::new(Inner {
                    ep,
                    mq,
                    addrs,
                    live: KeyMap::default(),
                    next_key: 1,
                    done: KeyMap::default(),
                    gone: vec![false; size],
                    departures_seen: 0,
                    kept: Vec::new(),
                    open: true,
                }),
                tracker: Arc::new(Tracker::new()),
                closing: AtomicBool::new(false),
                boot,
            }),
        })
    }

    /// How PSM2 runs in this process (hardware, or shm-only).
    pub fn mode(&self) -> &PsmMode {
        &self.engine.lib.mode
    }

    /// The raw PSM2 handles under this device: the library, the matched
    /// queue and every rank's endpoint address. For benchmarks that compare
    /// the device with raw PSM2 calls on the same endpoint.
    ///
    /// # Safety
    /// While the caller uses the handles, no operation of this device may
    /// run or be outstanding (the device's progress would complete the
    /// caller's requests, and the caller's would disturb the device's), the
    /// caller must complete every request it starts before using the device
    /// again, use only contexts (the middle tag word) the device's users do
    /// not use, and never close or finalize anything.
    pub unsafe fn raw_handles(&self) -> RawPsm {
        let l = self.engine.lock();
        RawPsm {
            psm: self.engine.psm(),
            mq: l.mq,
            addrs: l.addrs.clone(),
        }
    }
}

/// Raw PSM2 handles of an open [`PsmDevice`] (see [`PsmDevice::raw_handles`]).
pub struct RawPsm {
    /// The library's function table.
    pub psm: &'static Psm2,
    /// The matched queue.
    pub mq: psm2_mq_t,
    /// Endpoint address of each rank.
    pub addrs: Vec<psm2_epaddr_t>,
}

/// Frees the process's endpoint slot if opening fails.
struct Release;

impl Drop for Release {
    fn drop(&mut self) {
        ENDPOINT_TAKEN.store(false, Ordering::Release);
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
        let eng = &self.engine;
        let pattern = Pattern::new(source, tag, context);
        let env = Envelope {
            source: eng.rank,
            tag: -1,
            context,
        };
        let reject = |buf, e| {
            let core = eng
                .tracker
                .rejected(RequestKind::Recv, buf, Status::failed(env, e));
            Request::new(core, eng.clone())
        };
        if let Err(e) = check_recv(source, tag, eng.size).and_then(|_| eng.check_open()) {
            return reject(buf, e);
        }
        let mut l = eng.lock();
        if let Source::Rank(s) = source {
            if l.gone[s] {
                drop(l);
                return reject(buf, lost(s));
            }
        }
        let core = eng.tracker.start(RequestKind::Recv, buf);
        match eng.post_recv(
            &mut l,
            core.buffer_ptr(),
            core.buffer_len(),
            &pattern,
            false,
        ) {
            Ok((key, req)) => {
                core.set_token(key as u64);
                let source = match source {
                    Source::Rank(s) => Some(s),
                    Source::Any => None,
                };
                l.live.insert(
                    key,
                    Slot::Request {
                        core: core.clone(),
                        req,
                        send: None,
                        source,
                    },
                );
            }
            Err(e) => {
                eng.tracker.complete(&core, Status::failed(env, e));
            }
        }
        drop(l);
        Request::new(core, eng.clone())
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
        // Posted receives PSM2 has not matched go back to it before the
        // close (they end with Closed below, with the rest).
        for s in l.live.values() {
            if let Slot::Request {
                req, send: None, ..
            } = s
            {
                eng.cancel_req(*req);
            }
        }
        let psm = eng.psm();
        // SAFETY: the MQ and endpoint are open and used only under this lock;
        // after this no PSM2 call touches them (l.open = false).
        let e = unsafe {
            (psm.psm2_mq_finalize)(l.mq);
            (psm.psm2_ep_close)(l.ep, PSM2_EP_CLOSE_GRACEFUL as i32, PSM_TIMEOUT_NS)
        };
        if e != psm2_error::PSM2_OK {
            // SAFETY: as above; a graceful close that timed out is forced.
            unsafe { (psm.psm2_ep_close)(l.ep, PSM2_EP_CLOSE_FORCE as i32, 0) };
        }
        l.open = false;
        // Receives that had matched finish inside the close; what is still
        // live (cancelled or not) can no longer complete.
        for (_, s) in l.live.drain() {
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
        ENDPOINT_TAKEN.store(false, Ordering::Release);
        r
    }
}

impl Engine {
    fn iprobe_locked(&self, l: &mut Inner, p: &Pattern) -> Option<Status> {
        if !l.open {
            return None; // closed by `finish` after the caller's check
        }
        let (src, mut rtag, mut sel) = selector(&l.addrs, p);
        let mut st = std::mem::MaybeUninit::<psm2_mq_status2_t>::zeroed();
        // SAFETY: mq is open; tags and status are valid for the call.
        let e = unsafe {
            (self.psm().psm2_mq_iprobe2)(l.mq, src, &mut rtag, &mut sel, st.as_mut_ptr())
        };
        if e != psm2_error::PSM2_OK {
            return None;
        }
        // SAFETY: filled by PSM2 on success.
        let st = unsafe { st.assume_init() };
        let s = self.recv_status(&st, None);
        Some(s)
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
        // SAFETY: the core owns its buffer until completed; it is completed
        // only when PSM2 has finished with it (or kept forever, see Slot).
        let data = unsafe { std::slice::from_raw_parts(core.buffer_ptr(), core.buffer_len()) };
        match eng.post_send(&mut l, data, (dest, tag, context), sync, false) {
            Ok((key, req)) => {
                l.live.insert(
                    key,
                    Slot::Request {
                        core: core.clone(),
                        req,
                        send: Some((env, data.len())),
                        source: None,
                    },
                );
            }
            Err(e) => {
                eng.tracker.complete(&core, Status::failed(env, e));
            }
        }
        drop(l);
        Request::new(core, eng.clone())
    }
}

/// A message length as PSM2 takes it (`u32`).
fn psm_len(len: usize) -> Result<u32> {
    u32::try_from(len)
        .map_err(|_| Error::ResourceExhausted("PSM2 messages are limited to 4 GiB".into()))
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
mod tests {
    use super::*;
    use xdev::bootstrap::{BootstrapServer, Secret};
    use xdev::{Buffer, Device};

    thread_local! {
        /// Makes the next blocking call of this thread panic right after
        /// its PSM2 request is posted (fault injection for the unwind test).
        pub(super) static PANIC_AFTER_PUBLISH: std::cell::Cell<bool> =
            const { std::cell::Cell::new(false) };
    }

    /// A one-rank psm job in this process (PSM2 allows one endpoint per
    /// process: every psm test of this binary is in this one function).
    fn solo() -> Option<PsmDevice> {
        let job = format!("psm-unit-{}", std::process::id());
        let secret = Secret::generate().unwrap();
        let server =
            BootstrapServer::start("127.0.0.1:0".parse().unwrap(), 1, &job, secret.clone())
                .unwrap();
        let boot = Bootstrap::connect(server.addr(), 0, 1, &job, &secret).unwrap();
        std::mem::forget(server);
        match PsmDevice::with_bootstrap(&Config::new(0, 1, job), boot) {
            Ok(d) => Some(d),
            Err(e) => {
                println!("skipped: no PSM2 endpoint here: {e}");
                None
            }
        }
    }

    #[test]
    fn blocking_calls_that_unwind_leave_psm2_nothing_of_the_callers_memory() {
        let Some(dev) = solo() else {
            return;
        };
        // A synchronous self-send goes through PSM2 (its self device) and
        // completes only once a receive matched it: it unwinds right after
        // it is posted; the caller reuses its block at once.
        let want: Vec<u8> = (0..(1u32 << 20)).map(|i| (i % 253) as u8).collect();
        let got = std::thread::scope(|s| {
            let receiver = s.spawn(|| {
                std::thread::sleep(Duration::from_millis(100));
                let mut buf = vec![0u8; want.len()];
                let st = dev.recv(&mut buf, Source::Rank(0), TagSel::Tag(3), 0);
                (st, buf)
            });
            let mut block = want.clone();
            let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                PANIC_AFTER_PUBLISH.with(|p| p.set(true));
                dev.ssend(&block, 0, 3, 0)
            }));
            assert!(unwound.is_err(), "the injected panic unwound the send");
            block.fill(0xee);
            receiver.join().unwrap()
        });
        let (st, buf) = got;
        assert_eq!(st.unwrap().count, want.len());
        assert!(buf == want, "the receiver got the reused block's bytes");

        // A blocking receive that unwinds once posted is cancelled: a later
        // message goes elsewhere, not into the caller's old block.
        let mut block = vec![0u8; 64];
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            PANIC_AFTER_PUBLISH.with(|p| p.set(true));
            dev.recv(&mut block, Source::Rank(0), TagSel::Tag(4), 0)
        }));
        assert!(unwound.is_err(), "the injected panic unwound the receive");
        block.fill(0xaa);
        let r = dev.irecv(Buffer::zeroed(64), Source::Rank(0), TagSel::Tag(4), 0);
        dev.ssend(&[0x55; 64], 0, 4, 0).unwrap();
        let c = r.wait();
        assert!(c.status.error.is_none(), "{:?}", c.status);
        assert!(c.buf.iter().all(|&x| x == 0x55));
        assert!(
            block.iter().all(|&x| x == 0xaa),
            "the cancelled receive was written"
        );

        // `finish` racing with receives posted from other threads: each
        // completes (Closed at the latest), and none reaches the closed
        // endpoint.
        let go = std::sync::Barrier::new(3);
        let posted = std::thread::scope(|s| {
            let poster = |tag: i32| {
                let (dev, go) = (&dev, &go);
                move || {
                    let mut reqs = Vec::new();
                    go.wait();
                    loop {
                        let r = dev.irecv(Buffer::zeroed(8), Source::Rank(0), TagSel::Tag(tag), 0);
                        match r.test() {
                            Ok(c) if c.status.error == Some(Error::Closed) => break,
                            Ok(c) => panic!("unexpected completion {:?}", c.status),
                            Err(r) => reqs.push(r),
                        }
                    }
                    reqs
                }
            };
            let a = s.spawn(poster(10));
            let b = s.spawn(poster(11));
            go.wait();
            std::thread::sleep(Duration::from_millis(5));
            dev.finish().unwrap();
            let mut all = a.join().unwrap();
            all.extend(b.join().unwrap());
            all
        });
        for mut r in posted {
            let t = Instant::now();
            loop {
                match r.test() {
                    Ok(_) => break,
                    Err(back) => r = back,
                }
                assert!(
                    t.elapsed() < Duration::from_secs(10),
                    "a receive posted during finish never completed"
                );
                std::thread::yield_now();
            }
        }
    }
}
