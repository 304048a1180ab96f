//! ServiceAccount tokens from the TokenRequest API, so components under test run with their
//! real in-cluster identities (and RBAC) instead of the harness's admin.
//!
//! In: a namespace, a ServiceAccount name and [`TokenOptions`]. Out: a signed JWT minted by the
//! apiserver. Bound to a Pod that is scheduled, the token carries the
//! `authentication.kubernetes.io/node-name` extra (as kubelet-projected tokens do), which
//! node-scoped RBAC and ValidatingAdmissionPolicies key on. Turn the token into a client with
//! [`crate::ControlPlane::client_for_token`] or a kubeconfig file with
//! [`crate::ControlPlane::write_token_kubeconfig`].

use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};

use crate::Error;
use crate::harness::wait;

/// What to ask the TokenRequest API for.
#[derive(Debug, Clone, Default)]
pub struct TokenOptions {
    /// Audiences; empty means the apiserver's own (the issuer).
    pub audiences: Vec<String>,
    /// Lifetime in seconds; `None` means one hour. The apiserver's minimum is 600.
    pub expiration_seconds: Option<i64>,
    /// Bind the token to this pod: it dies with the pod and, once the pod is scheduled, names
    /// the pod's node in its `authentication.kubernetes.io/node-name` extra.
    pub bound_pod: Option<Pod>,
}

/// Mints a token for `namespace/service_account` (which must exist).
pub async fn service_account_token(
    client: &Client,
    namespace: &str,
    service_account: &str,
    options: &TokenOptions,
) -> Result<String, Error> {
    let bound = options.bound_pod.as_ref().map(|pod| BoundObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        name: Some(pod.name_any()),
        uid: pod.uid(),
    });
    let request = TokenRequest {
        spec: TokenRequestSpec {
            audiences: options.audiences.clone(),
            expiration_seconds: Some(options.expiration_seconds.unwrap_or(3600)),
            bound_object_ref: bound,
        },
        ..Default::default()
    };
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    let what = format!("requesting a token for ServiceAccount {namespace}/{service_account}");
    let answer: TokenRequest = wait::api(
        &what,
        sas.create_subresource("token", service_account, &PostParams::default(), &request),
    )
    .await?;
    answer
        .status
        .map(|s| s.token)
        .filter(|t| !t.is_empty())
        .ok_or(Error::EmptyToken { what })
}
