use super::*;

#[test]
fn only_peers_on_this_host_and_pid_namespace_are_watched() {
    let mine = my_record();
    let with_pid = |pid: u32, rest: &[u8]| {
        let mut r = pid.to_le_bytes().to_vec();
        r.extend_from_slice(rest);
        r
    };
    let mut other_host = mine[4..].to_vec();
    let last = other_host.len() - 1;
    other_host[last] ^= 1;
    let mut other_ns = mine[4..].to_vec();
    other_ns[0] ^= 1;
    let sleeper = || {
        std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap()
    };
    let (mut a, mut b) = (sleeper(), sleeper());
    let records = vec![
        with_pid(a.id(), &mine[4..]),
        mine.clone(),
        with_pid(102, &other_host),
        with_pid(103, &other_ns),
        with_pid(b.id(), &mine[4..]),
        Vec::new(),
    ];
    assert_eq!(
        peers_to_watch(1, &mine, &records),
        vec![(0, a.id()), (4, b.id())]
    );
    assert!(peers_to_watch(1, &[], &records).is_empty());

    // Records another rank could have forged under PMI: two ranks naming
    // one process (neither is watched), this process's own pid, and a
    // pid no process has.
    let forged = vec![
        with_pid(a.id(), &mine[4..]),
        mine.clone(),
        with_pid(a.id(), &mine[4..]),
        with_pid(std::process::id(), &mine[4..]),
        with_pid(4_000_000_000, &mine[4..]),
        with_pid(b.id(), &mine[4..]),
    ];
    assert_eq!(peers_to_watch(1, &mine, &forged), vec![(5, b.id())]);
    for c in [&mut a, &mut b] {
        c.kill().unwrap();
        c.wait().unwrap();
    }
}

#[test]
fn a_watched_process_that_exits_is_a_departure() {
    // The only test that starts the (once per process) watch.
    let mut child = std::process::Command::new("sleep")
        .arg("0.3")
        .spawn()
        .unwrap();
    start(vec![(5, child.id())]);
    assert!(started());
    let t = std::time::Instant::now();
    while !departures().iter().any(|d| d.rank == 5 && !d.clean) {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(10),
            "the exit was not seen"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(
        t.elapsed() >= std::time::Duration::from_millis(200),
        "seen too early"
    );
    child.wait().unwrap();
}
