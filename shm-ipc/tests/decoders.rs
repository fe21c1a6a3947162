//! Property tests of what the process device decodes from peers: the
//! bootstrap record ([`PeerInfo`]) and segment names. Arbitrary or mutated
//! input must give an error or a valid value, never a panic.

use proptest::prelude::*;
use shm_ipc::process::PeerInfo;
use shm_ipc::segment::valid_ref;

fn info() -> impl Strategy<Value = PeerInfo> {
    (
        1u32..,
        2u32..20,
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
        any::<u128>(),
    )
        .prop_map(|(pid, shift, credit, addr, value, name)| PeerInfo {
            pid,
            nslots: 1 << shift,
            credit_bytes: credit,
            probe_addr: addr,
            probe_value: value,
            segment: format!("xdev-fd-{name:032x}"),
        })
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..300)) {
        if let Ok(i) = PeerInfo::decode(&b) {
            prop_assert!(valid_ref(&i.segment));
            prop_assert_eq!(i.encode(), b);
        }
    }

    #[test]
    fn valid_records_roundtrip(i in info()) {
        prop_assert_eq!(PeerInfo::decode(&i.encode()).unwrap(), i);
    }

    #[test]
    fn mutated_records_decode_to_valid_values_or_errors(
        i in info(),
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
        cut in any::<usize>(),
    ) {
        let mut b = i.encode();
        for (at, x) in flips {
            let k = at % b.len();
            b[k] ^= x;
        }
        let n = b.len();
        b.truncate(n - cut % 3);
        if let Ok(d) = PeerInfo::decode(&b) {
            prop_assert!(valid_ref(&d.segment));
            prop_assert!(d.nslots.is_power_of_two() && d.nslots >= 4 && d.pid != 0);
        }
    }

    #[test]
    fn references_other_than_an_offer_name_are_refused(s in "\\PC{0,80}") {
        let r = format!("xdev-fd-{s}");
        let ok = s.len() == 32 && s.bytes().all(|b| b.is_ascii_hexdigit());
        prop_assert_eq!(valid_ref(&r), ok);
        prop_assert!(!valid_ref(&s) || s.starts_with("xdev-fd-"));
    }
}
