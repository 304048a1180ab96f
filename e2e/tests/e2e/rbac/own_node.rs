//! On its own Node the agent's real writes pass the policies, and every other change, and
//! every Event not in its own name or about another node, is refused with the policy's message.

use super::*;

/// The Node parts the agent must never change, as one comparable value.
fn foreign_parts(n: &Node) -> serde_json::Value {
    let mut labels = n.metadata.labels.clone().unwrap_or_default();
    labels.remove(VERIFIED_LABEL);
    let spec = n.spec.clone().unwrap_or_default();
    let taints: Vec<_> = spec
        .taints
        .iter()
        .flatten()
        .filter(|t| t.key != TAINT_KEY)
        .cloned()
        .collect();
    let status = n.status.clone().unwrap_or_default();
    let conditions: Vec<_> = status
        .conditions
        .iter()
        .flatten()
        .filter(|c| c.type_ != CONDITION_TYPE)
        .map(|c| (c.type_.clone(), c.status.clone()))
        .collect();
    json!({
        "labels": labels,
        "annotations": n.metadata.annotations,
        "finalizers": n.metadata.finalizers,
        "taints": taints,
        "unschedulable": spec.unschedulable,
        "capacity": status.capacity,
        "addresses": status.addresses,
        "images": status.images.as_ref().map(Vec::len),
        "conditions": conditions,
    })
}

#[tokio::test]
async fn agent_token_changes_only_meshgates_taint_label_and_condition() -> anyhow::Result<()> {
    let f = fixture().await;
    let admin = f.cp.client()?;
    let nodes: Api<Node> = Api::all(admin.clone());
    let agent = f.cp.client_for_token(&f.agent_token_c)?;
    let c = f.node_c.as_str();
    make_it_big(&nodes, c).await?;
    let before = nodes.get(c).await?;
    let foreign = foreign_parts(&before);
    assert!(
        foreign.to_string().contains(FOREIGN_TAINT)
            && foreign.to_string().contains(RESTRICTED_LABEL),
        "node C carries another taint and a restricted label: {foreign}"
    );

    the_agents_own_writes_pass(&admin, &agent, c, &before, &foreign).await?;
    every_other_change_is_refused(&nodes, &agent, c, &foreign).await?;
    its_events_name_it_and_its_node(f, &agent, c).await
}

/// Node C made as big as a real Node: 50 images and 40 more labels.
async fn make_it_big(nodes: &Api<Node>, c: &str) -> anyhow::Result<()> {
    // A Node as big as a real one: the kubelet reports up to 50 images, cloud nodes carry
    // dozens of labels. The policy compares all of it on every write of the agent, within
    // the apiserver's CEL cost limit.
    let images: Vec<_> = (0..50)
        .map(|i| {
            json!({
                "names": [
                    format!("registry.example.com/team-{i}/app@sha256:{i:064x}"),
                    format!("registry.example.com/team-{i}/app:v{i}"),
                ],
                "sizeBytes": 100_000_000 + i,
            })
        })
        .collect();
    nodes
        .patch_status(
            c,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"images": images}})),
        )
        .await?;
    let many: serde_json::Map<String, serde_json::Value> = (0..40)
        .map(|i| {
            (
                format!("example.com/label-{i}"),
                json!(format!("value-{i}")),
            )
        })
        .collect();
    nodes
        .patch(
            c,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": many}})),
        )
        .await?;
    Ok(())
}

/// 1. Everything the real agent writes passes: `NodeGate` and its Events, under its token.
async fn the_agents_own_writes_pass(
    admin: &Client,
    agent: &Client,
    c: &str,
    before: &Node,
    foreign: &serde_json::Value,
) -> anyhow::Result<()> {
    use kube::runtime::events::Reporter;
    let nodes: Api<Node> = Api::all(admin.clone());
    // 1. Everything the real agent writes passes: NodeGate (the taint and label JSON patch
    //    guarded by a resourceVersion test, the condition by server-side apply on nodes/status,
    //    the Event) with the agent's real token, through unverified → verified → unverified:
    //    label and condition written, taint removed, taint added back.
    let reporter = Reporter {
        controller: "meshgate-agent".into(),
        instance: Some(c.to_owned()),
    };
    node_gate_writes_pass(&nodes, agent, c, reporter.clone(), foreign).await?;
    its_events_pass(admin, agent, c, before, reporter).await
}

/// `NodeGate`'s writes through unverified → verified → unverified: label and condition
/// written, taint removed, taint added back, and nothing else changed.
async fn node_gate_writes_pass(
    nodes: &Api<Node>,
    agent: &Client,
    c: &str,
    reporter: kube::runtime::events::Reporter,
    foreign: &serde_json::Value,
) -> anyhow::Result<()> {
    use kube::runtime::events::Recorder;
    use meshgate_agent::daemon::node::{NodeGate, TaintEffect, TaintKey};
    use meshgate_core::mode::Mode;
    let gate = NodeGate::new(
        agent.clone(),
        c.to_owned(),
        TaintKey::default(),
        TaintEffect::NoSchedule,
        std::time::Duration::from_secs(5),
        Recorder::new(agent.clone(), reporter),
    );
    for (verified, want_taint, reason) in [
        (false, true, "ChainedPluginMissing"),
        (true, false, "Verified"),
        (false, true, "ChainedPluginMissing"),
    ] {
        let applied = gate
            .reconcile(None, &verdict(verified)?, Mode::Enforce)
            .await
            .with_context(|| format!("the agent's own writes (verified={verified})"))?;
        let n = nodes.get(c).await?;
        assert_eq!(tainted(&n), want_taint, "{applied:?}");
        assert_eq!(label(&n), Some(if verified { "true" } else { "false" }));
        assert_eq!(
            condition(&n),
            Some((
                if verified { "True" } else { "False" }.into(),
                reason.into()
            ))
        );
        assert_eq!(
            foreign_parts(&n),
            *foreign,
            "the agent's writes kept the rest"
        );
    }
    Ok(())
}

/// Its Events (created, then patched as a series repeats), about its Node and about a Pod.
async fn its_events_pass(
    admin: &Client,
    agent: &Client,
    c: &str,
    before: &Node,
    reporter: kube::runtime::events::Reporter,
) -> anyhow::Result<()> {
    use kube::runtime::events::{Event as Note, EventType, Recorder};
    let events: Api<Event> = Api::namespaced(admin.clone(), "default");
    poll_until(
        "the agent's CNIChainVerified Event on node C",
        WAIT,
        || async {
            let list = events.list(&ListParams::default()).await?;
            anyhow::Ok(list.items.into_iter().find(|e| {
                e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(c)
                    && e.reason.as_deref() == Some("CNIChainVerified")
            }))
        },
    )
    .await?;
    let recorder = Recorder::new(agent.clone(), reporter);
    let note = Note {
        type_: EventType::Warning,
        reason: "PolicyProbe".into(),
        note: Some("the same Event twice: created, then patched as a series".into()),
        action: "Probe".into(),
        secondary: None,
    };
    let node_ref = kube::Resource::object_ref(before, &());
    for _ in 0..2 {
        recorder
            .publish(&note, &node_ref)
            .await
            .context("the agent's Event about its own Node")?;
    }
    let pod_ref = k8s_openapi::api::core::v1::ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        namespace: Some("default".into()),
        name: Some("meshed-web".into()),
        uid: Some("00000000-0000-0000-0000-000000000001".into()),
        ..Default::default()
    };
    recorder
        .publish(&note, &pod_ref)
        .await
        .context("the agent's Event about a Pod")?;
    Ok(())
}

/// 2. Every other change to its own Node is refused, each with the policy's message.
async fn every_other_change_is_refused(
    nodes: &Api<Node>,
    agent: &Client,
    c: &str,
    foreign: &serde_json::Value,
) -> anyhow::Result<()> {
    let as_agent: Api<Node> = Api::all(agent.clone());
    // 2. Every other change to its own Node is refused, each with the policy's message.
    let n = nodes.get(c).await?;
    let msg = Messages::of(c);
    let mut tried = Attempts::default();
    other_taint_changes(&as_agent, c, &n, &msg, &mut tried).await?;
    spec_and_metadata_changes(&as_agent, c, &msg, &mut tried).await;
    status_changes(&as_agent, c, &msg, &mut tried).await;
    let wrong: Vec<_> = tried
        .tried
        .iter()
        .filter(|(_, _, bad)| !bad.is_empty())
        .collect();
    assert!(
        wrong.is_empty(),
        "changes not refused by the policy with its message: {wrong:#?}"
    );
    spec_sent_to_status_is_dropped(nodes, &as_agent, c, foreign).await
}

/// The policy's message for each kind of change to Node `c`.
struct Messages {
    spec: String,
    label: String,
    meta: String,
    status: String,
}

impl Messages {
    fn of(c: &str) -> Self {
        Self {
            spec: format!("may change only the taint {TAINT_KEY} in the spec of Node {c}"),
            label: format!("may change only the label {VERIFIED_LABEL} of Node {c}"),
            meta: format!("may not change the metadata of Node {c}"),
            status: format!(
                "may change only the condition {CONDITION_TYPE} in the status of Node {c}"
            ),
        }
    }
}

/// Each change tried: what, the answer, and "" when the policy refused it with its message.
#[derive(Default)]
struct Attempts {
    tried: Vec<(&'static str, String, &'static str)>,
}

impl Attempts {
    fn record(&mut self, what: &'static str, r: Result<Node, kube::Error>, msg: &str) {
        let own = "meshgate-agent-own-node";
        self.tried.push((
            what,
            r.as_ref()
                .map(|_| "allowed".to_owned())
                .unwrap_or_else(|e| e.to_string()),
            if refused_by_policy(&r, own) && status_of(&r).is_some_and(|(_, m)| m.contains(msg)) {
                ""
            } else {
                "NOT REFUSED AS EXPECTED"
            },
        ));
    }
}

/// The agent's own patch shape (resourceVersion test, then the taint list), with another
/// taint removed, added or changed.
async fn other_taint_changes(
    as_agent: &Api<Node>,
    c: &str,
    n: &Node,
    msg: &Messages,
    tried: &mut Attempts,
) -> anyhow::Result<()> {
    let rv = n.resource_version().unwrap_or_default();
    let taints = n
        .spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default();
    let ours_only: Vec<_> = taints
        .iter()
        .filter(|t| t.key == TAINT_KEY)
        .cloned()
        .collect();
    let mut plus_evil = taints.clone();
    plus_evil.push(k8s_openapi::api::core::v1::Taint {
        key: "example.com/evil".into(),
        effect: "NoExecute".into(),
        ..Default::default()
    });
    let harden = |mut t: Vec<k8s_openapi::api::core::v1::Taint>| {
        for x in t.iter_mut().filter(|x| x.key == FOREIGN_TAINT) {
            x.effect = "NoExecute".into();
        }
        t
    };
    let rv_patch = |taints: &[k8s_openapi::api::core::v1::Taint]| -> anyhow::Result<Patch<()>> {
        Ok(Patch::Json(serde_json::from_value(json!([
            {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
            {"op": "add", "path": "/spec/taints", "value": taints},
        ]))?))
    };
    let pp = PatchParams::default();
    tried.record(
        "remove another taint",
        as_agent.patch(c, &pp, &rv_patch(&ours_only)?).await,
        &msg.spec,
    );
    tried.record(
        "add another taint",
        as_agent.patch(c, &pp, &rv_patch(&plus_evil)?).await,
        &msg.spec,
    );
    tried.record(
        "change another taint's effect",
        as_agent
            .patch(c, &pp, &rv_patch(&harden(taints.clone()))?)
            .await,
        &msg.spec,
    );
    Ok(())
}

/// Cordoning, the provider ID, labels, annotations and finalizers.
async fn spec_and_metadata_changes(
    as_agent: &Api<Node>,
    c: &str,
    msg: &Messages,
    tried: &mut Attempts,
) {
    let pp = PatchParams::default();
    tried.record(
        "cordon (spec.unschedulable)",
        as_agent
            .patch(
                c,
                &pp,
                &Patch::Merge(json!({"spec": {"unschedulable": true}})),
            )
            .await,
        &msg.spec,
    );
    tried.record(
        "set spec.providerID",
        as_agent
            .patch(
                c,
                &pp,
                &Patch::Merge(json!({"spec": {"providerID": "evil://x"}})),
            )
            .await,
        &msg.spec,
    );
    tried.record(
        "change a node-restriction.kubernetes.io label",
        as_agent
            .patch(
                c,
                &pp,
                &Patch::Merge(json!({"metadata": {"labels": {RESTRICTED_LABEL: "b"}}})),
            )
            .await,
        &msg.label,
    );
    tried.record(
        "add a node-restriction.kubernetes.io label",
        as_agent.patch(c, &pp, &Patch::Merge(json!({"metadata": {"labels": {"node-restriction.kubernetes.io/secure": "true"}}}))).await,
        &msg.label,
    );
    tried.record(
        "remove another label",
        as_agent
            .patch(
                c,
                &pp,
                &Patch::Merge(json!({"metadata": {"labels": {"kubernetes.io/hostname": null}}})),
            )
            .await,
        &msg.label,
    );
    tried.record(
        "add an annotation",
        as_agent
            .patch(
                c,
                &pp,
                &Patch::Merge(json!({"metadata": {"annotations": {"example.com/x": "y"}}})),
            )
            .await,
        &msg.meta,
    );
    tried.record(
        "add a finalizer",
        as_agent
            .patch(
                c,
                &pp,
                &Patch::Merge(json!({"metadata": {"finalizers": ["example.com/hold"]}})),
            )
            .await,
        &msg.meta,
    );
}

/// Through nodes/status: other conditions, the capacity, the addresses, and a label beside
/// its own condition.
async fn status_changes(as_agent: &Api<Node>, c: &str, msg: &Messages, tried: &mut Attempts) {
    let pp = PatchParams::default();
    tried.record(
        "set the Ready condition False (nodes/status)",
        as_agent
            .patch_status(
                c,
                &pp,
                &Patch::Strategic(json!({"status": {"conditions": [{
                    "type": "Ready", "status": "False", "reason": "Forged", "message": "forged"
                }]}})),
            )
            .await,
        &msg.status,
    );
    tried.record(
        "change the capacity (nodes/status)",
        as_agent
            .patch_status(
                c,
                &pp,
                &Patch::Merge(json!({"status": {"capacity": {"pods": "1000"}}})),
            )
            .await,
        &msg.status,
    );
    tried.record(
        "change the addresses (nodes/status)",
        as_agent
            .patch_status(c, &pp, &Patch::Merge(json!({"status": {"addresses": [{"type": "InternalIP", "address": "10.9.9.9"}]}})))
            .await,
        &msg.status,
    );
    tried.record(
        "its condition plus a label (nodes/status)",
        as_agent
            .patch_status(c, &pp, &Patch::Strategic(json!({
                "metadata": {"labels": {RESTRICTED_LABEL: "b"}},
                "status": {"conditions": [{"type": CONDITION_TYPE, "status": "True", "reason": "Verified", "message": "forged"}]}
            })))
            .await,
        &msg.label,
    );
}

/// A spec change sent to nodes/status is dropped by the apiserver (the status strategy keeps
/// the old spec) whatever the policy says: the node stays schedulable, and nothing but
/// meshgate's parts changed.
async fn spec_sent_to_status_is_dropped(
    nodes: &Api<Node>,
    as_agent: &Api<Node>,
    c: &str,
    foreign: &serde_json::Value,
) -> anyhow::Result<()> {
    let pp = PatchParams::default();
    let _ = as_agent
        .patch_status(
            c,
            &pp,
            &Patch::Merge(json!({"spec": {"unschedulable": true}})),
        )
        .await;
    let after = nodes.get(c).await?;
    assert_eq!(
        foreign_parts(&after),
        *foreign,
        "nothing but meshgate's parts changed"
    );
    assert!(tainted(&after) && label(&after) == Some("false"));

    Ok(())
}

/// 3. Its Events must name it and concern its own Node or a Pod.
async fn its_events_name_it_and_its_node(
    f: &Fixture,
    agent: &Client,
    c: &str,
) -> anyhow::Result<()> {
    // 3. Its Events must name it and concern its own Node or a Pod.
    let agent_events: Api<Event> = Api::namespaced(agent.clone(), "default");
    let forged =
        |controller: &str, instance: &str, kind: &str, name: &str| -> anyhow::Result<Event> {
            Ok(serde_json::from_value(json!({
                "metadata": {"generateName": "forged-"},
                "eventTime": "2026-01-01T00:00:00.000000Z",
                "reportingController": controller, "reportingInstance": instance,
                "action": "Probe", "reason": "Forged", "type": "Warning", "note": "forged",
                "regarding": {"apiVersion": "v1", "kind": kind, "name": name},
            }))?)
        };
    let events_policy = "meshgate-agent-own-events";
    for (what, ev, msg) in [
        (
            "as the kubelet",
            forged("kubelet", c, "Node", c)?,
            "only as reportingController meshgate-agent",
        ),
        (
            "as the agent of node B",
            forged(AGENT, &f.node_b, "Node", &f.node_b)?,
            "only as reportingController meshgate-agent",
        ),
        (
            "about node B",
            forged(AGENT, c, "Node", &f.node_b)?,
            "only about its own Node or a Pod",
        ),
        (
            "about a Secret",
            forged(AGENT, c, "Secret", "x")?,
            "only about its own Node or a Pod",
        ),
    ] {
        let r = agent_events.create(&PostParams::default(), &ev).await;
        assert!(
            refused_by_policy(&r, events_policy)
                && status_of(&r).is_some_and(|(_, m)| m.contains(msg)),
            "an Event {what}: {}",
            describe(&r)
        );
    }
    let ok = agent_events
        .create(&PostParams::default(), &forged(AGENT, c, "Node", c)?)
        .await;
    assert!(
        ok.is_ok(),
        "a hand-made Event about its own Node: {}",
        describe(&ok)
    );
    Ok(())
}
