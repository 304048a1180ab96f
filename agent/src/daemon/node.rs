//! Keeps the agent's own Node in step with the chain verdict: taint, label, condition, Events.
//!
//! In: the latest verdict and the latest Node seen by the Node watch. Out: the smallest set of
//! writes that makes the Node say what the verdict says, and what changed ([`Applied`]).
//!
//! - Taint and label go in one JSON patch guarded by a `test` of `metadata.resourceVersion`,
//!   so a concurrent writer's taints are never overwritten: on conflict the Node is re-read
//!   and the patch recomputed (bounded). Taints other than meshgate's are kept as they are.
//! - The condition goes through the `nodes/status` subresource with a strategic merge patch
//!   (conditions merge by `type`), and its `lastTransitionTime` moves only when its status does.
//! - Events are published only when the condition's status or reason changes, after the
//!   condition is written: a restart then finds the condition already current and publishes
//!   nothing, so one transition never yields two Events.
//!
//! The planning functions are pure and unit-tested; [`NodeGate`] is the thin I/O around them.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, NodeCondition, Taint};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Resource, ResourceExt};
use meshgate_core::cni::ChainVerdict;
use meshgate_core::{CONDITION_TYPE, TAINT_KEY, VERIFIED_LABEL, event_reason};
use serde_json::{Value, json};

/// Conflicting writers are retried this many times before the reconcile is reported failed
/// (and retried later with backoff).
const MAX_CONFLICT_RETRIES: usize = 8;

/// `--taint-effect` values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum TaintEffect {
    /// New pods without a toleration are not scheduled; running pods stay.
    #[default]
    #[value(name = "NoSchedule")]
    NoSchedule,
    /// Also evicts running pods without a toleration (use with care).
    #[value(name = "NoExecute")]
    NoExecute,
}

impl TaintEffect {
    /// The effect as the API spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            TaintEffect::NoSchedule => "NoSchedule",
            TaintEffect::NoExecute => "NoExecute",
        }
    }
}

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
    pub taint_at: Option<std::time::Instant>,
    /// The label value written, if it changed.
    pub label: Option<&'static str>,
    /// True when the condition was written.
    pub condition: bool,
    /// The Event reason published, if any.
    pub event: Option<&'static str>,
}

/// The taint list the Node should have, or `None` when `current` is already right.
/// Only meshgate's own taint is added, changed or removed; every other taint is kept.
pub fn plan_taints(current: &[Taint], verified: bool, effect: TaintEffect) -> Option<Vec<Taint>> {
    let ours: Vec<&Taint> = current.iter().filter(|t| t.key == TAINT_KEY).collect();
    let want_ours = !verified;
    let is_right = if want_ours {
        ours.len() == 1
            && ours[0].effect == effect.as_str()
            && ours[0].value.as_deref().unwrap_or("").is_empty()
    } else {
        ours.is_empty()
    };
    if is_right {
        return None;
    }
    let mut next: Vec<Taint> = current
        .iter()
        .filter(|t| t.key != TAINT_KEY)
        .cloned()
        .collect();
    if want_ours {
        next.push(Taint {
            key: TAINT_KEY.to_string(),
            value: None,
            effect: effect.as_str().to_string(),
            // The API server only records timeAdded for NoExecute taints.
            time_added: (effect == TaintEffect::NoExecute).then(|| Time(Timestamp::now())),
        });
    }
    Some(next)
}

/// The label value the Node should have, or `None` when it already has it.
pub fn plan_label(labels: &BTreeMap<String, String>, verified: bool) -> Option<&'static str> {
    let want = if verified { "true" } else { "false" };
    (labels.get(VERIFIED_LABEL).map(String::as_str) != Some(want)).then_some(want)
}

/// The condition to write, or `None` when status, reason and message are already current.
/// `lastTransitionTime` is kept unless the status changes.
pub fn plan_condition(
    current: Option<&NodeCondition>,
    verdict: &ChainVerdict,
    now: Timestamp,
) -> Option<NodeCondition> {
    let status = if verdict.verified { "True" } else { "False" };
    let reason = verdict.reason.as_str();
    if let Some(c) = current
        && c.status == status
        && c.reason.as_deref() == Some(reason)
        && c.message.as_deref() == Some(verdict.message.as_str())
    {
        return None;
    }
    let transition = match current {
        Some(c) if c.status == status => c.last_transition_time.clone(),
        _ => None,
    }
    .unwrap_or(Time(now));
    Some(NodeCondition {
        type_: CONDITION_TYPE.to_string(),
        status: status.to_string(),
        reason: Some(reason.to_string()),
        message: Some(verdict.message.clone()),
        last_heartbeat_time: Some(Time(now)),
        last_transition_time: Some(transition),
    })
}

/// The Event to publish for a condition change, if the status or reason changed.
pub fn plan_event(current: Option<&NodeCondition>, verdict: &ChainVerdict) -> Option<Event> {
    let status = if verdict.verified { "True" } else { "False" };
    if let Some(c) = current
        && c.status == status
        && c.reason.as_deref() == Some(verdict.reason.as_str())
    {
        return None;
    }
    let (type_, reason) = if verdict.verified {
        (EventType::Normal, event_reason::CHAIN_VERIFIED)
    } else {
        (EventType::Warning, event_reason::CHAIN_UNVERIFIED)
    };
    Some(Event {
        type_,
        reason: reason.to_string(),
        note: Some(truncate(
            &format!("{}: {}", verdict.reason, verdict.message),
            1024,
        )),
        action: if verdict.verified { "Untaint" } else { "Taint" }.to_string(),
        secondary: None,
    })
}

/// The JSON patch for taints and label, guarded by the resourceVersion we planned from.
pub fn metadata_patch(
    resource_version: &str,
    has_labels: bool,
    taints: Option<&[Taint]>,
    label: Option<&str>,
) -> Value {
    let mut ops =
        vec![json!({"op": "test", "path": "/metadata/resourceVersion", "value": resource_version})];
    if let Some(taints) = taints {
        ops.push(json!({"op": "add", "path": "/spec/taints", "value": taints}));
    }
    if let Some(value) = label {
        if has_labels {
            // "~1" is how JSON pointer escapes the "/" in the label key.
            let path = format!(
                "/metadata/labels/{}",
                VERIFIED_LABEL.replace('~', "~0").replace('/', "~1")
            );
            ops.push(json!({"op": "add", "path": path, "value": value}));
        } else {
            ops.push(
                json!({"op": "add", "path": "/metadata/labels", "value": {VERIFIED_LABEL: value}}),
            );
        }
    }
    Value::Array(ops)
}

fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

fn condition_of(node: &Node) -> Option<&NodeCondition> {
    node.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == CONDITION_TYPE)
}

fn is_conflict(e: &kube::Error) -> bool {
    // A failed JSON-patch `test` is 422 (older servers: 409 or 500 with "testing value").
    matches!(e, kube::Error::Api(s) if s.code == 409 || s.code == 422)
}

/// The agent's handle on its own Node.
pub struct NodeGate {
    /// Writes: the taint-and-label patch and the condition.
    api: Api<Node>,
    /// Reads (a GET when the watch has nothing, or after a conflict); `api` unless
    /// [`NodeGate::reading_as`] gave it another identity.
    reader: Api<Node>,
    name: String,
    effect: TaintEffect,
    timeout: Duration,
    recorder: Recorder,
}

impl NodeGate {
    /// A gate for Node `name`, bounding each API call by `timeout`.
    pub fn new(
        client: kube::Client,
        name: String,
        effect: TaintEffect,
        timeout: Duration,
        recorder: Recorder,
    ) -> Self {
        let api = Api::all(client);
        Self {
            reader: api.clone(),
            api,
            name,
            effect,
            timeout,
            recorder,
        }
    }

    /// Reads the Node through `client` (the node's own identity with `--impersonate-node`);
    /// writes stay with the client given to [`NodeGate::new`].
    #[must_use]
    pub fn reading_as(mut self, client: kube::Client) -> Self {
        self.reader = Api::all(client);
        self
    }

    /// The Node's name.
    pub fn name(&self) -> &str {
        &self.name
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

    /// Makes the Node say what `verdict` says. `seen` is the latest Node from the watch, if
    /// any; on a resourceVersion conflict the Node is re-read.
    pub async fn reconcile(
        &self,
        seen: Option<Node>,
        verdict: &ChainVerdict,
    ) -> Result<Applied, GateError> {
        // `fresh`: `node` came from the API just now (a GET or a patch response), not the cache.
        let (mut node, mut fresh) = match seen {
            Some(n) => (n, false),
            None => (self.get().await?, true),
        };
        let mut applied = Applied::default();
        let mut attempts = 0;
        loop {
            let taints = node
                .spec
                .as_ref()
                .and_then(|s| s.taints.clone())
                .unwrap_or_default();
            let planned_taints = plan_taints(&taints, verdict.verified, self.effect);
            let planned_label = plan_label(node.labels(), verdict.verified);
            if planned_taints.is_none() && planned_label.is_none() {
                break;
            }
            let rv = node.resource_version().unwrap_or_default();
            let patch = metadata_patch(
                &rv,
                node.metadata.labels.is_some(),
                planned_taints.as_deref(),
                planned_label,
            );
            let patch: json_patch::Patch =
                serde_json::from_value(patch).map_err(|e| GateError::Api {
                    op: "build patch",
                    source: kube::Error::SerdeError(e),
                })?;
            match self
                .call(
                    "patch node taints",
                    self.api.patch(
                        &self.name,
                        &PatchParams::default(),
                        &Patch::<()>::Json(patch),
                    ),
                )
                .await
            {
                Ok(updated) => {
                    if planned_taints.is_some() {
                        applied.taint = Some(!verdict.verified);
                        applied.taint_at = Some(std::time::Instant::now());
                    }
                    applied.label = planned_label;
                    node = updated;
                    fresh = true;
                    break;
                }
                Err(GateError::Api { source, .. }) if is_conflict(&source) => {
                    attempts += 1;
                    if attempts >= MAX_CONFLICT_RETRIES {
                        return Err(GateError::Conflicts);
                    }
                    tracing::debug!(node = %self.name, attempts, "node changed under us; re-reading");
                    node = self.get().await?;
                    fresh = true;
                }
                Err(e) => return Err(e),
            }
        }

        // The watch cache can lag behind our own last condition write; writing from a stale
        // view would publish the same transition's Event twice. So a write planned from the
        // cache is re-planned from a fresh read (this costs one GET per transition only).
        if plan_condition(condition_of(&node), verdict, Timestamp::now()).is_some() && !fresh {
            node = self.get().await?;
        }
        let current = condition_of(&node).cloned();
        if let Some(condition) = plan_condition(current.as_ref(), verdict, Timestamp::now()) {
            let patch = json!({"status": {"conditions": [condition]}});
            self.call(
                "patch node condition",
                self.api.patch_status(
                    &self.name,
                    &PatchParams::default(),
                    &Patch::Strategic(patch),
                ),
            )
            .await?;
            applied.condition = true;
            if let Some(event) = plan_event(current.as_ref(), verdict) {
                applied.event = Some(if verdict.verified {
                    event_reason::CHAIN_VERIFIED
                } else {
                    event_reason::CHAIN_UNVERIFIED
                });
                // An Event is a notification, not state: a failure is logged, never retried,
                // so a retry can never publish the same transition twice.
                let reference = node.object_ref(&());
                match tokio::time::timeout(self.timeout, self.recorder.publish(&event, &reference))
                    .await
                {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        tracing::warn!(node = %self.name, error = %e, "publishing the Node Event failed")
                    }
                    Err(_) => {
                        tracing::warn!(node = %self.name, "publishing the Node Event timed out")
                    }
                }
            }
        }
        Ok(applied)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshgate_core::cni::{Reason, Runtime};

    fn taint(key: &str, effect: &str) -> Taint {
        Taint {
            key: key.into(),
            effect: effect.into(),
            value: None,
            time_added: None,
        }
    }

    fn verdict(reason: Reason, message: &str) -> ChainVerdict {
        ChainVerdict {
            verified: reason == Reason::Verified,
            reason,
            message: message.into(),
            config_file: None,
            plugins: vec![],
            runtime: Runtime::Containerd,
        }
    }

    #[test]
    fn taint_is_added_and_removed_keeping_other_taints() {
        let others = vec![
            taint("node.kubernetes.io/not-ready", "NoSchedule"),
            taint("dedicated", "NoExecute"),
        ];
        let added = plan_taints(&others, false, TaintEffect::NoSchedule).unwrap();
        assert_eq!(added.len(), 3);
        assert_eq!(&added[..2], &others[..]);
        assert_eq!(added[2].key, TAINT_KEY);
        assert_eq!(added[2].effect, "NoSchedule");
        assert!(added[2].time_added.is_none());

        assert_eq!(
            plan_taints(&added, false, TaintEffect::NoSchedule),
            None,
            "already tainted"
        );
        assert_eq!(
            plan_taints(&added, true, TaintEffect::NoSchedule).unwrap(),
            others
        );
        assert_eq!(
            plan_taints(&others, true, TaintEffect::NoSchedule),
            None,
            "already untainted"
        );

        // An effect change replaces our taint; duplicates of ours are collapsed to one.
        let ne = plan_taints(&added, false, TaintEffect::NoExecute).unwrap();
        assert_eq!(ne.iter().filter(|t| t.key == TAINT_KEY).count(), 1);
        assert!(ne[2].time_added.is_some());
        let dup = [added.clone(), vec![taint(TAINT_KEY, "NoSchedule")]].concat();
        assert_eq!(
            plan_taints(&dup, false, TaintEffect::NoSchedule)
                .unwrap()
                .len(),
            3
        );
    }

    #[test]
    fn label_follows_the_verdict() {
        let mut labels = BTreeMap::new();
        assert_eq!(plan_label(&labels, false), Some("false"));
        labels.insert(VERIFIED_LABEL.into(), "false".into());
        assert_eq!(plan_label(&labels, false), None);
        assert_eq!(plan_label(&labels, true), Some("true"));
    }

    #[test]
    fn condition_transition_time_moves_only_on_status_change() {
        let t0 = Timestamp::from_second(1_000).unwrap();
        let t1 = Timestamp::from_second(2_000).unwrap();
        let missing = verdict(Reason::ChainedPluginMissing, "a");
        let first = plan_condition(None, &missing, t0).unwrap();
        assert_eq!(first.status, "False");
        assert_eq!(first.last_transition_time, Some(Time(t0)));
        assert_eq!(
            plan_condition(Some(&first), &missing, t1),
            None,
            "unchanged: no write"
        );

        // Same status, new reason: written, transition time kept.
        let invalid = verdict(Reason::ConfigInvalid, "b");
        let second = plan_condition(Some(&first), &invalid, t1).unwrap();
        assert_eq!(second.reason.as_deref(), Some("ConfigInvalid"));
        assert_eq!(second.last_transition_time, Some(Time(t0)));

        let ok = verdict(Reason::Verified, "c");
        let third = plan_condition(Some(&second), &ok, t1).unwrap();
        assert_eq!(third.status, "True");
        assert_eq!(third.last_transition_time, Some(Time(t1)));
    }

    #[test]
    fn events_only_on_status_or_reason_change() {
        let missing = verdict(Reason::ChainedPluginMissing, "a");
        let ev = plan_event(None, &missing).unwrap();
        assert_eq!(ev.reason, event_reason::CHAIN_UNVERIFIED);
        assert!(matches!(ev.type_, EventType::Warning));
        assert!(ev.note.unwrap().starts_with("ChainedPluginMissing: "));
        let cond = plan_condition(None, &missing, Timestamp::now()).unwrap();
        assert!(
            plan_event(
                Some(&cond),
                &verdict(Reason::ChainedPluginMissing, "other text")
            )
            .is_none()
        );
        let ok = plan_event(Some(&cond), &verdict(Reason::Verified, "ok")).unwrap();
        assert_eq!(ok.reason, event_reason::CHAIN_VERIFIED);
    }

    #[test]
    fn patch_is_guarded_by_resource_version_and_escapes_the_label_key() {
        let p = metadata_patch(
            "42",
            true,
            Some(&[taint(TAINT_KEY, "NoSchedule")]),
            Some("false"),
        );
        assert_eq!(
            p[0],
            json!({"op": "test", "path": "/metadata/resourceVersion", "value": "42"})
        );
        assert_eq!(p[1]["path"], "/spec/taints");
        assert_eq!(p[2]["path"], "/metadata/labels/meshgate.io~1cni-verified");
        let p = metadata_patch("7", false, None, Some("true"));
        assert_eq!(
            p[1],
            json!({"op": "add", "path": "/metadata/labels", "value": {VERIFIED_LABEL: "true"}})
        );
        assert!(serde_json::from_value::<json_patch::Patch>(p).is_ok());
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
            let foreign = json!({"key": "example.com/maintenance", "effect": "NoSchedule"});
            let ours = json!({"key": TAINT_KEY, "effect": "NoSchedule"});
            let server = tokio::spawn({
                let (foreign, ours) = (foreign.clone(), ours.clone());
                async move {
                    let mut handle = pin!(handle);
                    // 1. Patch planned from the watch cache (rv 1): refused, someone wrote meanwhile.
                    let (req, send) = handle.next_request().await.unwrap();
                    assert_eq!(req.method(), http::Method::PATCH);
                    assert_eq!(req.uri().path(), "/api/v1/nodes/n1");
                    assert_eq!(req.headers()["content-type"], "application/json-patch+json");
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
                    // 4. The condition, through the status subresource, as a strategic merge.
                    let (req, send) = handle.next_request().await.unwrap();
                    assert_eq!(req.method(), http::Method::PATCH);
                    assert_eq!(req.uri().path(), "/api/v1/nodes/n1/status");
                    assert_eq!(
                        req.headers()["content-type"],
                        "application/strategic-merge-patch+json"
                    );
                    let patch = body_json(req).await;
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
            });
            let gate = gate_for_n1(svc, Some("n1"));
            let seen: Node = serde_json::from_value(node("1", json!([]))).unwrap();
            let applied = gate
                .reconcile(
                    Some(seen),
                    &verdict(
                        Reason::ChainedPluginMissing,
                        "10-calico.conflist does not chain linkerd-cni",
                    ),
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
                    label: Some("false"),
                    condition: true,
                    event: Some(event_reason::CHAIN_UNVERIFIED)
                }
            );
            server.await.unwrap();
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
                conditions: Some(vec![plan_condition(None, &v, Timestamp::now()).unwrap()]),
                ..Default::default()
            });
            assert_eq!(
                gate.reconcile(Some(seen), &v).await.unwrap(),
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
