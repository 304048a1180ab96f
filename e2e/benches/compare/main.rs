//! `make bench`: meshgate's figures beside the mechanisms of the tools operators use today,
//! in one run, against one local real control plane (release build, root).
//!
//! In: the release `meshgate-agent` and `meshgate-webhook` binaries, the Kubernetes binaries,
//! root (network namespaces and netfilter rules). Out: one table on stdout, with ratios to
//! the baselines and the goals of issue 8, and notes on what was measured and what modeled.
//! Asserts nothing about speed: `docs/performance.md` records the figures, misses included.
//!
//! Baselines are small drivers written here that run the *mechanism* of each tool against
//! the same control plane, with a scaled-down interval, plus a model that scales the result
//! back to the real interval:
//! - node-readiness-controller: a reporter polls the verdict (`meshgate-agent check`) every
//!   interval and writes a Node condition; a controller watching the Node removes or adds
//!   its taint. Real interval 30 s; run at `MESHGATE_BENCH_NRC_INTERVAL_MS` (300).
//! - Cilium's unmanaged-pod watcher: a sweep every interval lists the node's pods, inspects
//!   each Running meshed pod (`meshgate-agent inspect`) and evicts the un-redirected. Real
//!   interval 15 s; run at `MESHGATE_BENCH_SWEEP_INTERVAL_MS` (150).
//! - Linkerd's network-validator init container: nothing is known until its 10 s timeout
//!   fires; modeled only (10 s, a lower bound: container start and the crash-loop or repair
//!   controller come on top).
//!
//! The model for the polling baselines: a change lands at a uniformly random phase of the
//! interval, so latency = U(0, interval) + the work measured after the poll that saw it.
//! Quantiles of that sum are computed from the measured work samples.
//!
//! Sections (`MESHGATE_BENCH_ONLY=gating,realnode,detection,sweep,agents,admission,webhook,storm,fleet`
//! to run some): gating (untaint / re-taint on the stand-in node, stage by stage), realnode (the
//! same on a real kubelet + containerd node with Istio's real CNI plugin and meshgate from its
//! chart, beside the stand-in's figures, and its kubelet's steady requests beside the agent's), detection (un-redirected pod Running → eviction),
//! sweep (250 real pod namespaces: inspection cost, full sweep, agent RSS, idle API requests),
//! agents (what each agent costs the apiserver at 10, 100 and 1,000 stand-in Nodes with a
//! real agent process each: steady requests, watches and bytes, per transition, and the
//! reconnect after an apiserver restart; ratios to the smallest N),
//! admission (pod CREATE and pods/binding through the apiserver with no admission, the
//! placement policy and the webhook, at 100/s and 300/s: what each adds; the policy's cost
//! with 1, 100 and 1,000 gated Nodes), webhook (5,000 cached Nodes: RSS, latency at 2,000/s
//! and 5,000/s, saturation throughput), storm (Nodes registering at 1,000/min while pods are
//! created and bound at 100/s: meshgate's webhook against one that admits everything), fleet (on a control plane of its own, 1,000, 10,000
//! and 65,000 GKE-sized Node objects beside 50: the webhook's RSS and time to sync from a cold
//! start and its review latency, the apiserver's RSS with and without the placement policy
//! and the policy's request cost, Nodes twice as large, and a plot of RSS against Nodes).

use anyhow::{Context, bail};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, EvictParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use meshgate_e2e::harness::audit::AuditedIdentity;
use meshgate_e2e::load::review;
use meshgate_e2e::load::review::{Review, WebhookProcess};
use meshgate_e2e::load::stats::quantile;
use meshgate_e2e::sim::netns::{PodNetns, Rules, private_subnet, require_privileges};
use meshgate_e2e::sim::node::{Agent, CniDirs, golden, plain, workspace_bin};
use meshgate_e2e::sim::pod::{MESH_LABEL, meshed_pod, pending_meshed_pod};
use meshgate_e2e::{ControlPlane, NodeSpec, Options, mark_pod_running};
use serde_json::json;
use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::{mpsc, watch};

mod admission;
mod agents;
mod detection;
mod fleet;
mod gating;
mod realnode;
mod stages;
mod storm;
mod sweep;
mod webhook;

const NRC_TAINT: &str = "bench.meshgate.io/nrc-unverified";
const NRC_CONDITION: &str = "BenchNRCReady";

// ---------------------------------------------------------------------------------------
// Figures and the table
// ---------------------------------------------------------------------------------------

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A deterministic uniform delay in `0..max`, so writes land at every phase of a polling
/// driver's interval instead of locking onto its ticks.
fn jitter(state: &mut u64, max: Duration) -> Duration {
    *state = state
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    max.mul_f64((*state >> 11) as f64 / (1u64 << 53) as f64)
}

/// A duration for the table: µs below 1 ms, ms below 10 s, s above.
fn human(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s < 1e-3 {
        format!("{:.0} µs", s * 1e6)
    } else if s < 1.0 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

/// Quantile `p` of U(0, interval) + w, over the measured work samples `work`.
fn modeled(interval: Duration, work: &[Duration], p: f64) -> Duration {
    const STEPS: u32 = 400;
    let mut all: Vec<Duration> = work
        .iter()
        .flat_map(|w| {
            (0..STEPS).map(move |k| interval.mul_f64((f64::from(k) + 0.5) / f64::from(STEPS)) + *w)
        })
        .collect();
    all.sort();
    quantile(&all, p)
}

fn ratio(theirs: Duration, ours: Duration) -> String {
    if ours.is_zero() {
        return "—".into();
    }
    let r = theirs.as_secs_f64() / ours.as_secs_f64();
    if r >= 100.0 {
        format!("{r:.0}×")
    } else {
        format!("{r:.1}×")
    }
}

#[derive(Default)]
struct Table {
    rows: Vec<[String; 7]>,
    /// The stage table: transition, node, total, event, read, probe, PATCH, watch, other.
    stages: Vec<[String; 9]>,
    /// Tables of their own (markdown, with their heading), printed after the stage table.
    blocks: Vec<String>,
    notes: Vec<String>,
}

impl Table {
    #[allow(clippy::too_many_arguments)]
    fn row(
        &mut self,
        figure: &str,
        ours: String,
        mechanism: &str,
        theirs: String,
        ratio: String,
        goal: &str,
        met: Option<bool>,
    ) {
        let met = match met {
            Some(true) => "yes",
            Some(false) => "**no**",
            None => "—",
        };
        self.rows.push([
            figure.into(),
            ours,
            mechanism.into(),
            theirs,
            ratio,
            goal.into(),
            met.into(),
        ]);
    }

    fn note(&mut self, s: String) {
        eprintln!("  {s}");
        self.notes.push(s);
    }

    fn print(&self, header: &str) {
        println!("{header}\n");
        println!("| figure | meshgate | baseline mechanism | baseline | ratio | goal | met |");
        println!("|---|---|---|---|---|---|---|");
        for r in &self.rows {
            println!("| {} |", r.join(" | "));
        }
        println!();
        if !self.stages.is_empty() {
            println!("Stages (each column is that stage's own quantile over the transitions):\n");
            println!(
                "| transition | node | total | event | read | probe | PATCH | watch | other |"
            );
            println!("|---|---|---|---|---|---|---|---|---|");
            for r in &self.stages {
                println!("| {} |", r.join(" | "));
            }
            println!();
        }
        for b in &self.blocks {
            println!("{b}");
        }
        for n in &self.notes {
            println!("- {n}");
        }
    }
}

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

/// Sets the agent's log filter for the next [`Agent::start`].
fn agent_log(filter: &str) {
    // SAFETY: set while no other thread reads the environment: the runtime's workers only
    // run this benchmark's own tasks, which do not read env vars, and the agent process
    // reads its copy at spawn.
    unsafe { std::env::set_var("MESHGATE_AGENT_LOG", filter) };
}

/// A bare meshed pod the bench's deletion watch follows (`bench=yes`), gone at once when
/// evicted.
fn bench_pod(name: &str, node: &str) -> Pod {
    meshed_pod(name, node, &[("bench", "yes")], Some(0))
}

/// Records when each pod of the namespace was first seen with a deletion timestamp.
fn deletion_watch(
    client: &Client,
    ns: &str,
) -> (
    Arc<Mutex<HashMap<String, Instant>>>,
    tokio::task::JoinHandle<()>,
) {
    let seen: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let (api, log) = (Api::<Pod>::namespaced(client.clone(), ns), seen.clone());
    let task = tokio::spawn(async move {
        let cfg = kube::runtime::watcher::Config::default().labels("bench=yes");
        let mut s = std::pin::pin!(kube::runtime::watcher(api, cfg));
        while let Some(ev) = s.next().await {
            let pods = match ev {
                Ok(
                    kube::runtime::watcher::Event::Apply(p)
                    | kube::runtime::watcher::Event::InitApply(p),
                ) => vec![p],
                Ok(kube::runtime::watcher::Event::Delete(p)) => vec![p],
                _ => continue,
            };
            let now = Instant::now();
            for p in pods {
                if p.metadata.deletion_timestamp.is_some() {
                    log.lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .entry(p.name_any())
                        .or_insert(now);
                }
            }
        }
    });
    (seen, task)
}

async fn wait_for<T>(
    what: &str,
    timeout: Duration,
    mut f: impl FnMut() -> Option<T>,
) -> anyhow::Result<T> {
    let end = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Ok(v);
        }
        if Instant::now() > end {
            bail!("{what}: not within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Force-deletes a pod and waits until it is gone, so its IP can be used again.
async fn remove_pod(api: &Api<Pod>, name: &str) -> anyhow::Result<()> {
    let _ = api
        .delete(name, &DeleteParams::default().grace_period(0))
        .await;
    let end = Instant::now() + Duration::from_secs(30);
    while api.get_opt(name).await?.is_some() {
        if Instant::now() > end {
            bail!("pod {name} not gone");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let only: Vec<String> = std::env::var("MESHGATE_BENCH_ONLY")
        .map(|v| v.split(',').map(|s| s.trim().to_string()).collect())
        .unwrap_or_default();
    let run = |s: &str| only.is_empty() || only.iter().any(|o| o == s);
    eprintln!("starting a local control plane ...");
    let cp = ControlPlane::start(Options::default()).await?;
    let client = cp.client()?;
    let ns = cp.create_namespace(&client, "bench").await?;
    let mut table = Table::default();
    let begun = Instant::now();
    let mut standin = None;
    if run("gating") {
        standin = Some(
            gating::run(&cp, &client, &mut table)
                .await
                .context("gating")?,
        );
    }
    if run("realnode") {
        realnode::run(&mut table, standin.as_ref())
            .await
            .context("realnode")?;
    }
    if run("detection") {
        detection::run(&cp, &client, &ns, &mut table)
            .await
            .context("detection")?;
    }
    if run("sweep") {
        sweep::run(&cp, &client, &ns, &mut table)
            .await
            .context("sweep")?;
    }
    if run("agents") {
        agents::run(&cp, &client, &ns, &mut table)
            .await
            .context("agents")?;
    }
    if run("admission") {
        admission::run(&cp, &client, &mut table)
            .await
            .context("admission")?;
    }
    if run("webhook") {
        // Last: 5,000 Nodes without kubelets keep the controller manager busy for minutes
        // (node lifecycle), which would slow every Node registration after them.
        eprintln!("creating 5,000 Nodes for the webhook section ...");
        // The controller manager has no part in admission, but with 5,000 kubelet-less Nodes
        // its node-lifecycle work would share the 2 CPUs with the measurement: frozen.
        cp.freeze_component("kube-controller-manager", true)?;
        let measured = match review::create_nodes(&client, "wh", 4500, 500, 32).await {
            Ok(created) => webhook::run(&cp, &client, &ns, created, &mut table).await,
            Err(e) => Err(e),
        };
        cp.freeze_component("kube-controller-manager", false)?;
        measured.context("webhook")?;
    }
    if run("storm") {
        storm::run(&cp, &client, &mut table)
            .await
            .context("storm")?;
    }
    // On a control plane of its own, so its Node counts are exact and its 65,000 Nodes
    // burden no other section.
    if run("fleet") {
        fleet::run(&mut table).await.context("fleet")?;
    }
    table.print(&format!(
        "meshgate benchmark, Kubernetes {}, {} CPUs, one run of {:.0} s (release build; figures vary run to run on a shared machine)",
        cp.version(),
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        begun.elapsed().as_secs_f64()
    ));
    cp.stop();
    Ok(())
}
