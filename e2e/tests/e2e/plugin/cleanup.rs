//! `kubectl meshgate cleanup` on a control plane of its own (it cleans every Node): a dry run
//! changes nothing, then only meshgate's taint, label and condition go, a second run changes
//! nothing, `--wait-for-agents` waits for an agent pod to go before it writes, and gives up
//! at `--timeout` when one stays.

use std::collections::BTreeSet;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Client;
use kube::api::{Api, DeleteParams, PostParams};
use meshgate_core::field_manager;
use meshgate_core::gate::{
    CONDITION_TYPE, DEFAULT_TAINT_KEY as TAINT_KEY, LEGACY_TAINT_KEY, VERIFIED_LABEL,
};
use meshgate_e2e::sim::node::{Managed, managed_fields, owners};
use meshgate_e2e::{ControlPlane, NodeSpec, Options, unique_name};
use serde_json::json;

use super::{Ran, gated_node, plugin, run};

static DEDICATED: OnceLock<&'static ControlPlane> = OnceLock::new();
static START: tokio::sync::OnceCell<Result<(), String>> = tokio::sync::OnceCell::const_new();
/// One test at a time: each cleans every Node of the control plane.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

extern "C" fn stop_dedicated_at_exit() {
    if let Some(cp) = DEDICATED.get() {
        cp.stop();
    }
}

/// The control plane of this module, started by the first test that asks.
async fn dedicated() -> &'static ControlPlane {
    crate::init_logging();
    let started = START
        .get_or_init(|| async {
            let cp = ControlPlane::start(Options::default())
                .await
                .map_err(|e| e.to_string())?;
            let cp: &'static ControlPlane = Box::leak(Box::new(cp));
            if DEDICATED.set(cp).is_ok() {
                // SAFETY: registers a plain extern "C" fn without arguments, run once during exit().
                let rc = unsafe { libc::atexit(stop_dedicated_at_exit) };
                if rc != 0 {
                    return Err("atexit registration failed".into());
                }
            }
            Ok(())
        })
        .await;
    match (started, DEDICATED.get()) {
        (Ok(()), Some(cp)) => cp,
        (Err(e), _) => panic!("cannot start the cleanup tests' control plane: {e}"),
        (Ok(()), None) => panic!("the cleanup tests' control plane is missing"),
    }
}

/// The Node's taint keys, labels and condition types.
async fn marks(
    client: &Client,
    name: &str,
) -> anyhow::Result<(BTreeSet<String>, BTreeSet<String>, BTreeSet<String>)> {
    let node = Api::<Node>::all(client.clone()).get(name).await?;
    let taints = node
        .spec
        .and_then(|s| s.taints)
        .unwrap_or_default()
        .into_iter()
        .map(|t| t.key)
        .collect();
    let labels = node
        .metadata
        .labels
        .unwrap_or_default()
        .into_keys()
        .collect();
    let conditions = node
        .status
        .and_then(|s| s.conditions)
        .unwrap_or_default()
        .into_iter()
        .map(|c| c.type_)
        .collect();
    Ok((taints, labels, conditions))
}

/// True when the Node carries meshgate's taint (either key), label and condition.
async fn marked(client: &Client, name: &str) -> anyhow::Result<bool> {
    let (t, l, c) = marks(client, name).await?;
    let tainted = t.contains(TAINT_KEY) || t.contains(LEGACY_TAINT_KEY);
    Ok(tainted && l.contains(VERIFIED_LABEL) && c.contains(CONDITION_TYPE))
}

/// An agent pod as the DaemonSet makes it (its selector's label), bound to `node`.
async fn agent_pod(client: &Client, ns: &str, node: &str) -> anyhow::Result<String> {
    let name = unique_name("meshgate-agent");
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "meshgate-agent"}},
        "spec": {"nodeName": node, "containers": [{"name": "agent", "image": "registry.invalid/meshgate:1"}]},
    }))?;
    Api::<Pod>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &pod)
        .await?;
    Ok(name)
}

#[tokio::test]
async fn cleanup_removes_only_meshgates_marks_and_is_idempotent() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let cp = dedicated().await;
    let client = cp.client()?;
    let (a, b, clean) = (
        unique_name("cl-a"),
        unique_name("cl-b"),
        unique_name("cl-clean"),
    );
    gated_node(cp, &client, &a, TAINT_KEY, "ChainedPluginMissing").await?;
    // Under the key of a release before --taint-key: meshgate's too.
    gated_node(cp, &client, &b, LEGACY_TAINT_KEY, "NoConfig").await?;
    cp.register_node(
        &client,
        &NodeSpec::new(&clean).taint("example.com/maintenance", "NoSchedule"),
    )
    .await?;
    let before = marks(&client, &a).await?;
    let clean_before = marks(&client, &clean).await?;
    let ns = cp.create_namespace(&client, "cl-home").await?;

    let kubeconfig = cp.admin_kubeconfig_path();
    // A dry run names what it would remove and removes nothing.
    let dry = run(kubeconfig, &["cleanup", "--dry-run", "-n", &ns]).await?;
    ensure!(dry.code == Some(0), "{dry}");
    ensure!(
        dry.stdout
            .contains(&format!("node/{a}: would remove taint, label, condition\n")),
        "{dry}"
    );
    ensure!(
        marked(&client, &a).await? && marked(&client, &b).await?,
        "a dry run changed a node"
    );

    let ran = run(kubeconfig, &["cleanup", "--wait-for-agents", "-n", &ns]).await?;
    ensure!(ran.code == Some(0), "{ran}");
    for n in [&a, &b] {
        only_meshgates_marks_were_removed(&client, &ran, n, &before.0).await?;
        the_cleanup_names_its_field_manager(&client, n).await?;
    }
    ensure!(
        before.0.contains("example.com/maintenance"),
        "the fixture carries a foreign taint"
    );
    ensure!(!ran.stdout.contains(&format!("node/{clean}:")), "{ran}");
    ensure!(
        marks(&client, &clean).await? == clean_before,
        "the clean node was changed"
    );
    ensure!(ran.stdout.contains("cleanup: 2 changed, 0 failed"), "{ran}");

    let again = run(kubeconfig, &["cleanup", "-n", &ns]).await?;
    ensure!(
        again.code == Some(0) && again.stdout.contains("cleanup: 0 changed, 0 failed"),
        "{again}"
    );
    Ok(())
}

/// The cleanup says it removed node `n`'s taint, label and condition, and those are gone
/// while the node's other taints (`taints_before` less meshgate's), labels and conditions
/// stay.
async fn only_meshgates_marks_were_removed(
    client: &Client,
    ran: &Ran,
    n: &str,
    taints_before: &BTreeSet<String>,
) -> anyhow::Result<()> {
    ensure!(
        ran.stdout
            .contains(&format!("node/{n}: removed taint, label, condition\n")),
        "{ran}"
    );
    let (t, l, c) = marks(client, n).await?;
    let want = |set: &BTreeSet<String>, ours: &str| -> BTreeSet<String> {
        set.iter().filter(|k| k.as_str() != ours).cloned().collect()
    };
    ensure!(
        t == want(taints_before, TAINT_KEY),
        "taints of {n}: {t:?}, before {:?}",
        taints_before
    );
    ensure!(
        l.iter().all(|k| k != VERIFIED_LABEL) && l.contains("example.com/team"),
        "labels of {n}: {l:?}"
    );
    ensure!(
        !c.contains(CONDITION_TYPE) && c.contains("example.com/DiskHealthy") && c.contains("Ready"),
        "conditions of {n}: {c:?}"
    );
    Ok(())
}

#[tokio::test]
async fn cleanup_waits_for_the_agents_to_go_and_gives_up_at_its_timeout() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let cp = dedicated().await;
    let client = cp.client()?;
    let node = unique_name("cl-wait");
    gated_node(cp, &client, &node, TAINT_KEY, "ChainedPluginMissing").await?;
    let ns = cp.create_namespace(&client, "cl-agents").await?;
    let agent = agent_pod(&client, &ns, &node).await?;
    let kubeconfig = cp.admin_kubeconfig_path();

    // An agent that stays: nothing is cleaned, exit 1 at the timeout, naming the pod.
    let started = Instant::now();
    let ran = run(
        kubeconfig,
        &["cleanup", "--wait-for-agents", "--timeout", "3s", "-n", &ns],
    )
    .await?;
    ensure!(ran.code == Some(1) && ran.stdout.contains(&agent), "{ran}");
    ensure!(
        started.elapsed() >= Duration::from_secs(2),
        "gave up after {:?}",
        started.elapsed()
    );
    ensure!(marked(&client, &node).await?, "cleaned while an agent ran");

    // An agent that goes: the cleanup waits for it, then cleans.
    let child = plugin(
        kubeconfig,
        &[
            "cleanup",
            "--wait-for-agents",
            "--timeout",
            "60s",
            "-n",
            &ns,
        ],
    )?
    .stdout(std::process::Stdio::piped())
    .spawn()
    .context("starting kubectl-meshgate")?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    ensure!(
        marked(&client, &node).await?,
        "cleaned before the agent went"
    );
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    pods.delete(&agent, &DeleteParams::default().grace_period(0))
        .await?;
    let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .context("cleanup did not end")??;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.code() == Some(0),
        "exit {:?}: {stdout}",
        out.status.code()
    );
    ensure!(
        stdout.contains(&format!("node/{node}: removed taint, label, condition")),
        "{stdout}"
    );
    ensure!(
        !marked(&client, &node).await?,
        "still marked after the cleanup"
    );
    Ok(())
}

/// The cleanup's write is recorded under `meshgate-cleanup`: it owns the taint list it wrote
/// back without meshgate's taint (an atomic list: the writer owns it whole), and no one owns
/// the removed label or condition any more.
async fn the_cleanup_names_its_field_manager(client: &Client, n: &str) -> anyhow::Result<()> {
    let node = Api::<Node>::all(client.clone()).get(n).await?;
    let (meta, all) = (&node.metadata, managed_fields(&node.metadata));
    let cleanup = Managed::new(field_manager::CLEANUP, "Update", "");
    ensure!(
        owners(meta, &["f:spec", "f:taints"]) == [cleanup],
        "the taint list of {n} is the cleanup's:\n{all}"
    );
    let label = format!("f:{VERIFIED_LABEL}");
    let condition = format!("k:{}", json!({ "type": CONDITION_TYPE }));
    ensure!(
        owners(meta, &["f:metadata", "f:labels", &label]).is_empty()
            && owners(meta, &["f:status", "f:conditions", &condition]).is_empty(),
        "no one owns the removed label or condition of {n}:\n{all}"
    );
    Ok(())
}
