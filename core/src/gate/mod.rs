//! The node gate: meshgate's taint, label and condition on a Node, and the plans that keep
//! them in step with the chain verdict.
//!
//! In: a Node (its taints, labels and `MeshCNIVerified` condition; at registration, the Node
//! as JSON), the [`ChainVerdict`], the [`TaintKey`], the [`TaintEffect`] and the clock. Out:
//! the writes that make
//! the Node say what the verdict says ([`plan_metadata`], [`plan_condition`]), the Node Event
//! a transition publishes ([`plan_event`], with the untaint latency in a documented form:
//! [`NodeEvent::with_untaint_latency`], read back by [`untaint_latency`]), and the JSON Patch
//! that gates a Node from the instant it is created ([`node_registration_patch`]).
//!
//! Pure: the agent's `daemon::node` carries the plans out on its own Node, the webhook's
//! `/mutate-node` answers with the registration patch. Both take `--taint-key` and
//! `--taint-effect`. The Node types are k8s-openapi's (data only, no client), so a plan is
//! exactly what is written.
//!
//! The names below are the ones operators write alerts, runbooks and tolerations against, as
//! docs/operations.md states them ("Reading `kubectl describe node`"): defined once, here.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, NodeCondition, Taint};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use serde_json::{Value, json};

use crate::cni::ChainVerdict;
use crate::{EVENT_NOTE_MAX_BYTES, event_note, event_reason};

mod key;

pub use key::{DEFAULT_TAINT_KEY, InvalidTaintKey, LEGACY_TAINT_KEY, TaintKey};

/// Label mirroring the verdict (`"true"` / `"false"`); the webhook and nodeAffinity read it.
pub const VERIFIED_LABEL: &str = "meshgate.io/cni-verified";
/// Node condition type carrying the verdict's reason and message.
pub const CONDITION_TYPE: &str = "MeshCNIVerified";

/// The effect of meshgate's taint (`--taint-effect`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum TaintEffect {
    /// New pods without a toleration are not scheduled; running pods stay.
    #[default]
    NoSchedule,
    /// Also evicts running pods without a toleration (use with care).
    NoExecute,
}

impl TaintEffect {
    /// Every effect, in the order the flag's help lists them.
    pub const ALL: [TaintEffect; 2] = [TaintEffect::NoSchedule, TaintEffect::NoExecute];

    /// The effect as the API spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            TaintEffect::NoSchedule => "NoSchedule",
            TaintEffect::NoExecute => "NoExecute",
        }
    }
}

impl fmt::Display for TaintEffect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A taint effect meshgate does not set (`PreferNoSchedule`, a typo).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown taint effect {0:?}: use NoSchedule or NoExecute")]
pub struct UnknownTaintEffect(pub String);

impl FromStr for TaintEffect {
    type Err = UnknownTaintEffect;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|e| e.as_str() == s)
            .ok_or_else(|| UnknownTaintEffect(s.to_owned()))
    }
}

/// The taint list the Node should have, or `None` when `current` is already right.
/// Only meshgate's own taint `key` is added, changed or removed, and the keys it supersedes
/// ([`TaintKey::superseded`]) are removed; every other taint is kept.
/// `now` stamps a `NoExecute` taint's `timeAdded`.
pub fn plan_taints(
    current: &[Taint],
    verified: bool,
    key: &TaintKey,
    effect: TaintEffect,
    now: Timestamp,
) -> Option<Vec<Taint>> {
    let ours: Vec<&Taint> = current.iter().filter(|t| t.key == key.as_str()).collect();
    let stale = |t: &Taint| key.superseded().any(|k| t.key == k);
    let want_ours = !verified;
    let is_right = !current.iter().any(stale)
        && if want_ours {
            ours.len() == 1
                && ours[0].effect == effect.as_str()
                && ours[0].value.as_deref().unwrap_or("").is_empty()
        } else {
            ours.is_empty()
        };
    if is_right {
        return None;
    }
    let mut next: Vec<Taint> = current
        .iter()
        .filter(|t| t.key != key.as_str() && !stale(t))
        .cloned()
        .collect();
    if want_ours {
        next.push(Taint {
            key: key.to_string(),
            value: None,
            effect: effect.as_str().to_string(),
            // The API server only records timeAdded for NoExecute taints.
            time_added: (effect == TaintEffect::NoExecute).then_some(Time(now)),
        });
    }
    Some(next)
}

/// The label value the Node should have, or `None` when it already has it.
pub fn plan_label(labels: &BTreeMap<String, String>, verified: bool) -> Option<&'static str> {
    let want = if verified { "true" } else { "false" };
    (labels.get(VERIFIED_LABEL).map(String::as_str) != Some(want)).then_some(want)
}

/// The taint-and-label write a Node needs: one JSON patch ([`MetadataPlan::patch`]).
#[derive(Clone, Debug, PartialEq)]
pub struct MetadataPlan {
    /// The whole taint list to write, when meshgate's taint must change.
    pub taints: Option<Vec<Taint>>,
    /// The label value to write, when it must change.
    pub label: Option<&'static str>,
    /// The resourceVersion planned from: the patch applies only to that version.
    pub resource_version: String,
    /// Whether the Node has a labels map at all (the patch adds one otherwise).
    pub has_labels: bool,
}

impl MetadataPlan {
    /// The JSON patch, guarded by the resourceVersion planned from.
    pub fn patch(&self) -> Value {
        metadata_patch(
            &self.resource_version,
            self.has_labels,
            self.taints.as_deref(),
            self.label,
        )
    }
}

/// The taint-and-label write that makes `node` say `verified`, or `None` when it does.
pub fn plan_metadata(
    node: &Node,
    verified: bool,
    key: &TaintKey,
    effect: TaintEffect,
    now: Timestamp,
) -> Option<MetadataPlan> {
    let current = node.spec.as_ref().and_then(|s| s.taints.as_deref());
    let taints = plan_taints(current.unwrap_or_default(), verified, key, effect, now);
    let labels = node.metadata.labels.as_ref();
    let label = plan_label(labels.unwrap_or(&BTreeMap::new()), verified);
    if taints.is_none() && label.is_none() {
        return None;
    }
    Some(MetadataPlan {
        taints,
        label,
        resource_version: node.metadata.resource_version.clone().unwrap_or_default(),
        has_labels: labels.is_some(),
    })
}

/// The Node's `MeshCNIVerified` condition, if it has one.
pub fn condition_of(node: &Node) -> Option<&NodeCondition> {
    node.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == CONDITION_TYPE)
}

/// The condition to write, or `None` when status, reason and message are already current.
/// `lastTransitionTime` is kept unless the status changes.
pub fn plan_condition(
    current: Option<&NodeCondition>,
    verdict: &ChainVerdict,
    now: Timestamp,
) -> Option<NodeCondition> {
    let status = if verdict.verified { "True" } else { "False" };
    let reason = verdict.reason.as_str();
    if let Some(c) = current
        && c.status == status
        && c.reason.as_deref() == Some(reason)
        && c.message.as_deref() == Some(verdict.message.as_str())
    {
        return None;
    }
    let transition = match current {
        Some(c) if c.status == status => c.last_transition_time.clone(),
        _ => None,
    }
    .unwrap_or(Time(now));
    Some(NodeCondition {
        type_: CONDITION_TYPE.to_string(),
        status: status.to_string(),
        reason: Some(reason.to_string()),
        message: Some(verdict.message.clone()),
        last_heartbeat_time: Some(Time(now)),
        last_transition_time: Some(transition),
    })
}

/// A Node Event to publish (events.k8s.io/v1 fields).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeEvent {
    /// `Warning` when true, else `Normal`.
    pub warning: bool,
    /// One of [`event_reason`].
    pub reason: &'static str,
    /// What changed and why, within the API's note limit.
    pub note: String,
    /// What meshgate does about it.
    pub action: &'static str,
}

/// The Event to publish for a condition change, if the status or reason changed.
pub fn plan_event(current: Option<&NodeCondition>, verdict: &ChainVerdict) -> Option<NodeEvent> {
    let status = if verdict.verified { "True" } else { "False" };
    if let Some(c) = current
        && c.status == status
        && c.reason.as_deref() == Some(verdict.reason.as_str())
    {
        return None;
    }
    let (reason, action) = if verdict.verified {
        (event_reason::CHAIN_VERIFIED, "Untaint")
    } else {
        (event_reason::CHAIN_UNVERIFIED, "Taint")
    };
    Some(NodeEvent {
        warning: !verdict.verified,
        reason,
        note: event_note(&format!("{}: {}", verdict.reason, verdict.message)),
        action,
    })
}

/// How a `CNIChainVerified` note that removed the taint ends: `" [untaint latency: N ms]"`,
/// N the whole milliseconds from the config change (or the agent's start) to the API
/// accepting the taint's removal. A stable interface (docs/operations.md, "Reading `kubectl
/// describe node`"): `kubectl meshgate status` reads it back with [`untaint_latency`].
const UNTAINT_LATENCY_OPEN: &str = " [untaint latency: ";
const UNTAINT_LATENCY_CLOSE: &str = " ms]";

impl NodeEvent {
    /// The note with the untaint latency appended in its documented form; the text before it
    /// is cut (ending in `…`) so the whole still fits in [`EVENT_NOTE_MAX_BYTES`].
    #[must_use]
    pub fn with_untaint_latency(mut self, latency: Duration) -> Self {
        let suffix = format!(
            "{UNTAINT_LATENCY_OPEN}{}{UNTAINT_LATENCY_CLOSE}",
            latency.as_millis()
        );
        if self.note.len() + suffix.len() > EVENT_NOTE_MAX_BYTES {
            let mut end = EVENT_NOTE_MAX_BYTES - suffix.len() - '…'.len_utf8();
            while !self.note.is_char_boundary(end) {
                end -= 1;
            }
            self.note.truncate(end);
            self.note.push('…');
        }
        self.note.push_str(&suffix);
        self
    }
}

/// The untaint latency a `CNIChainVerified` note carries, if it ends in the form
/// [`NodeEvent::with_untaint_latency`] writes.
pub fn untaint_latency(note: &str) -> Option<Duration> {
    let rest = note.strip_suffix(UNTAINT_LATENCY_CLOSE)?;
    let start = rest.rfind(UNTAINT_LATENCY_OPEN)? + UNTAINT_LATENCY_OPEN.len();
    let ms = &rest[start..];
    if ms.is_empty() || !ms.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    ms.parse().ok().map(Duration::from_millis)
}

/// Escapes a key for a JSON Pointer path segment (RFC 6901: `~` → `~0`, `/` → `~1`).
pub(crate) fn pointer_segment(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

/// The JSON patch for taints and label, guarded by the resourceVersion we planned from.
pub fn metadata_patch(
    resource_version: &str,
    has_labels: bool,
    taints: Option<&[Taint]>,
    label: Option<&str>,
) -> Value {
    let mut ops =
        vec![json!({"op": "test", "path": "/metadata/resourceVersion", "value": resource_version})];
    if let Some(taints) = taints {
        ops.push(json!({"op": "add", "path": "/spec/taints", "value": taints}));
    }
    if let Some(value) = label {
        if has_labels {
            let path = format!("/metadata/labels/{}", pointer_segment(VERIFIED_LABEL));
            ops.push(json!({"op": "add", "path": path, "value": value}));
        } else {
            ops.push(
                json!({"op": "add", "path": "/metadata/labels", "value": {VERIFIED_LABEL: value}}),
            );
        }
    }
    Value::Array(ops)
}

/// The JSON Patch (RFC 6902 operations) that gates a Node being created: the taint `key`
/// with `effect`, unless a taint with that key is already
/// there (kubelet's `--register-with-taints` may have set it, perhaps with `NoExecute`), and the
/// label `meshgate.io/cni-verified=false`, which replaces any value a registering node claims
/// for itself: a node that was just created has not been verified by the agent.
///
/// `node` is the Node object as JSON. Returns an empty list when nothing needs to change.
pub fn node_registration_patch(node: &Value, key: &TaintKey, effect: TaintEffect) -> Vec<Value> {
    let mut ops = Vec::new();
    ops.extend(registration_label(node));
    ops.extend(registration_taint(node, key, effect));
    ops
}

/// The label part of [`node_registration_patch`].
fn registration_label(node: &Value) -> Option<Value> {
    if let Some(Value::Object(map)) = node.pointer("/metadata/labels") {
        if map.get(VERIFIED_LABEL).and_then(Value::as_str) == Some("false") {
            return None;
        }
        // `add` on an existing member replaces it (RFC 6902 §4.1).
        return Some(json!({
            "op": "add",
            "path": format!("/metadata/labels/{}", pointer_segment(VERIFIED_LABEL)),
            "value": "false",
        }));
    }
    Some(if node.get("metadata").is_some_and(Value::is_object) {
        json!({ "op": "add", "path": "/metadata/labels", "value": { VERIFIED_LABEL: "false" } })
    } else {
        json!({ "op": "add", "path": "/metadata", "value": { "labels": { VERIFIED_LABEL: "false" } } })
    })
}

/// The taint part of [`node_registration_patch`].
fn registration_taint(node: &Value, key: &TaintKey, effect: TaintEffect) -> Option<Value> {
    let taint = json!({ "key": key.as_str(), "effect": effect.as_str() });
    if let Some(Value::Array(taints)) = node.pointer("/spec/taints") {
        let present = taints
            .iter()
            .any(|t| t.get("key").and_then(Value::as_str) == Some(key.as_str()));
        return (!present)
            .then(|| json!({ "op": "add", "path": "/spec/taints/-", "value": taint }));
    }
    Some(if node.get("spec").is_some_and(Value::is_object) {
        json!({ "op": "add", "path": "/spec/taints", "value": [taint] })
    } else {
        json!({ "op": "add", "path": "/spec", "value": { "taints": [taint] } })
    })
}

#[cfg(test)]
mod tests;
