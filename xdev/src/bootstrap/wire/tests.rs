use super::*;

#[test]
fn roundtrip_and_limits() {
    let m = Message::Put {
        id: 3,
        key: "k".into(),
        value: vec![1, 2, 3],
    };
    let frame = encode(&m).unwrap();
    let got = read_message(&mut &frame[..], MAX_FRAME_LEN, 0).unwrap();
    assert_eq!(got, Some(m));
    let long_key = Message::Get {
        id: 0,
        key: "x".repeat(MAX_KEY_LEN + 1),
    };
    assert!(matches!(encode(&long_key), Err(Error::Config(_))));
    let big = Message::Value {
        id: 0,
        value: vec![0; MAX_VALUE_LEN + 1],
    };
    assert!(matches!(encode(&big), Err(Error::ResourceExhausted(_))));
    let long_text = Message::Refused {
        reason: "é".repeat(MAX_TEXT_LEN),
    };
    let frame = encode(&long_text).unwrap();
    match read_message(&mut &frame[..], MAX_FRAME_LEN, 0).unwrap() {
        Some(Message::Refused { reason }) => assert!(reason.len() <= MAX_TEXT_LEN),
        other => panic!("{other:?}"),
    }
}

#[test]
fn rejects_bad_frames() {
    let oversize = ((MAX_FRAME_LEN + 1) as u32).to_le_bytes();
    assert!(matches!(
        read_message(&mut &oversize[..], MAX_FRAME_LEN, 7),
        Err(Error::Protocol { rank: 7, .. })
    ));
    let unknown = [1, 0, 0, 0, 0xee];
    assert!(read_message(&mut &unknown[..], MAX_FRAME_LEN, 0).is_err());
    let bad_bool = [6, 0, 0, 0, op::DEPARTED, 0, 0, 0, 0, 2];
    assert!(read_message(&mut &bad_bool[..], MAX_FRAME_LEN, 0).is_err());
    let trailing = [6, 0, 0, 0, op::CANCEL, 0, 0, 0, 0, 0];
    assert!(read_message(&mut &trailing[..], MAX_FRAME_LEN, 0).is_err());
    let empty: [u8; 0] = [];
    assert_eq!(
        read_message(&mut &empty[..], MAX_FRAME_LEN, 0).unwrap(),
        None
    );
    let cut = [2, 0];
    assert!(read_message(&mut &cut[..], MAX_FRAME_LEN, 0).is_err());
}
