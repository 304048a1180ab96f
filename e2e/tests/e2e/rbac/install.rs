//! The chart's install is wired (workloads, caBundles, policies, the NetworkPolicy); the alert
//! rules the chart renders pass promtool.

use super::*;

#[tokio::test]
async fn install_manifests_apply_and_are_wired() -> anyhow::Result<()> {
    let f = fixture().await;
    let client = f.cp.client()?;
    the_agent_runs_on_every_node(f, &client).await?;
    the_webhook_replicas_are_scheduled(&client).await?;
    every_webhook_trusts_the_generated_ca(f, &client).await?;
    the_network_policy_opens_the_named_ports(&client).await?;
    the_policies_type_check(&client).await?;
    Ok(())
}

/// The DaemonSet wants a pod on every node, and got them; the priority class resolved.
async fn the_agent_runs_on_every_node(f: &Fixture, client: &Client) -> anyhow::Result<()> {
    let ds: Api<DaemonSet> = Api::namespaced(client.clone(), NS);
    let desired = poll_until("the DaemonSet to count the 3 nodes", WAIT, || async {
        let s = ds.get(AGENT).await?.status.unwrap_or_default();
        anyhow::Ok((s.desired_number_scheduled == 3).then_some(s.desired_number_scheduled))
    })
    .await?;
    assert_eq!(desired, 3);
    for node in [&f.node_a, &f.node_b, &f.node_c] {
        let pod = scheduled_pod(client, AGENT, Some(node)).await?;
        let spec = pod.spec.context("spec")?;
        assert_eq!(
            spec.priority,
            Some(2_000_001_000),
            "system-node-critical resolved"
        );
        assert_eq!(
            spec.service_account_name.as_deref(),
            Some(AGENT),
            "the agent runs as its own ServiceAccount"
        );
    }
    Ok(())
}

/// The webhook Deployment's two replicas exist and were scheduled despite the node taint.
async fn the_webhook_replicas_are_scheduled(client: &Client) -> anyhow::Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let lp = ListParams::default().labels(&format!("app.kubernetes.io/name={WEBHOOK}"));
    poll_until("2 webhook pods scheduled", WAIT, || async {
        let list = pods.list(&lp).await?.items;
        let bound = list
            .iter()
            .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some())
            .count();
        anyhow::Ok((bound == 2).then_some(()))
    })
    .await?;
    let pdb = Api::<PodDisruptionBudget>::namespaced(client.clone(), NS)
        .get(WEBHOOK)
        .await?;
    assert!(pdb.spec.and_then(|s| s.min_available).is_some());
    let svc = Api::<Service>::namespaced(client.clone(), NS)
        .get(WEBHOOK)
        .await?;
    let port = svc
        .spec
        .and_then(|s| s.ports)
        .and_then(|p| p.into_iter().next())
        .context("service port")?;
    assert_eq!(port.port, 443);
    Ok(())
}

/// Every webhook trusts exactly the CA the chart made (the one in the webhook's Secret).
async fn every_webhook_trusts_the_generated_ca(f: &Fixture, client: &Client) -> anyhow::Result<()> {
    let ca = &f.tls.ca_pem;
    let vwc = Api::<ValidatingWebhookConfiguration>::all(client.clone())
        .get("meshgate")
        .await?;
    let validating = vwc.webhooks.unwrap_or_default();
    let names: Vec<&str> = validating.iter().map(|w| w.name.as_str()).collect();
    assert_eq!(
        names,
        ["pods.validate.meshgate.io", "bindings.validate.meshgate.io"]
    );
    let mwc = Api::<MutatingWebhookConfiguration>::all(client.clone())
        .get("meshgate")
        .await?;
    let mutating = mwc.webhooks.unwrap_or_default();
    assert_eq!(mutating.len(), 1);
    let bundles: Vec<(&str, Option<&Vec<u8>>)> = validating
        .iter()
        .map(|w| {
            (
                w.name.as_str(),
                w.client_config.ca_bundle.as_ref().map(|b| &b.0),
            )
        })
        .chain(mutating.iter().map(|w| {
            (
                w.name.as_str(),
                w.client_config.ca_bundle.as_ref().map(|b| &b.0),
            )
        }))
        .collect();
    for (name, bundle) in bundles {
        assert_eq!(bundle, Some(ca), "caBundle of {name}");
    }
    Ok(())
}

/// The NetworkPolicy selects the webhook's pods, and the ports it opens are the
/// container's named ports: the webhook port (from the control plane) and the admin port.
async fn the_network_policy_opens_the_named_ports(client: &Client) -> anyhow::Result<()> {
    let np = Api::<k8s_openapi::api::networking::v1::NetworkPolicy>::namespaced(client.clone(), NS)
        .get(WEBHOOK)
        .await?;
    let np_spec = np.spec.context("NetworkPolicy spec")?;
    let webhook_pod = scheduled_pod(client, WEBHOOK, None).await?;
    let pod_labels = webhook_pod.metadata.labels.clone().unwrap_or_default();
    let selector = np_spec
        .pod_selector
        .as_ref()
        .and_then(|s| s.match_labels.clone())
        .unwrap_or_default();
    assert!(
        !selector.is_empty() && selector.iter().all(|(k, v)| pod_labels.get(k) == Some(v)),
        "the NetworkPolicy selects the webhook pods: {selector:?} vs {pod_labels:?}"
    );
    assert_eq!(np_spec.policy_types, Some(vec!["Ingress".to_owned()]));
    let container_ports: BTreeSet<String> = webhook_pod
        .spec
        .iter()
        .flat_map(|s| s.containers.iter())
        .flat_map(|c| c.ports.iter().flatten())
        .filter_map(|p| p.name.clone())
        .collect();
    let opened: BTreeSet<String> = np_spec
        .ingress
        .iter()
        .flatten()
        .flat_map(|r| r.ports.iter().flatten())
        .filter_map(|p| match &p.port {
            Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(n)) => {
                Some(n.clone())
            }
            _ => None,
        })
        .collect();
    assert_eq!(
        opened,
        BTreeSet::from(["admin".to_owned(), "https".to_owned()]),
        "the NetworkPolicy opens the webhook and admin ports by name"
    );
    assert!(
        opened.is_subset(&container_ports),
        "{opened:?} vs {container_ports:?}"
    );
    Ok(())
}

/// The policies' CEL type-checks against the real schemas.
async fn the_policies_type_check(client: &Client) -> anyhow::Result<()> {
    for name in [
        "meshgate-agent-own-node",
        "meshgate-agent-own-node-evictions",
        "meshgate-agent-own-events",
        "meshgate-agent-own-pod-events",
        "meshgate-placement",
    ] {
        let vap = Api::<ValidatingAdmissionPolicy>::all(client.clone())
            .get(name)
            .await?;
        let status = vap.status.context("policy status")?;
        let warnings = status
            .type_checking
            .and_then(|t| t.expression_warnings)
            .unwrap_or_default();
        assert!(warnings.is_empty(), "{name}: {warnings:?}");
    }
    Ok(())
}

#[test]
fn alert_rules_pass_promtool() -> anyhow::Result<()> {
    let script = repo_root().join("manifests/charts/monitoring/test.sh");
    let out = Command::new("bash")
        .arg(&script)
        .env("HELM", helm::binary()?)
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.success(),
        "{} failed ({}):\n{stdout}\n{stderr}",
        script.display(),
        out.status
    );
    assert!(stdout.contains("SUCCESS"), "{stdout}");
    Ok(())
}
