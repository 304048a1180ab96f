//! Sweep: 250 real pod namespaces; RSS; idle API requests.

use super::*;

/// Values of `key=` in the agent's log lines containing `marker` (colour codes removed).
pub(super) fn log_values(log: &str, marker: &str, key: &str) -> Vec<u64> {
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
pub(super) async fn inspected(agent: &Agent) -> (f64, f64, f64) {
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

pub(super) async fn run(
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
    let plan = plan(count);
    let netns = build_namespaces(&plan)?;
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
    let first_pass = first_pass(&agent, &api, node, count).await?;
    let rss_loaded = agent.rss_kib().unwrap_or(0);

    // Full sweeps: every verdict change re-inspects every pod in one batch.
    let flips = env_num("MESHGATE_BENCH_SWEEPS", 6) as usize;
    let (sweeps, surveys) = full_sweeps(&agent, &dirs, (&valid, &invalid), count, flips).await?;
    let rss_swept = agent.rss_kib().unwrap_or(0);
    let inspections = Inspections::of(&agent).await;

    // Idle: nothing changes; count the agent's requests by the apiserver's audit log.
    dirs.config("10-calico.conflist", &valid)?;
    let idle = idle_requests(cp, &id, idle).await?;
    let rss_end = agent.rss_kib().unwrap_or(0);
    drop(agent);

    let figures = Figures {
        count,
        missing,
        first_pass,
        flips,
        sweeps,
        surveys,
        inspections,
        rss_kib: [rss_idle, rss_loaded, rss_swept, rss_end],
        idle,
    };
    figures.rows(table);
    figures.notes(table);
    id.remove(client).await;
    drop(netns);
    Ok(())
}

/// Each pod's address and rules: 4 in 5 with linkerd's rules (legacy and nft), the rest
/// without.
fn plan(count: usize) -> Vec<(Ipv4Addr, Rules)> {
    let subnets: Vec<[u8; 3]> = (0..count.div_ceil(250)).map(|_| private_subnet()).collect();
    (0..count)
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
        .collect()
}

/// The plan's network namespaces, built on a few threads.
fn build_namespaces(plan: &[(Ipv4Addr, Rules)]) -> anyhow::Result<Vec<PodNetns>> {
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
    Ok(netns)
}

/// Creates the `count` pods and returns how long the agent took, from the first create, to
/// judge every one of them (redirected or missing) within 300 s.
async fn first_pass(
    agent: &Agent,
    api: &Api<Pod>,
    node: &str,
    count: usize,
) -> anyhow::Result<Duration> {
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
        let (r, m, u) = inspected(agent).await;
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
    Ok(started.elapsed())
}

/// Flips the config between `(valid, invalid)` `flips` times; each flip must re-inspect all
/// `count` pods within 60 s. Returns each sweep's duration (survey + inspections) and each
/// survey's, both sorted.
async fn full_sweeps(
    agent: &Agent,
    dirs: &CniDirs,
    (valid, invalid): (&[u8], &[u8]),
    count: usize,
    flips: usize,
) -> anyhow::Result<(Vec<Duration>, Vec<Duration>)> {
    let mut sweeps: Vec<Duration> = Vec::new();
    let mut surveys: Vec<Duration> = Vec::new();
    for f in 0..flips {
        let before_log = agent.log().len();
        let sum0 = agent
            .metric("meshgate_pod_inspection_seconds_sum")
            .await
            .unwrap_or(0.0);
        let (r0, m0, _) = inspected(agent).await;
        dirs.config(
            "10-calico.conflist",
            if f % 2 == 0 { invalid } else { valid },
        )?;
        let end = Instant::now() + Duration::from_secs(60);
        loop {
            let (r, m, _) = inspected(agent).await;
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
    Ok((sweeps, surveys))
}

/// Every redirected pod's inspection time from the agent's log (first pass and sweeps),
/// sorted, and its inspection histogram's count and sum.
struct Inspections {
    per_pod: Vec<Duration>,
    count: f64,
    sum: f64,
}

impl Inspections {
    async fn of(agent: &Agent) -> Self {
        let mut per_pod: Vec<Duration> =
            log_values(&agent.log(), "mesh redirects in place", "inspect_us")
                .into_iter()
                .map(Duration::from_micros)
                .collect();
        per_pod.sort();
        let (count, sum) = (
            agent
                .metric("meshgate_pod_inspection_seconds_count")
                .await
                .unwrap_or(0.0),
            agent
                .metric("meshgate_pod_inspection_seconds_sum")
                .await
                .unwrap_or(0.0),
        );
        Self {
            per_pod,
            count,
            sum,
        }
    }
}

/// The agent's requests in an idle window, by the apiserver's audit log.
struct Idle {
    window: Duration,
    requests: usize,
    kinds: BTreeMap<String, usize>,
    lists: usize,
    per_min: f64,
}

/// Lets the agent settle for 5 s, then counts its requests over `window`.
async fn idle_requests(
    cp: &ControlPlane,
    id: &AuditedIdentity,
    window: Duration,
) -> anyhow::Result<Idle> {
    tokio::time::sleep(Duration::from_secs(5)).await;
    let from = SystemTime::now();
    tokio::time::sleep(window).await;
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
    let per_min = requests.len() as f64 * 60.0 / window.as_secs_f64();
    Ok(Idle {
        window,
        requests: requests.len(),
        kinds,
        lists,
        per_min,
    })
}

/// What the sweep measured, for the table.
struct Figures {
    count: usize,
    /// Pods without rules.
    missing: usize,
    first_pass: Duration,
    flips: usize,
    sweeps: Vec<Duration>,
    surveys: Vec<Duration>,
    inspections: Inspections,
    /// Agent RSS: ready with no pods, after the first pass, after the sweeps, after idling.
    rss_kib: [u64; 4],
    idle: Idle,
}

impl Figures {
    fn rows(&self, table: &mut Table) {
        let (count, flips) = (self.count, self.flips);
        let per_pod = &self.inspections.per_pod;
        let p50 = quantile(per_pod, 0.5);
        let p99 = quantile(per_pod, 0.99);
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
        let sweep_p50 = quantile(&self.sweeps, 0.5);
        table.row(
            &format!("full sweep of {count} pods (in the daemon), p50 of {flips}"),
            human(sweep_p50),
            "—",
            "—".into(),
            "—".into(),
            "≤ 60 ms",
            Some(sweep_p50 <= Duration::from_millis(60)),
        );
        let [_, rss_loaded, rss_swept, _] = self.rss_kib;
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
        let (per_min, lists) = (self.idle.per_min, self.idle.lists);
        table.row(
            &format!("API requests per minute, idle agent with {count} pods"),
            format!("{per_min:.2}/min, {lists} LIST"),
            "—",
            "—".into(),
            "—".into(),
            "no periodic LIST",
            Some(lists == 0),
        );
    }

    fn notes(&self, table: &mut Table) {
        let (count, missing, flips) = (self.count, self.missing, self.flips);
        let Inspections {
            per_pod,
            count: count_h,
            sum: sum_h,
        } = &self.inspections;
        let (sweeps, surveys) = (&self.sweeps, &self.surveys);
        table.note(format!(
            "Inspection: {count} bare meshed pods, each in its own real network namespace ({} with linkerd's rules written by iptables-legacy or iptables-nft, {missing} without), bound to one node and marked Running by the kubelet stand-in; the release agent inspected all within {:.1} s of the first create. Per-pod figures are the agent's own `inspect_us` for every inspection of a redirected pod, first pass and sweeps ({} samples; locate + read rules + match, the namespace survey excluded); p90 {}; histogram mean over all {count_h} inspections {}.",
            count - missing,
            self.first_pass.as_secs_f64(),
            per_pod.len(),
            human(quantile(per_pod, 0.9)),
            human(Duration::from_secs_f64(sum_h / count_h.max(1.0))),
        ));
        table.note(format!(
            "Full sweep: the config flipped {flips} times; each verdict change re-inspects every pod in one batch. Sweep = the batch's namespace survey + the sum of its per-pod inspections: p50 {} max {}; survey alone p50 {} max {}. `cargo bench -p meshgate-agent --bench inspect_sweep` measures the same work outside the daemon.",
            human(quantile(sweeps, 0.5)),
            human(quantile(sweeps, 1.0)),
            human(quantile(surveys, 0.5)),
            human(quantile(surveys, 1.0)),
        ));
        let [rss_idle, rss_loaded, rss_swept, rss_end] = self.rss_kib;
        table.note(format!(
            "Agent RSS: {:.1} MiB ready with no pods, {:.1} MiB after the first pass over {count} pods, {:.1} MiB after the sweeps, {:.1} MiB after the idle window.",
            rss_idle as f64 / 1024.0,
            rss_loaded as f64 / 1024.0,
            rss_swept as f64 / 1024.0,
            rss_end as f64 / 1024.0
        ));
        let Idle {
            window,
            requests,
            kinds,
            per_min,
            ..
        } = &self.idle;
        table.note(format!(
            "Idle API requests: the agent ran under its own ServiceAccount; the apiserver's audit log counted {requests} requests in a {:.0} s window with nothing changing ({per_min:.2}/min): {kinds:?}. A window longer than the watches' 290 s server-side timeout includes their renewals.",
            window.as_secs_f64(),
        ));
    }
}
