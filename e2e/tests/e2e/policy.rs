//! The apiserver's own placement policy (`templates/placement-policy.yaml`), alone, on the
//! real apiserver: no webhook is registered.
//!
//! In: the shared control plane; this test's Nodes (gated with and without a reason,
//! verified, unlabelled) and namespaces (plain, ambient, opted out), all carrying its scope
//! label; the shipped policy scoped to them (`sim::policy`). Out: pass/fail on
//! - every pod of a matrix of labels, annotations and namespaces, created (dry run) with
//!   `spec.nodeName` on each Node: on a gated Node the policy refuses exactly what
//!   `core::admission::decide` refuses, with its message word for word; on a verified Node
//!   it admits all; on a Node the agent has not labelled, or one that does not exist, it
//!   admits what only the webhook refuses (docs/webhook.md, "Failure policy");
//! - a Node labelled verified is open to meshed pods within a second, and closed again as
//!   soon as it is labelled `false` (printed: how long each took);
//! - the binding the chart renders follows the mode: `Audit` in report mode, else `Deny`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::Client;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use meshgate_core::admission::{self, Decision, Input, NodeFacts, PodFacts, RequestKind};
use meshgate_core::gate::{CONDITION_TYPE, TaintKey, VERIFIED_LABEL};
use meshgate_core::profile::ProfileSet;
use meshgate_e2e::harness::helm;
use meshgate_e2e::sim::policy;
use meshgate_e2e::sim::webhook::Scope;
use meshgate_e2e::unique_name;
use serde_json::{Value, json};

use crate::cp;
use crate::webhook::{CALL, SCOPE_KEY, create_pod};

/// The reason the gated Node's condition carries.
const REASON: &str = "ChainedPluginMissing";

/// Pod label and annotation sets: every way a built-in profile selects or excludes a pod.
pub(crate) fn pods() -> Vec<(&'static str, Value, Value)> {
    let none = json!({});
    vec![
        ("no mesh label", none.clone(), none.clone()),
        (
            "linkerd",
            json!({"linkerd.io/control-plane-ns": "linkerd"}),
            none.clone(),
        ),
        (
            "istio",
            json!({"security.istio.io/tlsMode": "istio"}),
            none.clone(),
        ),
        (
            "istio, other mode",
            json!({"security.istio.io/tlsMode": "disabled"}),
            none.clone(),
        ),
        (
            "ambient",
            json!({"istio.io/dataplane-mode": "ambient"}),
            none.clone(),
        ),
        (
            "ambient opted out",
            json!({"istio.io/dataplane-mode": "none"}),
            none.clone(),
        ),
        (
            "ambient, sidecar injected",
            json!({"istio.io/dataplane-mode": "ambient"}),
            json!({"sidecar.istio.io/status": "{}"}),
        ),
        (
            "sidecar injected",
            none.clone(),
            json!({"sidecar.istio.io/status": "{}"}),
        ),
        (
            "istio and ambient",
            json!({"security.istio.io/tlsMode": "istio", "istio.io/dataplane-mode": "ambient"}),
            none,
        ),
    ]
}

fn to_map(v: &Value) -> BTreeMap<String, String> {
    serde_json::from_value(v.clone()).unwrap_or_default()
}

/// One of this test's Nodes, and what the webhook's cache would know of it.
struct TestNode {
    name: String,
    labels: Option<BTreeMap<String, String>>,
    reason: Option<&'static str>,
}

/// The scope this test's objects carry.
struct Fixture {
    client: Client,
    tag: String,
    namespaces: Vec<(String, BTreeMap<String, String>)>,
    nodes: Vec<TestNode>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_policy_refuses_what_the_webhook_refuses_on_gated_nodes() {
    let cp = cp().await;
    let client = cp.client().expect("client");
    let tag = unique_name("pol");
    let scope = Scope {
        label: Some((SCOPE_KEY.into(), tag.clone())),
        hook_infix: None,
    };
    policy::register(cp, &client, &tag, &scope)
        .await
        .expect("placement policy registered");
    let result = async {
        let f = Fixture::create(cp, client.clone(), tag.clone()).await?;
        let r = match until_active(&f).await {
            Ok(()) => parity(&f).await,
            e => e,
        };
        let r = match r {
            Ok(()) => opens_and_closes(&f).await,
            e => e,
        };
        f.delete().await;
        r
    }
    .await;
    policy::unregister(&client, &tag).await;
    result.expect("placement policy e2e");
}

impl Fixture {
    async fn create(
        cp: &meshgate_e2e::ControlPlane,
        client: Client,
        tag: String,
    ) -> anyhow::Result<Self> {
        let mut namespaces = Vec::new();
        for extra in [
            json!({}),
            json!({"istio.io/dataplane-mode": "ambient"}),
            json!({"meshgate.io/ignore": "true", "istio.io/dataplane-mode": "ambient"}),
        ] {
            let ns = cp.create_namespace(&client, "pol").await?;
            let mut labels = to_map(&extra);
            labels.insert(SCOPE_KEY.into(), tag.clone());
            let api: Api<Namespace> = Api::all(client.clone());
            let patch = Patch::Merge(json!({"metadata": {"labels": labels}}));
            tokio::time::timeout(CALL, api.patch(&ns, &PatchParams::default(), &patch)).await??;
            labels.insert("kubernetes.io/metadata.name".into(), ns.clone());
            namespaces.push((ns, labels));
        }
        let mut f = Self {
            client,
            tag,
            namespaces,
            nodes: Vec::new(),
        };
        for (label, reason) in [
            (Some("false"), Some(REASON)),
            (Some("false"), None),
            (Some("true"), None),
            (None, None),
        ] {
            let node = f.node(label, reason).await?;
            f.nodes.push(node);
        }
        Ok(f)
    }

    /// Registers a Node in scope, labelled `cni-verified=<label>`, with `reason` on its
    /// MeshCNIVerified condition.
    async fn node(
        &self,
        label: Option<&str>,
        reason: Option<&'static str>,
    ) -> anyhow::Result<TestNode> {
        let name = unique_name("pol-node");
        let mut labels = BTreeMap::from([(SCOPE_KEY.to_owned(), self.tag.clone())]);
        if let Some(v) = label {
            labels.insert(VERIFIED_LABEL.into(), v.into());
        }
        let node: Node =
            serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}}))?;
        let api: Api<Node> = Api::all(self.client.clone());
        tokio::time::timeout(CALL, api.create(&PostParams::default(), &node)).await??;
        if let Some(r) = reason {
            let status = json!({"status": {"conditions": [{
                "type": CONDITION_TYPE, "status": "False", "reason": r, "message": "test",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
            }]}});
            let pp = PatchParams::default();
            tokio::time::timeout(CALL, api.patch_status(&name, &pp, &Patch::Merge(status)))
                .await??;
        }
        Ok(TestNode {
            name,
            labels: Some(labels),
            reason,
        })
    }

    async fn delete(&self) {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        let dp = DeleteParams::default();
        for n in &self.nodes {
            let _ = tokio::time::timeout(CALL, nodes.delete(&n.name, &dp)).await;
        }
        for (ns, _) in &self.namespaces {
            let _ = tokio::time::timeout(CALL, namespaces.delete(ns, &dp)).await;
        }
    }
}

/// A pod bound to `node` at creation.
fn pod(name: &str, node: &str, labels: &Value, annotations: &Value) -> anyhow::Result<Pod> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels, "annotations": annotations},
        "spec": {"nodeName": node, "containers": [{"name": "app", "image": "registry.invalid/app:1"}]},
    }))?)
}

/// What the webhook decides for this pod on this node, its caches complete.
fn webhook_decision(
    ns: &(String, BTreeMap<String, String>),
    name: &str,
    labels: &BTreeMap<String, String>,
    annotations: &BTreeMap<String, String>,
    node: &TestNode,
) -> Decision {
    let key = TaintKey::default();
    let input = Input {
        kind: RequestKind::PodCreate,
        namespace: &ns.0,
        pod_name: name,
        pod: PodFacts::Known {
            labels,
            annotations,
        },
        namespace_labels: Some(&ns.1),
        node_name: &node.name,
        node: match &node.labels {
            Some(labels) => NodeFacts::Known { labels },
            None => NodeFacts::Unknown,
        },
        node_reason: node.reason,
        taint_key: &key,
    };
    admission::decide(&input, &ProfileSet::all_builtin())
}

/// Waits until the apiserver enforces the new policy (it loads policies and their params
/// asynchronously): a meshed pod on the gated Node is refused.
async fn until_active(f: &Fixture) -> anyhow::Result<()> {
    let linkerd = json!({"linkerd.io/control-plane-ns": "linkerd"});
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let p = pod(
            &unique_name("pol-wait"),
            &f.nodes[0].name,
            &linkerd,
            &json!({}),
        )?;
        if create_pod(&f.client, &f.namespaces[0].0, &p, true)
            .await?
            .is_err()
        {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "the placement policy never refused"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every pod of [`pods`], in every namespace, on every Node (and one that does not exist).
async fn parity(f: &Fixture) -> anyhow::Result<()> {
    let mut wrong = Vec::new();
    let (mut refused, mut admitted) = (0, 0);
    let ghost = TestNode {
        name: unique_name("pol-ghost"),
        labels: None,
        reason: None,
    };
    for (what, labels, annotations) in pods() {
        for (i, ns) in f.namespaces.iter().enumerate() {
            for node in f.nodes.iter().chain([&ghost]) {
                let name = unique_name("pol-pod");
                let got = create_pod(
                    &f.client,
                    &ns.0,
                    &pod(&name, &node.name, &labels, &annotations)?,
                    true,
                )
                .await?;
                let (l, a) = (to_map(&labels), to_map(&annotations));
                let gated = node
                    .labels
                    .as_ref()
                    .and_then(|l| l.get(VERIFIED_LABEL))
                    .is_some_and(|v| v == "false");
                // The opted-out namespace is out of the policy's scope, as of the webhook's.
                let want = match webhook_decision(ns, &name, &l, &a, node) {
                    Decision::Refuse { message } if gated && i < 2 => Some(message),
                    _ => None,
                };
                match (&want, &got) {
                    (None, Ok(_)) => admitted += 1,
                    (Some(m), Err(e))
                        if e.contains(&format!(
                            "ValidatingAdmissionPolicy 'meshgate-{}'",
                            f.tag
                        )) && e.contains(m.as_str()) =>
                    {
                        refused += 1
                    }
                    _ => wrong.push(format!(
                        "{what} in {} on {}: got {got:?}, want {want:?}",
                        ns.0,
                        node.name,
                        got = got.as_ref().map(|_| "admitted")
                    )),
                }
            }
        }
    }
    println!(
        "placement policy: {refused} refused, {admitted} admitted, as the webhook would on gated nodes"
    );
    ensure!(
        wrong.is_empty(),
        "policy and webhook disagree:\n{}",
        wrong.join("\n")
    );
    ensure!(
        refused >= 8,
        "only {refused} refusals: the matrix no longer covers the meshes"
    );
    Ok(())
}

/// The gated Node opens once labelled verified and closes once labelled `false` again.
async fn opens_and_closes(f: &Fixture) -> anyhow::Result<()> {
    let node = &f.nodes[0].name;
    let ns = &f.namespaces[0].0;
    let linkerd = json!({"linkerd.io/control-plane-ns": "linkerd"});
    let api: Api<Node> = Api::all(f.client.clone());
    for (value, admits) in [("true", true), ("false", false)] {
        let patch = Patch::Merge(json!({"metadata": {"labels": {VERIFIED_LABEL: value}}}));
        let began = Instant::now();
        tokio::time::timeout(CALL, api.patch(node, &PatchParams::default(), &patch)).await??;
        loop {
            let p = pod(&unique_name("pol-flip"), node, &linkerd, &json!({}))?;
            if create_pod(&f.client, ns, &p, true).await?.is_ok() == admits {
                break;
            }
            if began.elapsed() > Duration::from_secs(1) {
                bail!(
                    "{node} labelled {value}: the policy still {} after 1 s",
                    if admits { "refuses" } else { "admits" }
                );
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        println!(
            "labelled {VERIFIED_LABEL}={value}: the policy {} a meshed pod {:.0} ms later",
            if admits { "admits" } else { "refuses" },
            began.elapsed().as_secs_f64() * 1000.0
        );
    }
    Ok(())
}

/// The binding refuses in enforce and condition-only mode, and only audits in report mode
/// (the webhook warns there).
#[tokio::test]
async fn the_binding_follows_the_rendered_mode() -> anyhow::Result<()> {
    for (mode, want) in [
        ("enforce", "[\"Deny\"]"),
        ("condition-only", "[\"Deny\"]"),
        ("report", "[\"Audit\"]"),
    ] {
        let set = format!("mode={mode},placementPolicy.enabled=true");
        let text = helm::template(&["--show-only", policy::SHIPPED, "--set", &set])
            .await
            .with_context(|| format!("rendering with {set}"))?;
        let line = text
            .lines()
            .find(|l| l.trim_start().starts_with("validationActions:"))
            .context("no validationActions")?;
        ensure!(line.trim_end().ends_with(want), "{mode}: {line}");
    }
    Ok(())
}

/// The policy is opt-in: its cost grows with the gated Nodes (docs/webhook.md, "The placement
/// policy"), so the chart's defaults render none of it.
#[tokio::test]
async fn the_policy_is_rendered_only_when_turned_on() -> anyhow::Result<()> {
    let defaults = helm::template(&[]).await?;
    let on = helm::template(&["--set", "placementPolicy.enabled=true"]).await?;
    let has = |text: &str| text.contains("\n  name: meshgate-placement\n");
    ensure!(!has(&defaults), "the defaults render the placement policy");
    ensure!(
        has(&on),
        "placementPolicy.enabled=true renders no placement policy"
    );
    Ok(())
}
