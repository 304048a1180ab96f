//! One pod as the inspector sees it: what of the watched Pod inspection reads, and which
//! profiles select it.
//!
//! In: a [`SlimPod`] from the node-scoped watch, the profiles, the label and annotation keys
//! they read ([`PodKeys::inspection`], `core::projection`), and the labels of the pod's
//! namespace when known. Out: a [`PodInfo`] (the full object is dropped at once, so memory
//! stays flat): identity, the kept labels and annotations, container names, ownership,
//! sandbox (IPs and restarts), and the selecting profiles. An unknown namespace never
//! selects: a pod whose selection hangs on its namespace's labels waits for them.

use std::collections::BTreeMap;
use std::net::IpAddr;

use meshgate_core::profile::{PodView, ProfileSet, Selected};
use meshgate_core::projection::PodKeys;

use super::slim::SlimPod;

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
