//! Whether the apiserver can call meshgate's webhook: a server-side dry-run of a pod the entry
//! `pods.validate` reviews.
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
//! - `failed calling webhook`, or admitted while the apiserver's count of calls that failed
//!   open (`apiserver_admission_webhook_fail_open_count`, read from its `/metrics` before and
//!   after) rose for one of the configuration's webhooks: `unreachable` (Service, endpoints,
//!   TLS, `caBundle`, network policy: whatever stands between the apiserver and the webhook;
//!   the shipped entries fail open, so an outage admits the probe);
//! - admitted without a word and without a failed call: `not-called` (the namespace is not
//!   governed, or the webhook admits such pods). When `/metrics` cannot be read (RBAC, or
//!   another apiserver of an HA control plane answered), the detail says the two cannot be
//!   told apart.
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
/// Most bytes of the apiserver's `/metrics` scanned (tens of MiB on a large cluster); only
/// one line is held at a time.
const MAX_METRICS_BYTES: usize = 256 * 1024 * 1024;
/// Longest `/metrics` line kept; a longer one is skipped.
const MAX_METRICS_LINE: usize = 64 * 1024;
/// The apiserver's count of webhook calls that failed and were admitted (failurePolicy Ignore).
const FAIL_OPEN_METRIC: &str = "apiserver_admission_webhook_fail_open_count{";
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
    let answer = tokio::time::timeout(args.webhook_timeout, async {
        let before = fail_open_count(client, &hooks).await;
        let mut answer = dry_run(client, &args.probe_namespace, &probe_name).await?;
        if let (Some(before), true) = (before, (200..300).contains(&answer.code)) {
            let after = fail_open_count(client, &hooks).await;
            answer.failed_open = after.map(|after| after > before);
        }
        anyhow::Ok(answer)
    })
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
    /// Whether the apiserver counted a call to one of the webhooks that failed open while the
    /// probe ran; `None` when its `/metrics` could not be read.
    pub failed_open: Option<bool>,
}

/// The sum of `apiserver_admission_webhook_fail_open_count` over `hooks`, from the
/// apiserver's `/metrics`, streamed; `None` when it cannot be read.
async fn fail_open_count(client: &kube::Client, hooks: &[String]) -> Option<f64> {
    let request = http::Request::get("/metrics")
        .body(kube::client::Body::empty())
        .ok()?;
    let response = client.send(request).await.ok()?;
    if !response.status().is_success() {
        return None;
    }
    let mut body = response.into_body();
    let (mut line, mut read, mut sum) = (Vec::new(), 0usize, 0.0);
    while let Some(frame) = body.frame().await {
        let data = frame.ok()?.into_data().unwrap_or_default();
        read += data.len();
        if read > MAX_METRICS_BYTES {
            return None;
        }
        for chunk in data.split_inclusive(|b| *b == b'\n') {
            if line.len() + chunk.len() <= MAX_METRICS_LINE {
                line.extend_from_slice(chunk);
            }
            if chunk.ends_with(b"\n") {
                sum += fail_open_sample(&String::from_utf8_lossy(&line), hooks);
                line.clear();
            }
        }
    }
    Some(sum + fail_open_sample(&String::from_utf8_lossy(&line), hooks))
}

/// The value of one `/metrics` line when it counts fail-opens of one of `hooks`, else 0.
fn fail_open_sample(line: &str, hooks: &[String]) -> f64 {
    if !line.starts_with(FAIL_OPEN_METRIC) {
        return 0.0;
    }
    let ours = hooks
        .iter()
        .any(|h| line.contains(&format!("name=\"{h}\"")));
    match line.trim_end().rsplit(' ').next().map(str::parse::<f64>) {
        Some(Ok(v)) if ours => v,
        _ => 0.0,
    }
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
        failed_open: None,
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
        let not_called = format!(
            "the probe pod was admitted with no word from the webhook: namespace {namespace} is not governed (kube-system, meshgate's, or labelled meshgate.io/ignore=true; choose another with --probe-namespace), or the webhook admits mesh pods on unknown nodes"
        );
        return match answer.failed_open {
            Some(true) => webhook(
                "unreachable",
                "the apiserver could not call the webhook and admitted the probe (its entries fail open): apiserver_admission_webhook_fail_open_count rose",
            ),
            Some(false) => webhook("not-called", not_called),
            None => webhook(
                "not-called",
                format!(
                    "{not_called}; or the apiserver could not call it (its entries fail open): its /metrics, which would tell, could not be read"
                ),
            ),
        };
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
            failed_open: Some(false),
        }
    }

    /// Admitted: failed open when the apiserver counted it so; else not called, saying so
    /// when the count could not be read.
    #[test]
    fn an_admission_is_unreachable_only_when_it_failed_open() {
        let probe = "meshgate-status-probe-1";
        for (failed_open, state, says) in [
            (Some(true), "unreachable", "fail_open_count rose"),
            (Some(false), "not-called", "is not governed"),
            (None, "not-called", "could not be read"),
        ] {
            let a = Answer {
                failed_open,
                ..answer(201, "", &[])
            };
            let w = judge(&a, &hooks(), "default", probe);
            assert_eq!(w.state, state, "{failed_open:?}: {}", w.detail);
            assert!(w.detail.contains(says), "{}", w.detail);
        }
    }

    #[test]
    fn fail_open_samples_are_read_for_our_hooks_only() {
        let ours = "apiserver_admission_webhook_fail_open_count{name=\"pods.validate.meshgate.io\",type=\"validating\"} 3\n";
        let theirs = "apiserver_admission_webhook_fail_open_count{name=\"x.example.com\",type=\"validating\"} 5";
        assert_eq!(fail_open_sample(ours, &hooks()), 3.0);
        assert_eq!(fail_open_sample(theirs, &hooks()), 0.0);
        assert_eq!(
            fail_open_sample(
                "# HELP apiserver_admission_webhook_fail_open_count x",
                &hooks()
            ),
            0.0
        );
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
