//! The wire-up record's encoding and its checks.

use proptest::prelude::*;

use super::PeerRecord;
use crate::verbs::{Gid, Mtu};

fn record(n: usize) -> PeerRecord {
    PeerRecord {
        lid: 7,
        mtu: Mtu::from_bytes(1024).unwrap(),
        gid: Some(Gid([9; 16])),
        eager_limit: 8192,
        recv_depth: 64,
        eager_window: 1 << 20,
        qps: (0..n as u32).map(|i| (i + 100, i * 3)).collect(),
    }
}

#[test]
fn record_round_trip_and_rejects() {
    let r = record(3);
    let b = r.encode();
    assert_eq!(PeerRecord::decode(&b, 3).unwrap(), r);
    assert!(PeerRecord::decode(&b, 4).unwrap_err().contains("3 ranks"));
    assert!(PeerRecord::decode(&b[..b.len() - 1], 3).is_err());
    let mut bad = b.clone();
    bad[0] = b'X';
    assert!(PeerRecord::decode(&bad, 3).is_err());
    let mut bad = b.clone();
    bad[14] = 7;
    assert!(PeerRecord::decode(&bad, 3)
        .unwrap_err()
        .contains("GID flag"));
    let mut bad = b;
    bad[10] = 99;
    assert!(PeerRecord::decode(&bad, 3).unwrap_err().contains("MTU"));
}

proptest! {
    #[test]
    fn record_decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..120), n in 0usize..6) {
        if let Ok(r) = PeerRecord::decode(&bytes, n) {
            prop_assert_eq!(r.qps.len(), n);
            prop_assert_eq!(r.encode(), bytes);
        }
    }
}
