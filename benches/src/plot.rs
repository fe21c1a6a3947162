//! Hand-written SVG line plots for the comparison report: message size on a
//! log2 axis, values on a log10 axis, one polyline per series, a legend, no
//! dependencies. The output is a complete, self-contained SVG document.

use std::fmt::Write;

/// One line of a plot.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    /// The legend's label.
    pub name: String,
    /// (message size in bytes, value) pairs; sizes below 1 and values that
    /// are not positive are left out (they have no place on log axes).
    pub points: Vec<(usize, f64)>,
    /// Drawn dashed, without markers (floors).
    pub dashed: bool,
}

/// A line plot on log axes.
#[derive(Clone, Debug, PartialEq)]
pub struct Plot {
    /// Title line above the plot.
    pub title: String,
    /// Label of the value axis, e.g. `"latency (us)"`.
    pub y_label: String,
    /// The lines, drawn in order (the legend lists them in the same order).
    pub series: Vec<Series>,
}

const WIDTH: f64 = 860.0;
const HEIGHT: f64 = 520.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 230.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 60.0;

/// Colours of the solid lines, in order (distinct, print-safe).
const PALETTE: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf",
];
/// Colours of the dashed lines (floors).
const FLOOR_PALETTE: [&str; 3] = ["#000000", "#7f7f7f", "#bcbd22"];
/// Their dash patterns, one each: floors that coincide (the cache-line
/// floors of threads and of processes often do) stay told apart.
const FLOOR_DASHES: [&str; 3] = ["8,5", "2,3", "12,3,2,3"];

/// `size` in bytes as an axis label: 1, 4, 16, ..., 1K, 4K, ..., 1M, 4M.
pub fn size_label(size: usize) -> String {
    if size >= 1 << 20 && size % (1 << 20) == 0 {
        format!("{}M", size >> 20)
    } else if size >= 1 << 10 && size % (1 << 10) == 0 {
        format!("{}K", size >> 10)
    } else {
        size.to_string()
    }
}

/// A value-axis label: `1e-2` style outside 0.001 ..= 100000.
fn value_label(v: f64) -> String {
    if (1e-3..1.0).contains(&v) {
        format!("{v}")
    } else if (1.0..=1e5).contains(&v) {
        format!("{v:.0}")
    } else {
        format!("1e{}", v.log10().round())
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

impl Plot {
    /// The points of every series that fit log axes.
    fn drawable(&self) -> Vec<Vec<(f64, f64)>> {
        self.series
            .iter()
            .map(|s| {
                s.points
                    .iter()
                    .filter(|&&(size, v)| size >= 1 && v > 0.0 && v.is_finite())
                    .map(|&(size, v)| ((size as f64).log2(), v.log10()))
                    .collect()
            })
            .collect()
    }

    /// The plot as an SVG document. A plot without drawable points says so
    /// in its frame.
    pub fn svg(&self) -> String {
        let lines = self.drawable();
        let all: Vec<(f64, f64)> = lines.iter().flatten().copied().collect();
        let (mut x0, mut x1) = all
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| {
                (a.min(p.0), b.max(p.0))
            });
        let (y_lo, y_hi) = all
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| {
                (a.min(p.1), b.max(p.1))
            });
        if all.is_empty() {
            (x0, x1) = (0.0, 1.0);
        }
        if x1 <= x0 {
            x1 = x0 + 1.0;
        }
        // Whole decades around the data.
        let (y0, mut y1) = if all.is_empty() {
            (0.0, 1.0)
        } else {
            (y_lo.floor(), y_hi.ceil())
        };
        if y1 <= y0 {
            y1 = y0 + 1.0;
        }
        let pw = WIDTH - LEFT - RIGHT;
        let ph = HEIGHT - TOP - BOTTOM;
        let px = |x: f64| LEFT + (x - x0) / (x1 - x0) * pw;
        let py = |y: f64| TOP + ph - (y - y0) / (y1 - y0) * ph;

        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(
            s,
            r#"<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" fill="white"/>"#
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="28" font-size="16" text-anchor="middle">{}</text>"#,
            LEFT + pw / 2.0,
            escape(&self.title)
        );
        // Value grid: every decade labelled, 2 and 5 as faint lines (and
        // labelled when the axis spans few decades).
        let few = y1 - y0 <= 3.0;
        for d in (y0 as i32)..=(y1 as i32) {
            for m in [1.0, 2.0, 5.0] {
                let v = 10f64.powi(d) * m;
                let y = v.log10();
                if y > y1 + 1e-9 {
                    continue;
                }
                let major = m == 1.0;
                let _ = writeln!(
                    s,
                    r#"<line x1="{LEFT}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="{}" stroke-width="1"/>"#,
                    LEFT + pw,
                    if major { "#cccccc" } else { "#eeeeee" },
                    yy = py(y)
                );
                if major || few {
                    let _ = writeln!(
                        s,
                        r#"<text x="{}" y="{:.1}" text-anchor="end" fill="{}">{}</text>"#,
                        LEFT - 6.0,
                        py(y) + 4.0,
                        if major { "#000" } else { "#666" },
                        value_label(v)
                    );
                }
            }
        }
        // Size grid: every power of two, labelled every other one.
        let mut k = x0.ceil() as i32;
        while f64::from(k) <= x1 + 1e-9 {
            let x = px(f64::from(k));
            let _ = writeln!(
                s,
                r#"<line x1="{x:.1}" y1="{TOP}" x2="{x:.1}" y2="{:.1}" stroke="{}" stroke-width="1"/>"#,
                TOP + ph,
                if k % 2 == 0 { "#dddddd" } else { "#f2f2f2" }
            );
            if k % 2 == 0 {
                let _ = writeln!(
                    s,
                    r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                    TOP + ph + 18.0,
                    size_label(1usize << k)
                );
            }
            k += 1;
        }
        let _ = writeln!(
            s,
            r##"<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#000"/>"##
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">message size (bytes, log2 scale)</text>"#,
            LEFT + pw / 2.0,
            HEIGHT - 16.0
        );
        let _ = writeln!(
            s,
            r#"<text transform="translate(20,{}) rotate(-90)" text-anchor="middle">{} (log scale)</text>"#,
            TOP + ph / 2.0,
            escape(&self.y_label)
        );
        if all.is_empty() {
            let _ = writeln!(
                s,
                r##"<text x="{}" y="{}" text-anchor="middle" fill="#a00">no data measured</text>"##,
                LEFT + pw / 2.0,
                TOP + ph / 2.0
            );
        }
        // Lines and legend.
        let (mut solid, mut dashed) = (0, 0);
        for (i, (series, pts)) in self.series.iter().zip(&lines).enumerate() {
            let (colour, dash) = if series.dashed {
                dashed += 1;
                let k = dashed - 1;
                (
                    FLOOR_PALETTE[k % FLOOR_PALETTE.len()],
                    format!(
                        r#" stroke-dasharray="{}""#,
                        FLOOR_DASHES[k % FLOOR_DASHES.len()]
                    ),
                )
            } else {
                solid += 1;
                (PALETTE[(solid - 1) % PALETTE.len()], String::new())
            };
            if pts.len() > 1 {
                let path: Vec<String> = pts
                    .iter()
                    .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
                    .collect();
                let _ = writeln!(
                    s,
                    r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>"#,
                    path.join(" ")
                );
            }
            if !series.dashed || pts.len() == 1 {
                for &(x, y) in pts {
                    let _ = writeln!(
                        s,
                        r#"<circle cx="{:.1}" cy="{:.1}" r="2.5" fill="{colour}"/>"#,
                        px(x),
                        py(y)
                    );
                }
            }
            let ly = TOP + 10.0 + 20.0 * i as f64;
            let lx = LEFT + pw + 15.0;
            let _ = writeln!(
                s,
                r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{colour}" stroke-width="2"{dash}/>"#,
                lx + 28.0
            );
            let label = if pts.is_empty() {
                format!("{} (no data)", series.name)
            } else {
                series.name.clone()
            };
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{}">{}</text>"#,
                lx + 34.0,
                ly + 4.0,
                escape(&label)
            );
        }
        s.push_str("</svg>\n");
        s
    }
}

#[cfg(test)]
mod tests;
