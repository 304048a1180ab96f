//! The report as `kubectl meshgate status` prints it by default: a node table, then one
//! section per question (pods without redirects, evictions, unknown pods, webhook, mode, the
//! agent's grants), then the warnings.
//!
//! In: a [`Report`] and the clock (ages are relative to it). Out: text. Messages and notes
//! are the agents' own and cut to one line; `-o json` carries them whole.

use std::fmt::Write as _;
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;

use super::{PodEvent, Report};

/// Pod rows printed per section; `-o json` lists them all.
pub const MAX_POD_ROWS: usize = 20;
/// Characters of a message or note printed in a cell.
const MAX_CELL_CHARS: usize = 80;

/// The whole table.
pub fn render(report: &Report, now: Timestamp) -> String {
    let mut out = String::new();
    nodes(&mut out, report, now);
    pods(
        &mut out,
        "PODS WITHOUT REDIRECTS (MeshRedirectMissing Events still in the API)",
        &report.missing_pods,
        now,
    );
    let window = human(Duration::from_secs(report.evictions.window_seconds));
    let _ = writeln!(
        out,
        "\nEVICTIONS IN THE LAST {window}: {}",
        report.evictions.count
    );
    if !report.evictions.pods.is_empty() {
        pods(&mut out, "EVICTED PODS", &report.evictions.pods, now);
    }
    out.push_str(
        "\nPODS JUDGED UNKNOWN: not in the API (the agent publishes no Event for them; see \
         meshgate_pod_inspections_total{verdict=\"unknown\"} on the agents' /metrics)\n",
    );
    if let Some(w) = &report.webhook {
        let _ = writeln!(out, "\nWEBHOOK: {} ({})", w.state, one_line(&w.detail, 200));
    }
    if let Some(m) = &report.mode {
        let _ = writeln!(out, "MODE: {} ({})", m.mode, m.source);
    }
    if let Some(a) = &report.agent_access {
        let _ = writeln!(
            out,
            "AGENT GRANTS: {} ({}; {} gate: {})",
            a.grants.name(),
            a.reach(),
            super::access::GATE,
            a.gate.name()
        );
        if let Some(w) = &a.warning {
            let _ = writeln!(out, "WARNING: {w}");
        }
    }
    for list in &report.truncated {
        let _ = writeln!(
            out,
            "WARNING: the {list} list was cut at its bound; the report covers only what was read"
        );
    }
    out
}

fn nodes(out: &mut String, report: &Report, now: Timestamp) {
    let gated = report.nodes.iter().filter(|n| n.gated).count();
    let _ = writeln!(
        out,
        "NODES: {} ({gated} gated; taint {})",
        report.nodes.len(),
        report.taint_key
    );
    let mut rows = vec![
        [
            "NODE",
            "GATED",
            "TAINT",
            "LABEL",
            "REASON",
            "SINCE",
            "LAST UNTAINT",
            "MESSAGE",
        ]
        .map(String::from),
    ];
    for n in &report.nodes {
        let untaint = n.last_untaint.as_ref().map_or_else(
            || "-".into(),
            |u| format!("{}ms ({} ago)", u.latency_ms, age(&u.at, now)),
        );
        rows.push([
            n.name.clone(),
            if n.gated { "yes" } else { "no" }.into(),
            n.taint.clone().unwrap_or_else(|| "-".into()),
            n.label.clone().unwrap_or_else(|| "-".into()),
            n.reason.clone(),
            n.since
                .as_deref()
                .map_or_else(|| "-".into(), |s| age(s, now)),
            untaint,
            one_line(n.message.as_deref().unwrap_or("-"), MAX_CELL_CHARS),
        ]);
    }
    columns(out, &rows);
}

fn pods(out: &mut String, title: &str, pods: &[PodEvent], now: Timestamp) {
    let _ = writeln!(out, "\n{title}: {}", pods.len());
    if pods.is_empty() {
        return;
    }
    let mut rows =
        vec![["NAMESPACE", "POD", "NODE", "ACTION", "LAST SEEN", "NOTE"].map(String::from)];
    for p in pods.iter().take(MAX_POD_ROWS) {
        rows.push([
            p.namespace.clone(),
            p.name.clone(),
            p.node.clone().unwrap_or_else(|| "-".into()),
            p.action.clone(),
            format!("{} ago", age(&p.last_seen, now)),
            one_line(&p.note, MAX_CELL_CHARS),
        ]);
    }
    columns(out, &rows);
    if pods.len() > MAX_POD_ROWS {
        let _ = writeln!(
            out,
            "... and {} more (-o json lists them all)",
            pods.len() - MAX_POD_ROWS
        );
    }
}

/// Left-aligned columns, three spaces apart, as kubectl prints them.
fn columns<const N: usize>(out: &mut String, rows: &[[String; N]]) {
    let mut widths = [0usize; N];
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    for row in rows {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            if i + 1 == N {
                line.push_str(cell);
            } else {
                let pad = widths[i] - cell.chars().count();
                let _ = write!(line, "{cell}{}   ", " ".repeat(pad));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
}

/// `text` on one line, cut to `max` characters with `…`.
fn one_line(text: &str, max: usize) -> String {
    let flat: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if flat.chars().count() <= max {
        return flat;
    }
    let mut cut: String = flat.chars().take(max - 1).collect();
    cut.push('…');
    cut
}

/// How long before `now` the RFC 3339 time `at` was (`?` when it does not parse).
fn age(at: &str, now: Timestamp) -> String {
    let Ok(at) = at.parse::<Timestamp>() else {
        return "?".into();
    };
    let secs = now.as_second().saturating_sub(at.as_second()).max(0);
    human(Duration::from_secs(secs.unsigned_abs()))
}

/// A duration as kubectl prints ages: `45s`, `12m`, `5h`, `3d`.
fn human(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..120 => format!("{s}s"),
        120..7200 => format!("{}m", s / 60),
        7200..172_800 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86_400),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_as_kubectl_prints_them() {
        assert_eq!(human(Duration::from_secs(45)), "45s");
        assert_eq!(human(Duration::from_secs(3600)), "60m");
        assert_eq!(human(Duration::from_secs(5 * 3600)), "5h");
        assert_eq!(human(Duration::from_secs(3 * 86_400)), "3d");
        let now: Timestamp = "2026-11-26T12:00:00Z".parse().unwrap();
        assert_eq!(age("2026-11-26T11:55:00Z", now), "5m");
        assert_eq!(age("not a time", now), "?");
        // A clock behind the API's reads as no time at all, never negative.
        assert_eq!(age("2026-11-26T12:00:09Z", now), "0s");
    }

    #[test]
    fn cells_are_one_line_and_bounded() {
        assert_eq!(one_line("a\nb\tc", 10), "a b c");
        assert_eq!(one_line(&"é".repeat(100), 5), "éééé…");
    }
}
