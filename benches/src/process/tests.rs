use super::*;

fn job() -> String {
    format!("bench-test-{}", std::process::id())
}

#[test]
fn shared_line_is_shared_between_mappings() {
    let (a, object) = SharedLine::create(&job()).unwrap();
    assert!(object.name().starts_with(&shm_prefix(&job())));
    let b = SharedLine::attach(&job(), object.name()).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| b.line().echo());
        assert!(a.line().ping(1_000) > 0.0);
    });
    let name = object.name().to_string();
    drop(object);
    let gone = SharedLine::attach(&job(), &name).err().unwrap();
    assert_eq!(gone.kind(), io::ErrorKind::NotFound);
}

#[test]
fn attach_refuses_foreign_names() {
    let ours = format!("{}{NAME_TAG}", shm_prefix(&job()));
    let other = format!("{}{NAME_TAG}1", shm_prefix("another-job"));
    let up = format!("{ours}../x");
    for name in ["/etc-passwd", &ours, &up, &ours[1..], &other] {
        let e = SharedLine::attach(&job(), name).err().unwrap();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{name}");
    }
}

#[test]
fn created_objects_are_private() {
    let (_line, object) = SharedLine::create(&job()).unwrap();
    let path = format!("/dev/shm{}", object.name());
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&path).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600);
    drop(object);
    assert!(std::fs::metadata(&path).is_err(), "unlinked on drop");
}

#[test]
fn floor_over_the_thread_device() {
    let out = shm_ipc::ThreadWorld::new(3).run(|dev| {
        let floor = ProcessFloor::setup(&DeviceCoordinator(dev), &job()).unwrap();
        // Few round trips: three spinning ranks may share two cores.
        let runs: Vec<Option<f64>> = (0..3).map(|_| floor.cache_line(100)).collect();
        let shared = DeviceCoordinator(dev).share("k", b"from 0").unwrap();
        (runs, shared)
    });
    assert!(out[0].0.iter().all(|r| r.unwrap() > 0.0));
    assert!(out[1].0.iter().all(Option::is_none));
    assert!(out[2].0.iter().all(Option::is_none));
    assert!(out.iter().all(|(_, s)| s == b"from 0"));
}
