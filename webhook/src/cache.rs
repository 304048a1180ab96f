//! The webhook's view of the cluster: metadata-only caches and bounded API fallbacks.
//!
//! In: a kube `Client`. Out: [`Caches`], the real [`Cluster`] behind the reviewer, and the
//! watch futures that keep it filled, plus a readiness signal that turns true once every
//! cache has listed.
//!
//! - Nodes: a metadata-only watch (`PartialObjectMetadata`) into [`NodeVerdicts`], which keeps
//!   of each Node its name and its `meshgate.io/cni-verified` label, nothing else. The verdict
//!   is in a label, so the node's status (the bulk of a Node object) is never transferred.
//! - Pods: [`crate::pods`], a metadata-only watch limited to *unscheduled* pods
//!   (`spec.nodeName=`), each projected to the keys the profiles read, capped, listed in small
//!   pages. A binding is only ever created for an unscheduled pod, so this is exactly the set
//!   the binding path needs. A pod the cache does not hold is fetched with a metadata-only
//!   GET, within the lookup limits.
//! - Namespaces: a metadata-only watch keeping each namespace's name and the labels the
//!   profiles read, because a profile may select on them (`istio-ambient`:
//!   `istio.io/dataplane-mode=ambient` on the namespace). A pod can only be created in a
//!   namespace that exists, so the cache has it unless its watch lags; then the decision
//!   fails closed for the profiles that read it.
//! - A node's `MeshCNIVerified` condition reason is read with a bounded GET, only to word a
//!   refusal, and remembered for a few seconds so a burst of refusals costs one GET. Only a
//!   node in the cache is ever looked up: a name the cache does not know costs no request,
//!   so reviews naming made-up nodes cannot turn into a flood of GETs.
//! - The agent DaemonSet (`--agent-daemonset`): a watch of that one object (field selector
//!   `metadata.name`, so a Role with `resourceNames` grants it), whose pod template decides
//!   which new Nodes `/mutate-node` gates ([`crate::placement`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::FutureExt as _;
use futures::StreamExt;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Namespace, Node};
use kube::api::{Api, PartialObjectMeta};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use meshgate_core::admission::LookupFailure;
use meshgate_core::profile::ProfileSet;
use meshgate_core::projection::PodKeys;
use tokio::sync::watch;

use crate::metrics::Metrics;
use crate::nodes::NodeVerdicts;
use crate::placement::{AgentDaemonSet, DaemonSetRef};
use crate::pods::{PendingPods, PodLimits};
use crate::review::{Cluster, PodMeta};

/// How long a looked-up condition reason is reused.
const REASON_TTL: Duration = Duration::from_secs(5);
/// Bound on remembered reasons; the map is cleared when full (refusals are rare).
const REASON_CAPACITY: usize = 1024;

/// Metadata caches of Nodes, Namespaces and unscheduled Pods, with bounded API fallbacks.
pub struct Caches {
    nodes: Arc<NodeVerdicts>,
    pods: Arc<PendingPods>,
    namespaces: Store<PartialObjectMeta<Namespace>>,
    agent: Store<DaemonSet>,
    agent_ref: ObjectRef<DaemonSet>,
    client: Client,
    lookup_timeout: Duration,
    reasons: Mutex<HashMap<String, (Instant, Option<String>)>>,
}

/// What the caches keep and how they look things up.
#[derive(Clone, Debug)]
pub struct Setup {
    /// Bound on each API lookup (`--lookup-timeout`).
    pub lookup_timeout: Duration,
    /// `--max-pending-pods` and the pod lookup limits.
    pub pods: PodLimits,
    /// The pod labels and annotations the profiles read.
    pub pod_keys: PodKeys,
    /// The namespace labels the profiles read.
    pub namespace_keys: BTreeSet<String>,
    /// The agent DaemonSet (`--agent-daemonset`).
    pub agent: DaemonSetRef,
}

impl Setup {
    /// The setup for `profiles`.
    pub fn new(
        profiles: &ProfileSet,
        lookup_timeout: Duration,
        pods: PodLimits,
        agent: DaemonSetRef,
    ) -> Self {
        Self {
            lookup_timeout,
            pods,
            pod_keys: PodKeys::selection(profiles),
            namespace_keys: profiles.namespace_label_keys(),
            agent,
        }
    }
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

/// A cached Namespace keeps its name and the labels profiles select on.
fn slim_namespace(ns: &mut PartialObjectMeta<Namespace>, keys: &BTreeSet<String>) {
    slim_common(ns);
    ns.metadata.annotations = None;
    if let Some(labels) = ns.metadata.labels.as_mut() {
        labels.retain(|k, _| keys.contains(k));
    }
}

/// The futures that keep the caches filled; spawn them. They run until dropped.
pub struct Watches {
    /// Drives the Namespace watch.
    pub namespaces: std::pin::Pin<Box<dyn Future<Output = ()> + Send>>,
    /// Drives the Node watch.
    pub nodes: std::pin::Pin<Box<dyn Future<Output = ()> + Send>>,
    /// Drives the unscheduled-Pod watch.
    pub pods: std::pin::Pin<Box<dyn Future<Output = ()> + Send>>,
    /// Drives the agent DaemonSet's watch.
    pub agent: std::pin::Pin<Box<dyn Future<Output = ()> + Send>>,
    /// Turns the readiness signal true once both caches listed; then finishes.
    pub synced: std::pin::Pin<Box<dyn Future<Output = ()> + Send>>,
}

impl Watches {
    /// Runs each watch in a task of its own; the caller aborts them at stop.
    pub fn spawn(self) -> [tokio::task::JoinHandle<()>; 5] {
        [
            tokio::spawn(self.namespaces),
            tokio::spawn(self.nodes),
            tokio::spawn(self.pods),
            tokio::spawn(self.agent),
            tokio::spawn(self.synced),
        ]
    }
}

/// A metadata-only watch of `K` into `writer`, retried with backoff for as long as it runs;
/// `slim` drops what the decisions never read before an object is stored.
fn metadata_watch<K>(
    api: Api<PartialObjectMeta<K>>,
    config: watcher::Config,
    slim: impl FnMut(&mut PartialObjectMeta<K>) + Send + 'static,
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

/// The metadata-only Node watch into `nodes`, retried with backoff for as long as it runs.
/// The default (most recent) list semantic lists in pages of 500: with thousands of nodes,
/// one unpaginated `resourceVersion=0` list would be buffered whole, and that buffer sets the
/// process's peak memory.
fn node_watch(
    api: Api<PartialObjectMeta<Node>>,
    nodes: Arc<NodeVerdicts>,
) -> impl Future<Output = ()> + Send + 'static {
    watcher(api, watcher::Config::default())
        .default_backoff()
        .for_each(move |ev| {
            match ev {
                Ok(ev) => nodes.apply(ev),
                Err(e) => tracing::warn!(error = %e, "node watch failed; retrying with backoff"),
            }
            futures::future::ready(())
        })
}

/// The watch of the one agent DaemonSet `agent` into `writer`, retried with backoff for as
/// long as it runs. Its managed fields are dropped; the rest is one small object.
fn agent_watch(
    client: Client,
    agent: &DaemonSetRef,
    writer: reflector::store::Writer<DaemonSet>,
) -> impl Future<Output = ()> + Send + 'static {
    let api: Api<DaemonSet> = Api::namespaced(client, &agent.namespace);
    let config = watcher::Config::default().fields(&format!("metadata.name={}", agent.name));
    watcher(api, config)
        .default_backoff()
        .modify(|ds| ds.metadata.managed_fields = None)
        .reflect(writer)
        .for_each(|ev| {
            match ev {
                Err(e) => {
                    tracing::warn!(error = %e, "agent DaemonSet watch failed; retrying with backoff")
                }
                Ok(watcher::Event::InitDone) => tracing::info!("agent DaemonSet listed"),
                Ok(_) => {}
            }
            futures::future::ready(())
        })
}

impl Caches {
    /// Builds the caches over `client`; nothing is fetched until the [`Watches`] run.
    pub fn new(
        client: Client,
        setup: Setup,
        metrics: Metrics,
        ready: watch::Sender<bool>,
    ) -> (Self, Watches) {
        let nodes = Arc::new(NodeVerdicts::default());
        let (namespaces, namespace_writer) = reflector::store::<PartialObjectMeta<Namespace>>();
        let (agent, agent_writer) = reflector::store::<DaemonSet>();
        let agent_watch = agent_watch(client.clone(), &setup.agent, agent_writer);
        let agent_ref = ObjectRef::new(&setup.agent.name).within(&setup.agent.namespace);
        let pods = Arc::new(PendingPods::new(
            client.clone(),
            setup.pod_keys,
            setup.pods,
            setup.lookup_timeout,
            metrics,
        ));
        let node_watch = node_watch(Api::all(client.clone()), nodes.clone());
        let pod_watch = pods.clone().watch();
        let namespace_keys = setup.namespace_keys;
        let namespace_watch = metadata_watch(
            Api::all(client.clone()),
            watcher::Config::default(),
            move |ns| slim_namespace(ns, &namespace_keys),
            namespace_writer,
            "namespace",
        );

        // Readiness does not wait for the agent DaemonSet: a webhook that cannot read it must
        // still gate pods; until it has listed, new Nodes are only left to their agent.
        let (n, p, ns) = (nodes.clone(), pods.clone(), namespaces.clone());
        let synced = async move {
            let ((), (), c) = futures::join!(
                n.wait_until_listed(),
                p.wait_until_listed(),
                ns.wait_until_ready()
            );
            if c.is_ok() {
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
                agent,
                agent_ref,
                client,
                lookup_timeout: setup.lookup_timeout,
                reasons: Mutex::new(HashMap::new()),
            },
            Watches {
                namespaces: Box::pin(namespace_watch),
                nodes: Box::pin(node_watch),
                pods: Box::pin(pod_watch),
                agent: Box::pin(agent_watch),
                synced: Box::pin(synced),
            },
        )
    }

    async fn fetch_reason(&self, name: &str) -> Option<String> {
        let api: Api<Node> = Api::all(self.client.clone());
        match tokio::time::timeout(self.lookup_timeout, api.get_opt(name)).await {
            Ok(Ok(Some(node))) => node
                .status
                .and_then(|s| s.conditions)
                .and_then(|cs| {
                    cs.into_iter()
                        .find(|c| c.type_ == meshgate_core::gate::CONDITION_TYPE)
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
        self.nodes.labels(name)
    }

    fn namespace_labels(&self, name: &str) -> Option<BTreeMap<String, String>> {
        self.namespaces
            .get(&ObjectRef::new(name))
            .map(|n| n.labels().clone())
    }

    async fn pod_meta(&self, namespace: &str, name: &str) -> Result<PodMeta, LookupFailure> {
        self.pods.meta(namespace, name).await
    }

    fn agent_daemonset(&self) -> AgentDaemonSet {
        // Ready once listed, and never unready again (a relist swaps the store whole).
        if !matches!(self.agent.wait_until_ready().now_or_never(), Some(Ok(()))) {
            return AgentDaemonSet::NotSynced;
        }
        match self.agent.get(&self.agent_ref) {
            Some(ds) => AgentDaemonSet::Known(ds),
            None => AgentDaemonSet::Absent,
        }
    }

    async fn node_reason(&self, name: &str) -> Option<String> {
        // Only a node in the cache is looked up (see the module doc).
        if !self.nodes.contains(name) {
            return None;
        }
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
    fn cached_namespaces_keep_only_what_is_read() {
        let mut ns: PartialObjectMeta<Namespace> = PartialObjectMeta {
            types: None,
            metadata: ObjectMeta {
                name: Some("shop".into()),
                labels: Some(
                    [
                        ("istio.io/dataplane-mode".to_string(), "ambient".to_string()),
                        ("team".to_string(), "payments".to_string()),
                    ]
                    .into(),
                ),
                annotations: Some([("a".to_string(), "b".to_string())].into()),
                managed_fields: Some(vec![Default::default()]),
                ..ObjectMeta::default()
            },
            _phantom: std::marker::PhantomData,
        };
        let keys = ProfileSet::all_builtin().namespace_label_keys();
        slim_namespace(&mut ns, &keys);
        assert_eq!(
            ns.metadata.labels,
            Some([("istio.io/dataplane-mode".to_string(), "ambient".to_string())].into())
        );
        assert!(ns.metadata.annotations.is_none() && ns.metadata.managed_fields.is_none());
    }

    /// A node the cache does not know is never looked up: no request reaches the API,
    /// however many made-up names are asked for.
    #[tokio::test]
    async fn a_node_not_in_the_cache_costs_no_request() {
        let api = crate::pods::tests::MockApi::not_found();
        let (ready, _) = watch::channel(false);
        let setup = Setup::new(
            &ProfileSet::all_builtin(),
            Duration::from_secs(1),
            PodLimits::default(),
            crate::placement::DEFAULT_AGENT_DAEMONSET.parse().unwrap(),
        );
        let metrics = Metrics::register(&mut prometheus_client::registry::Registry::default());
        // The watches are never run: the node cache stays empty.
        let (caches, _watches) = Caches::new(api.client(), setup, metrics, ready);
        for i in 0..100 {
            assert_eq!(caches.node_reason(&format!("made-up-{i}")).await, None);
        }
        assert_eq!(api.requests(), 0);
        // Nor has the agent DaemonSet been listed: /mutate-node gates nothing yet.
        assert!(matches!(
            caches.agent_daemonset(),
            AgentDaemonSet::NotSynced
        ));
    }
}
