//! The HTTPS front's tests, and the TLS client, PKI and fake-cluster app the crate's other
//! tests share (`crate::server::tests`).

use super::*;
use crate::review::tests::{binding_review, fake_cluster, pod_review, reviewer};
use axum::body::{Body, Bytes};
use axum::http::header;
use http::Request;
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
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

/// A body sent chunked that stops coming is answered 408, with the connection closed, at
/// the body read timeout: well before the request timeout.
#[tokio::test]
async fn a_body_that_stops_coming_is_cut_at_the_body_read_timeout() {
    let (app, _tx) = app(fake_cluster(), true, Limits::default());
    let (tx, rx) = futures::channel::mpsc::unbounded::<Result<Bytes, std::io::Error>>();
    tx.unbounded_send(Ok(Bytes::from_static(b"{"))).unwrap();
    let begun = std::time::Instant::now();
    let resp = app
        .oneshot(
            Request::post("/validate")
                .body(Body::from_stream(rx))
                .unwrap(),
        )
        .await
        .unwrap();
    let took = begun.elapsed();
    assert_eq!(resp.status(), StatusCode::REQUEST_TIMEOUT);
    assert_eq!(resp.headers()[header::CONNECTION], "close");
    assert!(
        took >= crate::budget::BODY_READ_TIMEOUT && took < Limits::default().request_timeout,
        "cut after {took:?}"
    );
    drop(tx);
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
    pub(crate) fn issue(&self, cert_path: &std::path::Path, key_path: &std::path::Path) -> Vec<u8> {
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
    connect_over(pki, tokio::net::TcpStream::connect(addr).await?).await
}

/// [`connect`] over a TCP connection already made.
pub(crate) async fn connect_over(
    pki: &Pki,
    tcp: tokio::net::TcpStream,
) -> std::io::Result<(Sender, Vec<u8>)> {
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

async fn send(sender: &mut Sender, body: &serde_json::Value) -> (StatusCode, serde_json::Value) {
    let a = try_send(sender, body).await.unwrap();
    (a.status, a.body)
}

/// Waits up to 2 s for the server to close a connection (the client side sees it closed).
/// Only meaningful while the answers said nothing of closing: after a `Connection: close`
/// answer hyper's client closes by itself (use [`read_until_closed`] there).
pub(crate) async fn closed_by_server(sender: &mut Sender) -> bool {
    tokio::time::timeout(Duration::from_secs(2), async {
        while !sender.is_closed() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .is_ok()
}

/// A TLS stream spoken to byte by byte: unlike hyper's client, it does not close its own
/// side on a `Connection: close` answer, so it shows whether the server closed.
pub(crate) type Raw = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

/// TLS over an open TCP connection to the test server.
pub(crate) async fn handshake_raw(pki: &Pki, tcp: tokio::net::TcpStream) -> std::io::Result<Raw> {
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    pki.connector().connect(name, tcp).await
}

pub(crate) async fn connect_raw(pki: &Pki, addr: std::net::SocketAddr) -> std::io::Result<Raw> {
    handshake_raw(pki, tokio::net::TcpStream::connect(addr).await?).await
}

/// Writes `POST /validate` with `body` as HTTP/1.1 (keep-alive unless the server says
/// otherwise).
pub(crate) async fn write_review(stream: &mut Raw, body: &serde_json::Value) {
    use tokio::io::AsyncWriteExt;
    let body = serde_json::to_vec(body).unwrap();
    let head = format!(
        "POST /validate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(&body).await.unwrap();
    stream.flush().await.unwrap();
}

/// Reads one answer (head, then a `Content-Length` body) within 5 s; panics if the
/// connection ends first.
pub(crate) async fn read_answer(stream: &mut Raw) -> Answer {
    use tokio::io::AsyncReadExt;
    async fn more(stream: &mut Raw, buf: &mut Vec<u8>) {
        let mut chunk = [0u8; 4096];
        let n = stream.read(&mut chunk).await.expect("reading the answer");
        assert!(
            n > 0,
            "closed mid-answer: {:?}",
            String::from_utf8_lossy(buf)
        );
        buf.extend_from_slice(&chunk[..n]);
    }
    let read = async {
        let mut buf = Vec::new();
        let body_at = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            more(stream, &mut buf).await;
        };
        let head = String::from_utf8(buf[..body_at].to_vec()).unwrap();
        let status: u16 = head.split_whitespace().nth(1).unwrap().parse().unwrap();
        let field = |name: &str| {
            head.lines().skip(1).find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.trim()
                    .eq_ignore_ascii_case(name)
                    .then(|| v.trim().to_string())
            })
        };
        let len: usize = field("content-length")
            .expect("a Content-Length answer")
            .parse()
            .unwrap();
        while buf.len() < body_at + len {
            more(stream, &mut buf).await;
        }
        assert_eq!(buf.len(), body_at + len, "bytes after the answer");
        Answer {
            status: StatusCode::from_u16(status).unwrap(),
            body: serde_json::from_slice(&buf[body_at..]).unwrap_or_default(),
            close: field("connection").is_some_and(|v| v.eq_ignore_ascii_case("close")),
        }
    };
    tokio::time::timeout(Duration::from_secs(5), read)
        .await
        .expect("an answer within 5 s")
}

/// Reads until the server closes the connection (end of stream, or an error such as a
/// reset or a TCP close without TLS `close_notify`), for at most `within`: the bytes read
/// before the close, or `None` if the connection is still open.
pub(crate) async fn read_until_closed(stream: &mut Raw, within: Duration) -> Option<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let mut out = Vec::new();
    let closed = tokio::time::timeout(within, async {
        let mut chunk = [0u8; 4096];
        loop {
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => out.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await
    .is_ok();
    closed.then_some(out)
}

/// Serves `app` on a fresh loopback listener; the phase sender drives its shutdown.
pub(crate) async fn start(
    app: Router,
    tls: Arc<ServerConfig>,
    drain: Duration,
) -> (
    std::net::SocketAddr,
    watch::Sender<Phase>,
    tokio::task::JoinHandle<()>,
) {
    start_capped(app, tls, drain, DEFAULT_MAX_CONNECTIONS).await
}

/// [`start`] with a connection cap.
pub(crate) async fn start_capped(
    app: Router,
    tls: Arc<ServerConfig>,
    drain: Duration,
    max_connections: usize,
) -> (
    std::net::SocketAddr,
    watch::Sender<Phase>,
    tokio::task::JoinHandle<()>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (phase_tx, phase) = crate::shutdown::phase_channel();
    // The cap alone: every test connection comes from one address.
    let caps = (max_connections, max_connections);
    let server = tokio::spawn(serve_tls(listener, tls, app, phase, drain, caps));
    (addr, phase_tx, server)
}

/// The server task ends within 5 s (`why` names what it waited for), without a panic.
pub(crate) async fn stops(server: tokio::task::JoinHandle<()>, why: &str) {
    tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .unwrap_or_else(|_| panic!("{why}: not within 5 s"))
        .unwrap();
}

/// A 200 answer whose review says `allowed`.
pub(crate) fn assert_answered(a: &Answer, allowed: bool) {
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.body["response"]["allowed"], allowed);
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
    start_tls_with(cluster, Limits::default(), Duration::from_secs(5)).await
}

/// [`start_tls`] with the given limits and drain timeout.
pub(crate) async fn start_tls_with(
    cluster: crate::review::tests::FakeCluster,
    limits: Limits,
    drain: Duration,
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
    let (app, _tx) = app(cluster, true, limits);
    let tls = crate::tls::server_config(&cert, &key).unwrap();
    let (addr, phase, server) = start_capped(app, tls, drain, limits.max_connections).await;
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
    let (addr, phase, server) = start(app, tls, Duration::from_secs(5)).await;

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
    stops(server, "server stops after draining").await;
    assert!(
        connect(&pki, addr).await.is_err(),
        "listener closed after shutdown"
    );
}

/// The shutdown delay on a real TLS listener: a new connection made during the delay is
/// accepted and answered, every answer from the delay on says `Connection: close` and the
/// server then closes that connection, a request in flight when the delay starts is
/// answered with the close too; at the drain the listener closes, a connection idle
/// through the whole delay is closed, and a request in flight still finishes. The closes
/// after `Connection: close` answers are read on raw TLS streams, which do not close by
/// themselves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_delay_keeps_serving_and_moves_clients_off_then_the_drain_closes() {
    let mut cluster = fake_cluster();
    cluster.delay = Some(Duration::from_millis(600));
    let (_dir, pki, addr, phase, server) = start_tls(cluster).await;
    let meshed_on_bad = pod_review("web", Some("bad"), true);
    let closed = |bytes: Option<Vec<u8>>| bytes.as_deref() == Some(&[][..]);

    // Serving: keep-alive as usual.
    let (mut idle, _) = connect(&pki, addr).await.unwrap();
    let a = try_send(&mut idle, &meshed_on_bad).await.unwrap();
    assert_eq!(a.status, StatusCode::OK);
    assert!(!a.close, "no close while serving");
    let mut busy = connect_raw(&pki, addr).await.unwrap();
    write_review(&mut busy, &meshed_on_bad).await;
    assert!(!read_answer(&mut busy).await.close);

    // A binding whose lookup takes 600 ms is in flight when the delay starts.
    let mut slow = connect_raw(&pki, addr).await.unwrap();
    write_review(&mut slow, &binding_review("meshed", "bad")).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    phase.send_replace(Phase::Delaying);

    // A new connection during the delay: accepted, answered right, then closed by the
    // server after it told the client so.
    let mut fresh = connect_raw(&pki, addr)
        .await
        .expect("the listener still accepts during the delay");
    write_review(&mut fresh, &meshed_on_bad).await;
    let a = read_answer(&mut fresh).await;
    assert_answered(&a, false);
    assert!(a.close, "answers during the delay carry Connection: close");
    assert!(
        closed(read_until_closed(&mut fresh, Duration::from_secs(2)).await),
        "closed by the server after the answer"
    );
    // An existing keep-alive connection is answered once more, then retired the same way.
    write_review(&mut busy, &meshed_on_bad).await;
    let a = read_answer(&mut busy).await;
    assert_eq!(a.status, StatusCode::OK);
    assert!(a.close);
    assert!(closed(
        read_until_closed(&mut busy, Duration::from_secs(2)).await
    ));
    // The request in flight when the delay began: answered right, with the close.
    let a = read_answer(&mut slow).await;
    assert_answered(&a, false);
    assert!(a.close);
    assert!(closed(
        read_until_closed(&mut slow, Duration::from_secs(2)).await
    ));
    // The connection that carried no request during the delay is still open.
    assert!(!idle.is_closed());

    // Another lookup in flight when the drain starts.
    let mut last = connect_raw(&pki, addr).await.unwrap();
    write_review(&mut last, &binding_review("meshed", "bad")).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    phase.send_replace(Phase::Draining);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        connect(&pki, addr).await.is_err(),
        "the listener closes when the drain starts"
    );
    // Its answer carried nothing about closing, so hyper's client sees the server's close.
    assert!(
        closed_by_server(&mut idle).await,
        "an idle keep-alive connection is closed at the drain"
    );
    let a = read_answer(&mut last).await;
    assert_eq!(a.status, StatusCode::OK, "the in-flight request drained");
    assert_eq!(a.body["response"]["allowed"], false);
    assert!(closed(
        read_until_closed(&mut last, Duration::from_secs(2)).await
    ));
    stops(server, "the server stops once drained").await;
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
    assert_answered(&a, true);
    assert!(a.close);
    stops(server, "the server stops once that connection is done").await;
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
        let (mut sender, _) = connect_over(&pki, tcp).await.expect("not reset");
        let a = try_send(&mut sender, &pod_review("web", Some("bad"), true))
            .await
            .expect("answered");
        assert_answered(&a, false);
    }
    assert!(connect(&pki, addr).await.is_err(), "listener closed");
    stops(server, "the server stops").await;
}

/// A connection the server accepted while serving whose TLS handshake only ends after the
/// drain started (a slow client) is answered, not closed before its request is read.
/// Single-threaded, so the server has accepted it before the phase changes.
#[tokio::test]
async fn a_handshake_that_ends_after_the_drain_started_is_answered() {
    let (_dir, pki, addr, phase, server) = start_tls(fake_cluster()).await;
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    // The server accepts it now and waits for the ClientHello, still serving.
    tokio::time::sleep(Duration::from_millis(200)).await;
    phase.send_replace(Phase::Delaying);
    phase.send_replace(Phase::Draining);
    // The server runs into the drain and signals its connections to finish.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!server.is_finished(), "the drain waits for the connection");
    let mut late = handshake_raw(&pki, tcp).await.expect("handshake");
    write_review(&mut late, &pod_review("web", Some("good"), true)).await;
    let a = read_answer(&mut late).await;
    assert_answered(&a, true);
    assert!(a.close);
    stops(server, "the server stops once that connection is done").await;
}

/// A request stalled past the drain timeout: the server returns within the bound and its
/// connection is closed (the connection task aborted), not left running behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_timeout_closes_the_connections_left() {
    let mut cluster = fake_cluster();
    cluster.delay = Some(Duration::from_secs(30));
    let limits = Limits {
        request_timeout: Duration::from_secs(60),
        ..Limits::default()
    };
    let drain = Duration::from_millis(300);
    let (_dir, pki, addr, phase, server) = start_tls_with(cluster, limits, drain).await;
    let mut stalled = connect_raw(&pki, addr).await.unwrap();
    write_review(&mut stalled, &binding_review("meshed", "bad")).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    phase.send_replace(Phase::Draining);
    let begun = std::time::Instant::now();
    stops(server, "the server stops at the drain timeout").await;
    assert!(
        begun.elapsed() >= drain,
        "returned before the drain timeout"
    );
    // Left running, the connection would stay open until the 30 s lookup ended.
    assert_eq!(
        read_until_closed(&mut stalled, Duration::from_secs(2)).await,
        Some(Vec::new()),
        "the stalled connection is closed, unanswered"
    );
}

/// The connection cap: with 2 connections open, a third is not served (its TCP connect
/// completes in the kernel, its TLS handshake does not) until one of the two ends; then it
/// is served. A flood of connections past the cap costs no task.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_cap_wait_until_one_ends() {
    let limits = Limits {
        max_connections: 2,
        ..Limits::default()
    };
    let (_dir, pki, addr, phase, server) =
        start_tls_with(fake_cluster(), limits, Duration::from_secs(5)).await;
    let pki = Arc::new(pki);
    let review = pod_review("web", Some("bad"), true);
    let (mut first, _) = connect(&pki, addr).await.unwrap();
    let (mut second, _) = connect(&pki, addr).await.unwrap();
    assert_answered(&try_send(&mut first, &review).await.unwrap(), false);
    assert_answered(&try_send(&mut second, &review).await.unwrap(), false);

    // Past the cap: the kernel completes the TCP connects, nothing answers the TLS hello.
    let mut waiting = Vec::new();
    for _ in 0..20 {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let pki = pki.clone();
        waiting.push(tokio::spawn(async move { connect_over(&pki, tcp).await }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        waiting.iter().all(|w| !w.is_finished()),
        "a connection past the cap was served"
    );
    // The two served connections still work.
    assert_answered(&try_send(&mut first, &review).await.unwrap(), false);

    // One ends: exactly one waiting connection is served in its place.
    drop(first);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let served: Vec<usize> = (0..waiting.len())
        .filter(|&i| waiting[i].is_finished())
        .collect();
    assert_eq!(served.len(), 1, "one connection takes the freed place");
    let (mut third, _) = waiting.remove(served[0]).await.unwrap().unwrap();
    assert_answered(&try_send(&mut third, &review).await.unwrap(), false);
    assert!(waiting.iter().all(|w| !w.is_finished()));

    for w in &waiting {
        w.abort();
    }
    drop((second, third));
    phase.send_replace(Phase::Draining);
    stops(server, "the server stops").await;
}

/// Over TLS, with the shared server's idle timeout apart from its header timeout: a
/// keep-alive connection idle past the header timeout still answers, and a next head begun
/// with a partial TLS record (bytes on the socket, none decrypted yet) is closed at the
/// header timeout from those bytes, not at the idle timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_idle_waits_outlive_the_header_timeout_but_a_begun_record_does_not() {
    use tokio::io::AsyncWriteExt;
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    let pki = Pki::new();
    pki.issue(&cert, &key);
    let (app, _tx) = app(fake_cluster(), true, Limits::default());
    let tls = crate::tls::server_config(&cert, &key).unwrap();
    let limits = shared::Limits {
        max_connections: 4,
        max_connections_per_client: 4,
        handshake_timeout: HANDSHAKE_TIMEOUT,
        header_read_timeout: Duration::from_secs(1),
        keep_alive_timeout: Duration::from_secs(10),
        max_buf_size: MAX_BUF_SIZE,
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (phase_tx, phase) = crate::shutdown::phase_channel();
    let handshake = Tls(TlsAcceptor::from(tls));
    let drain = Duration::from_secs(5);
    let server = tokio::spawn(shared::serve(
        listener, handshake, app, phase, drain, limits,
    ));
    let review = pod_review("web", Some("bad"), true);
    let mut s = connect_raw(&pki, addr).await.unwrap();
    write_review(&mut s, &review).await;
    assert_answered(&read_answer(&mut s).await, false);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    write_review(&mut s, &review).await;
    assert_answered(&read_answer(&mut s).await, false);

    tokio::time::sleep(Duration::from_millis(1500)).await;
    // The first bytes of a TLS application-data record header, written under the TLS layer.
    s.get_mut().0.write_all(&[0x17, 0x03]).await.unwrap();
    let begun = std::time::Instant::now();
    // The idle timeout would close it 8.5 s from now.
    let closed = read_until_closed(&mut s, Duration::from_secs(3)).await;
    let took = begun.elapsed();
    assert!(
        closed.is_some(),
        "the begun record was not closed within 3 s"
    );
    assert!(
        took >= Duration::from_millis(800),
        "closed {took:?} after the record began, the header timeout is 1 s"
    );
    phase_tx.send_replace(Phase::Draining);
    stops(server, "the server stops").await;
}
