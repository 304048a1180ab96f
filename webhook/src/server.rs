//! The HTTPS front: routes, limits, TLS accept loop and graceful shutdown.
//!
//! In: a [`Reviewer`], the readiness signal, [`Limits`], a bound TCP listener, a rustls
//! config (see [`crate::tls`]) and a shutdown future. Out: HTTP responses:
//! - `POST /validate`, `POST /mutate-node` → 200 with the AdmissionReview response;
//! - a body that is not an AdmissionReview → 400 with a plain-text reason;
//! - a body over `max_body_bytes` → 413;
//! - not answered within `request_timeout` → 503, so the apiserver applies the
//!   webhook's failurePolicy well before its own timeout (10 s by default) fires;
//! - caches not synced yet → the request waits for them inside that same timeout.
//!
//! On shutdown the listener closes first, idle keep-alive connections are closed, and
//! requests in flight finish (bounded by the drain timeout).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Json, Response};
use axum::routing::post;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use rustls::ServerConfig;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_rustls::TlsAcceptor;
use tower_http::timeout::TimeoutLayer;

use crate::review::{Cluster, Outcome, Reviewer};

/// Request limits.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Largest accepted request body. A Pod object is at most ~1.5 MB (etcd's limit), and an
    /// AdmissionReview for CREATE carries it once.
    pub max_body_bytes: usize,
    /// Per-request deadline; keep it well below the webhook's `timeoutSeconds`.
    pub request_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_body_bytes: 3 * 1024 * 1024,
            request_timeout: Duration::from_secs(3),
        }
    }
}

/// Timeouts of the connection layer.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

struct AppState<C> {
    reviewer: Arc<Reviewer<C>>,
    ready: watch::Receiver<bool>,
}

impl<C> Clone for AppState<C> {
    fn clone(&self) -> Self {
        Self {
            reviewer: self.reviewer.clone(),
            ready: self.ready.clone(),
        }
    }
}

fn respond(outcome: Outcome) -> Response {
    match outcome {
        Outcome::Answer(review) => Json(review).into_response(),
        Outcome::Malformed(message) => (StatusCode::BAD_REQUEST, message).into_response(),
    }
}

async fn wait_ready(ready: &watch::Receiver<bool>) -> bool {
    let mut ready = ready.clone();
    // Bounded by the timeout layer; a dropped sender means the caches never sync.
    ready.wait_for(|r| *r).await.is_ok()
}

async fn validate<C: Cluster>(State(s): State<AppState<C>>, body: Bytes) -> Response {
    if !wait_ready(&s.ready).await {
        return (StatusCode::SERVICE_UNAVAILABLE, "caches not synced\n").into_response();
    }
    respond(s.reviewer.validate(&body).await)
}

async fn mutate_node<C: Cluster>(State(s): State<AppState<C>>, body: Bytes) -> Response {
    // Needs no cache: a new node is gated whatever the caches say.
    respond(s.reviewer.mutate_node(&body))
}

/// The webhook's routes with body limit and per-request timeout.
pub fn router<C: Cluster>(
    reviewer: Arc<Reviewer<C>>,
    ready: watch::Receiver<bool>,
    limits: Limits,
) -> Router {
    Router::new()
        .route("/validate", post(validate::<C>))
        .route("/mutate-node", post(mutate_node::<C>))
        .with_state(AppState { reviewer, ready })
        .layer(DefaultBodyLimit::max(limits.max_body_bytes))
        .layer(TimeoutLayer::with_status_code(
            StatusCode::SERVICE_UNAVAILABLE,
            limits.request_timeout,
        ))
}

/// Serves `app` over TLS on `listener` until `shutdown` resolves, then drains for at most
/// `drain`. Accept and handshake errors are logged, never fatal.
pub async fn serve_tls(
    listener: TcpListener,
    tls: Arc<ServerConfig>,
    app: Router,
    shutdown: impl Future<Output = ()>,
    drain: Duration,
) {
    let acceptor = TlsAcceptor::from(tls);
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // EMFILE and friends: back off briefly instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = tcp.set_nodelay(true);
        let acceptor = acceptor.clone();
        let app = app.clone();
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                    return;
                }
                Err(_) => {
                    tracing::debug!(%peer, "TLS handshake timed out");
                    return;
                }
            };
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .serve_connection(TokioIo::new(tls), TowerToHyperService::new(app));
            if let Err(e) = watcher.watch(conn).await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    tracing::info!(
        connections = graceful.count(),
        "shutting down: draining in-flight requests"
    );
    tokio::select! {
        () = graceful.shutdown() => tracing::info!("drained"),
        () = tokio::time::sleep(drain) => tracing::warn!(?drain, "drain timed out; closing remaining connections"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::review::tests::{binding_review, fake_cluster, pod_review, reviewer};
    use axum::body::Body;
    use http::Request;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    fn app(
        cluster: crate::review::tests::FakeCluster,
        ready: bool,
        limits: Limits,
    ) -> (Router, watch::Sender<bool>) {
        let (r, _) = reviewer(cluster);
        let (tx, rx) = watch::channel(ready);
        (router(Arc::new(r), rx, limits), tx)
    }

    async fn post(app: Router, path: &str, body: Vec<u8>) -> (StatusCode, Vec<u8>) {
        let resp = app
            .oneshot(
                Request::post(path)
                    .header("content-type", "application/json")
                    .body(Body::from(body))
                    .unwrap(),
            )
            .await
            .unwrap();
        let status = resp.status();
        (
            status,
            resp.into_body()
                .collect()
                .await
                .unwrap()
                .to_bytes()
                .to_vec(),
        )
    }

    #[tokio::test]
    async fn review_round_trip_over_http() {
        let (app, _tx) = app(fake_cluster(), true, Limits::default());
        let body = serde_json::to_vec(&pod_review("web", Some("bad"), true)).unwrap();
        let (status, out) = post(app.clone(), "/validate", body).await;
        assert_eq!(status, StatusCode::OK);
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["response"]["allowed"], false);

        let (status, out) = post(app.clone(), "/validate", b"{not json".to_vec()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(String::from_utf8_lossy(&out).contains("malformed AdmissionReview"));

        let (status, _) = post(app, "/nope", b"{}".to_vec()).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
    }

    #[tokio::test]
    async fn oversized_bodies_are_refused() {
        let limits = Limits {
            max_body_bytes: 1024,
            ..Limits::default()
        };
        let (app, _tx) = app(fake_cluster(), true, limits);
        let mut review = pod_review("web", Some("bad"), true);
        review["request"]["object"]["metadata"]["annotations"] =
            serde_json::json!({"big": "x".repeat(4096)});
        let (status, _) = post(app, "/validate", serde_json::to_vec(&review).unwrap()).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    }

    #[tokio::test]
    async fn slow_answers_time_out_with_503_and_unsynced_caches_are_waited_for() {
        let mut cluster = fake_cluster();
        cluster.delay = Some(Duration::from_millis(500));
        let limits = Limits {
            request_timeout: Duration::from_millis(100),
            ..Limits::default()
        };
        let (slow, _tx) = app(cluster, true, limits);
        let body = serde_json::to_vec(&binding_review("meshed", "bad")).unwrap();
        let (status, _) = post(slow, "/validate", body.clone()).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);

        let limits = Limits {
            request_timeout: Duration::from_millis(2000),
            ..Limits::default()
        };
        let (unsynced, tx) = app(fake_cluster(), false, limits);
        let pending = tokio::spawn(post(unsynced, "/validate", body));
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!pending.is_finished(), "answered before the caches synced");
        tx.send(true).unwrap();
        let (status, _) = pending.await.unwrap();
        assert_eq!(status, StatusCode::OK);
    }

    /// A CA and a serving certificate for 127.0.0.1 signed by it, written to `dir`.
    struct Pki {
        ca: rcgen::Issuer<'static, rcgen::KeyPair>,
        ca_der: rustls::pki_types::CertificateDer<'static>,
    }

    impl Pki {
        fn new() -> Self {
            let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
            params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            params
                .distinguished_name
                .push(rcgen::DnType::CommonName, "meshgate test CA");
            let key = rcgen::KeyPair::generate().unwrap();
            let cert = params.self_signed(&key).unwrap();
            Self {
                ca_der: cert.der().clone(),
                ca: rcgen::Issuer::new(params, key),
            }
        }

        /// Issues a serving certificate and writes it (and its key) to the given paths.
        fn issue(&self, cert_path: &std::path::Path, key_path: &std::path::Path) -> Vec<u8> {
            let key = rcgen::KeyPair::generate().unwrap();
            let params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
            let cert = params.signed_by(&key, &self.ca).unwrap();
            // Key first, then the certificate: each intermediate state is either the old
            // pair, a mismatched pair (kept out by the resolver), or the new pair.
            std::fs::write(key_path, key.serialize_pem()).unwrap();
            std::fs::write(cert_path, cert.pem()).unwrap();
            cert.der().to_vec()
        }

        fn connector(&self) -> tokio_rustls::TlsConnector {
            let mut roots = rustls::RootCertStore::empty();
            roots.add(self.ca_der.clone()).unwrap();
            let config = rustls::ClientConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
            tokio_rustls::TlsConnector::from(Arc::new(config))
        }
    }

    type Sender = hyper::client::conn::http1::SendRequest<http_body_util::Full<Bytes>>;

    /// Opens a TLS connection (verifying the CA and the 127.0.0.1 SAN) and returns a request
    /// sender plus the certificate the server presented.
    async fn connect(pki: &Pki, addr: std::net::SocketAddr) -> std::io::Result<(Sender, Vec<u8>)> {
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
        let tls = pki.connector().connect(name, tcp).await?;
        let presented = tls.get_ref().1.peer_certificates().unwrap()[0].to_vec();
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(std::io::Error::other)?;
        tokio::spawn(conn);
        Ok((sender, presented))
    }

    async fn send(
        sender: &mut Sender,
        body: &serde_json::Value,
    ) -> (StatusCode, serde_json::Value) {
        sender.ready().await.unwrap();
        let req = Request::post("/validate")
            .header("host", "127.0.0.1")
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(Bytes::from(
                serde_json::to_vec(body).unwrap(),
            )))
            .unwrap();
        let resp = sender.send_request(req).await.unwrap();
        let status = resp.status();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice(&bytes).unwrap_or_default())
    }

    /// Real TLS on loopback: certificate rotation without restart, keep-alive connections
    /// surviving it, and a graceful shutdown that lets an in-flight review finish.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tls_rotation_and_graceful_shutdown() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        let pki = Pki::new();
        let first = pki.issue(&cert, &key);

        let mut cluster = fake_cluster();
        cluster.delay = Some(Duration::from_millis(400));
        let (app, _tx) = app(cluster, true, Limits::default());
        let tls = crate::tls::server_config(&cert, &key).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve_tls(
            listener,
            tls,
            app,
            async {
                let _ = stop_rx.await;
            },
            Duration::from_secs(5),
        ));

        let (mut old_conn, presented) = connect(&pki, addr).await.unwrap();
        assert_eq!(presented, first);
        let meshed_on_bad = pod_review("web", Some("bad"), true);
        let (status, v) = send(&mut old_conn, &meshed_on_bad).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(v["response"]["allowed"], false);

        // Rotate on disk. Give the files a distinct mtime even on coarse-clock filesystems.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let second = pki.issue(&cert, &key);
        assert_ne!(first, second);
        let (mut new_conn, presented) = connect(&pki, addr).await.unwrap();
        assert_eq!(
            presented, second,
            "new connections get the rotated certificate"
        );
        assert_eq!(send(&mut new_conn, &meshed_on_bad).await.0, StatusCode::OK);
        // The keep-alive connection made before the rotation keeps working.
        assert_eq!(send(&mut old_conn, &meshed_on_bad).await.0, StatusCode::OK);

        // A binding whose pod lookup takes 400 ms is in flight when shutdown starts.
        let binding = binding_review("meshed", "bad");
        let in_flight = tokio::spawn(async move { send(&mut new_conn, &binding).await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        stop_tx.send(()).unwrap();
        let (status, v) = in_flight.await.unwrap();
        assert_eq!(status, StatusCode::OK, "in-flight request drained");
        assert_eq!(v["response"]["allowed"], false);
        tokio::time::timeout(Duration::from_secs(5), server)
            .await
            .expect("server stops after draining")
            .unwrap();
        assert!(
            connect(&pki, addr).await.is_err(),
            "listener closed after shutdown"
        );
    }
}
