//! Unit tests of the reviewer: request shapes, admission answers and the Node mutation.

use super::*;
use prometheus_client::registry::Registry;
use proptest::prelude::*;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::Mutex;

use meshgate_shell::logging::{LogFormat, capture};

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
        self.agent
            .clone()
            .unwrap_or_else(|| agent_daemonset(json!({"tolerations": [{"operator": "Exists"}]})))
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

pub(crate) async fn validate(r: &Reviewer<FakeCluster>, v: &Value) -> Value {
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
        text.contains("meshgate_admission_reviews_total{resource=\"pods\",allowed=\"false\"} 1"),
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
    opted_out["request"]["object"]["metadata"]["labels"]["istio.io/dataplane-mode"] = json!("none");
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

/// A review's lines are logged inside its span, which names the request once.
#[tokio::test]
async fn a_refusal_is_logged_inside_its_review_span() {
    let (log, _guard) = capture(LogFormat::Json, "info");
    let (r, _) = reviewer(fake_cluster());
    validate(&r, &pod_review("web", Some("bad"), true)).await;
    let lines = log.json_lines();
    let refused = lines
        .iter()
        .find(|l| l["message"] == "refused mesh pod on unverified node")
        .unwrap_or_else(|| panic!("{lines:?}"));
    let span = &refused["span"];
    assert_eq!(span["name"], "review");
    assert_eq!(span["uid"], "uid-web");
    assert_eq!(span["resource"], "pods");
    assert_eq!(span["namespace"], "shop");
    assert_eq!(span["dry_run"], false);
    assert_eq!(refused["node"], "bad");
    assert!(refused.get("uid").is_none(), "{refused}");
}
