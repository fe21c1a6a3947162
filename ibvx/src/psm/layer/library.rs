//! libpsm2 for this process: loading, `psm2_init`, error descriptions, job
//! keys and the one endpoint slot.

use std::ffi::CStr;
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use psm_sys::ffi::*;
use psm_sys::Psm2;
use xdev::{Error, Result};

/// How PSM2 runs in this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PsmMode {
    /// `psm2_init` succeeded: PSM2's default devices, hardware included.
    Hardware,
    /// No hfi unit: only PSM2's `self` and `shm` devices (ranks on one host).
    ShmOnly,
}

/// libpsm2, loaded and initialised once per process ([`Library::get`]).
///
/// `psm2_finalize` is never called: after the failed `psm2_init` of
/// shm-only mode it crashes, and with hardware, process exit releases the
/// library (`psm_sys`'s docs).
pub struct Library {
    psm: &'static Psm2,
    mode: PsmMode,
}

/// Whether the process's one endpoint is taken (see [`EndpointSlot`]).
static ENDPOINT_TAKEN: AtomicBool = AtomicBool::new(false);

/// A PSM2 failure: the description PSM2 gives of its error code.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{description}")]
pub struct Psm2Error {
    code: u32,
    description: String,
}

impl Psm2Error {
    /// The `psm2_error_t` value.
    pub fn code(&self) -> u32 {
        self.code
    }
}

/// PSM2's description of `code`, with the number.
pub(super) fn describe(psm: &Psm2, code: psm2_error_t) -> String {
    // SAFETY: psm2_error_get_string accepts any code and returns a static
    // NUL-terminated string or NULL.
    let s = unsafe { (psm.psm2_error_get_string)(code) };
    if s.is_null() {
        format!("PSM2 error {}", code.0)
    } else {
        // SAFETY: non-null, NUL-terminated and static (above).
        let t = unsafe { CStr::from_ptr(s) };
        format!("{} (PSM2 error {})", t.to_string_lossy(), code.0)
    }
}

/// The xdev error of PSM2 `call` failing with `code`.
pub(super) fn psm_error(psm: &Psm2, call: &str, code: psm2_error_t) -> Error {
    let e = Psm2Error {
        code: code.0,
        description: describe(psm, code),
    };
    Error::transport(call.to_string(), e)
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

impl Library {
    /// libpsm2 after `psm2_init`, loaded and initialised on the first call
    /// (the outcome, error included, is kept for the process).
    ///
    /// Without an Omni-Path hfi unit, `psm2_init` fails with
    /// `PSM2_INTERNAL_ERR` yet leaves a library that runs PSM2's `self` and
    /// `shm` devices: that is [`PsmMode::ShmOnly`], said once on stderr. It
    /// needs `PSM2_DEVICES=self,shm`, which a program linking this crate
    /// sets before `main` (a user's value is kept); if the program cleared
    /// it since, this fails rather than set it while threads may read the
    /// environment.
    pub fn get() -> Result<&'static Library> {
        static LIB: OnceLock<std::result::Result<Library, Error>> = OnceLock::new();
        LIB.get_or_init(Library::init)
            .as_ref()
            .map_err(Clone::clone)
    }

    fn init() -> Result<Library> {
        let psm = Psm2::load().map_err(|e| Error::Config(e.to_string()))?;
        let hfi = hfi_present();
        if !hfi && std::env::var_os("PSM2_DEVICES").is_none() {
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
            tracing::warn!(
                "psm: no Omni-Path hfi unit on this host: PSM2 runs in shm-only mode \
                 (PSM2_DEVICES={}); all ranks must share this host",
                std::env::var("PSM2_DEVICES").unwrap_or_default()
            );
            PsmMode::ShmOnly
        } else {
            return Err(psm_error(psm, "psm2_init", e));
        };
        Ok(Library { psm, mode })
    }

    /// How PSM2 runs in this process.
    pub fn mode(&self) -> &PsmMode {
        &self.mode
    }

    /// The function table, for the other handles of this layer.
    pub(super) fn psm(&self) -> &'static Psm2 {
        self.psm
    }

    /// A fresh job key (`psm2_uuid_generate`): every endpoint of one job
    /// opens with the same key.
    pub fn job_key(&self) -> JobKey {
        let mut key: psm2_uuid_t = [0; 16];
        // SAFETY: key is a 16-byte buffer, as psm2_uuid_t requires.
        unsafe { (self.psm.psm2_uuid_generate)(key.as_mut_ptr()) };
        JobKey(key)
    }

    /// Takes the process's one endpoint slot (PSM2 allows one endpoint per
    /// process: a second `psm2_ep_open` fails, and with `PSM2_MULTI_EP` the
    /// second endpoint's close crashes). Fails with a configuration error
    /// while another slot is held.
    pub fn reserve_endpoint(&'static self) -> Result<EndpointSlot> {
        if ENDPOINT_TAKEN.swap(true, Ordering::AcqRel) {
            return Err(Error::Config(
                "PSM2 allows one endpoint per process, and this process has one open".into(),
            ));
        }
        Ok(EndpointSlot { lib: self })
    }
}

/// A PSM2 job key (`psm2_uuid_t`): endpoints connect only within one key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JobKey(pub [u8; 16]);

/// The process's one endpoint slot ([`Library::reserve_endpoint`]),
/// released on drop. An [`Endpoint`](super::Endpoint) holds it while open.
pub struct EndpointSlot {
    lib: &'static Library,
}

impl EndpointSlot {
    /// The library the slot belongs to.
    pub fn library(&self) -> &'static Library {
        self.lib
    }
}

impl Drop for EndpointSlot {
    fn drop(&mut self) {
        ENDPOINT_TAKEN.store(false, Ordering::Release);
    }
}
