//! The options read from a configuration, and their checks.

use xdev::Config;

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
