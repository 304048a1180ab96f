//! The webhook's contract metrics.
//!
//! In: one observation per handled AdmissionReview (resource, allowed, duration). Out: the
//! counters and histogram registered in a prometheus-client `Registry`, served by
//! [`crate::admin`]. Names follow `shared/design/contract.md` exactly (prometheus-client adds
//! the `_total` suffix to counters).

use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

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
    /// The label value from the contract.
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

/// Handles to the webhook's metrics; cheap to clone (they share the underlying atomics).
#[derive(Clone, Debug)]
pub struct Metrics {
    reviews: Family<ReviewLabels, Counter>,
    duration: Histogram,
}

impl Metrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
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
        Self { reviews, duration }
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
    }
}
