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
//! Sections (`MESHGATE_BENCH_ONLY=gating,detection,sweep,webhook` to run some):
//! gating (untaint / re-taint), detection (un-redirected pod Running → eviction), sweep
//! (250 real pod namespaces: inspection cost, full sweep, agent RSS, idle API requests),
//! webhook (5,000 cached Nodes: RSS, latency at 2,000/s and 5,000/s, saturation throughput).

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, bail};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, EvictParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use meshgate_e2e::harness::audit::AuditedIdentity;
use meshgate_e2e::load::review::{self, Review, WebhookProcess};
use meshgate_e2e::load::stats::quantile;
use meshgate_e2e::sim::netns::{PodNetns, Rules, private_subnet, require_privileges};
use meshgate_e2e::sim::node::{Agent, CniDirs, golden, plain, workspace_bin};
use meshgate_e2e::sim::pod::{MESH_LABEL, meshed_pod, pending_meshed_pod};
use meshgate_e2e::{ControlPlane, NodeSpec, Options, mark_pod_running};
use serde_json::json;
use tokio::sync::{mpsc, watch};

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
// Gating: untaint and re-taint, against the node-readiness-controller mechanism
// ---------------------------------------------------------------------------------------

/// Waits for the watch to report the wanted taint state; returns when it was seen.
async fn until(
    rx: &mut mpsc::UnboundedReceiver<(Instant, bool)>,
    want: bool,
) -> anyhow::Result<Instant> {
    loop {
        match tokio::time::timeout(Duration::from_secs(60), rx.recv()).await {
            Ok(Some((at, t))) if t == want => return Ok(at),
            Ok(Some(_)) => continue,
            Ok(None) => bail!("node watch ended"),
            Err(_) => bail!("no taint={want} within 60 s"),
        }
    }
}

fn watch_taint(
    client: &Client,
    node: &str,
    key: &'static str,
) -> (
    mpsc::UnboundedReceiver<(Instant, bool)>,
    tokio::task::JoinHandle<()>,
) {
    let (tx, rx) = mpsc::unbounded_channel();
    let (api, name) = (Api::<Node>::all(client.clone()), node.to_string());
    let task = tokio::spawn(async move {
        let mut s = std::pin::pin!(kube::runtime::watcher::watch_object(api, &name));
        while let Some(Ok(Some(n))) = s.next().await {
            let has = n
                .spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .is_some_and(|t| t.iter().any(|t| t.key == key));
            if tx.send((Instant::now(), has)).is_err() {
                break;
            }
        }
    });
    (rx, task)
}

/// The node-readiness-controller model's reporter: polls `meshgate-agent check` every
/// `interval` and writes the Node condition when the answer changes; publishes (poll start,
/// verified) for every poll.
async fn nrc_reporter(
    client: Client,
    node: String,
    dirs: (PathBuf, PathBuf),
    interval: Duration,
    tx: watch::Sender<(Instant, bool)>,
) {
    let Ok(agent) = workspace_bin("meshgate-agent") else {
        return;
    };
    let nodes: Api<Node> = Api::all(client);
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last: Option<bool> = None;
    loop {
        tick.tick().await;
        let polled = Instant::now();
        let status = tokio::process::Command::new(&agent)
            .args([
                "check",
                "--require-plugin",
                "linkerd-cni",
                "--output",
                "json",
            ])
            .arg("--cni-conf-dir")
            .arg(&dirs.0)
            .arg("--cni-bin-dir")
            .arg(&dirs.1)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .await;
        let Ok(status) = status else { continue };
        let ok = status.code() == Some(0);
        if last != Some(ok) {
            let now = k8s_openapi::jiff::Timestamp::now().to_string();
            let patch = json!({"status": {"conditions": [{
                "type": NRC_CONDITION, "status": if ok { "True" } else { "False" },
                "reason": if ok { "Ready" } else { "NotReady" }, "message": "bench reporter",
                "lastHeartbeatTime": now, "lastTransitionTime": now
            }]}});
            if nodes
                .patch_status(&node, &PatchParams::default(), &Patch::Strategic(patch))
                .await
                .is_ok()
            {
                last = Some(ok);
            }
        }
        let _ = tx.send((polled, ok));
    }
}

/// The model's controller: watches the Node and removes its taint when the condition is
/// True, adds it when False (node-readiness-controller's continuous enforcement).
async fn nrc_controller(client: Client, node: String) {
    let nodes: Api<Node> = Api::all(client);
    let mut s = std::pin::pin!(kube::runtime::watcher::watch_object(nodes.clone(), &node));
    while let Some(item) = s.next().await {
        let Ok(Some(n)) = item else { continue };
        let ready = n
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|c| c.iter().find(|c| c.type_ == NRC_CONDITION))
            .map(|c| c.status == "True");
        let Some(ready) = ready else { continue };
        let taints = n
            .spec
            .as_ref()
            .and_then(|s| s.taints.clone())
            .unwrap_or_default();
        let has = taints.iter().any(|t| t.key == NRC_TAINT);
        if ready != has {
            continue;
        }
        let mut next: Vec<serde_json::Value> = taints
            .iter()
            .filter(|t| t.key != NRC_TAINT)
            .map(|t| serde_json::to_value(t).unwrap_or_default())
            .collect();
        if !ready {
            next.push(json!({"key": NRC_TAINT, "effect": "NoSchedule"}));
        }
        let patch = json!({"metadata": {"resourceVersion": n.resource_version()}, "spec": {"taints": next}});
        let _ = nodes
            .patch(&node, &PatchParams::default(), &Patch::Merge(patch))
            .await;
    }
}

async fn gating(cp: &ControlPlane, client: &Client, table: &mut Table) -> anyhow::Result<()> {
    let n = env_num("MESHGATE_BENCH_TRANSITIONS", 100) as usize;
    eprintln!(
        "gating: {n} transitions each way, meshgate agent and the node-readiness-controller model ..."
    );
    let (invalid, valid) = (
        golden("calico.conflist")?,
        golden("calico-linkerd.conflist")?,
    );

    // meshgate.
    let node = "gate-agent";
    cp.register_node(client, &NodeSpec::new(node)).await?;
    let dirs = CniDirs::new()?;
    dirs.config("10-calico.conflist", &invalid)?;
    agent_log("warn");
    let agent = Agent::start(cp, node, &dirs, &[])?;
    let (mut rx, w) = watch_taint(client, node, meshgate_core::TAINT_KEY);
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
    w.abort();
    let rss = agent.rss_kib().unwrap_or(0);
    drop(agent);
    untaint.sort();
    retaint.sort();

    // The node-readiness-controller model, same transitions.
    let interval = Duration::from_millis(env_num("MESHGATE_BENCH_NRC_INTERVAL_MS", 300));
    let real = Duration::from_secs(30);
    let node_b = "gate-nrc";
    cp.register_node(
        client,
        &NodeSpec::new(node_b).taint(NRC_TAINT, "NoSchedule"),
    )
    .await?;
    let dirs_b = CniDirs::new()?;
    dirs_b.config("10-calico.conflist", &invalid)?;
    let (ptx, prx) = watch::channel((Instant::now(), false));
    let reporter = tokio::spawn(nrc_reporter(
        client.clone(),
        node_b.into(),
        (dirs_b.conf.clone(), dirs_b.bin.clone()),
        interval,
        ptx,
    ));
    let controller = tokio::spawn(nrc_controller(client.clone(), node_b.into()));
    let (mut rx, w) = watch_taint(client, node_b, NRC_TAINT);
    until(&mut rx, true)
        .await
        .context("NRC model: initial taint")?;
    let (mut phase, mut work_un, mut work_re, mut total_un, mut total_re) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut seed = 0x6d65_7368u64;
    for i in 0..2 * n {
        let want_valid = i % 2 == 0;
        // A random phase of the poll interval for every write.
        tokio::time::sleep(jitter(&mut seed, interval)).await;
        let t0 = Instant::now();
        dirs_b.config(
            "10-calico.conflist",
            if want_valid { &valid } else { &invalid },
        )?;
        let seen = until(&mut rx, !want_valid).await?;
        // The first poll that started after the write and saw the new verdict.
        let (polled, ok) = *prx.borrow();
        if ok != want_valid {
            bail!("NRC model: the reporter's last poll disagrees with the disk");
        }
        let polled = polled.max(t0);
        phase.push(polled - t0);
        let (work, total) = if want_valid {
            (&mut work_un, &mut total_un)
        } else {
            (&mut work_re, &mut total_re)
        };
        work.push(seen.saturating_duration_since(polled));
        total.push(seen - t0);
    }
    w.abort();
    reporter.abort();
    controller.abort();
    for v in [
        &mut phase,
        &mut work_un,
        &mut work_re,
        &mut total_un,
        &mut total_re,
    ] {
        v.sort();
    }

    for (name, ours, work) in [
        ("untaint: config valid → taint removed", &untaint, &work_un),
        ("re-taint on drift (S4)", &retaint, &work_re),
    ] {
        for (q, label) in [(0.5, "p50"), (0.99, "p99")] {
            let theirs = modeled(real, work, q);
            let o = quantile(ours, q);
            table.row(
                &format!("{name}, {label}"),
                human(o),
                "NRC: 30 s condition poll + controller",
                format!("{} (modeled)", human(theirs)),
                ratio(theirs, o),
                if label == "p99" { "p99 ≤ 100 ms" } else { "" },
                (label == "p99").then_some(o <= Duration::from_millis(100)),
            );
        }
    }
    table.note(format!(
        "Gating: {n} transitions each way, from the write on disk to a Node watch seeing the taint change. meshgate max untaint {}, max re-taint {}; agent RSS after {:.1} MiB.",
        human(quantile(&untaint, 1.0)),
        human(quantile(&retaint, 1.0)),
        rss as f64 / 1024.0
    ));
    table.note(format!(
        "NRC model run for real at a {} poll interval ({} transitions): measured phase p50 {} (expected {} = interval/2), work after the poll (check + condition patch + controller's taint patch + watch) p50 {} p99 {}; measured end-to-end at that interval p50 {} / p99 {} (untaint), {} / {} (re-taint). Modeled at the real 30 s interval: U(0, 30 s) + measured work.",
        human(interval),
        2 * n,
        human(quantile(&phase, 0.5)),
        human(interval / 2),
        human(quantile(&work_un, 0.5)),
        human(quantile(&work_un, 0.99)),
        human(quantile(&total_un, 0.5)),
        human(quantile(&total_un, 0.99)),
        human(quantile(&total_re, 0.5)),
        human(quantile(&total_re, 0.99)),
    ));
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Detection: un-redirected pod Running → eviction
// ---------------------------------------------------------------------------------------

/// The Cilium-style sweep: every `interval`, list the node's pods and evict each Running
/// meshed pod whose namespace `meshgate-agent inspect` finds without redirects. Publishes
/// when each pod was first found missing (the sweep's start).
async fn sweep_driver(
    client: Client,
    node: String,
    netns: HashMap<IpAddr, String>,
    interval: Duration,
    found: Arc<Mutex<HashMap<String, Instant>>>,
) {
    let Ok(agent) = workspace_bin("meshgate-agent") else {
        return;
    };
    let pods: Api<Pod> = Api::all(client.clone());
    let lp = ListParams::default().fields(&format!("spec.nodeName={node}"));
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let swept = Instant::now();
        let Ok(list) = pods.list(&lp).await else {
            continue;
        };
        for p in list.items {
            let running = p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
            if !running
                || p.metadata.deletion_timestamp.is_some()
                || !p.labels().contains_key(MESH_LABEL)
            {
                continue;
            }
            let ip: Option<IpAddr> = p
                .status
                .as_ref()
                .and_then(|s| s.pod_ip.as_deref())
                .and_then(|i| i.parse().ok());
            let Some(ns_name) = ip.and_then(|ip| netns.get(&ip)) else {
                continue;
            };
            let out = tokio::process::Command::new(&agent)
                .args([
                    "inspect",
                    "--profile",
                    "linkerd",
                    "--output",
                    "json",
                    "--netns",
                ])
                .arg(format!("/run/netns/{ns_name}"))
                .output()
                .await;
            if !out.is_ok_and(|o| o.status.code() == Some(1)) {
                continue;
            }
            found
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .entry(p.name_any())
                .or_insert(swept);
            let api: Api<Pod> = Api::namespaced(client.clone(), &p.namespace().unwrap_or_default());
            let _ = api.evict(&p.name_any(), &EvictParams::default()).await;
        }
    }
}

/// Creates pods one at a time on `node`, marks each Running with an IP of a namespace
/// without rules, and returns per pod (name, due, evicted-seen) times.
#[allow(clippy::too_many_arguments)]
async fn run_detection(
    client: &Client,
    ns: &str,
    node: &str,
    prefix: &str,
    ips: &[Ipv4Addr],
    n: usize,
    phase_spread: Duration,
    deleted: &Arc<Mutex<HashMap<String, Instant>>>,
) -> anyhow::Result<Vec<(String, SystemTime, Instant, Instant)>> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let mut out = Vec::with_capacity(n);
    let mut seed = 0x6465_7465u64;
    for i in 0..n {
        let name = format!("{prefix}-{i}");
        api.create(&PostParams::default(), &bench_pod(&name, node))
            .await?;
        // The pod is seen by the agent's watch before it runs; and it starts at a random
        // phase of a polling driver's interval (up to `phase_spread`).
        tokio::time::sleep(Duration::from_millis(30) + jitter(&mut seed, phase_spread)).await;
        let (sys, t0) = (SystemTime::now(), Instant::now());
        mark_pod_running(client, ns, &name, IpAddr::V4(ips[i % ips.len()])).await?;
        let seen = wait_for(
            &format!("eviction of {name}"),
            Duration::from_secs(120),
            || {
                deleted
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(&name)
                    .copied()
            },
        )
        .await?;
        out.push((name.clone(), sys, t0, seen));
        remove_pod(&api, &name).await?;
    }
    Ok(out)
}

async fn detection(
    cp: &ControlPlane,
    client: &Client,
    ns: &str,
    table: &mut Table,
) -> anyhow::Result<()> {
    let n = env_num("MESHGATE_BENCH_DETECTIONS", 100) as usize;
    eprintln!("detection: {n} un-redirected pods for the agent, {n} for the sweep model ...");
    require_privileges()?;
    let subnet = private_subnet();
    let mk = |hosts: std::ops::Range<u8>| -> anyhow::Result<Vec<PodNetns>> {
        hosts
            .map(|h| {
                PodNetns::new(
                    Ipv4Addr::new(subnet[0], subnet[1], subnet[2], h),
                    Rules::None,
                )
            })
            .collect()
    };
    let (ours_ns, sweep_ns) = (mk(1..5)?, mk(11..15)?);
    let (deleted, watcher) = deletion_watch(client, ns);

    // meshgate, under its own identity so its eviction requests are timed by the apiserver.
    let id = AuditedIdentity::new(cp, client, ns, "detect-agent").await?;
    let node = "detect-agent";
    cp.register_node(client, &NodeSpec::new(node)).await?;
    let dirs = CniDirs::new()?;
    dirs.config("10-calico.conflist", &golden("calico-linkerd.conflist")?)?;
    agent_log("warn");
    let agent = Agent::start_with_kubeconfig(
        &id.kubeconfig,
        node,
        &dirs,
        &[
            "--profile",
            "linkerd",
            "--evict-unowned",
            "--max-evictions-per-minute",
            "1000000",
        ],
    )?;
    agent.wait_ready(Duration::from_secs(60)).await?;
    let ips: Vec<Ipv4Addr> = ours_ns.iter().map(|n| n.ip).collect();
    let ours = run_detection(client, ns, node, "d", &ips, n, Duration::ZERO, &deleted).await?;
    let requests = id.requests(cp, SystemTime::now() - Duration::from_secs(3600))?;
    drop(agent);
    let mut seen: Vec<Duration> = ours.iter().map(|(_, _, t0, t1)| *t1 - *t0).collect();
    seen.sort();
    let mut requested: Vec<Duration> = ours
        .iter()
        .filter_map(|(name, sys, _, _)| {
            let r = requests
                .iter()
                .find(|r| r.subresource == "eviction" && &r.name == name)?;
            r.received.duration_since(*sys).ok()
        })
        .collect();
    requested.sort();

    // The sweep model on its own node, same pods.
    let interval = Duration::from_millis(env_num("MESHGATE_BENCH_SWEEP_INTERVAL_MS", 150));
    let node_c = "detect-sweep";
    cp.register_node(client, &NodeSpec::new(node_c)).await?;
    let map: HashMap<IpAddr, String> = sweep_ns
        .iter()
        .map(|n| (IpAddr::V4(n.ip), n.name.clone()))
        .collect();
    let found: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let driver = tokio::spawn(sweep_driver(
        client.clone(),
        node_c.into(),
        map,
        interval,
        found.clone(),
    ));
    let ips: Vec<Ipv4Addr> = sweep_ns.iter().map(|n| n.ip).collect();
    let theirs = run_detection(client, ns, node_c, "s", &ips, n, interval, &deleted).await?;
    driver.abort();
    watcher.abort();
    let (mut phase, mut work, mut total) = (Vec::new(), Vec::new(), Vec::new());
    {
        let found = found.lock().unwrap_or_else(|e| e.into_inner());
        for (name, _, t0, t1) in &theirs {
            let swept = found.get(name).copied().unwrap_or(*t0).max(*t0);
            phase.push(swept - *t0);
            work.push(t1.saturating_duration_since(swept));
            total.push(*t1 - *t0);
        }
    }
    for v in [&mut phase, &mut work, &mut total] {
        v.sort();
    }
    let real_sweep = Duration::from_secs(15);
    let validator = Duration::from_secs(10);
    for (q, label) in [(0.5, "p50"), (0.99, "p99")] {
        let o = quantile(&seen, q);
        let sweep = modeled(real_sweep, &work, q);
        table.row(
            &format!("detection: un-redirected pod Running → evicted, {label}"),
            human(o),
            "Cilium-style 15 s sweep tick",
            format!("{} (modeled)", human(sweep)),
            ratio(sweep, o),
            if label == "p99" { "p99 ≤ 1 s" } else { "" },
            (label == "p99").then_some(o <= Duration::from_secs(1)),
        );
        table.row(
            &format!("detection, {label}"),
            human(o),
            "Linkerd validator init container, 10 s timeout",
            format!("≥ {} (modeled)", human(validator)),
            format!("≥ {}", ratio(validator, o)),
            "",
            None,
        );
    }
    table.note(format!(
        "Detection: {n} bare meshed pods, one at a time, each marked Running (status patch) with the IP of a real network namespace without redirect rules; timed from just before the status patch to a pod watch seeing the eviction's deletion timestamp. By the apiserver's clock (audit log), the eviction request arrived p50 {} / p99 {} after the status patch was sent ({} requests matched).",
        human(quantile(&requested, 0.5)),
        human(quantile(&requested, 0.99)),
        requested.len()
    ));
    table.note(format!(
        "Sweep model run for real at a {} interval: list the node's pods, `meshgate-agent inspect` each Running meshed pod, evict: phase p50 {} (expected {}), work after the sweep started p50 {} p99 {}, end to end at that interval p50 {} p99 {}. Modeled at 15 s: U(0, 15 s) + work. Cilium's watcher also skips pods younger than 30 s (unmanagedPodMinimalAge), which would add 30 s; not counted.",
        human(interval),
        human(quantile(&phase, 0.5)),
        human(interval / 2),
        human(quantile(&work, 0.5)),
        human(quantile(&work, 0.99)),
        human(quantile(&total, 0.5)),
        human(quantile(&total, 0.99)),
    ));
    table.note("Linkerd's validator is modeled as its 10 s timeout alone (a lower bound; container start, crash-loop backoff or the repair controller's deletion come on top). It is fail-closed: the app container never starts without redirects, whereas a pod meshgate evicts ran unredirected for the detection time plus its termination grace period.".to_string());
    id.remove(client).await;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Sweep: 250 real pod namespaces; RSS; idle API requests
// ---------------------------------------------------------------------------------------

/// Values of `key=` in the agent's log lines containing `marker` (colour codes removed).
fn log_values(log: &str, marker: &str, key: &str) -> Vec<u64> {
    log.lines()
        .filter(|l| l.contains(marker))
        .filter_map(|l| {
            plain(l)
                .split(&format!("{key}="))
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

/// The agent's inspection counters: (redirected, missing, unknown).
async fn inspected(agent: &Agent) -> (f64, f64, f64) {
    let get = |v: &'static str| async move {
        agent
            .metric(&format!(
                "meshgate_pod_inspections_total{{profile=\"linkerd\",verdict=\"{v}\"}}"
            ))
            .await
            .unwrap_or(0.0)
    };
    (
        get("redirected").await,
        get("missing").await,
        get("unknown").await,
    )
}

async fn sweep(
    cp: &ControlPlane,
    client: &Client,
    ns: &str,
    table: &mut Table,
) -> anyhow::Result<()> {
    let count = env_num("MESHGATE_BENCH_PODS", 250) as usize;
    // Longer than the watches' server-side timeout (290 s), so their renewals are counted.
    let idle = Duration::from_secs(env_num("MESHGATE_BENCH_IDLE_SECS", 320));
    eprintln!("sweep: {count} pods in real network namespaces, then {idle:?} idle ...");
    require_privileges()?;
    // Namespaces, built on a few threads: 4 in 5 with linkerd's rules (legacy and nft), the
    // rest without.
    let subnets: Vec<[u8; 3]> = (0..count.div_ceil(250)).map(|_| private_subnet()).collect();
    let plan: Vec<(Ipv4Addr, Rules)> = (0..count)
        .map(|i| {
            let s = subnets[i / 250];
            let ip = Ipv4Addr::new(s[0], s[1], s[2], (i % 250 + 1) as u8);
            let rules = match i % 5 {
                0 => Rules::None,
                1 | 2 => Rules::Linkerd("iptables-legacy"),
                _ => Rules::Linkerd("iptables-nft"),
            };
            (ip, rules)
        })
        .collect();
    let built = Instant::now();
    let netns: Vec<PodNetns> = std::thread::scope(|s| {
        let chunks: Vec<_> = plan
            .chunks(plan.len().div_ceil(4).max(1))
            .map(|c| {
                s.spawn(move || {
                    c.iter()
                        .map(|(ip, r)| PodNetns::new(*ip, *r))
                        .collect::<anyhow::Result<Vec<_>>>()
                })
            })
            .collect();
        chunks
            .into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| anyhow::anyhow!("netns thread panicked"))?
            })
            .collect::<anyhow::Result<Vec<Vec<_>>>>()
    })?
    .into_iter()
    .flatten()
    .collect();
    eprintln!(
        "  {} namespaces in {:.1} s",
        netns.len(),
        built.elapsed().as_secs_f64()
    );
    let missing = plan.iter().filter(|(_, r)| *r == Rules::None).count();

    let id = AuditedIdentity::new(cp, client, ns, "sweep-agent").await?;
    let node = "sweep-agent";
    cp.register_node(client, &NodeSpec::new(node).pods(count as u32 + 10))
        .await?;
    let dirs = CniDirs::new()?;
    let (valid, invalid) = (
        golden("calico-linkerd.conflist")?,
        golden("calico.conflist")?,
    );
    dirs.config("10-calico.conflist", &valid)?;
    agent_log("warn,meshgate_agent::daemon::pods=debug");
    let agent = Agent::start_with_kubeconfig(
        &id.kubeconfig,
        node,
        &dirs,
        &["--profile", "linkerd", "--no-evict"],
    )?;
    agent.wait_ready(Duration::from_secs(60)).await?;
    let rss_idle = agent.rss_kib().unwrap_or(0);
    let ips: HashMap<String, IpAddr> = (0..count)
        .map(|i| (format!("p-{i}"), IpAddr::V4(plan[i].0)))
        .collect();
    let _kubelet = cp.run_pods(node, move |p: &Pod| ips.get(&p.name_any()).copied());
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let started = Instant::now();
    let creates: Vec<anyhow::Result<()>> = futures::stream::iter(0..count)
        .map(|i| {
            let api = api.clone();
            async move {
                api.create(&PostParams::default(), &bench_pod(&format!("p-{i}"), node))
                    .await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    creates.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
    let end = Instant::now() + Duration::from_secs(300);
    loop {
        let (r, m, u) = inspected(&agent).await;
        if (r + m) as usize >= count {
            break;
        }
        if Instant::now() > end {
            bail!(
                "only {r} redirected + {m} missing + {u} unknown of {count} inspected\n{}",
                agent.log()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let first_pass = started.elapsed();
    let rss_loaded = agent.rss_kib().unwrap_or(0);

    // Full sweeps: every verdict change re-inspects every pod in one batch.
    let flips = env_num("MESHGATE_BENCH_SWEEPS", 6) as usize;
    let mut sweeps: Vec<Duration> = Vec::new();
    let mut surveys: Vec<Duration> = Vec::new();
    for f in 0..flips {
        let before_log = agent.log().len();
        let sum0 = agent
            .metric("meshgate_pod_inspection_seconds_sum")
            .await
            .unwrap_or(0.0);
        let (r0, m0, _) = inspected(&agent).await;
        dirs.config(
            "10-calico.conflist",
            if f % 2 == 0 { &invalid } else { &valid },
        )?;
        let end = Instant::now() + Duration::from_secs(60);
        loop {
            let (r, m, _) = inspected(&agent).await;
            if (r + m - r0 - m0) as usize >= count {
                break;
            }
            if Instant::now() > end {
                bail!("sweep {f}: not every pod was inspected again");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let sum1 = agent
            .metric("meshgate_pod_inspection_seconds_sum")
            .await
            .unwrap_or(0.0);
        let new_log = agent.log();
        let tail = new_log.get(before_log..).unwrap_or_default();
        let survey: u64 = log_values(tail, "inspection batch", "survey_us")
            .iter()
            .sum();
        let batches = log_values(tail, "inspection batch", "pods");
        surveys.push(Duration::from_micros(survey));
        sweeps.push(Duration::from_micros(survey) + Duration::from_secs_f64(sum1 - sum0));
        eprintln!(
            "  sweep {f}: batches {batches:?}, survey {survey} µs, inspections {:.1} ms",
            (sum1 - sum0) * 1e3
        );
    }
    sweeps.sort();
    surveys.sort();
    let rss_swept = agent.rss_kib().unwrap_or(0);
    // Every redirected pod's inspection, first pass and sweeps.
    let mut per_pod: Vec<Duration> =
        log_values(&agent.log(), "mesh redirects in place", "inspect_us")
            .into_iter()
            .map(Duration::from_micros)
            .collect();
    per_pod.sort();
    let (count_h, sum_h) = (
        agent
            .metric("meshgate_pod_inspection_seconds_count")
            .await
            .unwrap_or(0.0),
        agent
            .metric("meshgate_pod_inspection_seconds_sum")
            .await
            .unwrap_or(0.0),
    );

    // Idle: nothing changes; count the agent's requests by the apiserver's audit log.
    dirs.config("10-calico.conflist", &valid)?;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let from = SystemTime::now();
    tokio::time::sleep(idle).await;
    let to = SystemTime::now();
    let requests: Vec<_> = id
        .requests(cp, from)?
        .into_iter()
        .filter(|r| r.received < to)
        .collect();
    let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
    for r in &requests {
        let what = if r.uri.contains("watch=true") {
            format!("{} (watch)", r.kind())
        } else {
            r.kind()
        };
        *kinds.entry(what).or_default() += 1;
    }
    let lists = requests.iter().filter(|r| r.verb == "list").count();
    let per_min = requests.len() as f64 * 60.0 / idle.as_secs_f64();
    let rss_end = agent.rss_kib().unwrap_or(0);
    drop(agent);

    let p50 = quantile(&per_pod, 0.5);
    let p99 = quantile(&per_pod, 0.99);
    table.row(
        "inspection cost per pod, p50",
        human(p50),
        "—",
        "—".into(),
        "—".into(),
        "≤ 200 µs per pod",
        Some(p50 <= Duration::from_micros(200)),
    );
    table.row(
        "inspection cost per pod, p99",
        human(p99),
        "—",
        "—".into(),
        "—".into(),
        "≤ 200 µs per pod",
        Some(p99 <= Duration::from_micros(200)),
    );
    let sweep_p50 = quantile(&sweeps, 0.5);
    table.row(
        &format!("full sweep of {count} pods (in the daemon), p50 of {flips}"),
        human(sweep_p50),
        "—",
        "—".into(),
        "—".into(),
        "≤ 60 ms",
        Some(sweep_p50 <= Duration::from_millis(60)),
    );
    let rss_mib = rss_swept.max(rss_loaded) as f64 / 1024.0;
    table.row(
        &format!("agent RSS with {count} pods"),
        format!("{rss_mib:.1} MiB"),
        "—",
        "—".into(),
        "—".into(),
        "≤ 16 MiB",
        Some(rss_mib <= 16.0),
    );
    table.row(
        &format!("API requests per minute, idle agent with {count} pods"),
        format!("{per_min:.2}/min, {lists} LIST"),
        "—",
        "—".into(),
        "—".into(),
        "no periodic LIST",
        Some(lists == 0),
    );
    table.note(format!(
        "Inspection: {count} bare meshed pods, each in its own real network namespace ({} with linkerd's rules written by iptables-legacy or iptables-nft, {missing} without), bound to one node and marked Running by the kubelet stand-in; the release agent inspected all within {:.1} s of the first create. Per-pod figures are the agent's own `inspect_us` for every inspection of a redirected pod, first pass and sweeps ({} samples; locate + read rules + match, the namespace survey excluded); p90 {}; histogram mean over all {count_h} inspections {}.",
        count - missing,
        first_pass.as_secs_f64(),
        per_pod.len(),
        human(quantile(&per_pod, 0.9)),
        human(Duration::from_secs_f64(sum_h / count_h.max(1.0))),
    ));
    table.note(format!(
        "Full sweep: the config flipped {flips} times; each verdict change re-inspects every pod in one batch. Sweep = the batch's namespace survey + the sum of its per-pod inspections: p50 {} max {}; survey alone p50 {} max {}. `cargo bench -p meshgate-agent --bench inspect_sweep` measures the same work outside the daemon.",
        human(sweep_p50),
        human(quantile(&sweeps, 1.0)),
        human(quantile(&surveys, 0.5)),
        human(quantile(&surveys, 1.0)),
    ));
    table.note(format!(
        "Agent RSS: {:.1} MiB ready with no pods, {:.1} MiB after the first pass over {count} pods, {:.1} MiB after the sweeps, {:.1} MiB after the idle window.",
        rss_idle as f64 / 1024.0,
        rss_loaded as f64 / 1024.0,
        rss_swept as f64 / 1024.0,
        rss_end as f64 / 1024.0
    ));
    table.note(format!(
        "Idle API requests: the agent ran under its own ServiceAccount; the apiserver's audit log counted {} requests in a {:.0} s window with nothing changing ({per_min:.2}/min): {kinds:?}. A window longer than the watches' 290 s server-side timeout includes their renewals.",
        requests.len(),
        idle.as_secs_f64(),
    ));
    id.remove(client).await;
    drop(netns);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Webhook: 5,000 cached Nodes, latency and throughput on loopback
// ---------------------------------------------------------------------------------------

/// `meshgate_admission_duration_seconds` buckets as (upper bound, cumulative count).
fn histogram(metrics: &str) -> Vec<(f64, f64)> {
    metrics
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("meshgate_admission_duration_seconds_bucket{le=\"")?;
            let (le, count) = rest.split_once("\"} ")?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, count.trim().parse().ok()?))
        })
        .collect()
}

/// The upper bound of the bucket holding quantile `p` of the observations between two
/// scrapes: the webhook's own handling time, without TLS, the network or the client.
fn server_quantile(before: &[(f64, f64)], after: &[(f64, f64)], p: f64) -> String {
    let diff: Vec<(f64, f64)> = after
        .iter()
        .map(|(le, n)| {
            (
                *le,
                n - before.iter().find(|(l, _)| l == le).map_or(0.0, |b| b.1),
            )
        })
        .collect();
    let total = diff.last().map_or(0.0, |d| d.1);
    match diff.iter().find(|(_, n)| *n >= p * total) {
        Some((le, _)) if le.is_finite() => format!("≤ {}", human(Duration::from_secs_f64(*le))),
        Some(_) => "> the largest bucket".into(),
        None => "no observations".into(),
    }
}

async fn webhook(
    cp: &ControlPlane,
    client: &Client,
    ns: &str,
    nodes_created: Duration,
    table: &mut Table,
) -> anyhow::Result<()> {
    eprintln!("webhook: 5,000 cached nodes, load at 2,000/s, 5,000/s and saturation ...");
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    pods.create(&PostParams::default(), &pending_meshed_pod("pending"))
        .await?;
    // SAFETY of set_var: see agent_log.
    unsafe { std::env::set_var("MESHGATE_WEBHOOK_LOG", "warn") };
    let mut hook = WebhookProcess::start(cp.admin_kubeconfig_path(), &[])?;
    let synced = hook.wait_ready(Duration::from_secs(120)).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (rss_idle, _) = hook.rss_kib().unwrap_or((0, 0));
    let connector = review::tls_connector(&hook.ca_der)?;
    // Typical: what a cluster sends all day, answered from the caches (meshed pods on
    // verified nodes, plain pods anywhere, bindings to verified nodes).
    let mut typical: Vec<Review> = Vec::new();
    // Refusal-heavy: 40% refusals spread over the 500 unverified nodes; each refusal reads
    // the node's condition reason for its message (a bounded GET, remembered 5 s per node).
    let mut refusals: Vec<Review> = Vec::new();
    for i in 0..4000 {
        let uid = format!("bench-{i}");
        let (v, u) = (format!("wh-v-{}", i % 4500), format!("wh-u-{}", i % 500));
        typical.push(match i % 10 {
            0..=5 => review::pod_review(&uid, &v, true, true),
            6 | 7 => review::pod_review(&uid, &u, false, true),
            8 => review::pod_review(&uid, &v, false, true),
            _ => review::binding_review(&uid, ns, "pending", &v, true),
        });
        refusals.push(match i % 10 {
            0..=3 => review::pod_review(&uid, &v, true, true),
            4..=6 => review::pod_review(&uid, &u, true, false),
            7 | 8 => review::pod_review(&uid, &u, false, true),
            _ => review::binding_review(&uid, ns, "pending", &u, false),
        });
    }
    let (typical, refusals) = (Arc::new(typical), Arc::new(refusals));
    let spec =
        |reviews: &Arc<Vec<Review>>, rate: f64, secs: f64, connections: usize| review::Spec {
            addr: hook.listen,
            path: "/validate".into(),
            connector: connector.clone(),
            reviews: reviews.clone(),
            rate,
            duration: Duration::from_secs_f64(secs),
            connections,
        };
    // Warm up (connections, first refusal-reason lookups).
    let warm = review::run(spec(&refusals, 500.0, 2.0, 8)).await?;
    if !warm.errors().is_empty() {
        bail!(
            "webhook warm-up errors: {:?}\n{}",
            warm.errors().first(),
            hook.log()
        );
    }
    let secs = env_num("MESHGATE_BENCH_LOAD_SECS", 10) as f64;
    let scrape = || async {
        histogram(
            &hook
                .admin_get("/metrics")
                .await
                .map(|r| r.1)
                .unwrap_or_default(),
        )
    };
    let mut runs = Vec::new();
    for (name, reviews, rate, connections) in [
        ("typical mix at 2,000/s", &typical, 2000.0, 16),
        ("typical mix at 5,000/s", &typical, 5000.0, 32),
        ("refusal-heavy mix at 2,000/s", &refusals, 2000.0, 16),
    ] {
        let before = scrape().await;
        let r = review::run(spec(reviews, rate, secs, connections)).await?;
        let after = scrape().await;
        let server = format!(
            "server-side handling p50 {}, p99 {}",
            server_quantile(&before, &after, 0.5),
            server_quantile(&before, &after, 0.99)
        );
        eprintln!("  {name}: {}; {server}", r.summary());
        runs.push((name, r, server));
    }
    let sat = review::run(spec(&typical, 30000.0, 5.0, 64)).await?;
    let (rss_after, hwm) = hook.rss_kib().unwrap_or((0, 0));
    drop(hook);

    let rss_mib = rss_idle as f64 / 1024.0;
    table.row(
        "webhook RSS, 5,000 Nodes cached (idle)",
        format!("{rss_mib:.1} MiB"),
        "—",
        "—".into(),
        "—".into(),
        "≤ 32 MiB",
        Some(rss_mib <= 32.0),
    );
    for (name, r, _) in &runs {
        let (p50, p99) = (r.latency(0.5), r.latency(0.99));
        let goal = *name == "typical mix at 2,000/s";
        table.row(
            &format!("webhook latency, {name}, p50 / p99"),
            format!("{} / {}", human(p50), human(p99)),
            "—",
            "—".into(),
            "—".into(),
            if goal { "p99 ≤ 2 ms at 2,000/s" } else { "" },
            goal.then_some(p99 <= Duration::from_millis(2) && r.errors().is_empty()),
        );
    }
    table.row(
        "webhook throughput at saturation (typical mix, 30,000/s offered)",
        format!("{:.0}/s", sat.throughput()),
        "—",
        "—".into(),
        "—".into(),
        "",
        None,
    );
    table.note(format!(
        "Webhook: release binary, 4,500 verified and 500 unverified Nodes (created {:.1} s before; caches synced {:.1} s after start). Typical mix: 60% meshed pods on verified nodes, 30% plain pods, 10% bindings to verified nodes, all answered from the caches. Refusal-heavy mix: 40% meshed pods on verified nodes, 30% meshed pods on unverified nodes and 10% bindings of a pending meshed pod to them (refused; each refusal reads the node's condition reason with a GET remembered 5 s per node, and 500 distinct nodes often miss), 20% plain pods. Pod reviews are ~3 KB, sent over TLS on loopback from this process (open loop; latency from each request's due time). {}. Saturation (typical mix): {}. The load generator, the webhook, the apiserver and etcd share the 2 CPUs; the controller manager was frozen (SIGSTOP) for this section, since its node-lifecycle work on 5,000 kubelet-less Nodes is an artifact of the rig. RSS {:.1} MiB idle, {:.1} MiB after the load (peak {:.1} MiB).",
        nodes_created.as_secs_f64(),
        synced.as_secs_f64(),
        runs.iter()
            .map(|(name, r, server)| format!("{name}: {}; {server}", r.summary()))
            .collect::<Vec<_>>()
            .join(". "),
        sat.summary(),
        rss_idle as f64 / 1024.0,
        rss_after as f64 / 1024.0,
        hwm as f64 / 1024.0,
    ));
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
    if run("gating") {
        gating(&cp, &client, &mut table).await.context("gating")?;
    }
    if run("detection") {
        detection(&cp, &client, &ns, &mut table)
            .await
            .context("detection")?;
    }
    if run("sweep") {
        sweep(&cp, &client, &ns, &mut table)
            .await
            .context("sweep")?;
    }
    if run("webhook") {
        // Last: 5,000 Nodes without kubelets keep the controller manager busy for minutes
        // (node lifecycle), which would slow every Node registration after them.
        eprintln!("creating 5,000 Nodes for the webhook section ...");
        // The controller manager has no part in admission, but with 5,000 kubelet-less Nodes
        // its node-lifecycle work would share the 2 CPUs with the measurement: frozen.
        cp.freeze_component("kube-controller-manager", true)?;
        let measured = match review::create_nodes(&client, "wh", 4500, 500, 32).await {
            Ok(created) => webhook(&cp, &client, &ns, created, &mut table).await,
            Err(e) => Err(e),
        };
        cp.freeze_component("kube-controller-manager", false)?;
        measured.context("webhook")?;
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
