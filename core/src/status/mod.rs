//! `kubectl meshgate status`'s report: which nodes are gated, why and since when, their last
//! untaint latency, the pods the agents judged without redirects, and their evictions.
//!
//! In: the Nodes, the Events the agents published (events.k8s.io/v1, `reportingController:
//! meshgate-agent`; others are ignored), meshgate's taint key, the eviction window and the
//! clock. Out: a [`Report`], whose JSON form is the command's stable schema ([`SCHEMA`],
//! documented in docs/operations.md, "kubectl meshgate"), and its table ([`table::render`]).
//! The plugin's I/O side (`agent::plugin::status`) adds what only the API can answer: the
//! mode ConfigMap, the webhook probe, the agent's grants against the apiserver's
//! Constrained Impersonation gate ([`access`]), and which lists were cut at their bound.
//!
//! Pods judged `unknown` are not in the report: the agent publishes no Event for them (it
//! logs them and counts `meshgate_pod_inspections_total{verdict="unknown"}`), so the API holds
//! no record of them to read.

pub mod access;
pub mod table;

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::jiff::Timestamp;
use serde::Serialize;

use crate::cleanup::is_meshgate_taint;
use crate::gate::{TaintKey, VERIFIED_LABEL};
use crate::{event_reason, gate};

/// The report's schema name (the JSON's `schema` field); a change that breaks readers gets a
/// new version.
pub const SCHEMA: &str = "meshgate.io/status/v1";
/// The `reportingController` of the agent's Events.
pub const AGENT_CONTROLLER: &str = "meshgate-agent";
/// The `action` of the `MeshRedirectMissing` Event of a pod the agent evicted.
pub const EVICT_ACTION: &str = "Evict";

/// Everything the report is built from.
#[derive(Clone, Copy, Debug)]
pub struct Inputs<'a> {
    /// Every Node.
    pub nodes: &'a [Node],
    /// Events (any; only the agent's `CNIChainVerified` and `MeshRedirectMissing` are read).
    pub events: &'a [Event],
    /// meshgate's taint key (a taint under a key it supersedes is meshgate's too).
    pub taint_key: &'a TaintKey,
    /// Evictions counted are those last seen within this window before `now`.
    pub eviction_window: Duration,
    /// The clock.
    pub now: Timestamp,
}

/// The whole report (the JSON schema: field names are stable).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Report {
    /// [`SCHEMA`].
    pub schema: &'static str,
    /// When the report was made (RFC 3339).
    pub generated_at: String,
    /// The taint key the nodes were read for.
    pub taint_key: String,
    /// The mode setting, when it was read.
    pub mode: Option<Mode>,
    /// Whether the webhook answered the probe, when it was run.
    pub webhook: Option<Webhook>,
    /// The agent's grants and the apiserver's Constrained Impersonation gate, when its
    /// ClusterRole could be read.
    pub agent_access: Option<access::AgentAccess>,
    /// Every node, sorted by name.
    pub nodes: Vec<NodeStatus>,
    /// Pods the agents judged without redirects (one entry per pod, the latest Event).
    pub missing_pods: Vec<PodEvent>,
    /// Evictions in the window.
    pub evictions: Evictions,
    /// Lists cut at their bound (`nodes`, `events`): the report covers only what was read.
    pub truncated: Vec<String>,
}

/// The mode setting (ConfigMap `meshgate-mode`, key `mode`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Mode {
    /// The value (`enforce` when the ConfigMap or the key is absent).
    pub mode: String,
    /// `configmap` or `default`.
    pub source: &'static str,
}

/// The webhook probe's answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Webhook {
    /// `reachable`, `unreachable`, `not-called`, `not-installed` or `inconclusive`.
    pub state: &'static str,
    /// What the apiserver answered, in a sentence.
    pub detail: String,
}

/// One node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct NodeStatus {
    /// Node name.
    pub name: String,
    /// Meshed pods are kept off it: it carries meshgate's taint, or is not labelled
    /// `meshgate.io/cni-verified=true` (the webhook refuses meshed pods there).
    pub gated: bool,
    /// The effect of meshgate's taint (its key or one it supersedes), when the node carries it.
    pub taint: Option<String>,
    /// The value of `meshgate.io/cni-verified`, if any.
    pub label: Option<String>,
    /// The condition's status (`True`, `False`, `Unknown`), if the node has it.
    pub condition: Option<String>,
    /// Why: the condition's reason, or `NoVerdict` when no agent has written it.
    pub reason: String,
    /// The condition's message, if any.
    pub message: Option<String>,
    /// Since when (RFC 3339): the condition's lastTransitionTime, else the taint's timeAdded.
    pub since: Option<String>,
    /// The latest `CNIChainVerified` Event of this node that carries an untaint latency.
    pub last_untaint: Option<Untaint>,
}

/// An untaint, as its Event recorded it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Untaint {
    /// Milliseconds from the config change to the API accepting the taint's removal.
    pub latency_ms: u64,
    /// When the Event was first written (its `eventTime`), which is when that latency was
    /// measured; a later untaint folded into the Event's series keeps the first note.
    pub at: String,
}

/// A pod's `MeshRedirectMissing` Event.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PodEvent {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub name: String,
    /// The node whose agent reported it (`reportingInstance`).
    pub node: Option<String>,
    /// What the agent did (`Evict`, `EvictBlocked`, `DryRun`, `ReportOnly`, ...).
    pub action: String,
    /// The Event's note.
    pub note: String,
    /// When it was last seen (RFC 3339).
    pub last_seen: String,
}

/// Evictions in the window.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Evictions {
    /// The window, in seconds.
    pub window_seconds: u64,
    /// How many pods were evicted in it.
    pub count: usize,
    /// Those pods, latest first.
    pub pods: Vec<PodEvent>,
}

impl Report {
    /// True when the report asks for attention: a node is gated, the webhook is not
    /// reachable, or the agent acts as its node on an apiserver without the gate (the
    /// command then exits 1).
    pub fn needs_attention(&self) -> bool {
        self.nodes.iter().any(|n| n.gated)
            || self
                .webhook
                .as_ref()
                .is_some_and(|w| w.state == "unreachable")
            || self
                .agent_access
                .as_ref()
                .is_some_and(access::AgentAccess::broken)
    }
}

/// Builds the report from the Nodes and Events.
pub fn build(inputs: &Inputs<'_>) -> Report {
    let agent: Vec<&Event> = inputs
        .events
        .iter()
        .filter(|e| e.reporting_controller.as_deref() == Some(AGENT_CONTROLLER))
        .collect();
    let untaints = last_untaints(&agent);
    let mut nodes: Vec<NodeStatus> = inputs
        .nodes
        .iter()
        .map(|n| node_status(n, inputs.taint_key, &untaints))
        .collect();
    nodes.sort_by(|a, b| a.name.cmp(&b.name));
    let missing_pods = missing_pods(&agent);
    let evictions = evictions(&missing_pods, inputs.now, inputs.eviction_window);
    Report {
        schema: SCHEMA,
        generated_at: inputs.now.to_string(),
        taint_key: inputs.taint_key.to_string(),
        mode: None,
        webhook: None,
        agent_access: None,
        nodes,
        missing_pods,
        evictions,
        truncated: Vec::new(),
    }
}

fn node_status(
    node: &Node,
    taint_key: &TaintKey,
    untaints: &BTreeMap<String, Untaint>,
) -> NodeStatus {
    let name = node.metadata.name.clone().unwrap_or_default();
    let taint = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_deref())
        .unwrap_or_default()
        .iter()
        .find(|t| is_meshgate_taint(taint_key, &t.key));
    let label = node
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(VERIFIED_LABEL))
        .cloned();
    let condition = gate::condition_of(node);
    let since = condition
        .and_then(|c| c.last_transition_time.as_ref())
        .or_else(|| taint.and_then(|t| t.time_added.as_ref()))
        .map(|t| t.0.to_string());
    NodeStatus {
        gated: taint.is_some() || label.as_deref() != Some("true"),
        taint: taint.map(|t| t.effect.clone()),
        label,
        condition: condition.map(|c| c.status.clone()),
        reason: condition
            .and_then(|c| c.reason.clone())
            .unwrap_or_else(|| "NoVerdict".into()),
        message: condition.and_then(|c| c.message.clone()),
        since,
        last_untaint: untaints.get(&name).cloned(),
        name,
    }
}

/// When an Event was first written: `eventTime`, else its creation.
fn first_seen(e: &Event) -> Option<Timestamp> {
    e.event_time
        .as_ref()
        .map(|t| t.0)
        .or_else(|| e.metadata.creation_timestamp.as_ref().map(|t| t.0))
}

/// When an Event was last seen: its series' `lastObservedTime`, else when it was first.
fn last_seen(e: &Event) -> Option<Timestamp> {
    e.series
        .as_ref()
        .map(|s| s.last_observed_time.0)
        .or_else(|| first_seen(e))
}

/// Per node, the latest `CNIChainVerified` Event that carries an untaint latency.
fn last_untaints(events: &[&Event]) -> BTreeMap<String, Untaint> {
    let mut latest: BTreeMap<String, (Timestamp, Untaint)> = BTreeMap::new();
    for e in events {
        let Some(node) = regarding(e, "Node") else {
            continue;
        };
        if e.reason.as_deref() != Some(event_reason::CHAIN_VERIFIED) {
            continue;
        }
        let latency = e.note.as_deref().and_then(gate::untaint_latency);
        let (Some(latency), Some(at)) = (latency, first_seen(e)) else {
            continue;
        };
        let untaint = Untaint {
            latency_ms: u64::try_from(latency.as_millis()).unwrap_or(u64::MAX),
            at: at.to_string(),
        };
        if latest.get(&node).is_none_or(|(t, _)| *t < at) {
            latest.insert(node, (at, untaint));
        }
    }
    latest.into_iter().map(|(n, (_, u))| (n, u)).collect()
}

/// The name of the object an Event is about, when it is of `kind`.
fn regarding(e: &Event, kind: &str) -> Option<String> {
    let r = e.regarding.as_ref()?;
    (r.kind.as_deref() == Some(kind)).then(|| r.name.clone())?
}

/// One entry per pod (namespace, name, uid): its latest `MeshRedirectMissing` Event, latest
/// first.
fn missing_pods(events: &[&Event]) -> Vec<PodEvent> {
    let mut latest: BTreeMap<(String, String, String), (Timestamp, PodEvent)> = BTreeMap::new();
    for e in events {
        if e.reason.as_deref() != Some(event_reason::REDIRECT_MISSING) {
            continue;
        }
        let (Some(r), Some(seen)) = (e.regarding.as_ref(), last_seen(e)) else {
            continue;
        };
        if r.kind.as_deref() != Some("Pod") {
            continue;
        }
        let namespace = r.namespace.clone().unwrap_or_default();
        let name = r.name.clone().unwrap_or_default();
        let key = (
            namespace.clone(),
            name.clone(),
            r.uid.clone().unwrap_or_default(),
        );
        let pod = PodEvent {
            namespace,
            name,
            node: e.reporting_instance.clone(),
            action: e.action.clone().unwrap_or_default(),
            note: e.note.clone().unwrap_or_default(),
            last_seen: seen.to_string(),
        };
        if latest.get(&key).is_none_or(|(t, _)| *t < seen) {
            latest.insert(key, (seen, pod));
        }
    }
    let mut pods: Vec<(Timestamp, PodEvent)> = latest.into_values().collect();
    pods.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.name.cmp(&b.1.name)));
    pods.into_iter().map(|(_, p)| p).collect()
}

/// The evicted pods last seen within `window` before `now`.
fn evictions(missing: &[PodEvent], now: Timestamp, window: Duration) -> Evictions {
    let window_seconds = window.as_secs();
    let cutoff = i64::try_from(window_seconds).ok().and_then(|s| {
        now.checked_sub(k8s_openapi::jiff::SignedDuration::from_secs(s))
            .ok()
    });
    let pods: Vec<PodEvent> = missing
        .iter()
        .filter(|p| p.action == EVICT_ACTION)
        .filter(|p| {
            let seen = p.last_seen.parse::<Timestamp>().ok();
            match (seen, cutoff) {
                (Some(seen), Some(cutoff)) => seen >= cutoff,
                (Some(_), None) => true,
                (None, _) => false,
            }
        })
        .cloned()
        .collect();
    Evictions {
        window_seconds,
        count: pods.len(),
        pods,
    }
}

#[cfg(test)]
mod tests;
