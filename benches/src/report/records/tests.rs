use super::*;
use crate::report::tests::{rec, VM_FILE};

#[test]
fn records_and_notices_are_parsed() {
    let text = "\
# a comment
{\"device\":\"shm\",\"test\":\"latency\",\"size\":8,\"value\":0.5000,\"unit\":\"us\",\"floor\":0.0500}
test tests::x ... {\"device\":\"thread\",\"test\":\"bw\",\"size\":1024,\"value\":1.5e3,\"unit\":\"MB/s\",\"floor\":3000}
{\"device\":\"ibv\",\"not_measured\":\"verbs not available: \\\"x\\\"\"}
{\"floor\":\"threads\",\"test\":\"cache_line\",\"size\":0,\"value\":0.1,\"unit\":\"us\"}
{\"floor\":\"processes\",\"test\":\"memcpy\",\"size\":8,\"value\":9,\"unit\":\"MB/s\"}
{broken
";
    let r = parse_results(text);
    assert_eq!(
        r.records,
        [
            rec("shm", "latency", 8, 0.5, 0.05),
            rec("thread", "bw", 1024, 1500.0, 3000.0),
            rec("floor (threads)", "latency", 0, 0.1, 0.1),
            rec("floor (processes)", "bw", 8, 9.0, 9.0),
        ]
    );
    assert_eq!(
        r.not_measured,
        [("ibv".to_string(), "verbs not available: \"x\"".to_string())]
    );
    // What xdev-bench prints parses back.
    let line = crate::osu::not_measured("ibv", "no \"rdma\"\ndevice", true);
    assert_eq!(
        parse_results(&line).not_measured,
        [("ibv".to_string(), "no \"rdma\"\ndevice".to_string())]
    );
    let m = crate::osu::multi_bandwidth_json("shm", 2, 1.0, 2.0, 2);
    assert_eq!(
        parse_results(&m).records,
        [rec("shm", "mbw_mr", 2, 1.0, 2.0)]
    );
}

#[test]
fn vm_files_are_parsed() {
    let vm = parse_vm(VM_FILE);
    assert_eq!(
        vm.info,
        [
            ("guest kernel".to_string(), "6.1.0".to_string()),
            ("perftest".to_string(), "6.06: ib_send_lat".to_string()),
            (
                "perftest failed".to_string(),
                "ib_write_bw -s 2 in round 1".to_string()
            ),
        ]
    );
    assert_eq!(vm.results.records.len(), 7);
    assert_eq!(
        vm.results.records[0],
        rec("perftest", "latency", 8, 20.0, 0.0)
    );
    assert!(vm.results.not_measured.is_empty());
    assert_eq!(
        perftest_status(&vm, "f"),
        PeerStatus::Measured("in the soft-RoCE VM: perftest 6.06: ib_send_lat".into())
    );
    let only_ibv: String = VM_FILE
        .lines()
        .filter(|l| !l.contains("\"device\":\"perftest\""))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(
        perftest_status(&parse_vm(&only_ibv), "f"),
        PeerStatus::NotMeasured("no perftest figures in f (ib_write_bw -s 2 in round 1)".into())
    );
}
