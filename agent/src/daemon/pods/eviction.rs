//! The Eviction API call, and what each outcome means for metrics and the pod's Event.
//!
//! In: a pod (namespace, name, UID) to evict, a client without kube's built-in 429 retry, a
//! deadline; or an [`Outcome`] to report. Out: the classified answer ([`Answer`]), and the
//! `MeshRedirectMissing` Event and metric label for an outcome.
//!
//! The eviction carries a UID precondition, so a pod recreated under the same name (a
//! StatefulSet's) is never evicted in place of the one inspected. The API answers 429 when a
//! PodDisruptionBudget forbids the disruption now, and 500 when several budgets match the
//! pod (the API refuses to choose); both leave the pod running and are retried later.

use std::time::Duration;

use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use k8s_openapi::api::policy::v1::Eviction;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{DeleteOptions, ObjectMeta, Preconditions};
use kube::Resource;
use kube::api::{EvictParams, PostParams};
use kube::core::Request;
use kube::runtime::events::{Event, EventType};
use meshgate_core::evict::SkipWhy;
use meshgate_core::field_manager;
use meshgate_core::{event_note, event_reason};

use super::cluster_budget::Deferral;

/// The API's answer to one eviction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// Accepted: the pod is being deleted.
    Evicted,
    /// 429: a PodDisruptionBudget forbids it now.
    Pdb(String),
    /// 500 naming several PodDisruptionBudgets: the API refuses to choose one.
    MultiplePdbs(String),
    /// 404 / 409: the pod is gone, or another pod now has its name.
    Gone,
    /// Anything else (timeout, connection, other status): retried later.
    Failed(String),
}

/// Classifies the API's answer. Pure.
pub fn classify(result: Result<(), kube::Error>) -> Answer {
    match result {
        Ok(()) => Answer::Evicted,
        Err(kube::Error::Api(s)) => match s.code {
            429 => Answer::Pdb(s.message.clone()),
            // The API's wording: "This pod has more than one PodDisruptionBudget, which the
            // eviction subresource does not support."
            500 if s.message.contains("more than one PodDisruptionBudget") => {
                Answer::MultiplePdbs(s.message.clone())
            }
            404 | 409 => Answer::Gone,
            code => Answer::Failed(format!("HTTP {code}: {}", s.message)),
        },
        Err(e) => Answer::Failed(e.to_string()),
    }
}

/// The `policy/v1` Eviction of `namespace/name`, valid only while the pod has `uid`.
pub fn eviction_body(namespace: &str, name: &str, uid: &str) -> Eviction {
    Eviction {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(namespace.to_owned()),
            ..ObjectMeta::default()
        },
        delete_options: Some(DeleteOptions {
            preconditions: Some(Preconditions {
                uid: Some(uid.to_owned()),
                resource_version: None,
            }),
            ..DeleteOptions::default()
        }),
    }
}

/// Evicts `namespace/name` if it still has `uid`, within `timeout`.
///
/// kube's `Api::<Pod>::evict` would send the delete options under the key `delete_options`,
/// which the API server does not know and drops, and with it the UID precondition. So the
/// request is kube's (URL, method, headers) with the `policy/v1` body put in.
pub async fn evict(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    uid: &str,
    timeout: Duration,
) -> Answer {
    let body = match serde_json::to_vec(&eviction_body(namespace, name, uid)) {
        Ok(b) => b,
        Err(e) => return Answer::Failed(format!("cannot encode the Eviction: {e}")),
    };
    // The eviction is a create of `pods/eviction`: it names the agent's field manager, as
    // every write of the agent does. Only an audit log shows it (the request URI): the
    // apiserver sets the pod's `DisruptionTarget` condition itself, under no field manager.
    let params = EvictParams {
        post_options: PostParams {
            field_manager: Some(field_manager::AGENT.into()),
            ..PostParams::default()
        },
        ..EvictParams::default()
    };
    let request = match Request::new(Pod::url_path(&(), Some(namespace))).evict(name, &params) {
        Ok(r) => r.map(|_| body),
        Err(e) => return Answer::Failed(format!("cannot build the eviction request: {e}")),
    };
    let call = client.request::<kube::core::Status>(request);
    match tokio::time::timeout(timeout, call).await {
        Ok(result) => classify(result.map(|_| ())),
        Err(_) => Answer::Failed(format!("no answer within {timeout:?}")),
    }
}

/// What happened to one pod whose redirects are missing: the subject of its Event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The Eviction API accepted it.
    Evicted,
    /// Not evicted, for a reason `core::evict` (or a 429) gave.
    Skipped(SkipWhy),
    /// The API refused: several PodDisruptionBudgets match the pod.
    MultiplePdbs,
    /// The cluster-wide eviction budget refused (spent, or its ledger unusable).
    ClusterBudget(Deferral),
    /// The call failed; retried later.
    Failed(String),
}

impl Outcome {
    /// The Event's `action`. Distinct per outcome: the Recorder folds repeats of the same
    /// (reason, action) into one Event's series, keeping the first note, so a later
    /// "evicted" must not land in an earlier "blocked" Event.
    pub fn action(&self) -> &'static str {
        match self {
            Outcome::Evicted => "Evict",
            Outcome::Skipped(SkipWhy::Pdb) | Outcome::MultiplePdbs => "EvictBlocked",
            Outcome::Skipped(SkipWhy::RateLimit) => "EvictDeferred",
            Outcome::Skipped(SkipWhy::ClusterBudget) => "EvictDeferredClusterBudget",
            Outcome::ClusterBudget(d) if d.spent => "EvictDeferredClusterBudget",
            Outcome::ClusterBudget(_) => "EvictDeferredNoBudgetLedger",
            Outcome::Skipped(SkipWhy::DryRun) => "DryRun",
            Outcome::Skipped(SkipWhy::Unowned) => "ReportUnowned",
            Outcome::Skipped(SkipWhy::NoEvict) => "ReportOnly",
            Outcome::Skipped(SkipWhy::AlreadyEvicted | SkipWhy::Unknown) => "Report",
            Outcome::Skipped(SkipWhy::NoProxy) => "ReportNoProxy",
            Outcome::Skipped(SkipWhy::NodeProxyNotReady) => "ReportNodeProxyNotReady",
            Outcome::Skipped(SkipWhy::Report) => "WouldEvict",
            Outcome::Failed(_) => "EvictFailed",
        }
    }

    /// The `why` label of `meshgate_evictions_skipped_total`, if the contract counts it.
    /// Several matching budgets are a PDB refusal too.
    pub fn skip_label(&self) -> Option<&'static str> {
        match self {
            Outcome::Skipped(why) => why.metric_label(),
            Outcome::MultiplePdbs => SkipWhy::Pdb.metric_label(),
            Outcome::ClusterBudget(_) => SkipWhy::ClusterBudget.metric_label(),
            Outcome::Evicted | Outcome::Failed(_) => None,
        }
    }

    /// What was done, for the Event note and logs.
    pub fn describe(&self, per_minute: u32) -> String {
        match self {
            Outcome::Evicted => {
                "evicted, so that its controller recreates it on a verified node".into()
            }
            Outcome::Skipped(SkipWhy::Pdb) => {
                "not evicted: blocked by a PodDisruptionBudget; retrying with backoff".into()
            }
            Outcome::MultiplePdbs => {
                "not evicted: blocked, more than one PodDisruptionBudget matches the pod (the Eviction API refuses); retrying with backoff".into()
            }
            Outcome::Skipped(SkipWhy::RateLimit) => format!(
                "eviction deferred by the node's rate limit ({per_minute} per minute)"
            ),
            Outcome::Skipped(SkipWhy::ClusterBudget) => {
                "eviction deferred by the cluster-wide eviction budget".into()
            }
            Outcome::ClusterBudget(d) if d.spent => format!(
                "eviction deferred: {} (--cluster-eviction-budget); retried when the window has room",
                d.why
            ),
            Outcome::ClusterBudget(d) => format!(
                "eviction deferred: {}; nothing is evicted without the cluster-wide budget (--cluster-eviction-budget); retrying with backoff",
                d.why
            ),
            Outcome::Skipped(SkipWhy::DryRun) => "dry-run: would be evicted".into(),
            Outcome::Skipped(SkipWhy::Report) => {
                "report mode: would evict it (the mode enforce evicts it)".into()
            }
            Outcome::Skipped(SkipWhy::Unowned) => {
                "not evicted: skipped as unowned, no controller would recreate it (--evict-unowned evicts it)".into()
            }
            Outcome::Skipped(SkipWhy::NoEvict) => "report only (--no-evict): not evicted".into(),
            Outcome::Skipped(SkipWhy::NoProxy) => {
                "not evicted: the pod carries the mesh's label but runs no proxy container of the mesh, so it is not the mesh's to evict (a recreated pod would be the same); fix its injection or its labels".into()
            }
            Outcome::Skipped(SkipWhy::NodeProxyNotReady) => {
                "not evicted while the node proxy is not ready on this node (its restart closes its listeners in every pod); inspected again once the node is verified".into()
            }
            Outcome::Skipped(w @ (SkipWhy::AlreadyEvicted | SkipWhy::Unknown)) => {
                format!("not evicted: {w}")
            }
            Outcome::Failed(e) => format!("eviction failed ({e}); retrying with backoff"),
        }
    }

    /// The pod's `MeshRedirectMissing` Warning Event.
    pub fn event(&self, summary: &str, per_minute: u32) -> Event {
        Event {
            type_: EventType::Warning,
            reason: event_reason::REDIRECT_MISSING.to_string(),
            note: Some(event_note(&format!(
                "{summary}; {}",
                self.describe(per_minute)
            ))),
            action: self.action().to_string(),
            secondary: None,
        }
    }
}

/// The Event's `regarding` reference to a pod.
pub fn pod_reference(namespace: &str, name: &str, uid: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        namespace: Some(namespace.into()),
        name: Some(name.into()),
        uid: Some(uid.into()),
        ..ObjectReference::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api_error(code: u16, message: &str) -> kube::Error {
        kube::Error::Api(Box::new(kube::core::Status {
            code,
            message: message.into(),
            ..kube::core::Status::default()
        }))
    }

    #[test]
    fn answers_are_classified() {
        assert_eq!(classify(Ok(())), Answer::Evicted);
        assert!(matches!(
            classify(Err(api_error(
                429,
                "Cannot evict pod as it would violate the pod's disruption budget."
            ))),
            Answer::Pdb(m) if m.contains("disruption budget")
        ));
        assert!(matches!(
            classify(Err(api_error(
                500,
                "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support."
            ))),
            Answer::MultiplePdbs(_)
        ));
        assert!(matches!(
            classify(Err(api_error(500, "etcd is down"))),
            Answer::Failed(m) if m.contains("500")
        ));
        assert_eq!(classify(Err(api_error(404, "not found"))), Answer::Gone);
        assert_eq!(classify(Err(api_error(409, "uid mismatch"))), Answer::Gone);
    }

    #[test]
    fn every_outcome_has_its_own_action_and_the_contract_label() {
        let outcomes = [
            Outcome::Evicted,
            Outcome::Skipped(SkipWhy::Pdb),
            Outcome::Skipped(SkipWhy::RateLimit),
            Outcome::Skipped(SkipWhy::DryRun),
            Outcome::Skipped(SkipWhy::Unowned),
            Outcome::Skipped(SkipWhy::NoEvict),
            Outcome::Skipped(SkipWhy::NoProxy),
            Outcome::ClusterBudget(Deferral {
                spent: true,
                why: "spent".into(),
            }),
            Outcome::ClusterBudget(Deferral {
                spent: false,
                why: "no ledger".into(),
            }),
            Outcome::Failed("x".into()),
        ];
        let actions: std::collections::BTreeSet<_> = outcomes.iter().map(|o| o.action()).collect();
        assert_eq!(actions.len(), outcomes.len());
        assert_eq!(Outcome::MultiplePdbs.skip_label(), Some("pdb"));
        assert_eq!(Outcome::Skipped(SkipWhy::Pdb).skip_label(), Some("pdb"));
        assert_eq!(Outcome::Skipped(SkipWhy::NoEvict).skip_label(), None);
        assert_eq!(Outcome::Evicted.skip_label(), None);
        assert_eq!(
            Outcome::ClusterBudget(Deferral {
                spent: true,
                why: "spent".into()
            })
            .skip_label(),
            Some("cluster_budget")
        );
    }

    #[test]
    fn event_notes_say_what_was_done() {
        let s = "linkerd redirects missing: no inbound TCP redirect to port 4143";
        for (o, word) in [
            (Outcome::Evicted, "evicted"),
            (Outcome::Skipped(SkipWhy::DryRun), "dry-run"),
            (
                Outcome::Skipped(SkipWhy::Pdb),
                "blocked by a PodDisruptionBudget",
            ),
            (Outcome::MultiplePdbs, "more than one PodDisruptionBudget"),
            (Outcome::Skipped(SkipWhy::Unowned), "skipped as unowned"),
            (Outcome::Skipped(SkipWhy::NoEvict), "report only"),
            (Outcome::Skipped(SkipWhy::RateLimit), "2 per minute"),
            (
                Outcome::Skipped(SkipWhy::NoProxy),
                "runs no proxy container of the mesh",
            ),
        ] {
            let e = o.event(s, 2);
            assert_eq!(e.reason, "MeshRedirectMissing");
            assert_eq!(e.type_, EventType::Warning);
            let note = e.note.unwrap_or_default();
            assert!(note.starts_with(s) && note.contains(word), "{note}");
        }
        let long = "x".repeat(2000);
        let note = Outcome::Evicted.event(&long, 1).note.unwrap_or_default();
        assert!(note.len() <= 1024 && note.ends_with('…'));
    }

    /// The request the agent sends: POST pods/<name>/eviction with a UID precondition; and a
    /// 429 from the API comes back as a PDB refusal, not an error to retry blindly.
    #[tokio::test]
    async fn eviction_request_carries_the_uid_precondition() {
        use http::{Request, Response};
        use http_body_util::BodyExt;
        use kube::client::Body;

        let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = kube::Client::new(svc, "default");
        let server = tokio::spawn(async move {
            let mut seen = Vec::new();
            for status in [201u16, 429] {
                let Some((req, send)) = handle.next_request().await else {
                    break;
                };
                let path = req.uri().path().to_string();
                let query = req.uri().query().unwrap_or_default().to_string();
                let body = req.into_body().collect().await.map(|b| b.to_bytes());
                let body: serde_json::Value =
                    serde_json::from_slice(&body.unwrap_or_default()).unwrap_or_default();
                seen.push((path, query, body));
                let reply = if status == 201 {
                    serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201})
                } else {
                    serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                        "reason": "TooManyRequests", "code": 429,
                        "message": "Cannot evict pod as it would violate the pod's disruption budget."})
                };
                send.send_response(
                    Response::builder()
                        .status(status)
                        .body(Body::from(serde_json::to_vec(&reply).unwrap()))
                        .unwrap(),
                );
            }
            seen
        });
        let t = Duration::from_secs(5);
        assert_eq!(
            evict(&client, "ns1", "web-1", "uid-1", t).await,
            Answer::Evicted
        );
        assert!(matches!(
            evict(&client, "ns1", "web-1", "uid-1", t).await,
            Answer::Pdb(_)
        ));
        let seen = server.await.unwrap_or_default();
        assert_eq!(seen.len(), 2);
        let (path, query, body) = &seen[0];
        assert_eq!(path, "/api/v1/namespaces/ns1/pods/web-1/eviction");
        assert_eq!(
            query, "&fieldManager=meshgate-agent",
            "the agent's field manager"
        );
        assert_eq!(body["apiVersion"], "policy/v1");
        assert_eq!(body["kind"], "Eviction");
        assert_eq!(body["metadata"]["name"], "web-1");
        assert_eq!(body["metadata"]["namespace"], "ns1");
        assert_eq!(body["deleteOptions"]["preconditions"]["uid"], "uid-1");
    }
}
