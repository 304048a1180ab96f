//! meshgate-webhook: refuses mesh pods on nodes whose CNI chain is not verified, and gates
//! new Nodes from their first instant.
//!
//! In: AdmissionReviews over HTTPS from the apiserver; Node and unscheduled-Pod metadata from
//! watches. Out: allow / refuse answers (the decision is `meshgate_core::admission`), JSON
//! Patches for new Nodes, and `/live` `/ready` `/metrics` on the admin port.
//!
//! - [`review`]: AdmissionReview ⇄ `core::admission`, over a [`review::Cluster`] view.
//! - [`cache`]: the real cluster view (metadata watches, bounded API fallbacks).
//! - [`server`]: routes, limits, TLS accept loop, graceful shutdown; [`tls`]: certificates
//!   re-read on change.
//! - [`metrics`]: the contract metrics, served by `meshgate_runtime::admin` with the agent's
//!   admin server; logging, client, profiles and signals come from `meshgate_runtime` too.

pub mod cache;
pub mod metrics;
pub mod review;
pub mod server;
pub mod tls;

/// `--log-format` values (shared with the agent).
pub use meshgate_runtime::logging::LogFormat;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use meshgate_core::profile::ProfileSet;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// `meshgate-webhook` command line (contract: `--listen --tls-cert --tls-key [--kubeconfig]
/// [--admin-addr] [--profile ...]`).
#[derive(Clone, Debug, clap::Parser)]
#[command(
    name = "meshgate-webhook",
    version,
    about = "meshgate admission webhook: refuses mesh pods on unverified nodes"
)]
pub struct Args {
    /// Address of the HTTPS listener (`POST /validate`, `POST /mutate-node`).
    #[arg(long, env = "MESHGATE_LISTEN")]
    pub listen: SocketAddr,
    /// PEM certificate chain; re-read when it changes on disk.
    #[arg(long, env = "MESHGATE_TLS_CERT")]
    pub tls_cert: PathBuf,
    /// PEM private key; re-read when it changes on disk.
    #[arg(long, env = "MESHGATE_TLS_KEY")]
    pub tls_key: PathBuf,
    /// Kubeconfig file; else `KUBECONFIG`, else the in-cluster service account.
    #[arg(long, env = "MESHGATE_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Plain-HTTP admin address for `/live`, `/ready`, `/metrics`; none when unset.
    #[arg(long, env = "MESHGATE_ADMIN_ADDR")]
    pub admin_addr: Option<SocketAddr>,
    /// Mesh profiles whose pods are gated (repeatable or comma-separated); default: all
    /// built-in and file-defined profiles.
    #[arg(long = "profile", env = "MESHGATE_PROFILES", value_delimiter = ',')]
    pub profiles: Vec<String>,
    /// JSON file of custom mesh profiles, added to the built-in ones.
    #[arg(long, env = "MESHGATE_PROFILE_FILE")]
    pub profile_file: Option<PathBuf>,
    /// Deadline for answering one review (e.g. `3s`, `500ms`); keep it well below the
    /// webhook configuration's `timeoutSeconds`.
    #[arg(long, env = "MESHGATE_REQUEST_TIMEOUT", default_value = "3s", value_parser = parse_duration)]
    pub request_timeout: Duration,
    /// Deadline for one API lookup (pod for a binding, node condition for a refusal).
    #[arg(long, env = "MESHGATE_LOOKUP_TIMEOUT", default_value = "1s", value_parser = parse_duration)]
    pub lookup_timeout: Duration,
    /// Largest accepted request body in bytes.
    #[arg(long, env = "MESHGATE_MAX_BODY_BYTES", default_value_t = 3 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// How long in-flight requests may take to finish after SIGTERM.
    #[arg(long, env = "MESHGATE_SHUTDOWN_TIMEOUT", default_value = "20s", value_parser = parse_duration)]
    pub shutdown_timeout: Duration,
    /// Log format on stderr (`RUST_LOG` filters, default `info`).
    #[arg(long, env = "MESHGATE_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

/// Parses `1.5s`, `500ms` or plain seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, scale) = if let Some(n) = s.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1.0)
    } else {
        (s, 1.0)
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("invalid duration {s:?}: use e.g. 3s or 500ms"))?;
    if !v.is_finite() || v < 0.0 {
        return Err(format!("invalid duration {s:?}: must be a positive number"));
    }
    Duration::try_from_secs_f64(v * scale).map_err(|e| format!("invalid duration {s:?}: {e}"))
}

/// The profile set from `--profile-file` and `--profile`.
pub fn load_profiles(args: &Args) -> anyhow::Result<ProfileSet> {
    meshgate_runtime::profiles::load(&args.profiles, args.profile_file.as_deref())
}

/// Runs the webhook until SIGTERM/SIGINT.
pub async fn run(args: Args) -> anyhow::Result<()> {
    let listener = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    run_on(args, listener, meshgate_runtime::shutdown::signal()).await
}

/// Runs the webhook on an already-bound listener until `shutdown` resolves (tests and
/// embedders pick their own port and stop condition).
pub async fn run_on(
    args: Args,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let profiles = load_profiles(&args)?;
    let tls = tls::server_config(&args.tls_cert, &args.tls_key)?;
    let client = meshgate_runtime::client::build(args.kubeconfig.as_deref()).await?;

    let mut registry = Registry::default();
    let metrics = metrics::Metrics::register(&mut registry);
    let registry = Arc::new(registry);

    let (ready_tx, ready_rx) = watch::channel(false);
    let (caches, watches) = cache::Caches::new(client, args.lookup_timeout, ready_tx);
    let watch_tasks = [
        tokio::spawn(watches.nodes),
        tokio::spawn(watches.pods),
        tokio::spawn(watches.synced),
    ];

    // One shutdown signal fanned out to the admin server and the TLS server.
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    };

    let admin = match args.admin_addr {
        Some(addr) => {
            let l = TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding admin address {addr}"))?;
            tracing::info!(addr = %l.local_addr()?, "admin server listening");
            Some(tokio::spawn(meshgate_runtime::admin::serve(
                l,
                registry.clone(),
                ready_rx.clone(),
                stopped(),
            )))
        }
        None => None,
    };

    let profile_names: Vec<&str> = profiles.iter().map(|p| p.name.as_str()).collect();
    tracing::info!(
        addr = %listener.local_addr()?,
        profiles = ?profile_names,
        request_timeout = ?args.request_timeout,
        "webhook listening"
    );
    let reviewer = Arc::new(review::Reviewer::new(caches, profiles, metrics));
    let limits = server::Limits {
        max_body_bytes: args.max_body_bytes,
        request_timeout: args.request_timeout,
    };
    let app = server::router(reviewer, ready_rx, limits);
    server::serve_tls(listener, tls, app, stopped(), args.shutdown_timeout).await;

    for t in watch_tasks {
        t.abort();
    }
    if let Some(a) = admin {
        match tokio::time::timeout(Duration::from_secs(2), a).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "admin server failed"),
            Ok(Err(e)) => tracing::warn!(error = %e, "admin server task failed"),
            Err(_) => tracing::warn!("admin server did not stop in time"),
        }
    }
    tracing::info!("webhook stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("3s"), Ok(Duration::from_secs(3)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
        assert!(parse_duration("-1s").is_err());
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("NaNs").is_err());
    }

    #[test]
    fn contract_flags_parse() {
        let a = Args::try_parse_from([
            "meshgate-webhook",
            "--listen",
            "127.0.0.1:8443",
            "--tls-cert",
            "/c",
            "--tls-key",
            "/k",
            "--kubeconfig",
            "/kc",
            "--admin-addr",
            "127.0.0.1:9090",
            "--profile",
            "linkerd",
            "--profile",
            "istio",
        ])
        .unwrap();
        assert_eq!(a.profiles, ["linkerd", "istio"]);
        assert_eq!(a.request_timeout, Duration::from_secs(3));
        let set = load_profiles(&a).unwrap();
        assert_eq!(set.iter().count(), 2);

        let bad = Args::try_parse_from([
            "meshgate-webhook",
            "--listen",
            "127.0.0.1:8443",
            "--tls-cert",
            "/c",
            "--tls-key",
            "/k",
            "--profile",
            "consul",
        ])
        .unwrap();
        assert!(load_profiles(&bad).is_err());
        assert!(Args::try_parse_from(["meshgate-webhook", "--listen", "x"]).is_err());
    }
}
