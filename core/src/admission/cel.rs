//! The pod path of [`super::decide`] as CEL, for the apiserver's own admission: the chart's
//! ValidatingAdmissionPolicy `meshgate-placement` (`templates/placement-policy.yaml`).
//!
//! In: a [`ProfileSet`]. Out: [`PlacementCel`], the policy's expressions:
//! - `may_select`, its match condition: some profile may select the pod (match conditions
//!   have no `namespaceObject`, so a namespace label is taken as present);
//! - `selected`, a variable the validation reads: true exactly when some profile selects the
//!   pod, as [`PodSelector::select`] decides with the namespace's labels known
//!   (`namespaceObject`);
//! - `meshes` and `plugins`, variables naming the selecting profiles and their CNI plugins;
//! - `message`, the refusal, word for word what [`super::decide`] says of a pod created with
//!   `spec.nodeName` on a Node labelled `meshgate.io/cni-verified=false`.
//!
//! The policy reads `object` (the Pod), `request.namespace`, `namespaceObject` (the Pod's
//! Namespace) and `params` (one gated Node: the policy is evaluated once per Node labelled
//! `meshgate.io/cni-verified=false`). A Binding carries no pod, so bindings stay with the
//! webhook; what the policy cannot say is in docs/webhook.md ("Failure policy").

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::{CREATE_MEANWHILE, remedy_then};
use crate::gate::{CONDITION_TYPE, VERIFIED_LABEL};
use crate::profile::{PodSelector, ProfileSet};

/// The expressions of the placement policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlacementCel {
    /// Match condition: some profile may select the pod (its namespace's labels taken as
    /// matching).
    pub may_select: String,
    /// Variable `selected`: some profile selects the pod.
    pub selected: String,
    /// Variable `meshes`: the selecting profiles' names, joined with ", ".
    pub meshes: String,
    /// Variable `plugins`: their CNI plugin types, sorted, once each, joined with ", ".
    pub plugins: String,
    /// The validation's `messageExpression` (reads `variables.meshes` and `variables.plugins`).
    pub message: String,
}

/// One map of the admitted request that selectors read.
struct Map {
    /// The field that holds it, e.g. `object.metadata.labels`.
    path: &'static str,
}

const POD_LABELS: Map = Map {
    path: "object.metadata.labels",
};
const POD_ANNOTATIONS: Map = Map {
    path: "object.metadata.annotations",
};
const NAMESPACE_LABELS: Map = Map {
    path: "namespaceObject.metadata.labels",
};

impl Map {
    /// True when the map holds `key`, with `value` unless `value` is empty (any value), as
    /// the selectors' `all_present` and `any_present` read an entry.
    fn entry(&self, key: &str, value: &str) -> String {
        let (p, k) = (self.path, quote(key));
        // `has` first: a Pod without labels has no such field, and `in` on it would fail.
        let mut s = format!("(has({p}) && {k} in {p}");
        if !value.is_empty() {
            let _ = write!(s, " && {p}[{k}] == {}", quote(value));
        }
        s.push(')');
        s
    }
}

/// A CEL string literal.
pub(crate) fn quote(s: &str) -> String {
    let mut q = String::with_capacity(s.len() + 2);
    q.push('\'');
    for c in s.chars() {
        match c {
            '\\' => q.push_str("\\\\"),
            '\'' => q.push_str("\\'"),
            '\n' => q.push_str("\\n"),
            '\r' => q.push_str("\\r"),
            c if c.is_control() => {
                let _ = write!(q, "\\u{:04x}", c as u32);
            }
            c => q.push(c),
        }
    }
    q.push('\'');
    q
}

/// How a selector's namespace labels are read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Namespace {
    /// From `namespaceObject`, which validations and variables have.
    Read,
    /// Taken as matching: match conditions have no `namespaceObject` (on v1.35 it has no
    /// `metadata` there), so a condition can only say "may be selected".
    Assumed,
}

/// `sel` as CEL. With [`Namespace::Read`], true exactly when [`PodSelector::select`] says
/// `Yes` with the namespace's labels known; with [`Namespace::Assumed`], true whenever it
/// may (namespace labels are only ever required, never excluded, so dropping them widens).
pub fn selector(sel: &PodSelector, ns: Namespace) -> String {
    if !sel.has_requirement() {
        return "false".into();
    }
    let required = |m: &Map, entries: &BTreeMap<String, String>| -> Vec<String> {
        entries.iter().map(|(k, v)| m.entry(k, v)).collect()
    };
    let excluded = |m: &Map, entries: &BTreeMap<String, String>| -> Vec<String> {
        entries
            .iter()
            .map(|(k, v)| format!("!{}", m.entry(k, v)))
            .collect()
    };
    let mut terms = required(&POD_LABELS, &sel.labels);
    terms.extend(required(&POD_ANNOTATIONS, &sel.annotations));
    terms.extend(excluded(&POD_LABELS, &sel.exclude_labels));
    terms.extend(excluded(&POD_ANNOTATIONS, &sel.exclude_annotations));
    if ns == Namespace::Read {
        terms.extend(required(&NAMESPACE_LABELS, &sel.namespace_labels));
    }
    if !sel.any_of.is_empty() {
        let alts: Vec<String> = sel
            .any_of
            .iter()
            .map(|alt| format!("({})", selector(alt, ns)))
            .collect();
        terms.push(format!("({})", alts.join(" || ")));
    }
    match terms.is_empty() {
        true => "true".into(),
        false => terms.join(" && "),
    }
}

/// `[c1 ? 'a' : '', …]`, less the empty strings, joined with ", ".
fn names_where(pairs: &[(String, &str)]) -> String {
    let items: Vec<String> = pairs
        .iter()
        .map(|(cond, name)| format!("({cond}) ? {} : ''", quote(name)))
        .collect();
    format!("[{}].filter(n, n != '').join(', ')", items.join(", "))
}

impl PlacementCel {
    /// The expressions for `profiles`.
    pub fn of(profiles: &ProfileSet) -> Self {
        let each: Vec<(String, &str, &str)> = profiles
            .iter()
            .map(|p| {
                let cel = selector(&p.selector, Namespace::Read);
                (cel, p.name.as_str(), p.plugin_type.as_str())
            })
            .collect();
        let may_select: Vec<String> = profiles
            .iter()
            .map(|p| selector(&p.selector, Namespace::Assumed))
            .collect();
        let meshes: Vec<(String, &str)> = each.iter().map(|(c, n, _)| (c.clone(), *n)).collect();
        let mut plugins: BTreeMap<&str, Vec<String>> = BTreeMap::new();
        for (c, _, plugin) in &each {
            plugins.entry(plugin).or_default().push(c.clone());
        }
        let plugins: Vec<(String, &str)> = plugins
            .into_iter()
            .map(|(plugin, conds)| (any(&conds), plugin))
            .collect();
        let selected: Vec<String> = each.into_iter().map(|(c, _, _)| c).collect();
        Self {
            may_select: any(&may_select),
            selected: any(&selected),
            meshes: names_where(&meshes),
            plugins: names_where(&plugins),
            message: message(),
        }
    }
}

/// `(a) || (b) || …`; `false` for none.
fn any(conds: &[String]) -> String {
    match conds {
        [] => "false".into(),
        _ => {
            let each: Vec<String> = conds.iter().map(|c| format!("({c})")).collect();
            each.join(" || ")
        }
    }
}

/// The refusal, as `refusal_message` writes it for a pod create, a known pod and a node
/// labelled `false`, with the node's `MeshCNIVerified` reason when it has one.
fn message() -> String {
    let name = "(has(object.metadata.name) && object.metadata.name != '' ? \
                object.metadata.name : object.metadata.generateName)";
    let node = "params.metadata.name";
    let reason = format!(
        "(has(params.status) && has(params.status.conditions) ? \
         params.status.conditions.filter(c, c.type == {ty} && has(c.reason) && c.reason != '')\
         .map(c, {prefix} + c.reason) : []).join('')",
        ty = quote(CONDITION_TYPE),
        prefix = quote(&format!("; condition {CONDITION_TYPE} reason ")),
    );
    let parts = [
        quote("meshgate: pod "),
        "request.namespace".into(),
        quote("/"),
        name.into(),
        quote(" belongs to mesh profile "),
        "variables.meshes".into(),
        quote(", but node "),
        node.into(),
        quote(&format!(
            " is not verified for the mesh CNI chain: it is labelled {VERIFIED_LABEL}=\"false\""
        )),
        reason,
        quote(". Remedy: fix the CNI chain on node "),
        node.into(),
        quote(" so it chains "),
        "variables.plugins".into(),
        quote(" (kubectl describe node "),
        node.into(),
        quote(&format!(
            ": condition {CONDITION_TYPE}){}{CREATE_MEANWHILE}",
            remedy_then()
        )),
    ];
    parts.join(" + ")
}

#[cfg(test)]
mod tests;
