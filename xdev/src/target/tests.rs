use super::*;

#[test]
fn blocking_send_reports_its_outcome_once_done() {
    let tracker = Tracker::new();
    let env = Envelope {
        source: 1,
        tag: 2,
        context: 3,
    };
    let ok = BlockingSend::new();
    assert!(!ok.is_done());
    SendOwner::Blocking(ok.clone()).complete(&tracker, env, 8, Ok(()));
    assert!(ok.is_done());
    assert!(ok.outcome().is_ok());
    let failed = BlockingSend::new();
    SendOwner::Blocking(failed.clone()).complete(&tracker, env, 8, Err(lost(1, "gone")));
    assert!(failed.is_done());
    assert!(matches!(
        failed.outcome(),
        Err(Error::PeerLost { rank: 1, .. })
    ));
}
