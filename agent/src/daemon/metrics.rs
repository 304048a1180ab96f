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
}
