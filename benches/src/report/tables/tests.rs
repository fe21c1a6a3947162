use super::*;

#[test]
fn a_small_ratio_keeps_two_significant_digits() {
    assert_eq!(fmt_ratio(0.5), "0.50");
    assert_eq!(fmt_ratio(1.234), "1.23");
    assert_eq!(fmt_ratio(0.012), "0.01");
    assert_eq!(fmt_ratio(0.0049), "0.0049");
    assert_eq!(fmt_ratio(0.000_123_45), "0.00012");
    assert_eq!(fmt_ratio(0.0), "0.00");
}
