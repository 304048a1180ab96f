//! A non-default `--taint-key` end to end, on a real apiserver: the webhook taints a new Node
//! with it, the agent (its real binary, under its Pod-bound token) untaints and re-taints with
//! it and removes the key an older release left, and the own-node ValidatingAdmissionPolicy,
//! applied with `ownTaint` set to that key, admits exactly those writes.
//!
//! In: a dedicated control plane (the policy is cluster-wide, and on the shared one or the
//! rbac module's it would say the default key), the chart's namespace, ServiceAccounts, RBAC
//! and admission policies rendered with `--set taintKey=` the key, as docs/operations.md
//! ("Autoscalers") tells operators, the in-process webhook with `--taint-key`, the agent with
//! `--taint-key`. Out: pass/fail.

use anyhow::{Context as _, bail, ensure};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Client;
use kube::api::{Api, Patch, PatchParams, PostParams};
use meshgate_core::gate::{DEFAULT_TAINT_KEY, LEGACY_TAINT_KEY, VERIFIED_LABEL};
use meshgate_e2e::harness::wait::poll_until;
use meshgate_e2e::sim::node::{Agent, CniDirs, golden, verified_label};
use meshgate_e2e::{ControlPlane, NodeSpec, Options, unique_name};
use serde_json::json;

use crate::WAIT;
use crate::support::{
    AGENT, BASE_CONFINEMENT, NS, apply_base_files, bound_token, describe, expect_policy, wait_node,
};
use crate::webhook::{Fixture, SCOPE_KEY, Start};

/// The key every part runs with here: under neither meshgate's old prefix nor the default's.
const KEY: &str = "example.com/mesh-cni-unverified";
/// Another controller's taint, which the agent must leave alone.
const FOREIGN: &str = "example.com/maintenance";
/// The policy this test's writes are judged by.
const POLICY: &str = "meshgate-agent-own-node";

fn keys(n: &Node) -> Vec<&str> {
    n.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .map(|ts| ts.iter().map(|t| t.key.as_str()).collect())
        .unwrap_or_default()
}

/// Applies the chart's namespace, ServiceAccounts, RBAC and admission policies, rendered with
/// `taintKey` [`KEY`] (the own-node policy's `ownTaint`).
async fn apply_base(cp: &ControlPlane) -> anyhow::Result<()> {
    let set = format!("taintKey={KEY}");
    let applied = apply_base_files(cp, &BASE_CONFINEMENT, &[&set])
        .await
        .context("applying the chart's confinement")?;
    ensure!(!applied.is_empty(), "nothing applied");
    let policy = meshgate_e2e::harness::helm::template(&[
        "--show-only",
        "templates/admission-policy.yaml",
        "--set",
        &set,
    ])
    .await?;
    ensure!(
        policy.contains(&format!("expression: \"'{KEY}'\"")),
        "the chart did not render ownTaint as {KEY}"
    );
    Ok(())
}

/// A pod of the agent's ServiceAccount on `node`, and a kubeconfig with a token bound to it.
async fn agent_identity(
    cp: &ControlPlane,
    admin: &Client,
    node: &str,
) -> anyhow::Result<(Client, std::path::PathBuf)> {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": unique_name("agent")},
        "spec": {
            "nodeName": node,
            "serviceAccountName": AGENT,
            "containers": [{"name": "agent", "image": "registry.invalid/agent:1"}],
        },
    }))?;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), NS);
    // The ServiceAccount appears a moment after the apply.
    let pod = poll_until("creating the agent's pod", WAIT, || async {
        pods.create(&PostParams::default(), &pod).await.map(Some)
    })
    .await?;
    let token = bound_token(admin, AGENT, pod).await?;
    let client = cp.client_for_token(&token)?;
    Ok((
        client,
        cp.write_token_kubeconfig("taint-key-agent", &token)?,
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_custom_taint_key_is_the_one_webhook_agent_and_policy_use() -> anyhow::Result<()> {
    crate::init_logging();
    let cp = ControlPlane::start(Options::default())
        .await
        .context("starting a dedicated control plane")?;
    apply_base(&cp).await?;
    let start = Start {
        kubeconfig: cp.admin_kubeconfig_path().to_path_buf(),
        profile_file: None,
        tag_hooks: false,
        taint_key: KEY.parse()?,
        mode: Default::default(),
    };
    let webhook = Fixture::start_with(&cp, "tk", start).await?;
    let result = custom_key(&cp, &webhook).await;
    webhook.teardown().await;
    result
}

async fn custom_key(cp: &ControlPlane, webhook: &Fixture) -> anyhow::Result<()> {
    let admin = cp.client()?;
    let nodes: Api<Node> = Api::all(admin.clone());

    // A node a kubelet registers with an older release's --register-with-taints: the webhook
    // adds the configured key beside it, and a foreign taint stays.
    let n = unique_name("tk");
    cp.register_node(
        &admin,
        &NodeSpec::new(n.as_str())
            .label(SCOPE_KEY, webhook.tag.as_str())
            .taint(LEGACY_TAINT_KEY, "NoSchedule")
            .taint(FOREIGN, "NoSchedule"),
    )
    .await?;
    let created = nodes.get(&n).await?;
    ensure!(
        keys(&created) == [LEGACY_TAINT_KEY, FOREIGN, KEY],
        "the webhook gates with --taint-key at CREATE: {:?}",
        keys(&created)
    );
    ensure!(verified_label(&created) == Some("false"), "label false");

    // The agent with the same key verifies the node: it removes its taint and the legacy
    // one in one write the policy admits, and keeps the foreign taint.
    let (agent_client, kubeconfig) = agent_identity(cp, &admin, &n).await?;
    policy_in_force(&agent_client, &n).await?;
    let dirs = CniDirs::new()?;
    let conf = "10-calico-linkerd.conflist";
    dirs.config(conf, &golden("calico-linkerd.conflist")?)?;
    let agent = Agent::start_with_kubeconfig(&kubeconfig, &n, &dirs, &["--taint-key", KEY])?;
    let open = wait_node(&admin, &n, "untainted and labelled verified", |node| {
        keys(node) == [FOREIGN] && verified_label(node) == Some("true")
    })
    .await;
    if let Err(e) = open {
        bail!("{e:#}; agent log:\n{}", agent.log());
    }

    // Drift: the agent taints its node again with the key, a real write the policy admits.
    dirs.remove_config(conf)?;
    let gated = wait_node(&admin, &n, "tainted again with the key", |node| {
        keys(node) == [FOREIGN, KEY] && verified_label(node) == Some("false")
    })
    .await;
    if let Err(e) = gated {
        bail!("{e:#}; agent log:\n{}", agent.log());
    }
    drop(agent);
    refuses_every_other_taint_change(&agent_client, &n).await?;
    keeps_or_removes_a_superseded_taint(&admin, &agent_client, &n).await
}

/// A superseded taint someone else put back stays through the agent's other writes (a label
/// patch leaves it in place) and may be removed by the agent.
async fn keeps_or_removes_a_superseded_taint(
    admin: &Client,
    agent: &Client,
    n: &str,
) -> anyhow::Result<()> {
    let taint = |key: &str| json!({"key": key, "effect": "NoSchedule"});
    let with = |taints: Vec<serde_json::Value>| Patch::Merge(json!({"spec": {"taints": taints}}));
    let all = vec![taint(FOREIGN), taint(KEY), taint(LEGACY_TAINT_KEY)];
    Api::<Node>::all(admin.clone())
        .patch(n, &PatchParams::default(), &with(all))
        .await?;
    let nodes: Api<Node> = Api::all(agent.clone());
    let dry = PatchParams::default().dry_run();
    let label = Patch::Merge(json!({"metadata": {"labels": {VERIFIED_LABEL: "true"}}}));
    let r = nodes.patch(n, &dry, &label).await;
    ensure!(
        r.is_ok(),
        "a label write beside the legacy taint: {}",
        describe(&r)
    );
    let r = nodes
        .patch(n, &dry, &with(vec![taint(FOREIGN), taint(KEY)]))
        .await;
    ensure!(r.is_ok(), "removing the legacy taint: {}", describe(&r));
    Ok(())
}

/// Waits until the apiserver enforces the policy (it reaches admission through an informer):
/// a dry-run cordon under the agent's token is refused.
async fn policy_in_force(agent: &Client, n: &str) -> anyhow::Result<()> {
    let nodes: Api<Node> = Api::all(agent.clone());
    let cordon = Patch::Merge(json!({"spec": {"unschedulable": true}}));
    poll_until("the own-node policy to refuse a cordon", WAIT, || async {
        let r = nodes
            .patch(n, &PatchParams::default().dry_run(), &cordon)
            .await;
        anyhow::Ok(crate::support::refused_by_policy(&r, POLICY).then_some(()))
    })
    .await?;
    Ok(())
}

/// Under the agent's token, dry-run: the key comes and goes, nothing else about the taints
/// changes, and a superseded key may be removed but never added.
async fn refuses_every_other_taint_change(agent: &Client, n: &str) -> anyhow::Result<()> {
    let nodes: Api<Node> = Api::all(agent.clone());
    let dry = PatchParams::default().dry_run();
    let taint = |key: &str| json!({"key": key, "effect": "NoSchedule"});
    let with = |taints: Vec<serde_json::Value>| Patch::Merge(json!({"spec": {"taints": taints}}));

    let r = nodes.patch(n, &dry, &with(vec![taint(FOREIGN)])).await;
    ensure!(r.is_ok(), "removing the key: {}", describe(&r));
    for (what, taints) in [
        (
            "the legacy key",
            vec![taint(FOREIGN), taint(KEY), taint(LEGACY_TAINT_KEY)],
        ),
        (
            "the default key",
            vec![taint(FOREIGN), taint(KEY), taint(DEFAULT_TAINT_KEY)],
        ),
        ("no foreign taint", vec![taint(KEY)]),
        (
            "another taint",
            vec![taint(FOREIGN), taint(KEY), taint("example.com/other")],
        ),
    ] {
        let r = nodes.patch(n, &dry, &with(taints)).await;
        expect_policy(&r, POLICY).with_context(|| format!("adding {what}"))?;
        let msg = describe(&r);
        ensure!(
            msg.contains(&format!(
                "may change only the taint {KEY} in the spec of Node {n}"
            )),
            "{what}: the refusal names the configured key: {msg}"
        );
    }
    // The label is still the agent's to write.
    let label = Patch::Merge(json!({"metadata": {"labels": {VERIFIED_LABEL: "true"}}}));
    let r = nodes.patch(n, &dry, &label).await;
    ensure!(r.is_ok(), "the verified label: {}", describe(&r));
    Ok(())
}
