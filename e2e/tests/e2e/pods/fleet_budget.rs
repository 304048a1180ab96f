//! The cluster-wide eviction budget held by two real agents on two nodes, against the real
//! apiserver: every pod on both nodes lacks its redirect rules, the budget allows one
//! eviction, so exactly one pod is evicted in the whole "fleet" and every other is deferred
//! with an Event that says why. Before the ledger exists, nothing is evicted (fail safe).

use super::*;
use k8s_openapi::api::core::v1::ConfigMap;
use meshgate_core::cluster_budget::{CONFIGMAP, KEY};
use meshgate_core::field_manager;
use meshgate_e2e::sim::node::{Managed, managed_fields, owners};

/// The agents' flags: budget 1 per 10 minutes, the ledger in `ns`.
fn budget_flags(ns: &str) -> Vec<String> {
    ["--profile", "linkerd", "--cluster-eviction-budget", "1"]
        .iter()
        .map(|s| s.to_string())
        .chain(["--cluster-eviction-budget-window".into(), "10m".into()])
        .chain(["--namespace".into(), ns.to_owned()])
        .collect()
}

/// A node with two pods without rules, running (their replacements get rules): the scene,
/// what keeps the pods' namespaces and the kubelet stand-in alive, and the pods' names.
async fn node_with_pods(prefix: &str) -> anyhow::Result<(Scene, (Plan, impl Drop), Vec<String>)> {
    let scene = Scene::new(prefix).await?;
    let mut plan = Plan::new()?;
    plan.add("web", 2, Rules::None)?;
    plan.add("web", 2, Rules::Linkerd("iptables-nft"))?;
    let kubelet = cp().await.run_pods(&scene.node, plan.ip_source());
    scene
        .create_rs(&replica_set("web", &scene.node, 2, false)?)
        .await?;
    let names = scene.running_names("web", 2).await?;
    Ok((scene, (plan, kubelet), names))
}

#[tokio::test]
async fn the_cluster_budget_holds_across_nodes_and_fails_safe() -> anyhow::Result<()> {
    let (a, _keep_a, names_a) = node_with_pods("fleet-a").await?;
    let (b, _keep_b, names_b) = node_with_pods("fleet-b").await?;
    let originals = [names_a, names_b];
    let flags = budget_flags(&a.ns);
    let args: Vec<&str> = flags.iter().map(String::as_str).collect();
    let agents = [a.start_agent_with(&args)?, b.start_agent_with(&args)?];

    // No ledger yet: every eviction is deferred, none is made.
    for agent in &agents {
        wait_metric(agent, &skipped("cluster_budget"), |v| v >= 1.0).await?;
        assert_eq!(metric(agent, EVICTED).await, 0.0, "{}", agent.log());
    }
    a.wait_events(
        &originals[0],
        "EvictDeferredNoBudgetLedger",
        "cannot read the cluster-wide eviction ledger",
    )
    .await?;

    let ledger: ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": CONFIGMAP}, "data": {KEY: ""}}))?;
    Api::<ConfigMap>::namespaced(a.client.clone(), &a.ns)
        .create(&PostParams::default(), &ledger)
        .await?;
    poll_until("one eviction in the fleet", WAIT, || async {
        let n = metric(&agents[0], EVICTED).await + metric(&agents[1], EVICTED).await;
        anyhow::Ok((n >= 1.0).then_some(()))
    })
    .await?;
    // Every agent retries with backoff: give a second eviction every chance to happen.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let evicted = metric(&agents[0], EVICTED).await + metric(&agents[1], EVICTED).await;
    assert_eq!(evicted, 1.0, "{}\n{}", agents[0].log(), agents[1].log());
    let stored = Api::<ConfigMap>::namespaced(a.client.clone(), &a.ns)
        .get(CONFIGMAP)
        .await?;
    // The agent's write names it (docs/operations.md, "Who wrote it: field managers").
    assert_eq!(
        owners(&stored.metadata, &["f:data", &format!("f:{KEY}")]),
        [Managed::new(field_manager::AGENT, "Update", "")],
        "the ledger's owner:\n{}",
        managed_fields(&stored.metadata)
    );
    let entries = stored
        .data
        .and_then(|d| d.get(KEY).cloned())
        .unwrap_or_default();
    assert_eq!(
        entries.split(',').filter(|e| !e.is_empty()).count(),
        1,
        "ledger {entries:?}"
    );
    let mut left = Vec::new();
    for (scene, names) in [(&a, &originals[0]), (&b, &originals[1])] {
        let pods = scene.app_pods("web").await?;
        left.extend(
            pods.iter()
                .filter(|p| names.contains(&p.name_any()) && !terminating(p))
                .map(|p| (scene, p.name_any())),
        );
    }
    assert_eq!(
        left.len(),
        3,
        "one of the four pods evicted: {left:?}",
        left = left.iter().map(|(_, n)| n).collect::<Vec<_>>()
    );
    for (scene, pod) in &left {
        scene
            .wait_events(
                std::slice::from_ref(pod),
                "EvictDeferredClusterBudget",
                "cluster-wide eviction budget is spent",
            )
            .await?;
    }
    Ok(())
}
