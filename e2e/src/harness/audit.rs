//! kube-apiserver audit events, as the harness's control plane logs them
//! ([`crate::ControlPlane::audit_log`]): one JSON object per line, metadata level, for every
//! request made by a ServiceAccount outside kube-system.
//!
//! In: the log file. Out: [`Request`]s, one per audited request (the `ResponseStarted` and
//! `ResponseComplete` stages of one request share an audit ID and are merged), so tests and
//! benchmarks can count a component's API calls by verb and resource, time them with the
//! apiserver's own clock, and check what it did (for example: at most one eviction per pod).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::SystemTime;

use serde::Deserialize;

/// One audited request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// The audit ID the apiserver gave the request.
    pub audit_id: String,
    /// The authenticated user name (`system:serviceaccount:<ns>:<name>`).
    pub user: String,
    /// The user the request acted as through impersonation (`system:node:<name>`), if any.
    pub impersonated_user: Option<String>,
    /// `get`, `list`, `watch`, `create`, `patch`, `update`, `delete`, ...
    pub verb: String,
    /// Resource (`nodes`, `pods`, `events`), empty for non-resource URLs.
    pub resource: String,
    /// Subresource (`status`, `eviction`, `token`), empty when none.
    pub subresource: String,
    /// Namespace, empty for cluster-scoped objects and collections.
    pub namespace: String,
    /// Object name, empty for collections.
    pub name: String,
    /// The request URI (with its query: `watch=true`, `fieldSelector=...`).
    pub uri: String,
    /// HTTP status code of the response, when it completed.
    pub code: Option<u16>,
    /// Whether its `ResponseComplete` stage is in the log: a WATCH without it is still
    /// open (the apiserver logs `ResponseStarted` when a watch begins streaming).
    pub complete: bool,
    /// When the apiserver received the request.
    pub received: SystemTime,
    /// The event's annotations: the authorizer's decision, and each admission webhook's
    /// audit annotations as `<webhook name>/<key>` (merged over the request's stages).
    pub annotations: BTreeMap<String, String>,
}

impl Request {
    /// `verb resource[/subresource]`, for tables.
    pub fn kind(&self) -> String {
        if self.subresource.is_empty() {
            format!("{} {}", self.verb, self.resource)
        } else {
            format!("{} {}/{}", self.verb, self.resource, self.subresource)
        }
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Event {
    #[serde(rename = "auditID")]
    audit_id: String,
    #[serde(default)]
    verb: String,
    #[serde(default)]
    stage: String,
    #[serde(rename = "requestURI", default)]
    request_uri: String,
    #[serde(default)]
    user: User,
    #[serde(default)]
    impersonated_user: Option<User>,
    #[serde(default)]
    object_ref: ObjectRef,
    #[serde(default)]
    response_status: Option<Status>,
    #[serde(default)]
    request_received_timestamp: String,
    #[serde(default)]
    annotations: BTreeMap<String, String>,
}

#[derive(Deserialize, Default)]
struct User {
    #[serde(default)]
    username: String,
}

#[derive(Deserialize, Default)]
struct ObjectRef {
    #[serde(default)]
    resource: String,
    #[serde(default)]
    subresource: String,
    #[serde(default)]
    namespace: String,
    #[serde(default)]
    name: String,
}

#[derive(Deserialize)]
struct Status {
    #[serde(default)]
    code: Option<u16>,
}

/// Parses RFC 3339 UTC timestamps as the apiserver writes them
/// (`2026-01-02T03:04:05.123456Z`).
fn parse_time(s: &str) -> Option<SystemTime> {
    let ts: k8s_openapi::jiff::Timestamp = s.parse().ok()?;
    Some(SystemTime::from(ts))
}

/// Every audited request in the log, in the order they were received. Lines that are not
/// audit events (a log cut mid-line while it is being written) are skipped.
pub fn read(path: &Path) -> std::io::Result<Vec<Request>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e),
    };
    let mut by_id: BTreeMap<String, Request> = BTreeMap::new();
    for line in text.lines() {
        let Ok(e) = serde_json::from_str::<Event>(line) else {
            continue;
        };
        let Some(received) = parse_time(&e.request_received_timestamp) else {
            continue;
        };
        let code = e.response_status.and_then(|s| s.code);
        let impersonated = e.impersonated_user.map(|u| u.username);
        let complete = e.stage == "ResponseComplete";
        by_id
            .entry(e.audit_id.clone())
            .and_modify(|r| {
                r.annotations.extend(e.annotations.clone());
                r.code = r.code.or(code);
                r.complete |= complete;
                r.impersonated_user = r.impersonated_user.take().or(impersonated.clone());
            })
            .or_insert(Request {
                audit_id: e.audit_id,
                user: e.user.username,
                impersonated_user: impersonated,
                verb: e.verb,
                resource: e.object_ref.resource,
                subresource: e.object_ref.subresource,
                namespace: e.object_ref.namespace,
                name: e.object_ref.name,
                uri: e.request_uri,
                code,
                complete,
                received,
                annotations: e.annotations,
            });
    }
    let mut all: Vec<Request> = by_id.into_values().collect();
    all.sort_by_key(|r| r.received);
    Ok(all)
}

/// The requests of one user, received in `[from, to)`.
pub fn by_user(all: &[Request], user: &str, from: SystemTime, to: SystemTime) -> Vec<Request> {
    all.iter()
        .filter(|r| r.user == user && r.received >= from && r.received < to)
        .cloned()
        .collect()
}

/// The user name a ServiceAccount's token authenticates as.
pub fn service_account_user(namespace: &str, name: &str) -> String {
    format!("system:serviceaccount:{namespace}:{name}")
}

/// A ServiceAccount bound to `cluster-admin`, with a token kubeconfig, so a component run
/// under it has requests of its own in the audit log. (Least-privilege RBAC is tested on its
/// own; this identity is for counting and timing requests.)
pub struct AuditedIdentity {
    /// Kubeconfig with the ServiceAccount's token (in the control plane's `tokens/` dir).
    pub kubeconfig: std::path::PathBuf,
    /// The user name its requests carry in the audit log.
    pub user: String,
    binding: String,
}

impl AuditedIdentity {
    /// Creates ServiceAccount `namespace/name`, binds it to `cluster-admin` with a uniquely
    /// named ClusterRoleBinding, and writes a kubeconfig with a one-hour token.
    pub async fn new(
        cp: &crate::ControlPlane,
        client: &kube::Client,
        namespace: &str,
        name: &str,
    ) -> anyhow::Result<Self> {
        use k8s_openapi::api::core::v1::ServiceAccount;
        use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
        use kube::api::{Api, PostParams};
        let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
        let sa: ServiceAccount =
            serde_json::from_value(serde_json::json!({"metadata": {"name": name}}))?;
        crate::harness::wait::api(
            "creating a ServiceAccount",
            sas.create(&PostParams::default(), &sa),
        )
        .await?;
        let binding = crate::unique_name("audited");
        let crb: ClusterRoleBinding = serde_json::from_value(serde_json::json!({
            "metadata": {"name": binding},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]
        }))?;
        let crbs: Api<ClusterRoleBinding> = Api::all(client.clone());
        crate::harness::wait::api(
            "binding the ServiceAccount",
            crbs.create(&PostParams::default(), &crb),
        )
        .await?;
        let token =
            crate::service_account_token(client, namespace, name, &crate::TokenOptions::default())
                .await?;
        let kubeconfig = cp.write_token_kubeconfig(&format!("{namespace}-{name}"), &token)?;
        Ok(Self {
            kubeconfig,
            user: service_account_user(namespace, name),
            binding,
        })
    }

    /// Its requests received since `from`.
    pub fn requests(
        &self,
        cp: &crate::ControlPlane,
        from: SystemTime,
    ) -> std::io::Result<Vec<Request>> {
        let all = read(&cp.audit_log())?;
        Ok(by_user(
            &all,
            &self.user,
            from,
            SystemTime::now() + std::time::Duration::from_secs(3600),
        ))
    }

    /// Deletes the ClusterRoleBinding (best effort).
    pub async fn remove(self, client: &kube::Client) {
        use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
        let crbs: kube::api::Api<ClusterRoleBinding> = kube::api::Api::all(client.clone());
        let _ = tokio::time::timeout(
            crate::harness::wait::API_TIMEOUT,
            crbs.delete(&self.binding, &kube::api::DeleteParams::default()),
        )
        .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_of_one_request_merge_and_order_is_by_receipt() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.log");
        let lines = [
            r#"{"kind":"Event","auditID":"b","stage":"ResponseStarted","requestURI":"/api/v1/pods?watch=true","verb":"watch","user":{"username":"system:serviceaccount:x:agent"},"objectRef":{"resource":"pods","apiVersion":"v1"},"requestReceivedTimestamp":"2026-01-01T00:00:02.000100Z"}"#,
            r#"{"kind":"Event","auditID":"a","stage":"ResponseComplete","requestURI":"/api/v1/namespaces/x/pods/p/eviction","verb":"create","user":{"username":"system:serviceaccount:x:agent"},"objectRef":{"resource":"pods","namespace":"x","name":"p","subresource":"eviction"},"responseStatus":{"code":201},"requestReceivedTimestamp":"2026-01-01T00:00:01.5Z"}"#,
            r#"{"kind":"Event","auditID":"b","stage":"ResponseComplete","requestURI":"/api/v1/pods?watch=true","verb":"watch","user":{"username":"system:serviceaccount:x:agent"},"impersonatedUser":{"username":"system:node:n1","groups":["system:nodes"]},"objectRef":{"resource":"pods"},"responseStatus":{"code":200},"requestReceivedTimestamp":"2026-01-01T00:00:02.000100Z"}"#,
            r#"{"kind":"Event","auditID":"c","stage":"Resp"#,
            r#"{"kind":"Event","auditID":"d","stage":"ResponseStarted","requestURI":"/api/v1/nodes?watch=true","verb":"watch","user":{"username":"system:serviceaccount:x:agent"},"objectRef":{"resource":"nodes"},"responseStatus":{"code":200},"requestReceivedTimestamp":"2026-01-01T00:00:03Z"}"#,
        ];
        std::fs::write(&path, lines.join("\n")).unwrap();
        let all = read(&path).unwrap();
        assert_eq!(all.len(), 3);
        assert_eq!(all[0].audit_id, "a");
        assert_eq!(all[0].kind(), "create pods/eviction");
        assert_eq!(all[0].code, Some(201));
        assert_eq!(all[0].impersonated_user, None);
        assert_eq!(all[1].impersonated_user.as_deref(), Some("system:node:n1"));
        assert_eq!(all[1].kind(), "watch pods");
        assert_eq!(all[1].code, Some(200));
        assert!(all[0].complete && all[1].complete);
        assert!(!all[2].complete, "a watch still streaming");
        let d = all[1].received.duration_since(all[0].received).unwrap();
        assert_eq!(d.as_micros(), 500_100);
        let user = service_account_user("x", "agent");
        assert_eq!(
            by_user(&all, &user, SystemTime::UNIX_EPOCH, SystemTime::now()).len(),
            3
        );
        assert!(read(&dir.path().join("missing")).unwrap().is_empty());
    }
}
