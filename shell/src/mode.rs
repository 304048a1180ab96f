//! The live mode both daemons act in: a watch of the ConfigMap `meshgate-mode` (key `mode`)
//! in meshgate's namespace, published to the rest of the process as a `tokio::sync::watch`.
//!
//! In: [`ModeSource`] (`--namespace`, `--mode-configmap`), a `kube::Client`, and the
//! ConfigMap's changes, watched by name (a field selector on `metadata.name`, so a Role with
//! `resourceNames: [meshgate-mode]` suffices). Out: a `watch::Receiver<Mode>` that follows it
//! without a restart, the gauges `meshgate_mode{mode}` and `meshgate_mode_config_invalid`, and
//! the counter `meshgate_report_only_actions_total{action}` the daemons feed in report mode.
//!
//! No ConfigMap, or no `mode` key, is `enforce`. A value meshgate does not know is
//! `enforce` too (`Mode::FAIL_CLOSED`): a typo never opens the gate. It is logged as an
//! error and `meshgate_mode_config_invalid` stays 1 until the value is fixed.
//! [`ModeWatch::start`] waits (bounded) for the first list, so a daemon restarted in report
//! mode never acts as enforce for its first moments.

use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use meshgate_core::mode::{self, Mode};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Where the mode is read from (both daemons' flags, in [`crate::cli::Common`]).
#[derive(Clone, Debug, PartialEq, Eq, clap::Args)]
pub struct ModeSource {
    /// meshgate's own namespace, where the mode ConfigMap lives (the manifests set it from
    /// the Downward API).
    #[arg(long, env = "MESHGATE_NAMESPACE", default_value = DEFAULT_NAMESPACE)]
    pub namespace: String,
    /// The ConfigMap whose `mode` key says enforce, report or condition-only; absent means
    /// enforce.
    #[arg(long, env = "MESHGATE_MODE_CONFIGMAP", default_value = mode::CONFIGMAP)]
    pub mode_configmap: String,
}

/// `--namespace`'s default: the manifests' namespace.
pub const DEFAULT_NAMESPACE: &str = "meshgate-system";

impl Default for ModeSource {
    fn default() -> Self {
        Self {
            namespace: DEFAULT_NAMESPACE.to_owned(),
            mode_configmap: mode::CONFIGMAP.to_owned(),
        }
    }
}

/// `mode` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModeLabel {
    mode: &'static str,
}

/// `action` label of `meshgate_report_only_actions_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ActionLabel {
    action: &'static str,
}

/// What report mode counts: what enforce would have done instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WouldAction {
    /// The agent would have tainted its Node (once per transition to unverified).
    Taint,
    /// The agent would have evicted a pod (once per pod sandbox).
    Evict,
    /// The webhook would have refused a placement (once per review).
    Refuse,
}

impl WouldAction {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            WouldAction::Taint => "taint",
            WouldAction::Evict => "evict",
            WouldAction::Refuse => "refuse",
        }
    }
}

/// The mode's metrics; cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct ModeMetrics {
    mode: Family<ModeLabel, Gauge>,
    invalid: Gauge,
    report_only: Family<ActionLabel, Counter>,
}

impl ModeMetrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "meshgate_mode",
            "1 for the mode this process acts in (enforce, report, condition-only), 0 for the others",
            m.mode.clone(),
        );
        registry.register(
            "meshgate_mode_config_invalid",
            "1 while the mode ConfigMap holds a value meshgate does not know (it then enforces)",
            m.invalid.clone(),
        );
        registry.register(
            "meshgate_report_only_actions",
            "What enforce would have done while in report mode, by action (taint, evict, refuse)",
            m.report_only.clone(),
        );
        m
    }

    /// Records the mode in force and whether the setting was invalid.
    fn set(&self, current: Mode, invalid: bool) {
        for m in Mode::ALL {
            let on = i64::from(m == current);
            self.mode
                .get_or_create(&ModeLabel { mode: m.as_str() })
                .set(on);
        }
        self.invalid.set(i64::from(invalid));
    }

    /// Counts one thing report mode did not do.
    pub fn would(&self, action: WouldAction) {
        let label = ActionLabel {
            action: action.as_str(),
        };
        self.report_only.get_or_create(&label).inc();
    }
}

/// The live mode: a receiver that follows the ConfigMap, and the task that watches it.
pub struct ModeWatch {
    rx: watch::Receiver<Mode>,
    task: JoinHandle<()>,
}

impl ModeWatch {
    /// Starts watching `source` through `client` and waits up to `first` for the first list;
    /// if it does not come in time the mode stays `enforce` until it does.
    pub async fn start(
        client: kube::Client,
        source: &ModeSource,
        metrics: ModeMetrics,
        first: Duration,
    ) -> Self {
        let (tx, rx) = watch::channel(Mode::FAIL_CLOSED);
        let (synced_tx, mut synced) = watch::channel(false);
        metrics.set(Mode::FAIL_CLOSED, false);
        let api: Api<ConfigMap> = Api::namespaced(client, &source.namespace);
        let config =
            watcher::Config::default().fields(&format!("metadata.name={}", source.mode_configmap));
        let stream = watcher::watcher(api, config).default_backoff();
        let follower = Follower {
            tx,
            synced: synced_tx,
            metrics,
            source: source.clone(),
            seen: None,
        };
        let task = tokio::spawn(follower.run(stream));
        if tokio::time::timeout(first, synced.wait_for(|s| *s))
            .await
            .is_err()
        {
            tracing::warn!(namespace = %source.namespace, configmap = %source.mode_configmap,
                waited_ms = first.as_millis() as u64,
                "the mode ConfigMap could not be read yet; enforcing until it is");
        }
        Self { rx, task }
    }

    /// A receiver of the mode, current and future.
    pub fn subscribe(&self) -> watch::Receiver<Mode> {
        self.rx.clone()
    }

    /// Stops the watch.
    pub fn stop(&self) {
        self.task.abort();
    }
}

impl Drop for ModeWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Follows the watch events of the one ConfigMap.
struct Follower {
    tx: watch::Sender<Mode>,
    synced: watch::Sender<bool>,
    metrics: ModeMetrics,
    source: ModeSource,
    /// The `mode` value seen during the current (re)list: `Some(None)` when the ConfigMap
    /// has no such key.
    seen: Option<Option<String>>,
}

impl Follower {
    async fn run(
        mut self,
        stream: impl futures::Stream<Item = Result<Event<ConfigMap>, watcher::Error>> + Send,
    ) {
        let mut stream = std::pin::pin!(stream);
        while let Some(item) = stream.next().await {
            match item {
                Ok(Event::Init) => self.seen = None,
                Ok(Event::InitApply(cm)) => self.seen = Some(value_of(&cm)),
                Ok(Event::InitDone) => {
                    let seen = self.seen.take().flatten();
                    self.adopt(seen.as_deref());
                    let _ = self.synced.send(true);
                }
                Ok(Event::Apply(cm)) => self.adopt(value_of(&cm).as_deref()),
                Ok(Event::Delete(_)) => self.adopt(None),
                Err(e) => {
                    tracing::warn!(namespace = %self.source.namespace, configmap = %self.source.mode_configmap,
                        error = %e, "mode ConfigMap watch error; retrying with backoff (the mode stays as it is)");
                }
            }
        }
    }

    /// Takes the ConfigMap's `mode` value (`None`: no ConfigMap or no key).
    fn adopt(&self, value: Option<&str>) {
        let (mode, invalid) = match Mode::from_config(value) {
            Ok(m) => (m, false),
            Err(e) => {
                tracing::error!(namespace = %self.source.namespace, configmap = %self.source.mode_configmap,
                    error = %e, fallback = %Mode::FAIL_CLOSED, "invalid mode; enforcing until it is fixed");
                (Mode::FAIL_CLOSED, true)
            }
        };
        self.metrics.set(mode, invalid);
        let changed = self.tx.send_if_modified(|cur| {
            let changed = *cur != mode;
            *cur = mode;
            changed
        });
        if changed {
            tracing::info!(%mode, configured = value.is_some(), "mode changed");
        }
    }
}

/// The ConfigMap's `mode` value, if it has one.
fn value_of(cm: &ConfigMap) -> Option<String> {
    cm.data.as_ref()?.get(mode::KEY).cloned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoded(registry: &Registry) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, registry).unwrap();
        out
    }

    fn configmap(mode: Option<&str>) -> ConfigMap {
        let data = mode.map(|m| [(mode::KEY.to_owned(), m.to_owned())].into());
        ConfigMap {
            data,
            ..ConfigMap::default()
        }
    }

    /// The watch events a ConfigMap's life produces, through the follower: the receiver and
    /// the metrics follow each one.
    #[tokio::test]
    async fn the_mode_follows_the_configmap_and_an_invalid_value_enforces() {
        let mut registry = Registry::default();
        let metrics = ModeMetrics::register(&mut registry);
        let (tx, rx) = watch::channel(Mode::FAIL_CLOSED);
        let (synced, synced_rx) = watch::channel(false);
        let follower = Follower {
            tx,
            synced,
            metrics,
            source: ModeSource::default(),
            seen: None,
        };
        let (events_tx, events) = tokio::sync::mpsc::unbounded_channel();
        let task = tokio::spawn(follower.run(tokio_stream_of(events)));
        let send = |e: Event<ConfigMap>| events_tx.send(Ok(e)).unwrap();
        let mut rx2 = rx.clone();
        let step = async |rx: &mut watch::Receiver<Mode>| {
            tokio::time::timeout(Duration::from_secs(5), rx.changed())
                .await
                .unwrap()
                .unwrap();
            *rx.borrow_and_update()
        };
        // The first list holds a ConfigMap saying report.
        send(Event::Init);
        send(Event::InitApply(configmap(Some("report"))));
        send(Event::InitDone);
        assert_eq!(step(&mut rx2).await, Mode::Report);
        assert!(*synced_rx.borrow());
        let text = encoded(&registry);
        assert!(text.contains("meshgate_mode{mode=\"report\"} 1"), "{text}");
        assert!(text.contains("meshgate_mode{mode=\"enforce\"} 0"), "{text}");
        // Edited to condition-only, then to a typo: enforce, flagged invalid.
        send(Event::Apply(configmap(Some("condition-only"))));
        assert_eq!(step(&mut rx2).await, Mode::ConditionOnly);
        send(Event::Apply(configmap(Some("conditon-only"))));
        assert_eq!(step(&mut rx2).await, Mode::Enforce);
        assert!(encoded(&registry).contains("meshgate_mode_config_invalid 1"));
        // Fixed, then deleted: enforce, valid.
        send(Event::Apply(configmap(Some("report"))));
        assert_eq!(step(&mut rx2).await, Mode::Report);
        send(Event::Delete(configmap(Some("report"))));
        assert_eq!(step(&mut rx2).await, Mode::Enforce);
        assert!(encoded(&registry).contains("meshgate_mode_config_invalid 0"));
        // A relist that no longer finds it: enforce (already); one without the key: same.
        send(Event::Apply(configmap(Some("report"))));
        assert_eq!(step(&mut rx2).await, Mode::Report);
        send(Event::Init);
        send(Event::InitDone);
        assert_eq!(step(&mut rx2).await, Mode::Enforce);
        drop(events_tx);
        task.await.unwrap();
    }

    /// An mpsc receiver as a stream (tokio-stream is not a dependency).
    fn tokio_stream_of<T: Send + 'static>(
        rx: tokio::sync::mpsc::UnboundedReceiver<T>,
    ) -> impl futures::Stream<Item = T> + Send {
        futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|x| (x, rx)) })
    }

    #[test]
    fn report_only_actions_are_counted_by_action() {
        let mut registry = Registry::default();
        let m = ModeMetrics::register(&mut registry);
        m.would(WouldAction::Evict);
        m.would(WouldAction::Refuse);
        m.would(WouldAction::Refuse);
        let text = encoded(&registry);
        for line in [
            "meshgate_report_only_actions_total{action=\"evict\"} 1",
            "meshgate_report_only_actions_total{action=\"refuse\"} 2",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
    }
}
