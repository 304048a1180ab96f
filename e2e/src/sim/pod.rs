//! The pods the e2e tests and the benchmarks create: bare pause pods bound to a
//! simulated node, meshed (labelled and given the proxy container as linkerd's injector
//! does) or plain, and a meshed pod that stays Pending for binding reviews.
//!
//! In: names, a node, labels. Out: `Pod` objects to create through the real API; nothing is
//! sent from here. The kubelet stand-in ([`crate::sim::kubelet`]) then runs the bound ones.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, Pod, PodSpec};
use kube::api::ObjectMeta;

/// The label linkerd's injector puts on a meshed pod: what the built-in `linkerd` profile
/// selects.
pub const MESH_LABEL: &str = "linkerd.io/control-plane-ns";

/// The container linkerd's injector adds to a meshed pod: the built-in `linkerd` profile
/// evicts only pods that run it.
pub const LINKERD_PROXY: &str = "linkerd-proxy";

/// The one container image of every pod here; nothing pulls it (no container runtime runs:
/// the kubelet stand-in only reports the pods running).
pub const PAUSE_IMAGE: &str = "registry.k8s.io/pause:3.10";

/// A bare pause pod (no owner) with `labels`; bound to `node` when one is given.
/// `grace` is its `terminationGracePeriodSeconds` (the API's default, 30 s, when `None`).
pub fn bare_pod(
    name: &str,
    node: Option<&str>,
    labels: &[(&str, &str)],
    grace: Option<i64>,
) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect::<BTreeMap<_, _>>(),
            ),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            node_name: node.map(str::to_owned),
            termination_grace_period_seconds: grace,
            containers: vec![Container {
                name: "app".into(),
                image: Some(PAUSE_IMAGE.into()),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        ..Pod::default()
    }
}

/// Adds the `linkerd-proxy` container, as linkerd's injector does.
pub fn with_linkerd_proxy(mut pod: Pod) -> Pod {
    if let Some(spec) = pod.spec.as_mut() {
        spec.containers.push(Container {
            name: LINKERD_PROXY.into(),
            image: Some(PAUSE_IMAGE.into()),
            ..Container::default()
        });
    }
    pod
}

/// A bare meshed (linkerd) pause pod bound to `node`, with `extra` labels: the mesh label
/// and the `linkerd-proxy` container, as linkerd's injector leaves a pod.
pub fn meshed_pod(name: &str, node: &str, extra: &[(&str, &str)], grace: Option<i64>) -> Pod {
    let mut labels = vec![(MESH_LABEL, "linkerd")];
    labels.extend_from_slice(extra);
    with_linkerd_proxy(bare_pod(name, Some(node), &labels, grace))
}

/// A meshed pod no scheduler binds (`schedulerName: nobody`), so it stays Pending and the
/// webhook's pod cache holds it: the pod that binding reviews bind.
pub fn pending_meshed_pod(name: &str) -> Pod {
    let mut pod = bare_pod(name, None, &[(MESH_LABEL, "linkerd")], None);
    if let Some(spec) = pod.spec.as_mut() {
        spec.scheduler_name = Some("nobody".into());
    }
    pod
}

/// The most annotation bytes (keys and values) the API accepts on one object.
pub const ANNOTATION_LIMIT: usize = 256 * 1024;

/// The annotation `kubectl apply` keeps its copy of the whole object in: the usual reason a
/// pod's annotations are large.
pub const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// How large [`fat_pod`] makes a pod.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fat {
    /// Bytes of annotations (keys and values), at most [`ANNOTATION_LIMIT`], all in
    /// [`LAST_APPLIED`].
    pub annotations: usize,
    /// About this many bytes of extra labels (63-character values under numbered keys).
    pub labels: usize,
    /// Bytes of one environment variable's value in the pod's container (0: none).
    pub env: usize,
}

/// A pod as large as its author makes it ([`Fat`]). Meshed (linkerd) or plain; bound to
/// `node`, or left Pending for the nobody scheduler when `node` is `None`.
pub fn fat_pod(name: &str, node: Option<&str>, meshed: bool, fat: Fat) -> Pod {
    let mut pod = match (meshed, node) {
        (true, Some(n)) => meshed_pod(name, n, &[], Some(0)),
        (true, None) => pending_meshed_pod(name),
        (false, _) => bare_pod(name, node, &[], Some(0)),
    };
    if let Some(spec) = pod.spec.as_mut() {
        if node.is_none() {
            spec.scheduler_name = Some("nobody".into());
        }
        if fat.env > 0 {
            spec.containers[0].env = Some(vec![k8s_openapi::api::core::v1::EnvVar {
                name: "FILLER".into(),
                value: Some(filler(fat.env)),
                ..Default::default()
            }]);
        }
    }
    let value = fat
        .annotations
        .min(ANNOTATION_LIMIT)
        .saturating_sub(LAST_APPLIED.len());
    pod.metadata.annotations = Some(BTreeMap::from([(LAST_APPLIED.to_owned(), filler(value))]));
    let labels = pod.metadata.labels.get_or_insert_with(BTreeMap::new);
    let value = filler(63);
    for i in 0..fat.labels / (63 + 7) {
        labels.insert(format!("f{i:05}"), value.clone());
    }
    pod
}

/// `len` bytes of printable ASCII that no JSON encoder escapes or compresses well.
fn filler(len: usize) -> String {
    let mut x: u32 = 0x9e37_79b9;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            char::from(b'a' + (x % 26) as u8)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixtures_serialize_as_the_api_expects() {
        let pod = serde_json::to_value(meshed_pod("p", "n", &[("bench", "yes")], Some(0))).unwrap();
        assert_eq!(
            pod,
            serde_json::json!({
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": { "name": "p", "labels": { MESH_LABEL: "linkerd", "bench": "yes" } },
                "spec": {
                    "nodeName": "n",
                    "terminationGracePeriodSeconds": 0,
                    "containers": [
                        { "name": "app", "image": PAUSE_IMAGE },
                        { "name": LINKERD_PROXY, "image": PAUSE_IMAGE }
                    ]
                }
            })
        );
        let fat = fat_pod(
            "f",
            None,
            true,
            Fat {
                annotations: ANNOTATION_LIMIT,
                labels: 7000,
                env: 1024,
            },
        );
        assert_eq!(fat.metadata.labels.as_ref().unwrap().len(), 101);
        let annotations = fat.metadata.annotations.as_ref().unwrap();
        let size: usize = annotations.iter().map(|(k, v)| k.len() + v.len()).sum();
        assert_eq!(size, ANNOTATION_LIMIT);
        let spec = fat.spec.as_ref().unwrap();
        assert_eq!(spec.scheduler_name.as_deref(), Some("nobody"));
        assert_eq!(
            spec.containers[0].env.as_ref().unwrap()[0]
                .value
                .as_ref()
                .unwrap()
                .len(),
            1024
        );
        let bound = fat_pod(
            "b",
            Some("n"),
            false,
            Fat {
                annotations: 1000,
                ..Fat::default()
            },
        );
        assert_eq!(bound.spec.as_ref().unwrap().node_name.as_deref(), Some("n"));
        assert!(bound.spec.as_ref().unwrap().containers[0].env.is_none());
        let pending = serde_json::to_value(pending_meshed_pod("pending")).unwrap();
        assert_eq!(pending["spec"]["schedulerName"], "nobody");
        assert!(pending["spec"].get("nodeName").is_none());
        assert_eq!(pending["metadata"]["labels"][MESH_LABEL], "linkerd");
    }
}
