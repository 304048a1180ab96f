//! The fleet's figures for the table: rows beside the 50-Node baseline, the scale table, the
//! notes, and the plot of RSS against Nodes.
//!
//! In: the [`Step`]s of the pass (the baseline first) and the reading among Nodes twice as
//! large. Out: rows, a block and notes on the [`Table`], and the SVG file, whose path is
//! noted.

use super::*;
use meshgate_e2e::load::plot;

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

pub(super) fn report(
    table: &mut Table,
    steps: &[Step],
    double: Option<&Double>,
) -> anyhow::Result<()> {
    let base = steps.first().context("no size was measured")?;
    for s in steps.iter().skip(1) {
        rows(table, s, base);
    }
    table.blocks.push(scale_table(steps, base));
    notes(table, steps, base, double);
    let path = write_plot(steps, double)?;
    table.note(format!(
        "Fleet: RSS against Nodes drawn to {}.",
        path.display()
    ));
    eprintln!("fleet: plot written to {}", path.display());
    Ok(())
}

fn rows(table: &mut Table, s: &Step, base: &Step) {
    let (w, b) = (&s.webhook, &base.webhook);
    table.row(
        &format!(
            "webhook among {} Nodes: RSS once synced / time to sync from a cold start",
            s.nodes
        ),
        format!("{:.1} MiB / {}", mib(w.rss_kib), human(w.synced_in)),
        &format!("the same among {} Nodes, same run", base.nodes),
        format!("{:.1} MiB / {}", mib(b.rss_kib), human(b.synced_in)),
        format!(
            "{:.2}× / {}",
            w.rss_kib as f64 / b.rss_kib.max(1) as f64,
            ratio(w.synced_in, b.synced_in)
        ),
        if s.nodes >= 65_000 {
            "≤ 64 MiB at 65,000 Nodes"
        } else {
            ""
        },
        (s.nodes >= 65_000).then_some(mib(w.rss_kib) <= 64.0),
    );
    let (p50, p99) = (w.reviews.latency(0.5), w.reviews.latency(0.99));
    let (b50, b99) = (b.reviews.latency(0.5), b.reviews.latency(0.99));
    table.row(
        &format!(
            "webhook latency among {} Nodes, typical mix at {}/s, p50 / p99",
            s.nodes,
            env_num("MESHGATE_BENCH_FLEET_RATE", 2000)
        ),
        format!("{} / {}", human(p50), human(p99)),
        &format!("the same reviews' mix among {} Nodes, same run", base.nodes),
        format!("{} / {}", human(b50), human(b99)),
        format!("{} / {}", ratio(p50, b50), ratio(p99, b99)),
        "",
        None,
    );
    let a = &s.apiserver;
    table.row(
        &format!(
            "kube-apiserver RSS among {} Nodes: with the placement policy / without",
            s.nodes
        ),
        format!("{:.0} MiB", mib(a.rss_with_kib)),
        "the same apiserver before the policy was registered",
        format!("{:.0} MiB", mib(a.rss_without_kib)),
        format!("{:+.1} MiB", mib(a.rss_with_kib) - mib(a.rss_without_kib)),
        "",
        None,
    );
    let (p50, p99) = (a.policy.latency(0.5), a.policy.latency(0.99));
    let (n50, n99) = (a.none.latency(0.5), a.none.latency(0.99));
    table.row(
        &format!(
            "pod CREATE (dry run) at 100/s among {} Nodes, {GATED} gated, p50 / p99, with the placement policy",
            s.nodes
        ),
        format!("{} / {}", human(p50), human(p99)),
        "same requests, a namespace the policy does not select, same run",
        format!("{} / {}", human(n50), human(n99)),
        format!("{} / {}", ratio(p50, n50), ratio(p99, n99)),
        "",
        None,
    );
}

/// One line a size: the figures of docs/performance.md's scale table.
fn scale_table(steps: &[Step], base: &Step) -> String {
    let mut out = String::from(
        "Fleet (each size's review latency beside the first row's, same run):\n\n\
         | Nodes | webhook RSS (peak) | sync from cold start | review p50 / p99 | × first row | apiserver RSS without / with the policy | params cost | policy: dry-run p50 / p99 with / without | etcd RSS |\n\
         |---|---|---|---|---|---|---|---|---|\n",
    );
    for s in steps {
        let (w, a) = (&s.webhook, &s.apiserver);
        let (p50, p99) = (w.reviews.latency(0.5), w.reviews.latency(0.99));
        let (b50, b99) = (
            base.webhook.reviews.latency(0.5),
            base.webhook.reviews.latency(0.99),
        );
        out.push_str(&format!(
            "| {} | {:.1} MiB ({:.1}) | {} | {} / {} | {} / {} | {:.0} / {:.0} MiB | {:+.0} MiB | {} / {}; {} / {} | {:.0} MiB |\n",
            s.nodes,
            mib(w.rss_kib),
            mib(w.hwm_kib),
            human(w.synced_in),
            human(p50),
            human(p99),
            ratio(p50, b50),
            ratio(p99, b99),
            mib(a.rss_without_kib),
            mib(a.rss_with_kib),
            mib(a.rss_with_kib) - mib(a.rss_without_kib),
            human(a.policy.latency(0.5)),
            human(a.policy.latency(0.99)),
            human(a.none.latency(0.5)),
            human(a.none.latency(0.99)),
            mib(a.etcd_rss_kib),
        ));
    }
    out
}

/// Bytes of RSS per Node added between `base` and `s`.
fn per_node(rss: u64, base_rss: u64, nodes: usize, base_nodes: usize) -> f64 {
    (rss as f64 - base_rss as f64) * 1024.0 / (nodes.saturating_sub(base_nodes).max(1)) as f64
}

fn notes(table: &mut Table, steps: &[Step], base: &Step, double: Option<&Double>) {
    for s in steps {
        table.note(format!(
            "Fleet at {} Nodes: {} registered in {:.1} s ({:.0}/s, {PARALLEL} creates at a time); a Node is {:.1} KB as served (JSON, managed fields included); {} MiB of memory available after the step; the webhook cached {} Nodes, {} reviews, {}.",
            s.nodes,
            s.creation.created,
            s.creation.took.as_secs_f64(),
            s.creation.rate(),
            s.object_bytes as f64 / 1000.0,
            s.available_mib,
            s.webhook.cached,
            s.webhook.reviews.samples.len(),
            s.webhook.server,
        ));
    }
    if let Some(last) = steps.last().filter(|l| l.nodes > base.nodes) {
        table.note(format!(
            "Fleet, growth per Node from {} to {} Nodes (objects of {:.1} KB): webhook {:.0} B of RSS per Node; kube-apiserver {:.1} KB without the policy, {:.1} KB with it.",
            base.nodes,
            last.nodes,
            last.object_bytes as f64 / 1000.0,
            per_node(last.webhook.rss_kib, base.webhook.rss_kib, last.nodes, base.nodes),
            per_node(last.apiserver.rss_without_kib, base.apiserver.rss_without_kib, last.nodes, base.nodes) / 1024.0,
            per_node(last.apiserver.rss_with_kib, base.apiserver.rss_with_kib, last.nodes, base.nodes) / 1024.0,
        ));
    }
    if let Some(d) = double {
        let same = steps.iter().find(|s| s.nodes == d.nodes);
        table.note(format!(
            "Fleet, Nodes twice as large: among {} Nodes of {:.1} KB (registered in {:.1} s on a control plane of their own) the webhook synced in {} and holds {:.1} MiB (peak {:.1}); among as many of {:.1} KB in the pass: {}.",
            d.nodes,
            d.object_bytes as f64 / 1000.0,
            d.creation.took.as_secs_f64(),
            human(d.webhook.synced_in),
            mib(d.webhook.rss_kib),
            mib(d.webhook.hwm_kib),
            same.map_or(0.0, |s| s.object_bytes as f64 / 1000.0),
            same.map_or("not measured".into(), |s| format!(
                "{:.1} MiB (peak {:.1})",
                mib(s.webhook.rss_kib),
                mib(s.webhook.hwm_kib)
            )),
        ));
    }
}

fn write_plot(steps: &[Step], double: Option<&Double>) -> anyhow::Result<PathBuf> {
    let line = |name: &str, f: &dyn Fn(&Step) -> u64| plot::Series {
        name: name.into(),
        points: steps.iter().map(|s| (s.nodes as f64, mib(f(s)))).collect(),
    };
    let mut series = vec![
        line("meshgate-webhook", &|s| s.webhook.rss_kib),
        line("kube-apiserver without the placement policy", &|s| {
            s.apiserver.rss_without_kib
        }),
        line("kube-apiserver with the placement policy", &|s| {
            s.apiserver.rss_with_kib
        }),
    ];
    if let Some(d) = double {
        series.push(plot::Series {
            name: "meshgate-webhook, Nodes twice as large".into(),
            points: vec![(d.nodes as f64, mib(d.webhook.rss_kib))],
        });
    }
    let svg = plot::svg(&plot::Chart {
        title: "Resident memory against Node objects (kubelet-less GKE-sized Nodes)".into(),
        x_label: "Nodes (log scale)".into(),
        y_label: "RSS, MiB (log scale)".into(),
        series,
    })?;
    plot::save(
        "MESHGATE_BENCH_FLEET_SVG",
        "target/bench/fleet-rss.svg",
        &svg,
    )
}
