//! Unscheduled pods, as the binding path needs them: a projected, capped cache kept by a
//! metadata watch, and the bounded lookup of a pod the cache does not hold.
//!
//! In: watch events of unscheduled pods' metadata (field selector `spec.nodeName=`), the
//! [`PodKeys`] the profiles read, the [`PodLimits`] flags, and a kube `Client` for lookups.
//! Out: [`PendingPods::meta`]: a pod's projected labels and annotations, or the
//! [`LookupFailure`] that makes a binding to an unverified node fail closed; the
//! `meshgate_pod_lookups_total` and `meshgate_pod_cache_overflow_total` metrics.
//!
//! Memory is bounded three ways, because anyone who can create pods decides their size:
//! - each cached pod keeps only the keys the profiles read (values bounded as
//!   `core::projection` says), so `kubectl apply`'s copy of the object and any other bulk is
//!   dropped as the pod arrives;
//! - the watch lists in pages of [`PAGE_SIZE`]: a page is held whole while it is decoded, so
//!   the page size, not the number of pods, sets the peak of a (re)list; and a pod's labels
//!   and annotations are decoded as their JSON text ([`SlimMeta`]), one allocation each, from
//!   which only the kept keys are read, instead of as maps of thousands of small strings;
//! - at most `--max-pending-pods` pods are cached (twice that during a relist, when the old
//!   list keeps serving until the new one is complete). Past the cap a pod is not cached,
//!   counted in `meshgate_pod_cache_overflow_total` and logged; a binding naming it is looked
//!   up instead, within the lookup limits below, and fails closed on an unverified node when
//!   it cannot be (a verified node needs no lookup).
//!
//! Lookups are bounded by `core::lookup` (a pod the API just did not find is remembered for a
//! few seconds; at most `--pod-lookups-per-second`) and by `--max-pod-lookups-in-flight`,
//! each by `--lookup-timeout`. A lookup refused by a limit costs the apiserver nothing.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kube::Client;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use meshgate_core::admission::LookupFailure;
use meshgate_core::lookup::{self, Admit, Gate};
use meshgate_core::projection::PodKeys;
use meshgate_shell::meta::SlimMeta;
use serde::Deserialize;
use tokio::sync::{Semaphore, watch};

use crate::metrics::{LookupOutcome, Metrics};
use crate::review::PodMeta;

/// Pods per page of the unscheduled-pod list. A pod's metadata can be up to about 1.5 MiB
/// (256 KiB of annotations, the rest labels and managed fields), and a page is held about
/// three times over while it is decoded (the body, a copy of it, the labels' and
/// annotations' text): 10 such pods stay far below the memory limit (docs/reliability.md).
/// 1,000 pending pods are 100 requests at a relist.
pub const PAGE_SIZE: u32 = 10;
/// Default `--max-pending-pods`.
pub const DEFAULT_MAX_PENDING_PODS: usize = 50_000;
/// Default `--max-pod-lookups-in-flight`.
pub const DEFAULT_MAX_LOOKUPS_IN_FLIGHT: usize = 8;
/// A throttled lookup is logged as a warning at most this often (with the count since);
/// the metric counts every one.
const THROTTLE_LOG_EVERY: Duration = Duration::from_secs(10);

/// Bounds on what the webhook keeps and looks up about unscheduled pods.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::Args)]
pub struct PodLimits {
    /// Most unscheduled pods kept in the cache. Past it a pod is not cached: a binding of it
    /// is looked up (within the limits below) or, when it cannot be, refused on an
    /// unverified node.
    #[arg(long, env = "MESHGATE_MAX_PENDING_PODS", default_value_t = DEFAULT_MAX_PENDING_PODS)]
    pub max_pending_pods: usize,
    /// API lookups per second of pods a binding names that the cache does not hold (at most
    /// one second's worth at once); past it such a binding to an unverified node is refused
    /// without a lookup. 0: never look up.
    #[arg(long, env = "MESHGATE_POD_LOOKUPS_PER_SECOND", default_value_t = lookup::DEFAULT_PER_SECOND)]
    pub pod_lookups_per_second: u32,
    /// Most such lookups in flight at once; past it, refused the same way.
    #[arg(long, env = "MESHGATE_MAX_POD_LOOKUPS_IN_FLIGHT", default_value_t = DEFAULT_MAX_LOOKUPS_IN_FLIGHT)]
    pub max_pod_lookups_in_flight: usize,
}

impl Default for PodLimits {
    fn default() -> Self {
        Self {
            max_pending_pods: DEFAULT_MAX_PENDING_PODS,
            pod_lookups_per_second: lookup::DEFAULT_PER_SECOND,
            max_pod_lookups_in_flight: DEFAULT_MAX_LOOKUPS_IN_FLIGHT,
        }
    }
}

/// An unscheduled pod's metadata, as the list, the watch and a lookup decode it: listed and
/// fetched metadata-only (`PartialObjectMetadata`), its labels and annotations left as text.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct PendingPod {
    /// `metadata`.
    #[serde(default)]
    pub metadata: SlimMeta,
}

// Listed, watched and fetched at the Pod's URL, metadata only.
meshgate_shell::pod_view!(PendingPod, metadata_only = true);

/// `namespace/name`: a pod's key in the cache and the gate (names hold no `/`).
fn key(namespace: &str, name: &str) -> String {
    format!("{namespace}/{name}")
}

/// A watched pod's key; `None` without a name or namespace (never from the API).
fn pod_key(pod: &PendingPod) -> Option<String> {
    let m = &pod.metadata.meta;
    Some(key(m.namespace.as_deref()?, m.name.as_deref()?))
}

/// The cached pods.
#[derive(Default)]
struct Store {
    live: HashMap<String, PodMeta>,
    /// The (re)list in progress; `live` keeps serving until it is complete.
    relist: Option<HashMap<String, PodMeta>>,
    /// True while pods are being left out for the cap (logged once per episode).
    full: bool,
}

/// Unscheduled pods: the cache and the lookups. Shared by the watch and the reviewer.
pub struct PendingPods {
    keys: PodKeys,
    cap: usize,
    store: RwLock<Store>,
    listed: watch::Sender<bool>,
    client: Client,
    lookup_timeout: Duration,
    gate: Mutex<Gate>,
    in_flight: Semaphore,
    origin: Instant,
    /// When a throttled lookup was last logged as a warning, and how many since.
    throttled: Mutex<(Option<Instant>, u64)>,
    metrics: Metrics,
}

impl PendingPods {
    /// An empty cache; nothing is fetched until [`Self::watch`] runs.
    pub fn new(
        client: Client,
        keys: PodKeys,
        limits: PodLimits,
        lookup_timeout: Duration,
        metrics: Metrics,
    ) -> Self {
        Self {
            keys,
            cap: limits.max_pending_pods,
            store: RwLock::new(Store::default()),
            listed: watch::channel(false).0,
            client,
            lookup_timeout,
            gate: Mutex::new(Gate::new(lookup::Limits {
                per_second: limits.pod_lookups_per_second,
                ..lookup::Limits::default()
            })),
            in_flight: Semaphore::new(limits.max_pod_lookups_in_flight),
            origin: Instant::now(),
            throttled: Mutex::new((None, 0)),
            metrics,
        }
    }

    /// Keeps the cache filled from a metadata watch of unscheduled pods, retried with backoff
    /// for as long as it runs.
    pub fn watch(self: Arc<Self>) -> impl Future<Output = ()> + Send + 'static {
        let api: Api<PendingPod> = Api::all(self.client.clone());
        let config = watcher::Config::default()
            .fields("spec.nodeName=")
            .page_size(PAGE_SIZE);
        watcher(api, config).default_backoff().for_each(move |ev| {
            match ev {
                Ok(ev) => self.apply(ev),
                Err(e) => {
                    tracing::warn!(error = %e, "pod watch failed; retrying with backoff")
                }
            }
            futures::future::ready(())
        })
    }

    /// Resolves once the first list is complete.
    pub async fn wait_until_listed(&self) {
        let mut rx = self.listed.subscribe();
        let _ = rx.wait_for(|listed| *listed).await;
    }

    /// Number of cached pods (logs, tests).
    pub fn len(&self) -> usize {
        self.read().live.len()
    }

    /// True when no pod is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Store> {
        self.store.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Store> {
        self.store.write().unwrap_or_else(|p| p.into_inner())
    }

    /// What the profiles read of a pod's metadata; `None` when its labels or annotations
    /// are not maps of strings (never from the API: such a pod is not cached, and its lookup
    /// fails closed).
    fn project(&self, pod: &PendingPod) -> Option<PodMeta> {
        let m = &pod.metadata;
        let projected = self
            .keys
            .project_labels_json(m.labels_json())
            .and_then(|labels| {
                let annotations = self.keys.project_annotations_json(m.annotations_json())?;
                Ok(PodMeta {
                    labels,
                    annotations,
                })
            });
        match projected {
            Ok(meta) => Some(meta),
            Err(e) => {
                tracing::warn!(pod = ?pod_key(pod), error = %e, "pod metadata not understood; not cached");
                None
            }
        }
    }

    /// Applies one watch event.
    pub fn apply(&self, event: watcher::Event<PendingPod>) {
        match event {
            watcher::Event::Init => self.write().relist = Some(HashMap::new()),
            watcher::Event::InitApply(pod) => self.insert(&pod, true),
            watcher::Event::InitDone => {
                let mut store = self.write();
                if let Some(listed) = store.relist.take() {
                    store.live = listed;
                }
                let pods = store.live.len();
                if pods < self.cap {
                    store.full = false;
                }
                drop(store);
                if !*self.listed.borrow() {
                    tracing::info!(pods, "pending pods listed");
                }
                self.listed.send_replace(true);
            }
            watcher::Event::Apply(pod) => self.insert(&pod, false),
            watcher::Event::Delete(pod) => {
                if let Some(k) = pod_key(&pod) {
                    let mut store = self.write();
                    store.live.remove(&k);
                    if store.full && store.live.len() < self.cap {
                        store.full = false;
                        tracing::info!(cap = self.cap, "pending-pod cache below its cap again");
                    }
                }
            }
        }
    }

    /// Caches a pod (in the relist in progress when `listing`), unless that would pass the
    /// cap; a pod already cached is always updated.
    fn insert(&self, pod: &PendingPod, listing: bool) {
        let (Some(k), Some(meta)) = (pod_key(pod), self.project(pod)) else {
            return;
        };
        let mut store = self.write();
        let store = &mut *store;
        let map = match (listing, store.relist.as_mut()) {
            (true, Some(relist)) => relist,
            _ => &mut store.live,
        };
        if map.len() < self.cap || map.contains_key(&k) {
            map.insert(k, meta);
            return;
        }
        self.metrics.pod_cache_overflow();
        if !store.full {
            store.full = true;
            tracing::warn!(
                cap = self.cap,
                "pending-pod cache full (--max-pending-pods): pods past it are not cached; a \
                 binding naming one is looked up within --pod-lookups-per-second, else refused \
                 on an unverified node"
            );
        }
    }

    /// The pod's projected labels and annotations: from the cache, else from a bounded API
    /// lookup, else why not.
    pub async fn meta(&self, namespace: &str, name: &str) -> Result<PodMeta, LookupFailure> {
        let k = key(namespace, name);
        if let Some(m) = self.read().live.get(&k) {
            return Ok(m.clone());
        }
        let admit = {
            let mut gate = self.gate.lock().unwrap_or_else(|p| p.into_inner());
            let now = self.origin.elapsed();
            gate.admit(&k, now)
        };
        match admit {
            Admit::KnownMissing => {
                self.metrics.pod_lookup(LookupOutcome::KnownMissing);
                return Err(LookupFailure::NotFound);
            }
            Admit::RateLimited => return Err(self.throttled(LookupOutcome::RateLimited, &k)),
            Admit::Lookup => {}
        }
        let Ok(_permit) = self.in_flight.try_acquire() else {
            return Err(self.throttled(LookupOutcome::InFlightLimit, &k));
        };
        let api: Api<PendingPod> = Api::namespaced(self.client.clone(), namespace);
        let got = tokio::time::timeout(self.lookup_timeout, api.get_opt(name)).await;
        let gate = || self.gate.lock().unwrap_or_else(|p| p.into_inner());
        match got {
            Ok(Ok(Some(pod))) => {
                gate().found(&k);
                self.metrics.pod_lookup(LookupOutcome::Found);
                self.project(&pod).ok_or(LookupFailure::Failed)
            }
            Ok(Ok(None)) => {
                gate().not_found(&k, self.origin.elapsed());
                self.metrics.pod_lookup(LookupOutcome::NotFound);
                tracing::info!(
                    namespace,
                    pod = name,
                    "binding for a pod that does not exist"
                );
                Err(LookupFailure::NotFound)
            }
            Ok(Err(e)) => {
                self.metrics.pod_lookup(LookupOutcome::Failed);
                tracing::warn!(namespace, pod = name, error = %e, "pod lookup failed");
                Err(LookupFailure::Failed)
            }
            Err(_) => {
                self.metrics.pod_lookup(LookupOutcome::Failed);
                tracing::warn!(namespace, pod = name, timeout = ?self.lookup_timeout, "pod lookup timed out");
                Err(LookupFailure::Failed)
            }
        }
    }

    /// Counts a lookup a limit refused, and warns at most every [`THROTTLE_LOG_EVERY`].
    fn throttled(&self, outcome: LookupOutcome, key: &str) -> LookupFailure {
        self.metrics.pod_lookup(outcome);
        let mut t = self.throttled.lock().unwrap_or_else(|p| p.into_inner());
        t.1 += 1;
        let due = t.0.is_none_or(|at| at.elapsed() >= THROTTLE_LOG_EVERY);
        if due {
            tracing::warn!(
                pod = key,
                refused = t.1,
                limit = outcome.as_str(),
                "pod lookups throttled: bindings of pods the cache does not hold are refused on \
                 unverified nodes without a lookup"
            );
            *t = (Some(Instant::now()), 0);
        } else {
            tracing::debug!(pod = key, limit = outcome.as_str(), "pod lookup throttled");
        }
        LookupFailure::Throttled
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use meshgate_core::profile::ProfileSet;
    use prometheus_client::registry::Registry;
    use serde_json::{Value, json};
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";
    const MESH: &str = "linkerd.io/control-plane-ns";

    /// An API server made of a map (request path → object; anything else is 404) that
    /// answers after `delay` and counts the requests it gets.
    pub(crate) struct MockApi {
        requests: Arc<AtomicUsize>,
        objects: Arc<HashMap<String, Value>>,
        delay: Duration,
    }

    impl MockApi {
        pub(crate) fn not_found() -> Self {
            Self::new(HashMap::new(), Duration::ZERO)
        }

        fn new(objects: HashMap<String, Value>, delay: Duration) -> Self {
            Self {
                requests: Arc::new(AtomicUsize::new(0)),
                objects: Arc::new(objects),
                delay,
            }
        }

        pub(crate) fn client(&self) -> Client {
            let (requests, objects, delay) =
                (self.requests.clone(), self.objects.clone(), self.delay);
            let service = tower::service_fn(move |req: http::Request<kube::client::Body>| {
                requests.fetch_add(1, Ordering::SeqCst);
                let found = objects.get(req.uri().path()).cloned();
                async move {
                    tokio::time::sleep(delay).await;
                    let (status, body) = match found {
                        Some(v) => (200, v),
                        None => (
                            404,
                            json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                   "reason": "NotFound", "code": 404, "message": "not found"}),
                        ),
                    };
                    http::Response::builder()
                        .status(status)
                        .header("content-type", "application/json")
                        .body(kube::client::Body::from(serde_json::to_vec(&body).unwrap()))
                }
            });
            Client::new(service, "default")
        }

        pub(crate) fn requests(&self) -> usize {
            self.requests.load(Ordering::SeqCst)
        }
    }

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// A pod's metadata as the API sends it (`PartialObjectMetadata`).
    fn pod_json(name: &str, labels: &[(&str, &str)], annotations: &[(&str, &str)]) -> Value {
        json!({
            "apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
            "metadata": {"name": name, "namespace": "shop", "labels": map(labels),
                         "annotations": map(annotations),
                         "managedFields": [{"manager": "kubectl", "operation": "Apply"}]}
        })
    }

    fn pod(name: &str, labels: &[(&str, &str)], annotations: &[(&str, &str)]) -> PendingPod {
        serde_json::from_str(&pod_json(name, labels, annotations).to_string()).unwrap()
    }

    fn pending(api: &MockApi, limits: PodLimits) -> (Arc<PendingPods>, Registry) {
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        let keys = PodKeys::selection(&ProfileSet::all_builtin());
        let pods = PendingPods::new(api.client(), keys, limits, Duration::from_secs(1), metrics);
        (Arc::new(pods), registry)
    }

    fn metrics(registry: &Registry) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, registry).unwrap();
        out
    }

    fn listed(p: &PendingPods, pods: Vec<PendingPod>) {
        p.apply(watcher::Event::Init);
        for pod in pods {
            p.apply(watcher::Event::InitApply(pod));
        }
        p.apply(watcher::Event::InitDone);
    }

    /// A fat pod (kubectl's 256 KiB copy of the object, a long sidecar status) is cached as
    /// the few keys the profiles read, and a binding of it costs no request.
    #[tokio::test]
    async fn cached_pods_keep_only_what_the_profiles_read() {
        let api = MockApi::not_found();
        let (p, _) = pending(&api, PodLimits::default());
        let fat = "x".repeat(256 * 1024);
        listed(
            &p,
            vec![pod(
                "web",
                &[(MESH, "linkerd"), ("app", "web")],
                &[(LAST_APPLIED, &fat), ("sidecar.istio.io/status", &fat)],
            )],
        );
        let m = p.meta("shop", "web").await.unwrap();
        assert_eq!(m.labels, map(&[(MESH, "")]));
        assert_eq!(m.annotations, map(&[("sidecar.istio.io/status", "")]));
        assert_eq!(api.requests(), 0);
        tokio::time::timeout(Duration::from_secs(1), p.wait_until_listed())
            .await
            .expect("listed");
    }

    /// Past `--max-pending-pods` a pod is not cached but counted; one already cached is
    /// still updated, and a deletion makes room again. A pod left out is looked up.
    #[tokio::test]
    async fn the_cache_is_capped_and_counts_what_it_leaves_out() {
        let api = MockApi::not_found();
        let limits = PodLimits {
            max_pending_pods: 2,
            ..PodLimits::default()
        };
        let (p, registry) = pending(&api, limits);
        listed(
            &p,
            vec![
                pod("a", &[(MESH, "l")], &[]),
                pod("b", &[], &[]),
                pod("c", &[(MESH, "l")], &[]),
            ],
        );
        assert_eq!(p.len(), 2);
        assert!(metrics(&registry).contains("meshgate_pod_cache_overflow_total 1"));
        assert_eq!(p.meta("shop", "c").await, Err(LookupFailure::NotFound));
        assert_eq!(api.requests(), 1);

        p.apply(watcher::Event::Apply(pod("b", &[(MESH, "l")], &[])));
        assert_eq!(
            p.meta("shop", "b").await.unwrap().labels,
            map(&[(MESH, "")])
        );
        p.apply(watcher::Event::Apply(pod("d", &[], &[])));
        assert_eq!(p.len(), 2);
        assert!(metrics(&registry).contains("meshgate_pod_cache_overflow_total 2"));
        p.apply(watcher::Event::Delete(pod("a", &[], &[])));
        p.apply(watcher::Event::Apply(pod("d", &[], &[])));
        assert_eq!(p.len(), 2);
        assert!(p.meta("shop", "d").await.is_ok());
        assert_eq!(api.requests(), 1, "b and d came from the cache");
    }

    /// During a relist the previous list keeps answering; once the new one is complete it
    /// replaces it whole.
    #[tokio::test]
    async fn a_relist_serves_the_old_list_until_the_new_one_is_complete() {
        let api = MockApi::not_found();
        let (p, _) = pending(&api, PodLimits::default());
        listed(&p, vec![pod("a", &[], &[])]);
        p.apply(watcher::Event::Init);
        p.apply(watcher::Event::InitApply(pod("b", &[], &[])));
        assert!(p.meta("shop", "a").await.is_ok());
        assert_eq!(api.requests(), 0);
        p.apply(watcher::Event::InitDone);
        assert!(p.meta("shop", "b").await.is_ok());
        assert_eq!(p.meta("shop", "a").await, Err(LookupFailure::NotFound));
        assert_eq!(api.requests(), 1);
    }

    /// A pod the watch has not delivered yet is found by a lookup, projected like a cached
    /// one.
    #[tokio::test]
    async fn a_pod_the_watch_has_not_delivered_is_looked_up() {
        let found = pod_json("new", &[(MESH, "linkerd")], &[(LAST_APPLIED, "{}")]);
        let api = MockApi::new(
            [("/api/v1/namespaces/shop/pods/new".to_string(), found)].into(),
            Duration::ZERO,
        );
        let (p, registry) = pending(&api, PodLimits::default());
        let m = p.meta("shop", "new").await.unwrap();
        assert_eq!(m.labels, map(&[(MESH, "")]));
        assert!(m.annotations.is_empty());
        assert_eq!(api.requests(), 1);
        assert!(metrics(&registry).contains("meshgate_pod_lookups_total{outcome=\"found\"} 1"));
    }

    /// Forged bindings naming 100 made-up pods cost 5 GETs at 5 lookups a second; the rest
    /// are refused as throttled without a request. A name the API just did not find is
    /// answered from memory.
    #[tokio::test]
    async fn forged_names_cost_at_most_the_rate_and_a_missing_pod_one_request() {
        let api = MockApi::not_found();
        let limits = PodLimits {
            pod_lookups_per_second: 5,
            ..PodLimits::default()
        };
        let (p, registry) = pending(&api, limits);
        let mut not_found = 0;
        for i in 0..100 {
            match p.meta("shop", &format!("forged-{i}")).await {
                Err(LookupFailure::NotFound) => not_found += 1,
                Err(LookupFailure::Throttled) => {}
                other => panic!("forged-{i}: {other:?}"),
            }
        }
        assert_eq!((not_found, api.requests()), (5, 5));
        for _ in 0..20 {
            assert_eq!(
                p.meta("shop", "forged-0").await,
                Err(LookupFailure::NotFound)
            );
        }
        assert_eq!(api.requests(), 5);
        let text = metrics(&registry);
        for line in [
            "meshgate_pod_lookups_total{outcome=\"not_found\"} 5",
            "meshgate_pod_lookups_total{outcome=\"rate_limited\"} 95",
            "meshgate_pod_lookups_total{outcome=\"known_missing\"} 20",
        ] {
            assert!(text.contains(line), "{text}");
        }
    }

    /// With the API slow, lookups past `--max-pod-lookups-in-flight` are refused at once
    /// instead of piling up.
    #[tokio::test]
    async fn lookups_in_flight_are_capped() {
        let api = MockApi::new(HashMap::new(), Duration::from_millis(300));
        let limits = PodLimits {
            max_pod_lookups_in_flight: 2,
            pod_lookups_per_second: 1000,
            ..PodLimits::default()
        };
        let (p, registry) = pending(&api, limits);
        let started = Instant::now();
        let results = futures::future::join_all((0..10).map(|i| {
            let p = p.clone();
            async move { p.meta("shop", &format!("slow-{i}")).await }
        }))
        .await;
        let throttled = results
            .iter()
            .filter(|r| **r == Err(LookupFailure::Throttled))
            .count();
        assert_eq!(throttled, 8, "{results:?}");
        assert_eq!(api.requests(), 2);
        assert!(started.elapsed() < Duration::from_secs(1));
        assert!(
            metrics(&registry)
                .contains("meshgate_pod_lookups_total{outcome=\"in_flight_limit\"} 8")
        );
    }
}
