//! What a mesh writes into one pod's network namespace: the expectation the matcher checks.
//!
//! In: a [`MeshProfile`], the IP families the pod has addresses in, and the pod's annotations
//! (a plain map). Out: an [`Expectation`]: per direction, the proxy port and the IP families
//! whose rules must intercept it; an empty family list means the mesh writes no interception
//! for that direction, so its absence is no reason to evict.
//!
//! - **Families.** A pod with an IPv4 address always needs IPv4 rules. IPv6 rules are needed
//!   for an IPv6-only pod, and for a dual-stack pod only when the profile says the mesh is
//!   configured dual-stack ([`MeshProfile::dual_stack`]): Istio writes `ip6tables` rules for a
//!   dual-stack pod only with `ISTIO_DUAL_STACK` (istio-cni `sidecar_redirect.go` reads it
//!   from the proxy's environment; istio-iptables' `EnableIPv6`), and Linkerd only with
//!   `disableIPv6: false` (proxy-init's IPv6 pass). Both default to IPv4 only.
//! - **Annotations.** The profile's [`AnnotationDialect`](super::AnnotationDialect) then
//!   removes what the pod opts out of. Each mesh's dialect, with the upstream code it
//!   follows, is in its own file under [`crate::meshes`].

use std::collections::BTreeMap;

use super::expected::{Expectation, Expected, IpFamily};
use crate::profile::MeshProfile;

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
    profile.annotation_dialect.narrow(annotations, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meshes::istio::ISTIO_IN_PORTS;
    use crate::rules::AnnotationDialect;

    fn profile(name: &str) -> MeshProfile {
        crate::meshes::builtin_named(name).expect("built-in profile")
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
    fn custom_profiles_read_no_annotations() {
        let mut p = profile("istio");
        p.annotation_dialect = AnnotationDialect::NONE;
        let got = expectation(&p, &[V4], &ann(&[(ISTIO_IN_PORTS, "")]));
        assert!(got.inbound.is_expected());
    }
}
