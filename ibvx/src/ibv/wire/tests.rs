//! Frames round-trip, have their fixed lengths, and bad ones are refused.

use super::*;
use proptest::prelude::*;

fn frame(head: &Header, body: &Body<'_>) -> Vec<u8> {
    let mut out = vec![0u8; MAX_CONTROL_LEN];
    let n = encode(head, body, &mut out);
    out.truncate(n);
    if let Body::Eager(p) = body {
        out.extend_from_slice(p);
    }
    out
}

#[test]
fn control_frames_have_fixed_lengths() {
    let h = Header::default();
    let reply = Body::RndzReply {
        rid: 7,
        addr: 0x1000,
        len: 4096,
        rkey: 0x55,
    };
    let f = frame(&h, &reply);
    assert_eq!(f.len(), MAX_CONTROL_LEN);
    assert_eq!(decode(&f, 0).unwrap(), (h, reply));
    let mut longer = f.clone();
    longer.push(0);
    assert!(matches!(decode(&longer, 0), Err(WireError::Long { .. })));
    assert!(matches!(decode(&f[..40], 0), Err(WireError::Short { .. })));
}

#[test]
fn refuses_bad_kind_flags_tag_and_size() {
    let h = Header {
        tag: 3,
        ..Header::default()
    };
    let mut f = frame(&h, &Body::Eager(&[1, 2, 3]));
    assert!(decode(&f, 3).is_ok());
    assert_eq!(decode(&f, 2), Err(WireError::TooLarge { len: 3, limit: 2 }));
    f[1] = 0x80;
    assert!(matches!(decode(&f, 3), Err(WireError::Flags { .. })));
    f[1] = FLAG_FAILED; // not an eager flag
    assert!(matches!(decode(&f, 3), Err(WireError::Flags { .. })));
    f[1] = 0;
    f[8..12].copy_from_slice(&(-5i32).to_le_bytes());
    assert_eq!(decode(&f, 3), Err(WireError::Tag(-5)));
    f[0] = 99;
    assert_eq!(decode(&f, 3), Err(WireError::UnknownKind(99)));
    assert!(matches!(decode(&f[..10], 3), Err(WireError::Short { .. })));
}

fn arb_body() -> impl Strategy<Value = (u8, u64, u64, u64, u32, Vec<u8>)> {
    (
        1u8..=6,
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
        any::<u32>(),
        proptest::collection::vec(any::<u8>(), 0..64),
    )
}

proptest! {
    /// Whatever a peer sends, decoding never panics, and what it accepts
    /// respects the limits.
    #[test]
    fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..128), limit in 0usize..100) {
        if let Ok((h, body)) = decode(&bytes, limit) {
            prop_assert!(bytes.len() >= HEADER_LEN);
            match body {
                Body::Eager(p) => {
                    prop_assert!(p.len() <= limit);
                    prop_assert!(h.tag >= 0);
                    prop_assert_eq!(h.flags & !FLAG_SYNC, 0);
                }
                other => prop_assert_eq!(bytes.len(), other.kind().frame_len()),
            }
        }
    }

    /// Encoding then decoding gives back what was encoded.
    #[test]
    fn round_trip(flags in 0u8..4, slots in any::<u16>(), bytes in any::<u32>(),
                  tag in 0i32..=i32::MAX, context in any::<u32>(), id in any::<u64>(),
                  (kind, a, b, c, k, payload) in arb_body()) {
        let body = match kind {
            1 => Body::Eager(&payload),
            2 => Body::RndzStart { len: a },
            3 => Body::RndzReply { rid: a, addr: b, len: c, rkey: k },
            4 => Body::RndzEnd,
            5 => Body::Ack,
            _ => Body::Credit,
        };
        let h = Header { flags: flags & body.kind().allowed_flags(), slots, bytes, tag, context, id };
        let f = frame(&h, &body);
        prop_assert_eq!(decode(&f, 64).unwrap(), (h, body));
    }
}
