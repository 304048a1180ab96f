//! What the inspector does with the pods due: sweep them, judge each, carry out the decision.
//!
//! In: the tracker's due pods, a sweep's results, the eviction history and the rate limiter.
//! Out: per pod, one of: settled (redirects in place), retried (`unknown`), or, when its
//! redirects are missing, `core::evict::decide`'s [`Decision`] carried out — the Eviction API
//! call after the pinned namespace's re-check, the rate-limit token given back when nothing
//! was disrupted — then reported: metrics, logs and the pod's Event, once per sandbox and
//! outcome. A pod's lines are logged inside its `pod` span, which names it.

use std::time::Duration;

use meshgate_core::evict::{self, Candidate, Decision, SandboxKey, SkipWhy};
use meshgate_core::rules::{Inspection, RedirectVerdict};
use meshgate_shell::mode::WouldAction;
use tracing::Instrument;

use super::Inspector;
use super::cluster_budget::Deferral;
use super::eviction::{self, Answer, Outcome};
use super::pod_info::PodInfo;
use super::sweep::{self, Inspected, Job, ProxyCheck};
use super::tracker::{Due, Tracker};
use crate::daemon::state::State;
use crate::netns::Pinned;

/// A pod whose redirects are missing, as judged from its inspection.
struct Missing<'a> {
    due: &'a Due,
    /// The inspection that decided.
    decided: &'a Inspection,
    /// Whether the pod runs the deciding mesh's proxy container.
    has_proxy: bool,
    /// What was found, for the Event.
    summary: String,
    /// The inspected namespace, held for the re-check before evicting.
    pinned: Option<Pinned>,
    /// The deciding profile's missing part is its node proxy's listeners while the proxy
    /// is not ready: never evicted.
    node_proxy_hold: bool,
}

impl Inspector {
    /// Prunes the history, then sweeps and decides for every pod due.
    pub(super) async fn pass(&mut self) {
        if self.prune_history && self.tracker.listed() {
            self.prune_history = false;
            self.prune().await;
        }
        let due = self.tracker.due(self.now());
        if due.is_empty() {
            return;
        }
        let Some(batch) = self.sweep(&due).await else {
            return;
        };
        for (d, inspected) in due.into_iter().zip(batch) {
            // What one pod's inspection leads to is logged inside its span.
            let span = tracing::info_span!("pod", pod = %d.info.key());
            self.decide(d, inspected).instrument(span).await;
        }
    }

    /// Forgets the evictions of pods no longer on the node.
    async fn prune(&self) {
        let live = self.tracker.uids();
        self.save(
            move |s| {
                let before = s.evicted.len();
                s.evicted.retain_pods(&live);
                s.evicted.len() != before
            },
            "cannot save the pruned eviction history",
        )
        .await;
    }

    /// Writes an accepted eviction to the state file before anything else can happen.
    async fn record_eviction(&self, key: SandboxKey) {
        self.save(
            move |s| {
                s.evicted.record(key);
                true
            },
            "cannot save the eviction history; it is kept in memory",
        )
        .await;
    }

    /// Changes the state and saves it on the blocking pool; a failure is logged as `failed`
    /// (the change stays in memory).
    async fn save(
        &self,
        change: impl FnOnce(&mut State) -> bool + Send + 'static,
        failed: &'static str,
    ) {
        let state = self.state.clone();
        let saved = tokio::task::spawn_blocking(move || state.update(change)).await;
        let error = match saved {
            Ok(Ok(_)) => return,
            Ok(Err(e)) => e.to_string(),
            Err(e) => e.to_string(),
        };
        tracing::warn!(%error, "{failed}");
    }

    /// Inspects the pods due on the blocking pool; `None` when the batch failed (every pod
    /// is then `unknown` and retried later, rather than spinning on the same pods).
    async fn sweep(&mut self, due: &[Due]) -> Option<Vec<Inspected>> {
        // A pure input: the node's verdict is verified only while the proxy is ready there.
        let node_proxy = self
            .config
            .node_proxy
            .as_ref()
            .map(|(profile, proxy)| ProxyCheck {
                profile: profile.clone(),
                proxy: proxy.clone(),
                ready: self.proxy_settled(),
                pods: self
                    .node_proxy_pods
                    .as_ref()
                    .map(|rx| crate::daemon::node_proxy::ready_uids(rx.borrow().as_deref()))
                    .unwrap_or_default(),
            });
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
                    .filter_map(|n| self.config.profiles.get(n).cloned())
                    .collect(),
                node_proxy: node_proxy.clone(),
            })
            .collect();
        let dirs = self.config.netns_dirs.clone();
        let count = jobs.len();
        self.progress.pass_started();
        let span = tracing::Span::current();
        let work = move || {
            span.in_scope(|| {
                let batch = sweep::run(&sweep::confirm_ready(jobs), &dirs);
                let trim = std::time::Instant::now();
                // Every pod's read allocates its receive buffers and rules on this thread and
                // frees them; glibc keeps the freed pages in this thread's arena. Handed back
                // after each batch, the agent's resident memory is what it holds, not the
                // high-water mark of its largest batch (docs/performance.md, agent RSS).
                meshgate_shell::alloc::trim();
                (batch, trim.elapsed())
            })
        };
        let batch = tokio::task::spawn_blocking(work).await;
        self.progress.pass_ended();
        let (batch, trim) = match batch {
            Ok(b) => b,
            Err(e) => {
                tracing::error!(error = %e, pods = count, "pod inspection batch failed");
                let now = self.now();
                for d in due {
                    self.tracker.inspected(d);
                    self.tracker.unknown(&d.info.uid, now);
                }
                return None;
            }
        };
        for e in &batch.survey_errors {
            tracing::debug!(error = %e, "a network namespace could not be surveyed");
        }
        tracing::debug!(
            pods = count,
            namespaces = batch.namespaces,
            survey_us = batch.survey.as_micros() as u64,
            trim_us = trim.as_micros() as u64,
            "inspection batch"
        );
        Some(batch.pods)
    }

    /// Counts one pod's inspection and acts on its verdict.
    async fn decide(&mut self, d: Due, mut inspected: Inspected) {
        self.tracker.inspected(&d);
        for i in &inspected.inspections {
            self.metrics.inspected(&i.profile, i.verdict.as_str());
        }
        self.metrics
            .pod_inspection_seconds
            .observe(inspected.elapsed.as_secs_f64());
        let info = &d.info;
        let profiles = &self.config.profiles;
        let Some(decided) = sweep::combine(&inspected.inspections, |p| info.has_proxy(profiles, p))
        else {
            return;
        };
        let profile = &decided.profile;
        match decided.verdict {
            RedirectVerdict::Redirected => {
                self.tracker.settled(&info.uid);
                tracing::debug!(%profile, inspect_us = inspected.elapsed.as_micros() as u64, "mesh redirects in place");
            }
            RedirectVerdict::Unknown => {
                let retry = self.tracker.unknown(&info.uid, self.now());
                tracing::info!(%profile, why = %decided.message, retry_in_ms = retry.map(|r| r.as_millis() as u64), "pod's network namespace not inspectable; never evicting on unknown");
            }
            RedirectVerdict::Missing => {
                let has_proxy = info.has_proxy(profiles, profile);
                let summary = self.summary(decided, &inspected, has_proxy);
                let pinned = inspected.pinned.take();
                let node_proxy_hold = inspected.held.as_deref() == Some(profile.as_str());
                let missing = Missing {
                    due: &d,
                    decided,
                    has_proxy,
                    summary,
                    pinned,
                    node_proxy_hold,
                };
                self.act(missing).await;
            }
        }
    }

    /// The Event's account of what was found.
    fn summary(&self, decided: &Inspection, inspected: &Inspected, has_proxy: bool) -> String {
        let mut summary = sweep::summary(decided, inspected.netns.as_deref());
        if !has_proxy {
            let wanted = self
                .config
                .profiles
                .get(&decided.profile)
                .map(|p| p.proxy_containers.join(" or "))
                .unwrap_or_default();
            summary.push_str(&format!(" (the pod has no {wanted} container)"));
        }
        summary
    }

    /// Asks `core::evict` what to do about a pod whose redirects are missing, carries it out
    /// and reports the outcome.
    async fn act(&mut self, mut m: Missing<'_>) {
        let info = &m.due.info;
        let key = SandboxKey {
            pod_uid: info.uid.clone(),
            sandbox: info.sandbox(),
        };
        let candidate = Candidate {
            verdict: RedirectVerdict::Missing,
            has_proxy: m.has_proxy,
            owned: info.owned,
            node_proxy_hold: m.node_proxy_hold,
            key: &key,
        };
        let now = self.now();
        let flags = evict::Flags {
            mode: *self.mode.borrow(),
            ..self.config.flags
        };
        let limiter = &mut self.limiter;
        let decision = self
            .state
            .read(|s| evict::decide(&candidate, &s.evicted, limiter, flags, now));
        let outcome = match decision {
            Decision::NotNeeded | Decision::Skip(SkipWhy::Unknown) => return,
            Decision::Skip(SkipWhy::AlreadyEvicted) => {
                tracing::debug!("sandbox already evicted");
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
                let pinned = m.pinned.take();
                let Some(o) = self.evict(&m, pinned, key, token).await else {
                    return;
                };
                o
            }
        };
        self.report(&m, &outcome).await;
    }

    /// Evicts the pod if its namespace is still the one inspected; `None` when there is
    /// nothing to report (the namespace changed, or the pod is gone).
    async fn evict(
        &mut self,
        m: &Missing<'_>,
        pinned: Option<Pinned>,
        key: SandboxKey,
        token: Duration,
    ) -> Option<Outcome> {
        let (info, now) = (&m.due.info, self.now());
        let profile = &m.decided.profile;
        // The verdict is about the namespace that was read: act only while the pod's path
        // still leads to it and it still holds the pod's IPs (a recycled pid or a re-created
        // sandbox must never get a pod evicted).
        if let Err(why) = confirm(pinned, info).await {
            self.limiter.refund(token);
            let retry = self.tracker.unknown(&info.uid, now);
            tracing::warn!(%profile, %why, retry_in_ms = retry.map(|r| r.as_millis() as u64), "not evicting: the pod's network namespace changed since it was inspected");
            return None;
        }
        if let Some(Err(deferral)) = self.take_cluster_budget().await {
            // Not disrupted: the node's token goes back; the pod is tried again later.
            self.limiter.refund(token);
            let retry_in_ms = back_off_ms(&mut self.tracker, &info.uid, now);
            tracing::warn!(%profile, why = %deferral.why, retry_in_ms, "eviction deferred by the cluster-wide eviction budget");
            return Some(Outcome::ClusterBudget(deferral));
        }
        let detect_ms = now.saturating_sub(m.due.ready_since).as_millis() as u64;
        tracing::info!(%profile, detect_ms, "evicting: mesh redirects missing");
        let timeout = self.config.api_timeout;
        let answer = eviction::evict(
            &self.client,
            &info.namespace,
            &info.name,
            &info.uid,
            timeout,
        )
        .await;
        if answer != Answer::Evicted {
            // Nothing was disrupted: the token goes back.
            self.limiter.refund(token);
        }
        match answer {
            Answer::Evicted => {
                self.record_eviction(key).await;
                self.metrics.evicted(profile);
                Some(Outcome::Evicted)
            }
            Answer::Gone => {
                tracing::debug!("pod gone before its eviction");
                None
            }
            Answer::Pdb(message) => {
                let retry_in_ms = back_off_ms(&mut self.tracker, &info.uid, now);
                tracing::info!(%message, retry_in_ms, "eviction refused by a PodDisruptionBudget");
                Some(Outcome::Skipped(SkipWhy::Pdb))
            }
            Answer::MultiplePdbs(message) => {
                let retry_in_ms = back_off_ms(&mut self.tracker, &info.uid, now);
                tracing::warn!(%message, retry_in_ms, "eviction refused: several PodDisruptionBudgets match the pod");
                Some(Outcome::MultiplePdbs)
            }
            Answer::Failed(e) => {
                self.metrics.api_error("evict");
                let retry_in_ms = back_off_ms(&mut self.tracker, &info.uid, now);
                tracing::warn!(error = %e, retry_in_ms, "eviction failed");
                Some(Outcome::Failed(e))
            }
        }
    }

    /// One eviction from the cluster-wide budget; `None` when the budget is off.
    async fn take_cluster_budget(&self) -> Option<Result<(), Deferral>> {
        Some(self.cluster_budget.as_ref()?.take().await)
    }

    /// Counts, logs and publishes (once per sandbox and outcome) what happened to the pod.
    async fn report(&mut self, m: &Missing<'_>, outcome: &Outcome) {
        let info = &m.due.info;
        let profile = &m.decided.profile;
        if let Some(why) = outcome.skip_label() {
            self.metrics.skipped(why);
        }
        if *outcome == Outcome::Skipped(SkipWhy::Report) {
            self.metrics.mode.would(WouldAction::Evict);
        }
        let message = &m.decided.message;
        if *outcome == Outcome::Evicted {
            let detect_ms = self.now().saturating_sub(m.due.ready_since).as_millis() as u64;
            tracing::warn!(%profile, detect_ms, %message, "pod evicted: mesh redirects missing");
        } else {
            let what = outcome.describe(self.config.per_minute);
            tracing::warn!(%profile, outcome = %what, %message, "mesh redirects missing");
        }
        if self
            .tracker
            .should_publish(&info.uid, &info.sandbox(), outcome.action())
        {
            let event = outcome.event(&m.summary, self.config.per_minute);
            let regarding = eviction::pod_reference(&info.namespace, &info.name, &info.uid);
            self.events.publish(&event, &regarding).await;
        }
    }
}

/// Schedules the pod's retry after the next backoff step; the delay in ms, for the log.
fn back_off_ms(tracker: &mut Tracker, uid: &str, now: Duration) -> Option<u64> {
    tracker.back_off(uid, now).map(|r| r.as_millis() as u64)
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
