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
    let (n, prefix) = size_in_units(size);
    format!("{n}{prefix}")
}

/// `size` in bytes as a count of its largest whole binary unit and that
/// unit's prefix: `(n, "M")` for whole MiB, `(n, "K")` for whole KiB, else
/// `(size, "")`.
pub fn size_in_units(size: usize) -> (usize, &'static str) {
    if size >= 1 << 20 && size % (1 << 20) == 0 {
        (size >> 20, "M")
    } else if size >= 1 << 10 && size % (1 << 10) == 0 {
        (size >> 10, "K")
    } else {
        (size, "")
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
        let f = Frame::around(&all);
        let mut s = String::new();
        self.head(&mut s, &f);
        value_grid(&mut s, &f);
        size_grid(&mut s, &f);
        self.axes(&mut s, &f, all.is_empty());
        self.lines_and_legend(&mut s, &f, &lines);
        s.push_str("</svg>\n");
        s
    }

    /// The document's opening tag, its white background and the title.
    fn head(&self, s: &mut String, f: &Frame) {
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
            LEFT + f.pw / 2.0,
            escape(&self.title)
        );
    }

    /// The plot area's border, both axis titles, and the "no data measured"
    /// note when `empty`.
    fn axes(&self, s: &mut String, f: &Frame, empty: bool) {
        let (pw, ph) = (f.pw, f.ph);
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
        if empty {
            let _ = writeln!(
                s,
                r##"<text x="{}" y="{}" text-anchor="middle" fill="#a00">no data measured</text>"##,
                LEFT + pw / 2.0,
                TOP + ph / 2.0
            );
        }
    }

    /// Every series' line and markers, and its legend entry.
    fn lines_and_legend(&self, s: &mut String, f: &Frame, lines: &[Vec<(f64, f64)>]) {
        let (mut solid, mut dashed) = (0, 0);
        for (i, (series, pts)) in self.series.iter().zip(lines).enumerate() {
            let (colour, dash) = style(series, &mut solid, &mut dashed);
            draw_series(s, f, series, pts, colour, &dash);
            legend_entry(s, f, i, series, pts, colour, &dash);
        }
    }
}

/// Where the data lies on both (log) axes, widened to whole decades on the
/// value axis, and how it maps to pixels.
struct Frame {
    x0: f64,
    x1: f64,
    y0: f64,
    y1: f64,
    /// Width of the plot area in pixels.
    pw: f64,
    /// Height of the plot area in pixels.
    ph: f64,
}

impl Frame {
    /// The frame around `all` (log2 size, log10 value) points; a unit frame
    /// when there are none.
    fn around(all: &[(f64, f64)]) -> Frame {
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
        Frame {
            x0,
            x1,
            y0,
            y1,
            pw,
            ph,
        }
    }

    /// The pixel column of log2 size `x`.
    fn px(&self, x: f64) -> f64 {
        LEFT + (x - self.x0) / (self.x1 - self.x0) * self.pw
    }

    /// The pixel row of log10 value `y`.
    fn py(&self, y: f64) -> f64 {
        TOP + self.ph - (y - self.y0) / (self.y1 - self.y0) * self.ph
    }
}

/// Value grid: every decade labelled, 2 and 5 as faint lines (and labelled
/// when the axis spans few decades).
fn value_grid(s: &mut String, f: &Frame) {
    let (y0, y1, pw) = (f.y0, f.y1, f.pw);
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
                yy = f.py(y)
            );
            if major || few {
                let _ = writeln!(
                    s,
                    r#"<text x="{}" y="{:.1}" text-anchor="end" fill="{}">{}</text>"#,
                    LEFT - 6.0,
                    f.py(y) + 4.0,
                    if major { "#000" } else { "#666" },
                    value_label(v)
                );
            }
        }
    }
}

/// Size grid: every power of two, labelled every other one.
fn size_grid(s: &mut String, f: &Frame) {
    let (x0, x1, ph) = (f.x0, f.x1, f.ph);
    let mut k = x0.ceil() as i32;
    while f64::from(k) <= x1 + 1e-9 {
        let x = f.px(f64::from(k));
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
}

/// The colour and dash attribute of `series`: solid lines take the next
/// palette colour, dashed ones (floors) the next floor colour and dash
/// pattern; `solid` and `dashed` count the series of each kind so far.
fn style(series: &Series, solid: &mut usize, dashed: &mut usize) -> (&'static str, String) {
    if series.dashed {
        *dashed += 1;
        let k = *dashed - 1;
        (
            FLOOR_PALETTE[k % FLOOR_PALETTE.len()],
            format!(
                r#" stroke-dasharray="{}""#,
                FLOOR_DASHES[k % FLOOR_DASHES.len()]
            ),
        )
    } else {
        *solid += 1;
        (PALETTE[(*solid - 1) % PALETTE.len()], String::new())
    }
}

/// The polyline of one series (when it has two points or more) and its
/// markers (solid lines, or a floor of a single point).
fn draw_series(
    s: &mut String,
    f: &Frame,
    series: &Series,
    pts: &[(f64, f64)],
    colour: &str,
    dash: &str,
) {
    if pts.len() > 1 {
        let path: Vec<String> = pts
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", f.px(x), f.py(y)))
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
                f.px(x),
                f.py(y)
            );
        }
    }
}

/// Legend entry `i`: a stroke in the series' style and its label, which
/// says "(no data)" when nothing was drawable.
fn legend_entry(
    s: &mut String,
    f: &Frame,
    i: usize,
    series: &Series,
    pts: &[(f64, f64)],
    colour: &str,
    dash: &str,
) {
    let ly = TOP + 10.0 + 20.0 * i as f64;
    let lx = LEFT + f.pw + 15.0;
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

#[cfg(test)]
mod tests;
