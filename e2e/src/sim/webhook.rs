//! meshgate's webhook wired into a local control plane, as an operator would install it,
//! but on loopback: a test CA and serving certificate (rcgen), and the shipped Validating and
//! Mutating webhook configurations (the chart's `templates/webhook-configurations.yaml`,
//! rendered with its default values) pointing at `https://127.0.0.1:<port>`.
//!
//! In: the control plane, the webhook's address, a scope. Out: registered configurations
//! (and a CA that can rotate the serving certificate), and the shipped agent DaemonSet's
//! placement as an API object for the webhook to read. Used by the e2e tests and the
//! benchmarks.

use std::path::Path;

use anyhow::Context;
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::apps::v1::DaemonSet;
use kube::Client;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::{Value, json};

use crate::harness::wait::API_TIMEOUT;

/// A CA that signs loopback serving certificates.
pub struct TestCa {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    pem: String,
    der: Vec<u8>,
}

impl TestCa {
    /// A fresh self-signed CA.
    pub fn new() -> anyhow::Result<Self> {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "meshgate e2e webhook CA");
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let key = rcgen::KeyPair::generate()?;
        let cert = params.self_signed(&key)?;
        Ok(Self {
            pem: cert.pem(),
            der: cert.der().to_vec(),
            issuer: rcgen::Issuer::new(params, key),
        })
    }

    /// The CA certificate (PEM): the webhook configurations' `caBundle`.
    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// The CA certificate (DER), for clients that verify the webhook.
    pub fn der(&self) -> &[u8] {
        &self.der
    }

    /// Issues a serving certificate for 127.0.0.1 and writes the key, then the certificate,
    /// as a rotation tool would; returns the certificate's DER.
    pub fn issue(&self, cert: &Path, key: &Path) -> anyhow::Result<Vec<u8>> {
        let kp = rcgen::KeyPair::generate()?;
        let mut params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])?;
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "meshgate-webhook");
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
        let c = params.signed_by(&kp, &self.issuer)?;
        std::fs::write(key, kp.serialize_pem())
            .with_context(|| format!("writing {}", key.display()))?;
        std::fs::write(cert, c.pem()).with_context(|| format!("writing {}", cert.display()))?;
        Ok(c.der().to_vec())
    }
}

/// Which objects one registration governs.
#[derive(Clone, Debug, Default)]
pub struct Scope {
    /// Also require this namespace label (key, value) for pods, and this object label for
    /// Nodes; `None` governs everything, as in production. Tests sharing a control plane use
    /// it so their webhooks never touch each other's objects.
    pub label: Option<(String, String)>,
    /// Rename each webhook `<x>.meshgate.io` to `<x>.<infix>.meshgate.io`, so the apiserver's
    /// per-webhook metrics (`apiserver_admission_webhook_*{name=...}`) count this
    /// registration's calls alone.
    pub hook_infix: Option<String>,
}

/// The registrations meshgate ships, which every test registers (adapted by [`configurations`]).
pub const SHIPPED: &str = "templates/webhook-configurations.yaml";
/// The agent DaemonSet meshgate ships, whose placement decides which Nodes are gated.
pub const AGENT: &str = "templates/agent.yaml";

/// The objects of the chart's template `template` (relative to the chart), rendered by
/// `helm template` with the chart's defaults for `cp` (its version, and the optional kinds it
/// serves, as `helm install` would see them) and read through kubectl as an operator's
/// `kubectl apply` reads them.
pub(crate) async fn shipped(
    cp: &crate::ControlPlane,
    template: &str,
) -> anyhow::Result<Vec<Value>> {
    shipped_with(cp, template, &[]).await
}

/// [`shipped`], with extra `helm template` arguments (`--set` of an opt-in).
pub(crate) async fn shipped_with(
    cp: &crate::ControlPlane,
    template: &str,
    extra: &[&str],
) -> anyhow::Result<Vec<Value>> {
    let mut args = vec!["--show-only".to_owned(), template.to_owned()];
    args.extend(extra.iter().map(|a| a.to_string()));
    args.extend(crate::harness::helm::api_versions(cp).await?);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let rendered = crate::harness::helm::template(&args)
        .await
        .with_context(|| format!("rendering {template}"))?;
    let file = template.replace(['/', '.'], "-");
    let path = cp
        .dir()
        .join(format!("{file}-{}.yaml", crate::unique_name("r")));
    std::fs::write(&path, rendered).with_context(|| format!("writing {}", path.display()))?;
    let text = cp
        .kubectl(&[
            "create",
            "--dry-run=client",
            "-o",
            "json",
            "-f",
            &path.display().to_string(),
        ])
        .await
        .with_context(|| format!("reading {template}"))?;
    let mut objects = Vec::new();
    for doc in serde_json::Deserializer::from_str(&text).into_iter::<Value>() {
        let doc = doc.context("kubectl's JSON")?;
        match doc.get("items").and_then(Value::as_array) {
            Some(items) if doc["kind"] == "List" => objects.extend(items.iter().cloned()),
            _ => objects.push(doc),
        }
    }
    Ok(objects)
}

/// The shipped Validating and Mutating webhook configurations ([`SHIPPED`], rendered by
/// `helm template` with the chart's defaults and read through kubectl as an operator's
/// `kubectl apply` reads them), adapted to a webhook on
/// `https://127.0.0.1:<port>`: each webhook's `clientConfig` becomes that URL (with the
/// Service's path) and `ca_pem`, the configurations are named `meshgate-<name>`, and `scope`
/// is added (a namespace label to every namespaceSelector, an object label to the Node
/// webhook, the hook infix). Everything else (rules, matchConditions, failure policies,
/// timeouts, the exempt namespaces) is as shipped.
pub async fn configurations(
    cp: &crate::ControlPlane,
    name: &str,
    port: u16,
    ca_pem: &str,
    scope: &Scope,
) -> anyhow::Result<(ValidatingWebhookConfiguration, MutatingWebhookConfiguration)> {
    let objects = shipped(cp, SHIPPED).await?;
    let ca_bundle = serde_json::to_value(ByteString(ca_pem.as_bytes().to_vec()))?;
    let adapt = |kind: &str| -> anyhow::Result<Value> {
        let mut obj = objects
            .iter()
            .find(|o| o["kind"] == kind)
            .cloned()
            .with_context(|| format!("no {kind} in {SHIPPED}"))?;
        obj["metadata"] = json!({"name": format!("meshgate-{name}")});
        let hooks = obj["webhooks"].as_array_mut().context("webhooks")?;
        for hook in hooks {
            adapt_hook(hook, kind, port, &ca_bundle, scope)?;
        }
        Ok(obj)
    };
    let validating = serde_json::from_value(adapt("ValidatingWebhookConfiguration")?)?;
    let mutating = serde_json::from_value(adapt("MutatingWebhookConfiguration")?)?;
    Ok((validating, mutating))
}

/// One webhook of [`configurations`]: URL, CA, scope.
fn adapt_hook(
    hook: &mut Value,
    kind: &str,
    port: u16,
    ca_bundle: &Value,
    scope: &Scope,
) -> anyhow::Result<()> {
    let path = hook["clientConfig"]["service"]["path"]
        .as_str()
        .context("a shipped webhook without a Service path")?
        .to_owned();
    hook["clientConfig"] =
        json!({"url": format!("https://127.0.0.1:{port}{path}"), "caBundle": ca_bundle});
    if let Some(infix) = &scope.hook_infix {
        let name = hook["name"].as_str().context("webhook name")?;
        let base = name
            .strip_suffix(".meshgate.io")
            .with_context(|| format!("webhook {name} not under meshgate.io"))?;
        hook["name"] = json!(format!("{base}.{infix}.meshgate.io"));
    }
    if let Some((k, v)) = &scope.label {
        if kind == "MutatingWebhookConfiguration" {
            // Added to the shipped pre-filter (the agent's nodeSelector), not replacing it.
            let selector = hook["objectSelector"]
                .as_object_mut()
                .context("a shipped Node webhook without objectSelector")?;
            let labels = selector.entry("matchLabels").or_insert_with(|| json!({}));
            labels[k] = json!(v);
        } else {
            let exprs = hook["namespaceSelector"]["matchExpressions"]
                .as_array_mut()
                .context("a shipped pod webhook without namespaceSelector.matchExpressions")?;
            exprs.push(json!({"key": k, "operator": "In", "values": [v]}));
        }
    }
    Ok(())
}

/// The agent DaemonSet meshgate ships (the chart's `templates/agent.yaml`, rendered and read
/// through kubectl),
/// as the webhook's placement sees it, in `namespace`: its pod template keeps the shipped
/// `nodeSelector` (plus `scope`'s label, so the DaemonSet controller makes pods for that
/// test's nodes only), `affinity`, `tolerations` and `hostNetwork`, with one placeholder
/// container and a scheduler that does not run, so its pods are never bound or started.
pub async fn agent_daemonset(
    cp: &crate::ControlPlane,
    namespace: &str,
    scope: &Scope,
) -> anyhow::Result<DaemonSet> {
    let shipped = shipped(cp, AGENT)
        .await?
        .into_iter()
        .find(|o| o["kind"] == "DaemonSet")
        .with_context(|| format!("no DaemonSet in {AGENT}"))?;
    let spec = &shipped["spec"]["template"]["spec"];
    let mut node_selector = spec["nodeSelector"].clone();
    if let Some((k, v)) = &scope.label {
        node_selector[k] = json!(v);
    }
    let labels = &shipped["spec"]["selector"]["matchLabels"];
    Ok(serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": shipped["metadata"]["name"], "namespace": namespace},
        "spec": {"selector": {"matchLabels": labels}, "template": {
            "metadata": {"labels": labels},
            "spec": {
                "nodeSelector": node_selector,
                "affinity": spec["affinity"],
                "tolerations": spec["tolerations"],
                "hostNetwork": spec["hostNetwork"],
                "schedulerName": "meshgate-e2e-nobody",
                "automountServiceAccountToken": false,
                "containers": [{"name": "agent", "image": "registry.invalid/agent:1"}],
            }}}
    }))?)
}

/// Registers [`configurations`] as `meshgate-<name>`.
pub async fn register(
    cp: &crate::ControlPlane,
    client: &Client,
    name: &str,
    port: u16,
    ca_pem: &str,
    scope: &Scope,
) -> anyhow::Result<()> {
    let (validating, mutating) = configurations(cp, name, port, ca_pem, scope).await?;
    let pp = PostParams::default();
    let v: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    tokio::time::timeout(API_TIMEOUT, v.create(&pp, &validating))
        .await
        .context("registering the validating webhook")??;
    let m: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    tokio::time::timeout(API_TIMEOUT, m.create(&pp, &mutating))
        .await
        .context("registering the mutating webhook")??;
    Ok(())
}

/// Deletes what [`register`] created (best effort).
pub async fn unregister(client: &Client, name: &str) {
    let name = format!("meshgate-{name}");
    let dp = DeleteParams::default();
    let v: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let _ = tokio::time::timeout(API_TIMEOUT, v.delete(&name, &dp)).await;
    let m: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let _ = tokio::time::timeout(API_TIMEOUT, m.delete(&name, &dp)).await;
}
