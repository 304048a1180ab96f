//! Load generator and fixture tool for benchmarking `meshgate-webhook` (see `bench/run.sh`).
//!
//! In: flags. Out, per subcommand:
//! - `certs --dir D`: a test CA (`ca.crt`) and a 127.0.0.1 serving pair (`tls.crt`, `tls.key`).
//! - `nodes --kubeconfig K --count N --unverified M`: N Nodes named `bench-v-*` (labelled
//!   verified) and M named `bench-u-*` (labelled unverified), each with the labels a cloud
//!   node carries, plus one pending meshed pod `bench/pending` for the binding scenarios.
//! - `load --url U --ca C --scenario S --connections N --duration D`: N keep-alive HTTPS
//!   connections POSTing AdmissionReviews as fast as answers come back; prints one JSON line
//!   with the client-observed latency percentiles and the throughput.
//!
//! It runs as its own process so the webhook's figures are not inflated by sharing a runtime.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand, ValueEnum};
use futures::StreamExt;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

#[derive(Parser)]
#[command(name = "loadgen", about = "meshgate-webhook load generator")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Write a CA and a serving certificate for 127.0.0.1.
    Certs {
        /// Output directory.
        #[arg(long, env = "LOADGEN_DIR")]
        dir: PathBuf,
    },
    /// Create the bench Nodes and the pending pod.
    Nodes {
        /// Admin kubeconfig.
        #[arg(long, env = "LOADGEN_KUBECONFIG")]
        kubeconfig: PathBuf,
        /// Verified nodes to create.
        #[arg(long, env = "LOADGEN_COUNT", default_value_t = 4500)]
        count: usize,
        /// Unverified nodes to create.
        #[arg(long, env = "LOADGEN_UNVERIFIED", default_value_t = 500)]
        unverified: usize,
        /// Concurrent create calls.
        #[arg(long, env = "LOADGEN_PARALLEL", default_value_t = 16)]
        parallel: usize,
    },
    /// Send reviews and measure.
    Load {
        /// `https://127.0.0.1:PORT/validate`.
        #[arg(long, env = "LOADGEN_URL")]
        url: String,
        /// CA certificate (PEM) that signed the webhook's certificate.
        #[arg(long, env = "LOADGEN_CA")]
        ca: PathBuf,
        /// What to send.
        #[arg(long, env = "LOADGEN_SCENARIO", value_enum)]
        scenario: Scenario,
        /// Concurrent keep-alive connections.
        #[arg(long, env = "LOADGEN_CONNECTIONS", default_value_t = 8)]
        connections: usize,
        /// How long to send, in seconds.
        #[arg(long, env = "LOADGEN_DURATION", default_value_t = 10)]
        duration: u64,
        /// How many of the bench nodes the requests spread over (cache lookups by name).
        #[arg(long, env = "LOADGEN_NODES", default_value_t = 500)]
        nodes: usize,
    },
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Scenario {
    /// Mesh pod with nodeName on a verified node: allowed from the node cache.
    Allowed,
    /// Non-mesh pod with nodeName on an unverified node: allowed after profile matching.
    Plain,
    /// Mesh pod with nodeName on an unverified node: refused, reason from a 5 s cache.
    Refused,
    /// Binding to a verified node: allowed without a pod lookup.
    BindingAllowed,
    /// Binding of the pending mesh pod to an unverified node: pod from the cache, refused.
    BindingRefused,
}

fn pod_review(i: usize, node: &str, meshed: bool) -> Value {
    let mut labels = json!({"app": "web", "pod-template-hash": "5d8f7c9b4d"});
    if meshed {
        labels["linkerd.io/control-plane-ns"] = json!("linkerd");
        labels["linkerd.io/proxy-deployment"] = json!("web");
        labels["linkerd.io/workload-ns"] = json!("bench");
    }
    // Roughly the size of a real meshed Pod after injection (two containers, an init
    // container, volumes): about 4 KB of JSON.
    let container = |name: &str, image: &str| {
        json!({"name": name, "image": image,
               "ports": [{"containerPort": 8080, "protocol": "TCP"}],
               "env": (0..8).map(|k| json!({"name": format!("VAR_{k}"), "value": "some-value"})).collect::<Vec<_>>(),
               "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
               "volumeMounts": [{"name": "kube-api-access", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": true}],
               "terminationMessagePath": "/dev/termination-log", "imagePullPolicy": "IfNotPresent"})
    };
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": format!("00000000-0000-0000-0000-{i:012}"),
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "name": format!("web-{i}"),
            "namespace": "bench",
            "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller",
                         "groups": ["system:serviceaccounts", "system:authenticated"]},
            "object": {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": format!("web-{i}"), "namespace": "bench", "labels": labels,
                             "annotations": {"linkerd.io/inject": "enabled",
                                             "linkerd.io/proxy-version": "stable-2.14.10"},
                             "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                                  "name": "web-5d8f7c9b4d", "uid": "1b2c3d4e",
                                                  "controller": true, "blockOwnerDeletion": true}]},
                "spec": {
                    "nodeName": node,
                    "initContainers": [container("linkerd-init", "cr.l5d.io/linkerd/proxy-init:v2.2.3")],
                    "containers": [container("app", "registry.example/web:1.2.3"),
                                   container("linkerd-proxy", "cr.l5d.io/linkerd/proxy:stable-2.14.10")],
                    "volumes": [{"name": "kube-api-access", "projected": {"sources": [
                        {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}}]}}],
                    "restartPolicy": "Always", "dnsPolicy": "ClusterFirst",
                    "serviceAccountName": "default", "schedulerName": "default-scheduler",
                    "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists",
                                     "effect": "NoExecute", "tolerationSeconds": 300}]
                },
                "status": {}
            },
            "oldObject": null,
            "dryRun": false,
            "options": {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1"}
        }
    })
}

fn binding_review(i: usize, pod: &str, node: &str) -> Value {
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": format!("00000000-0000-0000-0001-{i:012}"),
            "kind": {"group": "", "version": "v1", "kind": "Binding"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "subResource": "binding",
            "name": pod,
            "namespace": "bench",
            "operation": "CREATE",
            "userInfo": {"username": "system:kube-scheduler"},
            "object": {"apiVersion": "v1", "kind": "Binding",
                       "metadata": {"name": pod, "namespace": "bench"},
                       "target": {"apiVersion": "v1", "kind": "Node", "name": node}},
            "dryRun": false
        }
    })
}

/// Distinct request bodies for the scenario, spread over `nodes` node names.
fn bodies(scenario: Scenario, nodes: usize) -> anyhow::Result<Vec<Bytes>> {
    let n = nodes.clamp(1, 4096);
    (0..n)
        .map(|i| {
            let v = match scenario {
                Scenario::Allowed => pod_review(i, &format!("bench-v-{i}"), true),
                Scenario::Plain => pod_review(i, &format!("bench-u-{i}"), false),
                Scenario::Refused => pod_review(i, &format!("bench-u-{i}"), true),
                Scenario::BindingAllowed => binding_review(i, "pending", &format!("bench-v-{i}")),
                Scenario::BindingRefused => binding_review(i, "pending", &format!("bench-u-{i}")),
            };
            Ok(Bytes::from(serde_json::to_vec(&v)?))
        })
        .collect()
}

fn expected_allowed(s: Scenario) -> bool {
    matches!(
        s,
        Scenario::Allowed | Scenario::Plain | Scenario::BindingAllowed
    )
}

fn certs(dir: PathBuf) -> anyhow::Result<()> {
    std::fs::create_dir_all(&dir)?;
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "meshgate bench CA");
    let ca_key = rcgen::KeyPair::generate()?;
    let ca_cert = ca.self_signed(&ca_key)?;
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let key = rcgen::KeyPair::generate()?;
    let cert =
        rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])?.signed_by(&key, &issuer)?;
    std::fs::write(dir.join("ca.crt"), ca_cert.pem())?;
    std::fs::write(dir.join("tls.key"), key.serialize_pem())?;
    std::fs::write(dir.join("tls.crt"), cert.pem())?;
    Ok(())
}

async fn nodes(
    kubeconfig: PathBuf,
    count: usize,
    unverified: usize,
    parallel: usize,
) -> anyhow::Result<()> {
    let client = meshgate_runtime::client::build(Some(&kubeconfig)).await?;
    let api: Api<Node> = Api::all(client.clone());
    let names = (0..count)
        .map(|i| (format!("bench-v-{i}"), "true"))
        .chain((0..unverified).map(|i| (format!("bench-u-{i}"), "false")));
    let started = Instant::now();
    let results: Vec<anyhow::Result<()>> = futures::stream::iter(names)
        .map(|(name, verified)| {
            let api = api.clone();
            async move {
                let node: Node = serde_json::from_value(json!({
                    "apiVersion": "v1", "kind": "Node",
                    "metadata": {"name": name, "labels": {
                        "kubernetes.io/hostname": name,
                        "kubernetes.io/os": "linux",
                        "kubernetes.io/arch": "amd64",
                        "beta.kubernetes.io/os": "linux",
                        "beta.kubernetes.io/arch": "amd64",
                        "node.kubernetes.io/instance-type": "m6i.2xlarge",
                        "beta.kubernetes.io/instance-type": "m6i.2xlarge",
                        "topology.kubernetes.io/region": "eu-west-1",
                        "topology.kubernetes.io/zone": "eu-west-1a",
                        "failure-domain.beta.kubernetes.io/region": "eu-west-1",
                        "failure-domain.beta.kubernetes.io/zone": "eu-west-1a",
                        "eks.amazonaws.com/nodegroup": "general-purpose",
                        "meshgate.io/cni-verified": verified,
                    }},
                    "spec": {"providerID": format!("aws:///eu-west-1a/i-{name}")}
                }))?;
                match tokio::time::timeout(
                    Duration::from_secs(30),
                    api.create(&PostParams::default(), &node),
                )
                .await?
                {
                    Ok(_) => Ok(()),
                    Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
                    Err(e) => Err(e.into()),
                }
            }
        })
        .buffer_unordered(parallel.max(1))
        .collect()
        .await;
    let failed: Vec<String> = results
        .into_iter()
        .filter_map(|r| r.err().map(|e| e.to_string()))
        .collect();
    if !failed.is_empty() {
        bail!("{} node creates failed, first: {}", failed.len(), failed[0]);
    }
    eprintln!(
        "created {} nodes in {:.1} s",
        count + unverified,
        started.elapsed().as_secs_f64()
    );

    let ns: Api<Namespace> = Api::all(client.clone());
    let _ = ns
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "bench"}}))?,
        )
        .await;
    let pods: Api<Pod> = Api::namespaced(client, "bench");
    let pending: Pod = serde_json::from_value(json!({
        "metadata": {"name": "pending", "labels": {"linkerd.io/control-plane-ns": "linkerd"}},
        "spec": {"schedulerName": "nobody", "containers": [{"name": "c", "image": "x"}]}
    }))?;
    // The namespace's default ServiceAccount appears a moment after the namespace.
    for _ in 0..100 {
        match pods.create(&PostParams::default(), &pending).await {
            Ok(_) => break,
            Err(kube::Error::Api(s)) if s.code == 409 => break,
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
    Ok(())
}

fn tls_connector(ca: &PathBuf) -> anyhow::Result<tokio_rustls::TlsConnector> {
    let pem = std::fs::read(ca).with_context(|| format!("reading {}", ca.display()))?;
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls_pemfile::certs(&mut pem.as_slice()) {
        roots.add(c?)?;
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

struct ConnResult {
    latencies_us: Vec<u32>,
    unexpected: u64,
    errors: u64,
}

async fn one_connection(
    addr: String,
    path: String,
    connector: tokio_rustls::TlsConnector,
    bodies: Arc<Vec<Bytes>>,
    offset: usize,
    until: Instant,
    want_allowed: bool,
) -> anyhow::Result<ConnResult> {
    let tcp = tokio::net::TcpStream::connect(&addr).await?;
    tcp.set_nodelay(true)?;
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1")?;
    let tls = connector.connect(name, tcp).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
    tokio::spawn(conn);
    let mut out = ConnResult {
        latencies_us: Vec::with_capacity(1 << 16),
        unexpected: 0,
        errors: 0,
    };
    let mut i = offset;
    let needle: &[u8] = if want_allowed {
        b"\"allowed\":true"
    } else {
        b"\"allowed\":false"
    };
    while Instant::now() < until {
        let body = bodies[i % bodies.len()].clone();
        i += 1;
        let req = http::Request::post(path.as_str())
            .header("host", "127.0.0.1")
            .header("content-type", "application/json")
            .body(Full::new(body))?;
        let t0 = Instant::now();
        sender.ready().await?;
        match sender.send_request(req).await {
            Ok(resp) => {
                let ok = resp.status().is_success();
                let bytes = resp.into_body().collect().await?.to_bytes();
                let took = t0.elapsed();
                out.latencies_us
                    .push(u32::try_from(took.as_micros()).unwrap_or(u32::MAX));
                if !ok || !bytes.windows(needle.len()).any(|w| w == needle) {
                    out.unexpected += 1;
                }
            }
            Err(_) => {
                out.errors += 1;
                break;
            }
        }
    }
    Ok(out)
}

fn pct(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    f64::from(sorted[idx.min(sorted.len() - 1)]) / 1000.0
}

async fn load(
    url: String,
    ca: PathBuf,
    scenario: Scenario,
    connections: usize,
    duration: u64,
    nodes: usize,
) -> anyhow::Result<()> {
    let rest = url
        .strip_prefix("https://")
        .context("--url must start with https://")?;
    let (addr, path) = match rest.find('/') {
        Some(i) => (rest[..i].to_string(), rest[i..].to_string()),
        None => (rest.to_string(), "/".to_string()),
    };
    let connector = tls_connector(&ca)?;
    let bodies = Arc::new(bodies(scenario, nodes)?);
    let body_bytes = bodies[0].len();
    let want = expected_allowed(scenario);

    // Warm-up: one second, not measured (connection setup, first cache lookups).
    let warm = Instant::now() + Duration::from_secs(1);
    let _ = one_connection(
        addr.clone(),
        path.clone(),
        connector.clone(),
        bodies.clone(),
        0,
        warm,
        want,
    )
    .await?;

    let started = Instant::now();
    let until = started + Duration::from_secs(duration);
    let tasks: Vec<_> = (0..connections.max(1))
        .map(|c| {
            tokio::spawn(one_connection(
                addr.clone(),
                path.clone(),
                connector.clone(),
                bodies.clone(),
                c * 7919,
                until,
                want,
            ))
        })
        .collect();
    let mut all = Vec::new();
    let (mut unexpected, mut errors) = (0, 0);
    for t in tasks {
        let r = t.await??;
        all.extend(r.latencies_us);
        unexpected += r.unexpected;
        errors += r.errors;
    }
    let elapsed = started.elapsed().as_secs_f64();
    all.sort_unstable();
    let line = json!({
        "scenario": format!("{scenario:?}"),
        "connections": connections,
        "duration_s": elapsed,
        "requests": all.len(),
        "rps": all.len() as f64 / elapsed,
        "p50_ms": pct(&all, 0.50),
        "p90_ms": pct(&all, 0.90),
        "p99_ms": pct(&all, 0.99),
        "max_ms": pct(&all, 1.0),
        "unexpected_answers": unexpected,
        "errors": errors,
        "body_bytes": body_bytes,
    });
    println!("{line}");
    if unexpected > 0 || errors > 0 {
        bail!("{unexpected} unexpected answers, {errors} connection errors");
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Certs { dir } => certs(dir),
        Command::Nodes {
            kubeconfig,
            count,
            unverified,
            parallel,
        } => nodes(kubeconfig, count, unverified, parallel).await,
        Command::Load {
            url,
            ca,
            scenario,
            connections,
            duration,
            nodes,
        } => load(url, ca, scenario, connections, duration, nodes).await,
    }
}
