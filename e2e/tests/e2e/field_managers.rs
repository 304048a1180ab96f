//! Who wrote it: the real agent's every kind of write, read back from `managedFields` on the
//! real apiserver, names the agent's field manager (docs/operations.md, "Who wrote it: field
//! managers"). The cleanup's removal is checked where it runs, in `plugin::cleanup`.
//!
//! In: a Node with another writer's taint, the agent on it, its CNI config going from
//! unverified to verified, and a pod on the Node evicted the way the agent evicts. Out: the
//! owners of the taint list, the label, the condition and the Events, and that the eviction
//! leaves no owner behind.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::events::v1::Event;
use kube::Client;
use kube::api::{Api, ListParams, PostParams};
use meshgate_agent::daemon::pods::eviction::{self, Answer};
use meshgate_core::field_manager::AGENT;
use meshgate_core::gate::{CONDITION_TYPE, VERIFIED_LABEL};
use meshgate_e2e::sim::node::{
    Managed, gate_condition as condition, managed_fields, owners, tainted, verified_label as label,
};
use meshgate_e2e::{ControlPlane, NodeSpec, unique_name};
use serde_json::json;

use crate::cp;
use crate::support::{Agent, CniDirs, golden, wait_node};

/// Another writer's taint, kept beside meshgate's.
const FOREIGN_TAINT: &str = "example.com/maintenance";

/// The `fieldsV1` key of the agent's condition in `status.conditions` (a map keyed by `type`).
fn condition_key() -> String {
    format!("k:{}", json!({ "type": CONDITION_TYPE }))
}

/// The agent owns its taint list (a JSON patch: an `Update`), its label (the same patch) and
/// its condition (a server-side apply of `nodes/status`: an `Apply` of that one entry), and
/// no one else owns the label or the condition.
fn the_agent_owns_its_marks(n: &Node) {
    let (meta, all) = (&n.metadata, managed_fields(&n.metadata));
    eprintln!("managedFields of the Node:\n{all}");
    let label_key = format!("f:{VERIFIED_LABEL}");
    assert_eq!(
        owners(meta, &["f:metadata", "f:labels", &label_key]),
        [Managed::new(AGENT, "Update", "")],
        "the label's owner:\n{all}"
    );
    // An atomic list: whoever writes it last owns it whole, the other writer's taint too.
    assert_eq!(
        owners(meta, &["f:spec", "f:taints"]),
        [Managed::new(AGENT, "Update", "")],
        "the taint list's owner:\n{all}"
    );
    let key = condition_key();
    assert_eq!(
        owners(meta, &["f:status", "f:conditions", &key]),
        [Managed::new(AGENT, "Apply", "status")],
        "the condition's owner:\n{all}"
    );
    // The apply owns the one entry and nothing else of the status.
    let applied =
        meta.managed_fields.iter().flatten().find(|e| {
            e.manager.as_deref() == Some(AGENT) && e.operation.as_deref() == Some("Apply")
        });
    let fields = applied.and_then(|e| e.fields_v1.as_ref()).map(|f| &f.0);
    let conditions = fields.and_then(|f| f["f:status"]["f:conditions"].as_object());
    assert_eq!(
        conditions.map(|c| c.keys().cloned().collect::<Vec<_>>()),
        Some(vec![key]),
        "the apply's fields:\n{all}"
    );
    assert_eq!(
        fields
            .and_then(|f| f["f:status"].as_object())
            .map(|s| s.len()),
        Some(1),
        "the apply owns only status.conditions' one entry:\n{all}"
    );
}

/// The agent's Events about `node`, each checked to be recorded under the agent's name.
async fn the_agents_events_are_its_own(client: &Client, node: &str) -> anyhow::Result<usize> {
    let events: Api<Event> = Api::namespaced(client.clone(), "default");
    let list = events.list(&ListParams::default()).await?.items;
    let ours: Vec<Event> = list
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(node))
        .collect();
    for e in &ours {
        let all = managed_fields(&e.metadata);
        eprintln!("managedFields of Event {:?}:\n{all}", e.reason);
        assert_eq!(e.reporting_controller.as_deref(), Some(AGENT), "{e:?}");
        assert_eq!(e.reporting_instance.as_deref(), Some(node), "{e:?}");
        assert_eq!(
            owners(&e.metadata, &["f:reason"]),
            [Managed::new(AGENT, "Update", "")],
            "the Event's owner:\n{all}"
        );
    }
    Ok(ours.len())
}

/// A pod bound to `node` (no kubelet runs it, so it stays while terminating), evicted the
/// way the agent evicts, as read back after the eviction.
async fn evict_a_pod(cp: &ControlPlane, client: &Client, node: &str) -> anyhow::Result<Pod> {
    let ns = cp.create_namespace(client, "fm").await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "web-1"},
        "spec": {"nodeName": node, "containers": [{"name": "web", "image": "registry.invalid/web:1"}]},
    }))?;
    let pod = pods.create(&PostParams::default(), &pod).await?;
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let answer = eviction::evict(client, &ns, "web-1", &uid, Duration::from_secs(10)).await;
    assert_eq!(answer, Answer::Evicted);
    Ok(pods.get("web-1").await?)
}

#[tokio::test]
async fn every_write_of_the_agent_names_its_field_manager() -> anyhow::Result<()> {
    let cp = cp().await;
    let client = cp.client()?;
    let node = unique_name("fm");
    let spec = NodeSpec::new(&node).taint(FOREIGN_TAINT, "NoSchedule");
    cp.register_node(&client, &spec).await?;
    let dirs = CniDirs::new()?;
    dirs.config("10-calico.conflist", &golden("calico.conflist")?)?;
    let agent = Agent::start(cp, &node, &dirs, &[])?;

    // Unverified: taint added, label false, condition False.
    let gated = |n: &Node| {
        tainted(n) && label(n) == Some("false") && condition(n).is_some_and(|c| c.0 == "False")
    };
    let n = wait_node(&client, &node, "gated", gated).await?;
    the_agent_owns_its_marks(&n);
    // Verified: taint removed (the other writer's kept), label true, condition True.
    dirs.config("10-calico.conflist", &golden("calico-linkerd.conflist")?)?;
    let open = |n: &Node| {
        !tainted(n) && label(n) == Some("true") && condition(n).is_some_and(|c| c.0 == "True")
    };
    let n = wait_node(&client, &node, "verified", open).await?;
    the_agent_owns_its_marks(&n);
    let taints = n.spec.and_then(|s| s.taints).unwrap_or_default();
    assert_eq!(
        taints.iter().map(|t| t.key.as_str()).collect::<Vec<_>>(),
        [FOREIGN_TAINT]
    );

    // Its Events (CNIChainUnverified, CNIChainVerified), published after each condition.
    let mut events = 0;
    for _ in 0..50 {
        events = the_agents_events_are_its_own(&client, &node).await?;
        if events == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(events, 2, "{}", agent.log());

    // The eviction names the agent's field manager too (in its request URI), but the
    // apiserver records nothing of it in managedFields: it sets the pod's DisruptionTarget
    // condition and deletionTimestamp itself, outside the field managers' bookkeeping.
    let pod = evict_a_pod(cp, &client, &node).await?;
    let all = managed_fields(&pod.metadata);
    let conditions = pod.status.as_ref().and_then(|s| s.conditions.clone());
    let disruption = conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "DisruptionTarget");
    assert!(
        pod.metadata.deletion_timestamp.is_some() && disruption,
        "{pod:?}"
    );
    assert!(
        owners(&pod.metadata, &["f:status"]).is_empty(),
        "the eviction's DisruptionTarget condition is recorded under no manager: {conditions:?}\n{all}"
    );
    Ok(())
}
