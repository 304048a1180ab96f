//! Mesh profiles: which pods a mesh owns, which chained CNI plugin it needs, which proxy
//! container it injects, which redirect ports its CNI plugin writes into the pod's network
//! namespace, and the node proxy it needs, if any ([`node_proxy`]).
//!
//! In: a pod's labels and annotations (plain maps), its Namespace's labels when the caller
//! knows them ([`PodView`]), its container names, or a profile file's text. Out: the
//! profiles that select the pod, each with a three-valued [`Selected`] (a selector that reads
//! namespace labels the caller does not have answers `Unknown`, never a guess), whether
//! the pod runs the mesh's proxy container ([`MeshProfile::proxy_present`]), and labels that
//! every profile selects ([`ProfileSet::labels_selecting_each`], the status probe's). Built-in
//! profiles follow the contract table, except `istio-ambient`, which selects as Istio itself
//! enrolls pods (see [`crate::meshes`] and docs/architecture.md "Contract drift"); operators add
//! their own from a JSON file parsed by [`ProfileSet::with_custom_json`].

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::rules::expected::AnnotationDialect;

pub mod node_proxy;

pub use node_proxy::NodeProxy;

/// How a profile recognises its pods.
///
/// Every listed requirement must hold (logical AND): the pod's `labels` and `annotations`,
/// its namespace's `namespaceLabels`; none of `excludeLabels` / `excludeAnnotations` may be
/// on the pod; and when `anyOf` is given, at least one of its selectors must match too. A
/// value of `""` means "present, any value". This is enough to say what Istio's ambient
/// enablement selectors say (a pod label, or a namespace label unless the pod opts out).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PodSelector {
    /// Label key → required value; an empty value means "present, any value".
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Annotation key → required value; an empty value means "present, any value".
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
    /// Label key → required value on the pod's Namespace.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub namespace_labels: BTreeMap<String, String>,
    /// Pod labels that exclude it: key → value (`""`: the key with any value).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub exclude_labels: BTreeMap<String, String>,
    /// Pod annotations that exclude it: key → value (`""`: the key with any value).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub exclude_annotations: BTreeMap<String, String>,
    /// Alternatives: when not empty, at least one of them must match as well.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub any_of: Vec<PodSelector>,
}

/// What a selector is matched against: the pod's metadata and, when the caller has them,
/// its Namespace's labels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PodView<'a> {
    /// `metadata.labels`.
    pub labels: &'a BTreeMap<String, String>,
    /// `metadata.annotations`.
    pub annotations: &'a BTreeMap<String, String>,
    /// The labels of the pod's Namespace; `None` when the caller does not know them (not
    /// cached yet).
    pub namespace_labels: Option<&'a BTreeMap<String, String>>,
}

/// Whether a selector selects a pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Selected {
    /// It does not.
    No,
    /// It depends on namespace labels the caller did not have.
    Unknown,
    /// It does.
    Yes,
}

impl Selected {
    /// Three-valued AND.
    fn and(self, other: Selected) -> Selected {
        self.min(other)
    }
    /// Three-valued OR.
    fn or(self, other: Selected) -> Selected {
        self.max(other)
    }
    fn from_bool(b: bool) -> Selected {
        if b { Selected::Yes } else { Selected::No }
    }
}

/// True when every `want` entry is in `have` (an empty wanted value: any value).
fn all_present(want: &BTreeMap<String, String>, have: &BTreeMap<String, String>) -> bool {
    want.iter().all(|(k, v)| match have.get(k) {
        Some(actual) => v.is_empty() || actual == v,
        None => false,
    })
}

/// True when some `unwanted` entry is in `have`.
fn any_present(unwanted: &BTreeMap<String, String>, have: &BTreeMap<String, String>) -> bool {
    unwanted.iter().any(|(k, v)| match have.get(k) {
        Some(actual) => v.is_empty() || actual == v,
        None => false,
    })
}

impl PodSelector {
    /// True when the selector requires something (a label, annotation or namespace label,
    /// here or in an alternative). A selector without requirements selects nothing: a
    /// profile that selected every pod would be a configuration mistake, and failing
    /// closed there would gate every pod in the cluster.
    pub fn has_requirement(&self) -> bool {
        !self.labels.is_empty()
            || !self.annotations.is_empty()
            || !self.namespace_labels.is_empty()
            || self.any_of.iter().any(PodSelector::has_requirement)
    }

    /// True when matching reads the pod's namespace labels.
    pub fn uses_namespace_labels(&self) -> bool {
        !self.namespace_labels.is_empty()
            || self.any_of.iter().any(PodSelector::uses_namespace_labels)
    }

    fn namespace_label_keys(&self, into: &mut BTreeSet<String>) {
        into.extend(self.namespace_labels.keys().cloned());
        for s in &self.any_of {
            s.namespace_label_keys(into);
        }
    }

    /// Matches one pod. `Unknown` only when the answer hangs on namespace labels the view
    /// does not carry.
    pub fn select(&self, pod: &PodView<'_>) -> Selected {
        if !self.has_requirement() {
            return Selected::No;
        }
        let mut got = Selected::from_bool(
            all_present(&self.labels, pod.labels)
                && all_present(&self.annotations, pod.annotations)
                && !any_present(&self.exclude_labels, pod.labels)
                && !any_present(&self.exclude_annotations, pod.annotations),
        );
        if !self.namespace_labels.is_empty() {
            got = got.and(match pod.namespace_labels {
                Some(ns) => Selected::from_bool(all_present(&self.namespace_labels, ns)),
                None => Selected::Unknown,
            });
        }
        if !self.any_of.is_empty() {
            let alt = self
                .any_of
                .iter()
                .map(|s| s.select(pod))
                .fold(Selected::No, Selected::or);
            got = got.and(alt);
        }
        got
    }

    /// Labels that make a pod without annotations certainly selected, its namespace's labels
    /// unknown: the required labels (`any` for one whose value may be anything), with those of
    /// the first alternative that is selected so. `None` when labels alone cannot do it (the
    /// selector requires an annotation or namespace labels).
    pub fn labels_that_select(&self, any: &str) -> Option<BTreeMap<String, String>> {
        if !self.annotations.is_empty() || !self.namespace_labels.is_empty() {
            return None;
        }
        let own: BTreeMap<String, String> = self
            .labels
            .iter()
            .map(|(k, v)| (k.clone(), if v.is_empty() { any } else { v }.to_string()))
            .collect();
        let candidates = if self.any_of.is_empty() {
            vec![own]
        } else {
            let with = |alt: BTreeMap<String, String>| own.clone().into_iter().chain(alt).collect();
            self.any_of
                .iter()
                .filter_map(|alt| alt.labels_that_select(any))
                .map(with)
                .collect()
        };
        let none = BTreeMap::new();
        candidates.into_iter().find(|l| self.matches(l, &none))
    }

    /// True when the selector certainly selects a pod with these labels and annotations,
    /// its namespace's labels unknown.
    pub fn matches(
        &self,
        labels: &BTreeMap<String, String>,
        annotations: &BTreeMap<String, String>,
    ) -> bool {
        let pod = PodView {
            labels,
            annotations,
            namespace_labels: None,
        };
        self.select(&pod) == Selected::Yes
    }
}

/// One mesh: how its pods are recognised and what its CNI plugin must do for them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MeshProfile {
    /// Profile name used in flags, metrics labels and messages (`linkerd`, `istio`, ...).
    pub name: String,
    /// Which pods belong to this mesh.
    pub selector: PodSelector,
    /// The chained CNI plugin `type` that writes the redirect rules.
    pub plugin_type: String,
    /// TCP port inbound traffic must be redirected to (from nat PREROUTING).
    pub inbound_port: u16,
    /// TCP port outbound traffic must be redirected to (from nat OUTPUT).
    pub outbound_port: u16,
    /// True when the mesh writes IPv6 rules for dual-stack pods (Istio with
    /// `ISTIO_DUAL_STACK`, Linkerd with `disableIPv6: false`). Off by default, as in both
    /// meshes: a dual-stack pod then needs IPv4 rules only. See [`crate::rules::expect`].
    #[serde(default)]
    pub dual_stack: bool,
    /// Whose pod annotations narrow the expected rules (opt-outs of a direction or family).
    #[serde(default)]
    pub annotation_dialect: AnnotationDialect,
    /// Names of the proxy container the mesh injects (`linkerd-proxy`, `istio-proxy`). A
    /// selected pod running none of them is not the mesh's: its label was copied or its
    /// injection skipped, the mesh's CNI plugin skips it too, and evicting it would only
    /// recreate the same pod. Empty: the mesh runs no sidecar (ambient), nothing to check.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub proxy_containers: Vec<String>,
    /// The node proxy the mesh's CNI plugin hands pods to (Istio ambient's ztunnel), which
    /// must be ready on a node for it to be verified when the profile is named by
    /// `--profile` ([`crate::node_proxy`]). None: the mesh has no node proxy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_proxy: Option<NodeProxy>,
}

impl MeshProfile {
    /// True when the pod runs one of the mesh's proxy containers, or the mesh has none.
    /// `containers` are the names of the pod's containers and of its native sidecars
    /// (init containers with `restartPolicy: Always`); the caller picks those.
    pub fn proxy_present<'a>(&self, containers: impl IntoIterator<Item = &'a str>) -> bool {
        if self.proxy_containers.is_empty() {
            return true;
        }
        containers
            .into_iter()
            .any(|c| self.proxy_containers.iter().any(|p| p == c))
    }
}

/// Errors from building a profile set.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProfileError {
    /// `--profile NAME` named no built-in or configured profile.
    #[error("unknown mesh profile {0:?} (known: {1})")]
    Unknown(String, String),
    /// The profile file is not valid JSON of the expected shape.
    #[error("invalid profile file: {0}")]
    Parse(String),
    /// A profile in the file is unusable (empty selector, empty plugin, port 0, duplicate,
    /// a proxy container name that is no container name).
    #[error("invalid profile {name:?}: {why}")]
    Invalid { name: String, why: String },
}

/// A DNS-1123 label, as the API accepts a container or namespace name.
pub(crate) fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// The profiles one component acts on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProfileSet {
    profiles: Vec<MeshProfile>,
}

impl ProfileSet {
    /// A set of exactly these profiles (the built-in ones: [`crate::meshes`]).
    pub(crate) fn new(profiles: Vec<MeshProfile>) -> Self {
        Self { profiles }
    }

    /// Parses a profile file: a JSON array of [`MeshProfile`] objects. Custom profiles are
    /// added to the built-in ones; a custom profile may not reuse a built-in name, so a
    /// typo cannot silently replace the contract's ports.
    pub fn with_custom_json(mut self, text: &str) -> Result<Self, ProfileError> {
        let custom: Vec<MeshProfile> =
            serde_json::from_str(text).map_err(|e| ProfileError::Parse(e.to_string()))?;
        for p in custom {
            let invalid = |why: &str| ProfileError::Invalid {
                name: p.name.clone(),
                why: why.into(),
            };
            if p.name.is_empty() {
                return Err(invalid("name is empty"));
            }
            if !p.selector.has_requirement() {
                return Err(invalid(
                    "selector selects nothing: give labels, annotations or namespaceLabels",
                ));
            }
            if p.plugin_type.is_empty() || p.plugin_type.contains('/') {
                return Err(invalid("pluginType must be a plain CNI plugin type"));
            }
            if p.inbound_port == 0 || p.outbound_port == 0 {
                return Err(invalid("ports must be 1-65535"));
            }
            if !p.proxy_containers.iter().all(|c| is_dns_label(c)) {
                return Err(invalid(
                    "proxyContainers must be container names (lowercase letters, digits, '-', at most 63)",
                ));
            }
            if let Some(why) = p.node_proxy.as_ref().and_then(|n| n.problem()) {
                return Err(invalid(why));
            }
            if self.profiles.iter().any(|q| q.name == p.name) {
                return Err(invalid("a profile with this name already exists"));
            }
            self.profiles.push(p);
        }
        Ok(self)
    }

    /// Keeps only the named profiles (the `--profile` flag); empty `names` keeps all.
    pub fn select(self, names: &[String]) -> Result<Self, ProfileError> {
        if names.is_empty() {
            return Ok(self);
        }
        let mut kept = Vec::with_capacity(names.len());
        for n in names {
            match self.profiles.iter().find(|p| &p.name == n) {
                Some(p) if !kept.contains(p) => kept.push(p.clone()),
                Some(_) => {}
                None => {
                    let known = self
                        .profiles
                        .iter()
                        .map(|p| p.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ");
                    return Err(ProfileError::Unknown(n.clone(), known));
                }
            }
        }
        Ok(Self { profiles: kept })
    }

    /// Looks a profile up by name.
    pub fn get(&self, name: &str) -> Option<&MeshProfile> {
        self.profiles.iter().find(|p| p.name == name)
    }

    /// All profiles in this set, in order.
    pub fn iter(&self) -> impl Iterator<Item = &MeshProfile> {
        self.profiles.iter()
    }

    /// True when some profile selects on namespace labels: only then does a component need
    /// to know its pods' namespaces.
    pub fn uses_namespace_labels(&self) -> bool {
        self.profiles
            .iter()
            .any(|p| p.selector.uses_namespace_labels())
    }

    /// The namespace label keys the profiles read: all a namespace cache needs to keep.
    pub fn namespace_label_keys(&self) -> BTreeSet<String> {
        let mut keys = BTreeSet::new();
        for p in &self.profiles {
            p.selector.namespace_label_keys(&mut keys);
        }
        keys
    }

    /// One label set that selects a pod for each profile that labels alone can select
    /// ([`PodSelector::labels_that_select`]); where two profiles want one key, the earlier
    /// profile's value is kept.
    pub fn labels_selecting_each(&self, any: &str) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        for p in &self.profiles {
            for (k, v) in p.selector.labels_that_select(any).into_iter().flatten() {
                out.entry(k).or_insert(v);
            }
        }
        out
    }

    /// Every profile that selects the pod or may select it (`Unknown`: it hangs on
    /// namespace labels the view does not carry), in profile order.
    pub fn selection<'a>(
        &'a self,
        pod: PodView<'a>,
    ) -> impl Iterator<Item = (&'a MeshProfile, Selected)> + 'a {
        self.profiles
            .iter()
            .map(move |p| (p, p.selector.select(&pod)))
            .filter(|(_, s)| *s != Selected::No)
    }

    /// The profiles that certainly select a pod with these labels and annotations when its
    /// namespace's labels are not known.
    pub fn selecting<'a>(
        &'a self,
        labels: &'a BTreeMap<String, String>,
        annotations: &'a BTreeMap<String, String>,
    ) -> impl Iterator<Item = &'a MeshProfile> + 'a {
        self.profiles
            .iter()
            .filter(move |p| p.selector.matches(labels, annotations))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn select_by_name_rejects_unknown() {
        let err = ProfileSet::all_builtin()
            .select(&["consul".into()])
            .unwrap_err();
        assert!(matches!(err, ProfileError::Unknown(ref n, _) if n == "consul"));
        let one = ProfileSet::all_builtin().select(&["istio".into()]).unwrap();
        assert_eq!(one.iter().count(), 1);
        assert_eq!(one.get("istio").unwrap().inbound_port, 15006);
    }

    #[test]
    fn custom_profiles_are_validated() {
        let ok = r#"[{"name":"kuma","selector":{"annotations":{"kuma.io/sidecar-injected":"true"}},
                      "pluginType":"kuma-cni","inboundPort":15006,"outboundPort":15001}]"#;
        let set = ProfileSet::all_builtin().with_custom_json(ok).unwrap();
        assert_eq!(set.get("kuma").unwrap().plugin_type, "kuma-cni");
        // No proxyContainers: no proxy check, as before the field existed.
        assert!(set.get("kuma").unwrap().proxy_containers.is_empty());

        let with_proxy = r#"[{"name":"kuma","selector":{"annotations":{"kuma.io/sidecar-injected":"true"}},
                      "pluginType":"kuma-cni","inboundPort":15006,"outboundPort":15001,
                      "proxyContainers":["kuma-sidecar"]}]"#;
        let set = ProfileSet::all_builtin()
            .with_custom_json(with_proxy)
            .unwrap();
        assert!(!set.get("kuma").unwrap().proxy_present(["app"]));
        assert!(set.get("kuma").unwrap().proxy_present(["kuma-sidecar"]));
        let bad_proxy = with_proxy.replace("kuma-sidecar", "Kuma Sidecar");
        assert!(matches!(
            ProfileSet::all_builtin().with_custom_json(&bad_proxy),
            Err(ProfileError::Invalid { .. })
        ));

        // A namespace-only custom selector is a requirement too.
        let ns_only = r#"[{"name":"x","selector":{"namespaceLabels":{"mesh":"on"}},"pluginType":"x","inboundPort":1,"outboundPort":2}]"#;
        let set = ProfileSet::all_builtin().with_custom_json(ns_only).unwrap();
        assert!(set.get("x").unwrap().selector.uses_namespace_labels());

        for selects_nothing in [
            r#"[{"name":"x","selector":{},"pluginType":"x","inboundPort":1,"outboundPort":2}]"#,
            r#"[{"name":"x","selector":{"excludeLabels":{"a":""}},"pluginType":"x","inboundPort":1,"outboundPort":2}]"#,
            r#"[{"name":"x","selector":{"anyOf":[{}]},"pluginType":"x","inboundPort":1,"outboundPort":2}]"#,
        ] {
            assert!(
                matches!(
                    ProfileSet::all_builtin().with_custom_json(selects_nothing),
                    Err(ProfileError::Invalid { .. })
                ),
                "{selects_nothing}"
            );
        }
        let dup = r#"[{"name":"linkerd","selector":{"labels":{"a":""}},"pluginType":"x","inboundPort":1,"outboundPort":2}]"#;
        assert!(matches!(
            ProfileSet::all_builtin().with_custom_json(dup),
            Err(ProfileError::Invalid { .. })
        ));
        assert!(matches!(
            ProfileSet::all_builtin().with_custom_json("{"),
            Err(ProfileError::Parse(_))
        ));
    }
}
