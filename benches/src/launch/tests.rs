use super::*;

#[test]
fn the_self_launch_keeps_the_arguments_and_names_the_device() {
    let raw: Vec<OsString> = ["--device", "shm", "--quick"]
        .iter()
        .map(OsString::from)
        .collect();
    let c = self_launch_command(Path::new("/t/xdev-bench"), 3, Some("shm"), &raw);
    assert_eq!(c.get_program(), "/t/xdev-bench");
    let got: Vec<&std::ffi::OsStr> = c.get_args().collect();
    assert_eq!(got, ["--device", "shm", "--quick"]);
    let envs: Vec<_> = c.get_envs().collect();
    assert!(envs.contains(&(LAUNCH_RANKS.as_ref(), Some("3".as_ref()))));
    assert!(envs.contains(&(bootstrap::XDEV_DEVICE.as_ref(), Some("shm".as_ref()))));
    let c = self_launch_command(Path::new("/t/xdev-bench"), 2, None, &raw);
    assert!(c
        .get_envs()
        .any(|(k, v)| k == bootstrap::XDEV_DEVICE && v.is_none()));
}
