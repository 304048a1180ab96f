//! This node's meshed pods as the pod watch reports them, and which of them need an
//! inspection now.
//!
//! In: pods from the node-scoped watch, as [`PodInfo`]s (`super::pod_info`), the labels of
//! their namespaces when a profile selects on them, the node verdict's generation, and the results of
//! inspections and eviction attempts. Out: the pods due for inspection ([`Tracker::due`])
//! and when the next deferred retry is due ([`Tracker::next_retry`]).
//!
//! A pod is inspected once it runs with IPs, and again when its sandbox changes (IPs or
//! restart count: [`PodInfo::sandbox`]), when the node's verdict changes, when its
//! namespace's labels change which profiles select it, or when a deferred eviction (PDB
//! refusal, rate limit, failed call) or an `unknown` verdict is retried. Pods that no profile
//! selects, hostNetwork pods (no netns of their own) and terminating pods are never
//! inspected. A pod whose selection hangs on its namespace's labels (`istio-ambient`) is
//! kept, unselected, until they are known: an unknown namespace never selects. Pure: the
//! clock is a `Duration` since an arbitrary origin.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::Duration;

use meshgate_core::enroll::Enrollment;
use meshgate_core::profile::ProfileSet;

pub use super::pod_info::PodInfo;

/// First retry delay after a refusal or an `unknown` verdict; it doubles per consecutive one.
pub const RETRY_MIN: Duration = Duration::from_secs(2);
/// How long a profile that a label change just added to a running pod (a namespace labelled
/// `istio.io/dataplane-mode=ambient`, a pod label added) waits before it judges the pod: the
/// mesh enrolls running pods asynchronously, so an inspection at once would find them
/// `missing` and evict healthy pods that were about to be enrolled. Per (pod, profile): see
/// [`Enrollment`].
pub use meshgate_core::enroll::ENROLL_GRACE;
/// Retry delay cap.
pub const RETRY_MAX: Duration = Duration::from_secs(30);

/// How often an `unknown` verdict is retried before the pod is left alone (until its
/// sandbox or the node verdict changes): a VM-isolated pod stays unknown for good.
pub const MAX_UNKNOWN_RETRIES: u32 = 3;

/// What the tracker remembers about one pod.
#[derive(Clone, Debug)]
struct Entry {
    info: PodInfo,
    /// Sandbox, verdict generation and profiles judged of the last inspection.
    inspected: Option<Judged>,
    /// When a deferred eviction or an unknown verdict is retried.
    retry_at: Option<Duration>,
    /// Consecutive refusals / unknowns for this sandbox: the retry backoff exponent.
    failures: u32,
    /// When the pod was first seen inspectable in this sandbox (detection latency).
    ready_since: Option<Duration>,
    /// The profiles a label change added to the running pod, waiting [`ENROLL_GRACE`].
    enroll: Enrollment,
    /// The sandbox and Event action last published, so one outcome is published once.
    published: Option<(String, &'static str)>,
}

/// What one inspection covered: (sandbox, verdict generation, profiles judged).
type Judged = (String, u64, Vec<String>);

/// The profiles `entry` must be judged for at `now` under verdict generation `generation`,
/// or `None` when it is not due: every selecting profile out of its grace, once per sandbox,
/// generation and set of such profiles, and again when a retry is due.
fn needs_inspection(entry: &Entry, generation: u64, now: Duration) -> Option<Vec<String>> {
    if !entry.info.inspectable() {
        return None;
    }
    let profiles = entry.enroll.judgeable(&entry.info.profiles, now);
    if profiles.is_empty() {
        return None;
    }
    let current = (entry.info.sandbox(), generation, profiles);
    let due =
        entry.inspected.as_ref() != Some(&current) || entry.retry_at.is_some_and(|t| t <= now);
    due.then_some(current.2)
}

/// The retry delay after `failures` consecutive refusals: 2 s, 4 s, ... capped at 30 s.
pub fn retry_delay(failures: u32) -> Duration {
    let factor = 1u32.checked_shl(failures.min(16)).unwrap_or(u32::MAX);
    RETRY_MIN.saturating_mul(factor).min(RETRY_MAX)
}

/// One pod due for inspection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Due {
    /// The pod as last seen, with only the profiles to judge now in `profiles` (those still
    /// in their enrollment grace are left out).
    pub info: PodInfo,
    /// The verdict generation this inspection answers (pass back to [`Tracker::inspected`]).
    pub generation: u64,
    /// When it was first seen inspectable in this sandbox.
    pub ready_since: Duration,
}

/// The node's tracked pods.
#[derive(Debug, Default)]
pub struct Tracker {
    pods: HashMap<String, Entry>,
    generation: u64,
    /// UIDs listed since the watch (re)started its list; `None` outside a list.
    relist: Option<HashSet<String>>,
    listed: bool,
}

impl Tracker {
    /// An empty tracker, waiting for the first full list.
    pub fn new() -> Self {
        Self::default()
    }

    /// True once a first full list has been applied: only then is the view complete enough
    /// to inspect (and to prune the eviction history).
    pub fn listed(&self) -> bool {
        self.listed
    }

    /// Number of selected, non-hostNetwork pods (pods kept only until their namespace's
    /// labels are known do not count).
    pub fn len(&self) -> usize {
        self.pods.values().filter(|e| e.info.relevant()).count()
    }

    /// True when no pod is selected.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// UIDs of every kept pod.
    pub fn uids(&self) -> BTreeSet<String> {
        self.pods.keys().cloned().collect()
    }

    /// A namespace's labels are known now (or changed, or it is gone: `None`): selects its
    /// pods again. One that lost its selection is no longer inspected. A pod newly selected is
    /// due at once when the labels were not `known_before` (the agent only now learns them);
    /// when they were, the change enrolled running pods in a mesh, which the mesh does
    /// asynchronously, so they are due after [`ENROLL_GRACE`]. Returns how many pods changed
    /// selection.
    pub fn reselect_namespace(
        &mut self,
        namespace: &str,
        profiles: &ProfileSet,
        labels: Option<&BTreeMap<String, String>>,
        known_before: bool,
        now: Duration,
    ) -> usize {
        let mut changed = 0;
        for e in self.pods.values_mut() {
            if e.info.namespace != namespace {
                continue;
            }
            let before = e.info.profiles.clone();
            e.info.reselect(profiles, labels);
            if e.info.profiles != before {
                changed += 1;
                // Inspected for other profiles before (or never): inspect again.
                e.inspected = None;
                e.retry_at = None;
                e.failures = 0;
                e.ready_since = e.info.inspectable().then_some(now);
                e.enroll
                    .reselected(&before, &e.info.profiles, known_before, now);
            }
        }
        changed
    }

    /// The node's verdict changed: every pod is inspected again.
    pub fn verdict_changed(&mut self) {
        self.generation += 1;
    }

    /// A pod was added or modified.
    pub fn apply(&mut self, info: PodInfo, now: Duration) {
        if let Some(seen) = self.relist.as_mut() {
            seen.insert(info.uid.clone());
        }
        if !info.tracked() {
            self.pods.remove(&info.uid);
            return;
        }
        let ready = info.inspectable().then_some(now);
        match self.pods.get_mut(&info.uid) {
            Some(e) => {
                if e.info.sandbox() != info.sandbox() {
                    // A new sandbox starts with a clean slate.
                    e.retry_at = None;
                    e.failures = 0;
                    e.ready_since = ready;
                    e.enroll.clear();
                } else {
                    if e.ready_since.is_none() {
                        e.ready_since = ready;
                    }
                    // A label or annotation change may have put the running pod under
                    // another mesh: that profile waits, the others keep their clocks.
                    e.enroll
                        .reselected(&e.info.profiles, &info.profiles, true, now);
                }
                e.info = info;
            }
            None => {
                self.pods.insert(
                    info.uid.clone(),
                    Entry {
                        info,
                        inspected: None,
                        retry_at: None,
                        failures: 0,
                        ready_since: ready,
                        enroll: Enrollment::default(),
                        published: None,
                    },
                );
            }
        }
    }

    /// A pod was deleted.
    pub fn delete(&mut self, uid: &str) {
        self.pods.remove(uid);
    }

    /// The watch starts a (re)list: pods not listed again before [`Tracker::finish_list`]
    /// are gone.
    pub fn start_list(&mut self) {
        self.relist = Some(HashSet::new());
    }

    /// The (re)list is complete: forgets pods it did not list.
    pub fn finish_list(&mut self) {
        if let Some(seen) = self.relist.take() {
            self.pods.retain(|uid, _| seen.contains(uid));
        }
        self.listed = true;
    }

    /// The pods to inspect at `now`. Nothing before the first full list.
    pub fn due(&self, now: Duration) -> Vec<Due> {
        if !self.listed {
            return Vec::new();
        }
        let mut due: Vec<Due> = self
            .pods
            .values()
            .filter_map(|e| {
                let profiles = needs_inspection(e, self.generation, now)?;
                Some(Due {
                    info: PodInfo {
                        profiles,
                        ..e.info.clone()
                    },
                    generation: self.generation,
                    ready_since: e.ready_since.unwrap_or(now),
                })
            })
            .collect();
        // Oldest first: under a rate limit the pods that waited longest go first.
        due.sort_by(|a, b| {
            (a.ready_since, &a.info.namespace, &a.info.name).cmp(&(
                b.ready_since,
                &b.info.namespace,
                &b.info.name,
            ))
        });
        due
    }

    /// Records the inspection `due` asked for; clears any pending retry. Ignored when the
    /// pod changed sandbox meanwhile (it is due again).
    pub fn inspected(&mut self, due: &Due) {
        let sandbox = due.info.sandbox();
        if let Some(e) = self.pods.get_mut(&due.info.uid)
            && e.info.sandbox() == sandbox
        {
            e.inspected = Some((sandbox, due.generation, due.info.profiles.clone()));
            e.retry_at = None;
        }
    }

    /// The redirects are in place: forget past refusals.
    pub fn settled(&mut self, uid: &str) {
        if let Some(e) = self.pods.get_mut(uid) {
            e.failures = 0;
            e.retry_at = None;
        }
    }

    /// Retries the pod at `at` (a rate limit says exactly when a token frees up).
    pub fn retry_at(&mut self, uid: &str, at: Duration) {
        if let Some(e) = self.pods.get_mut(uid) {
            e.retry_at = Some(at);
        }
    }

    /// Retries the pod after the next backoff step (PDB refusal, failed call). Returns the
    /// delay chosen.
    pub fn back_off(&mut self, uid: &str, now: Duration) -> Option<Duration> {
        let e = self.pods.get_mut(uid)?;
        let delay = retry_delay(e.failures);
        e.failures = e.failures.saturating_add(1);
        e.retry_at = Some(now + delay);
        Some(delay)
    }

    /// An `unknown` verdict: retried with backoff a few times, then left alone until the
    /// sandbox or the node verdict changes. Returns the delay, or `None` when giving up.
    pub fn unknown(&mut self, uid: &str, now: Duration) -> Option<Duration> {
        let failures = self.pods.get(uid)?.failures;
        if failures >= MAX_UNKNOWN_RETRIES {
            return None;
        }
        self.back_off(uid, now)
    }

    /// True (and remembered) when this outcome was not yet published for this sandbox.
    pub fn should_publish(&mut self, uid: &str, sandbox: &str, action: &'static str) -> bool {
        let Some(e) = self.pods.get_mut(uid) else {
            return false;
        };
        let key = (sandbox.to_owned(), action);
        if e.published.as_ref() == Some(&key) {
            return false;
        }
        e.published = Some(key);
        true
    }

    /// The earliest pending retry or enrollment grace end, for the loop's timer. Graces
    /// that ended before `now` are not pending: the loop would wake at once, for ever.
    pub fn next_retry(&self, now: Duration) -> Option<Duration> {
        self.pods
            .values()
            .filter(|e| e.info.inspectable())
            .flat_map(|e| [e.retry_at, e.enroll.next_end(now)])
            .flatten()
            .min()
    }
}

#[cfg(test)]
mod tests;
