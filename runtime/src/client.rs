//! Builds the Kubernetes client and bounds every call in time.
//!
//! In: an optional kubeconfig path. Out: a `kube::Client` whose connections time out, and
//! [`bounded`], which turns any API future into one that fails with a clear error after a
//! deadline, so no reconcile step can hang on a half-open connection.

use std::future::Future;
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use kube::config::{KubeConfigOptions, Kubeconfig};

/// Connect timeout for API connections: loopback or cluster-local, so a few seconds is plenty.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Builds a client from `kubeconfig` if given, else `KUBECONFIG`, else the in-cluster config.
pub async fn build(kubeconfig: Option<&Path>) -> anyhow::Result<kube::Client> {
    kube::Client::try_from(config(kubeconfig).await?).context("building the Kubernetes client")
}

/// Like [`build`], but without kube's built-in retry of 429/503/504 responses. For calls
/// where a 429 is an answer rather than congestion: an eviction refused by a
/// PodDisruptionBudget must reach the caller at once, not be retried inside the client
/// until the caller's deadline expires.
pub async fn build_without_retry(kubeconfig: Option<&Path>) -> anyhow::Result<kube::Client> {
    let mut config = config(kubeconfig).await?;
    config.default_retry = false;
    kube::Client::try_from(config).context("building the Kubernetes client")
}

async fn config(kubeconfig: Option<&Path>) -> anyhow::Result<kube::Config> {
    let mut config = match kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .with_context(|| format!("loading kubeconfig {}", path.display()))?
        }
        None => kube::Config::infer()
            .await
            .context("no --kubeconfig, KUBECONFIG or in-cluster config")?,
    };
    config.connect_timeout = Some(CONNECT_TIMEOUT);
    // read_timeout stays unset: watches hold a response open for minutes by design. Every
    // non-watch call is bounded by `bounded` instead.
    Ok(config)
}

/// An API call that did not finish within its deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the API call did not finish within {0:?}")]
pub struct Elapsed(pub Duration);

/// Runs `call` with a deadline of `timeout`.
pub async fn bounded<T>(timeout: Duration, call: impl Future<Output = T>) -> Result<T, Elapsed> {
    tokio::time::timeout(timeout, call)
        .await
        .map_err(|_| Elapsed(timeout))
}
