//! `meshgate-agent run`: the DaemonSet process that gates its own Node on the chain verdict.
//!
//! In: inotify events from the CNI dirs, a periodic resync tick, changes to the agent's own
//! Node (watched by name), and SIGTERM. Out: the Node's taint, label, condition and Events
//! (through [`node::NodeGate`]), the state file, and metrics on the admin port, whose `/live`
//! follows the loop's progress: a pass (verify, then write the Node) running longer than
//! `--stall-timeout`, or no pass begun for `--resync-interval` plus that, fails it, so the
//! kubelet restarts a wedged agent instead of leaving its Node's state frozen.
//!
//! One loop does everything in order — wait for a reason, coalesce a burst of file events,
//! verify, reconcile — so there is never more than one writer of meshgate's names on the Node
//! and every write is based on a verdict computed just before it. A failed reconcile is
//! retried with capped exponential backoff, and each retry verifies again, so a long API
//! outage can never end in an untaint based on what the disk said before it.

pub mod clients;
pub mod fswatch;
pub mod metrics;
pub mod node;
pub mod pods;
pub mod state;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use backon::{BackoffBuilder, ExponentialBuilder};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::events::{Recorder, Reporter};
use meshgate_core::cni::{ChainVerdict, Reason, Runtime};
use meshgate_shell::admin::LoopProgress;
use meshgate_shell::cli::{Common, duration};
use prometheus_client::registry::Registry;
use tokio::sync::{mpsc, watch};

use crate::cni::CniArgs;
use metrics::AgentMetrics;
use node::{NodeGate, TaintEffect};
use state::{Loaded, State};

/// `meshgate-agent run` flags (see docs/operations.md).
#[derive(Debug, clap::Args)]
pub struct Args {
    /// This node's name (from the Downward API in the DaemonSet).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,
    #[command(flatten)]
    pub cni: CniArgs,
    /// Kubeconfig, admin address, profiles, log format.
    #[command(flatten)]
    pub common: Common,
    /// Read the Node and the pods on it, and evict them, as the node itself (Constrained
    /// Impersonation: Kubernetes 1.35+ with the ConstrainedImpersonation feature gate, and
    /// the RBAC of manifests/components/node-impersonation). Node writes and Events stay
    /// with the ServiceAccount.
    #[arg(long, env = "MESHGATE_IMPERSONATE_NODE")]
    pub impersonate_node: bool,
    /// Effect of the meshgate.io/cni-unverified taint.
    #[arg(
        long,
        env = "MESHGATE_TAINT_EFFECT",
        value_enum,
        default_value = "NoSchedule"
    )]
    pub taint_effect: TaintEffect,
    /// Decide and report evictions, but evict nothing.
    #[arg(long, env = "MESHGATE_DRY_RUN")]
    pub dry_run: bool,
    /// Report pods without redirect rules, never evict them.
    #[arg(long, env = "MESHGATE_NO_EVICT")]
    pub no_evict: bool,
    /// Per-node eviction rate limit.
    #[arg(long, env = "MESHGATE_MAX_EVICTIONS_PER_MINUTE", default_value_t = 10)]
    pub max_evictions_per_minute: u32,
    /// Also evict pods without a controlling owner (bare pods), which nothing recreates.
    #[arg(long, env = "MESHGATE_EVICT_UNOWNED")]
    pub evict_unowned: bool,
    /// Node-local state (boot id, last verdict, eviction history); keep it on tmpfs.
    #[arg(
        long,
        env = "MESHGATE_STATE_FILE",
        default_value = "/var/run/meshgate/state.json"
    )]
    pub state_file: PathBuf,
    /// Re-verify at least this often, as a safety net for missed inotify events.
    #[arg(long, env = "MESHGATE_RESYNC_INTERVAL", default_value = "60s", value_parser = duration)]
    pub resync_interval: Duration,
    /// Quiet time that ends a burst of file events (a write-then-rename is one change); a
    /// burst that never goes quiet is cut after ten times this.
    #[arg(long, env = "MESHGATE_COALESCE", default_value = "20ms", value_parser = duration)]
    pub coalesce: Duration,
    /// Deadline for each Kubernetes API call.
    #[arg(long, env = "MESHGATE_API_TIMEOUT", default_value = "5s", value_parser = duration)]
    pub api_timeout: Duration,
    /// /live fails when one pass of the loop (verify, then write the Node) runs longer than
    /// this, or when no pass begins within --resync-interval plus this. A pass is a
    /// verification (each plugin probe bounded by --probe-timeout) and a few API calls (each
    /// bounded by --api-timeout): well under a second normally.
    #[arg(long, env = "MESHGATE_STALL_TIMEOUT", default_value = "60s", value_parser = duration)]
    pub stall_timeout: Duration,
}

/// Why the loop woke up.
enum Wake {
    Files(Instant),
    Resync,
    NodeChanged,
    Retry,
}

/// Runs the daemon until SIGTERM/SIGINT.
pub async fn run(args: Args) -> anyhow::Result<()> {
    let node_name = args.node_name.clone();
    let boot_id = state::boot_id().context("reading the boot id")?;
    let saved = match state::load(&args.state_file, &boot_id) {
        Loaded::Restarted(s) => {
            tracing::info!(node = %node_name, last = ?s.last_verdict, evictions = s.evicted.len(), "agent restarted within the same boot; state restored");
            s
        }
        Loaded::FreshBoot { previous_boot } => {
            tracing::info!(node = %node_name, ?previous_boot, "fresh boot: verifying from scratch");
            State {
                version: state::FORMAT_VERSION,
                boot_id: boot_id.clone(),
                ..State::default()
            }
        }
        Loaded::Refused(e) => {
            tracing::error!(node = %node_name, error = %e, "refusing the state file; starting fresh");
            State {
                version: state::FORMAT_VERSION,
                boot_id: boot_id.clone(),
                ..State::default()
            }
        }
    };

    let shared = Arc::new(state::Shared::new(args.state_file.clone(), saved));

    let clients = clients::Clients::build(
        args.common.kubeconfig.as_deref(),
        &node_name,
        args.impersonate_node,
        true,
    )
    .await?;
    let client = clients.own.clone();
    let mut registry = Registry::default();
    let metrics = AgentMetrics::register(&mut registry);
    let ready = Arc::new(AtomicBool::new(false));
    let listener = args.common.bind_admin().await?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let progress = LoopProgress::new(
        args.stall_timeout,
        args.resync_interval.saturating_add(args.stall_timeout),
    );
    // The pod inspector's batches are bounded by the same stall timeout; it may idle for as
    // long as no pod needs inspecting, so only its passes are bounded.
    let pod_progress = LoopProgress::idle("the pod inspector", args.stall_timeout, Duration::MAX);
    let admin = listener.map(|listener| {
        tokio::spawn(meshgate_shell::admin::serve_with(
            listener,
            Arc::new(registry),
            ready.clone(),
            (progress.clone(), pod_progress.clone()),
            wait_stop(stop_rx.clone()),
        ))
    });

    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "meshgate-agent".into(),
            instance: Some(node_name.clone()),
        },
    );
    let gate = NodeGate::new(
        client.clone(),
        node_name.clone(),
        args.taint_effect,
        args.api_timeout,
        recorder,
    )
    .reading_as(clients.node.clone());

    // The Node, as last seen by a watch on it alone: reconciles read it instead of GETting,
    // and a change by someone else (our taint removed by hand) wakes the loop.
    let (node_tx, mut node_rx) = watch::channel::<Option<Node>>(None);
    // The verdict as the pod inspector sees it: sent only when it changes, so pods are
    // inspected again after a change, not after every resync.
    let (verdict_tx, verdict_rx) = watch::channel::<Option<ChainVerdict>>(None);
    let pods = pods::spawn(
        &args,
        verdict_rx,
        shared.clone(),
        metrics.clone(),
        pod_progress,
        stop_rx.clone(),
    )
    .await?;
    let node_watch = tokio::spawn(watch_node(
        Api::all(clients.node.clone()),
        node_name.clone(),
        node_tx,
    ));

    let (fs_tx, mut fs_rx) = mpsc::unbounded_channel();
    let mut fs = fswatch::FsWatch::start(&args.cni.cni_conf_dir, &args.cni.cni_bin_dirs, fs_tx)
        .context("starting inotify watches")?;
    if !fs.all_direct() {
        tracing::info!(node = %node_name, dir = %args.cni.cni_conf_dir.display(), "a CNI directory does not exist yet; waiting for it");
    }

    let prober = Arc::new(args.cni.prober());
    let cni = Arc::new(args.cni.clone());
    let mut resync = tokio::time::interval(args.resync_interval);
    resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    resync.tick().await; // the first tick is immediate; the start-up verification covers it
    let mut shutdown = std::pin::pin!(meshgate_shell::shutdown::signal());

    let backoff = || {
        ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(50))
            .with_max_delay(Duration::from_millis(500))
            .with_jitter()
            .without_max_times()
            .build()
    };
    let mut retry = backoff();
    let mut retry_at: Option<tokio::time::Instant>;
    // When the disk last changed: the start of the untaint-latency measurement.
    let mut changed_at = Instant::now();
    let mut verdict: Option<ChainVerdict> = None;
    let mut wake = Wake::Resync;

    loop {
        progress.pass_started();
        // Verify unless only the Node changed and we already have a fresh verdict.
        if !matches!(wake, Wake::NodeChanged) || verdict.is_none() {
            let v = verify(cni.clone(), prober.clone()).await;
            metrics.verified(v.reason.as_str());
            if verdict.as_ref().map(|o| (o.reason, &o.message)) != Some((v.reason, &v.message)) {
                tracing::info!(node = %node_name, reason = %v.reason, verified = v.verified, message = %v.message, "verdict");
            }
            verdict_tx.send_if_modified(|cur| {
                let changed =
                    cur.as_ref().map(|c| (c.verified, c.reason)) != Some((v.verified, v.reason));
                if changed {
                    *cur = Some(v.clone());
                }
                changed
            });
            verdict = Some(v);
        }
        let Some(v) = verdict.as_ref() else { continue };

        let seen = node_rx.borrow_and_update().clone();
        match gate.reconcile(seen, v).await {
            Ok(applied) => {
                retry = backoff();
                retry_at = None;
                if let Some(added) = applied.taint {
                    metrics.taint(added);
                    if added {
                        tracing::warn!(node = %node_name, reason = %v.reason, "node tainted: CNI chain not verified");
                    } else {
                        let latency = applied
                            .taint_at
                            .unwrap_or_else(Instant::now)
                            .saturating_duration_since(changed_at);
                        metrics.untaint_latency.observe(latency.as_secs_f64());
                        tracing::info!(node = %node_name, latency_ms = latency.as_millis() as u64, "node untainted: CNI chain verified");
                    }
                }
                if let Some(event) = applied.event {
                    tracing::info!(node = %node_name, event, "event published");
                }
                metrics.node_verified.set(i64::from(v.verified));
                ready.store(true, Ordering::Release);
                let last = state::LastVerdict {
                    reason: v.reason.as_str().to_string(),
                    verified: v.verified,
                };
                let saved = shared.update(|s| {
                    let changed = s.last_verdict.as_ref() != Some(&last);
                    s.last_verdict = Some(last);
                    changed
                });
                if let Err(e) = saved {
                    tracing::warn!(node = %node_name, error = %e, "cannot save state");
                }
            }
            Err(e) => {
                let delay = retry.next().unwrap_or(Duration::from_millis(500));
                tracing::warn!(node = %node_name, error = %e, retry_in_ms = delay.as_millis() as u64, "reconcile failed; the Node keeps its current state");
                retry_at = Some(tokio::time::Instant::now() + delay);
            }
        }

        progress.pass_ended();
        wake = tokio::select! {
            _ = &mut shutdown => break,
            Some(t) = fs_rx.recv() => Wake::Files(t),
            _ = resync.tick() => Wake::Resync,
            Ok(()) = node_rx.changed() => Wake::NodeChanged,
            _ = sleep_until(retry_at) => Wake::Retry,
        };
        if let Wake::Files(first) = wake {
            changed_at = coalesce(&mut fs_rx, first, args.coalesce).await;
            fs.ensure();
        }
    }

    tracing::info!(node = %node_name, "stopping; the Node keeps its taint state as it is");
    let _ = stop_tx.send(true);
    node_watch.abort();
    if let Some(admin) = admin {
        let _ = admin.await;
    }
    let _ = pods.await;
    if let Err(e) = shared.save() {
        tracing::warn!(node = %node_name, error = %e, "cannot save state");
    }
    Ok(())
}

/// A burst of file events ends after `quiet` without one, and at the latest
/// `COALESCE_LIMIT` times `quiet` after it began.
const COALESCE_LIMIT: u32 = 10;

/// Waits until a burst of file events is over, so a write-then-rename is one change, and
/// returns when the last event of the burst happened. The bound matters: a writer touching
/// the directories more often than `quiet`, forever (a flapping installer, a log rotated into
/// the conf dir), would otherwise keep the node from ever being verified again.
async fn coalesce(
    rx: &mut mpsc::UnboundedReceiver<Instant>,
    first: Instant,
    quiet: Duration,
) -> Instant {
    let end = tokio::time::Instant::now() + quiet * COALESCE_LIMIT;
    let mut last = first;
    loop {
        let at = (tokio::time::Instant::now() + quiet).min(end);
        match tokio::time::timeout_at(at, rx.recv()).await {
            Ok(Some(t)) => last = t,
            Ok(None) | Err(_) => return last,
        }
    }
}

async fn wait_stop(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|stop| *stop).await;
}

async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Verifies on a blocking thread (it reads files and runs plugin binaries). An unreadable
/// config dir is a verdict, not a crash: the node stays gated.
async fn verify(cni: Arc<CniArgs>, prober: Arc<crate::cni::Prober>) -> ChainVerdict {
    let dir = cni.cni_conf_dir.display().to_string();
    let runtime: Runtime = cni.runtime;
    let result = tokio::task::spawn_blocking(move || cni.verify(&prober)).await;
    let why = match result {
        Ok(Ok(v)) => return v,
        Ok(Err(e)) => format!("cannot read {dir}: {e}"),
        Err(e) => format!("verification failed: {e}"),
    };
    ChainVerdict {
        verified: false,
        reason: Reason::ConfigInvalid,
        message: why,
        config_file: None,
        plugins: Vec::new(),
        runtime,
    }
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
            Err(e) => tracing::debug!(node = %name, error = %e, "node watch error; retrying"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_burst_ends_when_it_goes_quiet_and_reports_its_last_event() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let first = Instant::now();
        let mut sent = Vec::new();
        for _ in 0..3 {
            let t = Instant::now();
            tx.send(t).unwrap();
            sent.push(t);
        }
        let last = coalesce(&mut rx, first, Duration::from_millis(20)).await;
        assert_eq!(last, sent[2]);
    }

    /// A writer touching the directory every 5 ms forever: the burst is cut at its bound
    /// (200 ms here) instead of keeping the loop from verifying while the writes go on.
    #[tokio::test]
    async fn a_burst_that_never_goes_quiet_is_cut_at_its_bound() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let writer = tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(5)).await;
                if tx.send(Instant::now()).is_err() {
                    break;
                }
            }
        });
        let start = Instant::now();
        let ended = tokio::time::timeout(
            Duration::from_secs(5),
            coalesce(&mut rx, start, Duration::from_millis(20)),
        )
        .await;
        assert!(
            ended.is_ok(),
            "the burst was never cut while the writes went on"
        );
        assert!(
            !writer.is_finished(),
            "the writer was still writing when it was cut"
        );
        writer.abort();
    }
}
