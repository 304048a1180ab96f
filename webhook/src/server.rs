//! The HTTPS front: routes, limits and TLS, served by `meshgate_shell::server`.
//!
//! In: a [`Reviewer`], the readiness signal, [`Limits`], a bound TCP listener, a rustls
//! config (see [`crate::tls`]) and the shutdown [`Phase`]. Out: HTTP responses:
//! - `POST /validate`, `POST /mutate-node` → 200 with the AdmissionReview response;
//! - a body that is not an AdmissionReview → 400 with a plain-text reason;
//! - a body over `max_body_bytes` → 413;
//! - a body not received within [`crate::budget::BODY_READ_TIMEOUT`] of its charge → 408
//!   and the connection closed; a body sent in chunks that finds the budget spent → 503;
//! - not answered within `request_timeout` → 503, so the apiserver applies the
//!   webhook's failurePolicy well before its own timeout (10 s by default) fires; a review
//!   waiting for room in the review memory budget ([`crate::budget`]) waits inside it;
//! - caches not synced yet → the request waits for them inside that same timeout.
//!
//! The connections are bounded by the server shared with the admin ports
//! (`meshgate_shell::server`): at most `max_connections` at once (past the cap the next one
//! waits, unaccepted, in the kernel's backlog), at most half of them from one client (peer
//! address; past its share a client's connection is closed at once), a TLS handshake within [`HANDSHAKE_TIMEOUT`],
//! a request head within [`HEADER_READ_TIMEOUT`] (of the handshake's end for a connection's
//! first request, of its first byte for a later one), an idle keep-alive connection closed
//! after [`KEEP_ALIVE_TIMEOUT`] and at most [`MAX_BUF_SIZE`] bytes buffered per connection (a
//! larger head gets a 431). The shutdown phases (delay with `Connection: close`, then a bounded drain)
//! are that server's too; [`crate::shutdown`] drives them.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{ConnectInfo, FromRequest, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Json, Response};
use axum::routing::post;
use meshgate_shell::server::{self as shared, Handshake, Socket};
use rustls::ServerConfig;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_rustls::TlsAcceptor;
use tower_http::timeout::TimeoutLayer;

use crate::budget::{Budget, Held};
use crate::review::{Cluster, Outcome, Reviewer};
use crate::shutdown::Phase;

/// Request and connection limits.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Largest accepted request body. A Pod object is at most ~1.5 MB (etcd's limit), and an
    /// AdmissionReview for CREATE carries it once.
    pub max_body_bytes: usize,
    /// Per-request deadline; keep it well below the webhook's `timeoutSeconds`.
    pub request_timeout: Duration,
    /// Connections served at once (see [`serve_tls`]).
    pub max_connections: usize,
    /// Connections one client (peer IP address) may hold at once, within `max_connections`:
    /// [`max_connections_per_client`] of it.
    pub max_connections_per_client: usize,
    /// Memory the reviews being read and decoded may hold at once (see [`crate::budget`]).
    pub review_memory_bytes: usize,
}

/// Default of `--max-connections`: above what the apiservers keep open to one replica (a
/// keep-alive connection per concurrent review, and an apiserver's concurrency is bounded by
/// its in-flight limits, 600 requests by default), and a bound on the memory and tasks that
/// connections opened by anyone else can cost: a TLS connection whose client fills its
/// 8 KiB buffer costs about 25 KiB (measured: docs/reliability.md), so 1024 of them stay
/// under 26 MiB.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_body_bytes: 3 * 1024 * 1024,
            request_timeout: Duration::from_secs(3),
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_connections_per_client: max_connections_per_client(DEFAULT_MAX_CONNECTIONS),
            review_memory_bytes: crate::budget::DEFAULT_REVIEW_MEMORY_BYTES,
        }
    }
}

/// What one client (peer IP address) may hold of `--max-connections`: half, so a client
/// that opens connections and holds them leaves the other half to the apiservers (each
/// apiserver is a client of its own).
pub fn max_connections_per_client(max_connections: usize) -> usize {
    max_connections.div_ceil(2)
}

/// Deadline for a TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Deadline for a request head: a new connection's first one from the handshake's end, a
/// later one from its first byte.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a keep-alive connection may sit idle between requests. Above the idle timeout of
/// the apiserver's webhook client (90 s, Go's `DefaultTransport`), so the client closes an
/// idle connection first: a server that closes it races the client's reuse of it, and a lost
/// race fails the review (Go does not retry a POST), while a close too early makes the next
/// burst pay fresh TLS handshakes. An idle connection costs only its place among
/// `max_connections`.
pub const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(120);
/// hyper's input buffer per connection, hyper's smallest. The apiserver's request heads are a
/// few hundred bytes; bodies stream through it in chunks.
pub const MAX_BUF_SIZE: usize = 8 * 1024;

struct AppState<C> {
    reviewer: Arc<Reviewer<C>>,
    ready: watch::Receiver<bool>,
    budget: Budget,
}

impl<C> Clone for AppState<C> {
    fn clone(&self) -> Self {
        Self {
            reviewer: self.reviewer.clone(),
            ready: self.ready.clone(),
            budget: self.budget.clone(),
        }
    }
}

/// A review's body, read within the review memory budget, and the share of the budget it
/// holds until the handler returns.
struct ReviewBody(axum::body::Bytes, #[allow(dead_code)] Held);

impl<C: Cluster> FromRequest<AppState<C>> for ReviewBody {
    type Rejection = Response;

    async fn from_request(req: Request, state: &AppState<C>) -> Result<Self, Response> {
        let (parts, body) = req.into_parts();
        // The TLS peer's address, from the shared server; none in-process (tests): one client.
        let client = parts
            .extensions
            .get::<ConnectInfo<SocketAddr>>()
            .map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), |c| c.0.ip());
        match state.budget.read(client, &parts.headers, body).await {
            Ok((bytes, held)) => Ok(Self(bytes, held)),
            Err(refusal) => {
                tracing::debug!(error = %refusal, %client, "refusing a request body");
                state.reviewer.metrics().body_refused(refusal.reason());
                Err(refusal.into_response())
            }
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

async fn validate<C: Cluster>(State(s): State<AppState<C>>, body: ReviewBody) -> Response {
    if !wait_ready(&s.ready).await {
        return (StatusCode::SERVICE_UNAVAILABLE, "caches not synced\n").into_response();
    }
    respond(s.reviewer.validate(&body.0).await)
}

async fn mutate_node<C: Cluster>(State(s): State<AppState<C>>, body: ReviewBody) -> Response {
    // Needs no cache: a new node is gated whatever the caches say.
    respond(s.reviewer.mutate_node(&body.0))
}

/// The webhook's routes with the body limit, the review memory budget and the per-request
/// timeout.
pub fn router<C: Cluster>(
    reviewer: Arc<Reviewer<C>>,
    ready: watch::Receiver<bool>,
    limits: Limits,
) -> Router {
    let budget = Budget::new(limits.review_memory_bytes, limits.max_body_bytes);
    Router::new()
        .route("/validate", post(validate::<C>))
        .route("/mutate-node", post(mutate_node::<C>))
        .with_state(AppState {
            reviewer,
            ready,
            budget,
        })
        .layer(TimeoutLayer::with_status_code(
            StatusCode::SERVICE_UNAVAILABLE,
            limits.request_timeout,
        ))
}

/// The TLS handshake of the shared server.
#[derive(Clone)]
struct Tls(TlsAcceptor);

impl Handshake for Tls {
    type Io = tokio_rustls::server::TlsStream<Socket>;
    fn handshake(&self, tcp: Socket) -> impl Future<Output = std::io::Result<Self::Io>> + Send {
        self.0.accept(tcp)
    }
}

/// Serves `app` over TLS on `listener` until `phase` reaches [`Phase::Draining`], then drains
/// for at most `drain` (see `meshgate_shell::server::serve`), with at most
/// `max_connections` connections at once (`max_connections_per_client` of them from one
/// client) and this module's handshake, header and buffer limits.
pub async fn serve_tls(
    listener: TcpListener,
    tls: Arc<ServerConfig>,
    app: Router,
    phase: watch::Receiver<Phase>,
    drain: Duration,
    (max_connections, max_connections_per_client): (usize, usize),
) {
    let limits = shared::Limits {
        max_connections,
        max_connections_per_client: max_connections_per_client.min(max_connections),
        handshake_timeout: HANDSHAKE_TIMEOUT,
        header_read_timeout: HEADER_READ_TIMEOUT,
        keep_alive_timeout: KEEP_ALIVE_TIMEOUT,
        max_buf_size: MAX_BUF_SIZE,
    };
    let handshake = Tls(TlsAcceptor::from(tls));
    shared::serve(listener, handshake, app, phase, drain, limits).await;
}

#[cfg(test)]
pub(crate) mod tests;
