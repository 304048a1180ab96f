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
//! "Contract drift"). An ambient pod's traffic is only meshed once ztunnel on its node
//! took the pod's sockets, so the profile carries ztunnel as its node proxy
//! ([`ztunnel`]).
//!
//! Its annotations are the pod-level overrides istio-cni's node agent reads
//! (`getPodLevelTrafficOverrides` in istio/istio `cni/pkg/nodeagent/net.go`), as its in-pod
//! rules (`AppendInpodRules` in `cni/pkg/iptables/iptables.go` and
//! `cni/pkg/nftables/nftables.go`) apply them:
//! - `ambient.istio.io/bypass-inbound-capture`, a Go boolean (`strconv.ParseBool`; any other
//!   value is ignored): true writes no inbound redirect ("ingress mode"), so inbound is not
//!   expected; outbound still is.
//! - `ambient.istio.io/dns-capture` only adds or removes the DNS redirects to 15053, which
//!   meshgate does not require: no change.
//! - `istio.io/reroute-virtual-interfaces` adds, ahead of the inbound redirect, a redirect to
//!   15001 and a return for each listed interface; the inbound redirect for every other
//!   interface stays: no change (the matcher does not let an interface-scoped rule decide).

use std::collections::BTreeMap;

use super::{Mesh, map};
use crate::profile::{MeshProfile, PodSelector};
use crate::rules::expected::{AnnotationDialect, Dialect, Expectation};

/// Istio's enrollment label, on a pod or its namespace (`istio.io/dataplane-mode`).
pub const ISTIO_DATAPLANE_MODE: &str = "istio.io/dataplane-mode";
/// The annotation Istio's sidecar injector writes on every pod it injected. Istio never
/// enrolls such a pod into ambient (`podHasSidecar` in istio/istio
/// `cni/pkg/util/enablement_selector.go`).
pub const ISTIO_SIDECAR_STATUS: &str = "sidecar.istio.io/status";

/// Ambient's inbound opt-out ("ingress mode": only outbound traffic is captured).
pub const AMBIENT_BYPASS_INBOUND: &str = "ambient.istio.io/bypass-inbound-capture";
/// Ambient's DNS capture override (the DNS redirects only).
pub const AMBIENT_DNS_CAPTURE: &str = "ambient.istio.io/dns-capture";
/// Interfaces whose inbound traffic istio-cni treats as outbound.
pub const AMBIENT_REROUTE_VIRTUAL_INTERFACES: &str = "istio.io/reroute-virtual-interfaces";

pub(super) const MESH: Mesh = Mesh {
    profile,
    dialect: &DIALECT,
};

/// The pod-level overrides of istio-cni's node agent. Only the one that removes a
/// requirement is kept by the agent's pod cache; the other two change nothing meshgate
/// checks (see the module doc).
pub const DIALECT: Dialect = Dialect {
    name: "istio-ambient",
    annotation_keys: &[AMBIENT_BYPASS_INBOUND],
    narrow,
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
        annotation_dialect: AnnotationDialect::of(&DIALECT),
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

fn narrow(annotations: &BTreeMap<String, String>, out: &mut Expectation) {
    // Untrimmed, as istio-cni reads it (`CheckBooleanAnnotation`).
    if annotations
        .get(AMBIENT_BYPASS_INBOUND)
        .is_some_and(|v| go_parse_bool(v) == Some(true))
    {
        out.inbound.drop_all(format!(
            "{AMBIENT_BYPASS_INBOUND}=true: istio-cni captures outbound traffic only"
        ));
    }
}

/// Go's `strconv.ParseBool`: the only spellings istio-cni accepts.
fn go_parse_bool(v: &str) -> Option<bool> {
    match v {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::expectation;
    use crate::rules::expected::IpFamily;

    #[test]
    fn only_a_go_true_bypass_removes_inbound() {
        let p = profile();
        let e = |pairs: &[(&str, &str)]| expectation(&p, &[IpFamily::V4], &map(pairs));
        for yes in ["true", "1", "t", "T", "TRUE", "True"] {
            let got = e(&[(AMBIENT_BYPASS_INBOUND, yes)]);
            assert!(!got.inbound.is_expected(), "{yes}");
            assert!(got.outbound.is_expected(), "{yes}");
            assert!(got.inbound.exempt[0].contains("outbound traffic only"));
        }
        // istio-cni ignores what ParseBool refuses, untrimmed values included.
        for no in ["false", "0", "", "yes", " true", "true ", "on"] {
            let got = e(&[(AMBIENT_BYPASS_INBOUND, no)]);
            assert!(
                got.inbound.is_expected() && got.outbound.is_expected(),
                "{no:?}"
            );
        }
        // The other two overrides change nothing meshgate requires.
        for pairs in [
            [(AMBIENT_DNS_CAPTURE, "false")],
            [(AMBIENT_DNS_CAPTURE, "true")],
            [(AMBIENT_REROUTE_VIRTUAL_INTERFACES, "virt0, docker0")],
        ] {
            let got = e(&pairs);
            assert!(got.inbound.is_expected() && got.outbound.is_expected());
        }
        // The sidecar profile's opt-outs mean nothing to ambient.
        let got = e(&[("traffic.sidecar.istio.io/includeInboundPorts", "")]);
        assert!(got.inbound.is_expected());
    }
}
