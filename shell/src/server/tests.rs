//! The shared server on loopback: limits, keep-alive, drain.

use super::*;
use axum::routing::get;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TEST_LIMITS: Limits = Limits {
    max_connections: 2,
    max_connections_per_client: 2,
    handshake_timeout: Duration::from_secs(1),
    header_read_timeout: Duration::from_millis(300),
    // Far above the header timeout: a new connection must not get the idle bound.
    keep_alive_timeout: Duration::from_secs(30),
    max_buf_size: 8 * 1024,
};

type Started = (
    SocketAddr,
    watch::Sender<Phase>,
    tokio::task::JoinHandle<()>,
);

/// A plain server on loopback answering `GET /` with "ok"; the phase sender stops it.
async fn start(limits: Limits) -> Started {
    start_draining_in(limits, DRAIN).await
}

/// [`start`] with the drain timeout `drain`.
async fn start_draining_in(limits: Limits, drain: Duration) -> Started {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, phase) = watch::channel(Phase::Serving);
    let app = Router::new().route("/", get(|| async { "ok" }));
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

/// A connection from 127.0.0.2 (another client), bound before it connects.
async fn connect_from(ip: [u8; 4], addr: SocketAddr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::from((ip, 0))).unwrap();
    socket.connect(addr).await.unwrap()
}

/// One client holding its share of the cap has its next connection closed at once, while
/// another client is served; each request sees its peer's address.
#[tokio::test]
async fn a_client_past_its_share_is_closed_and_others_are_served() {
    let limits = Limits {
        max_connections: 4,
        max_connections_per_client: 2,
        header_read_timeout: Duration::from_secs(5),
        ..TEST_LIMITS
    };
    let listener = TcpListener::bind("0.0.0.0:0").await.unwrap();
    let addr = SocketAddr::from(([127, 0, 0, 1], listener.local_addr().unwrap().port()));
    let (phase_tx, phase) = watch::channel(Phase::Serving);
    let app = Router::new().route(
        "/",
        get(|ConnectInfo(peer): ConnectInfo<SocketAddr>| async move { peer.ip().to_string() }),
    );
    let task = tokio::spawn(serve(listener, Plain, app, phase, DRAIN, limits));
    let _a = connect_from([127, 0, 0, 2], addr).await;
    let _b = connect_from([127, 0, 0, 2], addr).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut third = connect_from([127, 0, 0, 2], addr).await;
    let (_, closed) = read_to_close(&mut third).await;
    assert!(closed, "a third connection of one client was kept");
    let mut other = TcpStream::connect(addr).await.unwrap();
    let req = b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    other.write_all(req).await.unwrap();
    let (answer, _) = read_to_close(&mut other).await;
    assert!(answer.ends_with("127.0.0.1"), "{answer}");
    stop(phase_tx, task).await;
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

/// Sends `GET /` on a keep-alive connection and reads its one answer (3 s at most): whether
/// it was "ok".
async fn get_kept_alive(s: &mut TcpStream) -> bool {
    if s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .is_err()
    {
        return false;
    }
    let mut out = Vec::new();
    let answered = tokio::time::timeout(Duration::from_secs(3), async {
        let mut chunk = [0u8; 4096];
        // The answer is a short head and a 2-byte body: complete once it ends with it.
        while !(out.ends_with(b"\r\n\r\nok")) {
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => out.extend_from_slice(&chunk[..n]),
            }
        }
        true
    })
    .await;
    answered == Ok(true) && out.starts_with(b"HTTP/1.1 200")
}

/// A server with these header and idle timeouts (and `drain`), and a connection to it that
/// was answered once and stays open.
async fn answered_once(
    header_read: Duration,
    keep_alive: Duration,
    drain: Duration,
) -> (TcpStream, Started) {
    let limits = Limits {
        header_read_timeout: header_read,
        keep_alive_timeout: keep_alive,
        ..TEST_LIMITS
    };
    let started = start_draining_in(limits, drain).await;
    let mut s = TcpStream::connect(started.0).await.unwrap();
    assert!(get_kept_alive(&mut s).await, "first request");
    (s, started)
}

/// Waits (3 s at most) for the server to close `s` without sending anything (`what` names
/// the connection); how long that took.
async fn closed_silently(s: &mut TcpStream, what: &str) -> Duration {
    let begun = std::time::Instant::now();
    let (sent, closed) = read_to_close(s).await;
    assert!(closed, "{what} was not closed within 3 s");
    assert!(sent.is_empty(), "{what} was sent {sent:?}");
    begun.elapsed()
}

const DRAIN: Duration = Duration::from_millis(500);

/// A keep-alive connection idle for longer than the header timeout, but not the idle one,
/// still serves its next request.
#[tokio::test]
async fn an_idle_connection_outlives_the_header_timeout() {
    let (mut s, (_, phase, task)) =
        answered_once(Duration::from_millis(300), Duration::from_secs(5), DRAIN).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        get_kept_alive(&mut s).await,
        "second request, after 1 s idle"
    );
    stop(phase, task).await;
}

/// After a first request, a next head begun and left unfinished is closed at the header
/// timeout counted from its first byte, not at the idle timeout.
#[tokio::test]
async fn a_slow_second_head_is_held_to_the_header_timeout() {
    let (mut s, (_, phase, task)) =
        answered_once(Duration::from_secs(1), Duration::from_secs(10), DRAIN).await;
    // Idle past the header timeout first: the head's deadline runs from its first byte.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        .await
        .unwrap();
    // Waits 3 s at most: the idle timeout would close it 8.5 s from now.
    let took = closed_silently(&mut s, "the slow head").await;
    assert!(
        took >= Duration::from_millis(800),
        "closed {took:?} after the head began, the header timeout is 1 s"
    );
    stop(phase, task).await;
}

/// A keep-alive connection that stays idle is closed at the idle timeout.
#[tokio::test]
async fn an_idle_connection_is_closed_at_the_idle_timeout() {
    let (mut s, (_, phase, task)) = answered_once(
        Duration::from_millis(300),
        Duration::from_millis(1200),
        DRAIN,
    )
    .await;
    let took = closed_silently(&mut s, "the idle connection").await;
    assert!(
        took >= Duration::from_millis(1000),
        "closed after {took:?} idle, the idle timeout is 1.2 s"
    );
    stop(phase, task).await;
}

/// The drain closes an idle keep-alive connection at once, not at the idle timeout nor at
/// the drain's.
#[tokio::test]
async fn the_drain_closes_idle_connections_promptly() {
    let (mut s, (_, phase, task)) = answered_once(
        Duration::from_millis(300),
        Duration::from_secs(30),
        Duration::from_secs(10),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    phase.send_replace(Phase::Draining);
    let took = closed_silently(&mut s, "the idle connection").await;
    assert!(
        took < Duration::from_secs(2),
        "closed {took:?} after the drain began"
    );
    tokio::time::timeout(Duration::from_secs(2), task)
        .await
        .expect("drained within 2 s")
        .unwrap();
}
