//! The baseline webhook: a TLS server that admits every AdmissionReview, and does nothing
//! else. It stands where meshgate's webhook stands in a comparison (same registration, same
//! apiserver, same TLS), so what meshgate adds is the difference.
//!
//! In: a serving certificate and key (PEM files, e.g. from [`crate::sim::webhook::TestCa`]).
//! Out: [`AllowAll`], listening on a free loopback port until dropped; every POST, on any
//! path, is answered `allowed: true` with the request's uid (a Node CREATE as a mutating
//! webhook: no patch). HTTP/1.1 with keep-alive, as the apiserver dials webhooks.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use anyhow::Context as _;
use http_body_util::{BodyExt as _, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response};
use rustls::pki_types::pem::PemObject as _;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

/// A review body larger than this is refused (the apiserver sends at most a few MiB).
const MAX_BODY: usize = 8 << 20;

/// The running server; stops when dropped.
pub struct AllowAll {
    /// Where it listens (127.0.0.1, a free port).
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for AllowAll {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

impl AllowAll {
    /// Listens on a free loopback port with the certificate `cert` and key `key` (PEM).
    pub fn start(cert: &Path, key: &Path) -> anyhow::Result<Self> {
        let certs = rustls::pki_types::CertificateDer::pem_file_iter(cert)
            .with_context(|| format!("reading {}", cert.display()))?
            .collect::<Result<Vec<_>, _>>()?;
        let key = rustls::pki_types::PrivateKeyDer::from_pem_file(key)
            .with_context(|| format!("reading {}", key.display()))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(certs, key)?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        // A runtime on a thread of its own, as a webhook is a process of its own: the caller's
        // load generator never delays an answer.
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name("allow-all".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let Ok(listener) = TcpListener::from_std(listener) else {
                        return;
                    };
                    tokio::select! {
                        () = serve(listener, acceptor) => {}
                        _ = stopped => {}
                    }
                });
            })?;
        Ok(Self {
            addr,
            stop: Some(stop),
        })
    }
}

async fn serve(listener: TcpListener, acceptor: TlsAcceptor) {
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            continue;
        };
        let acceptor = acceptor.clone();
        tokio::spawn(async move {
            let Ok(tls) = acceptor.accept(tcp).await else {
                return;
            };
            let io = hyper_util::rt::TokioIo::new(tls);
            let service = hyper::service::service_fn(answer);
            let _ = hyper::server::conn::http1::Builder::new()
                .keep_alive(true)
                .serve_connection(io, service)
                .await;
        });
    }
}

/// `allowed: true` with the review's uid; 400 for a body that is not a review.
async fn answer(req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return Ok(status(400)),
    };
    let uid = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v["request"]["uid"].as_str().map(str::to_owned));
    let Some(uid) = uid else {
        return Ok(status(400));
    };
    let review = json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": {"uid": uid, "allowed": true},
    });
    let mut res = Response::new(Full::new(Bytes::from(review.to_string())));
    res.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    Ok(res)
}

fn status(code: u16) -> Response<Full<Bytes>> {
    let mut res = Response::new(Full::new(Bytes::new()));
    *res.status_mut() = hyper::StatusCode::from_u16(code).unwrap_or(hyper::StatusCode::BAD_REQUEST);
    res
}
