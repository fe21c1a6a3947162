//! Every registered device refuses an option key it does not know, naming the
//! keys it knows, and refuses a value that does not parse, naming the key and
//! the expected form, before it connects to anything. Opened through the
//! registry a runtime uses, outside any launcher.

use xdev::{Config, Error};

#[test]
fn every_device_refuses_unknown_keys_and_bad_values() {
    let reg = ibvx::registry();
    let names: Vec<&str> = reg.entries().iter().map(|e| e.name).collect();
    for want in ["thread", "shm", "ibv", "psm", "hybrid"] {
        assert!(names.contains(&want), "{want} not registered: {names:?}");
    }
    for e in reg.entries() {
        let known: Vec<&str> = e.options.iter().map(|s| s.key).collect();
        assert!(!known.is_empty(), "{} declares no options", e.name);
        for s in e.options {
            assert!(!s.doc.is_empty() && !s.form.is_empty(), "{}: {s:?}", e.name);
        }

        let cfg = Config::new(0, 2, format!("opts-{}", e.name)).with("no_such_key", 1);
        let err = reg.open(e.name, &cfg).err().expect("unknown key accepted");
        match &err {
            Error::UnknownOption(u) => {
                assert_eq!((u.device, u.key.as_str()), (e.name, "no_such_key"));
                assert_eq!(u.known, known, "{}", e.name);
            }
            other => panic!("{}: expected UnknownOption, got {other:?}", e.name),
        }
        let text = err.to_string();
        assert!(text.contains(&known.join(", ")), "{}: {text}", e.name);

        // The first plain key with a value that parses as nothing numeric.
        let spec = e.options.iter().find(|s| !s.key.ends_with('.')).unwrap();
        if spec.form.starts_with("an RDMA device name") {
            continue;
        }
        let cfg = Config::new(0, 2, format!("opts-{}", e.name)).with(spec.key, "§?");
        match reg.open(e.name, &cfg).err().expect("bad value accepted") {
            Error::BadOption(b) => {
                assert_eq!(
                    (b.device, b.key.as_str(), b.value.as_str()),
                    (e.name, spec.key, "§?")
                );
                assert_eq!(b.expected, spec.form);
            }
            // `remote` of hybrid is a string checked against its list.
            Error::Config(m) if e.name == "hybrid" => assert!(m.contains("remote"), "{m}"),
            other => panic!("{}: expected BadOption, got {other:?}", e.name),
        }
    }
}

#[test]
fn hybrid_checks_the_options_it_passes_on() {
    let reg = ibvx::registry();
    let cfg = Config::new(0, 2, "opts-hybrid-sub")
        .with("remote", "shm")
        .with("local.ring_byte", 4096);
    match reg.open("hybrid", &cfg).err().expect("accepted") {
        Error::UnknownOption(u) => {
            assert_eq!((u.device, u.key.as_str()), ("shm", "ring_byte"))
        }
        other => panic!("expected UnknownOption, got {other:?}"),
    }
    let cfg = Config::new(0, 2, "opts-hybrid-sub").with("remote.recv_depth", "deep");
    match reg.open("hybrid", &cfg).err().expect("accepted") {
        Error::BadOption(b) => {
            assert_eq!((b.device, b.key.as_str()), ("ibv", "recv_depth"))
        }
        other => panic!("expected BadOption, got {other:?}"),
    }
}
