//! meshgate's in-apiserver placement policy (the chart's `templates/placement-policy.yaml`,
//! rendered with its default values and the policy's opt-in on) registered on a local control plane, scoped to one
//! test.
//!
//! In: the control plane, a name and a [`Scope`]. Out: the registered
//! ValidatingAdmissionPolicy and its binding, both named `meshgate-<name>`, with the scope's
//! label added to the binding's namespace selector and to its params' selector, so the
//! policy sees only that test's namespaces and Nodes. Everything else (match conditions,
//! variables, the validation, the failure policy, the params' `cni-verified=false` selector)
//! is as shipped.
//!
//! The same for the affinity policy (`templates/placement-affinity.yaml`), where the control
//! plane serves MutatingAdmissionPolicy: [`register_affinity`] registers it, named
//! `meshgate-<name>-affinity`, its binding scoped by the same namespace label.

use anyhow::Context;
use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use kube::Client;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, PostParams};
use serde_json::{Value, json};

use super::webhook::{Scope, shipped, shipped_with};
use crate::harness::wait::API_TIMEOUT;

/// The placement policy meshgate ships.
pub const SHIPPED: &str = "templates/placement-policy.yaml";
/// The affinity policy meshgate ships where the apiserver serves MutatingAdmissionPolicy.
pub const AFFINITY: &str = "templates/placement-affinity.yaml";

/// The shipped policy and binding, adapted to `name` and `scope`.
pub async fn objects(
    cp: &crate::ControlPlane,
    name: &str,
    scope: &Scope,
) -> anyhow::Result<(ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding)> {
    // Opt-in in the chart: rendered as an operator who turned it on has it.
    let objects = shipped_with(cp, SHIPPED, &["--set", "placementPolicy.enabled=true"]).await?;
    let find = |kind: &str| {
        objects
            .iter()
            .find(|o| o["kind"] == kind)
            .cloned()
            .with_context(|| format!("no {kind} in {SHIPPED}"))
    };
    let full = format!("meshgate-{name}");
    let mut policy = find("ValidatingAdmissionPolicy")?;
    policy["metadata"] = json!({"name": full});
    let mut binding = find("ValidatingAdmissionPolicyBinding")?;
    binding["metadata"] = json!({"name": full});
    binding["spec"]["policyName"] = json!(full);
    if let Some((k, v)) = &scope.label {
        scope_binding(&mut binding, k, v)?;
    }
    Ok((
        serde_json::from_value(policy)?,
        serde_json::from_value(binding)?,
    ))
}

/// Adds `k=v` to the binding's namespace selector and to its params' selector.
fn scope_binding(binding: &mut Value, k: &str, v: &str) -> anyhow::Result<()> {
    let spec = &mut binding["spec"];
    spec["matchResources"]["namespaceSelector"]["matchExpressions"]
        .as_array_mut()
        .context("a shipped binding without namespaceSelector.matchExpressions")?
        .push(json!({"key": k, "operator": "In", "values": [v]}));
    spec["paramRef"]["selector"]["matchLabels"]
        .as_object_mut()
        .context("a shipped binding without paramRef.selector.matchLabels")?
        .insert(k.to_owned(), json!(v));
    Ok(())
}

/// Registers [`objects`] and waits until the policy has been type-checked.
pub async fn register(
    cp: &crate::ControlPlane,
    client: &Client,
    name: &str,
    scope: &Scope,
) -> anyhow::Result<()> {
    let (policy, binding) = objects(cp, name, scope).await?;
    let pp = PostParams::default();
    let p: Api<ValidatingAdmissionPolicy> = Api::all(client.clone());
    tokio::time::timeout(API_TIMEOUT, p.create(&pp, &policy))
        .await
        .context("registering the placement policy")??;
    let b: Api<ValidatingAdmissionPolicyBinding> = Api::all(client.clone());
    tokio::time::timeout(API_TIMEOUT, b.create(&pp, &binding))
        .await
        .context("binding the placement policy")??;
    Ok(())
}

/// The shipped affinity policy and its binding as dynamic objects, named
/// `meshgate-<name>-affinity`, the binding's namespace selector scoped to `scope`; `None` where
/// the chart does not render them for `cp` (it serves no MutatingAdmissionPolicy).
pub async fn affinity_objects(
    cp: &crate::ControlPlane,
    name: &str,
    scope: &Scope,
) -> anyhow::Result<Option<[DynamicObject; 2]>> {
    let objects = shipped(cp, AFFINITY).await?;
    let find = |kind: &str| objects.iter().find(|o| o["kind"] == kind).cloned();
    let (Some(mut policy), Some(mut binding)) = (
        find("MutatingAdmissionPolicy"),
        find("MutatingAdmissionPolicyBinding"),
    ) else {
        return Ok(None);
    };
    let full = format!("meshgate-{name}-affinity");
    policy["metadata"] = json!({"name": full});
    binding["metadata"] = json!({"name": full});
    binding["spec"]["policyName"] = json!(full);
    if let Some((k, v)) = &scope.label {
        binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"]
            .as_array_mut()
            .context("a shipped affinity binding without namespaceSelector.matchExpressions")?
            .push(json!({"key": k, "operator": "In", "values": [v]}));
    }
    Ok(Some([
        serde_json::from_value(policy)?,
        serde_json::from_value(binding)?,
    ]))
}

/// The versions the chart may render the affinity policy in.
const AFFINITY_VERSIONS: [&str; 2] = ["v1", "v1beta1"];

/// The API of a dynamic object's kind (`mutatingadmissionpolicies` or their bindings).
fn dynamic_api(client: &Client, obj: &DynamicObject) -> anyhow::Result<Api<DynamicObject>> {
    let types = obj
        .types
        .as_ref()
        .context("an object without apiVersion and kind")?;
    kind_api(client, &GroupVersionKind::try_from(types)?)
}

/// The API of `gvk`, one of the affinity policy's two kinds.
fn kind_api(client: &Client, gvk: &GroupVersionKind) -> anyhow::Result<Api<DynamicObject>> {
    let plural = match gvk.kind.as_str() {
        "MutatingAdmissionPolicy" => "mutatingadmissionpolicies",
        "MutatingAdmissionPolicyBinding" => "mutatingadmissionpolicybindings",
        other => anyhow::bail!("no resource known for kind {other}"),
    };
    Ok(Api::all_with(
        client.clone(),
        &ApiResource::from_gvk_with_plural(gvk, plural),
    ))
}

/// Registers [`affinity_objects`]; `false` where the chart renders none for `cp`.
pub async fn register_affinity(
    cp: &crate::ControlPlane,
    client: &Client,
    name: &str,
    scope: &Scope,
) -> anyhow::Result<bool> {
    let Some(objects) = affinity_objects(cp, name, scope).await? else {
        return Ok(false);
    };
    for obj in &objects {
        let api = dynamic_api(client, obj)?;
        tokio::time::timeout(API_TIMEOUT, api.create(&PostParams::default(), obj))
            .await
            .context("registering the affinity policy")??;
    }
    Ok(true)
}

/// Deletes what [`register_affinity`] created, binding first, in whichever version it was
/// registered (best effort; the names are known, so nothing is rendered again).
pub async fn unregister_affinity(client: &Client, name: &str) {
    let full = format!("meshgate-{name}-affinity");
    for version in AFFINITY_VERSIONS {
        for kind in ["MutatingAdmissionPolicyBinding", "MutatingAdmissionPolicy"] {
            let gvk = GroupVersionKind::gvk("admissionregistration.k8s.io", version, kind);
            let Ok(api) = kind_api(client, &gvk) else {
                continue;
            };
            let _ = tokio::time::timeout(API_TIMEOUT, api.delete(&full, &DeleteParams::default()))
                .await;
        }
    }
}

/// Deletes what [`register`] created (best effort).
pub async fn unregister(client: &Client, name: &str) {
    let name = format!("meshgate-{name}");
    let dp = DeleteParams::default();
    let b: Api<ValidatingAdmissionPolicyBinding> = Api::all(client.clone());
    let _ = tokio::time::timeout(API_TIMEOUT, b.delete(&name, &dp)).await;
    let p: Api<ValidatingAdmissionPolicy> = Api::all(client.clone());
    let _ = tokio::time::timeout(API_TIMEOUT, p.delete(&name, &dp)).await;
}

#[cfg(test)]
mod tests {
    use meshgate_core::admission::affinity;
    use meshgate_core::admission::cel::PlacementCel;
    use meshgate_core::profile::ProfileSet;

    /// The chart's placement policy carries the expressions meshgate-core generates from the
    /// built-in profiles, so its verdict and its message are the webhook's: a mesh added as
    /// its record alone, or a reworded refusal, fails here until the chart is regenerated.
    /// On failure it prints the expressions the chart should carry.
    /// The chart's affinity policy selects as the placement policy does and carries the patch
    /// meshgate-core generates; on failure it prints what the chart should carry.
    #[test]
    fn the_charts_affinity_policy_is_the_generated_one() {
        let path = crate::harness::paths::repo_root()
            .join("manifests/charts/meshgate")
            .join(super::AFFINITY);
        let text = std::fs::read_to_string(&path).expect("the chart's affinity policy");
        let cel = PlacementCel::of(&ProfileSet::all_builtin());
        let patch = affinity::patch();
        let want = [
            ("may-be-selected", &cel.may_select, 8),
            ("selected", &cel.selected, 8),
            ("terms", &affinity::TERMS.to_owned(), 8),
            ("the JSON Patch", &patch, 10),
        ];
        for (what, expression, indent) in want {
            let line = format!("\n{}{expression}\n", " ".repeat(indent));
            assert!(
                text.contains(&line),
                "{} does not carry the generated {what}; it should read:\n{expression}",
                path.display()
            );
        }
    }

    #[test]
    fn the_charts_placement_policy_is_the_generated_one() {
        let path = crate::harness::paths::repo_root()
            .join("manifests/charts/meshgate")
            .join(super::SHIPPED);
        let text = std::fs::read_to_string(&path).expect("the chart's placement policy");
        let cel = PlacementCel::of(&ProfileSet::all_builtin());
        let want = [
            ("may-be-selected", &cel.may_select),
            ("selected", &cel.selected),
            ("meshes", &cel.meshes),
            ("plugins", &cel.plugins),
            ("messageExpression", &cel.message),
        ];
        for (what, expression) in want {
            assert!(
                text.contains(&format!("\n        {expression}\n")),
                "{} does not carry the generated {what}; it should read:\n{expression}",
                path.display()
            );
        }
    }
}
