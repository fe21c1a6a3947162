use super::*;
use crate::cli::{parse, Parsed};

/// The arguments of `line`, which parses as a run.
fn run_args(line: &str) -> Args {
    let Ok(Parsed::Run(a)) = parse(line.split_whitespace().map(String::from)) else {
        panic!("{line:?} is not a run");
    };
    a
}

#[test]
fn a_rank_measures_the_launchers_device_or_the_one_named() {
    let env = |d: &str| Some(d.to_string());
    assert_eq!(rank_device(&run_args(""), env("shm")).unwrap(), "shm");
    assert_eq!(
        rank_device(&run_args("--device thread --device shm"), env("shm")).unwrap(),
        "shm"
    );
    assert!(rank_device(&run_args("--device verbs"), env("shm")).is_err());
    assert_eq!(rank_device(&run_args("--device shm"), None).unwrap(), "shm");
    assert!(rank_device(&run_args(""), None).is_err());
    assert!(rank_device(&run_args("--device a --device b"), None).is_err());
}
