//! The agent's Prometheus metrics, named as in the contract.
//!
//! In: calls from the verifier, the Node reconciler and the pod inspector. Out: a
//! prometheus-client `Registry` served on `/metrics`. prometheus-client appends `_total` to
//! counters and the unit suffix to histograms registered with a unit, so names are
//! registered without those suffixes.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

/// `reason` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// A contract verification reason.
    pub reason: String,
}

/// `action` label: `added` / `removed`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActionLabel {
    /// What happened to the taint.
    pub action: String,
}

/// `profile` and `verdict` labels of `meshgate_pod_inspections_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct InspectionLabels {
    /// The mesh profile the pod was checked against.
    pub profile: String,
    /// `redirected` / `missing` / `unknown`.
    pub verdict: String,
}

/// `profile` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProfileLabel {
    /// The mesh profile.
    pub profile: String,
}

/// `why` label: `pdb` / `rate_limit` / `dry_run` / `unowned`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WhyLabel {
    /// Why the eviction did not happen.
    pub why: String,
}

/// Every agent metric.
#[derive(Clone)]
pub struct AgentMetrics {
    /// `meshgate_node_verified`: 1 while the applied verdict is Verified.
    pub node_verified: Gauge,
    /// `meshgate_verifications_total{reason}`.
    pub verifications: Family<ReasonLabel, Counter>,
    /// `meshgate_taint_transitions_total{action}`.
    pub taint_transitions: Family<ActionLabel, Counter>,
    /// `meshgate_untaint_latency_seconds`: config valid on disk → taint removal accepted.
    pub untaint_latency: Histogram,
    /// `meshgate_pod_inspections_total{profile,verdict}`.
    pub pod_inspections: Family<InspectionLabels, Counter>,
    /// `meshgate_pod_inspection_seconds`: reading one pod's netns and matching its rules.
    pub pod_inspection_seconds: Histogram,
    /// `meshgate_pods_evicted_total{profile}`.
    pub pods_evicted: Family<ProfileLabel, Counter>,
    /// `meshgate_evictions_skipped_total{why}`.
    pub evictions_skipped: Family<WhyLabel, Counter>,
}

impl AgentMetrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            node_verified: Gauge::default(),
            verifications: Family::default(),
            taint_transitions: Family::default(),
            // 1 ms .. ~16 s
            untaint_latency: Histogram::new(exponential_buckets(0.001, 2.0, 15)),
            pod_inspections: Family::default(),
            // 10 µs .. ~2.6 s: one netns is read in well under a millisecond.
            pod_inspection_seconds: Histogram::new(exponential_buckets(0.00001, 2.0, 18)),
            pods_evicted: Family::default(),
            evictions_skipped: Family::default(),
        };
        registry.register(
            "meshgate_node_verified",
            "1 while this node's CNI chain is verified and applied, else 0",
            m.node_verified.clone(),
        );
        registry.register(
            "meshgate_verifications",
            "CNI chain verifications, by verdict reason",
            m.verifications.clone(),
        );
        registry.register(
            "meshgate_taint_transitions",
            "Taint changes on this node, by action (added/removed)",
            m.taint_transitions.clone(),
        );
        registry.register_with_unit(
            "meshgate_untaint_latency",
            "Time from the config change that made the chain valid to the API accepting the taint removal",
            Unit::Seconds,
            m.untaint_latency.clone(),
        );
        registry.register(
            "meshgate_pod_inspections",
            "Meshed pod network namespaces checked, by profile and verdict (redirected/missing/unknown)",
            m.pod_inspections.clone(),
        );
        registry.register_with_unit(
            "meshgate_pod_inspection",
            "Time to read one pod network namespace's addresses and NAT rules and match them",
            Unit::Seconds,
            m.pod_inspection_seconds.clone(),
        );
        registry.register(
            "meshgate_pods_evicted",
            "Pods evicted because their redirect rules were missing, by profile",
            m.pods_evicted.clone(),
        );
        registry.register(
            "meshgate_evictions_skipped",
            "Evictions not done for a pod with missing redirects, by why (pdb/rate_limit/dry_run/unowned)",
            m.evictions_skipped.clone(),
        );
        m
    }

    /// Counts one verification.
    pub fn verified(&self, reason: &str) {
        self.verifications
            .get_or_create(&ReasonLabel {
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Counts one taint transition.
    pub fn taint(&self, added: bool) {
        let action = if added { "added" } else { "removed" };
        self.taint_transitions
            .get_or_create(&ActionLabel {
                action: action.to_string(),
            })
            .inc();
    }

    /// Counts one pod inspection for one profile.
    pub fn inspected(&self, profile: &str, verdict: &str) {
        self.pod_inspections
            .get_or_create(&InspectionLabels {
                profile: profile.to_string(),
                verdict: verdict.to_string(),
            })
            .inc();
    }

    /// Counts one eviction.
    pub fn evicted(&self, profile: &str) {
        self.pods_evicted
            .get_or_create(&ProfileLabel {
                profile: profile.to_string(),
            })
            .inc();
    }

    /// Counts one eviction not done, for a contract `why`.
    pub fn skipped(&self, why: &str) {
        self.evictions_skipped
            .get_or_create(&WhyLabel {
                why: why.to_string(),
            })
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_metrics_have_the_contract_names() {
        let mut registry = Registry::default();
        let m = AgentMetrics::register(&mut registry);
        m.inspected("linkerd", "missing");
        m.pod_inspection_seconds.observe(0.0002);
        m.evicted("linkerd");
        m.skipped("pdb");
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for sample in [
            "meshgate_pod_inspections_total{profile=\"linkerd\",verdict=\"missing\"} 1",
            "meshgate_pod_inspection_seconds_count 1",
            "meshgate_pods_evicted_total{profile=\"linkerd\"} 1",
            "meshgate_evictions_skipped_total{why=\"pdb\"} 1",
        ] {
            assert!(text.lines().any(|l| l == sample), "{sample} in\n{text}");
        }
    }
}
