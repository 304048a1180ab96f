//! `webhook/bench/run.sh`'s load generator and fixture tool: the harness's
//! [`meshgate_e2e::load::review`] in a process of its own, so the webhook's figures are not
//! inflated by sharing a runtime with the generator.
//!
//! In: flags (each with an env twin). Out, per subcommand:
//! - `certs --dir D`: a test CA (`ca.crt`) and a 127.0.0.1 serving pair (`tls.crt`,
//!   `tls.key`) for the webhook.
//! - `nodes --kubeconfig K --count N --unverified M`: N verified Nodes named `bench-v-*` and M
//!   unverified ones named `bench-u-*`, labelled as cloud nodes are
//!   ([`review::create_nodes`]), and one pending meshed pod `bench/pending` for the
//!   binding scenarios.
//! - `load --url U --ca C --scenario S --connections N --duration D --nodes K`: a closed loop
//!   (each of N keep-alive HTTPS connections sends its next review as soon as the answer
//!   came back) after one second of warm-up; prints one JSON line with the client-observed
//!   latency percentiles and the throughput, and fails if any answer was wrong or missing.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand, ValueEnum};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use meshgate_e2e::harness::wait::API_TIMEOUT;
use meshgate_e2e::load::review::{self, Outcome, Review};
use meshgate_e2e::sim::pod::pending_meshed_pod;
use meshgate_e2e::sim::webhook::TestCa;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use serde_json::json;

/// The namespace of the pending pod the binding scenarios bind.
const NAMESPACE: &str = "bench";

#[derive(Parser)]
#[command(name = "webhook_load", about = "meshgate-webhook load generator")]
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

/// Distinct reviews for the scenario, spread over `nodes` node names.
fn reviews(scenario: Scenario, nodes: usize) -> Vec<Review> {
    (0..nodes.clamp(1, 4096))
        .map(|i| {
            let uid = format!("{scenario:?}-{i}");
            let (v, u) = (format!("bench-v-{i}"), format!("bench-u-{i}"));
            match scenario {
                Scenario::Allowed => review::pod_review(&uid, &v, true, true),
                Scenario::Plain => review::pod_review(&uid, &u, false, true),
                Scenario::Refused => review::pod_review(&uid, &u, true, false),
                Scenario::BindingAllowed => {
                    review::binding_review(&uid, NAMESPACE, "pending", &v, true)
                }
                Scenario::BindingRefused => {
                    review::binding_review(&uid, NAMESPACE, "pending", &u, false)
                }
            }
        })
        .collect()
}

fn certs(dir: PathBuf) -> anyhow::Result<()> {
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let ca = TestCa::new()?;
    ca.issue(&dir.join("tls.crt"), &dir.join("tls.key"))?;
    std::fs::write(dir.join("ca.crt"), ca.pem())?;
    Ok(())
}

async fn nodes(
    kubeconfig: PathBuf,
    count: usize,
    unverified: usize,
    parallel: usize,
) -> anyhow::Result<()> {
    let kc = Kubeconfig::read_from(&kubeconfig)
        .with_context(|| format!("reading {}", kubeconfig.display()))?;
    let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    let client = kube::Client::try_from(config)?;
    let took = review::create_nodes(&client, "bench", count, unverified, parallel).await?;
    eprintln!(
        "created {} nodes in {:.1} s",
        count + unverified,
        took.as_secs_f64()
    );

    let ns: Api<Namespace> = Api::all(client.clone());
    let namespace = serde_json::from_value(json!({"metadata": {"name": NAMESPACE}}))?;
    match tokio::time::timeout(API_TIMEOUT, ns.create(&PostParams::default(), &namespace)).await {
        Ok(Ok(_)) => {}
        // Already there from an earlier run: fine.
        Ok(Err(kube::Error::Api(s))) if s.code == 409 => {}
        Ok(Err(e)) => {
            return Err(anyhow::Error::new(e).context(format!("creating namespace {NAMESPACE}")));
        }
        Err(_) => bail!("creating namespace {NAMESPACE}: no answer within {API_TIMEOUT:?}"),
    }
    let pods: Api<Pod> = Api::namespaced(client, NAMESPACE);
    let pending = pending_meshed_pod("pending");
    // The namespace's default ServiceAccount appears a moment after the namespace, so the
    // create is retried, every attempt and all of them together bounded.
    const CREATE_WITHIN: Duration = Duration::from_secs(30);
    let deadline = std::time::Instant::now() + CREATE_WITHIN;
    let mut last = String::from("no attempt");
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            bail!(
                "the pending pod {NAMESPACE}/pending could not be created within {CREATE_WITHIN:?}; last error: {last}"
            );
        }
        match tokio::time::timeout(left, pods.create(&PostParams::default(), &pending)).await {
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(kube::Error::Api(s))) if s.code == 409 => return Ok(()),
            Ok(Err(e)) => last = e.to_string(),
            Err(_) => last = format!("no answer within {left:?}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
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
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let ca_der = CertificateDer::from_pem_file(&ca)
        .with_context(|| format!("reading the CA certificate {}", ca.display()))?;
    let reviews = Arc::new(reviews(scenario, nodes));
    let body_bytes = reviews[0].body.len();
    let spec = |connections: usize, secs: u64| -> anyhow::Result<review::Spec> {
        Ok(review::Spec {
            addr: addr
                .parse()
                .with_context(|| format!("--url address {addr}"))?,
            path: path.to_owned(),
            connector: review::tls_connector(&ca_der)?,
            reviews: reviews.clone(),
            rate: f64::INFINITY,
            duration: Duration::from_secs(secs),
            connections,
        })
    };

    // Warm-up: one second on one connection, not measured (connection setup, first cache
    // lookups).
    review::run(spec(1, 1)?).await?;

    let report = review::run(spec(connections.max(1), duration)?).await?;
    let (mut answered, mut unexpected, mut errors) = (0usize, 0usize, 0usize);
    for s in &report.samples {
        match s.outcome {
            Outcome::Right => answered += 1,
            Outcome::Wrong(_) => {
                answered += 1;
                unexpected += 1;
            }
            Outcome::Failed(_) => errors += 1,
        }
    }
    let elapsed = match (report.start, report.samples.iter().map(|s| s.done).max()) {
        (Some(start), Some(end)) => end.saturating_duration_since(start).as_secs_f64(),
        _ => 0.0,
    };
    let ms = |p: f64| report.latency(p).as_secs_f64() * 1e3;
    let line = json!({
        "scenario": format!("{scenario:?}"),
        "connections": connections,
        "duration_s": elapsed,
        "requests": answered,
        "rps": answered as f64 / elapsed.max(1e-9),
        "p50_ms": ms(0.50),
        "p90_ms": ms(0.90),
        "p99_ms": ms(0.99),
        "max_ms": ms(1.0),
        "unexpected_answers": unexpected,
        "errors": errors,
        "body_bytes": body_bytes,
    });
    println!("{line}");
    if unexpected > 0 || errors > 0 {
        let first = report.errors().first().map(|s| format!("{:?}", s.outcome));
        bail!("{unexpected} unexpected answers, {errors} connection errors; first: {first:?}");
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
