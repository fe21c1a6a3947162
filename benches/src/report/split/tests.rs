use super::*;
use crate::report::tests::rec;

#[test]
fn a_split_run_gives_its_records_and_nothing_else() {
    let text = "\
{\"device\":\"psm-vs-raw\",\"test\":\"rate_send\",\"size\":8,\"value\":7000000.0,\"unit\":\"msg/s\",\"floor\":9000000.0}
{\"device\":\"psm-vs-raw\",\"test\":\"rate_recv\",\"size\":8,\"value\":4500000.0,\"unit\":\"msg/s\",\"floor\":9000000.0}
{\"device\":\"psm-vs-raw\",\"test\":\"rate_recv_post\",\"size\":8,\"value\":80.0,\"unit\":\"ns\",\"floor\":35.0}
{\"device\":\"psm-vs-raw\",\"test\":\"rate\",\"size\":8,\"value\":1.0,\"unit\":\"msg/s\",\"floor\":1.0}
{\"device\":\"psm\",\"test\":\"rate_send\",\"size\":8,\"value\":1.0,\"unit\":\"msg/s\",\"floor\":1.0}
";
    let r = split_records(text);
    let tests: Vec<&str> = r.records.iter().map(|x| x.test.as_str()).collect();
    assert_eq!(tests, ["rate_send", "rate_recv", "rate_recv_post"]);
    assert_eq!(
        split_args(true).join(" "),
        "--json --device psm --test rate_split --min-size 8 --max-size 8 --quick"
    );
    assert_eq!(
        split_args(false).join(" "),
        "--json --device psm --test rate_split --min-size 8 --max-size 8"
    );
}

#[test]
fn the_split_table_follows_the_message_rate_with_each_side_against_raw_psm2() {
    let mut r = crate::report::tests::report_with_rates();
    assert_eq!(r.split_section(), "", "not measured: no section");
    assert!(!r.markdown().contains("by side"));
    r.results.records.extend([
        rec("psm-vs-raw", "rate_send", 8, 7_000_000.0, 9_000_000.0),
        rec("psm-vs-raw", "rate_recv", 8, 4_500_000.0, 9_000_000.0),
        rec("psm-vs-raw", "rate_recv_post", 8, 81.4, 35.6),
        rec("psm-vs-raw", "rate_recv_wait", 8, 145.0, 75.2),
    ]);
    let md = r.markdown();
    let at = md.find("### Message rate of psm by side").expect(&md);
    assert!(
        at > md.find("## Message rate").unwrap(),
        "after the rate table"
    );
    let section = &md[at..];
    assert!(
        section.contains("| sender through the device | 7.00 M | 9.00 M | 0.78 |"),
        "{section}"
    );
    assert!(
        section.contains("| receiver through the device | 4.50 M | 9.00 M | 0.50 |"),
        "{section}"
    );
    assert!(
        section.contains(
            "with the receiver through the device: posting 81 ns (raw PSM2: 36 ns), \
             waiting 145 ns (raw PSM2: 75 ns)."
        ),
        "{section}"
    );
    let headline = &md[md.find("## Headline").unwrap()..md.find("## Latency").unwrap()];
    assert!(!headline.contains("through the device"), "{headline}");
}
