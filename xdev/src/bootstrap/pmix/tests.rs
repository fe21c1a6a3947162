use super::*;

#[test]
fn info_flags_are_laid_out_as_in_pmix() {
    let i = PmixInfo::flag("pmix.collect", true);
    assert_eq!(cstr_field(&i.key), "pmix.collect");
    assert_eq!(i.value.kind, PMIX_BOOL);
    // The bool is the first byte of the union, at offset 8 of the value.
    // SAFETY: reading the bytes of a plain repr(C) struct.
    let bytes: &[u8] =
        unsafe { std::slice::from_raw_parts((&i.value as *const PmixValue).cast(), 32) };
    assert_eq!(bytes[8], 1);
    assert_eq!(std::mem::offset_of!(PmixInfo, value), 520);
    assert_eq!(std::mem::offset_of!(PmixInfo, flags), 512);
    assert_eq!(std::mem::offset_of!(PmixValue, data), 8);
}

/// Issue 21: a key several ranks put does not quietly resolve to the
/// lowest rank's value.
#[test]
fn a_key_put_by_several_ranks_is_ambiguous() {
    assert_eq!(only_one("k", vec![]).unwrap(), None);
    assert_eq!(
        only_one("k", vec![(2, b"v".to_vec())]).unwrap(),
        Some(b"v".to_vec())
    );
    assert_eq!(
        only_one("k", vec![(0, b"v".to_vec()), (3, b"v".to_vec())]).unwrap(),
        Some(b"v".to_vec()),
        "the same value from two ranks is one answer"
    );
    match only_one("k", vec![(0, b"forged".to_vec()), (1, b"real".to_vec())]) {
        Err(Error::Protocol { rank: 1, what }) => {
            assert!(
                what.contains("\"k\"") && what.contains("ranks 0 and 1"),
                "{what}"
            )
        }
        other => panic!("expected an ambiguity error, got {other:?}"),
    }
}

#[test]
fn a_missing_library_is_a_clear_error() {
    match Api::load_from("/nonexistent/libpmix.so.2") {
        Err(Error::Config(m)) => {
            assert!(m.starts_with("PMIx not available: "), "{m}");
            assert!(m.contains("/nonexistent/libpmix.so.2"), "{m}");
        }
        _ => panic!("expected PMIx not available"),
    }
}
