//! What docs/architecture.md's "where to make a change" promises for a new mesh: its record
//! is all the generic code reads. `EXAMPLE` is a mesh as a newcomer writes it in
//! `core/src/meshes/<mesh>.rs`; each test hands it to the generic code the way [`ALL`] does
//! for the built-in ones and shows that code honours it. The agent's status probe pod is
//! shown the same way in `agent/src/plugin/probe.rs`.

use std::collections::BTreeMap;

use super::super::*;
use crate::cni::{MemSource, ProbeOutcome, Reason, Runtime, VerifyOptions, verdict};
use crate::profile::{MeshProfile, NodeProxy, PodSelector};
use crate::rules::expect::expectation;
use crate::rules::expected::{Dialect, Expectation, get};

const SKIP_INBOUND: &str = "example.test/skip-inbound";

const EXAMPLE_DIALECT: Dialect = Dialect {
    name: "example",
    annotation_keys: &[SKIP_INBOUND],
    narrow: skip_inbound,
};

fn skip_inbound(annotations: &BTreeMap<String, String>, out: &mut Expectation) {
    if get(annotations, SKIP_INBOUND) == Some("true") {
        out.inbound.drop_all(format!("{SKIP_INBOUND}=true"));
    }
}

fn example() -> MeshProfile {
    MeshProfile {
        name: "example".into(),
        selector: PodSelector {
            labels: map(&[("example.test/mesh", "")]),
            ..PodSelector::default()
        },
        plugin_type: "example-cni".into(),
        inbound_port: 4143,
        outbound_port: 4140,
        dual_stack: false,
        annotation_dialect: AnnotationDialect::of(&EXAMPLE_DIALECT),
        proxy_containers: vec!["example-proxy".into()],
        node_proxy: Some(NodeProxy {
            name: "example-node-proxy".into(),
            namespace: "example-system".into(),
            labels: map(&[("app", "example-node-proxy")]),
            socket: "/var/run/example/proxy.sock".into(),
            listen_ports: vec![4143],
        }),
    }
}

const EXAMPLE: Mesh = Mesh {
    profile: example,
    dialect: &EXAMPLE_DIALECT,
};

/// The built-in meshes and the new one, as [`ALL`] would list them with its entry added.
fn all_with_example() -> [Mesh; 4] {
    [linkerd::MESH, istio::MESH, istio_ambient::MESH, EXAMPLE]
}

#[test]
fn its_profile_is_named_and_selects_its_pods() {
    let set = ProfileSet::of(&all_with_example());
    let only = set.clone().select(&["example".into()]).unwrap();
    assert_eq!(
        only.iter().map(|p| &p.name).collect::<Vec<_>>(),
        ["example"]
    );
    let (labels, none) = (map(&[("example.test/mesh", "default")]), BTreeMap::new());
    let selected: Vec<_> = set.selecting(&labels, &none).collect();
    assert_eq!(selected.len(), 1);
    assert_eq!(selected[0].name, "example");
    assert!(!selected[0].proxy_present(["app"]));
    assert!(selected[0].proxy_present(["app", "example-proxy"]));
}

#[test]
fn its_dialect_is_found_by_name_and_narrows_the_expected_rules() {
    assert_eq!(
        dialect_named("example", &all_with_example()).map(AnnotationDialect::name),
        Some("example")
    );
    assert!(dialect_named("example", &ALL).is_none());
    let skip = map(&[(SKIP_INBOUND, "true")]);
    let want = expectation(&example(), &[], &skip);
    assert!(!want.inbound.is_expected());
    assert!(want.outbound.is_expected());
    assert_eq!(want.outbound.port, 4140);
}

#[test]
fn its_node_proxy_is_required_when_it_is_named() {
    let set = ProfileSet::of(&all_with_example());
    let named = crate::node_proxy::required(&set, &["example".into()]).unwrap();
    assert_eq!(named.map(|p| p.name.as_str()), Some("example"));
    assert_eq!(crate::node_proxy::required(&set, &[]).unwrap(), None);
}

/// A chain `[example-cni, istio-cni]` with `istio-cni` required: knowing the new mesh, its
/// plugin is interface-less like `linkerd-cni`, so nothing creates the pod's interface.
#[test]
fn the_chain_verdict_treats_its_plugin_as_interface_less() {
    let conflist = br#"{"cniVersion":"1.0.0","name":"k8s","plugins":[{"type":"example-cni"},{"type":"istio-cni"}]}"#;
    let opts = VerifyOptions {
        conf_dir: "/etc/cni/net.d".into(),
        runtime: Runtime::Containerd,
        required: vec!["istio-cni".into()],
        multus: Default::default(),
    };
    let verify = |meshes: &[Mesh]| {
        let mut src = MemSource::new().file("10-k8s.conflist", conflist.to_vec());
        verdict::verify_knowing(&mut src, &opts, meshes, |t| ProbeOutcome::Answered {
            path: format!("/opt/cni/bin/{t}"),
            supported: vec!["1.0.0".into()],
        })
    };
    let known = verify(&all_with_example());
    assert_eq!(
        known.reason,
        Reason::PrimaryPluginMissing,
        "{}",
        known.message
    );
    assert!(
        known
            .message
            .contains("only interface-less plugins (#1 to #1)")
    );
    // Unknown, it would be taken for the primary plugin.
    assert_eq!(verify(&ALL).reason, Reason::Verified);
}

#[test]
fn the_builtins_plugins_are_the_meshes_plugins() {
    assert_eq!(plugin_types(&ALL), ["linkerd-cni", "istio-cni"]);
    assert_eq!(
        plugin_types(&all_with_example()),
        ["linkerd-cni", "istio-cni", "example-cni"]
    );
}

/// The status probe's pod must be reviewed as every mesh's: its labels come from the
/// selectors, and every profile selects them.
#[test]
fn its_selector_labels_are_in_the_probe_pods_labels() {
    let set = ProfileSet::of(&all_with_example());
    let labels = set.labels_selecting_each("probe");
    assert_eq!(
        labels.get("example.test/mesh").map(String::as_str),
        Some("probe")
    );
    for p in set.iter() {
        assert!(p.selector.matches(&labels, &BTreeMap::new()), "{}", p.name);
    }
}
