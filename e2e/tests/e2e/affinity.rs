//! The binding path in the apiserver itself: the affinity policy
//! (`templates/placement-affinity.yaml`) on a control plane of this test's own that serves
//! MutatingAdmissionPolicy (v1.35: the `MutatingAdmissionPolicy` gate and
//! `admissionregistration.k8s.io/v1beta1` on; v1 from 1.36), with the shipped webhook
//! configurations rendered for it, so the binding entry fails open.
//!
//! In: that control plane and its real kube-scheduler; the webhook in-process, then stopped;
//! the shipped placement and affinity policies scoped to this test's namespaces (plain,
//! ambient, opted out); two Nodes registered as a kubelet does (Leases renewed), one gated at
//! registration, one verified. Out: pass/fail on
//! - every pod of a matrix (mesh labels × namespace × tolerations × affinity it already has ×
//!   `spec.nodeName`), created (dry run): it gets `meshgate.io/cni-verified In ["true"]`,
//!   ANDed into each term, exactly when a built-in profile selects it, it tolerates the gate's
//!   taint and it is left to the scheduler; nothing else about it changes;
//! - with both webhook replicas dead: no request that needs no refusal is refused (bindings
//!   included); the scheduler binds tolerating meshed pods to the verified Node only; one that
//!   fits only the gated Node waits, and is bound once the Node is verified (printed: how
//!   long after the write); a meshed pod created on the gated Node is still refused.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use meshgate_core::gate::{TaintKey, VERIFIED_LABEL};
use meshgate_core::profile::{PodView, ProfileSet, Selected};
use meshgate_e2e::sim::policy;
use meshgate_e2e::{ControlPlane, NodeSpec, Options, unique_name};
use serde_json::{Value, json};

use crate::outage::{apiserver_metrics, sample_sum};
use crate::policy::pods as mesh_label_sets;
use crate::webhook::{CALL, Fixture, SCOPE_KEY, Start, bind, create_pod};

/// What turns MutatingAdmissionPolicy on in a v1.35 apiserver.
const MAP_FLAGS: [&str; 2] = [
    "--feature-gates=MutatingAdmissionPolicy=true",
    "--runtime-config=admissionregistration.k8s.io/v1beta1=true",
];

/// The scheduler name of pods that must stay unbound (no scheduler serves it).
const NOBODY: &str = "meshgate-e2e-nobody";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_affinity_policy_an_outage_refuses_no_binding_and_keeps_meshed_pods_off_gated_nodes()
 {
    crate::init_logging();
    let options = Options {
        apiserver_flags: MAP_FLAGS.iter().map(|f| f.to_string()).collect(),
        ..Options::default()
    };
    let cp = ControlPlane::start(options)
        .await
        .expect("a control plane serving MutatingAdmissionPolicy");
    let start = Start {
        kubeconfig: cp.admin_kubeconfig_path().to_path_buf(),
        profile_file: None,
        tag_hooks: true,
        mode: Default::default(),
        taint_key: Default::default(),
    };
    let mut f = Fixture::start_with(&cp, "aff", start)
        .await
        .expect("webhook starts");
    let result = run(&cp, &mut f).await;
    policy::unregister_affinity(&f.client, &f.tag).await;
    policy::unregister(&f.client, &f.tag).await;
    f.teardown().await;
    result.expect("affinity policy e2e");
}

async fn run(cp: &ControlPlane, f: &mut Fixture) -> anyhow::Result<()> {
    let c = f.client.clone();
    ensure!(
        bindings_failure_policy(&c, &f.tag).await? == "Ignore",
        "the shipped binding entry, rendered for an apiserver serving the affinity policy, \
         should fail open"
    );
    policy::register(cp, &c, &f.tag, &f.scope()).await?;
    ensure!(
        policy::register_affinity(cp, &c, &f.tag, &f.scope()).await?,
        "the chart rendered no affinity policy for an apiserver that serves it"
    );
    let ns = BTreeMap::from([
        (f.namespace(&[]).await?, BTreeMap::new()),
        (
            f.namespace(&[("istio.io/dataplane-mode", "ambient")])
                .await?,
            BTreeMap::from([("istio.io/dataplane-mode".to_owned(), "ambient".to_owned())]),
        ),
        (
            f.namespace(&[("meshgate.io/ignore", "true")]).await?,
            BTreeMap::from([("meshgate.io/ignore".to_owned(), "true".to_owned())]),
        ),
    ]);
    let nodes = Nodes::register(cp, f).await?;
    let governed = ns.keys().next().context("a namespace")?.clone();
    until_enforced(&c, &governed).await?;
    parity(&c, &ns, &nodes.verified).await?;
    f.stop_webhook().await?;
    let before = apiserver_metrics(&c).await?;
    outage(&c, &ns, &nodes).await?;
    let after = apiserver_metrics(&c).await?;
    // Six bindings went through the entry that fails open: three meshed pods', the plain
    // pod's (scheduler and client) and the waiting pod's.
    let name = format!("bindings.validate.{}.meshgate.io", f.tag);
    let delta = |m: &str| {
        sample_sum(&after, m, &[("name", &name)]) - sample_sum(&before, m, &[("name", &name)])
    };
    let (open, refused) = (
        delta("apiserver_admission_webhook_fail_open_count"),
        delta("apiserver_admission_webhook_rejection_count"),
    );
    println!("binding entry during the outage: {open} failed open, {refused} refused");
    ensure!(
        open == 6.0 && refused == 0.0,
        "binding entry: {open} failed open, {refused} refused; want 6 and 0"
    );
    Ok(())
}

/// The shipped binding entry's failure policy, as registered.
async fn bindings_failure_policy(c: &Client, tag: &str) -> anyhow::Result<String> {
    let api: Api<ValidatingWebhookConfiguration> = Api::all(c.clone());
    let config = tokio::time::timeout(CALL, api.get(&format!("meshgate-{tag}"))).await??;
    let hook = config
        .webhooks
        .unwrap_or_default()
        .into_iter()
        .find(|w| w.name.starts_with("bindings.validate."))
        .context("no binding entry")?;
    hook.failure_policy.context("no failure policy")
}

/// The apiserver loads policies asynchronously: wait until a tolerating meshed pod comes back
/// with the requirement.
async fn until_enforced(c: &Client, ns: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let p = pod(&Shape {
        labels: json!({"linkerd.io/control-plane-ns": "linkerd"}),
        toleration: Some(json!({"operator": "Exists"})),
        affinity: None,
        node: None,
    })?;
    loop {
        if let Ok(created) = create_pod(c, ns, &p, true).await?
            && requirement_count(&created) == 1
        {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "affinity policy not enforced after 20 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One pod of the matrix.
struct Shape {
    labels: Value,
    toleration: Option<Value>,
    affinity: Option<Value>,
    node: Option<String>,
}

fn pod(s: &Shape) -> anyhow::Result<Pod> {
    let mut spec = json!({
        "containers": [{"name": "app", "image": "registry.invalid/app:1"}],
        "schedulerName": NOBODY,
    });
    if let Some(t) = &s.toleration {
        spec["tolerations"] = json!([t]);
    }
    if let Some(a) = &s.affinity {
        spec["affinity"] = a.clone();
    }
    if let Some(n) = &s.node {
        spec["nodeName"] = json!(n);
    }
    Ok(serde_json::from_value(json!({
        "metadata": {"generateName": "aff-", "labels": s.labels},
        "spec": spec,
    }))?)
}

/// The ways a pod may tolerate the gate, or not: (toleration, tolerates it).
fn tolerations() -> Vec<(Option<Value>, bool)> {
    let key = TaintKey::default().as_str().to_owned();
    vec![
        (None, false),
        (Some(json!({"key": key, "operator": "Exists"})), true),
        (Some(json!({"operator": "Exists"})), true),
        (
            Some(json!({"key": key, "operator": "Exists", "effect": "NoExecute"})),
            false,
        ),
        (
            Some(json!({"key": "other.io/taint", "operator": "Exists"})),
            false,
        ),
    ]
}

/// Affinities a pod may already have.
fn affinities() -> Vec<Option<Value>> {
    vec![
        None,
        Some(
            json!({"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 1, "podAffinityTerm": {"topologyKey": "zone", "labelSelector": {"matchLabels": {"app": "x"}}}}
            ]}}),
        ),
        Some(json!({"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]},
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
            ]},
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 1, "preference": {"matchExpressions": [{"key": "z", "operator": "Exists"}]}}
            ],
        }})),
    ]
}

/// The affinity the pod should come back with: `before`, with the requirement ANDed into
/// each required term (or as the only one) when `gets` is true.
fn expected_affinity(before: Option<&Value>, gets: bool) -> Value {
    let mut after = before.cloned().unwrap_or(Value::Null);
    if !gets {
        return after;
    }
    let req = json!({"key": VERIFIED_LABEL, "operator": "In", "values": ["true"]});
    if after.is_null() {
        after = json!({});
    }
    let terms = &mut after["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"];
    match terms.as_array_mut() {
        Some(terms) => {
            for t in terms {
                let exprs = t
                    .as_object_mut()
                    .map(|o| o.entry("matchExpressions").or_insert_with(|| json!([])));
                if let Some(Value::Array(a)) = exprs {
                    a.push(req.clone());
                }
            }
        }
        None => *terms = json!([{"matchExpressions": [req]}]),
    }
    after
}

/// Every pod of the matrix, created (dry run): its affinity is what [`expected_affinity`]
/// says.
async fn parity(
    c: &Client,
    namespaces: &BTreeMap<String, BTreeMap<String, String>>,
    verified: &str,
) -> anyhow::Result<()> {
    let profiles = ProfileSet::all_builtin();
    let (mut given, mut left, mut wrong) = (0, 0, Vec::new());
    for (ns, ns_labels) in namespaces {
        let governed = !ns_labels.contains_key("meshgate.io/ignore");
        for (what, labels, annotations) in mesh_label_sets() {
            let l: BTreeMap<String, String> = serde_json::from_value(labels.clone())?;
            let a: BTreeMap<String, String> = serde_json::from_value(annotations.clone())?;
            let view = PodView {
                labels: &l,
                annotations: &a,
                namespace_labels: Some(ns_labels),
            };
            let selected = profiles.selection(view).any(|(_, s)| s == Selected::Yes);
            for (toleration, tolerates) in tolerations() {
                for affinity in affinities() {
                    for node in [None, Some(verified.to_owned())] {
                        let gets = governed && selected && tolerates && node.is_none();
                        let shape = Shape {
                            labels: labels.clone(),
                            toleration: toleration.clone(),
                            affinity: affinity.clone(),
                            node,
                        };
                        let mut p = pod(&shape)?;
                        p.metadata.annotations = serde_json::from_value(annotations.clone())?;
                        let created = match create_pod(c, ns, &p, true).await? {
                            Ok(created) => created,
                            Err(m) => bail!("{what} in {ns} refused: {m}"),
                        };
                        let have = serde_json::to_value(
                            created.spec.as_ref().and_then(|s| s.affinity.clone()),
                        )?;
                        let want = expected_affinity(affinity.as_ref(), gets);
                        if have != want {
                            wrong.push(format!(
                                "{what} in {ns}, toleration {toleration:?}, node {:?}: \
                                 {have} (want {want})",
                                shape.node
                            ));
                        }
                        if gets { given += 1 } else { left += 1 }
                    }
                }
            }
        }
    }
    println!("affinity policy: {given} pods given the requirement, {left} left as they were");
    ensure!(
        wrong.is_empty(),
        "{} pods differ:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
    ensure!(
        given > 0 && left > 0,
        "the matrix did not cover both outcomes"
    );
    Ok(())
}

/// Required node-affinity expressions on `meshgate.io/cni-verified`.
fn requirement_count(p: &Pod) -> usize {
    let v =
        serde_json::to_value(p.spec.as_ref().and_then(|s| s.affinity.clone())).unwrap_or_default();
    v["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        .as_array()
        .map(|terms| {
            terms
                .iter()
                .flat_map(|t| {
                    t["matchExpressions"]
                        .as_array()
                        .cloned()
                        .unwrap_or_default()
                })
                .filter(|e| e["key"] == VERIFIED_LABEL)
                .count()
        })
        .unwrap_or(0)
}

/// The two Nodes: registered as a kubelet does, in this test's scope, while the webhook is up.
struct Nodes {
    /// Gated at registration (labelled `false`, tainted).
    gated: String,
    /// Labelled verified, its taint removed, as the agent does.
    verified: String,
}

impl Nodes {
    async fn register(cp: &ControlPlane, f: &Fixture) -> anyhow::Result<Self> {
        let mut names = Vec::new();
        for _ in 0..2 {
            let name = unique_name("aff-node");
            let spec = NodeSpec::new(&name).label(SCOPE_KEY, &f.tag).pods(20);
            let node = cp.register_node(&f.client, &spec).await?;
            let labels = node.metadata.labels.unwrap_or_default();
            ensure!(
                labels.get(VERIFIED_LABEL).map(String::as_str) == Some("false"),
                "{name} not gated at registration: {labels:?}"
            );
            names.push(name);
        }
        let nodes = Self {
            verified: names.pop().context("two nodes")?,
            gated: names.pop().context("two nodes")?,
        };
        verify(&f.client, &nodes.verified, &f.taint_key).await?;
        Ok(nodes)
    }
}

/// What the agent writes once the chain is verified: the label `true`, no gate taint.
async fn verify(c: &Client, node: &str, taint_key: &str) -> anyhow::Result<()> {
    let api: Api<Node> = Api::all(c.clone());
    let n = tokio::time::timeout(CALL, api.get(node)).await??;
    let taints: Vec<_> = n
        .spec
        .and_then(|s| s.taints)
        .unwrap_or_default()
        .into_iter()
        .filter(|t| t.key != taint_key)
        .collect();
    let patch = json!({
        "metadata": {"labels": {VERIFIED_LABEL: "true"}},
        "spec": {"taints": taints},
    });
    tokio::time::timeout(
        CALL,
        api.patch(node, &PatchParams::default(), &Patch::Merge(patch)),
    )
    .await??;
    Ok(())
}

/// Both replicas dead (the webhook stopped: connections refused).
async fn outage(
    c: &Client,
    namespaces: &BTreeMap<String, BTreeMap<String, String>>,
    nodes: &Nodes,
) -> anyhow::Result<()> {
    let mut ns = namespaces.keys();
    let (governed, ambient) = (
        ns.next().context("governed")?.clone(),
        ns.next().context("ambient")?.clone(),
    );
    let tolerate_all = Some(json!({"operator": "Exists"}));
    let linkerd = json!({"linkerd.io/control-plane-ns": "linkerd"});
    let scheduled = |labels: &Value, affinity: Option<Value>| Shape {
        labels: labels.clone(),
        toleration: tolerate_all.clone(),
        affinity,
        node: None,
    };
    let only_gated = Some(
        json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
        {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [nodes.gated]}]}]}}}),
    );

    // Meshed pods that tolerate the gate, left to the scheduler: bound to the verified Node.
    let mut meshed = Vec::new();
    for (ns, labels) in [
        (&governed, linkerd.clone()),
        (&governed, json!({"security.istio.io/tlsMode": "istio"})),
        (&ambient, json!({})),
    ] {
        meshed.push((
            ns.clone(),
            scheduled_pod(c, ns, &scheduled(&labels, None)).await?,
        ));
    }
    // A plain pod that fits only the gated Node: its binding needs no refusal.
    let plain = scheduled_pod(c, &governed, &scheduled(&json!({}), only_gated.clone())).await?;
    // A meshed pod that fits only the gated Node: it must wait for it.
    let waiting = scheduled_pod(c, &governed, &scheduled(&linkerd, only_gated)).await?;
    for (ns, name) in &meshed {
        let on = until_bound(c, ns, name, Duration::from_secs(30)).await?;
        ensure!(
            on == nodes.verified,
            "meshed pod {ns}/{name} bound to {on}, not the verified Node"
        );
    }
    let on = until_bound(c, &governed, &plain, Duration::from_secs(30)).await?;
    ensure!(on == nodes.gated, "plain pod bound to {on}");
    // A binding posted by a client (not the scheduler) of a plain pod: admitted.
    let mut unbound = pod(&scheduled(&json!({}), None))?;
    unbound.metadata.generate_name = None;
    unbound.metadata.name = Some(unique_name("aff-unbound"));
    let name = unbound.metadata.name.clone().unwrap_or_default();
    create_pod(c, &governed, &unbound, false)
        .await?
        .map_err(anyhow::Error::msg)?;
    bind(c, &governed, &name, &nodes.gated)
        .await?
        .map_err(|m| anyhow::anyhow!("a plain pod's binding refused during the outage: {m}"))?;
    // Still refused, by the placement policy: a meshed pod created on the gated Node.
    let on_gated = Shape {
        labels: linkerd.clone(),
        toleration: None,
        affinity: None,
        node: Some(nodes.gated.clone()),
    };
    ensure!(
        create_pod(c, &governed, &pod(&on_gated)?, true)
            .await?
            .is_err(),
        "a meshed pod created on the gated Node admitted during the outage"
    );
    // The waiting pod: unbound while the Node is gated, bound once it is verified.
    let settle = Duration::from_secs(3);
    ensure!(
        until_bound(c, &governed, &waiting, settle).await.is_err(),
        "a meshed pod was bound to the gated Node"
    );
    let written = Instant::now();
    verify(c, &nodes.gated, TaintKey::default().as_str()).await?;
    until_bound(c, &governed, &waiting, Duration::from_secs(30)).await?;
    println!(
        "outage with the affinity policy: {} meshed pods bound to the verified Node, a plain \
         pod's bindings (scheduler and client) admitted, 0 refusals needing none; the meshed \
         pod that fits only the gated Node bound {:?} after the Node was verified",
        meshed.len(),
        written.elapsed()
    );
    Ok(())
}

/// Creates `s` for the real scheduler; its name.
async fn scheduled_pod(c: &Client, ns: &str, s: &Shape) -> anyhow::Result<String> {
    let mut p = pod(s)?;
    if let Some(spec) = p.spec.as_mut() {
        spec.scheduler_name = None;
    }
    let created = create_pod(c, ns, &p, false)
        .await?
        .map_err(|m| anyhow::anyhow!("pod refused during the outage: {m}"))?;
    created
        .metadata
        .name
        .context("a created pod without a name")
}

/// Waits up to `timeout` until `ns/name` is bound; the Node's name.
async fn until_bound(
    c: &Client,
    ns: &str,
    name: &str,
    timeout: Duration,
) -> anyhow::Result<String> {
    let api: Api<Pod> = Api::namespaced(c.clone(), ns);
    let deadline = Instant::now() + timeout;
    loop {
        let p = tokio::time::timeout(CALL, api.get(name)).await??;
        if let Some(node) = p.spec.and_then(|s| s.node_name).filter(|n| !n.is_empty()) {
            return Ok(node);
        }
        ensure!(
            Instant::now() < deadline,
            "{ns}/{name} not bound after {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What the chart renders, by mode and by the MutatingAdmissionPolicy version the apiserver
/// serves: the affinity policy (its apiVersion, or none) and the binding entry's failure
/// policy. Ignore only where an outage admits nothing the apiserver would not refuse itself.
#[tokio::test]
async fn the_binding_entry_fails_open_only_where_the_apiserver_keeps_meshed_pods_off() {
    const V1: &str = "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy";
    const BETA: &str = "admissionregistration.k8s.io/v1beta1/MutatingAdmissionPolicy";
    let cases = [
        ("enforce", None, None, "Fail"),
        (
            "enforce",
            Some(BETA),
            Some("admissionregistration.k8s.io/v1beta1"),
            "Ignore",
        ),
        (
            "enforce",
            Some(V1),
            Some("admissionregistration.k8s.io/v1"),
            "Ignore",
        ),
        (
            "condition-only",
            Some(V1),
            Some("admissionregistration.k8s.io/v1"),
            "Fail",
        ),
        ("condition-only", None, None, "Fail"),
        ("report", Some(V1), None, "Ignore"),
        ("report", None, None, "Ignore"),
    ];
    let mut wrong = Vec::new();
    for (mode, served, want_api, want_policy) in cases {
        let set = format!("mode={mode}");
        let mut args = vec![
            "--show-only",
            "templates/webhook-configurations.yaml",
            "--show-only",
            policy::AFFINITY,
            "--set",
            &set,
        ];
        if let Some(kind) = served {
            args.extend(["--api-versions", kind]);
        }
        // A template that renders nothing makes --show-only fail: render both, or only the
        // configurations where no policy is expected.
        if want_api.is_none() {
            args.drain(2..4);
        }
        let text = meshgate_e2e::harness::helm::template(&args)
            .await
            .unwrap_or_else(|e| panic!("rendering {mode} with {served:?}: {e}"));
        // Line-wise, as helm writes it: the policy's apiVersion is the line before its kind;
        // the entry's failurePolicy is the first after its name.
        let lines: Vec<&str> = text.lines().collect();
        let api = lines
            .iter()
            .position(|l| *l == "kind: MutatingAdmissionPolicy")
            .and_then(|i| lines.get(i.checked_sub(1)?))
            .and_then(|l| l.strip_prefix("apiVersion: "))
            .map(str::to_owned);
        let policy = lines
            .iter()
            .skip_while(|l| l.trim() != "- name: bindings.validate.meshgate.io")
            .find_map(|l| l.trim().strip_prefix("failurePolicy: "))
            .map(str::to_owned);
        if api.as_deref() != want_api || policy.as_deref() != Some(want_policy) {
            wrong.push(format!(
                "{mode}, served {served:?}: policy {api:?}, bindings {policy:?} \
                 (want {want_api:?}, {want_policy})"
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
