use super::*;

#[test]
fn vec_round_trip_keeps_address_and_bytes() {
    let v = vec![1u8, 2, 3];
    let addr = v.as_ptr();
    let b = Buffer::from(v);
    let moved = b; // moving the handle must not move the memory
    assert_eq!(moved.as_ptr(), addr);
    assert_eq!(&moved[..], &[1, 2, 3]);
    assert_eq!(moved.into_vec(), vec![1, 2, 3]);
}

struct Slab(Box<[u8; 16]>);
// SAFETY: the boxed array never moves and is owned by the Slab.
unsafe impl BufferStorage for Slab {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.0.as_mut_ptr()
    }
    fn capacity(&self) -> usize {
        16
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[test]
fn foreign_storage_is_recognisable_and_clamped() {
    let mut b = Buffer::from_storage(Box::new(Slab(Box::new([7; 16]))), 100);
    assert_eq!(b.len(), 16);
    b[0] = 9;
    assert!(b.storage().unwrap().downcast_ref::<Slab>().is_some());
    assert_eq!(b.into_vec()[..2], [9, 7]);
}

/// Sets a flag when dropped, and checks the memory it watches is still
/// there (the attachment is dropped before the memory is released).
struct Watch {
    dropped: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.dropped
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

fn watch() -> (Attachment, std::sync::Arc<std::sync::atomic::AtomicBool>) {
    let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    (
        Box::new(Watch {
            dropped: flag.clone(),
        }),
        flag,
    )
}

#[test]
fn identities_are_unique_and_follow_the_allocation() {
    let a = Buffer::zeroed(8);
    let b = Buffer::zeroed(8);
    assert_ne!(a.id(), b.id());
    let id = a.id();
    let moved = a;
    assert_eq!(moved.id(), id, "moving the handle keeps the identity");
    // A new buffer over the same Vec allocation is a new identity.
    let v = moved.into_vec();
    let again = Buffer::from(v);
    assert_ne!(again.id(), id);
}

#[test]
fn the_attachment_is_dropped_with_the_buffer_or_by_into_vec() {
    let seen = std::sync::atomic::Ordering::SeqCst;
    let (tok, flag) = watch();
    let mut b = Buffer::zeroed(4);
    b.attach(tok);
    assert!(b.attachment().is_some_and(|a| a.is::<Watch>()));
    drop(b);
    assert!(flag.load(seen), "dropped with the buffer");

    let (tok, flag) = watch();
    let mut b = Buffer::from(vec![1, 2, 3]);
    b.attach(tok);
    assert_eq!(b.into_vec(), vec![1, 2, 3]);
    assert!(flag.load(seen), "dropped by into_vec");

    let (tok, flag) = watch();
    let mut b = Buffer::from_storage(Box::new(Slab(Box::new([7; 16]))), 4);
    b.attach(tok);
    let (tok2, flag2) = watch();
    b.attach(tok2);
    assert!(flag.load(seen), "replaced attachments are dropped");
    assert!(!flag2.load(seen));
    assert_eq!(b.into_vec(), vec![7; 4]);
    assert!(flag2.load(seen));
}

#[test]
fn a_buffer_handle_is_two_words() {
    // Passed by value in two registers (see `Buffer::tail`), and `None`
    // costs no third word.
    let word = std::mem::size_of::<usize>();
    assert_eq!(std::mem::size_of::<Buffer>(), 2 * word);
    assert_eq!(std::mem::size_of::<Option<Buffer>>(), 2 * word);
}

#[test]
fn a_vec_with_spare_capacity_comes_back_whole() {
    let mut v = Vec::with_capacity(64);
    v.extend_from_slice(&[4u8, 5, 6]);
    let addr = v.as_ptr();
    let mut b = Buffer::from(v);
    assert_eq!(b.len(), 3);
    let (tok, flag) = watch();
    b.attach(tok);
    let v = b.into_vec();
    assert!(flag.load(std::sync::atomic::Ordering::SeqCst));
    assert_eq!(v.as_ptr(), addr, "the same allocation");
    assert_eq!(v.capacity(), 64, "with its capacity");
    assert_eq!(v, [4, 5, 6]);
    // Dropped with spare capacity and no attachment: freed as allocated
    // (Miri or a sanitizer would flag a wrong layout).
    let mut w = Vec::with_capacity(32);
    w.push(1u8);
    drop(Buffer::from(w));
    drop(Buffer::from(Vec::new()));
    assert!(Buffer::from(Vec::new()).into_vec().is_empty());
}

#[test]
fn a_page_aligned_buffer_starts_on_a_page_and_is_zeroed() {
    for len in [1usize, 100, 4096, 4097, 1 << 20] {
        let mut b = Buffer::zeroed_page_aligned(len);
        assert_eq!(b.len(), len);
        assert_eq!(b.as_ptr() as usize % crate::PageAligned::PAGE, 0, "{len}");
        assert!(b.iter().all(|&x| x == 0), "{len}: zero-filled");
        b[len - 1] = 7;
        assert!(b.storage().is_some_and(|s| s.is::<crate::PageAligned>()));
        assert_eq!(b.into_vec().last(), Some(&7));
    }
    let empty = Buffer::zeroed_page_aligned(0);
    assert!(empty.is_empty());
}
