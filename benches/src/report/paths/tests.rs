use super::*;
use crate::report::tests::rec;

#[test]
fn a_paths_run_is_renamed_and_keeps_only_its_own_records() {
    let text = "\
# OSU MPI Bi-Directional Bandwidth Test (xdev-bench)
{\"device\":\"shm\",\"test\":\"bibw\",\"size\":1048576,\"value\":9000.0,\"unit\":\"MB/s\",\"floor\":12000.0}
{\"device\":\"thread\",\"test\":\"bibw\",\"size\":1048576,\"value\":1.0,\"unit\":\"MB/s\",\"floor\":1.0}
";
    let r = path_records(text, "shm cma=off");
    assert_eq!(r.records.len(), 1);
    assert_eq!(r.records[0].device, "shm cma=off");
    assert_eq!((r.records[0].value, r.records[0].floor), (9000.0, 12000.0));
    let a = path_args(&["cma=on", "cma_split_bytes=0"], 4 << 20, true).join(" ");
    assert_eq!(
        a,
        "--json --device shm --test bibw --min-size 32768 --max-size 4194304 \
         --option cma=on --option cma_split_bytes=0 --quick"
    );
    assert!(PATHS.iter().all(|(n, _)| n.starts_with(PATH_PREFIX)));
}

#[test]
fn the_path_table_divides_by_open_mpi_and_stays_out_of_the_headline() {
    let mut r = crate::report::tests::report_with_rates();
    assert!(
        !r.markdown().contains("by rendezvous path"),
        "no path series, no table"
    );
    r.results.records.extend([
        rec("shm cma=on split=off", "bibw", 1 << 20, 12000.0, 12000.0),
        rec("shm cma=off", "bibw", 1 << 20, 6000.0, 12000.0),
        rec("shm cma=off", "bibw", 4 << 20, 5000.0, 11000.0),
        rec("Open MPI", "bibw", 1 << 20, 10000.0, 0.0),
    ]);
    let md = r.markdown();
    assert!(
        md.contains("### Bi-directional bandwidth of shm by rendezvous path"),
        "{md}"
    );
    assert!(
        md.contains("| size | shm | shm cma=on split=off | shm cma=off |"),
        "{md}"
    );
    assert!(
        md.contains("| 1M | 6000 (0.60x) | 12000 (1.20x) | 6000 (0.60x) |"),
        "{md}"
    );
    // No Open MPI figure at 4 MiB: no ratio, and nothing made up.
    assert!(md.contains("| 4M | – | – | 5000 (–) |"), "{md}");
    let headline = &md[md.find("## Headline").unwrap()..md.find("## Latency").unwrap()];
    assert!(!headline.contains("shm cma="), "{headline}");
}
