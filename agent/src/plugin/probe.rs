//! Whether the apiserver can call meshgate's webhook: a server-side dry-run of a pod the
//! fail-closed entry `pods.validate` must review.
//!
//! In: the configuration's name, the namespace to probe in, a deadline. Out: a
//! `core::status::Webhook`. The probe pod carries labels every built-in mesh's selector
//! selects (read from the profiles, so a new mesh is probed as it is) and names a node that
//! does not exist (`spec.nodeName`), so the shipped configuration sends it to the webhook,
//! which refuses it (the node is not verified). Nothing is stored: with `dryRun=All`
//! the apiserver runs admission and stops, and the webhooks (`sideEffects: None`) are called
//! as for a real create. The answer is read raw, for its status and `Warning` headers:
//! - refused by one of the configuration's webhooks, or admitted with a warning naming the
//!   probe (the webhook's warn mode): `reachable`;
//! - `failed calling webhook`: `unreachable` (Service, endpoints, TLS, `caBundle`, network
//!   policy: whatever stands between the apiserver and the webhook);
//! - admitted without a word: `not-called` (the namespace is not governed, or the webhook
//!   admits such pods);
//! - the configuration absent: `not-installed`; anything else (RBAC, Pod Security, a
//!   timeout): `inconclusive`, with what the apiserver said.

use std::time::Duration;

use http_body_util::{BodyExt, Limited};
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use kube::api::{Api, PostParams};
use meshgate_core::profile::ProfileSet;
use meshgate_core::status::Webhook;
use meshgate_shell::cli::duration;
use serde_json::{Value, json};

use super::{Conn, is_not_found};

/// Most bytes of the apiserver's answer read (a pod or a Status: a few KiB).
const MAX_ANSWER_BYTES: usize = 256 * 1024;
/// The node the probe pod names: a valid name that no node has (`.invalid`, RFC 2606).
pub const PROBE_NODE: &str = "meshgate-status-probe.invalid";

/// The probe's flags.
#[derive(Clone, Debug, clap::Args)]
pub struct ProbeArgs {
    /// The ValidatingWebhookConfiguration meshgate installed.
    #[arg(
        long,
        env = "MESHGATE_WEBHOOK_CONFIGURATION",
        default_value = "meshgate"
    )]
    pub webhook_configuration: String,
    /// Namespace of the dry-run probe pod: one the webhook governs (not kube-system, not
    /// meshgate's, not labelled meshgate.io/ignore=true).
    #[arg(long, env = "MESHGATE_PROBE_NAMESPACE", default_value = "default")]
    pub probe_namespace: String,
    /// Deadline of the probe; above the webhook configuration's timeoutSeconds (5), so an
    /// unreachable webhook is reported as the apiserver words it.
    #[arg(long, env = "MESHGATE_WEBHOOK_TIMEOUT", default_value = "15s", value_parser = duration)]
    pub webhook_timeout: Duration,
    /// Do not probe the webhook (needs no right to create pods).
    #[arg(long, env = "MESHGATE_NO_WEBHOOK_PROBE")]
    pub no_webhook_probe: bool,
}

fn webhook(state: &'static str, detail: impl Into<String>) -> Webhook {
    Webhook {
        state,
        detail: detail.into(),
    }
}

/// Probes the webhook; `None` with `--no-webhook-probe`.
pub async fn run(args: &ProbeArgs, conn: &Conn, client: &kube::Client) -> Option<Webhook> {
    if args.no_webhook_probe {
        return None;
    }
    let api: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let name = &args.webhook_configuration;
    let hooks = match conn
        .call("reading the webhook configuration", api.get(name))
        .await
    {
        Ok(c) => c
            .webhooks
            .unwrap_or_default()
            .into_iter()
            .map(|w| w.name)
            .collect::<Vec<_>>(),
        Err(e) if is_not_found(&e) => {
            return Some(webhook(
                "not-installed",
                format!("no ValidatingWebhookConfiguration {name}"),
            ));
        }
        Err(e) => return Some(webhook("inconclusive", format!("{e:#}"))),
    };
    let probe_name = probe_name();
    let answer = tokio::time::timeout(
        args.webhook_timeout,
        dry_run(client, &args.probe_namespace, &probe_name),
    )
    .await;
    Some(match answer {
        Err(_) => webhook(
            "inconclusive",
            format!(
                "the apiserver did not answer the probe within {:?}",
                args.webhook_timeout
            ),
        ),
        Ok(Err(e)) => webhook("inconclusive", format!("{e:#}")),
        Ok(Ok(answer)) => judge(&answer, &hooks, &args.probe_namespace, &probe_name),
    })
}

/// A name unique enough to be found in a warning (dry-run names are never stored).
fn probe_name() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or_default();
    format!("meshgate-status-probe-{nanos:08x}")
}

/// What the apiserver answered the dry-run.
#[derive(Debug)]
pub struct Answer {
    /// HTTP status.
    pub code: u16,
    /// The Status message, when it refused.
    pub message: String,
    /// `Warning` headers.
    pub warnings: Vec<String>,
}

/// The probe pod: a label set every built-in profile selects, on [`PROBE_NODE`], as Pod
/// Security's `restricted` level admits it.
pub fn probe_pod(name: &str) -> Value {
    probe_pod_of(name, &ProfileSet::all_builtin())
}

/// The probe pod for `profiles`: their selectors' labels, each that takes any value set to
/// `meshgate-status-probe` ([`ProfileSet::labels_selecting_each`]).
fn probe_pod_of(name: &str, profiles: &ProfileSet) -> Value {
    let mut labels = profiles.labels_selecting_each("meshgate-status-probe");
    labels.insert(
        "app.kubernetes.io/name".into(),
        "meshgate-status-probe".into(),
    );
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "nodeName": PROBE_NODE,
            "automountServiceAccountToken": false,
            "securityContext": {"runAsNonRoot": true, "runAsUser": 65532, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "probe", "image": "meshgate.invalid/probe:0",
                "resources": {"requests": {"cpu": "1m", "memory": "1Mi"}, "limits": {"cpu": "1m", "memory": "1Mi"}},
                "securityContext": {"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}},
            }],
        },
    })
}

async fn dry_run(client: &kube::Client, namespace: &str, name: &str) -> anyhow::Result<Answer> {
    let body = serde_json::to_vec(&probe_pod(name))?;
    let params = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let request = kube::core::Request::new(format!("/api/v1/namespaces/{namespace}/pods"))
        .create(&params, body)?
        .map(kube::client::Body::from);
    let response = client.send(request).await?;
    let code = response.status().as_u16();
    let warnings = response
        .headers()
        .get_all(http::header::WARNING)
        .iter()
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .collect();
    let bytes = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
        .collect()
        .await
        .map_err(|e| anyhow::anyhow!("reading the apiserver's answer: {e}"))?
        .to_bytes();
    let message = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|v| v.get("message").and_then(Value::as_str).map(str::to_owned))
        .unwrap_or_default();
    Ok(Answer {
        code,
        message,
        warnings,
    })
}

/// What an answer says about the webhook (see the module's list).
pub fn judge(answer: &Answer, hooks: &[String], namespace: &str, probe: &str) -> Webhook {
    let named = |text: &str, how: &str| {
        hooks
            .iter()
            .find(|h| text.contains(&format!("{how} \"{h}\"")))
    };
    if (200..300).contains(&answer.code) {
        if let Some(w) = answer.warnings.iter().find(|w| w.contains(probe)) {
            return webhook(
                "reachable",
                format!("the webhook admitted the probe with a warning (warn mode): {w}"),
            );
        }
        return webhook(
            "not-called",
            format!(
                "the probe pod was admitted with no word from the webhook: namespace {namespace} is not governed (kube-system, meshgate's, or labelled meshgate.io/ignore=true; choose another with --probe-namespace), or the webhook admits mesh pods on unknown nodes"
            ),
        );
    }
    let text = &answer.message;
    if let Some(h) = named(text, "failed calling webhook") {
        return webhook(
            "unreachable",
            format!("the apiserver could not call {h}: {text}"),
        );
    }
    if let Some(h) = named(text, "admission webhook") {
        return webhook(
            "reachable",
            format!(
                "{h} answered the dry-run probe (refused it, as it must: the probe names no verified node)"
            ),
        );
    }
    webhook(
        "inconclusive",
        format!(
            "the apiserver refused the probe before the webhook (HTTP {}): {text}",
            answer.code
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(code: u16, message: &str, warnings: &[&str]) -> Answer {
        Answer {
            code,
            message: message.into(),
            warnings: warnings.iter().map(|w| w.to_string()).collect(),
        }
    }

    fn hooks() -> Vec<String> {
        vec![
            "pods.validate.meshgate.io".into(),
            "bindings.validate.meshgate.io".into(),
        ]
    }

    #[test]
    fn each_answer_is_judged() {
        let probe = "meshgate-status-probe-1";
        let failed = "Internal error occurred: failed calling webhook \"pods.validate.meshgate.io\": failed to call webhook: Post \"https://meshgate-webhook.meshgate-system.svc:443/validate?timeout=5s\": context deadline exceeded";
        let cases: [(u16, &str, &[&str], &str); 6] = [
            (
                403,
                "admission webhook \"pods.validate.meshgate.io\" denied the request: meshgate: pod default/p ...",
                &[],
                "reachable",
            ),
            (500, failed, &[], "unreachable"),
            // The webhook's warn mode: admitted, with a warning naming the probe.
            (
                201,
                "",
                &["299 - \"meshgate: pod default/meshgate-status-probe-1 would be refused\""],
                "reachable",
            ),
            (201, "", &["299 - \"some other warning\""], "not-called"),
            // Another webhook's refusal, or RBAC's, says nothing about meshgate's.
            (
                403,
                "admission webhook \"pods.validate.example.com\" denied the request",
                &[],
                "inconclusive",
            ),
            (
                403,
                "pods is forbidden: User \"u\" cannot create resource \"pods\"",
                &[],
                "inconclusive",
            ),
        ];
        for (code, message, warnings, want) in cases {
            let w = judge(&answer(code, message, warnings), &hooks(), "default", probe);
            assert_eq!(w.state, want, "{code} {message} {warnings:?}: {}", w.detail);
        }
        let w = judge(&answer(500, failed, &[]), &hooks(), "default", probe);
        assert!(
            w.detail.contains("context deadline exceeded"),
            "{}",
            w.detail
        );
    }

    #[test]
    fn the_probe_pod_matches_the_fail_closed_entry() {
        let pod = probe_pod("p");
        assert_eq!(pod["spec"]["nodeName"], PROBE_NODE);
        assert!(pod["metadata"]["labels"]["linkerd.io/control-plane-ns"].is_string());
        assert_eq!(
            pod["metadata"]["labels"]["security.istio.io/tlsMode"],
            "istio"
        );
    }

    #[test]
    fn the_probe_pod_carries_the_builtin_selectors_labels() {
        let pod = probe_pod("p");
        assert_eq!(
            pod["metadata"]["labels"],
            json!({
                "linkerd.io/control-plane-ns": "meshgate-status-probe",
                "security.istio.io/tlsMode": "istio",
                "istio.io/dataplane-mode": "ambient",
                "app.kubernetes.io/name": "meshgate-status-probe",
            })
        );
    }

    /// A mesh added as its record alone (`core/src/meshes/<mesh>.rs` and its entry in
    /// `meshes::ALL`) is probed as it is: its selector's labels are on the probe pod.
    #[test]
    fn a_new_meshs_labels_are_on_the_probe_pod() {
        use meshgate_core::meshes::Mesh;
        use meshgate_core::profile::{MeshProfile, PodSelector};
        use meshgate_core::rules::expected::{AnnotationDialect, NO_DIALECT};
        fn example() -> MeshProfile {
            MeshProfile {
                name: "example".into(),
                selector: PodSelector {
                    labels: [("example.test/mesh".to_string(), String::new())].into(),
                    ..PodSelector::default()
                },
                plugin_type: "example-cni".into(),
                inbound_port: 4143,
                outbound_port: 4140,
                dual_stack: false,
                annotation_dialect: AnnotationDialect::NONE,
                proxy_containers: Vec::new(),
                node_proxy: None,
            }
        }
        const EXAMPLE: Mesh = Mesh {
            profile: example,
            dialect: &NO_DIALECT,
        };
        let pod = probe_pod_of("p", &ProfileSet::of(&[EXAMPLE]));
        assert_eq!(
            pod["metadata"]["labels"]["example.test/mesh"],
            "meshgate-status-probe"
        );
        assert_eq!(pod["spec"]["nodeName"], PROBE_NODE);
    }
}
