//! What a stolen meshgate-agent token can read and write, asked of a real kube-apiserver with
//! the token of an agent pod: with the chart's default RBAC and with its opt-in
//! `agent.impersonateNode` (reads and evictions as the node itself, Constrained
//! Impersonation). Each assertion is a row of docs/reliability.md, "What a stolen
//! agent token can do".
//!
//! In: a dedicated control plane whose apiserver runs with
//! `--feature-gates=ConstrainedImpersonation=true` (alpha in 1.35: the shared one stays as
//! clusters run by default), the chart's namespace, ServiceAccounts, RBAC and admission
//! policies (rendered with `helm template`; no webhook, no workloads), two tainted nodes, an
//! application pod with an environment value on each, and tokens bound to pods on node A.
//! Out: pass/fail; the impersonation ClusterRole replaces the default one halfway through, so
//! the two modes run one after the other in a single test.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::SystemTime;

use anyhow::{Context as _, bail, ensure};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Node, Pod, Secret};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams, WatchParams};
use kube::{Client, ResourceExt};
use meshgate_agent::daemon::clients::{Clients, node_user};
use meshgate_agent::daemon::node::{NodeGate, TaintEffect, TaintKey};
use meshgate_core::gate::{DEFAULT_TAINT_KEY as TAINT_KEY, VERIFIED_LABEL};
use meshgate_core::mode::Mode;
use meshgate_e2e::harness::audit;
use meshgate_e2e::harness::helm;
use meshgate_e2e::harness::wait::poll_until;
use meshgate_e2e::sim::node::{Agent, CniDirs, golden, tainted};
use meshgate_e2e::{ControlPlane, NodeSpec, Options, TokenOptions, unique_name};
use serde_json::json;

use crate::WAIT;
use crate::support::{
    AGENT, BASE_CONFINEMENT, NS, apply_base_files, bound_token, dry_run_eviction, effective_rules,
    expect_forbidden, expect_policy, label_verified_dry_run, mode_reader_rules, refused_by_policy,
    refused_by_rbac, triples, verdict,
};

/// A ServiceAccount of this test only, for what the agent is not granted as the node.
const PROBE: &str = "meshgate-probe";
/// The alpha feature behind the component.
pub(crate) const GATE: &str = "--feature-gates=ConstrainedImpersonation=true";
/// The Node authorizer's refusal of a pod list or watch not scoped to the node.
const SELECTOR_ONLY: &str = "can only list/watch pods with spec.nodeName field selector";
/// The environment variable each application pod carries (what a Pod read discloses).
pub(crate) const ENV: &str = "DATABASE_PASSWORD";

/// The control plane and the objects both modes ask about (reach.rs's too).
pub(crate) struct Fixture {
    pub(crate) cp: ControlPlane,
    pub(crate) admin: Client,
    pub(crate) node_a: String,
    pub(crate) node_b: String,
    /// The application namespace, with pod `on-a` on node A and `on-b` on node B.
    pub(crate) app: String,
    /// The environment value of `on-b` (node B's pod).
    pub(crate) secret_b: String,
    /// Kubeconfig with meshgate-agent's token bound to its pod on node A.
    pub(crate) agent_kubeconfig: PathBuf,
}

impl Fixture {
    /// The stolen token, as itself and as node A (or another node).
    pub(crate) async fn agent(&self, act_as: &str) -> anyhow::Result<Clients> {
        Clients::build(Some(&self.agent_kubeconfig), act_as, true, false).await
    }
}

/// A pod in `ns` on `node` with an environment value, as an application writes one.
async fn app_pod(
    admin: &Client,
    ns: &str,
    name: &str,
    node: &str,
    sa: &str,
) -> anyhow::Result<Pod> {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "nodeName": node,
            "serviceAccountName": sa,
            "containers": [{
                "name": "app", "image": "registry.invalid/app:1",
                "env": [{"name": ENV, "value": unique_name("value")}],
            }],
        },
    }))?;
    let api: Api<Pod> = Api::namespaced(admin.clone(), ns);
    Ok(
        poll_until(&format!("creating pod {ns}/{name}"), WAIT, || async {
            api.create(&PostParams::default(), &pod).await.map(Some)
        })
        .await?,
    )
}

pub(crate) fn env_value(p: &Pod) -> Option<String> {
    p.spec
        .as_ref()?
        .containers
        .first()?
        .env
        .as_ref()?
        .iter()
        .find_map(|e| (e.name == ENV).then(|| e.value.clone()).flatten())
}

async fn setup() -> anyhow::Result<Fixture> {
    let cp = ControlPlane::start(Options {
        apiserver_flags: vec![GATE.into()],
        ..Options::default()
    })
    .await
    .context("starting a control plane with ConstrainedImpersonation")?;
    seed(cp, "authz").await
}

/// On `cp`: the chart's base (namespace, ServiceAccounts, RBAC and policies rendered with the
/// default values for the pinned version), nodes A and B, an application pod with an
/// environment value on each, and the agent's token bound to a pod on node A. `prefix` names
/// the nodes, the namespace and the kubeconfig.
pub(crate) async fn seed(cp: ControlPlane, prefix: &str) -> anyhow::Result<Fixture> {
    let admin = cp.client()?;
    apply_base_files(&cp, &BASE_CONFINEMENT, &[])
        .await
        .context("applying the chart's RBAC")?;

    let node_a = unique_name(&format!("{prefix}-a"));
    let node_b = unique_name(&format!("{prefix}-b"));
    for n in [&node_a, &node_b] {
        cp.register_node(&admin, &NodeSpec::new(n).taint(TAINT_KEY, "NoSchedule"))
            .await?;
    }
    let app = cp.create_namespace(&admin, prefix).await?;
    app_pod(&admin, &app, "on-a", &node_a, "default").await?;
    let on_b = app_pod(&admin, &app, "on-b", &node_b, "default").await?;
    let secret_b = env_value(&on_b).context("on-b's env")?;
    let agent_pod = app_pod(&admin, NS, &unique_name("agent"), &node_a, AGENT).await?;
    let token = bound_token(&admin, AGENT, agent_pod).await?;
    let agent_kubeconfig = cp.write_token_kubeconfig(&format!("{prefix}-agent"), &token)?;
    Ok(Fixture {
        cp,
        admin,
        node_a,
        node_b,
        app,
        secret_b,
        agent_kubeconfig,
    })
}

#[tokio::test]
async fn a_stolen_agent_token_reaches_only_what_each_mode_grants() -> anyhow::Result<()> {
    crate::init_logging();
    let f = setup().await?;
    default_reads(&f).await.context("default RBAC: reads")?;
    default_writes(&f).await.context("default RBAC: writes")?;
    switch_to_impersonation(&f).await?;
    impersonation_reads(&f)
        .await
        .context("impersonation: reads")?;
    impersonation_writes(&f)
        .await
        .context("impersonation: writes")?;
    node_writes_stay_with_the_service_account(&f)
        .await
        .context("why Node writes are not made as the node")?;
    agent_runs_as_its_node(&f)
        .await
        .context("the agent binary with --impersonate-node")?;
    Ok(())
}

/// Default: the token reads every Pod (their environment included), Node and Namespace.
async fn default_reads(f: &Fixture) -> anyhow::Result<()> {
    let me = f.agent(&f.node_a).await?.own;
    let pods = Api::<Pod>::all(me.clone())
        .list(&ListParams::default())
        .await?;
    let on_b = pods
        .items
        .iter()
        .find(|p| p.name_any() == "on-b" && p.namespace().as_deref() == Some(&f.app))
        .context("the pod on node B, listed cluster-wide")?;
    assert_eq!(env_value(on_b).as_deref(), Some(f.secret_b.as_str()));
    let nodes = Api::<Node>::all(me.clone())
        .list(&ListParams::default())
        .await?;
    let names: Vec<String> = nodes.items.iter().map(ResourceExt::name_any).collect();
    ensure!(names.contains(&f.node_b), "node B not listed: {names:?}");
    Api::<Namespace>::all(me.clone())
        .list(&ListParams::default())
        .await?;
    // Never Secrets or ConfigMaps, and no impersonation at all.
    let secret = Api::<Secret>::namespaced(me.clone(), &f.app)
        .list(&ListParams::default())
        .await;
    expect_forbidden(&secret, "cannot ")?;
    let cm = Api::<ConfigMap>::namespaced(me, &f.app)
        .list(&ListParams::default())
        .await;
    expect_forbidden(&cm, "cannot ")?;
    let as_node = Api::<Pod>::all(f.agent(&f.node_a).await?.node)
        .list(&ListParams::default().fields(&format!("spec.nodeName={}", f.node_a)))
        .await;
    expect_forbidden(&as_node, "cannot impersonate-on:associated-node:list")?;
    Ok(())
}

/// An events.k8s.io Event by meshgate-agent of node A about `regarding`, in `ns`.
fn event(node: &str, regarding: serde_json::Value) -> anyhow::Result<Event> {
    Ok(serde_json::from_value(json!({
        "metadata": {"generateName": "authz-"},
        "eventTime": "2026-01-01T00:00:00.000000Z",
        "reportingController": AGENT, "reportingInstance": node,
        "action": "Inspect", "reason": "MeshRedirectMissing", "type": "Warning",
        "note": "forged",
        "regarding": regarding,
    }))?)
}

fn dry_run() -> PostParams {
    PostParams {
        dry_run: true,
        ..Default::default()
    }
}

/// Default: writes stay confined by the admission policies, Events about pods included.
async fn default_writes(f: &Fixture) -> anyhow::Result<()> {
    let me = f.agent(&f.node_a).await?.own;
    // The policies' Pod parameters come from an informer started with the policy: wait for it.
    let evictions: Api<Pod> = Api::namespaced(me.clone(), &f.app);
    poll_until(
        "the eviction policy to refuse the pod on node B",
        WAIT,
        || async {
            let r = evictions.evict("on-b", &dry_run_eviction()).await;
            anyhow::Ok(refused_by_policy(&r, "meshgate-agent-own-node-evictions").then_some(()))
        },
    )
    .await?;
    let label_b = label_verified_dry_run(&Api::all(me.clone()), &f.node_b).await;
    expect_policy(&label_b, "meshgate-agent-own-node")?;
    let events: Api<Event> = Api::namespaced(me.clone(), &f.app);
    let pod_ref =
        |name: &str| json!({"apiVersion": "v1", "kind": "Pod", "namespace": f.app, "name": name});
    // Events are published only after the policies' Pod informer has the pods.
    poll_until("an Event about the pod on node A", WAIT, || async {
        let ok = events
            .create(&dry_run(), &event(&f.node_a, pod_ref("on-a"))?)
            .await
            .is_ok();
        anyhow::Ok(ok.then_some(()))
    })
    .await?;
    let about_b = events
        .create(&dry_run(), &event(&f.node_a, pod_ref("on-b"))?)
        .await;
    expect_policy(&about_b, "meshgate-agent-own-pod-events")?;
    let why = format!(
        "not about pod {}/on-b, which is on node {}",
        f.app, f.node_b
    );
    expect_forbidden(&about_b, &why)?;
    // Put in another namespace, where no pod is, the same Event is refused too.
    let elsewhere = Api::<Event>::namespaced(me, "default")
        .create(&dry_run(), &event(&f.node_a, pod_ref("on-b"))?)
        .await;
    expect_policy(&elsewhere, "meshgate-agent-own-events")?;
    Ok(())
}

/// `helm template` of the chart with `args`, written to a file in `cp`'s directory.
async fn render(cp: &ControlPlane, name: &str, args: &[&str]) -> anyhow::Result<String> {
    let rendered = helm::template(args).await?;
    let path = cp.dir().join(format!("{name}.yaml"));
    std::fs::write(&path, rendered)?;
    Ok(path.display().to_string())
}

/// Applies the impersonation ClusterRole, after checking the chart renders it with
/// agent.impersonateNode and passes a server-side dry run as a whole install.
async fn switch_to_impersonation(f: &Fixture) -> anyhow::Result<()> {
    const ON: &str = "agent.impersonateNode=true";
    // Without the `helm test` hook: its Pod's ServiceAccount would have to exist for a dry
    // run (rbac::chart checks the hook).
    let whole = render(&f.cp, "authz-impersonation", &["--set", ON, "--skip-tests"]).await?;
    let rendered = std::fs::read_to_string(&whole)?;
    ensure!(
        rendered.contains("MESHGATE_IMPERSONATE_NODE: \"true\"")
            && rendered.contains("impersonate:associated-node"),
        "agent.impersonateNode did not render: {rendered}"
    );
    f.cp.kubectl(&["apply", "-f", &whole, "--dry-run=server"])
        .await
        .context("server-side dry run of the chart with agent.impersonateNode")?;
    let only = [
        "--set",
        ON,
        "--show-only",
        "templates/agent-clusterrole-impersonation.yaml",
    ];
    let role = render(&f.cp, "authz-impersonation-role", &only).await?;
    f.cp.kubectl(&["apply", "-f", &role]).await?;
    let me = f.agent(&f.node_a).await?.own;
    let pods: Api<Pod> = Api::all(me);
    poll_until("the base's pod list revoked", WAIT, || async {
        let r = pods.list(&ListParams::default().limit(1)).await;
        anyhow::Ok(refused_by_rbac(&r).then_some(()))
    })
    .await?;
    Ok(())
}

/// With the component: the ServiceAccount reads no Pod or Node any more; as node A, the
/// token reads node A and the pods bound to it, nothing else.
async fn impersonation_reads(f: &Fixture) -> anyhow::Result<()> {
    let clients = f.agent(&f.node_a).await?;
    as_itself_it_reads_no_pod_or_node(f, &clients).await?;
    as_the_node_it_reads_its_own_only(f, &clients).await
}

/// The agent's rules with the impersonation component, in every namespace.
fn impersonation_rules() -> BTreeSet<(String, String, String)> {
    triples(&[
        ("", &["nodes"], &["patch"]),
        ("", &["nodes/status"], &["patch"]),
        ("events.k8s.io", &["events"], &["create", "patch"]),
        ("", &["namespaces"], &["list", "watch"]),
        (
            "authentication.k8s.io",
            &["nodes"],
            &["impersonate:associated-node"],
        ),
        (
            "",
            &["nodes"],
            &[
                "impersonate-on:associated-node:get",
                "impersonate-on:associated-node:list",
                "impersonate-on:associated-node:watch",
            ],
        ),
        (
            "",
            &["pods"],
            &[
                "impersonate-on:associated-node:list",
                "impersonate-on:associated-node:watch",
            ],
        ),
        (
            "",
            &["pods/eviction"],
            &["impersonate-on:associated-node:create"],
        ),
    ])
}

/// As itself, the ServiceAccount has only the impersonation rules: it reads no Node (nor
/// Pod), and Namespaces stay readable.
async fn as_itself_it_reads_no_pod_or_node(f: &Fixture, clients: &Clients) -> anyhow::Result<()> {
    let want = impersonation_rules();
    for ns in [NS, "default", f.app.as_str()] {
        let mut want = want.clone();
        if ns == NS {
            // The base's Role: the one ConfigMap that holds the mode.
            want.extend(mode_reader_rules());
        }
        assert_eq!(
            effective_rules(&clients.own, ns).await?,
            want,
            "rules in {ns}"
        );
    }
    let own_nodes = Api::<Node>::all(clients.own.clone()).get(&f.node_a).await;
    expect_forbidden(&own_nodes, "cannot ")?;
    Api::<Namespace>::all(clients.own.clone())
        .list(&ListParams::default().limit(1))
        .await
        .context("Namespaces stay readable as itself")?;
    Ok(())
}

/// As node A, the token lists and watches node A's pods and reads node A, and nothing else:
/// every pod, node B's pods, node B, all nodes and Secrets are refused.
async fn as_the_node_it_reads_its_own_only(f: &Fixture, clients: &Clients) -> anyhow::Result<()> {
    let pods: Api<Pod> = Api::all(clients.node.clone());
    let mine = ListParams::default().fields(&format!("spec.nodeName={}", f.node_a));
    let listed = pods
        .list(&mine)
        .await
        .context("its node's pods, as the node")?;
    let names: Vec<String> = listed.items.iter().map(ResourceExt::name_any).collect();
    ensure!(
        names.contains(&"on-a".to_owned()) && !names.contains(&"on-b".to_owned()),
        "{names:?}"
    );
    // A watch is authorized before its stream begins: Ok here means the apiserver let it run.
    let watching = WatchParams::default().fields(&format!("spec.nodeName={}", f.node_a));
    let stream = pods.watch(&watching.timeout(1), "0").await;
    ensure!(
        stream.is_ok(),
        "watching its node's pods, as the node: refused"
    );
    let every = pods.watch(&WatchParams::default().timeout(1), "0").await;
    expect_forbidden(&every.map(|_| "a watch stream"), SELECTOR_ONLY)
        .context("watching every pod")?;
    for (what, lp) in [
        ("every pod", ListParams::default()),
        (
            "node B's pods",
            ListParams::default().fields(&format!("spec.nodeName={}", f.node_b)),
        ),
    ] {
        let r = pods.list(&lp).await;
        expect_forbidden(&r, SELECTOR_ONLY).context(what)?;
    }
    let nodes: Api<Node> = Api::all(clients.node.clone());
    nodes
        .get(&f.node_a)
        .await
        .context("its own Node, as the node")?;
    let b = nodes.get(&f.node_b).await;
    expect_forbidden(&b, "only its own Node object")?;
    let all = nodes.list(&ListParams::default()).await;
    expect_forbidden(&all, "cannot read all nodes")?;
    let secret = Api::<Secret>::namespaced(clients.node.clone(), &f.app)
        .list(&ListParams::default())
        .await;
    expect_forbidden(&secret, "cannot impersonate-on:associated-node:list")?;
    Ok(())
}

/// With the component: evictions as the node reach its own pods only (NodeRestriction);
/// nothing else is granted as the node; no other node, and no token without one.
async fn impersonation_writes(f: &Fixture) -> anyhow::Result<()> {
    let as_a = f.agent(&f.node_a).await?.node;
    let evictions: Api<Pod> = Api::namespaced(as_a.clone(), &f.app);
    let b = evictions.evict("on-b", &dry_run_eviction()).await;
    expect_forbidden(&b, "can only evict pods with spec.nodeName set to itself")?;
    evictions
        .evict("on-a", &dry_run_eviction())
        .await
        .context("evicting its own node's pod, as the node")?;
    let label = label_verified_dry_run(&Api::all(as_a.clone()), &f.node_a).await;
    expect_forbidden(&label, "cannot impersonate-on:associated-node:patch")?;
    let ev = Api::<Event>::namespaced(as_a, "default")
        .create(
            &dry_run(),
            &event(
                &f.node_a,
                json!({"apiVersion": "v1", "kind": "Node", "name": f.node_a}),
            )?,
        )
        .await;
    expect_forbidden(&ev, "cannot impersonate-on:associated-node:create")?;

    // Node A's token acting as node B; an unbound token of the same ServiceAccount acting
    // as node A: both refused before any authorizer sees the request.
    let as_b = f.agent(&f.node_b).await?.node;
    let mine_b = ListParams::default().fields(&format!("spec.nodeName={}", f.node_b));
    let r = Api::<Pod>::all(as_b).list(&mine_b).await;
    expect_forbidden(&r, "cannot impersonate").context("as node B")?;
    let unbound =
        meshgate_e2e::service_account_token(&f.admin, NS, AGENT, &TokenOptions::default()).await?;
    let path = f.cp.write_token_kubeconfig("authz-unbound", &unbound)?;
    let loose = Clients::build(Some(&path), &f.node_a, true, false)
        .await?
        .node;
    let mine_a = ListParams::default().fields(&format!("spec.nodeName={}", f.node_a));
    let r = Api::<Pod>::all(loose).list(&mine_a).await;
    expect_forbidden(&r, "cannot impersonate").context("a token bound to no pod")?;
    Ok(())
}

/// Why the agent's Node writes stay with its ServiceAccount and the policies: as the node,
/// NodeRestriction refuses the very write meshgate makes (its taint), and admits what the
/// policies refuse (cordoning, annotations, other conditions). Shown with a ServiceAccount of
/// this test granted `patch` as its associated node.
async fn node_writes_stay_with_the_service_account(f: &Fixture) -> anyhow::Result<()> {
    let role = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": PROBE},
        "rules": [
            {"apiGroups": ["authentication.k8s.io"], "resources": ["nodes"], "verbs": ["impersonate:associated-node"]},
            {"apiGroups": [""], "resources": ["nodes", "nodes/status"], "verbs": ["impersonate-on:associated-node:patch"]},
        ],
    });
    let binding = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": PROBE},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": PROBE},
        "subjects": [{"kind": "ServiceAccount", "name": PROBE, "namespace": NS}],
    });
    let sa = json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": PROBE, "namespace": NS}});
    let file = f.cp.dir().join("authz-probe.json");
    std::fs::write(
        &file,
        serde_json::to_vec(
            &json!({"apiVersion": "v1", "kind": "List", "items": [sa, role, binding]}),
        )?,
    )?;
    f.cp.kubectl(&["apply", "-f", &file.display().to_string()])
        .await?;
    let pod = app_pod(&f.admin, NS, &unique_name("probe"), &f.node_a, PROBE).await?;
    let token = bound_token(&f.admin, PROBE, pod).await?;
    let path = f.cp.write_token_kubeconfig("authz-probe", &token)?;
    let nodes: Api<Node> = Api::all(
        Clients::build(Some(&path), &f.node_a, true, false)
            .await?
            .node,
    );
    let dry = PatchParams::default().dry_run();
    let untaint = poll_until("the probe's role in effect", WAIT, || async {
        let r = nodes
            .patch(
                &f.node_a,
                &dry,
                &Patch::Merge(json!({"spec": {"taints": null}})),
            )
            .await;
        anyhow::Ok((!refused_by_rbac(&r)).then_some(r))
    })
    .await?;
    expect_forbidden(&untaint, "is not allowed to modify taints")?;
    for (what, patch) in [
        ("cordon", json!({"spec": {"unschedulable": true}})),
        (
            "annotate",
            json!({"metadata": {"annotations": {"example.com/x": "y"}}}),
        ),
        (
            "label",
            json!({"metadata": {"labels": {VERIFIED_LABEL: "true"}}}),
        ),
    ] {
        nodes
            .patch(&f.node_a, &dry, &Patch::Merge(patch))
            .await
            .with_context(|| format!("{what} as the node (NodeRestriction admits it)"))?;
    }
    nodes
        .patch_status(
            &f.node_a,
            &dry,
            &Patch::Strategic(json!({"status": {"conditions": [{"type": "Ready", "status": "False", "reason": "Forged"}]}})),
        )
        .await
        .context("Ready=False as the node")?;
    Ok(())
}

/// The agent binary, with `--impersonate-node` and its token: it gates and ungates its Node
/// through the ServiceAccount's patches, and every read of the Node and of the pods goes out
/// as node A and is answered (the audit log), with no refusal at all.
async fn agent_runs_as_its_node(f: &Fixture) -> anyhow::Result<()> {
    let since = SystemTime::now();
    let dirs = CniDirs::new()?;
    dirs.config(
        "10-calico-linkerd.conflist",
        &golden("calico-linkerd.conflist")?,
    )?;
    let agent = Agent::start_with_kubeconfig(
        &f.agent_kubeconfig,
        &f.node_a,
        &dirs,
        &["--impersonate-node"],
    )?;
    let nodes: Api<Node> = Api::all(f.admin.clone());
    let open = poll_until("node A untainted by the agent", WAIT, || async {
        let n = nodes.get(&f.node_a).await?;
        anyhow::Ok((!tainted(&n)).then_some(()))
    })
    .await;
    if let Err(e) = open {
        bail!("{e}; agent log:\n{}", agent.log());
    }
    agent.wait_ready(WAIT).await?;

    its_gate_reads_as_the_node_and_writes_as_itself(f, &nodes, agent).await?;
    every_request_answered_as_the_right_user(f, since)
}

/// Its Node read through the impersonating client (NodeGate::reading_as), its writes as
/// itself: the product's gate taints node A again. The agent process is stopped first.
async fn its_gate_reads_as_the_node_and_writes_as_itself(
    f: &Fixture,
    nodes: &Api<Node>,
    agent: Agent,
) -> anyhow::Result<()> {
    let clients = f.agent(&f.node_a).await?;
    drop(agent);
    let recorder = kube::runtime::events::Recorder::new(
        clients.own.clone(),
        kube::runtime::events::Reporter {
            controller: AGENT.into(),
            instance: Some(f.node_a.clone()),
        },
    );
    let gate = NodeGate::new(
        clients.own.clone(),
        f.node_a.clone(),
        TaintKey::default(),
        TaintEffect::NoSchedule,
        std::time::Duration::from_secs(5),
        recorder,
    )
    .reading_as(clients.node.clone());
    gate.reconcile(None, &verdict(false)?, Mode::Enforce)
        .await?;
    ensure!(
        tainted(&nodes.get(&f.node_a).await?),
        "node A tainted again"
    );
    Ok(())
}

/// By the audit log since `since`: none of the agent's requests was refused; it read pods and
/// nodes as node A, and patched its Node, listed namespaces and created Events as itself,
/// never the other way round.
fn every_request_answered_as_the_right_user(f: &Fixture, since: SystemTime) -> anyhow::Result<()> {
    let user = audit::service_account_user(NS, AGENT);
    let all = audit::read(&f.cp.audit_log())?;
    let mine = audit::by_user(&all, &user, since, SystemTime::now());
    let refused: Vec<String> = mine
        .iter()
        .filter(|r| matches!(r.code, Some(401 | 403)))
        .map(|r| format!("{} {} {:?}", r.kind(), r.uri, r.code))
        .collect();
    ensure!(refused.is_empty(), "refused requests: {refused:?}");
    let mut summary: std::collections::BTreeMap<String, usize> = Default::default();
    for r in &mine {
        let who = r.impersonated_user.as_deref().unwrap_or("itself");
        *summary
            .entry(format!("{} as {who} -> {:?}", r.kind(), r.code))
            .or_default() += 1;
    }
    println!("the agent's requests with --impersonate-node: {summary:#?}");
    let as_node = Some(node_user(&f.node_a));
    let by_kind = |kind: &str, impersonated: &Option<String>| {
        mine.iter()
            .filter(|r| r.kind() == kind && &r.impersonated_user == impersonated)
            .count()
    };
    for kind in [
        "list pods",
        "watch pods",
        "list nodes",
        "watch nodes",
        "get nodes",
    ] {
        ensure!(
            by_kind(kind, &as_node) > 0,
            "no {kind} as node A: {mine:#?}"
        );
    }
    for kind in ["patch nodes", "list namespaces", "create events"] {
        ensure!(by_kind(kind, &None) > 0, "no {kind} as the ServiceAccount");
    }
    for kind in [
        "list pods",
        "watch pods",
        "list nodes",
        "get nodes",
        "patch nodes",
    ] {
        let wrong = if kind == "patch nodes" {
            &as_node
        } else {
            &None
        };
        ensure!(by_kind(kind, wrong) == 0, "{kind} under the wrong identity");
    }
    Ok(())
}
