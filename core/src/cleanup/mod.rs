//! `kubectl meshgate cleanup`'s plan for one Node: the writes that take meshgate's taint,
//! label and condition off it, and nothing else.
//!
//! In: the Node as last read, and meshgate's taint key (a taint under it or under a key it
//! supersedes, `TaintKey::superseded`, is meshgate's, as the agent treats it). Out: which of meshgate's marks it
//! carries ([`marks`]), and two JSON Patches (RFC 6902), each guarded by a `test` of the
//! resourceVersion planned from: [`metadata_patch`] for the taint and label (the `nodes`
//! resource) and [`status_patch`] for the `MeshCNIVerified` condition (`nodes/status`).
//! Every other taint, label and condition is left as it is: the taint list is written back
//! without meshgate's key, the label and the condition are removed by their own paths.
//!
//! Pure: the agent crate's `plugin::cleanup` carries the plans out, re-reading and re-planning
//! after a conflict.

use k8s_openapi::api::core::v1::Node;
use serde::Serialize;
use serde_json::{Value, json};

use crate::gate::{CONDITION_TYPE, TaintKey, VERIFIED_LABEL, pointer_segment};

/// meshgate's marks on one Node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Marks {
    /// A taint with meshgate's key or one it supersedes (any value, any effect).
    pub taint: bool,
    /// The label `meshgate.io/cni-verified` (any value).
    pub label: bool,
    /// The condition `MeshCNIVerified`.
    pub condition: bool,
}

impl Marks {
    /// True when the Node carries none of them.
    pub fn is_empty(&self) -> bool {
        !(self.taint || self.label || self.condition)
    }

    /// The marks, as a summary line names them (`taint, label, condition`).
    pub fn describe(&self) -> String {
        let names = [
            (self.taint, "taint"),
            (self.label, "label"),
            (self.condition, "condition"),
        ];
        let present: Vec<&str> = names
            .iter()
            .filter(|(on, _)| *on)
            .map(|(_, n)| *n)
            .collect();
        present.join(", ")
    }
}

/// True when a taint with key `taint` is meshgate's: `key`, or a key it supersedes.
pub fn is_meshgate_taint(key: &TaintKey, taint: &str) -> bool {
    taint == key.as_str() || key.superseded().any(|k| k == taint)
}

/// Which of meshgate's marks `node` carries.
pub fn marks(node: &Node, taint_key: &TaintKey) -> Marks {
    Marks {
        taint: taints(node)
            .iter()
            .any(|t| is_meshgate_taint(taint_key, &t.key)),
        label: node
            .metadata
            .labels
            .as_ref()
            .is_some_and(|l| l.contains_key(VERIFIED_LABEL)),
        condition: !condition_indexes(node).is_empty(),
    }
}

fn taints(node: &Node) -> &[k8s_openapi::api::core::v1::Taint] {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_deref())
        .unwrap_or_default()
}

/// Positions of the `MeshCNIVerified` conditions (one, unless a writer repeated it).
fn condition_indexes(node: &Node) -> Vec<usize> {
    let conditions = node.status.as_ref().and_then(|s| s.conditions.as_deref());
    conditions
        .unwrap_or_default()
        .iter()
        .enumerate()
        .filter(|(_, c)| c.type_ == CONDITION_TYPE)
        .map(|(i, _)| i)
        .collect()
}

fn guard(node: &Node) -> Value {
    let rv = node
        .metadata
        .resource_version
        .as_deref()
        .unwrap_or_default();
    json!({"op": "test", "path": "/metadata/resourceVersion", "value": rv})
}

/// The patch of `nodes` that removes meshgate's taint and label, or `None` when it carries
/// neither. The remaining taints are written whole (JSON Patch cannot remove by key), which
/// the resourceVersion test makes safe: a taint added meanwhile fails the patch instead of
/// being lost.
pub fn metadata_patch(node: &Node, taint_key: &TaintKey) -> Option<Value> {
    let found = marks(node, taint_key);
    if !found.taint && !found.label {
        return None;
    }
    let mut ops = vec![guard(node)];
    if found.taint {
        let kept: Vec<_> = taints(node)
            .iter()
            .filter(|t| !is_meshgate_taint(taint_key, &t.key))
            .collect();
        ops.push(if kept.is_empty() {
            json!({"op": "remove", "path": "/spec/taints"})
        } else {
            json!({"op": "replace", "path": "/spec/taints", "value": kept})
        });
    }
    if found.label {
        let path = format!("/metadata/labels/{}", pointer_segment(VERIFIED_LABEL));
        ops.push(json!({"op": "remove", "path": path}));
    }
    Some(Value::Array(ops))
}

/// The patch of `nodes/status` that removes the `MeshCNIVerified` condition, or `None` when
/// there is none. Removed by index, highest first, so each index still names its condition.
pub fn status_patch(node: &Node) -> Option<Value> {
    let indexes = condition_indexes(node);
    if indexes.is_empty() {
        return None;
    }
    let mut ops = vec![guard(node)];
    for i in indexes.into_iter().rev() {
        ops.push(json!({"op": "remove", "path": format!("/status/conditions/{i}")}));
    }
    Some(Value::Array(ops))
}

#[cfg(test)]
mod tests;
