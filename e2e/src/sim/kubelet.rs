//! The kubelet stand-in: Nodes without a kubelet still look and behave like real ones.
//!
//! In: a [`NodeSpec`], pods bound to a node by the real scheduler, and the pod IPs a test
//! chose (later: addresses of network namespaces it created). Out, through the real API:
//! - a registered Node (labels, taints, capacity/allocatable, Ready and pressure conditions,
//!   addresses, nodeInfo) and its Lease in `kube-node-lease`, renewed every 10 s;
//! - bound pods moved to Running and Ready through the `pods/status` subresource;
//! - pods being deleted finalized (deleted with grace 0), as a kubelet does once the
//!   containers stopped, so evictions and scale-downs complete.
//!
//! The node-lifecycle controller stays **on**: it is what lifts the
//! `node.kubernetes.io/not-ready` taint the TaintNodesByCondition admission plugin puts on every
//! new Node, and meshgate must coexist with it in real clusters. Renewing Leases keeps it from
//! marking the stand-in's nodes unreachable (grace period 50 s).

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{
    Container, Node, NodeAddress, NodeCondition, NodeDaemonEndpoints, NodeSpec as K8sNodeSpec,
    NodeStatus, NodeSystemInfo, Pod, Taint,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, OwnerReference, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams, Preconditions};
use kube::config::Kubeconfig;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde_json::json;

use crate::Error;
use crate::harness::wait::{self, API_TIMEOUT};

/// Namespace of node heartbeat Leases.
pub const LEASE_NAMESPACE: &str = "kube-node-lease";
/// How often the stand-in renews Leases (the kubelet's default is 10 s).
pub const LEASE_RENEW_INTERVAL: Duration = Duration::from_secs(10);
const LEASE_DURATION_SECONDS: i32 = 40;
/// Taints the node-lifecycle controller manages from node health.
const LIFECYCLE_TAINTS: [&str; 2] = [
    "node.kubernetes.io/not-ready",
    "node.kubernetes.io/unreachable",
];

/// Computes a pod's IP, or `None` to leave the pod pending for now.
pub type PodIpFn = Arc<dyn Fn(&Pod) -> Option<IpAddr> + Send + Sync>;

/// What to register. Defaults: 4 CPUs, 8 GiB, 110 pods, InternalIP 127.0.0.1, no taints.
#[derive(Debug, Clone)]
pub struct NodeSpec {
    /// Node name (also its `kubernetes.io/hostname` label).
    pub name: String,
    /// Extra labels; the well-known hostname/os/arch labels are always set.
    pub labels: BTreeMap<String, String>,
    /// Taints present from registration on (as with kubelet `--register-with-taints`).
    pub taints: Vec<Taint>,
    /// CPU capacity (a Kubernetes quantity).
    pub cpu: String,
    /// Memory capacity (a Kubernetes quantity).
    pub memory: String,
    /// Pod capacity.
    pub pods: u32,
    /// The node's InternalIP address (pods' hostIP).
    pub internal_ip: IpAddr,
}

impl NodeSpec {
    /// A node named `name` with the defaults above.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            labels: BTreeMap::new(),
            taints: Vec::new(),
            cpu: "4".into(),
            memory: "8Gi".into(),
            pods: 110,
            internal_ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
        }
    }

    /// Adds a label.
    pub fn label(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }

    /// Adds a taint with an empty value.
    pub fn taint(mut self, key: impl Into<String>, effect: impl Into<String>) -> Self {
        self.taints.push(Taint {
            key: key.into(),
            effect: effect.into(),
            ..Default::default()
        });
        self
    }

    /// Sets the pod capacity.
    pub fn pods(mut self, pods: u32) -> Self {
        self.pods = pods;
        self
    }

    /// Sets the InternalIP.
    pub fn internal_ip(mut self, ip: IpAddr) -> Self {
        self.internal_ip = ip;
        self
    }

    fn status(&self, kubelet_version: &str) -> NodeStatus {
        let now = Time(Timestamp::now());
        let resources: BTreeMap<String, Quantity> = [
            ("cpu", self.cpu.clone()),
            ("memory", self.memory.clone()),
            ("pods", self.pods.to_string()),
            ("ephemeral-storage", "100Gi".to_owned()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), Quantity(v)))
        .collect();
        let condition = |type_: &str, status: &str, reason: &str, message: &str| NodeCondition {
            type_: type_.into(),
            status: status.into(),
            reason: Some(reason.into()),
            message: Some(message.into()),
            last_heartbeat_time: Some(now.clone()),
            last_transition_time: Some(now.clone()),
        };
        NodeStatus {
            capacity: Some(resources.clone()),
            allocatable: Some(resources),
            conditions: Some(vec![
                condition(
                    "MemoryPressure",
                    "False",
                    "KubeletHasSufficientMemory",
                    "kubelet has sufficient memory available",
                ),
                condition(
                    "DiskPressure",
                    "False",
                    "KubeletHasNoDiskPressure",
                    "kubelet has no disk pressure",
                ),
                condition(
                    "PIDPressure",
                    "False",
                    "KubeletHasSufficientPID",
                    "kubelet has sufficient PID available",
                ),
                condition(
                    "Ready",
                    "True",
                    "KubeletReady",
                    "meshgate-e2e kubelet stand-in is posting ready status",
                ),
            ]),
            addresses: Some(vec![
                NodeAddress {
                    type_: "InternalIP".into(),
                    address: self.internal_ip.to_string(),
                },
                NodeAddress {
                    type_: "Hostname".into(),
                    address: self.name.clone(),
                },
            ]),
            daemon_endpoints: Some(NodeDaemonEndpoints {
                kubelet_endpoint: Some(Default::default()),
            }),
            node_info: Some(NodeSystemInfo {
                architecture: std::env::consts::ARCH
                    .replace("x86_64", "amd64")
                    .replace("aarch64", "arm64"),
                operating_system: "linux".into(),
                os_image: "meshgate-e2e".into(),
                kernel_version: "meshgate-e2e".into(),
                kubelet_version: kubelet_version.into(),
                container_runtime_version: "meshgate-e2e://0".into(),
                machine_id: self.name.clone(),
                system_uuid: self.name.clone(),
                boot_id: self.name.clone(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }
}

/// Creates the Node (with status, as a kubelet registers), posts its status, and creates its
/// Lease owned by the Node (so garbage collection removes it with the Node).
pub async fn create_node(
    client: &Client,
    spec: &NodeSpec,
    kubelet_version: &str,
) -> Result<Node, Error> {
    // The kubelet's own labels; a spec's label of the same key wins (a Windows node).
    let mut labels = spec.labels.clone();
    labels.insert("kubernetes.io/hostname".into(), spec.name.clone());
    labels
        .entry("kubernetes.io/os".into())
        .or_insert_with(|| "linux".into());
    labels
        .entry("kubernetes.io/arch".into())
        .or_insert_with(|| {
            std::env::consts::ARCH
                .replace("x86_64", "amd64")
                .replace("aarch64", "arm64")
        });
    let status = spec.status(kubelet_version);
    let node = Node {
        metadata: ObjectMeta {
            name: Some(spec.name.clone()),
            labels: Some(labels),
            ..Default::default()
        },
        spec: Some(K8sNodeSpec {
            taints: (!spec.taints.is_empty()).then(|| spec.taints.clone()),
            ..Default::default()
        }),
        status: Some(status.clone()),
    };
    let nodes: Api<Node> = Api::all(client.clone());
    wait::api(
        &format!("creating Node {}", spec.name),
        nodes.create(&PostParams::default(), &node),
    )
    .await?;
    // Whatever the create strategy kept of the status, post it as the kubelet's first update.
    let node = wait::api(
        &format!("posting Node {} status", spec.name),
        nodes.patch_status(
            &spec.name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": status })),
        ),
    )
    .await?;
    let lease = Lease {
        metadata: ObjectMeta {
            name: Some(spec.name.clone()),
            namespace: Some(LEASE_NAMESPACE.into()),
            owner_references: Some(vec![OwnerReference {
                api_version: "v1".into(),
                kind: "Node".into(),
                name: spec.name.clone(),
                uid: node.uid().unwrap_or_default(),
                ..Default::default()
            }]),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(spec.name.clone()),
            lease_duration_seconds: Some(LEASE_DURATION_SECONDS),
            renew_time: Some(MicroTime(Timestamp::now())),
            ..Default::default()
        }),
    };
    let leases: Api<Lease> = Api::namespaced(client.clone(), LEASE_NAMESPACE);
    wait::api(
        &format!("creating Lease for Node {}", spec.name),
        leases.create(&PostParams::default(), &lease),
    )
    .await?;
    Ok(node)
}

/// Waits (30 s) until the node-lifecycle controller has removed its health taints from `node`.
pub async fn wait_schedulable(client: &Client, node: &str) -> Result<(), Error> {
    let nodes: Api<Node> = Api::all(client.clone());
    wait::poll_until(
        &format!("Node {node} to lose the not-ready taint"),
        API_TIMEOUT,
        || async {
            let n = nodes.get(node).await?;
            let taints = n.spec.and_then(|s| s.taints).unwrap_or_default();
            Ok::<_, kube::Error>(
                (!taints
                    .iter()
                    .any(|t| LIFECYCLE_TAINTS.contains(&t.key.as_str())))
                .then_some(()),
            )
        },
    )
    .await
}

/// Renews `node`'s Lease. `Ok(false)` when the Node no longer exists (stop renewing).
pub async fn renew_lease(client: &Client, node: &str) -> Result<bool, Error> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), LEASE_NAMESPACE);
    let patch =
        json!({ "spec": { "renewTime": MicroTime(Timestamp::now()), "holderIdentity": node } });
    match wait::api(
        &format!("renewing Lease {node}"),
        leases.patch(node, &PatchParams::default(), &Patch::Merge(patch)),
    )
    .await
    {
        Ok(_) => Ok(true),
        Err(e) if e.api_code() == Some(404) => {
            let nodes: Api<Node> = Api::all(client.clone());
            Ok(
                wait::api(&format!("reading Node {node}"), nodes.get_opt(node))
                    .await?
                    .is_some(),
            )
        }
        Err(e) => Err(e),
    }
}

/// Background task: renews the Lease of every registered node every 10 s, and forgets nodes
/// that were deleted.
pub(crate) async fn lease_loop(kubeconfig: Kubeconfig, nodes: Arc<Mutex<BTreeSet<String>>>) {
    let client = match kube::Config::try_from(kubeconfig).map(Client::try_from) {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return tracing::error!(error = %e, "lease loop: cannot build a client"),
        Err(e) => return tracing::error!(error = %e, "lease loop: cannot load the kubeconfig"),
    };
    let mut tick = tokio::time::interval(LEASE_RENEW_INTERVAL);
    loop {
        tick.tick().await;
        let names: Vec<String> = nodes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .cloned()
            .collect();
        for name in names {
            match renew_lease(&client, &name).await {
                Ok(true) => {}
                Ok(false) => {
                    nodes
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .remove(&name);
                }
                Err(e) => tracing::warn!(node = %name, error = %e, "lease renewal failed"),
            }
        }
    }
}

/// Moves a bound pod to Running and Ready via `pods/status`, with `pod_ip` as its IP and the
/// node's InternalIP as its hostIP, as the kubelet reports once the sandbox and containers run.
pub async fn mark_pod_running(
    client: &Client,
    namespace: &str,
    name: &str,
    pod_ip: IpAddr,
) -> Result<Pod, Error> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let pod = wait::api(&format!("reading Pod {namespace}/{name}"), pods.get(name)).await?;
    let node_name = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .ok_or_else(|| Error::NotBound {
            namespace: namespace.into(),
            name: name.into(),
        })?;
    let nodes: Api<Node> = Api::all(client.clone());
    let node = wait::api(&format!("reading Node {node_name}"), nodes.get(&node_name)).await?;
    let host_ip = node
        .status
        .and_then(|s| s.addresses)
        .and_then(|a| a.into_iter().find(|a| a.type_ == "InternalIP"))
        .map(|a| a.address)
        .unwrap_or_else(|| Ipv4Addr::LOCALHOST.to_string());
    let patch = running_status_patch(&pod, pod_ip, &host_ip, Timestamp::now());
    wait::api(
        &format!("marking Pod {namespace}/{name} Running"),
        pods.patch_status(name, &PatchParams::default(), &Patch::Strategic(patch)),
    )
    .await
}

/// The status a kubelet posts for a pod whose containers all started and passed readiness.
fn running_status_patch(
    pod: &Pod,
    pod_ip: IpAddr,
    host_ip: &str,
    now: Timestamp,
) -> serde_json::Value {
    let now = Time(now);
    let uid = pod.uid().unwrap_or_default();
    let spec = pod.spec.clone().unwrap_or_default();
    let conditions: Vec<_> = [
        "PodReadyToStartContainers",
        "Initialized",
        "ContainersReady",
        "Ready",
        "PodScheduled",
    ]
    .iter()
    .map(|t| json!({ "type": t, "status": "True", "lastTransitionTime": now }))
    .collect();
    // App containers run; init containers ran to completion before them.
    let container_status = |c: &Container, running: bool| {
        let state = if running {
            json!({ "running": { "startedAt": now } })
        } else {
            json!({ "terminated": { "exitCode": 0, "reason": "Completed", "startedAt": now, "finishedAt": now } })
        };
        let mut status = json!({
            "name": c.name,
            "image": c.image.clone().unwrap_or_default(),
            "imageID": "",
            "containerID": format!("meshgate-e2e://{uid}/{}", c.name),
            "ready": true,
            "restartCount": 0,
            "state": state,
        });
        if running {
            status["started"] = json!(true);
        }
        status
    };
    let containers: Vec<_> = spec
        .containers
        .iter()
        .map(|c| container_status(c, true))
        .collect();
    let init: Vec<_> = spec
        .init_containers
        .unwrap_or_default()
        .iter()
        .map(|c| container_status(c, false))
        .collect();
    let mut status = json!({
        "phase": "Running",
        "hostIP": host_ip,
        "hostIPs": [{ "ip": host_ip }],
        "podIP": pod_ip.to_string(),
        "podIPs": [{ "ip": pod_ip.to_string() }],
        "startTime": now,
        "conditions": conditions,
        "containerStatuses": containers,
    });
    if !init.is_empty() {
        status["initContainerStatuses"] = json!(init);
    }
    json!({ "status": status })
}

/// Deletes a terminating pod with grace period 0 (uid precondition), as the kubelet does once
/// its containers stopped. A pod already gone counts as done.
pub async fn finalize_deletion(client: &Client, pod: &Pod) -> Result<(), Error> {
    let ns = pod.namespace().unwrap_or_default();
    let name = pod.name_any();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let dp = DeleteParams {
        grace_period_seconds: Some(0),
        preconditions: Some(Preconditions {
            uid: pod.uid(),
            resource_version: None,
        }),
        ..Default::default()
    };
    match wait::api(
        &format!("finalizing Pod {ns}/{name}"),
        pods.delete(&name, &dp),
    )
    .await
    {
        Ok(_) => Ok(()),
        Err(e) if matches!(e.api_code(), Some(404 | 409)) => Ok(()),
        Err(e) => Err(e),
    }
}

/// True when the stand-in has nothing (more) to do for this pod's start.
fn is_running(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .is_some_and(|s| s.phase.as_deref() == Some("Running") && s.pod_ip.is_some())
}

fn is_finished(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .is_some_and(|s| matches!(s.phase.as_deref(), Some("Succeeded" | "Failed")))
}

/// Background task: the pod half of the kubelet for `node`.
pub(crate) async fn pod_loop(kubeconfig: Kubeconfig, node: String, pod_ip: PodIpFn) {
    let client = match kube::Config::try_from(kubeconfig).map(Client::try_from) {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return tracing::error!(error = %e, "pod loop: cannot build a client"),
        Err(e) => return tracing::error!(error = %e, "pod loop: cannot load the kubeconfig"),
    };
    let pods: Api<Pod> = Api::all(client.clone());
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let mut events = watcher(pods, config)
        .default_backoff()
        .applied_objects()
        .boxed();
    while let Some(event) = events.next().await {
        let pod = match event {
            Ok(pod) => pod,
            Err(e) => {
                tracing::warn!(node = %node, error = %e, "pod watch error");
                continue;
            }
        };
        let (ns, name) = (pod.namespace().unwrap_or_default(), pod.name_any());
        let result = if pod.metadata.deletion_timestamp.is_some() {
            finalize_deletion(&client, &pod).await
        } else if is_running(&pod) || is_finished(&pod) {
            Ok(())
        } else if let Some(ip) = pod_ip(&pod) {
            mark_pod_running(&client, &ns, &name, ip).await.map(|_| ())
        } else {
            Ok(())
        };
        if let Err(e) = result {
            tracing::warn!(node = %node, pod = %format!("{ns}/{name}"), error = %e, "kubelet stand-in failed on a pod");
        }
    }
}

/// Stops a [`crate::ControlPlane::run_pods`] loop when dropped.
#[derive(Debug)]
pub struct PodRunner {
    task: tokio::task::AbortHandle,
}

impl PodRunner {
    pub(crate) fn new(task: tokio::task::AbortHandle) -> Self {
        Self { task }
    }
}

impl Drop for PodRunner {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Hands out `first`, `first+1`, ... as pod IPs (for tests that need no real network namespace).
pub fn sequential_ips(first: Ipv4Addr) -> impl Fn(&Pod) -> Option<IpAddr> + Send + Sync + 'static {
    let next = std::sync::atomic::AtomicU32::new(u32::from(first));
    move |_| {
        Some(IpAddr::V4(Ipv4Addr::from(
            next.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{Container, PodSpec};

    fn pod() -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some("p".into()),
                uid: Some("u1".into()),
                ..Default::default()
            },
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: "app".into(),
                    image: Some("pause".into()),
                    ..Default::default()
                }],
                init_containers: Some(vec![Container {
                    name: "init".into(),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            status: None,
        }
    }

    #[test]
    fn running_patch_reports_ready_containers_and_both_ips() {
        let ip: IpAddr = "10.1.2.3".parse().unwrap();
        let patch = running_status_patch(&pod(), ip, "192.0.2.1", Timestamp::UNIX_EPOCH);
        let s = &patch["status"];
        assert_eq!(s["phase"], "Running");
        assert_eq!(s["podIP"], "10.1.2.3");
        assert_eq!(s["podIPs"][0]["ip"], "10.1.2.3");
        assert_eq!(s["hostIP"], "192.0.2.1");
        assert_eq!(s["containerStatuses"][0]["name"], "app");
        assert_eq!(s["containerStatuses"][0]["ready"], true);
        assert!(s["containerStatuses"][0]["state"]["running"]["startedAt"].is_string());
        assert_eq!(s["containerStatuses"][0]["started"], true);
        assert!(s["initContainerStatuses"][0].get("started").is_none());
        assert_eq!(
            s["initContainerStatuses"][0]["state"]["terminated"]["exitCode"],
            0
        );
        let ready = s["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "Ready")
            .unwrap();
        assert_eq!(ready["status"], "True");
    }

    #[test]
    fn node_status_has_capacity_and_ready() {
        let st = NodeSpec::new("n1").pods(3).status("v1.35.4");
        assert_eq!(st.capacity.as_ref().unwrap()["pods"].0, "3");
        assert_eq!(st.allocatable.as_ref().unwrap()["pods"].0, "3");
        let ready = st
            .conditions
            .unwrap()
            .into_iter()
            .find(|c| c.type_ == "Ready")
            .unwrap();
        assert_eq!(ready.status, "True");
        assert_eq!(st.node_info.unwrap().kubelet_version, "v1.35.4");
    }

    #[test]
    fn sequential_ips_count_up() {
        let f = sequential_ips(Ipv4Addr::new(10, 9, 0, 254));
        let p = pod();
        assert_eq!(f(&p), Some("10.9.0.254".parse().unwrap()));
        assert_eq!(f(&p), Some("10.9.0.255".parse().unwrap()));
        assert_eq!(f(&p), Some("10.9.1.0".parse().unwrap()));
    }

    #[test]
    fn running_and_finished_pods_are_left_alone() {
        let mut p = pod();
        assert!(!is_running(&p));
        p.status = Some(k8s_openapi::api::core::v1::PodStatus {
            phase: Some("Running".into()),
            pod_ip: Some("10.0.0.9".into()),
            ..Default::default()
        });
        assert!(is_running(&p));
        p.status = Some(k8s_openapi::api::core::v1::PodStatus {
            phase: Some("Failed".into()),
            ..Default::default()
        });
        assert!(is_finished(&p));
    }
}
