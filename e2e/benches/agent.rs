//! Agent latency benchmark against a real local control plane: how long from the moment a
//! config change lands on disk until the Node's taint is removed (S1) or re-added (S4), as
//! seen by a watch on the Node, over many transitions; plus the agent's own untaint
//! histogram and its RSS. Prints a table; asserts nothing about speed.
//!
//! `make bench` runs it (release build). `MESHGATE_BENCH_TRANSITIONS` sets the number of
//! round trips (default 100).

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use meshgate_e2e::node_sim::{Agent, CniDirs, golden, tainted};
use meshgate_e2e::{ControlPlane, NodeSpec, Options};
use tokio::sync::mpsc;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1e3)
}

/// Waits for the watch to report the wanted taint state; returns when it was seen.
async fn until(rx: &mut mpsc::UnboundedReceiver<(Instant, bool)>, want: bool) -> anyhow::Result<Instant> {
    loop {
        match tokio::time::timeout(Duration::from_secs(30), rx.recv()).await {
            Ok(Some((at, t))) if t == want => return Ok(at),
            Ok(Some(_)) => continue,
            Ok(None) => bail!("node watch ended"),
            Err(_) => bail!("no taint={want} within 30 s"),
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let n: usize = std::env::var("MESHGATE_BENCH_TRANSITIONS").ok().and_then(|v| v.parse().ok()).unwrap_or(100);
    eprintln!("starting a local control plane ...");
    let cp = ControlPlane::start(Options::default()).await?;
    let client = cp.client()?;
    let node = "bench-node";
    cp.register_node(&client, &NodeSpec::new(node)).await?;
    let dirs = CniDirs::new()?;
    let invalid = golden("calico.conflist")?;
    let valid = golden("calico-linkerd.conflist")?;
    dirs.config("10-calico.conflist", &invalid)?;
    // SAFETY of the env var: set before the agent process is spawned; read only by it.
    let agent = {
        // Quiet logs: the benchmark measures the agent, not its log volume.
        unsafe { std::env::set_var("MESHGATE_AGENT_LOG", "warn") };
        Agent::start(&cp, node, &dirs, &[])?
    };

    let (tx, mut rx) = mpsc::unbounded_channel();
    let api: Api<Node> = Api::all(client.clone());
    let watch = tokio::spawn(async move {
        let mut s = std::pin::pin!(kube::runtime::watcher::watch_object(api, node));
        while let Some(Ok(Some(n))) = s.next().await {
            if tx.send((Instant::now(), tainted(&n))).is_err() {
                break;
            }
        }
    });
    until(&mut rx, true).await.context("initial gating")?;

    let (mut untaint, mut retaint) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for _ in 0..n {
        let t0 = Instant::now();
        dirs.config("10-calico.conflist", &valid)?;
        untaint.push(until(&mut rx, false).await? - t0);
        let t0 = Instant::now();
        dirs.config("10-calico.conflist", &invalid)?;
        retaint.push(until(&mut rx, true).await? - t0);
    }
    untaint.sort();
    retaint.sort();
    let count = agent.metric("meshgate_untaint_latency_seconds_count").await.unwrap_or(0.0);
    let sum = agent.metric("meshgate_untaint_latency_seconds_sum").await.unwrap_or(0.0);
    let rss = agent.rss_kib().unwrap_or(0);
    watch.abort();

    println!("meshgate agent benchmark: {n} transitions each way, Kubernetes {}", cp.version());
    println!("| figure | p50 ms | p90 ms | p99 ms | max ms |");
    println!("|---|---|---|---|---|");
    for (name, v) in [("untaint: config valid on disk → taint gone (watch)", &untaint), ("re-taint: drift on disk → taint back (watch)", &retaint)] {
        println!("| {name} | {} | {} | {} | {} |", ms(percentile(v, 0.5)), ms(percentile(v, 0.9)), ms(percentile(v, 0.99)), ms(percentile(v, 1.0)));
    }
    if count > 0.0 {
        println!("agent's own meshgate_untaint_latency_seconds: mean {:.1} ms over {count} removals", sum / count * 1e3);
    }
    println!("agent RSS after the run: {:.1} MiB", rss as f64 / 1024.0);
    drop(agent);
    cp.stop();
    Ok(())
}
