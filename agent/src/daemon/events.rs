//! Kubernetes Events, published through one bounded helper for the node gate and the pod
//! inspector alike.
//!
//! In: an Event and the object it is about. Out: one events.k8s.io/v1 write (the Recorder
//! creates the Event, or patches its series when the same one repeats), within the API
//! timeout. An Event is a notification, not state: a failure or a timeout is logged and never
//! retried, so a retry can never publish the same transition twice, and a slow API delays the
//! caller by one timeout at most.

use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, Recorder, Reporter};

/// The controller name the agent's Events carry (`reportingController`).
pub const REPORTER: &str = "meshgate-agent";

/// Publishes Events, each within `timeout`.
#[derive(Clone)]
pub struct Events {
    recorder: Recorder,
    timeout: Duration,
}

impl Events {
    /// Events sent through `client`, reported by the agent of `node`.
    pub fn new(client: kube::Client, node: &str, timeout: Duration) -> Self {
        let reporter = Reporter {
            controller: REPORTER.into(),
            instance: Some(node.to_owned()),
        };
        Self::with_recorder(Recorder::new(client, reporter), timeout)
    }

    /// Events sent through an existing `recorder`.
    pub fn with_recorder(recorder: Recorder, timeout: Duration) -> Self {
        Self { recorder, timeout }
    }

    /// Publishes `event` about `regarding`; logs and drops it when the API fails or is slow.
    /// Returns whether the API accepted it.
    pub async fn publish(&self, event: &Event, regarding: &ObjectReference) -> bool {
        let kind = regarding.kind.as_deref().unwrap_or_default();
        let name = regarding.name.as_deref().unwrap_or_default();
        let namespace = regarding.namespace.as_deref().unwrap_or_default();
        match tokio::time::timeout(self.timeout, self.recorder.publish(event, regarding)).await {
            Ok(Ok(())) => true,
            Ok(Err(e)) => {
                tracing::warn!(kind, namespace, name, reason = %event.reason, error = %e, "publishing an Event failed");
                false
            }
            Err(_) => {
                tracing::warn!(kind, namespace, name, reason = %event.reason, timeout_ms = self.timeout.as_millis() as u64, "publishing an Event timed out");
                false
            }
        }
    }
}
