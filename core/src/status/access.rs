//! What the agent's token may read, and whether the apiserver can honour the confined grants:
//! `kubectl meshgate status`'s `agent_access`.
//!
//! In: the ClusterRole `meshgate-agent` (or its absence), and the text of the apiserver's
//! `/metrics` (or nothing, when it could not be read). Out: an [`AgentAccess`]: the grants
//! (`node`: reads and evictions as its node through Constrained Impersonation; `cluster`: every
//! Pod and Node readable), the `ConstrainedImpersonation` feature gate (`on`, `off`, `unknown`),
//! and a warning when the two disagree. The chart cannot see feature gates (only the
//! apiserver's version), so this is where a mismatch shows.

use k8s_openapi::api::rbac::v1::ClusterRole;
use serde::Serialize;

/// The agent's ClusterRole, as the chart names it.
pub const CLUSTER_ROLE: &str = "meshgate-agent";
/// The feature gate of Constrained Impersonation (KEP-5284).
pub const GATE: &str = "ConstrainedImpersonation";
/// The verb only the confined ClusterRole grants: acting as the node its token is bound to.
const ACT_AS_ITS_NODE: &str = "impersonate:associated-node";
/// The apiserver's gauge of its feature gates (1 on, 0 off), one series per gate.
const FEATURE_METRIC: &str = "kubernetes_feature_enabled";

/// Which grants the agent runs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Grants {
    /// Reads and evictions as its node: its own Node and the pods bound to it, nothing else.
    Node,
    /// The cluster-wide reads: every Pod (their environment included) and every Node.
    Cluster,
    /// No ClusterRole `meshgate-agent`.
    NotInstalled,
}

impl Grants {
    /// The name `-o json` prints.
    pub fn name(self) -> &'static str {
        match self {
            Self::Node => "node",
            Self::Cluster => "cluster",
            Self::NotInstalled => "not-installed",
        }
    }
}

/// The apiserver's `ConstrainedImpersonation` feature gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Gate {
    /// On: impersonation as the associated node is honoured.
    On,
    /// Off, or a release that does not have the gate.
    Off,
    /// `/metrics` could not be read, or does not carry the feature gauge.
    Unknown,
}

impl Gate {
    /// The name `-o json` prints.
    pub fn name(self) -> &'static str {
        match self {
            Self::On => "on",
            Self::Off => "off",
            Self::Unknown => "unknown",
        }
    }
}

/// The grants, the gate, and what to do when they disagree.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct AgentAccess {
    /// The agent's grants.
    pub grants: Grants,
    /// The apiserver's gate, as its `/metrics` says.
    pub gate: Gate,
    /// Set when the grants and the gate disagree.
    pub warning: Option<String>,
}

impl AgentAccess {
    /// Confined grants on an apiserver without the gate: every read of every agent is
    /// refused, so no node can be verified.
    pub fn broken(&self) -> bool {
        self.grants == Grants::Node && self.gate == Gate::Off
    }

    /// What a stolen agent token reads, in a few words.
    pub fn reach(&self) -> &'static str {
        match self.grants {
            Grants::Node => "a stolen agent token reads only its own Node and the pods on it",
            Grants::Cluster => {
                "a stolen agent token reads every Pod (environment values included) and every Node"
            }
            Grants::NotInstalled => "no ClusterRole meshgate-agent",
        }
    }
}

/// The grants `role` gives: `node` when it lets the agent act as its node.
pub fn grants_of(role: Option<&ClusterRole>) -> Grants {
    let Some(role) = role else {
        return Grants::NotInstalled;
    };
    let confined = role
        .rules
        .iter()
        .flatten()
        .any(|r| r.verbs.iter().any(|v| v == ACT_AS_ITS_NODE));
    if confined {
        Grants::Node
    } else {
        Grants::Cluster
    }
}

/// The gate, from the apiserver's `/metrics` text: the series
/// `kubernetes_feature_enabled{name="ConstrainedImpersonation",...}`. A gauge without that
/// series is a release without the gate (off); no gauge at all is `unknown`.
pub fn gate_from_metrics(text: &str) -> Gate {
    let mut family_seen = false;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(FEATURE_METRIC) else {
            continue;
        };
        let Some((labels, value)) = rest.strip_prefix('{').and_then(|r| r.split_once('}')) else {
            continue;
        };
        family_seen = true;
        let ours = labels
            .split(',')
            .any(|l| l.trim() == format!("name=\"{GATE}\""));
        if !ours {
            continue;
        }
        let value = value.split_whitespace().next().map(str::parse::<f64>);
        return match value {
            Some(Ok(v)) => {
                if v == 1.0 {
                    Gate::On
                } else {
                    Gate::Off
                }
            }
            _ => Gate::Unknown,
        };
    }
    if family_seen {
        Gate::Off
    } else {
        Gate::Unknown
    }
}

/// The grants and the gate, with a warning where they disagree: confined grants without the
/// gate (every agent read refused), or cluster-wide grants where the gate would confine them.
pub fn assess(grants: Grants, gate: Gate) -> AgentAccess {
    let warning = match (grants, gate) {
        (Grants::Node, Gate::Off) => Some(format!(
            "the agent acts as its node (agent.impersonateNode) but the apiserver's {GATE} \
             feature gate is off: every read of the agents is refused (403) and no node can \
             be verified; turn the gate on on every kube-apiserver, or set \
             agent.impersonateNode=false"
        )),
        (Grants::Cluster, Gate::On) => Some(format!(
            "the apiserver's {GATE} feature gate is on but the agent reads with cluster-wide \
             grants: a stolen agent token reads every Pod (environment values included) and \
             every Node; confine it to its own node with agent.impersonateNode=true"
        )),
        _ => None,
    };
    AgentAccess {
        grants,
        gate,
        warning,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn role(verbs: &[&str]) -> ClusterRole {
        serde_json::from_value(json!({
            "metadata": {"name": CLUSTER_ROLE},
            "rules": [
                {"apiGroups": [""], "resources": ["nodes"], "verbs": ["patch"]},
                {"apiGroups": ["authentication.k8s.io"], "resources": ["nodes"], "verbs": verbs},
            ],
        }))
        .unwrap()
    }

    #[test]
    fn the_grants_are_read_from_the_cluster_role() {
        assert_eq!(grants_of(None), Grants::NotInstalled);
        assert_eq!(
            grants_of(Some(&role(&["impersonate:associated-node"]))),
            Grants::Node
        );
        assert_eq!(grants_of(Some(&role(&["get", "list"]))), Grants::Cluster);
        let empty: ClusterRole = serde_json::from_value(json!({"metadata": {}})).unwrap();
        assert_eq!(grants_of(Some(&empty)), Grants::Cluster);
    }

    #[test]
    fn the_gate_is_read_from_the_feature_gauge() {
        let metrics = |v: &str| {
            format!(
                "# HELP kubernetes_feature_enabled [BETA] This metric records the data about the stage and enablement of a k8s feature.\n\
                 # TYPE kubernetes_feature_enabled gauge\n\
                 kubernetes_feature_enabled{{name=\"AllAlpha\",stage=\"ALPHA\"}} 0\n\
                 kubernetes_feature_enabled{{name=\"ConstrainedImpersonationX\",stage=\"ALPHA\"}} 1\n\
                 kubernetes_feature_enabled{{name=\"ConstrainedImpersonation\",stage=\"ALPHA\"}} {v}\n\
                 apiserver_request_total{{code=\"200\"}} 5\n"
            )
        };
        assert_eq!(gate_from_metrics(&metrics("1")), Gate::On);
        assert_eq!(gate_from_metrics(&metrics("0")), Gate::Off);
        assert_eq!(gate_from_metrics(&metrics("x")), Gate::Unknown);
        // The labels in another order.
        let swapped =
            "kubernetes_feature_enabled{stage=\"BETA\",name=\"ConstrainedImpersonation\"} 1\n";
        assert_eq!(gate_from_metrics(swapped), Gate::On);
        // A release that does not know the gate lists others only: off.
        let without = "kubernetes_feature_enabled{name=\"AllAlpha\",stage=\"ALPHA\"} 0\n";
        assert_eq!(gate_from_metrics(without), Gate::Off);
        // No gauge at all (another endpoint, a filtered proxy): unknown.
        assert_eq!(
            gate_from_metrics("apiserver_request_total 1\n"),
            Gate::Unknown
        );
        assert_eq!(gate_from_metrics(""), Gate::Unknown);
    }

    #[test]
    fn a_mismatch_of_grants_and_gate_warns() {
        let confined_off = assess(Grants::Node, Gate::Off);
        assert!(confined_off.broken());
        let w = confined_off.warning.unwrap();
        assert!(w.contains("refused (403)") && w.contains("agent.impersonateNode=false"));

        let wide_on = assess(Grants::Cluster, Gate::On);
        assert!(!wide_on.broken());
        let w = wide_on.warning.unwrap();
        assert!(w.contains("every Pod") && w.contains("agent.impersonateNode=true"));

        for (grants, gate) in [
            (Grants::Node, Gate::On),
            (Grants::Node, Gate::Unknown),
            (Grants::Cluster, Gate::Off),
            (Grants::Cluster, Gate::Unknown),
            (Grants::NotInstalled, Gate::On),
            (Grants::NotInstalled, Gate::Off),
        ] {
            let a = assess(grants, gate);
            assert_eq!(a.warning, None, "{grants:?} {gate:?}");
            assert!(!a.broken(), "{grants:?} {gate:?}");
        }
    }

    #[test]
    fn the_json_names_are_stable() {
        let a = assess(Grants::NotInstalled, Gate::Unknown);
        assert_eq!(
            serde_json::to_value(&a).unwrap(),
            json!({"grants": "not-installed", "gate": "unknown", "warning": null})
        );
        for g in [Grants::Node, Grants::Cluster, Grants::NotInstalled] {
            assert_eq!(serde_json::to_value(g).unwrap(), json!(g.name()));
        }
        for g in [Gate::On, Gate::Off, Gate::Unknown] {
            assert_eq!(serde_json::to_value(g).unwrap(), json!(g.name()));
        }
    }
}
