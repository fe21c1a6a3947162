//! [`Buffer`]: the owned memory that non-blocking operations take and give back.

use std::any::Any;
use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::request::Carry;

pub mod aligned;
mod huge;
pub(crate) mod shared;

/// Memory a [`Buffer`] can own besides a `Vec<u8>`, such as a slab a device
/// leases out of a pre-registered pool.
///
/// # Safety
/// Implementors guarantee that [`as_mut_ptr`](BufferStorage::as_mut_ptr)
/// returns the same non-null pointer for the whole life of the object, valid
/// for reads and writes of [`capacity`](BufferStorage::capacity) bytes, not
/// aliased by anything else while the storage lives, and that the memory is
/// not freed or moved before the object is dropped.
pub unsafe trait BufferStorage: Send + Sync + 'static {
    /// Start of the memory.
    fn as_mut_ptr(&mut self) -> *mut u8;
    /// Usable bytes.
    fn capacity(&self) -> usize;
    /// The storage as `Any`, so that the device that leased it can recognise
    /// it (for example to find its memory registration).
    fn as_any(&self) -> &dyn Any;
}

/// The identity of the allocation a [`Buffer`] holds: unique in the process
/// and never reused (a 64-bit counter), fixed for the buffer's life.
///
/// Two buffers with the same identity are the same allocation, held by one
/// `Buffer` whose memory has not been released in between: a device may key
/// what it knows about the memory (a NIC registration) by it.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufferId(u64);

impl BufferId {
    /// The number behind the identity.
    pub fn get(self) -> u64 {
        self.0
    }
}

/// The next buffer identity (0 is never handed out).
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn next_id() -> BufferId {
    BufferId(NEXT_ID.fetch_add(1, Ordering::Relaxed))
}

/// Something a device attached to a buffer's allocation
/// ([`Buffer::attach`]).
pub type Attachment = Box<dyn Any + Send + Sync>;

/// An owned byte buffer, handed to a device by `isend`/`irecv` and returned
/// by the completed request.
///
/// While a request holds it, no safe code can reach it: the device is the only
/// owner. The memory never moves while owned (moving a `Buffer` moves only its
/// handle), so a device may keep its address for the lifetime of a request.
///
/// Each buffer has an [identity](Buffer::id) and may carry one
/// [attachment](Buffer::attach), which is dropped *before* the memory is
/// released (the buffer dropped, or its `Vec` taken back by
/// [`into_vec`](Buffer::into_vec)): a device that keeps the memory
/// registered between operations attaches a token whose drop ends that
/// registration, so no registration outlives the allocation it names.
///
/// Making a buffer allocates its small tail (one allocation besides the
/// memory); moving, sending and receiving it allocate nothing, so a caller
/// that reuses its buffers allocates nothing per message.
pub struct Buffer {
    ptr: NonNull<u8>,
    /// Everything but the address, out of line, so that the handle is two
    /// words: a call that takes or returns a `Buffer` by value passes it in
    /// two registers. A handle of more words goes through memory, and a
    /// send's caller then writes it just before the device reads it back:
    /// the read waits for every store before it to reach the cache,
    /// including the previous message's ring slot, whose line the receiving
    /// core holds (a profile of the 8-byte rate found 77% of `isend`'s
    /// samples on that one load). The tail is made once per buffer, and
    /// never touched by a move.
    tail: Box<Tail>,
}

/// The out-of-line part of a [`Buffer`]: its length, identity, and what a
/// plain heap buffer does not need.
struct Tail {
    len: usize,
    id: BufferId,
    /// A heap buffer's `Vec` capacity (when `storage` is `None`).
    heap_cap: usize,
    /// Foreign memory; `None` for a heap buffer.
    storage: Option<Box<dyn BufferStorage>>,
    /// Dropped before the memory is released (see [`Buffer::attach`]).
    attachment: Option<Attachment>,
    /// The request whose handle holds this buffer, if any (see
    /// `request::carry`).
    carry: Carry,
}

// SAFETY: a Buffer owns its memory exclusively (a Vec's allocation or a
// BufferStorage, which is itself Send + Sync); the raw pointer is only an
// address into that memory. Its tail's carry holds a pointer to a `Lender`
// (Send + Sync), used only for `&self` calls by the request that holds
// the buffer.
unsafe impl Send for Buffer {}
// SAFETY: shared access only hands out `&[u8]`, as `Vec<u8>` does.
unsafe impl Sync for Buffer {}

impl Buffer {
    /// A zero-filled heap buffer of `len` bytes.
    pub fn zeroed(len: usize) -> Self {
        Buffer::from(vec![0u8; len])
    }

    /// A zero-filled buffer of `len` bytes that starts on a page boundary
    /// (its storage is [`PageAligned`](crate::PageAligned)): what OSU's
    /// benchmarks use, and what a copy between processes or by a NIC runs
    /// fastest on when both ends are aligned alike. From 256 KiB up it is
    /// backed by 2 MiB huge pages where the system gives them (see
    /// [`PageAligned`](crate::PageAligned)).
    pub fn zeroed_page_aligned(len: usize) -> Self {
        Buffer::from_storage(Box::new(aligned::PageAligned::zeroed(len)), len)
    }

    /// Wraps foreign storage; the buffer's length is `len`, at most the
    /// storage's capacity.
    pub fn from_storage(mut storage: Box<dyn BufferStorage>, len: usize) -> Self {
        let len = len.min(storage.capacity());
        let ptr = NonNull::new(storage.as_mut_ptr()).unwrap_or(NonNull::dangling());
        Buffer {
            ptr,
            tail: Box::new(Tail {
                len,
                id: next_id(),
                heap_cap: 0,
                storage: Some(storage),
                attachment: None,
                carry: Carry::new(),
            }),
        }
    }

    /// Length in bytes: what a send sends and what a receive accepts.
    pub fn len(&self) -> usize {
        self.tail.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.tail.len == 0
    }

    /// Start address, stable for the buffer's life (for devices that copy or
    /// register it while they own it).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Start address for writing, stable for the buffer's life.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The foreign storage, if this buffer was built by
    /// [`from_storage`](Buffer::from_storage).
    pub fn storage(&self) -> Option<&dyn Any> {
        Some(self.tail.storage.as_ref()?.as_any())
    }

    /// The identity of this buffer's allocation (see [`BufferId`]).
    pub fn id(&self) -> BufferId {
        self.tail.id
    }

    /// Attaches `token` to this buffer's allocation, dropping any earlier
    /// attachment. The token is dropped just before the memory is released
    /// (when the buffer is dropped or [`into_vec`](Buffer::into_vec) is
    /// called), or when another `attach` replaces it; a leaked buffer
    /// (`mem::forget`) never releases its memory and keeps its token.
    pub fn attach(&mut self, token: Attachment) {
        self.tail.attachment = Some(token);
    }

    /// The attachment, if any (a device downcasts it to recognise its own).
    pub fn attachment(&self) -> Option<&(dyn Any + Send + Sync)> {
        self.tail.attachment.as_deref()
    }

    /// The buffer as its two words, its memory and tail still owned (for
    /// a request's two words: see `request/handle.rs`);
    /// [`from_raw_parts`](Buffer::from_raw_parts) takes it back.
    #[inline(always)]
    pub(crate) fn into_raw_parts(self) -> (NonNull<u8>, NonNull<()>) {
        let me = std::mem::ManuallyDrop::new(self);
        // SAFETY: `me` is never dropped, so the tail is moved out once.
        let tail = unsafe { std::ptr::read(&me.tail) };
        // SAFETY: `Box::into_raw` never gives null.
        let tail = unsafe { NonNull::new_unchecked(Box::into_raw(tail)) };
        (me.ptr, tail.cast())
    }

    /// The buffer [`into_raw_parts`](Buffer::into_raw_parts) gave as
    /// `(ptr, tail)`.
    ///
    /// # Safety
    /// The parts came from `into_raw_parts`, and each pair is taken back
    /// once (or viewed without being dropped).
    #[inline(always)]
    pub(crate) unsafe fn from_raw_parts(ptr: NonNull<u8>, tail: NonNull<()>) -> Self {
        Buffer {
            ptr,
            // SAFETY: the caller's contract: the tail `into_raw_parts`
            // gave out of its box.
            tail: unsafe { Box::from_raw(tail.cast::<Tail>().as_ptr()) },
        }
    }

    /// What the request that holds this buffer in its handle keeps here.
    #[inline(always)]
    pub(crate) fn carry(&self) -> &Carry {
        &self.tail.carry
    }

    /// [`carry`](Buffer::carry), to write.
    #[inline(always)]
    pub(crate) fn carry_mut(&mut self) -> &mut Carry {
        &mut self.tail.carry
    }

    /// The bytes as a `Vec` (free for heap buffers, a copy for foreign ones).
    /// The attachment is dropped first, while the memory is still held.
    pub fn into_vec(self) -> Vec<u8> {
        let me = std::mem::ManuallyDrop::new(self);
        // SAFETY: `me` is never dropped, so its tail is moved out (and
        // dropped at the end of this call) exactly once, here.
        let mut tail = unsafe { std::ptr::read(&me.tail) };
        match tail.release() {
            // SAFETY: `ptr`, `len` and `cap` are the raw parts of the Vec
            // this heap buffer took in `From<Vec<u8>>`, whose allocation
            // nothing else owns; `me` is never dropped, so the Vec is
            // rebuilt exactly once.
            Ok(cap) => unsafe { Vec::from_raw_parts(me.ptr.as_ptr(), tail.len, cap) },
            Err(foreign) => {
                // SAFETY: the storage, still held, is valid for `len` bytes
                // at `ptr` (the `BufferStorage` contract).
                let bytes = unsafe { std::slice::from_raw_parts(me.ptr.as_ptr(), tail.len) };
                let copy = bytes.to_vec();
                drop(foreign); // releases the foreign memory
                copy
            }
        }
    }
}

impl Tail {
    /// Takes the foreign parts out, the attachment dropped first (while
    /// the memory is still held): `Ok` with the `Vec` capacity of a heap
    /// buffer, or `Err` with the foreign storage, still holding the memory
    /// until the caller drops it.
    fn release(&mut self) -> Result<usize, Box<dyn BufferStorage>> {
        drop(self.attachment.take());
        match self.storage.take() {
            Some(storage) => Err(storage),
            None => Ok(self.heap_cap),
        }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // A foreign buffer's memory is released with its storage, dropped
        // here with the `Err`.
        if let Ok(cap) = self.tail.release() {
            // SAFETY: as in `into_vec`: the raw parts of the Vec this heap
            // buffer owns, rebuilt once, here, to free it.
            drop(unsafe { Vec::from_raw_parts(self.ptr.as_ptr(), self.tail.len, cap) });
        }
    }
}

impl From<Vec<u8>> for Buffer {
    fn from(v: Vec<u8>) -> Self {
        // The Vec's raw parts: its heap pointer does not change while the
        // Buffer holds it (the Buffer never grows or shrinks it), and `Drop`
        // or `into_vec` rebuild the Vec from them.
        let mut v = std::mem::ManuallyDrop::new(v);
        let (len, cap) = (v.len(), v.capacity());
        let ptr = NonNull::new(v.as_mut_ptr()).unwrap_or(NonNull::dangling());
        Buffer {
            ptr,
            tail: Box::new(Tail {
                len,
                id: next_id(),
                heap_cap: cap,
                storage: None,
                attachment: None,
                carry: Carry::new(),
            }),
        }
    }
}

impl From<&[u8]> for Buffer {
    fn from(s: &[u8]) -> Self {
        Buffer::from(s.to_vec())
    }
}

impl std::ops::Deref for Buffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` bytes this buffer owns (a Vec's
        // allocation, or a BufferStorage by its contract), or dangling
        // with len 0.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.tail.len) }
    }
}

impl std::ops::DerefMut for Buffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` proves exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.tail.len) }
    }
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer")
            .field("len", &self.tail.len)
            .field("id", &self.tail.id.0)
            .field("foreign", &self.storage().is_some())
            .finish()
    }
}

#[cfg(test)]
mod tests;
