use serde_json::{Value, json};

use super::*;
use crate::gate::{CONDITION_TYPE, DEFAULT_TAINT_KEY, LEGACY_TAINT_KEY};

const TAINT_KEY: &str = DEFAULT_TAINT_KEY;

const NOW: &str = "2026-11-26T12:00:00Z";

fn now() -> Timestamp {
    NOW.parse().unwrap()
}

fn node(name: &str, taints: Value, label: Option<&str>, condition: Option<Value>) -> Node {
    let labels = match label {
        Some(v) => json!({VERIFIED_LABEL: v}),
        None => json!({}),
    };
    let conditions = condition.map_or_else(|| json!([]), |c| json!([c]));
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels},
        "spec": {"taints": taints},
        "status": {"conditions": conditions},
    }))
    .unwrap()
}

/// A `MeshCNIVerified` condition.
fn cond(status: &str, reason: &str, message: &str, since: &str) -> Option<Value> {
    Some(
        json!({"type": CONDITION_TYPE, "status": status, "reason": reason,
        "message": message, "lastTransitionTime": since}),
    )
}

/// An Event as the agent writes it (kube's Recorder: events.k8s.io/v1).
fn event(reason: &str, kind: &str, name: &str, action: &str, note: &str, at: &str) -> Event {
    serde_json::from_value(json!({
        "metadata": {"name": format!("{name}.{at}"), "namespace": "default"},
        "eventTime": at.replace('Z', ".000000Z"),
        "reason": reason, "action": action, "note": note, "type": "Normal",
        "reportingController": AGENT_CONTROLLER, "reportingInstance": "node-a",
        "regarding": {"kind": kind, "name": name, "namespace": "shop", "uid": format!("uid-{name}")},
    }))
    .unwrap()
}

/// The agent's `MeshRedirectMissing` Event about pod `name` (namespace shop).
fn pod_event(name: &str, action: &str, note: &str, at: &str) -> Event {
    event("MeshRedirectMissing", "Pod", name, action, note, at)
}

/// The agent's Node Event `reason` about `node`.
fn node_event(reason: &str, node: &str, action: &str, note: &str, at: &str) -> Event {
    event(reason, "Node", node, action, note, at)
}

/// What the plugin adds to the report: the webhook's (state, detail), the (mode, source).
fn probed(r: &mut Report, webhook: (&'static str, &str), mode: (&str, &'static str)) {
    r.webhook = Some(Webhook {
        state: webhook.0,
        detail: webhook.1.into(),
    });
    r.mode = Some(Mode {
        mode: mode.0.into(),
        source: mode.1,
    });
}

fn report(nodes: &[Node], events: &[Event]) -> Report {
    build(&Inputs {
        nodes,
        events,
        taint_key: &TaintKey::default(),
        eviction_window: Duration::from_secs(3600),
        now: now(),
    })
}

#[test]
fn gated_nodes_say_why_and_since_when() {
    let nodes = [
        node(
            "node-b",
            json!([{"key": "other", "effect": "NoSchedule"}]),
            Some("true"),
            cond("True", "Verified", "chains it", "2026-11-26T10:00:00Z"),
        ),
        node(
            "node-a",
            json!([{"key": TAINT_KEY, "effect": "NoSchedule"}]),
            Some("false"),
            cond(
                "False",
                "ChainedPluginMissing",
                "does not chain linkerd-cni",
                "2026-11-26T11:55:00Z",
            ),
        ),
        // Gated at registration, under the key of a release before --taint-key (meshgate's
        // too); no agent has reported.
        node(
            "node-c",
            json!([{"key": LEGACY_TAINT_KEY, "effect": "NoExecute", "timeAdded": "2026-11-26T11:00:00Z"}]),
            Some("false"),
            None,
        ),
        // No meshgate mark at all: the webhook refuses meshed pods there all the same.
        node("node-d", json!([]), None, None),
    ];
    let r = report(&nodes, &[]);
    let names: Vec<&str> = r.nodes.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, ["node-a", "node-b", "node-c", "node-d"]);
    let a = &r.nodes[0];
    assert!(a.gated);
    assert_eq!(a.taint.as_deref(), Some("NoSchedule"));
    assert_eq!(a.reason, "ChainedPluginMissing");
    assert_eq!(a.message.as_deref(), Some("does not chain linkerd-cni"));
    assert_eq!(a.since.as_deref(), Some("2026-11-26T11:55:00Z"));
    let b = &r.nodes[1];
    assert!(!b.gated, "another taint is not meshgate's");
    assert_eq!(
        (b.taint.as_deref(), b.condition.as_deref()),
        (None, Some("True"))
    );
    let c = &r.nodes[2];
    assert!(c.gated);
    assert_eq!(c.reason, "NoVerdict");
    assert_eq!(c.since.as_deref(), Some("2026-11-26T11:00:00Z"));
    let d = &r.nodes[3];
    assert!(d.gated && d.taint.is_none() && d.label.is_none() && d.since.is_none());
    assert!(r.needs_attention());
}

#[test]
fn the_last_untaint_is_the_latest_verified_event_with_a_latency() {
    let nodes = [node("node-a", json!([]), Some("true"), None)];
    let events = [
        node_event(
            "CNIChainVerified",
            "node-a",
            "Untaint",
            "Verified: ok [untaint latency: 900 ms]",
            "2026-11-26T09:00:00Z",
        ),
        node_event(
            "CNIChainVerified",
            "node-a",
            "Untaint",
            "Verified: ok [untaint latency: 183 ms]",
            "2026-11-26T11:00:00Z",
        ),
        // Later, but verified without an untaint (the node was never tainted): no latency.
        node_event(
            "CNIChainVerified",
            "node-a",
            "Untaint",
            "Verified: ok",
            "2026-11-26T11:30:00Z",
        ),
        node_event(
            "CNIChainUnverified",
            "node-a",
            "Taint",
            "NoConfig: x [untaint latency: 1 ms]",
            "2026-11-26T11:40:00Z",
        ),
    ];
    let r = report(&nodes, &events);
    assert_eq!(
        r.nodes[0].last_untaint,
        Some(Untaint {
            latency_ms: 183,
            at: "2026-11-26T11:00:00Z".into()
        })
    );
    assert!(!r.needs_attention());
}

#[test]
fn events_of_other_controllers_are_ignored() {
    let nodes = [node("node-a", json!([]), Some("true"), None)];
    let mut forged = node_event(
        "CNIChainVerified",
        "node-a",
        "Untaint",
        "Verified: ok [untaint latency: 1 ms]",
        "2026-11-26T11:00:00Z",
    );
    forged.reporting_controller = Some("someone-else".into());
    let mut pod = pod_event("web-1", "Evict", "evicted", "2026-11-26T11:59:00Z");
    pod.reporting_controller = None;
    let r = report(&nodes, &[forged, pod]);
    assert_eq!(r.nodes[0].last_untaint, None);
    assert!(r.missing_pods.is_empty());
    assert_eq!(r.evictions.count, 0);
}

#[test]
fn missing_pods_are_one_per_pod_and_evictions_are_counted_in_the_window() {
    let mut blocked_then_evicted = pod_event(
        "web-1",
        "EvictBlocked",
        "blocked by a PodDisruptionBudget",
        "2026-11-26T11:10:00Z",
    );
    // A series: first seen 11:10, last seen 11:20.
    blocked_then_evicted.series = Some(
        serde_json::from_value(
            json!({"count": 3, "lastObservedTime": "2026-11-26T11:20:00.000000Z"}),
        )
        .unwrap(),
    );
    let events = [
        blocked_then_evicted,
        pod_event("web-1", "Evict", "evicted", "2026-11-26T11:30:00Z"),
        pod_event("web-2", "Evict", "evicted", "2026-11-26T10:30:00Z"),
        pod_event(
            "web-3",
            "DryRun",
            "dry-run: would be evicted",
            "2026-11-26T11:45:00Z",
        ),
    ];
    let r = report(&[], &events);
    let pods: Vec<(&str, &str)> = r
        .missing_pods
        .iter()
        .map(|p| (p.name.as_str(), p.action.as_str()))
        .collect();
    assert_eq!(
        pods,
        [("web-3", "DryRun"), ("web-1", "Evict"), ("web-2", "Evict")]
    );
    assert_eq!(r.missing_pods[1].node.as_deref(), Some("node-a"));
    assert_eq!(r.missing_pods[1].last_seen, "2026-11-26T11:30:00Z");
    // web-2 was evicted 90 minutes ago: outside the hour.
    assert_eq!(r.evictions.count, 1);
    assert_eq!(r.evictions.pods[0].name, "web-1");
    assert_eq!(r.evictions.window_seconds, 3600);
}

#[test]
fn the_json_schema_names_are_stable() {
    let nodes = [node(
        "node-a",
        json!([{"key": TAINT_KEY, "effect": "NoSchedule"}]),
        Some("false"),
        None,
    )];
    let mut r = report(
        &nodes,
        &[pod_event(
            "web-1",
            "Evict",
            "evicted",
            "2026-11-26T11:30:00Z",
        )],
    );
    probed(
        &mut r,
        ("reachable", "refused the probe"),
        ("enforce", "default"),
    );
    let v = serde_json::to_value(&r).unwrap();
    let keys = |v: &Value| -> Vec<String> { v.as_object().unwrap().keys().cloned().collect() };
    assert_eq!(
        keys(&v),
        [
            "schema",
            "generated_at",
            "taint_key",
            "mode",
            "webhook",
            "agent_access",
            "nodes",
            "missing_pods",
            "evictions",
            "truncated"
        ]
    );
    assert_eq!(v["schema"], "meshgate.io/status/v1");
    assert_eq!(v["generated_at"], NOW);
    assert_eq!(
        keys(&v["nodes"][0]),
        [
            "name",
            "gated",
            "taint",
            "label",
            "condition",
            "reason",
            "message",
            "since",
            "last_untaint"
        ]
    );
    assert_eq!(
        keys(&v["missing_pods"][0]),
        ["namespace", "name", "node", "action", "note", "last_seen"]
    );
    assert_eq!(keys(&v["evictions"]), ["window_seconds", "count", "pods"]);
    assert_eq!(keys(&v["webhook"]), ["state", "detail"]);
    assert_eq!(keys(&v["mode"]), ["mode", "source"]);
    assert_eq!(v["agent_access"], Value::Null, "not read: null");
    r.agent_access = Some(access::assess(access::Grants::Node, access::Gate::On));
    let v = serde_json::to_value(&r).unwrap();
    assert_eq!(
        v["agent_access"],
        json!({"grants": "node", "gate": "on", "warning": null})
    );
}

#[test]
fn the_table_answers_each_question() {
    let nodes = [
        node(
            "node-a",
            json!([{"key": TAINT_KEY, "effect": "NoSchedule"}]),
            Some("false"),
            cond(
                "False",
                "NoConfig",
                "no .conf file\nin /etc/cni/net.d",
                "2026-11-26T11:55:00Z",
            ),
        ),
        node("node-b", json!([]), Some("true"), None),
    ];
    let events = [
        node_event(
            "CNIChainVerified",
            "node-b",
            "Untaint",
            "Verified: ok [untaint latency: 183 ms]",
            "2026-11-26T11:00:00Z",
        ),
        pod_event("web-1", "Evict", "evicted", "2026-11-26T11:30:00Z"),
    ];
    let mut r = report(&nodes, &events);
    probed(
        &mut r,
        ("unreachable", "failed calling webhook"),
        ("report", "configmap"),
    );
    r.truncated.push("events".into());
    let text = table::render(&r, now());
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], format!("NODES: 2 (1 gated; taint {TAINT_KEY})"));
    assert!(lines[1].starts_with("NODE "), "{text}");
    let a: Vec<&str> = lines[2].split_whitespace().collect();
    assert_eq!(
        &a[..6],
        ["node-a", "yes", "NoSchedule", "false", "NoConfig", "5m"],
        "{text}"
    );
    assert!(
        lines[2].ends_with("no .conf file in /etc/cni/net.d"),
        "{text}"
    );
    let b: Vec<&str> = lines[3].split_whitespace().collect();
    assert_eq!(
        &b[..7],
        ["node-b", "no", "-", "true", "NoVerdict", "-", "183ms"],
        "{text}"
    );
    assert!(
        text.contains(
            "\nPODS WITHOUT REDIRECTS (MeshRedirectMissing Events still in the API): 1\n"
        ),
        "{text}"
    );
    assert!(text.contains("\nEVICTIONS IN THE LAST 60m: 1\n"), "{text}");
    assert!(
        text.contains("PODS JUDGED UNKNOWN: not in the API"),
        "{text}"
    );
    assert!(
        text.contains("\nWEBHOOK: unreachable (failed calling webhook)\n"),
        "{text}"
    );
    assert!(text.contains("\nMODE: report (configmap)\n"), "{text}");
    assert!(text.contains("WARNING: the events list was cut"), "{text}");
}

/// The agent's grants against the gate: a line, and a WARNING when they disagree; confined
/// grants without the gate need attention (no agent can read), wide ones with it do not.
#[test]
fn the_agent_grants_are_printed_and_a_mismatch_warns() {
    use access::{Gate, Grants, assess};
    let nodes = [node("node-b", json!([]), Some("true"), None)];
    let with = |grants, gate| {
        let mut r = report(&nodes, &[]);
        r.agent_access = Some(assess(grants, gate));
        (table::render(&r, now()), r.needs_attention())
    };
    let (text, attention) = with(Grants::Node, Gate::On);
    assert!(
        text.contains("\nAGENT GRANTS: node (a stolen agent token reads only its own Node and the pods on it; ConstrainedImpersonation gate: on)\n"),
        "{text}"
    );
    assert!(!text.contains("WARNING"), "{text}");
    assert!(!attention);

    let (text, attention) = with(Grants::Node, Gate::Off);
    assert!(
        text.contains("ConstrainedImpersonation gate: off)"),
        "{text}"
    );
    assert!(
        text.contains("\nWARNING: the agent acts as its node (agent.impersonateNode) but the apiserver's ConstrainedImpersonation feature gate is off"),
        "{text}"
    );
    assert!(attention, "no agent can read: attention");

    let (text, attention) = with(Grants::Cluster, Gate::On);
    assert!(
        text.contains("AGENT GRANTS: cluster (a stolen agent token reads every Pod (environment values included) and every Node;"),
        "{text}"
    );
    assert!(
        text.contains("\nWARNING: the apiserver's ConstrainedImpersonation feature gate is on but the agent reads with cluster-wide grants"),
        "{text}"
    );
    assert!(!attention, "a hardening, not a fault");

    let (text, _) = with(Grants::Cluster, Gate::Unknown);
    assert!(
        text.contains("gate: unknown)") && !text.contains("WARNING"),
        "{text}"
    );
}
