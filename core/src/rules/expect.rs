//! What a mesh writes into one pod's network namespace: the expectation the matcher checks.
//!
//! In: a [`MeshProfile`], the IP families the pod has addresses in, and the pod's annotations
//! (a plain map). Out: an [`Expectation`]: per direction, the proxy port and the IP families
//! whose rules must intercept it; an empty family list means the mesh writes no interception
//! for that direction, so its absence is no reason to evict.
//!
//! The rules follow what the meshes' own code does with the same inputs:
//!
//! - **Families.** A pod with an IPv4 address always needs IPv4 rules. IPv6 rules are needed
//!   for an IPv6-only pod, and for a dual-stack pod only when the profile says the mesh is
//!   configured dual-stack ([`MeshProfile::dual_stack`]): Istio writes `ip6tables` rules for a
//!   dual-stack pod only with `ISTIO_DUAL_STACK` (istio-cni `sidecar_redirect.go` reads it
//!   from the proxy's environment; istio-iptables' `EnableIPv6`), and Linkerd only with
//!   `disableIPv6: false` (proxy-init's IPv6 pass). Both default to IPv4 only.
//! - **Istio** ([`AnnotationDialect::Istio`], istio-cni's annotation registry and
//!   istio-iptables' `run.go`): `traffic.sidecar.istio.io/includeInboundPorts: ""` writes no
//!   inbound capture; `includeOutboundIPRanges: ""` together with an empty (default)
//!   `includeOutboundPorts` writes no outbound capture; an `includeOutboundIPRanges` list with
//!   no CIDR of a family captures nothing of that family; `excludeOutboundIPRanges` holding
//!   `0.0.0.0/0` (or `::/0`) returns every packet of that family before the redirect.
//!   `sidecar.istio.io/interceptionMode: NONE` captures nothing. `TPROXY` changes the
//!   mechanism, not the expectation: the matcher accepts a TPROXY to the inbound port.
//! - **Linkerd** ([`AnnotationDialect::Linkerd`], proxy-init `iptables.go`):
//!   `config.linkerd.io/skip-inbound-ports` / `skip-outbound-ports` covering every port
//!   (`1-65535`) skip the direction; `skip-subnets` holding `0.0.0.0/0` (or `::/0`) makes
//!   `PROXY_INIT_REDIRECT` return every inbound packet of that family (proxy-init applies
//!   ignored subnets to inbound traffic only).
//!
//! An opt-out only ever removes a requirement, so a pod that opts out is never `missing` for
//! the part it opted out of; whatever it kept is still checked.

use std::collections::BTreeMap;
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use super::IpFamily;
use crate::profile::MeshProfile;

/// Whose pod annotations narrow a profile's expectation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AnnotationDialect {
    /// No annotation is read: both directions are expected (custom profiles' default).
    #[default]
    None,
    /// Istio sidecar annotations (`traffic.sidecar.istio.io/*`, `sidecar.istio.io/interceptionMode`).
    Istio,
    /// Linkerd annotations (`config.linkerd.io/skip-*`).
    Linkerd,
}

/// What one direction must look like.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Expected {
    /// Proxy port the direction must be intercepted to.
    pub port: u16,
    /// Families whose rules must intercept this direction, sorted; empty when the mesh
    /// writes no interception for this direction.
    pub families: Vec<IpFamily>,
    /// Why a family the pod has is not required, one line each (for messages).
    pub exempt: Vec<String>,
}

impl Expected {
    /// True when at least one family must be intercepted.
    pub fn is_expected(&self) -> bool {
        !self.families.is_empty()
    }

    fn drop_family(&mut self, ip: IpFamily, why: String) {
        if self.families.contains(&ip) {
            self.families.retain(|f| *f != ip);
            self.exempt.push(why);
        }
    }

    fn drop_all(&mut self, why: String) {
        if !self.families.is_empty() {
            self.families.clear();
            self.exempt.push(why);
        }
    }
}

/// What the mesh writes for one pod, per direction.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Expectation {
    /// Inbound: redirect (nat PREROUTING) or TPROXY (prerouting) to the inbound port.
    pub inbound: Expected,
    /// Outbound: redirect from nat OUTPUT to the outbound port.
    pub outbound: Expected,
}

const ISTIO_MODE: &str = "sidecar.istio.io/interceptionMode";
const ISTIO_IN_PORTS: &str = "traffic.sidecar.istio.io/includeInboundPorts";
const ISTIO_OUT_RANGES: &str = "traffic.sidecar.istio.io/includeOutboundIPRanges";
const ISTIO_OUT_PORTS: &str = "traffic.sidecar.istio.io/includeOutboundPorts";
const ISTIO_OUT_EXCLUDE: &str = "traffic.sidecar.istio.io/excludeOutboundIPRanges";
const LINKERD_SKIP_IN: &str = "config.linkerd.io/skip-inbound-ports";
const LINKERD_SKIP_OUT: &str = "config.linkerd.io/skip-outbound-ports";
const LINKERD_SKIP_SUBNETS: &str = "config.linkerd.io/skip-subnets";

impl AnnotationDialect {
    /// The pod annotations [`expectation`] reads for this dialect: what a cache of pods must
    /// keep, as they are, for the rules check.
    pub fn annotation_keys(self) -> &'static [&'static str] {
        match self {
            AnnotationDialect::None => &[],
            AnnotationDialect::Istio => &[
                ISTIO_MODE,
                ISTIO_IN_PORTS,
                ISTIO_OUT_RANGES,
                ISTIO_OUT_PORTS,
                ISTIO_OUT_EXCLUDE,
            ],
            AnnotationDialect::Linkerd => {
                &[LINKERD_SKIP_IN, LINKERD_SKIP_OUT, LINKERD_SKIP_SUBNETS]
            }
        }
    }
}

/// Derives the expectation for a pod with addresses in `families` (empty: IPv4 only) and
/// these annotations. Pure; unknown or malformed annotation values never add a requirement.
pub fn expectation(
    profile: &MeshProfile,
    families: &[IpFamily],
    annotations: &BTreeMap<String, String>,
) -> Expectation {
    let mut fams: Vec<IpFamily> = families.to_vec();
    if fams.is_empty() {
        fams.push(IpFamily::V4);
    }
    fams.sort();
    fams.dedup();
    let has_v4 = fams.contains(&IpFamily::V4);
    let mut required = fams.clone();
    let mut exempt = Vec::new();
    if has_v4 && fams.contains(&IpFamily::V6) && !profile.dual_stack {
        required.retain(|f| *f != IpFamily::V6);
        exempt.push(format!(
            "IPv6 not required: profile {} is single-stack (the mesh's default writes IPv4 rules \
             only for dual-stack pods; set dualStack for ISTIO_DUAL_STACK / disableIPv6=false)",
            profile.name
        ));
    }
    let direction = |port| Expected {
        port,
        families: required.clone(),
        exempt: exempt.clone(),
    };
    let mut out = Expectation {
        inbound: direction(profile.inbound_port),
        outbound: direction(profile.outbound_port),
    };
    let get = |k: &str| annotations.get(k).map(|v| v.trim());
    match profile.annotation_dialect {
        AnnotationDialect::None => {}
        AnnotationDialect::Istio => {
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
        AnnotationDialect::Linkerd => {
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
    }
    out
}

/// The non-empty, trimmed items of a comma-separated annotation value.
fn list(v: &str) -> impl Iterator<Item = &str> {
    v.split(',').map(str::trim).filter(|s| !s.is_empty())
}

/// The family of a CIDR or address (`10.0.0.0/8`, `2001:db8::/32`), if it parses.
fn cidr_family(cidr: &str) -> Option<IpFamily> {
    let addr = cidr.split_once('/').map_or(cidr, |(a, _)| a);
    match addr.trim().parse::<IpAddr>().ok()? {
        IpAddr::V4(_) => Some(IpFamily::V4),
        IpAddr::V6(_) => Some(IpFamily::V6),
    }
}

/// True when `cidr` is a `/0` of family `ip` (`0.0.0.0/0`, `::/0`): it matches every address.
fn covers_family(cidr: &str, ip: IpFamily) -> bool {
    match cidr.split_once('/') {
        Some((_, len)) => len.trim() == "0" && cidr_family(cidr) == Some(ip),
        None => false,
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

    fn profile(name: &str) -> MeshProfile {
        crate::profile::builtin_named(name).expect("built-in profile")
    }

    fn ann(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    const V4: IpFamily = IpFamily::V4;
    const V6: IpFamily = IpFamily::V6;

    #[test]
    fn defaults_require_both_directions_in_ipv4_only_for_dual_stack_pods() {
        for name in ["linkerd", "istio", "istio-ambient"] {
            let e = expectation(&profile(name), &[V6, V4], &BTreeMap::new());
            assert_eq!(e.inbound.families, [V4], "{name}");
            assert_eq!(e.outbound.families, [V4], "{name}");
            assert!(
                e.inbound.exempt[0].contains("IPv6"),
                "{:?}",
                e.inbound.exempt
            );
        }
        // A single-stack IPv6 pod gets IPv6 rules from both meshes.
        let e = expectation(&profile("linkerd"), &[V6], &BTreeMap::new());
        assert_eq!(e.inbound.families, [V6]);
        // No address at all: IPv4.
        let e = expectation(&profile("istio"), &[], &BTreeMap::new());
        assert_eq!(e.outbound.families, [V4]);
        // A dual-stack-configured profile requires both.
        let mut p = profile("istio");
        p.dual_stack = true;
        let e = expectation(&p, &[V4, V6], &BTreeMap::new());
        assert_eq!(e.inbound.families, [V4, V6]);
        assert!(e.inbound.exempt.is_empty());
        assert_eq!((e.inbound.port, e.outbound.port), (15006, 15001));
    }

    #[test]
    fn istio_opt_outs_follow_istio_cni_defaults() {
        let p = profile("istio");
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

    #[test]
    fn linkerd_opt_outs() {
        let p = profile("linkerd");
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
    fn custom_profiles_read_no_annotations() {
        let mut p = profile("istio");
        p.annotation_dialect = AnnotationDialect::None;
        let got = expectation(&p, &[V4], &ann(&[(ISTIO_IN_PORTS, "")]));
        assert!(got.inbound.is_expected());
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
