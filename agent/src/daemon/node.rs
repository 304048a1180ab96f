//! Keeps the agent's own Node in step with the chain verdict: taint, label, condition, Events.
//!
//! In: the latest verdict, the live mode and the latest Node seen by the Node watch. Out: the
//! smallest set of writes that makes the Node say what the verdict says, as far as the mode
//! lets meshgate write (`report`: meshgate's taint only removed; `condition-only`: no taint
//! touched), and what changed ([`Applied`]).
//!
//! What to write is planned in `meshgate_core::gate` (pure); [`NodeGate`] carries it out:
//! - Taint and label go in one JSON patch guarded by a `test` of `metadata.resourceVersion`,
//!   so a concurrent writer's taints are never overwritten: on conflict the Node is re-read
//!   and the patch recomputed (bounded). Taints other than meshgate's are kept as they are.
//!   Not server-side apply: `spec.taints` is an atomic list, which an apply would own whole
//!   (docs/architecture.md, "Field managers: which write is server-side apply").
//! - The condition goes through the `nodes/status` subresource as a server-side apply of its
//!   one entry (conditions are a map keyed by `type`, so meshgate owns `MeshCNIVerified` and no
//!   other), and its `lastTransitionTime` moves only when its status does.
//! - Every write carries the field manager `meshgate-agent` (`core::field_manager::AGENT`).
//! - Events are published only when the condition's status or reason changes, after the
//!   condition is written: a restart then finds the condition already current and publishes
//!   nothing, so one transition never yields two Events. A `CNIChainVerified` Event of a
//!   reconcile that removed the taint carries the untaint latency in its note
//!   (`gate::NodeEvent::with_untaint_latency`), measured from [`NodeGate::measure_from`].
//!   [`NodeGate::reconcile_deferring_event`] returns that Event instead of publishing it, for
//!   a caller that publishes it off its own path (the verdict loop's `EventQueue`).

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, NodeCondition, ObjectReference};
use k8s_openapi::jiff::Timestamp;
use kube::Resource;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder};
use meshgate_core::cni::ChainVerdict;
use meshgate_core::field_manager;
use meshgate_core::gate::{self, MetadataPlan, NodeEvent};
use meshgate_core::mode::Mode;
use serde_json::json;

use super::events::Events;

/// `--taint-key` and `--taint-effect` values; [`NodeGate::new`] takes one of each.
pub use meshgate_core::gate::{TaintEffect, TaintKey};

/// Conflicting writers are retried this many times before the reconcile is reported failed
/// (and retried later with backoff).
const MAX_CONFLICT_RETRIES: usize = 8;

/// Why a reconcile failed. The caller retries with backoff; nothing is assumed meanwhile.
#[derive(Debug, thiserror::Error)]
pub enum GateError {
    /// The API server answered with an error.
    #[error("{op} failed: {source}")]
    Api {
        /// What was being done.
        op: &'static str,
        /// The client error.
        #[source]
        source: kube::Error,
    },
    /// The API server did not answer in time.
    #[error("{op} timed out after {after:?}")]
    Timeout {
        /// What was being done.
        op: &'static str,
        /// The deadline.
        after: Duration,
    },
    /// Other writers kept changing the Node between our read and our write.
    #[error("the Node kept changing under {MAX_CONFLICT_RETRIES} read-modify-write attempts")]
    Conflicts,
    /// The Node does not exist (yet, or any more).
    #[error("Node {0} not found")]
    NodeNotFound(String),
}

/// What a successful reconcile changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    /// `Some(true)` when the taint was added, `Some(false)` when removed.
    pub taint: Option<bool>,
    /// When the API accepted the taint change (the end of the untaint-latency measurement,
    /// before the condition and Event writes that follow it).
    pub taint_at: Option<Instant>,
    /// From [`NodeGate::measure_from`] to `taint_at`, when this reconcile removed the taint.
    pub untaint_latency: Option<Duration>,
    /// The label value written, if it changed.
    pub label: Option<&'static str>,
    /// True when the condition was written.
    pub condition: bool,
    /// The reason of the Event the transition publishes, if any.
    pub event: Option<&'static str>,
}

/// A transition's Event, planned by a reconcile and published after it.
pub struct PendingEvent {
    /// The Event.
    pub event: Event,
    /// The Node it is about.
    pub regarding: ObjectReference,
}

/// The Node as last read, and whether it came from the API just now (a GET or a patch
/// response) rather than the watch cache.
struct Seen {
    node: Node,
    fresh: bool,
}

fn is_conflict(e: &kube::Error) -> bool {
    // A failed JSON-patch `test` is 422 (older servers: 409 or 500 with "testing value").
    matches!(e, kube::Error::Api(s) if s.code == 409 || s.code == 422)
}

/// The server-side apply of the agent's condition: forced, as a controller's apply is, so
/// that it takes over the entry's fields from whoever wrote them last (an earlier agent's
/// strategic merge, a hand edit) instead of failing on their ownership. It conflicts with no
/// one else's condition: each entry of the list is owned on its own.
fn apply_params() -> PatchParams {
    PatchParams::apply(field_manager::AGENT).force()
}

/// The apply configuration of Node `name`'s `status.conditions`: the agent's one entry,
/// whole (every field it sets, each time, so none it owns is dropped).
fn condition_apply(name: &str, condition: NodeCondition) -> Patch<serde_json::Value> {
    Patch::Apply(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name},
        "status": {"conditions": [condition]},
    }))
}

/// The kube Event for a planned Node Event.
fn to_event(planned: NodeEvent) -> Event {
    Event {
        type_: if planned.warning {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason: planned.reason.to_string(),
        note: Some(planned.note),
        action: planned.action.to_string(),
        secondary: None,
    }
}

/// The agent's handle on its own Node: carries out `core::gate`'s plans.
pub struct NodeGate {
    /// Writes: the taint-and-label patch and the condition.
    api: Api<Node>,
    /// Reads (a GET when the watch has nothing, or after a conflict); `api` unless
    /// [`NodeGate::reading_as`] gave it another identity.
    reader: Api<Node>,
    name: String,
    key: TaintKey,
    effect: TaintEffect,
    timeout: Duration,
    events: Events,
    /// The start of the untaint-latency measurement (the last config change).
    measure_from: Option<Instant>,
}

impl NodeGate {
    /// A gate for Node `name` with the taint `key` and `effect`, bounding each API call (and
    /// each Event) by `timeout`. Taints under the keys `key` supersedes are removed.
    pub fn new(
        client: kube::Client,
        name: String,
        key: TaintKey,
        effect: TaintEffect,
        timeout: Duration,
        recorder: Recorder,
    ) -> Self {
        let api = Api::all(client);
        Self {
            reader: api.clone(),
            api,
            name,
            key,
            effect,
            timeout,
            events: Events::with_recorder(recorder, timeout),
            measure_from: None,
        }
    }

    /// Reads the Node through `client` (the node's own identity with `--impersonate-node`);
    /// writes stay with the client given to [`NodeGate::new`].
    #[must_use]
    pub fn reading_as(mut self, client: kube::Client) -> Self {
        self.reader = Api::all(client);
        self
    }

    /// Measures the next untaint from `at` (when the disk last changed): the latency lands in
    /// [`Applied::untaint_latency`] and in the `CNIChainVerified` Event's note.
    pub fn measure_from(&mut self, at: Instant) {
        self.measure_from = Some(at);
    }

    async fn call<T>(
        &self,
        op: &'static str,
        f: impl std::future::Future<Output = kube::Result<T>>,
    ) -> Result<T, GateError> {
        match tokio::time::timeout(self.timeout, f).await {
            Err(_) => Err(GateError::Timeout {
                op,
                after: self.timeout,
            }),
            Ok(Err(kube::Error::Api(s))) if s.code == 404 => {
                Err(GateError::NodeNotFound(self.name.clone()))
            }
            Ok(Err(source)) => Err(GateError::Api { op, source }),
            Ok(Ok(v)) => Ok(v),
        }
    }

    /// Reads the Node from the API (used when the watch cache is empty or stale).
    pub async fn get(&self) -> Result<Node, GateError> {
        self.call("get node", self.reader.get(&self.name)).await
    }

    /// Makes the Node say what `verdict` says, as `mode` allows. `seen` is the latest Node
    /// from the watch, if any; on a resourceVersion conflict the Node is re-read.
    pub async fn reconcile(
        &self,
        seen: Option<Node>,
        verdict: &ChainVerdict,
        mode: Mode,
    ) -> Result<Applied, GateError> {
        let (applied, event) = self.reconcile_deferring_event(seen, verdict, mode).await?;
        if let Some(e) = event {
            self.events.publish(&e.event, &e.regarding).await;
        }
        Ok(applied)
    }

    /// [`NodeGate::reconcile`] without publishing the transition's Event: it is returned, to
    /// be published once this returns (its condition is written by then).
    pub async fn reconcile_deferring_event(
        &self,
        seen: Option<Node>,
        verdict: &ChainVerdict,
        mode: Mode,
    ) -> Result<(Applied, Option<PendingEvent>), GateError> {
        let seen = match seen {
            Some(node) => Seen { node, fresh: false },
            None => Seen {
                node: self.get().await?,
                fresh: true,
            },
        };
        let mut applied = Applied::default();
        let seen = self
            .write_metadata(seen, verdict, mode, &mut applied)
            .await?;
        let event = self
            .write_condition(seen, verdict, mode, &mut applied)
            .await?;
        Ok((applied, event))
    }

    /// The Events' publisher (a clone), for publishing deferred Events in order elsewhere.
    pub fn events(&self) -> Events {
        self.events.clone()
    }

    /// Writes the taint and label, re-planning from a fresh read after each conflict.
    async fn write_metadata(
        &self,
        mut seen: Seen,
        verdict: &ChainVerdict,
        mode: Mode,
        applied: &mut Applied,
    ) -> Result<Seen, GateError> {
        let mut attempts = 0;
        loop {
            let (verified, policy, now) = (verdict.verified, mode.taints(), Timestamp::now());
            let planned =
                gate::plan_metadata(&seen.node, verified, &self.key, self.effect, policy, now);
            let Some(plan) = planned else {
                return Ok(seen);
            };
            match self.patch_metadata(&plan).await {
                Ok(updated) => {
                    if let Some(taints) = &plan.taints {
                        let at = Instant::now();
                        let tainted = taints.iter().any(|t| t.key == self.key.as_str());
                        applied.taint = Some(tainted);
                        applied.taint_at = Some(at);
                        applied.untaint_latency = (verdict.verified && !tainted)
                            .then(|| self.measure_from.map(|m| at.saturating_duration_since(m)))
                            .flatten();
                    }
                    applied.label = plan.label;
                    return Ok(Seen {
                        node: updated,
                        fresh: true,
                    });
                }
                Err(GateError::Api { source, .. }) if is_conflict(&source) => {
                    attempts += 1;
                    if attempts >= MAX_CONFLICT_RETRIES {
                        return Err(GateError::Conflicts);
                    }
                    tracing::debug!(attempts, "node changed under us; re-reading");
                    seen = Seen {
                        node: self.get().await?,
                        fresh: true,
                    };
                }
                Err(e) => return Err(e),
            }
        }
    }

    async fn patch_metadata(&self, plan: &MetadataPlan) -> Result<Node, GateError> {
        let patch: json_patch::Patch =
            serde_json::from_value(plan.patch()).map_err(|e| GateError::Api {
                op: "build patch",
                source: kube::Error::SerdeError(e),
            })?;
        let params = PatchParams {
            field_manager: Some(field_manager::AGENT.into()),
            ..PatchParams::default()
        };
        let patch = Patch::<()>::Json(patch);
        let call = self.api.patch(&self.name, &params, &patch);
        self.call("patch node taints", call).await
    }

    /// Writes the condition when it is not current; the transition's Event, to publish next.
    async fn write_condition(
        &self,
        mut seen: Seen,
        verdict: &ChainVerdict,
        mode: Mode,
        applied: &mut Applied,
    ) -> Result<Option<PendingEvent>, GateError> {
        let planned =
            |node: &Node| gate::plan_condition(gate::condition_of(node), verdict, Timestamp::now());
        // The watch cache can lag behind our own last condition write; writing from a stale
        // view would publish the same transition's Event twice. So a write planned from the
        // cache is re-planned from a fresh read (this costs one GET per transition only).
        if planned(&seen.node).is_some() && !seen.fresh {
            seen.node = self.get().await?;
        }
        let Some(condition) = planned(&seen.node) else {
            return Ok(None);
        };
        let (params, patch) = (apply_params(), condition_apply(&self.name, condition));
        let call = self.api.patch_status(&self.name, &params, &patch);
        self.call("apply node condition", call).await?;
        applied.condition = true;
        if let Some(mut event) = gate::plan_event(gate::condition_of(&seen.node), verdict, mode) {
            if let Some(latency) = applied.untaint_latency {
                event = event.with_untaint_latency(latency);
            }
            applied.event = Some(event.reason);
            return Ok(Some(PendingEvent {
                event: to_event(event),
                regarding: seen.node.object_ref(&()),
            }));
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshgate_core::cni::Reason;
    use meshgate_core::event_reason;
    use meshgate_core::gate::{CONDITION_TYPE, DEFAULT_TAINT_KEY as TAINT_KEY, VERIFIED_LABEL};
    use meshgate_core::mode::TaintPolicy;
    use serde_json::Value;

    fn verdict(reason: Reason, message: &str) -> ChainVerdict {
        let v = json!({
            "verified": reason == Reason::Verified, "reason": reason, "message": message,
            "config_file": null, "plugins": [], "runtime": "containerd",
        });
        serde_json::from_value(v).expect("a verdict")
    }

    #[test]
    fn planned_patches_decode_as_json_patch() {
        let node: Node = serde_json::from_value(json!({
            "metadata": {"name": "n1", "resourceVersion": "7"},
        }))
        .unwrap();
        let key = TaintKey::default();
        let plan = gate::plan_metadata(
            &node,
            true,
            &key,
            TaintEffect::NoSchedule,
            TaintPolicy::Manage,
            Timestamp::now(),
        )
        .unwrap();
        assert!(serde_json::from_value::<json_patch::Patch>(plan.patch()).is_ok());
    }

    mod requests {
        //! The exact requests `NodeGate::reconcile` sends, against a tower-test mock.
        use super::*;
        use http::{Request, Response};
        use http_body_util::BodyExt;
        use kube::client::Body;
        use kube::runtime::events::Reporter;
        use std::pin::pin;
        use tower_test::mock;

        fn node(rv: &str, taints: Value) -> Value {
            json!({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": "n1", "resourceVersion": rv, "labels": {"kubernetes.io/hostname": "n1"}},
                "spec": {"taints": taints},
            })
        }

        fn respond(status: u16, body: &Value) -> Response<Body> {
            Response::builder()
                .status(status)
                .body(Body::from(serde_json::to_vec(body).unwrap()))
                .unwrap()
        }

        /// The gate of node `n1` (NoSchedule, 5 s API timeout), sending through `svc`.
        fn gate_for_n1(
            svc: mock::Mock<Request<Body>, Response<Body>>,
            instance: Option<&str>,
        ) -> NodeGate {
            let client = kube::Client::new(svc, "default");
            let recorder = Recorder::new(
                client.clone(),
                Reporter {
                    controller: "meshgate-agent".into(),
                    instance: instance.map(str::to_owned),
                },
            );
            NodeGate::new(
                client,
                "n1".into(),
                TaintKey::default(),
                TaintEffect::NoSchedule,
                Duration::from_secs(5),
                recorder,
            )
        }

        async fn body_json(req: Request<Body>) -> Value {
            let bytes = req.into_body().collect().await.unwrap().to_bytes();
            serde_json::from_slice(&bytes).unwrap()
        }

        #[tokio::test]
        async fn conflict_is_retried_on_a_fresh_read_and_keeps_the_other_writers_taint() {
            let (svc, handle) = mock::pair::<Request<Body>, Response<Body>>();
            let server = tokio::spawn(conflict_then_fresh_read(handle));
            let gate = gate_for_n1(svc, Some("n1"));
            let seen: Node = serde_json::from_value(node("1", json!([]))).unwrap();
            let applied = gate
                .reconcile(
                    Some(seen),
                    &verdict(
                        Reason::ChainedPluginMissing,
                        "10-calico.conflist does not chain linkerd-cni",
                    ),
                    Mode::Enforce,
                )
                .await
                .unwrap();
            assert!(
                applied.taint_at.is_some(),
                "the moment the taint change was accepted"
            );
            assert_eq!(
                Applied {
                    taint_at: None,
                    ..applied
                },
                Applied {
                    taint: Some(true),
                    taint_at: None,
                    untaint_latency: None,
                    label: Some("false"),
                    condition: true,
                    event: Some(event_reason::CHAIN_UNVERIFIED)
                }
            );
            server.await.unwrap();
        }

        /// The apiserver side of a conflicting taint patch: refused (someone wrote meanwhile),
        /// a fresh read showing another writer's taint, the recomputed patch keeping it, the
        /// condition and one Warning Event; nothing else.
        async fn conflict_then_fresh_read(handle: mock::Handle<Request<Body>, Response<Body>>) {
            let foreign = json!({"key": "example.com/maintenance", "effect": "NoSchedule"});
            let ours = json!({"key": TAINT_KEY, "effect": "NoSchedule"});
            let mut handle = pin!(handle);
            // 1. Patch planned from the watch cache (rv 1): refused, someone wrote meanwhile.
            let (req, send) = handle.next_request().await.unwrap();
            assert_eq!(req.method(), http::Method::PATCH);
            assert_eq!(req.uri().path(), "/api/v1/nodes/n1");
            assert_eq!(req.headers()["content-type"], "application/json-patch+json");
            assert_eq!(req.uri().query(), Some("&fieldManager=meshgate-agent"));
            let patch = body_json(req).await;
            assert_eq!(
                patch[0],
                json!({"op": "test", "path": "/metadata/resourceVersion", "value": "1"})
            );
            assert_eq!(
                patch[1],
                json!({"op": "add", "path": "/spec/taints", "value": [ours]})
            );
            assert_eq!(
                patch[2],
                json!({"op": "add", "path": "/metadata/labels/meshgate.io~1cni-verified", "value": "false"})
            );
            send.send_response(respond(422, &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Invalid", "code": 422, "message": "the server rejected our request due to an error in our request"})));
            // 2. Fresh read: the other writer added its taint.
            let (req, send) = handle.next_request().await.unwrap();
            assert_eq!(req.method(), http::Method::GET);
            assert_eq!(req.uri().path(), "/api/v1/nodes/n1");
            send.send_response(respond(200, &node("2", json!([foreign]))));
            // 3. Recomputed patch keeps it.
            let (req, send) = handle.next_request().await.unwrap();
            let patch = body_json(req).await;
            assert_eq!(patch[0]["value"], "2");
            assert_eq!(patch[1]["value"], json!([foreign, ours]));
            send.send_response(respond(200, &node("3", json!([foreign, ours]))));
            // 4. The condition, through the status subresource, as a forced server-side apply
            //    of its one entry.
            let (req, send) = handle.next_request().await.unwrap();
            assert_eq!(req.method(), http::Method::PATCH);
            assert_eq!(req.uri().path(), "/api/v1/nodes/n1/status");
            assert_eq!(
                req.headers()["content-type"],
                "application/apply-patch+yaml"
            );
            assert_eq!(
                req.uri().query(),
                Some("&force=true&fieldManager=meshgate-agent")
            );
            let patch = body_json(req).await;
            assert_eq!(
                (&patch["apiVersion"], &patch["kind"], &patch["metadata"]),
                (&json!("v1"), &json!("Node"), &json!({"name": "n1"}))
            );
            assert_eq!(
                patch["status"]["conditions"].as_array().map(Vec::len),
                Some(1)
            );
            let cond = &patch["status"]["conditions"][0];
            assert_eq!(cond["type"], CONDITION_TYPE);
            assert_eq!(cond["status"], "False");
            assert_eq!(cond["reason"], "ChainedPluginMissing");
            assert_eq!(
                cond["message"],
                "10-calico.conflist does not chain linkerd-cni"
            );
            assert!(cond["lastTransitionTime"].is_string());
            send.send_response(respond(200, &node("4", json!([foreign, ours]))));
            // 5. One Warning Event on the Node, in the default namespace.
            let (req, send) = handle.next_request().await.unwrap();
            assert_eq!(req.method(), http::Method::POST);
            assert_eq!(
                req.uri().path(),
                "/apis/events.k8s.io/v1/namespaces/default/events"
            );
            let ev = body_json(req).await;
            assert_eq!(ev["reason"], event_reason::CHAIN_UNVERIFIED);
            assert_eq!(ev["type"], "Warning");
            assert_eq!(ev["regarding"]["kind"], "Node");
            assert_eq!(ev["regarding"]["name"], "n1");
            send.send_response(respond(201, &ev));
            // Nothing else is sent.
            assert!(
                tokio::time::timeout(Duration::from_millis(100), handle.next_request())
                    .await
                    .is_err()
            );
        }

        #[tokio::test]
        async fn an_untaint_publishes_its_latency_in_the_verified_event() {
            let (svc, handle) = mock::pair::<Request<Body>, Response<Body>>();
            let ours = json!({"key": TAINT_KEY, "effect": "NoSchedule"});
            let server = tokio::spawn(async move {
                let mut handle = pin!(handle);
                // 1. The taint-and-label patch removes our taint.
                let (req, send) = handle.next_request().await.unwrap();
                assert_eq!(req.uri().path(), "/api/v1/nodes/n1");
                let patch = body_json(req).await;
                assert_eq!(
                    patch[1],
                    json!({"op": "add", "path": "/spec/taints", "value": []})
                );
                send.send_response(respond(200, &node("2", json!([]))));
                // 2. The condition.
                let (req, send) = handle.next_request().await.unwrap();
                assert_eq!(req.uri().path(), "/api/v1/nodes/n1/status");
                send.send_response(respond(200, &node("3", json!([]))));
                // 3. The Normal Event, its note ending in the latency's documented form.
                let (req, send) = handle.next_request().await.unwrap();
                let ev = body_json(req).await;
                assert_eq!(ev["reason"], event_reason::CHAIN_VERIFIED);
                let note = ev["note"].as_str().unwrap().to_owned();
                send.send_response(respond(201, &ev));
                note
            });
            let mut gate = gate_for_n1(svc, Some("n1"));
            gate.measure_from(Instant::now() - Duration::from_millis(250));
            let seen: Node = serde_json::from_value(node("1", json!([ours]))).unwrap();
            let applied = gate
                .reconcile(
                    Some(seen),
                    &verdict(Reason::Verified, "chained"),
                    Mode::Enforce,
                )
                .await
                .unwrap();
            let latency = applied.untaint_latency.expect("the untaint was measured");
            assert!(latency >= Duration::from_millis(250), "{latency:?}");
            let note = server.await.unwrap();
            assert!(
                note.starts_with("Verified: chained [untaint latency: "),
                "{note}"
            );
            assert_eq!(
                gate::untaint_latency(&note).map(|d| d.as_millis()),
                Some(latency.as_millis()),
                "{note}"
            );
        }

        /// The verdict loop's reconcile returns after the condition, its Event unsent: the
        /// next pass does not wait for the Event's request.
        #[tokio::test]
        async fn a_deferred_event_is_returned_not_sent() {
            let (svc, handle) = mock::pair::<Request<Body>, Response<Body>>();
            let ours = json!({"key": TAINT_KEY, "effect": "NoSchedule"});
            let server = tokio::spawn(async move {
                let mut handle = pin!(handle);
                for (path, rv) in [("/api/v1/nodes/n1", "2"), ("/api/v1/nodes/n1/status", "3")] {
                    let (req, send) = handle.next_request().await.unwrap();
                    assert_eq!(req.uri().path(), path);
                    send.send_response(respond(200, &node(rv, json!([]))));
                }
                tokio::time::timeout(Duration::from_millis(100), handle.next_request())
                    .await
                    .is_err()
            });
            let gate = gate_for_n1(svc, Some("n1"));
            let seen: Node = serde_json::from_value(node("1", json!([ours]))).unwrap();
            let v = verdict(Reason::Verified, "chained");
            let (applied, event) = gate
                .reconcile_deferring_event(Some(seen), &v, Mode::Enforce)
                .await
                .unwrap();
            assert_eq!(applied.event, Some(event_reason::CHAIN_VERIFIED));
            let event = event.expect("the transition's Event");
            assert_eq!(event.event.reason, event_reason::CHAIN_VERIFIED);
            assert_eq!(event.regarding.name.as_deref(), Some("n1"));
            assert!(server.await.unwrap(), "no Event request");
        }

        #[tokio::test]
        async fn a_node_already_in_step_costs_no_request() {
            let (svc, handle) = mock::pair::<Request<Body>, Response<Body>>();
            let gate = gate_for_n1(svc, None);
            let v = verdict(Reason::Verified, "ok");
            let mut seen: Node = serde_json::from_value(node("9", json!([]))).unwrap();
            seen.metadata
                .labels
                .as_mut()
                .unwrap()
                .insert(VERIFIED_LABEL.into(), "true".into());
            seen.status = Some(k8s_openapi::api::core::v1::NodeStatus {
                conditions: Some(vec![
                    gate::plan_condition(None, &v, Timestamp::now()).unwrap(),
                ]),
                ..Default::default()
            });
            assert_eq!(
                gate.reconcile(Some(seen), &v, Mode::Enforce).await.unwrap(),
                Applied::default()
            );
            let mut handle = pin!(handle);
            assert!(
                tokio::time::timeout(Duration::from_millis(50), handle.next_request())
                    .await
                    .is_err()
            );
        }
    }
}
