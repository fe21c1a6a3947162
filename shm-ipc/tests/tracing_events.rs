//! The events a runtime sees through `tracing`: a subscriber of this test
//! (global: the events come from every rank's thread) records what the
//! libraries emit while two ranks of the thread device are opened through
//! the registry and one of them dies. The libraries themselves print
//! nothing; without a subscriber these events go nowhere.

use std::fmt::Debug;
use std::sync::{Arc, Barrier, Mutex};
use std::thread;
use std::time::Duration;

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};
use xdev::devkit::conformance::Watchdog;
use xdev::{Config, Error, Registry, Source, ANY_TAG};

/// One event: its level, target, and fields (`message` included) as text.
#[derive(Debug, Clone)]
struct Recorded {
    level: Level,
    target: String,
    fields: Vec<(String, String)>,
}

impl Recorded {
    fn field(&self, name: &str) -> Option<&str> {
        self.fields
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Records every event; spans are accepted and ignored.
struct Recorder(Arc<Mutex<Vec<Recorded>>>);

struct Fields<'a>(&'a mut Vec<(String, String)>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        self.0
            .push((field.name().to_string(), format!("{value:?}")));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.push((field.name().to_string(), value.to_string()));
    }
}

impl Subscriber for Recorder {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut fields = Vec::new();
        event.record(&mut Fields(&mut fields));
        self.0.lock().unwrap().push(Recorded {
            level: *event.metadata().level(),
            target: event.metadata().target().to_string(),
            fields,
        });
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

#[test]
fn device_open_and_peer_lost_are_events() {
    let _dog = Watchdog::arm("tracing events", Duration::from_secs(60));
    let events = Arc::new(Mutex::new(Vec::new()));
    tracing::subscriber::set_global_default(Recorder(events.clone()))
        .expect("the only subscriber of this test binary");

    let job = format!("tracing-{}", std::process::id());
    let start = Arc::new(Barrier::new(2));
    let (j, s) = (job.clone(), start.clone());
    let dying = thread::spawn(move || {
        let mut registry = Registry::new();
        shm_ipc::register(&mut registry);
        let dev = registry
            .open("thread", &Config::new(1, 2, &j))
            .expect("open rank 1");
        s.wait();
        drop(dev); // dies: no finish
    });
    let mut registry = Registry::new();
    shm_ipc::register(&mut registry);
    let dev = registry
        .open("thread", &Config::new(0, 2, &job))
        .expect("open rank 0");
    start.wait();
    let e = dev
        .recv(&mut [0u8; 4], Source::Rank(1), ANY_TAG, 0)
        .unwrap_err();
    assert!(matches!(e, Error::PeerLost { rank: 1, .. }), "{e:?}");
    dying.join().unwrap();
    dev.finish().unwrap();

    let seen = events.lock().unwrap().clone();
    for rank in ["0", "1"] {
        assert!(
            seen.iter().any(|e| e.level == Level::INFO
                && e.target.starts_with("xdev")
                && e.field("message") == Some("device open")
                && e.field("device") == Some("thread")
                && e.field("rank") == Some(rank)
                && e.field("size") == Some("2")),
            "no device-open event of rank {rank} in {seen:#?}"
        );
    }
    assert!(
        seen.iter().any(|e| e.level == Level::INFO
            && e.target.starts_with("shm_ipc")
            && e.field("message") == Some("peer lost")
            && e.field("peer") == Some("1")),
        "no peer-lost event for rank 1 in {seen:#?}"
    );
}
