use super::*;
use std::mem::{align_of, offset_of, size_of};

#[test]
fn missing_library_is_reported() {
    let err = Psm2::load_from("/nonexistent/psm-sys-test/libpsm2.so.2").unwrap_err();
    let msg = err.to_string();
    assert!(msg.starts_with("PSM2 not available: "), "{msg}");
    assert!(
        msg.contains("/nonexistent/psm-sys-test/libpsm2.so.2"),
        "{msg}"
    );
    assert!(matches!(err, LoadError::Library { .. }), "{err:?}");
}

#[test]
fn load_is_cached() {
    let first = Psm2::load().map(|p| p as *const Psm2);
    let second = Psm2::load().map(|p| p as *const Psm2);
    assert_eq!(first, second);
}

#[test]
fn mq_tag_layout() {
    // 96 bits of tag in a 16-byte, 4-aligned union (PSM2_MQ_TAG_ELEMENTS = 4).
    assert_eq!(PSM2_MQ_TAG_ELEMENTS, 4);
    assert_eq!(size_of::<psm2_mq_tag_t>(), 16);
    assert_eq!(align_of::<psm2_mq_tag_t>(), 4);
    assert_eq!(size_of::<psm2_mq_tag__bindgen_ty_1>(), 12);
    assert_eq!(offset_of!(psm2_mq_tag__bindgen_ty_1, tag0), 0);
    assert_eq!(offset_of!(psm2_mq_tag__bindgen_ty_1, tag1), 4);
    assert_eq!(offset_of!(psm2_mq_tag__bindgen_ty_1, tag2), 8);
    let tag = psm2_mq_tag_t {
        tag: [0x11, 0x22, 0x33, 0],
    };
    // SAFETY: both union views are plain u32 data over the same bytes.
    let words = unsafe { tag.__bindgen_anon_1 };
    assert_eq!((words.tag0, words.tag1, words.tag2), (0x11, 0x22, 0x33));
    // The status keeps the tag 16-byte aligned (`aligned(16)` in the header).
    assert_eq!(align_of::<psm2_mq_status2_t>(), 16);
    assert_eq!(offset_of!(psm2_mq_status2_t, msg_tag), 16);
    assert_eq!(size_of::<psm2_mq_status2_t>(), 64);
}

#[test]
fn errhandler_sentinels() {
    let value = |h: psm2_ep_errhandler_t| h.map_or(0, |f| f as usize);
    assert_eq!(value(ffi::errhandler_psm_handler()), usize::MAX);
    assert_eq!(value(ffi::errhandler_no_handler()), usize::MAX - 1);
}

#[test]
fn enums_are_newtypes() {
    assert_eq!(psm2_error::PSM2_OK.0, 0);
    assert_eq!(psm2_error::PSM2_INTERNAL_ERR.0, 8);
    assert_eq!(size_of::<psm2_error_t>(), size_of::<core::ffi::c_uint>());
}
