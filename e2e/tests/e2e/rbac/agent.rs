//! The agent under its real token: it gates only its own Node, may evict no pod on another
//! node, may write nothing without a node claim, and reads no Secrets.

use super::*;

#[tokio::test]
async fn agent_runs_with_its_token_and_gates_only_its_own_node() -> anyhow::Result<()> {
    let f = fixture().await;
    let admin = f.cp.client()?;
    let nodes: Api<Node> = Api::all(admin.clone());
    let (dirs, _scratch, mut agent) = start_as_the_daemonset_does(f, &admin).await?;
    gated_without_config(f, &nodes, &mut agent).await?;
    verified_once_chained(f, &nodes, &agent, &dirs).await?;
    its_events_are_accepted(f, &admin).await?;
    let as_agent: Api<Node> = Api::all(f.cp.client_for_token(&f.agent_token)?);
    node_b_is_refused(f, &nodes, &as_agent).await?;

    // A hand-made write to its own node passes the policy (dry run): the refusals above are
    // about the node, not the kind of write.
    let own = label_verified_dry_run(&as_agent, &f.node_a).await;
    assert!(own.is_ok(), "{}", describe(&own));
    Ok(())
}

/// The agent exactly as the DaemonSet runs it, with the token bound to its pod on node A.
/// Returns its CNI dirs, its scratch dir (both kept while it runs) and the process.
async fn start_as_the_daemonset_does(
    f: &Fixture,
    admin: &Client,
) -> anyhow::Result<(CniDirs, tempfile::TempDir, Workload)> {
    let ds = Api::<DaemonSet>::namespaced(admin.clone(), NS)
        .get(AGENT)
        .await?;
    let spec = ds
        .spec
        .and_then(|s| s.template.spec)
        .context("pod template")?;
    let dirs = CniDirs::new()?;
    let scratch = tempfile::tempdir()?;
    let host_dirs = BTreeMap::from([
        ("/etc/cni/net.d", dirs.conf.clone()),
        ("/opt/cni/bin", dirs.bin.clone()),
    ]);
    let kubeconfig = f.cp.write_token_kubeconfig("rbac-agent", &f.agent_token)?;
    let agent = Workload::start(
        admin,
        &spec,
        &f.node_a,
        &kubeconfig,
        &host_dirs,
        scratch.path(),
    )
    .await?;
    ensure!(
        agent.mounts.contains_key("/var/run/meshgate"),
        "the state dir is a volume"
    );
    Ok((dirs, scratch, agent))
}

/// No config yet: the node stays gated, and the condition says why.
async fn gated_without_config(
    f: &Fixture,
    nodes: &Api<Node>,
    agent: &mut Workload,
) -> anyhow::Result<()> {
    let gated = poll_until("node A gated with reason NoConfig", WAIT, || async {
        let n = nodes.get(&f.node_a).await?;
        let ok = tainted(&n)
            && label(&n) == Some("false")
            && condition(&n) == Some(("False".into(), "NoConfig".into()));
        anyhow::Ok(ok.then_some(()))
    })
    .await;
    if let Err(e) = gated {
        bail!(
            "{e}; exit: {:?}; agent log:\n{}",
            agent.exited(),
            agent.log()
        );
    }
    Ok(())
}

/// The mesh plugin is chained: the agent's own token untaints its own node. It is ready then.
async fn verified_once_chained(
    f: &Fixture,
    nodes: &Api<Node>,
    agent: &Workload,
    dirs: &CniDirs,
) -> anyhow::Result<()> {
    dirs.config(
        "10-calico-linkerd.conflist",
        &golden("calico-linkerd.conflist")?,
    )?;
    let open = poll_until("node A untainted and verified", WAIT, || async {
        let n = nodes.get(&f.node_a).await?;
        let ok = !tainted(&n)
            && label(&n) == Some("true")
            && condition(&n) == Some(("True".into(), "Verified".into()));
        anyhow::Ok(ok.then_some(()))
    })
    .await;
    if let Err(e) = open {
        bail!("{e}; agent log:\n{}", agent.log());
    }
    let ready = agent.addrs.get("--admin-addr").copied().context("admin")?;
    assert_eq!(http_status(ready, "/ready").await, Some(200));
    Ok(())
}

/// Its Events were accepted (events.k8s.io create under its RBAC).
async fn its_events_are_accepted(f: &Fixture, admin: &Client) -> anyhow::Result<()> {
    let events: Api<Event> = Api::namespaced(admin.clone(), "default");
    let verified_event = poll_until("the CNIChainVerified Event", WAIT, || async {
        let list = events.list(&ListParams::default()).await?;
        anyhow::Ok(list.items.into_iter().find(|e| {
            e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(f.node_a.as_str())
                && e.reason.as_deref() == Some("CNIChainVerified")
        }))
    })
    .await?;
    assert_eq!(
        verified_event.reporting_controller.as_deref(),
        Some("meshgate-agent")
    );
    Ok(())
}

/// The same token is refused node B: the taint, the label, and the condition. Node B keeps
/// all three.
async fn node_b_is_refused(
    f: &Fixture,
    nodes: &Api<Node>,
    as_agent: &Api<Node>,
) -> anyhow::Result<()> {
    let untaint_b = as_agent
        .patch(
            &f.node_b,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"taints": null}})),
        )
        .await;
    assert!(
        refused_by_policy(&untaint_b, "meshgate-agent-own-node"),
        "{}",
        describe(&untaint_b)
    );
    let msg = status_of(&untaint_b)
        .map(|(_, m)| m.to_owned())
        .unwrap_or_default();
    assert!(
        msg.contains(&format!(
            "on node {} may not modify Node {}",
            f.node_a, f.node_b
        )),
        "{msg}"
    );
    let label_b = as_agent
        .patch(
            &f.node_b,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {VERIFIED_LABEL: "true"}}})),
        )
        .await;
    assert!(
        refused_by_policy(&label_b, "meshgate-agent-own-node"),
        "{}",
        describe(&label_b)
    );
    let status_b = as_agent
        .patch_status(
            &f.node_b,
            &PatchParams::default(),
            &Patch::Strategic(json!({"status": {"conditions": [{
                "type": CONDITION_TYPE, "status": "True", "reason": "Verified", "message": "forged"
            }]}})),
        )
        .await;
    assert!(
        refused_by_policy(&status_b, "meshgate-agent-own-node"),
        "{}",
        describe(&status_b)
    );
    let b = nodes.get(&f.node_b).await?;
    assert!(tainted(&b), "node B keeps its taint");
    assert_eq!(label(&b), None);
    assert_eq!(condition(&b), None);
    Ok(())
}

#[tokio::test]
async fn agent_token_cannot_evict_a_pod_on_another_node() -> anyhow::Result<()> {
    let f = fixture().await;
    let admin = f.cp.client()?;
    let ns = exempt_namespace_with_pods(
        &admin,
        "rbac-evict",
        &[("on-a", &f.node_a), ("on-b", &f.node_b)],
    )
    .await?;
    let as_agent: Api<Pod> = Api::namespaced(f.cp.client_for_token(&f.agent_token)?, &ns);
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &ns);

    let foreign = as_agent.evict("on-b", &EvictParams::default()).await;
    assert!(
        refused_by_policy(&foreign, "meshgate-agent-own-node-evictions"),
        "{}",
        describe(&foreign)
    );
    let msg = status_of(&foreign)
        .map(|(_, m)| m.to_owned())
        .unwrap_or_default();
    assert!(
        msg.contains(&format!(
            "may not evict pod {ns}/on-b, which is on node {}",
            f.node_b
        )),
        "{msg}"
    );
    assert!(
        pods.get("on-b")
            .await?
            .metadata
            .deletion_timestamp
            .is_none(),
        "a refused eviction deletes nothing"
    );

    // Its own node's pod: RBAC and the policy both allow it, and the pod is being deleted.
    as_agent
        .evict("on-a", &EvictParams::default())
        .await
        .context("evicting a pod on the agent's own node")?;
    let gone = pods.get_opt("on-a").await?;
    assert!(
        gone.is_none_or(|p| p.metadata.deletion_timestamp.is_some()),
        "the evicted pod is terminating"
    );
    Ok(())
}

#[tokio::test]
async fn agent_token_without_a_node_may_write_nothing() -> anyhow::Result<()> {
    let f = fixture().await;
    let admin = f.cp.client()?;
    let ns = exempt_namespace_with_pods(&admin, "rbac-nonode", &[("on-a", &f.node_a)]).await?;

    // A token of the same ServiceAccount not bound to a pod (like a legacy Secret token).
    let token =
        meshgate_e2e::service_account_token(&admin, NS, AGENT, &TokenOptions::default()).await?;
    let client = f.cp.client_for_token(&token)?;
    let review =
        Api::<k8s_openapi::api::authentication::v1::SelfSubjectReview>::all(client.clone())
            .create(&PostParams::default(), &Default::default())
            .await?;
    let extra = review
        .status
        .and_then(|s| s.user_info)
        .and_then(|u| u.extra)
        .unwrap_or_default();
    assert!(!extra.contains_key(NODE_EXTRA), "{extra:?}");

    let nodes: Api<Node> = Api::all(client.clone());
    let patch = label_verified_dry_run(&nodes, &f.node_a).await;
    assert!(
        refused_by_policy(&patch, "meshgate-agent-own-node"),
        "{}",
        describe(&patch)
    );
    let evict = Api::<Pod>::namespaced(client.clone(), &ns)
        .evict("on-a", &dry_run_eviction())
        .await;
    assert!(
        refused_by_policy(&evict, "meshgate-agent-own-node-evictions"),
        "{}",
        describe(&evict)
    );
    // Not even an Event about node A as the agent of node A.
    let event: Event = serde_json::from_value(json!({
        "metadata": {"generateName": "unbound-"},
        "eventTime": "2026-01-01T00:00:00.000000Z",
        "reportingController": AGENT, "reportingInstance": f.node_a,
        "action": "Probe", "reason": "Probe", "type": "Normal",
        "regarding": {"apiVersion": "v1", "kind": "Node", "name": f.node_a},
    }))?;
    let publish = Api::<Event>::namespaced(client, "default")
        .create(
            &PostParams {
                dry_run: true,
                ..Default::default()
            },
            &event,
        )
        .await;
    assert!(
        refused_by_policy(&publish, "meshgate-agent-own-events"),
        "{}",
        describe(&publish)
    );
    Ok(())
}

#[tokio::test]
async fn agent_token_cannot_read_secrets_and_has_exactly_its_rules() -> anyhow::Result<()> {
    let f = fixture().await;
    let admin = f.cp.client()?;
    let agent = f.cp.client_for_token(&f.agent_token)?;

    let tls_secret = Api::<Secret>::namespaced(admin.clone(), NS)
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .map(|s| s.name_any())
        .find(|n| n.starts_with("meshgate-webhook-tls"))
        .context("the webhook's TLS Secret")?;
    let get = Api::<Secret>::namespaced(agent.clone(), NS)
        .get(&tls_secret)
        .await;
    assert!(refused_by_rbac(&get), "{}", describe(&get));
    let list = Api::<Secret>::all(agent.clone())
        .list(&ListParams::default())
        .await;
    assert!(refused_by_rbac(&list), "{}", describe(&list));
    let sa_token = Api::<ServiceAccount>::namespaced(agent.clone(), NS)
        .create_subresource::<
            k8s_openapi::api::authentication::v1::TokenRequest,
            k8s_openapi::api::authentication::v1::TokenRequest,
        >(
            "token",
            WEBHOOK,
            &PostParams::default(),
            &Default::default(),
        )
        .await;
    assert!(refused_by_rbac(&sa_token), "{}", describe(&sa_token));
    // Namespaces are read (their labels select pods), never written, never read one by one.
    let namespaces = Api::<k8s_openapi::api::core::v1::Namespace>::all(agent.clone());
    let listed = namespaces
        .list_metadata(&ListParams::default().limit(1))
        .await;
    assert!(listed.is_ok(), "{}", describe(&listed));
    let relabel = namespaces
        .patch(
            "default",
            &PatchParams::default().dry_run(),
            &Patch::Merge(json!({"metadata": {"labels": {"istio.io/dataplane-mode": "ambient"}}})),
        )
        .await;
    assert!(refused_by_rbac(&relabel), "{}", describe(&relabel));

    let want = triples(&[
        ("", &["nodes"], &["get", "list", "watch", "patch"]),
        ("", &["nodes/status"], &["patch"]),
        ("", &["pods"], &["list", "watch"]),
        ("", &["namespaces"], &["list", "watch"]),
        ("", &["pods/eviction"], &["create"]),
        ("events.k8s.io", &["events"], &["create", "patch"]),
    ]);
    expect_rules(&agent, &want, &eviction_budget_rules(), "the agent").await?;
    expect_only_the_mode_configmap(&agent).await?;
    Ok(())
}
