//! The one HTTP/1 server behind every port meshgate opens: the webhook's HTTPS listener and
//! the admin ports of the agent and the webhook.
//!
//! In: a bound TCP listener, a [`Handshake`] (TLS, or none: [`Plain`]), an axum [`Router`], a
//! [`Phase`] watch, a drain timeout and [`Limits`]. Out: the router's answers over HTTP/1.1
//! until the phase reaches [`Phase::Draining`], then a drain bounded by the timeout.
//!
//! What a connection from outside may cost is bounded:
//! - at most `max_connections` connections at once: past the cap the next connection is not
//!   accepted until one ends, so it waits in the kernel's accept backlog (and its client's own
//!   timeout bounds the wait) instead of costing a task, buffers and memory;
//! - at most `max_connections_per_client` of them from one client (peer IP address): a
//!   connection past its client's share is closed as soon as it is accepted, so one client
//!   cannot keep the others out (`server/clients.rs`);
//! - the handshake must end within `handshake_timeout`;
//! - a request head must arrive complete within `header_read_timeout`: the first one counted
//!   from the handshake's end (so a connection that never sends anything is closed after that
//!   time), a later one from its first byte;
//! - a keep-alive connection may sit idle between requests for `keep_alive_timeout`, then it
//!   is closed. hyper times both with its one header-read timer, so each connection gets a
//!   timer of its own that tells the two waits apart (`server/keep_alive.rs`, with its
//!   known gap);
//! - hyper buffers at most `max_buf_size` bytes of a connection's input: a head that does not
//!   fit is answered 431 and the connection closed. Bodies stream through the same buffer.
//!
//! So the connections together hold at most `max_connections` × (`max_buf_size` + what the
//! handshake keeps per connection) of memory, whatever their clients send or withhold; a long
//! `keep_alive_timeout` lets an idle connection keep its place longer, not cost more.
//!
//! The phases (see [`Phase`]):
//! - [`Phase::Delaying`]: the listener keeps accepting and every request is answered as
//!   usual, but each response carries `Connection: close`, so a client's next request opens a
//!   new connection (which a Service routes to another replica once this one left the
//!   endpoints). Clients learn of the close from the response itself.
//! - [`Phase::Draining`]: the listener closes (connections already waiting in its backlog are
//!   still accepted), keep-alive connections still idle are closed, and requests in flight
//!   finish, bounded by the drain timeout; connections still open when it expires are
//!   aborted. A connection whose handshake ended after the stop request answers its one
//!   request even if that request arrives after the drain started.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use axum::http::{HeaderValue, Request, header};
use axum::response::Response;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinSet;

mod clients;
mod keep_alive;
use clients::{PerClient, Slot};
pub use keep_alive::Socket;

/// Where a server is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Normal service.
    Serving,
    /// Stop requested: still accepting and answering, every answer with `Connection: close`.
    Delaying,
    /// Listener closed; requests in flight finish within the drain timeout.
    Draining,
}

/// Bounds on what connections may cost (see the module's documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Connections served at once (at least 1).
    pub max_connections: usize,
    /// Connections one client (peer IP address) may hold at once (at least 1); at most
    /// `max_connections`.
    pub max_connections_per_client: usize,
    /// Deadline for the [`Handshake`] of a new connection.
    pub handshake_timeout: Duration,
    /// Deadline for a complete request head: for the first request of a connection, from the
    /// handshake's end (so a connection that never sends anything is closed after it); for a
    /// later one, from its first byte.
    pub header_read_timeout: Duration,
    /// How long a connection may sit idle between requests, after its first request, before
    /// it is closed.
    pub keep_alive_timeout: Duration,
    /// hyper's per-connection input buffer, in bytes (hyper's minimum, 8 KiB, at least). A
    /// request head must fit in it.
    pub max_buf_size: usize,
}

/// hyper refuses (panics on) a buffer below 8 KiB.
const MIN_BUF_SIZE: usize = 8 * 1024;

impl Limits {
    /// The HTTP/1 connection builder these limits describe, but for its timer: hyper arms the
    /// header timer only when it has one (and refuses to serve without it), so each connection
    /// is given its own ([`Connections::spawn`]).
    fn http1(&self) -> http1::Builder {
        let mut builder = http1::Builder::new();
        builder
            .header_read_timeout(self.header_read_timeout)
            .max_buf_size(self.max_buf_size.max(MIN_BUF_SIZE));
        builder
    }
}

/// What turns an accepted TCP connection into the stream HTTP is spoken on (a TLS handshake,
/// or nothing). Bounded by [`Limits::handshake_timeout`].
pub trait Handshake: Clone + Send + Sync + 'static {
    /// The stream HTTP is spoken on.
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    /// Performs the handshake on `tcp`.
    fn handshake(&self, tcp: Socket) -> impl Future<Output = std::io::Result<Self::Io>> + Send;
}

/// Plain HTTP: no handshake.
#[derive(Clone, Copy, Debug, Default)]
pub struct Plain;

impl Handshake for Plain {
    type Io = Socket;
    fn handshake(&self, tcp: Socket) -> impl Future<Output = std::io::Result<Socket>> + Send {
        std::future::ready(Ok(tcp))
    }
}

/// Serves `app` on `listener` until `phase` reaches [`Phase::Draining`], then drains for at
/// most `drain`; connections still open when the drain times out are aborted (their sockets
/// closed), so nothing outlives the returned future. From [`Phase::Delaying`] on, responses
/// carry `Connection: close`. Accept and handshake errors are logged, never fatal.
///
/// Each connection holds a permit from its accept to its end; without a free permit the loop
/// does not accept, so excess connections wait in the kernel's backlog. At the close, backlog
/// connections beyond the cap are closed unserved.
pub async fn serve<H: Handshake>(
    listener: TcpListener,
    handshake: H,
    app: Router,
    phase: watch::Receiver<Phase>,
    drain: Duration,
    limits: Limits,
) {
    let max_connections = limits.max_connections.clamp(1, Semaphore::MAX_PERMITS);
    // Names the server in its logs: a process runs more than one.
    let addr = listener
        .local_addr()
        .map_or_else(|e| e.to_string(), |a| a.to_string());
    let permits = Arc::new(Semaphore::new(max_connections));
    let clients = PerClient::new(limits.max_connections_per_client);
    let mut conns = Connections {
        handshake,
        limits,
        http1: limits.http1(),
        app: close_when_stopping(app, phase.clone()),
        phase: phase.clone(),
        graceful: GracefulShutdown::new(),
        tasks: JoinSet::new(),
    };
    let mut draining = phase;
    // A dropped sender also ends serving: nobody could ask for the drain any more.
    let draining = async move {
        let _ = draining.wait_for(|p| *p == Phase::Draining).await;
    };
    let mut draining = std::pin::pin!(draining);
    let mut cap = CapWarning::new(
        "connection cap reached; new connections wait until one ends",
        max_connections,
        &addr,
    );
    let mut share = CapWarning::new(
        "a client reached its share of the connection cap; its new connections are closed",
        limits.max_connections_per_client,
        &addr,
    );
    while let Some(permit) = next_permit(&permits, &mut cap, &mut draining).await {
        let Some((tcp, peer)) = next_connection(&listener, &mut draining).await else {
            break;
        };
        conns.reap();
        let Some(slot) = clients.take(peer.ip()) else {
            tracing::debug!(%peer, "client over its share of the connection cap; closing");
            share.reached();
            continue;
        };
        conns.spawn(tcp, peer, (permit, slot));
    }
    close(listener, (&permits, &clients), conns, drain, &addr).await;
}

/// What a connection holds from its accept to its end: its place under the cap, and under
/// its client's share.
type Place = (OwnedSemaphorePermit, Slot);

/// The warning that a connection cap (the server's, or a client's share) is reached, at most
/// once a minute: a flood reaches the cap on every freed slot.
struct CapWarning<'a> {
    message: &'static str,
    max_connections: usize,
    addr: &'a str,
    warned: Option<tokio::time::Instant>,
}

impl<'a> CapWarning<'a> {
    fn new(message: &'static str, max_connections: usize, addr: &'a str) -> Self {
        Self {
            message,
            max_connections,
            addr,
            warned: None,
        }
    }

    fn reached(&mut self) {
        if self
            .warned
            .is_none_or(|at| at.elapsed() >= Duration::from_secs(60))
        {
            self.warned = Some(tokio::time::Instant::now());
            tracing::warn!(
                max_connections = self.max_connections,
                addr = %self.addr,
                "{}",
                self.message
            );
        }
    }
}

/// A free connection slot, waiting for one while the cap is reached; `None` once draining.
async fn next_permit(
    permits: &Arc<Semaphore>,
    cap: &mut CapWarning<'_>,
    draining: &mut (impl Future<Output = ()> + Unpin),
) -> Option<OwnedSemaphorePermit> {
    if let Ok(p) = permits.clone().try_acquire_owned() {
        return Some(p);
    }
    cap.reached();
    tokio::select! {
        biased;
        () = draining => None,
        // Never closed; `None` ends the loop rather than spin if it were.
        p = permits.clone().acquire_owned() => p.ok(),
    }
}

/// The next accepted connection; `None` once draining. Accept errors are logged and retried.
async fn next_connection(
    listener: &TcpListener,
    draining: &mut (impl Future<Output = ()> + Unpin),
) -> Option<(TcpStream, SocketAddr)> {
    loop {
        tokio::select! {
            // Checked first, so the backlog left at the close is handled in one place.
            biased;
            () = &mut *draining => return None,
            accepted = listener.accept() => match accepted {
                Ok(a) => return Some(a),
                Err(e) => {
                    // EMFILE and friends: back off briefly instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
        }
    }
}

/// Closes the listener, serves the connections left in its backlog, and drains within
/// `drain`.
async fn close<H: Handshake>(
    listener: TcpListener,
    (permits, clients): (&Arc<Semaphore>, &PerClient),
    mut conns: Connections<H>,
    drain: Duration,
    addr: &str,
) {
    // Connections the kernel completed before the close are served, not reset by it (each
    // answers one request and closes). Accepted with the plain socket call: the async
    // listener only retries once the reactor reported readiness, which may not have happened.
    let late = accept_backlog(listener, |tcp, peer| {
        let place = permits.clone().try_acquire_owned().ok();
        match place.zip(clients.take(peer.ip())) {
            Some(place) => conns.spawn(tcp, peer, place),
            None => tracing::debug!(%peer, "connection cap reached at the close; closing it"),
        }
    });
    tracing::info!(
        %addr,
        connections = conns.graceful.count(),
        accepted_at_close = late,
        "shutting down: listener closed, draining in-flight requests"
    );
    let graceful = std::mem::take(&mut conns.graceful);
    tokio::select! {
        () = graceful.shutdown() => tracing::info!(%addr, "drained"),
        () = tokio::time::sleep(drain) => tracing::warn!(
            %addr,
            ?drain,
            connections = conns.tasks.len(),
            "drain timed out; closing remaining connections"
        ),
    }
    // After a timeout, aborts what is left (dropping a task closes its socket); after a
    // complete drain, only tasks past their last byte remain. Waits for them either way, so
    // an embedder's runtime holds no connection of ours once this returns.
    conns.tasks.shutdown().await;
}

/// `app` whose answers say `Connection: close` once `phase` has left [`Phase::Serving`].
/// Decided when the response is written, so a request in flight when the delay starts is
/// answered with the close too.
fn close_when_stopping(app: Router, phase: watch::Receiver<Phase>) -> Router {
    app.layer(tower::util::MapResponseLayer::new(
        move |mut resp: Response| {
            if *phase.borrow() != Phase::Serving {
                resp.headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            resp
        },
    ))
}

/// Serves `app` on `listener` until `stop` resolves, then drains for at most `drain`: for a
/// server with no delay phase (the admin ports).
pub async fn serve_until<H: Handshake>(
    listener: TcpListener,
    handshake: H,
    app: Router,
    stop: impl Future<Output = ()> + Send,
    drain: Duration,
    limits: Limits,
) {
    let (phase_tx, phase) = watch::channel(Phase::Serving);
    let stopping = async move {
        stop.await;
        phase_tx.send_replace(Phase::Draining);
    };
    tokio::join!(
        serve(listener, handshake, app, phase, drain, limits),
        stopping
    );
}

/// The accepted connections: what serves them, and their tasks (aborted if the drain times
/// out).
struct Connections<H> {
    handshake: H,
    limits: Limits,
    http1: http1::Builder,
    app: Router,
    phase: watch::Receiver<Phase>,
    graceful: GracefulShutdown,
    tasks: JoinSet<()>,
}

impl<H: Handshake> Connections<H> {
    /// Forgets the tasks that have ended, so the set holds only live connections.
    fn reap(&mut self) {
        while let Some(ended) = self.tasks.try_join_next() {
            if let Err(e) = ended
                && e.is_panic()
            {
                tracing::error!(error = %e, "connection task panicked");
            }
        }
    }

    /// Handshakes and serves one connection in a task of the set.
    ///
    /// Whether the drain may close the connection while it is idle is decided after the
    /// handshake, from the phase then: one still [`Phase::Serving`] is told to finish at the
    /// drain (its idle keep-alive is closed, a request in flight completes). One whose
    /// handshake ended after the stop request is not: its answers carry `Connection: close`,
    /// so it ends by itself after one request, whereas told to shut down before its request
    /// was read (the drain having started during, or just after, its handshake) it would be
    /// closed unanswered. Its watcher is held all the same, so the drain waits for it.
    ///
    /// `place` is held until the connection ends: that is what the connection cap and the
    /// client's share count. Each request is given the peer address ([`ConnectInfo`]).
    fn spawn(&mut self, tcp: TcpStream, peer: SocketAddr, place: Place) {
        let _ = tcp.set_nodelay(true);
        let (tcp, timer) = Socket::new(
            tcp,
            self.limits.header_read_timeout,
            self.limits.keep_alive_timeout,
        );
        let handshake = self.handshake.clone();
        let timeout = self.limits.handshake_timeout;
        let mut http1 = self.http1.clone();
        http1.timer(timer);
        let app = tower::ServiceBuilder::new()
            .map_request(move |mut req: Request<Incoming>| {
                req.extensions_mut().insert(ConnectInfo(peer));
                req
            })
            .service(self.app.clone());
        let phase = self.phase.clone();
        let watcher = self.graceful.watcher();
        self.tasks.spawn(async move {
            let _place = place;
            let begun = tokio::time::Instant::now();
            let io = match tokio::time::timeout(timeout, handshake.handshake(tcp)).await {
                Ok(Ok(s)) => {
                    // A client that opens a connection per request in flight (the apiserver:
                    // HTTP/1.1, no TLS resumption) pays this on each: see docs/performance.md.
                    tracing::debug!(%peer, took = ?begun.elapsed(), "handshake done");
                    s
                }
                Ok(Err(e)) => {
                    tracing::debug!(%peer, error = %e, "handshake failed");
                    return;
                }
                Err(_) => {
                    tracing::debug!(%peer, "handshake timed out");
                    return;
                }
            };
            let serving = *phase.borrow() == Phase::Serving;
            let conn = http1.serve_connection(TokioIo::new(io), TowerToHyperService::new(app));
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
}

/// At most this many connections still waiting in the kernel are accepted when the listener
/// closes (the default `somaxconn` is 4096; the rest are reset).
const ACCEPT_BACKLOG_DRAIN: usize = 4096;

/// Accepts what waits in `listener`'s backlog without waiting for more, hands each to `serve`,
/// and closes the listener; returns how many there were.
fn accept_backlog(listener: TcpListener, mut serve: impl FnMut(TcpStream, SocketAddr)) -> usize {
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
            .and_then(|()| TcpStream::from_std(tcp))
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

#[cfg(test)]
mod tests;
