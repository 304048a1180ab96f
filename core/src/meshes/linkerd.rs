//! Linkerd: pods labelled `linkerd.io/control-plane-ns`, chained `linkerd-cni`, inbound 4143
//! and outbound 4140, the `linkerd-proxy` sidecar.
//!
//! Its annotations (proxy-init `iptables.go`): `config.linkerd.io/skip-inbound-ports` /
//! `skip-outbound-ports` covering every port (`1-65535`) skip the direction; `skip-subnets`
//! holding `0.0.0.0/0` (or `::/0`) makes `PROXY_INIT_REDIRECT` return every inbound packet of
//! that family (proxy-init applies ignored subnets to inbound traffic only).

use std::collections::BTreeMap;

use super::{Mesh, map};
use crate::profile::{MeshProfile, PodSelector};
use crate::rules::expected::{
    AnnotationDialect, Dialect, Expectation, IpFamily, covers_family, get, list,
};

/// Skips inbound ports.
pub const LINKERD_SKIP_IN: &str = "config.linkerd.io/skip-inbound-ports";
/// Skips outbound ports.
pub const LINKERD_SKIP_OUT: &str = "config.linkerd.io/skip-outbound-ports";
/// Skips subnets (inbound sources).
pub const LINKERD_SKIP_SUBNETS: &str = "config.linkerd.io/skip-subnets";

pub(super) const MESH: Mesh = Mesh {
    profile,
    dialect: &DIALECT,
};

/// Linkerd's annotations.
pub const DIALECT: Dialect = Dialect {
    name: "linkerd",
    annotation_keys: &[LINKERD_SKIP_IN, LINKERD_SKIP_OUT, LINKERD_SKIP_SUBNETS],
    narrow,
};

fn profile() -> MeshProfile {
    MeshProfile {
        name: "linkerd".into(),
        selector: PodSelector {
            labels: map(&[("linkerd.io/control-plane-ns", "")]),
            ..PodSelector::default()
        },
        plugin_type: "linkerd-cni".into(),
        inbound_port: 4143,
        outbound_port: 4140,
        dual_stack: false,
        annotation_dialect: AnnotationDialect::of(&DIALECT),
        proxy_containers: vec!["linkerd-proxy".into()],
        node_proxy: None,
    }
}

fn narrow(annotations: &BTreeMap<String, String>, out: &mut Expectation) {
    let get = |k| get(annotations, k);
    if get(LINKERD_SKIP_IN).is_some_and(covers_every_port) {
        out.inbound
            .drop_all(format!("{LINKERD_SKIP_IN} skips every port"));
    }
    if get(LINKERD_SKIP_OUT).is_some_and(covers_every_port) {
        out.outbound
            .drop_all(format!("{LINKERD_SKIP_OUT} skips every port"));
    }
    if let Some(subnets) = get(LINKERD_SKIP_SUBNETS) {
        for ip in [IpFamily::V4, IpFamily::V6] {
            if list(subnets).any(|r| covers_family(r, ip)) {
                out.inbound.drop_family(
                    ip,
                    format!("{LINKERD_SKIP_SUBNETS} skips every {} source", ip.as_str()),
                );
            }
        }
    }
}

/// True when a Linkerd port list (`80,443,1000-2000`) covers every port 1-65535.
fn covers_every_port(v: &str) -> bool {
    let mut ranges: Vec<(u32, u32)> = Vec::new();
    for item in list(v) {
        let (lo, hi) = match item.split_once('-') {
            Some((a, b)) => (a.trim().parse::<u16>(), b.trim().parse::<u16>()),
            None => (item.parse::<u16>(), item.parse::<u16>()),
        };
        match (lo, hi) {
            (Ok(lo), Ok(hi)) if lo <= hi => ranges.push((u32::from(lo), u32::from(hi))),
            // proxy-init logs and drops an item it cannot parse.
            _ => {}
        }
    }
    ranges.sort_unstable();
    let mut next = 1u32;
    for (lo, hi) in ranges {
        if lo > next {
            return false;
        }
        next = next.max(hi + 1);
    }
    next > 65535
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::expectation;

    fn ann(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        map(pairs)
    }

    const V4: IpFamily = IpFamily::V4;
    const V6: IpFamily = IpFamily::V6;

    #[test]
    fn linkerd_opt_outs() {
        let p = profile();
        let e = |fams: &[IpFamily], a: &[(&str, &str)]| expectation(&p, fams, &ann(a));
        assert!(
            !e(&[V4], &[(LINKERD_SKIP_IN, "1-65535")])
                .inbound
                .is_expected()
        );
        assert!(
            !e(&[V4], &[(LINKERD_SKIP_IN, "1-1000,999-65535")])
                .inbound
                .is_expected()
        );
        assert!(
            e(&[V4], &[(LINKERD_SKIP_IN, "2-65535")])
                .inbound
                .is_expected()
        );
        assert!(
            e(&[V4], &[(LINKERD_SKIP_IN, "4190,4191")])
                .inbound
                .is_expected()
        );
        assert!(e(&[V4], &[(LINKERD_SKIP_IN, "x-y,")]).inbound.is_expected());
        let out = e(&[V4], &[(LINKERD_SKIP_OUT, "1-65535")]);
        assert!(out.inbound.is_expected() && !out.outbound.is_expected());
        // skip-subnets is inbound only, per family.
        let mut dual = p.clone();
        dual.dual_stack = true;
        let got = expectation(
            &dual,
            &[V4, V6],
            &ann(&[(LINKERD_SKIP_SUBNETS, "0.0.0.0/0")]),
        );
        assert_eq!(got.inbound.families, [V6]);
        assert_eq!(got.outbound.families, [V4, V6]);
        assert!(
            e(&[V4], &[(LINKERD_SKIP_SUBNETS, "10.0.0.0/8")])
                .inbound
                .is_expected()
        );
    }

    #[test]
    fn port_coverage() {
        assert!(covers_every_port("1-65535"));
        assert!(covers_every_port("1-100, 101-65535"));
        assert!(covers_every_port("0-65535"));
        assert!(!covers_every_port(""));
        assert!(!covers_every_port("1-65534"));
        assert!(!covers_every_port("65535-1"));
        assert!(covers_family("0.0.0.0/0", V4));
        assert!(!covers_family("0.0.0.0/0", V6));
        assert!(covers_family("::/0", V6));
        assert!(!covers_family("0.0.0.0", V4));
        assert!(!covers_family("10.0.0.0/0x", V4));
    }
}
