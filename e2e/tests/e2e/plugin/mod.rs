//! The kubectl plugin `kubectl-meshgate` against the real control plane, run as a process as
//! kubectl runs it (`--kubeconfig`; its stdout, stderr and exit code).
//!
//! In: Nodes carrying meshgate's taint, label and condition beside foreign ones, Events as
//! the agent writes them (events.k8s.io/v1, `reportingController: meshgate-agent`), pods,
//! the real webhook with the shipped configurations (`webhook::Fixture`). Out: `status`'s
//! table and JSON (`status.rs`); `cleanup`'s writes, its wait for agent pods and its timeout
//! (`cleanup.rs`, on a control plane of its own: it cleans every Node, which would ungate the
//! nodes other tests share).

mod cleanup;
mod status;

use std::path::Path;
use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, Patch, PatchParams, PostParams};
use meshgate_core::gate::{CONDITION_TYPE, VERIFIED_LABEL};
use meshgate_e2e::{ControlPlane, NodeSpec};
use serde_json::{Value, json};

/// Bound on one run of the plugin.
const RUN: Duration = Duration::from_secs(90);

/// What one run of the plugin printed and returned.
pub struct Ran {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl std::fmt::Display for Ran {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit {:?}\n--- stdout\n{}--- stderr\n{}",
            self.code, self.stdout, self.stderr
        )
    }
}

/// The plugin's command line against `kubeconfig` (no other kubeconfig in its environment).
pub fn plugin(kubeconfig: &Path, args: &[&str]) -> anyhow::Result<tokio::process::Command> {
    let bin = meshgate_e2e::sim::node::workspace_bin("kubectl-meshgate")?;
    let mut cmd = tokio::process::Command::new(bin);
    cmd.args(args)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .env_remove("KUBECONFIG")
        .env("RUST_LOG", "warn")
        .kill_on_drop(true);
    Ok(cmd)
}

/// Runs the plugin to its end.
pub async fn run(kubeconfig: &Path, args: &[&str]) -> anyhow::Result<Ran> {
    let out = tokio::time::timeout(RUN, plugin(kubeconfig, args)?.output())
        .await
        .context("kubectl-meshgate did not finish")??;
    Ok(Ran {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}

/// meshgate's marks as the agent writes them on an unverified node: taint, label `false`,
/// condition `False` with `reason`.
pub async fn gated_node(
    cp: &ControlPlane,
    client: &Client,
    name: &str,
    taint_key: &str,
    reason: &str,
) -> anyhow::Result<()> {
    let spec = NodeSpec::new(name)
        .taint(taint_key, "NoSchedule")
        .taint("example.com/maintenance", "NoSchedule")
        .label(VERIFIED_LABEL, "false")
        .label("example.com/team", "payments");
    cp.register_node(client, &spec).await?;
    condition(client, name, "False", reason, "does not chain linkerd-cni").await
}

/// Writes a `MeshCNIVerified` condition beside the kubelet's, as the agent does.
pub async fn condition(
    client: &Client,
    node: &str,
    status: &str,
    reason: &str,
    message: &str,
) -> anyhow::Result<()> {
    let now = Timestamp::now().to_string();
    let patch = json!({"status": {"conditions": [
        {"type": CONDITION_TYPE, "status": status, "reason": reason, "message": message,
         "lastHeartbeatTime": now, "lastTransitionTime": now},
        {"type": "example.com/DiskHealthy", "status": "True", "reason": "Fine", "message": "foreign",
         "lastHeartbeatTime": now, "lastTransitionTime": now},
    ]}});
    let nodes: Api<Node> = Api::all(client.clone());
    tokio::time::timeout(
        Duration::from_secs(20),
        nodes.patch_status(node, &PatchParams::default(), &Patch::Strategic(patch)),
    )
    .await??;
    Ok(())
}

/// An Event as the agent's Recorder writes it (events.k8s.io/v1), in `namespace`.
pub async fn agent_event(
    client: &Client,
    namespace: &str,
    regarding: Value,
    reason: &str,
    action: &str,
    note: &str,
    instance: &str,
) -> anyhow::Result<()> {
    let name = format!(
        "{}.{:x}",
        regarding["name"].as_str().unwrap_or("x"),
        Timestamp::now().as_nanosecond()
    );
    let event: Event = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": namespace},
        "eventTime": MicroTime(Timestamp::now()),
        "reason": reason, "action": action, "note": note,
        "type": if reason == "CNIChainVerified" { "Normal" } else { "Warning" },
        "reportingController": "meshgate-agent", "reportingInstance": instance,
        "regarding": regarding,
    }))?;
    let api: Api<Event> = Api::namespaced(client.clone(), namespace);
    tokio::time::timeout(
        Duration::from_secs(20),
        api.create(&PostParams::default(), &event),
    )
    .await??;
    Ok(())
}
