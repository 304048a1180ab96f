//! The Pod as the inspector reads it, decoded straight from the API's JSON.
//!
//! In: the JSON of a Pod from this node's pod list and watch. Out: [`SlimPod`], a kube
//! `Resource` the watcher decodes directly: its identity and owner, its labels and
//! annotations as JSON text (`meshgate_shell::meta`, read by `core::projection` for the
//! keys inspection needs), the names of its containers (and
//! of its init containers, with their restart policy), `hostNetwork`, and of its status the
//! phase, the IPs and the containers' restart counts. Anyone who can create pods on the node
//! decides how large they are (up to about 1.5 MiB: environment values, commands, volumes);
//! everything a decision does not read is skipped while the page is decoded, never
//! allocated. A page's response body is still held whole while it is decoded, so the pod
//! list's page size ([`super::PAGE_SIZE`]) bounds that part.

use meshgate_shell::meta::SlimMeta;
use serde::Deserialize;

/// What the inspector reads of a Pod.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct SlimPod {
    /// `metadata`.
    #[serde(default)]
    pub metadata: SlimMeta,
    /// `spec`, in part.
    #[serde(default)]
    pub spec: Option<SlimSpec>,
    /// `status`, in part.
    #[serde(default)]
    pub status: Option<SlimStatus>,
}

/// What the inspector reads of a Pod's spec.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SlimSpec {
    /// `containers`: their names.
    #[serde(default)]
    pub containers: Option<Vec<SlimContainer>>,
    /// `initContainers`: their names and restart policies (native sidecars).
    #[serde(default)]
    pub init_containers: Option<Vec<SlimContainer>>,
    /// `hostNetwork`.
    #[serde(default)]
    pub host_network: Option<bool>,
}

/// A container's name and restart policy.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SlimContainer {
    /// `name`.
    #[serde(default)]
    pub name: String,
    /// `restartPolicy` (`Always`: a native sidecar).
    #[serde(default)]
    pub restart_policy: Option<String>,
}

/// What the inspector reads of a Pod's status.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SlimStatus {
    /// `phase`.
    #[serde(default)]
    pub phase: Option<String>,
    /// `podIP`.
    #[serde(default, rename = "podIP")]
    pub pod_ip: Option<String>,
    /// `podIPs`.
    #[serde(default, rename = "podIPs")]
    pub pod_ips: Option<Vec<SlimPodIp>>,
    /// `containerStatuses`: their restart counts.
    #[serde(default)]
    pub container_statuses: Option<Vec<SlimContainerStatus>>,
}

/// One of `status.podIPs`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct SlimPodIp {
    /// `ip`.
    #[serde(default)]
    pub ip: String,
}

/// One of `status.containerStatuses`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SlimContainerStatus {
    /// `restartCount`.
    #[serde(default)]
    pub restart_count: i32,
}

// Listed and watched at the Pod's URL, as whole Pods.
meshgate_shell::pod_view!(SlimPod, metadata_only = false);

#[cfg(test)]
mod tests {
    use super::*;
    use kube::Resource as _;

    /// A pod as the API sends it, fat parts and all, decodes into what the inspector reads;
    /// it is listed and watched at the Pod's own URL.
    #[test]
    fn a_pod_decodes_into_what_the_inspector_reads() {
        let fat = "x".repeat(1024 * 1024);
        let json = serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "web", "namespace": "shop", "uid": "u1",
                         "labels": {"linkerd.io/control-plane-ns": "linkerd"}},
            "spec": {
                "hostNetwork": false,
                "initContainers": [{"name": "linkerd-init", "image": "x"},
                                   {"name": "linkerd-proxy", "image": "x", "restartPolicy": "Always"}],
                "containers": [{"name": "app", "image": "x", "env": [{"name": "FILLER", "value": fat}],
                                "command": ["sleep"], "volumeMounts": [{"name": "v", "mountPath": "/v"}]}],
                "volumes": [{"name": "v", "emptyDir": {}}]
            },
            "status": {"phase": "Running", "podIP": "10.1.0.1",
                       "podIPs": [{"ip": "10.1.0.1"}, {"ip": "fd00::1"}],
                       "containerStatuses": [{"name": "app", "restartCount": 2, "ready": true, "image": "x",
                                              "imageID": "", "state": {"running": {}}}],
                       "conditions": [{"type": "Ready", "status": "True"}]}
        });
        let pod: SlimPod = serde_json::from_str(&json.to_string()).unwrap();
        assert_eq!(pod.metadata.meta.uid.as_deref(), Some("u1"));
        assert_eq!(
            pod.metadata.labels_json(),
            r#"{"linkerd.io/control-plane-ns":"linkerd"}"#
        );
        let spec = pod.spec.unwrap();
        let names = |c: &Option<Vec<SlimContainer>>| -> Vec<(String, Option<String>)> {
            c.iter()
                .flatten()
                .map(|c| (c.name.clone(), c.restart_policy.clone()))
                .collect()
        };
        assert_eq!(names(&spec.containers), [("app".into(), None)]);
        assert_eq!(
            names(&spec.init_containers),
            [
                ("linkerd-init".into(), None),
                ("linkerd-proxy".into(), Some("Always".into()))
            ]
        );
        assert_eq!(spec.host_network, Some(false));
        let status = pod.status.unwrap();
        assert_eq!(status.phase.as_deref(), Some("Running"));
        assert_eq!(status.pod_ip.as_deref(), Some("10.1.0.1"));
        assert_eq!(status.pod_ips.unwrap().len(), 2);
        assert_eq!(status.container_statuses.unwrap()[0].restart_count, 2);

        // An empty object is a pod with nothing set, not an error.
        let empty: SlimPod = serde_json::from_str("{}").unwrap();
        assert!(empty.spec.is_none() && empty.status.is_none());

        assert_eq!(
            SlimPod::url_path(&(), Some("shop")),
            "/api/v1/namespaces/shop/pods"
        );
        assert_eq!(SlimPod::kind(&()), "Pod");
        assert_eq!(SlimPod::api_version(&()), "v1");
    }
}
