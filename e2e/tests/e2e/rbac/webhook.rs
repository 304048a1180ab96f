//! The webhook under its real token: ready with its caches, serving the generated certificate,
//! and able to write nothing.

use super::*;

#[tokio::test]
async fn webhook_token_reads_what_it_caches_and_writes_nothing() -> anyhow::Result<()> {
    let f = fixture().await;
    let admin = f.cp.client()?;
    let webhook = f.cp.client_for_token(&f.webhook_token)?;
    its_rules_only_read(&webhook).await?;
    every_write_is_refused(f, &admin, &webhook).await?;
    let (_scratch, server) = ready_under_its_token(f, &admin).await?;
    serves_the_generated_certificate(f, &admin, &server).await
}

/// Its effective rules, namespace by namespace, read what it caches and nothing more.
async fn its_rules_only_read(webhook: &Client) -> anyhow::Result<()> {
    let cluster_wide = [
        ("", &["nodes", "pods"][..], &["get", "list", "watch"][..]),
        ("", &["namespaces"], &["list", "watch"]),
    ];
    // In meshgate's namespace only, the agent DaemonSet's placement and the mode ConfigMap.
    let mut in_ns = cluster_wide.to_vec();
    in_ns.push((
        "apps",
        &["daemonsets[meshgate-agent]"],
        &["get", "list", "watch"],
    ));
    let mut own = triples(&in_ns);
    own.extend(mode_reader_rules());
    for (ns, want) in [
        (NS, own),
        ("default", triples(&cluster_wide)),
        ("kube-system", triples(&cluster_wide)),
    ] {
        let have = effective_rules(webhook, ns).await?;
        assert_eq!(have, want, "the webhook's rules in namespace {ns}");
    }
    expect_only_the_mode_configmap(webhook).await?;
    Ok(())
}

/// Every kind of write it might be tempted to make is refused by RBAC (dry runs, so a wrongly
/// granted write would change nothing and still fail the test).
async fn every_write_is_refused(
    f: &Fixture,
    admin: &Client,
    webhook: &Client,
) -> anyhow::Result<()> {
    let dry = PatchParams::default().dry_run();
    let dry_post = PostParams {
        dry_run: true,
        ..Default::default()
    };
    let nodes: Api<Node> = Api::all(webhook.clone());
    let pods: Api<Pod> = Api::namespaced(webhook.clone(), NS);
    let victim = scheduled_pod(admin, AGENT, Some(&f.node_a))
        .await?
        .name_any();
    let mut attempts: Vec<(&str, String, bool)> = Vec::new();
    let r = nodes
        .patch(
            &f.node_a,
            &dry,
            &Patch::Merge(json!({"metadata": {"labels": {VERIFIED_LABEL: "true"}}})),
        )
        .await;
    attempts.push(("patch node", describe(&r), refused_by_rbac(&r)));
    let r = nodes
        .patch_status(
            &f.node_a,
            &dry,
            &Patch::Merge(json!({"status": {"conditions": []}})),
        )
        .await;
    attempts.push(("patch node status", describe(&r), refused_by_rbac(&r)));
    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": "forged" },
        "spec": { "containers": [{ "name": "c", "image": "registry.k8s.io/pause:3.10" }] }
    }))?;
    let r = pods.create(&dry_post, &pod).await;
    attempts.push(("create pod", describe(&r), refused_by_rbac(&r)));
    let r = pods
        .delete(
            &victim,
            &DeleteParams {
                dry_run: true,
                ..Default::default()
            },
        )
        .await;
    attempts.push(("delete pod", describe(&r), refused_by_rbac(&r)));
    let r = pods.evict(&victim, &dry_run_eviction()).await;
    attempts.push(("evict pod", describe(&r), refused_by_rbac(&r)));
    let r = Api::<Secret>::namespaced(webhook.clone(), NS)
        .create(&dry_post, &Secret::default())
        .await;
    attempts.push(("create secret", describe(&r), refused_by_rbac(&r)));
    let event: Event = serde_json::from_value(json!({
        "metadata": { "name": "forged" },
        "eventTime": "2026-01-01T00:00:00.000000Z",
        "reportingController": "meshgate-webhook", "reportingInstance": "x", "action": "x",
        "reason": "x", "type": "Normal"
    }))?;
    let r = Api::<Event>::namespaced(webhook.clone(), NS)
        .create(&dry_post, &event)
        .await;
    attempts.push(("create event", describe(&r), refused_by_rbac(&r)));
    let cm = profiles_configmap(admin).await?;
    let r = Api::<ConfigMap>::namespaced(webhook.clone(), NS)
        .patch(&cm, &dry, &Patch::Merge(json!({"data": {"x": "y"}})))
        .await;
    attempts.push(("patch configmap", describe(&r), refused_by_rbac(&r)));
    let allowed: Vec<_> = attempts.iter().filter(|(_, _, refused)| !refused).collect();
    assert!(
        allowed.is_empty(),
        "writes not refused by RBAC: {allowed:#?}"
    );
    Ok(())
}

/// The name of the chart's profiles ConfigMap.
async fn profiles_configmap(admin: &Client) -> anyhow::Result<String> {
    Api::<ConfigMap>::namespaced(admin.clone(), NS)
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .map(|c| c.name_any())
        .find(|n| n.starts_with("meshgate-profiles"))
        .context("the profiles ConfigMap")
}

/// Enough to work: the webhook as the Deployment runs it, with this token, gets ready (both
/// metadata caches listed under its RBAC) and lists the agent DaemonSet. Returns its scratch
/// directory (kept while it runs) and the process.
async fn ready_under_its_token(
    f: &Fixture,
    admin: &Client,
) -> anyhow::Result<(tempfile::TempDir, Workload)> {
    let deployment = Api::<Deployment>::namespaced(admin.clone(), NS)
        .get(WEBHOOK)
        .await?;
    let spec = deployment
        .spec
        .and_then(|s| s.template.spec)
        .context("pod template")?;
    let scratch = tempfile::tempdir()?;
    let kubeconfig =
        f.cp.write_token_kubeconfig("rbac-webhook", &f.webhook_token)?;
    let mut server = Workload::start(
        admin,
        &spec,
        &f.node_a,
        &kubeconfig,
        &BTreeMap::new(),
        scratch.path(),
    )
    .await?;
    let admin_addr = server.addrs.get("--admin-addr").copied().context("admin")?;
    let ready = poll_until("the webhook to be ready", WAIT, || async {
        anyhow::Ok((http_status(admin_addr, "/ready").await == Some(200)).then_some(()))
    })
    .await;
    if let Err(e) = ready {
        bail!(
            "{e}; exit: {:?}; webhook log:\n{}",
            server.exited(),
            server.log()
        );
    }
    // Its watch of the agent DaemonSet (the field-selected list, then the watch) is allowed.
    let listed = poll_until("the webhook to list the agent DaemonSet", WAIT, || async {
        anyhow::Ok(
            server
                .log()
                .contains("agent DaemonSet listed")
                .then_some(()),
        )
    })
    .await;
    if let Err(e) = listed {
        bail!("{e}; webhook log:\n{}", server.log());
    }
    Ok((scratch, server))
}

/// It serves the Secret's certificate for the Service's DNS name, trusted through the
/// caBundle the apiserver uses.
async fn serves_the_generated_certificate(
    f: &Fixture,
    admin: &Client,
    server: &Workload,
) -> anyhow::Result<()> {
    let vwc = Api::<ValidatingWebhookConfiguration>::all(admin.clone())
        .get("meshgate")
        .await?;
    let bundle = vwc
        .webhooks
        .unwrap_or_default()
        .into_iter()
        .next()
        .and_then(|w| w.client_config.ca_bundle)
        .context("caBundle")?;
    let mut roots = rustls::RootCertStore::empty();
    for der in CertificateDer::pem_slice_iter(&bundle.0) {
        roots.add(der?)?;
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let listen = server.addrs.get("--listen").copied().context("listen")?;
    let tcp = tokio::net::TcpStream::connect(listen).await?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(rustls::pki_types::ServerName::try_from(SERVICE_DNS)?, tcp)
        .await
        .context("TLS handshake as the apiserver makes it")?;
    let presented = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .context("no certificate presented")?
        .to_vec();
    let expected = CertificateDer::pem_slice_iter(&f.tls.cert_pem)
        .next()
        .context("tls.crt")??;
    assert_eq!(
        presented,
        expected.to_vec(),
        "the generated serving certificate"
    );
    Ok(())
}
