//! The verdict loop: `pass` → `next_wake`, until a stop request.
//!
//! In: its context, built by [`super::start`]: what a pass verifies with ([`Verifier`]: the
//! CNI args and prober, the inotify watches, and the node proxy's pods, socket and
//! connection when a named profile has one, [`NodeProxyWatch`]: ambient's ztunnel), where its
//! outcome goes ([`Outcome`]), and why it wakes up ([`Wakes`]: inotify events, the resync
//! tick, the Node watch, the live mode, stop requests). Out: one pass per wake-up — verify
//! (the chain, then the node proxy over it), hand the verdict to the pod inspector when it
//! changed, reconcile the Node as the mode allows ([`NodeGate`]), then record the outcome
//! (metrics, readiness, state file) or schedule a retry with capped backoff, and, after a
//! transient verdict, schedule verifying again. A mode change wakes the loop to write the
//! Node again without re-verifying.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};
use k8s_openapi::api::core::v1::Node;
use meshgate_core::cni::{ChainVerdict, Reason, Runtime};
use meshgate_core::event_reason;
use meshgate_core::mode::Mode;
use meshgate_shell::admin::LoopProgress;
use meshgate_shell::mode::WouldAction;
use meshgate_shell::shutdown::Shutdown;
use tokio::sync::{mpsc, watch};

use super::coalesce::coalesce;
use super::events::EventQueue;
use super::fswatch::{FsEvent, FsWatch};
use super::metrics::AgentMetrics;
use super::node::{Applied, GateError, NodeGate};
use super::node_proxy::{self, NodeProxyWatch};
use super::stages::PassClock;
use super::state::{self, Shared};
use super::timer::sleep_until;
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

/// What a pass verifies with.
pub struct Verifier {
    /// The CNI dirs, runtime and probes (`--cni-*`, `--require-plugin`, ...).
    pub cni: Arc<CniArgs>,
    pub prober: Arc<Prober>,
    /// The inotify watches on the CNI dirs: a pass makes them follow the delegate file its
    /// verdict names, a burst of events makes sure every dir is watched again.
    pub fs: FsWatch,
    /// The node proxy that must be ready too (ambient's ztunnel), when a named profile has one.
    pub node_proxy: Option<NodeProxyWatch>,
}

/// Where a pass's outcome goes.
pub struct Outcome {
    /// The Node's taint, label and condition.
    pub gate: NodeGate,
    /// Publishes the Node's Events off the loop, in order (see `events::EventQueue`).
    pub node_events: EventQueue,
    /// The verdict as the pod inspector sees it: sent only when it changes, so pods are
    /// inspected again after a change, not after every resync.
    pub to_pods: watch::Sender<Option<ChainVerdict>>,
    pub metrics: AgentMetrics,
    /// `/ready`: true once a pass has written the Node.
    pub ready: Arc<AtomicBool>,
    /// The state file (the last verdict).
    pub shared: Arc<Shared>,
}

impl Outcome {
    /// At stop, once the other tasks have: the queued Events are published and the state is
    /// saved.
    pub async fn finish(self) {
        self.node_events.stop().await;
        if let Err(e) = self.shared.save() {
            tracing::warn!(error = %e, "cannot save state");
        }
    }
}

/// Why the loop wakes up.
pub struct Wakes {
    /// SIGTERM or SIGINT: the loop ends.
    pub shutdown: Shutdown,
    /// The CNI dirs' inotify events ([`Verifier::fs`]).
    pub files: mpsc::UnboundedReceiver<FsEvent>,
    /// `--coalesce`: the quiet time that ends a burst of file events.
    pub coalesce: Duration,
    /// `--resync-interval`, its first (immediate) tick taken.
    pub resync: tokio::time::Interval,
    /// The Node, as last seen by a watch on it alone: reconciles read it instead of GETting,
    /// and a change by someone else (our taint removed by hand) wakes the loop.
    pub node: watch::Receiver<Option<Node>>,
    /// The live mode.
    pub mode: watch::Receiver<Mode>,
}

/// A backoff schedule and when its next step is due.
struct Schedule {
    new: fn() -> ExponentialBackoff,
    steps: ExponentialBackoff,
    at: Option<tokio::time::Instant>,
}

impl Schedule {
    fn new(new: fn() -> ExponentialBackoff) -> Self {
        Self {
            new,
            steps: new(),
            at: None,
        }
    }

    /// Nothing due; the next step starts from the first again.
    fn reset(&mut self) {
        self.steps = (self.new)();
        self.at = None;
    }

    /// Schedules the next step (`last` once the steps ran out) and returns its delay.
    fn next(&mut self, last: Duration) -> Duration {
        let delay = self.steps.next().unwrap_or(last);
        self.at = Some(tokio::time::Instant::now() + delay);
        delay
    }
}

/// The verdict loop's state between wake-ups.
pub struct VerdictLoop {
    verifier: Verifier,
    outcome: Outcome,
    wakes: Wakes,
    /// What `/live` follows.
    progress: LoopProgress,
    /// Retrying a failed reconcile.
    retry: Schedule,
    /// Verifying again after a transient verdict: its own schedule, which a successful
    /// reconcile does not reset (the verdict, not the write, is what may change).
    reverify: Schedule,
    /// When the disk last changed: the start of the untaint-latency measurement.
    changed_at: Instant,
    verdict: Option<ChainVerdict>,
    /// The stages of the pass under way (`verify stages` line, stage histogram).
    clock: PassClock,
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

impl VerdictLoop {
    /// The loop over its context; `progress` is in its first pass (the start-up) until the
    /// first [`Self::pass`] ends.
    pub fn new(verifier: Verifier, outcome: Outcome, wakes: Wakes, progress: LoopProgress) -> Self {
        Self {
            verifier,
            outcome,
            wakes,
            progress,
            retry: Schedule::new(backoff),
            reverify: Schedule::new(reverify_backoff),
            changed_at: Instant::now(),
            verdict: None,
            clock: PassClock::default(),
        }
    }

    /// Passes until a stop request; returns what the daemon's stop still needs.
    pub async fn run(mut self) -> (Verifier, Outcome) {
        let mut wake = Wake::Resync;
        loop {
            self.pass(&wake).await;
            match self.next_wake().await {
                Some(next) => wake = next,
                None => return (self.verifier, self.outcome),
            }
        }
    }

    /// One pass: verify (unless only the Node changed and the verdict is fresh), then make
    /// the Node say what the verdict says, and record the outcome. Its lines are logged
    /// inside a `pass` span that says why it ran.
    #[tracing::instrument(name = "pass", skip_all, fields(wake = wake.as_str()))]
    pub async fn pass(&mut self, wake: &Wake) {
        self.progress.pass_started();
        self.clock.pass_started();
        if !matches!(wake, Wake::NodeChanged | Wake::ModeChanged) || self.verdict.is_none() {
            let v = self.verify().await;
            self.adopt(v);
            self.schedule_reverify();
        }
        if let Some(v) = self.verdict.clone() {
            self.reconcile(&v).await;
        }
        self.progress.pass_ended();
    }

    /// The chain as the disk says now, with the node proxy over it.
    async fn verify(&mut self) -> ChainVerdict {
        let began = Instant::now();
        let verifier = &mut self.verifier;
        let (v, probing) = verify(verifier.cni.clone(), verifier.prober.clone()).await;
        self.clock.verified(began.elapsed(), probing);
        let delegate = v.delegate.as_ref().and_then(|d| d.file.as_deref());
        verifier
            .fs
            .follow_delegate(delegate.map(std::path::Path::new));
        match verifier.node_proxy.as_mut() {
            Some(np) => judge_node_proxy(v, np).await,
            None => v,
        }
    }

    /// Makes the Node say what `v` says, as the mode allows, and records the outcome.
    async fn reconcile(&mut self, v: &ChainVerdict) {
        let seen = self.wakes.node.borrow_and_update().clone();
        let mode = *self.wakes.mode.borrow_and_update();
        let gate = &mut self.outcome.gate;
        gate.measure_from(self.changed_at);
        self.clock.reconcile_started();
        match gate.reconcile_deferring_event(seen, v, mode).await {
            Ok((applied, event)) => {
                self.clock.report(&applied, &self.outcome.metrics);
                self.settled(v, &applied, mode);
                if let Some(e) = event {
                    self.outcome.node_events.send(e.event, e.regarding).await;
                }
            }
            Err(e) => self.failed(&e),
        }
    }

    /// Waits for the next reason to pass; `None` on a stop request. A burst of file events
    /// is waited out before returning.
    pub async fn next_wake(&mut self) -> Option<Wake> {
        let mut first = None;
        let w = &mut self.wakes;
        let wake = tokio::select! {
            () = w.shutdown.first() => return None,
            Some(e) = w.files.recv() => {
                let at = e.at;
                first = Some(e);
                Wake::Files(at)
            }
            _ = w.resync.tick() => Wake::Resync,
            Ok(()) = w.node.changed() => Wake::NodeChanged,
            Ok(()) = w.mode.changed() => Wake::ModeChanged,
            () = node_proxy_changed(self.verifier.node_proxy.as_mut()) => Wake::NodeProxy,
            _ = sleep_until(self.retry.at) => Wake::Retry,
            _ = sleep_until(self.reverify.at) => Wake::Reverify,
        };
        self.clock.woke(match wake {
            Wake::Files(first) => Some(first),
            _ => None,
        });
        match wake {
            Wake::Files(_) => {
                if let Some(first) = first {
                    self.changed_at = coalesce(&mut w.files, first, w.coalesce).await;
                }
                self.verifier.fs.ensure();
            }
            // The untaint latency runs from the change that made the node verifiable.
            Wake::NodeProxy => self.changed_at = Instant::now(),
            _ => {}
        }
        Some(wake)
    }

    /// Takes a new verdict: counts and logs it, and hands it to the pod inspector when its
    /// outcome (verified, reason) changed.
    fn adopt(&mut self, v: ChainVerdict) {
        self.outcome.metrics.verified(v.reason.as_str());
        let last = self.verdict.as_ref().map(|o| (o.reason, &o.message));
        if last != Some((v.reason, &v.message)) {
            tracing::info!(reason = %v.reason, verified = v.verified, message = %v.message, "verdict");
        }
        self.outcome.to_pods.send_if_modified(|cur| {
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
            self.reverify.reset();
            return;
        }
        let delay = self.reverify.next(REVERIFY_MAX);
        tracing::info!(
            retry_in_ms = delay.as_millis() as u64,
            "the verdict rests on a failure that may pass by itself; verifying again"
        );
    }

    /// The Node says what `v` says (as `mode` allows): metrics, readiness, the state file.
    fn settled(&mut self, v: &ChainVerdict, applied: &Applied, mode: Mode) {
        self.retry.reset();
        let metrics = &self.outcome.metrics;
        if mode.is_report() && applied.event == Some(event_reason::CHAIN_UNVERIFIED) {
            metrics.mode.would(WouldAction::Taint);
            tracing::warn!(reason = %v.reason, "report mode: would taint the node (CNI chain not verified)");
        }
        if let Some(added) = applied.taint {
            metrics.taint(added);
            if !added && !v.verified {
                tracing::info!(%mode, "meshgate's taint removed: this mode does not gate");
            } else if added {
                tracing::warn!(reason = %v.reason, "node tainted: CNI chain not verified");
            } else {
                let latency = applied.untaint_latency.unwrap_or_default();
                metrics.untaint_latency.observe(latency.as_secs_f64());
                tracing::info!(
                    latency_ms = latency.as_millis() as u64,
                    "node untainted: CNI chain verified"
                );
            }
        }
        if let Some(event) = applied.event {
            tracing::info!(event, "event queued");
        }
        metrics.node_verified.set(i64::from(v.verified));
        metrics.node_shows(v.reason.as_str(), v.verified);
        self.outcome.ready.store(true, Ordering::Release);
        let last = state::LastVerdict {
            reason: v.reason.as_str().to_string(),
            verified: v.verified,
        };
        let saved = self.outcome.shared.update(|s| {
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
        let delay = self.retry.next(Duration::from_millis(500));
        self.outcome.metrics.api_error("node");
        tracing::warn!(error = %e, retry_in_ms = delay.as_millis() as u64, "reconcile failed; the Node keeps its current state");
    }
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
