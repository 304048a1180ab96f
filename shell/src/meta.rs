//! Object metadata for caches that keep only part of it.
//!
//! In: an object's `metadata` JSON, as a list or watch decodes it. Out: [`SlimMeta`]: an
//! `ObjectMeta` with only the identity fields (name, namespace, uid, resourceVersion,
//! deletionTimestamp), whether a controller owns the object, and its labels and annotations
//! as JSON text, one allocation each, for `meshgate_core::projection` to read the keys a cache
//! keeps. Everything else (managed fields, finalizers, the owner references themselves) is
//! skipped while decoding.
//!
//! Why: anyone who can create a pod decides its metadata, up to about 1.5 MiB (a quarter
//! of it annotations, the rest labels and managed fields). Decoded as maps, 12,000 labels
//! cost several times their size in small allocations, which the allocator keeps mapped
//! after they are freed; kept as text they cost their size, in one allocation that is
//! returned when the object is dropped.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use serde::Deserialize;
use serde_json::value::RawValue;

/// An object's metadata, its labels and annotations left as JSON text.
#[derive(Clone, Debug, Default)]
pub struct SlimMeta {
    /// `name`, `namespace`, `uid`, `resourceVersion` and `deletionTimestamp`; nothing else.
    pub meta: ObjectMeta,
    /// True when an owner reference has `controller: true`.
    pub controlled: bool,
    labels: Option<Box<RawValue>>,
    annotations: Option<Box<RawValue>>,
}

impl SlimMeta {
    /// The labels' JSON text (`{}` when there are none).
    pub fn labels_json(&self) -> &str {
        self.labels.as_deref().map_or("{}", RawValue::get)
    }

    /// The annotations' JSON text (`{}` when there are none).
    pub fn annotations_json(&self) -> &str {
        self.annotations.as_deref().map_or("{}", RawValue::get)
    }
}

/// An owner reference, of which only `controller` is read.
#[derive(Deserialize)]
struct Owner {
    #[serde(default)]
    controller: Option<bool>,
}

/// The wire form: unknown fields are skipped without being allocated.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Wire {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    uid: Option<String>,
    #[serde(default)]
    resource_version: Option<String>,
    #[serde(default)]
    deletion_timestamp: Option<Time>,
    #[serde(default)]
    owner_references: Option<Vec<Owner>>,
    #[serde(default)]
    labels: Option<Box<RawValue>>,
    #[serde(default)]
    annotations: Option<Box<RawValue>>,
}

impl<'de> Deserialize<'de> for SlimMeta {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let w = Wire::deserialize(d)?;
        Ok(Self {
            meta: ObjectMeta {
                name: w.name,
                namespace: w.namespace,
                uid: w.uid,
                resource_version: w.resource_version,
                deletion_timestamp: w.deletion_timestamp,
                ..ObjectMeta::default()
            },
            controlled: w
                .owner_references
                .iter()
                .flatten()
                .any(|o| o.controller == Some(true)),
            labels: w.labels,
            annotations: w.annotations,
        })
    }
}

/// Implements `kube::Resource` for `$view`, a view of Pods (listed, watched and fetched at
/// the Pod's own URL) whose `metadata` field is a [`SlimMeta`]; `metadata_only` asks the
/// apiserver for `PartialObjectMetadata` instead of whole Pods. The crate using it depends on
/// `kube` and `k8s-openapi`.
#[macro_export]
macro_rules! pod_view {
    ($view:ty, metadata_only = $metadata_only:expr) => {
        impl ::kube::Resource for $view {
            type DynamicType = ();
            type Scope = ::k8s_openapi::NamespaceResourceScope;

            fn kind(_: &()) -> ::std::borrow::Cow<'_, str> {
                <::k8s_openapi::api::core::v1::Pod as ::k8s_openapi::Resource>::KIND.into()
            }
            fn group(_: &()) -> ::std::borrow::Cow<'_, str> {
                <::k8s_openapi::api::core::v1::Pod as ::k8s_openapi::Resource>::GROUP.into()
            }
            fn version(_: &()) -> ::std::borrow::Cow<'_, str> {
                <::k8s_openapi::api::core::v1::Pod as ::k8s_openapi::Resource>::VERSION.into()
            }
            fn plural(_: &()) -> ::std::borrow::Cow<'_, str> {
                <::k8s_openapi::api::core::v1::Pod as ::k8s_openapi::Resource>::URL_PATH_SEGMENT
                    .into()
            }
            fn metadata_api() -> bool {
                $metadata_only
            }
            fn meta(&self) -> &::k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                &self.metadata.meta
            }
            fn meta_mut(
                &mut self,
            ) -> &mut ::k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                &mut self.metadata.meta
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_fields_are_kept_and_the_maps_are_left_as_text() {
        let json = r#"{"name": "web", "namespace": "shop", "uid": "u1", "resourceVersion": "42",
            "deletionTimestamp": "2026-01-02T03:04:05Z", "generateName": "web-",
            "labels": {"a": "b", "c": "d"}, "annotations": {"x": "y"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "rs", "uid": "r"},
                                {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "rs2", "uid": "s", "controller": true}],
            "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:metadata": {}}}],
            "finalizers": ["example.com/f"]}"#;
        let m: SlimMeta = serde_json::from_str(json).unwrap();
        assert_eq!(m.meta.name.as_deref(), Some("web"));
        assert_eq!(m.meta.namespace.as_deref(), Some("shop"));
        assert_eq!(m.meta.uid.as_deref(), Some("u1"));
        assert_eq!(m.meta.resource_version.as_deref(), Some("42"));
        assert!(m.meta.deletion_timestamp.is_some());
        assert!(m.meta.managed_fields.is_none() && m.meta.generate_name.is_none());
        assert!(m.controlled);
        assert_eq!(m.labels_json(), r#"{"a": "b", "c": "d"}"#);
        assert_eq!(m.annotations_json(), r#"{"x": "y"}"#);

        let bare: SlimMeta = serde_json::from_str(r#"{"name": "n", "labels": null}"#).unwrap();
        assert_eq!((bare.labels_json(), bare.annotations_json()), ("{}", "{}"));
        assert!(!bare.controlled);
    }
}
