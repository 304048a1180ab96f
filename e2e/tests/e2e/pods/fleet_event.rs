//! A fleet-wide event, small: the primary CNI rewrites every node's conflist at once (its
//! chained mesh plugin dropped, as a DaemonSet rollout of aws-node or Calico does), then writes
//! it back, while each node runs a meshed pod whose redirect rules stay intact.
//!
//! In: `MESHGATE_FLEET_EVENT_NODES` simulated nodes (10 in `make test`), each a stand-in Node
//! with its own CNI directory, a real `meshgate-agent` process and one ReplicaSet pod in a
//! network namespace with linkerd's rules. What the simulation shares that real nodes would
//! not: one host and its CPUs, one loopback apiserver, one clock; the rewrite is one loop over
//! the directories (microseconds apart). Out: every node re-tainted, then re-verified; the
//! time the whole fleet took for each; the apiserver's peak request rate in 1 s buckets (every
//! client's, the agents' included); 0 evictions and every original pod still running
//! (printed, and asserted).

use super::*;
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Node;
use kube::runtime::{WatchStreamExt, watcher};
use meshgate_e2e::sim::node::{tainted, verified_label};
use std::collections::HashSet;
use std::sync::Arc;

fn nodes() -> usize {
    std::env::var("MESHGATE_FLEET_EVENT_NODES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10)
}

/// The gate of each of the fleet's Nodes, as one watch sees it: name → (tainted, label).
type Gates = Arc<Mutex<BTreeMap<String, (bool, Option<String>)>>>;

/// Watches every Node (one watch, so the test adds no request per poll) into `gates`.
fn watch_gates(client: Client, names: HashSet<String>) -> (Gates, tokio::task::JoinHandle<()>) {
    let gates: Gates = Arc::default();
    let into = gates.clone();
    let task = tokio::spawn(async move {
        let api: Api<Node> = Api::all(client);
        let mut nodes = std::pin::pin!(
            watcher(api, watcher::Config::default())
                .default_backoff()
                .applied_objects()
        );
        while let Some(Ok(n)) = nodes.next().await {
            let name = n.name_any();
            if names.contains(&name) {
                let gate = (tainted(&n), verified_label(&n).map(str::to_owned));
                into.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(name, gate);
            }
        }
    });
    (gates, task)
}

/// Waits until every one of `n` Nodes is gated (`true`) or verified (`false`); how long.
async fn until_all(gates: &Gates, n: usize, gated: bool) -> anyhow::Result<Duration> {
    let began = Instant::now();
    let want = (gated, Some(if gated { "false" } else { "true" }.to_owned()));
    poll_until(
        &format!("all {n} nodes {}", if gated { "gated" } else { "verified" }),
        WAIT,
        || async {
            let g = gates.lock().unwrap_or_else(|p| p.into_inner());
            let done = g.len() == n && g.values().all(|v| *v == want);
            anyhow::Ok(done.then(|| began.elapsed()))
        },
    )
    .await
    .map_err(Into::into)
}

/// The apiserver's `apiserver_request_total`, summed over every series.
async fn requests_total(c: &Client) -> anyhow::Result<f64> {
    let text = crate::outage::apiserver_metrics(c).await?;
    Ok(text
        .lines()
        .filter(|l| l.starts_with("apiserver_request_total{"))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum())
}

/// Samples the apiserver's request rate every second until `stop`; the peak (requests/s, less
/// the sampler's own one).
fn sample_peak(
    c: Client,
    stop: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<f64> {
    tokio::spawn(async move {
        let (mut peak, mut last) = (0.0f64, requests_total(&c).await.unwrap_or(0.0));
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.tick().await;
        while !*stop.borrow() {
            tick.tick().await;
            if let Ok(now) = requests_total(&c).await {
                peak = peak.max(now - last - 1.0);
                last = now;
            }
        }
        peak
    })
}

#[tokio::test]
async fn a_fleet_wide_conflist_rewrite_re_gates_every_node_and_evicts_nothing() -> anyhow::Result<()>
{
    require_privileges()?;
    let n = nodes();
    let (mut scenes, mut keep) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let scene = Scene::new("fev").await?;
        let mut plan = Plan::new()?;
        plan.add("web", 1, Rules::Linkerd("iptables-nft"))?;
        let kubelet = cp().await.run_pods(&scene.node, plan.ip_source());
        scene
            .create_rs(&replica_set("web", &scene.node, 1, false)?)
            .await?;
        keep.push((plan, kubelet));
        scenes.push(scene);
    }
    let mut originals = Vec::new();
    for s in &scenes {
        originals.push(s.running_names("web", 1).await?);
    }
    let client = scenes[0].client.clone();
    let names: HashSet<String> = scenes.iter().map(|s| s.node.clone()).collect();
    let (gates, watch) = watch_gates(client.clone(), names);
    let agents: Vec<Agent> = scenes
        .iter()
        .map(|s| s.start_agent(&[]))
        .collect::<anyhow::Result<_>>()?;
    let result = async {
        until_all(&gates, n, false).await?;
        for a in &agents {
            wait_metric(a, REDIRECTED, |v| v >= 1.0).await?;
        }
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let sampler = sample_peak(client.clone(), stopped);
        // The rollout: every node's conflist rewritten without linkerd-cni, at once.
        let plain_conflist = golden("calico.conflist")?;
        for s in &scenes {
            s.dirs.config("10-calico.conflist", &plain_conflist)?;
        }
        let gated_in = until_all(&gates, n, true).await?;
        // And written back.
        let chained = golden("calico-linkerd.conflist")?;
        for s in &scenes {
            s.dirs.config("10-calico.conflist", &chained)?;
        }
        let verified_in = until_all(&gates, n, false).await?;
        // Every agent re-inspects on its own schedule: give an eviction every chance.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let _ = stop.send(true);
        let peak = sampler.await?;
        let mut evicted = 0.0;
        for a in &agents {
            evicted += metric(a, EVICTED).await;
        }
        let mut still = 0;
        for (s, names) in scenes.iter().zip(&originals) {
            still += s
                .app_pods("web")
                .await?
                .iter()
                .filter(|p| names.contains(&p.name_any()) && running(p))
                .count();
        }
        println!(
            "fleet-wide conflist rewrite on {n} nodes: all re-tainted in {gated_in:?}, all \
             re-verified {verified_in:?} after the write-back; apiserver peak {peak:.0} requests/s \
             (every client); {evicted} evictions; {still} of {n} original pods still running"
        );
        ensure!(evicted == 0.0, "pods with intact rules were evicted");
        ensure!(still == n, "{still} of {n} original pods still running");
        anyhow::Ok(())
    }
    .await;
    watch.abort();
    if result.is_err() {
        for a in &agents {
            eprintln!("--- agent log ---\n{}", tail(&a.log(), 30));
        }
    }
    result
}
