//! A registration storm during normal scheduling, small: Nodes register through the shipped
//! node-mutating webhook at 1,000 a minute while meshed pods are created and bound through the
//! shipped pod and binding entries, on the real apiserver.
//!
//! In: the shared control plane; the webhook in-process with the shipped registrations and the
//! shipped agent DaemonSet's placement ([`Fixture`]); one verified Node the pods are bound to;
//! `MESHGATE_STORM_NODES` new Nodes (60 in `make test`) cycling through the shapes whose gate
//! `core::placement` decides for the shipped placement (Linux: gated; Windows, which the
//! entry's objectSelector leaves out, and virtual-kubelet, which the DaemonSet's affinity
//! leaves out: not), registered open loop at 1,000/min; meanwhile pending meshed pods created
//! and bound at 20/s each. Out: every Node gated exactly as its shape says; no pod CREATE or
//! binding refused or timed out; the latencies of each kind (printed). The webhook's cost
//! against a webhook that admits everything is a benchmark figure, not asserted here.

use std::time::Duration;

use anyhow::{Context as _, ensure};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use meshgate_core::gate::VERIFIED_LABEL;
use meshgate_e2e::load::api;
use meshgate_e2e::load::review::Report;
use meshgate_e2e::sim::pod::pending_meshed_pod;
use meshgate_e2e::unique_name;
use serde_json::{Value, json};

use crate::cp;
use crate::webhook::{CALL, Fixture, SCOPE_KEY, taint_count_of};

/// 1,000 Nodes a minute.
const NODES_PER_SECOND: f64 = 1000.0 / 60.0;
/// Pod creates and bindings a second, each.
const PODS_PER_SECOND: f64 = 20.0;
/// Bound on each request.
const STEP: Duration = Duration::from_secs(10);

fn nodes() -> usize {
    std::env::var("MESHGATE_STORM_NODES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60)
}

/// The shapes registered, and whether the shipped placement gates each.
fn shape(k: usize) -> (Value, Value, bool) {
    match k % 3 {
        0 | 1 => (json!({"kubernetes.io/os": "linux"}), json!([]), true),
        _ if k.is_multiple_of(2) => (json!({"kubernetes.io/os": "windows"}), json!([]), false),
        _ => (
            json!({"kubernetes.io/os": "linux", "type": "virtual-kubelet"}),
            json!([{"key": "virtual-kubelet.io/provider", "value": "azure", "effect": "NoSchedule"}]),
            false,
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_storm_gates_every_node_and_refuses_no_review() {
    let cp = cp().await;
    let f = Fixture::start(cp, "storm").await.expect("webhook starts");
    let names: Vec<String> = (0..nodes()).map(|_| unique_name("storm")).collect();
    let verified = unique_name("storm-verified");
    let result = storm(&f, &names, &verified).await;
    let api: Api<Node> = Api::all(f.client.clone());
    for n in names.iter().chain([&verified]) {
        let _ = tokio::time::timeout(CALL, api.delete(n, &DeleteParams::default())).await;
    }
    f.teardown().await;
    result.expect("registration storm e2e");
}

async fn storm(f: &Fixture, names: &[String], verified: &str) -> anyhow::Result<()> {
    verified_node(f, verified).await?;
    let ns = f.namespace(&[]).await?;
    let pods: Api<Pod> = Api::namespaced(f.client.clone(), &ns);
    let n = names.len();
    let pod_count = ((n as f64 / NODES_PER_SECOND) * PODS_PER_SECOND).ceil() as usize;
    let node_api: Api<Node> = Api::all(f.client.clone());
    let register = api::open_loop(NODES_PER_SECOND, n, 64, STEP, |k| {
        register(node_api.clone(), f.tag.clone(), names[k].clone(), shape(k))
    });
    let created = api::open_loop(PODS_PER_SECOND, pod_count, 64, STEP, |k| {
        api::create_pod(pods.clone(), pending_meshed_pod(&format!("storm-{k}")))
    });
    // Bindings follow their pods by half a second.
    let bound = async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        api::open_loop(PODS_PER_SECOND, pod_count, 64, STEP, |k| {
            api::bind(pods.clone(), format!("storm-{k}"), verified.to_owned())
        })
        .await
    };
    let (register, created, bound) = tokio::join!(register, created, bound);
    let reports = [
        ("Node registrations", register?),
        ("pod CREATEs", created?),
        ("bindings", bound?),
    ];
    for (what, r) in &reports {
        println!("storm: {what}: {}", summary(r));
    }
    for (what, r) in &reports {
        let errors: Vec<String> = r
            .errors()
            .iter()
            .map(|s| format!("{:?}", s.outcome))
            .collect();
        ensure!(
            errors.is_empty(),
            "{what}: {} failed: {errors:?}",
            errors.len()
        );
    }
    let _ = tokio::time::timeout(CALL, api::delete_all_pods(&pods, Duration::from_secs(60))).await;
    Ok(())
}

fn summary(r: &Report) -> String {
    format!(
        "{} requests, {} errors, p50 {:?} p99 {:?}",
        r.samples.len(),
        r.errors().len(),
        r.latency(0.5),
        r.latency(0.99)
    )
}

/// Registers one Node in the fixture's scope; an error unless it is gated as `want` says.
async fn register(
    api: Api<Node>,
    tag: String,
    name: String,
    (mut labels, taints, want): (Value, Value, bool),
) -> Result<(), String> {
    labels[SCOPE_KEY] = json!(tag);
    let node: Node = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels},
        "spec": {"taints": taints},
    }))
    .map_err(|e| e.to_string())?;
    let created = api
        .create(&PostParams::default(), &node)
        .await
        .map_err(|e| e.to_string())?;
    let key = meshgate_core::gate::TaintKey::default();
    let gate = (
        taint_count_of(&created, key.as_str()),
        created.labels().get(VERIFIED_LABEL).cloned(),
    );
    match (want, &gate) {
        (true, (1, Some(l))) if l == "false" => Ok(()),
        (false, (0, None)) => Ok(()),
        _ => Err(format!("node {name}: want gated {want}, got {gate:?}")),
    }
}

/// A Node in scope, gated at registration and then labelled verified as the agent would.
async fn verified_node(f: &Fixture, name: &str) -> anyhow::Result<()> {
    let api: Api<Node> = Api::all(f.client.clone());
    let node: Node = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {SCOPE_KEY: f.tag, "kubernetes.io/os": "linux"}},
    }))?;
    tokio::time::timeout(CALL, api.create(&PostParams::default(), &node)).await??;
    let patch = json!({"metadata": {"labels": {VERIFIED_LABEL: "true"}}, "spec": {"taints": []}});
    tokio::time::timeout(
        CALL,
        api.patch(name, &PatchParams::default(), &Patch::Merge(patch)),
    )
    .await?
    .context("labelling the Node verified")?;
    // The webhook's cache must see the label before a binding to it is admitted.
    tokio::time::sleep(Duration::from_millis(500)).await;
    Ok(())
}
