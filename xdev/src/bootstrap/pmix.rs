//! The PMIx backend: the bootstrap over the PMIx server of the launcher
//! (Open MPI's `mpirun`, Slurm's `srun --mpi=pmix`, PRRTE), recognised by
//! `PMIX_RANK` and `PMIX_NAMESPACE` in the environment.
//!
//! `libpmix.so.2` is loaded at run time with `dlopen` (`XDEV_PMIX_LIBRARY`
//! names another file); nothing links against it at build time, and the few
//! PMIx types used are declared here as in PMIx 4's `pmix_common.h`. Rank
//! and namespace come from `PMIx_Init`, the size from `PMIX_JOB_SIZE` of the
//! namespace's wildcard rank, the job identity is the namespace. Values are
//! byte objects put with `PMIX_GLOBAL` scope and committed at once; a fence
//! with `PMIX_COLLECT_DATA` is the barrier and publishes them. Departures are
//! the processes named by the PMIx events `PMIX_ERR_PROC_ABORTED`,
//! `PMIX_EVENT_PROC_TERMINATED`, `PMIX_PROC_TERMINATED` and
//! `PMIX_ERR_PROC_TERM_WO_SYNC` (and every rank once
//! `PMIX_ERR_LOST_CONNECTION` says the server is gone), when the server
//! sends them.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use super::{Departure, SERVICE};
use crate::{Error, Rank, Result};

/// Environment variable: the PMIx rank.
pub const PMIX_RANK: &str = "PMIX_RANK";
/// Environment variable: the PMIx namespace.
pub const PMIX_NAMESPACE: &str = "PMIX_NAMESPACE";
/// Environment variable: the PMIx library to load instead of `libpmix.so.2`.
pub const XDEV_PMIX_LIBRARY: &str = "XDEV_PMIX_LIBRARY";

const DEFAULT_LIBRARY: &str = "libpmix.so.2";

// pmix_common.h (PMIx 4.2)
const PMIX_SUCCESS: c_int = 0;
const PMIX_ERR_NOT_FOUND: c_int = -46;
const PMIX_ERR_PROC_ABORTED: c_int = -7;
const PMIX_ERR_LOST_CONNECTION: c_int = -61;
const PMIX_PROC_TERMINATED: c_int = -111;
const PMIX_ERR_PROC_TERM_WO_SYNC: c_int = -200;
const PMIX_EVENT_PROC_TERMINATED: c_int = -201;
const PMIX_EVENT_ACTION_COMPLETE: c_int = -334;
const PMIX_BOOL: u16 = 1;
const PMIX_UINT32: u16 = 14;
const PMIX_PROC: u16 = 22;
const PMIX_BYTE_OBJECT: u16 = 27;
const PMIX_GLOBAL: u8 = 3;
const PMIX_RANK_WILDCARD: u32 = u32::MAX - 1;
const PMIX_RANK_UNDEF: u32 = u32::MAX;
const PMIX_MAX_NSLEN: usize = 255;
const PMIX_MAX_KEYLEN: usize = 511;

/// `pmix_proc_t`.
#[repr(C)]
#[derive(Clone, Copy)]
struct PmixProc {
    nspace: [c_char; PMIX_MAX_NSLEN + 1],
    rank: u32,
}

/// `pmix_value_t`: the type, then a 24-byte union (8-aligned).
#[repr(C)]
#[derive(Clone, Copy)]
struct PmixValue {
    kind: u16,
    data: [u64; 3],
}

/// `pmix_info_t`.
#[repr(C)]
struct PmixInfo {
    key: [c_char; PMIX_MAX_KEYLEN + 1],
    flags: u32,
    value: PmixValue,
}

const _: () = assert!(std::mem::size_of::<PmixProc>() == 260);
const _: () = assert!(std::mem::size_of::<PmixValue>() == 32);
const _: () = assert!(std::mem::size_of::<PmixInfo>() == 552);

impl PmixInfo {
    fn flag(key: &str, on: bool) -> PmixInfo {
        let mut i = PmixInfo {
            key: [0; PMIX_MAX_KEYLEN + 1],
            flags: 0,
            value: PmixValue {
                kind: PMIX_BOOL,
                data: [u64::from(on), 0, 0],
            },
        };
        for (d, s) in i.key.iter_mut().zip(key.bytes()) {
            *d = s as c_char;
        }
        i
    }
}

type EventCompleteFn = unsafe extern "C" fn(
    status: c_int,
    results: *mut PmixInfo,
    nresults: usize,
    cbfunc: *mut c_void,
    thiscbdata: *mut c_void,
    notification_cbdata: *mut c_void,
);

type NotificationFn = unsafe extern "C" fn(
    id: usize,
    status: c_int,
    source: *const PmixProc,
    info: *mut PmixInfo,
    ninfo: usize,
    results: *mut PmixInfo,
    nresults: usize,
    cbfunc: Option<EventCompleteFn>,
    cbdata: *mut c_void,
);

type InitFn = unsafe extern "C" fn(*mut PmixProc, *mut PmixInfo, usize) -> c_int;
type FinalizeFn = unsafe extern "C" fn(*const PmixInfo, usize) -> c_int;
type PutFn = unsafe extern "C" fn(u8, *const c_char, *mut PmixValue) -> c_int;
type CommitFn = unsafe extern "C" fn() -> c_int;
type FenceFn = unsafe extern "C" fn(*const PmixProc, usize, *const PmixInfo, usize) -> c_int;
type GetFn = unsafe extern "C" fn(
    *const PmixProc,
    *const c_char,
    *const PmixInfo,
    usize,
    *mut *mut PmixValue,
) -> c_int;
type ValueDestructFn = unsafe extern "C" fn(*mut PmixValue);
type ErrorStringFn = unsafe extern "C" fn(c_int) -> *const c_char;
type RegisterFn = unsafe extern "C" fn(
    *mut c_int,
    usize,
    *mut PmixInfo,
    usize,
    NotificationFn,
    *mut c_void,
    *mut c_void,
) -> c_int;

/// The entry points used, resolved from the library.
struct Api {
    init: InitFn,
    finalize: FinalizeFn,
    put: PutFn,
    commit: CommitFn,
    fence: FenceFn,
    get: GetFn,
    value_destruct: ValueDestructFn,
    error_string: ErrorStringFn,
    register: RegisterFn,
}

fn unavailable(why: impl std::fmt::Display) -> Error {
    Error::Config(format!("PMIx not available: {why}"))
}

fn dlerror() -> String {
    // SAFETY: dlerror returns a thread-local C string or null.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown error".into()
    } else {
        // SAFETY: non-null: a NUL-terminated string owned by libdl.
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

impl Api {
    fn load() -> Result<Api> {
        Self::load_from(
            &std::env::var(XDEV_PMIX_LIBRARY).unwrap_or_else(|_| DEFAULT_LIBRARY.into()),
        )
    }

    fn load_from(path: &str) -> Result<Api> {
        let path = path.to_owned();
        let c = CString::new(path.clone()).map_err(|_| unavailable("library name holds a NUL"))?;
        // SAFETY: dlopen with a valid C string; the handle is kept for the
        // life of the process (never dlclosed), so the symbols stay valid.
        // RTLD_GLOBAL: PMIx's own plugins resolve symbols of libpmix.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if h.is_null() {
            return Err(unavailable(format!(
                "cannot load {path}: {} (install libpmix2, or set {XDEV_PMIX_LIBRARY})",
                dlerror()
            )));
        }
        let sym = |name: &str| -> Result<*mut c_void> {
            let n = CString::new(name).expect("symbol names hold no NUL");
            // SAFETY: `h` is a live handle, `n` a valid C string.
            let p = unsafe { libc::dlsym(h, n.as_ptr()) };
            if p.is_null() {
                Err(unavailable(format!("{path} has no {name}: {}", dlerror())))
            } else {
                Ok(p)
            }
        };
        // SAFETY (each transmute): the symbol is the PMIx 4 function of that
        // name, whose C prototype in pmix.h matches the function pointer type
        // it becomes.
        Ok(Api {
            // SAFETY: see above.
            init: unsafe { std::mem::transmute::<*mut c_void, InitFn>(sym("PMIx_Init")?) },
            // SAFETY: see above.
            finalize: unsafe {
                std::mem::transmute::<*mut c_void, FinalizeFn>(sym("PMIx_Finalize")?)
            },
            // SAFETY: see above.
            put: unsafe { std::mem::transmute::<*mut c_void, PutFn>(sym("PMIx_Put")?) },
            // SAFETY: see above.
            commit: unsafe { std::mem::transmute::<*mut c_void, CommitFn>(sym("PMIx_Commit")?) },
            // SAFETY: see above.
            fence: unsafe { std::mem::transmute::<*mut c_void, FenceFn>(sym("PMIx_Fence")?) },
            // SAFETY: see above.
            get: unsafe { std::mem::transmute::<*mut c_void, GetFn>(sym("PMIx_Get")?) },
            // SAFETY: see above.
            value_destruct: unsafe {
                std::mem::transmute::<*mut c_void, ValueDestructFn>(sym("PMIx_Value_destruct")?)
            },
            // SAFETY: see above.
            error_string: unsafe {
                std::mem::transmute::<*mut c_void, ErrorStringFn>(sym("PMIx_Error_string")?)
            },
            // SAFETY: see above.
            register: unsafe {
                std::mem::transmute::<*mut c_void, RegisterFn>(sym("PMIx_Register_event_handler")?)
            },
        })
    }

    fn describe(&self, rc: c_int) -> String {
        // SAFETY: PMIx_Error_string returns a static string for any code.
        let p = unsafe { (self.error_string)(rc) };
        if p.is_null() {
            format!("PMIx status {rc}")
        } else {
            // SAFETY: non-null static NUL-terminated string.
            format!("{} ({rc})", unsafe { CStr::from_ptr(p) }.to_string_lossy())
        }
    }
}

/// The process's PMIx client (PMIx allows one per process).
pub(crate) struct Session {
    api: Api,
    me: PmixProc,
    rank: Rank,
    size: usize,
    job: String,
    finalized: Mutex<bool>,
}

// SAFETY: `Session` holds function pointers into libpmix and plain data; the
// PMIx client API is thread-safe (its calls are serialised on PMIx's own
// progress thread).
unsafe impl Send for Session {}
// SAFETY: as above.
unsafe impl Sync for Session {}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Departures reported by PMIx events, in the order they came.
static DEPARTURES: Mutex<Vec<Departure>> = Mutex::new(Vec::new());
static SESSION: OnceLock<Result<Arc<Session>>> = OnceLock::new();

/// The process's PMIx session, set up on first use.
pub(crate) fn session() -> Result<Arc<Session>> {
    SESSION
        .get_or_init(|| {
            let s = Arc::new(Session::init()?);
            // SAFETY: `finalize_at_exit` is an `extern "C" fn()` that does
            // not unwind, as atexit requires.
            unsafe { libc::atexit(finalize_at_exit) };
            Ok(s)
        })
        .clone()
}

extern "C" fn finalize_at_exit() {
    if let Some(Ok(s)) = SESSION.get() {
        s.finalize();
    }
}

fn cstr_field(bytes: &[c_char]) -> String {
    let b: Vec<u8> = bytes
        .iter()
        .take_while(|&&c| c != 0)
        // c_char is i8 on x86_64 and u8 on aarch64: the byte as it is.
        .map(|&c| u8::from_ne_bytes(c.to_ne_bytes()))
        .collect();
    String::from_utf8_lossy(&b).into_owned()
}

fn record(rank: u32, size: usize, all: bool) {
    let mut d = lock(&DEPARTURES);
    let mut add = |r: usize| {
        if !d.iter().any(|x| x.rank == r) {
            d.push(Departure {
                rank: r,
                clean: false,
            });
        }
    };
    if all {
        (0..size).for_each(&mut add);
    } else if (rank as usize) < size {
        add(rank as usize);
    }
}

/// The job size, as the handler needs it (set once the session is up).
static JOB_SIZE: OnceLock<(usize, u32, [c_char; PMIX_MAX_NSLEN + 1])> = OnceLock::new();

unsafe extern "C" fn on_event(
    _id: usize,
    status: c_int,
    source: *const PmixProc,
    info: *mut PmixInfo,
    ninfo: usize,
    _results: *mut PmixInfo,
    _nresults: usize,
    cbfunc: Option<EventCompleteFn>,
    cbdata: *mut c_void,
) {
    if let Some(&(size, me, nspace)) = JOB_SIZE.get() {
        if status == PMIX_ERR_LOST_CONNECTION {
            // The server is gone: so is every other rank's way to us.
            let mut d = lock(&DEPARTURES);
            for r in (0..size).filter(|&r| r != me as usize) {
                if !d.iter().any(|x| x.rank == r) {
                    d.push(Departure {
                        rank: r,
                        clean: false,
                    });
                }
            }
        } else {
            let mut affected: Vec<PmixProc> = Vec::new();
            if !info.is_null() {
                for i in 0..ninfo {
                    // SAFETY: PMIx passes `ninfo` valid infos at `info`.
                    let inf = unsafe { &*info.add(i) };
                    if cstr_field(&inf.key) == "pmix.evproc" && inf.value.kind == PMIX_PROC {
                        let p = inf.value.data[0] as *const PmixProc;
                        if !p.is_null() {
                            // SAFETY: a PMIX_PROC value points at a pmix_proc_t.
                            affected.push(unsafe { *p });
                        }
                    }
                }
            }
            if affected.is_empty() && !source.is_null() {
                // SAFETY: a non-null source is a valid pmix_proc_t.
                affected.push(unsafe { *source });
            }
            for p in affected {
                if p.nspace[..] == nspace[..] && p.rank != me && p.rank < PMIX_RANK_WILDCARD {
                    record(p.rank, size, false);
                }
            }
        }
    }
    if let Some(cb) = cbfunc {
        // SAFETY: PMIx requires the handler to call cbfunc with its cbdata
        // once it is done; no results are passed.
        unsafe {
            cb(
                PMIX_EVENT_ACTION_COMPLETE,
                std::ptr::null_mut(),
                0,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                cbdata,
            )
        };
    }
}

impl Session {
    fn init() -> Result<Session> {
        let api = Api::load()?;
        let mut me = PmixProc {
            nspace: [0; PMIX_MAX_NSLEN + 1],
            rank: PMIX_RANK_UNDEF,
        };
        // SAFETY: `me` is a writable pmix_proc_t; no info.
        let rc = unsafe { (api.init)(&mut me, std::ptr::null_mut(), 0) };
        if rc != PMIX_SUCCESS {
            return Err(Error::Config(format!(
                "PMIx_Init failed: {} (is this process started by a PMIx launcher?)",
                api.describe(rc)
            )));
        }
        let job = cstr_field(&me.nspace);
        let mut wildcard = me;
        wildcard.rank = PMIX_RANK_WILDCARD;
        let key = CString::new("pmix.job.size").expect("no NUL");
        let mut val: *mut PmixValue = std::ptr::null_mut();
        // SAFETY: valid proc and key; PMIx allocates `val` on success.
        let rc = unsafe { (api.get)(&wildcard, key.as_ptr(), std::ptr::null(), 0, &mut val) };
        if rc != PMIX_SUCCESS || val.is_null() {
            return Err(pmix_err(format!(
                "PMIx_Get(PMIX_JOB_SIZE) failed: {}",
                api.describe(rc)
            )));
        }
        // SAFETY: `val` is the value PMIx returned.
        let v = unsafe { *val };
        // SAFETY: the value was allocated by PMIx with malloc; destruct then
        // free it, as PMIX_VALUE_RELEASE does.
        unsafe {
            (api.value_destruct)(val);
            libc::free(val.cast());
        }
        let size = match v.kind {
            PMIX_UINT32 => (v.data[0] & 0xffff_ffff) as usize,
            k => return Err(pmix_err(format!("PMIX_JOB_SIZE has type {k}, not uint32"))),
        };
        let rank = me.rank as usize;
        if size == 0 || rank >= size {
            return Err(pmix_err(format!("PMIx says rank {rank} of {size}")));
        }
        if job.is_empty() || job.len() > super::wire::MAX_JOB_LEN {
            return Err(pmix_err(format!("namespace {job:?} is empty or too long")));
        }
        let _ = JOB_SIZE.set((size, me.rank, me.nspace));
        let mut codes = [
            PMIX_ERR_PROC_ABORTED,
            PMIX_EVENT_PROC_TERMINATED,
            PMIX_PROC_TERMINATED,
            PMIX_ERR_PROC_TERM_WO_SYNC,
            PMIX_ERR_LOST_CONNECTION,
        ];
        // SAFETY: `codes` outlives the call (PMIx copies it); with no
        // registration callback the call blocks until registered. The
        // handler only touches statics. A server that offers none of these
        // events just never calls it, so a failure here is not an error.
        let _ = unsafe {
            (api.register)(
                codes.as_mut_ptr(),
                codes.len(),
                std::ptr::null_mut(),
                0,
                on_event,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        };
        Ok(Session {
            api,
            me,
            rank,
            size,
            job,
            finalized: Mutex::new(false),
        })
    }

    pub(crate) fn rank(&self) -> Rank {
        self.rank
    }

    pub(crate) fn size(&self) -> usize {
        self.size
    }

    pub(crate) fn job(&self) -> &str {
        &self.job
    }

    fn key(key: &str) -> Result<CString> {
        let prefixed = format!("xdev.{key}");
        if prefixed.len() > PMIX_MAX_KEYLEN {
            return Err(Error::Config(format!(
                "bootstrap key of {} bytes is too long for PMIx",
                key.len()
            )));
        }
        CString::new(prefixed).map_err(|_| Error::Config("bootstrap keys must not hold NUL".into()))
    }

    /// Puts `value` under `key` for this rank and commits it.
    pub(crate) fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        let k = Self::key(key)?;
        let mut v = PmixValue {
            kind: PMIX_BYTE_OBJECT,
            data: [value.as_ptr() as u64, value.len() as u64, 0],
        };
        // SAFETY: PMIx_Put copies the byte object (`value` is readable for
        // its length) and the key.
        let rc = unsafe { (self.api.put)(PMIX_GLOBAL, k.as_ptr(), &mut v) };
        if rc != PMIX_SUCCESS {
            return Err(pmix_err(format!(
                "PMIx_Put({key:?}) failed: {}",
                self.api.describe(rc)
            )));
        }
        // SAFETY: no arguments.
        let rc = unsafe { (self.api.commit)() };
        if rc != PMIX_SUCCESS {
            return Err(pmix_err(format!(
                "PMIx_Commit failed: {}",
                self.api.describe(rc)
            )));
        }
        Ok(())
    }

    /// The value `rank` put under `key` (`None`: not there): a get bound
    /// to its putter, since PMIx stores each value under the rank that put
    /// it and no rank can put under another's. With `local_only` only what
    /// this process already holds is searched.
    pub(crate) fn get_from(
        &self,
        rank: u32,
        key: &str,
        local_only: bool,
    ) -> Result<Option<Vec<u8>>> {
        let k = Self::key(key)?;
        let mut p = self.me;
        p.rank = rank;
        let info = [PmixInfo::flag("pmix.optional", true)];
        let (ip, n) = if local_only {
            (info.as_ptr(), 1)
        } else {
            (std::ptr::null(), 0)
        };
        let mut val: *mut PmixValue = std::ptr::null_mut();
        // SAFETY: valid proc, key and info; PMIx allocates `val` on success.
        let rc = unsafe { (self.api.get)(&p, k.as_ptr(), ip, n, &mut val) };
        if rc == PMIX_ERR_NOT_FOUND || (rc != PMIX_SUCCESS && local_only) {
            return Ok(None);
        }
        if rc != PMIX_SUCCESS || val.is_null() {
            return Err(pmix_err(format!(
                "PMIx_Get({key:?} of rank {rank}) failed: {}",
                self.api.describe(rc)
            )));
        }
        // SAFETY: `val` is the value PMIx returned.
        let v = unsafe { *val };
        let out = if v.kind == PMIX_BYTE_OBJECT {
            let (ptr, len) = (v.data[0] as *const u8, v.data[1] as usize);
            if ptr.is_null() || len == 0 {
                Ok(Vec::new())
            } else {
                // SAFETY: a byte object holds `len` readable bytes at `ptr`.
                Ok(unsafe { std::slice::from_raw_parts(ptr, len) }.to_vec())
            }
        } else {
            Err(Error::Protocol {
                rank: rank as usize,
                what: format!("PMIx value of {key:?} has type {}, not bytes", v.kind),
            })
        };
        // SAFETY: as in `init`: release the value PMIx allocated.
        unsafe {
            (self.api.value_destruct)(val);
            libc::free(val.cast());
        }
        out.map(Some)
    }

    /// The value some rank put under `key`, searching what this process
    /// holds (everything fenced so far) of every rank.
    ///
    /// PMIx keeps one value per (rank, key): a key that several ranks put
    /// is several records, and no rank's is more authoritative than
    /// another's. So a key found under two ranks with different values is
    /// refused with [`Error::Protocol`] (naming the higher rank and both in
    /// the text) instead of returning the lowest rank's; a caller that knows
    /// who should have put a record asks for that rank's with
    /// [`get_from`](Self::get_from).
    pub(crate) fn get_any(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let mut found = Vec::new();
        for r in 0..self.size as u32 {
            if let Some(v) = self.get_from(r, key, true)? {
                found.push((r, v));
            }
        }
        only_one(key, found)
    }

    /// A fence over the whole namespace that collects the data put so far.
    pub(crate) fn fence(&self) -> Result<()> {
        let info = [PmixInfo::flag("pmix.collect", true)];
        let mut all = self.me;
        all.rank = PMIX_RANK_WILDCARD;
        // SAFETY: one valid proc, one valid info.
        let rc = unsafe { (self.api.fence)(&all, 1, info.as_ptr(), info.len()) };
        if rc != PMIX_SUCCESS {
            let what = format!("PMIx_Fence failed: {}", self.api.describe(rc));
            if let Some(d) = lock(&DEPARTURES).first() {
                return Err(Error::PeerLost {
                    rank: d.rank,
                    reason: what,
                });
            }
            return Err(pmix_err(what));
        }
        Ok(())
    }

    /// What PMIx events reported gone.
    pub(crate) fn departures(&self) -> Vec<Departure> {
        lock(&DEPARTURES).clone()
    }

    fn finalize(&self) {
        let mut done = lock(&self.finalized);
        if !*done {
            *done = true;
            // SAFETY: PMIx was initialised by `init`; no info.
            unsafe { (self.api.finalize)(std::ptr::null(), 0) };
        }
    }
}

/// The one value of `key` among what the ranks in `found` put under it
/// (`None` if none did); a protocol error if two ranks put different
/// values.
fn only_one(key: &str, found: Vec<(u32, Vec<u8>)>) -> Result<Option<Vec<u8>>> {
    let mut it = found.into_iter();
    let Some((first, value)) = it.next() else {
        return Ok(None);
    };
    if let Some((other, _)) = it.find(|(_, v)| *v != value) {
        return Err(Error::Protocol {
            rank: other as Rank,
            what: format!(
                "PMIx: ranks {first} and {other} put different values under {key:?}; \
                 the key is ambiguous (read one rank's record)"
            ),
        });
    }
    Ok(Some(value))
}

fn pmix_err(what: impl Into<String>) -> Error {
    Error::Protocol {
        rank: SERVICE,
        what: what.into(),
    }
}

#[cfg(test)]
mod tests;
