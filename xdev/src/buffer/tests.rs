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
