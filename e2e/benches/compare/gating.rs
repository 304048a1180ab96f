//! Gating: untaint and re-taint, against the node-readiness-controller mechanism.

use super::*;

/// Waits for the watch to report the wanted taint state; returns when it was seen.
pub(super) async fn until(
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

pub(super) fn watch_taint(
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
pub(super) async fn nrc_reporter(
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
pub(super) async fn nrc_controller(client: Client, node: String) {
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

/// The stand-in node's figures, for the real node's rows beside them.
pub(super) struct StandIn {
    pub(super) untaint: Vec<Duration>,
    pub(super) retaint: Vec<Duration>,
}

pub(super) async fn run(
    cp: &ControlPlane,
    client: &Client,
    table: &mut Table,
) -> anyhow::Result<StandIn> {
    let n = env_num("MESHGATE_BENCH_TRANSITIONS", 100) as usize;
    eprintln!(
        "gating: {n} transitions each way, meshgate agent and the node-readiness-controller model ..."
    );
    let (invalid, valid) = (
        golden("calico.conflist")?,
        golden("calico-linkerd.conflist")?,
    );
    let configs = (invalid.as_slice(), valid.as_slice());
    let (untaint, retaint, rss) = meshgate(cp, client, table, n, configs).await?;
    let interval = Duration::from_millis(env_num("MESHGATE_BENCH_NRC_INTERVAL_MS", 300));
    let nrc = Nrc::run(cp, client, n, interval, configs).await?;
    nrc.rows(table, &untaint, &retaint);
    table.note(format!(
        "Gating: {n} transitions each way, from the write on disk to a Node watch seeing the taint change. meshgate max untaint {}, max re-taint {}; agent RSS after {:.1} MiB.",
        human(quantile(&untaint, 1.0)),
        human(quantile(&retaint, 1.0)),
        rss as f64 / 1024.0
    ));
    nrc.note(table, n, interval);
    Ok(StandIn { untaint, retaint })
}

/// meshgate's agent on a stand-in node, the config flipped `n` times each way between
/// `(invalid, valid)`; each transition's stages go in the table. Returns the untaint and
/// re-taint latencies (sorted) and the agent's RSS after.
async fn meshgate(
    cp: &ControlPlane,
    client: &Client,
    table: &mut Table,
    n: usize,
    (invalid, valid): (&[u8], &[u8]),
) -> anyhow::Result<(Vec<Duration>, Vec<Duration>, u64)> {
    let node = "gate-agent";
    cp.register_node(client, &NodeSpec::new(node)).await?;
    let dirs = CniDirs::new()?;
    dirs.config("10-calico.conflist", invalid)?;
    agent_log("warn,meshgate_agent::daemon::stages=info");
    let agent = Agent::start(cp, node, &dirs, &["--log-format", "json"])?;
    let (mut rx, w) = watch_taint(client, node, meshgate_core::gate::DEFAULT_TAINT_KEY);
    until(&mut rx, true).await.context("initial gating")?;
    let skip = stages::count(&stages::settle(1, || agent.log()).await);
    let (mut untaint, mut retaint) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let mut transitions = Vec::with_capacity(2 * n);
    for _ in 0..n {
        for (text, tainted) in [(valid, false), (invalid, true)] {
            let (wall, at) = stages::stamp();
            dirs.config("10-calico.conflist", text)?;
            let seen = until(&mut rx, tainted).await?;
            let all = if tainted { &mut retaint } else { &mut untaint };
            all.push(seen - at);
            transitions.push(stages::Transition {
                tainted,
                wall,
                at,
                seen,
            });
        }
    }
    w.abort();
    let rss = agent.rss_kib().unwrap_or(0);
    let log = stages::settle(skip + 2 * n, || agent.log()).await;
    drop(agent);
    let joined = stages::join(&transitions, &log, skip).context("the stand-in's stages")?;
    stages::rows(table, "stand-in node", &transitions, &joined);
    untaint.sort();
    retaint.sort();
    Ok((untaint, retaint, rss))
}

/// The node-readiness-controller model's figures, each sorted: the poll's phase, the work
/// after the poll and the end-to-end latency, untaint (`_un`) and re-taint (`_re`).
struct Nrc {
    phase: Vec<Duration>,
    work_un: Vec<Duration>,
    work_re: Vec<Duration>,
    total_un: Vec<Duration>,
    total_re: Vec<Duration>,
}

impl Nrc {
    /// The node-readiness-controller model, same transitions, polling every `interval`.
    async fn run(
        cp: &ControlPlane,
        client: &Client,
        n: usize,
        interval: Duration,
        (invalid, valid): (&[u8], &[u8]),
    ) -> anyhow::Result<Self> {
        let node_b = "gate-nrc";
        cp.register_node(
            client,
            &NodeSpec::new(node_b).taint(NRC_TAINT, "NoSchedule"),
        )
        .await?;
        let dirs_b = CniDirs::new()?;
        dirs_b.config("10-calico.conflist", invalid)?;
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
        let mut nrc = Self {
            phase: Vec::new(),
            work_un: Vec::new(),
            work_re: Vec::new(),
            total_un: Vec::new(),
            total_re: Vec::new(),
        };
        let mut seed = 0x6d65_7368u64;
        for i in 0..2 * n {
            let want_valid = i % 2 == 0;
            // A random phase of the poll interval for every write.
            tokio::time::sleep(jitter(&mut seed, interval)).await;
            let t0 = Instant::now();
            dirs_b.config(
                "10-calico.conflist",
                if want_valid { valid } else { invalid },
            )?;
            let seen = until(&mut rx, !want_valid).await?;
            // The first poll that started after the write and saw the new verdict.
            let (polled, ok) = *prx.borrow();
            if ok != want_valid {
                bail!("NRC model: the reporter's last poll disagrees with the disk");
            }
            let polled = polled.max(t0);
            nrc.phase.push(polled - t0);
            let (work, total) = if want_valid {
                (&mut nrc.work_un, &mut nrc.total_un)
            } else {
                (&mut nrc.work_re, &mut nrc.total_re)
            };
            work.push(seen.saturating_duration_since(polled));
            total.push(seen - t0);
        }
        w.abort();
        reporter.abort();
        controller.abort();
        for v in [
            &mut nrc.phase,
            &mut nrc.work_un,
            &mut nrc.work_re,
            &mut nrc.total_un,
            &mut nrc.total_re,
        ] {
            v.sort();
        }
        Ok(nrc)
    }

    /// meshgate's untaint and re-taint latencies beside the model's, scaled to its real 30 s
    /// interval.
    fn rows(&self, table: &mut Table, untaint: &[Duration], retaint: &[Duration]) {
        let real = Duration::from_secs(30);
        for (name, ours, work) in [
            (
                "untaint: config valid → taint removed",
                untaint,
                &self.work_un,
            ),
            ("re-taint on drift (S4)", retaint, &self.work_re),
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
    }

    fn note(&self, table: &mut Table, n: usize, interval: Duration) {
        table.note(format!(
            "NRC model run for real at a {} poll interval ({} transitions): measured phase p50 {} (expected {} = interval/2), work after the poll (check + condition patch + controller's taint patch + watch) p50 {} p99 {}; measured end-to-end at that interval p50 {} / p99 {} (untaint), {} / {} (re-taint). Modeled at the real 30 s interval: U(0, 30 s) + measured work.",
            human(interval),
            2 * n,
            human(quantile(&self.phase, 0.5)),
            human(interval / 2),
            human(quantile(&self.work_un, 0.5)),
            human(quantile(&self.work_un, 0.99)),
            human(quantile(&self.total_un, 0.5)),
            human(quantile(&self.total_un, 0.99)),
            human(quantile(&self.total_re, 0.5)),
            human(quantile(&self.total_re, 0.99)),
        ));
    }
}
