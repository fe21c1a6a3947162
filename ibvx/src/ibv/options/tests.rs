//! The options read from a configuration, and their checks.

use xdev::{Config, Error};

use super::IbvOptions;

#[test]
fn options_validate() {
    let c = Config::new(0, 2, "j");
    assert_eq!(IbvOptions::from_config(&c).unwrap(), IbvOptions::default());
    let c2 = c.clone().with("recv_depth", 2);
    assert!(IbvOptions::from_config(&c2).is_err());
    let c3 = c.clone().with("eager_window", 10);
    assert!(IbvOptions::from_config(&c3).is_err());
    let c4 = c.with("ibv_gid_index", 3).with("ibv_device", "rxe0");
    let o = IbvOptions::from_config(&c4).unwrap();
    assert_eq!((o.gid_index, o.device.as_deref()), (Some(3), Some("rxe0")));
}

#[test]
fn unknown_key_and_bad_value_are_refused() {
    let c = Config::new(0, 2, "j").with("recv_dpeth", 128);
    match IbvOptions::from_config(&c) {
        Err(Error::UnknownOption(u)) => {
            assert_eq!((u.device, u.key.as_str()), ("ibv", "recv_dpeth"));
            assert_eq!(u.known.len(), IbvOptions::KEYS.len());
            assert!(u.known.contains(&"recv_depth"), "{:?}", u.known);
        }
        other => panic!("expected UnknownOption, got {other:?}"),
    }
    let c = Config::new(0, 2, "j").with("send_slots", "many");
    match IbvOptions::from_config(&c) {
        Err(Error::BadOption(b)) => {
            assert_eq!((b.key.as_str(), b.value.as_str()), ("send_slots", "many"));
        }
        other => panic!("expected BadOption, got {other:?}"),
    }
}
