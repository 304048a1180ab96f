//! The agent's API clients, and the identity each of its calls goes out as.
//!
//! In: `--kubeconfig`, the node's name and `--impersonate-node`. Out: [`Clients`]:
//! - `own`, the agent's ServiceAccount, for what the ValidatingAdmissionPolicies confine to
//!   meshgate's own parts (the Node's taint, label and condition; Events) and for the
//!   Namespace labels profiles read;
//! - `node`, for reading the Node and the pods on it and for evicting them: the same
//!   ServiceAccount by default, or, with `--impersonate-node`, the node itself
//!   (`system:node:<name>`, Constrained Impersonation's `associated-node` mode), so that
//!   the Node authorizer and NodeRestriction confine those calls to this node and the
//!   ServiceAccount needs no cluster-wide read.
//!
//! Node writes never go out as the node: NodeRestriction forbids a node to change its own
//! taints, and as the node every other label, annotation and status field of the Node
//! would be open to the agent too (docs/reliability.md, "What a stolen agent token can do").

use std::path::Path;

use anyhow::Context;

/// The user a node's kubelet authenticates as, which `--impersonate-node` acts as.
pub fn node_user(node: &str) -> String {
    format!("system:node:{node}")
}

/// The agent's two identities (one and the same without `--impersonate-node`).
#[derive(Clone)]
pub struct Clients {
    /// As the ServiceAccount: Node patches, Events, Namespaces.
    pub own: kube::Client,
    /// As the node (or the ServiceAccount): the Node and its pods read, evictions.
    pub node: kube::Client,
}

impl Clients {
    /// Builds both; `retry` keeps kube's built-in retry of 429/503/504 (off for the pod
    /// inspector, whose evictions must see a PodDisruptionBudget's 429 at once).
    pub async fn build(
        kubeconfig: Option<&Path>,
        node: &str,
        impersonate_node: bool,
        retry: bool,
    ) -> anyhow::Result<Self> {
        let own = if retry {
            meshgate_shell::client::build(kubeconfig).await?
        } else {
            meshgate_shell::client::build_without_retry(kubeconfig).await?
        };
        let node = if impersonate_node {
            meshgate_shell::client::build_impersonating(kubeconfig, &node_user(node), retry)
                .await
                .with_context(|| format!("acting as node {node} (--impersonate-node)"))?
        } else {
            own.clone()
        };
        Ok(Self { own, node })
    }
}
