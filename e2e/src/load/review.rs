//! An AdmissionReview load generator for `meshgate-webhook`, over real TLS on loopback: what
//! the benchmarks (`make bench`, `webhook/bench/run.sh`) and the fault suite drive the webhook
//! with, and the cluster objects those reviews name.
//!
//! In: the webhook's address, the CA that signed its certificate, a set of [`Review`]s with
//! the answers they must get, a rate, a duration and a number of keep-alive connections.
//! Out: one [`Sample`] per request (when it was due, sent and answered, and whether the answer
//! was right), summarized by [`Report`]. Beside it, [`create_nodes`] registers the verified and
//! unverified Nodes the reviews name, labelled as cloud nodes are, for the webhook's cache.
//!
//! Open loop (a finite rate): request `k` is due at `start + k / rate`, whatever happened to
//! earlier ones, and its latency is measured from when it was *due*, so a stall shows up as the
//! queueing it causes instead of silently lowering the offered rate (coordinated omission).
//! Requests are spread round-robin over the connections; each connection sends its next
//! request when it is due or, if it is still busy, as soon as the previous answer arrives.
//! Closed loop (`rate` = infinity): each connection sends its next request as soon as the
//! previous answer arrives, which measures throughput at saturation and the service time.
//! A broken connection is re-established for the next request; the request that hit it is
//! counted as failed. Connecting (TCP, TLS and HTTP handshakes) and each request are bounded
//! by [`STEP_TIMEOUT`], so a stalled server ends the run with failed samples instead of
//! hanging it. A [`Spec`] that cannot be run (no connections, no reviews, a rate that is not a
//! positive number) is refused with a [`SpecError`] before anything is sent.
//!
//! [`WebhookProcess`] runs the real `meshgate-webhook` binary to point the load at: in, a
//! kubeconfig and extra flags; out, its HTTPS and admin addresses, the CA that signed its
//! certificate, its log, its memory use, SIGTERM and its exit code.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::{Namespace, Node};
use kube::Client;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

use crate::harness::wait::API_TIMEOUT;
use crate::load::stats::quantile;

/// Bound on connecting (TCP connect, TLS and HTTP handshakes) and on one request (from
/// sending it to the end of the answer's body). Well above the webhook's own request deadline
/// (3 s by default), so it only fires when the server stalls.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(10);

/// Why [`run`] refused a [`Spec`] or could not finish.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    /// `rate` must be a positive number of requests per second (or infinity for a closed
    /// loop), and large enough that one connection's interval fits in a [`Duration`].
    #[error("rate {0} is not a usable positive number of requests per second")]
    InvalidRate(f64),
    /// At least one connection is needed to send anything.
    #[error("connections must be at least 1")]
    NoConnections,
    /// At least one review is needed to send anything.
    #[error("no reviews to send")]
    NoReviews,
    /// A connection task was cancelled before it returned its samples (the runtime is
    /// shutting down), so the report would be incomplete.
    #[error("a connection task did not finish: {0}")]
    TaskCancelled(String),
}

impl Spec {
    /// Checks what [`run`] needs: at least one connection and one review, and a rate that
    /// is positive (infinity: closed loop) with an interval per connection that fits in a
    /// [`Duration`].
    pub fn validate(&self) -> Result<(), SpecError> {
        if self.connections == 0 {
            return Err(SpecError::NoConnections);
        }
        if self.reviews.is_empty() {
            return Err(SpecError::NoReviews);
        }
        let usable = self.rate > 0.0
            && (self.rate == f64::INFINITY
                || Duration::try_from_secs_f64(self.connections as f64 / self.rate).is_ok());
        if !usable {
            return Err(SpecError::InvalidRate(self.rate));
        }
        Ok(())
    }
}

/// One request body and the answer it must get.
#[derive(Clone, Debug)]
pub struct Review {
    /// The serialized AdmissionReview.
    pub body: Bytes,
    /// Its `request.uid`, which the answer must echo.
    pub uid: String,
    /// The `response.allowed` it must get.
    pub allowed: bool,
}

/// The namespace of the [`pod_review`]s. [`create_nodes`] creates it: the apiserver admits
/// pods only into namespaces that exist, and the webhook reads the namespace's labels from its
/// cache (a profile may select by them), failing closed for a namespace it does not know.
pub const NAMESPACE: &str = "load";

/// A pod CREATE review with `spec.nodeName` set: a meshed (linkerd) or plain pod, about the
/// size of a real injected pod.
pub fn pod_review(uid: &str, node: &str, meshed: bool, allowed: bool) -> Review {
    let mut labels = json!({"app": "web", "pod-template-hash": "5d8f7c9b4d"});
    if meshed {
        labels["linkerd.io/control-plane-ns"] = json!("linkerd");
        labels["linkerd.io/proxy-deployment"] = json!("web");
    }
    let container = |name: &str, image: &str| {
        json!({"name": name, "image": image,
               "ports": [{"containerPort": 8080, "protocol": "TCP"}],
               "env": (0..8).map(|k| json!({"name": format!("VAR_{k}"), "value": "some-value"})).collect::<Vec<_>>(),
               "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
               "terminationMessagePath": "/dev/termination-log", "imagePullPolicy": "IfNotPresent"})
    };
    let v = json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "name": format!("web-{uid}"),
            "namespace": NAMESPACE,
            "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
            "object": {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": format!("web-{uid}"), "namespace": NAMESPACE, "labels": labels,
                             "annotations": {"linkerd.io/inject": "enabled"},
                             "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                                  "name": "web-5d8f7c9b4d", "uid": "1b2c3d4e", "controller": true}]},
                "spec": {
                    "nodeName": node,
                    "initContainers": [container("linkerd-init", "cr.l5d.io/linkerd/proxy-init:v2.2.3")],
                    "containers": [container("app", "registry.example/web:1.2.3"),
                                   container("linkerd-proxy", "cr.l5d.io/linkerd/proxy:stable-2.14.10")],
                    "restartPolicy": "Always", "serviceAccountName": "default"
                },
                "status": {}
            },
            "oldObject": null,
            "dryRun": false,
            "options": {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1"}
        }
    });
    Review {
        body: Bytes::from(v.to_string()),
        uid: uid.to_string(),
        allowed,
    }
}

/// A `pods/binding` CREATE review of pod `namespace/pod` to `node`.
pub fn binding_review(uid: &str, namespace: &str, pod: &str, node: &str, allowed: bool) -> Review {
    let v = json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Binding"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "subResource": "binding",
            "name": pod,
            "namespace": namespace,
            "operation": "CREATE",
            "userInfo": {"username": "system:kube-scheduler"},
            "object": {"apiVersion": "v1", "kind": "Binding",
                       "metadata": {"name": pod, "namespace": namespace},
                       "target": {"apiVersion": "v1", "kind": "Node", "name": node}},
            "dryRun": false
        }
    });
    Review {
        body: Bytes::from(v.to_string()),
        uid: uid.to_string(),
        allowed,
    }
}

/// A TLS client config trusting only `ca_der`.
pub fn tls_connector(ca_der: &[u8]) -> anyhow::Result<tokio_rustls::TlsConnector> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(rustls::pki_types::CertificateDer::from(ca_der.to_vec()))?;
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

/// What to send.
#[derive(Clone)]
pub struct Spec {
    /// The webhook's HTTPS address.
    pub addr: SocketAddr,
    /// Path to POST to (`/validate`).
    pub path: String,
    /// Trusts the webhook's certificate.
    pub connector: tokio_rustls::TlsConnector,
    /// Bodies, sent in turn.
    pub reviews: Arc<Vec<Review>>,
    /// Requests per second offered; `f64::INFINITY` for a closed loop (each connection
    /// sends as soon as its previous answer arrived).
    pub rate: f64,
    /// How long to offer them.
    pub duration: Duration,
    /// Keep-alive connections.
    pub connections: usize,
}

/// How one request ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// HTTP 200 with the expected `allowed` and the request's uid.
    Right,
    /// An answer, but not the expected one (status, allowed or uid).
    Wrong(String),
    /// No answer: the connection could not be made or broke.
    Failed(String),
}

/// One request.
#[derive(Clone, Debug)]
pub struct Sample {
    /// When it was due.
    pub due: Instant,
    /// When its bytes were handed to the connection.
    pub sent: Instant,
    /// When the answer (or the failure) arrived.
    pub done: Instant,
    /// How it ended.
    pub outcome: Outcome,
    /// The connection it used (for diagnosis).
    pub connection: usize,
}

/// All samples of a run.
#[derive(Debug, Default)]
pub struct Report {
    /// Every request, in no particular order.
    pub samples: Vec<Sample>,
    /// When the first request was due.
    pub start: Option<Instant>,
}

impl Report {
    /// Requests answered right.
    pub fn right(&self) -> usize {
        self.samples
            .iter()
            .filter(|s| s.outcome == Outcome::Right)
            .count()
    }

    /// Requests answered wrong or not at all.
    pub fn errors(&self) -> Vec<&Sample> {
        self.samples
            .iter()
            .filter(|s| s.outcome != Outcome::Right)
            .collect()
    }

    /// Latency (due → answered) of the right answers, sorted.
    pub fn latencies(&self) -> Vec<Duration> {
        self.right_since(|s| s.due)
    }

    /// Service time (sent → answered) of the right answers, sorted.
    pub fn service_times(&self) -> Vec<Duration> {
        self.right_since(|s| s.sent)
    }

    /// For each right answer, the time from `from(sample)` to the answer, sorted.
    fn right_since(&self, from: impl Fn(&Sample) -> Instant) -> Vec<Duration> {
        let mut v: Vec<Duration> = self
            .samples
            .iter()
            .filter(|s| s.outcome == Outcome::Right)
            .map(|s| s.done.saturating_duration_since(from(s)))
            .collect();
        v.sort();
        v
    }

    /// The `p` quantile (0..=1) of [`Self::latencies`].
    pub fn latency(&self, p: f64) -> Duration {
        quantile(&self.latencies(), p)
    }

    /// Right answers per second over the span from the first due time to the last answer.
    pub fn throughput(&self) -> f64 {
        let (Some(start), Some(end)) = (self.start, self.samples.iter().map(|s| s.done).max())
        else {
            return 0.0;
        };
        self.right() as f64 / end.saturating_duration_since(start).as_secs_f64().max(1e-9)
    }

    /// A one-line summary.
    pub fn summary(&self) -> String {
        let lat = self.latencies();
        let svc = self.service_times();
        format!(
            "{} requests, {} right, {} errors, {:.0}/s; latency p50 {:.2} ms p99 {:.2} ms max {:.2} ms; service p50 {:.2} ms p99 {:.2} ms",
            self.samples.len(),
            self.right(),
            self.errors().len(),
            self.throughput(),
            quantile(&lat, 0.5).as_secs_f64() * 1e3,
            quantile(&lat, 0.99).as_secs_f64() * 1e3,
            quantile(&lat, 1.0).as_secs_f64() * 1e3,
            quantile(&svc, 0.5).as_secs_f64() * 1e3,
            quantile(&svc, 0.99).as_secs_f64() * 1e3,
        )
    }
}

type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

/// [`connect_unbounded`] within `step` ([`STEP_TIMEOUT`]).
async fn connect(spec: &Spec, step: Duration) -> anyhow::Result<Sender> {
    tokio::time::timeout(step, connect_unbounded(spec))
        .await
        .map_err(|_| anyhow::anyhow!("timeout: not connected within {step:?}"))?
}

async fn connect_unbounded(spec: &Spec) -> anyhow::Result<Sender> {
    let tcp = tokio::net::TcpStream::connect(spec.addr).await?;
    tcp.set_nodelay(true)?;
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1")?;
    let tls = spec.connector.connect(name, tcp).await?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}

fn judge(review: &Review, status: u16, body: &[u8]) -> Outcome {
    if status != 200 {
        return Outcome::Wrong(format!(
            "HTTP {status}: {}",
            String::from_utf8_lossy(&body[..body.len().min(200)])
        ));
    }
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return Outcome::Wrong("answer is not JSON".into());
    };
    let resp = &v["response"];
    if resp["uid"].as_str() != Some(review.uid.as_str()) {
        return Outcome::Wrong(format!("uid {} for {}", resp["uid"], review.uid));
    }
    if resp["allowed"].as_bool() != Some(review.allowed) {
        return Outcome::Wrong(format!(
            "allowed={} for {} (expected {}): {}",
            resp["allowed"], review.uid, review.allowed, resp["status"]["message"]
        ));
    }
    Outcome::Right
}

/// [`one_unbounded`] within `step` ([`STEP_TIMEOUT`]); a timeout is an error (the
/// connection is then dropped: its answer may still come).
async fn one(
    sender: &mut Sender,
    spec: &Spec,
    review: &Review,
    step: Duration,
) -> Result<Outcome, String> {
    tokio::time::timeout(step, one_unbounded(sender, spec, review))
        .await
        .map_err(|_| format!("timeout: no answer within {step:?}"))?
}

async fn one_unbounded(
    sender: &mut Sender,
    spec: &Spec,
    review: &Review,
) -> Result<Outcome, String> {
    let (status, body) = exchange(sender, spec, review).await?;
    Ok(judge(review, status, &body))
}

/// Sends one review and reads the whole answer: (HTTP status, body).
async fn exchange(
    sender: &mut Sender,
    spec: &Spec,
    review: &Review,
) -> Result<(u16, Bytes), String> {
    let req = http::Request::post(spec.path.as_str())
        .header("host", "127.0.0.1")
        .header("content-type", "application/json")
        .body(Full::new(review.body.clone()))
        .map_err(|e| e.to_string())?;
    sender.ready().await.map_err(|e| e.to_string())?;
    let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok((status, body))
}

/// Sends one review over a connection of its own (`spec`'s address, path and connector;
/// its reviews, rate and connections are not used) and returns the answer's `response`
/// object, for a test that reads the message; an answer that is not HTTP 200 JSON is an
/// error. Bounded by [`STEP_TIMEOUT`] per step.
pub async fn answer(spec: &Spec, review: &Review) -> anyhow::Result<Value> {
    let mut sender = connect(spec, STEP_TIMEOUT).await?;
    let (status, body) = tokio::time::timeout(STEP_TIMEOUT, exchange(&mut sender, spec, review))
        .await
        .map_err(|_| anyhow::anyhow!("no answer within {STEP_TIMEOUT:?}"))?
        .map_err(|e| anyhow::anyhow!(e))?;
    anyhow::ensure!(
        status == 200,
        "HTTP {status}: {}",
        String::from_utf8_lossy(&body[..body.len().min(200)])
    );
    let v: Value = serde_json::from_slice(&body)?;
    Ok(v["response"].clone())
}

/// One connection's requests. `spec` was validated by [`run`]: at least one connection and
/// review, a positive rate; the arithmetic is checked all the same, and ends the loop rather
/// than panicking.
async fn connection_loop(
    spec: Arc<Spec>,
    index: usize,
    start: Instant,
    step: Duration,
) -> Vec<Sample> {
    let mut out = Vec::new();
    let (connections, reviews) = (spec.connections, spec.reviews.len());
    // Zero for a closed loop (infinite rate); `None` if the rate is unusable.
    let interval = Duration::try_from_secs_f64(connections as f64 / spec.rate);
    let offset = Duration::try_from_secs_f64(index as f64 / spec.rate);
    let (Ok(interval), Ok(offset), Some(end)) =
        (interval, offset, start.checked_add(spec.duration))
    else {
        return out;
    };
    let mut sender: Option<Sender> = None;
    let mut k: u32 = 0;
    while let Some(due) = due_at(&spec, start, interval, offset, k) {
        if due >= end {
            break;
        }
        k = match k.checked_add(1) {
            Some(k) => k,
            None => break,
        };
        // Only when the request is not due yet: tokio's timer rounds even an elapsed deadline
        // up to its next 1 ms tick, which would pace a closed loop at one request per tick.
        if due > Instant::now() {
            tokio::time::sleep_until(due.into()).await;
        }
        let review =
            &spec.reviews[index.wrapping_add((k as usize).wrapping_mul(connections)) % reviews];
        let sent = Instant::now();
        if let Err(e) = reuse_or_connect(&mut sender, &spec, step).await {
            out.push(Sample {
                due,
                sent,
                done: Instant::now(),
                outcome: Outcome::Failed(format!("connect: {e}")),
                connection: index,
            });
            continue;
        }
        let Some(s) = sender.as_mut() else { continue };
        let outcome = match one(s, &spec, review, step).await {
            Ok(o) => o,
            Err(e) => {
                sender = None;
                Outcome::Failed(e)
            }
        };
        out.push(Sample {
            due,
            sent,
            done: Instant::now(),
            outcome,
            connection: index,
        });
    }
    out
}

/// When request `k` of a connection is due: `offset` plus `k` intervals after `start` at a
/// finite rate, now (not before `start`) in a closed loop; `None` when that overflows.
fn due_at(
    spec: &Spec,
    start: Instant,
    interval: Duration,
    offset: Duration,
    k: u32,
) -> Option<Instant> {
    if !spec.rate.is_finite() {
        return Some(Instant::now().max(start));
    }
    interval
        .checked_mul(k)
        .and_then(|d| d.checked_add(offset))
        .and_then(|d| start.checked_add(d))
}

/// Leaves a usable connection in `sender`: the current one, or a new one when there is none or
/// it cannot take a request. A connection the server closed, or said it would close
/// (`Connection: close` on the last answer, as a stopping webhook does), is not reused: `ready`
/// waits for the connection's state to settle instead of racing the close (RFC 9112 §9.6).
async fn reuse_or_connect(
    sender: &mut Option<Sender>,
    spec: &Spec,
    step: Duration,
) -> anyhow::Result<()> {
    if let Some(s) = sender.as_mut()
        && !matches!(tokio::time::timeout(step, s.ready()).await, Ok(Ok(())))
    {
        *sender = None;
    }
    if sender.is_none() {
        *sender = Some(connect(spec, step).await?);
    }
    Ok(())
}

/// Offers the load and returns every sample once the last request finished; refuses a spec
/// [`Spec::validate`] rejects. A connection task that panicked (a bug in this module) panics
/// the caller too, rather than silently dropping its samples.
pub async fn run(spec: Spec) -> Result<Report, SpecError> {
    run_bounded(spec, STEP_TIMEOUT).await
}

/// [`run`] with each connect and request bounded by `step`.
async fn run_bounded(spec: Spec, step: Duration) -> Result<Report, SpecError> {
    spec.validate()?;
    let spec = Arc::new(spec);
    // A little head start so every connection's first request is due after it was spawned.
    let start = Instant::now() + Duration::from_millis(20);
    let tasks: Vec<_> = (0..spec.connections)
        .map(|i| tokio::spawn(connection_loop(spec.clone(), i, start, step)))
        .collect();
    gather(tasks, start).await
}

/// The report of tasks that each return samples, the first due at `start`. A task that
/// panicked (a bug in the load code) panics the caller too, rather than silently dropping
/// its samples; one cancelled is a [`SpecError::TaskCancelled`].
pub(crate) async fn gather<S>(
    tasks: Vec<tokio::task::JoinHandle<S>>,
    start: Instant,
) -> Result<Report, SpecError>
where
    S: IntoIterator<Item = Sample>,
{
    let mut report = Report {
        samples: Vec::with_capacity(tasks.len()),
        start: Some(start),
    };
    for t in tasks {
        match t.await {
            Ok(samples) => report.samples.extend(samples),
            Err(e) => match e.try_into_panic() {
                Ok(panic) => std::panic::resume_unwind(panic),
                Err(e) => return Err(SpecError::TaskCancelled(e.to_string())),
            },
        }
    }
    Ok(report)
}

/// A Node named `name` with the labels a cloud node carries (hostname, os, arch, instance
/// type, region, zone, node group) and meshgate's verified label, as the webhook caches it.
pub fn cloud_node(name: &str, verified: bool) -> anyhow::Result<Node> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {
            "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
            "node.kubernetes.io/instance-type": "m6i.2xlarge",
            "topology.kubernetes.io/region": "eu-west-1", "topology.kubernetes.io/zone": "eu-west-1a",
            "eks.amazonaws.com/nodegroup": "general-purpose",
            meshgate_core::gate::VERIFIED_LABEL: if verified { "true" } else { "false" },
        }},
        "spec": {"providerID": format!("aws:///eu-west-1a/i-{name}")}
    }))?)
}

/// Creates the [`NAMESPACE`] of the pod reviews; one that already exists counts as created.
pub async fn create_namespace(client: &Client) -> anyhow::Result<()> {
    let api: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": NAMESPACE}}))?;
    match tokio::time::timeout(API_TIMEOUT, api.create(&PostParams::default(), &ns)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(kube::Error::Api(s))) if s.code == 409 => Ok(()),
        Ok(Err(e)) => Err(anyhow::Error::new(e).context(format!("creating namespace {NAMESPACE}"))),
        Err(_) => anyhow::bail!("creating namespace {NAMESPACE}: no answer within {API_TIMEOUT:?}"),
    }
}

/// Creates `verified` [`cloud_node`]s named `<prefix>-v-<i>` and `unverified` ones named
/// `<prefix>-u-<i>`, `parallel` creates at a time, each bounded by [`API_TIMEOUT`]; a Node
/// that already exists counts as created; and the pod reviews' [`NAMESPACE`] (not timed).
/// Returns how long the nodes took.
pub async fn create_nodes(
    client: &Client,
    prefix: &str,
    verified: usize,
    unverified: usize,
    parallel: usize,
) -> anyhow::Result<Duration> {
    create_namespace(client).await?;
    let started = Instant::now();
    let nodes = (0..verified)
        .map(|i| cloud_node(&format!("{prefix}-v-{i}"), true))
        .chain((0..unverified).map(|i| cloud_node(&format!("{prefix}-u-{i}"), false)));
    create_node_objects(client, nodes, parallel).await?;
    Ok(started.elapsed())
}

/// Creates `nodes`, `parallel` creates at a time, each bounded by [`API_TIMEOUT`]; a Node that
/// already exists counts as created. Fails naming the first failure and how many failed.
pub async fn create_node_objects(
    client: &Client,
    nodes: impl Iterator<Item = anyhow::Result<Node>>,
    parallel: usize,
) -> anyhow::Result<()> {
    let api: Api<Node> = Api::all(client.clone());
    let results: Vec<anyhow::Result<()>> = futures::stream::iter(nodes)
        .map(|node| {
            let api = api.clone();
            async move {
                let node = node?;
                let name = node.metadata.name.clone().unwrap_or_default();
                match tokio::time::timeout(API_TIMEOUT, api.create(&PostParams::default(), &node))
                    .await
                {
                    Ok(Ok(_)) => Ok(()),
                    Ok(Err(kube::Error::Api(s))) if s.code == 409 => Ok(()),
                    Ok(Err(e)) => Err(anyhow::Error::new(e).context(format!("creating {name}"))),
                    Err(_) => anyhow::bail!("creating {name}: no answer within {API_TIMEOUT:?}"),
                }
            }
        })
        .buffer_unordered(parallel.max(1))
        .collect()
        .await;
    let failed: Vec<anyhow::Error> = results.into_iter().filter_map(Result::err).collect();
    if let Some(first) = failed.first() {
        anyhow::bail!("{} node creates failed, first: {first:#}", failed.len());
    }
    Ok(())
}

/// `meshgate-webhook` as a real process with a test CA's loopback certificate, pointed at a
/// kubeconfig; killed on drop.
pub struct WebhookProcess {
    child: Option<std::process::Child>,
    /// The HTTPS address (`/validate`).
    pub listen: SocketAddr,
    /// The admin address (`/ready`, `/metrics`).
    pub admin: SocketAddr,
    /// The CA (DER) that signed its serving certificate.
    pub ca_der: Vec<u8>,
    /// The same CA (PEM): a webhook configuration's `caBundle`.
    pub ca_pem: String,
    log: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl WebhookProcess {
    /// Starts the webhook binary (from the workspace target dir) with `extra` flags.
    pub fn start(kubeconfig: &std::path::Path, extra: &[&str]) -> anyhow::Result<Self> {
        Self::start_with_env(kubeconfig, extra, &[])
    }

    /// [`Self::start`] with variables added to its environment.
    pub fn start_with_env(
        kubeconfig: &std::path::Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        use anyhow::Context;
        let dir = tempfile::tempdir()?;
        let ca = crate::sim::webhook::TestCa::new()?;
        let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        ca.issue(&cert, &key)?;
        let listen = SocketAddr::from(([127, 0, 0, 1], crate::sim::node::free_port()?));
        let admin = SocketAddr::from(([127, 0, 0, 1], crate::sim::node::free_port()?));
        let log = dir.path().join("webhook.log");
        let out = std::fs::File::create(&log)?;
        let child =
            std::process::Command::new(crate::sim::node::workspace_bin("meshgate-webhook")?)
                .arg("--listen")
                .arg(listen.to_string())
                .arg("--admin-addr")
                .arg(admin.to_string())
                .arg("--tls-cert")
                .arg(&cert)
                .arg("--tls-key")
                .arg(&key)
                .arg("--kubeconfig")
                .arg(kubeconfig)
                .args(extra)
                .envs(env.iter().copied())
                // The log is read back ([`Self::cached_nodes`]): no colour codes in it.
                .env("NO_COLOR", "1")
                .env(
                    "RUST_LOG",
                    std::env::var("MESHGATE_WEBHOOK_LOG").unwrap_or_else(|_| {
                        "warn,meshgate_webhook=info,meshgate_shell=info".into()
                    }),
                )
                .stdin(std::process::Stdio::null())
                .stdout(out.try_clone()?)
                .stderr(out)
                .spawn()
                .context("starting meshgate-webhook")?;
        Ok(Self {
            child: Some(child),
            listen,
            admin,
            ca_der: ca.der().to_vec(),
            ca_pem: ca.pem().to_owned(),
            log,
            _dir: dir,
        })
    }

    /// Waits until `/ready` answers 200 (caches synced), up to `timeout`.
    pub async fn wait_ready(&mut self, timeout: Duration) -> anyhow::Result<Duration> {
        let begun = Instant::now();
        while begun.elapsed() < timeout {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                anyhow::bail!(
                    "meshgate-webhook exited ({status}) before it was ready:\n{}",
                    self.log()
                );
            }
            if self
                .admin_get("/ready")
                .await
                .is_some_and(|(code, _)| code == 200)
            {
                return Ok(begun.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        anyhow::bail!(
            "meshgate-webhook not ready within {timeout:?}:\n{}",
            self.log()
        )
    }

    /// GETs an admin path: (status, body).
    pub async fn admin_get(&self, path: &str) -> Option<(u16, String)> {
        crate::sim::node::http_get(self.admin, path).await
    }

    /// The process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(std::process::Child::id)
    }

    /// Resident set size in KiB (and the peak, `VmHWM`), from /proc.
    pub fn rss_kib(&self) -> Option<(u64, u64)> {
        crate::load::http_abuse::memory_kib(self.pid()?)
    }

    /// Sends SIGTERM; returns when it was sent.
    pub fn sigterm(&self) -> Option<Instant> {
        let pid = self.pid()?;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .ok()?;
        Some(Instant::now())
    }

    /// Waits up to `timeout` for the process to exit; its exit code (None: killed or still
    /// running, then killed).
    pub async fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        let mut c = self.child.take()?;
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = c.try_wait() {
                return status.code();
            }
            if Instant::now() >= deadline {
                let _ = c.kill();
                let _ = c.wait();
                return None;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The webhook's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The count of Nodes its "caches synced" log line gives (logged at info level by
    /// `meshgate_webhook` once every cache has listed, when `/ready` turns 200), if logged.
    pub fn cached_nodes(&self) -> Option<usize> {
        cached_nodes(&self.log())
    }
}

/// The `nodes` field of the first "caches synced" line of `log` (text or JSON format).
fn cached_nodes(log: &str) -> Option<usize> {
    let line = log.lines().find(|l| l.contains("caches synced"))?;
    let at = line
        .find("nodes=")
        .map(|k| k + "nodes=".len())
        .or_else(|| line.find("\"nodes\":").map(|k| k + "\"nodes\":".len()))?;
    let digits: String = line[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

impl Drop for WebhookProcess {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};

    /// A TLS server on loopback that answers every review after `delay`, right for the
    /// reviews built below: allowed unless the uid starts with `refuse`.
    async fn answering_server(
        ca: &crate::sim::webhook::TestCa,
        delay: Duration,
    ) -> anyhow::Result<SocketAddr> {
        let dir = tempfile::tempdir()?;
        let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        ca.issue(&cert, &key)?;
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(
            vec![CertificateDer::from_pem_file(&cert)?],
            PrivateKeyDer::from_pem_file(&key)?,
        )?;
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    // As the webhook does: no Nagle delay on small answers.
                    let _ = tcp.set_nodelay(true);
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let answer = hyper::service::service_fn(
                        move |req: http::Request<hyper::body::Incoming>| async move {
                            let body = req.into_body().collect().await?.to_bytes();
                            let review: Value = serde_json::from_slice(&body).unwrap_or_default();
                            let uid = review["request"]["uid"].as_str().unwrap_or_default();
                            let allowed = !uid.starts_with("refuse");
                            tokio::time::sleep(delay).await;
                            let out = json!({"response": {"uid": uid, "allowed": allowed}});
                            Ok::<_, hyper::Error>(http::Response::new(Full::new(Bytes::from(
                                out.to_string(),
                            ))))
                        },
                    );
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tls), answer)
                        .await;
                });
            }
        });
        Ok(addr)
    }

    #[tokio::test]
    async fn open_loop_paces_requests_and_closed_loop_sends_back_to_back() {
        let ca = crate::sim::webhook::TestCa::new().unwrap();
        let service = Duration::from_millis(2);
        let addr = answering_server(&ca, service).await.unwrap();
        let reviews = Arc::new(vec![
            pod_review("allow-1", "n", true, true),
            pod_review("refuse-1", "n", true, false),
            binding_review("refuse-2", "ns", "p", "n", false),
        ]);
        let spec = |rate: f64| Spec {
            addr,
            path: "/validate".into(),
            connector: tls_connector(ca.der()).unwrap(),
            reviews: reviews.clone(),
            rate,
            duration: Duration::from_millis(500),
            connections: 2,
        };

        // Open loop, 100/s for 0.5 s over 2 connections: exactly 50 requests, one every
        // 20 ms per connection, every answer right.
        let open = run(spec(100.0)).await.unwrap();
        assert_eq!(open.samples.len(), 50);
        assert_eq!(open.right(), 50, "{:?}", open.errors().first());

        // Closed loop: each connection sends as soon as its answer is back: far more than the
        // paced run's 50 (at most one per service time and connection), all right.
        let closed = run(spec(f64::INFINITY)).await.unwrap();
        assert!(closed.errors().is_empty(), "{:?}", closed.errors().first());
        let most = 2 * (500 / service.as_millis() as usize);
        assert!(
            (51..=most).contains(&closed.samples.len()),
            "at most {most} possible in 0.5 s: {}",
            closed.summary()
        );
        assert!(closed.latency(0.5) >= service);
    }

    #[tokio::test]
    async fn unusable_specs_are_refused_before_anything_is_sent() {
        let ca = crate::sim::webhook::TestCa::new().unwrap();
        // Nothing listens there: a spec that got past validation would record failures.
        let spec = |rate: f64, connections: usize, reviews: Vec<Review>| Spec {
            addr: SocketAddr::from(([127, 0, 0, 1], 9)),
            path: "/validate".into(),
            connector: tls_connector(ca.der()).unwrap(),
            reviews: Arc::new(reviews),
            rate,
            duration: Duration::from_millis(50),
            connections,
        };
        let one = || vec![pod_review("u1", "n", true, true)];
        for rate in [0.0, -1.0, f64::NAN, f64::NEG_INFINITY, 1e-300] {
            assert!(
                matches!(
                    run(spec(rate, 2, one())).await,
                    Err(SpecError::InvalidRate(_))
                ),
                "rate {rate}"
            );
        }
        assert!(matches!(
            run(spec(100.0, 0, one())).await,
            Err(SpecError::NoConnections)
        ));
        assert!(matches!(
            run(spec(100.0, 2, Vec::new())).await,
            Err(SpecError::NoReviews)
        ));
        assert!(spec(f64::INFINITY, 1, one()).validate().is_ok());
        assert!(spec(0.5, 1, one()).validate().is_ok());
    }

    #[tokio::test]
    async fn a_stalled_server_ends_the_run_with_timeouts_instead_of_hanging() {
        let ca = crate::sim::webhook::TestCa::new().unwrap();
        // Accepts TCP connections and never says a word: the TLS handshake stalls.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let silent = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((tcp, _)) = listener.accept().await {
                held.push(tcp);
            }
        });
        let spec = Spec {
            addr,
            path: "/validate".into(),
            connector: tls_connector(ca.der()).unwrap(),
            reviews: Arc::new(vec![pod_review("u1", "n", true, true)]),
            rate: 20.0,
            duration: Duration::from_millis(100),
            connections: 2,
        };
        let step = Duration::from_millis(200);
        let report = tokio::time::timeout(Duration::from_secs(5), run_bounded(spec, step))
            .await
            .expect("the run ends although the server stalls")
            .unwrap();
        silent.abort();
        assert_eq!(report.samples.len(), 2, "one due request per connection");
        for s in &report.samples {
            assert!(
                matches!(&s.outcome, Outcome::Failed(e) if e.contains("timeout")),
                "{:?}",
                s.outcome
            );
            assert!(s.done.duration_since(s.sent) >= step);
        }
    }

    #[test]
    fn the_cached_node_count_is_read_from_text_and_json_lines() {
        let text = "2026-01-05T10:00:00Z  INFO meshgate_webhook::cache: caches synced nodes=65000 pending_pods=1 namespaces=5";
        assert_eq!(cached_nodes(text), Some(65_000));
        let json = r#"{"level":"INFO","message":"caches synced","nodes":1000,"pending_pods":0}"#;
        assert_eq!(cached_nodes(json), Some(1000));
        assert_eq!(cached_nodes("listening on 127.0.0.1:8443"), None);
    }

    #[test]
    fn answers_are_judged_by_status_uid_and_allowed() {
        let r = pod_review("u1", "n", true, false);
        let ok = br#"{"response":{"uid":"u1","allowed":false}}"#;
        assert_eq!(judge(&r, 200, ok), Outcome::Right);
        assert!(matches!(judge(&r, 503, b"busy"), Outcome::Wrong(_)));
        let other = br#"{"response":{"uid":"u2","allowed":false}}"#;
        assert!(matches!(judge(&r, 200, other), Outcome::Wrong(_)));
        let allowed = br#"{"response":{"uid":"u1","allowed":true}}"#;
        assert!(matches!(judge(&r, 200, allowed), Outcome::Wrong(_)));
        let body: Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(body["request"]["object"]["spec"]["nodeName"], "n");
        assert!(r.body.len() > 2000, "about the size of an injected pod");
    }
}
