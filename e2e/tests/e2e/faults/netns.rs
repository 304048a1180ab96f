//! Vanishing pod namespaces and IPs that match no namespace are never evicted blindly.

use super::*;

/// Pods whose namespace is deleted around the moment they start (before, during or after
/// the agent's inspection), and pods whose IP no namespace holds: none is evicted unless its
/// namespace was seen without rules, nothing crashes, and the agent keeps working (control
/// pods in the same run are inspected and evicted as usual).
#[tokio::test]
async fn vanishing_netns_and_unmatched_ips_are_never_evicted_blindly() -> anyhow::Result<()> {
    require_privileges()?;
    let cp = cp().await;
    let client = cp.client()?;
    let mut rng = Rng::new("vanishing");
    let ns = cp.create_namespace(&client, "faults-netns").await?;
    // `_dirs` keeps the CNI dirs (and so the valid config) for the whole test.
    let Rig {
        node,
        agent,
        dirs: _dirs,
    } = Rig::start(&client, "faults-netns", |node, dirs| {
        let flags = [
            "--profile",
            "linkerd",
            "--evict-unowned",
            "--max-evictions-per-minute",
            "100000",
        ];
        Agent::start(cp, node, dirs, &flags)
    })
    .await?;
    agent.wait_ready(WAIT).await?;
    let pid = agent.pid().context("pid")?;
    let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let subnet = private_subnet();
    // An IP range no namespace holds: the next private /24, never populated.
    let ghost = private_subnet();

    let (n_vanish, n_ghost) = if soak() { (60, 40) } else { (24, 12) };
    let mut vanishing = vanishing_pods(subnet, n_vanish)?;
    let control_missing = PodNetns::new(ip_of(subnet, 200), Rules::None)?;
    let control_ok = PodNetns::new(ip_of(subnet, 201), Rules::Linkerd("iptables-nft"))?;
    create_pods(&api, &node, &vanishing, n_ghost).await?;
    let cpu0 = cpu_seconds(pid).context("cpu")?;
    let begun = Instant::now();

    let gone_before_running = start_while_vanishing(&client, &ns, &mut vanishing, &mut rng).await?;
    for i in 0..n_ghost {
        meshgate_e2e::mark_pod_running(
            &client,
            &ns,
            &format!("ghost-{i}"),
            IpAddr::V4(ip_of(ghost, (i + 1) as u8)),
        )
        .await?;
    }
    meshgate_e2e::mark_pod_running(
        &client,
        &ns,
        "control-missing",
        IpAddr::V4(control_missing.ip),
    )
    .await?;
    meshgate_e2e::mark_pod_running(&client, &ns, "control-ok", IpAddr::V4(control_ok.ip)).await?;

    // The control pod without rules is evicted: the agent is working.
    meshgate_e2e::harness::wait::poll_until("control-missing evicted", WAIT, || async {
        let p = api.get("control-missing").await?;
        anyhow::Ok(p.metadata.deletion_timestamp.is_some().then_some(()))
    })
    .await
    .with_context(|| tail(&agent.log(), 60))?;
    // Unknown pods are retried with backoff: watch a while for an eviction or a busy loop.
    tokio::time::sleep(Duration::from_secs(if soak() { 30 } else { 8 })).await;
    let elapsed = begun.elapsed();
    let cpu = cpu_seconds(pid).context("cpu after")? - cpu0;
    let spent = Spent { pid, cpu, elapsed };
    none_evicted_blindly(
        &api,
        &agent,
        &gone_before_running,
        (n_vanish, n_ghost),
        spent,
    )
    .await
}

/// The pods whose namespace will vanish: (name, IP, namespace).
type Vanishing = Vec<(String, Ipv4Addr, Option<PodNetns>)>;

/// `n` pods in namespaces without rules, in `subnet` from .1 on.
fn vanishing_pods(subnet: [u8; 3], n: usize) -> anyhow::Result<Vanishing> {
    let mut vanishing: Vanishing = Vec::new();
    for i in 0..n {
        let ip = ip_of(subnet, (i + 1) as u8);
        vanishing.push((
            format!("vanish-{i}"),
            ip,
            Some(PodNetns::new(ip, Rules::None)?),
        ));
    }
    Ok(vanishing)
}

/// Creates the vanishing pods, `n_ghost` pods no namespace will hold, and the two control
/// pods, on `node`.
async fn create_pods(
    api: &Api<Pod>,
    node: &str,
    vanishing: &Vanishing,
    n_ghost: usize,
) -> anyhow::Result<()> {
    for (name, _, _) in vanishing {
        api.create(&PostParams::default(), &meshed_pod(name, node)?)
            .await?;
    }
    for i in 0..n_ghost {
        api.create(
            &PostParams::default(),
            &meshed_pod(&format!("ghost-{i}"), node)?,
        )
        .await?;
    }
    for name in ["control-missing", "control-ok"] {
        api.create(&PostParams::default(), &meshed_pod(name, node)?)
            .await?;
    }
    Ok(())
}

/// Starts the pods one after the other while their namespaces disappear at random moments
/// over the same span: some before their pod is Running, some while the agent inspects the
/// burst, some after. Returns the pods whose namespace was gone before they were Running.
async fn start_while_vanishing(
    client: &Client,
    ns: &str,
    vanishing: &mut Vanishing,
    rng: &mut Rng,
) -> anyhow::Result<Vec<String>> {
    let n_vanish = vanishing.len();
    let mut schedule: Vec<(usize, Duration, PodNetns)> = Vec::new();
    for (i, v) in vanishing.iter_mut().enumerate() {
        if let Some(netns) = v.2.take() {
            schedule.push((
                i,
                Duration::from_millis(rng.below(20 * n_vanish as u64)),
                netns,
            ));
        }
    }
    schedule.sort_by_key(|(_, at, _)| *at);
    let t0 = Instant::now();
    let deleter = tokio::task::spawn_blocking(move || {
        let mut deleted = HashMap::new();
        for (i, at, netns) in schedule {
            std::thread::sleep((t0 + at).saturating_duration_since(Instant::now()));
            drop(netns); // `ip netns del`
            deleted.insert(i, Instant::now());
        }
        deleted
    });
    let mut marked: HashMap<usize, Instant> = HashMap::new();
    for (i, (name, ip, _)) in vanishing.iter().enumerate() {
        marked.insert(i, Instant::now());
        meshgate_e2e::mark_pod_running(client, ns, name, IpAddr::V4(*ip)).await?;
    }
    let deleted = deleter.await?;
    Ok(vanishing
        .iter()
        .enumerate()
        .filter(|(i, _)| deleted[i] < marked[i])
        .map(|(_, v)| v.0.clone())
        .collect())
}

/// The agent's process and the CPU it spent over the watched span.
struct Spent {
    pid: u32,
    cpu: f64,
    elapsed: Duration,
}

/// None of the pods was evicted without its namespace read without rules, the ghosts are
/// reported unknown, and the agent lives, did not panic, and backed off.
async fn none_evicted_blindly(
    api: &Api<Pod>,
    agent: &Agent,
    gone_before_running: &[String],
    (n_vanish, n_ghost): (usize, usize),
    Spent { pid, cpu, elapsed }: Spent,
) -> anyhow::Result<()> {
    let all = api.list(&Default::default()).await?.items;
    let evicted: Vec<String> = all
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_some())
        .map(ResourceExt::name_any)
        .collect();
    let unknown = agent
        .metric("meshgate_pod_inspections_total{profile=\"linkerd\",verdict=\"unknown\"}")
        .await
        .unwrap_or(0.0);
    let evicted_vanished = evicted.iter().filter(|n| n.starts_with("vanish-")).count();
    eprintln!(
        "[faults] vanishing netns: {n_vanish} pods whose namespace was deleted around their start \
         ({} before Running), {n_ghost} pods with no namespace; evicted: {evicted_vanished} of the vanishing ones \
         (whose namespace still existed when the agent read it), none of the rest; {unknown} unknown \
         inspections; agent CPU {:.2} s over {:.1} s",
        gone_before_running.len(),
        cpu,
        elapsed.as_secs_f64()
    );
    ensure!(alive(pid), "the agent died:\n{}", tail(&agent.log(), 60));
    ensure!(!agent.log().contains("panicked"), "{}", agent.log());
    let blind: Vec<&String> = evicted
        .iter()
        .filter(|n| {
            n.starts_with("ghost-") || gone_before_running.contains(n) || *n == "control-ok"
        })
        .collect();
    ensure!(
        blind.is_empty(),
        "evicted without having read a namespace without rules: {blind:?}\n{}",
        tail(&agent.log(), 60)
    );
    ensure!(
        unknown >= n_ghost as f64,
        "ghost pods are reported unknown ({unknown})"
    );
    // Backoff, not a busy loop: well under a tenth of a core on average.
    ensure!(
        cpu / elapsed.as_secs_f64() < 0.1,
        "agent CPU {cpu:.2} s in {elapsed:?}: a retry loop?"
    );
    Ok(())
}
