use super::*;
use proptest::prelude::*;

fn hello() -> Hello {
    Hello {
        test: TestKind::WriteLat,
        all: false,
        check: true,
        size: 64,
        iters: 1000,
        mtu_requested: 0,
        mtu_active: 1024,
        window: 1,
        endpoint: Endpoint {
            lid: 0,
            qpn: 0x11,
            psn: 0xabcdef,
            gid: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 77, 0, 1],
            rkey: 0x1234,
            addr: 0x7f00_0000_1000,
            len: 128,
        },
    }
}

#[test]
fn frames_round_trip() {
    let msgs = [
        Message::Hello(hello()),
        Message::Reject("options differ: size".into()),
        Message::Sync(7),
        Message::BwReport(BwReport {
            size: 1 << 20,
            iters: 300,
            peak: 75.5,
            avg: 70.25,
            msg_rate: 0.00007,
        }),
        Message::Bye,
    ];
    let mut stream = Vec::new();
    for m in &msgs {
        stream.extend(m.encode());
    }
    let mut at = 0;
    for m in &msgs {
        let (got, used) = Message::decode(&stream[at..]).unwrap();
        assert_eq!(&got, m);
        at += used;
    }
    assert_eq!(at, stream.len());
    assert_eq!(
        Message::Hello(hello()).encode().len(),
        HEADER_LEN + HELLO_LEN
    );
}

#[test]
fn bad_frames_are_refused() {
    assert_eq!(Message::decode(&[]), Err(WireError::Incomplete));
    assert_eq!(Message::decode(&[9, 0, 0, 0, 0]), Err(WireError::Kind(9)));
    assert_eq!(
        Message::decode(&[SYNC, 0, 0, 0, 5, 0, 0, 0, 0, 0]),
        Err(WireError::Length { kind: SYNC, len: 5 })
    );
    assert_eq!(
        Message::decode(&[SYNC, 0, 0, 0, 4, 0]),
        Err(WireError::Incomplete)
    );
    let mut h = Message::Hello(hello()).encode();
    h[HEADER_LEN] = 0; // test code
    assert_eq!(Message::decode(&h), Err(WireError::Field("test")));
    let mut r = Message::Reject("x".into()).encode();
    r[HEADER_LEN] = 0xff;
    assert_eq!(Message::decode(&r), Err(WireError::Field("reason")));
    // The magic is not a frame.
    assert!(Message::decode(&MAGIC).is_err());
}

#[test]
fn long_reasons_are_cut_at_a_char_boundary() {
    let long = "é".repeat(MAX_REASON);
    let (m, _) = Message::decode(&Message::Reject(long).encode()).unwrap();
    let Message::Reject(s) = m else { panic!() };
    assert!(s.len() <= MAX_REASON && s.chars().all(|c| c == 'é'));
}

#[test]
fn mismatches_are_named() {
    let s = hello();
    assert_eq!(mismatch(&s, &s), None);
    let mut c = s;
    c.endpoint.qpn = 0x99; // endpoints may differ
    c.window = 128;
    assert_eq!(mismatch(&s, &c), None);
    c.size = 128;
    c.test = TestKind::SendLat;
    c.mtu_requested = 2048;
    let m = mismatch(&s, &c).unwrap();
    assert!(m.contains("test: server write_lat, client send_lat"), "{m}");
    assert!(m.contains("size: server 64, client 128"), "{m}");
    assert!(m.contains("mtu: server port default, client 2048"), "{m}");
    assert!(!m.contains("iterations"), "{m}");
    c = s;
    c.all = true;
    c.check = false;
    c.iters = 5;
    let m = mismatch(&s, &c).unwrap();
    assert!(m.contains("size: server 64, client --all"), "{m}");
    assert!(m.contains("iterations: server 1000, client 5"), "{m}");
    assert!(m.contains("data check (-c): server on, client off"), "{m}");
}

proptest! {
    #[test]
    fn random_bytes_never_panic_the_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = Message::decode(&bytes);
        if bytes.len() >= HEADER_LEN {
            let _ = Message::decode_payload(bytes[0], &bytes[HEADER_LEN..]);
        }
    }

    #[test]
    fn random_payloads_of_valid_headers_never_panic(kind in 0u8..8, payload in proptest::collection::vec(any::<u8>(), 0..120)) {
        let mut frame = vec![kind];
        frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        frame.extend_from_slice(&payload);
        if let Ok((m, used)) = Message::decode(&frame) {
            prop_assert_eq!(used, frame.len());
            // Whatever decodes re-encodes to the same bytes (floats bitwise).
            prop_assert_eq!(m.encode(), frame);
        }
    }

    #[test]
    fn hellos_round_trip(test in 1u8..4, flags in 0u8..4, size: u64, iters: u64, mreq: u16, mact: u16,
                         window: u32, lid: u16, qpn in 0u32..0x100_0000, psn in 0u32..0x100_0000,
                         gid: [u8; 16], rkey: u32, addr: u64, len: u64) {
        let h = Hello {
            test: TestKind::from_code(test).unwrap(),
            all: flags & 1 != 0,
            check: flags & 2 != 0,
            size, iters, mtu_requested: mreq, mtu_active: mact, window,
            endpoint: Endpoint { lid, qpn, psn, gid, rkey, addr, len },
        };
        let bytes = Message::Hello(h).encode();
        prop_assert_eq!(Message::decode(&bytes), Ok((Message::Hello(h), bytes.len())));
    }
}
