//! This node's meshed pods as the pod watch reports them, and which of them need an
//! inspection now.
//!
//! In: Pods from the node-scoped watch ([`SlimPod`]s, converted by [`PodInfo::from_pod`], so the
//! full objects are dropped at once and memory stays flat; of their labels and annotations
//! only those the profiles and the rules read are kept, `core::projection`), the labels of
//! their namespaces
//! when a profile selects on them, the node verdict's generation, and the results of
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
use std::net::IpAddr;
use std::time::Duration;

use meshgate_core::enroll::Enrollment;
use meshgate_core::profile::{PodView, ProfileSet, Selected};
use meshgate_core::projection::PodKeys;

use super::slim::SlimPod;

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

/// What the inspector needs to know about one pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodInfo {
    /// `metadata.namespace`.
    pub namespace: String,
    /// `metadata.name`.
    pub name: String,
    /// `metadata.uid`.
    pub uid: String,
    /// `metadata.labels` the profiles read, for selecting again when the namespace's labels
    /// change.
    pub labels: BTreeMap<String, String>,
    /// `metadata.annotations` the profiles and the rules read: selection, and the rules each
    /// mesh writes for this pod follow from them.
    pub annotations: BTreeMap<String, String>,
    /// Names of the containers and native sidecars (init containers with
    /// `restartPolicy: Always`): does it run its mesh's proxy?
    pub containers: Vec<String>,
    /// Names of the profiles that select the pod, in profile order.
    pub profiles: Vec<String>,
    /// True when some profile's selection of this pod hangs on its namespace's labels.
    pub namespace_dependent: bool,
    /// True when an ownerReference has `controller: true`: something recreates the pod.
    pub owned: bool,
    /// `spec.hostNetwork`: the pod shares the node's netns, there is nothing to inspect.
    pub host_network: bool,
    /// `status.phase == Running`.
    pub running: bool,
    /// `metadata.deletionTimestamp` is set.
    pub terminating: bool,
    /// `status.podIPs` (or `status.podIP`), parsed; unparsable entries are left out.
    pub ips: Vec<IpAddr>,
    /// Sum of the containers' restart counts: a recreated sandbox restarts every container.
    pub restarts: u32,
}

impl PodInfo {
    /// Reads a pod, keeping of its labels and annotations what `keys` (the profiles'
    /// [`PodKeys::inspection`]) says; `None` when it lacks a name, namespace or UID, or its
    /// labels or annotations are not maps of strings (never from the API: such a pod is never
    /// inspected). `namespace_labels` are its namespace's labels, `None` when not known (yet).
    pub fn from_pod(
        pod: &SlimPod,
        profiles: &ProfileSet,
        keys: &PodKeys,
        namespace_labels: Option<&BTreeMap<String, String>>,
    ) -> Option<Self> {
        let meta = &pod.metadata.meta;
        let namespace = meta.namespace.clone()?;
        let name = meta.name.clone()?;
        let uid = meta.uid.clone()?;
        let labels = keys.project_labels_json(pod.metadata.labels_json()).ok()?;
        let annotations = keys
            .project_annotations_json(pod.metadata.annotations_json())
            .ok()?;
        let containers = pod
            .spec
            .iter()
            .flat_map(|s| {
                let sidecars = s
                    .init_containers
                    .iter()
                    .flatten()
                    .filter(|c| c.restart_policy.as_deref() == Some("Always"));
                s.containers.iter().flatten().chain(sidecars)
            })
            .map(|c| c.name.clone())
            .collect();
        let owned = pod.metadata.controlled;
        let host_network = pod
            .spec
            .as_ref()
            .and_then(|s| s.host_network)
            .unwrap_or(false);
        let status = pod.status.as_ref();
        let running = status.and_then(|s| s.phase.as_deref()) == Some("Running");
        let mut ips: Vec<IpAddr> = status
            .and_then(|s| s.pod_ips.as_ref())
            .into_iter()
            .flatten()
            .filter_map(|p| p.ip.parse().ok())
            .collect();
        if ips.is_empty() {
            // Older kubelets and some stand-ins fill only the singular field.
            ips.extend(
                status
                    .and_then(|s| s.pod_ip.as_deref())
                    .and_then(|ip| ip.parse::<IpAddr>().ok()),
            );
        }
        ips.sort();
        ips.dedup();
        let restarts = status
            .and_then(|s| s.container_statuses.as_ref())
            .into_iter()
            .flatten()
            .map(|c| u32::try_from(c.restart_count).unwrap_or(0))
            .fold(0u32, u32::saturating_add);
        let mut info = Self {
            namespace,
            name,
            uid,
            labels,
            annotations,
            containers,
            profiles: Vec::new(),
            namespace_dependent: false,
            owned,
            host_network,
            running,
            terminating: meta.deletion_timestamp.is_some(),
            ips,
            restarts,
        };
        info.reselect(profiles, namespace_labels);
        Some(info)
    }

    /// Selects the profiles again, with the namespace's labels as now known. Only a
    /// certain selection counts: an unknown namespace never selects (never inspected, never
    /// evicted) until its labels arrive.
    pub fn reselect(
        &mut self,
        profiles: &ProfileSet,
        namespace_labels: Option<&BTreeMap<String, String>>,
    ) {
        let view = PodView {
            labels: &self.labels,
            annotations: &self.annotations,
            namespace_labels,
        };
        self.profiles = profiles
            .selection(view)
            .filter(|(_, s)| *s == Selected::Yes)
            .map(|(p, _)| p.name.clone())
            .collect();
        let blind = PodView {
            namespace_labels: None,
            ..view
        };
        self.namespace_dependent = profiles
            .selection(blind)
            .any(|(_, s)| s == Selected::Unknown);
    }

    /// True when it runs a proxy container of profile `name` (or that mesh has none).
    pub fn has_proxy(&self, profiles: &ProfileSet, name: &str) -> bool {
        profiles
            .get(name)
            .is_none_or(|p| p.proxy_present(self.containers.iter().map(String::as_str)))
    }

    /// True when the pod is to be inspected at all: a profile selects it and it has a netns
    /// of its own.
    pub fn relevant(&self) -> bool {
        !self.profiles.is_empty() && !self.host_network
    }

    /// True when the tracker keeps it: relevant, or a namespace label may make it so.
    pub fn tracked(&self) -> bool {
        !self.host_network && (!self.profiles.is_empty() || self.namespace_dependent)
    }

    /// True when its netns can be inspected now: running with IPs, not being deleted.
    pub fn inspectable(&self) -> bool {
        self.relevant() && self.running && !self.terminating && !self.ips.is_empty()
    }

    /// The sandbox identity: the pod IPs and the restart count. A new sandbox gets new IPs
    /// (or at least restarts every container), so it is inspected, and may be evicted, anew.
    pub fn sandbox(&self) -> String {
        let ips: Vec<String> = self.ips.iter().map(ToString::to_string).collect();
        format!("{}#{}", ips.join(","), self.restarts)
    }

    /// `namespace/name`, for logs.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

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
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Pod;

    fn pod(json: serde_json::Value) -> Pod {
        serde_json::from_value(json).expect("pod json")
    }

    fn meshed(name: &str, ip: &str) -> Pod {
        pod(serde_json::json!({
            "metadata": {
                "namespace": "ns", "name": name, "uid": format!("uid-{name}"),
                "labels": { "linkerd.io/control-plane-ns": "linkerd" },
                "ownerReferences": [{
                    "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "rs",
                    "uid": "rs-uid", "controller": true
                }]
            },
            "spec": { "containers": [{ "name": "app" }] },
            "status": {
                "phase": "Running", "podIP": ip, "podIPs": [{ "ip": ip }],
                "containerStatuses": [{
                    "name": "app", "image": "x", "imageID": "", "ready": true,
                    "restartCount": 0
                }]
            }
        }))
    }

    fn info(p: &Pod) -> PodInfo {
        // The namespace is known and carries no mesh label.
        info_in(p, &ProfileSet::all_builtin(), Some(&BTreeMap::new())).expect("identity")
    }

    /// [`PodInfo::from_pod`] with the keys `profiles` read, of `p` as the watch decodes it.
    fn info_in(
        p: &Pod,
        profiles: &ProfileSet,
        namespace_labels: Option<&BTreeMap<String, String>>,
    ) -> Option<PodInfo> {
        let slim: SlimPod = serde_json::from_str(&serde_json::to_string(p).unwrap()).unwrap();
        PodInfo::from_pod(
            &slim,
            profiles,
            &PodKeys::inspection(profiles),
            namespace_labels,
        )
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    fn listed(pods: &[&Pod]) -> Tracker {
        let mut t = Tracker::new();
        t.start_list();
        for p in pods {
            t.apply(info(p), secs(0));
        }
        t.finish_list();
        t
    }

    fn due_names(t: &Tracker, now: Duration) -> Vec<String> {
        t.due(now).into_iter().map(|d| d.info.name).collect()
    }

    fn inspect_all(t: &mut Tracker, now: Duration) {
        for d in t.due(now) {
            t.inspected(&d);
        }
    }

    #[test]
    fn pod_is_read_into_the_inspector_inputs() {
        let mut p = meshed("a", "10.1.0.5");
        let status = p.status.as_mut().unwrap();
        status.pod_ips = Some(vec![
            serde_json::from_value(serde_json::json!({"ip": "fd00::5"})).unwrap(),
            serde_json::from_value(serde_json::json!({"ip": "10.1.0.5"})).unwrap(),
            serde_json::from_value(serde_json::json!({"ip": "not-an-ip"})).unwrap(),
        ]);
        status.container_statuses.as_mut().unwrap()[0].restart_count = 2;
        let i = info(&p);
        assert_eq!(i.key(), "ns/a");
        assert_eq!(i.uid, "uid-a");
        assert_eq!(i.profiles, ["linkerd"]);
        assert!(i.owned && i.running && !i.terminating && !i.host_network);
        assert_eq!(
            i.ips,
            [
                "10.1.0.5".parse::<IpAddr>().unwrap(),
                "fd00::5".parse().unwrap()
            ]
        );
        assert_eq!(i.sandbox(), "10.1.0.5,fd00::5#2");
        assert!(i.inspectable());

        // Only the singular podIP: still read.
        let mut p = meshed("b", "10.1.0.6");
        p.status.as_mut().unwrap().pod_ips = None;
        assert_eq!(info(&p).ips, ["10.1.0.6".parse::<IpAddr>().unwrap()]);

        // An owner that is not the controller does not count.
        let mut p = meshed("c", "10.1.0.7");
        p.metadata.owner_references.as_mut().unwrap()[0].controller = Some(false);
        assert!(!info(&p).owned);

        // No identity, no info.
        let mut p = meshed("d", "10.1.0.8");
        p.metadata.uid = None;
        assert_eq!(info_in(&p, &ProfileSet::all_builtin(), None), None);
    }

    #[test]
    fn only_running_selected_pods_with_their_own_netns_are_inspected() {
        let ok = meshed("ok", "10.1.0.1");
        let mut plain = meshed("plain", "10.1.0.2");
        plain.metadata.labels = None;
        let mut host = meshed("host", "10.1.0.3");
        host.spec.as_mut().unwrap().host_network = Some(true);
        let mut pending = meshed("pending", "10.1.0.4");
        pending.status.as_mut().unwrap().phase = Some("Pending".into());
        let mut no_ip = meshed("noip", "10.1.0.5");
        no_ip.status.as_mut().unwrap().pod_ip = None;
        no_ip.status.as_mut().unwrap().pod_ips = None;
        let mut deleting = meshed("deleting", "10.1.0.6");
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ));
        let t = listed(&[&ok, &plain, &host, &pending, &no_ip, &deleting]);
        // Unselected and hostNetwork pods are not even kept.
        assert_eq!(t.len(), 4);
        assert_eq!(due_names(&t, secs(1)), ["ok"]);
    }

    #[test]
    fn nothing_is_due_before_the_first_full_list() {
        let mut t = Tracker::new();
        t.start_list();
        t.apply(info(&meshed("a", "10.1.0.1")), secs(0));
        assert!(t.due(secs(0)).is_empty());
        t.finish_list();
        assert_eq!(due_names(&t, secs(0)), ["a"]);
    }

    #[test]
    fn inspected_once_then_again_on_sandbox_or_verdict_change() {
        let a = meshed("a", "10.1.0.1");
        let mut t = listed(&[&a]);
        inspect_all(&mut t, secs(1));
        assert!(t.due(secs(2)).is_empty(), "inspected once");

        // A status update that changes nothing about the sandbox: not due.
        let mut same = a.clone();
        same.status.as_mut().unwrap().conditions = Some(vec![]);
        t.apply(info(&same), secs(3));
        assert!(t.due(secs(3)).is_empty());

        // Restart count moves: the sandbox may have been recreated.
        let mut restarted = a.clone();
        restarted
            .status
            .as_mut()
            .unwrap()
            .container_statuses
            .as_mut()
            .unwrap()[0]
            .restart_count = 1;
        t.apply(info(&restarted), secs(4));
        assert_eq!(due_names(&t, secs(4)), ["a"]);
        inspect_all(&mut t, secs(4));

        // New IP: new sandbox.
        t.apply(info(&meshed("a", "10.1.0.9")), secs(5));
        assert_eq!(due_names(&t, secs(5)), ["a"]);
        inspect_all(&mut t, secs(5));
        assert!(t.due(secs(6)).is_empty());

        // The node's verdict changes: everything again, once.
        t.verdict_changed();
        assert_eq!(due_names(&t, secs(7)), ["a"]);
        inspect_all(&mut t, secs(7));
        assert!(t.due(secs(8)).is_empty());
    }

    #[test]
    fn a_verdict_change_during_an_inspection_is_not_lost() {
        let mut t = listed(&[&meshed("a", "10.1.0.1")]);
        let batch = t.due(secs(1));
        t.verdict_changed();
        for d in batch {
            t.inspected(&d);
        }
        assert_eq!(due_names(&t, secs(2)), ["a"]);
    }

    #[test]
    fn refusals_back_off_and_a_new_sandbox_resets() {
        let mut t = listed(&[&meshed("a", "10.1.0.1")]);
        inspect_all(&mut t, secs(0));
        assert_eq!(t.back_off("uid-a", secs(10)), Some(secs(2)));
        assert_eq!(t.next_retry(secs(10)), Some(secs(12)));
        assert!(t.due(secs(11)).is_empty());
        assert_eq!(due_names(&t, secs(12)), ["a"]);
        inspect_all(&mut t, secs(12));
        assert_eq!(t.next_retry(secs(12)), None, "inspection clears the retry");
        assert_eq!(t.back_off("uid-a", secs(12)), Some(secs(4)));
        assert_eq!(t.back_off("uid-a", secs(12)), Some(secs(8)));
        for _ in 0..10 {
            t.back_off("uid-a", secs(12));
        }
        assert_eq!(t.back_off("uid-a", secs(12)), Some(RETRY_MAX));

        // A new sandbox starts over.
        t.apply(info(&meshed("a", "10.1.0.2")), secs(13));
        inspect_all(&mut t, secs(13));
        assert_eq!(t.back_off("uid-a", secs(13)), Some(secs(2)));

        // Redirects found: the slate is clean.
        t.settled("uid-a");
        assert_eq!(t.next_retry(secs(14)), None);
        assert_eq!(t.back_off("uid-a", secs(14)), Some(secs(2)));
    }

    #[test]
    fn unknown_is_retried_a_few_times_only() {
        let mut t = listed(&[&meshed("a", "10.1.0.1")]);
        let mut now = secs(0);
        let mut retries = 0;
        loop {
            inspect_all(&mut t, now);
            match t.unknown("uid-a", now) {
                Some(d) => {
                    retries += 1;
                    now += d;
                    assert_eq!(due_names(&t, now), ["a"]);
                }
                None => break,
            }
        }
        assert_eq!(retries, MAX_UNKNOWN_RETRIES);
        assert!(t.due(now + RETRY_MAX).is_empty());
    }

    #[test]
    fn rate_limited_pods_retry_when_the_token_frees_up_oldest_first() {
        let mut t = Tracker::new();
        t.start_list();
        t.apply(info(&meshed("late", "10.1.0.2")), secs(5));
        t.apply(info(&meshed("early", "10.1.0.1")), secs(1));
        t.finish_list();
        assert_eq!(due_names(&t, secs(6)), ["early", "late"]);
        inspect_all(&mut t, secs(6));
        t.retry_at("uid-late", secs(60));
        assert_eq!(t.next_retry(secs(6)), Some(secs(60)));
        assert_eq!(due_names(&t, secs(60)), ["late"]);
    }

    #[test]
    fn a_relist_forgets_pods_that_are_gone_and_keeps_the_rest() {
        let mut t = listed(&[&meshed("a", "10.1.0.1"), &meshed("b", "10.1.0.2")]);
        inspect_all(&mut t, secs(0));
        t.start_list();
        t.apply(info(&meshed("a", "10.1.0.1")), secs(5));
        t.finish_list();
        assert_eq!(t.uids(), BTreeSet::from(["uid-a".to_string()]));
        assert!(
            t.due(secs(5)).is_empty(),
            "a was inspected before the relist"
        );
        t.delete("uid-a");
        assert!(t.is_empty());
    }

    #[test]
    fn a_pod_that_loses_its_mesh_label_is_dropped() {
        let mut t = listed(&[&meshed("a", "10.1.0.1")]);
        let mut p = meshed("a", "10.1.0.1");
        p.metadata.labels = None;
        t.apply(info(&p), secs(1));
        assert!(t.is_empty());
    }

    #[test]
    fn each_outcome_is_published_once_per_sandbox() {
        let mut t = listed(&[&meshed("a", "10.1.0.1")]);
        assert!(t.should_publish("uid-a", "s1", "DryRun"));
        assert!(!t.should_publish("uid-a", "s1", "DryRun"));
        assert!(t.should_publish("uid-a", "s1", "Evict"));
        assert!(t.should_publish("uid-a", "s2", "Evict"));
        assert!(!t.should_publish("uid-gone", "s1", "Evict"));
    }

    /// A pod as Istio's ambient mode meets it: no mesh label of its own, enrolled by its
    /// namespace's `istio.io/dataplane-mode=ambient`.
    fn ambient_candidate(name: &str, ip: &str) -> Pod {
        let mut p = meshed(name, ip);
        p.metadata.labels = Some(BTreeMap::from([("app".to_string(), "web".to_string())]));
        p
    }

    /// An operator labels a namespace `istio.io/dataplane-mode=ambient` (or a running pod):
    /// Istio enrolls its running pods asynchronously, so they are left alone for
    /// ENROLL_GRACE instead of being inspected (and evicted as `missing`) at once.
    #[test]
    fn running_pods_enrolled_by_a_label_change_get_time_to_be_enrolled() {
        let set = ProfileSet::all_builtin();
        let ambient =
            BTreeMap::from([("istio.io/dataplane-mode".to_string(), "ambient".to_string())]);
        let plain = BTreeMap::new();
        let p = ambient_candidate("a", "10.1.0.1");
        let mut t = Tracker::new();
        t.start_list();
        t.apply(info_in(&p, &set, Some(&plain)).unwrap(), secs(0));
        t.finish_list();
        assert!(t.due(secs(1)).is_empty(), "not meshed yet");

        // The known namespace is labelled at 10 s.
        assert_eq!(
            t.reselect_namespace("ns", &set, Some(&ambient), true, secs(10)),
            1
        );
        assert!(t.due(secs(10)).is_empty());
        assert!(t.due(secs(10) + ENROLL_GRACE - secs(1)).is_empty());
        assert_eq!(
            t.next_retry(secs(10)),
            Some(secs(10) + ENROLL_GRACE),
            "the loop wakes for it"
        );
        let due = t.due(secs(10) + ENROLL_GRACE);
        assert_eq!(due.len(), 1);
        assert_eq!(due[0].info.profiles, ["istio-ambient"]);
        t.inspected(&due[0]);
        assert_eq!(
            t.next_retry(secs(10) + ENROLL_GRACE),
            None,
            "an ended grace does not keep the loop awake"
        );

        // The same through the pod's own label, on a pod of a plain namespace.
        let q = ambient_candidate("b", "10.1.0.2");
        let mut t = Tracker::new();
        t.start_list();
        t.apply(info_in(&q, &set, Some(&plain)).unwrap(), secs(0));
        t.finish_list();
        let mut labelled = q.clone();
        labelled
            .metadata
            .labels
            .get_or_insert_with(Default::default)
            .insert("istio.io/dataplane-mode".into(), "ambient".into());
        t.apply(info_in(&labelled, &set, Some(&plain)).unwrap(), secs(5));
        assert!(t.due(secs(5)).is_empty());
        assert_eq!(t.due(secs(5) + ENROLL_GRACE).len(), 1);
    }

    /// A linkerd pod whose ambient label is toggled: only istio-ambient waits for its grace;
    /// linkerd, which selected the pod all along, is judged at once every time.
    #[test]
    fn a_label_toggle_postpones_only_the_profile_it_gains() {
        let set = ProfileSet::all_builtin();
        let plain = BTreeMap::new();
        let p = meshed("a", "10.1.0.1");
        let mut ambient = p.clone();
        ambient
            .metadata
            .labels
            .get_or_insert_with(Default::default)
            .insert("istio.io/dataplane-mode".into(), "ambient".into());
        let mut t = listed(&[&p]);
        inspect_all(&mut t, secs(0));
        let mut now = secs(0);
        for _ in 0..10 {
            now += secs(10);
            t.apply(info_in(&ambient, &set, Some(&plain)).unwrap(), now);
            now += secs(10);
            t.verdict_changed();
            let due = t.due(now);
            assert_eq!(due.len(), 1, "at {now:?}");
            assert_eq!(due[0].info.profiles, ["linkerd"], "at {now:?}");
            t.inspected(&due[0]);
            now += secs(5);
            t.apply(info_in(&p, &set, Some(&plain)).unwrap(), now);
        }
        // Left labelled, istio-ambient is judged too once its own grace ends.
        t.apply(info_in(&ambient, &set, Some(&plain)).unwrap(), now);
        assert_eq!(t.next_retry(now), Some(now + ENROLL_GRACE));
        assert!(
            t.due(now + ENROLL_GRACE - secs(1)).is_empty(),
            "linkerd was judged"
        );
        let due = t.due(now + ENROLL_GRACE);
        assert_eq!(due[0].info.profiles, ["linkerd", "istio-ambient"]);
    }

    #[test]
    fn a_namespace_label_selects_its_pods_once_known_and_only_then() {
        let set = ProfileSet::all_builtin();
        let p = ambient_candidate("a", "10.1.0.1");
        let mut t = Tracker::new();
        t.start_list();
        // The namespace's labels are not known yet: kept, not selected, not due.
        let unknown = info_in(&p, &set, None).unwrap();
        assert!(unknown.profiles.is_empty() && unknown.namespace_dependent);
        t.apply(unknown, secs(0));
        t.finish_list();
        assert!(t.is_empty());
        assert!(t.due(secs(1)).is_empty());

        // They arrive: ambient. Selected and due at once.
        let ambient =
            BTreeMap::from([("istio.io/dataplane-mode".to_string(), "ambient".to_string())]);
        assert_eq!(
            t.reselect_namespace("ns", &set, Some(&ambient), false, secs(2)),
            1
        );
        let due = t.due(secs(2));
        assert_eq!(due.len(), 1);
        assert_eq!(due[0].info.profiles, ["istio-ambient"]);
        assert_eq!(due[0].ready_since, secs(2));
        inspect_all(&mut t, secs(2));
        // Same labels again: nothing changes, nothing due.
        assert_eq!(
            t.reselect_namespace("ns", &set, Some(&ambient), true, secs(3)),
            0
        );
        assert!(t.due(secs(3)).is_empty());
        // Another namespace's change does not touch it.
        assert_eq!(t.reselect_namespace("other", &set, None, false, secs(3)), 0);

        // The namespace drops the label: no longer selected, never inspected again.
        assert_eq!(
            t.reselect_namespace("ns", &set, Some(&BTreeMap::new()), true, secs(4)),
            1
        );
        assert!(t.is_empty() && t.due(secs(5)).is_empty());

        // A pod that opted out (dataplane-mode=none) is not selected by its ambient
        // namespace, and no namespace can change that: it is not even kept.
        let mut out = ambient_candidate("b", "10.1.0.2");
        out.metadata
            .labels
            .as_mut()
            .unwrap()
            .insert("istio.io/dataplane-mode".into(), "none".into());
        let i = info_in(&out, &set, Some(&ambient)).unwrap();
        assert!(i.profiles.is_empty() && !i.namespace_dependent && !i.tracked());

        // With only sidecar profiles, an unlabelled pod is not kept at all.
        let sidecars = set.clone().select(&["linkerd".into()]).unwrap();
        let i = info_in(&p, &sidecars, None).unwrap();
        assert!(!i.tracked());
    }

    #[test]
    fn containers_and_native_sidecars_tell_whether_the_proxy_runs() {
        let set = ProfileSet::all_builtin();
        // Labelled by hand (or injection skipped): no linkerd-proxy.
        let bare = info(&meshed("a", "10.1.0.1"));
        assert_eq!(bare.containers, ["app"]);
        assert!(!bare.has_proxy(&set, "linkerd"));

        // As linkerd's injector writes it: the proxy is a container.
        let mut p = meshed("b", "10.1.0.2");
        p.spec
            .as_mut()
            .unwrap()
            .containers
            .push(serde_json::from_value(serde_json::json!({"name": "linkerd-proxy"})).unwrap());
        assert!(info(&p).has_proxy(&set, "linkerd"));

        // Native sidecar (Kubernetes ≥ 1.29; linkerd's proxy-enable-native-sidecar, Istio's
        // ENABLE_NATIVE_SIDECARS): an init container with restartPolicy Always counts, a
        // plain init container of that name does not (it ran to completion before the pod
        // started).
        let mut p = meshed("c", "10.1.0.3");
        p.spec.as_mut().unwrap().init_containers = Some(vec![
            serde_json::from_value(serde_json::json!({"name": "linkerd-init"})).unwrap(),
            serde_json::from_value(
                serde_json::json!({"name": "linkerd-proxy", "restartPolicy": "Always"}),
            )
            .unwrap(),
        ]);
        assert!(info(&p).has_proxy(&set, "linkerd"));
        p.spec.as_mut().unwrap().init_containers = Some(vec![
            serde_json::from_value(serde_json::json!({"name": "linkerd-proxy"})).unwrap(),
        ]);
        assert!(!info(&p).has_proxy(&set, "linkerd"));

        // Ambient has no proxy container to look for.
        assert!(bare.has_proxy(&set, "istio-ambient"));
    }

    #[test]
    fn annotations_are_kept_for_the_rules_but_not_kubectls_copy() {
        let mut p = meshed("a", "10.1.0.1");
        let fat = "x".repeat(256 * 1024);
        p.metadata.annotations = Some(BTreeMap::from([
            (
                "traffic.sidecar.istio.io/includeInboundPorts".to_string(),
                String::new(),
            ),
            (
                "config.linkerd.io/skip-subnets".to_string(),
                "10.0.0.0/8,0.0.0.0/0".to_string(),
            ),
            (
                "kubectl.kubernetes.io/last-applied-configuration".to_string(),
                fat.clone(),
            ),
            ("example.com/notes".to_string(), fat),
        ]));
        p.metadata
            .labels
            .as_mut()
            .unwrap()
            .insert("team".into(), "payments".into());
        let i = info(&p);
        assert_eq!(
            i.annotations,
            BTreeMap::from([
                (
                    "config.linkerd.io/skip-subnets".to_string(),
                    "10.0.0.0/8,0.0.0.0/0".to_string()
                ),
                (
                    "traffic.sidecar.istio.io/includeInboundPorts".to_string(),
                    String::new()
                ),
            ])
        );
        assert_eq!(
            i.labels.keys().collect::<Vec<_>>(),
            ["linkerd.io/control-plane-ns"]
        );
        assert_eq!(i.profiles, ["linkerd"]);
    }

    #[test]
    fn ready_since_marks_the_first_inspectable_sighting() {
        let mut pending = meshed("a", "10.1.0.1");
        pending.status.as_mut().unwrap().phase = Some("Pending".into());
        let mut t = Tracker::new();
        t.start_list();
        t.apply(info(&pending), secs(1));
        t.finish_list();
        t.apply(info(&meshed("a", "10.1.0.1")), secs(7));
        t.apply(info(&meshed("a", "10.1.0.1")), secs(9));
        assert_eq!(t.due(secs(10))[0].ready_since, secs(7));
    }
}
