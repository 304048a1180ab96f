//! Istio ambient: pods Istio enrolls into ambient, redirected by `istio-cni` to ztunnel's
//! inbound 15006 and outbound 15001; no sidecar.
//!
//! It selects as Istio's default ambient enablement selectors do (istio/istio
//! `cni/pkg/util/enablement_selector.go`, `Matches`, and the chart's default
//! `ambient.enablementSelectors`): the pod label `istio.io/dataplane-mode=ambient`, or the
//! namespace label `istio.io/dataplane-mode=ambient` unless the pod is labelled
//! `istio.io/dataplane-mode=none`; never a pod Istio injected a sidecar into (it carries
//! `sidecar.istio.io/status`). Host-network pods Istio skips too; the agent never inspects
//! them. The contract's `ambient.istio.io/redirection=enabled` annotation is written by
//! istio-cni only *after* it set the redirects up, so a pod whose setup failed never carried
//! it: selecting on it could never find the pods meshgate exists for (docs/architecture.md,
//! "Contract drift"). Ambient pods carry no sidecar annotations istio-cni would honour, so
//! the profile reads none. An ambient pod's traffic is only meshed once ztunnel on its node
//! took the pod's sockets, so the profile carries ztunnel as its node proxy
//! ([`ztunnel`]).

use super::{Mesh, map};
use crate::profile::{MeshProfile, PodSelector};
use crate::rules::expected::{AnnotationDialect, NO_DIALECT};

/// Istio's enrollment label, on a pod or its namespace (`istio.io/dataplane-mode`).
pub const ISTIO_DATAPLANE_MODE: &str = "istio.io/dataplane-mode";
/// The annotation Istio's sidecar injector writes on every pod it injected. Istio never
/// enrolls such a pod into ambient (`podHasSidecar` in istio/istio
/// `cni/pkg/util/enablement_selector.go`).
pub const ISTIO_SIDECAR_STATUS: &str = "sidecar.istio.io/status";

pub(super) const MESH: Mesh = Mesh {
    profile,
    dialect: &NO_DIALECT,
};

fn profile() -> MeshProfile {
    MeshProfile {
        name: "istio-ambient".into(),
        selector: PodSelector {
            exclude_annotations: map(&[(ISTIO_SIDECAR_STATUS, "")]),
            any_of: vec![
                PodSelector {
                    labels: map(&[(ISTIO_DATAPLANE_MODE, "ambient")]),
                    ..PodSelector::default()
                },
                PodSelector {
                    namespace_labels: map(&[(ISTIO_DATAPLANE_MODE, "ambient")]),
                    exclude_labels: map(&[(ISTIO_DATAPLANE_MODE, "none")]),
                    ..PodSelector::default()
                },
            ],
            ..PodSelector::default()
        },
        plugin_type: "istio-cni".into(),
        inbound_port: 15006,
        outbound_port: 15001,
        dual_stack: false,
        annotation_dialect: AnnotationDialect::NONE,
        // Ambient runs no sidecar: ztunnel is a node proxy.
        proxy_containers: Vec::new(),
        // ...and a node is in the mesh only once ztunnel there is ready.
        node_proxy: Some(ztunnel()),
    }
}

/// Istio ambient's ztunnel, as istio/istio ships it: the DaemonSet's pods are labelled
/// `app: ztunnel` (`manifests/charts/ztunnel/templates/daemonset.yaml`) in `istio-system`.
/// `/var/run/ztunnel/ztunnel.sock` is LISTENED on by istio-cni's node agent
/// (`cni/pkg/nodeagent/ztunnelserver_linux.go`, `net.ListenUnix("unixpacket", ...)`; the
/// flag's default in `cni/cmd/root.go`) and ztunnel connects to it (its `INPOD_UDS`); both
/// charts mount that directory from the host (`hostPath` `/var/run/ztunnel`). Over that
/// connection ztunnel receives each ambient pod's netns and opens, inside it, inbound HBONE
/// 15008, plaintext inbound 15006 and outbound 15001.
pub fn ztunnel() -> crate::profile::NodeProxy {
    crate::profile::NodeProxy {
        name: "ztunnel".into(),
        namespace: "istio-system".into(),
        labels: map(&[("app", "ztunnel")]),
        socket: "/var/run/ztunnel/ztunnel.sock".into(),
        listen_ports: vec![15008, 15006, 15001],
    }
}
