//! Whether a DaemonSet's pod would be placed on a Node, decided as the DaemonSet controller
//! decides it, so that the webhook gates at registration exactly the nodes the agent will run on.
//!
//! In: the DaemonSet's pod template spec (`spec.template.spec`) and a Node's name, labels and
//! taints ([`NodeView`]). Out: [`Placement`]: the pod runs there, or why it is excluded.
//!
//! The rules, from kubernetes/kubernetes (v1.35):
//! - `pkg/controller/daemon/daemon_controller.go` `NodeShouldRunDaemonPod` and `predicates`:
//!   the template's `spec.nodeName`, if set, must be the node's name; the required node
//!   affinity must match; no `NoSchedule` or `NoExecute` taint may be left untolerated.
//! - `staging/src/k8s.io/component-helpers/scheduling/corev1/nodeaffinity/nodeaffinity.go`
//!   `GetRequiredNodeAffinity`: every `nodeSelector` entry must equal the node's label; the
//!   `nodeSelectorTerms` of `requiredDuringSchedulingIgnoredDuringExecution` are ORed, the
//!   requirements of a term ANDed; a term without requirements matches nothing, and a term
//!   that does not parse (an unknown operator, a wrong number of values, a `Gt`/`Lt` bound that
//!   is not an integer) matches nothing either. `matchExpressions` read labels (`In`, `NotIn`,
//!   `Exists`, `DoesNotExist`, `Gt`, `Lt`, as apimachinery's `labels.Requirement.Matches`);
//!   `matchFields` read fields (`In`, `NotIn` with exactly one value; the only field a Node
//!   has is `metadata.name`, any other reads as empty), and are skipped for a nameless node.
//! - `pkg/controller/daemon/util/daemonset_util.go` `AddOrUpdateDaemonPodTolerations`: the
//!   controller adds to every pod the tolerations in [`controller_tolerations`].
//! - `staging/src/k8s.io/api/core/v1/toleration.go` `ToleratesTaint`: how one toleration
//!   tolerates one taint (`Lt`/`Gt` compare integer values).
//!
//! Label keys and values are not re-validated: the template comes from a DaemonSet the
//! apiserver validated. What is not modelled: the scheduler's own filters (resources, host
//! ports), which can keep a placed pod Pending but do not make the controller skip the node.
//!
//! At registration ([`placement_at_registration`]) the node is judged as it will be once its
//! kubelet reports Ready: the apiserver's `TaintNodesByCondition` admission plugin puts
//! `node.kubernetes.io/not-ready:NoSchedule` on every new Node before any webhook sees it, and
//! the node lifecycle controller lifts it (and `unreachable`) then; the DaemonSet controller
//! tolerates neither with `NoSchedule`, so judged as created every new node would be excluded.

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::api::core::v1::{
    NodeSelector, NodeSelectorRequirement, PodSpec, Taint, Toleration,
};

/// The node lifecycle taints a healthy new node loses by itself ([`placement_at_registration`]).
pub const LIFECYCLE_TAINTS: [&str; 2] = [
    "node.kubernetes.io/not-ready",
    "node.kubernetes.io/unreachable",
];

/// The one field a Node has for `matchFields`.
const NAME_FIELD: &str = "metadata.name";

/// A Node as placement reads it.
#[derive(Clone, Copy, Debug)]
pub struct NodeView<'a> {
    /// `metadata.name` (empty when not known).
    pub name: &'a str,
    /// `metadata.labels`.
    pub labels: &'a BTreeMap<String, String>,
    /// `spec.taints` (only `NoSchedule` and `NoExecute` ones matter).
    pub taints: &'a [Taint],
}

/// Whether the DaemonSet controller would place the pod on the node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Placement {
    /// It would.
    Runs,
    /// It would not, for this reason.
    Excluded(Exclusion),
}

/// Why a node gets no pod of the DaemonSet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Exclusion {
    /// The template's `spec.nodeName` names another node.
    NodeName,
    /// The node lacks the label `key` with the template's `nodeSelector` value.
    NodeSelector {
        /// The `nodeSelector` key that did not match.
        key: String,
    },
    /// No term of the required node affinity matches the node.
    NodeAffinity,
    /// A taint the pod does not tolerate, even with the controller's tolerations.
    Taint {
        /// The taint's key.
        key: String,
        /// The taint's effect (`NoSchedule` or `NoExecute`).
        effect: String,
    },
}

impl fmt::Display for Exclusion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Exclusion::NodeName => f.write_str("the pod template names another node"),
            Exclusion::NodeSelector { key } => write!(f, "nodeSelector {key} does not match"),
            Exclusion::NodeAffinity => f.write_str("no required node affinity term matches"),
            Exclusion::Taint { key, effect } => write!(f, "taint {key}:{effect} not tolerated"),
        }
    }
}

/// The tolerations the DaemonSet controller adds to every pod it creates, as (key, effect),
/// each with operator `Exists`; `node.kubernetes.io/network-unavailable` only for
/// `hostNetwork` pods.
pub fn controller_tolerations(
    host_network: bool,
) -> impl Iterator<Item = (&'static str, &'static str)> {
    [
        ("node.kubernetes.io/not-ready", "NoExecute"),
        ("node.kubernetes.io/unreachable", "NoExecute"),
        ("node.kubernetes.io/disk-pressure", "NoSchedule"),
        ("node.kubernetes.io/memory-pressure", "NoSchedule"),
        ("node.kubernetes.io/pid-pressure", "NoSchedule"),
        ("node.kubernetes.io/unschedulable", "NoSchedule"),
    ]
    .into_iter()
    .chain(host_network.then_some(("node.kubernetes.io/network-unavailable", "NoSchedule")))
}

/// Whether the DaemonSet controller would place a pod of template `spec` on `node`
/// (`NodeShouldRunDaemonPod`'s `shouldRun`).
pub fn daemon_pod_placement(spec: &PodSpec, node: &NodeView<'_>) -> Placement {
    placement(spec, node, |_| true)
}

/// [`daemon_pod_placement`] for a Node being created: its [`LIFECYCLE_TAINTS`] are left out
/// (see the module doc).
pub fn placement_at_registration(spec: &PodSpec, node: &NodeView<'_>) -> Placement {
    placement(spec, node, |t| !LIFECYCLE_TAINTS.contains(&t.key.as_str()))
}

/// The decision, over the taints `counts` keeps.
fn placement(spec: &PodSpec, node: &NodeView<'_>, counts: impl Fn(&Taint) -> bool) -> Placement {
    if spec
        .node_name
        .as_deref()
        .is_some_and(|n| !n.is_empty() && n != node.name)
    {
        return Placement::Excluded(Exclusion::NodeName);
    }
    if let Err(why) = required_affinity(spec, node) {
        return Placement::Excluded(why);
    }
    let host_network = spec.host_network.unwrap_or(false);
    let tolerations = spec.tolerations.as_deref().unwrap_or_default();
    let untolerated = node
        .taints
        .iter()
        .filter(|t| t.effect == "NoSchedule" || t.effect == "NoExecute")
        .filter(|t| counts(t))
        .find(|t| !tolerated(t, tolerations, host_network));
    match untolerated {
        Some(t) => Placement::Excluded(Exclusion::Taint {
            key: t.key.clone(),
            effect: t.effect.clone(),
        }),
        None => Placement::Runs,
    }
}

/// `nodeSelector`, then the required node affinity (`RequiredNodeAffinity.Match`).
fn required_affinity(spec: &PodSpec, node: &NodeView<'_>) -> Result<(), Exclusion> {
    for (key, value) in spec.node_selector.iter().flatten() {
        if node.labels.get(key) != Some(value) {
            return Err(Exclusion::NodeSelector { key: key.clone() });
        }
    }
    let required = spec
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|a| {
            a.required_during_scheduling_ignored_during_execution
                .as_ref()
        });
    match required {
        Some(selector) if !selector_matches(selector, node) => Err(Exclusion::NodeAffinity),
        _ => Ok(()),
    }
}

/// Terms ORed; an empty term or one that does not parse matches nothing.
fn selector_matches(selector: &NodeSelector, node: &NodeView<'_>) -> bool {
    selector.node_selector_terms.iter().any(|term| {
        let exprs = term.match_expressions.as_deref().unwrap_or_default();
        let fields = term.match_fields.as_deref().unwrap_or_default();
        if exprs.is_empty() && fields.is_empty() {
            return false;
        }
        let labels: Option<Vec<bool>> = exprs
            .iter()
            .map(|r| label_requirement(r, node.labels))
            .collect();
        let fields: Option<Vec<bool>> = fields
            .iter()
            .map(|r| field_requirement(r, node.name))
            .collect();
        match (labels, fields) {
            (Some(l), Some(f)) => {
                l.into_iter().all(|m| m) && (node.name.is_empty() || f.into_iter().all(|m| m))
            }
            _ => false,
        }
    })
}

/// One `matchExpressions` requirement on the node's labels; `None` when it does not parse.
fn label_requirement(
    r: &NodeSelectorRequirement,
    labels: &BTreeMap<String, String>,
) -> Option<bool> {
    let values = r.values.as_deref().unwrap_or_default();
    let value = labels.get(&r.key);
    Some(match r.operator.as_str() {
        "In" | "NotIn" if values.is_empty() => return None,
        "In" => value.is_some_and(|v| values.contains(v)),
        "NotIn" => value.is_none_or(|v| !values.contains(v)),
        "Exists" | "DoesNotExist" if !values.is_empty() => return None,
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        op @ ("Gt" | "Lt") => {
            let [bound] = values else { return None };
            let bound: i64 = bound.parse().ok()?;
            match value.and_then(|v| v.parse::<i64>().ok()) {
                Some(n) if op == "Gt" => n > bound,
                Some(n) => n < bound,
                None => false,
            }
        }
        _ => return None,
    })
}

/// One `matchFields` requirement on the node's fields; `None` when it does not parse.
fn field_requirement(r: &NodeSelectorRequirement, name: &str) -> Option<bool> {
    let [value] = r.values.as_deref().unwrap_or_default() else {
        return None;
    };
    let field = if r.key == NAME_FIELD { name } else { "" };
    match r.operator.as_str() {
        "In" => Some(field == value),
        "NotIn" => Some(field != value),
        _ => None,
    }
}

/// Whether the pod's own tolerations or the controller's tolerate `taint`.
fn tolerated(taint: &Taint, tolerations: &[Toleration], host_network: bool) -> bool {
    tolerations.iter().any(|t| tolerates(t, taint))
        || controller_tolerations(host_network).any(|(k, e)| k == taint.key && e == taint.effect)
}

/// `Toleration.ToleratesTaint`.
pub fn tolerates(t: &Toleration, taint: &Taint) -> bool {
    let effect = t.effect.as_deref().unwrap_or_default();
    let key = t.key.as_deref().unwrap_or_default();
    if (!effect.is_empty() && effect != taint.effect) || (!key.is_empty() && key != taint.key) {
        return false;
    }
    let value = t.value.as_deref().unwrap_or_default();
    let taint_value = taint.value.as_deref().unwrap_or_default();
    match t.operator.as_deref().unwrap_or_default() {
        "" | "Equal" => value == taint_value,
        "Exists" => true,
        op @ ("Lt" | "Gt") => match (value.parse::<i64>(), taint_value.parse::<i64>()) {
            (Ok(bound), Ok(n)) if op == "Lt" => n < bound,
            (Ok(bound), Ok(n)) => n > bound,
            _ => false,
        },
        _ => false,
    }
}

#[cfg(test)]
mod tests;
