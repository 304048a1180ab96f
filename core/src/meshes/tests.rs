//! Tests of the built-in profiles: what they select, and that they round-trip through the
//! profile file format.

use std::collections::BTreeMap;

use super::*;
use crate::profile::{MeshProfile, PodView, Selected};

fn view<'a>(
    labels: &'a BTreeMap<String, String>,
    annotations: &'a BTreeMap<String, String>,
    ns: Option<&'a BTreeMap<String, String>>,
) -> PodView<'a> {
    PodView {
        labels,
        annotations,
        namespace_labels: ns,
    }
}

#[test]
fn builtin_profiles_select_their_pods_only() {
    let set = ProfileSet::all_builtin();
    let none = BTreeMap::new();
    let linkerd = map(&[("linkerd.io/control-plane-ns", "linkerd")]);
    let names = |l: &BTreeMap<String, String>, a: &BTreeMap<String, String>| {
        set.selecting(l, a)
            .map(|p| p.name.clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(names(&linkerd, &none), ["linkerd"]);
    assert_eq!(
        names(&map(&[("security.istio.io/tlsMode", "istio")]), &none),
        ["istio"]
    );
    assert!(names(&map(&[("security.istio.io/tlsMode", "disabled")]), &none).is_empty());
    assert_eq!(
        names(&map(&[(ISTIO_DATAPLANE_MODE, "ambient")]), &none),
        ["istio-ambient"]
    );
    assert!(names(&map(&[("app", "web")]), &none).is_empty());
}

/// Istio's default enablement selectors, case by case, with the label and annotation
/// values Istio's own code and installer write.
#[test]
fn ambient_selects_as_istio_enrolls() {
    let set = ProfileSet::all_builtin();
    let ambient = set.get("istio-ambient").unwrap();
    let none = BTreeMap::new();
    let ns_ambient = map(&[(ISTIO_DATAPLANE_MODE, "ambient"), ("name", "shop")]);
    let ns_plain = map(&[("kubernetes.io/metadata.name", "shop")]);
    let pod_ambient = map(&[(ISTIO_DATAPLANE_MODE, "ambient"), ("app", "web")]);
    let pod_none = map(&[(ISTIO_DATAPLANE_MODE, "none"), ("app", "web")]);
    let pod_plain = map(&[("app", "web")]);
    let injected = map(&[(
        ISTIO_SIDECAR_STATUS,
        r#"{"initContainers":["istio-init"],"containers":["istio-proxy"],"volumes":["istio-envoy"],"imagePullSecrets":null,"revision":"default"}"#,
    )]);
    let sel = |l, a, ns| ambient.selector.select(&view(l, a, ns));

    // The pod's own label enrolls it, whatever its namespace (known or not).
    assert_eq!(sel(&pod_ambient, &none, Some(&ns_plain)), Selected::Yes);
    assert_eq!(sel(&pod_ambient, &none, None), Selected::Yes);
    // A labelled namespace enrolls its pods ...
    assert_eq!(sel(&pod_plain, &none, Some(&ns_ambient)), Selected::Yes);
    // ... except those opting out with dataplane-mode=none.
    assert_eq!(sel(&pod_none, &none, Some(&ns_ambient)), Selected::No);
    assert_eq!(sel(&pod_none, &none, None), Selected::No);
    // Neither: not ambient.
    assert_eq!(sel(&pod_plain, &none, Some(&ns_plain)), Selected::No);
    // A pod with a sidecar is never ambient, even labelled.
    assert_eq!(
        sel(&pod_ambient, &injected, Some(&ns_ambient)),
        Selected::No
    );
    assert_eq!(sel(&pod_plain, &injected, Some(&ns_ambient)), Selected::No);
    // Without the namespace's labels the answer is not guessed.
    assert_eq!(sel(&pod_plain, &none, None), Selected::Unknown);
    // The annotation istio-cni writes after success no longer selects by itself.
    let redirected = map(&[("ambient.istio.io/redirection", "enabled")]);
    assert_eq!(sel(&pod_plain, &redirected, Some(&ns_plain)), Selected::No);

    assert!(set.uses_namespace_labels());
    assert_eq!(
        set.namespace_label_keys().into_iter().collect::<Vec<_>>(),
        [ISTIO_DATAPLANE_MODE]
    );
    let sidecar_only = ProfileSet::all_builtin()
        .select(&["linkerd".into(), "istio".into()])
        .unwrap();
    assert!(!sidecar_only.uses_namespace_labels());
    let v = view(&pod_plain, &none, None);
    let got: Vec<_> = set
        .selection(v)
        .map(|(p, s)| (p.name.as_str(), s))
        .collect();
    assert_eq!(got, [("istio-ambient", Selected::Unknown)]);
}

#[test]
fn proxy_containers_of_the_builtins() {
    let set = ProfileSet::all_builtin();
    let linkerd = set.get("linkerd").unwrap();
    assert!(linkerd.proxy_present(["app", "linkerd-proxy"]));
    assert!(!linkerd.proxy_present(["app"]));
    assert!(!linkerd.proxy_present(["app", "istio-proxy"]));
    assert!(set.get("istio").unwrap().proxy_present(["istio-proxy"]));
    assert!(!set.get("istio").unwrap().proxy_present(["app"]));
    // Ambient has no sidecar: every pod passes.
    assert!(set.get("istio-ambient").unwrap().proxy_present(["app"]));
}

#[test]
fn builtins_round_trip_through_the_file_format() {
    // What docs/operations.md tells operators to copy: the built-ins as JSON parse back
    // into the same profiles.
    for p in builtin() {
        let text = serde_json::to_string(&p).unwrap();
        let back: MeshProfile = serde_json::from_str(&text).unwrap();
        assert_eq!(back, p, "{text}");
    }
}

#[test]
fn a_profile_file_names_a_dialect_the_meshes_know() {
    let with = |dialect: &str| {
        format!(
            r#"[{{"name":"x","selector":{{"labels":{{"a":""}}}},"pluginType":"x","inboundPort":1,"outboundPort":2,"annotationDialect":"{dialect}"}}]"#
        )
    };
    for (name, keys) in [
        ("none", 0),
        ("istio", 5),
        ("linkerd", 3),
        ("istio-ambient", 1),
    ] {
        let set = ProfileSet::all_builtin()
            .with_custom_json(&with(name))
            .unwrap();
        let d = set.get("x").unwrap().annotation_dialect;
        assert_eq!((d.name(), d.annotation_keys().len()), (name, keys));
    }
    let err = ProfileSet::all_builtin()
        .with_custom_json(&with("kuma"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(
            "unknown variant `kuma`, expected one of `none`, `linkerd`, `istio`, `istio-ambient` at line 1"
        ),
        "{err}"
    );
}

mod new_mesh;
