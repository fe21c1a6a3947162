use super::*;

#[test]
fn messages_are_one_line_and_name_the_problem() {
    let e = Error::NoDevice {
        reason: String::new(),
    };
    assert_eq!(e.to_string(), "no RDMA device found");
    let e = Error::DeviceNotFound {
        name: "mlx5_0".into(),
        available: vec!["rxe0".into()],
    };
    assert_eq!(
        e.to_string(),
        "RDMA device \"mlx5_0\" not found (available: rxe0)"
    );
    let e = Error::QpTransition {
        qpn: 0x11,
        transition: Transition::InitToRtr,
        source: io::Error::from_raw_os_error(libc::EINVAL),
    };
    let s = e.to_string();
    assert!(
        s.starts_with("QP 0x11: transition INIT->RTR failed: "),
        "{s}"
    );
    let e = Error::BadGidIndex {
        device: "rxe0".into(),
        port: 1,
        index: 7,
        reason: "out of range".into(),
    };
    assert_eq!(
        e.to_string(),
        "bad GID index 7 on rxe0 port 1: out of range"
    );
    for e in [
        Error::InvalidArgument("x".into()),
        Error::Budget {
            what: "registration cache lease",
            requested: 4096,
            pinned: 1 << 30,
            limit: 1 << 30,
        },
        Error::from_rc("ibv_post_send", libc::ENOMEM),
        Error::from_rc("ibv_post_send", -libc::ENOMEM),
    ] {
        assert!(!e.to_string().contains('\n'));
    }
    assert_eq!(
        errno_error(-libc::ENOMEM).raw_os_error(),
        Some(libc::ENOMEM)
    );
}
