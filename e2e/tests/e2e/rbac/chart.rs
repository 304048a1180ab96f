//! The chart beyond its default install: rendered with every option on (and with an existing
//! Secret) and applied with a server-side dry run against the real apiserver; its
//! self-signed TLS kept across an upgrade; its release kept out of meshgate's own namespace.
//!
//! The test apiserver has no cert-manager or Prometheus Operator CRDs, so their kinds
//! (Issuer, Certificate, PodMonitor, PrometheusRule) cannot be dry-run: they are checked by
//! content here, and the rule by promtool (`alert_rules_pass_promtool`). Everything else the
//! chart renders, hooks included, goes through the apiserver's validation.

use super::*;

/// The values file that turns every option on.
const ALL_ON: &str = "e2e/chart/all-on-values.yaml";
/// API groups served by CRDs the test apiserver does not have.
const CRD_GROUPS: [&str; 2] = ["cert-manager.io/", "monitoring.coreos.com/"];

/// The rendered documents, split into (built-in kinds, CRD kinds).
fn split_rendered(rendered: &str) -> (Vec<String>, Vec<String>) {
    rendered
        .split("\n---\n")
        .filter(|d| d.lines().any(|l| l.starts_with("kind: ")))
        .map(str::to_owned)
        .partition(|d| {
            !CRD_GROUPS
                .iter()
                .any(|g| d.contains(&format!("apiVersion: {g}")))
        })
}

/// The `helm test` hook's ServiceAccount, created for real (no role is bound to it): the
/// ServiceAccount admission plugin looks a Pod's ServiceAccount up in storage, where a dry run
/// of the same apply has not put it, so the test Pod's dry run needs it there first.
async fn test_hook_service_account(f: &Fixture) -> anyhow::Result<()> {
    let api: Api<ServiceAccount> = Api::namespaced(f.cp.client()?, NS);
    let sa = ServiceAccount {
        metadata: ObjectMeta {
            name: Some("meshgate-test".into()),
            ..Default::default()
        },
        ..Default::default()
    };
    match api.create(&PostParams::default(), &sa).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(e).context("creating the test hook's ServiceAccount"),
    }
}

/// `kubectl apply --server-side --dry-run=server` of `docs`: the apiserver validates and
/// admits each one (schemas, strict field validation, admission), and nothing changes.
async fn dry_run(f: &Fixture, label: &str, docs: &[String]) -> anyhow::Result<()> {
    test_hook_service_account(f).await?;
    let path =
        f.cp.dir()
            .join(format!("chart-{}.yaml", label.replace(' ', "-")));
    std::fs::write(&path, docs.join("\n---\n"))?;
    let out =
        f.cp.kubectl(&[
            "apply",
            "--server-side",
            "--force-conflicts",
            "--field-manager=e2e-dry-run",
            "--dry-run=server",
            "-f",
            path.to_str().context("path")?,
        ])
        .await
        .with_context(|| format!("server-side dry run of the chart ({label})"))?;
    let applied = out
        .lines()
        .filter(|l| l.ends_with("(server dry run)"))
        .count();
    assert_eq!(applied, docs.len(), "{label}: every object dry-run:\n{out}");
    Ok(())
}

#[tokio::test]
async fn the_chart_with_every_option_passes_a_server_side_dry_run() -> anyhow::Result<()> {
    let f = fixture().await;
    let all_on = repo_root().join(ALL_ON);
    let all_on = all_on.to_str().context("path")?;

    let defaults = helm::template(&[]).await?;
    let (builtin, crds) = split_rendered(&defaults);
    assert!(crds.is_empty(), "the defaults need no CRD: {crds:?}");
    dry_run(f, "default values", &builtin).await?;

    let rendered = helm::template(&["--values", all_on]).await?;
    let (builtin, crds) = split_rendered(&rendered);
    for want in [
        "kind: NetworkPolicy",
        "name: meshgate-cleanup",
        "helm.sh/hook: test",
        "MESHGATE_IMPERSONATE_NODE: \"true\"",
        "name: meshgate-dashboard",
    ] {
        assert!(
            builtin.iter().any(|d| d.contains(want)),
            "every option on renders {want}"
        );
    }
    ambient_is_on(
        &builtin,
        "MESHGATE_REQUIRE_PLUGINS: \"istio-cni,linkerd-cni\"",
    );
    dry_run(f, "every option on", &builtin).await?;
    the_crd_kinds_are_as_documented(&crds, &builtin);

    // An existing Secret (the fixture's own, with its CA given as tls.caBundle, since
    // `helm template` cannot read the cluster): no Secret of the chart's, the caBundle given.
    let ca = String::from_utf8(f.tls.ca_pem.clone())?;
    let rendered = helm::template(&[
        "--set",
        "tls.mode=existingSecret,tls.secretName=meshgate-webhook-tls",
        "--set-string",
        &format!("tls.caBundle={ca}"),
    ])
    .await?;
    let (builtin, _) = split_rendered(&rendered);
    assert!(!builtin.iter().any(|d| d.contains("kind: Secret")));
    dry_run(f, "existing secret", &builtin).await?;
    Ok(())
}

/// `ambient.enabled`: both components run istio-ambient,istio, the agent requires the
/// ambient plugins (`plugins`, as rendered) and mounts ztunnel's socket directory.
fn ambient_is_on(builtin: &[String], plugins: &str) {
    let doc = |name: &str| {
        builtin
            .iter()
            .find(|d| d.contains("kind: ConfigMap") && d.contains(&format!("name: {name}\n")))
            .unwrap_or_else(|| panic!("no ConfigMap {name}"))
    };
    let profiles = "MESHGATE_PROFILES: \"istio-ambient,istio\"";
    for name in ["meshgate-agent", "meshgate-webhook"] {
        assert!(doc(name).contains(profiles), "{name}: {}", doc(name));
    }
    assert!(
        doc("meshgate-agent").contains(plugins),
        "{}",
        doc("meshgate-agent")
    );
    let agent = builtin
        .iter()
        .find(|d| d.contains("kind: DaemonSet"))
        .expect("the agent DaemonSet");
    assert!(
        agent.contains("mountPath: \"/var/run/ztunnel\"")
            && agent.contains("path: \"/var/run/ztunnel\""),
        "{agent}"
    );
}

/// `ambient.enabled=true` alone: the defaults turned to ambient, with a server-side dry run;
/// and the profiles then set from agent.env are refused.
#[tokio::test]
async fn the_chart_turns_ambient_on_with_one_value() -> anyhow::Result<()> {
    let f = fixture().await;
    let rendered = helm::template(&["--set", "ambient.enabled=true"]).await?;
    let (builtin, _) = split_rendered(&rendered);
    ambient_is_on(&builtin, "MESHGATE_REQUIRE_PLUGINS: \"istio-cni\"");
    dry_run(f, "ambient enabled", &builtin).await?;
    let defaults = helm::template(&[]).await?;
    assert!(!defaults.contains("MESHGATE_PROFILES"), "off by default");
    assert!(!defaults.contains("/var/run/ztunnel"), "off by default");
    let refused = helm::template(&[
        "--set",
        "ambient.enabled=true",
        "--set",
        "agent.env.MESHGATE_PROFILES=istio",
    ])
    .await;
    let err = format!(
        "{:#}",
        refused.expect_err("the chart owns MESHGATE_PROFILES then")
    );
    assert!(err.contains("agent.env.MESHGATE_PROFILES"), "{err}");
    Ok(())
}

/// cert-manager's and the Prometheus Operator's objects, by content (no CRDs here).
fn the_crd_kinds_are_as_documented(crds: &[String], builtin: &[String]) {
    let top = "kind: ";
    let count = |kind: &str| {
        crds.iter()
            .filter(|d| d.lines().any(|l| l.strip_prefix(top) == Some(kind)))
            .count()
    };
    assert_eq!(
        (
            count("Issuer"),
            count("Certificate"),
            count("PodMonitor"),
            count("PrometheusRule")
        ),
        (2, 2, 2, 1),
        "{crds:#?}"
    );
    assert!(
        crds.iter()
            .any(|d| d.contains("secretName: meshgate-webhook-tls\n")
                && d.contains(&format!("- {SERVICE_DNS}\n"))),
        "a Certificate for the Service name into the Secret the Deployment mounts"
    );
    assert!(
        crds.iter()
            .filter(|d| d.contains("monitoring.coreos.com/"))
            .all(|d| d.contains("release: kube-prometheus-stack")),
        "monitoring.labels on every monitoring object"
    );
    let injected = builtin
        .iter()
        .filter(|d| d.contains("cert-manager.io/inject-ca-from: meshgate-system/meshgate-webhook"))
        .count();
    assert_eq!(
        injected, 2,
        "both webhook configurations get the CA injected"
    );
    assert!(
        !builtin.iter().any(|d| d.contains("caBundle:")),
        "with cert-manager the injector, not the chart, writes the caBundles"
    );
}

/// An upgrade keeps the self-signed CA and serving certificate (read back with `lookup`), so
/// the caBundle the apiserver trusts never changes under the running webhook.
#[tokio::test]
async fn an_upgrade_keeps_the_self_signed_certificate() -> anyhow::Result<()> {
    let f = fixture().await;
    helm::release(f.cp, "upgrade", &["--reuse-values"], WAIT)
        .await
        .context("helm upgrade")?;
    let after = Tls::read(&f.cp.client()?).await?;
    let pem = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    assert_eq!(
        pem(&after.ca_pem),
        pem(&f.tls.ca_pem),
        "the CA survives the upgrade"
    );
    assert_eq!(
        pem(&after.cert_pem),
        pem(&f.tls.cert_pem),
        "so does the serving certificate"
    );
    let vwc = Api::<ValidatingWebhookConfiguration>::all(f.cp.client()?)
        .get("meshgate")
        .await?;
    for hook in vwc.webhooks.unwrap_or_default() {
        let bundle = hook.client_config.ca_bundle.map(|b| b.0);
        assert_eq!(
            bundle.as_ref(),
            Some(&f.tls.ca_pem),
            "caBundle of {}",
            hook.name
        );
    }
    Ok(())
}

/// meshgate's namespace is a chart object that `helm uninstall` deletes, so the chart refuses
/// to store its release there (the release would lose its own record during the uninstall).
#[tokio::test]
async fn the_chart_refuses_to_store_its_release_in_meshgates_namespace() -> anyhow::Result<()> {
    let chart = helm::chart();
    let args = [
        "template",
        helm::RELEASE,
        chart.to_str().context("chart path")?,
        "--namespace",
        NS,
    ];
    let err = helm::run_offline(&args)
        .await
        .expect_err("a release in meshgate-system must be refused");
    let msg = err.to_string();
    assert!(
        msg.contains("install the release into another namespace"),
        "{msg}"
    );
    Ok(())
}
