//! Istio with sidecars: pods labelled `security.istio.io/tlsMode=istio`, chained `istio-cni`,
//! inbound 15006 and outbound 15001, the `istio-proxy` sidecar.
//!
//! Its annotations (istio-cni's annotation registry and istio-iptables' `run.go`):
//! `traffic.sidecar.istio.io/includeInboundPorts: ""` writes no inbound capture;
//! `includeOutboundIPRanges: ""` together with an empty (default) `includeOutboundPorts`
//! writes no outbound capture; an `includeOutboundIPRanges` list with no CIDR of a family
//! captures nothing of that family; `excludeOutboundIPRanges` holding `0.0.0.0/0` (or `::/0`)
//! returns every packet of that family before the redirect.
//! `sidecar.istio.io/interceptionMode: NONE` captures nothing. `TPROXY` changes the
//! mechanism, not the expectation: the matcher accepts a TPROXY to the inbound port.

use std::collections::BTreeMap;

use super::{Mesh, map};
use crate::profile::{MeshProfile, PodSelector};
use crate::rules::expected::{
    AnnotationDialect, Dialect, Expectation, IpFamily, cidr_family, covers_family, get, list,
};

/// Interception mode (`REDIRECT`, `TPROXY`, `NONE`).
pub const ISTIO_MODE: &str = "sidecar.istio.io/interceptionMode";
/// Inbound ports to capture (`*`, a list, or `""`: none).
pub const ISTIO_IN_PORTS: &str = "traffic.sidecar.istio.io/includeInboundPorts";
/// Outbound ranges to capture (`*`, CIDRs, or `""`: none).
pub const ISTIO_OUT_RANGES: &str = "traffic.sidecar.istio.io/includeOutboundIPRanges";
/// Outbound ports captured whatever the ranges say.
pub const ISTIO_OUT_PORTS: &str = "traffic.sidecar.istio.io/includeOutboundPorts";
/// Outbound ranges returned before the capture.
pub const ISTIO_OUT_EXCLUDE: &str = "traffic.sidecar.istio.io/excludeOutboundIPRanges";

pub(super) const MESH: Mesh = Mesh {
    profile,
    dialect: &DIALECT,
};

/// Istio's sidecar annotations.
pub const DIALECT: Dialect = Dialect {
    name: "istio",
    annotation_keys: &[
        ISTIO_MODE,
        ISTIO_IN_PORTS,
        ISTIO_OUT_RANGES,
        ISTIO_OUT_PORTS,
        ISTIO_OUT_EXCLUDE,
    ],
    narrow,
};

fn profile() -> MeshProfile {
    MeshProfile {
        name: "istio".into(),
        selector: PodSelector {
            labels: map(&[("security.istio.io/tlsMode", "istio")]),
            ..PodSelector::default()
        },
        plugin_type: "istio-cni".into(),
        inbound_port: 15006,
        outbound_port: 15001,
        dual_stack: false,
        annotation_dialect: AnnotationDialect::of(&DIALECT),
        proxy_containers: vec!["istio-proxy".into()],
        node_proxy: None,
    }
}

fn narrow(annotations: &BTreeMap<String, String>, out: &mut Expectation) {
    let get = |k| get(annotations, k);
    if get(ISTIO_MODE) == Some("NONE") {
        let why = format!("{ISTIO_MODE}=NONE: the mesh captures nothing");
        out.inbound.drop_all(why.clone());
        out.outbound.drop_all(why);
    }
    if get(ISTIO_IN_PORTS) == Some("") {
        out.inbound
            .drop_all(format!("{ISTIO_IN_PORTS}=\"\": no inbound capture"));
    }
    let ranges = get(ISTIO_OUT_RANGES).unwrap_or("*");
    let ports = get(ISTIO_OUT_PORTS).unwrap_or("");
    if ports.is_empty() {
        if ranges.is_empty() {
            out.outbound.drop_all(format!(
                "{ISTIO_OUT_RANGES}=\"\" and no {ISTIO_OUT_PORTS}: no outbound capture"
            ));
        } else if !ranges.split(',').any(|r| r.trim() == "*") {
            for ip in [IpFamily::V4, IpFamily::V6] {
                if !list(ranges).any(|r| cidr_family(r) == Some(ip)) {
                    out.outbound.drop_family(
                        ip,
                        format!(
                            "{ISTIO_OUT_RANGES} lists no {} range: no {} outbound capture",
                            ip.as_str(),
                            ip.as_str()
                        ),
                    );
                }
            }
        }
    }
    // A /0 exclusion returns that family's packets ahead of the range redirects; it
    // removes the family whatever else is set, since dropping a requirement on a
    // doubt can only spare a pod, never evict one.
    if let Some(ex) = get(ISTIO_OUT_EXCLUDE) {
        for ip in [IpFamily::V4, IpFamily::V6] {
            if list(ex).any(|r| covers_family(r, ip)) {
                out.outbound.drop_family(
                    ip,
                    format!("{ISTIO_OUT_EXCLUDE} excludes every {} address", ip.as_str()),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meshes::linkerd::LINKERD_SKIP_IN;
    use crate::rules::expectation;

    fn ann(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        map(pairs)
    }

    const V4: IpFamily = IpFamily::V4;

    #[test]
    fn istio_opt_outs_follow_istio_cni_defaults() {
        let p = profile();
        let e = |a: &[(&str, &str)]| expectation(&p, &[V4], &ann(a));
        // includeInboundPorts "" removes inbound, keeps outbound.
        let got = e(&[(ISTIO_IN_PORTS, "")]);
        assert!(!got.inbound.is_expected() && got.outbound.is_expected());
        assert!(got.inbound.exempt[0].contains("includeInboundPorts"));
        // "*" and a port list keep it.
        assert!(e(&[(ISTIO_IN_PORTS, "*")]).inbound.is_expected());
        assert!(e(&[(ISTIO_IN_PORTS, "8080")]).inbound.is_expected());
        // includeOutboundIPRanges "" removes outbound unless includeOutboundPorts is set.
        let got = e(&[(ISTIO_OUT_RANGES, " ")]);
        assert!(got.inbound.is_expected() && !got.outbound.is_expected());
        assert!(
            e(&[(ISTIO_OUT_RANGES, ""), (ISTIO_OUT_PORTS, "32000,31000")])
                .outbound
                .is_expected()
        );
        // An IPv6-only range list captures no IPv4.
        assert!(
            !e(&[(ISTIO_OUT_RANGES, "2001:db8::/32")])
                .outbound
                .is_expected()
        );
        assert!(
            e(&[(ISTIO_OUT_RANGES, "10.0.0.0/8")])
                .outbound
                .is_expected()
        );
        // Excluding every IPv4 address.
        assert!(
            !e(&[(ISTIO_OUT_EXCLUDE, "10.1.0.0/16, 0.0.0.0/0")])
                .outbound
                .is_expected()
        );
        assert!(e(&[(ISTIO_OUT_EXCLUDE, "::/0")]).outbound.is_expected());
        assert!(
            !e(&[(ISTIO_OUT_EXCLUDE, "0.0.0.0/0"), (ISTIO_OUT_PORTS, "8080")])
                .outbound
                .is_expected()
        );
        // Mode NONE captures nothing; TPROXY changes nothing here.
        let none = e(&[(ISTIO_MODE, "NONE")]);
        assert!(!none.inbound.is_expected() && !none.outbound.is_expected());
        let tproxy = e(&[(ISTIO_MODE, "TPROXY")]);
        assert!(tproxy.inbound.is_expected() && tproxy.outbound.is_expected());
        // Linkerd's annotations mean nothing to Istio.
        assert!(e(&[(LINKERD_SKIP_IN, "1-65535")]).inbound.is_expected());
    }
}
