//! The control plane itself behaves like a cluster: versions, Nodes and Leases, taint patches
//! with optimistic concurrency, scheduling around taints, pod status through the status
//! subresource, eviction against PodDisruptionBudgets, kubectl, and ServiceAccount identities.
//! These are the building blocks the agent and webhook e2e tests reuse.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};

use anyhow::{Context, bail, ensure};
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::authentication::v1::SelfSubjectReview;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod, ServiceAccount};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::api::{Api, EvictParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use meshgate_core::gate::DEFAULT_TAINT_KEY as TAINT_KEY;
use meshgate_e2e::harness::wait::poll_until;
use meshgate_e2e::{ControlPlane, NodeSpec, TokenOptions, unique_name};
use serde_json::json;

use crate::{WAIT, cp};

/// The label every node and pod of one test carries, so its Deployments select only its nodes.
const TEST_LABEL: &str = "e2e.meshgate.io/test";

fn api_code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(s) => Some(s.code),
        _ => None,
    }
}

fn taint_keys(node: &Node) -> Vec<String> {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|t| t.key)
        .collect()
}

/// A Deployment of `replicas` pause pods restricted to nodes labelled `TEST_LABEL=group`.
fn deployment(name: &str, group: &str, replicas: i32) -> anyhow::Result<Deployment> {
    Ok(serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": {
            "replicas": replicas,
            "selector": { "matchLabels": { "app": name } },
            "template": {
                "metadata": { "labels": { "app": name } },
                "spec": {
                    "nodeSelector": { TEST_LABEL: group },
                    "terminationGracePeriodSeconds": 30,
                    "containers": [{ "name": "app", "image": "registry.k8s.io/pause:3.10" }]
                }
            }
        }
    }))?)
}

async fn pods_with_label(client: &Client, ns: &str, app: &str) -> anyhow::Result<Vec<Pod>> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    Ok(pods
        .list(&ListParams::default().labels(&format!("app={app}")))
        .await?
        .items)
}

fn node_of(pod: &Pod) -> Option<&str> {
    pod.spec.as_ref()?.node_name.as_deref()
}

fn is_running_ready(pod: &Pod) -> bool {
    let Some(status) = pod.status.as_ref() else {
        return false;
    };
    status.phase.as_deref() == Some("Running")
        && status
            .conditions
            .iter()
            .flatten()
            .any(|c| c.type_ == "Ready" && c.status == "True")
}

#[tokio::test]
async fn version_reports_the_pinned_release() -> anyhow::Result<()> {
    let cp = cp().await;
    let info = cp.client()?.apiserver_version().await?;
    let pinned = meshgate_e2e::kubernetes_version()?;
    assert_eq!(
        info.git_version, pinned,
        "/version must report the release install-deps.sh built"
    );
    assert_eq!(
        format!("v{}.{}", info.major, info.minor),
        pinned.rsplit_once('.').context("version")?.0
    );
    Ok(())
}

#[tokio::test]
async fn registered_node_is_ready_and_its_lease_is_renewed() -> anyhow::Result<()> {
    let cp = cp().await;
    let client = cp.client()?;
    let name = unique_name("cp-lease");
    cp.register_node(&client, &NodeSpec::new(&name).pods(7))
        .await?;

    let node = Api::<Node>::all(client.clone()).get(&name).await?;
    let status = node.status.clone().context("node status")?;
    assert_eq!(status.allocatable.context("allocatable")?["pods"].0, "7");
    let ready = status
        .conditions
        .unwrap_or_default()
        .into_iter()
        .find(|c| c.type_ == "Ready");
    assert_eq!(ready.map(|c| c.status).as_deref(), Some("True"));
    assert!(
        taint_keys(&node).is_empty(),
        "the lifecycle controller lifted its taints: {:?}",
        taint_keys(&node)
    );

    let leases: Api<Lease> = Api::namespaced(client.clone(), "kube-node-lease");
    let first = leases
        .get(&name)
        .await?
        .spec
        .context("lease spec")?
        .renew_time
        .context("renewTime")?;
    // The background renewer runs every 10 s; a new renewTime proves it outlives this call.
    poll_until("the node lease to be renewed", WAIT, || async {
        let renewed = leases.get(&name).await?.spec.and_then(|s| s.renew_time);
        Ok::<_, kube::Error>(renewed.filter(|t| t.0 > first.0))
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn taint_patch_with_stale_resource_version_conflicts_and_retry_succeeds() -> anyhow::Result<()>
{
    let cp = cp().await;
    let client = cp.client()?;
    let name = unique_name("cp-taints");
    cp.register_node(&client, &NodeSpec::new(&name)).await?;
    let nodes: Api<Node> = Api::all(client.clone());
    let pp = PatchParams::default();

    // Writer A: JSON patch guarded by a `test` of the resourceVersion it read. The node
    // lifecycle controller writes the Node too, so A itself may lose a race and retry.
    let mut attempts = 0;
    let stale_rv = loop {
        let read = nodes.get(&name).await?;
        let rv = read.resource_version().context("resourceVersion")?;
        let a = json!([
            { "op": "test", "path": "/metadata/resourceVersion", "value": rv },
            { "op": "add", "path": "/spec/taints", "value": [{ "key": TAINT_KEY, "effect": "NoSchedule" }] }
        ]);
        match nodes
            .patch(&name, &pp, &Patch::<()>::Json(serde_json::from_value(a)?))
            .await
        {
            Ok(_) => break rv,
            Err(e) if api_code(&e) == Some(422) && attempts < 10 => attempts += 1,
            Err(e) => return Err(e.into()),
        }
    };

    // Writer B still holds the old read: a merge patch carrying that resourceVersion is a
    // conflict (409), not a silent overwrite of A's taint.
    let b = |rv: &str, taints: serde_json::Value| json!({ "metadata": { "resourceVersion": rv }, "spec": { "taints": taints } });
    let err = nodes
        .patch(
            &name,
            &pp,
            &Patch::Merge(b(
                &stale_rv,
                json!([{ "key": "writer-b", "effect": "NoSchedule" }]),
            )),
        )
        .await
        .expect_err("a stale merge patch must not apply");
    assert_eq!(api_code(&err), Some(409), "{err}");

    // Writer C uses the JSON-patch test op with the stale version: 422.
    let c = json!([
        { "op": "test", "path": "/metadata/resourceVersion", "value": stale_rv },
        { "op": "replace", "path": "/spec/taints", "value": [] }
    ]);
    let err = nodes
        .patch(&name, &pp, &Patch::<()>::Json(serde_json::from_value(c)?))
        .await
        .expect_err("a failed test op must not apply");
    assert_eq!(api_code(&err), Some(422), "{err}");

    // B retries the read-modify-write on a fresh read and keeps A's taint.
    let fresh = nodes.get(&name).await?;
    let fresh_rv = fresh.resource_version().context("resourceVersion")?;
    assert_ne!(fresh_rv, stale_rv);
    let mut taints = serde_json::to_value(fresh.spec.and_then(|s| s.taints).unwrap_or_default())?;
    taints
        .as_array_mut()
        .context("taints")?
        .push(json!({ "key": "writer-b", "effect": "NoSchedule" }));
    nodes
        .patch(&name, &pp, &Patch::Merge(b(&fresh_rv, taints)))
        .await?;

    let keys = taint_keys(&nodes.get(&name).await?);
    assert_eq!(
        keys,
        vec![TAINT_KEY.to_owned(), "writer-b".to_owned()],
        "no update was lost"
    );
    Ok(())
}

#[tokio::test]
async fn deployment_avoids_the_tainted_node_until_the_taint_is_removed() -> anyhow::Result<()> {
    let cp = cp().await;
    let client = cp.client()?;
    let ns = cp.create_namespace(&client, "cp-sched").await?;
    let group = ns.clone();
    let tainted = unique_name("cp-sched-tainted");
    let clean = unique_name("cp-sched-clean");
    cp.register_node(
        &client,
        &NodeSpec::new(&tainted)
            .label(TEST_LABEL, &group)
            .taint(TAINT_KEY, "NoSchedule"),
    )
    .await?;
    // Room for exactly two pods, so the scheduler must look elsewhere for the rest.
    cp.register_node(
        &client,
        &NodeSpec::new(&clean).label(TEST_LABEL, &group).pods(2),
    )
    .await?;

    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    two_pods_avoid_the_tainted_node(&client, &ns, &group, &deployments, &clean).await?;
    let pending = two_more_pend_on_the_taint(&client, &ns, &deployments).await?;
    they_land_once_it_is_untainted(&client, &ns, &pending, &tainted, &clean).await?;
    Ok(())
}

/// A Deployment of 2 lands both pods on the clean node, avoiding the tainted one.
async fn two_pods_avoid_the_tainted_node(
    client: &Client,
    ns: &str,
    group: &str,
    deployments: &Api<Deployment>,
    clean: &str,
) -> anyhow::Result<()> {
    deployments
        .create(&PostParams::default(), &deployment("web", group, 2)?)
        .await?;
    let placed = poll_until("2 pods scheduled", WAIT, || async {
        let pods = pods_with_label(client, ns, "web").await?;
        let bound: Vec<String> = pods
            .iter()
            .filter_map(|p| node_of(p).map(str::to_owned))
            .collect();
        Ok::<_, anyhow::Error>((pods.len() == 2 && bound.len() == 2).then_some(bound))
    })
    .await?;
    assert!(
        placed.iter().all(|n| *n == clean),
        "pods must avoid the tainted node: {placed:?}"
    );
    Ok(())
}

/// Two more replicas: the clean node is full and the other is tainted, so they stay pending,
/// and the scheduler says a taint is one reason (since 1.33 it no longer names the key).
async fn two_more_pend_on_the_taint(
    client: &Client,
    ns: &str,
    deployments: &Api<Deployment>,
) -> anyhow::Result<Vec<String>> {
    deployments
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "replicas": 4 } })),
        )
        .await?;
    Ok(poll_until(
        "2 pods unschedulable because of the taint",
        WAIT,
        || async {
            let pods = pods_with_label(client, ns, "web").await?;
            let pending: Vec<String> = pods
                .iter()
                .filter(|p| node_of(p).is_none())
                .filter(|p| {
                    let conds = p
                        .status
                        .as_ref()
                        .and_then(|s| s.conditions.clone())
                        .unwrap_or_default();
                    conds.iter().any(|c| {
                        c.type_ == "PodScheduled"
                            && c.reason.as_deref() == Some("Unschedulable")
                            && c.message
                                .as_deref()
                                .is_some_and(|m| m.contains("untolerated taint"))
                    })
                })
                .map(|p| p.name_any())
                .collect();
            Ok::<_, anyhow::Error>((pods.len() == 4 && pending.len() == 2).then_some(pending))
        },
    )
    .await?)
}

/// Once the taint is removed, the pending pods land on that node; the clean node keeps two.
async fn they_land_once_it_is_untainted(
    client: &Client,
    ns: &str,
    pending: &[String],
    tainted: &str,
    clean: &str,
) -> anyhow::Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .patch(
            tainted,
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "taints": null } })),
        )
        .await?;

    let on_tainted = poll_until(
        "the pending pods to land on the untainted node",
        WAIT,
        || async {
            let pods = pods_with_label(client, ns, "web").await?;
            let moved: BTreeSet<String> = pods
                .iter()
                .filter(|p| pending.contains(&p.name_any()) && node_of(p) == Some(tainted))
                .map(|p| p.name_any())
                .collect();
            Ok::<_, anyhow::Error>((moved.len() == 2).then_some(moved))
        },
    )
    .await?;
    assert_eq!(on_tainted.len(), 2);
    let on_clean = pods_with_label(client, ns, "web")
        .await?
        .iter()
        .filter(|p| node_of(p) == Some(clean))
        .count();
    assert_eq!(on_clean, 2);
    Ok(())
}

#[tokio::test]
async fn bound_pod_is_moved_to_running_through_the_status_subresource() -> anyhow::Result<()> {
    let cp = cp().await;
    let client = cp.client()?;
    let ns = cp.create_namespace(&client, "cp-running").await?;
    let node = unique_name("cp-running");
    let node_ip: IpAddr = Ipv4Addr::new(192, 0, 2, 10).into();
    cp.register_node(
        &client,
        &NodeSpec::new(&node)
            .label(TEST_LABEL, &ns)
            .internal_ip(node_ip),
    )
    .await?;

    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": "solo" },
        "spec": {
            "nodeSelector": { TEST_LABEL: ns },
            "containers": [{ "name": "app", "image": "registry.k8s.io/pause:3.10" }]
        }
    }))?;
    pods.create(&PostParams::default(), &pod).await?;
    poll_until("the scheduler to bind the pod", WAIT, || async {
        Ok::<_, kube::Error>(node_of(&pods.get("solo").await?).map(str::to_owned))
    })
    .await?;
    let before = pods.get("solo").await?;
    assert_eq!(
        before.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Pending")
    );

    let pod_ip: IpAddr = Ipv4Addr::new(10, 200, 0, 7).into();
    meshgate_e2e::mark_pod_running(&client, &ns, "solo", pod_ip).await?;

    let after = pods.get("solo").await?;
    assert!(is_running_ready(&after), "{:?}", after.status);
    let status = after.status.context("status")?;
    assert_eq!(status.pod_ip.as_deref(), Some("10.200.0.7"));
    assert_eq!(status.host_ip.as_deref(), Some("192.0.2.10"));
    assert_eq!(
        status
            .container_statuses
            .unwrap_or_default()
            .first()
            .map(|c| c.ready),
        Some(true)
    );
    // The status subresource changes status only: the spec's generation did not move.
    assert_eq!(after.metadata.generation, before.metadata.generation);
    Ok(())
}

#[tokio::test]
async fn eviction_honours_the_pdb_and_the_replicaset_recreates_the_pod() -> anyhow::Result<()> {
    let cp = cp().await;
    let client = cp.client()?;
    let ns = cp.create_namespace(&client, "cp-evict").await?;
    let node = unique_name("cp-evict");
    cp.register_node(&client, &NodeSpec::new(&node).label(TEST_LABEL, &ns))
        .await?;
    let _kubelet = cp.run_pods(
        &node,
        meshgate_e2e::sequential_ips(Ipv4Addr::new(10, 201, 0, 1)),
    );

    Api::<Deployment>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &deployment("guarded", &ns, 2)?)
        .await?;
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), &ns);
    let pdb: PodDisruptionBudget = serde_json::from_value(json!({
        "metadata": { "name": "guarded" },
        "spec": { "minAvailable": 2, "selector": { "matchLabels": { "app": "guarded" } } }
    }))?;
    pdbs.create(&PostParams::default(), &pdb).await?;

    let original = poll_until("2 pods Running and Ready", WAIT, || async {
        let pods = pods_with_label(&client, &ns, "guarded").await?;
        let ready: Vec<Pod> = pods.into_iter().filter(is_running_ready).collect();
        Ok::<_, anyhow::Error>((ready.len() == 2).then_some(ready))
    })
    .await?;
    disruptions_allowed(&pdbs, 0).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let victim = original[0].name_any();
    refused_while_the_pdb_forbids(&pods, &victim).await?;
    pdbs.patch(
        "guarded",
        &PatchParams::default(),
        &Patch::Merge(json!({ "spec": { "minAvailable": 1 } })),
    )
    .await?;
    disruptions_allowed(&pdbs, 1).await?;
    pods.evict(&victim, &EvictParams::default()).await?;

    the_replicaset_replaces_it(&client, &ns, &original, &victim).await
}

/// Waits until the PDB's status, current for its generation with 2 healthy pods, allows
/// `want` disruptions.
async fn disruptions_allowed(pdbs: &Api<PodDisruptionBudget>, want: i32) -> anyhow::Result<()> {
    poll_until(
        &format!("PDB status disruptionsAllowed={want}"),
        WAIT,
        || async {
            let pdb = pdbs.get("guarded").await?;
            let generation = pdb.metadata.generation;
            let status = pdb.status.unwrap_or_default();
            let current = status.observed_generation == generation && status.current_healthy == 2;
            Ok::<_, kube::Error>((current && status.disruptions_allowed == want).then_some(()))
        },
    )
    .await?;
    Ok(())
}

/// While the PDB allows no disruption, evicting `victim` is refused with 429 and deletes
/// nothing.
async fn refused_while_the_pdb_forbids(pods: &Api<Pod>, victim: &str) -> anyhow::Result<()> {
    let err = pods
        .evict(victim, &EvictParams::default())
        .await
        .expect_err("the PDB must refuse");
    assert_eq!(api_code(&err), Some(429), "{err}");
    assert!(
        pods.get(victim)
            .await?
            .metadata
            .deletion_timestamp
            .is_none(),
        "a refused eviction deletes nothing"
    );
    Ok(())
}

/// The evicted pod's ReplicaSet (not a new rollout) replaces it with a Running one.
async fn the_replicaset_replaces_it(
    client: &Client,
    ns: &str,
    original: &[Pod],
    victim: &str,
) -> anyhow::Result<()> {
    let rs_uid = original[0]
        .owner_references()
        .first()
        .map(|o| o.uid.clone())
        .context("owner")?;
    let replacement = poll_until(
        "the ReplicaSet to replace the evicted pod with a Running one",
        WAIT,
        || async {
            let now = pods_with_label(client, ns, "guarded").await?;
            if now.iter().any(|p| p.name_any() == victim) {
                return Ok(None); // the kubelet stand-in has not finalized the deletion yet
            }
            let fresh: Vec<Pod> = now
                .into_iter()
                .filter(|p| {
                    !original.iter().any(|o| o.name_any() == p.name_any()) && is_running_ready(p)
                })
                .collect();
            Ok::<_, anyhow::Error>(fresh.into_iter().next())
        },
    )
    .await?;
    assert_eq!(
        replacement
            .owner_references()
            .first()
            .map(|o| o.uid.clone()),
        Some(rs_uid.clone())
    );
    let rs = Api::<ReplicaSet>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await?;
    assert_eq!(rs.items.len(), 1, "the same ReplicaSet, not a new rollout");
    Ok(())
}

#[tokio::test]
async fn kubectl_describe_node_shows_the_taint() -> anyhow::Result<()> {
    let cp = cp().await;
    let client = cp.client()?;
    let name = unique_name("cp-kubectl");
    cp.register_node(
        &client,
        &NodeSpec::new(&name).taint(TAINT_KEY, "NoSchedule"),
    )
    .await?;

    let version = cp.kubectl(&["version", "--client", "-o", "json"]).await?;
    let version: serde_json::Value = serde_json::from_str(&version)?;
    assert_eq!(
        version["clientVersion"]["gitVersion"],
        cp.version(),
        "the kubectl built with the control plane"
    );

    let out = cp.kubectl(&["describe", "node", &name]).await?;
    let taints = out
        .lines()
        .find(|l| l.starts_with("Taints:"))
        .context("no Taints line")?;
    assert_eq!(
        taints.split_whitespace().nth(1),
        Some(format!("{TAINT_KEY}:NoSchedule").as_str()),
        "{out}"
    );
    Ok(())
}

#[tokio::test]
async fn service_account_token_carries_node_identity_and_rbac_applies() -> anyhow::Result<()> {
    let cp = cp().await;
    let client = cp.client()?;
    let ns = cp.create_namespace(&client, "cp-token").await?;
    let node = unique_name("cp-token");
    cp.register_node(&client, &NodeSpec::new(&node).label(TEST_LABEL, &ns))
        .await?;

    let pod = scheduled_agent_pod(&client, &ns).await?;
    let options = TokenOptions {
        bound_pod: Some(pod),
        ..Default::default()
    };
    let token = meshgate_e2e::service_account_token(&client, &ns, "agent", &options).await?;
    let agent = cp.client_for_token(&token)?;

    the_token_names_its_node_and_pod(&agent, &ns, &node).await?;
    rbac_denies_until_a_binding_allows(&client, agent, &ns, &node).await?;
    the_token_kubeconfig_authenticates(cp, &ns, &token, &node).await
}

/// A pod of ServiceAccount `agent` in `ns`, once the scheduler bound it.
async fn scheduled_agent_pod(client: &Client, ns: &str) -> anyhow::Result<Pod> {
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), ns);
    sas.create(
        &PostParams::default(),
        &serde_json::from_value(json!({ "metadata": { "name": "agent" } }))?,
    )
    .await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": "agent" },
        "spec": {
            "serviceAccountName": "agent",
            "nodeSelector": { TEST_LABEL: ns },
            "containers": [{ "name": "agent", "image": "registry.k8s.io/pause:3.10" }]
        }
    }))?;
    pods.create(&PostParams::default(), &pod).await?;
    Ok(poll_until("the agent pod to be scheduled", WAIT, || async {
        let p = pods.get("agent").await?;
        Ok::<_, kube::Error>(node_of(&p).is_some().then_some(p))
    })
    .await?)
}

/// A token bound to that pod authenticates as the ServiceAccount and carries the pod's
/// node and name.
async fn the_token_names_its_node_and_pod(
    agent: &Client,
    ns: &str,
    node: &str,
) -> anyhow::Result<()> {
    let review: SelfSubjectReview = Api::<SelfSubjectReview>::all(agent.clone())
        .create(&PostParams::default(), &SelfSubjectReview::default())
        .await?;
    let user = review
        .status
        .and_then(|s| s.user_info)
        .context("userInfo")?;
    assert_eq!(
        user.username.as_deref(),
        Some(format!("system:serviceaccount:{ns}:agent").as_str())
    );
    let extra = user.extra.unwrap_or_default();
    assert_eq!(
        extra.get("authentication.kubernetes.io/node-name"),
        Some(&vec![node.to_owned()]),
        "{extra:?}"
    );
    assert_eq!(
        extra.get("authentication.kubernetes.io/pod-name"),
        Some(&vec!["agent".to_owned()])
    );
    Ok(())
}

/// RBAC is enforced: nothing grants this identity access to Nodes until a
/// ClusterRoleBinding does.
async fn rbac_denies_until_a_binding_allows(
    client: &Client,
    agent: Client,
    ns: &str,
    node: &str,
) -> anyhow::Result<()> {
    // RBAC is enforced: nothing grants this identity access to Nodes yet...
    let agent_nodes: Api<Node> = Api::all(agent);
    let err = agent_nodes.get(node).await.expect_err("RBAC must deny");
    assert_eq!(api_code(&err), Some(403), "{err}");

    // ...until a ClusterRoleBinding does.
    let role = format!("{ns}-node-reader");
    Api::<ClusterRole>::all(client.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": { "name": role },
                "rules": [{ "apiGroups": [""], "resources": ["nodes"], "verbs": ["get"] }]
            }))?,
        )
        .await?;
    Api::<ClusterRoleBinding>::all(client.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": { "name": role },
                "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role },
                "subjects": [{ "kind": "ServiceAccount", "name": "agent", "namespace": ns }]
            }))?,
        )
        .await?;
    poll_until("RBAC to allow the agent to read its node", WAIT, || async {
        match agent_nodes.get(node).await {
            Ok(n) => Ok(Some(n)),
            Err(e) if api_code(&e) == Some(403) => Ok(None),
            Err(e) => Err(e),
        }
    })
    .await?;
    Ok(())
}

/// The same token as a kubeconfig file, for processes under test, authenticates and lives in
/// the control plane's directory.
async fn the_token_kubeconfig_authenticates(
    cp: &ControlPlane,
    ns: &str,
    token: &str,
    node: &str,
) -> anyhow::Result<()> {
    let path = cp.write_token_kubeconfig(ns, token)?;
    let from_file = kube::config::Kubeconfig::read_from(&path)?;
    let file_client = Client::try_from(
        kube::Config::from_custom_kubeconfig(from_file, &Default::default()).await?,
    )?;
    if Api::<Node>::all(file_client).get(node).await.is_err() {
        bail!(
            "the token kubeconfig at {} does not authenticate",
            path.display()
        );
    }
    ensure!(
        path.starts_with(cp.dir()),
        "token kubeconfigs live in the control plane's directory"
    );
    Ok(())
}
