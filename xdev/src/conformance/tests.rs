use super::*;

#[test]
fn pattern_detects_any_changed_byte() {
    let mut v = patterned(1000, 5);
    assert!(check(&v, 5).is_ok());
    assert!(check(&v, 6).is_err(), "different seed");
    v[517] ^= 1;
    assert_eq!(check(&v, 5), Err(517));
}

#[test]
fn case_names_are_unique() {
    let mut names: Vec<_> = CASES.iter().map(|c| c.0).collect();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), CASES.len());
}
