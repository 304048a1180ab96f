use super::*;
use crate::profile::PodSelector;

fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn strings_are_quoted_for_cel() {
    assert_eq!(quote("a.io/b"), "'a.io/b'");
    assert_eq!(quote(r"it's \ ok"), r"'it\'s \\ ok'");
    assert_eq!(quote("x\ny\u{1}"), "'x\\ny\\u0001'");
}

#[test]
fn a_selector_without_requirements_selects_nothing() {
    assert_eq!(selector(&PodSelector::default(), Namespace::Read), "false");
    let exclude_only = PodSelector {
        exclude_labels: map(&[("a", "")]),
        ..PodSelector::default()
    };
    assert_eq!(selector(&exclude_only, Namespace::Read), "false");
}

#[test]
fn each_requirement_becomes_one_guarded_term() {
    let sel = PodSelector {
        labels: map(&[("k", "")]),
        annotations: map(&[("a", "v")]),
        exclude_labels: map(&[("x", "none")]),
        namespace_labels: map(&[("n", "on")]),
        ..PodSelector::default()
    };
    assert_eq!(
        selector(&sel, Namespace::Read),
        "(has(object.metadata.labels) && 'k' in object.metadata.labels) \
         && (has(object.metadata.annotations) && 'a' in object.metadata.annotations \
         && object.metadata.annotations['a'] == 'v') \
         && !(has(object.metadata.labels) && 'x' in object.metadata.labels \
         && object.metadata.labels['x'] == 'none') \
         && (has(namespaceObject.metadata.labels) && 'n' in namespaceObject.metadata.labels \
         && namespaceObject.metadata.labels['n'] == 'on')"
    );
    let assumed = selector(&sel, Namespace::Assumed);
    assert!(!assumed.contains("namespaceObject"), "{assumed}");
    assert!(
        assumed.starts_with("(has(object.metadata.labels) && 'k' in"),
        "{assumed}"
    );
    let only_namespace = PodSelector {
        namespace_labels: map(&[("n", "on")]),
        ..PodSelector::default()
    };
    assert_eq!(selector(&only_namespace, Namespace::Assumed), "true");
}

#[test]
fn alternatives_are_one_disjunction() {
    let sel = PodSelector {
        exclude_annotations: map(&[("s", "")]),
        any_of: vec![
            PodSelector {
                labels: map(&[("m", "a")]),
                ..PodSelector::default()
            },
            PodSelector::default(),
        ],
        ..PodSelector::default()
    };
    assert_eq!(
        selector(&sel, Namespace::Read),
        "!(has(object.metadata.annotations) && 's' in object.metadata.annotations) \
         && (((has(object.metadata.labels) && 'm' in object.metadata.labels \
         && object.metadata.labels['m'] == 'a')) || (false))"
    );
}

/// The plugins variable names each plugin once, in order, whichever profiles select.
#[test]
fn plugins_are_grouped_and_sorted() {
    let cel = PlacementCel::of(&ProfileSet::all_builtin());
    let istio = cel.plugins.find("'istio-cni'").expect("istio-cni");
    let linkerd = cel.plugins.find("'linkerd-cni'").expect("linkerd-cni");
    assert!(istio < linkerd, "{}", cel.plugins);
    assert_eq!(cel.plugins.matches("'istio-cni'").count(), 1);
    assert_eq!(cel.meshes.matches(" ? '").count(), 3, "{}", cel.meshes);
    assert_eq!(
        PlacementCel::of(&ProfileSet::new(Vec::new())).selected,
        "false"
    );
}
