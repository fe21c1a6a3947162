use super::*;

#[test]
fn size_labels() {
    assert_eq!(size_label(1), "1");
    assert_eq!(size_label(512), "512");
    assert_eq!(size_label(4096), "4K");
    assert_eq!(size_label(4 << 20), "4M");
}

#[test]
fn a_plot_has_one_polyline_per_series_and_a_legend() {
    let p = Plot {
        title: "latency <test>".into(),
        y_label: "us".into(),
        series: vec![
            Series {
                name: "shm".into(),
                points: vec![(0, 1.0), (1, 0.5), (2, 0.6), (1024, 3.0)],
                dashed: false,
            },
            Series {
                name: "floor".into(),
                points: vec![(1, 0.05), (1024, 0.05)],
                dashed: true,
            },
        ],
    };
    let svg = p.svg();
    assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
    assert!(svg.trim_end().ends_with("</svg>"));
    assert_eq!(svg.matches("<polyline").count(), 2);
    assert_eq!(
        svg.matches("stroke-dasharray").count(),
        2,
        "line and legend"
    );
    // A second floor gets a dash pattern of its own.
    let mut two = p.clone();
    two.series.push(Series {
        name: "floor 2".into(),
        points: vec![(1, 0.05), (1024, 0.05)],
        dashed: true,
    });
    let svg2 = two.svg();
    assert_eq!(svg2.matches(r#"stroke-dasharray="8,5""#).count(), 2);
    assert_eq!(svg2.matches(r#"stroke-dasharray="2,3""#).count(), 2);
    // Size 0 has no place on a log axis: three markers for shm.
    assert_eq!(svg.matches("<circle").count(), 3);
    assert!(svg.contains("latency &lt;test&gt;"));
    assert!(svg.contains(">1K<"), "size axis labels");
    assert!(
        svg.contains(">0.01<") && svg.contains(">10<"),
        "value decades"
    );
}

#[test]
fn an_empty_plot_says_so() {
    let p = Plot {
        title: "t".into(),
        y_label: "y".into(),
        series: vec![Series {
            name: "none".into(),
            points: vec![],
            dashed: false,
        }],
    };
    let svg = p.svg();
    assert!(svg.contains("no data measured") && svg.contains("none (no data)"));
    assert!(!svg.contains("NaN") && !svg.contains("inf"));
}
