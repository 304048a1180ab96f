//! The agent's API clients, and the identity each of its calls goes out as.
//!
//! In: the runtime's client and the configuration it was built from
//! (`meshgate_shell::runtime`), the node's name and `--impersonate-node`. Out: two sets of
//! [`Clients`], the verdict loop's and the pod inspector's (without kube's retry), each:
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
use meshgate_shell::client::from_config;

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
    /// The verdict loop's: `own` is the runtime's client (kube's retry on); the node's
    /// identity is built from the same `config`.
    pub fn with_retry(
        own: kube::Client,
        config: &kube::Config,
        node: &str,
        impersonate_node: bool,
    ) -> anyhow::Result<Self> {
        let node = as_node(own.clone(), config, node, impersonate_node, true)?;
        Ok(Self { own, node })
    }

    /// The pod inspector's: both without kube's retry of 429/503/504, so a
    /// PodDisruptionBudget's 429 on an eviction is seen as one.
    pub fn without_retry(
        config: &kube::Config,
        node: &str,
        impersonate_node: bool,
    ) -> anyhow::Result<Self> {
        let own = from_config(config, false, None)?;
        let node = as_node(own.clone(), config, node, impersonate_node, false)?;
        Ok(Self { own, node })
    }

    /// Both sets' way from a kubeconfig (else `KUBECONFIG` or in-cluster), as the runtime reads
    /// it: the verdict loop's (`retry`) or the pod inspector's. For callers without a runtime (the
    /// e2e tests that act as the agent).
    pub async fn build(
        kubeconfig: Option<&Path>,
        node: &str,
        impersonate_node: bool,
        retry: bool,
    ) -> anyhow::Result<Self> {
        let config =
            meshgate_shell::client::load_config(kubeconfig, meshgate_core::field_manager::AGENT)
                .await?;
        if retry {
            let own = from_config(&config, true, None)?;
            Self::with_retry(own, &config, node, impersonate_node)
        } else {
            Self::without_retry(&config, node, impersonate_node)
        }
    }
}

/// The node's identity with `--impersonate-node`, else `own`.
fn as_node(
    own: kube::Client,
    config: &kube::Config,
    node: &str,
    impersonate_node: bool,
    retry: bool,
) -> anyhow::Result<kube::Client> {
    if !impersonate_node {
        return Ok(own);
    }
    from_config(config, retry, Some(&node_user(node)))
        .with_context(|| format!("acting as node {node} (--impersonate-node)"))
}
