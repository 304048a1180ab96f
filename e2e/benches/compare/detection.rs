//! Detection: an un-redirected pod Running → its eviction.

use super::*;

/// The Cilium-style sweep: every `interval`, list the node's pods and evict each Running
/// meshed pod whose namespace `meshgate-agent inspect` finds without redirects. Publishes
/// when each pod was first found missing (the sweep's start).
pub(super) async fn sweep_driver(
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
pub(super) async fn run_detection(
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

pub(super) async fn run(
    cp: &ControlPlane,
    client: &Client,
    ns: &str,
    table: &mut Table,
) -> anyhow::Result<()> {
    let n = env_num("MESHGATE_BENCH_DETECTIONS", 100) as usize;
    eprintln!("detection: {n} un-redirected pods for the agent, {n} for the sweep model ...");
    require_privileges()?;
    let subnet = private_subnet();
    let (ours_ns, sweep_ns) = (netns(subnet, 1..5)?, netns(subnet, 11..15)?);
    let (deleted, watcher) = deletion_watch(client, ns);

    // meshgate, under its own identity so its eviction requests are timed by the apiserver.
    let id = AuditedIdentity::new(cp, client, ns, "detect-agent").await?;
    let ips: Vec<Ipv4Addr> = ours_ns.iter().map(|n| n.ip).collect();
    let (seen, requested) = meshgate(cp, client, ns, &id, &ips, n, &deleted).await?;

    // The sweep model on its own node, same pods.
    let interval = Duration::from_millis(env_num("MESHGATE_BENCH_SWEEP_INTERVAL_MS", 150));
    let sweep = Sweep::run(client, cp, ns, &sweep_ns, n, interval, &deleted).await?;
    watcher.abort();
    sweep.rows(table, &seen);
    table.note(format!(
        "Detection: {n} bare meshed pods, one at a time, each marked Running (status patch) with the IP of a real network namespace without redirect rules; timed from just before the status patch to a pod watch seeing the eviction's deletion timestamp. By the apiserver's clock (audit log), the eviction request arrived p50 {} / p99 {} after the status patch was sent ({} requests matched).",
        human(quantile(&requested, 0.5)),
        human(quantile(&requested, 0.99)),
        requested.len()
    ));
    sweep.note(table, interval);
    table.note("Linkerd's validator is modeled as its 10 s timeout alone (a lower bound; container start, crash-loop backoff or the repair controller's deletion come on top). It is fail-closed: the app container never starts without redirects, whereas a pod meshgate evicts ran unredirected for the detection time plus its termination grace period.".to_string());
    id.remove(client).await;
    Ok(())
}

/// Network namespaces without rules at `hosts` of `subnet`.
fn netns(subnet: [u8; 3], hosts: std::ops::Range<u8>) -> anyhow::Result<Vec<PodNetns>> {
    hosts
        .map(|h| {
            PodNetns::new(
                Ipv4Addr::new(subnet[0], subnet[1], subnet[2], h),
                Rules::None,
            )
        })
        .collect()
}

/// meshgate's agent, as `id`, detecting `n` un-redirected pods at `ips`. Returns, sorted, the
/// time from Running to the eviction seen by the watch, and, by the apiserver's clock, to
/// the eviction request.
async fn meshgate(
    cp: &ControlPlane,
    client: &Client,
    ns: &str,
    id: &AuditedIdentity,
    ips: &[Ipv4Addr],
    n: usize,
    deleted: &Arc<Mutex<HashMap<String, Instant>>>,
) -> anyhow::Result<(Vec<Duration>, Vec<Duration>)> {
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
    let ours = run_detection(client, ns, node, "d", ips, n, Duration::ZERO, deleted).await?;
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
    Ok((seen, requested))
}

/// The sweep model's figures, each sorted: the sweep's phase, the work after the sweep
/// started, and the end-to-end time.
struct Sweep {
    phase: Vec<Duration>,
    work: Vec<Duration>,
    total: Vec<Duration>,
}

impl Sweep {
    /// The sweep model every `interval` on its own node, detecting `n` un-redirected pods in
    /// `sweep_ns`.
    #[allow(clippy::too_many_arguments)]
    async fn run(
        client: &Client,
        cp: &ControlPlane,
        ns: &str,
        sweep_ns: &[PodNetns],
        n: usize,
        interval: Duration,
        deleted: &Arc<Mutex<HashMap<String, Instant>>>,
    ) -> anyhow::Result<Self> {
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
        let theirs = run_detection(client, ns, node_c, "s", &ips, n, interval, deleted).await?;
        driver.abort();
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
        Ok(Self { phase, work, total })
    }

    /// meshgate's detection times (`seen`) beside the sweep's, modeled at its real 15 s tick,
    /// and beside Linkerd's validator timeout.
    fn rows(&self, table: &mut Table, seen: &[Duration]) {
        let real_sweep = Duration::from_secs(15);
        let validator = Duration::from_secs(10);
        for (q, label) in [(0.5, "p50"), (0.99, "p99")] {
            let o = quantile(seen, q);
            let sweep = modeled(real_sweep, &self.work, q);
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
    }

    fn note(&self, table: &mut Table, interval: Duration) {
        table.note(format!(
            "Sweep model run for real at a {} interval: list the node's pods, `meshgate-agent inspect` each Running meshed pod, evict: phase p50 {} (expected {}), work after the sweep started p50 {} p99 {}, end to end at that interval p50 {} p99 {}. Modeled at 15 s: U(0, 15 s) + work. Cilium's watcher also skips pods younger than 30 s (unmanagedPodMinimalAge), which would add 30 s; not counted.",
            human(interval),
            human(quantile(&self.phase, 0.5)),
            human(interval / 2),
            human(quantile(&self.work, 0.5)),
            human(quantile(&self.work, 0.99)),
            human(quantile(&self.total, 0.5)),
            human(quantile(&self.total, 0.99)),
        ));
    }
}
