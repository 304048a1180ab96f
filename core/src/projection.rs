//! What a cache of pods keeps of each pod's labels and annotations, derived from the mesh
//! profiles themselves.
//!
//! In: a [`ProfileSet`] (its selectors, and for the agent each profile's annotation dialect),
//! then a pod's labels and annotations. Out: [`PodKeys`], and the projected maps: the keys
//! some profile reads and nothing else. A projected pod is selected exactly as the whole pod
//! (and, with [`PodKeys::inspection`], gets the same expected rules), which the property
//! test below checks on arbitrary pods. Everything else (`kubectl apply`'s copy of the whole
//! object, other tools' annotations, labels no profile names) is dropped however large, so
//! what a cache holds per pod is bounded by the profiles, not by what a pod's author wrote.
//!
//! The maps can also be read straight from their JSON text ([`PodKeys::project_labels_json`]),
//! allocating only what is kept: a pod's labels decoded as a map cost several times their
//! size in small allocations, and a pod's author can give it a megabyte of them.
//!
//! Values are bounded too: a label or annotation a selector only compares with a few values
//! keeps its value when it is one of them, and is kept as `""` otherwise, which still says
//! "present" (for "present, any value" and for exclusions) and equals no wanted value. Only
//! the annotations a rules check parses ([`AnnotationDialect::annotation_keys`]) are kept as
//! they are.
//!
//! [`AnnotationDialect::annotation_keys`]: crate::rules::AnnotationDialect::annotation_keys

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::Deserialize;
use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, Visitor};

use crate::profile::{PodSelector, ProfileSet};

/// Labels or annotations whose JSON text is not an object of strings (never from the API).
#[derive(Debug, thiserror::Error)]
#[error("labels or annotations are not a JSON object of strings: {0}")]
pub struct NotAMapOfStrings(String);

/// What a projection keeps of one pod label or annotation.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Keep {
    /// The values some selector compares with; any other value becomes `""`.
    Values(BTreeSet<String>),
    /// The value as it is.
    Verbatim,
}

/// The pod labels and annotations a set of profiles reads.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodKeys {
    labels: BTreeMap<String, Keep>,
    annotations: BTreeMap<String, Keep>,
}

/// Notes that a selector compares `key` with `value` (`""`: present, any value).
fn want(keys: &mut BTreeMap<String, Keep>, key: &str, value: &str) {
    let keep = keys
        .entry(key.to_owned())
        .or_insert_with(|| Keep::Values(BTreeSet::new()));
    if let Keep::Values(values) = keep
        && !value.is_empty()
    {
        values.insert(value.to_owned());
    }
}

/// Adds every pod label and annotation `selector` compares, with the values it compares
/// them with.
fn add_selector(keys: &mut PodKeys, selector: &PodSelector) {
    for (k, v) in selector.labels.iter().chain(&selector.exclude_labels) {
        want(&mut keys.labels, k, v);
    }
    for (k, v) in selector
        .annotations
        .iter()
        .chain(&selector.exclude_annotations)
    {
        want(&mut keys.annotations, k, v);
    }
    for s in &selector.any_of {
        add_selector(keys, s);
    }
}

/// The part of `map` that `keys` keeps. Each kept key is looked up, so a pod with thousands
/// of labels costs a lookup per kept key, not a copy of the map.
fn project(
    keys: &BTreeMap<String, Keep>,
    map: &BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    keys.iter()
        .filter_map(|(k, keep)| Some((k.clone(), kept(keep, map.get(k)?))))
        .collect()
}

/// What `keep` keeps of the value `v`.
fn kept(keep: &Keep, v: &str) -> String {
    match keep {
        Keep::Verbatim => v.to_owned(),
        Keep::Values(values) if values.contains(v) => v.to_owned(),
        Keep::Values(_) => String::new(),
    }
}

/// A string read from JSON text: borrowed unless it holds escapes.
struct Text<'de>(Cow<'de, str>);

impl<'de> Deserialize<'de> for Text<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct TextVisitor;
        impl<'de> Visitor<'de> for TextVisitor {
            type Value = Text<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(v.to_owned())))
            }
        }
        d.deserialize_str(TextVisitor)
    }
}

/// Reads a JSON object of strings, keeping what `0` keeps; every other entry is skipped
/// without being allocated.
struct Projector<'k>(&'k BTreeMap<String, Keep>);

impl<'de> DeserializeSeed<'de> for Projector<'_> {
    type Value = BTreeMap<String, String>;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Projector<'_> {
    type Value = BTreeMap<String, String>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a map of strings")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out = BTreeMap::new();
        while let Some(Text(k)) = map.next_key()? {
            match self.0.get_key_value(k.as_ref()) {
                Some((key, keep)) => {
                    let Text(v) = map.next_value()?;
                    out.insert(key.clone(), kept(keep, &v));
                }
                None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(out)
    }
}

/// [`project`] of the map whose JSON text is `json`.
fn project_json(
    keys: &BTreeMap<String, Keep>,
    json: &str,
) -> Result<BTreeMap<String, String>, NotAMapOfStrings> {
    let mut de = serde_json::Deserializer::from_str(json);
    Projector(keys)
        .deserialize(&mut de)
        .and_then(|m| de.end().map(|()| m))
        .map_err(|e| NotAMapOfStrings(e.to_string()))
}

impl PodKeys {
    /// What the profiles' selectors read: all a cache needs to select its pods (the
    /// webhook's unscheduled pods).
    pub fn selection(profiles: &ProfileSet) -> Self {
        let mut keys = Self::default();
        for p in profiles.iter() {
            add_selector(&mut keys, &p.selector);
        }
        keys
    }

    /// [`Self::selection`] plus the annotations each profile's annotation dialect reads,
    /// kept as they are: all a cache needs to select its pods and derive the rules their
    /// mesh writes (the agent's pods).
    pub fn inspection(profiles: &ProfileSet) -> Self {
        let mut keys = Self::selection(profiles);
        for p in profiles.iter() {
            for k in p.annotation_dialect.annotation_keys() {
                keys.annotations.insert((*k).to_owned(), Keep::Verbatim);
            }
        }
        keys
    }

    /// The labels of `labels` the profiles read.
    pub fn project_labels(&self, labels: &BTreeMap<String, String>) -> BTreeMap<String, String> {
        project(&self.labels, labels)
    }

    /// The annotations of `annotations` the profiles read.
    pub fn project_annotations(
        &self,
        annotations: &BTreeMap<String, String>,
    ) -> BTreeMap<String, String> {
        project(&self.annotations, annotations)
    }

    /// [`Self::project_labels`] of the labels whose JSON text (`{"key": "value", ...}`) is
    /// `json`, reading it without building the whole map.
    pub fn project_labels_json(
        &self,
        json: &str,
    ) -> Result<BTreeMap<String, String>, NotAMapOfStrings> {
        project_json(&self.labels, json)
    }

    /// [`Self::project_annotations`] of the annotations whose JSON text is `json`.
    pub fn project_annotations_json(
        &self,
        json: &str,
    ) -> Result<BTreeMap<String, String>, NotAMapOfStrings> {
        project_json(&self.annotations, json)
    }

    /// The label keys kept (logs, tests).
    pub fn label_keys(&self) -> impl Iterator<Item = &str> {
        self.labels.keys().map(String::as_str)
    }

    /// The annotation keys kept (logs, tests).
    pub fn annotation_keys(&self) -> impl Iterator<Item = &str> {
        self.annotations.keys().map(String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meshes::{ISTIO_DATAPLANE_MODE, ISTIO_SIDECAR_STATUS};
    use crate::profile::PodView;
    use crate::rules::{IpFamily, expectation};
    use proptest::prelude::*;

    const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";
    const KUMA: &str = r#"[{"name":"kuma","selector":{"annotations":{"kuma.io/sidecar-injected":"true"},
        "excludeLabels":{"app":"batch"}},"pluginType":"kuma-cni","inboundPort":15006,"outboundPort":15001}]"#;

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn profiles() -> ProfileSet {
        ProfileSet::all_builtin().with_custom_json(KUMA).unwrap()
    }

    /// The keys are the selectors' own, built-in or from a profile file; the bulk of a pod
    /// (kubectl's copy of the object, long values no selector compares) is dropped.
    #[test]
    fn the_keys_come_from_the_profiles_and_the_bulk_is_dropped() {
        let keys = PodKeys::selection(&profiles());
        assert_eq!(
            keys.label_keys().collect::<Vec<_>>(),
            [
                "app",
                ISTIO_DATAPLANE_MODE,
                "linkerd.io/control-plane-ns",
                "security.istio.io/tlsMode"
            ]
        );
        assert_eq!(
            keys.annotation_keys().collect::<Vec<_>>(),
            ["kuma.io/sidecar-injected", ISTIO_SIDECAR_STATUS]
        );
        let builtin = PodKeys::selection(&ProfileSet::all_builtin());
        assert!(!builtin.label_keys().any(|k| k == "app"));

        let (labels, annotations) = bulky_pod();
        assert_eq!(
            keys.project_labels(&labels),
            map(&[
                // Compared with "batch" only.
                ("app", ""),
                (ISTIO_DATAPLANE_MODE, "ambient"),
                // "present, any value".
                ("linkerd.io/control-plane-ns", ""),
                ("security.istio.io/tlsMode", ""),
            ])
        );
        assert_eq!(
            keys.project_annotations(&annotations),
            map(&[
                ("kuma.io/sidecar-injected", "true"),
                (ISTIO_SIDECAR_STATUS, ""),
            ])
        );
        the_inspection_keeps_the_rules_annotations(&annotations);
        the_json_text_projects_the_same(&keys, &labels);
    }

    /// A pod's labels and annotations, with kubectl's copy of the object and a long status
    /// among them.
    fn bulky_pod() -> (BTreeMap<String, String>, BTreeMap<String, String>) {
        let fat = "x".repeat(256 * 1024);
        let labels = map(&[
            ("app", "web"),
            ("linkerd.io/control-plane-ns", "linkerd"),
            (ISTIO_DATAPLANE_MODE, "ambient"),
            ("security.istio.io/tlsMode", "disabled"),
            ("team", "payments"),
        ]);
        let annotations = map(&[
            (LAST_APPLIED, &fat),
            (ISTIO_SIDECAR_STATUS, &fat),
            ("kuma.io/sidecar-injected", "true"),
            (
                "traffic.sidecar.istio.io/excludeOutboundIPRanges",
                "0.0.0.0/0",
            ),
        ]);
        (labels, annotations)
    }

    /// The agent also keeps the annotations the Istio and Linkerd rules read, as they are.
    fn the_inspection_keeps_the_rules_annotations(annotations: &BTreeMap<String, String>) {
        let inspection = PodKeys::inspection(&profiles());
        assert_eq!(
            inspection
                .project_annotations(annotations)
                .get("traffic.sidecar.istio.io/excludeOutboundIPRanges")
                .map(String::as_str),
            Some("0.0.0.0/0")
        );
        assert!(
            inspection
                .annotation_keys()
                .any(|k| k == "config.linkerd.io/skip-subnets")
        );
        assert!(!inspection.annotation_keys().any(|k| k == LAST_APPLIED));
    }

    /// The same from the JSON text; escapes in keys and values are read as JSON says.
    fn the_json_text_projects_the_same(keys: &PodKeys, labels: &BTreeMap<String, String>) {
        let text = serde_json::to_string(labels).unwrap();
        assert_eq!(
            keys.project_labels_json(&text).unwrap(),
            keys.project_labels(labels)
        );
        let escaped = r#"{"linkerd.io\/control-plane-ns": "a\"b", "kuma.io/sidecar-injected": "x", "app": "batch"}"#;
        assert_eq!(
            keys.project_labels_json(escaped).unwrap(),
            map(&[("app", "batch"), ("linkerd.io/control-plane-ns", "")])
        );
        assert_eq!(
            keys.project_annotations_json(r#"{"kuma.io/sidecar-injected": "tr\u0075e"}"#)
                .unwrap(),
            map(&[("kuma.io/sidecar-injected", "true")])
        );
        assert!(keys.project_labels_json("{}").unwrap().is_empty());
        for bad in ["", "[]", "null", r#"{"app": 1}"#, r#"{"app": "x"} {}"#, "{"] {
            assert!(keys.project_labels_json(bad).is_err(), "{bad}");
        }
    }

    fn arb_map(keys: Vec<&'static str>) -> impl Strategy<Value = BTreeMap<String, String>> {
        let values = prop_oneof![
            prop::sample::select(vec![
                "",
                "linkerd",
                "istio",
                "disabled",
                "ambient",
                "none",
                "true",
                "batch",
                "NONE",
                "TPROXY",
                "0.0.0.0/0",
                "::/0",
                "10.0.0.0/8,fd00::/8",
                "*",
                "1-65535",
                "80,443",
            ])
            .prop_map(str::to_owned),
            ".{0,8}",
        ];
        proptest::collection::btree_map(
            prop::sample::select(keys).prop_map(str::to_owned),
            values,
            0..8,
        )
    }

    /// Every key any profile reads, and some no profile reads.
    fn vocabulary() -> Vec<&'static str> {
        vec![
            "app",
            "team",
            "quote\"and\\backslash/é",
            LAST_APPLIED,
            ISTIO_DATAPLANE_MODE,
            ISTIO_SIDECAR_STATUS,
            "linkerd.io/control-plane-ns",
            "security.istio.io/tlsMode",
            "kuma.io/sidecar-injected",
            "ambient.istio.io/redirection",
            "sidecar.istio.io/interceptionMode",
            "traffic.sidecar.istio.io/includeInboundPorts",
            "traffic.sidecar.istio.io/includeOutboundIPRanges",
            "traffic.sidecar.istio.io/includeOutboundPorts",
            "traffic.sidecar.istio.io/excludeOutboundIPRanges",
            "config.linkerd.io/skip-inbound-ports",
            "config.linkerd.io/skip-outbound-ports",
            "config.linkerd.io/skip-subnets",
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, .. ProptestConfig::default() })]

        /// A projected pod is selected by every profile exactly as the whole pod, whatever
        /// its namespace's labels; and with the inspection keys every profile expects the
        /// same rules of it.
        #[test]
        fn a_projected_pod_is_decided_as_the_whole_pod(
            labels in arb_map(vocabulary()),
            annotations in arb_map(vocabulary()),
            namespace in proptest::option::of(arb_map(vec![ISTIO_DATAPLANE_MODE, "team"])),
            families in prop::sample::select(vec![
                vec![], vec![IpFamily::V4], vec![IpFamily::V6], vec![IpFamily::V4, IpFamily::V6],
            ]),
        ) {
            let set = profiles();
            for keys in [PodKeys::selection(&set), PodKeys::inspection(&set)] {
                let (l, a) = (keys.project_labels(&labels), keys.project_annotations(&annotations));
                let whole = PodView { labels: &labels, annotations: &annotations, namespace_labels: namespace.as_ref() };
                let projected = PodView { labels: &l, annotations: &a, namespace_labels: namespace.as_ref() };
                for p in set.iter() {
                    prop_assert_eq!(p.selector.select(&whole), p.selector.select(&projected), "profile {}", p.name);
                }
            }
            for keys in [PodKeys::selection(&set), PodKeys::inspection(&set)] {
                let (l, a) = (serde_json::to_string(&labels).unwrap(), serde_json::to_string(&annotations).unwrap());
                prop_assert_eq!(keys.project_labels_json(&l).unwrap(), keys.project_labels(&labels));
                prop_assert_eq!(keys.project_annotations_json(&a).unwrap(), keys.project_annotations(&annotations));
            }
            let keys = PodKeys::inspection(&set);
            let a = keys.project_annotations(&annotations);
            for p in set.iter() {
                prop_assert_eq!(
                    expectation(p, &families, &annotations),
                    expectation(p, &families, &a),
                    "profile {}", p.name
                );
            }
        }
    }
}
