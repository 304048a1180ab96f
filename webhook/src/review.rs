//! AdmissionReview ⇄ `core::admission`.
//!
//! In: the raw request body the apiserver POSTs (bytes, possibly garbage; [`crate::decode`]
//! keeps only the parts admission reads), and a [`Cluster`] view (node labels from the cache;
//! a pod's labels for bindings, cache first and an API GET within the lookup limits after, or
//! why not; a node's condition reason, only when refusing a pod on a node the cache knows: a
//! node it does not know is decided from the cache alone, so reviews naming made-up nodes cost
//! no API request). Out: an [`Outcome`]: the AdmissionReview response to send, or a
//! "malformed" message for a 400. What a refusal becomes follows the live mode
//! (`meshgate_core::mode`): refused in `enforce` and `condition-only` (which judge the node by
//! meshgate's label, never by a taint), admitted in `report` with the refusal as a warning to
//! the client and the audit annotation [`WOULD_REFUSE`]. A Node is tainted at CREATE only in
//! `enforce`. Every decoding failure is a value, never a panic: the proptest in this module
//! feeds it arbitrary bytes. A decoded review's lines are logged inside its `review` span
//! (uid, operation, resource, namespace, name, dry run).

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Instant;

use kube::core::DynamicObject;
use kube::core::Status;
use kube::core::admission::{AdmissionResponse, AdmissionReview, Operation};
use meshgate_core::admission::{
    self, Decision, Input, LookupFailure, NodeFacts, PodFacts, RequestKind,
};
use meshgate_core::gate::{self, TaintEffect, TaintKey};
use meshgate_core::mode::{Mode, OnRefusal};
use meshgate_core::profile::ProfileSet;
use meshgate_shell::mode::WouldAction;
use tokio::sync::watch;
use tracing::Instrument;

pub use crate::decode::decode;
use crate::decode::{Object, Request};
use crate::metrics::{Metrics, Resource};
use crate::placement::{self, AgentDaemonSet, DaemonSetRef};

/// A pod's labels and annotations, as the binding path needs them: only those the profiles
/// read (`meshgate_core::projection`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodMeta {
    /// `metadata.labels`, projected.
    pub labels: BTreeMap<String, String>,
    /// `metadata.annotations`, projected.
    pub annotations: BTreeMap<String, String>,
}

/// What the reviewer needs to know about the cluster. The real implementation is
/// [`crate::cache::Caches`]; unit tests use a map.
pub trait Cluster: Send + Sync + 'static {
    /// The node's labels, or `None` when the node is not in the cache.
    fn node_labels(&self, name: &str) -> Option<BTreeMap<String, String>>;
    /// The pod's labels and annotations (cache, then a bounded API GET), or why they are
    /// not known.
    fn pod_meta(
        &self,
        namespace: &str,
        name: &str,
    ) -> impl Future<Output = Result<PodMeta, LookupFailure>> + Send;
    /// The node's `MeshCNIVerified` condition reason, if it can be read quickly.
    fn node_reason(&self, name: &str) -> impl Future<Output = Option<String>> + Send;
    /// The labels of a Namespace, or `None` when it is not in the cache. Read only when a
    /// profile selects on namespace labels (`istio-ambient`).
    fn namespace_labels(&self, name: &str) -> Option<BTreeMap<String, String>>;
    /// The agent DaemonSet, which decides the Nodes `/mutate-node` gates.
    fn agent_daemonset(&self) -> AgentDaemonSet;
}

/// What to send back.
#[derive(Debug)]
pub enum Outcome {
    /// A well-formed request: answer with this review (HTTP 200).
    Answer(Box<AdmissionReview<DynamicObject>>),
    /// The body is not an AdmissionReview request: answer 400 with this message.
    Malformed(String),
}

impl Outcome {
    /// The response's `allowed`, when there is one (tests and logs).
    pub fn allowed(&self) -> Option<bool> {
        match self {
            Outcome::Answer(r) => r.response.as_ref().map(|r| r.allowed),
            Outcome::Malformed(_) => None,
        }
    }
}

fn answer(resp: AdmissionResponse) -> Outcome {
    Outcome::Answer(Box::new(resp.into_review()))
}

fn refuse(req: &Request, message: String, code: u16) -> Outcome {
    let mut resp = AdmissionResponse::from(req);
    resp.allowed = false;
    let reason = if code == 400 {
        "BadRequest"
    } else {
        "Forbidden"
    };
    resp.result = Status::failure(&message, reason).with_code(code);
    answer(resp)
}

/// The pod and the node a CREATE review names.
struct Target<'a> {
    kind: RequestKind,
    object: &'a Object,
    namespace: &'a str,
    node: &'a str,
    /// The pod's name (its `generateName` prefix for a pod not named yet).
    pod: &'a str,
}

impl<'a> Target<'a> {
    /// What `req` asks to place where, or the answer when there is nothing to decide (a pod
    /// not bound to a node yet) or the review cannot be decided (no object, no target).
    fn of(req: &'a Request, resource: Resource) -> Result<Self, Outcome> {
        let Some(object) = req.object.as_ref() else {
            return Err(refuse(
                req,
                "meshgate: CREATE review without an object".into(),
                400,
            ));
        };
        let namespace = req
            .namespace
            .as_deref()
            .or(object.metadata.namespace.as_deref())
            .unwrap_or_default();
        let (kind, node, pod) = match resource {
            Resource::Pods => {
                let Some(node) = object.node_name().filter(|n| !n.is_empty()) else {
                    // Unbound pods go through the scheduler and are checked at binding.
                    return Err(answer(AdmissionResponse::from(req)));
                };
                let name = object
                    .metadata
                    .name
                    .as_deref()
                    .or(object.metadata.generate_name.as_deref())
                    .unwrap_or(req.name.as_str());
                (RequestKind::PodCreate, node, name)
            }
            Resource::PodsBinding => {
                let Some(node) = object.target_name().filter(|n| !n.is_empty()) else {
                    return Err(refuse(
                        req,
                        "meshgate: Binding without target.name".into(),
                        400,
                    ));
                };
                // The pod's name: in the URL for pods/binding, and the Binding's own name for
                // the legacy resource (which the apiserver also puts in request.name).
                let pod = Some(req.name.as_str())
                    .filter(|n| !n.is_empty())
                    .or(object.metadata.name.as_deref())
                    .unwrap_or_default();
                (RequestKind::Binding, node, pod)
            }
        };
        Ok(Self {
            kind,
            object,
            namespace,
            node,
            pod,
        })
    }
}

static EMPTY: BTreeMap<String, String> = BTreeMap::new();

/// The audit annotation a review admitted in report mode carries, with the refusal message
/// as its value. The apiserver records it as `<webhook name>/would-refuse`, e.g.
/// `pods.validate.meshgate.io/would-refuse` (a webhook's keys may hold no `/`).
pub const WOULD_REFUSE: &str = "would-refuse";

/// The answer in report mode to a placement enforce would refuse: allowed, with the message
/// as a warning (kubectl prints it, the client gets a `Warning` header) and as an audit
/// annotation.
fn admit_with_warning(req: &Request, message: String) -> Outcome {
    let mut resp = AdmissionResponse::from(req);
    resp.warnings = Some(vec![format!(
        "meshgate report mode: enforce would refuse this: {message}"
    )]);
    resp.audit_annotations
        .insert(WOULD_REFUSE.to_owned(), message);
    answer(resp)
}

/// Answers `/validate` and `/mutate-node` reviews.
pub struct Reviewer<C> {
    cluster: C,
    profiles: ProfileSet,
    metrics: Metrics,
    /// The key of meshgate's taint (`--taint-key`): what new Nodes get, what refusals name.
    taint_key: TaintKey,
    /// The effect of the taint new Nodes get (`--taint-effect`).
    taint_effect: TaintEffect,
    /// `--agent-daemonset`, for the logs.
    agent: DaemonSetRef,
    /// The live mode.
    mode: watch::Receiver<Mode>,
}

impl<C: Cluster> Reviewer<C> {
    /// A reviewer over `cluster`, gating pods selected by `profiles`.
    pub fn new(cluster: C, profiles: ProfileSet, metrics: Metrics) -> Self {
        Self {
            cluster,
            profiles,
            metrics,
            taint_key: TaintKey::default(),
            taint_effect: TaintEffect::default(),
            agent: DaemonSetRef {
                namespace: "meshgate-system".into(),
                name: "meshgate-agent".into(),
            },
            mode: watch::channel(Mode::default()).1,
        }
    }

    /// The metrics it records into (the server's refusals are counted there too).
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Gates with the taint `key` (`--taint-key`) instead of the default.
    #[must_use]
    pub fn with_taint_key(mut self, key: TaintKey) -> Self {
        self.taint_key = key;
        self
    }

    /// Names the agent DaemonSet (`--agent-daemonset`) in the logs.
    #[must_use]
    pub fn with_agent_daemonset(mut self, agent: DaemonSetRef) -> Self {
        self.agent = agent;
        self
    }

    /// Follows the live mode `mode` instead of enforcing always.
    #[must_use]
    pub fn with_mode(mut self, mode: watch::Receiver<Mode>) -> Self {
        self.mode = mode;
        self
    }

    /// Taints new Nodes with `effect` (`--taint-effect`) instead of `NoSchedule`.
    #[must_use]
    pub fn with_taint_effect(mut self, effect: TaintEffect) -> Self {
        self.taint_effect = effect;
        self
    }

    /// The cluster view (for tests and the server's readiness).
    pub fn cluster(&self) -> &C {
        &self.cluster
    }

    /// `POST /validate`: pods CREATE with `spec.nodeName`, and bindings CREATE, through the
    /// `pods/binding` subresource (what kube-scheduler posts) or the legacy `bindings`
    /// resource (`POST /api/v1/namespaces/{ns}/bindings`, a core/v1 Binding naming the pod).
    /// Both bind a pod to a node, so both are decided alike and counted as `pods_binding`.
    pub async fn validate(&self, body: &[u8]) -> Outcome {
        let start = Instant::now();
        let req = match decode(body) {
            Ok(r) => r,
            Err(m) => {
                tracing::warn!(error = %m, "refusing malformed AdmissionReview");
                return Outcome::Malformed(m);
            }
        };
        let span = review_span(&req);
        self.validate_decoded(&req, start).instrument(span).await
    }

    /// [`Reviewer::validate`] once the review decoded.
    async fn validate_decoded(&self, req: &Request, start: Instant) -> Outcome {
        let core = req.resource.group.is_empty();
        let resource = match (
            core,
            req.resource.resource.as_str(),
            req.sub_resource.as_deref(),
        ) {
            (true, "pods", None) => Resource::Pods,
            (true, "pods", Some("binding")) | (true, "bindings", None) => Resource::PodsBinding,
            _ => {
                // Only reachable through a misconfigured webhook registration: this webhook
                // has no opinion on other resources, so it must not block them.
                tracing::warn!(
                    sub_resource = ?req.sub_resource,
                    "review for a resource meshgate does not gate; allowing"
                );
                return answer(AdmissionResponse::from(req));
            }
        };
        let outcome = if req.operation == Operation::Create {
            self.validate_create(req, resource).await
        } else {
            answer(AdmissionResponse::from(req))
        };
        if let Some(allowed) = outcome.allowed() {
            self.metrics.observe(resource, allowed, start.elapsed());
        }
        outcome
    }

    async fn validate_create(&self, req: &Request, resource: Resource) -> Outcome {
        let t = match Target::of(req, resource) {
            Ok(t) => t,
            Err(outcome) => return outcome,
        };
        let node_labels = self.cluster.node_labels(t.node);
        let node = match &node_labels {
            Some(labels) => NodeFacts::Known { labels },
            None => NodeFacts::Unknown,
        };
        // A verified node takes any pod: answer before looking the pod up.
        if let NodeFacts::Known { labels } = node
            && admission::node_is_verified(labels)
        {
            return answer(AdmissionResponse::from(req));
        }

        let looked_up = match t.kind {
            RequestKind::PodCreate => None,
            RequestKind::Binding => Some(self.cluster.pod_meta(t.namespace, t.pod).await),
        };
        let pod = match &looked_up {
            None => PodFacts::Known {
                labels: t.object.metadata.labels.as_ref().unwrap_or(&EMPTY),
                annotations: t.object.metadata.annotations.as_ref().unwrap_or(&EMPTY),
            },
            Some(Ok(m)) => PodFacts::Known {
                labels: &m.labels,
                annotations: &m.annotations,
            },
            Some(Err(why)) => PodFacts::Unknown(*why),
        };
        let namespace_labels = if self.profiles.uses_namespace_labels() {
            self.cluster.namespace_labels(t.namespace)
        } else {
            None
        };
        let input = Input {
            kind: t.kind,
            namespace: t.namespace,
            pod_name: t.pod,
            pod,
            namespace_labels: namespace_labels.as_ref(),
            node_name: t.node,
            node,
            node_reason: None,
            taint_key: &self.taint_key,
        };
        match admission::decide(&input, &self.profiles) {
            Decision::Allow(why) => {
                tracing::debug!(node = t.node, ?why, "allowed");
                answer(AdmissionResponse::from(req))
            }
            Decision::Refuse { .. } => self.refusal(req, resource, input).await,
        }
    }

    /// The answer to a review `decide` refused: decided again with the node's condition
    /// reason, so the message says why the node is not verified.
    async fn refusal(&self, req: &Request, resource: Resource, input: Input<'_>) -> Outcome {
        // Refusals are rare and read by people: spend a bounded lookup on the reason, but only
        // for a node the cache knows. A node it does not know is refused as "not known yet"
        // from the cache alone: otherwise every review naming a made-up node would cost the
        // apiserver a GET.
        let reason = match input.node {
            NodeFacts::Known { .. } => self.cluster.node_reason(input.node_name).await,
            NodeFacts::Unknown => None,
        };
        let input = Input {
            node_reason: reason.as_deref(),
            ..input
        };
        let message = match admission::decide(&input, &self.profiles) {
            Decision::Refuse { message } => message,
            // `decide` does not look at the reason to allow; keep the first verdict.
            Decision::Allow(_) => return answer(AdmissionResponse::from(req)),
        };
        let mode = *self.mode.borrow();
        let (namespace, pod, node) = (input.namespace, input.pod_name, input.node_name);
        let resource = resource.as_str();
        match mode.on_refusal() {
            OnRefusal::Refuse => {
                tracing::info!(namespace, pod, node, resource, %mode, "refused mesh pod on unverified node");
                refuse(req, message, 403)
            }
            OnRefusal::Warn => {
                // A dry run places nothing: enforce would not have refused a placement.
                if !req.dry_run {
                    self.metrics.mode.would(WouldAction::Refuse);
                }
                tracing::info!(namespace, pod, node, resource, %mode, "report mode: admitted mesh pod on unverified node that enforce would refuse");
                admit_with_warning(req, message)
            }
        }
    }

    /// `POST /mutate-node`: taint and label a Node being created, when the agent DaemonSet
    /// will run on it ([`placement::gates`]). Always allows: node registration must never
    /// depend on meshgate.
    pub fn mutate_node(&self, body: &[u8]) -> Outcome {
        let req = match decode(body) {
            Ok(r) => r,
            Err(m) => {
                tracing::warn!(error = %m, "refusing malformed AdmissionReview");
                return Outcome::Malformed(m);
            }
        };
        let span = review_span(&req);
        let _in_review = span.enter();
        let resp = AdmissionResponse::from(&req);
        let is_node_create = req.operation == Operation::Create
            && req.resource.group.is_empty()
            && req.resource.resource == "nodes"
            && req.sub_resource.is_none();
        let Some(obj) = req.object.as_ref().filter(|_| is_node_create) else {
            return answer(resp);
        };
        if let Err(why) = placement::gates(&self.cluster.agent_daemonset(), &req.name, obj) {
            self.metrics.node_ungated(why.reason());
            why.log(&req.name, &self.agent);
            return answer(resp);
        }
        let (view, mode) = (obj.registration_view(), *self.mode.borrow());
        let ops = gate::node_registration_patch(&view, &self.taint_key, self.taint_effect, mode);
        if ops.is_empty() {
            return answer(resp);
        }
        let patch: json_patch::Patch = match serde_json::from_value(serde_json::Value::Array(ops)) {
            Ok(p) => p,
            Err(e) => {
                tracing::error!(error = %e, "registration patch does not decode as JSON Patch");
                return answer(resp);
            }
        };
        match resp.clone().with_patch(patch) {
            Ok(r) => {
                let taint = mode.taints_at_registration();
                tracing::info!(%mode, taint, "gating new node: label (and, in enforce, taint) added");
                answer(r)
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot serialize registration patch");
                answer(resp)
            }
        }
    }
}

/// The span a review's lines are logged in: which request it is (its `uid`, as the
/// apiserver's audit log names it) and what it is about.
fn review_span(req: &Request) -> tracing::Span {
    tracing::info_span!(
        "review",
        uid = %req.uid,
        operation = ?req.operation,
        resource = %req.resource.resource,
        namespace = req.namespace.as_deref().unwrap_or(""),
        name = %req.name,
        dry_run = req.dry_run,
    )
}

#[cfg(test)]
mod mode_tests;

#[cfg(test)]
pub(crate) mod tests;
