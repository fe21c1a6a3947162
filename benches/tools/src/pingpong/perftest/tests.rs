use super::*;
use ibvx::verbs::Mtu;
use proptest::prelude::*;

/// A key message captured from `ib_send_lat` 6.06 on rxe0.
const CAPTURED: &str = "0000:0001:000011:f90b5d:00000000:000055b02cab2000:00:00:00:00:00:00:00:00:00:00:ff:ff:0a:4d:00:01:00000000:";

#[test]
fn decodes_a_captured_perftest_message() {
    let mut msg = CAPTURED.as_bytes().to_vec();
    msg.resize(KEY_MSG_SIZE_GID, 0);
    let k = KeyMsg::decode(&msg, true).unwrap();
    assert_eq!((k.lid, k.out_reads, k.qpn, k.psn), (0, 1, 0x11, 0xf90b5d));
    assert_eq!((k.rkey, k.vaddr, k.srqn), (0, 0x55b0_2cab_2000, 0));
    assert_eq!(k.gid.unwrap()[10..], [0xff, 0xff, 10, 77, 0, 1]);
    // and encodes to the same bytes
    assert_eq!(k.encode(), msg);
}

#[test]
fn key_messages_have_perftests_lengths() {
    let k = KeyMsg {
        lid: 0xffff,
        out_reads: 16,
        qpn: 0xff_ffff,
        psn: 0xff_ffff,
        rkey: u32::MAX,
        vaddr: u64::MAX,
        gid: Some([0xab; 16]),
        srqn: u32::MAX,
    };
    assert_eq!(k.encode().len(), KEY_MSG_SIZE_GID);
    assert_eq!(KeyMsg::decode(&k.encode(), true), Ok(k));
    let k = KeyMsg { gid: None, ..k };
    assert_eq!(k.encode().len(), KEY_MSG_SIZE);
    assert_eq!(*k.encode().last().unwrap(), 0);
    assert_eq!(KeyMsg::decode(&k.encode(), false), Ok(k));
    assert!(KeyMsg::decode(&k.encode(), true).is_err());
}

#[test]
fn versions_and_mtus() {
    let v = version_msg();
    assert_eq!(&v[..5], b"6.06\0");
    assert_eq!(parse_version(&v), Some(6.06));
    assert_eq!(parse_version(b"5.70\0\0"), Some(5.70));
    assert_eq!(parse_version(&super::super::wire::MAGIC), None);
    assert_eq!(mtu_msg(Mtu::Mtu1024), *b"3\0");
    assert_eq!(parse_mtu(b"3\0"), Some(Mtu::Mtu1024));
    assert_eq!(parse_mtu(b"9\0"), None);
    assert_eq!(parse_mtu(b"\0\0"), None);
}

#[test]
fn bw_report_fields_match_a_capture() {
    // From ib_write_bw 6.06: 65536 bytes, 20 iterations, then the doubles.
    let f = [
        0x0000_0000_0001_0000u64.to_be_bytes(),
        0x14u64.to_be_bytes(),
        0x4049_948c_58be_a9b1u64.to_be_bytes(),
        0x4048_94e7_2fbd_f39du64.to_be_bytes(),
        0x3f49_c696_4e46_3c93u64.to_be_bytes(),
    ];
    let r = PerftestBwReport::from_fields(&f);
    assert_eq!((r.size, r.iters), (65536, 20));
    assert!((r.bw_peak - 51.16).abs() < 0.01, "{}", r.bw_peak);
    assert!((r.bw_avg - 49.16).abs() < 0.01, "{}", r.bw_avg);
    assert!((r.msg_rate - 0.000787).abs() < 1e-6, "{}", r.msg_rate);
    assert_eq!(r.fields(), f);
}

proptest! {
    #[test]
    fn random_bytes_never_panic_the_key_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..130), gid: bool) {
        let _ = KeyMsg::decode(&bytes, gid);
        let _ = parse_version(&bytes);
    }

    #[test]
    fn colon_heavy_text_never_panics(s in "[0-9a-fx:]{0,120}", gid: bool) {
        let _ = KeyMsg::decode(s.as_bytes(), gid);
    }

    #[test]
    fn key_messages_round_trip(lid: u16, qpn in 0u32..0x100_0000, psn in 0u32..0x100_0000,
                               rkey: u32, vaddr: u64, gid: Option<[u8; 16]>, srqn: u32) {
        let k = KeyMsg { lid: u32::from(lid), out_reads: 1, qpn, psn, rkey, vaddr, gid, srqn };
        let bytes = k.encode();
        prop_assert_eq!(bytes.len(), KeyMsg::len(gid.is_some()));
        prop_assert_eq!(KeyMsg::decode(&bytes, gid.is_some()), Ok(k));
    }
}
