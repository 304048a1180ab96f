//! Node objects as a managed cloud's kubelet registers them, at their real size: what the
//! `fleet` bench registers by the tens of thousands.
//!
//! In: a name, whether meshgate verified the node, and how many images its status lists. Out:
//! a [`Node`] with a GKE node's labels, annotations, taints, pod CIDRs, provider id, and a
//! status with its addresses, capacity and allocatable, node-problem-detector and kubelet
//! conditions (meshgate's among them), node info and the `status.images` list that makes up
//! most of a real Node object (about 200 bytes an image). With [`TYPICAL_IMAGES`] a Node is
//! about 15 KB as JSON, as real GKE and EKS Nodes are (10-20 KB); with [`LARGE_IMAGES`]
//! about twice that. Every per-node string (addresses, ids, boot id) differs from node to
//! node, derived from the name, so nothing is shared that a real fleet would not share.
//!
//! Status is part of the object created: the apiserver keeps a Node's status on create (the
//! kubelet registers that way), so one POST per Node registers all of it.

use k8s_openapi::api::core::v1::Node;
use serde_json::{Value, json};

/// Images listed by a typical node: the system DaemonSets' and a few workloads'.
pub const TYPICAL_IMAGES: usize = 40;
/// Images that make a Node about twice the size of one with [`TYPICAL_IMAGES`].
pub const LARGE_IMAGES: usize = 100;

/// A stable 64-bit digest of `s` and `salt` (FNV-1a, then splitmix64's finalizer: FNV alone
/// leaves names that differ in their last byte equal in the upper bits the addresses take).
fn digest(s: &str, salt: u64) -> u64 {
    let h = s.bytes().fold(0xcbf2_9ce4_8422_2325 ^ salt, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// A hex string of `len` digits derived from `s` and `salt`.
fn hex(s: &str, salt: u64, len: usize) -> String {
    (0..len.div_ceil(16))
        .map(|k| format!("{:016x}", digest(s, salt.wrapping_add(k as u64))))
        .collect::<String>()[..len]
        .to_string()
}

/// Image `k` of a node's `status.images`: a digest name, a tag name and a size, as the
/// kubelet lists them (at most 5 names an image; 2 is the common case).
fn image(k: usize) -> Value {
    let repo = format!("us-docker.pkg.dev/fleet-project/fleet-images/workload-component-{k:03}");
    json!({
        "names": [
            format!("{repo}@sha256:{}", hex(&repo, 1, 64)),
            format!("{repo}:v1.{}.{}-gke.{}", k % 30, k % 7, 100 + k),
        ],
        "sizeBytes": 10_000_000 + (digest(&repo, 2) % 900_000_000),
    })
}

/// A node condition as the kubelet or node-problem-detector writes it.
fn condition(type_: &str, status: &str, reason: &str, message: &str) -> Value {
    json!({
        "type": type_, "status": status, "reason": reason, "message": message,
        "lastHeartbeatTime": "2026-01-05T10:00:00Z",
        "lastTransitionTime": "2026-01-01T08:00:00Z",
    })
}

fn conditions(verified: bool) -> Vec<Value> {
    let npd = [
        (
            "FrequentUnregisterNetDevice",
            "NoFrequentUnregisterNetDevice",
            "node is functioning properly",
        ),
        (
            "FrequentKubeletRestart",
            "NoFrequentKubeletRestart",
            "kubelet is functioning properly",
        ),
        (
            "FrequentDockerRestart",
            "NoFrequentDockerRestart",
            "docker is functioning properly",
        ),
        (
            "FrequentContainerdRestart",
            "NoFrequentContainerdRestart",
            "containerd is functioning properly",
        ),
        (
            "KernelDeadlock",
            "KernelHasNoDeadlock",
            "kernel has no deadlock",
        ),
        (
            "ReadonlyFilesystem",
            "FilesystemIsNotReadOnly",
            "Filesystem is not read-only",
        ),
        (
            "CorruptDockerOverlay2",
            "NoCorruptDockerOverlay2",
            "docker overlay2 is functioning properly",
        ),
    ];
    let mut out: Vec<Value> = npd
        .iter()
        .map(|(t, r, m)| condition(t, "False", r, m))
        .collect();
    out.push(condition(
        "NetworkUnavailable",
        "False",
        "RouteCreated",
        "NodeController create implicit route",
    ));
    out.push(condition(
        "MemoryPressure",
        "False",
        "KubeletHasSufficientMemory",
        "kubelet has sufficient memory available",
    ));
    out.push(condition(
        "DiskPressure",
        "False",
        "KubeletHasNoDiskPressure",
        "kubelet has no disk pressure",
    ));
    out.push(condition(
        "PIDPressure",
        "False",
        "KubeletHasSufficientPID",
        "kubelet has sufficient PID available",
    ));
    out.push(condition(
        "Ready",
        "True",
        "KubeletReady",
        "kubelet is posting ready status. AppArmor enabled",
    ));
    out.push(if verified {
        condition(
            meshgate_core::gate::CONDITION_TYPE,
            "True",
            "Verified",
            "the mesh CNI plugin is chained and answers VERSION",
        )
    } else {
        condition(
            meshgate_core::gate::CONDITION_TYPE,
            "False",
            "ChainedPluginMissing",
            "/etc/cni/net.d/10-gke-ptp.conflist does not chain istio-cni",
        )
    });
    out
}

fn labels(name: &str, pool: &str, verified: bool) -> Value {
    json!({
        "beta.kubernetes.io/arch": "amd64", "beta.kubernetes.io/instance-type": "e2-standard-8",
        "beta.kubernetes.io/os": "linux",
        "cloud.google.com/gke-boot-disk": "pd-balanced",
        "cloud.google.com/gke-container-runtime": "containerd",
        "cloud.google.com/gke-cpu-scaling-level": "8",
        "cloud.google.com/gke-logging-variant": "DEFAULT",
        "cloud.google.com/gke-max-pods-per-node": "110",
        "cloud.google.com/gke-nodepool": pool,
        "cloud.google.com/gke-os-distribution": "cos",
        "cloud.google.com/gke-provisioning": "standard",
        "cloud.google.com/gke-stack-type": "IPV4",
        "cloud.google.com/machine-family": "e2",
        "cloud.google.com/private-node": "false",
        "failure-domain.beta.kubernetes.io/region": "us-central1",
        "failure-domain.beta.kubernetes.io/zone": "us-central1-a",
        "kubernetes.io/arch": "amd64", "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
        "node.kubernetes.io/instance-type": "e2-standard-8",
        "topology.gke.io/zone": "us-central1-a",
        "topology.kubernetes.io/region": "us-central1",
        "topology.kubernetes.io/zone": "us-central1-a",
        meshgate_core::gate::VERIFIED_LABEL: if verified { "true" } else { "false" },
    })
}

/// A Node named `name` as a GKE kubelet registers it, listing `images` images; unverified
/// ones carry meshgate's taint and a `MeshCNIVerified=False` condition.
pub fn registered(name: &str, verified: bool, images: usize) -> anyhow::Result<Node> {
    let n = digest(name, 0);
    let (a, b, c) = ((n >> 8) & 0xff, (n >> 16) & 0xff, (n >> 24) & 0xff);
    let pool = "default-pool";
    let instance_id = (n >> 1) % 9_000_000_000_000_000 + 1_000_000_000_000_000;
    let taints = if verified {
        json!([])
    } else {
        json!([{"key": meshgate_core::gate::DEFAULT_TAINT_KEY, "effect": "NoSchedule"}])
    };
    let v = json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {
            "name": name,
            "labels": labels(name, pool, verified),
            "annotations": {
                "container.googleapis.com/instance_id": instance_id.to_string(),
                "csi.volume.kubernetes.io/nodeid": format!(
                    "{{\"pd.csi.storage.gke.io\":\"projects/fleet-project/zones/us-central1-a/instances/{name}\"}}"),
                "node.alpha.kubernetes.io/ttl": "0",
                "node.gke.io/last-applied-node-labels": format!(
                    "cloud.google.com/gke-boot-disk=pd-balanced,cloud.google.com/gke-container-runtime=containerd,cloud.google.com/gke-nodepool={pool},cloud.google.com/gke-os-distribution=cos,cloud.google.com/machine-family=e2"),
                "node.gke.io/last-applied-node-taints": "",
                "volumes.kubernetes.io/controller-managed-attach-detach": "true",
            },
        },
        "spec": {
            "podCIDR": format!("10.{a}.{b}.0/24"), "podCIDRs": [format!("10.{a}.{b}.0/24")],
            "providerID": format!("gce://fleet-project/us-central1-a/{name}"),
            "taints": taints,
        },
        "status": {
            "addresses": [
                {"type": "InternalIP", "address": format!("10.128.{b}.{c}")},
                {"type": "ExternalIP", "address": format!("34.{a}.{b}.{c}")},
                {"type": "InternalDNS", "address": format!("{name}.us-central1-a.c.fleet-project.internal")},
                {"type": "Hostname", "address": format!("{name}.us-central1-a.c.fleet-project.internal")},
            ],
            "capacity": {"cpu": "8", "ephemeral-storage": "98831908Ki", "hugepages-1Gi": "0",
                         "hugepages-2Mi": "0", "memory": "32873200Ki", "pods": "110"},
            "allocatable": {"cpu": "7910m", "ephemeral-storage": "47060071478", "hugepages-1Gi": "0",
                            "hugepages-2Mi": "0", "memory": "29094640Ki", "pods": "110"},
            "conditions": conditions(verified),
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "images": (0..images).map(image).collect::<Vec<_>>(),
            "nodeInfo": {
                "architecture": "amd64", "bootID": hex(name, 3, 32), "containerRuntimeVersion": "containerd://1.7.24",
                "kernelVersion": "6.6.56+", "kubeProxyVersion": "v1.35.4-gke.1000", "kubeletVersion": "v1.35.4-gke.1000",
                "machineID": hex(name, 4, 32), "operatingSystem": "linux",
                "osImage": "Container-Optimized OS from Google", "systemUUID": hex(name, 5, 32),
            },
        },
    });
    Ok(serde_json::from_value(v)?)
}

/// The size of `node` as JSON, in bytes (what a client writes; the apiserver adds its
/// metadata and managed fields on top).
pub fn json_size(node: &Node) -> usize {
    serde_json::to_vec(node).map_or(0, |v| v.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_typical_node_is_the_size_of_a_real_one_and_a_large_one_twice_that() {
        let typical =
            json_size(&registered("gke-fleet-default-pool-0000-1", true, TYPICAL_IMAGES).unwrap());
        let large =
            json_size(&registered("gke-fleet-default-pool-0000-1", true, LARGE_IMAGES).unwrap());
        assert!(
            (12_000..=18_000).contains(&typical),
            "typical node: {typical} bytes"
        );
        let r = large as f64 / typical as f64;
        assert!(
            (1.8..=2.2).contains(&r),
            "large {large} / typical {typical} = {r:.2}"
        );
    }

    #[test]
    fn nodes_differ_by_name_and_carry_the_verdict() {
        let a = registered("n-1", true, 2).unwrap();
        let b = registered("n-2", false, 2).unwrap();
        let ip = |n: &Node| {
            n.status.as_ref().unwrap().addresses.as_ref().unwrap()[0]
                .address
                .clone()
        };
        assert_ne!(ip(&a), ip(&b));
        let label = |n: &Node| {
            n.metadata.labels.as_ref().unwrap()[meshgate_core::gate::VERIFIED_LABEL].clone()
        };
        assert_eq!((label(&a).as_str(), label(&b).as_str()), ("true", "false"));
        assert!(a.spec.as_ref().unwrap().taints.as_ref().unwrap().is_empty());
        let taints = b.spec.as_ref().unwrap().taints.clone().unwrap();
        assert_eq!(taints[0].key, meshgate_core::gate::DEFAULT_TAINT_KEY);
        assert_eq!(a.status.as_ref().unwrap().images.as_ref().unwrap().len(), 2);
        // Deterministic: the same name gives the same object.
        assert_eq!(
            json_size(&a),
            json_size(&registered("n-1", true, 2).unwrap())
        );
    }
}
