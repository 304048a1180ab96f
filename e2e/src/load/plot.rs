//! A line chart as SVG text, written by hand so the benchmarks can draw their figures without
//! a plotting dependency.
//!
//! In: a [`Chart`]: a title, axis labels and named series of (x, y) points, all positive.
//! Out: the SVG document as a string: both axes logarithmic (the benchmarks' sizes and
//! memories span decades), ticks at 1, 2 and 5 times each power of ten with grid lines, one
//! polyline with point markers per series, and a legend. A chart with no points, or a point
//! that is not a positive finite number, is refused with a [`PlotError`].

use std::fmt::Write as _;

/// One named line.
#[derive(Clone, Debug)]
pub struct Series {
    /// The legend's text.
    pub name: String,
    /// (x, y) points, drawn in the order given.
    pub points: Vec<(f64, f64)>,
}

/// What to draw.
#[derive(Clone, Debug)]
pub struct Chart {
    /// Above the plot.
    pub title: String,
    /// Under the x axis.
    pub x_label: String,
    /// Beside the y axis.
    pub y_label: String,
    /// The lines.
    pub series: Vec<Series>,
}

/// Why a chart could not be drawn.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlotError {
    /// No series has a point: there is nothing to scale the axes to.
    #[error("the chart has no points")]
    NoPoints,
    /// Logarithmic axes need every coordinate positive and finite.
    #[error("series {series:?} has the point ({x}, {y}): log axes need positive finite values")]
    NotPositive {
        /// The series' name.
        series: String,
        /// The point's x.
        x: f64,
        /// The point's y.
        y: f64,
    },
}

const WIDTH: f64 = 820.0;
const HEIGHT: f64 = 520.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 30.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 70.0;
const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

/// A logarithmic axis: the decades `lo..=hi` (powers of ten) mapped onto `from..to` pixels.
#[derive(Clone, Copy, Debug)]
struct Axis {
    lo: f64,
    hi: f64,
    from: f64,
    to: f64,
}

impl Axis {
    /// The axis covering `min..=max`, widened to whole decades.
    fn covering(min: f64, max: f64, from: f64, to: f64) -> Self {
        let lo = min.log10().floor();
        let hi = max.log10().ceil().max(lo + 1.0);
        Self { lo, hi, from, to }
    }

    fn pixel(&self, v: f64) -> f64 {
        self.from + (v.log10() - self.lo) / (self.hi - self.lo) * (self.to - self.from)
    }

    /// 1, 2 and 5 times each power of ten on the axis.
    fn ticks(&self) -> Vec<f64> {
        let mut out = Vec::new();
        let (lo, hi) = (self.lo as i32, self.hi as i32);
        for e in lo..=hi {
            for m in [1.0, 2.0, 5.0] {
                let v = m * 10f64.powi(e);
                if v <= 10f64.powi(hi) * 1.000_001 {
                    out.push(v);
                }
            }
        }
        out
    }
}

/// Writes a benchmark's plot `svg` to the path in `var`, else `default` (a relative path is
/// under the workspace), creating its directory; returns the path.
pub fn save(var: &str, default: &str, svg: &str) -> anyhow::Result<std::path::PathBuf> {
    use anyhow::Context as _;
    let p = std::path::PathBuf::from(std::env::var(var).unwrap_or_else(|_| default.into()));
    let path = if p.is_absolute() {
        p
    } else {
        crate::harness::paths::repo_root().join(p)
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(&path, svg).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// A tick's text: `50`, `2k`, `65k`, `1M`, `0.5`.
fn tick_label(v: f64) -> String {
    let trim = |s: String| {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s
        }
    };
    if v >= 1e6 {
        format!("{}M", trim(format!("{:.1}", v / 1e6)))
    } else if v >= 1e3 {
        format!("{}k", trim(format!("{:.1}", v / 1e3)))
    } else {
        trim(format!("{v:.3}"))
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Every point of `chart`, checked positive and finite.
fn points(chart: &Chart) -> Result<Vec<(f64, f64)>, PlotError> {
    let mut all = Vec::new();
    for s in &chart.series {
        for &(x, y) in &s.points {
            let ok = |v: f64| v.is_finite() && v > 0.0;
            if !ok(x) || !ok(y) {
                return Err(PlotError::NotPositive {
                    series: s.name.clone(),
                    x,
                    y,
                });
            }
            all.push((x, y));
        }
    }
    if all.is_empty() {
        return Err(PlotError::NoPoints);
    }
    Ok(all)
}

/// The chart as an SVG document.
pub fn svg(chart: &Chart) -> Result<String, PlotError> {
    let all = points(chart)?;
    let fold = |f: fn(f64, f64) -> f64, init: f64, pick: fn(&(f64, f64)) -> f64| {
        all.iter().map(pick).fold(init, f)
    };
    let x = Axis::covering(
        fold(f64::min, f64::MAX, |p| p.0),
        fold(f64::max, 0.0, |p| p.0),
        LEFT,
        WIDTH - RIGHT,
    );
    let y = Axis::covering(
        fold(f64::min, f64::MAX, |p| p.1),
        fold(f64::max, 0.0, |p| p.1),
        HEIGHT - BOTTOM,
        TOP,
    );
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        out,
        r#"<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>"#
    );
    let _ = writeln!(
        out,
        r#"<text x="{}" y="28" text-anchor="middle" font-size="16">{}</text>"#,
        WIDTH / 2.0,
        escape(&chart.title)
    );
    axes(&mut out, chart, &x, &y);
    for (i, s) in chart.series.iter().enumerate() {
        line(&mut out, s, COLORS[i % COLORS.len()], &x, &y);
    }
    legend(&mut out, chart);
    out.push_str("</svg>\n");
    Ok(out)
}

/// Grid lines, ticks and their labels, the frame and the axis labels.
fn axes(out: &mut String, chart: &Chart, x: &Axis, y: &Axis) {
    let (bottom, top, left, right) = (y.from, y.to, x.from, x.to);
    for t in x.ticks() {
        let px = x.pixel(t);
        let _ = writeln!(
            out,
            r##"<line class="grid" x1="{px:.1}" y1="{top}" x2="{px:.1}" y2="{bottom}" stroke="#ddd"/><text class="xtick" x="{px:.1}" y="{}" text-anchor="middle">{}</text>"##,
            bottom + 18.0,
            tick_label(t)
        );
    }
    for t in y.ticks() {
        let py = y.pixel(t);
        let _ = writeln!(
            out,
            r##"<line class="grid" x1="{left}" y1="{py:.1}" x2="{right}" y2="{py:.1}" stroke="#ddd"/><text class="ytick" x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
            left - 6.0,
            py + 4.0,
            tick_label(t)
        );
    }
    let _ = writeln!(
        out,
        r#"<rect x="{left}" y="{top}" width="{}" height="{}" fill="none" stroke="black"/>"#,
        right - left,
        bottom - top
    );
    let _ = writeln!(
        out,
        r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
        (left + right) / 2.0,
        HEIGHT - 25.0,
        escape(&chart.x_label)
    );
    let _ = writeln!(
        out,
        r#"<text x="20" y="{0}" text-anchor="middle" transform="rotate(-90 20 {0})">{1}</text>"#,
        (top + bottom) / 2.0,
        escape(&chart.y_label)
    );
}

/// One series: its polyline and a marker on each point.
fn line(out: &mut String, s: &Series, color: &str, x: &Axis, y: &Axis) {
    let coords: Vec<(f64, f64)> = s
        .points
        .iter()
        .map(|&(px, py)| (x.pixel(px), y.pixel(py)))
        .collect();
    let path: Vec<String> = coords
        .iter()
        .map(|(a, b)| format!("{a:.1},{b:.1}"))
        .collect();
    let _ = writeln!(
        out,
        r#"<polyline class="series" points="{}" fill="none" stroke="{color}" stroke-width="2"/>"#,
        path.join(" ")
    );
    for (a, b) in coords {
        let _ = writeln!(
            out,
            r#"<circle cx="{a:.1}" cy="{b:.1}" r="3.5" fill="{color}"/>"#
        );
    }
}

/// The legend, in the plot's top-left corner.
fn legend(out: &mut String, chart: &Chart) {
    for (i, s) in chart.series.iter().enumerate() {
        let y = TOP + 18.0 + 18.0 * i as f64;
        let color = COLORS[i % COLORS.len()];
        let _ = writeln!(
            out,
            r#"<line x1="{0}" y1="{1}" x2="{2}" y2="{1}" stroke="{color}" stroke-width="2"/><text class="legend" x="{3}" y="{4}">{5}</text>"#,
            LEFT + 12.0,
            y,
            LEFT + 36.0,
            LEFT + 42.0,
            y + 4.0,
            escape(&s.name)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chart(series: Vec<Series>) -> Chart {
        Chart {
            title: "RSS <against> Nodes".into(),
            x_label: "Nodes".into(),
            y_label: "MiB".into(),
            series,
        }
    }

    /// The (x, y) pixel pairs of each polyline, in document order.
    fn polylines(svg: &str) -> Vec<Vec<(f64, f64)>> {
        svg.lines()
            .filter(|l| l.starts_with("<polyline"))
            .map(|l| {
                let pts = l
                    .split("points=\"")
                    .nth(1)
                    .unwrap()
                    .split('"')
                    .next()
                    .unwrap();
                pts.split(' ')
                    .map(|p| {
                        let (a, b) = p.split_once(',').unwrap();
                        (a.parse().unwrap(), b.parse().unwrap())
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn each_series_is_a_line_through_its_points_with_a_legend_entry() {
        let svg = svg(&chart(vec![
            Series {
                name: "webhook".into(),
                points: vec![(50.0, 12.0), (1000.0, 13.0), (65000.0, 40.0)],
            },
            Series {
                name: "apiserver & policy".into(),
                points: vec![(50.0, 300.0), (65000.0, 4000.0)],
            },
        ]))
        .unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        let lines = polylines(&svg);
        assert_eq!(lines.iter().map(Vec::len).collect::<Vec<_>>(), vec![3, 2]);
        // Left to right as x grows; up (smaller pixel y) as y grows.
        let w = &lines[0];
        assert!(w[0].0 < w[1].0 && w[1].0 < w[2].0);
        assert!(w[0].1 > w[1].1 && w[1].1 > w[2].1);
        // Both ends of the x range sit inside the frame.
        assert!(w[0].0 >= LEFT && w[2].0 <= WIDTH - RIGHT);
        assert_eq!(svg.matches("class=\"legend\"").count(), 2);
        assert!(svg.contains(">apiserver &amp; policy</text>"));
        assert!(svg.contains("RSS &lt;against&gt; Nodes"));
        for label in [">10<", ">100k<", ">1k<", ">5k<", ">10k<"] {
            assert!(svg.contains(label), "no tick {label}");
        }
    }

    #[test]
    fn equal_ratios_are_equal_distances_on_log_axes() {
        let a = Axis::covering(10.0, 100_000.0, 0.0, 400.0);
        let step = |lo: f64, hi: f64| a.pixel(hi) - a.pixel(lo);
        assert!((step(10.0, 100.0) - 100.0).abs() < 1e-9);
        assert!((step(1000.0, 10_000.0) - 100.0).abs() < 1e-9);
        assert_eq!(tick_label(65_000.0), "65k");
        assert_eq!(tick_label(2_500.0), "2.5k");
        assert_eq!(tick_label(0.5), "0.5");
        assert_eq!(tick_label(2e6), "2M");
    }

    #[test]
    fn charts_without_points_or_with_non_positive_ones_are_refused() {
        assert_eq!(svg(&chart(vec![])), Err(PlotError::NoPoints));
        let bad = Series {
            name: "s".into(),
            points: vec![(10.0, 0.0)],
        };
        assert!(matches!(
            svg(&chart(vec![bad])),
            Err(PlotError::NotPositive { .. })
        ));
        let nan = Series {
            name: "s".into(),
            points: vec![(f64::NAN, 1.0)],
        };
        assert!(matches!(
            svg(&chart(vec![nan])),
            Err(PlotError::NotPositive { .. })
        ));
    }
}
