//! Mesh profiles: which pods a mesh owns, which chained CNI plugin it needs, and which
//! redirect ports its CNI plugin writes into the pod's network namespace.
//!
//! In: a pod's labels and annotations (plain maps), or a profile file's text. Out: the
//! profiles that select the pod. Built-in profiles follow the contract table; operators add
//! their own from a JSON or YAML-as-JSON file parsed by [`ProfileSet::from_json`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// How a profile recognises its pods. Every listed key must match (logical AND).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PodSelector {
    /// Label key → required value; an empty value means "present, any value".
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Annotation key → required value; an empty value means "present, any value".
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
}

impl PodSelector {
    /// True when every label and annotation requirement is met. An empty selector matches
    /// nothing: a profile that selected every pod would be a configuration mistake, and
    /// failing closed here would gate every pod in the cluster.
    pub fn matches(
        &self,
        labels: &BTreeMap<String, String>,
        annotations: &BTreeMap<String, String>,
    ) -> bool {
        if self.labels.is_empty() && self.annotations.is_empty() {
            return false;
        }
        fn all(want: &BTreeMap<String, String>, have: &BTreeMap<String, String>) -> bool {
            want.iter().all(|(k, v)| match have.get(k) {
                Some(actual) => v.is_empty() || actual == v,
                None => false,
            })
        }
        all(&self.labels, labels) && all(&self.annotations, annotations)
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
    pub annotation_dialect: crate::rules::AnnotationDialect,
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
    /// A profile in the file is unusable (empty selector, empty plugin, port 0, duplicate).
    #[error("invalid profile {name:?}: {why}")]
    Invalid { name: String, why: String },
}

fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The contract's built-in profiles: `linkerd`, `istio`, `istio-ambient`.
pub fn builtin() -> Vec<MeshProfile> {
    vec![
        MeshProfile {
            name: "linkerd".into(),
            selector: PodSelector {
                labels: map(&[("linkerd.io/control-plane-ns", "")]),
                annotations: BTreeMap::new(),
            },
            plugin_type: "linkerd-cni".into(),
            inbound_port: 4143,
            outbound_port: 4140,
            dual_stack: false,
            annotation_dialect: crate::rules::AnnotationDialect::Linkerd,
        },
        MeshProfile {
            name: "istio".into(),
            selector: PodSelector {
                labels: map(&[("security.istio.io/tlsMode", "istio")]),
                annotations: BTreeMap::new(),
            },
            plugin_type: "istio-cni".into(),
            inbound_port: 15006,
            outbound_port: 15001,
            dual_stack: false,
            annotation_dialect: crate::rules::AnnotationDialect::Istio,
        },
        MeshProfile {
            name: "istio-ambient".into(),
            selector: PodSelector {
                labels: BTreeMap::new(),
                annotations: map(&[("ambient.istio.io/redirection", "enabled")]),
            },
            plugin_type: "istio-cni".into(),
            inbound_port: 15006,
            outbound_port: 15001,
            // Ambient pods carry no sidecar annotations istio-cni would honour.
            dual_stack: false,
            annotation_dialect: crate::rules::AnnotationDialect::None,
        },
    ]
}

/// The profiles one component acts on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProfileSet {
    profiles: Vec<MeshProfile>,
}

impl ProfileSet {
    /// Every built-in profile: the default when no `--profile` is given.
    pub fn all_builtin() -> Self {
        Self {
            profiles: builtin(),
        }
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
            if p.selector.labels.is_empty() && p.selector.annotations.is_empty() {
                return Err(invalid(
                    "selector selects nothing: give labels or annotations",
                ));
            }
            if p.plugin_type.is_empty() || p.plugin_type.contains('/') {
                return Err(invalid("pluginType must be a plain CNI plugin type"));
            }
            if p.inbound_port == 0 || p.outbound_port == 0 {
                return Err(invalid("ports must be 1-65535"));
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

    /// The profiles that select a pod with these labels and annotations.
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
            names(&none, &map(&[("ambient.istio.io/redirection", "enabled")])),
            ["istio-ambient"]
        );
        assert!(names(&map(&[("app", "web")]), &none).is_empty());
    }

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

        let empty_selector =
            r#"[{"name":"x","selector":{},"pluginType":"x","inboundPort":1,"outboundPort":2}]"#;
        assert!(matches!(
            ProfileSet::all_builtin().with_custom_json(empty_selector),
            Err(ProfileError::Invalid { .. })
        ));
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
