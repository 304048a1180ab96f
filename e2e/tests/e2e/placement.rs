//! `/mutate-node` gates exactly the new Nodes the agent DaemonSet will run on, on the real
//! apiserver: Nodes created through the API, the webhook in-process, the shipped agent
//! DaemonSet's placement as an API object ([`Fixture`] creates it; no kubelet runs its pods).
//!
//! In: the shared control plane. Out: the taint (and label) the apiserver stored on each new
//! Node, as its create answer shows it, for the shipped placement (Linux nodes yes; Windows and
//! virtual-kubelet nodes no), then after the DaemonSet's nodeSelector and tolerations change,
//! then once it is deleted; and the webhook's `meshgate_node_registrations_ungated_total`.

use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use meshgate_core::gate::VERIFIED_LABEL;
use meshgate_e2e::unique_name;
use serde_json::{Value, json};

use crate::cp;
use crate::webhook::{CALL, Fixture, SCOPE_KEY, taint_count_of};

/// A label the test adds to the DaemonSet's nodeSelector.
const POOL: &str = "e2e.meshgate.io/pool";

/// Creates a Node in the fixture's scope with `labels` and `taints` (JSON) as a kubelet
/// registers one, and returns whether the webhook gated it: `true` with meshgate's taint and
/// label, `false` with neither (anything else fails).
pub(crate) async fn gated(
    f: &Fixture,
    prefix: &str,
    labels: Value,
    taints: Value,
) -> anyhow::Result<bool> {
    let name = unique_name(prefix);
    let mut labels = labels;
    labels[SCOPE_KEY] = json!(f.tag);
    let node: Node = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels},
        "spec": {"taints": taints},
    }))?;
    let api: Api<Node> = Api::all(f.client.clone());
    let created = tokio::time::timeout(CALL, api.create(&PostParams::default(), &node))
        .await?
        .with_context(|| format!("creating node {name}"))?;
    let _ = tokio::time::timeout(CALL, api.delete(&name, &DeleteParams::default())).await;
    let label = created.labels().get(VERIFIED_LABEL).cloned();
    match (taint_count_of(&created, &f.taint_key), label.as_deref()) {
        (1, Some("false")) => Ok(true),
        (0, None) => Ok(false),
        (n, l) => bail!("node {name}: {n} meshgate taint(s) and label {l:?}"),
    }
}

/// Creates nodes like [`gated`] until one is gated as `want` says (the webhook's DaemonSet
/// watch follows a change within milliseconds), for at most 20 s.
pub(crate) async fn until_gated(f: &Fixture, labels: Value, want: bool) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while gated(f, "whp-probe", labels.clone(), json!([])).await? != want {
        ensure!(
            Instant::now() < deadline,
            "the webhook did not follow the DaemonSet within 20 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

fn taint(key: &str, value: &str, effect: &str) -> Value {
    json!({"key": key, "value": value, "effect": effect})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_nodes_are_gated_only_where_the_agent_daemonset_runs() {
    let cp = cp().await;
    let f = Fixture::start(cp, "whp").await.expect("webhook starts");
    let result = placement(&f).await;
    f.teardown().await;
    result.expect("placement e2e");
}

async fn placement(f: &Fixture) -> anyhow::Result<()> {
    let linux = json!({"kubernetes.io/os": "linux"});
    let vk = taint("virtual-kubelet.io/provider", "azure", "NoSchedule");

    // The shipped placement: Linux nodes, not Windows (the objectSelector keeps them from the
    // webhook) nor virtual-kubelet ones (the DaemonSet's affinity).
    ensure!(
        gated(f, "whp-lin", linux.clone(), json!([])).await?,
        "a Linux node is gated"
    );
    ensure!(
        !gated(
            f,
            "whp-win",
            json!({"kubernetes.io/os": "windows"}),
            json!([])
        )
        .await?,
        "a Windows node is not gated"
    );
    let virtual_node = json!({"kubernetes.io/os": "linux", "type": "virtual-kubelet"});
    ensure!(
        !gated(f, "whp-vk", virtual_node, json!([vk.clone()])).await?,
        "a virtual-kubelet node is not gated"
    );

    // The DaemonSet changes: a pool label to select, one toleration instead of all.
    let daemonsets: Api<DaemonSet> = Api::namespaced(f.client.clone(), &f.agent_namespace);
    let change = json!({"spec": {"template": {"spec": {
        "nodeSelector": {POOL: "mesh"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "mesh", "effect": "NoSchedule"}],
    }}}});
    tokio::time::timeout(
        CALL,
        daemonsets.patch(
            "meshgate-agent",
            &PatchParams::default(),
            &Patch::Merge(&change),
        ),
    )
    .await??;
    until_gated(f, linux.clone(), false).await?;
    let mut pool = linux.clone();
    pool[POOL] = json!("mesh");
    // Every new Node carries node.kubernetes.io/not-ready:NoSchedule (TaintNodesByCondition),
    // which this DaemonSet does not tolerate: it does not count at registration.
    ensure!(
        gated(f, "whp-pool", pool.clone(), json!([])).await?,
        "a pool node is gated"
    );
    let dedicated = taint("dedicated", "mesh", "NoSchedule");
    ensure!(
        gated(f, "whp-ded", pool.clone(), json!([dedicated])).await?,
        "a tolerated taint does not keep the agent away"
    );
    let exec = taint("example.com/maintenance", "", "NoExecute");
    ensure!(
        !gated(f, "whp-exec", pool.clone(), json!([exec])).await?,
        "an untolerated NoExecute taint keeps the agent away"
    );
    ensure!(
        !gated(f, "whp-vk2", pool.clone(), json!([vk])).await?,
        "the virtual-kubelet taint is no longer tolerated"
    );

    // No DaemonSet: nothing is gated.
    tokio::time::timeout(
        CALL,
        daemonsets.delete("meshgate-agent", &DeleteParams::default()),
    )
    .await??;
    until_gated(f, pool, false).await?;

    let metrics = f.metrics().await?;
    for reason in ["not_placed", "daemonset_absent"] {
        let line = format!("meshgate_node_registrations_ungated_total{{reason=\"{reason}\"}}");
        ensure!(metrics.contains(&line), "metrics lack {line}:\n{metrics}");
    }
    Ok(())
}
