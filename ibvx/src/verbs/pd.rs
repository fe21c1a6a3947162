//! Protection domains.

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use ibvx_sys as sys;

use super::device::Context;
use super::error::{Error, Result};

/// A protection domain (`ibv_pd`). Cheap to clone (reference counted).
/// Memory regions and queue pairs hold a clone, so the domain is
/// deallocated only after all of them, and it keeps its [`Context`] open.
#[derive(Clone)]
pub struct ProtectionDomain {
    inner: Arc<PdInner>,
}

struct PdInner {
    raw: NonNull<sys::ibv_pd>,
    // Declared after `raw`; dropped after `PdInner::drop` deallocates.
    ctx: Context,
}

// SAFETY: an ibv_pd may be used from any thread; the fields are immutable.
unsafe impl Send for PdInner {}
// SAFETY: as above; only thread-safe verbs are called through `&self`.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: allocated by ibv_alloc_pd and deallocated once; every MR
        // and QP of this domain holds a clone, so none is left.
        unsafe { (self.ctx.verbs().ibv_dealloc_pd)(self.raw.as_ptr()) };
    }
}

impl fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProtectionDomain")
            .field("device", &self.inner.ctx.name())
            .finish_non_exhaustive()
    }
}

impl ProtectionDomain {
    /// Allocates a protection domain on `ctx`.
    pub fn new(ctx: &Context) -> Result<ProtectionDomain> {
        // SAFETY: live context.
        let raw = unsafe { (ctx.verbs().ibv_alloc_pd)(ctx.as_raw()) };
        let raw = NonNull::new(raw).ok_or_else(|| Error::last_os("ibv_alloc_pd"))?;
        Ok(ProtectionDomain {
            inner: Arc::new(PdInner {
                raw,
                ctx: ctx.clone(),
            }),
        })
    }

    /// The device context.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// The raw `ibv_pd`, valid while this domain (or a clone) lives.
    pub fn as_raw(&self) -> *mut sys::ibv_pd {
        self.inner.raw.as_ptr()
    }
}
