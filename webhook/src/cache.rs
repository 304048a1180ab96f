//! The webhook's view of the cluster: metadata-only caches and bounded API fallbacks.
//!
//! In: a kube `Client`. Out: [`Caches`], the real [`Cluster`] behind the reviewer, and the
//! watch futures that keep it filled, plus a readiness signal that turns true once every
//! cache has listed.
//!
//! - Nodes: a metadata-only watch (`PartialObjectMetadata`), with everything but the name and
//!   the `meshgate.io/cni-verified` label dropped before it is stored. The verdict is in a
//!   label, so the node's status (the bulk of a Node object) is never transferred.
//! - Pods: a metadata-only watch limited to *unscheduled* pods (`spec.nodeName=`). A binding
//!   is only ever created for an unscheduled pod, so this is exactly the set the binding path
//!   needs, and it stays small however many pods run. A pod the watch has not delivered yet
//!   (created a moment before its binding) is fetched with a metadata-only GET bounded by
//!   `lookup_timeout`.
//! - Namespaces: a metadata-only watch keeping each namespace's name and labels, because a
//!   profile may select on them (`istio-ambient`: `istio.io/dataplane-mode=ambient` on the
//!   namespace). A pod can only be created in a namespace that exists, so the cache has it
//!   unless its watch lags; then the decision fails closed for the profiles that read it.
//! - A node's `MeshCNIVerified` condition reason is read with a bounded GET, only to word a
//!   refusal, and remembered for a few seconds so a burst of refusals costs one GET. Only a
//!   node in the cache is ever looked up: a name the cache does not know costs no request,
//!   so reviews naming made-up nodes cannot turn into a flood of GETs.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::{Api, PartialObjectMeta};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tokio::sync::watch;

use crate::review::{Cluster, PodMeta};

/// How long a looked-up condition reason is reused.
const REASON_TTL: Duration = Duration::from_secs(5);
/// Bound on remembered reasons; the map is cleared when full (refusals are rare).
const REASON_CAPACITY: usize = 1024;

/// Metadata caches of Nodes and unscheduled Pods, with bounded API fallbacks.
pub struct Caches {
    nodes: Store<PartialObjectMeta<Node>>,
    pods: Store<PartialObjectMeta<Pod>>,
    namespaces: Store<PartialObjectMeta<Namespace>>,
    client: Client,
    lookup_timeout: Duration,
    reasons: Mutex<HashMap<String, (Instant, Option<String>)>>,
}

/// Drops what the webhook never reads from a cached object's metadata.
fn slim_common<K>(obj: &mut PartialObjectMeta<K>) {
    let m = &mut obj.metadata;
    m.managed_fields = None;
    m.owner_references = None;
    m.finalizers = None;
    m.creation_timestamp = None;
    m.generate_name = None;
}

/// A cached Node keeps its name and the one label the decision reads: cloud nodes carry a
/// dozen labels, and with thousands of nodes they would be most of the cache.
fn slim_node(node: &mut PartialObjectMeta<Node>) {
    slim_common(node);
    node.metadata.annotations = None;
    if let Some(labels) = node.metadata.labels.as_mut() {
        labels.retain(|k, _| k == meshgate_core::VERIFIED_LABEL);
    }
}

/// A cached Pod keeps labels and annotations: mesh profiles select on both.
fn slim_pod(pod: &mut PartialObjectMeta<Pod>) {
    slim_common(pod);
}

/// A cached Namespace keeps its name and labels: profiles select on labels only.
fn slim_namespace(ns: &mut PartialObjectMeta<Namespace>) {
    slim_common(ns);
    ns.metadata.annotations = None;
}

/// The futures that keep the caches filled; spawn them. They run until dropped.
pub struct Watches {
    /// Drives the Namespace watch.
    pub namespaces: std::pin::Pin<Box<dyn Future<Output = ()> + Send>>,
    /// Drives the Node watch.
    pub nodes: std::pin::Pin<Box<dyn Future<Output = ()> + Send>>,
    /// Drives the unscheduled-Pod watch.
    pub pods: std::pin::Pin<Box<dyn Future<Output = ()> + Send>>,
    /// Turns the readiness signal true once both caches listed; then finishes.
    pub synced: std::pin::Pin<Box<dyn Future<Output = ()> + Send>>,
}

/// A metadata-only watch of `K` into `writer`, retried with backoff for as long as it runs;
/// `slim` drops what the decisions never read before an object is stored.
fn metadata_watch<K>(
    api: Api<PartialObjectMeta<K>>,
    config: watcher::Config,
    slim: fn(&mut PartialObjectMeta<K>),
    writer: reflector::store::Writer<PartialObjectMeta<K>>,
    what: &'static str,
) -> impl Future<Output = ()> + Send + 'static
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    watcher(api, config)
        .default_backoff()
        .modify(slim)
        .reflect(writer)
        .for_each(move |ev| {
            if let Err(e) = ev {
                tracing::warn!(error = %e, "{what} watch failed; retrying with backoff");
            }
            futures::future::ready(())
        })
}

impl Caches {
    /// Builds the caches over `client`; nothing is fetched until the [`Watches`] run.
    pub fn new(
        client: Client,
        lookup_timeout: Duration,
        ready: watch::Sender<bool>,
    ) -> (Self, Watches) {
        let (nodes, node_writer) = reflector::store::<PartialObjectMeta<Node>>();
        let (pods, pod_writer) = reflector::store::<PartialObjectMeta<Pod>>();
        let (namespaces, namespace_writer) = reflector::store::<PartialObjectMeta<Namespace>>();
        // The default (most recent) list semantic lists in pages of 500: with thousands of
        // nodes, one unpaginated `resourceVersion=0` list would be buffered whole, and that
        // buffer sets the process's peak memory.
        let node_watch = metadata_watch(
            Api::all(client.clone()),
            watcher::Config::default(),
            slim_node,
            node_writer,
            "node",
        );
        let pod_watch = metadata_watch(
            Api::all(client.clone()),
            watcher::Config::default().fields("spec.nodeName="),
            slim_pod,
            pod_writer,
            "pod",
        );
        let namespace_watch = metadata_watch(
            Api::all(client.clone()),
            watcher::Config::default(),
            slim_namespace,
            namespace_writer,
            "namespace",
        );

        let (n, p, ns) = (nodes.clone(), pods.clone(), namespaces.clone());
        let synced = async move {
            let (a, b, c) = futures::join!(
                n.wait_until_ready(),
                p.wait_until_ready(),
                ns.wait_until_ready()
            );
            if a.is_ok() && b.is_ok() && c.is_ok() {
                tracing::info!(
                    nodes = n.len(),
                    pending_pods = p.len(),
                    namespaces = ns.len(),
                    "caches synced"
                );
                let _ = ready.send(true);
            }
        };

        (
            Self {
                nodes,
                pods,
                namespaces,
                client,
                lookup_timeout,
                reasons: Mutex::new(HashMap::new()),
            },
            Watches {
                namespaces: Box::pin(namespace_watch),
                nodes: Box::pin(node_watch),
                pods: Box::pin(pod_watch),
                synced: Box::pin(synced),
            },
        )
    }

    /// Number of cached nodes (logs, tests).
    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    async fn fetch_reason(&self, name: &str) -> Option<String> {
        let api: Api<Node> = Api::all(self.client.clone());
        match tokio::time::timeout(self.lookup_timeout, api.get_opt(name)).await {
            Ok(Ok(Some(node))) => node
                .status
                .and_then(|s| s.conditions)
                .and_then(|cs| {
                    cs.into_iter()
                        .find(|c| c.type_ == meshgate_core::CONDITION_TYPE)
                })
                .and_then(|c| c.reason),
            Ok(Ok(None)) => None,
            Ok(Err(e)) => {
                tracing::debug!(node = name, error = %e, "reading node condition failed");
                None
            }
            Err(_) => {
                tracing::debug!(node = name, "reading node condition timed out");
                None
            }
        }
    }
}

impl Cluster for Caches {
    fn node_labels(&self, name: &str) -> Option<BTreeMap<String, String>> {
        self.nodes
            .get(&ObjectRef::new(name))
            .map(|n| n.labels().clone())
    }

    fn namespace_labels(&self, name: &str) -> Option<BTreeMap<String, String>> {
        self.namespaces
            .get(&ObjectRef::new(name))
            .map(|n| n.labels().clone())
    }

    async fn pod_meta(&self, namespace: &str, name: &str) -> Option<PodMeta> {
        let key = ObjectRef::new(name).within(namespace);
        if let Some(p) = self.pods.get(&key) {
            return Some(PodMeta {
                labels: p.labels().clone(),
                annotations: p.annotations().clone(),
            });
        }
        let api: Api<PartialObjectMeta<Pod>> = Api::namespaced(self.client.clone(), namespace);
        match tokio::time::timeout(self.lookup_timeout, api.get_opt(name)).await {
            Ok(Ok(Some(p))) => Some(PodMeta {
                labels: p.metadata.labels.unwrap_or_default(),
                annotations: p.metadata.annotations.unwrap_or_default(),
            }),
            Ok(Ok(None)) => {
                tracing::info!(
                    namespace,
                    pod = name,
                    "binding for a pod that does not exist"
                );
                None
            }
            Ok(Err(e)) => {
                tracing::warn!(namespace, pod = name, error = %e, "pod lookup failed");
                None
            }
            Err(_) => {
                tracing::warn!(namespace, pod = name, timeout = ?self.lookup_timeout, "pod lookup timed out");
                None
            }
        }
    }

    async fn node_reason(&self, name: &str) -> Option<String> {
        // Only a node in the cache is looked up (see the module doc).
        self.nodes.get(&ObjectRef::new(name))?;
        let now = Instant::now();
        {
            let reasons = self.reasons.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((at, reason)) = reasons.get(name)
                && now.duration_since(*at) < REASON_TTL
            {
                return reason.clone();
            }
        }
        let reason = self.fetch_reason(name).await;
        let mut reasons = self.reasons.lock().unwrap_or_else(|p| p.into_inner());
        if reasons.len() >= REASON_CAPACITY {
            reasons.clear();
        }
        reasons.insert(name.to_string(), (now, reason.clone()));
        reason
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::api::ObjectMeta;

    #[test]
    fn cached_nodes_keep_only_name_and_verdict_label() {
        let mut node: PartialObjectMeta<Node> = PartialObjectMeta {
            types: None,
            metadata: ObjectMeta {
                name: Some("n1".into()),
                labels: Some(
                    [
                        ("kubernetes.io/hostname", "n1"),
                        ("topology.kubernetes.io/zone", "a"),
                        (meshgate_core::VERIFIED_LABEL, "true"),
                    ]
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                ),
                annotations: Some([("a".to_string(), "b".to_string())].into()),
                managed_fields: Some(vec![Default::default()]),
                ..ObjectMeta::default()
            },
            _phantom: std::marker::PhantomData,
        };
        slim_node(&mut node);
        assert_eq!(node.metadata.name.as_deref(), Some("n1"));
        assert_eq!(
            node.metadata
                .labels
                .as_ref()
                .map(|l| l.keys().collect::<Vec<_>>()),
            Some(vec![&meshgate_core::VERIFIED_LABEL.to_string()])
        );
        assert!(node.metadata.annotations.is_none() && node.metadata.managed_fields.is_none());

        let mut pod: PartialObjectMeta<Pod> = PartialObjectMeta {
            types: None,
            metadata: ObjectMeta {
                labels: Some([("app".to_string(), "x".to_string())].into()),
                annotations: Some(
                    [(
                        "ambient.istio.io/redirection".to_string(),
                        "enabled".to_string(),
                    )]
                    .into(),
                ),
                ..ObjectMeta::default()
            },
            _phantom: std::marker::PhantomData,
        };
        slim_pod(&mut pod);
        assert!(pod.metadata.labels.is_some() && pod.metadata.annotations.is_some());

        let mut ns: PartialObjectMeta<Namespace> = PartialObjectMeta {
            types: None,
            metadata: ObjectMeta {
                name: Some("shop".into()),
                labels: Some(
                    [("istio.io/dataplane-mode".to_string(), "ambient".to_string())].into(),
                ),
                annotations: Some([("a".to_string(), "b".to_string())].into()),
                managed_fields: Some(vec![Default::default()]),
                ..ObjectMeta::default()
            },
            _phantom: std::marker::PhantomData,
        };
        slim_namespace(&mut ns);
        assert_eq!(ns.metadata.labels.as_ref().map(|l| l.len()), Some(1));
        assert!(ns.metadata.annotations.is_none() && ns.metadata.managed_fields.is_none());
    }

    /// A node the cache does not know is never looked up: no request reaches the API,
    /// however many made-up names are asked for.
    #[tokio::test]
    async fn a_node_not_in_the_cache_costs_no_request() {
        let requests = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let seen = requests.clone();
        let service = tower::service_fn(move |_req: http::Request<kube::client::Body>| {
            seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async move {
                let body = serde_json::json!({
                    "kind": "Status", "apiVersion": "v1", "status": "Failure",
                    "reason": "NotFound", "code": 404, "message": "not found"
                });
                http::Response::builder()
                    .status(404)
                    .header("content-type", "application/json")
                    .body(kube::client::Body::from(serde_json::to_vec(&body).unwrap()))
            }
        });
        let client = Client::new(service, "default");
        let (ready, _) = watch::channel(false);
        // The watches are never run: the node cache stays empty.
        let (caches, _watches) = Caches::new(client, Duration::from_secs(1), ready);
        for i in 0..100 {
            assert_eq!(caches.node_reason(&format!("made-up-{i}")).await, None);
        }
        assert_eq!(requests.load(std::sync::atomic::Ordering::SeqCst), 0);
    }
}
