//! Which new Nodes `/mutate-node` gates: exactly those the agent DaemonSet will run on.
//!
//! In: the agent DaemonSet as the cache holds it ([`AgentDaemonSet`], `--agent-daemonset`)
//! and the Node being created (its name, labels and `NoSchedule`/`NoExecute` taints, as
//! [`crate::decode`] keeps them). Out: gate it, or why not ([`Ungated`], the `reason` of
//! `meshgate_node_registrations_ungated_total`). The decision is
//! `meshgate_core::placement::placement_at_registration`.
//!
//! While the DaemonSet is not known (the watch has not listed yet, or there is no such
//! DaemonSet) the node is not gated: a node tainted where no agent ever runs stays tainted for
//! ever, while a node left untainted is tainted by its agent once that starts.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::PodSpec;
use meshgate_core::placement::{self, Exclusion, NodeView, Placement};

use crate::decode::Object;

/// `--agent-daemonset`: where the agent DaemonSet is, `NAMESPACE/NAME`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DaemonSetRef {
    /// Its namespace (meshgate's own).
    pub namespace: String,
    /// Its name.
    pub name: String,
}

/// The manifests' agent DaemonSet.
pub const DEFAULT_AGENT_DAEMONSET: &str = "meshgate-system/meshgate-agent";

impl FromStr for DaemonSetRef {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || {
            format!("invalid DaemonSet {s:?}: use NAMESPACE/NAME, e.g. {DEFAULT_AGENT_DAEMONSET}")
        };
        let (namespace, name) = s.split_once('/').ok_or_else(bad)?;
        // A namespace is a DNS label, a DaemonSet name a DNS subdomain (lowercase).
        let dns = |part: &str, dots: bool, max: usize| {
            !part.is_empty()
                && part.len() <= max
                && part.bytes().all(|b| {
                    b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || (dots && b == b'.')
                })
                && part
                    .bytes()
                    .next()
                    .is_some_and(|b| b.is_ascii_alphanumeric())
                && part
                    .bytes()
                    .last()
                    .is_some_and(|b| b.is_ascii_alphanumeric())
        };
        if !dns(namespace, false, 63) || !dns(name, true, 253) {
            return Err(bad());
        }
        Ok(Self {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        })
    }
}

impl fmt::Display for DaemonSetRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// What the webhook knows of the agent DaemonSet.
#[derive(Clone, Debug)]
pub enum AgentDaemonSet {
    /// Its watch has not listed yet.
    NotSynced,
    /// Listed: there is no such DaemonSet.
    Absent,
    /// The DaemonSet.
    Known(Arc<DaemonSet>),
}

/// Why a new Node is not gated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ungated {
    /// The agent DaemonSet will not run on it.
    NotPlaced(Exclusion),
    /// The DaemonSet's watch has not listed yet.
    DaemonSetNotSynced,
    /// There is no agent DaemonSet.
    DaemonSetAbsent,
}

impl Ungated {
    /// The `reason` label value (docs/operations.md, "Metrics").
    pub fn reason(&self) -> &'static str {
        match self {
            Ungated::NotPlaced(_) => "not_placed",
            Ungated::DaemonSetNotSynced => "daemonset_not_synced",
            Ungated::DaemonSetAbsent => "daemonset_absent",
        }
    }

    /// Logs the decision about node `name`: expected for a node the agent does not run on,
    /// worth a warning when meshgate cannot tell.
    pub fn log(&self, name: &str, agent: &DaemonSetRef) {
        match self {
            Ungated::NotPlaced(why) => tracing::info!(
                node = name, daemonset = %agent, reason = self.reason(), why = %why,
                "new node not gated: the agent DaemonSet will not run there"
            ),
            _ => tracing::warn!(
                node = name, daemonset = %agent, reason = self.reason(),
                "new node not gated: the agent DaemonSet is not known; its agent taints it once it runs"
            ),
        }
    }
}

static NO_LABELS: BTreeMap<String, String> = BTreeMap::new();

/// Whether to gate the Node `object` (named `name` in the request) being created.
pub fn gates(agent: &AgentDaemonSet, name: &str, object: &Object) -> Result<(), Ungated> {
    let ds = match agent {
        AgentDaemonSet::NotSynced => return Err(Ungated::DaemonSetNotSynced),
        AgentDaemonSet::Absent => return Err(Ungated::DaemonSetAbsent),
        AgentDaemonSet::Known(ds) => ds,
    };
    let default = PodSpec::default();
    let spec = ds
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .unwrap_or(&default);
    let node = NodeView {
        name: object.metadata.name.as_deref().unwrap_or(name),
        labels: object.metadata.labels.as_ref().unwrap_or(&NO_LABELS),
        taints: object.node_taints(),
    };
    match placement::placement_at_registration(spec, &node) {
        Placement::Runs => Ok(()),
        Placement::Excluded(why) => Err(Ungated::NotPlaced(why)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::review::tests::{
        agent_daemonset, decoded_patch, fake_cluster, node_review, reviewer, wire,
    };
    use serde_json::{Value, json};

    /// What `/mutate-node` answers for `node` with the agent DaemonSet `agent`: the patch
    /// (`None`: none), and the metrics text.
    fn mutate(agent: AgentDaemonSet, node: Value) -> (Option<Value>, String) {
        let mut cluster = fake_cluster();
        cluster.agent = Some(agent);
        let (r, registry) = reviewer(cluster);
        let out = wire(r.mutate_node(&node_review(node)));
        assert_eq!(out["response"]["allowed"], true, "{out}");
        let patch = out["response"].get("patch").map(|_| decoded_patch(&out));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        (patch, text)
    }

    /// A Node as the apiserver hands it to the webhook: with the `not-ready` taint the
    /// TaintNodesByCondition admission plugin adds to every new Node.
    fn new_node(labels: Value, taints: Value) -> Value {
        let mut all = json!([{"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}]);
        all.as_array_mut()
            .unwrap()
            .extend(taints.as_array().unwrap().iter().cloned());
        json!({"metadata": {"name": "n1", "labels": labels}, "spec": {"taints": all}})
    }

    fn ungated(text: &str, reason: &str) -> bool {
        text.contains(&format!(
            "meshgate_node_registrations_ungated_total{{reason=\"{reason}\"}} 1"
        ))
    }

    /// The shipped agent's placement: Linux nodes, not virtual-kubelet ones, every taint.
    fn shipped() -> AgentDaemonSet {
        agent_daemonset(json!({
            "nodeSelector": {"kubernetes.io/os": "linux"},
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [
                    {"key": "type", "operator": "NotIn", "values": ["virtual-kubelet"]}]}]}}},
            "tolerations": [{"operator": "Exists"}],
            "hostNetwork": true
        }))
    }

    #[test]
    fn only_nodes_the_agent_runs_on_are_gated() {
        let linux = json!({"kubernetes.io/os": "linux"});
        let (patch, text) = mutate(shipped(), new_node(linux.clone(), json!([])));
        let patch = patch.expect("a Linux node is gated");
        assert!(
            patch
                .to_string()
                .contains(meshgate_core::gate::DEFAULT_TAINT_KEY),
            "{patch}"
        );
        assert!(
            !text.contains("meshgate_node_registrations_ungated_total{"),
            "{text}"
        );

        for (what, node) in [
            (
                "windows",
                new_node(json!({"kubernetes.io/os": "windows"}), json!([])),
            ),
            ("no os label", new_node(json!({}), json!([]))),
            (
                "virtual-kubelet",
                new_node(
                    json!({"kubernetes.io/os": "linux", "type": "virtual-kubelet"}),
                    json!([{"key": "virtual-kubelet.io/provider", "value": "azure", "effect": "NoSchedule"}]),
                ),
            ),
        ] {
            let (patch, text) = mutate(shipped(), node);
            assert_eq!(patch, None, "{what}: no taint, no label");
            assert!(ungated(&text, "not_placed"), "{what}: {text}");
        }
    }

    /// Taints decide with the pod's tolerations plus the controller's; the `not-ready` taint
    /// every new Node carries does not.
    #[test]
    fn taints_are_judged_against_the_templates_tolerations() {
        let picky = || {
            agent_daemonset(json!({"tolerations": [
            {"key": "dedicated", "operator": "Equal", "value": "mesh", "effect": "NoSchedule"}]}))
        };
        let (patch, _) = mutate(picky(), new_node(json!({}), json!([])));
        assert!(
            patch.is_some(),
            "not-ready alone does not keep the agent away"
        );
        let (patch, _) = mutate(
            picky(),
            new_node(
                json!({}),
                json!([{"key": "dedicated", "value": "mesh", "effect": "NoSchedule"}]),
            ),
        );
        assert!(patch.is_some(), "a tolerated taint");
        let (patch, text) = mutate(
            picky(),
            new_node(
                json!({}),
                json!([{"key": "gpu", "effect": "NoExecute"}, {"key": "x", "effect": "PreferNoSchedule"}]),
            ),
        );
        assert_eq!(patch, None, "an untolerated NoExecute taint");
        assert!(ungated(&text, "not_placed"), "{text}");
    }

    /// Before the DaemonSet is known, and without one, new Nodes are left to their agent.
    #[test]
    fn an_unknown_daemonset_gates_nothing() {
        for (agent, reason) in [
            (AgentDaemonSet::NotSynced, "daemonset_not_synced"),
            (AgentDaemonSet::Absent, "daemonset_absent"),
        ] {
            let (patch, text) = mutate(
                agent,
                new_node(json!({"kubernetes.io/os": "linux"}), json!([])),
            );
            assert_eq!(patch, None, "{reason}");
            assert!(ungated(&text, reason), "{reason}: {text}");
        }
    }

    #[test]
    fn the_daemonset_flag_takes_namespace_and_name() {
        let r: DaemonSetRef = DEFAULT_AGENT_DAEMONSET.parse().unwrap();
        assert_eq!(
            (r.namespace.as_str(), r.name.as_str()),
            ("meshgate-system", "meshgate-agent")
        );
        assert_eq!(r.to_string(), DEFAULT_AGENT_DAEMONSET);
        assert!("mesh/agent.v2".parse::<DaemonSetRef>().is_ok());
        for bad in [
            "meshgate-agent",
            "/x",
            "x/",
            "a.b/x",
            "NS/x",
            "ns/-x",
            "ns/x/y",
            "",
        ] {
            assert!(bad.parse::<DaemonSetRef>().is_err(), "{bad:?}");
        }
    }
}
