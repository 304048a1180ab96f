//! The daemon's start and stop: the runtime, then each task with the context it uses.
//!
//! In: the daemon's [`Config`]. Out: a [`Daemon`]: the verdict loop over its own context
//! ([`Verifier`], [`Outcome`], [`Wakes`]) and the [`Tasks`] that run beside it, each started
//! with only what it uses: the pod inspector ([`pods::Config`], its own clients,
//! [`pods::Inputs`]), the Node watch (a client, the node's name, a sender), the node proxy's
//! watches, the inotify watches with their pre-prober, and, from the shared runtime
//! (`meshgate_shell::runtime`), the admin server and the mode watch.
//!
//! Start-up order: the runtime first (signal handlers, client, admin server serving `/live`,
//! the mode's first list within `--api-timeout`), then the state file, the agent's clients,
//! the Node, node proxy and pod tasks, the node proxy's first list (within
//! `--api-timeout`), the prober and the inotify watches. Nothing is verified before the first
//! pass. Stop: the tasks in reverse, then the queued Events and the state file.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::events::Recorder;
use meshgate_core::cni::ChainVerdict;
use meshgate_core::field_manager;
use meshgate_core::gate::{TaintEffect, TaintKey};
use meshgate_shell::admin::{AdminServer, LoopProgress};
use meshgate_shell::cli::Common;
use meshgate_shell::mode::ModeWatch;
use meshgate_shell::runtime::Runtime;
use prometheus_client::registry::Registry;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tracing::Instrument;

use super::Config;
use super::clients::Clients;
use super::events::{self, EventQueue};
use super::fswatch::{self, FsEvent, FsWatch};
use super::metrics::AgentMetrics;
use super::node::NodeGate;
use super::node_proxy::NodeProxyWatch;
use super::pods;
use super::state::{self, Loaded, Shared, State};
use super::verdict_loop::{Outcome, VerdictLoop, Verifier, Wakes};
use crate::cni::preprobe::PreProber;
use crate::cni::{CniArgs, Prober};

/// The verdict loop and the tasks beside it.
pub struct Daemon {
    verdict_loop: VerdictLoop,
    tasks: Tasks,
}

/// The tasks that run beside the verdict loop, stopped with it.
pub struct Tasks {
    /// `/live`, `/ready`, `/metrics`.
    admin: AdminServer,
    /// The live mode.
    mode: ModeWatch,
    /// Turns true to stop the pod inspector.
    stop_pods: watch::Sender<bool>,
    pods: JoinHandle<()>,
    /// Feeds [`Wakes::node`].
    node_watch: JoinHandle<()>,
}

/// What the pod inspector and the Node watch are started with.
struct Spawned {
    tasks: Tasks,
    node: watch::Receiver<Option<Node>>,
    to_pods: watch::Sender<Option<ChainVerdict>>,
}

impl Daemon {
    /// Starts the runtime, restores the state, and starts the Node watch, the node proxy's
    /// watches, the pod inspector and the inotify watches. Nothing is verified yet: the first
    /// pass of [`Daemon::run`] does that.
    pub async fn start(config: Config) -> anyhow::Result<Self> {
        let (progress, pod_progress) = progress(config.resync_interval, config.stall_timeout);
        let ready = Arc::new(AtomicBool::new(false));
        let live = (progress.clone(), pod_progress.clone());
        let probes = (ready.clone(), live);
        let (rt, metrics) = start_runtime(&config.common, config.api_timeout, probes).await?;
        let shared = Arc::new(Shared::new(
            config.state_file.clone(),
            restore_state(&config.state_file)?,
        ));
        let (node, impersonate) = (&config.node, config.impersonate_node);
        let clients = Clients::with_retry(rt.client, &rt.client_config, node, impersonate)?;
        // Without kube's 429 retry, so a PodDisruptionBudget's refusal is seen as one.
        let pod_clients = Clients::without_retry(&rt.client_config, node, impersonate)
            .context("building the pod inspector's clients")?;
        let mut node_proxy = config
            .node_proxy
            .clone()
            .map(|p| NodeProxyWatch::start(clients.node.clone(), node, p));
        let inputs = PodInputs {
            state: shared.clone(),
            metrics: metrics.clone(),
            progress: pod_progress,
            node_proxy: node_proxy.as_ref(),
        };
        let pods = (config.pods.clone(), pod_clients, inputs);
        let spawned = spawn_tasks(node, &clients, pods, (rt.admin, rt.mode));
        if let Some(np) = node_proxy.as_mut() {
            np.wait_listed(config.api_timeout).await;
        }
        let prober = Arc::new(config.cni.prober().with_counters(metrics.probes.clone()));
        let watch = fswatch::Options {
            mode: config.fs_watch,
            poll_interval: config.fs_poll_interval,
            polling: metrics.fs_watch_polling.clone(),
        };
        let (fs, files) = watch_files(&config.cni, node_proxy.as_ref(), &prober, watch)?;
        let taint = (config.taint_key.clone(), config.taint_effect);
        let gate = node_gate(&clients, node, taint, config.api_timeout);
        let outcome = Outcome {
            node_events: EventQueue::start(gate.events()),
            gate,
            to_pods: spawned.to_pods,
            metrics,
            ready,
            shared,
        };
        let wakes = Wakes {
            mode: spawned.tasks.mode.subscribe(),
            shutdown: rt.shutdown,
            files,
            coalesce: config.coalesce,
            resync: resync(config.resync_interval).await,
            node: spawned.node,
        };
        let verifier = Verifier {
            cni: Arc::new(config.cni),
            prober,
            fs,
            node_proxy,
        };
        let verdict_loop = VerdictLoop::new(verifier, outcome, wakes, progress);
        Ok(Self {
            verdict_loop,
            tasks: spawned.tasks,
        })
    }

    /// Runs the verdict loop until a stop request, then stops.
    pub async fn run(self) {
        let (verifier, outcome) = self.verdict_loop.run().await;
        tracing::info!("stopping; the Node keeps its taint state as it is");
        let tasks = self.tasks;
        let _ = tasks.stop_pods.send(true);
        tasks.node_watch.abort();
        tasks.mode.stop();
        if let Some(np) = &verifier.node_proxy {
            np.stop();
        }
        tasks.admin.stop().await;
        let _ = tasks.pods.await;
        outcome.finish().await;
    }
}

/// The shared runtime (`meshgate_shell::runtime`) with the agent's metrics, `/ready` turning
/// true after the first pass that wrote the Node and `/live` following both loops' progress;
/// the mode's first list is waited for within `--api-timeout`.
async fn start_runtime(
    common: &Common,
    api_timeout: Duration,
    (ready, live): (Arc<AtomicBool>, (LoopProgress, LoopProgress)),
) -> anyhow::Result<(Runtime, AgentMetrics)> {
    let mut registry = Registry::default();
    let metrics = AgentMetrics::register(&mut registry);
    let rt = Runtime::builder(common, field_manager::AGENT)
        .metrics(registry, metrics.mode.clone())
        .probes(ready, live)
        .mode_first_list(api_timeout)
        .build()
        .await?;
    Ok((rt, metrics))
}

/// What the pod inspector shares with the verdict loop.
struct PodInputs<'a> {
    state: Arc<Shared>,
    metrics: AgentMetrics,
    progress: LoopProgress,
    node_proxy: Option<&'a NodeProxyWatch>,
}

/// Starts the pod inspector and the Node watch, and keeps them with the runtime's admin server
/// and mode watch, to be stopped together.
fn spawn_tasks(
    node_name: &str,
    clients: &Clients,
    (config, pod_clients, inputs): (pods::Config, Clients, PodInputs<'_>),
    (admin, mode): (AdminServer, ModeWatch),
) -> Spawned {
    let (node_tx, node) = watch::channel::<Option<Node>>(None);
    let (to_pods, verdict) = watch::channel::<Option<ChainVerdict>>(None);
    let (stop_pods, stop) = watch::channel(false);
    let pods = pods::spawn(
        config,
        pod_clients,
        pods::Inputs {
            verdict,
            state: inputs.state,
            metrics: inputs.metrics,
            progress: inputs.progress,
            stop,
            mode: mode.subscribe(),
            node_proxy_pods: inputs.node_proxy.map(|np| np.pods.clone()),
        },
    );
    let api = Api::all(clients.node.clone());
    let node_watch = tokio::spawn(watch_node(api, node_name.to_owned(), node_tx).in_current_span());
    Spawned {
        tasks: Tasks {
            admin,
            mode,
            stop_pods,
            pods,
            node_watch,
        },
        node,
        to_pods,
    }
}

/// The resync tick, its first (immediate) tick taken: the first pass covers it.
async fn resync(every: Duration) -> tokio::time::Interval {
    let mut resync = tokio::time::interval(every);
    resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    resync.tick().await;
    resync
}

/// The state saved by an agent earlier in this boot, or a fresh one.
fn restore_state(state_file: &Path) -> anyhow::Result<State> {
    let boot_id = state::boot_id().context("reading the boot id")?;
    let fresh = || State {
        version: state::FORMAT_VERSION,
        boot_id: boot_id.clone(),
        ..State::default()
    };
    Ok(match state::load(state_file, &boot_id) {
        Loaded::Restarted(s) => {
            tracing::info!(last = ?s.last_verdict, evictions = s.evicted.len(), "agent restarted within the same boot; state restored");
            s
        }
        Loaded::FreshBoot { previous_boot } => {
            tracing::info!(?previous_boot, "fresh boot: verifying from scratch");
            fresh()
        }
        Loaded::Refused(e) => {
            tracing::error!(error = %e, "refusing the state file; starting fresh");
            fresh()
        }
    })
}

/// The gate of this node: writes and Events as the ServiceAccount, reads as the node with
/// `--impersonate-node`.
fn node_gate(
    clients: &Clients,
    node: &str,
    (taint_key, taint_effect): (TaintKey, TaintEffect),
    api_timeout: Duration,
) -> NodeGate {
    let recorder = Recorder::new(clients.own.clone(), events::reporter(node));
    NodeGate::new(
        clients.own.clone(),
        node.to_owned(),
        taint_key,
        taint_effect,
        api_timeout,
        recorder,
    )
    .reading_as(clients.node.clone())
}

/// What `/live` checks: the verdict loop's passes and waits, the pod inspector's batches.
fn progress(resync_interval: Duration, stall_timeout: Duration) -> (LoopProgress, LoopProgress) {
    let max_wait = resync_interval.saturating_add(stall_timeout);
    let verdict_loop = LoopProgress::new(stall_timeout, max_wait);
    // The pod inspector's batches are bounded by the same stall timeout; it may idle for as
    // long as no pod needs inspecting, so only its passes are bounded.
    let pods = LoopProgress::idle("the pod inspector", stall_timeout, Duration::MAX);
    (verdict_loop, pods)
}

/// Starts the watches (inotify, or polling: `options`) on the CNI dirs and the node proxy's
/// socket directory (a dir that does not exist yet is waited for), and the pre-prober they
/// feed, which lives as long as the watches.
fn watch_files(
    cni: &CniArgs,
    node_proxy: Option<&NodeProxyWatch>,
    prober: &Arc<Prober>,
    options: fswatch::Options,
) -> anyhow::Result<(FsWatch, mpsc::UnboundedReceiver<FsEvent>)> {
    let (tx, rx) = mpsc::unbounded_channel();
    let mut dirs = cni.cni_bin_dirs.clone();
    dirs.extend(node_proxy.and_then(NodeProxyWatch::socket_dir));
    let pre = PreProber::start(prober.clone()).context("starting the pre-probe workers")?;
    let notice = Arc::new(move |p: &std::path::Path| pre.notice(p));
    let fs = FsWatch::start(&cni.cni_conf_dir, &dirs, tx, notice, options)
        .context("watching the CNI directories")?;
    if !fs.all_direct() {
        tracing::info!(dir = %cni.cni_conf_dir.display(), "a CNI directory does not exist yet; waiting for it");
    }
    Ok((fs, rx))
}

/// Feeds `tx` with the Node as the API reports it, reconnecting with backoff.
async fn watch_node(api: Api<Node>, name: String, tx: watch::Sender<Option<Node>>) {
    let mut stream =
        std::pin::pin!(kube::runtime::watcher::watch_object(api, &name).default_backoff());
    while let Some(item) = stream.next().await {
        match item {
            Ok(node) => {
                let _ = tx.send(node);
            }
            Err(e) => tracing::debug!(error = %e, "node watch error; retrying"),
        }
    }
}
