//! The chart's Grafana dashboard and its alerts, evaluated on real data.
//!
//! In: a real agent for a simulated node (host process, real CNI files, real network
//! namespaces for its pods), the in-process webhook behind the shipped configurations
//! ([`Fixture`]), both reading their mode from a namespace of this test, and a real
//! Prometheus (`/usr/bin/prometheus`) scraping the agent's and the webhook's `/metrics` every
//! second with the labels the chart's PodMonitors give them (`job`, `node`, `namespace`), and
//! the apiserver's `/metrics` with the admin client certificate. Out: every query of
//! `dashboards/meshgate.json` and every alert expression of the rendered PrometheusRule,
//! evaluated through Prometheus' HTTP API at each step of a story and checked for the series
//! (labels, and values where they mean something) that step must produce; a query or alert
//! never seen with data fails the test, but `MeshgateNodeGatedWithoutAgent`, which reads
//! kube-state-metrics (not run here), and `MeshgateClusterEvictionBudgetSpent`, which needs a
//! fleet whose eviction budget is spent (`pods::fleet_budget` produces its series); both
//! expressions are still evaluated, so they must parse.
//! With `MESHGATE_WRITE_FIGURES=1`, the test also writes the figure of docs
//! ([`figure::PATH`]) from the range query of gated nodes over the story.
//!
//! The story: the agent starts before its Node exists (API errors); the Node is registered
//! and gated; the webhook refuses meshed pods there; the chain is completed (untaint), broken
//! (re-taint) and completed again; a pod without redirects is evicted and another is held by
//! its PodDisruptionBudget; report mode; an invalid mode; the webhook stops (its entries fail
//! open); the agent is killed, then its target removed.

mod figure;
mod queries;
mod story;

use std::net::SocketAddr;
use std::time::Duration;

use meshgate_e2e::harness::prometheus::{Prometheus, Target};

use crate::cp;
use crate::webhook::Fixture;

/// The test's scrape interval.
const SCRAPE: Duration = Duration::from_secs(1);

/// The alert whose series cannot be produced here: kube-state-metrics is not running.
const NEEDS_KUBE_STATE_METRICS: &str = "alert MeshgateNodeGatedWithoutAgent";
/// The alert whose series needs a fleet whose eviction budget is spent, which this story's
/// one node does not play: `pods::fleet_budget` reads the very series it sums
/// (`meshgate_evictions_skipped_total{why="cluster_budget"}`) from real agents, and its
/// promtool test fires it.
const NEEDS_A_SPENT_FLEET: &str = "alert MeshgateClusterEvictionBudgetSpent";

/// The scrape targets: the agent (as the agent PodMonitor labels it), the webhook at
/// `webhook` (as the webhook PodMonitor labels it), and the apiserver (as
/// kube-prometheus-stack does).
fn targets(s: &story::Story, webhook: SocketAddr, with_agent: bool) -> Vec<Target> {
    let cp = s.cp;
    // Without the agent: its job stays, without a target, so its series go stale.
    let agent = if with_agent {
        s.agent.admin.to_string()
    } else {
        String::new()
    };
    vec![
        Target {
            address: agent,
            job: "meshgate-agent".into(),
            labels: vec![
                ("namespace".into(), s.mode_ns.clone()),
                ("node".into(), s.node.clone()),
            ],
            tls: None,
        },
        Target {
            address: webhook.to_string(),
            job: "meshgate-webhook".into(),
            labels: vec![
                ("namespace".into(), s.mode_ns.clone()),
                ("node".into(), "e2e-host".into()),
                ("pod".into(), "meshgate-webhook-e2e".into()),
            ],
            tls: None,
        },
        Target {
            address: cp.apiserver_url().trim_start_matches("https://").to_owned(),
            job: "apiserver".into(),
            labels: Vec::new(),
            tls: Some((
                cp.ca_path().to_owned(),
                cp.pki().admin.cert.clone(),
                cp.pki().admin.key.clone(),
            )),
        },
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_panel_and_alert_answers_on_real_data() -> anyhow::Result<()> {
    let cp = cp().await;
    let (mode_ns, mut f) = story::webhook(cp).await?;
    let began = std::time::Instant::now();
    let result = match story::Story::new(cp, mode_ns) {
        Ok(mut s) => story_on(&mut s, &mut f).await,
        Err(e) => Err(e),
    };
    f.teardown().await;
    result?;
    println!(
        "dashboard test: {:.1} s after the webhook was up",
        began.elapsed().as_secs_f64()
    );
    Ok(())
}

async fn story_on(s: &mut story::Story, f: &mut Fixture) -> anyhow::Result<()> {
    let prom = Prometheus::start(&targets(s, f.admin(), true), SCRAPE).await?;
    let mut c = queries::Checker::new(&prom).await?;
    let mut steps = vec![(s.elapsed(), "start")];
    s.node_missing(&mut c).await?;
    steps.push((s.elapsed(), "gated"));
    s.gated(&mut c).await?;
    steps.push((s.elapsed(), "refusals"));
    s.refusals(&mut c, f).await?;
    steps.push((s.elapsed(), "verified"));
    s.verified(&mut c).await?;
    steps.push((s.elapsed(), "drift"));
    s.drift(&mut c).await?;
    steps.push((s.elapsed(), "pods"));
    s.pods(&mut c).await?;
    steps.push((s.elapsed(), "report"));
    s.report_mode(&mut c).await?;
    steps.push((s.elapsed(), "invalid"));
    s.invalid_mode(&mut c).await?;
    let span = (steps[0].0, s.elapsed());
    story::figure(s, &c, &prom, span, &steps).await?;
    s.webhook_down(&mut c, f).await?;
    s.agent_down(&mut c).await?;
    prom.reload(&targets(s, f.admin(), false)).await?;
    let agent = [("job", "meshgate-agent")];
    let absent = c.series("alert MeshgateAgentAbsent", &agent, |v| v == 1.0);
    if let Err(e) = absent.await {
        let up = prom.query("up").await;
        let log = meshgate_e2e::sim::node::tail(&prom.log(), 20);
        anyhow::bail!("{e:#}\nup: {up:?}\n--- prometheus ---\n{log}");
    }
    // Evaluated (so it parses) but without data: kube-state-metrics is not running here.
    c.empty(NEEDS_KUBE_STATE_METRICS).await?;
    c.empty(NEEDS_A_SPENT_FLEET).await?;
    let unproven = c.unproven(&[NEEDS_KUBE_STATE_METRICS, NEEDS_A_SPENT_FLEET]);
    anyhow::ensure!(unproven.is_empty(), "never seen with data: {unproven:?}");
    Ok(())
}
