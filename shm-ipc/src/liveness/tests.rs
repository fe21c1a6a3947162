use super::*;
use std::sync::mpsc;

#[test]
fn reports_a_killed_child_and_stops_on_drop() {
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let (tx, rx) = mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    let watch = PeerWatch::start(vec![(3, child.id())], move |r| {
        tx.lock().unwrap().send(r).unwrap();
    })
    .unwrap();
    assert!(
        rx.recv_timeout(Duration::from_millis(200)).is_err(),
        "alive"
    );
    child.kill().unwrap();
    // A pidfd becomes readable when the process exits, before it is reaped.
    assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), 3);
    child.wait().unwrap();
    drop(watch); // joins the thread: must not hang
}

#[test]
fn has_exited_asks_the_pidfd_at_once() {
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let watch = PeerWatch::start(vec![(1, child.id())], |_| {}).unwrap();
    assert!(!watch.has_exited(1));
    assert!(!watch.has_exited(0), "not watched");
    assert!(!watch.has_exited(7), "not watched");
    child.kill().unwrap();
    // Reaped: its pid could now be anyone's. The pidfd still says it
    // is the one we watched, and that it exited.
    child.wait().unwrap();
    assert!(watch.has_exited(1));
}
