//! The one start-up both daemons share: stop requests, the Kubernetes client, the admin
//! server and the live mode, in that order.
//!
//! In: the shared flags ([`Common`]: `--kubeconfig`, `--admin-addr`, `--namespace`,
//! `--mode-configmap`), the daemon's name (its `User-Agent`: `meshgate_core::field_manager`),
//! the daemon's metrics registry (its own metrics and the mode's already registered), what
//! its `/ready` and `/live` answer from, and how long the mode's first list may take. Out: a [`Runtime`] whose parts the daemon hands to its tasks: the
//! client (as the ServiceAccount, with kube's retry) and the configuration it was built
//! from (for the variants a daemon adds: `client::from_config`), the stop requests, the
//! running admin server and the mode watch.
//!
//! [`Builder::build`]'s order is what keeps a restart safe and observable:
//! 1. the SIGTERM and SIGINT handlers, first, before anything that may take time: from then
//!    on a signal is a stop request, never the default exit (an embedder's future replaces
//!    them, [`Builder::stop_on`]);
//! 2. the client (reads the kubeconfig or the in-cluster config; no API call);
//! 3. the admin listener, bound and served before any wait on the API, so `/live` answers
//!    during the waits that follow;
//! 4. the mode watch, whose first list is waited for within the bound given
//!    ([`Builder::mode_first_list`]), so a daemon restarted in report mode never acts as
//!    enforce for its first moments.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use prometheus_client::registry::Registry;

use crate::admin::{AdminServer, Liveness, Readiness};
use crate::cli::Common;
use crate::client;
use crate::mode::{ModeMetrics, ModeWatch};
use crate::shutdown::Shutdown;

/// How long the mode's first list is waited for unless the daemon says otherwise.
pub const DEFAULT_MODE_FIRST_LIST: Duration = Duration::from_secs(5);

/// A daemon's process-wide parts, running.
pub struct Runtime {
    /// As the ServiceAccount, with kube's retry of 429/503/504.
    pub client: kube::Client,
    /// What `client` was built from: other clients are built from it (`client::from_config`)
    /// without reading the kubeconfig again.
    pub client_config: kube::Config,
    /// SIGTERM and SIGINT from the first step of the build on (or the embedder's request).
    pub shutdown: Shutdown,
    /// Serving `/live`, `/ready` and `/metrics` since the build (nothing without
    /// `--admin-addr`).
    pub admin: AdminServer,
    /// The live mode, listed once (or the bound passed) before the build returned.
    pub mode: ModeWatch,
}

type StopOn = Pin<Box<dyn Future<Output = ()> + Send>>;

/// How a [`Runtime`] is built; `R` and `L` are what the admin server's `/ready` and `/live`
/// answer from ([`Builder::probes`]).
#[must_use]
pub struct Builder<'a, R, L> {
    common: &'a Common,
    name: &'static str,
    stop_on: Option<StopOn>,
    registry: Registry,
    mode_metrics: ModeMetrics,
    mode_first_list: Duration,
    ready: R,
    live: L,
}

impl Runtime {
    /// A builder from the shared flags, for the daemon `name` (`meshgate_core::field_manager`:
    /// every request of its clients names it in its `User-Agent`). Before [`Builder::build`],
    /// the daemon gives it its metrics ([`Builder::metrics`]) and its probes
    /// ([`Builder::probes`]).
    pub fn builder<'a>(common: &'a Common, name: &'static str) -> Builder<'a, (), ()> {
        let mut registry = Registry::default();
        let mode_metrics = ModeMetrics::register(&mut registry);
        Builder {
            common,
            name,
            stop_on: None,
            registry,
            mode_metrics,
            mode_first_list: DEFAULT_MODE_FIRST_LIST,
            ready: (),
            live: (),
        }
    }
}

impl<'a, R, L> Builder<'a, R, L> {
    /// What `/metrics` serves, with the mode's metrics (`mode`, registered in `registry`)
    /// among them: the daemon registers everything before the admin server starts.
    pub fn metrics(self, registry: Registry, mode: ModeMetrics) -> Self {
        Self {
            registry,
            mode_metrics: mode,
            ..self
        }
    }

    /// How long the build waits for the mode's first list (default
    /// [`DEFAULT_MODE_FIRST_LIST`]); past it the daemon enforces until the list comes.
    pub fn mode_first_list(self, bound: Duration) -> Self {
        Self {
            mode_first_list: bound,
            ..self
        }
    }

    /// Stops on `stop` instead of SIGTERM and SIGINT, whose handlers are then left alone:
    /// for embedders and tests that run a daemon inside a process of their own.
    pub fn stop_on(self, stop: impl Future<Output = ()> + Send + 'static) -> Self {
        Self {
            stop_on: Some(Box::pin(stop)),
            ..self
        }
    }

    /// What the admin server's `/ready` and `/live` answer from.
    pub fn probes<R2: Readiness, L2: Liveness>(self, ready: R2, live: L2) -> Builder<'a, R2, L2> {
        Builder {
            common: self.common,
            name: self.name,
            stop_on: self.stop_on,
            registry: self.registry,
            mode_metrics: self.mode_metrics,
            mode_first_list: self.mode_first_list,
            ready,
            live,
        }
    }
}

impl<R: Readiness, L: Liveness> Builder<'_, R, L> {
    /// Builds the runtime in the order the module documents.
    ///
    /// # Errors
    /// When a signal handler cannot be installed, the kubeconfig cannot be read, or
    /// `--admin-addr` cannot be bound. The mode's first list never fails it: past the bound
    /// the daemon enforces.
    pub async fn build(self) -> anyhow::Result<Runtime> {
        let shutdown = match self.stop_on {
            Some(stop) => Shutdown::on(stop),
            None => Shutdown::signals().context("installing the SIGTERM and SIGINT handlers")?,
        };
        let client_config =
            client::load_config(self.common.kubeconfig.as_deref(), self.name).await?;
        let client = client::from_config(&client_config, true, None)?;
        let listener = self.common.bind_admin().await?;
        let registry = Arc::new(self.registry);
        let admin = AdminServer::start(listener, registry, self.ready, self.live);
        let mode = ModeWatch::start(
            client.clone(),
            &self.common.mode,
            self.mode_metrics,
            self.mode_first_list,
        )
        .await;
        Ok(Runtime {
            client,
            client_config,
            shutdown,
            admin,
            mode,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    use crate::admin::AlwaysLive;

    /// A kubeconfig naming an apiserver that is not there: the build needs no API call to
    /// return (the mode's first list is bounded), and the admin server answers meanwhile.
    fn unreachable_kubeconfig(dir: &std::path::Path) -> std::path::PathBuf {
        let path = dir.join("kubeconfig");
        std::fs::write(
            &path,
            "apiVersion: v1\nkind: Config\ncurrent-context: c\nclusters:\n- name: c\n  cluster:\n    server: http://127.0.0.1:9\ncontexts:\n- name: c\n  context:\n    cluster: c\n    user: u\nusers:\n- name: u\n  user:\n    token: t\n",
        )
        .unwrap();
        path
    }

    /// A plain HTTP/1.0 GET: the status line's code.
    async fn status(addr: std::net::SocketAddr, path: &str) -> Option<u16> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
            .await
            .ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).await.ok()?;
        out.split_whitespace().nth(1)?.parse().ok()
    }

    /// The build: the mode's first list bounded, the admin server serving the daemon's
    /// registry and probes, the embedder's stop request as the one request, and the admin
    /// server stopping when asked.
    #[tokio::test]
    async fn the_build_serves_the_admin_port_and_bounds_the_mode_list() {
        let dir = tempfile::tempdir().unwrap();
        let admin_addr = {
            let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            probe.local_addr().unwrap()
        };
        let common = Common {
            kubeconfig: Some(unreachable_kubeconfig(dir.path())),
            admin_addr: Some(admin_addr),
            ..Common::default()
        };
        let mut registry = Registry::default();
        let mode = ModeMetrics::register(&mut registry);
        let ready = Arc::new(AtomicBool::new(false));
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let begun = std::time::Instant::now();
        let mut rt = Runtime::builder(&common, "test")
            .metrics(registry, mode)
            .probes(ready.clone(), AlwaysLive)
            .mode_first_list(Duration::from_millis(300))
            .stop_on(async move {
                let _ = stop_rx.await;
            })
            .build()
            .await
            .unwrap();
        let took = begun.elapsed();
        assert!(took >= Duration::from_millis(250), "{took:?}");
        assert!(took < Duration::from_secs(5), "{took:?}");
        assert_eq!(
            *rt.mode.subscribe().borrow(),
            meshgate_core::mode::Mode::Enforce
        );
        assert_eq!(status(admin_addr, "/live").await, Some(200));
        assert_eq!(status(admin_addr, "/ready").await, Some(503));
        ready.store(true, std::sync::atomic::Ordering::Release);
        assert_eq!(status(admin_addr, "/ready").await, Some(200));
        stop_tx.send(()).unwrap();
        let got = tokio::time::timeout(Duration::from_secs(1), rt.shutdown.next()).await;
        assert_eq!(got, Ok(Some(crate::shutdown::STOP_REQUEST)));
        rt.admin.stop().await;
        assert_eq!(status(admin_addr, "/live").await, None);
    }

    #[tokio::test]
    async fn an_unreadable_kubeconfig_fails_the_build_naming_it() {
        let common = Common {
            kubeconfig: Some("/nonexistent/kubeconfig".into()),
            ..Common::default()
        };
        let built = Runtime::builder(&common, "test")
            .probes(Arc::new(AtomicBool::new(false)), AlwaysLive)
            .stop_on(std::future::pending())
            .build()
            .await;
        let Err(err) = built else {
            panic!("built with an unreadable kubeconfig");
        };
        assert!(
            format!("{err:#}").contains("/nonexistent/kubeconfig"),
            "{err:#}"
        );
    }
}
