//! Issue 20 item 4 on real nodes: `helm uninstall` is the whole removal. meshgate installed
//! from its chart (`helm install`, the real node's values) gates one real node and verifies
//! another; then one `helm uninstall` leaves no taint, label or condition of meshgate's on any
//! Node, and no webhook configuration, admission policy or binding, RBAC object, namespace,
//! hook object or release record behind.
//!
//! In: root, the node binaries, images and helm `e2e/install-deps.sh` caches, meshgate's
//! image with `kubectl-meshgate` in it (`make` builds it; the chart's post-delete hook runs
//! `kubectl-meshgate cleanup --wait-for-agents`). Out: pass/fail, and the install and
//! uninstall times on stderr. Before the uninstall, `helm test` runs the chart's test hook
//! (`kubectl-meshgate status --webhook-only` in a Pod) against the installed webhook; the
//! uninstall then leaves none of its objects either.

use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
    ValidatingWebhookConfiguration,
};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Namespace, Node, Secret, ServiceAccount};
use k8s_openapi::api::flowcontrol::v1::{FlowSchema, PriorityLevelConfiguration};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::api::{Api, ListParams};
use kube::{Client, Resource, ResourceExt};
use meshgate_core::gate::{
    CONDITION_TYPE, DEFAULT_TAINT_KEY as TAINT_KEY, LEGACY_TAINT_KEY, VERIFIED_LABEL,
};
use meshgate_e2e::ControlPlane;
use meshgate_e2e::harness::helm;
use meshgate_e2e::harness::wait::poll_until;
use meshgate_e2e::real::cluster::{RealCluster, SYSTEM_NAMESPACE};
use meshgate_e2e::real::node::host_residue;
use meshgate_e2e::real::story::istio_cni_kubeconfig;
use meshgate_e2e::sim::node::{gate_condition, tainted, verified_label};
use serde::de::DeserializeOwned;

use crate::real_node::ONE_NODE;

/// The agent's first verdict, or a new one after istio-cni is chained, lands within this.
const VERDICT: Duration = Duration::from_secs(60);
/// `helm test`'s own timeout (the Pod pulls nothing: the image is local) and then some.
const HELM_TEST: Duration = Duration::from_secs(150);
/// meshgate's namespace is gone once its pods have terminated (30 s grace) after the uninstall.
const NAMESPACE_GONE: Duration = Duration::from_secs(120);

#[tokio::test]
async fn helm_uninstall_leaves_nothing_of_meshgate_on_real_nodes() -> anyhow::Result<()> {
    let _one = ONE_NODE.lock().await;
    let cluster = RealCluster::start().await?;
    let cp = cluster.control_plane();
    let client = cp.client()?;
    let verified = cluster.add_node().await?;
    let gated = cluster.add_node().await?;

    let started = Instant::now();
    cluster.install_meshgate().await?;
    eprintln!(
        "helm install from the chart to every meshgate pod Ready on 2 real nodes: {:.1} s",
        started.elapsed().as_secs_f64()
    );
    helm_test(cp).await?;

    // One node verified (label, condition True), the other gated (taint, condition False):
    // every mark meshgate writes is on some Node before the uninstall.
    let ns = cp.create_namespace(&client, "istio").await?;
    let kubeconfig = istio_cni_kubeconfig(cp, &client, &ns).await?;
    verified.install_istio_cni(&kubeconfig, false)?;
    node_reaches(&client, verified.name(), "verified", |n| {
        !tainted(n)
            && verified_label(n) == Some("true")
            && gate_condition(n).is_some_and(|c| c.0 == "True")
    })
    .await?;
    node_reaches(&client, gated.name(), "gated", |n| {
        tainted(n) && gate_condition(n).is_some_and(|c| c.0 == "False")
    })
    .await?;

    let started = Instant::now();
    let out = cluster.uninstall_meshgate().await?;
    eprintln!(
        "helm uninstall, cleanup hook included: {:.1} s\n{out}",
        started.elapsed().as_secs_f64()
    );
    let left = no_marks(&client).await.and(nothing_left(&client).await);
    drop(cluster);
    let residue = host_residue();
    ensure!(residue.is_empty(), "left behind on the host: {residue:?}");
    left
}

/// `helm test`: the chart's test hook, `kubectl-meshgate status --webhook-only` in a Pod, as
/// its own ServiceAccount; it passes with both nodes gated, since the webhook answers. Run
/// before istio-cni is chained: the harness's istio-cni may read pods of its own namespace
/// only, so it fails the sandbox of a Pod in meshgate's.
async fn helm_test(cp: &ControlPlane) -> anyhow::Result<()> {
    let started = Instant::now();
    let tested = helm::run(
        cp,
        &[
            "test",
            helm::RELEASE,
            "--namespace",
            helm::RELEASE_NAMESPACE,
            "--timeout",
            "120s",
        ],
        HELM_TEST,
    )
    .await;
    let tested = match tested {
        Ok(out) => out,
        Err(e) => {
            let pod = cp
                .kubectl(&["-n", SYSTEM_NAMESPACE, "get", "pods,events", "-o", "wide"])
                .await;
            anyhow::bail!("helm test: {e}\nmeshgate's namespace then: {pod:?}");
        }
    };
    // Succeeded: `status --webhook-only` exited 0, which it does only when the probe found
    // the webhook reachable. (Its log is not read here: this apiserver cannot dial the
    // kubelets by node name.)
    eprintln!(
        "helm test: {:.1} s\n{tested}",
        started.elapsed().as_secs_f64()
    );
    ensure!(tested.contains("Succeeded"), "{tested}");
    Ok(())
}

/// No Node carries meshgate's taint, label or condition.
async fn no_marks(client: &Client) -> anyhow::Result<()> {
    for node in Api::<Node>::all(client.clone())
        .list(&ListParams::default())
        .await?
    {
        let name = node.name_any();
        let taints = node
            .spec
            .as_ref()
            .and_then(|s| s.taints.clone())
            .unwrap_or_default();
        ensure!(
            !tainted(&node) && !taints.iter().any(|t| t.key == LEGACY_TAINT_KEY),
            "{name} keeps meshgate's taint ({TAINT_KEY} or {LEGACY_TAINT_KEY}): {taints:?}"
        );
        ensure!(
            verified_label(&node).is_none(),
            "{name} keeps the label {VERIFIED_LABEL}"
        );
        ensure!(
            gate_condition(&node).is_none(),
            "{name} keeps the condition {CONDITION_TYPE}"
        );
    }
    Ok(())
}

/// Polls `name` until `pred` holds, within [`VERDICT`].
async fn node_reaches(
    client: &Client,
    name: &str,
    what: &str,
    pred: impl Fn(&Node) -> bool,
) -> anyhow::Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    poll_until(&format!("node {name} {what}"), VERDICT, || async {
        anyhow::Ok(pred(&nodes.get(name).await?).then_some(()))
    })
    .await?;
    Ok(())
}

/// No object of meshgate's is left: the cluster-wide ones by name, meshgate's namespace (once
/// its pods are gone), the hook's objects and the release's records in the release namespace,
/// and nothing anywhere labelled `app.kubernetes.io/part-of=meshgate`.
async fn nothing_left(client: &Client) -> anyhow::Result<()> {
    absent::<ValidatingWebhookConfiguration>(client, &["meshgate"]).await?;
    absent::<MutatingWebhookConfiguration>(client, &["meshgate"]).await?;
    let policies = [
        "meshgate-agent-own-node",
        "meshgate-agent-own-node-evictions",
        "meshgate-agent-own-events",
        "meshgate-agent-own-pod-events",
        "meshgate-placement",
    ];
    absent::<ValidatingAdmissionPolicy>(client, &policies).await?;
    absent::<ValidatingAdmissionPolicyBinding>(client, &policies).await?;
    let rbac = [
        "meshgate-agent",
        "meshgate-webhook",
        "meshgate-cleanup",
        "meshgate-test",
    ];
    // API Priority and Fairness (templates/flowcontrol.yaml): each schema and its level share
    // a name.
    let apf = ["meshgate-node-writes", "meshgate"];
    absent::<FlowSchema>(client, &apf).await?;
    absent::<PriorityLevelConfiguration>(client, &apf).await?;
    absent::<ClusterRole>(client, &rbac).await?;
    absent::<ClusterRoleBinding>(client, &rbac).await?;
    // The test hook's grant in the probe's namespace.
    absent_in::<Role>(client, "default", &["meshgate-test-probe"]).await?;
    absent_in::<RoleBinding>(client, "default", &["meshgate-test-probe"]).await?;
    let hook = helm::RELEASE_NAMESPACE;
    absent_in::<Job>(client, hook, &["meshgate-cleanup"]).await?;
    absent_in::<ServiceAccount>(client, hook, &["meshgate-cleanup"]).await?;
    let releases: Api<Secret> = Api::namespaced(client.clone(), helm::RELEASE_NAMESPACE);
    let records = releases
        .list(&ListParams::default().labels("owner=helm,name=meshgate"))
        .await?;
    ensure!(records.items.is_empty(), "helm's release records are left");
    let namespaces: Api<Namespace> = Api::all(client.clone());
    poll_until(
        &format!("namespace {SYSTEM_NAMESPACE} gone"),
        NAMESPACE_GONE,
        || async {
            anyhow::Ok(
                namespaces
                    .get_opt(SYSTEM_NAMESPACE)
                    .await?
                    .is_none()
                    .then_some(()),
            )
        },
    )
    .await?;
    let part_of = ListParams::default().labels("app.kubernetes.io/part-of=meshgate");
    for (kind, n) in [
        ("ClusterRole", count::<ClusterRole>(client, &part_of).await?),
        (
            "ServiceAccount",
            count::<ServiceAccount>(client, &part_of).await?,
        ),
        ("Job", count::<Job>(client, &part_of).await?),
        ("Secret", count::<Secret>(client, &part_of).await?),
        (
            "ValidatingWebhookConfiguration",
            count::<ValidatingWebhookConfiguration>(client, &part_of).await?,
        ),
    ] {
        ensure!(n == 0, "{n} {kind}(s) labelled part-of=meshgate are left");
    }
    Ok(())
}

/// Each of the cluster-wide objects `names` of kind `K` is gone.
async fn absent<K>(client: &Client, names: &[&str]) -> anyhow::Result<()>
where
    K: Resource<DynamicType = (), Scope = kube::core::ClusterResourceScope>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug,
{
    gone(Api::<K>::all(client.clone()), names).await
}

/// Each of the objects `names` of kind `K` in `ns` is gone.
async fn absent_in<K>(client: &Client, ns: &str, names: &[&str]) -> anyhow::Result<()>
where
    K: Resource<DynamicType = (), Scope = kube::core::NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug,
{
    gone(Api::<K>::namespaced(client.clone(), ns), names).await
}

/// Each of `names` is missing from `api`.
async fn gone<K>(api: Api<K>, names: &[&str]) -> anyhow::Result<()>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug,
{
    for name in names {
        ensure!(
            api.get_opt(name).await?.is_none(),
            "{} {name} is left",
            K::kind(&())
        );
    }
    Ok(())
}

/// How many objects of kind `K` (in every namespace) `lp` selects.
async fn count<K>(client: &Client, lp: &ListParams) -> anyhow::Result<usize>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug,
{
    let api: Api<K> = Api::all(client.clone());
    Ok(api.list(lp).await.context("listing")?.items.len())
}
