use super::*;

fn args(line: &str) -> Args {
    match parse(line.split_whitespace().map(String::from)).unwrap() {
        Parsed::Run(a) => a,
        Parsed::Help => panic!("help"),
    }
}

#[test]
fn arguments() {
    assert_eq!(parse(["--help".to_string()]).unwrap(), Parsed::Help);
    assert!(parse(["--test".to_string(), "nope".to_string()]).is_err());
    let a = args("--device shm --option a=b --json --max-size 64 --test floor");
    assert_eq!(a.devices, ["shm"]);
    assert_eq!(a.options, [("a".to_string(), "b".to_string())]);
    assert!(a.json && a.max_size == 64 && a.only("floor"));
    assert_eq!(args("").tests, ["latency", "bw"]);
    assert_eq!(
        args("--test bw,all --test bibw,mbw_mr -n 6").tests,
        ["bw", "latency", "bibw", "mbw_mr"]
    );
    assert_eq!(args("-n 6").ranks, 6);
    assert_eq!(args("").ranks, MBW_RANKS);
    assert!(parse(["-n".to_string(), "3".to_string()]).is_err());
    assert!(parse(["--test".to_string(), "floor,bw".to_string()]).is_err());
    assert!(parse(["--test".to_string(), "bw,nope".to_string()]).is_err());
    // One size for long: what a profile needs.
    let one = args("--min-size 8 --max-size 8 --iterations 50 --test rate");
    assert_eq!(one.sizes(), [8]);
    assert_eq!(one.counts((100, 10)), (50, 5));
    assert_eq!(args("--quick").counts((100, 10)), (10, 1));
    assert_eq!(args("").counts((100, 10)), (100, 10));
    assert_eq!(args("--max-size 4").sizes(), [0, 1, 2, 4]);
    let again = args(&one.rank_args(Some("shm"), &one.tests).join(" "));
    assert_eq!(
        (again.min_size, again.max_size, again.iterations),
        (8, 8, Some(50))
    );
    assert!(parse(["--iterations".to_string(), "0".to_string()]).is_err());
    assert!(parse(["--min-size".to_string(), "x".to_string()]).is_err());
}

#[test]
fn mbw_mr_runs_as_a_job_of_its_own() {
    let a = args("--test latency,mbw_mr,bibw --ranks 6 --quick --option k=v");
    let j = jobs(&a);
    assert_eq!(
        j,
        [
            (2, vec!["latency".to_string(), "bibw".to_string()]),
            (6, vec!["mbw_mr".to_string()])
        ]
    );
    // The rank arguments say the same run again, for one job.
    let again = args(&a.rank_args(Some("shm"), &j[1].1).join(" "));
    assert_eq!(again.devices, ["shm"]);
    assert_eq!(again.tests, ["mbw_mr"]);
    assert_eq!((again.ranks, again.quick, again.json), (6, true, false));
    assert_eq!(again.options, a.options);
    assert_eq!(
        jobs(&args("--test mbw_mr")),
        [(4, vec!["mbw_mr".to_string()])]
    );
}

#[test]
fn options_go_to_the_devices_that_know_them() {
    let reg = registry();
    let a = args("--device shm --device thread --option cma=off --option ring_bytes=8192");
    check_options(&a, &reg).unwrap();
    let shm = reg.get("shm").unwrap().options;
    let thread = reg.get("thread").unwrap().options;
    assert_eq!(options_for(shm, &a.options).len(), 2);
    assert_eq!(
        options_for(thread, &a.options),
        [("ring_bytes".to_string(), "8192".to_string())]
    );
    // A key no device of the run knows is refused, with their keys.
    let bad = args("--device thread --option cma=off");
    let e = check_options(&bad, &reg).unwrap_err();
    assert!(
        e.contains("\"cma\"") && e.contains("thread: eager_limit"),
        "{e}"
    );
}
