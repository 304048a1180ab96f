//! The figure of the gate's states in docs: the dashboard's "Gated nodes by reason" over
//! the story, as Prometheus answered the range query, drawn as an SVG step chart.
//!
//! In: the range query's series (one per reason), the story's start and the instants of its
//! steps (labels on the time axis). Out: the SVG text, written to [`PATH`] by the test when
//! [`ENV`] is set (`MESHGATE_WRITE_FIGURES=1`), so the committed figure can be regenerated.

use std::fmt::Write as _;

use meshgate_e2e::harness::prometheus::Series;

/// Where the figure lives, from the repository's root.
pub(super) const PATH: &str = "docs/figures/dashboard-gated-nodes.svg";
/// Set to regenerate the figure.
pub(super) const ENV: &str = "MESHGATE_WRITE_FIGURES";

const W: f64 = 720.0;
const H: f64 = 260.0;
const LEFT: f64 = 50.0;
const TOP: f64 = 30.0;
const PLOT_W: f64 = 520.0;
const PLOT_H: f64 = 150.0;
/// The range query's step, in seconds.
pub(super) const STEP: f64 = 1.0;
const COLORS: [&str; 4] = ["#d62728", "#ff7f0e", "#9467bd", "#8c564b"];

/// The SVG: each series a step line of its values (gated nodes, 0 where absent) over the Unix
/// seconds `start`..`end`, with the story's `steps` (seconds, name) marked under the time axis.
pub(super) fn svg(series: &[Series], start: f64, end: f64, steps: &[(f64, &str)]) -> String {
    let span = (end - start).max(1.0);
    let top = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(1.0_f64, f64::max);
    let x = |t: f64| LEFT + (t - start) / span * PLOT_W;
    let y = |v: f64| TOP + PLOT_H - v / top * PLOT_H;
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(out, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="{LEFT}" y="18" font-size="13">Gated nodes by reason (the dashboard's query, as Prometheus answered it in the e2e story)</text>"#
    );
    axes(&mut out, span, top, &y);
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        // A step line: each point holds for one step; a missing point is 0 (no node gated
        // for that reason then).
        let mut d = format!("M{:.1},{:.1}", x(start), y(0.0));
        let mut held = (start, 0.0);
        for &(t, v) in &s.points {
            if t - held.0 > STEP * 1.5 {
                let _ = write!(d, " L{:.1},{:.1}", x(held.0 + STEP), y(held.1));
                let _ = write!(d, " L{:.1},{:.1}", x(held.0 + STEP), y(0.0));
                let _ = write!(d, " L{:.1},{:.1}", x(t), y(0.0));
            } else {
                let _ = write!(d, " L{:.1},{:.1}", x(t), y(held.1));
            }
            let _ = write!(d, " L{:.1},{:.1}", x(t), y(v));
            held = (t, v);
        }
        let _ = write!(d, " L{:.1},{:.1}", x((held.0 + STEP).min(end)), y(held.1));
        let _ = write!(d, " L{:.1},{:.1}", x((held.0 + STEP).min(end)), y(0.0));
        let _ = write!(d, " L{:.1},{:.1}", x(end), y(0.0));
        let _ = writeln!(
            out,
            r#"<path d="{d}" fill="none" stroke="{color}" stroke-width="2"/>"#
        );
        let ly = TOP + 14.0 * i as f64;
        let _ = writeln!(
            out,
            r#"<text x="{:.0}" y="{ly:.0}" fill="{color}">{}</text>"#,
            LEFT + PLOT_W + 10.0,
            s.label("reason")
        );
    }
    for (i, (t, name)) in steps.iter().enumerate() {
        let tx = x(start + t);
        let ty = TOP + PLOT_H + 28.0 + 12.0 * (i % 3) as f64;
        let _ = writeln!(
            out,
            r##"<line x1="{tx:.1}" y1="{TOP}" x2="{tx:.1}" y2="{:.1}" stroke="#bbb" stroke-dasharray="3,3"/><text x="{tx:.1}" y="{ty:.1}" fill="#555">{name}</text>"##,
            ty - 10.0
        );
    }
    out.push_str("</svg>\n");
    out
}

/// The axes: seconds along the bottom, gated nodes up the side.
fn axes(out: &mut String, span: f64, top: f64, y: &dyn Fn(f64) -> f64) {
    let (x0, y0) = (LEFT, TOP + PLOT_H);
    let _ = writeln!(
        out,
        r##"<path d="M{x0},{TOP} L{x0},{y0} L{:.1},{y0}" fill="none" stroke="#333"/>"##,
        LEFT + PLOT_W
    );
    let _ = writeln!(
        out,
        r#"<text x="{:.0}" y="{:.0}" text-anchor="end">{top:.0}</text><text x="{:.0}" y="{:.0}" text-anchor="end">0</text>"#,
        x0 - 5.0,
        y(top) + 4.0,
        x0 - 5.0,
        y0 + 4.0
    );
    let _ = writeln!(
        out,
        r#"<text x="{:.0}" y="{:.0}" text-anchor="end">{span:.0} s</text>"#,
        LEFT + PLOT_W,
        y0 + 14.0
    );
}
