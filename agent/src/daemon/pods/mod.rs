//! Pod inspection and eviction: the backstop for meshed pods that started before the node's
//! CNI chain was complete.
//!
//! In: a watch of this node's pods only (field selector `spec.nodeName`, listed in pages of
//! [`PAGE_SIZE`], decoded as [`slim::SlimPod`]; of each pod's labels and annotations the
//! tracker keeps only those inspection reads), a metadata-only
//! watch of Namespaces when a profile selects on namespace labels (`istio-ambient`), the
//! node's verdict
//! (a `watch` channel fed by the verdict loop), the shared state file (eviction history),
//! the flags `--profile`, `--profile-file`, `--dry-run`, `--no-evict`,
//! `--max-evictions-per-minute`, `--evict-unowned`, and the shutdown signal. Out: Eviction
//! API calls, `MeshRedirectMissing` Pod Events, the pod metrics, and the eviction history in
//! the state file. The pod watch and the evictions go out as the node itself with
//! `--impersonate-node`, the Namespace watch and Events as the ServiceAccount
//! ([`super::clients`]).
//!
//! Flow: the watch feeds a [`tracker::Tracker`] (no periodic LIST; the watcher relists only
//! when its watch breaks). Whenever pods are due — newly running, sandbox changed, node
//! verdict changed, namespace labels changed, retry time reached — one batch is inspected
//! on the blocking pool ([`inspect::run`]: namespace survey, locate, pin, read rules with the
//! pod's annotations at hand, match). Each `missing` pod goes through `core::evict::decide`
//! (proxy container present, history, ownership, report-only flags, rate limit); before the
//! Eviction API ([`eviction::evict`]) the pinned namespace is re-checked (still the one the
//! path leads to, still holding the pod's IPs), and every decision is counted and published
//! as a Pod Event once per sandbox and outcome.
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

pub mod eviction;
pub mod inspect;
pub mod slim;
pub mod tracker;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;
use futures::stream::BoxStream;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, PartialObjectMeta};
use kube::runtime::WatchStreamExt;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::watcher;
use meshgate_core::cni::{ChainVerdict, Reason};
use meshgate_core::evict::{self, Candidate, Decision, Flags, RateLimiter, SandboxKey, SkipWhy};
use meshgate_core::profile::ProfileSet;
use meshgate_core::projection::PodKeys;
use meshgate_core::rules::RedirectVerdict;
use meshgate_shell::admin::LoopProgress;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::Args;
use super::clients::Clients;
use super::metrics::AgentMetrics;
use super::state::Shared;
use crate::netns::{DEFAULT_NETNS_DIR, Pinned};
use eviction::{Answer, Outcome};
use inspect::{Inspected, Job};
use slim::SlimPod;
use tracker::{Due, PodInfo, Tracker};

/// Pods per page of the pod list. A page's response body is held whole (two or three copies
/// of it, as the client reads it) while it is decoded, and anyone who can create pods on
/// this node decides their size (up to about 1.5 MiB each): 5 of them stay far below the
/// agent's memory limit (measured with 100 pods of 1.25 MiB: docs/reliability.md); a node's
/// 110 pods are 22 requests.
pub const PAGE_SIZE: u32 = 5;

/// A burst of pod events ends after this much quiet; then its pods are inspected together.
const BURST_QUIET: Duration = Duration::from_millis(20);
/// ... or after this long, however busy the stream: detection is never delayed further.
const BURST_MAX: Duration = Duration::from_millis(250);

/// The pod inspector's configuration, from the daemon's flags.
#[derive(Clone, Debug)]
pub struct Setup {
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
    /// Deadline of each API call (eviction, Event).
    pub api_timeout: Duration,
    /// Where named network namespaces are bind-mounted, besides `/proc/*/ns/net`.
    pub netns_dirs: Vec<PathBuf>,
}

impl Setup {
    /// Reads the flags; fails on an unreadable profile file or an unknown `--profile`, so a
    /// typo stops the agent at start instead of silently inspecting nothing.
    pub fn from_args(args: &Args) -> anyhow::Result<Self> {
        let profiles = args.common.load_profiles()?;
        Ok(Self {
            node: args.node_name.clone(),
            keys: PodKeys::inspection(&profiles),
            profiles,
            flags: Flags {
                dry_run: args.dry_run,
                no_evict: args.no_evict,
                evict_unowned: args.evict_unowned,
            },
            per_minute: args.max_evictions_per_minute,
            api_timeout: args.api_timeout,
            netns_dirs: vec![PathBuf::from(DEFAULT_NETNS_DIR)],
        })
    }
}

/// Starts the pod inspector for `args`: reads its flags, builds its clients (without kube's
/// 429 retry, so a PDB refusal is seen as one; the pod watch and evictions as the node with
/// `--impersonate-node`), and spawns it. It stops when `stop` turns true.
pub async fn spawn(
    args: &Args,
    verdict: watch::Receiver<Option<ChainVerdict>>,
    state: Arc<Shared>,
    metrics: AgentMetrics,
    progress: LoopProgress,
    stop: watch::Receiver<bool>,
) -> anyhow::Result<JoinHandle<()>> {
    let setup = Setup::from_args(args)?;
    let clients = Clients::build(
        args.common.kubeconfig.as_deref(),
        &args.node_name,
        args.impersonate_node,
        false,
    )
    .await
    .context("building the pod inspector's clients")?;
    Ok(tokio::spawn(run(
        setup, clients, verdict, state, metrics, progress, stop,
    )))
}

/// The inspector's state between wake-ups.
struct Inspector {
    setup: Setup,
    /// Evictions (as the node with `--impersonate-node`).
    client: kube::Client,
    recorder: Recorder,
    state: Arc<Shared>,
    metrics: AgentMetrics,
    /// Inspection batches run on the blocking pool, where a wedged netlink read or setns
    /// would stall every later pod: `/live` fails when one outlasts its bound.
    progress: LoopProgress,
    tracker: Tracker,
    limiter: RateLimiter,
    /// The clock origin: `core::evict` and the tracker take durations since it.
    origin: Instant,
    /// The node verdict last seen (verified, reason); `None` before the first.
    last_verdict: Option<(bool, Reason)>,
    /// The eviction history is pruned after each complete pod list.
    prune_history: bool,
    /// Namespace name → its labels, only the keys the profiles read.
    namespaces: HashMap<String, BTreeMap<String, String>>,
    /// The namespace watch's (re)list in progress.
    namespace_relist: Option<HashMap<String, BTreeMap<String, String>>>,
    /// The namespace label keys the profiles read; empty: no namespace watch.
    namespace_keys: BTreeSet<String>,
    /// True once the namespace watch listed (or when there is none).
    namespaces_synced: bool,
}

/// A Namespace event, reduced to what the inspector keeps.
type NamespaceEvent = Result<watcher::Event<PartialObjectMeta<Namespace>>, watcher::Error>;

/// Runs the inspector until `stop` turns true (or its sender is dropped).
pub async fn run(
    setup: Setup,
    clients: Clients,
    mut verdict: watch::Receiver<Option<ChainVerdict>>,
    state: Arc<Shared>,
    metrics: AgentMetrics,
    progress: LoopProgress,
    mut stop: watch::Receiver<bool>,
) {
    let node = setup.node.clone();
    let profiles: Vec<&str> = setup.profiles.iter().map(|p| p.name.as_str()).collect();
    tracing::info!(
        node = %node,
        profiles = ?profiles,
        dry_run = setup.flags.dry_run,
        no_evict = setup.flags.no_evict,
        evict_unowned = setup.flags.evict_unowned,
        max_evictions_per_minute = setup.per_minute,
        "inspecting this node's meshed pods"
    );
    // Decoded as `SlimPod`: what inspection reads, the rest skipped while decoding.
    let pods: Api<SlimPod> = Api::all(clients.node.clone());
    let config = watcher::Config::default()
        .fields(&format!("spec.nodeName={node}"))
        .page_size(PAGE_SIZE);
    let mut stream = std::pin::pin!(watcher(pods, config).default_backoff());
    let namespace_keys = setup.profiles.namespace_label_keys();
    // Metadata only (PartialObjectMetadata): a namespace's labels are all a profile reads.
    let mut namespace_stream: BoxStream<'static, NamespaceEvent> = if namespace_keys.is_empty() {
        futures::stream::pending().boxed()
    } else {
        let api: Api<PartialObjectMeta<Namespace>> = Api::all(clients.own.clone());
        watcher(api, watcher::Config::default())
            .default_backoff()
            .boxed()
    };
    let mut me = Inspector {
        recorder: Recorder::new(
            clients.own.clone(),
            Reporter {
                controller: "meshgate-agent".into(),
                instance: Some(node.clone()),
            },
        ),
        limiter: RateLimiter::new(setup.per_minute),
        setup,
        client: clients.node,
        state,
        metrics,
        progress,
        tracker: Tracker::new(),
        origin: Instant::now(),
        last_verdict: None,
        prune_history: false,
        namespaces: HashMap::new(),
        namespace_relist: None,
        namespaces_synced: namespace_keys.is_empty(),
        namespace_keys,
    };
    me.on_verdict(&verdict.borrow_and_update());
    let mut verdict_open = true;

    loop {
        let retry = me
            .tracker
            .next_retry(me.now())
            .map(|at| tokio::time::Instant::from_std(me.origin + at));
        let burst = tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            // Pods wait for the namespaces' first list: selected without their
            // namespace's labels, ambient pods would be missed until a relist.
            item = stream.next(), if me.namespaces_synced => {
                let Some(item) = item else { break };
                me.on_event(item);
                true
            }
            ns = namespace_stream.next() => {
                let Some(ns) = ns else { break };
                me.on_namespace_event(ns);
                false
            }
            changed = verdict.changed(), if verdict_open => {
                match changed {
                    Ok(()) => me.on_verdict(&verdict.borrow_and_update()),
                    Err(_) => verdict_open = false,
                }
                false
            }
            _ = sleep_until(retry) => false,
        };
        if burst {
            // Coalesce a burst (pods starting one after another, a relist), so one
            // namespace survey serves many pods: take events until the stream is quiet for
            // BURST_QUIET, for at most BURST_MAX.
            let until = tokio::time::Instant::now() + BURST_MAX;
            loop {
                let quiet = (tokio::time::Instant::now() + BURST_QUIET).min(until);
                match tokio::time::timeout_at(quiet, stream.next()).await {
                    Ok(Some(item)) => me.on_event(item),
                    Ok(None) | Err(_) => break,
                }
            }
        }
        me.work().await;
    }
    tracing::info!(node = %node, "pod inspector stopped");
}

/// Re-checks the pinned namespace of an inspection right before evicting for it.
async fn confirm(pinned: Option<Pinned>, info: &PodInfo) -> Result<(), String> {
    let Some(pinned) = pinned else {
        return Err("the inspected namespace was not kept".into());
    };
    let ips = info.ips.clone();
    match tokio::task::spawn_blocking(move || pinned.confirm(&ips)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(e) => Err(format!("the re-check failed: {e}")),
    }
}

async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

impl Inspector {
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }

    fn on_verdict(&mut self, v: &Option<ChainVerdict>) {
        let Some(v) = v else { return };
        let seen = (v.verified, v.reason);
        if self.last_verdict.is_some_and(|last| last != seen) {
            tracing::info!(node = %self.setup.node, reason = %v.reason, verified = v.verified, pods = self.tracker.len(), "node verdict changed; inspecting every meshed pod again");
            self.tracker.verdict_changed();
        }
        self.last_verdict = Some(seen);
    }

    /// The labels of `namespace` the profiles read: `None` when the watch has not delivered
    /// it, or an empty map when no profile reads namespace labels.
    fn namespace_labels(&self, namespace: &str) -> Option<&BTreeMap<String, String>> {
        static NONE: BTreeMap<String, String> = BTreeMap::new();
        if self.namespace_keys.is_empty() {
            return Some(&NONE);
        }
        self.namespaces.get(namespace)
    }

    fn slim(
        &self,
        ns: &PartialObjectMeta<Namespace>,
    ) -> Option<(String, BTreeMap<String, String>)> {
        let name = ns.metadata.name.clone()?;
        let labels = ns
            .metadata
            .labels
            .iter()
            .flatten()
            .filter(|(k, _)| self.namespace_keys.contains(*k))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        Some((name, labels))
    }

    /// A namespace's labels are new or changed (`None`: it is gone): its pods are selected
    /// again.
    fn namespace_changed(&mut self, name: &str, labels: Option<BTreeMap<String, String>>) {
        let same = self.namespaces.get(name) == labels.as_ref();
        let known_before = self.namespaces.contains_key(name);
        match labels {
            Some(l) => self.namespaces.insert(name.to_owned(), l),
            None => self.namespaces.remove(name),
        };
        if same {
            return;
        }
        let now = self.now();
        let changed = self.tracker.reselect_namespace(
            name,
            &self.setup.profiles,
            self.namespaces.get(name),
            known_before,
            now,
        );
        if changed > 0 {
            tracing::info!(node = %self.setup.node, namespace = name, labels = ?self.namespaces.get(name), pods = changed, "namespace labels changed which profiles select its pods");
        }
    }

    fn on_namespace_event(&mut self, item: NamespaceEvent) {
        match item {
            Ok(watcher::Event::Init) => self.namespace_relist = Some(HashMap::new()),
            Ok(watcher::Event::InitApply(ns)) => {
                if let Some((name, labels)) = self.slim(&ns)
                    && let Some(relist) = self.namespace_relist.as_mut()
                {
                    relist.insert(name, labels);
                }
            }
            Ok(watcher::Event::InitDone) => {
                let listed = self.namespace_relist.take().unwrap_or_default();
                let gone: Vec<String> = self
                    .namespaces
                    .keys()
                    .filter(|n| !listed.contains_key(*n))
                    .cloned()
                    .collect();
                for name in gone {
                    self.namespace_changed(&name, None);
                }
                for (name, labels) in listed {
                    self.namespace_changed(&name, Some(labels));
                }
                if !self.namespaces_synced {
                    tracing::info!(node = %self.setup.node, namespaces = self.namespaces.len(), "namespace list complete");
                }
                self.namespaces_synced = true;
            }
            Ok(watcher::Event::Apply(ns)) => {
                if let Some((name, labels)) = self.slim(&ns) {
                    self.namespace_changed(&name, Some(labels));
                }
            }
            Ok(watcher::Event::Delete(ns)) => {
                if let Some(name) = ns.metadata.name.as_deref() {
                    self.namespace_changed(name, None);
                }
            }
            Err(e) => {
                tracing::warn!(node = %self.setup.node, error = %e, "namespace watch error; retrying with backoff")
            }
        }
    }

    fn on_event(&mut self, item: Result<watcher::Event<SlimPod>, watcher::Error>) {
        let now = self.now();
        match item {
            Ok(watcher::Event::Init) => self.tracker.start_list(),
            Ok(watcher::Event::InitApply(pod) | watcher::Event::Apply(pod)) => {
                let namespace = pod.metadata.meta.namespace.as_deref().unwrap_or_default();
                let labels = self.namespace_labels(namespace);
                let (profiles, keys) = (&self.setup.profiles, &self.setup.keys);
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
                tracing::debug!(node = %self.setup.node, pods = self.tracker.len(), "pod list complete");
            }
            Err(e) => {
                tracing::warn!(node = %self.setup.node, error = %e, "pod watch error; retrying with backoff")
            }
        }
    }

    /// Prunes the history, then inspects and decides for every pod due.
    async fn work(&mut self) {
        if self.prune_history && self.tracker.listed() {
            self.prune_history = false;
            let live = self.tracker.uids();
            let state = self.state.clone();
            let pruned = tokio::task::spawn_blocking(move || {
                state.update(|s| {
                    let before = s.evicted.len();
                    s.evicted.retain_pods(&live);
                    s.evicted.len() != before
                })
            })
            .await;
            match pruned {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    tracing::warn!(node = %self.setup.node, error = %e, "cannot save the pruned eviction history")
                }
                Err(e) => {
                    tracing::warn!(node = %self.setup.node, error = %e, "history pruning failed")
                }
            }
        }

        let due = self.tracker.due(self.now());
        if due.is_empty() {
            return;
        }
        let jobs: Vec<Job> = due
            .iter()
            .map(|d| Job {
                uid: d.info.uid.clone(),
                ips: d.info.ips.clone(),
                annotations: d.info.annotations.clone(),
                profiles: d
                    .info
                    .profiles
                    .iter()
                    .filter_map(|n| self.setup.profiles.get(n).cloned())
                    .collect(),
            })
            .collect();
        let dirs = self.setup.netns_dirs.clone();
        let count = jobs.len();
        self.progress.pass_started();
        let batch = tokio::task::spawn_blocking(move || inspect::run(&jobs, &dirs)).await;
        self.progress.pass_ended();
        let batch = match batch {
            Ok(b) => b,
            Err(e) => {
                // A panic in a reader: treat the batch as unknown (no eviction) and retry
                // later, rather than spinning on the same pods.
                tracing::error!(node = %self.setup.node, error = %e, pods = count, "pod inspection batch failed");
                let now = self.now();
                for d in &due {
                    self.tracker.inspected(d);
                    self.tracker.unknown(&d.info.uid, now);
                }
                return;
            }
        };
        for e in &batch.survey_errors {
            tracing::debug!(node = %self.setup.node, error = %e, "a network namespace could not be surveyed");
        }
        tracing::debug!(
            node = %self.setup.node,
            pods = count,
            namespaces = batch.namespaces,
            survey_us = batch.survey.as_micros() as u64,
            "inspection batch"
        );
        for (d, inspected) in due.into_iter().zip(batch.pods) {
            self.decide(d, inspected).await;
        }
    }

    /// Counts one pod's inspection, decides, evicts when decided, and reports.
    async fn decide(&mut self, d: Due, mut inspected: Inspected) {
        let info = &d.info;
        let pinned = inspected.pinned.take();
        let (node, pod) = (self.setup.node.clone(), info.key());
        let sandbox = info.sandbox();
        self.tracker.inspected(&d);
        for i in &inspected.inspections {
            self.metrics.inspected(&i.profile, i.verdict.as_str());
        }
        self.metrics
            .pod_inspection_seconds
            .observe(inspected.elapsed.as_secs_f64());
        let profiles = &self.setup.profiles;
        let Some(decided) =
            inspect::combine(&inspected.inspections, |p| info.has_proxy(profiles, p))
        else {
            return;
        };
        let has_proxy = info.has_proxy(profiles, &decided.profile);
        let mut summary = inspect::summary(decided, inspected.netns.as_deref());
        if !has_proxy {
            let wanted = profiles
                .get(&decided.profile)
                .map(|p| p.proxy_containers.join(" or "))
                .unwrap_or_default();
            summary.push_str(&format!(" (the pod has no {wanted} container)"));
        }
        let profile = decided.profile.clone();
        let now = self.now();
        match decided.verdict {
            RedirectVerdict::Redirected => {
                self.tracker.settled(&info.uid);
                tracing::debug!(node = %node, pod = %pod, %profile, inspect_us = inspected.elapsed.as_micros() as u64, "mesh redirects in place");
                return;
            }
            RedirectVerdict::Unknown => {
                let retry = self.tracker.unknown(&info.uid, now);
                tracing::info!(node = %node, pod = %pod, %profile, why = %decided.message, retry_in_ms = retry.map(|r| r.as_millis() as u64), "pod's network namespace not inspectable; never evicting on unknown");
                return;
            }
            RedirectVerdict::Missing => {}
        }

        let key = SandboxKey {
            pod_uid: info.uid.clone(),
            sandbox: sandbox.clone(),
        };
        let candidate = Candidate {
            verdict: RedirectVerdict::Missing,
            has_proxy,
            owned: info.owned,
            key: &key,
        };
        let (flags, limiter) = (self.setup.flags, &mut self.limiter);
        let decision = self
            .state
            .read(|s| evict::decide(&candidate, &s.evicted, limiter, flags, now));
        let detect_ms = now.saturating_sub(d.ready_since).as_millis() as u64;
        let outcome = match decision {
            Decision::NotNeeded | Decision::Skip(SkipWhy::Unknown) => return,
            Decision::Skip(SkipWhy::AlreadyEvicted) => {
                tracing::debug!(node = %node, pod = %pod, "sandbox already evicted");
                return;
            }
            Decision::Skip(SkipWhy::RateLimit) => {
                if let Some(at) = self.limiter.next_free(now) {
                    self.tracker.retry_at(&info.uid, at);
                }
                Outcome::Skipped(SkipWhy::RateLimit)
            }
            Decision::Skip(why) => Outcome::Skipped(why),
            Decision::Evict { token } => {
                // The verdict is about the namespace that was read: act only while the
                // pod's path still leads to it and it still holds the pod's IPs (a
                // recycled pid or a re-created sandbox must never get a pod evicted).
                if let Err(why) = confirm(pinned, info).await {
                    self.limiter.refund(token);
                    let retry = self.tracker.unknown(&info.uid, now);
                    tracing::warn!(node = %node, pod = %pod, %profile, %why, retry_in_ms = retry.map(|r| r.as_millis() as u64), "not evicting: the pod's network namespace changed since it was inspected");
                    return;
                }
                tracing::info!(node = %node, pod = %pod, %profile, detect_ms, "evicting: mesh redirects missing");
                let answer = eviction::evict(
                    &self.client,
                    &info.namespace,
                    &info.name,
                    &info.uid,
                    self.setup.api_timeout,
                )
                .await;
                if answer != Answer::Evicted {
                    // Nothing was disrupted: the token goes back.
                    self.limiter.refund(token);
                }
                match answer {
                    Answer::Evicted => {
                        self.record_eviction(key).await;
                        self.metrics.evicted(&profile);
                        Outcome::Evicted
                    }
                    Answer::Pdb(message) => {
                        let retry = self.tracker.back_off(&info.uid, now);
                        tracing::info!(node = %node, pod = %pod, %message, retry_in_ms = retry.map(|r| r.as_millis() as u64), "eviction refused by a PodDisruptionBudget");
                        Outcome::Skipped(SkipWhy::Pdb)
                    }
                    Answer::MultiplePdbs(message) => {
                        let retry = self.tracker.back_off(&info.uid, now);
                        tracing::warn!(node = %node, pod = %pod, %message, retry_in_ms = retry.map(|r| r.as_millis() as u64), "eviction refused: several PodDisruptionBudgets match the pod");
                        Outcome::MultiplePdbs
                    }
                    Answer::Gone => {
                        tracing::debug!(node = %node, pod = %pod, "pod gone before its eviction");
                        return;
                    }
                    Answer::Failed(e) => {
                        let retry = self.tracker.back_off(&info.uid, now);
                        tracing::warn!(node = %node, pod = %pod, error = %e, retry_in_ms = retry.map(|r| r.as_millis() as u64), "eviction failed");
                        Outcome::Failed(e)
                    }
                }
            }
        };
        if let Some(why) = outcome.skip_label() {
            self.metrics.skipped(why);
        }
        let what = outcome.describe(self.setup.per_minute);
        if outcome == Outcome::Evicted {
            tracing::warn!(node = %node, pod = %pod, %profile, detect_ms, message = %decided.message, "pod evicted: mesh redirects missing");
        } else {
            tracing::warn!(node = %node, pod = %pod, %profile, outcome = %what, message = %decided.message, "mesh redirects missing");
        }
        if self
            .tracker
            .should_publish(&info.uid, &sandbox, outcome.action())
        {
            let event = outcome.event(&summary, self.setup.per_minute);
            let reference = eviction::pod_reference(&info.namespace, &info.name, &info.uid);
            match tokio::time::timeout(
                self.setup.api_timeout,
                self.recorder.publish(&event, &reference),
            )
            .await
            {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::warn!(node = %node, pod = %pod, error = %e, "publishing the Pod Event failed")
                }
                Err(_) => {
                    tracing::warn!(node = %node, pod = %pod, "publishing the Pod Event timed out")
                }
            }
        }
    }

    /// Writes an accepted eviction to the state file before anything else can happen.
    async fn record_eviction(&self, key: SandboxKey) {
        let state = self.state.clone();
        let saved = tokio::task::spawn_blocking(move || {
            state.update(|s| {
                s.evicted.record(key);
                true
            })
        })
        .await;
        match saved {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                tracing::warn!(node = %self.setup.node, error = %e, "cannot save the eviction history; it is kept in memory")
            }
            Err(e) => {
                tracing::warn!(node = %self.setup.node, error = %e, "saving the eviction history failed")
            }
        }
    }
}
