//! The HTTPS front: routes, limits, TLS accept loop and graceful shutdown.
//!
//! In: a [`Reviewer`], the readiness signal, [`Limits`], a bound TCP listener, a rustls
//! config (see [`crate::tls`]) and the shutdown [`Phase`]. Out: HTTP responses:
//! - `POST /validate`, `POST /mutate-node` → 200 with the AdmissionReview response;
//! - a body that is not an AdmissionReview → 400 with a plain-text reason;
//! - a body over `max_body_bytes` → 413;
//! - not answered within `request_timeout` → 503, so the apiserver applies the
//!   webhook's failurePolicy well before its own timeout (10 s by default) fires;
//! - caches not synced yet → the request waits for them inside that same timeout.
//!
//! Shutdown follows a [`Phase`] watch (see [`crate::shutdown`]):
//! - [`Phase::Delaying`]: the listener keeps accepting and every request is answered as
//!   usual, but each response carries `Connection: close`, so a client's next request opens a
//!   new connection, which the Service routes to another replica once this one has left the
//!   endpoints. Clients learn of the close from the response itself, so none writes a request
//!   onto a connection the server is closing.
//! - [`Phase::Draining`]: the listener closes (connections already waiting in its backlog are
//!   still accepted), keep-alive connections still idle (they carried no request during the
//!   whole delay) are closed, and requests in flight finish, bounded by the drain timeout.
//!   A connection accepted after the stop request answers its one request even if that
//!   request arrives after the drain started.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderValue, StatusCode, header};
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
use crate::shutdown::Phase;

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

/// Serves `app` over TLS on `listener` until `phase` reaches [`Phase::Draining`], then drains
/// for at most `drain`. From [`Phase::Delaying`] on, responses carry `Connection: close`.
/// Accept and handshake errors are logged, never fatal.
pub async fn serve_tls(
    listener: TcpListener,
    tls: Arc<ServerConfig>,
    app: Router,
    phase: watch::Receiver<Phase>,
    drain: Duration,
) {
    let acceptor = TlsAcceptor::from(tls);
    let graceful = GracefulShutdown::new();
    let stopping = phase.clone();
    // Decided when the response is written, so a request in flight when the delay starts is
    // answered with the close too.
    let app = app.layer(tower::util::MapResponseLayer::new(
        move |mut resp: Response| {
            if *stopping.borrow() != Phase::Serving {
                resp.headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            resp
        },
    ));
    let mut draining = phase.clone();
    // A dropped sender also ends serving: nobody could ask for the drain any more.
    let draining = async move {
        let _ = draining.wait_for(|p| *p == Phase::Draining).await;
    };
    let mut draining = std::pin::pin!(draining);
    loop {
        let (tcp, peer) = tokio::select! {
            // Checked first, so the backlog left at the close is handled below, in one place.
            biased;
            () = &mut draining => break,
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
        let serving = *phase.borrow() == Phase::Serving;
        let watcher = graceful.watcher();
        spawn_connection(tcp, peer, &acceptor, &app, watcher, serving);
    }
    // Connections the kernel completed before the close are served, not reset by it (each
    // answers one request and closes). Accepted with the plain socket call: the async
    // listener only retries once the reactor reported readiness, which may not have happened.
    let late = accept_backlog(listener, |tcp, peer| {
        spawn_connection(tcp, peer, &acceptor, &app, graceful.watcher(), false);
    });
    tracing::info!(
        connections = graceful.count(),
        accepted_at_close = late,
        "shutting down: listener closed, draining in-flight requests"
    );
    tokio::select! {
        () = graceful.shutdown() => tracing::info!("drained"),
        () = tokio::time::sleep(drain) => tracing::warn!(?drain, "drain timed out; closing remaining connections"),
    }
}

/// At most this many connections still waiting in the kernel are accepted when the listener
/// closes (the default `somaxconn` is 4096; the rest are reset).
const ACCEPT_BACKLOG_DRAIN: usize = 4096;

/// Accepts what waits in `listener`'s backlog without waiting for more, hands each to `serve`,
/// and closes the listener; returns how many there were.
fn accept_backlog(
    listener: TcpListener,
    mut serve: impl FnMut(tokio::net::TcpStream, std::net::SocketAddr),
) -> usize {
    let listener = match listener.into_std() {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(error = %e, "cannot take the listener's backlog");
            return 0;
        }
    };
    let mut n = 0;
    while n < ACCEPT_BACKLOG_DRAIN {
        // Still non-blocking (tokio set it): WouldBlock ends the loop.
        let Ok((tcp, peer)) = listener.accept() else {
            break;
        };
        // An accepted socket does not inherit the listener's O_NONBLOCK.
        match tcp
            .set_nonblocking(true)
            .and_then(|()| tokio::net::TcpStream::from_std(tcp))
        {
            Ok(tcp) => {
                n += 1;
                serve(tcp, peer);
            }
            Err(e) => tracing::debug!(%peer, error = %e, "cannot register a late connection"),
        }
    }
    n
}

/// Handshakes and serves one connection. One accepted while `serving` is told to finish at the
/// drain (its idle keep-alive is closed, a request in flight completes). One accepted after the
/// stop request is not: its answers carry `Connection: close`, so it ends by itself after one
/// request, and told to shut down before its request was read (the drain starting during its
/// TLS handshake) it would be closed unanswered. Its watcher is held so the drain waits for it.
fn spawn_connection(
    tcp: tokio::net::TcpStream,
    peer: std::net::SocketAddr,
    acceptor: &TlsAcceptor,
    app: &Router,
    watcher: hyper_util::server::graceful::Watcher,
    serving: bool,
) {
    let _ = tcp.set_nodelay(true);
    let acceptor = acceptor.clone();
    let app = app.clone();
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
        let result = if serving {
            watcher.watch(conn).await
        } else {
            let _counted = watcher;
            conn.await
        };
        if let Err(e) = result {
            tracing::debug!(%peer, error = %e, "connection ended with an error");
        }
    });
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::review::tests::{binding_review, fake_cluster, pod_review, reviewer};
    use axum::body::Body;
    use http::Request;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    pub(crate) fn app(
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
    pub(crate) struct Pki {
        ca: rcgen::Issuer<'static, rcgen::KeyPair>,
        ca_der: rustls::pki_types::CertificateDer<'static>,
    }

    impl Pki {
        pub(crate) fn new() -> Self {
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
        pub(crate) fn issue(
            &self,
            cert_path: &std::path::Path,
            key_path: &std::path::Path,
        ) -> Vec<u8> {
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

    pub(crate) type Sender = hyper::client::conn::http1::SendRequest<http_body_util::Full<Bytes>>;

    /// Opens a TLS connection (verifying the CA and the 127.0.0.1 SAN) and returns a request
    /// sender plus the certificate the server presented.
    pub(crate) async fn connect(
        pki: &Pki,
        addr: std::net::SocketAddr,
    ) -> std::io::Result<(Sender, Vec<u8>)> {
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

    /// An answer: status, JSON body, and whether the server announced it closes the
    /// connection after it (`Connection: close`).
    pub(crate) struct Answer {
        pub status: StatusCode,
        pub body: serde_json::Value,
        pub close: bool,
    }

    pub(crate) async fn try_send(
        sender: &mut Sender,
        body: &serde_json::Value,
    ) -> Result<Answer, hyper::Error> {
        sender.ready().await?;
        let req = Request::post("/validate")
            .header("host", "127.0.0.1")
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(Bytes::from(
                serde_json::to_vec(body).unwrap(),
            )))
            .unwrap();
        let resp = sender.send_request(req).await?;
        let status = resp.status();
        let close = resp
            .headers()
            .get(header::CONNECTION)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"close"));
        let bytes = resp.into_body().collect().await?.to_bytes();
        Ok(Answer {
            status,
            body: serde_json::from_slice(&bytes).unwrap_or_default(),
            close,
        })
    }

    async fn send(
        sender: &mut Sender,
        body: &serde_json::Value,
    ) -> (StatusCode, serde_json::Value) {
        let a = try_send(sender, body).await.unwrap();
        (a.status, a.body)
    }

    /// Waits up to 2 s for the server to close a connection (the client side sees it closed).
    pub(crate) async fn closed_by_server(sender: &mut Sender) -> bool {
        tokio::time::timeout(Duration::from_secs(2), async {
            while !sender.is_closed() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .is_ok()
    }

    /// Serves `app` on a fresh loopback listener; the phase sender drives its shutdown.
    pub(crate) async fn start(
        app: Router,
        tls: Arc<ServerConfig>,
    ) -> (
        std::net::SocketAddr,
        watch::Sender<Phase>,
        tokio::task::JoinHandle<()>,
    ) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (phase_tx, phase) = crate::shutdown::phase_channel();
        let server = tokio::spawn(serve_tls(listener, tls, app, phase, Duration::from_secs(5)));
        (addr, phase_tx, server)
    }

    /// A TLS server over `cluster` with a fresh CA and certificate: the CA (to connect), the
    /// address, the phase sender and the server task. The directory holding the key lives as
    /// long as the returned guard.
    pub(crate) async fn start_tls(
        cluster: crate::review::tests::FakeCluster,
    ) -> (
        tempfile::TempDir,
        Pki,
        std::net::SocketAddr,
        watch::Sender<Phase>,
        tokio::task::JoinHandle<()>,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        let pki = Pki::new();
        pki.issue(&cert, &key);
        let (app, _tx) = app(cluster, true, Limits::default());
        let tls = crate::tls::server_config(&cert, &key).unwrap();
        let (addr, phase, server) = start(app, tls).await;
        (dir, pki, addr, phase, server)
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
        let (addr, phase, server) = start(app, tls).await;

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
        // No delay: straight to the drain.
        phase.send_replace(Phase::Draining);
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

    /// The shutdown delay on a real TLS listener: a new connection made during the delay is
    /// accepted and answered, every answer from the delay on says `Connection: close` and the
    /// server then closes that connection, a request in flight when the delay starts is
    /// answered with the close too; at the drain the listener closes, a connection idle
    /// through the whole delay is closed, and a request in flight still finishes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_delay_keeps_serving_and_moves_clients_off_then_the_drain_closes() {
        let mut cluster = fake_cluster();
        cluster.delay = Some(Duration::from_millis(600));
        let (_dir, pki, addr, phase, server) = start_tls(cluster).await;
        let meshed_on_bad = pod_review("web", Some("bad"), true);

        // Serving: keep-alive as usual.
        let (mut idle, _) = connect(&pki, addr).await.unwrap();
        let a = try_send(&mut idle, &meshed_on_bad).await.unwrap();
        assert_eq!(a.status, StatusCode::OK);
        assert!(!a.close, "no close while serving");
        let (mut busy, _) = connect(&pki, addr).await.unwrap();
        assert!(!try_send(&mut busy, &meshed_on_bad).await.unwrap().close);

        // A binding whose lookup takes 600 ms is in flight when the delay starts.
        let (mut slow, _) = connect(&pki, addr).await.unwrap();
        let binding = binding_review("meshed", "bad");
        let in_flight = tokio::spawn(async move {
            let a = try_send(&mut slow, &binding).await;
            (a, slow)
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        phase.send_replace(Phase::Delaying);

        // A new connection during the delay: accepted, answered right, then closed by the
        // server after it told the client so.
        let (mut fresh, _) = connect(&pki, addr)
            .await
            .expect("the listener still accepts during the delay");
        let a = try_send(&mut fresh, &meshed_on_bad).await.unwrap();
        assert_eq!(a.status, StatusCode::OK);
        assert_eq!(a.body["response"]["allowed"], false);
        assert!(a.close, "answers during the delay carry Connection: close");
        assert!(
            closed_by_server(&mut fresh).await,
            "closed after the answer"
        );
        // An existing keep-alive connection is answered once more, then retired the same way.
        let a = try_send(&mut busy, &meshed_on_bad).await.unwrap();
        assert_eq!(a.status, StatusCode::OK);
        assert!(a.close);
        assert!(closed_by_server(&mut busy).await);
        // The request in flight when the delay began: answered right, with the close.
        let (a, mut slow) = in_flight.await.unwrap();
        let a = a.unwrap();
        assert_eq!(a.status, StatusCode::OK);
        assert_eq!(a.body["response"]["allowed"], false);
        assert!(a.close);
        assert!(closed_by_server(&mut slow).await);
        // The connection that carried no request during the delay is still open.
        assert!(!idle.is_closed());

        // Another lookup in flight when the drain starts.
        let (mut last, _) = connect(&pki, addr).await.unwrap();
        let binding = binding_review("meshed", "bad");
        let in_flight = tokio::spawn(async move { try_send(&mut last, &binding).await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        phase.send_replace(Phase::Draining);
        assert!(!in_flight.is_finished(), "in flight when the drain starts");
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            connect(&pki, addr).await.is_err(),
            "the listener closes when the drain starts"
        );
        assert!(
            closed_by_server(&mut idle).await,
            "an idle keep-alive connection is closed at the drain"
        );
        let a = in_flight
            .await
            .unwrap()
            .expect("the in-flight request drained");
        assert_eq!(a.status, StatusCode::OK);
        assert_eq!(a.body["response"]["allowed"], false);
        tokio::time::timeout(Duration::from_secs(5), server)
            .await
            .expect("the server stops once drained")
            .unwrap();
    }

    /// A connection accepted during the delay whose request only comes after the drain
    /// started (its TLS handshake was still running, say) is answered, not closed unread.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connection_accepted_during_the_delay_is_answered_after_the_drain_starts() {
        let (_dir, pki, addr, phase, server) = start_tls(fake_cluster()).await;
        phase.send_replace(Phase::Delaying);
        let (mut quiet, _) = connect(&pki, addr).await.unwrap();
        phase.send_replace(Phase::Draining);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(connect(&pki, addr).await.is_err(), "listener closed");
        let a = try_send(&mut quiet, &pod_review("web", Some("good"), true))
            .await
            .expect("answered after the drain started");
        assert_eq!(a.status, StatusCode::OK);
        assert_eq!(a.body["response"]["allowed"], true);
        assert!(a.close);
        tokio::time::timeout(Duration::from_secs(5), server)
            .await
            .expect("the server stops once that connection is done")
            .unwrap();
    }

    /// Connections the kernel completed before the listener closed are served, not reset.
    /// Single-threaded, so the server cannot accept between the connect and the drain.
    #[tokio::test]
    async fn connections_waiting_in_the_backlog_at_the_close_are_served() {
        let (_dir, pki, addr, phase, server) = start_tls(fake_cluster()).await;
        tokio::task::yield_now().await; // the accept loop is waiting
        phase.send_replace(Phase::Delaying);
        // Blocking connects: the kernel completes them while the server task cannot run.
        let waiting: Vec<_> = (0..3)
            .map(|_| std::net::TcpStream::connect(addr).unwrap())
            .collect();
        phase.send_replace(Phase::Draining);
        for tcp in waiting {
            tcp.set_nonblocking(true).unwrap();
            let tcp = tokio::net::TcpStream::from_std(tcp).unwrap();
            let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
            let tls = pki.connector().connect(name, tcp).await.expect("not reset");
            let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
                .await
                .unwrap();
            tokio::spawn(conn);
            let a = try_send(&mut sender, &pod_review("web", Some("bad"), true))
                .await
                .expect("answered");
            assert_eq!(a.status, StatusCode::OK);
            assert_eq!(a.body["response"]["allowed"], false);
        }
        assert!(connect(&pki, addr).await.is_err(), "listener closed");
        tokio::time::timeout(Duration::from_secs(5), server)
            .await
            .expect("the server stops")
            .unwrap();
    }
}
