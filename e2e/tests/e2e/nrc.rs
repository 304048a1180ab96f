//! The chart's NodeReadinessRule through its lifecycle on a real apiserver, with `helm install`,
//! `helm upgrade` and `helm uninstall` as an operator runs them: an upgrade that changes a field
//! the controller holds immutable replaces the rule instead of being refused, the documented
//! hand-over from condition-only to enforce goes through, and `helm uninstall` deletes the rule
//! after the webhook configuration and the agent DaemonSet.
//!
//! In: the stand-in CRD `e2e/testdata/nrc/nodereadinessrules-crd.yaml` (the controller's own CRD
//! is not in the dependency cache; the stand-in carries the schema facts the chart relies on,
//! immutability included: docs/testing.md), a dedicated control plane (the chart's fail-closed
//! pod webhook, DaemonSet and Node webhook would change what the shared one's tests see). No
//! node-readiness-controller runs: what it does to Nodes is in docs/operations.md, with the
//! version it was seen with; here the test plays its finalizer. Out: pass/fail.

use std::collections::BTreeMap;
use std::fmt::Debug;

use anyhow::{Context as _, bail, ensure};
use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicyBinding, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams, WatchEvent,
    WatchParams,
};
use kube::{Client, Resource, ResourceExt};
use meshgate_core::mode;
use meshgate_e2e::harness::helm;
use meshgate_e2e::harness::paths::repo_root;
use meshgate_e2e::{ControlPlane, Options};
use serde::de::DeserializeOwned;
use serde_json::json;

use crate::WAIT;

/// The stand-in CRD.
const CRD: &str = "e2e/testdata/nrc/nodereadinessrules-crd.yaml";
/// meshgate's namespace, as the chart's defaults name it.
const NS: &str = "meshgate-system";
/// A finalizer standing in for the controller's, which untaints every Node at deletion.
const FINALIZER: &str = "e2e.meshgate.io/node-readiness-controller";

fn rules_api(client: &Client) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("readiness.node.x-k8s.io", "v1alpha1", "NodeReadinessRule");
    Api::all_with(client.clone(), &ApiResource::from_gvk(&gvk))
}

/// Every NodeReadinessRule, by name, with its spec.
async fn rules(client: &Client) -> anyhow::Result<BTreeMap<String, serde_json::Value>> {
    let list = rules_api(client).list(&ListParams::default()).await?;
    Ok(list
        .items
        .into_iter()
        .map(|r| (r.name_any(), r.data["spec"].clone()))
        .collect())
}

/// The one rule there is: (name, spec).
async fn the_rule(client: &Client) -> anyhow::Result<(String, serde_json::Value)> {
    let all = rules(client).await?;
    ensure!(all.len() == 1, "want one NodeReadinessRule, have {all:#?}");
    all.into_iter().next().context("no rule")
}

async fn upgrade(cp: &ControlPlane, set: &str) -> anyhow::Result<()> {
    helm::release(cp, "upgrade", &["--reuse-values", "--set", set], WAIT)
        .await
        .with_context(|| format!("helm upgrade --set {set}"))?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rule_is_replaced_on_an_immutable_change_handed_over_and_uninstalled()
-> anyhow::Result<()> {
    crate::init_logging();
    let cp = ControlPlane::start(Options::default())
        .await
        .context("starting a dedicated control plane")?;
    let crd = repo_root().join(CRD);
    cp.kubectl(&["apply", "-f", crd.to_str().context("path")?])
        .await?;
    cp.kubectl(&[
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/nodereadinessrules.readiness.node.x-k8s.io",
    ])
    .await?;
    // No kubelet runs here, so no hook Job could finish: the uninstall cleanup is off.
    let on = "mode=condition-only,nodeReadinessRule.enabled=true,uninstall.cleanup=false,\
              placementPolicy.enabled=true";
    helm::release(&cp, "install", &["--set", on], WAIT)
        .await
        .context("helm install")?;
    let client = cp.client()?;
    immutable_changes_replace_the_rule(&cp, &client).await?;
    handover_to_enforce(&cp, &client).await?;
    uninstall_deletes_the_rule_with_the_rest(&cp, &client).await
}

/// The stand-in refuses a change of each immutable field in place (422), as the controller's
/// CRD does; `helm upgrade` changing one creates a rule of another name and deletes the old.
async fn immutable_changes_replace_the_rule(
    cp: &ControlPlane,
    client: &Client,
) -> anyhow::Result<()> {
    let (first, spec) = the_rule(client).await?;
    assert_eq!(spec["enforcementMode"], "continuous");
    for change in [
        json!({"spec": {"enforcementMode": "bootstrap-only"}}),
        json!({"spec": {"taint": {"effect": "NoExecute"}}}),
        json!({"spec": {"taint": {"key": "readiness.k8s.io/other"}}}),
    ] {
        let refused = rules_api(client)
            .patch(&first, &PatchParams::default(), &Patch::Merge(&change))
            .await;
        match refused {
            Err(kube::Error::Api(e)) if e.code == 422 && e.message.contains("immutable") => {}
            other => bail!("{change}: want 422 immutable, got {other:?}"),
        }
    }
    let mut seen = vec![first];
    for (set, field, want) in [
        (
            "nodeReadinessRule.enforcementMode=bootstrap-only",
            "/enforcementMode",
            "bootstrap-only",
        ),
        ("taintEffect=NoExecute", "/taint/effect", "NoExecute"),
        (
            "taintKey=readiness.k8s.io/example-mesh-cni",
            "/taint/key",
            "readiness.k8s.io/example-mesh-cni",
        ),
    ] {
        upgrade(cp, set).await?;
        let (name, spec) = the_rule(client).await?;
        assert_eq!(spec.pointer(field), Some(&json!(want)), "{set}: {spec}");
        ensure!(
            !seen.contains(&name),
            "{set}: the rule kept the name {name}"
        );
        seen.push(name);
    }
    // Back to the defaults' fields: the defaults' name again; an upgrade that changes none of
    // them keeps the same object (no delete and create).
    upgrade(
        cp,
        "nodeReadinessRule.enforcementMode=continuous,taintEffect=NoSchedule,\
         taintKey=readiness.k8s.io/meshgate-cni-unverified",
    )
    .await?;
    let (name, _) = the_rule(client).await?;
    assert_eq!(
        name, seen[0],
        "the name is a function of the immutable fields"
    );
    let uid = rules_api(client).get(&name).await?.uid();
    upgrade(cp, "nodeReadinessRule.dryRun=true").await?;
    let (same, spec) = the_rule(client).await?;
    assert_eq!(
        (same.as_str(), &spec["dryRun"]),
        (name.as_str(), &json!(true))
    );
    assert_eq!(
        rules_api(client).get(&name).await?.uid(),
        uid,
        "patched in place"
    );
    upgrade(cp, "nodeReadinessRule.dryRun=false").await
}

/// docs/operations.md's condition-only → enforce: the mode ConfigMap patched to enforce first
/// (the agents take the key over while the rule still holds it), then one `helm upgrade` that
/// says enforce and drops the rule; then the rule back on (condition-only), which needs
/// `--force-conflicts` once.
async fn handover_to_enforce(cp: &ControlPlane, client: &Client) -> anyhow::Result<()> {
    let patch = json!({"data": {mode::KEY: "enforce"}});
    cp.kubectl(&[
        "-n",
        NS,
        "patch",
        "configmap",
        mode::CONFIGMAP,
        "--type",
        "merge",
        "-p",
        &patch.to_string(),
    ])
    .await?;
    // The same value as the patch's: helm's server-side apply shares the field, no conflict.
    upgrade(cp, "mode=enforce,nodeReadinessRule.enabled=false").await?;
    ensure!(rules(client).await?.is_empty(), "the rule is deleted");
    let cm = Api::<ConfigMap>::namespaced(client.clone(), NS)
        .get(mode::CONFIGMAP)
        .await?;
    assert_eq!(
        cm.data
            .unwrap_or_default()
            .get(mode::KEY)
            .map(String::as_str),
        Some("enforce")
    );
    // The patch's field manager still co-owns `mode`: helm 4's next upgrade that changes it
    // conflicts, and goes through with --force-conflicts (docs/operations.md says so).
    let back = "mode=condition-only,nodeReadinessRule.enabled=true";
    let refused = upgrade(cp, back).await.err().context("no conflict")?;
    ensure!(
        format!("{refused:#}").contains("conflict with \"kubectl-patch\""),
        "{refused:#}"
    );
    let args = ["--reuse-values", "--force-conflicts", "--set", back];
    helm::release(cp, "upgrade", &args, WAIT)
        .await
        .with_context(|| format!("helm upgrade --force-conflicts --set {back}"))?;
    Ok(())
}

/// With a finalizer on the rule (the controller's, which untaints every Node), `helm uninstall`
/// marks the rule for deletion after it deleted the webhook configuration and the agent
/// DaemonSet, and in the same burst as the placement policy's binding (helm deletes the kinds
/// it does not know last, by name: NodeReadinessRule before ValidatingAdmissionPolicyBinding);
/// the etcd revision of each deletion, from watches opened before it.
async fn uninstall_deletes_the_rule_with_the_rest(
    cp: &ControlPlane,
    client: &Client,
) -> anyhow::Result<()> {
    let (rule, _) = the_rule(client).await?;
    let finalizers = json!({"metadata": {"finalizers": [FINALIZER]}});
    rules_api(client)
        .patch(&rule, &PatchParams::default(), &Patch::Merge(&finalizers))
        .await?;
    let vwc = Api::<ValidatingWebhookConfiguration>::all(client.clone());
    let before = [
        deleted_at(vwc, "meshgate").await?,
        deleted_at(
            Api::<DaemonSet>::namespaced(client.clone(), NS),
            "meshgate-agent",
        )
        .await?,
    ];
    let vapb = Api::<ValidatingAdmissionPolicyBinding>::all(client.clone());
    let binding = deleted_at(vapb, "meshgate-placement").await?;
    let rule_deleted = deleted_at(rules_api(client), &rule).await?;
    helm::run(
        cp,
        &[
            "uninstall",
            helm::RELEASE,
            "--namespace",
            helm::RELEASE_NAMESPACE,
        ],
        WAIT,
    )
    .await
    .context("helm uninstall")?;
    let (_, rule_rv) = rule_deleted.await??;
    for w in before {
        let (what, rv) = w.await??;
        ensure!(
            rv < rule_rv,
            "{what} deleted at {rv}, after the rule ({rule_rv})"
        );
    }
    let (what, rv) = binding.await??;
    eprintln!("etcd revisions: the rule marked for deletion at {rule_rv}, {what} deleted at {rv}");
    // The controller's finalizer done: the rule goes.
    let none = json!({"metadata": {"finalizers": null}});
    rules_api(client)
        .patch(&rule, &PatchParams::default(), &Patch::Merge(&none))
        .await?;
    ensure!(rules(client).await?.is_empty(), "the rule is left");
    Ok(())
}

type Deletion = tokio::task::JoinHandle<anyhow::Result<(String, u64)>>;

/// Watches `name` from now on, and resolves to the etcd revision (resourceVersion; one etcd
/// backs this apiserver, so revisions order writes across kinds) at which it was deleted or,
/// held by a finalizer, marked for deletion.
async fn deleted_at<K>(api: Api<K>, name: &str) -> anyhow::Result<Deletion>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let what = format!(
        "{} {name}",
        std::any::type_name::<K>()
            .rsplit("::")
            .next()
            .unwrap_or("?")
    );
    let fields = format!("metadata.name={name}");
    let rv = api
        .list(&ListParams::default().fields(&fields))
        .await?
        .metadata
        .resource_version
        .context("list resourceVersion")?;
    let stream = api
        .watch(&WatchParams::default().fields(&fields).timeout(60), &rv)
        .await
        .with_context(|| format!("watching {what}"))?;
    Ok(tokio::spawn(async move {
        let mut stream = stream.boxed();
        while let Some(ev) = stream.try_next().await? {
            let obj = match ev {
                WatchEvent::Deleted(o) => o,
                WatchEvent::Modified(o) if o.meta().deletion_timestamp.is_some() => o,
                _ => continue,
            };
            let rv = obj.resource_version().context("resourceVersion")?;
            return Ok((what, rv.parse()?));
        }
        bail!("{what}: no deletion seen")
    }))
}
