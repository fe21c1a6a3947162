//! Run-time loading of libibverbs: the [`Verbs`] function table.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::sync::OnceLock;

use crate::bindings::*;

/// The shared object [`Verbs::load`] opens (rdma-core's stable soname).
pub const LIBIBVERBS: &str = "libibverbs.so.1";

/// Why libibverbs could not be loaded. Every variant displays as
/// `verbs not available: ...`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// `dlopen` failed (library not installed, not on the search path, or
    /// not loadable); `message` is the dynamic loader's `dlerror()` text.
    #[error("verbs not available: {message}")]
    Library {
        /// The path or soname that was passed to `dlopen`.
        path: String,
        /// The loader's message.
        message: String,
    },
    /// The library loaded but lacks an entry point at the expected symbol
    /// version (an rdma-core older than this crate supports, or not libibverbs).
    #[error("verbs not available: {path}: symbol {symbol}@{version} not found: {message}")]
    Symbol {
        /// The path or soname that was passed to `dlopen`.
        path: String,
        /// The missing symbol.
        symbol: &'static str,
        /// The symbol version that was asked for.
        version: &'static str,
        /// The loader's message.
        message: String,
    },
}

/// Declares the [`Verbs`] table: one field per entry point, the symbol
/// version it is resolved at, a compile-time check that the field type is
/// exactly the header's signature (`pfn_<symbol>` from wrapper.h, via
/// bindgen), and the resolution code.
macro_rules! verbs_table {
    ($(
        $(#[$attr:meta])*
        $name:ident @ $version:literal : $pfn:ident
            = fn($($arg:ident : $argty:ty),* $(,)?) $(-> $ret:ty)?;
    )*) => {
        /// The libibverbs entry points, resolved once with `dlvsym` at the
        /// symbol versions a program compiled against rdma-core 44's verbs.h
        /// binds to (mostly `IBVERBS_1.1`).
        ///
        /// Fields are the raw exported functions; their C contracts (see the
        /// rdma-core man pages of the same names) apply. Call the methods
        /// [`Verbs::query_port`], [`Verbs::reg_mr`] and [`Verbs::query_gid_ex`]
        /// instead of the fields where verbs.h wraps the export in a macro or
        /// inline function. The library stays loaded for the life of the
        /// process, so the pointers never dangle.
        #[derive(Clone, Copy, Debug)]
        pub struct Verbs {
            $(
                $(#[$attr])*
                pub $name: unsafe extern "C" fn($($arg: $argty),*) $(-> $ret)?,
            )*
        }

        // Each hand-written field type must be exactly the type bindgen
        // derived from verbs.h (`Some(f)` only type-checks if the fn pointer
        // types are identical), so header and table cannot drift apart.
        #[allow(dead_code)]
        const _: () = {
            $(
                fn $name(f: unsafe extern "C" fn($($argty),*) $(-> $ret)?) -> $pfn {
                    Some(f)
                }
            )*
        };

        impl Verbs {
            /// Every `(symbol, version)` pair the table resolves.
            pub const SYMBOLS: &'static [(&'static str, &'static str)] =
                &[$((stringify!($name), $version)),*];

            fn resolve(lib: &Library) -> Result<Self, LoadError> {
                Ok(Self {
                    $(
                        $name: {
                            let p = lib.symbol(stringify!($name), $version)?;
                            // SAFETY: `p` is the non-null address of the
                            // exported function `$name` at symbol version
                            // `$version`, whose C signature is the one
                            // written above (checked against verbs.h at
                            // compile time). Data and function pointers have
                            // the same size and representation on the
                            // supported (x86_64 Linux) target.
                            unsafe {
                                std::mem::transmute::<
                                    *mut c_void,
                                    unsafe extern "C" fn($($argty),*) $(-> $ret)?,
                                >(p)
                            }
                        },
                    )*
                })
            }
        }
    };
}

verbs_table! {
    /// `ibv_get_device_list(num_devices)`: NULL-terminated array of devices
    /// (NULL with errno set on failure, e.g. ENOSYS without kernel support).
    ibv_get_device_list @ "IBVERBS_1.1": pfn_ibv_get_device_list
        = fn(num_devices: *mut c_int) -> *mut *mut ibv_device;
    /// `ibv_free_device_list(list)`.
    ibv_free_device_list @ "IBVERBS_1.1": pfn_ibv_free_device_list
        = fn(list: *mut *mut ibv_device);
    /// `ibv_get_device_name(device)`: kernel device name, e.g. "rxe0".
    ibv_get_device_name @ "IBVERBS_1.1": pfn_ibv_get_device_name
        = fn(device: *mut ibv_device) -> *const c_char;
    /// `ibv_get_device_guid(device)`: node GUID in network byte order.
    ibv_get_device_guid @ "IBVERBS_1.1": pfn_ibv_get_device_guid
        = fn(device: *mut ibv_device) -> __be64;
    /// `ibv_open_device(device)`.
    ibv_open_device @ "IBVERBS_1.1": pfn_ibv_open_device
        = fn(device: *mut ibv_device) -> *mut ibv_context;
    /// `ibv_close_device(context)`.
    ibv_close_device @ "IBVERBS_1.1": pfn_ibv_close_device
        = fn(context: *mut ibv_context) -> c_int;
    /// `ibv_query_device(context, device_attr)`.
    ibv_query_device @ "IBVERBS_1.1": pfn_ibv_query_device
        = fn(context: *mut ibv_context, device_attr: *mut ibv_device_attr) -> c_int;
    /// The exported `ibv_query_port`, which fills the *compat* (older,
    /// shorter) port attribute layout. verbs.h hides it behind a macro;
    /// use [`Verbs::query_port`], which mirrors that macro.
    ibv_query_port @ "IBVERBS_1.1": pfn_ibv_query_port
        = fn(context: *mut ibv_context, port_num: u8, port_attr: *mut _compat_ibv_port_attr) -> c_int;
    /// `ibv_query_gid(context, port_num, index, gid)`.
    ibv_query_gid @ "IBVERBS_1.1": pfn_ibv_query_gid
        = fn(context: *mut ibv_context, port_num: u8, index: c_int, gid: *mut ibv_gid) -> c_int;
    /// `_ibv_query_gid_ex`, the export behind the inline `ibv_query_gid_ex`;
    /// use [`Verbs::query_gid_ex`].
    _ibv_query_gid_ex @ "IBVERBS_1.11": pfn__ibv_query_gid_ex
        = fn(
            context: *mut ibv_context,
            port_num: u32,
            gid_index: u32,
            entry: *mut ibv_gid_entry,
            flags: u32,
            entry_size: usize,
        ) -> c_int;
    /// `ibv_query_pkey(context, port_num, index, pkey)`.
    ibv_query_pkey @ "IBVERBS_1.1": pfn_ibv_query_pkey
        = fn(context: *mut ibv_context, port_num: u8, index: c_int, pkey: *mut __be16) -> c_int;
    /// `ibv_alloc_pd(context)`.
    ibv_alloc_pd @ "IBVERBS_1.1": pfn_ibv_alloc_pd
        = fn(context: *mut ibv_context) -> *mut ibv_pd;
    /// `ibv_dealloc_pd(pd)`.
    ibv_dealloc_pd @ "IBVERBS_1.1": pfn_ibv_dealloc_pd
        = fn(pd: *mut ibv_pd) -> c_int;
    /// The exported `ibv_reg_mr` (verbs.h wraps it in a macro; see
    /// [`Verbs::reg_mr`]).
    ibv_reg_mr @ "IBVERBS_1.1": pfn_ibv_reg_mr
        = fn(pd: *mut ibv_pd, addr: *mut c_void, length: usize, access: c_int) -> *mut ibv_mr;
    /// `ibv_reg_mr_iova2(pd, addr, length, iova, access)`: the variant that
    /// accepts the optional access flags.
    ibv_reg_mr_iova2 @ "IBVERBS_1.8": pfn_ibv_reg_mr_iova2
        = fn(pd: *mut ibv_pd, addr: *mut c_void, length: usize, iova: u64, access: c_uint) -> *mut ibv_mr;
    /// `ibv_dereg_mr(mr)`.
    ibv_dereg_mr @ "IBVERBS_1.1": pfn_ibv_dereg_mr
        = fn(mr: *mut ibv_mr) -> c_int;
    /// `ibv_create_comp_channel(context)`.
    ibv_create_comp_channel @ "IBVERBS_1.0": pfn_ibv_create_comp_channel
        = fn(context: *mut ibv_context) -> *mut ibv_comp_channel;
    /// `ibv_destroy_comp_channel(channel)`.
    ibv_destroy_comp_channel @ "IBVERBS_1.0": pfn_ibv_destroy_comp_channel
        = fn(channel: *mut ibv_comp_channel) -> c_int;
    /// `ibv_create_cq(context, cqe, cq_context, channel, comp_vector)`.
    ibv_create_cq @ "IBVERBS_1.1": pfn_ibv_create_cq
        = fn(
            context: *mut ibv_context,
            cqe: c_int,
            cq_context: *mut c_void,
            channel: *mut ibv_comp_channel,
            comp_vector: c_int,
        ) -> *mut ibv_cq;
    /// `ibv_resize_cq(cq, cqe)`.
    ibv_resize_cq @ "IBVERBS_1.1": pfn_ibv_resize_cq
        = fn(cq: *mut ibv_cq, cqe: c_int) -> c_int;
    /// `ibv_destroy_cq(cq)`.
    ibv_destroy_cq @ "IBVERBS_1.1": pfn_ibv_destroy_cq
        = fn(cq: *mut ibv_cq) -> c_int;
    /// `ibv_get_cq_event(channel, cq, cq_context)`: blocks unless the
    /// channel fd is non-blocking.
    ibv_get_cq_event @ "IBVERBS_1.1": pfn_ibv_get_cq_event
        = fn(channel: *mut ibv_comp_channel, cq: *mut *mut ibv_cq, cq_context: *mut *mut c_void) -> c_int;
    /// `ibv_ack_cq_events(cq, nevents)`.
    ibv_ack_cq_events @ "IBVERBS_1.1": pfn_ibv_ack_cq_events
        = fn(cq: *mut ibv_cq, nevents: c_uint);
    /// `ibv_create_qp(pd, qp_init_attr)`.
    ibv_create_qp @ "IBVERBS_1.1": pfn_ibv_create_qp
        = fn(pd: *mut ibv_pd, qp_init_attr: *mut ibv_qp_init_attr) -> *mut ibv_qp;
    /// `ibv_destroy_qp(qp)`.
    ibv_destroy_qp @ "IBVERBS_1.1": pfn_ibv_destroy_qp
        = fn(qp: *mut ibv_qp) -> c_int;
    /// `ibv_modify_qp(qp, attr, attr_mask)`; `attr_mask` is an OR of
    /// `IBV_QP_*` ([`ibv_qp_attr_mask`]) values.
    ibv_modify_qp @ "IBVERBS_1.1": pfn_ibv_modify_qp
        = fn(qp: *mut ibv_qp, attr: *mut ibv_qp_attr, attr_mask: c_int) -> c_int;
    /// `ibv_query_qp(qp, attr, attr_mask, init_attr)`.
    ibv_query_qp @ "IBVERBS_1.1": pfn_ibv_query_qp
        = fn(qp: *mut ibv_qp, attr: *mut ibv_qp_attr, attr_mask: c_int, init_attr: *mut ibv_qp_init_attr) -> c_int;
    /// `ibv_create_srq(pd, srq_init_attr)`.
    ibv_create_srq @ "IBVERBS_1.1": pfn_ibv_create_srq
        = fn(pd: *mut ibv_pd, srq_init_attr: *mut ibv_srq_init_attr) -> *mut ibv_srq;
    /// `ibv_modify_srq(srq, srq_attr, srq_attr_mask)`.
    ibv_modify_srq @ "IBVERBS_1.1": pfn_ibv_modify_srq
        = fn(srq: *mut ibv_srq, srq_attr: *mut ibv_srq_attr, srq_attr_mask: c_int) -> c_int;
    /// `ibv_query_srq(srq, srq_attr)`.
    ibv_query_srq @ "IBVERBS_1.1": pfn_ibv_query_srq
        = fn(srq: *mut ibv_srq, srq_attr: *mut ibv_srq_attr) -> c_int;
    /// `ibv_destroy_srq(srq)`.
    ibv_destroy_srq @ "IBVERBS_1.1": pfn_ibv_destroy_srq
        = fn(srq: *mut ibv_srq) -> c_int;
    /// `ibv_get_async_event(context, event)`: blocks unless
    /// `context->async_fd` is non-blocking.
    ibv_get_async_event @ "IBVERBS_1.1": pfn_ibv_get_async_event
        = fn(context: *mut ibv_context, event: *mut ibv_async_event) -> c_int;
    /// `ibv_ack_async_event(event)`.
    ibv_ack_async_event @ "IBVERBS_1.1": pfn_ibv_ack_async_event
        = fn(event: *mut ibv_async_event);
    /// `ibv_wc_status_str(status)`: static string, never NULL.
    ibv_wc_status_str @ "IBVERBS_1.1": pfn_ibv_wc_status_str
        = fn(status: ibv_wc_status) -> *const c_char;
    /// `ibv_port_state_str(port_state)`: static string, never NULL.
    ibv_port_state_str @ "IBVERBS_1.1": pfn_ibv_port_state_str
        = fn(port_state: ibv_port_state) -> *const c_char;
    /// `ibv_event_type_str(event)`: static string, never NULL.
    ibv_event_type_str @ "IBVERBS_1.1": pfn_ibv_event_type_str
        = fn(event: ibv_event_type) -> *const c_char;
    /// `ibv_node_type_str(node_type)`: static string, never NULL.
    ibv_node_type_str @ "IBVERBS_1.1": pfn_ibv_node_type_str
        = fn(node_type: ibv_node_type) -> *const c_char;
    /// `ibv_fork_init()`: must run before any other verbs call if the
    /// process will fork (or set `RDMAV_FORK_SAFE=1`).
    ibv_fork_init @ "IBVERBS_1.1": pfn_ibv_fork_init
        = fn() -> c_int;
}

static VERBS: OnceLock<Result<Verbs, LoadError>> = OnceLock::new();

impl Verbs {
    /// Loads [`LIBIBVERBS`] and resolves the table, once per process; later
    /// calls return the same table, or a clone of the same error (a failed
    /// load is not retried).
    pub fn load() -> Result<&'static Verbs, LoadError> {
        VERBS
            .get_or_init(|| Self::load_from(LIBIBVERBS))
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Loads the library at `path` (a soname searched like `dlopen` does, or
    /// a file path) and resolves the table, bypassing the process-wide cache.
    ///
    /// On success the library is never unloaded (rdma-core and its provider
    /// plugins do not support it), so each successful call keeps one more
    /// `dlopen` reference; meant for tests and non-default installations.
    pub fn load_from(path: &str) -> Result<Verbs, LoadError> {
        let lib = Library::open(path)?;
        match Self::resolve(&lib) {
            Ok(verbs) => {
                tracing::debug!(path, "libibverbs loaded");
                std::mem::forget(lib);
                Ok(verbs)
            }
            // `lib` is dropped (dlclose) because nothing points into it.
            Err(e) => Err(e),
        }
    }
}

/// A `dlopen` handle; dropping it `dlclose`s.
struct Library {
    handle: *mut c_void,
    path: String,
}

/// The current `dlerror()` text, or `fallback` if there is none.
fn dlerror_message(fallback: &str) -> String {
    // SAFETY: dlerror takes no arguments; glibc keeps its state per thread.
    let msg = unsafe { libc::dlerror() };
    if msg.is_null() {
        fallback.to_owned()
    } else {
        // SAFETY: a non-null dlerror() result is a NUL-terminated string that
        // stays valid until the next dl* call on this thread; it is copied at once.
        unsafe { CStr::from_ptr(msg) }
            .to_string_lossy()
            .into_owned()
    }
}

impl Library {
    fn open(path: &str) -> Result<Self, LoadError> {
        let err = |message: String| LoadError::Library {
            path: path.to_owned(),
            message,
        };
        let c_path =
            CString::new(path).map_err(|_| err(format!("{path:?}: path contains a NUL byte")))?;
        // SAFETY: `c_path` is a valid NUL-terminated string. Opening runs the
        // library's initialisers (libibverbs' only set up its provider list).
        let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(err(dlerror_message(&format!("{path}: dlopen failed"))));
        }
        Ok(Self {
            handle,
            path: path.to_owned(),
        })
    }

    fn symbol(&self, name: &'static str, version: &'static str) -> Result<*mut c_void, LoadError> {
        let err = |message: String| LoadError::Symbol {
            path: self.path.clone(),
            symbol: name,
            version,
            message,
        };
        let c_name = CString::new(name).map_err(|_| err("NUL in symbol name".into()))?;
        let c_version = CString::new(version).map_err(|_| err("NUL in version".into()))?;
        // SAFETY: clears any stale error so the check below sees only ours.
        unsafe { libc::dlerror() };
        #[cfg(target_env = "gnu")]
        // SAFETY: `self.handle` is a live handle from dlopen; both strings
        // are valid and NUL-terminated.
        let p = unsafe { libc::dlvsym(self.handle, c_name.as_ptr(), c_version.as_ptr()) };
        #[cfg(not(target_env = "gnu"))]
        // SAFETY: as above; without dlvsym the default version is used.
        let p = unsafe { libc::dlsym(self.handle, c_name.as_ptr()) };
        if p.is_null() {
            return Err(err(dlerror_message("resolved to NULL")));
        }
        Ok(p)
    }
}

impl Drop for Library {
    fn drop(&mut self) {
        // SAFETY: `handle` came from a successful dlopen and is closed once;
        // no pointer resolved from it outlives it (see `Verbs::load_from`).
        unsafe { libc::dlclose(self.handle) };
    }
}
