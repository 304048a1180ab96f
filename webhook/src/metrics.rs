//! The webhook's metrics.
//!
//! In: one observation per handled AdmissionReview (resource, allowed, duration), per pod
//! lookup a binding needed (its outcome), per pod the pending-pod cache left out for its
//! cap, per new Node `/mutate-node` left ungated (why), and per request body refused before a
//! review was decoded (why). Out: the counters and histogram registered in a prometheus-client `Registry`, served
//! by `meshgate_shell::admin`. Names, labels and label values are those of docs/operations.md,
//! "Metrics" (prometheus-client adds the `_total` suffix to counters); the lookup and cache
//! metrics are explained in docs/webhook.md too.

use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use meshgate_shell::mode::ModeMetrics;

/// `resource` label of `meshgate_admission_reviews_total`.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Resource {
    /// `pods` CREATE.
    Pods,
    /// `pods/binding` CREATE, and the legacy `bindings` CREATE: both bind a pod to a node
    /// and are decided alike, so the contract's two label values cover them.
    PodsBinding,
}

impl Resource {
    /// The label value (docs/operations.md, "Metrics").
    pub fn as_str(self) -> &'static str {
        match self {
            Resource::Pods => "pods",
            Resource::PodsBinding => "pods_binding",
        }
    }
}

// Hand-written because the derive would use the Rust variant names.
impl EncodeLabelValue for Resource {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        EncodeLabelValue::encode(&self.as_str(), encoder)
    }
}

/// Label set of `meshgate_admission_reviews_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReviewLabels {
    /// Which admission path.
    pub resource: Resource,
    /// `"true"` / `"false"`.
    pub allowed: &'static str,
}

/// `outcome` label of `meshgate_pod_lookups_total`: what became of a binding's pod that
/// the cache did not hold.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum LookupOutcome {
    /// Looked up and found.
    Found,
    /// Looked up: it does not exist.
    NotFound,
    /// Not looked up: the API said it does not exist a moment ago.
    KnownMissing,
    /// Not looked up: over `--pod-lookups-per-second`.
    RateLimited,
    /// Not looked up: `--max-pod-lookups-in-flight` lookups already running.
    InFlightLimit,
    /// Looked up: the API failed or did not answer within `--lookup-timeout`.
    Failed,
}

impl LookupOutcome {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            LookupOutcome::Found => "found",
            LookupOutcome::NotFound => "not_found",
            LookupOutcome::KnownMissing => "known_missing",
            LookupOutcome::RateLimited => "rate_limited",
            LookupOutcome::InFlightLimit => "in_flight_limit",
            LookupOutcome::Failed => "failed",
        }
    }
}

impl EncodeLabelValue for LookupOutcome {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        EncodeLabelValue::encode(&self.as_str(), encoder)
    }
}

/// Label set of `meshgate_pod_lookups_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LookupLabels {
    outcome: LookupOutcome,
}

/// Label set of `meshgate_node_registrations_ungated_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct UngatedLabels {
    reason: &'static str,
}

/// Label set of `meshgate_review_bodies_refused_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RefusedLabels {
    reason: &'static str,
}

/// Handles to the webhook's metrics; cheap to clone (they share the underlying atomics).
#[derive(Clone, Debug)]
pub struct Metrics {
    reviews: Family<ReviewLabels, Counter>,
    duration: Histogram,
    lookups: Family<LookupLabels, Counter>,
    overflow: Counter,
    ungated: Family<UngatedLabels, Counter>,
    refused: Family<RefusedLabels, Counter>,
    /// `meshgate_mode{mode}`, `meshgate_mode_config_invalid`,
    /// `meshgate_report_only_actions_total{action}` (shared with the agent).
    pub mode: ModeMetrics,
}

impl Metrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let mode = ModeMetrics::register(registry);
        let reviews = Family::<ReviewLabels, Counter>::default();
        registry.register(
            "meshgate_admission_reviews",
            "Pod admission reviews answered, by resource and verdict",
            reviews.clone(),
        );
        // 25 µs .. ~3.3 s: an answer from the caches takes tens of microseconds, and the slow
        // tail is the bounded API lookups (pod for a binding, node reason for a refusal).
        let duration = Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
            0.000025, 2.0, 18,
        ));
        registry.register(
            "meshgate_admission_duration_seconds",
            "Time to answer one pod admission review",
            duration.clone(),
        );
        let lookups = Family::<LookupLabels, Counter>::default();
        registry.register(
            "meshgate_pod_lookups",
            "Pods a binding named that the pending-pod cache did not hold, by outcome: looked \
             up (found, not_found, failed) or refused without a lookup (known_missing, \
             rate_limited, in_flight_limit)",
            lookups.clone(),
        );
        let overflow = Counter::default();
        registry.register(
            "meshgate_pod_cache_overflow",
            "Unscheduled pods left out of the cache because it held --max-pending-pods",
            overflow.clone(),
        );
        let ungated = Family::<UngatedLabels, Counter>::default();
        registry.register(
            "meshgate_node_registrations_ungated",
            "New Nodes /mutate-node left without the taint, by reason: not_placed (the agent \
             DaemonSet will not run there), daemonset_not_synced, daemonset_absent",
            ungated.clone(),
        );
        let refused = Family::<RefusedLabels, Counter>::default();
        registry.register(
            "meshgate_review_bodies_refused",
            "Request bodies refused before their review was decoded, by reason: too_large \
             (413), too_slow (408: not in within the body read timeout), budget_spent (503: a \
             chunked body with no room for its next chunk), unreadable (400)",
            refused.clone(),
        );
        Self {
            reviews,
            duration,
            lookups,
            overflow,
            ungated,
            refused,
            mode,
        }
    }

    /// Records one new Node left ungated, with its `reason` (`placement::Ungated::reason`).
    pub fn node_ungated(&self, reason: &'static str) {
        self.ungated.get_or_create(&UngatedLabels { reason }).inc();
    }

    /// Records one request body refused, with its `reason` (`budget::Refusal::reason`).
    pub fn body_refused(&self, reason: &'static str) {
        self.refused.get_or_create(&RefusedLabels { reason }).inc();
    }

    /// Records what became of one pod lookup.
    pub fn pod_lookup(&self, outcome: LookupOutcome) {
        self.lookups.get_or_create(&LookupLabels { outcome }).inc();
    }

    /// Records one pod the pending-pod cache left out.
    pub fn pod_cache_overflow(&self) {
        self.overflow.inc();
    }

    /// Records one answered review.
    pub fn observe(&self, resource: Resource, allowed: bool, took: Duration) {
        self.reviews
            .get_or_create(&ReviewLabels {
                resource,
                allowed: if allowed { "true" } else { "false" },
            })
            .inc();
        self.duration.observe(took.as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_labels_follow_the_contract() {
        let mut registry = Registry::default();
        let m = Metrics::register(&mut registry);
        m.observe(Resource::Pods, false, Duration::from_micros(300));
        m.observe(Resource::PodsBinding, true, Duration::from_micros(300));
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
        assert!(
            out.contains("meshgate_admission_reviews_total{resource=\"pods\",allowed=\"false\"} 1"),
            "{out}"
        );
        assert!(
            out.contains(
                "meshgate_admission_reviews_total{resource=\"pods_binding\",allowed=\"true\"} 1"
            ),
            "{out}"
        );
        assert!(
            out.contains("meshgate_admission_duration_seconds_count 2"),
            "{out}"
        );
        m.pod_lookup(LookupOutcome::RateLimited);
        m.pod_cache_overflow();
        m.node_ungated("not_placed");
        m.body_refused("too_slow");
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
        for line in [
            "meshgate_pod_lookups_total{outcome=\"rate_limited\"} 1",
            "meshgate_pod_cache_overflow_total 1",
            "meshgate_node_registrations_ungated_total{reason=\"not_placed\"} 1",
            "meshgate_review_bodies_refused_total{reason=\"too_slow\"} 1",
        ] {
            assert!(out.contains(line), "{out}");
        }
    }
}
