//! Property tests of what the process device decodes from peers: the
//! bootstrap record ([`PeerInfo`]) and segment names. Arbitrary or mutated
//! input must give an error or a valid value, never a panic.

use proptest::prelude::*;
use shm_ipc::process::PeerInfo;
use shm_ipc::segment::valid_name;

fn info() -> impl Strategy<Value = PeerInfo> {
    (
        1u32..,
        2u32..20,
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
        "[a-zA-Z0-9_-]{1,150}",
    )
        .prop_map(|(pid, shift, credit, addr, value, name)| PeerInfo {
            pid,
            nslots: 1 << shift,
            credit_bytes: credit,
            probe_addr: addr,
            probe_value: value,
            segment: format!("/xdev-{name}"),
        })
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..300)) {
        if let Ok(i) = PeerInfo::decode(&b) {
            prop_assert!(valid_name(&i.segment));
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
            prop_assert!(valid_name(&d.segment));
            prop_assert!(d.nslots.is_power_of_two() && d.nslots >= 4 && d.pid != 0);
        }
    }

    #[test]
    fn names_with_anything_but_the_alphabet_are_refused(s in "\\PC{0,80}") {
        let name = format!("/xdev-{s}");
        let ok = !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        prop_assert_eq!(valid_name(&name), ok);
    }
}
