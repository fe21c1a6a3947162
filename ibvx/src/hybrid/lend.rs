//! Blocking calls over requests: the caller's buffer lent to a request the
//! call waits for.

use std::any::Any;

use xdev::{Buffer, BufferStorage, Request, Result, Status};

/// The caller's buffer of a blocking send or receive, lent to a request
/// that the call waits for before it returns.
struct Lent {
    ptr: *mut u8,
    len: usize,
}

impl Lent {
    /// A buffer over `len` bytes at `ptr`, owned by the caller.
    ///
    /// # Safety
    /// The memory must stay valid, and untouched by anyone but the device,
    /// until the request given the buffer has completed and the buffer is
    /// dropped; the caller must not return (nor unwind) before then. For a
    /// send the memory may be shared (devices only read a send's buffer).
    unsafe fn buffer(ptr: *mut u8, len: usize) -> Buffer {
        Buffer::from_storage(Box::new(Lent { ptr, len }), len)
    }
}

// SAFETY: `Lent` is only an address range into memory borrowed for the
// whole call that created it (see `Lent::buffer`).
unsafe impl Send for Lent {}
// SAFETY: as above; `Lent` hands out no references itself.
unsafe impl Sync for Lent {}

// SAFETY: `ptr` is the start of `len` bytes that outlive this object: only
// `Lent::buffer` creates it, whose contract is that the caller waits for the
// request that owns the buffer (aborting rather than unwinding before then,
// see `AbortIfLent`). A receive's memory is an exclusive borrow; a send's may
// be shared, and devices only read it.
unsafe impl BufferStorage for Lent {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }

    fn capacity(&self) -> usize {
        self.len
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Aborts the process if dropped while armed: a blocking call that unwinds
/// (a panic inside a device) before its request completed cannot give the
/// caller back memory a device may still use.
struct AbortIfLent(bool);

impl Drop for AbortIfLent {
    fn drop(&mut self) {
        if self.0 {
            tracing::error!("hybrid: a blocking call unwound with its buffer still lent; aborting");
            std::process::abort();
        }
    }
}

/// Lends `len` bytes at `ptr` to the request `start` makes, waits for it,
/// and returns its status (its error, if any, as the error).
///
/// # Safety
/// As [`Lent::buffer`]: the memory is the caller's for the whole call, and
/// exclusively so unless the request is a send.
pub(super) unsafe fn lend_and_wait(
    ptr: *mut u8,
    len: usize,
    start: impl FnOnce(Buffer) -> Request,
) -> Result<Status> {
    // SAFETY: this function returns only after the request completed and its
    // buffer was dropped, and aborts instead of unwinding before that.
    let lent = unsafe { Lent::buffer(ptr, len) };
    let mut armed = AbortIfLent(true);
    let c = start(lent).wait();
    drop(c.buf);
    armed.0 = false;
    c.status.into_result()
}
