//! Admission decisions: may this pod land on this node?
//!
//! In: what is being admitted (a Pod created with `spec.nodeName` set, or a `pods/binding`),
//! the pod's labels and annotations (or why they could not be looked up: not found, lookups
//! throttled, the API failing), its namespace's labels
//! (or "unknown to the cache"), the target node's labels (or "unknown to the cache"), the node's `MeshCNIVerified` condition reason when known, and
//! the [`ProfileSet`]. Out: [`Decision::Allow`] or [`Decision::Refuse`] with a message that
//! names the node, the reason when known, and the remedy. The message is shown verbatim to the
//! client (`kubectl`, the scheduler's event), so it is written for an operator.
//!
//! The JSON Patch that gates a new Node is the node gate's (`crate::gate`).
//!
//! No I/O: the webhook crate feeds this from its caches and the AdmissionReview.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::gate::{CONDITION_TYPE, TaintKey, VERIFIED_LABEL};
use crate::profile::{PodView, ProfileSet, Selected};

pub mod affinity;
pub mod cel;

/// Which admission path the request came through. It changes only the remedy: a pod created
/// with `spec.nodeName` chose its node itself, a binding is the scheduler's choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestKind {
    /// `pods` CREATE with `spec.nodeName` already set: it never goes through the scheduler.
    PodCreate,
    /// `pods/binding` CREATE: the scheduler (or anyone) binding a pending pod to a node.
    Binding,
}

/// Why the pod a binding names is not known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LookupFailure {
    /// Neither the cache nor the API has it (the API said so, now or a few seconds ago).
    NotFound,
    /// Not looked up: the webhook's pod lookups are at their limit (a flood of bindings
    /// naming pods it does not cache), so the API is spared.
    Throttled,
    /// The API did not answer in time, or failed.
    Failed,
}

/// What is known about the pod being placed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodFacts<'a> {
    /// The pod's labels and annotations.
    Known {
        /// `metadata.labels`.
        labels: &'a BTreeMap<String, String>,
        /// `metadata.annotations`.
        annotations: &'a BTreeMap<String, String>,
    },
    /// A binding whose pod was neither in the cache nor returned by the API, and why.
    Unknown(LookupFailure),
}

/// What is known about the target node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeFacts<'a> {
    /// The node is in the cache with these labels.
    Known {
        /// `metadata.labels`.
        labels: &'a BTreeMap<String, String>,
    },
    /// The node is not in the cache: not registered yet, or registered a moment ago.
    Unknown,
}

/// Everything the decision needs.
#[derive(Clone, Copy, Debug)]
pub struct Input<'a> {
    /// Admission path.
    pub kind: RequestKind,
    /// Pod namespace (for the message).
    pub namespace: &'a str,
    /// Pod name, or its `generateName` prefix when the name is not assigned yet.
    pub pod_name: &'a str,
    /// Pod labels and annotations.
    pub pod: PodFacts<'a>,
    /// The labels of the pod's Namespace, `None` when the caller's cache does not have it.
    /// Only profiles that select on namespace labels (`istio-ambient`) read them; when one
    /// of those might select the pod and the labels are unknown, the pod counts as meshed
    /// (fail closed, as for a pod that could not be looked up).
    pub namespace_labels: Option<&'a BTreeMap<String, String>>,
    /// Target node name (`spec.nodeName` or the Binding's `target.name`).
    pub node_name: &'a str,
    /// Target node labels.
    pub node: NodeFacts<'a>,
    /// The node's `MeshCNIVerified` condition reason, when the caller could read it.
    pub node_reason: Option<&'a str>,
    /// meshgate's taint key (`--taint-key`), named in a binding's remedy.
    pub taint_key: &'a TaintKey,
}

/// Why a request was allowed (for logs and tests; the apiserver only sees "allowed").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllowReason {
    /// The node is labelled `meshgate.io/cni-verified=true`.
    NodeVerified,
    /// No mesh profile selects the pod.
    NotMeshed,
}

/// The admission verdict.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Let the request through.
    Allow(AllowReason),
    /// Refuse it; the message is shown to the client.
    Refuse {
        /// Names the node, its state and reason when known, and the remedy.
        message: String,
    },
}

impl Decision {
    /// True for [`Decision::Allow`].
    pub fn is_allowed(&self) -> bool {
        matches!(self, Decision::Allow(_))
    }
}

/// True when the node's labels say the meshgate agent verified its CNI chain.
pub fn node_is_verified(labels: &BTreeMap<String, String>) -> bool {
    labels.get(VERIFIED_LABEL).map(String::as_str) == Some("true")
}

/// The rules that let a placement through, in order: the first that allows it decides, and
/// a placement no rule allows is refused with [`refusal_message`]. A new admission rule is
/// one function below and one entry here (with its [`AllowReason`]).
const ALLOW_RULES: [AllowRule; 2] = [node_verified, not_meshed];

/// One admission rule: `Some(why)` when it allows the placement.
type AllowRule = fn(&Input<'_>, &[Mesh<'_>]) -> Option<AllowReason>;

/// A verified node admits every pod.
fn node_verified(input: &Input<'_>, _: &[Mesh<'_>]) -> Option<AllowReason> {
    match input.node {
        NodeFacts::Known { labels } if node_is_verified(labels) => Some(AllowReason::NodeVerified),
        _ => None,
    }
}

/// A pod known to belong to no mesh may land anywhere. A pod that could not be looked up is
/// not known to be unmeshed: on an unverified node it is refused (fail closed), and the
/// scheduler retries the binding.
fn not_meshed(input: &Input<'_>, meshes: &[Mesh<'_>]) -> Option<AllowReason> {
    (meshes.is_empty() && matches!(input.pod, PodFacts::Known { .. }))
        .then_some(AllowReason::NotMeshed)
}

/// Decides one pod placement by the allow rules (`ALLOW_RULES`, in order).
pub fn decide(input: &Input<'_>, profiles: &ProfileSet) -> Decision {
    let meshes = selecting_meshes(input, profiles);
    if let Some(why) = ALLOW_RULES.iter().find_map(|rule| rule(input, &meshes)) {
        return Decision::Allow(why);
    }
    Decision::Refuse {
        message: refusal_message(input, &meshes),
    }
}

/// The profiles that select (or may select) the pod; none when the pod is not known.
fn selecting_meshes<'a>(input: &Input<'a>, profiles: &'a ProfileSet) -> Vec<Mesh<'a>> {
    let PodFacts::Known {
        labels,
        annotations,
    } = input.pod
    else {
        return Vec::new();
    };
    let view = PodView {
        labels,
        annotations,
        namespace_labels: input.namespace_labels,
    };
    profiles
        .selection(view)
        .map(|(p, s)| Mesh {
            name: p.name.as_str(),
            plugin: p.plugin_type.as_str(),
            certain: s == Selected::Yes,
        })
        .collect()
}

/// A profile that selects (or, its namespace's labels unknown, may select) the pod.
struct Mesh<'a> {
    name: &'a str,
    plugin: &'a str,
    certain: bool,
}

/// The remedy's middle, after the node's `describe` hint: the same in the apiserver's own
/// policy ([`cel`]).
fn remedy_then() -> String {
    format!("; the meshgate agent then labels it {VERIFIED_LABEL}=true. Meanwhile ")
}
/// The remedy's end for a pod created with `spec.nodeName`.
const CREATE_MEANWHILE: &str =
    "create the pod without spec.nodeName so the scheduler can choose a verified node.";

/// What the client reads: who the pod is, what the node's state is, and the remedy.
fn refusal_message(input: &Input<'_>, meshes: &[Mesh<'_>]) -> String {
    let mut m = String::with_capacity(512);
    let _ = write!(m, "meshgate: pod {}/{} ", input.namespace, input.pod_name);
    write_pod_part(&mut m, input, meshes);
    write_node_part(&mut m, input);
    write_remedy(&mut m, input, meshes);
    m
}

/// Why the pod counts as meshed.
fn write_pod_part(m: &mut String, input: &Input<'_>, meshes: &[Mesh<'_>]) {
    if let PodFacts::Unknown(why) = input.pod {
        m.push_str(match why {
            LookupFailure::NotFound => {
                "was not found (neither in the webhook's cache nor in the API), so no mesh can \
                 be ruled out, and"
            }
            LookupFailure::Throttled => {
                "was not looked up: the webhook's pod lookups are at their limit (many bindings \
                 name pods it has not cached), so no mesh can be ruled out, and"
            }
            LookupFailure::Failed => {
                "could not be looked up to tell whether a mesh selects it, and"
            }
        });
    } else if meshes.iter().all(|x| !x.certain) {
        let names: Vec<&str> = meshes.iter().map(|x| x.name).collect();
        let _ = write!(
            m,
            "may belong to mesh profile {} (the labels of namespace {} are not known yet), and",
            names.join(", "),
            input.namespace
        );
    } else {
        let names: Vec<&str> = meshes
            .iter()
            .filter(|x| x.certain)
            .map(|x| x.name)
            .collect();
        let _ = write!(m, "belongs to mesh profile {}, but", names.join(", "));
    }
}

/// The node's state: not known, not labelled, or labelled unverified, and its reason.
fn write_node_part(m: &mut String, input: &Input<'_>) {
    let _ = write!(
        m,
        " node {} is not verified for the mesh CNI chain: ",
        input.node_name
    );
    match input.node {
        NodeFacts::Unknown => {
            m.push_str("the node is not known yet (not registered, or registered a moment ago)")
        }
        NodeFacts::Known { labels } => match labels.get(VERIFIED_LABEL) {
            None => {
                let _ = write!(
                    m,
                    "it has no {VERIFIED_LABEL} label (the meshgate agent has not verified it yet)"
                );
            }
            Some(v) => {
                let _ = write!(m, "it is labelled {VERIFIED_LABEL}={v:?}");
            }
        },
    }
    match input.node_reason {
        Some(r) if !r.is_empty() => {
            let _ = write!(m, "; condition {CONDITION_TYPE} reason {r}");
        }
        _ => {}
    }
}

/// What to fix on the node, and what to do meanwhile for this admission path.
fn write_remedy(m: &mut String, input: &Input<'_>, meshes: &[Mesh<'_>]) {
    let node = input.node_name;
    m.push_str(". Remedy: ");
    if meshes.is_empty() {
        m.push_str("retry; ");
    }
    let mut plugins: Vec<&str> = meshes.iter().map(|x| x.plugin).collect();
    plugins.sort_unstable();
    plugins.dedup();
    if plugins.is_empty() {
        let _ = write!(m, "fix the CNI chain on node {node}");
    } else {
        let _ = write!(
            m,
            "fix the CNI chain on node {node} so it chains {}",
            plugins.join(", ")
        );
    }
    let _ = write!(
        m,
        " (kubectl describe node {node}: condition {CONDITION_TYPE}){}",
        remedy_then()
    );
    match input.kind {
        RequestKind::PodCreate => m.push_str(CREATE_MEANWHILE),
        RequestKind::Binding => {
            let _ = write!(
                m,
                "do not let the pod tolerate the {} taint, so the scheduler avoids \
                 unverified nodes.",
                input.taint_key
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    struct Case {
        pod_labels: BTreeMap<String, String>,
        pod_annotations: BTreeMap<String, String>,
        namespace_labels: Option<BTreeMap<String, String>>,
        node_labels: Option<BTreeMap<String, String>>,
    }

    impl Case {
        fn decide(&self, kind: RequestKind, reason: Option<&str>) -> Decision {
            self.decide_with(kind, reason, &TaintKey::default())
        }

        fn decide_with(&self, kind: RequestKind, reason: Option<&str>, key: &TaintKey) -> Decision {
            let input = Input {
                kind,
                namespace: "shop",
                pod_name: "web-0",
                pod: PodFacts::Known {
                    labels: &self.pod_labels,
                    annotations: &self.pod_annotations,
                },
                namespace_labels: self.namespace_labels.as_ref(),
                node_name: "node-a",
                node: match &self.node_labels {
                    Some(labels) => NodeFacts::Known { labels },
                    None => NodeFacts::Unknown,
                },
                node_reason: reason,
                taint_key: key,
            };
            decide(&input, &ProfileSet::all_builtin())
        }
    }

    fn linkerd_pod(node_labels: Option<BTreeMap<String, String>>) -> Case {
        Case {
            pod_labels: map(&[("linkerd.io/control-plane-ns", "linkerd"), ("app", "web")]),
            pod_annotations: BTreeMap::new(),
            namespace_labels: Some(BTreeMap::new()),
            node_labels,
        }
    }

    fn message(d: Decision) -> String {
        match d {
            Decision::Refuse { message } => message,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn mesh_pod_on_verified_node_is_allowed() {
        let c = linkerd_pod(Some(map(&[(VERIFIED_LABEL, "true")])));
        assert_eq!(
            c.decide(RequestKind::PodCreate, None),
            Decision::Allow(AllowReason::NodeVerified)
        );
        assert!(c.decide(RequestKind::Binding, None).is_allowed());
    }

    #[test]
    fn mesh_pod_on_unverified_node_is_refused_with_node_reason_and_remedy() {
        let c = linkerd_pod(Some(map(&[(VERIFIED_LABEL, "false")])));
        let m = message(c.decide(RequestKind::PodCreate, Some("ChainedPluginMissing")));
        assert!(m.contains("pod shop/web-0"), "{m}");
        assert!(m.contains("mesh profile linkerd"), "{m}");
        assert!(m.contains("node node-a"), "{m}");
        assert!(m.contains("meshgate.io/cni-verified=\"false\""), "{m}");
        assert!(
            m.contains("condition MeshCNIVerified reason ChainedPluginMissing"),
            "{m}"
        );
        assert!(
            m.contains("Remedy: fix the CNI chain on node node-a"),
            "{m}"
        );
        assert!(m.contains("chains linkerd-cni"), "{m}");
        assert!(m.contains("without spec.nodeName"), "{m}");
    }

    #[test]
    fn reason_is_omitted_when_unknown() {
        let c = linkerd_pod(Some(map(&[(VERIFIED_LABEL, "false")])));
        let m = message(c.decide(RequestKind::PodCreate, None));
        assert!(!m.contains("reason"), "{m}");
        let m = message(c.decide(RequestKind::PodCreate, Some("")));
        assert!(!m.contains("condition MeshCNIVerified reason"), "{m}");
    }

    #[test]
    fn node_without_label_or_with_odd_value_is_unverified() {
        let c = linkerd_pod(Some(map(&[("kubernetes.io/os", "linux")])));
        let m = message(c.decide(RequestKind::PodCreate, None));
        assert!(m.contains("has no meshgate.io/cni-verified label"), "{m}");

        // Only the exact value "true" verifies: "True" or "yes" are not the agent's writing.
        let c = linkerd_pod(Some(map(&[(VERIFIED_LABEL, "True")])));
        let m = message(c.decide(RequestKind::PodCreate, None));
        assert!(
            m.contains("labelled meshgate.io/cni-verified=\"True\""),
            "{m}"
        );
    }

    #[test]
    fn mesh_pod_on_unknown_node_is_refused() {
        let c = linkerd_pod(None);
        let m = message(c.decide(RequestKind::PodCreate, None));
        assert!(m.contains("node node-a is not verified"), "{m}");
        assert!(m.contains("not known yet"), "{m}");
    }

    #[test]
    fn non_mesh_pod_is_allowed_everywhere() {
        for node in [
            None,
            Some(map(&[(VERIFIED_LABEL, "false")])),
            Some(BTreeMap::new()),
        ] {
            let c = Case {
                pod_labels: map(&[("app", "batch"), ("security.istio.io/tlsMode", "disabled")]),
                pod_annotations: map(&[("ambient.istio.io/redirection", "disabled")]),
                namespace_labels: Some(map(&[("kubernetes.io/metadata.name", "shop")])),
                node_labels: node,
            };
            for kind in [RequestKind::PodCreate, RequestKind::Binding] {
                assert_eq!(
                    c.decide(kind, Some("NoConfig")),
                    Decision::Allow(AllowReason::NotMeshed)
                );
            }
        }
    }

    #[test]
    fn istio_and_ambient_pods_are_selected_too() {
        let unverified = Some(map(&[(VERIFIED_LABEL, "false")]));
        let istio = Case {
            pod_labels: map(&[("security.istio.io/tlsMode", "istio")]),
            pod_annotations: map(&[("sidecar.istio.io/status", "{}")]),
            namespace_labels: Some(BTreeMap::new()),
            node_labels: unverified.clone(),
        };
        let m = message(istio.decide(RequestKind::PodCreate, None));
        assert!(
            m.contains("mesh profile istio,") && m.contains("istio-cni"),
            "{m}"
        );

        // An ambient pod is known by its namespace's label before istio-cni ever ran (the
        // redirection annotation comes only after a successful setup).
        let ambient = Case {
            pod_labels: map(&[("app", "web")]),
            pod_annotations: BTreeMap::new(),
            namespace_labels: Some(map(&[("istio.io/dataplane-mode", "ambient")])),
            node_labels: unverified.clone(),
        };
        let m = message(ambient.decide(RequestKind::Binding, None));
        assert!(m.contains("belongs to mesh profile istio-ambient"), "{m}");
        assert!(m.contains("chains istio-cni"), "{m}");

        // The pod opted out of its ambient namespace: not meshed.
        let opted_out = Case {
            pod_labels: map(&[("istio.io/dataplane-mode", "none")]),
            ..ambient
        };
        assert_eq!(
            opted_out.decide(RequestKind::PodCreate, None),
            Decision::Allow(AllowReason::NotMeshed)
        );
    }

    #[test]
    fn unknown_namespace_labels_fail_closed_only_where_they_matter() {
        let unverified = Some(map(&[(VERIFIED_LABEL, "false")]));
        let unknown_ns = Case {
            pod_labels: map(&[("app", "web")]),
            pod_annotations: BTreeMap::new(),
            namespace_labels: None,
            node_labels: unverified.clone(),
        };
        let m = message(unknown_ns.decide(RequestKind::Binding, None));
        assert!(
            m.contains("may belong to mesh profile istio-ambient (the labels of namespace shop are not known yet)"),
            "{m}"
        );
        // A pod with a sidecar is never ambient: its namespace does not matter.
        let sidecar = Case {
            pod_annotations: map(&[("sidecar.istio.io/status", "{}")]),
            ..unknown_ns
        };
        assert_eq!(
            sidecar.decide(RequestKind::PodCreate, None),
            Decision::Allow(AllowReason::NotMeshed)
        );
        // Without a namespace-reading profile, the unknown namespace changes nothing.
        let c = Case {
            pod_labels: map(&[("app", "web")]),
            pod_annotations: BTreeMap::new(),
            namespace_labels: None,
            node_labels: unverified,
        };
        let input = Input {
            kind: RequestKind::PodCreate,
            namespace: "shop",
            pod_name: "web-0",
            pod: PodFacts::Known {
                labels: &c.pod_labels,
                annotations: &c.pod_annotations,
            },
            namespace_labels: None,
            node_name: "node-a",
            node: NodeFacts::Unknown,
            node_reason: None,
            taint_key: &TaintKey::default(),
        };
        let sidecars = ProfileSet::all_builtin()
            .select(&["linkerd".into(), "istio".into()])
            .unwrap();
        assert_eq!(
            decide(&input, &sidecars),
            Decision::Allow(AllowReason::NotMeshed)
        );
    }

    #[test]
    fn binding_of_mesh_pod_to_unverified_node_is_refused_with_scheduler_remedy() {
        let c = linkerd_pod(Some(map(&[(VERIFIED_LABEL, "false")])));
        let m = message(c.decide(RequestKind::Binding, Some("PluginBinaryBroken")));
        assert!(m.contains("node node-a"), "{m}");
        assert!(m.contains("PluginBinaryBroken"), "{m}");
        assert!(
            m.contains(
                "do not let the pod tolerate the readiness.k8s.io/meshgate-cni-unverified taint"
            ),
            "{m}"
        );
    }

    #[test]
    fn a_binding_remedy_names_the_configured_taint_key() {
        let c = linkerd_pod(Some(map(&[(VERIFIED_LABEL, "false")])));
        let key: TaintKey = "example.com/mesh-not-ready".parse().unwrap();
        let m = message(c.decide_with(RequestKind::Binding, None, &key));
        assert!(
            m.contains("do not let the pod tolerate the example.com/mesh-not-ready taint"),
            "{m}"
        );
    }

    #[test]
    fn binding_of_unknown_pod_fails_closed_only_on_unverified_nodes() {
        let labels = map(&[(VERIFIED_LABEL, "false")]);
        let verified = map(&[(VERIFIED_LABEL, "true")]);
        let profiles = ProfileSet::all_builtin();
        for (why, says) in [
            (LookupFailure::Failed, "could not be looked up"),
            (LookupFailure::NotFound, "was not found"),
            (LookupFailure::Throttled, "pod lookups are at their limit"),
        ] {
            let mut input = Input {
                kind: RequestKind::Binding,
                namespace: "shop",
                pod_name: "web-0",
                pod: PodFacts::Unknown(why),
                namespace_labels: None,
                node_name: "node-a",
                node: NodeFacts::Known { labels: &labels },
                node_reason: None,
                taint_key: &TaintKey::default(),
            };
            let m = message(decide(&input, &profiles));
            assert!(m.starts_with("meshgate: pod shop/web-0 "), "{m}");
            assert!(m.contains(says), "{m}");
            assert!(m.contains("node node-a is not verified"), "{m}");
            assert!(m.contains("Remedy: retry"), "{m}");

            input.node = NodeFacts::Known { labels: &verified };
            assert_eq!(
                decide(&input, &profiles),
                Decision::Allow(AllowReason::NodeVerified)
            );
        }
    }

    #[test]
    fn only_the_selected_profiles_count() {
        let c = linkerd_pod(Some(map(&[(VERIFIED_LABEL, "false")])));
        let istio_only = ProfileSet::all_builtin().select(&["istio".into()]).unwrap();
        let input = Input {
            kind: RequestKind::PodCreate,
            namespace: "shop",
            pod_name: "web-0",
            pod: PodFacts::Known {
                labels: &c.pod_labels,
                annotations: &c.pod_annotations,
            },
            namespace_labels: None,
            node_name: "node-a",
            node: NodeFacts::Known {
                labels: c.node_labels.as_ref().unwrap(),
            },
            node_reason: None,
            taint_key: &TaintKey::default(),
        };
        assert_eq!(
            decide(&input, &istio_only),
            Decision::Allow(AllowReason::NotMeshed)
        );
    }
}
