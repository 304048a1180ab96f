//! Admin HTTP server: `/live`, `/ready` and `/metrics` on a plain-HTTP port.
//!
//! In: a prometheus-client [`Registry`] and a [`Readiness`] signal. Out: `GET /live` → 200
//! while the process serves at all; `GET /ready` → 200 once the signal says ready, else 503;
//! `GET /metrics` → the registry in OpenMetrics text. Nothing here knows about the webhook, so
//! the agent can share it (it is meant to move to a common crate).

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::watch;

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

#[derive(Clone)]
struct AdminState<R> {
    registry: Arc<Registry>,
    ready: R,
}

/// The admin router; exposed so tests (and embedders) can drive it without a socket.
pub fn router<R: Readiness>(registry: Arc<Registry>, ready: R) -> Router {
    Router::new()
        .route("/live", get(|| async { "ok\n" }))
        .route("/ready", get(ready_handler::<R>))
        .route("/metrics", get(metrics_handler::<R>))
        .with_state(AdminState { registry, ready })
}

async fn ready_handler<R: Readiness>(State(s): State<AdminState<R>>) -> Response {
    if s.ready.is_ready() {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n").into_response()
    }
}

async fn metrics_handler<R: Readiness>(State(s): State<AdminState<R>>) -> Response {
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

/// Serves the admin router on `listener` until `shutdown` resolves.
pub async fn serve<R: Readiness>(
    listener: TcpListener,
    registry: Arc<Registry>,
    ready: R,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(registry, ready))
        .with_graceful_shutdown(shutdown)
        .await
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
}
