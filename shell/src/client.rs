//! Builds the Kubernetes client and bounds every call in time.
//!
//! In: an optional kubeconfig path, the binary's name (`meshgate_core::field_manager`), and
//! optionally a user to impersonate. Out: a `kube::Client` whose connections time out and
//! whose every request names the binary in its `User-Agent`, or the configuration it is
//! built from ([`load_config`]), from which [`from_config`] builds the variants a daemon
//! needs (without kube's retry, impersonating) without reading the kubeconfig again. Each
//! caller puts its own deadline on every non-watch call (`--api-timeout`,
//! `--lookup-timeout`), so no step hangs on a half-open connection.
//!
//! kube sends no `User-Agent` of its own, and the apiserver records a write that names no
//! field manager under the User-Agent's product token, `unknown` without one: with it, such a
//! write (the kube `Recorder`'s Events) and every request in an audit log name the binary.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use kube::config::{KubeConfigOptions, Kubeconfig};
use meshgate_core::field_manager;

/// Connect timeout for API connections: loopback or cluster-local, so a few seconds is plenty.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Builds a client for the binary `name` from `kubeconfig` if given, else `KUBECONFIG`, else
/// the in-cluster config.
pub async fn build(kubeconfig: Option<&Path>, name: &str) -> anyhow::Result<kube::Client> {
    kube::Client::try_from(load_config(kubeconfig, name).await?)
        .context("building the Kubernetes client")
}

/// Like [`build`], as kubectl's `--context` does: the kubeconfig's context `context` instead
/// of its current one (the kubeconfig from `kubeconfig`, else `KUBECONFIG` or
/// `~/.kube/config`).
pub async fn build_in_context(
    kubeconfig: Option<&Path>,
    context: Option<&str>,
    name: &str,
) -> anyhow::Result<kube::Client> {
    let Some(context) = context else {
        return build(kubeconfig, name).await;
    };
    let options = KubeConfigOptions {
        context: Some(context.to_owned()),
        ..KubeConfigOptions::default()
    };
    let mut config = match kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &options).await
        }
        None => kube::Config::from_kubeconfig(&options).await,
    }
    .with_context(|| format!("loading context {context:?} of the kubeconfig"))?;
    config.connect_timeout = Some(CONNECT_TIMEOUT);
    identify(&mut config, name)?;
    kube::Client::try_from(config).context("building the Kubernetes client")
}

/// A client from `config` (as [`load_config`] read it), as [`build`] makes one, but:
/// - with `retry: false`, without kube's built-in retry of 429/503/504 responses. For calls
///   where a 429 is an answer rather than congestion: an eviction refused by a
///   PodDisruptionBudget must reach the caller at once, not be retried inside the client
///   until the caller's deadline expires;
/// - with `impersonate: Some(user)`, every request carries `Impersonate-User: <user>`: the
///   apiserver authorizes and admits it as `user`, once the caller's own identity may
///   impersonate `user` for that request (Constrained Impersonation: `impersonate:<mode>`
///   and `impersonate-on:<mode>:<verb>`).
pub fn from_config(
    config: &kube::Config,
    retry: bool,
    impersonate: Option<&str>,
) -> anyhow::Result<kube::Client> {
    let mut config = config.clone();
    config.default_retry = retry;
    let Some(user) = impersonate else {
        return kube::Client::try_from(config).context("building the Kubernetes client");
    };
    config.auth_info.impersonate = Some(user.to_owned());
    kube::Client::try_from(config).context("building the impersonating Kubernetes client")
}

/// The client configuration of the binary `name` from `kubeconfig` if given, else
/// `KUBECONFIG`, else the in-cluster config, with [`CONNECT_TIMEOUT`] and the binary's
/// `User-Agent`.
pub async fn load_config(kubeconfig: Option<&Path>, name: &str) -> anyhow::Result<kube::Config> {
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
    // non-watch call is bounded by its caller's deadline instead.
    identify(&mut config, name)?;
    Ok(config)
}

/// Makes every request of `config`'s clients carry the `User-Agent` of the binary `name`.
fn identify(config: &mut kube::Config, name: &str) -> anyhow::Result<()> {
    let value = http::HeaderValue::try_from(field_manager::user_agent(name))
        .with_context(|| format!("the User-Agent of {name:?}"))?;
    config
        .headers
        .retain(|(h, _)| h != http::header::USER_AGENT);
    config.headers.push((http::header::USER_AGENT, value));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Serves one request on a loopback port and returns its head (request line and headers).
    async fn one_request_head(listener: tokio::net::TcpListener) -> String {
        let (mut conn, _) = listener.accept().await.expect("accept");
        let mut head = Vec::new();
        let mut buf = [0u8; 4096];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = conn.read(&mut buf).await.expect("read");
            assert!(n > 0, "connection closed before the head ended");
            head.extend_from_slice(&buf[..n]);
        }
        let body = br#"{"major":"1","minor":"35"}"#;
        let answer = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        );
        conn.write_all(answer.as_bytes()).await.expect("write");
        conn.write_all(body).await.expect("write");
        String::from_utf8_lossy(&head).to_lowercase()
    }

    /// The head of the one request a client built by `build` sends to a local server.
    async fn head_sent_by<F, Fut>(build: F) -> String
    where
        F: FnOnce(std::path::PathBuf) -> Fut,
        Fut: Future<Output = anyhow::Result<kube::Client>>,
    {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kubeconfig");
        std::fs::write(
            &path,
            format!(
                "apiVersion: v1\nkind: Config\ncurrent-context: c\nclusters:\n- name: c\n  cluster:\n    server: http://127.0.0.1:{port}\ncontexts:\n- name: c\n  context:\n    cluster: c\n    user: u\nusers:\n- name: u\n  user:\n    token: the-token\n"
            ),
        )
        .unwrap();
        let server = tokio::spawn(one_request_head(listener));
        let client = build(path).await.unwrap();
        client.apiserver_version().await.unwrap();
        server.await.unwrap()
    }

    #[tokio::test]
    async fn an_impersonating_client_names_the_user_on_every_request() {
        let head = head_sent_by(|path| async move {
            let config = load_config(Some(&path), field_manager::AGENT).await?;
            from_config(&config, false, Some("system:node:node-a"))
        })
        .await;
        assert!(
            head.contains("\r\nimpersonate-user: system:node:node-a\r\n"),
            "{head}"
        );
        // Still authenticated as itself: the apiserver checks that identity may impersonate.
        assert!(
            head.contains("\r\nauthorization: bearer the-token\r\n"),
            "{head}"
        );
    }

    #[tokio::test]
    async fn a_plain_client_impersonates_nobody() {
        let head =
            head_sent_by(|path| async move { build(Some(&path), field_manager::PLUGIN).await })
                .await;
        assert!(!head.contains("impersonate-"), "{head}");
        assert!(
            head.contains("\r\nauthorization: bearer the-token\r\n"),
            "{head}"
        );
    }

    /// Every client names its binary, once: the apiserver takes a write's default field
    /// manager from it (the kube `Recorder`'s Events), audit logs show it.
    #[tokio::test]
    async fn every_client_names_its_binary_in_its_user_agent() {
        let ua = |name| format!("\r\nuser-agent: {}\r\n", field_manager::user_agent(name));
        let head = head_sent_by(|path| async move {
            let config = load_config(Some(&path), field_manager::AGENT).await?;
            from_config(&config, false, Some("system:node:node-a"))
        })
        .await;
        assert!(head.contains(&ua(field_manager::AGENT)), "{head}");
        assert_eq!(head.matches("user-agent:").count(), 1, "{head}");
        let head = head_sent_by(|path| async move {
            build_in_context(Some(&path), Some("c"), field_manager::PLUGIN).await
        })
        .await;
        assert!(head.contains(&ua(field_manager::PLUGIN)), "{head}");
    }
}
