//! The binding path of [`super::decide`] in the apiserver: the JSON Patch of the chart's
//! MutatingAdmissionPolicy `meshgate-placement-affinity`
//! (`templates/placement-affinity.yaml`).
//!
//! In: nothing but meshgate's label [`VERIFIED_LABEL`]. Out: [`patch`], a CEL expression that
//! evaluates to the JSON Patch giving a pod the required node affinity
//! `meshgate.io/cni-verified In ["true"]`, ANDed into every term it already has, or to no
//! patch when the pod is not `variables.selected` or already carries it in every term.
//!
//! Why an affinity: a Binding carries no pod, so no policy can refuse a meshed pod's binding
//! to a gated Node. A pod that tolerates the gate's taint is kept off such a Node only by the
//! webhook's binding review; with this affinity the scheduler itself never picks a Node
//! that is not labelled verified, which is exactly what [`super::decide`] admits. The policy
//! matches only pods that tolerate the gate (the taint keeps the others away), so a running
//! pod's affinity is never something the kubelet can trip on unless it could have run
//! unredirected.
//!
//! The patch reads `object` (the Pod) and `variables.selected` and `variables.terms` ([`TERMS`]: the
//! pod's required node selector terms, `[]` when it has none), and builds the narrowest
//! change: the missing `affinity` or `nodeAffinity`, or `required…` rewritten with the
//! requirement appended to each term, every other field kept.

use super::cel::quote;
use crate::gate::VERIFIED_LABEL;

/// CEL's name for the pod's `spec.affinity` type, as a MutatingAdmissionPolicy declares it.
const AFFINITY: &str = "Object.spec.affinity";
const NODE_AFFINITY: &str = "Object.spec.affinity.nodeAffinity";
const REQUIRED: &str =
    "Object.spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution";
const REQUIRED_PATH: &str =
    "/spec/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution";

/// The value every added requirement has: the one `decide` admits on.
const VERIFIED: &str = "true";

/// Variable `terms`: the pod's required node selector terms, or `[]`.
pub const TERMS: &str = "has(object.spec.affinity) && has(object.spec.affinity.nodeAffinity) && \
     has(object.spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution) \
     ? object.spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution\
     .nodeSelectorTerms : []";

/// The requirement as a typed object.
fn requirement() -> String {
    format!(
        "{REQUIRED}.nodeSelectorTerms.matchExpressions{{key: {}, operator: 'In', values: [{}]}}",
        quote(VERIFIED_LABEL),
        quote(VERIFIED)
    )
}

/// True when the term `t` already requires the label.
fn carries(t: &str) -> String {
    format!(
        "has({t}.matchExpressions) && {t}.matchExpressions.exists(e, e.key == {} && \
         e.operator == 'In' && e.values == [{}])",
        quote(VERIFIED_LABEL),
        quote(VERIFIED)
    )
}

/// `JSONPatch{op: 'add', path, value}`.
fn add(path: &str, value: &str) -> String {
    format!("[JSONPatch{{op: 'add', path: '{path}', value: {value}}}]")
}

/// The mutation's JSON Patch expression.
pub fn patch() -> String {
    let req = requirement();
    // Every term keeps its fields; the requirement is ANDed into each that lacks it (terms
    // are ORed).
    let each_term = format!(
        "variables.terms.map(t, {REQUIRED}.nodeSelectorTerms{{\
         matchExpressions: (has(t.matchExpressions) ? t.matchExpressions : []) + \
         ({} ? [] : [{req}]), \
         ?matchFields: has(t.matchFields) ? optional.of(t.matchFields) : optional.none()}})",
        carries("t")
    );
    let only = format!("[{REQUIRED}.nodeSelectorTerms{{matchExpressions: [{req}]}}]");
    // The terms are always written inside their typed parent: a JSON Patch whose value is a
    // bare list of typed objects panics the v1.35 apiserver ("reflect.Set: value of type
    // *structpb.Struct is not assignable to type *structpb.Value"; tried).
    let required = format!(
        "{REQUIRED}{{nodeSelectorTerms: size(variables.terms) == 0 ? {only} : {each_term}}}"
    );
    let node_affinity =
        format!("{NODE_AFFINITY}{{requiredDuringSchedulingIgnoredDuringExecution: {required}}}");
    let affinity = format!("{AFFINITY}{{nodeAffinity: {node_affinity}}}");
    let done = format!(
        "size(variables.terms) > 0 && variables.terms.all(t, {})",
        carries("t")
    );
    format!(
        "!variables.selected || ({done}) ? [] : \
         !has(object.spec.affinity) ? {} : \
         !has(object.spec.affinity.nodeAffinity) ? {} : {}",
        add("/spec/affinity", &affinity),
        add("/spec/affinity/nodeAffinity", &node_affinity),
        add(REQUIRED_PATH, &required),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_patch_requires_the_verified_label_and_keeps_other_fields() {
        let p = patch();
        assert!(p.starts_with("!variables.selected || "), "{p}");
        assert!(
            p.contains("matchExpressions{key: 'meshgate.io/cni-verified', operator: 'In', values: ['true']}"),
            "{p}"
        );
        assert!(p.contains("?matchFields: has(t.matchFields)"), "{p}");
        // Balanced, or the apiserver's compiler refuses it.
        for (open, close) in [('(', ')'), ('[', ']'), ('{', '}')] {
            assert_eq!(
                p.matches(open).count(),
                p.matches(close).count(),
                "{open}{close} in {p}"
            );
        }
    }
}
