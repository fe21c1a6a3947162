use super::*;
use crate::report::tests::rec;

#[test]
fn a_window_run_becomes_a_bibw_series_of_its_own() {
    let text = "\
# OSU MPI Bi-Directional Bandwidth Test (xdev-bench)
{\"device\":\"shm\",\"test\":\"bibw_window\",\"size\":8,\"value\":130.0,\"unit\":\"MB/s\",\"floor\":7000.0}
{\"device\":\"shm\",\"test\":\"bibw\",\"size\":8,\"value\":1.0,\"unit\":\"MB/s\",\"floor\":1.0}
{\"device\":\"thread\",\"test\":\"bibw_window\",\"size\":8,\"value\":2.0,\"unit\":\"MB/s\",\"floor\":1.0}
";
    let r = window_records(text, "shm");
    assert_eq!(r.records.len(), 1, "only shm's window records");
    let x = &r.records[0];
    assert_eq!(
        (x.device.as_str(), x.test.as_str()),
        ("shm (window calls)", "bibw")
    );
    assert_eq!((x.value, x.floor), (130.0, 7000.0));
    assert_eq!(
        window_args("thread", 4 << 20, true).join(" "),
        "--json --device thread --test bibw_window --min-size 1 --max-size 65536 --quick"
    );
    assert_eq!(
        window_args("shm", 64, false).join(" "),
        "--json --device shm --test bibw_window --min-size 1 --max-size 64"
    );
}

#[test]
fn the_window_series_sit_in_the_bibw_table_and_not_in_the_headline() {
    let mut r = crate::report::tests::report_with_rates();
    r.results.records.extend([
        rec("shm (window calls)", "bibw", 1 << 20, 7000.0, 12000.0),
        rec("thread (window calls)", "rate", 8, 1.0, 1.0),
    ]);
    let md = r.markdown();
    let headline = &md[md.find("## Headline").unwrap()..md.find("## Latency").unwrap()];
    assert!(!headline.contains("window calls"), "{headline}");
    let bibw = &md[md.find("## Bi-directional").unwrap()..md.find("## Message rate").unwrap()];
    assert!(bibw.contains(" shm (window calls) |"), "{bibw}");
    assert!(bibw.contains("7000"), "{bibw}");
}
