//! Request body → the parts of an AdmissionReview that admission reads, and nothing more.
//!
//! In: the bytes the apiserver POSTs (or anyone who reaches the port: possibly garbage, up to
//! `--max-body-bytes`). Out: a [`Request`], or a "malformed" message for a 400.
//!
//! Why not kube's `AdmissionReview<DynamicObject>`: it builds a `serde_json::Value` tree of
//! the whole object (and of `oldObject` and `options`), about 75 bytes of memory per byte of a
//! body made of tiny JSON objects. Here every field admission does not read is skipped by the
//! parser without being stored, and what is kept is typed:
//! - the review's `apiVersion` and `kind`, the request's `uid`, `kind`, `resource`,
//!   `subResource`, `name`, `namespace`, `operation` and `dryRun` (`userInfo` must be there,
//!   as for kube, but is not kept);
//! - of the object: `metadata.{name, generateName, namespace, labels, annotations}`, and
//!   `spec.nodeName` (a pod), `target.name` (a Binding) and, for a Node, whether `spec` is an
//!   object, whether `spec.taints` is an array and the keys of its taints (the taint key is a
//!   setting, `--taint-key`, so the decoder cannot compare it itself), and its `NoSchedule` and
//!   `NoExecute` taints (key, value, effect), which decide whether the agent DaemonSet will run
//!   there ([`crate::placement`]).
//!
//! Strings are kept once (one byte per byte); the label and annotation maps and the list of
//! taint keys are the only parts that cost more than the body (a taint key's `String` costs
//! less per body byte than a label's two): [`WORST_CASE_EXPANSION`] bytes per body byte at worst,
//! which the server charges against its review memory budget before reading a body.
//! `spec`, `spec.nodeName`, `spec.taints` and `target` are read leniently, as a JSON pointer
//! into the whole object would: a value of another type counts as absent, not as malformed.

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;

use k8s_openapi::api::core::v1::Taint;
use kube::core::admission::{AdmissionResponse, Operation};
use kube::core::{GroupVersionKind, GroupVersionResource, Status, TypeMeta};
use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::{Value, json};

/// Bytes of memory the decoded [`Request`] may hold per byte of body, at worst: a body that is
/// one `labels` map of the shortest distinct entries (`"ab":"",`), each becoming two `String`s
/// in a `BTreeMap` node plus the key's heap block (`tests/decode_memory.rs` measures it; a
/// body of tiny objects costs almost nothing, they are skipped).
pub const WORST_CASE_EXPANSION: usize = 16;

/// The parts of an AdmissionReview request that admission reads.
#[derive(Debug)]
pub struct Request {
    /// The review's `apiVersion` and `kind`, echoed in the answer.
    pub types: TypeMeta,
    /// `request.uid`, echoed in the answer.
    pub uid: String,
    /// `request.resource`.
    pub resource: GroupVersionResource,
    /// `request.subResource`.
    pub sub_resource: Option<String>,
    /// `request.name`.
    pub name: String,
    /// `request.namespace`.
    pub namespace: Option<String>,
    /// `request.operation`.
    pub operation: Operation,
    /// `request.dryRun`.
    pub dry_run: bool,
    /// `request.object`.
    pub object: Option<Object>,
}

/// The answer to `req` that allows it, as kube's `AdmissionResponse::from` builds it for its
/// own request type.
impl From<&Request> for AdmissionResponse {
    fn from(req: &Request) -> Self {
        // kube builds a response only from its own request type or as "invalid"; this is
        // "invalid" turned into what `From<&AdmissionRequest>` returns.
        let mut resp = AdmissionResponse::invalid("");
        resp.types = req.types.clone();
        resp.uid = req.uid.clone();
        resp.allowed = true;
        resp.result = Status::default();
        resp
    }
}

/// `request.object`, as far as admission reads it.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Object {
    /// `metadata`.
    pub metadata: Metadata,
    /// `spec` when it is a JSON object.
    pub spec: Lenient<Spec>,
    /// `target` when it is a JSON object (a Binding).
    pub target: Lenient<Target>,
}

/// `metadata`, as far as admission reads it.
#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct Metadata {
    /// `metadata.name`.
    pub name: Option<String>,
    /// `metadata.generateName`.
    pub generate_name: Option<String>,
    /// `metadata.namespace`.
    pub namespace: Option<String>,
    /// `metadata.labels`.
    pub labels: Option<BTreeMap<String, String>>,
    /// `metadata.annotations`.
    pub annotations: Option<BTreeMap<String, String>>,
}

/// `spec`: a pod's node and a Node's taints.
#[derive(Debug, Default)]
pub struct Spec {
    /// `spec.nodeName` when it is a string.
    pub node_name: Option<String>,
    /// When `spec.taints` is an array: the `key` of each entry that is an object with a
    /// string `key`.
    pub taints: Option<Vec<String>>,
    /// The entries of `spec.taints` whose effect is `NoSchedule` or `NoExecute` (the only
    /// ones placement reads): a body of the shortest such entries holds 9.6 bytes per body
    /// byte (`tests/decode_memory.rs`), within [`WORST_CASE_EXPANSION`].
    pub scheduling_taints: Vec<Taint>,
}

/// A Binding's `target`.
#[derive(Debug, Default)]
pub struct Target {
    /// `target.name` when it is a string.
    pub name: Option<String>,
}

impl Object {
    /// `spec.nodeName`.
    pub fn node_name(&self) -> Option<&str> {
        self.spec.0.as_ref()?.node_name.as_deref()
    }

    /// `target.name`.
    pub fn target_name(&self) -> Option<&str> {
        self.target.0.as_ref()?.name.as_deref()
    }

    /// A Node's `NoSchedule` and `NoExecute` taints.
    pub fn node_taints(&self) -> &[Taint] {
        self.spec
            .0
            .as_ref()
            .map_or(&[], |s| s.scheduling_taints.as_slice())
    }

    /// The Node as `meshgate_core::gate::node_registration_patch` reads it: exactly the
    /// members it looks at, with the values they had.
    pub fn registration_view(&self) -> Value {
        let mut metadata = json!({});
        if let Some(labels) = &self.metadata.labels {
            let verified: serde_json::Map<String, Value> = labels
                .get_key_value(meshgate_core::gate::VERIFIED_LABEL)
                .map(|(k, v)| (k.clone(), Value::String(v.clone())))
                .into_iter()
                .collect();
            metadata["labels"] = Value::Object(verified);
        }
        let spec = match &self.spec.0 {
            None => Value::Null,
            Some(Spec { taints: None, .. }) => json!({}),
            Some(Spec {
                taints: Some(keys), ..
            }) => {
                let taints: Vec<Value> = keys.iter().map(|k| json!({ "key": k })).collect();
                json!({ "taints": taints })
            }
        };
        json!({ "metadata": metadata, "spec": spec })
    }
}

/// The review envelope.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Review {
    api_version: String,
    kind: String,
    request: Option<WireRequest>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireRequest {
    uid: String,
    // Required as in kube's request type; only checked for shape.
    #[allow(dead_code)]
    kind: GroupVersionKind,
    resource: GroupVersionResource,
    #[serde(default)]
    sub_resource: Option<String>,
    #[serde(default)]
    name: String,
    #[serde(default)]
    namespace: Option<String>,
    operation: Operation,
    // Required as in kube's request type; skipped unread.
    #[allow(dead_code)]
    user_info: IgnoredAny,
    object: Option<Object>,
    #[serde(default)]
    dry_run: bool,
}

/// Decodes an AdmissionReview request, refusing anything that is not one.
pub fn decode(body: &[u8]) -> Result<Request, String> {
    let review: Review =
        serde_json::from_slice(body).map_err(|e| format!("malformed AdmissionReview: {e}"))?;
    if review.kind != "AdmissionReview" {
        return Err(format!(
            "malformed AdmissionReview: kind is {:?}, expected \"AdmissionReview\"",
            review.kind
        ));
    }
    let Some(req) = review.request else {
        return Err("malformed AdmissionReview: no request".into());
    };
    if req.uid.is_empty() {
        return Err("malformed AdmissionReview: request.uid is empty".into());
    }
    Ok(Request {
        types: TypeMeta {
            api_version: review.api_version,
            kind: review.kind,
        },
        uid: req.uid,
        resource: req.resource,
        sub_resource: req.sub_resource,
        name: req.name,
        namespace: req.namespace,
        operation: req.operation,
        dry_run: req.dry_run,
        object: req.object,
    })
}

/// A JSON value read as `T` when it is an object; any other value (null, a string, an
/// array, ...) is skipped and reads as `None`.
#[derive(Debug)]
pub struct Lenient<T>(pub Option<T>);

impl<T> Default for Lenient<T> {
    fn default() -> Self {
        Self(None)
    }
}

/// Read from the members of a JSON object.
trait FromMembers: Sized {
    fn from_members<'de, A: MapAccess<'de>>(map: A) -> Result<Self, A::Error>;
}

impl<'de, T: FromMembers> Deserialize<'de> for Lenient<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(AnyOr(PhantomData::<T>))
    }
}

/// Visits any JSON value: an object through `T`, anything else skipped.
struct AnyOr<T>(PhantomData<T>);

/// The non-object half of a lenient visitor: every other JSON value is skipped, arrays
/// element by element (without storing them).
macro_rules! skip_non_objects {
    ($none:expr) => {
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
            Ok($none)
        }
        fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
            Ok($none)
        }
        fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
            Ok($none)
        }
        fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
            Ok($none)
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok($none)
        }
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok($none)
        }
    };
}

impl<'de, T: FromMembers> Visitor<'de> for AnyOr<T> {
    type Value = Lenient<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        T::from_members(map).map(|t| Lenient(Some(t)))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Lenient(None))
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
        Ok(Lenient(None))
    }

    skip_non_objects!(Lenient(None));
}

/// A JSON value kept when it is a string, skipped otherwise.
struct LenientString(Option<String>);

impl<'de> Deserialize<'de> for LenientString {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = LenientString;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
                Ok(LenientString(Some(s.to_owned())))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(LenientString(None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(LenientString(None))
            }
            skip_non_objects!(LenientString(None));
        }
        d.deserialize_any(V)
    }
}

/// `spec.taints` when it is an array: the string `key`s of its object entries (anything else
/// reads as `None`), and the entries that keep pods away.
struct TaintsShape(Option<Vec<String>>, Vec<Taint>);

impl<'de> Deserialize<'de> for TaintsShape {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TaintsShape;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let (mut keys, mut kept) = (Vec::new(), Vec::new());
                while let Some(taint) = seq.next_element::<Lenient<TaintKey>>()? {
                    if let Some(TaintKey(key, scheduling)) = taint.0 {
                        keys.extend(key);
                        kept.extend(scheduling);
                    }
                }
                Ok(TaintsShape(Some(keys), kept))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(TaintsShape(None, Vec::new()))
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
                Ok(TaintsShape(None, Vec::new()))
            }
            skip_non_objects!(TaintsShape(None, Vec::new()));
        }
        d.deserialize_any(V)
    }
}

/// A taint: its `key` when that is a string, and the taint when its effect keeps pods away
/// (`NoSchedule`, `NoExecute`).
struct TaintKey(Option<String>, Option<Taint>);

/// Reads the members of an object, handing each key to `on` (which must consume the value)
/// and skipping the value of every key it declines. Keys are compared as borrowed strings
/// when the parser can lend them, so skipped members cost no allocation.
fn members<'de, A: MapAccess<'de>>(
    mut map: A,
    mut on: impl FnMut(&str, &mut A) -> Result<bool, A::Error>,
) -> Result<(), A::Error> {
    while let Some(key) = map.next_key::<Key<'de>>()? {
        if !on(key.as_str(), &mut map)? {
            map.next_value::<IgnoredAny>()?;
        }
    }
    Ok(())
}

impl FromMembers for Spec {
    fn from_members<'de, A: MapAccess<'de>>(map: A) -> Result<Self, A::Error> {
        let mut spec = Spec::default();
        members(map, |key, map| {
            match key {
                "nodeName" => spec.node_name = map.next_value::<LenientString>()?.0,
                "taints" => {
                    let shape = map.next_value::<TaintsShape>()?;
                    (spec.taints, spec.scheduling_taints) = (shape.0, shape.1);
                }
                _ => return Ok(false),
            }
            Ok(true)
        })?;
        Ok(spec)
    }
}

impl FromMembers for Target {
    fn from_members<'de, A: MapAccess<'de>>(map: A) -> Result<Self, A::Error> {
        let mut target = Target::default();
        members(map, |key, map| {
            if key != "name" {
                return Ok(false);
            }
            target.name = map.next_value::<LenientString>()?.0;
            Ok(true)
        })?;
        Ok(target)
    }
}

impl FromMembers for TaintKey {
    fn from_members<'de, A: MapAccess<'de>>(map: A) -> Result<Self, A::Error> {
        let (mut key, mut value, mut effect) = (None, None, None);
        members(map, |member, map| {
            let slot = match member {
                "key" => &mut key,
                "value" => &mut value,
                "effect" => &mut effect,
                _ => return Ok(false),
            };
            *slot = map.next_value::<LenientString>()?.0;
            Ok(true)
        })?;
        let scheduling =
            matches!(effect.as_deref(), Some("NoSchedule" | "NoExecute")).then(|| Taint {
                key: key.clone().unwrap_or_default(),
                value,
                effect: effect.unwrap_or_default(),
                time_added: None,
            });
        Ok(TaintKey(key, scheduling))
    }
}

/// An object key: borrowed from the body when it holds no escapes, owned otherwise.
struct Key<'de>(std::borrow::Cow<'de, str>);

impl Key<'_> {
    fn as_str(&self) -> &str {
        &self.0
    }
}

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object key")
            }
            fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Self::Value, E> {
                Ok(Key(s.into()))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
                Ok(Key(s.to_owned().into()))
            }
        }
        d.deserialize_str(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(v: Value) -> Object {
        serde_json::from_value(v).unwrap()
    }

    /// The JSON-pointer reads the decoder replaces, over the same objects: a value of another
    /// type is absent, not malformed.
    #[test]
    fn lenient_parts_read_like_a_json_pointer() {
        for (v, node, target) in [
            (json!({"spec": {"nodeName": "n1"}}), Some("n1"), None),
            (json!({"spec": {"nodeName": 5}}), None, None),
            (json!({"spec": {"nodeName": ["n1"]}}), None, None),
            (json!({"spec": "n1"}), None, None),
            (
                json!({"spec": null, "target": {"name": "n2"}}),
                None,
                Some("n2"),
            ),
            (json!({"target": {"name": {"a": 1}}}), None, None),
            (json!({"target": [1, 2]}), None, None),
        ] {
            let o = object(v.clone());
            assert_eq!(o.node_name(), node, "{v}");
            assert_eq!(o.target_name(), target, "{v}");
        }
        // Duplicate keys: the last one wins, as in serde_json's Value.
        let o: Object =
            serde_json::from_str(r#"{"spec":{"nodeName":"a","nodeName":"b"}}"#).unwrap();
        assert_eq!(o.node_name(), Some("b"));
        // Escaped keys are still recognised.
        let o: Object = serde_json::from_str(r#"{"spec":{"node\u004eame":"c"}}"#).unwrap();
        assert_eq!(o.node_name(), Some("c"));
    }

    /// The registration view gives the Node patch the same operations as the whole Node did.
    #[test]
    fn the_registration_view_patches_like_the_whole_node() {
        use meshgate_core::gate::{TaintEffect, TaintKey, node_registration_patch};
        let custom: TaintKey = "example.com/mesh-not-ready".parse().unwrap();
        for node in [
            json!({"metadata": {"name": "n"}}),
            json!({"metadata": {"labels": {"a": "b"}}, "spec": {}}),
            json!({"metadata": {"labels": {"meshgate.io/cni-verified": "false"}}, "spec": {"taints": []}}),
            json!({"metadata": {"labels": {"meshgate.io/cni-verified": "true"}}, "spec": {"taints": [
                {"key": "other", "effect": "NoSchedule"}, "junk", 7,
                {"key": "meshgate.io/cni-unverified", "effect": "NoExecute"}]}}),
            json!({"spec": {"taints": [{"key": "readiness.k8s.io/meshgate-cni-unverified"}]}}),
            json!({"spec": {"taints": [{"effect": "NoSchedule"}, {"key": "example.com/mesh-not-ready"}]}}),
            json!({"spec": {"taints": {"key": "meshgate.io/cni-unverified"}}}),
            json!({"spec": {"taints": [{"key": 1}]}}),
            json!({"spec": "weird"}),
            json!({"spec": [1, {"taints": []}]}),
            json!({"metadata": {"labels": null}, "spec": null}),
        ] {
            let o = object(node.clone());
            // What the earlier decoding handed the patch: the object with `metadata` always an
            // object (kube's ObjectMeta) and every other member as sent.
            let mut whole = node.clone();
            if whole.get("metadata").is_none() {
                whole["metadata"] = json!({});
            }
            if whole["metadata"].get("labels") == Some(&Value::Null) {
                whole["metadata"].as_object_mut().unwrap().remove("labels");
            }
            for key in [&TaintKey::default(), &custom] {
                assert_eq!(
                    node_registration_patch(&o.registration_view(), key, TaintEffect::NoSchedule),
                    node_registration_patch(&whole, key, TaintEffect::NoSchedule),
                    "{node} with {key}"
                );
            }
        }
    }

    #[test]
    fn reviews_decode_to_what_admission_reads_and_echo_their_types() {
        let body = json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {
                "uid": "u1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "name": "web", "namespace": "shop", "operation": "CREATE", "dryRun": true,
                "userInfo": {"username": "x", "groups": [{}, {}, {}]},
                "object": {"metadata": {"name": "web", "labels": {"app": "web"},
                                        "managedFields": [{"fieldsV1": {"f:a": {}}}]},
                           "spec": {"nodeName": "n1", "containers": [{}, {}]}},
                "oldObject": {"anything": [1, 2, 3]},
                "options": {"kind": "CreateOptions"}
            }
        });
        let req = decode(&serde_json::to_vec(&body).unwrap()).unwrap();
        assert_eq!(req.uid, "u1");
        assert_eq!(req.operation, Operation::Create);
        assert!(req.dry_run);
        assert_eq!(req.namespace.as_deref(), Some("shop"));
        let obj = req.object.as_ref().unwrap();
        assert_eq!(obj.node_name(), Some("n1"));
        assert_eq!(obj.metadata.labels.as_ref().unwrap()["app"], "web");
        let resp = AdmissionResponse::from(&req);
        let out = serde_json::to_value(resp.into_review()).unwrap();
        assert_eq!(out["apiVersion"], "admission.k8s.io/v1");
        assert_eq!(out["kind"], "AdmissionReview");
        assert_eq!(out["response"]["uid"], "u1");
        assert_eq!(out["response"]["allowed"], true);
        // Required like kube's request type: `userInfo`, `kind`, `operation`.
        for missing in ["userInfo", "kind", "operation", "resource", "uid"] {
            let mut b = body.clone();
            b["request"].as_object_mut().unwrap().remove(missing);
            assert!(
                decode(&serde_json::to_vec(&b).unwrap()).is_err(),
                "{missing}"
            );
        }
    }
}
