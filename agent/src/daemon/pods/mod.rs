//! Pod inspection and eviction: the backstop for meshed pods that started before the node's
//! CNI chain was complete.
//!
//! In: a watch of this node's pods only (field selector `spec.nodeName`, listed in pages of
//! [`PAGE_SIZE`], decoded as [`slim::SlimPod`]; of each pod's labels and annotations the
//! tracker keeps only those inspection reads), a metadata-only
//! watch of Namespaces when a profile selects on namespace labels (`istio-ambient`), the
//! node's verdict (a `watch` channel fed by the verdict loop; when the node requires a node
//! proxy, a verified verdict is what lets missing proxy listeners in a pod evict it), the
//! shared state file (eviction history),
//! its [`Config`] (from `--profile`, `--profile-file`, `--dry-run`, `--no-evict`,
//! `--max-evictions-per-minute`, `--evict-unowned`), the live mode (`report` evicts nothing
//! and says "would evict"; a switch to a mode that evicts inspects every pod again), and the
//! shutdown signal. Out: Eviction
//! API calls, `MeshRedirectMissing` Pod Events, the pod metrics, and the eviction history in
//! the state file. The pod watch and the evictions go out as the node itself with
//! `--impersonate-node`, the Namespace watch and Events as the ServiceAccount
//! ([`super::clients`]).
//!
//! Flow: the watch feeds a [`tracker::Tracker`] (no periodic LIST; the watcher relists only
//! when its watch breaks). Whenever pods are due — newly running, sandbox changed, node
//! verdict changed, namespace labels changed, retry time reached — one batch is inspected
//! on the blocking pool ([`sweep::run`]: namespace survey, locate, pin, read rules with the
//! pod's annotations at hand, match). Each `missing` pod goes through `core::evict::decide`
//! (proxy container present, history, ownership, report-only flags, rate limit), whose
//! [`Decision`](meshgate_core::evict::Decision) [`act`] carries out: before the Eviction API
//! ([`eviction::evict`]) the pinned namespace is re-checked (still the one the path leads
//! to, still holding the pod's IPs), and every outcome is counted and published as a Pod
//! Event once per sandbox and outcome (through [`super::events`]).
//!
//! The pod watch is read only once the namespace watch (when there is one) has listed, so a
//! pod is selected with its namespace's labels at hand; a namespace the watch has not
//! delivered selects nothing until it does.
//!
//! Safety: `unknown` (no namespace found, unreadable rules) never evicts. A pod labelled
//! for a mesh but running none of its proxy containers is reported, never evicted, never
//! retried. A namespace that changed between inspection and eviction is `unknown`. A 429 (PDB) or a
//! 500 for several PDBs gives the rate-limit token back and retries with backoff. An accepted
//! eviction is written to the state file before anything else happens, and terminating pods
//! are never inspected, so neither a restart nor a lagging watch evicts a sandbox twice.

pub mod act;
pub mod cluster_budget;
pub mod eviction;
pub mod namespaces;
pub mod pod_info;
pub mod slim;
pub mod sweep;
pub mod tracker;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::BoxStream;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, PartialObjectMeta};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher;
use meshgate_core::cni::{ChainVerdict, Reason};
use meshgate_core::evict::{Flags, RateLimiter};
use meshgate_core::mode::Mode;
use meshgate_core::node_proxy::{NodeProxy, ProxyPod};
use meshgate_core::profile::ProfileSet;
use meshgate_core::projection::PodKeys;
use meshgate_shell::admin::LoopProgress;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::Instrument;

use super::clients::Clients;
use super::events::Events;
use super::metrics::AgentMetrics;
use super::state::Shared;
use super::timer::sleep_until;
use cluster_budget::ClusterBudget;
use namespaces::{NamespaceEvent, Namespaces};
use pod_info::PodInfo;
use slim::SlimPod;
use tracker::Tracker;

/// Pods per page of the pod list. A page's response body is held whole (two or three copies
/// of it, as the client reads it) while it is decoded, and anyone who can create pods on
/// this node decides their size (up to about 1.5 MiB each): 5 of them stay far below the
/// agent's memory limit (measured with 100 pods of 1.25 MiB: docs/reliability.md); a node's
/// 110 pods are 22 requests.
pub const PAGE_SIZE: u32 = 5;

/// A burst of pod events ends after this much quiet; then its pods are inspected together.
const BURST_QUIET: Duration = Duration::from_millis(20);
/// How long the node proxy must have been ready (the node verified) before a pod without
/// its listeners may be evicted: a proxy that just (re)connected is still opening its
/// listeners in every pod it was handed, and a restarted ztunnel must not evict them all.
/// Pods are inspected again when it ends.
const PROXY_SETTLE: Duration = Duration::from_secs(10);
/// ... or after this long, however busy the stream: detection is never delayed further.
const BURST_MAX: Duration = Duration::from_millis(250);

/// The pod inspector's configuration (built from the daemon's flags by
/// [`super::Config::from_args`]).
#[derive(Clone, Debug)]
pub struct Config {
    /// This node.
    pub node: String,
    /// The profiles whose pods are inspected.
    pub profiles: ProfileSet,
    /// What of a pod's labels and annotations the profiles and the rules read.
    pub keys: PodKeys,
    /// `--dry-run`, `--no-evict`, `--evict-unowned`.
    pub flags: Flags,
    /// `--max-evictions-per-minute`.
    pub per_minute: u32,
    /// `--cluster-eviction-budget` and its window (off at 0).
    pub cluster_budget: meshgate_core::cluster_budget::Budget,
    /// meshgate's namespace (`--namespace`), where the budget's ledger is.
    pub namespace: String,
    /// Deadline of each API call (eviction, Event).
    pub api_timeout: Duration,
    /// Where named network namespaces are bind-mounted, besides `/proc/*/ns/net`.
    pub netns_dirs: Vec<PathBuf>,
    /// The profile whose node proxy the node requires, and the proxy's record (with the
    /// `--node-proxy-*` flags over it): that profile's pods must have its listeners.
    pub node_proxy: Option<(String, NodeProxy)>,
}

/// What the inspector shares with the rest of the daemon.
pub struct Inputs {
    /// The node verdict, fed by the verdict loop.
    pub verdict: watch::Receiver<Option<ChainVerdict>>,
    /// The state file (eviction history).
    pub state: Arc<Shared>,
    /// The agent's metrics.
    pub metrics: AgentMetrics,
    /// Inspection batches run on the blocking pool, where a wedged netlink read or setns
    /// would stall every later pod: `/live` fails when one outlasts its bound.
    pub progress: LoopProgress,
    /// Turns true at shutdown.
    pub stop: watch::Receiver<bool>,
    /// The live mode (`meshgate_shell::mode`).
    pub mode: watch::Receiver<Mode>,
    /// The required node proxy's pods on this node, when there is one: the batch re-check of
    /// its connection looks in their network namespaces.
    pub node_proxy_pods: Option<watch::Receiver<Option<Vec<ProxyPod>>>>,
}

/// Spawns the inspector with `clients` (without kube's 429 retry, so a PDB refusal is seen as
/// one; the pod watch and evictions as the node with `--impersonate-node`). It stops when
/// `inputs.stop` turns true.
pub fn spawn(config: Config, clients: Clients, inputs: Inputs) -> JoinHandle<()> {
    tokio::spawn(run(config, clients, inputs).in_current_span())
}

/// The inspector's state between wake-ups.
pub struct Inspector {
    config: Config,
    /// Evictions (as the node with `--impersonate-node`).
    client: kube::Client,
    events: Events,
    state: Arc<Shared>,
    metrics: AgentMetrics,
    progress: LoopProgress,
    /// The live mode: `report` evicts nothing.
    mode: watch::Receiver<Mode>,
    /// The required node proxy's pods ([`Inputs::node_proxy_pods`]).
    node_proxy_pods: Option<watch::Receiver<Option<Vec<ProxyPod>>>>,
    tracker: Tracker,
    limiter: RateLimiter,
    /// The cluster-wide eviction budget, when on.
    cluster_budget: Option<ClusterBudget>,
    /// The clock origin: `core::evict` and the tracker take durations since it.
    origin: Instant,
    /// The node verdict last seen (verified, reason); `None` before the first.
    last_verdict: Option<(bool, Reason)>,
    /// The last verdict's message: with a node proxy it changes with the proxy's state
    /// (connected, its pods) while the reason stays the same.
    last_message: String,
    /// Since when the node has been verified (with a node proxy: since the proxy is ready).
    verified_since: Option<Instant>,
    /// Whether the pods were inspected again once the proxy settled ([`PROXY_SETTLE`]).
    settled_pass: bool,
    /// The node was verified, then lost its node proxy, and is not verified again yet.
    proxy_lost: bool,
    /// The eviction history is pruned after each complete pod list.
    prune_history: bool,
    namespaces: Namespaces,
}

/// Why the inspector woke up.
enum Wake {
    Stop,
    /// A pod event: the start of a burst.
    Pod(Result<watcher::Event<SlimPod>, watcher::Error>),
    Namespace(NamespaceEvent),
    Verdict,
    Mode,
    /// The node proxy has been ready for [`PROXY_SETTLE`].
    ProxySettled,
    /// A deferred retry or an enrollment grace is due.
    Due,
}

/// The node's pods, listed in pages and watched; decoded as `SlimPod`: what inspection
/// reads, the rest skipped while decoding.
fn pod_stream(
    clients: &Clients,
    node: &str,
) -> BoxStream<'static, Result<watcher::Event<SlimPod>, watcher::Error>> {
    let pods: Api<SlimPod> = Api::all(clients.node.clone());
    let config = watcher::Config::default()
        .fields(&format!("spec.nodeName={node}"))
        .page_size(PAGE_SIZE);
    watcher(pods, config).default_backoff().boxed()
}

/// Metadata only (PartialObjectMetadata): a namespace's labels are all a profile reads.
/// Never yields when no profile reads them.
fn namespace_stream(clients: &Clients, watched: bool) -> BoxStream<'static, NamespaceEvent> {
    if !watched {
        return futures::stream::pending().boxed();
    }
    let api: Api<PartialObjectMeta<Namespace>> = Api::all(clients.own.clone());
    watcher(api, watcher::Config::default())
        .default_backoff()
        .boxed()
}

/// Runs the inspector until `stop` turns true (or its sender is dropped).
pub async fn run(config: Config, clients: Clients, inputs: Inputs) {
    let Inputs {
        mut verdict,
        mut stop,
        mut mode,
        ..
    } = inputs;
    let mut may_evict = mode.borrow_and_update().may_evict();
    let mut pods = pod_stream(&clients, &config.node);
    let mut me = Inspector::new(
        config,
        &clients,
        inputs.state,
        inputs.metrics,
        inputs.progress,
        mode.clone(),
    );
    me.node_proxy_pods = inputs.node_proxy_pods;
    let mut namespace_events = namespace_stream(&clients, me.namespaces.watched());
    me.on_verdict(&verdict.borrow_and_update());
    let mut verdict_open = true;
    loop {
        let retry = me
            .tracker
            .next_retry(me.now())
            .map(|at| tokio::time::Instant::from_std(me.origin + at));
        let wake = tokio::select! {
            _ = stop.wait_for(|s| *s) => Wake::Stop,
            // Pods wait for the namespaces' first list: selected without their
            // namespace's labels, ambient pods would be missed until a relist.
            item = pods.next(), if me.namespaces.synced() => match item {
                Some(item) => Wake::Pod(item),
                None => Wake::Stop,
            },
            ns = namespace_events.next() => ns.map_or(Wake::Stop, Wake::Namespace),
            changed = verdict.changed(), if verdict_open => {
                verdict_open = changed.is_ok();
                Wake::Verdict
            }
            Ok(()) = mode.changed() => Wake::Mode,
            _ = sleep_until(retry) => Wake::Due,
            _ = sleep_until(me.settle_at()) => Wake::ProxySettled,
        };
        match wake {
            Wake::Stop => break,
            Wake::Pod(item) => {
                me.on_event(item);
                me.take_burst(&mut pods).await;
            }
            Wake::Namespace(ns) => me.on_namespace_event(ns),
            Wake::Verdict if verdict_open => me.on_verdict(&verdict.borrow_and_update()),
            Wake::Mode => {
                let now = mode.borrow_and_update().may_evict();
                if now && !may_evict {
                    // What report mode only reported is acted on now.
                    tracing::info!(
                        pods = me.tracker.len(),
                        "the mode evicts now; inspecting every meshed pod again"
                    );
                    me.tracker.verdict_changed();
                }
                may_evict = now;
            }
            Wake::ProxySettled => {
                me.settled_pass = true;
                me.tracker.verdict_changed();
            }
            Wake::Verdict | Wake::Due => {}
        }
        me.pass().await;
    }
    tracing::info!("pod inspector stopped");
}

impl Inspector {
    fn new(
        config: Config,
        clients: &Clients,
        state: Arc<Shared>,
        metrics: AgentMetrics,
        progress: LoopProgress,
        mode: watch::Receiver<Mode>,
    ) -> Self {
        let profiles: Vec<&str> = config.profiles.iter().map(|p| p.name.as_str()).collect();
        tracing::info!(
            profiles = ?profiles,
            dry_run = config.flags.dry_run,
            no_evict = config.flags.no_evict,
            evict_unowned = config.flags.evict_unowned,
            max_evictions_per_minute = config.per_minute,
            "inspecting this node's meshed pods"
        );
        Self {
            events: Events::new(clients.own.clone(), &config.node, config.api_timeout),
            limiter: RateLimiter::new(config.per_minute),
            cluster_budget: config.cluster_budget.is_on().then(|| {
                ClusterBudget::new(
                    clients.own.clone(),
                    &config.namespace,
                    config.cluster_budget,
                    config.api_timeout,
                )
            }),
            namespaces: Namespaces::new(config.profiles.namespace_label_keys()),
            config,
            client: clients.node.clone(),
            state,
            metrics,
            progress,
            mode,
            node_proxy_pods: None,
            tracker: Tracker::new(),
            origin: Instant::now(),
            last_verdict: None,
            last_message: String::new(),
            verified_since: None,
            settled_pass: false,
            proxy_lost: false,
            prune_history: false,
        }
    }

    fn now(&self) -> Duration {
        self.origin.elapsed()
    }

    /// Coalesces a burst (pods starting one after another, a relist), so one namespace
    /// survey serves many pods: takes events until the stream is quiet for BURST_QUIET, for
    /// at most BURST_MAX.
    async fn take_burst(
        &mut self,
        pods: &mut BoxStream<'static, Result<watcher::Event<SlimPod>, watcher::Error>>,
    ) {
        let until = tokio::time::Instant::now() + BURST_MAX;
        loop {
            let quiet = (tokio::time::Instant::now() + BURST_QUIET).min(until);
            match tokio::time::timeout_at(quiet, pods.next()).await {
                Ok(Some(item)) => self.on_event(item),
                Ok(None) | Err(_) => break,
            }
        }
    }

    fn on_verdict(&mut self, v: &Option<ChainVerdict>) {
        let Some(v) = v else { return };
        let seen = (v.verified, v.reason);
        // Once a node proxy that was ready goes away, its pods' listeners close as its
        // processes end, after the verdict changed: each later change of what the message
        // says about it (its pod gone, a new one not connected) looks at the pods again.
        if v.verified {
            self.proxy_lost = false;
        } else if self.config.node_proxy.is_some() && self.last_verdict.is_some_and(|(was, _)| was)
        {
            self.proxy_lost = true;
        }
        let proxy_changed = self.proxy_lost && v.message != self.last_message;
        if self.last_verdict.is_some_and(|last| last != seen) || proxy_changed {
            tracing::info!(reason = %v.reason, verified = v.verified, pods = self.tracker.len(), "node verdict changed; inspecting every meshed pod again");
            self.tracker.verdict_changed();
        }
        if !v.verified {
            self.verified_since = None;
        } else if self.verified_since.is_none() {
            self.verified_since = Some(Instant::now());
            self.settled_pass = false;
        }
        self.last_verdict = Some(seen);
        self.last_message.clone_from(&v.message);
    }

    /// When the node proxy will have been ready for [`PROXY_SETTLE`], if that is still to
    /// come: the pods are inspected again then, since listeners missing before it do not
    /// evict.
    fn settle_at(&self) -> Option<tokio::time::Instant> {
        let since = self
            .verified_since
            .filter(|_| self.config.node_proxy.is_some())?;
        (!self.settled_pass).then(|| tokio::time::Instant::from_std(since + PROXY_SETTLE))
    }

    /// Whether the node proxy has been ready long enough for missing listeners to evict.
    fn proxy_settled(&self) -> bool {
        self.verified_since
            .is_some_and(|since| since.elapsed() >= PROXY_SETTLE)
    }

    fn on_namespace_event(&mut self, item: NamespaceEvent) {
        let was_synced = self.namespaces.synced();
        let changes = match self.namespaces.apply(item) {
            Ok(changes) => changes,
            Err(e) => {
                self.metrics.api_error("watch");
                tracing::warn!(error = %e, "namespace watch error; retrying with backoff");
                return;
            }
        };
        let now = self.now();
        for c in changes {
            let labels = c.labels.as_ref();
            let (profiles, name) = (&self.config.profiles, c.name.as_str());
            let changed =
                self.tracker
                    .reselect_namespace(name, profiles, labels, c.known_before, now);
            if changed > 0 {
                tracing::info!(namespace = name, labels = ?labels, pods = changed, "namespace labels changed which profiles select its pods");
            }
        }
        if !was_synced && self.namespaces.synced() {
            tracing::info!(
                namespaces = self.namespaces.len(),
                "namespace list complete"
            );
        }
    }

    fn on_event(&mut self, item: Result<watcher::Event<SlimPod>, watcher::Error>) {
        let now = self.now();
        match item {
            Ok(watcher::Event::Init) => self.tracker.start_list(),
            Ok(watcher::Event::InitApply(pod) | watcher::Event::Apply(pod)) => {
                let namespace = pod.metadata.meta.namespace.as_deref().unwrap_or_default();
                let labels = self.namespaces.labels(namespace);
                let (profiles, keys) = (&self.config.profiles, &self.config.keys);
                if let Some(info) = PodInfo::from_pod(&pod, profiles, keys, labels) {
                    self.tracker.apply(info, now);
                }
            }
            Ok(watcher::Event::Delete(pod)) => {
                if let Some(uid) = pod.metadata.meta.uid.as_deref() {
                    self.tracker.delete(uid);
                }
            }
            Ok(watcher::Event::InitDone) => {
                self.tracker.finish_list();
                self.prune_history = true;
                tracing::debug!(pods = self.tracker.len(), "pod list complete");
            }
            Err(e) => {
                self.metrics.api_error("watch");
                tracing::warn!(error = %e, "pod watch error; retrying with backoff")
            }
        }
    }
}
