//! The default install's agent token, measured: how many reads beyond its own node a stolen
//! token makes, with the apiserver's ConstrainedImpersonation gate off and on, and what
//! `kubectl meshgate status` and the chart's notes say about it. The rows of
//! docs/reliability.md, "What a stolen agent token can do", for `agent.impersonateNode=auto`.
//!
//! In: for each gate state a control plane of its own (v1.35.4; the gate is the one
//! kube-apiserver flag that differs), the chart's namespace, ServiceAccounts, RBAC and
//! policies rendered with the default values for a Kubernetes version (`helm template
//! --kube-version`: 1.35.4, the apiserver's own, as `helm install` renders; then 1.36.0, where
//! `auto` confines the agent), two nodes with an application pod each carrying an environment
//! value, and a token bound to an agent pod on node A. Out: pass/fail, and the figures printed
//! (`reads beyond its node: ...`).
//!
//! The five reads beyond node A, each tried as the ServiceAccount and as node A (a stolen token
//! can send the impersonation header too): every Pod listed, every Pod watched, node B's pods
//! listed (their environment values), node B read, every Node listed.

use anyhow::{Context as _, ensure};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams, WatchParams};
use kube::{Client, ResourceExt};
use meshgate_e2e::harness::helm;
use meshgate_e2e::harness::wait::poll_until;
use meshgate_e2e::{ControlPlane, Options};
use serde_json::Value;

use crate::WAIT;
use crate::authz::{self, Fixture, GATE, env_value};
use crate::support::{NS, refused_by_rbac};

/// The reads beyond its node the cluster-wide grants allow.
const ALL_FIVE: usize = 5;
/// The Kubernetes version from which `auto` confines the agent.
const CONFINING: &str = "1.36.0";
/// The confined ClusterRole's marker verb.
const ACT_AS_NODE: &str = "impersonate:associated-node";
/// The cluster-wide ClusterRole's Node rule.
const WIDE_NODES: &str = "verbs: [\"get\", \"list\", \"watch\", \"patch\"]";
/// The chart's warning in NOTES.txt when the agent reads with cluster-wide grants.
const NOTES_WARNING: &str = "WARNING: the agent reads with cluster-wide grants";

#[tokio::test]
async fn the_default_install_confines_the_token_where_the_gate_is_on() -> anyhow::Result<()> {
    crate::init_logging();
    auto_renders_by_kubernetes_version().await?;
    gate_off().await.context("ConstrainedImpersonation off")?;
    gate_on().await.context("ConstrainedImpersonation on")
}

/// `auto` (the default): the confined ClusterRole and MESHGATE_IMPERSONATE_NODE for 1.36, the
/// cluster-wide one for 1.35; `true` and `false` win over the version.
async fn auto_renders_by_kubernetes_version() -> anyhow::Result<()> {
    let auto: &[&str] = &[];
    for (version, set, confined) in [
        (CONFINING, auto, true),
        ("1.35.4", auto, false),
        ("v1.36.2-eks-4d3f2a1", auto, true),
        (CONFINING, &["--set", "agent.impersonateNode=false"], false),
        ("1.35.4", &["--set", "agent.impersonateNode=true"], true),
    ] {
        let r = helm::template(&[&["--kube-version", version], set].concat()).await?;
        let (role, env) = (
            r.contains(ACT_AS_NODE),
            r.contains("MESHGATE_IMPERSONATE_NODE: \"true\""),
        );
        ensure!(
            role == confined && env == confined && r.contains(WIDE_NODES) != confined,
            "{version} with {set:?}: confined role {role}, env {env}, want {confined}"
        );
    }
    Ok(())
}

/// A v1.35 apiserver as shipped: `helm install` renders the cluster-wide grants and its notes
/// warn; the token reads all five. Confined grants there (a 1.36 rendering, or `true`) read
/// nothing at all, their own node included, and status says so.
async fn gate_off() -> anyhow::Result<()> {
    let cp = start(&[]).await?;
    // Before the base is applied: helm refuses to install over objects it does not own.
    let notes = helm::release(&cp, "install", &["--dry-run=server"], WAIT)
        .await
        .context("helm install --dry-run=server")?;
    ensure!(
        notes.contains(&format!(
            "{NOTES_WARNING} (agent.impersonateNode=auto, Kubernetes v1.35.4 is before 1.36)"
        )) && notes.contains("--set agent.impersonateNode=true")
            && !notes.contains(ACT_AS_NODE),
        "the notes of a default install on 1.35:\n{notes}"
    );
    let f = authz::seed(cp, "reach").await?;
    expect_reach(&f, "gate off, default install (auto on 1.35.4)", ALL_FIVE).await?;
    expect_status(&f, "cluster", "off", None).await?;

    confine(&f).await?;
    expect_reach(&f, "gate off, confined grants", 0).await?;
    let own = Api::<Pod>::all(f.agent(&f.node_a).await?.node)
        .list(&ListParams::default().fields(&format!("spec.nodeName={}", f.node_a)))
        .await;
    crate::support::expect_forbidden(&own, "cannot impersonate")
        .context("without the gate the agent cannot read its own node's pods")?;
    expect_status(
        &f,
        "node",
        "off",
        Some("every read of the agents is refused (403)"),
    )
    .await
}

/// An apiserver with the gate on: the 1.35 rendering still reads all five, and status says it
/// could be confined; the default install as rendered for 1.36 reads none, and its own node's
/// pods still.
async fn gate_on() -> anyhow::Result<()> {
    let f = authz::seed(start(&[GATE]).await?, "reach").await?;
    expect_reach(&f, "gate on, default install rendered for 1.35.4", ALL_FIVE).await?;
    expect_status(&f, "cluster", "on", Some("confine it to its own node")).await?;

    confine(&f).await?;
    expect_reach(&f, "gate on, default install rendered for 1.36 (auto)", 0).await?;
    let own = Api::<Pod>::all(f.agent(&f.node_a).await?.node)
        .list(&ListParams::default().fields(&format!("spec.nodeName={}", f.node_a)))
        .await
        .context("its own node's pods, as the node")?;
    ensure!(own.items.iter().any(|p| p.name_any() == "on-a"));
    expect_status(&f, "node", "on", None).await
}

/// A control plane of its own, its apiserver run with `flags`.
async fn start(flags: &[&str]) -> anyhow::Result<ControlPlane> {
    ControlPlane::start(Options {
        apiserver_flags: flags.iter().map(|f| (*f).to_owned()).collect(),
        ..Options::default()
    })
    .await
    .context("starting a control plane")
}

/// The ClusterRole the default values render for 1.36, applied; returns once the cluster-wide
/// pod list is revoked.
pub(crate) async fn confine(f: &Fixture) -> anyhow::Result<()> {
    let only = "templates/agent-clusterrole-impersonation.yaml";
    let role = helm::template(&["--kube-version", CONFINING, "--show-only", only]).await?;
    ensure!(role.contains(ACT_AS_NODE), "{role}");
    let path = f.cp.dir().join("reach-confined.yaml");
    std::fs::write(&path, role)?;
    f.cp.kubectl(&["apply", "-f", &path.display().to_string()])
        .await?;
    let pods: Api<Pod> = Api::all(f.agent(&f.node_a).await?.own);
    poll_until("the cluster-wide pod list revoked", WAIT, || async {
        let r = pods.list(&ListParams::default().limit(1)).await;
        anyhow::Ok(refused_by_rbac(&r).then_some(()))
    })
    .await?;
    Ok(())
}

/// Counts the reads beyond node A the token makes, prints them, and wants `want`.
async fn expect_reach(f: &Fixture, case: &str, want: usize) -> anyhow::Result<()> {
    let clients = f.agent(&f.node_a).await?;
    let mut allowed = Vec::new();
    for client in [&clients.own, &clients.node] {
        for read in reads_beyond_node_a(f, client).await? {
            if !allowed.contains(&read) {
                allowed.push(read);
            }
        }
    }
    println!(
        "reads beyond its node: {case}: {} of {ALL_FIVE} {allowed:?}",
        allowed.len()
    );
    ensure!(allowed.len() == want, "{case}: {allowed:?}, want {want}");
    Ok(())
}

/// The reads beyond node A that `client` is allowed. Node B's pod read must disclose its
/// environment value, as a Pod read does.
async fn reads_beyond_node_a(f: &Fixture, client: &Client) -> anyhow::Result<Vec<&'static str>> {
    let pods: Api<Pod> = Api::all(client.clone());
    let nodes: Api<Node> = Api::all(client.clone());
    let on_b = ListParams::default().fields(&format!("spec.nodeName={}", f.node_b));
    let mut allowed = Vec::new();
    if pods.list(&ListParams::default()).await.is_ok() {
        allowed.push("list every pod");
    }
    if pods
        .watch(&WatchParams::default().timeout(1), "0")
        .await
        .is_ok()
    {
        allowed.push("watch every pod");
    }
    if let Ok(list) = pods.list(&on_b).await {
        let b = list
            .items
            .iter()
            .find(|p| p.namespace().as_deref() == Some(&f.app))
            .context("node B's pod")?;
        ensure!(env_value(b).as_deref() == Some(f.secret_b.as_str()));
        allowed.push("list node B's pods (their environment)");
    }
    if nodes.get(&f.node_b).await.is_ok() {
        allowed.push("get node B");
    }
    if nodes.list(&ListParams::default()).await.is_ok() {
        allowed.push("list every node");
    }
    Ok(allowed)
}

/// `kubectl meshgate status -o json` as the admin: the agent's grants, the gate, and a warning
/// containing `warning` (none when `None`); the table prints the same warning.
async fn expect_status(
    f: &Fixture,
    grants: &str,
    gate: &str,
    warning: Option<&str>,
) -> anyhow::Result<()> {
    let admin = f.cp.admin_kubeconfig_path();
    let args = ["status", "--no-webhook-probe", "-n", NS];
    let json = crate::plugin::run(admin, &[&args[..], &["-o", "json"]].concat()).await?;
    let report: Value = serde_json::from_str(&json.stdout).with_context(|| json.to_string())?;
    let access = &report["agent_access"];
    ensure!(
        access["grants"] == grants && access["gate"] == gate,
        "want {grants}/{gate}: {json}"
    );
    let table = crate::plugin::run(admin, &args).await?;
    println!(
        "status: {}",
        table
            .stdout
            .lines()
            .filter(|l| l.starts_with("AGENT GRANTS") || l.starts_with("WARNING"))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    match warning {
        Some(w) => ensure!(
            access["warning"].as_str().is_some_and(|s| s.contains(w))
                && table.stdout.contains(&format!(
                    "WARNING: {}",
                    access["warning"].as_str().unwrap_or_default()
                )),
            "want a warning with {w:?}: {json}\n{table}"
        ),
        None => ensure!(
            access["warning"].is_null() && !table.stdout.contains("WARNING"),
            "want no warning: {json}\n{table}"
        ),
    }
    Ok(())
}
