//! Stand-in registration cache (transient registrations only); replaced by
//! the real pin-down cache.
#![allow(missing_docs, dead_code)]

use std::any::Any;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::verbs::{Access, Error, MemoryRegion, ProtectionDomain, RemoteAddr, Result, Sge};

#[derive(Clone, Copy, Debug, Default)]
pub struct CacheLimits {
    pub max_idle_chunks: usize,
    pub max_idle_bytes: usize,
    pub max_pinned_bytes: usize,
}

#[derive(Clone)]
pub struct RegistrationCache {
    pd: ProtectionDomain,
    access: Access,
}

#[derive(Clone)]
pub struct Registration {
    mr: Arc<MemoryRegion<'static>>,
}

pub struct Lease {
    mr: Arc<MemoryRegion<'static>>,
}

// SAFETY: the region owns its allocation for its whole life.
unsafe impl xdev::BufferStorage for Lease {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.mr.as_mut_ptr()
    }
    fn capacity(&self) -> usize {
        self.mr.len()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl RegistrationCache {
    pub fn new(pd: &ProtectionDomain, access: Access, _limits: CacheLimits) -> Self {
        RegistrationCache {
            pd: pd.clone(),
            access,
        }
    }
    pub fn buffer(&self, len: usize) -> Result<xdev::Buffer> {
        let mr = MemoryRegion::alloc(&self.pd, len, self.access)?;
        Ok(xdev::Buffer::from_storage(
            Box::new(Lease { mr: Arc::new(mr) }),
            len,
        ))
    }
    pub fn find(&self, _ptr: *const u8, _len: usize) -> Option<Registration> {
        None
    }
    /// # Safety
    /// The range stays mapped until the registration is dropped.
    pub unsafe fn register(&self, ptr: *mut u8, len: usize) -> Result<Registration> {
        let p = NonNull::new(ptr).ok_or_else(|| Error::InvalidArgument("null".into()))?;
        // SAFETY: the caller keeps the range mapped.
        let mr = unsafe { MemoryRegion::register_raw_parts(&self.pd, p, len, self.access)? };
        Ok(Registration { mr: Arc::new(mr) })
    }
}

impl Registration {
    pub fn lkey(&self) -> u32 {
        self.mr.lkey()
    }
    pub fn rkey(&self) -> u32 {
        self.mr.rkey()
    }
    pub fn sge(&self, ptr: *const u8, len: usize) -> Sge<'_> {
        self.mr.sge(ptr as usize - self.mr.addr() as usize, len)
    }
    pub fn remote(&self, ptr: *const u8) -> RemoteAddr {
        self.mr.remote(ptr as usize - self.mr.addr() as usize)
    }
}
