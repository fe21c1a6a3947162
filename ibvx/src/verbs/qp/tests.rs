use super::*;

#[test]
fn send_flags_compose() {
    let f = SendFlags::SIGNALED | SendFlags::INLINE;
    assert!(f.contains(SendFlags::SIGNALED));
    assert!(f.contains(SendFlags::INLINE));
    assert!(!f.contains(SendFlags::SOLICITED));
    assert_eq!(
        SendFlags::NONE.with(SendFlags::INLINE, false),
        SendFlags::NONE
    );
    assert_eq!(
        SendFlags::NONE.with(SendFlags::INLINE, true),
        SendFlags::INLINE
    );
}

#[test]
fn psns_are_24_bits_and_vary() {
    let psns: std::collections::HashSet<u32> = (0..100).map(|_| random_psn()).collect();
    assert!(psns.iter().all(|&p| p <= 0xff_ffff));
    assert!(psns.len() > 90, "{} distinct PSNs of 100", psns.len());
}

#[test]
fn defaults_are_perftests() {
    let r = RtsAttr::default();
    assert_eq!((r.timeout, r.retry_cnt, r.rnr_retry), (14, 7, 7));
    assert!(InitAttr::default().access.contains(Access::REMOTE_WRITE));
}
