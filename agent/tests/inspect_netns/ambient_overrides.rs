//! Istio ambient's pod-level overrides as istio-cni's node agent writes them: the rules come
//! from `istio-inpod` (e2e/istio-inpod), which runs istio's own in-pod rule builders at the
//! pinned version (`AppendInpodRules`, iptables and nftables) inside the test namespace, for
//! the overrides the node agent derives from each pod's annotations. Each case is judged as
//! the daemon judges a pod (its rules, the profile, the pod's annotations), through every
//! backend istio-cni writes with.

use std::collections::BTreeMap;
use std::path::PathBuf;

use meshgate_agent::netns;
use meshgate_core::meshes::istio_ambient::{
    AMBIENT_BYPASS_INBOUND, AMBIENT_DNS_CAPTURE, AMBIENT_REROUTE_VIRTUAL_INTERFACES,
};
use meshgate_core::rules::{Inspection, RedirectVerdict};
use meshgate_e2e::harness::paths;

use super::{Netns, annotations, profile};

const BACKENDS: [&str; 3] = ["iptables-nft", "iptables-legacy", "nftables"];

/// The binary `e2e/install-deps.sh` builds against the pinned istio module.
fn istio_inpod() -> PathBuf {
    let cache = paths::cache_dir().unwrap_or_else(|e| panic!("{e}"));
    let version = paths::pinned_version("istio-cni-version").unwrap_or_else(|e| panic!("{e}"));
    let bin = cache
        .join("istio-inpod")
        .join(version)
        .join("bin/istio-inpod");
    assert!(
        bin.is_file(),
        "{} is missing: run e2e/install-deps.sh (make test does)",
        bin.display()
    );
    bin
}

/// A fresh pod namespace with istio-cni's in-pod rules for a pod carrying `pod` annotations,
/// written through `backend`; the rules as istio-inpod printed them.
fn pod_with_rules(backend: &str, pod: &BTreeMap<String, String>) -> (Netns, String) {
    let ns = Netns::new("amb");
    ns.addr("10.244.6.9/24");
    let json = serde_json::to_string(pod).expect("annotations as JSON");
    let written = ns.sh(&format!(
        "{} --backend {backend} --annotations '{json}'",
        istio_inpod().display()
    ));
    (ns, written)
}

fn judge(ns: &Netns, pod: &BTreeMap<String, String>) -> Inspection {
    netns::check_pod(&ns.path(), &profile("istio-ambient"), pod)
        .unwrap_or_else(|e| panic!("inspect {}: {e}", ns.name()))
}

#[test]
fn bypass_inbound_capture_writes_outbound_only_and_is_redirected() {
    let pod = annotations(&[(AMBIENT_BYPASS_INBOUND, "true")]);
    for backend in BACKENDS {
        let (ns, written) = pod_with_rules(backend, &pod);
        let got = judge(&ns, &pod);
        assert_eq!(
            got.verdict,
            RedirectVerdict::Redirected,
            "{backend}: {}\n{written}",
            got.message
        );
        assert!(
            !got.inbound.expected && !got.inbound.found,
            "{backend}: {got:?}"
        );
        assert!(got.outbound.found, "{backend}: {got:?}");
        // The rules really lack the inbound redirect: judged without the annotation, the
        // pod would be missing (what evicted these pods in a loop).
        let unannotated = judge(&ns, &BTreeMap::new());
        assert_eq!(
            unannotated.verdict,
            RedirectVerdict::Missing,
            "{backend}: {written}"
        );
        assert!(
            unannotated.message.contains("15006"),
            "{}",
            unannotated.message
        );
    }
}

#[test]
fn every_other_override_keeps_both_directions_redirected() {
    let cases = [
        vec![],
        vec![(AMBIENT_DNS_CAPTURE, "false")],
        vec![(AMBIENT_DNS_CAPTURE, "true")],
        vec![(AMBIENT_REROUTE_VIRTUAL_INTERFACES, "virt0, docker0")],
        // Not a Go boolean: istio-cni ignores it and captures inbound.
        vec![(AMBIENT_BYPASS_INBOUND, "yes")],
        vec![(AMBIENT_BYPASS_INBOUND, "false")],
    ];
    for backend in BACKENDS {
        for case in &cases {
            let pod = annotations(case);
            let (ns, written) = pod_with_rules(backend, &pod);
            let got = judge(&ns, &pod);
            assert_eq!(
                got.verdict,
                RedirectVerdict::Redirected,
                "{backend} {case:?}: {}\n{written}",
                got.message
            );
            assert!(
                got.inbound.found && got.outbound.found,
                "{backend} {case:?}: {got:?}"
            );
        }
    }
}
