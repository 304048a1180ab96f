//! The verdict loop: `start` → `pass` → `next_wake`, until SIGTERM.
//!
//! In: the daemon's [`Config`], inotify events, the resync tick, the Node watch, the live
//! mode (`meshgate_shell::mode`), the node proxy's pods, socket and connection when a named
//! profile has one ([`NodeProxyWatch`]: ambient's ztunnel) and SIGTERM.
//! Out: one pass per wake-up — verify (the chain, then the node proxy over it), hand the
//! verdict to the pod inspector when it changed, reconcile the Node as the mode allows
//! ([`NodeGate`]), then record the outcome (metrics, readiness, state file) or schedule a retry
//! with capped backoff, and, after a transient verdict, schedule verifying again — and, at
//! `stop`, the tasks it started. A mode change wakes the loop to write the Node again without re-verifying.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::events::{Recorder, Reporter};
use meshgate_core::cni::{ChainVerdict, Reason, Runtime};
use meshgate_core::event_reason;
use meshgate_core::mode::Mode;
use meshgate_shell::admin::LoopProgress;
use meshgate_shell::mode::{ModeWatch, WouldAction};
use prometheus_client::registry::Registry;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tracing::Instrument;

use super::Config;
use super::clients::Clients;
use super::coalesce::coalesce;
use super::events::{EventQueue, REPORTER};
use super::fswatch::{FsEvent, FsWatch};
use super::metrics::AgentMetrics;
use super::node::{Applied, GateError, NodeGate};
use super::node_proxy::{self, NodeProxyWatch};
use super::pods;
use super::stages::PassClock;
use super::state::{self, Loaded, Shared, State};
use super::timer::sleep_until;
use crate::cni::preprobe::PreProber;
use crate::cni::{CniArgs, Prober};

/// Why the loop woke up.
#[derive(Clone, Copy, Debug)]
pub enum Wake {
    /// The CNI dirs changed; the burst's last event happened then.
    Files(Instant),
    /// The resync tick (and the first pass).
    Resync,
    /// The Node changed (someone else's write, or our own coming back through the watch).
    NodeChanged,
    /// A failed reconcile's retry is due.
    Retry,
    /// A verdict that rested on a failure that may pass by itself (`ChainVerdict::transient`)
    /// is due to be verified again.
    Reverify,
    /// The mode changed: the Node is written again as the new mode allows.
    ModeChanged,
    /// The node proxy's pods on this node changed (ztunnel became Ready, or went away), or
    /// its connection to the CNI node agent's socket came or went (polled).
    NodeProxy,
}

impl Wake {
    /// How logs name it (the `pass` span's `wake` field).
    pub fn as_str(&self) -> &'static str {
        match self {
            Wake::Files(_) => "files",
            Wake::Resync => "resync",
            Wake::NodeChanged => "node-changed",
            Wake::Retry => "retry",
            Wake::Reverify => "reverify",
            Wake::ModeChanged => "mode-changed",
            Wake::NodeProxy => "node-proxy",
        }
    }
}

/// The tasks the loop started, stopped with it.
struct Tasks {
    stop: watch::Sender<bool>,
    admin: Option<JoinHandle<()>>,
    pods: JoinHandle<()>,
    node_watch: JoinHandle<()>,
}

/// Everything a pass needs, between wake-ups.
pub struct Daemon {
    cni: Arc<CniArgs>,
    prober: Arc<Prober>,
    gate: NodeGate,
    /// Publishes the Node's Events off the loop, in order (see `events::EventQueue`).
    node_events: EventQueue,
    metrics: AgentMetrics,
    ready: Arc<AtomicBool>,
    shared: Arc<Shared>,
    progress: LoopProgress,
    /// The Node, as last seen by a watch on it alone: reconciles read it instead of GETting,
    /// and a change by someone else (our taint removed by hand) wakes the loop.
    node_rx: watch::Receiver<Option<Node>>,
    /// The live mode; the watch stops with the daemon.
    mode: ModeWatch,
    mode_rx: watch::Receiver<Mode>,
    /// The verdict as the pod inspector sees it: sent only when it changes, so pods are
    /// inspected again after a change, not after every resync.
    verdict_tx: watch::Sender<Option<ChainVerdict>>,
    fs_rx: mpsc::UnboundedReceiver<FsEvent>,
    fs: FsWatch,
    /// The node proxy that must be ready too (ambient's ztunnel), when a named profile has one.
    node_proxy: Option<NodeProxyWatch>,
    resync: tokio::time::Interval,
    coalesce: Duration,
    retry: ExponentialBackoff,
    retry_at: Option<tokio::time::Instant>,
    /// Verifying again after a transient verdict: its own schedule, which a successful
    /// reconcile does not reset (the verdict, not the write, is what may change).
    reverify: ExponentialBackoff,
    reverify_at: Option<tokio::time::Instant>,
    /// When the disk last changed: the start of the untaint-latency measurement.
    changed_at: Instant,
    verdict: Option<ChainVerdict>,
    /// The stages of the pass under way (`verify stages` line, stage histogram).
    clock: PassClock,
    shutdown: Pin<Box<dyn Future<Output = ()> + Send>>,
    tasks: Tasks,
}

/// The reconcile retry schedule: 50 ms doubling to 500 ms, each step stretched by up to as
/// much again (backon's jitter, so never more than 1 s), for ever.
fn backoff() -> ExponentialBackoff {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(50))
        .with_max_delay(Duration::from_millis(500))
        .with_jitter()
        .without_max_times()
        .build()
}

/// The schedule of verifying again after a transient verdict: 1 s doubling to 15 s, each
/// stretched by up to as much again (backon's jitter), so 1–2 s first and never more than
/// 30 s, for as long as the verdict stays transient. Each run is bounded by --probe-timeout,
/// so a plugin that always hangs costs one probe per 15–30 s, not a busy loop.
fn reverify_backoff() -> ExponentialBackoff {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_secs(1))
        .with_max_delay(REVERIFY_MAX)
        .with_jitter()
        .without_max_times()
        .build()
}

/// The longest step of that schedule, before its jitter.
const REVERIFY_MAX: Duration = Duration::from_secs(15);

/// The state saved by an agent earlier in this boot, or a fresh one.
fn restore_state(config: &Config) -> anyhow::Result<State> {
    let boot_id = state::boot_id().context("reading the boot id")?;
    let fresh = || State {
        version: state::FORMAT_VERSION,
        boot_id: boot_id.clone(),
        ..State::default()
    };
    Ok(match state::load(&config.state_file, &boot_id) {
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

impl Daemon {
    /// Restores the state, binds the admin port, starts the Node watch, the pod inspector and
    /// the inotify watches. Nothing is verified yet: the first [`Daemon::pass`] does that.
    pub async fn start(config: Config) -> anyhow::Result<Self> {
        let shutdown = meshgate_shell::shutdown::signal()
            .context("installing the SIGTERM and SIGINT handlers")?;
        let node = config.node.clone();
        let shared = Arc::new(Shared::new(
            config.state_file.clone(),
            restore_state(&config)?,
        ));
        let kubeconfig = config.common.kubeconfig.as_deref();
        let clients = Clients::build(kubeconfig, &node, config.impersonate_node, true).await?;
        // Without kube's 429 retry, so a PodDisruptionBudget's refusal is seen as one.
        let pod_clients = Clients::build(kubeconfig, &node, config.impersonate_node, false)
            .await
            .context("building the pod inspector's clients")?;
        let mut registry = Registry::default();
        let metrics = AgentMetrics::register(&mut registry);
        let (progress, pod_progress) = progress(&config);
        let ready = Arc::new(AtomicBool::new(false));
        let (stop, stop_rx) = watch::channel(false);
        let admin = start_admin(
            &config,
            registry,
            ready.clone(),
            (progress.clone(), pod_progress.clone()),
            stop_rx.clone(),
        )
        .await?;
        let mode = watch_mode(&config, &clients, &metrics).await;
        let (node_tx, node_rx) = watch::channel::<Option<Node>>(None);
        let (verdict_tx, verdict_rx) = watch::channel::<Option<ChainVerdict>>(None);
        let mut node_proxy = config
            .node_proxy
            .clone()
            .map(|p| NodeProxyWatch::start(clients.node.clone(), &node, p));
        let pods = pods::spawn(
            config.pods.clone(),
            pod_clients,
            pods::Inputs {
                verdict: verdict_rx,
                state: shared.clone(),
                metrics: metrics.clone(),
                progress: pod_progress,
                stop: stop_rx,
                mode: mode.subscribe(),
                node_proxy_pods: node_proxy.as_ref().map(|np| np.pods.clone()),
            },
        );
        let node_watch = tokio::spawn(
            watch_node(Api::all(clients.node.clone()), node.clone(), node_tx).in_current_span(),
        );
        if let Some(np) = node_proxy.as_mut() {
            np.wait_listed(config.api_timeout).await;
        }
        let prober = Arc::new(config.cni.prober().with_counters(metrics.probes.clone()));
        let (fs, fs_rx) = watch_files(&config, node_proxy.as_ref(), &prober)?;
        let mut resync = tokio::time::interval(config.resync_interval);
        resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        resync.tick().await; // the first tick is immediate; the first pass covers it
        let gate = node_gate(&config, &clients);
        Ok(Self {
            node_events: EventQueue::start(gate.events()),
            gate,
            prober,
            cni: Arc::new(config.cni),
            coalesce: config.coalesce,
            metrics,
            ready,
            shared,
            progress,
            node_rx,
            mode_rx: mode.subscribe(),
            mode,
            verdict_tx,
            fs_rx,
            fs,
            node_proxy,
            resync,
            retry: backoff(),
            retry_at: None,
            reverify: reverify_backoff(),
            reverify_at: None,
            changed_at: Instant::now(),
            verdict: None,
            clock: PassClock::default(),
            shutdown: Box::pin(shutdown),
            tasks: Tasks {
                stop,
                admin,
                pods,
                node_watch,
            },
        })
    }

    /// One pass: verify (unless only the Node changed and the verdict is fresh), then make
    /// the Node say what the verdict says, and record the outcome. Its lines are logged
    /// inside a `pass` span that says why it ran.
    #[tracing::instrument(name = "pass", skip_all, fields(wake = wake.as_str()))]
    pub async fn pass(&mut self, wake: &Wake) {
        self.progress.pass_started();
        self.clock.pass_started();
        if !matches!(wake, Wake::NodeChanged | Wake::ModeChanged) || self.verdict.is_none() {
            let began = Instant::now();
            let (v, probing) = verify(self.cni.clone(), self.prober.clone()).await;
            self.clock.verified(began.elapsed(), probing);
            let delegate = v.delegate.as_ref().and_then(|d| d.file.as_deref());
            self.fs.follow_delegate(delegate.map(std::path::Path::new));
            let v = match self.node_proxy.as_mut() {
                Some(np) => judge_node_proxy(v, np).await,
                None => v,
            };
            self.adopt(v);
            self.schedule_reverify();
        }
        if let Some(v) = self.verdict.clone() {
            let seen = self.node_rx.borrow_and_update().clone();
            let mode = *self.mode_rx.borrow_and_update();
            self.gate.measure_from(self.changed_at);
            self.clock.reconcile_started();
            match self.gate.reconcile_deferring_event(seen, &v, mode).await {
                Ok((applied, event)) => {
                    self.clock.report(&applied, &self.metrics);
                    self.settled(&v, &applied, mode);
                    if let Some(e) = event {
                        self.node_events.send(e.event, e.regarding).await;
                    }
                }
                Err(e) => self.failed(&e),
            }
        }
        self.progress.pass_ended();
    }

    /// Waits for the next reason to pass; `None` on SIGTERM/SIGINT. A burst of file events
    /// is waited out before returning.
    pub async fn next_wake(&mut self) -> Option<Wake> {
        let mut first = None;
        let wake = tokio::select! {
            _ = &mut self.shutdown => return None,
            Some(e) = self.fs_rx.recv() => {
                let at = e.at;
                first = Some(e);
                Wake::Files(at)
            }
            _ = self.resync.tick() => Wake::Resync,
            Ok(()) = self.node_rx.changed() => Wake::NodeChanged,
            Ok(()) = self.mode_rx.changed() => Wake::ModeChanged,
            () = node_proxy_changed(self.node_proxy.as_mut()) => Wake::NodeProxy,
            _ = sleep_until(self.retry_at) => Wake::Retry,
            _ = sleep_until(self.reverify_at) => Wake::Reverify,
        };
        self.clock.woke(match wake {
            Wake::Files(first) => Some(first),
            _ => None,
        });
        match wake {
            Wake::Files(_) => {
                if let Some(first) = first {
                    self.changed_at = coalesce(&mut self.fs_rx, first, self.coalesce).await;
                }
                self.fs.ensure();
            }
            // The untaint latency runs from the change that made the node verifiable.
            Wake::NodeProxy => self.changed_at = Instant::now(),
            _ => {}
        }
        Some(wake)
    }

    /// Stops the tasks it started and saves the state; the Node keeps its taint state.
    pub async fn stop(self) {
        tracing::info!("stopping; the Node keeps its taint state as it is");
        let _ = self.tasks.stop.send(true);
        self.tasks.node_watch.abort();
        self.mode.stop();
        if let Some(np) = &self.node_proxy {
            np.stop();
        }
        if let Some(admin) = self.tasks.admin {
            let _ = admin.await;
        }
        let _ = self.tasks.pods.await;
        self.node_events.stop().await;
        if let Err(e) = self.shared.save() {
            tracing::warn!(error = %e, "cannot save state");
        }
    }

    /// Takes a new verdict: counts and logs it, and hands it to the pod inspector when its
    /// outcome (verified, reason) changed.
    fn adopt(&mut self, v: ChainVerdict) {
        self.metrics.verified(v.reason.as_str());
        let last = self.verdict.as_ref().map(|o| (o.reason, &o.message));
        if last != Some((v.reason, &v.message)) {
            tracing::info!(reason = %v.reason, verified = v.verified, message = %v.message, "verdict");
        }
        self.verdict_tx.send_if_modified(|cur| {
            let changed = cur.as_ref().map(|c| (c.verified, c.reason, &c.message))
                != Some((v.verified, v.reason, &v.message));
            if changed {
                *cur = Some(v.clone());
            }
            changed
        });
        self.verdict = Some(v);
    }

    /// After a verification: a transient verdict is verified again on its own schedule
    /// (without waiting for the resync); any other ends that schedule.
    fn schedule_reverify(&mut self) {
        if !self.verdict.as_ref().is_some_and(|v| v.transient) {
            self.reverify = reverify_backoff();
            self.reverify_at = None;
            return;
        }
        let delay = self.reverify.next().unwrap_or(REVERIFY_MAX);
        tracing::info!(
            retry_in_ms = delay.as_millis() as u64,
            "the verdict rests on a failure that may pass by itself; verifying again"
        );
        self.reverify_at = Some(tokio::time::Instant::now() + delay);
    }

    /// The Node says what `v` says (as `mode` allows): metrics, readiness, the state file.
    fn settled(&mut self, v: &ChainVerdict, applied: &Applied, mode: Mode) {
        self.retry = backoff();
        self.retry_at = None;
        if mode.is_report() && applied.event == Some(event_reason::CHAIN_UNVERIFIED) {
            self.metrics.mode.would(WouldAction::Taint);
            tracing::warn!(reason = %v.reason, "report mode: would taint the node (CNI chain not verified)");
        }
        if let Some(added) = applied.taint {
            self.metrics.taint(added);
            if !added && !v.verified {
                tracing::info!(%mode, "meshgate's taint removed: this mode does not gate");
            } else if added {
                tracing::warn!(reason = %v.reason, "node tainted: CNI chain not verified");
            } else {
                let latency = applied.untaint_latency.unwrap_or_default();
                self.metrics.untaint_latency.observe(latency.as_secs_f64());
                tracing::info!(
                    latency_ms = latency.as_millis() as u64,
                    "node untainted: CNI chain verified"
                );
            }
        }
        if let Some(event) = applied.event {
            tracing::info!(event, "event queued");
        }
        self.metrics.node_verified.set(i64::from(v.verified));
        self.ready.store(true, Ordering::Release);
        let last = state::LastVerdict {
            reason: v.reason.as_str().to_string(),
            verified: v.verified,
        };
        let saved = self.shared.update(|s| {
            let changed = s.last_verdict.as_ref() != Some(&last);
            s.last_verdict = Some(last);
            changed
        });
        if let Err(e) = saved {
            tracing::warn!(error = %e, "cannot save state");
        }
    }

    /// The reconcile failed: the Node keeps its state; retried after the next backoff step.
    fn failed(&mut self, e: &GateError) {
        let delay = self.retry.next().unwrap_or(Duration::from_millis(500));
        tracing::warn!(error = %e, retry_in_ms = delay.as_millis() as u64, "reconcile failed; the Node keeps its current state");
        self.retry_at = Some(tokio::time::Instant::now() + delay);
    }
}

/// The gate of this node: writes and Events as the ServiceAccount, reads as the node with
/// `--impersonate-node`.
fn node_gate(config: &Config, clients: &Clients) -> NodeGate {
    let recorder = Recorder::new(
        clients.own.clone(),
        Reporter {
            controller: REPORTER.into(),
            instance: Some(config.node.clone()),
        },
    );
    NodeGate::new(
        clients.own.clone(),
        config.node.clone(),
        config.taint_key.clone(),
        config.taint_effect,
        config.api_timeout,
        recorder,
    )
    .reading_as(clients.node.clone())
}

/// The live mode, read as the ServiceAccount (its Role names the one ConfigMap), waiting up
/// to `--api-timeout` for the first read.
async fn watch_mode(config: &Config, clients: &Clients, metrics: &AgentMetrics) -> ModeWatch {
    let (client, source) = (clients.own.clone(), &config.common.mode);
    ModeWatch::start(client, source, metrics.mode.clone(), config.api_timeout).await
}

/// What `/live` checks: the verdict loop's passes and waits, the pod inspector's batches.
fn progress(config: &Config) -> (LoopProgress, LoopProgress) {
    let max_wait = config.resync_interval.saturating_add(config.stall_timeout);
    let verdict_loop = LoopProgress::new(config.stall_timeout, max_wait);
    // The pod inspector's batches are bounded by the same stall timeout; it may idle for as
    // long as no pod needs inspecting, so only its passes are bounded.
    let pods = LoopProgress::idle("the pod inspector", config.stall_timeout, Duration::MAX);
    (verdict_loop, pods)
}

/// Starts the inotify watches on the CNI dirs and the node proxy's socket directory (a dir
/// that does not exist yet is waited for), and the pre-prober they feed, which lives as long
/// as the watches.
fn watch_files(
    config: &Config,
    node_proxy: Option<&NodeProxyWatch>,
    prober: &Arc<Prober>,
) -> anyhow::Result<(FsWatch, mpsc::UnboundedReceiver<FsEvent>)> {
    let (tx, rx) = mpsc::unbounded_channel();
    let mut dirs = config.cni.cni_bin_dirs.clone();
    dirs.extend(node_proxy.and_then(NodeProxyWatch::socket_dir));
    let pre = PreProber::start(prober.clone()).context("starting the pre-probe workers")?;
    let notice = Arc::new(move |p: &std::path::Path| pre.notice(p));
    let fs = FsWatch::start(&config.cni.cni_conf_dir, &dirs, tx, notice)
        .context("starting inotify watches")?;
    if !fs.all_direct() {
        tracing::info!(dir = %config.cni.cni_conf_dir.display(), "a CNI directory does not exist yet; waiting for it");
    }
    Ok((fs, rx))
}

/// Binds `--admin-addr`, if set, and serves `/live` (both loops' progress), `/ready` and
/// `/metrics` until `stop` turns true.
async fn start_admin(
    config: &Config,
    registry: Registry,
    ready: Arc<AtomicBool>,
    progress: (LoopProgress, LoopProgress),
    stop: watch::Receiver<bool>,
) -> anyhow::Result<Option<JoinHandle<()>>> {
    let Some(listener) = config.common.bind_admin().await? else {
        return Ok(None);
    };
    Ok(Some(tokio::spawn(meshgate_shell::admin::serve_with(
        listener,
        Arc::new(registry),
        ready,
        progress,
        wait_stop(stop),
    ))))
}

async fn wait_stop(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|stop| *stop).await;
}

/// Verifies on a blocking thread (it reads files and runs plugin binaries); also returns how
/// long it ran plugin binaries. An unreadable config dir is a verdict, not a crash: the node
/// stays gated.
async fn verify(cni: Arc<CniArgs>, prober: Arc<Prober>) -> (ChainVerdict, Duration) {
    let dir = cni.cni_conf_dir.display().to_string();
    let runtime: Runtime = cni.runtime;
    // The prober's lines belong to the pass that asked for them.
    let span = tracing::Span::current();
    let result =
        tokio::task::spawn_blocking(move || span.in_scope(|| cni.verify_timed(&prober))).await;
    let why = match result {
        Ok(Ok(v)) => return v,
        Ok(Err(e)) => format!("cannot read {dir}: {e}"),
        Err(e) => format!("verification failed: {e}"),
    };
    let v = ChainVerdict {
        verified: false,
        reason: Reason::ConfigInvalid,
        message: why,
        config_file: None,
        plugins: Vec::new(),
        runtime,
        delegate: None,
        // A read error or a failed blocking task says nothing lasting about the node.
        transient: true,
    };
    (v, Duration::ZERO)
}

/// The node's verdict with the node proxy over the chain's: its pods as last listed, its
/// socket and the connection on it as they are now.
async fn judge_node_proxy(chain: ChainVerdict, np: &mut NodeProxyWatch) -> ChainVerdict {
    let pods = np.pods.borrow_and_update().clone();
    np.socket.borrow_and_update();
    let uids = node_proxy::ready_uids(pods.as_deref());
    let (socket, connection) = node_proxy::look(&np.proxy.socket, uids).await;
    let seen = meshgate_core::node_proxy::Observed {
        pods,
        socket,
        connection,
    };
    meshgate_core::node_proxy::judge(chain, &np.proxy, &seen)
}

/// Returns when the node proxy's pods, or its socket or connection as polled, changed;
/// never without a node proxy (or once both watches ended).
async fn node_proxy_changed(np: Option<&mut NodeProxyWatch>) {
    if let Some(np) = np {
        let (pods, socket) = (&mut np.pods, &mut np.socket);
        let changed = tokio::select! {
            r = pods.changed() => r.is_ok(),
            r = socket.changed() => r.is_ok(),
        };
        if changed {
            return;
        }
    }
    std::future::pending().await
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
