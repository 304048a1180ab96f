//! meshgate's webhook wired into a local control plane, as an operator would install it,
//! but on loopback: a test CA and serving certificate (rcgen), and the Validating and
//! Mutating webhook configurations pointing at `https://127.0.0.1:<port>`.
//!
//! In: the API client, the webhook's address, a scope. Out: registered configurations (and a
//! CA that can rotate the serving certificate). Used by the e2e tests and the benchmarks.

use std::path::Path;

use anyhow::Context;
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use kube::Client;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::{Value, json};

use crate::wait::API_TIMEOUT;

/// The namespace meshgate itself runs in; never gated by its own webhook.
pub const MESHGATE_NAMESPACE: &str = "meshgate-system";

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
}

/// The production namespaceSelector (docs/webhook.md), plus the scope label if any.
pub fn namespace_selector(scope: &Scope) -> Value {
    let mut exprs = vec![
        json!({"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system", MESHGATE_NAMESPACE]}),
        json!({"key": "meshgate.io/ignore", "operator": "NotIn", "values": ["true"]}),
    ];
    if let Some((k, v)) = &scope.label {
        exprs.push(json!({"key": k, "operator": "In", "values": [v]}));
    }
    json!({"matchExpressions": exprs})
}

/// Registers `meshgate-<name>` Validating (pods, pods/binding and bindings CREATE, failurePolicy Fail)
/// and Mutating (nodes CREATE, failurePolicy Ignore) webhook configurations for a webhook
/// listening on `https://127.0.0.1:<port>`.
pub async fn register(
    client: &Client,
    name: &str,
    port: u16,
    ca_pem: &str,
    scope: &Scope,
) -> anyhow::Result<()> {
    let ca_bundle = serde_json::to_value(ByteString(ca_pem.as_bytes().to_vec()))?;
    let common = |hook: &str, path: &str| {
        json!({
            "name": hook,
            "clientConfig": {"url": format!("https://127.0.0.1:{port}{path}"), "caBundle": ca_bundle},
            "sideEffects": "None",
            "admissionReviewVersions": ["v1"],
            "timeoutSeconds": 5,
        })
    };
    let mut pods = common("pods.validate.meshgate.io", "/validate");
    pods["rules"] = json!([{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"], "scope": "Namespaced"}]);
    pods["failurePolicy"] = json!("Fail");
    pods["namespaceSelector"] = namespace_selector(scope);
    // Unbound pods are checked when they are bound; skipping them keeps pod creation
    // (Deployments, Jobs) working through a webhook outage.
    pods["matchConditions"] = json!([{"name": "bound-at-creation", "expression": "has(object.spec.nodeName) && object.spec.nodeName != ''"}]);
    let mut bindings = common("bindings.validate.meshgate.io", "/validate");
    // The subresource the scheduler posts and the legacy `bindings` resource, as in
    // manifests/base/webhook-configurations.yaml.
    bindings["rules"] = json!([{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods/binding", "bindings"], "scope": "Namespaced"}]);
    bindings["failurePolicy"] = json!("Fail");
    bindings["namespaceSelector"] = namespace_selector(scope);
    let validating: ValidatingWebhookConfiguration = serde_json::from_value(json!({
        "metadata": {"name": format!("meshgate-{name}")},
        "webhooks": [pods, bindings],
    }))?;

    let mut nodes = common("nodes.mutate.meshgate.io", "/mutate-node");
    nodes["rules"] = json!([{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["nodes"], "scope": "Cluster"}]);
    // Node registration must never depend on the webhook.
    nodes["failurePolicy"] = json!("Ignore");
    nodes["reinvocationPolicy"] = json!("Never");
    if let Some((k, v)) = &scope.label {
        nodes["objectSelector"] = json!({"matchLabels": {k: v}});
    }
    let mutating: MutatingWebhookConfiguration = serde_json::from_value(json!({
        "metadata": {"name": format!("meshgate-{name}")},
        "webhooks": [nodes],
    }))?;

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
