//! The built-in meshes, one file each: a mesh's profile (which pods it owns, its CNI plugin,
//! its proxy ports and containers, its node proxy) and its annotation dialect (which pod
//! annotations narrow the redirect rules it writes, and how).
//!
//! In: nothing. Out: [`builtin`] profiles, [`ProfileSet::all_builtin`] (and
//! [`ProfileSet::of`] any list of records), the meshes' CNI plugin types ([`plugin_types`]:
//! the chain verdict counts them as interface-less), and the lookup of an
//! [`AnnotationDialect`] by name when a profile file is read. The generic code
//! ([`crate::profile`], [`crate::rules::expect`], [`crate::cni::verdict`], the agent's status
//! probe) reads only the records, so a new mesh is one file here and one line in [`ALL`].

pub mod istio;
pub mod istio_ambient;
pub mod linkerd;

use std::collections::BTreeMap;

use crate::profile::{MeshProfile, ProfileSet};
use crate::rules::expected::{AnnotationDialect, Dialect, NO_DIALECT};

pub use istio_ambient::{ISTIO_DATAPLANE_MODE, ISTIO_SIDECAR_STATUS};

/// One built-in mesh.
pub struct Mesh {
    /// Its profile, as `--profile NAME` selects it and the profile file format writes it.
    pub profile: fn() -> MeshProfile,
    /// Its annotation dialect, also what `"annotationDialect"` in a profile file names.
    pub dialect: &'static Dialect,
}

/// Every built-in mesh, in profile order.
pub const ALL: [Mesh; 3] = [linkerd::MESH, istio::MESH, istio_ambient::MESH];

/// The built-in profiles: `linkerd`, `istio`, `istio-ambient`.
pub fn builtin() -> Vec<MeshProfile> {
    profiles(&ALL)
}

/// The profiles of `meshes`, in their order.
fn profiles(meshes: &[Mesh]) -> Vec<MeshProfile> {
    meshes.iter().map(|m| (m.profile)()).collect()
}

/// The chained CNI plugin types of `meshes` (each profile's `plugin_type`), once each. A
/// mesh's plugin rewrites the traffic of an interface another plugin created, so the chain
/// verdict never takes one for the primary plugin.
pub fn plugin_types(meshes: &[Mesh]) -> Vec<String> {
    let mut types: Vec<String> = Vec::new();
    for p in profiles(meshes) {
        if !types.contains(&p.plugin_type) {
            types.push(p.plugin_type);
        }
    }
    types
}

/// The built-in profile named `name` (`linkerd`, `istio`, `istio-ambient`), if there is one.
pub fn builtin_named(name: &str) -> Option<MeshProfile> {
    builtin().into_iter().find(|p| p.name == name)
}

impl ProfileSet {
    /// Every built-in profile: the default when no `--profile` is given.
    pub fn all_builtin() -> Self {
        ProfileSet::of(&ALL)
    }

    /// The profiles of these mesh records, in their order.
    pub fn of(meshes: &[Mesh]) -> Self {
        ProfileSet::new(profiles(meshes))
    }
}

/// The dialect a profile file names: `none`, or one of `meshes`' (the built-in ones: [`ALL`]).
fn dialect_named(name: &str, meshes: &[Mesh]) -> Option<AnnotationDialect> {
    std::iter::once(&NO_DIALECT)
        .chain(meshes.iter().map(|m| m.dialect))
        .find(|d| d.name == name)
        .map(AnnotationDialect::of)
}

impl<'de> serde::Deserialize<'de> for AnnotationDialect {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        dialect_named(&name, &ALL).ok_or_else(|| {
            let mut known = vec![NO_DIALECT.name];
            for m in &ALL {
                if !known.contains(&m.dialect.name) {
                    known.push(m.dialect.name);
                }
            }
            serde::de::Error::custom(format!(
                "unknown variant `{name}`, expected one of {}",
                known
                    .iter()
                    .map(|k| format!("`{k}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })
    }
}

/// A label or annotation map from pairs.
fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[cfg(test)]
mod tests;
