use std::time::Duration;

use super::*;

pub(super) fn rec(device: &str, test: &str, size: usize, value: f64, floor: f64) -> Record {
    Record {
        device: device.into(),
        test: test.into(),
        size,
        value,
        unit: match test {
            "latency" => "us",
            "rate" => "msg/s",
            _ => "MB/s",
        }
        .into(),
        floor,
    }
}

fn report() -> Report {
    let records = vec![
        rec("thread", "latency", 0, 0.2, 0.04),
        rec("thread", "latency", 8, 0.25, 0.05),
        rec("shm", "latency", 8, 0.5, 0.1),
        rec("psm", "latency", 8, 1.0, 0.08),
        rec("psm-vs-raw", "latency", 8, 1.0, 0.8),
        // Measured alone, next to the peers: counts among the
        // processes' floors, and is no line of its own.
        rec("floor (processes)", "latency", 8, 0.09, 0.09),
        rec("Open MPI", "latency", 8, 0.4, 0.0),
        rec("shm", "bw", 1 << 20, 5000.0, 10000.0),
        rec("thread", "bw", 1 << 20, 4000.0, 8000.0),
        rec("shm", "bibw", 1 << 20, 6000.0, 12000.0),
    ];
    Report {
        machine: Machine {
            host: "box".into(),
            cpu: "CPU".into(),
            cores: 2,
            kernel: "6.1".into(),
            date: "2024-01-01 00:00 UTC".into(),
            load: "0.1 0.2 0.3".into(),
        },
        load_after: "1 1 1".into(),
        load_range: None,
        command: "xdev-bench report".into(),
        elapsed: Duration::from_secs(3),
        built: vec!["thread".into(), "shm".into(), "psm".into()],
        results: Results {
            records,
            not_measured: vec![("ibv".into(), "no RDMA device".into())],
        },
        peers: vec![
            (
                RAW_PSM2.into(),
                PeerStatus::Measured("same endpoint".into()),
            ),
            ("Open MPI".into(), PeerStatus::Measured("v4".into())),
            (
                "MPICH".into(),
                PeerStatus::NotMeasured("not installed".into()),
            ),
            (
                "perftest".into(),
                PeerStatus::NotMeasured(PERFTEST_ABSENT.into()),
            ),
        ],
        passes: Err("skipped (--no-mpi)".into()),
        vm: None,
        relative: None,
    }
}

/// A VM results file of two rounds, as `ci/bench-vm.sh` writes it.
pub(super) const VM_FILE: &str = "\
{\"vm_info\":\"guest kernel\",\"value\":\"6.1.0\"}
{\"vm_info\":\"perftest\",\"value\":\"6.06: ib_send_lat\"}
{\"device\":\"perftest\",\"test\":\"latency\",\"size\":8,\"value\":20.0,\"unit\":\"us\",\"floor\":0}
{\"device\":\"ibv\",\"test\":\"latency\",\"size\":8,\"value\":30.0,\"unit\":\"us\",\"floor\":0.5}
{\"device\":\"ibv\",\"test\":\"latency\",\"size\":8,\"value\":25.0,\"unit\":\"us\",\"floor\":0.25}
{\"device\":\"perftest\",\"test\":\"latency\",\"size\":8,\"value\":22.0,\"unit\":\"us\",\"floor\":0}
{\"device\":\"perftest\",\"test\":\"bw\",\"size\":4194304,\"value\":40.0,\"unit\":\"MB/s\",\"floor\":0}
{\"device\":\"ibv\",\"test\":\"bw\",\"size\":4194304,\"value\":30.0,\"unit\":\"MB/s\",\"floor\":1000}
{\"device\":\"ibv\",\"test\":\"bw\",\"size\":4194304,\"value\":36.0,\"unit\":\"MB/s\",\"floor\":1200}
{\"vm_info\":\"perftest failed\",\"value\":\"ib_write_bw -s 2 in round 1\"}
";

#[test]
fn the_report_divides_by_the_floors_of_the_same_run() {
    let r = report();
    let md = r.markdown();
    assert!(md.contains("| `ibv` | xdev device | not measured: no RDMA device |"));
    assert!(md.contains("| `hybrid` | xdev device | not measured: not in this build"));
    let mut with_hybrid = report();
    with_hybrid.built.push("hybrid".into());
    with_hybrid
        .results
        .records
        .push(rec("hybrid", "latency", 8, 0.3, 0.05));
    assert!(with_hybrid.markdown().contains(
        "| `hybrid` | xdev device | measured (on this one host: its shared-memory side;"
    ));
    assert!(md.contains("| MPICH | peer | not measured: not installed |"));
    assert!(md.contains(&format!("Not measured: {PERFTEST_ABSENT}.")));
    // Headline rows: value and ratio. thread: 0.25 / 0.05 = 5; shm bw
    // 5000 / 10000; raw PSM2 is the floor field of psm-vs-raw, divided
    // by the processes' best cache-line floor (0.08); so is Open MPI.
    // Every ratio divides by the best floor of the run: at that size
    // for memcpy (10000 MB/s at 1 MiB), at any size for the cache line
    // (of the placement: 0.04 for threads, 0.08 for processes).
    assert!(
        md.contains("| thread | 0.250 | 6.25 | 4000 | 0.40 | – | – |"),
        "{md}"
    );
    assert!(
        md.contains("| shm | 0.500 | 6.25 | 5000 | 0.50 | 6000 | 0.50 |"),
        "{md}"
    );
    assert!(md.contains("| psm | 1.00 | 12.50 |"), "{md}");
    assert!(md.contains("| raw PSM2 | 0.800 | 10.00 |"), "{md}");
    assert!(md.contains("| Open MPI | 0.400 | 5.00 |"), "{md}");
    assert!(md.contains("![Latency](latency.svg)"));
    // Latency table: both cache-line floors, size 0 included.
    let lat = r.table("latency");
    assert!(
        lat.contains("\n| 8 | 0.040 | 0.080 | 0.250 | 6.25 | 0.500 | 6.25 |"),
        "{lat}"
    );
    assert!(lat.starts_with(
        "| size | cache-line floor (threads) | cache-line floor (processes) | thread | ratio |"
    ));
    assert!(
        lat.contains("\n| 0 | 0.040 | 0.080 | 0.200 | 5.00 | – | – |"),
        "{lat}"
    );
    // Plots: one line per device or peer, then the floors, dashed.
    let p = r.plot("latency");
    let names: Vec<&str> = p.series.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "thread",
            "shm",
            "psm",
            "raw PSM2",
            "Open MPI",
            "cache-line floor (threads)",
            "cache-line floor (processes)"
        ]
    );
    assert!(p.series[5].dashed && !p.series[0].dashed);
    let bibw = r.plot("bibw");
    assert_eq!(bibw.series.len(), 2, "shm and its floor");
    assert_eq!(bibw.series[1].name, "memcpy floor (2 concurrent)");
}

/// Without rate records every line of the headline says why it has no rate.
fn without_rates_every_line_says_why() {
    let md = report().markdown();
    assert!(
        md.contains(
            "| device or peer | latency 8 B (us) | ratio | bw 1 MiB (MB/s) | ratio | \
             bibw 1 MiB (MB/s) | ratio | messages/s at 8 B | ratio |\n\
             |---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
        ),
        "{md}"
    );
    assert!(
        md.contains("| thread | 0.250 | 6.25 | 4000 | 0.40 | – | – | not measured: no rate records in this run"),
        "{md}"
    );
    assert!(
        md.contains("| raw PSM2 | 0.800 | 10.00 | – | – | – | – | not measured: the psm device's run gave no rate records | – |"),
        "{md}"
    );
    assert!(md.contains("## Message rate (messages/s)\n"), "{md}");
    assert!(md.contains("![Message rate](rate.svg)\n\nNothing measured."));
}

/// [`report`] with message rate records.
pub(super) fn report_with_rates() -> Report {
    let mut r = report();
    r.results.records.extend([
        rec("thread", "rate", 8, 2e6, 2e7),
        // A hand-off of 0.02 us measured next to the rate at 16 B: the
        // least of the threads' run, so every thread row divides by
        // 1 / 0.02 us = 5e7 messages/s.
        rec("thread", "rate", 16, 1e6, 5e7),
        rec("shm", "rate", 8, 3e6, 1e7),
        rec("psm-vs-raw", "rate", 8, 4e6, 1.6e7),
        rec("Open MPI", "rate", 8, 2.5e7, 0.0),
        rec("Open MPI", "rate", 16, 2e7, 0.0),
    ]);
    r
}

/// The rate table and plot of [`report_with_rates`] (`md`, its markdown):
/// every row divides by one message per hand-off of its placement.
fn rate_table_and_plot_divide_by_one_message_per_hand_off(r: &Report, md: &str) {
    let t = r.table("rate");
    assert!(
        t.starts_with(
            "| size | 1 / cache-line floor (threads) | 1 / cache-line floor (processes) \
             | thread | ratio | shm | ratio | raw PSM2 | ratio | Open MPI | ratio |\n"
        ),
        "{t}"
    );
    assert!(
        t.contains("\n| 8 | 50000000 | 12500000 | 2000000 | 0.04 | 3000000 | 0.24 | 16000000 | 1.28 | 25000000 | 2.00 |\n"),
        "{t}"
    );
    assert!(
        t.contains(
            "\n| 16 | 50000000 | 12500000 | 1000000 | 0.02 | – | – | – | – | 20000000 | 1.60 |\n"
        ),
        "{t}"
    );
    assert!(!t.contains(DISTURBED_MARK), "latency alone is marked");
    assert!(md.contains("- **Message rate** (`ratio`"), "{md}");
    let p = r.plot("rate");
    assert!(p.title.starts_with("Message rate"), "{}", p.title);
    assert_eq!(p.y_label, "messages/s");
    let names: Vec<&str> = p.series.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "thread",
            "shm",
            "raw PSM2",
            "Open MPI",
            "1 / cache-line floor (threads)",
            "1 / cache-line floor (processes)"
        ]
    );
}

#[test]
fn the_headline_has_the_message_rate_at_8_bytes_for_every_line() {
    without_rates_every_line_says_why();
    let mut r = report_with_rates();
    let md = r.markdown();
    // thread: 2e6 / 5e7; the processes' least hand-off is psm's 0.08 us
    // (latency records), so their floor is 1.25e7 messages/s: shm 3e6
    // / 1.25e7, raw PSM2 (the floor field of psm-vs-raw) 1.6e7 /
    // 1.25e7, Open MPI 2.5e7 / 1.25e7.
    assert!(
        md.contains("| thread | 0.250 | 6.25 | 4000 | 0.40 | – | – | 2000000 | 0.04 |"),
        "{md}"
    );
    assert!(
        md.contains("| shm | 0.500 | 6.25 | 5000 | 0.50 | 6000 | 0.50 | 3000000 | 0.24 |"),
        "{md}"
    );
    assert!(
        md.contains(
            "| psm | 1.00 | 12.50 | – | – | – | – | not measured: no rate records in this run"
        ),
        "{md}"
    );
    assert!(
        md.contains("| raw PSM2 | 0.800 | 10.00 | – | – | – | – | 16000000 | 1.28 |"),
        "{md}"
    );
    assert!(
        md.contains("| Open MPI | 0.400 | 5.00 | – | – | – | – | 25000000 | 2.00 |"),
        "{md}"
    );
    rate_table_and_plot_divide_by_one_message_per_hand_off(&r, &md);
    // A psm run with rates but none at 8 B says so.
    r.results
        .records
        .push(rec("psm-vs-raw", "rate", 16, 4e6, 1.6e7));
    r.results
        .records
        .retain(|x| !(x.device == "psm-vs-raw" && x.test == "rate" && x.size == 8));
    assert!(r
        .markdown()
        .contains("| raw PSM2 | 0.800 | 10.00 | – | – | – | – | not measured: no 8 B figure in this run | – |"));
}

#[test]
fn the_vm_section_compares_ibv_with_perftest_over_the_guests_floors() {
    let mut r = report();
    r.vm = Some(parse_vm(VM_FILE));
    r.peers.retain(|(p, _)| p != PERFTEST);
    r.peers.push((
        PERFTEST.into(),
        PeerStatus::Measured("in the soft-RoCE VM".into()),
    ));
    let md = r.markdown();
    assert!(md.contains("| perftest | peer | measured (in the soft-RoCE VM) |"));
    // ibv: not measured on the host, measured in the VM.
    assert!(
        md.contains(
            "| `ibv` | xdev device | measured in the soft-RoCE VM (its section below); \
             on this host not measured: no RDMA device |"
        ),
        "{md}"
    );
    assert!(md.contains("| guest kernel | 6.1.0 |"), "{md}");
    assert!(md.contains("| perftest failed | ib_write_bw -s 2 in round 1 |"));
    // Best of the rounds: ibv 25 us over the least floor of the guest
    // (0.25) = 100; perftest 20 / 0.25 = 80; 25 / 20 = 1.25. At 4 MiB:
    // 36 / 1200, 40 / 1200, 36 / 40.
    assert!(
        md.contains("| latency 8 B (us) | 25.00 | 100.00 | 20.00 | 80.00 | 1.25 |"),
        "{md}"
    );
    assert!(
        md.contains("| bw 4 MiB (MB/s) | 36.00 | 0.03 | 40.00 | 0.03 | 0.90 |"),
        "{md}"
    );
    assert!(
        md.contains("| bw 1 MiB (MB/s) | – | – | – | – | – |"),
        "{md}"
    );
    let sub = r.vm_report().unwrap();
    let lat = sub.table("latency");
    assert!(
        lat.starts_with(
            "| size | cache-line floor (processes) | ibv | ratio | perftest | ratio | ibv / perftest |\n\
             |---|---:|---:|---:|---:|---:|---:|\n"
        ),
        "{lat}"
    );
    assert!(
        lat.contains("\n| 8 | 0.250 | 25.00 | 100.00 | 20.00 | 80.00 | 1.25 |"),
        "{lat}"
    );
    assert!(sub
        .table("bw")
        .contains("\n| 4M | 1200 | 36.00 | 0.03 | 40.00 | 0.03 | 0.90 |"));
    // The host's tables keep the host's floors and have no such column.
    assert!(!r.table("latency").contains("perftest"));
    let p = sub.plot("bw");
    assert!(p.title.contains(VM_HOST), "{}", p.title);
    let names: Vec<&str> = p.series.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["ibv", "perftest", "memcpy floor"]);
    assert!(md.contains("![Latency in the VM](vm-latency.svg)"));
    assert!(!md.contains(PERFTEST_ABSENT), "{md}");
}

#[test]
fn latency_measured_on_disturbed_cores_is_marked() {
    let mut r = report();
    // thread at 16 B: its own floor 0.2, five times the row's (0.04);
    // a better round at 8 B whose floor was 0.3: that value is kept,
    // with its floor.
    r.results
        .records
        .push(rec("thread", "latency", 16, 0.9, 0.2));
    r.results
        .records
        .push(rec("thread", "latency", 8, 0.24, 0.3));
    let md = r.markdown();
    assert!(md.contains("| thread | 0.240† | 6.00 |"), "headline: {md}");
    let lat = r.table("latency");
    assert!(
        lat.contains("\n| 16 | 0.040 | 0.080 | 0.900† | 22.50 |"),
        "{lat}"
    );
    assert!(
        lat.contains("\n| 0 | 0.040 | 0.080 | 0.200 | 5.00 |"),
        "{lat}"
    );
    assert!(
        lat.contains("† The cache-line floor measured alongside"),
        "{lat}"
    );
    // Not marked: no disturbed figure, and bandwidth never.
    let quiet = report();
    assert!(!quiet.table("latency").contains('†'));
    assert!(!quiet.markdown().contains('†'));
    r.results.records.push(rec("thread", "bw", 16, 1.0, 1.0));
    assert!(!r.table("bw").contains('†'));
}

#[test]
fn a_busy_machine_is_said_to_be() {
    let mut r = report();
    assert!(!r.markdown().contains("during the run"));
    r.load_range = Some((0.5, 1.5));
    let md = r.markdown();
    assert!(
        md.contains("| 1-minute load average during the run (sampled every 10 s) | 0.50 to 1.50 |"),
        "{md}"
    );
    assert!(!md.contains("was busy"), "1.5 on 2 cores: {md}");
    r.load_range = Some((0.5, 2.9));
    assert!(
        !r.markdown().contains("was busy"),
        "the run's own two ranks"
    );
    r.load_range = Some((0.5, 3.25));
    assert!(r.markdown().contains(
        "The machine was busy during this run: the 1-minute load average reached 3.25 on 2 cores"
    ));
}

#[test]
fn without_a_vm_file_its_section_says_why() {
    let md = report().markdown();
    assert!(
        md.contains(&format!("Not measured: {PERFTEST_ABSENT}.")),
        "{md}"
    );
    assert!(md.contains("| `ibv` | xdev device | not measured: no RDMA device |"));
    assert!(report().vm_report().is_none());
}

#[test]
fn the_vm_section_shows_system_calls_per_message_and_the_targets() {
    let text = format!(
        "{VM_FILE}\
{{\"vm_syscalls\":\"perftest\",\"placement\":\"one guest\",\"round\":1,\"calls\":5000,\"writes\":2020,\"messages\":2000}}
{{\"vm_syscalls\":\"ibv\",\"placement\":\"one guest\",\"round\":1,\"calls\":6600,\"writes\":2200,\"messages\":2200}}
{{\"vm_syscalls\":\"perftest\",\"placement\":\"one guest\",\"round\":2,\"calls\":4000,\"writes\":2010,\"messages\":2000}}
{{\"vm_syscalls\":\"ibv\",\"placement\":\"two guests\",\"round\":1,\"calls\":4400,\"writes\":2420,\"messages\":2200}}
{{\"vm_syscalls\":\"ibv\",\"placement\":\"bad\",\"round\":1,\"calls\":1,\"writes\":1,\"messages\":0}}
"
    );
    let vm = parse_vm(&text);
    assert_eq!(vm.syscalls.len(), 4, "a record of no messages is dropped");
    let t = super::markdown::syscall_table(&vm.syscalls);
    // Best rounds: perftest 2.00 calls and 1.005 writes; ibv 3.00 and 1.00.
    assert!(t.contains("| one guest | ibv | 3.00 | 1.00 | 1 |"), "{t}");
    assert!(
        t.contains("| one guest | perftest | 2.00 | 1.00 | 2 |"),
        "{t}"
    );
    assert!(t.contains("| two guests | ibv | 2.00 | 1.10 | 1 |"), "{t}");
    assert!(
        t.contains("- one guest: `ibv` makes 1.50x perftest's calls per message (target at most 1.2x: not met) and -0.00 writes per message (target at most +0.1: met)."),
        "{t}"
    );
    assert!(!t.contains("- two guests"), "no perftest there: no verdict");
    assert_eq!(super::markdown::syscall_table(&[]), "");
}

#[test]
fn ucx_sits_in_the_headline_with_its_loop_noted_and_no_bibw() {
    let mut r = report_with_rates();
    assert!(
        !r.markdown().contains(UCX_LOOP_NOTE),
        "no UCX line, no note"
    );
    r.results.records.extend([
        rec(UCX, "latency", 8, 0.16, 0.0),
        rec(UCX, "bw", 1 << 20, 20000.0, 0.0),
        rec(UCX, "rate", 8, 2.5e7, 0.0),
    ]);
    r.peers
        .push((UCX.into(), PeerStatus::Measured("UCX 1.13.1".into())));
    let md = r.markdown();
    // Latency and rate divide by the processes' floor (0.08 us), bw by
    // the best memcpy floor at 1 MiB (shm's 10000).
    assert!(
        md.contains(
            "| UCX | 0.160 | 2.00 | 20000 | 2.00 | not measured: ucx_perftest has no \
             bi-directional test | – | 25000000 | 2.00 |"
        ),
        "{md}"
    );
    assert!(md.contains(UCX_LOOP_NOTE), "{md}");
    assert!(
        md.contains("| UCX | peer | measured (UCX 1.13.1) |"),
        "{md}"
    );
    let absent = PeerStatus::NotMeasured(format!("not installed ({UCX_INSTALL})"));
    r.peers.last_mut().unwrap().1 = absent;
    r.results.records.retain(|x| x.device != UCX);
    let md = r.markdown();
    assert!(
        !md.contains("| UCX | 0."),
        "an absent peer is not filled in: {md}"
    );
    assert!(
        md.contains("| UCX | peer | not measured: not installed (apt-get install ucx-utils) |"),
        "{md}"
    );
}
