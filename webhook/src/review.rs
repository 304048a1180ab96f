//! AdmissionReview ⇄ `core::admission`.
//!
//! In: the raw request body the apiserver POSTs (bytes, possibly garbage; [`crate::decode`]
//! keeps only the parts admission reads), and a [`Cluster`] view (node labels from the cache;
//! a pod's labels for bindings, cache first and an API GET within the lookup limits after, or
//! why not; a node's condition reason, only when refusing a pod on a node the cache knows: a
//! node it does not know is decided from the cache alone, so reviews naming made-up nodes cost
//! no API request). Out: an [`Outcome`]: the AdmissionReview response to send, or a
//! "malformed" message for a 400. Every decoding
//! failure is a value, never a panic: the proptest in this module feeds it arbitrary bytes.

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
use meshgate_core::profile::ProfileSet;

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
        }
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
                    uid = %req.uid,
                    resource = %req.resource.resource,
                    sub_resource = ?req.sub_resource,
                    "review for a resource meshgate does not gate; allowing"
                );
                return answer(AdmissionResponse::from(&req));
            }
        };
        let outcome = if req.operation == Operation::Create {
            self.validate_create(&req, resource).await
        } else {
            answer(AdmissionResponse::from(&req))
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
                tracing::debug!(uid = %req.uid, node = t.node, ?why, "allowed");
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
        tracing::info!(
            uid = %req.uid,
            namespace = input.namespace,
            pod = input.pod_name,
            node = input.node_name,
            resource = resource.as_str(),
            dry_run = req.dry_run,
            "refused mesh pod on unverified node"
        );
        refuse(req, message, 403)
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
        let view = obj.registration_view();
        let ops = gate::node_registration_patch(&view, &self.taint_key, self.taint_effect);
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
                tracing::info!(node = %req.name, "gating new node: taint and label added");
                answer(r)
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot serialize registration patch");
                answer(resp)
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use prometheus_client::registry::Registry;
    use proptest::prelude::*;
    use serde_json::{Value, json};
    use std::collections::HashMap;
    use std::sync::Mutex;

    /// A cluster made of maps; records which lookups happened.
    #[derive(Default)]
    pub(crate) struct FakeCluster {
        pub nodes: HashMap<String, BTreeMap<String, String>>,
        pub pods: HashMap<(String, String), PodMeta>,
        pub reasons: HashMap<String, String>,
        pub namespaces: HashMap<String, BTreeMap<String, String>>,
        pub pod_lookups: Mutex<Vec<String>>,
        pub reason_lookups: Mutex<Vec<String>>,
        pub delay: Option<std::time::Duration>,
        /// Why a pod not in `pods` is not known (default: not found).
        pub lookup_failure: Option<LookupFailure>,
        /// The agent DaemonSet (default: one that runs on every node).
        pub agent: Option<AgentDaemonSet>,
    }

    impl Cluster for FakeCluster {
        fn node_labels(&self, name: &str) -> Option<BTreeMap<String, String>> {
            self.nodes.get(name).cloned()
        }
        async fn pod_meta(&self, namespace: &str, name: &str) -> Result<PodMeta, LookupFailure> {
            if let Some(d) = self.delay {
                tokio::time::sleep(d).await;
            }
            self.pod_lookups
                .lock()
                .unwrap()
                .push(format!("{namespace}/{name}"));
            self.pods
                .get(&(namespace.to_string(), name.to_string()))
                .cloned()
                .ok_or(self.lookup_failure.unwrap_or(LookupFailure::NotFound))
        }
        async fn node_reason(&self, name: &str) -> Option<String> {
            self.reason_lookups.lock().unwrap().push(name.to_string());
            self.reasons.get(name).cloned()
        }
        fn namespace_labels(&self, name: &str) -> Option<BTreeMap<String, String>> {
            self.namespaces.get(name).cloned()
        }
        fn agent_daemonset(&self) -> AgentDaemonSet {
            self.agent.clone().unwrap_or_else(|| {
                agent_daemonset(json!({"tolerations": [{"operator": "Exists"}]}))
            })
        }
    }

    /// An agent DaemonSet whose pod template spec is `spec` (plus a container).
    pub(crate) fn agent_daemonset(mut spec: Value) -> AgentDaemonSet {
        spec["containers"] = json!([{"name": "agent", "image": "x"}]);
        let ds = json!({
            "metadata": {"name": "meshgate-agent", "namespace": "meshgate-system"},
            "spec": {"selector": {}, "template": {"spec": spec}}
        });
        AgentDaemonSet::Known(std::sync::Arc::new(serde_json::from_value(ds).unwrap()))
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    pub(crate) fn fake_cluster() -> FakeCluster {
        let mut c = FakeCluster::default();
        c.nodes.insert(
            "good".into(),
            labels(&[("meshgate.io/cni-verified", "true")]),
        );
        c.nodes.insert(
            "bad".into(),
            labels(&[("meshgate.io/cni-verified", "false")]),
        );
        c.reasons
            .insert("bad".into(), "ChainedPluginMissing".into());
        c.namespaces.insert(
            "shop".into(),
            labels(&[("kubernetes.io/metadata.name", "shop")]),
        );
        c.pods.insert(
            ("shop".into(), "meshed".into()),
            PodMeta {
                labels: labels(&[("linkerd.io/control-plane-ns", "linkerd")]),
                annotations: BTreeMap::new(),
            },
        );
        c.pods.insert(
            ("shop".into(), "plain".into()),
            PodMeta {
                labels: labels(&[("app", "plain")]),
                annotations: BTreeMap::new(),
            },
        );
        c
    }

    pub(crate) fn reviewer(cluster: FakeCluster) -> (Reviewer<FakeCluster>, Registry) {
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        (
            Reviewer::new(cluster, ProfileSet::all_builtin(), metrics),
            registry,
        )
    }

    pub(crate) fn pod_review(name: &str, node: Option<&str>, meshed: bool) -> Value {
        let mut pod_labels = json!({"app": name});
        if meshed {
            pod_labels["linkerd.io/control-plane-ns"] = json!("linkerd");
        }
        let mut spec = json!({"containers": [{"name": "c", "image": "x"}]});
        if let Some(n) = node {
            spec["nodeName"] = json!(n);
        }
        json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": format!("uid-{name}"),
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "name": name,
                "namespace": "shop",
                "operation": "CREATE",
                "userInfo": {"username": "alice"},
                "object": {
                    "apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": name, "namespace": "shop", "labels": pod_labels},
                    "spec": spec
                },
                "oldObject": null,
                "dryRun": false
            }
        })
    }

    pub(crate) fn binding_review(pod: &str, node: &str) -> Value {
        json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": format!("uid-bind-{pod}"),
                "kind": {"group": "", "version": "v1", "kind": "Binding"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "subResource": "binding",
                "name": pod,
                "namespace": "shop",
                "operation": "CREATE",
                "userInfo": {"username": "system:kube-scheduler"},
                "object": {
                    "apiVersion": "v1", "kind": "Binding",
                    "metadata": {"name": pod, "namespace": "shop"},
                    "target": {"apiVersion": "v1", "kind": "Node", "name": node}
                }
            }
        })
    }

    /// The response JSON exactly as it goes on the wire.
    pub(crate) fn wire(o: Outcome) -> Value {
        match o {
            Outcome::Answer(r) => serde_json::to_value(&*r).unwrap(),
            Outcome::Malformed(m) => panic!("unexpected malformed: {m}"),
        }
    }

    async fn validate(r: &Reviewer<FakeCluster>, v: &Value) -> Value {
        wire(r.validate(&serde_json::to_vec(v).unwrap()).await)
    }

    #[tokio::test]
    async fn meshed_pod_with_node_name_on_unverified_node_is_refused_with_reason() {
        let (r, registry) = reviewer(fake_cluster());
        let out = validate(&r, &pod_review("web", Some("bad"), true)).await;
        assert_eq!(out["apiVersion"], "admission.k8s.io/v1");
        assert_eq!(out["kind"], "AdmissionReview");
        assert_eq!(out["response"]["uid"], "uid-web");
        assert_eq!(out["response"]["allowed"], false);
        assert_eq!(out["response"]["status"]["code"], 403);
        let msg = out["response"]["status"]["message"].as_str().unwrap();
        assert!(msg.contains("node bad"), "{msg}");
        assert!(msg.contains("ChainedPluginMissing"), "{msg}");
        assert!(msg.contains("Remedy"), "{msg}");

        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains(
                "meshgate_admission_reviews_total{resource=\"pods\",allowed=\"false\"} 1"
            ),
            "{text}"
        );
    }

    /// An ambient pod is known by its namespace's `istio.io/dataplane-mode=ambient` label
    /// (the pod itself carries no mesh label): the reviewer passes the cached namespace
    /// labels into the decision, and fails closed when the namespace is not cached.
    #[tokio::test]
    async fn pods_of_an_ambient_namespace_are_gated_by_its_label() {
        let mut c = fake_cluster();
        c.namespaces.insert(
            "shop".into(),
            labels(&[
                ("kubernetes.io/metadata.name", "shop"),
                ("istio.io/dataplane-mode", "ambient"),
            ]),
        );
        let (r, _) = reviewer(c);
        let out = validate(&r, &pod_review("web", Some("bad"), false)).await;
        assert_eq!(out["response"]["allowed"], false, "{out}");
        let msg = out["response"]["status"]["message"].as_str().unwrap();
        assert!(msg.contains("mesh profile istio-ambient"), "{msg}");
        // Opted out with the pod label Istio reads.
        let mut opted_out = pod_review("batch", Some("bad"), false);
        opted_out["request"]["object"]["metadata"]["labels"]["istio.io/dataplane-mode"] =
            json!("none");
        let out = validate(&r, &opted_out).await;
        assert_eq!(out["response"]["allowed"], true, "{out}");

        // The namespace is not cached: not guessed, refused on an unverified node only.
        let mut c = fake_cluster();
        c.namespaces.clear();
        let (r, _) = reviewer(c);
        let out = validate(&r, &pod_review("web", Some("bad"), false)).await;
        assert_eq!(out["response"]["allowed"], false, "{out}");
        let msg = out["response"]["status"]["message"].as_str().unwrap();
        assert!(msg.contains("are not known yet"), "{msg}");
        let out = validate(&r, &pod_review("web", Some("good"), false)).await;
        assert_eq!(out["response"]["allowed"], true, "{out}");
    }

    #[tokio::test]
    async fn verified_nodes_non_mesh_pods_and_unbound_pods_are_allowed() {
        let (r, _) = reviewer(fake_cluster());
        for review in [
            pod_review("web", Some("good"), true),
            pod_review("batch", Some("bad"), false),
            pod_review("batch", Some("nowhere"), false),
            pod_review("web", None, true),
        ] {
            let out = validate(&r, &review).await;
            assert_eq!(out["response"]["allowed"], true, "{review}");
            assert_eq!(out["response"]["uid"], review["request"]["uid"]);
        }
    }

    #[tokio::test]
    async fn meshed_pod_on_unknown_node_is_refused() {
        let (r, _) = reviewer(fake_cluster());
        let out = validate(&r, &pod_review("web", Some("nowhere"), true)).await;
        assert_eq!(out["response"]["allowed"], false);
        let msg = out["response"]["status"]["message"].as_str().unwrap();
        assert!(
            msg.contains("node nowhere") && msg.contains("not known"),
            "{msg}"
        );
    }

    /// Reviews naming nodes the cache does not know are decided from the cache alone: no
    /// reason lookup (an API GET in the real cluster view), for pods and bindings alike. A
    /// refusal on a known, unverified node still looks its reason up.
    #[tokio::test]
    async fn unknown_nodes_are_refused_without_a_lookup() {
        let (r, _) = reviewer(fake_cluster());
        for i in 0..50 {
            let node = format!("made-up-{i}");
            let out = validate(&r, &pod_review("web", Some(&node), true)).await;
            assert_eq!(out["response"]["allowed"], false);
            let out = validate(&r, &binding_review("meshed", &node)).await;
            assert_eq!(out["response"]["allowed"], false);
            let msg = out["response"]["status"]["message"].as_str().unwrap();
            assert!(msg.contains("not known"), "{msg}");
        }
        assert!(r.cluster().reason_lookups.lock().unwrap().is_empty());
        assert_eq!(
            validate(&r, &pod_review("web", Some("bad"), true)).await["response"]["allowed"],
            false
        );
        assert_eq!(*r.cluster().reason_lookups.lock().unwrap(), ["bad"]);
    }

    /// A core/v1 Binding posted to the legacy `bindings` resource, as the apiserver reviews it.
    fn legacy_binding_review(pod: &str, node: &str) -> Value {
        let mut v = binding_review(pod, node);
        v["request"]["uid"] = json!(format!("uid-legacy-{pod}"));
        v["request"]["resource"] = json!({"group": "", "version": "v1", "resource": "bindings"});
        v["request"].as_object_mut().unwrap().remove("subResource");
        v
    }

    /// The legacy `bindings` resource binds a pod just like `pods/binding`: decided alike
    /// and counted as `pods_binding`.
    #[tokio::test]
    async fn legacy_bindings_are_decided_like_pods_binding() {
        let (r, registry) = reviewer(fake_cluster());
        let out = validate(&r, &legacy_binding_review("meshed", "bad")).await;
        assert_eq!(out["response"]["uid"], "uid-legacy-meshed");
        assert_eq!(out["response"]["allowed"], false);
        let msg = out["response"]["status"]["message"].as_str().unwrap();
        assert!(
            msg.contains("pod shop/meshed") && msg.contains("node bad"),
            "{msg}"
        );
        for (pod, node) in [("plain", "bad"), ("meshed", "good")] {
            let out = validate(&r, &legacy_binding_review(pod, node)).await;
            assert_eq!(out["response"]["allowed"], true, "{pod} on {node}");
        }
        // The pod's name from the Binding itself when the request names none.
        let mut unnamed = legacy_binding_review("meshed", "bad");
        unnamed["request"]["name"] = json!("");
        assert_eq!(validate(&r, &unnamed).await["response"]["allowed"], false);
        assert_eq!(
            *r.cluster().pod_lookups.lock().unwrap(),
            ["shop/meshed", "shop/plain", "shop/meshed"]
        );
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for line in [
            "meshgate_admission_reviews_total{resource=\"pods_binding\",allowed=\"false\"} 2",
            "meshgate_admission_reviews_total{resource=\"pods_binding\",allowed=\"true\"} 2",
        ] {
            assert!(text.contains(line), "{text}");
        }
    }

    #[tokio::test]
    async fn bindings_look_the_pod_up_only_when_the_node_is_unverified() {
        let (r, _) = reviewer(fake_cluster());
        let out = validate(&r, &binding_review("meshed", "bad")).await;
        assert_eq!(out["response"]["allowed"], false);
        let msg = out["response"]["status"]["message"].as_str().unwrap();
        assert!(
            msg.contains("pod shop/meshed") && msg.contains("node bad"),
            "{msg}"
        );
        assert!(msg.contains("tolerate"), "{msg}");

        assert_eq!(
            validate(&r, &binding_review("plain", "bad")).await["response"]["allowed"],
            true
        );
        assert_eq!(
            validate(&r, &binding_review("meshed", "good")).await["response"]["allowed"],
            true
        );
        // The verified node needed no lookup.
        assert_eq!(
            *r.cluster().pod_lookups.lock().unwrap(),
            ["shop/meshed", "shop/plain"]
        );
        // An unknown pod on an unverified node fails closed; the scheduler retries.
        let out = validate(&r, &binding_review("ghost", "bad")).await;
        assert_eq!(out["response"]["allowed"], false);
        let msg = out["response"]["status"]["message"].as_str().unwrap();
        assert!(msg.contains("pod shop/ghost was not found"), "{msg}");
    }

    /// A binding whose pod was not looked up because the lookups are at their limit is
    /// refused on an unverified node, saying so; on a verified node it needs no lookup.
    #[tokio::test]
    async fn a_throttled_lookup_fails_closed_and_says_why() {
        let mut c = fake_cluster();
        c.lookup_failure = Some(LookupFailure::Throttled);
        let (r, _) = reviewer(c);
        let out = validate(&r, &binding_review("forged-1", "bad")).await;
        assert_eq!(out["response"]["allowed"], false);
        assert_eq!(out["response"]["status"]["code"], 403);
        let msg = out["response"]["status"]["message"].as_str().unwrap();
        assert!(
            msg.contains("pod shop/forged-1 was not looked up")
                && msg.contains("at their limit")
                && msg.contains("node bad"),
            "{msg}"
        );
        let out = validate(&r, &binding_review("forged-2", "good")).await;
        assert_eq!(out["response"]["allowed"], true);
        assert_eq!(*r.cluster().pod_lookups.lock().unwrap(), ["shop/forged-1"]);
    }

    #[tokio::test]
    async fn binding_without_target_is_a_bad_request_answer() {
        let (r, _) = reviewer(fake_cluster());
        let mut b = binding_review("meshed", "bad");
        b["request"]["object"]["target"] = json!({});
        let out = validate(&r, &b).await;
        assert_eq!(out["response"]["allowed"], false);
        assert_eq!(out["response"]["status"]["code"], 400);
        assert_eq!(out["response"]["uid"], "uid-bind-meshed");
    }

    #[tokio::test]
    async fn other_operations_and_resources_are_allowed() {
        let (r, _) = reviewer(fake_cluster());
        let mut update = pod_review("web", Some("bad"), true);
        update["request"]["operation"] = json!("UPDATE");
        assert_eq!(validate(&r, &update).await["response"]["allowed"], true);
        let mut svc = pod_review("web", Some("bad"), true);
        svc["request"]["resource"]["resource"] = json!("services");
        assert_eq!(validate(&r, &svc).await["response"]["allowed"], true);
    }

    #[tokio::test]
    async fn malformed_reviews_are_reported_not_answered() {
        let (r, _) = reviewer(fake_cluster());
        for body in [
            &b""[..],
            b"{",
            b"[]",
            b"{\"kind\":\"AdmissionReview\",\"apiVersion\":\"admission.k8s.io/v1\"}",
            b"{\"kind\":\"Pod\",\"apiVersion\":\"v1\"}",
        ] {
            match r.validate(body).await {
                Outcome::Malformed(m) => assert!(m.starts_with("malformed AdmissionReview"), "{m}"),
                other => panic!("{body:?} gave {other:?}"),
            }
            assert!(matches!(r.mutate_node(body), Outcome::Malformed(_)));
        }
        let mut no_uid = pod_review("web", Some("bad"), true);
        no_uid["request"]["uid"] = json!("");
        let body = serde_json::to_vec(&no_uid).unwrap();
        assert!(matches!(r.validate(&body).await, Outcome::Malformed(_)));
    }

    pub(crate) fn node_review(node: Value) -> Vec<u8> {
        serde_json::to_vec(&json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "uid-node",
                "kind": {"group": "", "version": "v1", "kind": "Node"},
                "resource": {"group": "", "version": "v1", "resource": "nodes"},
                "name": "n1",
                "operation": "CREATE",
                "userInfo": {"username": "system:node:n1"},
                "object": node
            }
        }))
        .unwrap()
    }

    /// kube-core serializes `patch` as a JSON array of bytes, which the apiserver's decoder
    /// accepts for a `[]byte` field just like base64.
    pub(crate) fn decoded_patch(out: &Value) -> Value {
        let bytes: Vec<u8> = serde_json::from_value(out["response"]["patch"].clone()).unwrap();
        serde_json::from_slice(&bytes).unwrap()
    }

    #[test]
    fn new_nodes_get_taint_and_label_by_json_patch() {
        let (r, _) = reviewer(fake_cluster());
        let body = node_review(json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": "n1", "labels": {"kubernetes.io/hostname": "n1"}},
            "spec": {"taints": [{"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}]}
        }));
        let out = wire(r.mutate_node(&body));
        assert_eq!(out["response"]["allowed"], true);
        assert_eq!(out["response"]["uid"], "uid-node");
        assert_eq!(out["response"]["patchType"], "JSONPatch");
        assert_eq!(
            decoded_patch(&out),
            json!([
                {"op": "add", "path": "/metadata/labels/meshgate.io~1cni-verified", "value": "false"},
                {"op": "add", "path": "/spec/taints/-", "value": {"key": "readiness.k8s.io/meshgate-cni-unverified", "effect": "NoSchedule"}}
            ])
        );

        // Already tainted by kubelet --register-with-taints: no duplicate, no patch at all.
        let body = node_review(json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": "n1", "labels": {"meshgate.io/cni-verified": "false"}},
            "spec": {"taints": [{"key": "readiness.k8s.io/meshgate-cni-unverified", "effect": "NoSchedule"}]}
        }));
        let out = wire(r.mutate_node(&body));
        assert_eq!(out["response"]["allowed"], true);
        assert!(out["response"].get("patch").is_none(), "{out}");
    }

    /// `--taint-effect NoExecute` reaches the registration patch, as it reaches the agent.
    #[test]
    fn new_nodes_get_the_configured_taint_effect() {
        let (r, _) = reviewer(fake_cluster());
        let r = r.with_taint_effect(TaintEffect::NoExecute);
        let body = node_review(json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": "n1", "labels": {"meshgate.io/cni-verified": "false"}},
            "spec": {}
        }));
        assert_eq!(
            decoded_patch(&wire(r.mutate_node(&body))),
            json!([
                {"op": "add", "path": "/spec/taints", "value": [{"key": "readiness.k8s.io/meshgate-cni-unverified", "effect": "NoExecute"}]}
            ])
        );
    }

    /// `--taint-key` reaches the registration patch: a node pre-tainted with the default key
    /// is not gated by a custom one.
    #[test]
    fn new_nodes_get_the_configured_taint_key() {
        let (r, _) = reviewer(fake_cluster());
        let r = r.with_taint_key("example.com/mesh-not-ready".parse().unwrap());
        let body = node_review(json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": "n1", "labels": {"meshgate.io/cni-verified": "false"}},
            "spec": {"taints": [{"key": "readiness.k8s.io/meshgate-cni-unverified", "effect": "NoSchedule"}]}
        }));
        assert_eq!(
            decoded_patch(&wire(r.mutate_node(&body))),
            json!([
                {"op": "add", "path": "/spec/taints/-", "value": {"key": "example.com/mesh-not-ready", "effect": "NoSchedule"}}
            ])
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, .. ProptestConfig::default() })]

        /// Arbitrary bytes never panic the decoding path of either endpoint.
        #[test]
        fn arbitrary_bytes_never_panic(body in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let (r, _) = reviewer(fake_cluster());
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            let v = rt.block_on(r.validate(&body));
            prop_assert!(matches!(v, Outcome::Malformed(_)) || v.allowed().is_some());
            let _ = r.mutate_node(&body);
        }

        /// Valid reviews with arbitrary bytes spliced in, cut short or with fields replaced by
        /// arbitrary JSON: answered or reported malformed, never a panic.
        #[test]
        fn mangled_reviews_never_panic(
            which in 0usize..3,
            cut in 0usize..4096,
            splice in proptest::collection::vec(any::<u8>(), 0..16),
            field in prop::sample::select(vec![
                "/request/object", "/request/object/spec", "/request/object/spec/nodeName",
                "/request/object/metadata", "/request/object/metadata/labels",
                "/request/object/target", "/request/object/target/name", "/request/name",
                "/request/namespace", "/request/subResource", "/request/resource",
                "/request/operation", "/request/uid", "/request", "/kind",
            ]),
            value in arb_json(),
        ) {
            let base = match which {
                0 => pod_review("meshed", Some("bad"), true),
                1 => binding_review("meshed", "bad"),
                _ => serde_json::from_slice(&node_review(json!({"metadata": {"name": "n"}}))).unwrap(),
            };
            let (r, _) = reviewer(fake_cluster());
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();

            let mut bytes = serde_json::to_vec(&base).unwrap();
            let at = cut.min(bytes.len());
            bytes.splice(at..at, splice);
            let _ = rt.block_on(r.validate(&bytes));
            let _ = r.mutate_node(&bytes);
            bytes.truncate(at);
            let _ = rt.block_on(r.validate(&bytes));

            let mut replaced = base.clone();
            if let Some(slot) = replaced.pointer_mut(field) {
                *slot = value;
            }
            let bytes = serde_json::to_vec(&replaced).unwrap();
            let _ = rt.block_on(r.validate(&bytes));
            let _ = r.mutate_node(&bytes);
        }
    }

    fn arb_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| json!(n)),
            any::<f64>().prop_map(|f| json!(f)),
            ".{0,12}".prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                proptest::collection::btree_map(".{0,8}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }
}
