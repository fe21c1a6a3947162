//! The xdev conformance suite on the `psm` device with 2 and 4 processes on
//! this host (PSM2's shm-only mode here: no Omni-Path hardware). Skipped,
//! saying why, where libpsm2 is not installed.
#![cfg(feature = "psm")]

use std::sync::Mutex;
use std::time::Duration;

use xdev::devkit::launch::LocalJob;

mod rank;

static SERIAL: Mutex<()> = Mutex::new(());

fn run(n: usize, case: &str) {
    if let Err(e) = psm_sys::Psm2::load() {
        println!("skipped: {e}");
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(program) = rank::program() else {
        return;
    };
    let job = LocalJob::start(
        n,
        program,
        &["conformance", case],
        &[("XDEV_DEVICE", "psm")],
    )
    .expect("start job");
    let exits = job.wait(Duration::from_secs(300)).expect("job ends");
    let failures = xdev::devkit::launch::failures(&exits);
    assert!(failures.is_empty(), "{failures}");
    // Honest about the mode it ran in.
    let shm_only = !std::path::Path::new("/dev/hfi1_0").exists();
    if shm_only {
        assert!(
            exits[0].stderr.contains("shm-only mode"),
            "{}",
            exits[0].stderr
        );
    }
}

mod two_processes {
    xdev::devkit::conformance_tests!(|case| super::run(2, case));
}

mod four_processes {
    xdev::devkit::conformance_tests!(|case| super::run(4, case));
}

/// PSM2 allows one endpoint per process: a second `psm` device opened in a
/// process that has one fails cleanly with a configuration error, and the
/// first works on. (In this test process, with one-rank jobs of its own.)
#[test]
fn one_endpoint_per_process() {
    use xdev::bootstrap::{Bootstrap, BootstrapServer, Secret};
    use xdev::{Config, Device, Error, Source, TagSel};

    if let Err(e) = psm_sys::Psm2::load() {
        println!("skipped: {e}");
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let open = |job: &str| {
        let secret = Secret::generate().expect("secret");
        let bind = "127.0.0.1:0".parse().expect("loopback address");
        let server = BootstrapServer::start(bind, 1, job, secret.clone()).expect("service");
        let boot = Bootstrap::connect(server.addr(), 0, 1, job, &secret).expect("connect");
        let dev = ibvx::PsmDevice::with_bootstrap(&Config::new(0, 1, job), boot);
        (server, dev)
    };
    let job = |n: u32| format!("psm-one-endpoint-{}-{n}", std::process::id());
    let (_first_service, first) = open(&job(1));
    let first = first.expect("the process's first endpoint opens");
    let (_second_service, second) = open(&job(2));
    match second {
        Err(Error::Config(m)) if m.contains("one endpoint per process") => {}
        Err(e) => panic!("second endpoint: {e}"),
        Ok(_) => panic!("a second endpoint opened in one process"),
    }
    first.send(b"ping", 0, 1, 7).expect("send to self");
    let mut buf = [0u8; 4];
    let st = first
        .recv(&mut buf, Source::Rank(0), TagSel::Tag(1), 7)
        .expect("receive from self");
    assert_eq!((st.count, &buf), (4, b"ping"));
    first.finish().expect("finish");
}
