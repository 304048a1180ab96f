//! What a dead webhook blocks: meshgate's shipped registrations and placement policy on the
//! real apiserver with both webhook replicas gone (nothing listens on the webhook's port:
//! every connection is refused) or hung (connections accepted, never answered).
//!
//! In: the shared control plane; the webhook in-process, for the check while it is up, then
//! stopped; the shipped placement policy, in the apiserver; this test's namespaces (governed,
//! ambient, opted out), kube-system and two Nodes (one gated at registration, one labelled
//! verified), labelled with its scope; webhooks named `<x>.<tag>.meshgate.io` so the
//! apiserver's per-webhook counters are this test's alone. Out: a table of each request, its
//! outcome and how long it waited (printed: the figures of docs/webhook.md, "What an outage
//! blocks"), the deltas of the apiserver metrics the alerts read, and pass/fail on what an
//! outage must refuse (a pod a built-in mesh selects, created on a gated Node: by the policy;
//! bindings: by their entry, which fails closed) and must not (everything else).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use meshgate_core::gate::VERIFIED_LABEL;
use meshgate_e2e::sim::policy;
use meshgate_e2e::sim::webhook::{self, Scope, TestCa};
use meshgate_e2e::unique_name;
use serde_json::{Value, json};

use crate::cp;
use crate::webhook::{
    CALL, Fixture, SCOPE_KEY, Start, bind, bind_legacy, create_pod, force_delete_pods, taint_count,
};

/// A custom mesh profile (`--profile-file`) whose pods carry no built-in profile's label.
const KUMA: &str = r#"[{"name":"kuma","selector":{"annotations":{"kuma.io/sidecar-injected":"true"}},"pluginType":"kuma-cni","inboundPort":15006,"outboundPort":15001}]"#;
/// Name prefix of this test's pods in kube-system (the only ones it deletes there).
const SYSTEM_POD: &str = "out-sys";
/// The scheduler name of pods that must stay unbound (no scheduler serves it).
const NOBODY: &str = "meshgate-e2e-nobody";

/// A pod with these labels and annotations, bound to `node` at creation if given.
fn pod(name: &str, node: Option<&str>, labels: Value, annotations: Value) -> anyhow::Result<Pod> {
    let mut spec = json!({
        "containers": [{"name": "app", "image": "registry.invalid/app:1"}],
        "terminationGracePeriodSeconds": 0,
    });
    match node {
        Some(n) => spec["nodeName"] = json!(n),
        None => spec["schedulerName"] = json!(NOBODY),
    }
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels, "annotations": annotations},
        "spec": spec,
    }))?)
}

/// Label sets the built-in profiles select on, and the custom one.
fn linkerd() -> Value {
    json!({"linkerd.io/control-plane-ns": "linkerd"})
}
fn istio() -> Value {
    json!({"security.istio.io/tlsMode": "istio"})
}
fn ambient() -> Value {
    json!({"istio.io/dataplane-mode": "ambient"})
}
fn kuma() -> Value {
    json!({"kuma.io/sidecar-injected": "true"})
}

/// One request made during the outage.
struct Row {
    what: String,
    namespace: String,
    /// `Ok` admitted; `Err` the refusal as the client saw it.
    outcome: Result<(), String>,
    waited: Duration,
}

impl Row {
    /// "admitted", or "refused by <webhook>" (the one the apiserver could not call).
    fn verdict(&self) -> String {
        match &self.outcome {
            Ok(()) => "admitted".into(),
            Err(m) => match (
                m.split("failed calling webhook \"").nth(1),
                m.split("ValidatingAdmissionPolicy '").nth(1),
            ) {
                (Some(rest), _) => format!("refused: {}", rest.split('"').next().unwrap_or("?")),
                (_, Some(rest)) => {
                    format!("refused: policy {}", rest.split('\'').next().unwrap_or("?"))
                }
                _ => format!("refused: {m}"),
            },
        }
    }
}

/// Runs `call`, timing it, and records it in `rows`.
async fn record<F>(rows: &mut Vec<Row>, what: &str, ns: &str, call: F) -> anyhow::Result<()>
where
    F: Future<Output = anyhow::Result<Result<(), String>>>,
{
    let began = Instant::now();
    let outcome = call.await?;
    rows.push(Row {
        what: what.into(),
        namespace: ns.into(),
        outcome,
        waited: began.elapsed(),
    });
    Ok(())
}

fn print_table(title: &str, rows: &[Row]) {
    println!("\n{title}\n| request | namespace | outcome | waited |\n|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {} | {} | {:.0} ms |",
            r.what,
            r.namespace,
            r.verdict(),
            r.waited.as_secs_f64() * 1000.0
        );
    }
}

/// Creates `p` in `ns`: `Ok(())` admitted, `Err(message)` refused.
async fn create(
    c: &Client,
    ns: &str,
    p: anyhow::Result<Pod>,
) -> anyhow::Result<Result<(), String>> {
    Ok(create_pod(c, ns, &p?, false).await?.map(|_| ()))
}

/// Registers a Node carrying this test's scope label (so only its mutating webhook sees it);
/// `Ok(taints of meshgate's key)` when admitted.
async fn create_node(c: &Client, name: &str, tag: &str) -> anyhow::Result<Result<usize, String>> {
    let node: Node = serde_json::from_value(json!({
        // A Linux node, as the agent's nodeSelector and the Node webhook's objectSelector want.
        "metadata": {"name": name, "labels": {SCOPE_KEY: tag, "kubernetes.io/os": "linux"}},
    }))?;
    let api: Api<Node> = Api::all(c.clone());
    match tokio::time::timeout(CALL, api.create(&PostParams::default(), &node)).await? {
        Ok(n) => Ok(Ok(taint_count(&n))),
        Err(kube::Error::Api(s)) => Ok(Err(format!("{} ({})", s.message, s.code))),
        Err(e) => Err(e.into()),
    }
}

/// Sets (or with `None` removes) this test's scope label on kube-system.
async fn scope_kube_system(c: &Client, tag: Option<&str>) -> anyhow::Result<()> {
    let api: Api<Namespace> = Api::all(c.clone());
    let patch = Patch::Merge(json!({"metadata": {"labels": {SCOPE_KEY: tag}}}));
    tokio::time::timeout(
        CALL,
        api.patch("kube-system", &PatchParams::default(), &patch),
    )
    .await??;
    Ok(())
}

/// The sum of `metric`'s samples whose labels include every `name="value"` in `labels`, in
/// the apiserver's `/metrics` text.
pub(crate) fn sample_sum(text: &str, metric: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{metric}{{")))
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

pub(crate) async fn apiserver_metrics(c: &Client) -> anyhow::Result<String> {
    let req = http::Request::get("/metrics").body(Vec::new())?;
    Ok(tokio::time::timeout(CALL, c.request_text(req)).await??)
}

/// The namespaces of one outage test, in its scope.
struct Namespaces {
    governed: String,
    ambient: String,
    ignored: String,
}

impl Namespaces {
    async fn create(f: &Fixture) -> anyhow::Result<Self> {
        Ok(Self {
            governed: f.namespace(&[]).await?,
            ambient: f
                .namespace(&[("istio.io/dataplane-mode", "ambient")])
                .await?,
            ignored: f.namespace(&[("meshgate.io/ignore", "true")]).await?,
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_replicas_dead_refuse_meshed_pods_on_gated_nodes_and_bindings() {
    let cp = cp().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let profiles = dir.path().join("profiles.json");
    std::fs::write(&profiles, KUMA).expect("profile file");
    let start = Start {
        kubeconfig: cp.admin_kubeconfig_path().to_path_buf(),
        profile_file: Some(profiles),
        tag_hooks: true,
        mode: Default::default(),
        taint_key: Default::default(),
    };
    let mut f = Fixture::start_with(cp, "out", start)
        .await
        .expect("webhook starts");
    let result = match policy::register(cp, &f.client, &f.tag, &f.scope()).await {
        Ok(()) => dead(&mut f).await,
        Err(e) => Err(e),
    };
    let _ = scope_kube_system(&f.client, None).await;
    policy::unregister(&f.client, &f.tag).await;
    f.teardown().await;
    result.expect("webhook outage e2e");
}

async fn dead(f: &mut Fixture) -> anyhow::Result<()> {
    let c = f.client.clone();
    let ns = Namespaces::create(f).await?;
    scope_kube_system(&c, Some(&f.tag)).await?;
    let nodes = Nodes {
        gated: gated_node(&c, &f.tag).await?,
        verified: gated_node(&c, &f.tag).await?,
        nowhere: unique_name("out-none"),
    };
    let patch = Patch::Merge(json!({"metadata": {"labels": {VERIFIED_LABEL: "true"}}}));
    let api: Api<Node> = Api::all(c.clone());
    tokio::time::timeout(
        CALL,
        api.patch(&nodes.verified, &PatchParams::default(), &patch),
    )
    .await??;

    // Up: a pod of the custom profile reaches the webhook and is refused (a node the webhook
    // does not know is not verified); the policy does not decide custom profiles.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let p = pod("probe", Some(&nodes.nowhere), json!({}), kuma());
        match create_pod(&c, &ns.governed, &p?, true).await? {
            Err(m) if m.contains(&format!("pods.validate.{}.meshgate.io", f.tag)) => break,
            other => ensure!(Instant::now() < deadline, "not gated while up: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The apiserver loads the policy and its params asynchronously: wait until it, not the
    // webhook, refuses a meshed pod on the gated Node.
    let by_policy = format!("ValidatingAdmissionPolicy 'meshgate-{}'", f.tag);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let p = pod("probe", Some(&nodes.gated), linkerd(), json!({}));
        match create_pod(&c, &ns.governed, &p?, true).await? {
            Err(m) if m.contains(&by_policy) => break,
            other => ensure!(Instant::now() < deadline, "policy not enforced: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Down: both replicas gone.
    f.stop_webhook().await?;
    let before = apiserver_metrics(&c).await?;
    let rows = requests_while_dead(&c, f, &ns, &nodes).await?;
    let after = apiserver_metrics(&c).await?;
    print_table("Both webhook replicas dead (connection refused):", &rows);
    cleanup(&c, &ns).await;
    for n in [&nodes.gated, &nodes.verified] {
        let _ = tokio::time::timeout(CALL, api.delete(n, &DeleteParams::default())).await;
    }

    check_outcomes(&rows, &f.tag)?;
    check_metrics(&before, &after, &f.tag)
}

/// The Nodes the outage test places pods on.
struct Nodes {
    /// Gated at registration by the webhook (labelled `cni-verified=false`, tainted).
    gated: String,
    /// Labelled verified by the test, as the agent would.
    verified: String,
    /// A name no Node has.
    nowhere: String,
}

/// Registers a Node in this test's scope while the webhook is up: gated as it registers.
async fn gated_node(c: &Client, tag: &str) -> anyhow::Result<String> {
    let name = unique_name("out-node");
    match create_node(c, &name, tag).await? {
        Ok(1) => Ok(name),
        other => bail!("node {name} not gated at registration: {other:?}"),
    }
}

/// Every kind of request an outage could touch, in the order of docs/webhook.md's table.
async fn requests_while_dead(
    c: &Client,
    f: &Fixture,
    ns: &Namespaces,
    nodes: &Nodes,
) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    let g = ns.governed.as_str();
    for (what, n, p) in pods_to_create(ns, nodes) {
        record(&mut rows, what, n, create(c, n, p)).await?;
    }
    let what = "pods/binding (what kube-scheduler posts), plain pod, gated node";
    record(
        &mut rows,
        what,
        g,
        bind(c, g, "unbound-plain", &nodes.gated),
    )
    .await?;
    let what = "legacy bindings, linkerd label, gated node";
    record(
        &mut rows,
        what,
        g,
        bind_legacy(c, g, "unbound", &nodes.gated),
    )
    .await?;
    let api: Api<Pod> = Api::namespaced(c.clone(), g);
    let del = async {
        let r = tokio::time::timeout(CALL, api.delete("unbound", &DeleteParams::default())).await?;
        Ok(r.map(|_| ()).map_err(|e| e.to_string()))
    };
    record(&mut rows, "pod delete (not registered)", g, del).await?;
    rows.push(node_creation(c, &f.tag).await?);
    Ok(rows)
}

/// Pods of every kind, with and without spec.nodeName, in each kind of namespace: (what, its
/// namespace, the pod).
fn pods_to_create<'a>(
    ns: &'a Namespaces,
    nodes: &Nodes,
) -> [(&'static str, &'a str, anyhow::Result<Pod>); 13] {
    let (g, a, i) = (
        ns.governed.as_str(),
        ns.ambient.as_str(),
        ns.ignored.as_str(),
    );
    let no = json!({});
    let on = |node: &str, labels: Value, annotations: Value| {
        pod(&unique_name(SYSTEM_POD), Some(node), labels, annotations)
    };
    let (gated, verified) = (nodes.gated.as_str(), nodes.verified.as_str());
    [
        (
            "pod with spec.nodeName, linkerd label, gated node",
            g,
            on(gated, linkerd(), no.clone()),
        ),
        (
            "pod with spec.nodeName, istio label, gated node",
            g,
            on(gated, istio(), no.clone()),
        ),
        (
            "pod with spec.nodeName, ambient label, gated node",
            g,
            on(gated, ambient(), no.clone()),
        ),
        (
            "pod with spec.nodeName, linkerd label, verified node",
            g,
            on(verified, linkerd(), no.clone()),
        ),
        (
            "pod with spec.nodeName, no mesh label, gated node",
            g,
            on(gated, no.clone(), no.clone()),
        ),
        (
            "pod with spec.nodeName, custom profile (kuma annotation), gated node",
            g,
            on(gated, no.clone(), kuma()),
        ),
        (
            "pod with spec.nodeName, no mesh label, gated node",
            a,
            on(gated, no.clone(), no.clone()),
        ),
        (
            "pod with spec.nodeName, no mesh label, verified node",
            a,
            on(verified, no.clone(), no.clone()),
        ),
        (
            "pod with spec.nodeName, linkerd label, gated node",
            "kube-system",
            on(gated, linkerd(), no.clone()),
        ),
        (
            "pod with spec.nodeName, linkerd label, gated node",
            i,
            on(gated, linkerd(), no.clone()),
        ),
        (
            "pod with spec.nodeName, linkerd label, node not registered",
            g,
            on(&nodes.nowhere, linkerd(), no.clone()),
        ),
        (
            "pod without spec.nodeName, linkerd label",
            g,
            pod("unbound", None, linkerd(), no.clone()),
        ),
        (
            "pod without spec.nodeName, no mesh label",
            g,
            pod("unbound-plain", None, no.clone(), no.clone()),
        ),
    ]
}

/// Registers a Node in this test's scope and deletes it again: admitted without meshgate's
/// taint (its mutating webhook did not run), or the refusal.
async fn node_creation(c: &Client, tag: &str) -> anyhow::Result<Row> {
    let node = unique_name("out-node");
    let began = Instant::now();
    let created = create_node(c, &node, tag).await?;
    let waited = began.elapsed();
    let api: Api<Node> = Api::all(c.clone());
    let _ = tokio::time::timeout(CALL, api.delete(&node, &DeleteParams::default())).await;
    let outcome = match created {
        Ok(0) => Ok(()),
        Ok(n) => Err(format!(
            "admitted with {n} meshgate taint(s): the mutating webhook ran"
        )),
        Err(m) => Err(m),
    };
    Ok(Row {
        what: "Node CREATE (registration)".into(),
        namespace: "(cluster)".into(),
        outcome,
        waited,
    })
}

async fn cleanup(c: &Client, ns: &Namespaces) {
    for n in [&ns.governed, &ns.ambient, &ns.ignored] {
        delete_pods(c, n, "").await;
    }
    delete_pods(c, "kube-system", SYSTEM_POD).await;
}

/// Deletes (grace 0) the pods of `ns` whose names start with `prefix`; best effort.
async fn delete_pods(c: &Client, ns: &str, prefix: &str) {
    let api: Api<Pod> = Api::namespaced(c.clone(), ns);
    if let Ok(Ok(list)) = tokio::time::timeout(CALL, api.list(&Default::default())).await {
        let names: Vec<String> = list
            .items
            .iter()
            .map(ResourceExt::name_any)
            .filter(|n| n.starts_with(prefix))
            .collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        force_delete_pods(c, ns, &refs).await;
    }
}

/// Refused, by the policy: every pod a built-in profile selects (by its label, or by its
/// ambient namespace) created on the gated Node; by the binding entry (which fails closed):
/// both bindings; admitted: everything else.
fn check_outcomes(rows: &[Row], tag: &str) -> anyhow::Result<()> {
    let policy = || format!("refused: policy meshgate-{tag}");
    let bindings = || format!("refused: bindings.validate.{tag}.meshgate.io");
    let admitted = || "admitted".to_owned();
    let mut want: Vec<String> = vec![policy(), policy(), policy()];
    want.extend(std::iter::repeat_with(admitted).take(3));
    want.push(policy());
    want.extend(std::iter::repeat_with(admitted).take(6));
    want.extend([bindings(), bindings()]);
    want.extend(std::iter::repeat_with(admitted).take(2));
    let have: Vec<String> = rows.iter().map(Row::verdict).collect();
    if have != want {
        let lines: Vec<String> = rows
            .iter()
            .zip(&want)
            .map(|(r, w)| format!("{} in {}: {} (want {w})", r.what, r.namespace, r.verdict()))
            .collect();
        bail!("outcomes during the outage:\n{}", lines.join("\n"));
    }
    Ok(())
}

/// The apiserver counted the bindings as calling errors of the entry that fails closed, each
/// admission past a dead entry that fails open as a fail-open, and each of the policy's
/// refusals as its deny: the series the alerts read.
fn check_metrics(before: &str, after: &str, tag: &str) -> anyhow::Result<()> {
    let delta = |metric: &str, labels: &[(&str, &str)]| {
        sample_sum(after, metric, labels) - sample_sum(before, metric, labels)
    };
    let hook = |h: &str| format!("{h}.{tag}.meshgate.io");
    let (pods, bindings, nodes) = (
        hook("pods.validate"),
        hook("bindings.validate"),
        hook("nodes.mutate"),
    );
    let calling = ("error_type", "calling_webhook_error");
    let rejection = "apiserver_admission_webhook_rejection_count";
    let fail_open = "apiserver_admission_webhook_fail_open_count";
    let policy = format!("meshgate-{tag}");
    let got = BTreeMap::from([
        (
            "pods refused",
            delta(rejection, &[("name", &pods), calling]),
        ),
        (
            "bindings refused",
            delta(rejection, &[("name", &bindings), calling]),
        ),
        ("pods failed open", delta(fail_open, &[("name", &pods)])),
        (
            "bindings failed open",
            delta(fail_open, &[("name", &bindings)]),
        ),
        ("nodes failed open", delta(fail_open, &[("name", &nodes)])),
        (
            "policy denied",
            delta(
                "apiserver_validating_admission_policy_check_total",
                &[("policy", &policy), ("enforcement_action", "deny")],
            ),
        ),
    ]);
    println!("apiserver counters during the outage: {got:?}");
    let want = BTreeMap::from([
        ("pods refused", 0.0),
        ("bindings refused", 2.0),
        ("pods failed open", 5.0),
        ("bindings failed open", 0.0),
        ("nodes failed open", 1.0),
        ("policy denied", 4.0),
    ]);
    ensure!(got == want, "apiserver counters {got:?}, want {want:?}");
    let codes: Vec<&str> = after
        .lines()
        .filter(|l| l.starts_with("apiserver_admission_webhook_request_total{") && l.contains(tag))
        .collect();
    println!(
        "apiserver_admission_webhook_request_total for this test:\n{}",
        codes.join("\n")
    );
    Ok(())
}

/// A listener that accepts connections and never answers (a replica frozen, or a network
/// path that swallows packets after the handshake): every call waits for `timeoutSeconds`.
async fn hang(listener: tokio::net::TcpListener) {
    let mut held = Vec::new();
    while let Ok((conn, _)) = listener.accept().await {
        held.push(conn);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_webhook_holds_each_call_for_its_timeout() {
    let cp = cp().await;
    let c = cp.client().expect("client");
    let tag = unique_name("hung");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let holder = tokio::spawn(hang(listener));
    let ca = TestCa::new().expect("test CA");
    let scope = Scope {
        label: Some((SCOPE_KEY.into(), tag.clone())),
        hook_infix: Some(tag.clone()),
    };
    webhook::register(cp, &c, &tag, port, ca.pem(), &scope)
        .await
        .expect("registering");
    policy::register(cp, &c, &tag, &scope)
        .await
        .expect("registering the policy");
    let result = hung(cp, &c, &tag).await;
    policy::unregister(&c, &tag).await;
    webhook::unregister(&c, &tag).await;
    holder.abort();
    result.expect("hung webhook e2e");
}

/// Registers a Node gated as the agent leaves it (`cni-verified=false`), in scope, without
/// the labels the Node webhook's pre-filter wants, so the hung webhook is not called.
async fn labelled_gated_node(c: &Client, tag: &str) -> anyhow::Result<String> {
    let name = unique_name("hung-node");
    let node: Node = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {SCOPE_KEY: tag, VERIFIED_LABEL: "false"}},
    }))?;
    let api: Api<Node> = Api::all(c.clone());
    tokio::time::timeout(CALL, api.create(&PostParams::default(), &node)).await??;
    Ok(name)
}

async fn hung(cp: &meshgate_e2e::ControlPlane, c: &Client, tag: &str) -> anyhow::Result<()> {
    let ns = cp.create_namespace(c, "hung").await?;
    let api: Api<Namespace> = Api::all(c.clone());
    let patch = Patch::Merge(json!({"metadata": {"labels": {SCOPE_KEY: tag}}}));
    tokio::time::timeout(CALL, api.patch(&ns, &PatchParams::default(), &patch))
        .await?
        .context("scoping the namespace")?;
    let gated = labelled_gated_node(c, tag).await?;
    let nowhere = unique_name("hung-none");
    let (at, no) = (Some(nowhere.as_str()), json!({}));
    let mut rows = Vec::new();
    // The scope label reaches admission through the namespace informer: wait until a pod
    // waits for the hung webhook (then admitted: it fails open).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let began = Instant::now();
        let probe = create_pod(c, &ns, &pod("probe", at, no.clone(), no.clone())?, true).await?;
        if began.elapsed() >= Duration::from_secs(4) {
            ensure!(
                probe.is_ok(),
                "the hung webhook's entry did not fail open: {probe:?}"
            );
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "the hung webhook was never called"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let pods = [
        (
            "pod with spec.nodeName, linkerd label, gated node",
            pod("meshed-gated", Some(&gated), linkerd(), no.clone()),
        ),
        (
            "pod with spec.nodeName, linkerd label, node not registered",
            pod("meshed", at, linkerd(), no.clone()),
        ),
        (
            "pod with spec.nodeName, no mesh label",
            pod("plain", at, no.clone(), no.clone()),
        ),
        (
            "pod without spec.nodeName",
            pod("unbound", None, no.clone(), no.clone()),
        ),
    ];
    for (what, p) in pods {
        record(&mut rows, what, &ns, create(c, &ns, p)).await?;
    }
    let what = "pods/binding, plain pod";
    record(&mut rows, what, &ns, bind(c, &ns, "unbound", &nowhere)).await?;
    rows.push(node_creation(c, tag).await?);
    print_table(
        "Both webhook replicas hung (connections accepted, never answered):",
        &rows,
    );
    force_delete_pods(c, &ns, &["meshed", "plain", "unbound"]).await;
    let nodes: Api<Node> = Api::all(c.clone());
    let _ = tokio::time::timeout(CALL, nodes.delete(&gated, &DeleteParams::default())).await;
    check_hung(&rows, tag)
}

/// The policy refuses at once; everything else waits for the webhook's timeout, then the
/// binding is refused (its entry fails closed) and the rest passes.
fn check_hung(rows: &[Row], tag: &str) -> anyhow::Result<()> {
    let have: Vec<String> = rows.iter().map(Row::verdict).collect();
    let mut want = vec![format!("refused: policy meshgate-{tag}")];
    want.extend(std::iter::repeat_n("admitted".to_owned(), 3));
    want.push(format!("refused: bindings.validate.{tag}.meshgate.io"));
    want.push("admitted".to_owned());
    ensure!(
        have == want,
        "outcomes with a hung webhook: {have:?}, want {want:?}"
    );
    ensure!(
        rows[0].waited < Duration::from_secs(1),
        "the policy's refusal waited {:?}",
        rows[0].waited
    );
    // The pod created without spec.nodeName is not sent to the webhook.
    for (i, r) in rows.iter().enumerate().filter(|(i, _)| *i != 0 && *i != 3) {
        ensure!(
            r.waited >= Duration::from_secs(4),
            "row {i} ({}) did not wait for the hung webhook: {:?}",
            r.what,
            r.waited
        );
    }
    Ok(())
}
