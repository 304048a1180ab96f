//! Istio ambient's node components on the real nodes, deployed as Istio deploys them:
//!
//! - **istio-cni's node agent, for real**: the `istio-cni-node` DaemonSet of istio/istio's
//!   `manifests/charts/istio-cni` with `ambient.enabled` (its ServiceAccount, its ClusterRoles
//!   and bindings, its ConfigMap's environment, its capabilities and host mounts), running
//!   Istio's own `install-cni` built from the pinned module. It installs the `istio-cni` plugin
//!   and chains it into the node's conflist itself, listens on ztunnel's ZDS socket
//!   ([`ZTUNNEL_SOCKET`]) and writes the in-pod redirection into ambient pods' netns. It runs
//!   with `ambient.shareHostNetworkNamespace: true` (hostNetwork), see [`istio_cni_objects`].
//! - **a stand-in ztunnel**: the `ztunnel` DaemonSet's pod shape from istio/istio's
//!   `manifests/charts/ztunnel` (namespace `istio-system`, label `app: ztunnel`, its
//!   capabilities, the hostPath `/var/run/ztunnel`, a readiness probe on 15021
//!   `/healthz/ready`) running `e2e/ztunnel-standin`, which speaks ZDS and opens ztunnel's
//!   in-pod listeners, and nothing else.
//!
//! In: a client of the cluster, the images the node imported
//! ([`crate::real::node::RealNode::import_ambient_images`]). Out: the objects created in the
//! API; [`StandinMode`] picks the stand-in's behaviour.

use crate::Error;
use crate::harness::wait;
use crate::real::node::{INSTALL_CNI_IMAGE, NODE_PROC, ZTUNNEL_STANDIN_IMAGE};
use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};
use serde_json::{Value, json};

/// Istio's namespace, where both components run.
pub const ISTIO_NAMESPACE: &str = "istio-system";
/// ztunnel's ZDS socket (its `INPOD_UDS`), which istio-cni's node agent listens on.
pub const ZTUNNEL_SOCKET: &str = "/var/run/ztunnel/ztunnel.sock";
/// The node agent's DaemonSet (the chart's `{{ template "name" }}-node`).
pub const ISTIO_CNI_DAEMONSET: &str = "istio-cni-node";
/// The stand-in's DaemonSet (the ztunnel chart's name).
pub const ZTUNNEL_DAEMONSET: &str = "ztunnel";

/// How the stand-in ztunnel behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StandinMode {
    /// As ztunnel: Ready only while connected to the node agent and past its snapshot.
    Connected,
    /// A ztunnel that reports Ready but never connects (the case the node-level "connected"
    /// check exists for).
    ReadyUnconnected,
}

/// The node agent's objects, as istio/istio `manifests/charts/istio-cni` renders them with
/// `ambient.enabled: true`, `ambient.shareHostNetworkNamespace: true`, the chart's default
/// `excludeNamespaces` and enablement selectors, and the repair controller off (it is for
/// sidecar pods). hostNetwork because Istio's default (the agent in a network namespace of its
/// own, `ALLOW_SWITCH_TO_HOST_NS`) enters `/host/proc/1/ns/net` for the node's rules: on these
/// nodes, which share the machine's PID namespace, that is the machine's own network namespace,
/// not the node's. Its `/host/proc` is the node's view of `/proc`
/// ([`crate::real::node::NODE_PROC`]) rather than the machine's, for the same reason.
pub fn istio_cni_objects() -> Vec<Value> {
    let name = "istio-cni";
    let labels = json!({"app": name, "app.kubernetes.io/name": name});
    vec![
        json!({"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": name, "namespace": ISTIO_NAMESPACE, "labels": labels}}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {"name": name, "labels": labels},
            "rules": [{"apiGroups": [""], "resources": ["pods", "nodes", "namespaces"],
                       "verbs": ["get", "list", "watch"]}]}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {"name": format!("{name}-ambient"), "labels": labels},
            "rules": [
                {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch", "update"]},
                {"apiGroups": ["apps"], "resources": ["daemonsets"],
                 "resourceNames": [ISTIO_CNI_DAEMONSET], "verbs": ["get"]}]}),
        binding(name, name),
        binding(&format!("{name}-ambient"), name),
        json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": format!("{name}-config"), "namespace": ISTIO_NAMESPACE, "labels": labels},
            "data": {
                "AMBIENT_ENABLED": "true",
                "AMBIENT_ENABLEMENT_SELECTOR": ENABLEMENT_SELECTORS,
                "AMBIENT_DNS_CAPTURE": "true",
                "AMBIENT_IPV6": "true",
                "AMBIENT_RECONCILE_POD_RULES_ON_STARTUP": "true",
                "ENABLE_AMBIENT_DETECTION_RETRY": "false",
                "ISTIO_OWNED_CNI_CONFIG": "false",
                "CHAINED_CNI_PLUGIN": "true",
                "EXCLUDE_NAMESPACES": "kube-system",
                "REPAIR_ENABLED": "false",
                "NATIVE_NFTABLES": "false"}}),
        istio_cni_daemonset(name),
    ]
}

/// The chart's default `ambient.enablementSelectors`: the pod's label, or its namespace's
/// unless the pod opts out.
const ENABLEMENT_SELECTORS: &str = "- podSelector:\n    matchLabels: {istio.io/dataplane-mode: ambient}\n- podSelector:\n    matchExpressions:\n    - {key: istio.io/dataplane-mode, operator: NotIn, values: [none]}\n  namespaceSelector:\n    matchLabels: {istio.io/dataplane-mode: ambient}\n";

fn binding(role: &str, account: &str) -> Value {
    json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": role},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": ISTIO_NAMESPACE}]})
}

fn field_env(name: &str, path: &str) -> Value {
    json!({"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}})
}

fn host_path(name: &str, path: &str, kind: Option<&str>) -> Value {
    let mut v = json!({"name": name, "hostPath": {"path": path}});
    if let Some(kind) = kind {
        v["hostPath"]["type"] = kind.into();
    }
    v
}

/// Tolerates every taint, as both of Istio's charts do (meshgate's among them).
fn tolerations() -> Value {
    json!([{"effect": "NoSchedule", "operator": "Exists"},
           {"key": "CriticalAddonsOnly", "operator": "Exists"},
           {"effect": "NoExecute", "operator": "Exists"}])
}

fn istio_cni_daemonset(name: &str) -> Value {
    let selector = json!({"k8s-app": ISTIO_CNI_DAEMONSET});
    json!({"apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": ISTIO_CNI_DAEMONSET, "namespace": ISTIO_NAMESPACE},
        "spec": {"selector": {"matchLabels": selector},
          "template": {
            "metadata": {"labels": {"k8s-app": ISTIO_CNI_DAEMONSET, "app": name,
                "sidecar.istio.io/inject": "false", "istio.io/dataplane-mode": "none"}},
            "spec": {
              "hostNetwork": true,
              "dnsPolicy": "ClusterFirstWithHostNet",
              "nodeSelector": {"kubernetes.io/os": "linux"},
              "tolerations": tolerations(),
              "priorityClassName": "system-node-critical",
              "serviceAccountName": name,
              "terminationGracePeriodSeconds": 5,
              "containers": [{
                "name": "install-cni",
                "image": INSTALL_CNI_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["install-cni"],
                "args": ["--log_output_level=info"],
                "readinessProbe": {"httpGet": {"path": "/readyz", "port": 8000},
                                   "periodSeconds": 1},
                "securityContext": {
                  "privileged": false, "runAsGroup": 0, "runAsUser": 0, "runAsNonRoot": false,
                  "capabilities": {"drop": ["ALL"],
                    "add": ["NET_ADMIN", "NET_RAW", "SYS_PTRACE", "SYS_ADMIN", "DAC_OVERRIDE"]}},
                "envFrom": [{"configMapRef": {"name": format!("{name}-config")}}],
                "env": [field_env("REPAIR_NODE_NAME", "spec.nodeName"),
                        field_env("NODE_NAME", "spec.nodeName"),
                        field_env("POD_NAME", "metadata.name"),
                        field_env("POD_NAMESPACE", "metadata.namespace")],
                "volumeMounts": [
                  {"mountPath": "/host/opt/cni/bin", "name": "cni-bin-dir"},
                  {"mountPath": "/host/proc", "name": "cni-host-procfs", "readOnly": true},
                  {"mountPath": "/host/etc/cni/net.d", "name": "cni-net-dir"},
                  {"mountPath": "/var/run/istio-cni", "name": "cni-socket-dir"},
                  {"mountPath": "/host/var/run/netns", "name": "cni-netns-dir",
                   "mountPropagation": "HostToContainer"},
                  {"mountPath": "/var/run/ztunnel", "name": "cni-ztunnel-sock-dir"}]}],
              "volumes": [
                host_path("cni-bin-dir", "/opt/cni/bin", None),
                // The chart mounts the host's /proc; the node's view of it (see NODE_PROC).
                host_path("cni-host-procfs", NODE_PROC, Some("Directory")),
                host_path("cni-ztunnel-sock-dir", "/var/run/ztunnel", Some("DirectoryOrCreate")),
                host_path("cni-net-dir", "/etc/cni/net.d", None),
                host_path("cni-socket-dir", "/var/run/istio-cni", None),
                host_path("cni-netns-dir", "/var/run/netns", Some("DirectoryOrCreate"))]}}}})
}

/// The stand-in ztunnel's DaemonSet: ztunnel's pod as istio/istio `manifests/charts/ztunnel`
/// shapes it, where meshgate and istio-cni look (namespace, labels, readiness probe, socket
/// directory, capabilities), with the stand-in's image.
pub fn ztunnel_daemonset(mode: StandinMode) -> Value {
    let args = match mode {
        StandinMode::Connected => json!([ZTUNNEL_SOCKET]),
        StandinMode::ReadyUnconnected => json!([ZTUNNEL_SOCKET, "--ready-unconnected"]),
    };
    json!({"apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": ZTUNNEL_DAEMONSET, "namespace": ISTIO_NAMESPACE,
                     "labels": {"app": "ztunnel"}},
        "spec": {"selector": {"matchLabels": {"app": "ztunnel"}},
          "template": {
            "metadata": {"labels": {"app": "ztunnel", "sidecar.istio.io/inject": "false",
                "istio.io/dataplane-mode": "none"}},
            "spec": {
              "nodeSelector": {"kubernetes.io/os": "linux"},
              "tolerations": tolerations(),
              "priorityClassName": "system-node-critical",
              "terminationGracePeriodSeconds": 2,
              "containers": [{
                "name": "istio-proxy",
                "image": ZTUNNEL_STANDIN_IMAGE,
                "imagePullPolicy": "Never",
                "args": args,
                "ports": [{"containerPort": 15021, "name": "ztunnel-health", "protocol": "TCP"}],
                "readinessProbe": {"httpGet": {"path": "/healthz/ready", "port": 15021},
                                   "periodSeconds": 1, "failureThreshold": 1},
                "securityContext": {
                  "privileged": false, "runAsGroup": 1337, "runAsUser": 0, "runAsNonRoot": false,
                  "allowPrivilegeEscalation": true, "readOnlyRootFilesystem": true,
                  "capabilities": {"drop": ["ALL"], "add": ["NET_ADMIN", "SYS_ADMIN", "NET_RAW"]}},
                "volumeMounts": [{"mountPath": "/var/run/ztunnel", "name": "cni-ztunnel-sock-dir"}]}],
              "volumes": [host_path("cni-ztunnel-sock-dir", "/var/run/ztunnel",
                                    Some("DirectoryOrCreate"))]}}}})
}

/// Creates `objects` (ClusterRoles, DaemonSets, ...) through the API, each bounded.
pub async fn create(client: &Client, objects: &[Value]) -> Result<(), Error> {
    for object in objects {
        let api_version = object["apiVersion"].as_str().unwrap_or_default();
        let kind = object["kind"].as_str().unwrap_or_default();
        let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
        let ar = ApiResource::from_gvk(&GroupVersionKind::gvk(group, version, kind));
        let obj: DynamicObject = serde_json::from_value(object.clone())
            .map_err(|e| Error::io(format!("{kind} is not an object"), e.into()))?;
        let api: Api<DynamicObject> = match object["metadata"]["namespace"].as_str() {
            Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
            None => Api::all_with(client.clone(), &ar),
        };
        wait::api(
            &format!("creating {kind} {}", object["metadata"]["name"]),
            api.create(&PostParams::default(), &obj),
        )
        .await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The node agent gets exactly the permissions Istio's chart grants it in ambient mode
    /// (repair off): read pods, nodes and namespaces; write pods' status (its
    /// `ambient.istio.io/redirection` annotation); read its own DaemonSet by name.
    #[test]
    fn the_node_agent_has_the_charts_least_privilege() {
        let objects = istio_cni_objects();
        let rules: Vec<&Value> = objects
            .iter()
            .filter(|o| o["kind"] == "ClusterRole")
            .flat_map(|o| o["rules"].as_array().into_iter().flatten())
            .collect();
        assert_eq!(rules.len(), 3, "{rules:?}");
        for r in &rules {
            let verbs: Vec<&str> = r["verbs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_str().unwrap())
                .collect();
            assert!(
                verbs
                    .iter()
                    .all(|v| ["get", "list", "watch", "patch", "update"].contains(v)),
                "{r}"
            );
            if r["resources"] == json!(["daemonsets"]) {
                assert_eq!(r["resourceNames"], json!([ISTIO_CNI_DAEMONSET]));
            }
            if verbs.contains(&"patch") {
                assert_eq!(r["resources"], json!(["pods/status"]));
            }
        }
        let ds = objects.iter().find(|o| o["kind"] == "DaemonSet").unwrap();
        assert_eq!(ds["metadata"]["name"], ISTIO_CNI_DAEMONSET);
        assert_eq!(ds["spec"]["template"]["spec"]["hostNetwork"], true);
    }

    #[test]
    fn the_standin_has_ztunnels_labels_probe_and_socket_dir() {
        let ds = ztunnel_daemonset(StandinMode::Connected);
        let spec = &ds["spec"]["template"]["spec"];
        assert_eq!(ds["metadata"]["namespace"], "istio-system");
        assert_eq!(
            ds["spec"]["template"]["metadata"]["labels"]["app"],
            "ztunnel"
        );
        assert!(
            spec.get("hostNetwork").is_none(),
            "ztunnel has a netns of its own"
        );
        assert_eq!(
            spec["containers"][0]["readinessProbe"]["httpGet"]["path"],
            "/healthz/ready"
        );
        assert_eq!(spec["volumes"][0]["hostPath"]["path"], "/var/run/ztunnel");
    }
}
