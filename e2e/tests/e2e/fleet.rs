//! The fleet: many node gates at once against the real apiserver, simulated in this process.
//!
//! `mass_eviction_stops_at_the_cluster_budget`: `MESHGATE_FLEET_NODES` simulated nodes (50 in
//! `make test`; the figures in docs/performance.md are from 1,000), each with one running pod
//! whose redirects are missing, all deciding to evict at the same moment. Each node gate is
//! the agent's own code path from the node's decision on: its `ClusterBudget` (its own
//! instance, as each agent process has) and the Eviction API call (`pods::eviction::evict`,
//! UID precondition included). What the simulation shares that real nodes would not: one
//! process, one HTTP client and its connection pool to the apiserver, one clock. Out: at most
//! the budget evicted, every other eviction deferred, the ledger's entries, the time the fleet
//! took and its request rate (printed).

use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::ResourceExt;
use kube::api::{Api, ListParams, PostParams};
use meshgate_agent::daemon::pods::cluster_budget::ClusterBudget;
use meshgate_agent::daemon::pods::eviction::{self, Answer};
use meshgate_core::cluster_budget::{Budget, CONFIGMAP, KEY};
use meshgate_e2e::sim::pod::meshed_pod;
use serde_json::json;

use crate::cp;

fn nodes() -> usize {
    std::env::var("MESHGATE_FLEET_NODES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mass_eviction_stops_at_the_cluster_budget() -> anyhow::Result<()> {
    let cp = cp().await;
    let client = cp.client()?;
    let ns = cp.create_namespace(&client, "fleet").await?;
    let n = nodes();
    let budget = Budget::new((n / 5).max(1) as u32, Duration::from_secs(600))?;
    let ledger: ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": CONFIGMAP}, "data": {KEY: ""}}))?;
    let configmaps: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    configmaps.create(&PostParams::default(), &ledger).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let created: Vec<anyhow::Result<Pod>> = futures::stream::iter(0..n)
        .map(|i| {
            let pods = pods.clone();
            async move {
                let pod = meshed_pod(&format!("p-{i}"), &format!("fleet-node-{i}"), &[], Some(0));
                Ok(pods.create(&PostParams::default(), &pod).await?)
            }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    let created: Vec<Pod> = created.into_iter().collect::<anyhow::Result<_>>()?;

    // Every node gate at once: take from the budget, then evict its pod.
    let began = Instant::now();
    let outcomes: Vec<Result<Answer, String>> = futures::stream::iter(created)
        .map(|pod| {
            let gate = ClusterBudget::new(client.clone(), &ns, budget, Duration::from_secs(10));
            let client = client.clone();
            async move {
                gate.take().await.map_err(|d| d.why)?;
                let (ns, name) = (pod.namespace().unwrap_or_default(), pod.name_any());
                let uid = pod.uid().unwrap_or_default();
                Ok(eviction::evict(&client, &ns, &name, &uid, Duration::from_secs(10)).await)
            }
        })
        .buffer_unordered(n)
        .collect()
        .await;
    let took = began.elapsed();

    let evicted = outcomes
        .iter()
        .filter(|o| matches!(o, Ok(Answer::Evicted)))
        .count();
    let spent = outcomes
        .iter()
        .filter(|o| matches!(o, Err(why) if why.contains("budget is spent")))
        .count();
    let other: Vec<&Result<Answer, String>> = outcomes
        .iter()
        .filter(|o| {
            !matches!(o, Ok(Answer::Evicted))
                && !matches!(o, Err(w) if w.contains("budget is spent"))
        })
        .collect();
    let stored = configmaps.get(CONFIGMAP).await?;
    let entries = stored
        .data
        .and_then(|d| d.get(KEY).cloned())
        .unwrap_or_default();
    let entries = entries.split(',').filter(|e| !e.is_empty()).count();
    // Evicted pods without a kubelet and with grace period 0 are deleted at once.
    let left = pods.list(&ListParams::default()).await?.items.len();
    let deleted = n - left;
    println!(
        "fleet of {n} node gates, budget {}: {evicted} evicted, {spent} deferred (spent), {} otherwise deferred ({:?}), in {:.2} s; ledger {entries} entries; pods deleted: {deleted}",
        budget.evictions,
        other.len(),
        other.first(),
        took.as_secs_f64()
    );
    ensure!(
        evicted <= budget.evictions as usize,
        "{evicted} evicted over a budget of {}",
        budget.evictions
    );
    ensure!(
        entries == evicted,
        "the ledger holds {entries} entries for {evicted} evictions"
    );
    ensure!(
        deleted == evicted,
        "{deleted} pods deleted for {evicted} evictions"
    );
    // Contention past the retries defers too (fail safe), as a busy budget.
    ensure!(
        other
            .iter()
            .all(|o| matches!(o, Err(w) if w.contains("is contended"))),
        "unexpected outcomes: {other:?}"
    );
    ensure!(evicted >= 1, "nothing evicted at all");
    let _ = cp
        .kubectl(&["delete", "namespace", &ns, "--wait=false"])
        .await
        .context("cleanup")?;
    Ok(())
}
