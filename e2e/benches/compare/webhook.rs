//! Webhook: 5,000 cached Nodes, latency and throughput on loopback.

use super::*;

/// `meshgate_admission_duration_seconds` buckets as (upper bound, cumulative count).
pub(super) fn histogram(metrics: &str) -> Vec<(f64, f64)> {
    metrics
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("meshgate_admission_duration_seconds_bucket{le=\"")?;
            let (le, count) = rest.split_once("\"} ")?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, count.trim().parse().ok()?))
        })
        .collect()
}

/// The upper bound of the bucket holding quantile `p` of the observations between two
/// scrapes: the webhook's own handling time, without TLS, the network or the client.
pub(super) fn server_quantile(before: &[(f64, f64)], after: &[(f64, f64)], p: f64) -> String {
    let diff: Vec<(f64, f64)> = after
        .iter()
        .map(|(le, n)| {
            (
                *le,
                n - before.iter().find(|(l, _)| l == le).map_or(0.0, |b| b.1),
            )
        })
        .collect();
    let total = diff.last().map_or(0.0, |d| d.1);
    match diff.iter().find(|(_, n)| *n >= p * total) {
        Some((le, _)) if le.is_finite() => format!("≤ {}", human(Duration::from_secs_f64(*le))),
        Some(_) => "> the largest bucket".into(),
        None => "no observations".into(),
    }
}

pub(super) async fn run(
    cp: &ControlPlane,
    client: &Client,
    ns: &str,
    nodes_created: Duration,
    table: &mut Table,
) -> anyhow::Result<()> {
    eprintln!("webhook: 5,000 cached nodes, load at 2,000/s, 5,000/s and saturation ...");
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    pods.create(&PostParams::default(), &pending_meshed_pod("pending"))
        .await?;
    // SAFETY of set_var: see agent_log.
    unsafe { std::env::set_var("MESHGATE_WEBHOOK_LOG", "warn") };
    let mut hook = WebhookProcess::start(cp.admin_kubeconfig_path(), &[])?;
    let synced = hook.wait_ready(Duration::from_secs(120)).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (rss_idle, _) = hook.rss_kib().unwrap_or((0, 0));
    let (runs, sat) = loads(&hook, ns).await?;
    let (rss_after, hwm) = hook.rss_kib().unwrap_or((0, 0));
    drop(hook);

    let rss_mib = rss_idle as f64 / 1024.0;
    table.row(
        "webhook RSS, 5,000 Nodes cached (idle)",
        format!("{rss_mib:.1} MiB"),
        "—",
        "—".into(),
        "—".into(),
        "≤ 32 MiB",
        Some(rss_mib <= 32.0),
    );
    latency_rows(table, &runs, &sat);
    table.note(format!(
        "Webhook: release binary, 4,500 verified and 500 unverified Nodes (created {:.1} s before; caches synced {:.1} s after start). Typical mix: 60% meshed pods on verified nodes, 30% plain pods, 10% bindings to verified nodes, all answered from the caches. Refusal-heavy mix: 40% meshed pods on verified nodes, 30% meshed pods on unverified nodes and 10% bindings of a pending meshed pod to them (refused; each refusal reads the node's condition reason with a GET remembered 5 s per node, and 500 distinct nodes often miss), 20% plain pods. Pod reviews are ~3 KB, sent over TLS on loopback from this process (open loop; latency from each request's due time). {}. Saturation (typical mix): {}. The load generator, the webhook, the apiserver and etcd share the 2 CPUs; the controller manager was frozen (SIGSTOP) for this section, since its node-lifecycle work on 5,000 kubelet-less Nodes is an artifact of the rig. RSS {:.1} MiB idle, {:.1} MiB after the load (peak {:.1} MiB).",
        nodes_created.as_secs_f64(),
        synced.as_secs_f64(),
        runs.iter()
            .map(|(name, r, server)| format!("{name}: {}; {server}", r.summary()))
            .collect::<Vec<_>>()
            .join(". "),
        sat.summary(),
        rss_idle as f64 / 1024.0,
        rss_after as f64 / 1024.0,
        hwm as f64 / 1024.0,
    ));
    Ok(())
}

/// The two mixes of 4,000 reviews: typical, what a cluster sends all day, answered from the
/// caches (meshed pods on verified nodes, plain pods anywhere, bindings to verified nodes);
/// and refusal-heavy, 40% refusals spread over the 500 unverified nodes, each reading the
/// node's condition reason for its message (a bounded GET, remembered 5 s per node).
fn mixes(ns: &str) -> (Vec<Review>, Vec<Review>) {
    let mut typical: Vec<Review> = Vec::new();
    let mut refusals: Vec<Review> = Vec::new();
    for i in 0..4000 {
        let uid = format!("bench-{i}");
        let (v, u) = (format!("wh-v-{}", i % 4500), format!("wh-u-{}", i % 500));
        typical.push(match i % 10 {
            0..=5 => review::pod_review(&uid, &v, true, true),
            6 | 7 => review::pod_review(&uid, &u, false, true),
            8 => review::pod_review(&uid, &v, false, true),
            _ => review::binding_review(&uid, ns, "pending", &v, true),
        });
        refusals.push(match i % 10 {
            0..=3 => review::pod_review(&uid, &v, true, true),
            4..=6 => review::pod_review(&uid, &u, true, false),
            7 | 8 => review::pod_review(&uid, &u, false, true),
            _ => review::binding_review(&uid, ns, "pending", &u, false),
        });
    }
    (typical, refusals)
}

/// One load run: its name, report, and the server-side handling quantiles.
type Run = (&'static str, review::Report, String);

/// After a warm-up, each mix at its rate for `MESHGATE_BENCH_LOAD_SECS`, with the webhook's
/// own handling time from its histogram; then the typical mix at saturation.
async fn loads(hook: &WebhookProcess, ns: &str) -> anyhow::Result<(Vec<Run>, review::Report)> {
    let connector = review::tls_connector(&hook.ca_der)?;
    let (typical, refusals) = mixes(ns);
    let (typical, refusals) = (Arc::new(typical), Arc::new(refusals));
    let spec =
        |reviews: &Arc<Vec<Review>>, rate: f64, secs: f64, connections: usize| review::Spec {
            addr: hook.listen,
            path: "/validate".into(),
            connector: connector.clone(),
            reviews: reviews.clone(),
            rate,
            duration: Duration::from_secs_f64(secs),
            connections,
        };
    // Warm up (connections, first refusal-reason lookups).
    let warm = review::run(spec(&refusals, 500.0, 2.0, 8)).await?;
    if !warm.errors().is_empty() {
        bail!(
            "webhook warm-up errors: {:?}\n{}",
            warm.errors().first(),
            hook.log()
        );
    }
    let secs = env_num("MESHGATE_BENCH_LOAD_SECS", 10) as f64;
    let scrape = || async {
        histogram(
            &hook
                .admin_get("/metrics")
                .await
                .map(|r| r.1)
                .unwrap_or_default(),
        )
    };
    let mut runs = Vec::new();
    for (name, reviews, rate, connections) in [
        ("typical mix at 2,000/s", &typical, 2000.0, 16),
        ("typical mix at 5,000/s", &typical, 5000.0, 32),
        ("refusal-heavy mix at 2,000/s", &refusals, 2000.0, 16),
    ] {
        let before = scrape().await;
        let r = review::run(spec(reviews, rate, secs, connections)).await?;
        let after = scrape().await;
        let server = format!(
            "server-side handling p50 {}, p99 {}",
            server_quantile(&before, &after, 0.5),
            server_quantile(&before, &after, 0.99)
        );
        eprintln!("  {name}: {}; {server}", r.summary());
        runs.push((name, r, server));
    }
    let sat = review::run(spec(&typical, 30000.0, 5.0, 64)).await?;
    Ok((runs, sat))
}

/// Each run's latency, the goal judged on the typical mix at 2,000/s, and the saturation
/// throughput.
fn latency_rows(table: &mut Table, runs: &[Run], sat: &review::Report) {
    for (name, r, _) in runs {
        let (p50, p99) = (r.latency(0.5), r.latency(0.99));
        let goal = *name == "typical mix at 2,000/s";
        table.row(
            &format!("webhook latency, {name}, p50 / p99"),
            format!("{} / {}", human(p50), human(p99)),
            "—",
            "—".into(),
            "—".into(),
            if goal { "p99 ≤ 2 ms at 2,000/s" } else { "" },
            goal.then_some(p99 <= Duration::from_millis(2) && r.errors().is_empty()),
        );
    }
    table.row(
        "webhook throughput at saturation (typical mix, 30,000/s offered)",
        format!("{:.0}/s", sat.throughput()),
        "—",
        "—".into(),
        "—".into(),
        "",
        None,
    );
}
