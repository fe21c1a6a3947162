use super::*;

#[test]
fn options_from_assignments() {
    let c = Config::new(0, 2, "j")
        .with_assignment("ring_bytes=8192")
        .unwrap();
    assert_eq!(c.options["ring_bytes"], "8192");
    assert!(matches!(
        Config::new(0, 2, "j").with_assignment("ring_bytes"),
        Err(Error::Config(_))
    ));
    let c = Config::new(0, 2, "j")
        .with_assignments(["a=1", "b=2", "a=3"])
        .unwrap();
    assert_eq!(
        (c.options["a"].as_str(), c.options["b"].as_str()),
        ("3", "2")
    );
    assert!(Config::new(0, 2, "j")
        .with_assignments(["a=1", "bad"])
        .is_err());
}
