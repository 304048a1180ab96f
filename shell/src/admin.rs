//! Admin HTTP server: `/live`, `/ready` and `/metrics` on a plain-HTTP port.
//!
//! In: a prometheus-client [`Registry`], a [`Readiness`] signal and a [`Liveness`] check.
//! Out: `GET /live` → 200 while the check passes, else 503 with the reason (so the kubelet
//! restarts a process whose work is stuck, not only one that stopped serving); `GET /ready` →
//! 200 once the signal says ready, else 503; `GET /metrics` → the registry in OpenMetrics
//! text. Nothing here knows about the webhook or the agent: the webhook is [`AlwaysLive`]
//! (serving is its work), the agent reports its loop's progress through [`LoopProgress`].
//! [`AdminServer`] runs it in a task of its own, as `crate::runtime` starts it for both
//! daemons.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

use crate::server;

/// Anything that can say whether the process is ready to serve (caches synced, ...).
pub trait Readiness: Clone + Send + Sync + 'static {
    /// True once the process may receive traffic.
    fn is_ready(&self) -> bool;
}

impl Readiness for watch::Receiver<bool> {
    fn is_ready(&self) -> bool {
        *self.borrow()
    }
}

impl Readiness for Arc<AtomicBool> {
    fn is_ready(&self) -> bool {
        self.load(Ordering::Acquire)
    }
}

/// Anything that can say whether the process still makes progress.
pub trait Liveness: Clone + Send + Sync + 'static {
    /// `Ok` while live; `Err(why)` once the process is stuck and should be restarted.
    fn check(&self) -> Result<(), String>;
}

/// Live whenever it answers: for a process whose only work is serving requests.
#[derive(Clone, Copy, Debug, Default)]
pub struct AlwaysLive;

impl Liveness for AlwaysLive {
    fn check(&self) -> Result<(), String> {
        Ok(())
    }
}

/// The progress of a loop that alternates passes (work that must end within `max_pass`)
/// and waits (which must end within `max_wait`, e.g. its resync period plus slack). The
/// loop calls [`Self::pass_started`] and [`Self::pass_ended`]; a pass running longer than its
/// bound, or a wait longer than its bound, fails the check. It starts in a pass: start-up is
/// the first one. Cheap to clone (one shared atomic).
#[derive(Clone, Debug)]
pub struct LoopProgress {
    inner: Arc<ProgressInner>,
}

#[derive(Debug)]
struct ProgressInner {
    origin: Instant,
    /// Bit 63: in a pass. Low bits: milliseconds from `origin` to the last change. One word,
    /// so a check never sees the flag of one change with the time of another.
    state: AtomicU64,
    max_pass: Duration,
    max_wait: Duration,
    /// Names the loop in the check's message.
    name: &'static str,
}

const IN_PASS: u64 = 1 << 63;

impl LoopProgress {
    /// A loop whose passes must end within `max_pass`, and whose waits within `max_wait`.
    pub fn new(max_pass: Duration, max_wait: Duration) -> Self {
        Self {
            inner: Arc::new(ProgressInner {
                origin: Instant::now(),
                state: AtomicU64::new(IN_PASS),
                max_pass,
                max_wait,
                name: "the loop",
            }),
        }
    }

    /// A loop named `name` in the check's message, that starts waiting rather than in a pass
    /// (a worker that is idle until work arrives).
    pub fn idle(name: &'static str, max_pass: Duration, max_wait: Duration) -> Self {
        let progress = Self {
            inner: Arc::new(ProgressInner {
                origin: Instant::now(),
                state: AtomicU64::new(0),
                max_pass,
                max_wait,
                name,
            }),
        };
        progress.pass_ended();
        progress
    }

    fn now_ms(&self) -> u64 {
        let ms = self.inner.origin.elapsed().as_millis();
        u64::try_from(ms).unwrap_or(u64::MAX >> 1).min(IN_PASS - 1)
    }

    /// The loop woke up and starts working.
    pub fn pass_started(&self) {
        self.inner
            .state
            .store(IN_PASS | self.now_ms(), Ordering::Release);
    }

    /// The loop finished its work and starts waiting.
    pub fn pass_ended(&self) {
        self.inner.state.store(self.now_ms(), Ordering::Release);
    }

    /// The check at `now` (tests pass a later instant instead of sleeping).
    pub fn check_at(&self, now: Instant) -> Result<(), String> {
        let state = self.inner.state.load(Ordering::Acquire);
        let since = self.inner.origin + Duration::from_millis(state & !IN_PASS);
        let for_ = now.saturating_duration_since(since);
        let (what, bound) = if state & IN_PASS != 0 {
            (
                format!("a pass of {} has been running", self.inner.name),
                self.inner.max_pass,
            )
        } else {
            (
                format!("{} has been waiting", self.inner.name),
                self.inner.max_wait,
            )
        };
        if for_ > bound {
            Err(format!(
                "stuck: {what} for {} ms (bound {} ms)",
                for_.as_millis(),
                bound.as_millis()
            ))
        } else {
            Ok(())
        }
    }
}

impl Liveness for LoopProgress {
    fn check(&self) -> Result<(), String> {
        self.check_at(Instant::now())
    }
}

/// Live while both parts are (e.g. an agent's verification loop and its pod inspector).
impl<A: Liveness, B: Liveness> Liveness for (A, B) {
    fn check(&self) -> Result<(), String> {
        self.0.check().and_then(|()| self.1.check())
    }
}

#[derive(Clone)]
struct AdminState<R, L> {
    registry: Arc<Registry>,
    ready: R,
    live: L,
}

/// The admin router, always live; exposed so tests (and embedders) can drive it without a
/// socket.
pub fn router<R: Readiness>(registry: Arc<Registry>, ready: R) -> Router {
    router_with(registry, ready, AlwaysLive)
}

/// The admin router with `/live` answering from `live`.
pub fn router_with<R: Readiness, L: Liveness>(
    registry: Arc<Registry>,
    ready: R,
    live: L,
) -> Router {
    Router::new()
        .route("/live", get(live_handler::<R, L>))
        .route("/ready", get(ready_handler::<R, L>))
        .route("/metrics", get(metrics_handler::<R, L>))
        .with_state(AdminState {
            registry,
            ready,
            live,
        })
}

async fn live_handler<R: Readiness, L: Liveness>(State(s): State<AdminState<R, L>>) -> Response {
    match s.live.check() {
        Ok(()) => (StatusCode::OK, "ok\n").into_response(),
        Err(why) => {
            tracing::warn!(reason = %why, "liveness check failing");
            (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")).into_response()
        }
    }
}

async fn ready_handler<R: Readiness, L: Liveness>(State(s): State<AdminState<R, L>>) -> Response {
    if s.ready.is_ready() {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n").into_response()
    }
}

async fn metrics_handler<R: Readiness, L: Liveness>(State(s): State<AdminState<R, L>>) -> Response {
    let mut body = String::with_capacity(4096);
    match prometheus_client::encoding::text::encode(&mut body, &s.registry) {
        Ok(()) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
        )
            .into_response(),
        Err(e) => {
            tracing::error!(error = %e, "encoding metrics failed");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "metrics encoding failed\n",
            )
                .into_response()
        }
    }
}

/// The admin ports' limits: kubelet probes and a metrics scraper need a handful of
/// connections with small heads, so a port reachable from the node's network (the agent's is
/// on the host network) holds at most 256 × 8 KiB of request buffers. A probe that finds the
/// cap taken waits in the backlog until a connection ends, within 2 s at most for one that
/// sends nothing. Idle keep-alive connections are closed after 2 s too: kubelet probes open
/// a connection per probe, and a scraper's next scrape is further away than any useful idle
/// bound.
pub const LIMITS: server::Limits = server::Limits {
    max_connections: 256,
    // No share per client: the probes and the scrapes come from one or two addresses.
    max_connections_per_client: 256,
    handshake_timeout: Duration::from_secs(2),
    header_read_timeout: Duration::from_secs(2),
    keep_alive_timeout: Duration::from_secs(2),
    max_buf_size: 8 * 1024,
};

/// How long requests in flight on an admin port may take to finish once it stops.
pub const DRAIN: Duration = Duration::from_secs(1);

/// Serves the admin router (always live) on `listener` until `shutdown` resolves.
pub async fn serve<R: Readiness>(
    listener: TcpListener,
    registry: Arc<Registry>,
    ready: R,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    serve_with(listener, registry, ready, AlwaysLive, shutdown).await;
}

/// Serves the admin router with `/live` answering from `live` until `shutdown` resolves,
/// within [`LIMITS`], then drains for at most [`DRAIN`]. Errors of single connections are
/// logged; none ends the server.
pub async fn serve_with<R: Readiness, L: Liveness>(
    listener: TcpListener,
    registry: Arc<Registry>,
    ready: R,
    live: L,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let app = router_with(registry, ready, live);
    server::serve_until(listener, server::Plain, app, shutdown, DRAIN, LIMITS).await;
}

/// How long [`AdminServer::stop`] waits for the server to end: its drain ([`DRAIN`]) and a
/// margin.
pub const STOP_WAIT: Duration = Duration::from_secs(2);

/// The admin server in a task of its own, from [`AdminServer::start`] until
/// [`AdminServer::stop`] (or until dropped: then it ends at once, without draining).
#[derive(Debug)]
pub struct AdminServer {
    /// The server's task and the sender whose drop stops it; `None` without a listener.
    running: Option<(JoinHandle<()>, oneshot::Sender<()>)>,
}

impl AdminServer {
    /// Serves the admin router with `/live` answering from `live` on `listener`; no server
    /// when there is none (no `--admin-addr`).
    pub fn start<R: Readiness, L: Liveness>(
        listener: Option<TcpListener>,
        registry: Arc<Registry>,
        ready: R,
        live: L,
    ) -> Self {
        let running = listener.map(|listener| {
            let (stop, stopped) = oneshot::channel::<()>();
            let stopped = async move {
                let _ = stopped.await;
            };
            let task = tokio::spawn(serve_with(listener, registry, ready, live, stopped));
            (task, stop)
        });
        Self { running }
    }

    /// Stops the server: requests in flight finish within [`DRAIN`]. Waits for it within
    /// [`STOP_WAIT`], and logs when it failed or did not stop in time.
    pub async fn stop(mut self) {
        let Some((task, stop)) = self.running.take() else {
            return;
        };
        drop(stop);
        match tokio::time::timeout(STOP_WAIT, task).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "admin server task failed"),
            Err(_) => tracing::warn!("admin server did not stop in time"),
        }
    }
}

impl Drop for AdminServer {
    fn drop(&mut self) {
        if let Some((task, _)) = &self.running {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use http::Request;
    use http_body_util::BodyExt;
    use prometheus_client::metrics::counter::Counter;
    use tower::ServiceExt;

    async fn get(app: Router, path: &str) -> (StatusCode, String) {
        let resp = app
            .oneshot(Request::get(path).body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = resp.status();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8(body.to_vec()).unwrap())
    }

    #[tokio::test]
    async fn ready_follows_the_signal_and_metrics_encode_the_registry() {
        let mut registry = Registry::default();
        let c = Counter::<u64>::default();
        registry.register("demo_things", "things", c.clone());
        c.inc();
        let registry = Arc::new(registry);
        let (tx, rx) = watch::channel(false);
        let app = router(registry, rx);

        assert_eq!(get(app.clone(), "/live").await.0, StatusCode::OK);
        assert_eq!(
            get(app.clone(), "/ready").await.0,
            StatusCode::SERVICE_UNAVAILABLE
        );
        tx.send(true).unwrap();
        assert_eq!(get(app.clone(), "/ready").await.0, StatusCode::OK);
        let (status, body) = get(app, "/metrics").await;
        assert_eq!(status, StatusCode::OK);
        assert!(body.contains("demo_things_total 1"), "{body}");
        assert!(body.ends_with("# EOF\n"), "{body}");
    }

    #[tokio::test]
    async fn atomic_bool_is_a_readiness_signal() {
        let flag = Arc::new(AtomicBool::new(false));
        let app = router(Arc::new(Registry::default()), flag.clone());
        assert_eq!(
            get(app.clone(), "/ready").await.0,
            StatusCode::SERVICE_UNAVAILABLE
        );
        flag.store(true, Ordering::Release);
        assert_eq!(get(app, "/ready").await.0, StatusCode::OK);
    }

    /// A loop stuck in a pass (a verification that never ends) fails `/live` with the
    /// reason once the pass bound is over; a loop waiting longer than its wait bound (not
    /// ticking) fails it too; each recovers when the loop moves again.
    #[tokio::test]
    async fn live_fails_while_the_loop_is_stuck() {
        let progress = LoopProgress::new(Duration::from_millis(100), Duration::from_millis(300));
        let app = router_with(
            Arc::new(Registry::default()),
            Arc::new(AtomicBool::new(true)),
            progress.clone(),
        );

        // Start-up is the first pass, within its bound.
        assert_eq!(get(app.clone(), "/live").await.0, StatusCode::OK);
        // Stuck in it.
        tokio::time::sleep(Duration::from_millis(150)).await;
        let (status, body) = get(app.clone(), "/live").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            body.contains("a pass of the loop has been running"),
            "{body}"
        );
        assert!(body.contains("bound 100 ms"), "{body}");
        // Readiness and metrics are not liveness: they keep answering.
        assert_eq!(get(app.clone(), "/ready").await.0, StatusCode::OK);
        assert_eq!(get(app.clone(), "/metrics").await.0, StatusCode::OK);

        // The pass ends: waiting, within the wait bound.
        progress.pass_ended();
        assert_eq!(get(app.clone(), "/live").await.0, StatusCode::OK);
        let now = Instant::now();
        assert!(progress.check_at(now + Duration::from_millis(250)).is_ok());
        // The loop never wakes again (no resync tick): stuck waiting.
        let err = progress
            .check_at(now + Duration::from_millis(400))
            .unwrap_err();
        assert!(err.contains("the loop has been waiting"), "{err}");
        // It wakes: a fresh pass.
        progress.pass_started();
        assert!(
            progress
                .check_at(Instant::now() + Duration::from_millis(50))
                .is_ok()
        );
        assert!(
            progress
                .check_at(Instant::now() + Duration::from_millis(200))
                .is_err()
        );
    }

    #[tokio::test]
    async fn an_idle_worker_is_live_until_a_pass_outlasts_its_bound_and_pairs_fail_on_either() {
        let loop_ = LoopProgress::new(Duration::from_secs(60), Duration::from_secs(120));
        let pods = LoopProgress::idle(
            "the pod inspector",
            Duration::from_millis(100),
            Duration::MAX,
        );
        let both = (loop_.clone(), pods.clone());
        // Idle for as long as it likes.
        assert!(
            pods.check_at(Instant::now() + Duration::from_secs(86_400))
                .is_ok()
        );
        assert!(both.check().is_ok());
        // A batch that never returns.
        pods.pass_started();
        let err = pods
            .check_at(Instant::now() + Duration::from_millis(200))
            .unwrap_err();
        assert!(
            err.contains("a pass of the pod inspector has been running"),
            "{err}"
        );
        tokio::time::sleep(Duration::from_millis(150)).await;
        let err = both.check().unwrap_err();
        assert!(err.contains("the pod inspector"), "{err}");
        pods.pass_ended();
        assert!(both.check().is_ok());
    }

    /// The admin server on a socket is the bounded server: a connection that sends part of a
    /// head and stops is closed at the 2 s header timeout while `/live` keeps answering, a
    /// head past 8 KiB gets a 431, and the server stops within its drain although that
    /// connection was still open when it was asked to.
    #[tokio::test]
    async fn the_admin_port_cuts_slow_and_oversized_heads() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(
            listener,
            Arc::new(Registry::default()),
            Arc::new(AtomicBool::new(true)),
            async move {
                let _ = stop_rx.await;
            },
        ));
        async fn read_all(s: &mut tokio::net::TcpStream, within: Duration) -> Option<String> {
            let mut out = Vec::new();
            tokio::time::timeout(within, s.read_to_end(&mut out))
                .await
                .ok()
                .map(|_| String::from_utf8_lossy(&out).into_owned())
        }
        let mut slow = tokio::net::TcpStream::connect(addr).await.unwrap();
        slow.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        let mut big = tokio::net::TcpStream::connect(addr).await.unwrap();
        let head = format!("GET /live HTTP/1.1\r\nX-Big: {}\r\n", "b".repeat(9000));
        let _ = big.write_all(head.as_bytes()).await;
        let answer = read_all(&mut big, Duration::from_secs(2)).await;
        assert!(
            answer
                .as_deref()
                .is_some_and(|a| a.starts_with("HTTP/1.1 431")),
            "{answer:?}"
        );
        let mut probe = tokio::net::TcpStream::connect(addr).await.unwrap();
        probe
            .write_all(b"GET /live HTTP/1.0\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let answer = read_all(&mut probe, Duration::from_secs(2)).await.unwrap();
        assert!(answer.starts_with("HTTP/1.0 200"), "{answer:?}");
        let begun = Instant::now();
        assert!(
            read_all(&mut slow, Duration::from_secs(4)).await.is_some(),
            "the slow head was not closed"
        );
        assert!(begun.elapsed() < Duration::from_secs(3));

        let mut held = tokio::net::TcpStream::connect(addr).await.unwrap();
        held.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
        drop(stop_tx);
        tokio::time::timeout(DRAIN + Duration::from_secs(1), server)
            .await
            .expect("stopped within the drain")
            .unwrap();
    }

    #[tokio::test]
    async fn the_plain_router_is_always_live() {
        let app = router(
            Arc::new(Registry::default()),
            Arc::new(AtomicBool::new(false)),
        );
        assert_eq!(get(app, "/live").await.0, StatusCode::OK);
    }
}
