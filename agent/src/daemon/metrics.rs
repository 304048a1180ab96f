//! The agent's Prometheus metrics, named as in the contract.
//!
//! In: calls from the verifier, the Node reconciler and the pod inspector. Out: a
//! prometheus-client `Registry` served on `/metrics`. prometheus-client appends `_total` to
//! counters and the unit suffix to histograms registered with a unit, so names are
//! registered without those suffixes.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Metric, Registry, Unit};

use meshgate_shell::mode::ModeMetrics;

use crate::cni::answers::ProbeCounters;

/// `reason` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// A contract verification reason.
    pub reason: String,
}

/// `action` label: `added` / `removed`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActionLabel {
    /// What happened to the taint.
    pub action: String,
}

/// `profile` and `verdict` labels of `meshgate_pod_inspections_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct InspectionLabels {
    /// The mesh profile the pod was checked against.
    pub profile: String,
    /// `redirected` / `missing` / `unknown`.
    pub verdict: String,
}

/// `profile` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProfileLabel {
    /// The mesh profile.
    pub profile: String,
}

/// `why` label: `pdb` / `rate_limit` / `dry_run` / `unowned`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WhyLabel {
    /// Why the eviction did not happen.
    pub why: String,
}

/// `call` label of `meshgate_api_errors_total`: `node` / `evict` / `watch`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CallLabel {
    /// Which kind of API call failed.
    pub call: String,
}

/// `stage` label of `meshgate_verify_stage_seconds`: `event` / `read` / `probe` / `patch`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StageLabel {
    /// The stage of a pass that changed the taint.
    pub stage: String,
}

/// The buckets of `meshgate_verify_stage_seconds`: 100 µs .. ~3.3 s.
fn stage_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.0001, 2.0, 16))
}

/// The buckets of the untaint and re-taint latencies: 1 ms .. ~16 s.
fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 15))
}

/// `meshgate_node_reason` with every reason at 0, so a dashboard sees them all from the start.
fn node_reasons() -> Family<ReasonLabel, Gauge> {
    let family = Family::<ReasonLabel, Gauge>::default();
    for r in meshgate_core::cni::reason::Reason::ALL {
        family
            .get_or_create(&ReasonLabel {
                reason: r.as_str().to_string(),
            })
            .set(0);
    }
    family
}

/// Every agent metric.
#[derive(Clone)]
pub struct AgentMetrics {
    /// `meshgate_node_verified`: 1 while the applied verdict is Verified.
    pub node_verified: Gauge,
    /// `meshgate_verifications_total{reason}`.
    pub verifications: Family<ReasonLabel, Counter>,
    /// `meshgate_taint_transitions_total{action}`.
    pub taint_transitions: Family<ActionLabel, Counter>,
    /// `meshgate_node_reason{reason}`: 1 for the reason of the verdict the Node shows.
    pub node_reason: Family<ReasonLabel, Gauge>,
    /// `meshgate_node_gated_since_timestamp_seconds`: when the node became unverified (Unix
    /// seconds), 0 while verified.
    pub gated_since: Gauge<f64, AtomicU64>,
    /// `meshgate_untaint_latency_seconds`: config valid on disk → taint removal accepted.
    pub untaint_latency: Histogram,
    /// `meshgate_retaint_latency_seconds`: first file event of the change that broke the
    /// chain → taint accepted.
    pub retaint_latency: Histogram,
    /// `meshgate_api_errors_total{call}`: API calls that failed.
    pub api_errors: Family<CallLabel, Counter>,
    /// `meshgate_verify_stage_seconds{stage}`: the stages of each pass that changed the taint.
    pub verify_stage: Family<StageLabel, Histogram, fn() -> Histogram>,
    /// `meshgate_pod_inspections_total{profile,verdict}`.
    pub pod_inspections: Family<InspectionLabels, Counter>,
    /// `meshgate_pod_inspection_seconds`: reading one pod's netns and matching its rules.
    pub pod_inspection_seconds: Histogram,
    /// `meshgate_pods_evicted_total{profile}`.
    pub pods_evicted: Family<ProfileLabel, Counter>,
    /// `meshgate_evictions_skipped_total{why}`.
    pub evictions_skipped: Family<WhyLabel, Counter>,
    /// `meshgate_probe_cache_lookups_total{result}`, `meshgate_preprobes_total{result}`:
    /// counted by the prober.
    pub probes: ProbeCounters,
    /// `meshgate_mode{mode}`, `meshgate_mode_config_invalid`,
    /// `meshgate_report_only_actions_total{action}` (shared with the webhook).
    pub mode: ModeMetrics,
    /// `meshgate_fs_watch_polling`: 1 while the CNI directories are polled, not watched with
    /// inotify.
    pub fs_watch_polling: Gauge,
}

/// Registers each metric and hands back the handle the agent records into (the registry
/// keeps a clone; both share the same storage).
struct Registrar<'a>(&'a mut Registry);

impl Registrar<'_> {
    /// Registers `metric` as `name` (with `unit`, whose suffix prometheus-client appends).
    fn add<M: Metric + Clone>(
        &mut self,
        name: &str,
        unit: Option<Unit>,
        help: &str,
        metric: M,
    ) -> M {
        match unit {
            Some(unit) => self.0.register_with_unit(name, help, unit, metric.clone()),
            None => self.0.register(name, help, metric.clone()),
        }
        metric
    }
}

impl AgentMetrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let mode = ModeMetrics::register(registry);
        let mut reg = Registrar(registry);
        let probes = ProbeCounters::default();
        reg.add(
            "meshgate_probe_cache_lookups",
            None,
            "Plugin binaries a verification asked about, by result (hit: answer cached; inflight: waited for the probe already running; miss: run during the verification)",
            probes.lookups.clone(),
        );
        reg.add(
            "meshgate_preprobes",
            None,
            "Plugin binaries probed ahead when they appeared or changed in a bin dir, by result (ran/cached/dropped)",
            probes.preprobes.clone(),
        );
        Self {
            probes,
            mode,
            node_verified: reg.add(
                "meshgate_node_verified",
                None,
                "1 while this node's CNI chain is verified and applied, else 0",
                Gauge::default(),
            ),
            verifications: reg.add(
                "meshgate_verifications",
                None,
                "CNI chain verifications, by verdict reason",
                Family::default(),
            ),
            taint_transitions: reg.add(
                "meshgate_taint_transitions",
                None,
                "Taint changes on this node, by action (added/removed)",
                Family::default(),
            ),
            node_reason: reg.add(
                "meshgate_node_reason",
                None,
                "1 for the reason of the verdict this node's Node shows, 0 for the other reasons",
                node_reasons(),
            ),
            gated_since: reg.add(
                "meshgate_node_gated_since_timestamp_seconds",
                None,
                "When this node's verdict last turned from verified (or the agent's start) to not verified, in Unix seconds; 0 while verified",
                Gauge::default(),
            ),
            untaint_latency: reg.add(
                "meshgate_untaint_latency",
                Some(Unit::Seconds),
                "Time from the config change that made the chain valid to the API accepting the taint removal",
                latency_histogram(),
            ),
            retaint_latency: reg.add(
                "meshgate_retaint_latency",
                Some(Unit::Seconds),
                "Time from the first file event of the change that broke the chain to the API accepting the taint",
                latency_histogram(),
            ),
            api_errors: reg.add(
                "meshgate_api_errors",
                None,
                "API calls that failed, by call (node: a Node reconcile; evict: an eviction, PDB refusals aside; watch: a pod or namespace watch)",
                Family::default(),
            ),
            verify_stage: reg.add(
                "meshgate_verify_stage",
                Some(Unit::Seconds),
                "Stages of each verification pass that added or removed the taint: event (first file event to the end of coalescing), read (config read and parse), probe (plugin VERSION runs), patch (the Node write)",
                Family::new_with_constructor(stage_histogram),
            ),
            pod_inspections: reg.add(
                "meshgate_pod_inspections",
                None,
                "Meshed pod network namespaces checked, by profile and verdict (redirected/missing/unknown)",
                Family::default(),
            ),
            pod_inspection_seconds: reg.add(
                "meshgate_pod_inspection",
                Some(Unit::Seconds),
                "Time to read one pod network namespace's addresses and NAT rules and match them",
                // 10 µs .. ~2.6 s: one netns is read in well under a millisecond.
                Histogram::new(exponential_buckets(0.00001, 2.0, 18)),
            ),
            pods_evicted: reg.add(
                "meshgate_pods_evicted",
                None,
                "Pods evicted because their redirect rules were missing, by profile",
                Family::default(),
            ),
            evictions_skipped: reg.add(
                "meshgate_evictions_skipped",
                None,
                "Evictions not done for a pod with missing redirects, by why (pdb/rate_limit/dry_run/unowned/no_proxy/node_proxy_not_ready/cluster_budget)",
                Family::default(),
            ),
            fs_watch_polling: reg.add(
                "meshgate_fs_watch_polling",
                None,
                "1 while the CNI directories are polled every --fs-poll-interval (--fs-watch=poll, or auto without inotify: the host's fs.inotify limits reached), 0 while inotify watches them",
                Gauge::default(),
            ),
        }
    }

    /// Counts one verification.
    pub fn verified(&self, reason: &str) {
        self.verifications
            .get_or_create(&ReasonLabel {
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Counts one taint transition.
    pub fn taint(&self, added: bool) {
        let action = if added { "added" } else { "removed" };
        self.taint_transitions
            .get_or_create(&ActionLabel {
                action: action.to_string(),
            })
            .inc();
    }

    /// Observes one stage of a pass that changed the taint.
    pub fn stage(&self, stage: &str, took: std::time::Duration) {
        self.verify_stage
            .get_or_create(&StageLabel {
                stage: stage.to_string(),
            })
            .observe(took.as_secs_f64());
    }

    /// The Node shows a verdict with `reason`, verified or not: the reason gauges and the
    /// gated-since timestamp follow it (the timestamp keeps its value while still unverified).
    pub fn node_shows(&self, reason: &str, verified: bool) {
        for r in meshgate_core::cni::reason::Reason::ALL {
            let value = i64::from(r.as_str() == reason);
            self.node_reason
                .get_or_create(&ReasonLabel {
                    reason: r.as_str().to_string(),
                })
                .set(value);
        }
        if verified {
            self.gated_since.set(0.0);
        } else if self.gated_since.get() == 0.0 {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default();
            self.gated_since.set(now.as_secs_f64());
        }
    }

    /// Counts one failed API call of kind `call` (`node`, `evict`, `watch`).
    pub fn api_error(&self, call: &str) {
        self.api_errors
            .get_or_create(&CallLabel {
                call: call.to_string(),
            })
            .inc();
    }

    /// Counts one pod inspection for one profile.
    pub fn inspected(&self, profile: &str, verdict: &str) {
        self.pod_inspections
            .get_or_create(&InspectionLabels {
                profile: profile.to_string(),
                verdict: verdict.to_string(),
            })
            .inc();
    }

    /// Counts one eviction.
    pub fn evicted(&self, profile: &str) {
        self.pods_evicted
            .get_or_create(&ProfileLabel {
                profile: profile.to_string(),
            })
            .inc();
    }

    /// Counts one eviction not done, for a contract `why`.
    pub fn skipped(&self, why: &str) {
        self.evictions_skipped
            .get_or_create(&WhyLabel {
                why: why.to_string(),
            })
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_has_its_contract_name() {
        let mut registry = Registry::default();
        let m = AgentMetrics::register(&mut registry);
        m.verified("Verified");
        m.taint(true);
        m.inspected("linkerd", "missing");
        m.pod_inspection_seconds.observe(0.0002);
        m.evicted("linkerd");
        m.skipped("pdb");
        m.probes.lookup("hit");
        m.probes.preprobe("ran");
        m.node_shows("ChainedPluginMissing", false);
        m.api_error("node");
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for sample in [
            "meshgate_node_verified 0",
            "meshgate_verifications_total{reason=\"Verified\"} 1",
            "meshgate_taint_transitions_total{action=\"added\"} 1",
            "meshgate_untaint_latency_seconds_count 0",
            "meshgate_pod_inspections_total{profile=\"linkerd\",verdict=\"missing\"} 1",
            "meshgate_pod_inspection_seconds_count 1",
            "meshgate_pods_evicted_total{profile=\"linkerd\"} 1",
            "meshgate_evictions_skipped_total{why=\"pdb\"} 1",
            "meshgate_probe_cache_lookups_total{result=\"hit\"} 1",
            "meshgate_preprobes_total{result=\"ran\"} 1",
            "meshgate_node_reason{reason=\"ChainedPluginMissing\"} 1",
            "meshgate_node_reason{reason=\"Verified\"} 0",
            "meshgate_retaint_latency_seconds_count 0",
            "meshgate_api_errors_total{call=\"node\"} 1",
        ] {
            assert!(text.lines().any(|l| l == sample), "{sample} in\n{text}");
        }
        assert!(m.gated_since.get() > 0.0, "{text}");
        let since = m.gated_since.get();
        m.node_shows("NoConfig", false);
        assert_eq!(m.gated_since.get(), since, "still gated: the start stays");
        m.node_shows("Verified", true);
        assert_eq!(m.gated_since.get(), 0.0);
    }
}
