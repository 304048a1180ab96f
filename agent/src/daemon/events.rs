//! Kubernetes Events, published through one bounded helper for the node gate and the pod
//! inspector alike.
//!
//! In: an Event and the object it is about. Out: one events.k8s.io/v1 write (the Recorder
//! creates the Event, or patches its series when the same one repeats), within the API
//! timeout. An Event is a notification, not state: a failure or a timeout is logged and never
//! retried, so a retry can never publish the same transition twice, and a slow API delays the
//! caller by one timeout at most. [`EventQueue`] publishes them in order on a task of its own,
//! for a caller that must not wait at all.

use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, Recorder, Reporter};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::Instrument;

/// The controller name the agent's Events carry (`reportingController`): the agent's field
/// manager, under which the apiserver also records them (the Recorder names no field
/// manager; the agent's `User-Agent` does, `meshgate_shell::client`).
pub const REPORTER: &str = meshgate_core::field_manager::AGENT;

/// Who reports the agent's Events: [`REPORTER`], and the node's name as `reportingInstance`
/// (stable across the agent pod's restarts, unlike the pod's name or hostname, which kube
/// would take without it).
pub fn reporter(node: &str) -> Reporter {
    Reporter {
        controller: REPORTER.into(),
        instance: Some(node.to_owned()),
    }
}

/// Publishes Events, each within `timeout`.
#[derive(Clone)]
pub struct Events {
    recorder: Recorder,
    timeout: Duration,
}

impl Events {
    /// Events sent through `client`, reported by the agent of `node`.
    pub fn new(client: kube::Client, node: &str, timeout: Duration) -> Self {
        Self::with_recorder(Recorder::new(client, reporter(node)), timeout)
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

/// Events waiting for [`EventQueue`]'s task; a sender waits while this many are queued.
const QUEUED: usize = 16;

/// Publishes Events on a task of its own, one at a time in the order they were sent, so the
/// sender does not wait for them: the verdict loop's next pass (a re-taint right after an
/// untaint) starts without waiting for the last one's Event.
pub struct EventQueue {
    tx: mpsc::Sender<(Event, ObjectReference)>,
    task: JoinHandle<()>,
    /// Publishes inline should the task be gone.
    fallback: Events,
    /// Bounds [`EventQueue::stop`]: one API timeout for all that is queued, so Events never
    /// hold the agent's termination much longer than a request would.
    stop_within: Duration,
}

impl EventQueue {
    /// Starts the task publishing through `events`.
    pub fn start(events: Events) -> Self {
        let (tx, mut rx) = mpsc::channel::<(Event, ObjectReference)>(QUEUED);
        let stop_within = events.timeout;
        let fallback = events.clone();
        let task = tokio::spawn(
            async move {
                while let Some((event, regarding)) = rx.recv().await {
                    events.publish(&event, &regarding).await;
                }
            }
            .in_current_span(),
        );
        Self {
            tx,
            task,
            fallback,
            stop_within,
        }
    }

    /// Queues `event` about `regarding`, waiting while the queue is full. Publishes it here
    /// if the task is gone (it never ends before [`EventQueue::stop`]).
    pub async fn send(&self, event: Event, regarding: ObjectReference) {
        let sent = self.tx.send((event, regarding)).await;
        if let Err(mpsc::error::SendError((event, regarding))) = sent {
            tracing::error!("the Event publisher's task is gone; publishing inline");
            self.fallback.publish(&event, &regarding).await;
        }
    }

    /// Publishes what is queued, then ends the task; what is left after one API timeout is
    /// dropped (and logged).
    pub async fn stop(self) {
        let Self {
            tx,
            mut task,
            stop_within,
            ..
        } = self;
        // The task ends once the queue is empty and no sender is left.
        drop(tx);
        if tokio::time::timeout(stop_within, &mut task).await.is_err() {
            tracing::warn!("queued Events not published in time; dropped");
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{Request, Response};
    use kube::client::Body;
    use kube::runtime::events::EventType;
    use std::pin::pin;
    use tower_test::mock;

    fn event() -> Event {
        Event {
            type_: EventType::Warning,
            reason: "MeshRedirectMissing".into(),
            note: Some("linkerd redirects missing".into()),
            action: "Evict".into(),
            secondary: None,
        }
    }

    /// Events of node `n1` sent through the mock `svc`, each within `timeout`.
    fn events_via(svc: mock::Mock<Request<Body>, Response<Body>>, timeout: Duration) -> Events {
        Events::new(kube::Client::new(svc, "default"), "n1", timeout)
    }

    fn pod() -> ObjectReference {
        ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            namespace: Some("ns1".into()),
            name: Some("web-1".into()),
            uid: Some("uid-1".into()),
            ..ObjectReference::default()
        }
    }

    /// An API that never answers costs the caller one timeout, not a hang.
    #[tokio::test]
    async fn a_silent_api_costs_one_timeout() {
        let (svc, handle) = mock::pair::<Request<Body>, Response<Body>>();
        let events = events_via(svc, Duration::from_millis(50));
        let server = tokio::spawn(async move {
            let mut handle = pin!(handle);
            // Take the request and never answer it.
            let held = handle.next_request().await;
            std::future::pending::<()>().await;
            drop(held);
        });
        let published =
            tokio::time::timeout(Duration::from_secs(5), events.publish(&event(), &pod())).await;
        assert_eq!(
            published.ok(),
            Some(false),
            "bounded by its timeout, and reported unpublished"
        );
        server.abort();
    }

    /// A refusal is reported, not retried: exactly one request.
    #[tokio::test]
    async fn a_refused_event_is_dropped_after_one_request() {
        let (svc, handle) = mock::pair::<Request<Body>, Response<Body>>();
        let events = events_via(svc, Duration::from_secs(5));
        let server = tokio::spawn(async move {
            let mut handle = pin!(handle);
            let (req, send) = handle.next_request().await.expect("one request");
            assert_eq!(req.method(), http::Method::POST);
            assert_eq!(
                req.uri().path(),
                "/apis/events.k8s.io/v1/namespaces/ns1/events"
            );
            let status = serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                "reason": "Forbidden", "code": 403, "message": "forbidden"});
            send.send_response(
                Response::builder()
                    .status(403)
                    .body(Body::from(serde_json::to_vec(&status).unwrap()))
                    .unwrap(),
            );
            tokio::time::timeout(Duration::from_millis(100), handle.next_request())
                .await
                .is_err()
        });
        assert!(!events.publish(&event(), &pod()).await);
        assert!(server.await.unwrap(), "no second request");
    }

    /// The queue returns at once, even while the API holds the first Event; the Events reach
    /// the API one at a time, in the order they were sent; `stop` publishes what is queued.
    #[tokio::test]
    async fn the_queue_publishes_in_order_without_holding_the_sender() {
        let (svc, handle) = mock::pair::<Request<Body>, Response<Body>>();
        let events = events_via(svc, Duration::from_secs(5));
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            let mut handle = pin!(handle);
            let mut reasons = Vec::new();
            let mut released = Some(released);
            for _ in 0..3 {
                let (req, send) = handle.next_request().await.expect("an Event");
                let bytes = http_body_util::BodyExt::collect(req.into_body())
                    .await
                    .unwrap()
                    .to_bytes();
                let ev: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
                reasons.push(ev["reason"].as_str().unwrap().to_owned());
                // The first answer waits until the sender has queued everything.
                if let Some(r) = released.take() {
                    r.await.unwrap();
                }
                send.send_response(
                    Response::builder()
                        .status(201)
                        .body(Body::from(bytes.to_vec()))
                        .unwrap(),
                );
            }
            reasons
        });
        let queue = EventQueue::start(events);
        for reason in ["First", "Second", "Third"] {
            let e = Event {
                reason: reason.into(),
                ..event()
            };
            tokio::time::timeout(Duration::from_secs(1), queue.send(e, pod()))
                .await
                .expect("queued without waiting for the API");
        }
        release.send(()).unwrap();
        queue.stop().await;
        assert_eq!(server.await.unwrap(), ["First", "Second", "Third"]);
    }
}
