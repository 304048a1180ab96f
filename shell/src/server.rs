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
//! - the handshake must end within `handshake_timeout`;
//! - a request head must arrive complete within `header_read_timeout`. hyper arms that timer
//!   only when it has a timer, so the builder here always gives it one. hyper waits for the
//!   next head of a keep-alive connection with the same timer, so an idle connection is closed
//!   after that time too;
//! - hyper buffers at most `max_buf_size` bytes of a connection's input: a head that does not
//!   fit is answered 431 and the connection closed. Bodies stream through the same buffer.
//!
//! So the connections together hold at most `max_connections` × (`max_buf_size` + what the
//! handshake keeps per connection) of memory, whatever their clients send or withhold.
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
use axum::http::{HeaderValue, header};
use axum::response::Response;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinSet;

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
    /// Deadline for the [`Handshake`] of a new connection.
    pub handshake_timeout: Duration,
    /// Deadline for a complete request head, and for an idle keep-alive connection's next one.
    pub header_read_timeout: Duration,
    /// hyper's per-connection input buffer, in bytes (hyper's minimum, 8 KiB, at least). A
    /// request head must fit in it.
    pub max_buf_size: usize,
}

/// hyper refuses (panics on) a buffer below 8 KiB.
const MIN_BUF_SIZE: usize = 8 * 1024;

impl Limits {
    /// The HTTP/1 connection builder these limits describe.
    fn http1(&self) -> http1::Builder {
        let mut builder = http1::Builder::new();
        builder
            .timer(TokioTimer::new())
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
    fn handshake(&self, tcp: TcpStream) -> impl Future<Output = std::io::Result<Self::Io>> + Send;
}

/// Plain HTTP: no handshake.
#[derive(Clone, Copy, Debug, Default)]
pub struct Plain;

impl Handshake for Plain {
    type Io = TcpStream;
    fn handshake(&self, tcp: TcpStream) -> impl Future<Output = std::io::Result<TcpStream>> + Send {
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
    let mut conns = Connections {
        handshake,
        handshake_timeout: limits.handshake_timeout,
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
    let mut cap = CapWarning {
        max_connections,
        addr: &addr,
        warned: None,
    };
    while let Some(permit) = next_permit(&permits, &mut cap, &mut draining).await {
        let Some((tcp, peer)) = next_connection(&listener, &mut draining).await else {
            break;
        };
        conns.reap();
        conns.spawn(tcp, peer, permit);
    }
    close(listener, &permits, conns, drain, &addr).await;
}

/// The warning that the connection cap is reached, at most once a minute: a flood reaches the
/// cap on every freed slot.
struct CapWarning<'a> {
    max_connections: usize,
    addr: &'a str,
    warned: Option<tokio::time::Instant>,
}

impl CapWarning<'_> {
    fn reached(&mut self) {
        if self
            .warned
            .is_none_or(|at| at.elapsed() >= Duration::from_secs(60))
        {
            self.warned = Some(tokio::time::Instant::now());
            tracing::warn!(
                max_connections = self.max_connections,
                addr = %self.addr,
                "connection cap reached; new connections wait until one ends"
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
    permits: &Arc<Semaphore>,
    mut conns: Connections<H>,
    drain: Duration,
    addr: &str,
) {
    // Connections the kernel completed before the close are served, not reset by it (each
    // answers one request and closes). Accepted with the plain socket call: the async
    // listener only retries once the reactor reported readiness, which may not have happened.
    let late = accept_backlog(listener, |tcp, peer| {
        match permits.clone().try_acquire_owned() {
            Ok(permit) => conns.spawn(tcp, peer, permit),
            Err(_) => tracing::debug!(%peer, "connection cap reached at the close; closing it"),
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
    handshake_timeout: Duration,
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
    /// `permit` is held until the connection ends: that is what the connection cap counts.
    fn spawn(&mut self, tcp: TcpStream, peer: SocketAddr, permit: OwnedSemaphorePermit) {
        let _ = tcp.set_nodelay(true);
        let handshake = self.handshake.clone();
        let timeout = self.handshake_timeout;
        let http1 = self.http1.clone();
        let app = self.app.clone();
        let phase = self.phase.clone();
        let watcher = self.graceful.watcher();
        self.tasks.spawn(async move {
            let _permit = permit;
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
mod tests {
    use super::*;
    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const TEST_LIMITS: Limits = Limits {
        max_connections: 2,
        handshake_timeout: Duration::from_secs(1),
        header_read_timeout: Duration::from_millis(300),
        max_buf_size: 8 * 1024,
    };

    /// A plain server on loopback answering `GET /` with "ok"; the phase sender stops it.
    async fn start(
        limits: Limits,
    ) -> (
        SocketAddr,
        watch::Sender<Phase>,
        tokio::task::JoinHandle<()>,
    ) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, phase) = watch::channel(Phase::Serving);
        let app = Router::new().route("/", get(|| async { "ok" }));
        let drain = Duration::from_millis(500);
        let task = tokio::spawn(serve(listener, Plain, app, phase, drain, limits));
        (addr, tx, task)
    }

    /// Asks the server to drain and waits (2 s at most) for it to end.
    async fn stop(phase: watch::Sender<Phase>, task: tokio::task::JoinHandle<()>) {
        phase.send_replace(Phase::Draining);
        tokio::time::timeout(Duration::from_secs(2), task)
            .await
            .expect("stopped within 2 s")
            .unwrap();
    }

    /// Reads until the server closes (or 3 s pass): what it sent, and whether it closed.
    async fn read_to_close(s: &mut TcpStream) -> (String, bool) {
        let mut out = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(3), async {
            let mut chunk = [0u8; 4096];
            loop {
                match s.read(&mut chunk).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => out.extend_from_slice(&chunk[..n]),
                }
            }
        })
        .await
        .is_ok();
        (String::from_utf8_lossy(&out).into_owned(), closed)
    }

    async fn get_ok(addr: SocketAddr) -> bool {
        let Ok(mut s) = TcpStream::connect(addr).await else {
            return false;
        };
        let req = b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
        s.write_all(req).await.is_ok() && read_to_close(&mut s).await.0.ends_with("ok")
    }

    /// A client that sends part of a head and stops is closed at the header read timeout; one
    /// that opens a connection and sends nothing, too; meanwhile and after, others are served.
    #[tokio::test]
    async fn a_head_that_never_ends_is_closed_at_the_header_timeout() {
        let (addr, phase, task) = start(TEST_LIMITS).await;
        let mut partial = TcpStream::connect(addr).await.unwrap();
        partial
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            .await
            .unwrap();
        let mut silent = TcpStream::connect(addr).await.unwrap();
        let begun = std::time::Instant::now();
        let (_, closed) = read_to_close(&mut partial).await;
        assert!(closed, "the partial head was not closed");
        let (_, closed) = read_to_close(&mut silent).await;
        assert!(closed, "the silent connection was not closed");
        let took = begun.elapsed();
        assert!(
            took >= Duration::from_millis(250) && took < Duration::from_secs(2),
            "closed after {took:?}, the timeout is 300 ms"
        );
        assert!(get_ok(addr).await, "served after the slow clients");
        stop(phase, task).await;
    }

    /// A head larger than the buffer is answered 431 and closed as soon as the buffer is full,
    /// without waiting for the rest of it.
    #[tokio::test]
    async fn a_head_larger_than_the_buffer_gets_a_431() {
        let limits = Limits {
            header_read_timeout: Duration::from_secs(30),
            ..TEST_LIMITS
        };
        let (addr, phase, task) = start(limits).await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n").await.unwrap();
        let line = format!("X-Big: {}\r\n", "a".repeat(1000));
        // 20 KiB of head and no end: the 8 KiB buffer fills long before.
        for _ in 0..20 {
            if s.write_all(line.as_bytes()).await.is_err() {
                break;
            }
        }
        let (answer, closed) = read_to_close(&mut s).await;
        assert!(closed, "not closed");
        assert!(answer.starts_with("HTTP/1.1 431"), "{answer:?}");
        assert!(get_ok(addr).await);
        stop(phase, task).await;
    }

    /// With the cap taken by two silent connections, a third is not served until the header
    /// timeout frees a place; then it is.
    #[tokio::test]
    async fn past_the_cap_a_connection_waits_for_a_free_place() {
        let limits = Limits {
            header_read_timeout: Duration::from_millis(800),
            ..TEST_LIMITS
        };
        let (addr, phase, task) = start(limits).await;
        let _a = TcpStream::connect(addr).await.unwrap();
        let _b = TcpStream::connect(addr).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let begun = std::time::Instant::now();
        assert!(get_ok(addr).await, "served once a place was free");
        let waited = begun.elapsed();
        assert!(
            waited >= Duration::from_millis(500),
            "served after {waited:?}, while the cap was taken"
        );
        stop(phase, task).await;
    }

    /// `serve_until`: the stop future ends serving; a connection holding a request in flight
    /// does not keep the server past the drain timeout.
    #[tokio::test]
    async fn serve_until_stops_within_the_drain() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new().route(
            "/slow",
            get(|| async {
                tokio::time::sleep(Duration::from_secs(30)).await;
                "late"
            }),
        );
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let stop = async move {
            let _ = stop_rx.await;
        };
        let drain = Duration::from_millis(300);
        let task = tokio::spawn(serve_until(listener, Plain, app, stop, drain, TEST_LIMITS));
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(stop_tx);
        let begun = std::time::Instant::now();
        tokio::time::timeout(Duration::from_secs(2), task)
            .await
            .expect("stopped within the drain")
            .unwrap();
        assert!(begun.elapsed() >= drain);
        assert!(TcpStream::connect(addr).await.is_err(), "listener closed");
    }
}
