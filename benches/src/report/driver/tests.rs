use super::*;

#[test]
fn report_arguments() {
    let v = |l: &str| l.split_whitespace().map(String::from).collect::<Vec<_>>();
    let r = parse_report(&v(
        "--out /tmp/r --quick --max-size 64 --vm f --no-mpi --no-ucx --passes 3",
    ))
    .unwrap()
    .unwrap();
    assert_eq!(
        r,
        ReportArgs {
            out: Some("/tmp/r".into()),
            quick: true,
            max_size: 64,
            vm: Some("f".into()),
            mpi: false,
            ucx: false,
            passes: Some(3),
        }
    );
    let d = parse_report(&[]).unwrap().unwrap();
    assert!(d.mpi && d.ucx && !d.quick && d.out.is_none() && d.max_size == 4 << 20);
    assert_eq!(d.passes, None);
    assert!(parse_report(&v("--passes x")).is_err());
    assert_eq!(parse_report(&v("--help")).unwrap(), None);
    assert!(parse_report(&v("--bogus")).is_err());
}
