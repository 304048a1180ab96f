//! Pods without redirect rules are evicted, as the PDB, the rate limit, dry-run and a
//! restart allow.

use super::*;

#[tokio::test]
async fn only_pods_without_redirects_are_evicted_and_their_replicaset_replaces_them()
-> anyhow::Result<()> {
    let scene = Scene::new("pods-evict").await?;
    let mut plan = Plan::new()?;
    plan.add("web", 2, Rules::None)?;
    // The replacements land in namespaces the (now chained) CNI plugin set up.
    let fixed = plan.add("web", 2, Rules::Linkerd("iptables-nft"))?;
    plan.add("ok", 1, Rules::Linkerd("iptables-nft"))?;
    plan.add("ok", 1, Rules::Linkerd("iptables-legacy"))?;
    plan.add("bare", 1, Rules::None)?;
    plan.add("plain", 1, Rules::None)?;
    plan.add("hostnet", 1, Rules::None)?;
    let _kubelet = cp().await.run_pods(&scene.node, plan.ip_source());

    // The agent watches first, so the latency measured below is detection, not start-up.
    let agent = scene.start_agent(&[])?;
    agent.wait_ready(WAIT).await?;

    let started = Instant::now();
    create_workloads(&scene).await?;
    let (original_web, replaced, latency) = web_pods_evicted_and_replaced(&scene, &agent).await?;
    let evict_seconds = started.elapsed();
    inspected_once_each(&agent).await?;
    the_rest_still_run(&scene, &replaced, &fixed).await?;
    events_only_about_pods_without_rules(&scene, &original_web).await?;
    report_latency(&agent, &latency, evict_seconds, &plan).await;
    drop(plan);
    Ok(())
}

/// Two web and two ok pods by ReplicaSet, a bare pod, an unmeshed one and a hostNetwork one.
async fn create_workloads(scene: &Scene) -> anyhow::Result<()> {
    scene
        .create_rs(&replica_set("web", &scene.node, 2, false)?)
        .await?;
    scene
        .create_rs(&replica_set("ok", &scene.node, 2, false)?)
        .await?;
    // Selected by no profile, and sharing the node's netns: never inspected.
    scene
        .create_pod(&bare_pod("plain", &scene.node, false))
        .await?;
    scene
        .create_rs(&replica_set("hostnet", &scene.node, 1, true)?)
        .await?;
    scene
        .create_pod(&bare_pod("bare", &scene.node, true))
        .await?;
    Ok(())
}

/// Both web pods are evicted and replaced by Running pods in namespaces with rules.
/// Polled every 20 ms to time each pod from Running to evicted as the API shows it. Returns the
/// original web pods, their replacements, and each original's time from Running to evicted.
async fn web_pods_evicted_and_replaced(
    scene: &Scene,
    agent: &Agent,
) -> anyhow::Result<(Vec<String>, Vec<String>, Latency)> {
    let mut latency = Latency::default();
    let mut original_web: Vec<String> = Vec::new();
    let deadline = Instant::now() + WAIT;
    let replaced = loop {
        let pods = scene.app_pods("web").await?;
        latency.observe(&pods);
        if original_web.is_empty() && pods.len() == 2 {
            original_web = pods.iter().map(ResourceExt::name_any).collect();
        }
        let fresh: Vec<String> = pods
            .iter()
            .filter(|p| !original_web.contains(&p.name_any()) && running(p))
            .map(ResourceExt::name_any)
            .collect();
        let originals_left = pods
            .iter()
            .filter(|p| original_web.contains(&p.name_any()))
            .count();
        if !original_web.is_empty() && originals_left == 0 && fresh.len() == 2 {
            break fresh;
        }
        if Instant::now() > deadline {
            bail!(
                "the web pods were not evicted and replaced: {:?}\n--- agent log ---\n{}",
                pods.iter()
                    .map(|p| (p.name_any(), running(p), terminating(p)))
                    .collect::<Vec<_>>(),
                tail(&agent.log(), 60)
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    Ok((original_web, replaced, latency))
}

/// Every selected pod with its own namespace was inspected exactly once: 2 web + 1 bare
/// missing; 2 ok + 2 replacements redirected. plain and hostnet never.
async fn inspected_once_each(agent: &Agent) -> anyhow::Result<()> {
    wait_metric(agent, REDIRECTED, |v| v >= 4.0).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(metric(agent, REDIRECTED).await, 4.0, "{}", agent.log());
    assert_eq!(metric(agent, MISSING).await, 3.0, "{}", agent.log());
    assert_eq!(metric(agent, UNKNOWN).await, 0.0, "{}", agent.log());
    assert_eq!(metric(agent, EVICTED).await, 2.0);
    assert_eq!(metric(agent, &skipped("unowned")).await, 1.0);
    assert!(
        agent
            .metric("meshgate_pod_inspection_seconds_count")
            .await
            .is_some_and(|c| c == 7.0),
        "one histogram sample per inspected pod"
    );
    Ok(())
}

/// The replacements, the ok pods and the bare pod are still there and running.
async fn the_rest_still_run(
    scene: &Scene,
    replaced: &[String],
    fixed: &[IpAddr],
) -> anyhow::Result<()> {
    let pods = scene.pods().list(&ListParams::default()).await?.items;
    let alive = |name: &str| pods.iter().any(|p| p.name_any() == name && running(p));
    for name in replaced {
        assert!(alive(name), "replacement {name} must not be evicted");
        let ip = pods.iter().find(|p| &p.name_any() == name).and_then(pod_ip);
        assert!(
            ip.is_some_and(|ip| fixed.contains(&ip)),
            "{name} runs in a namespace with rules: {ip:?}"
        );
    }
    let ok: Vec<String> = scene
        .app_pods("ok")
        .await?
        .iter()
        .map(ResourceExt::name_any)
        .collect();
    assert_eq!(ok.len(), 2);
    for name in ok
        .iter()
        .chain(["bare".to_string(), "plain".to_string()].iter())
    {
        assert!(alive(name), "{name} must not be evicted");
    }
    let hostnet = scene.app_pods("hostnet").await?;
    assert!(hostnet.len() == 1 && !terminating(&hostnet[0]));
    Ok(())
}

/// Events: evicted for the web pods, skipped as unowned for the bare pod, none else.
async fn events_only_about_pods_without_rules(
    scene: &Scene,
    original_web: &[String],
) -> anyhow::Result<()> {
    scene.wait_events(original_web, "Evict", "evicted").await?;
    scene
        .wait_events(&["bare".into()], "ReportUnowned", "skipped as unowned")
        .await?;
    let events = scene.events().await?;
    let mut about: Vec<&String> = events.keys().collect();
    about.sort();
    let mut want: Vec<&String> = original_web.iter().collect();
    let bare = "bare".to_string();
    want.push(&bare);
    want.sort();
    assert_eq!(
        about, want,
        "Events only about the pods without rules: {events:?}"
    );
    for (pod, es) in &events {
        assert_eq!(es.len(), 1, "one Event per pod: {pod}: {es:?}");
        assert!(
            es[0].1.contains("4143"),
            "the note says what is missing: {es:?}"
        );
    }
    Ok(())
}

/// Prints the latencies, API side and agent side, and the mean inspection time.
async fn report_latency(agent: &Agent, latency: &Latency, evict_seconds: Duration, plan: &Plan) {
    let rss = agent.rss_kib();
    let mut detect: Vec<u128> = latency.evicted.values().map(Duration::as_millis).collect();
    detect.sort();
    eprintln!(
        "[pods] evicted 2 of 7 meshed pods {:.1}s after their creation; pod Running -> evicted (API view): {detect:?} ms; agent RSS {rss:?} KiB; netns {:?}",
        evict_seconds.as_secs_f64(),
        plan.names()
    );
    let log = plain(&agent.log());
    let detect_lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("pod evicted"))
        .filter_map(|l| l.split("detect_ms=").nth(1)?.split_whitespace().next())
        .collect();
    eprintln!(
        "[pods] agent-side detection latency (Running seen -> eviction requested): {detect_lines:?} ms"
    );
    let sum = metric(agent, "meshgate_pod_inspection_seconds_sum").await;
    let count = metric(agent, "meshgate_pod_inspection_seconds_count").await;
    eprintln!(
        "[pods] mean inspection time per pod (locate + read rules + match): {:.0} µs over {count} pods",
        sum / count.max(1.0) * 1e6
    );
}

#[tokio::test]
async fn a_pdb_that_forbids_disruption_blocks_the_eviction_until_it_allows_it() -> anyhow::Result<()>
{
    let scene = Scene::new("pods-pdb").await?;
    let mut plan = Plan::new()?;
    plan.add("guarded", 2, Rules::None)?;
    plan.add("guarded", 2, Rules::Linkerd("iptables-nft"))?;
    let _kubelet = cp().await.run_pods(&scene.node, plan.ip_source());

    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(scene.client.clone(), &scene.ns);
    let pdb: PodDisruptionBudget = serde_json::from_value(json!({
        "metadata": { "name": "guarded" },
        "spec": { "minAvailable": 2, "selector": { "matchLabels": { "app": "guarded" } } }
    }))?;
    pdbs.create(&PostParams::default(), &pdb).await?;
    scene
        .create_rs(&replica_set("guarded", &scene.node, 2, false)?)
        .await?;
    let original = scene.running_names("guarded", 2).await?;

    let agent = scene.start_agent(&[])?;
    blocked_while_the_pdb_forbids(&scene, &agent, &original).await?;
    evicted_in_turn_once_allowed(&scene, &pdbs, &agent, &original).await
}

/// Refused, and retried: at least two refusals per pod; nothing is evicted, and each pod gets
/// one Warning Event however often the PDB refuses.
async fn blocked_while_the_pdb_forbids(
    scene: &Scene,
    agent: &Agent,
    original: &[String],
) -> anyhow::Result<()> {
    wait_metric(agent, &skipped("pdb"), |v| v >= 4.0).await?;
    let pods = scene.app_pods("guarded").await?;
    assert_eq!(pods.len(), 2, "nothing evicted while the PDB forbids it");
    assert!(
        pods.iter()
            .all(|p| running(p) && original.contains(&p.name_any()))
    );
    assert_eq!(metric(agent, EVICTED).await, 0.0);
    scene
        .wait_events(original, "EvictBlocked", "blocked by a PodDisruptionBudget")
        .await?;
    let events = scene.events().await?;
    for pod in original {
        assert_eq!(
            events.get(pod).map(Vec::len),
            Some(1),
            "one Warning Event per pod, however often the PDB refuses: {events:?}"
        );
    }
    Ok(())
}

/// The budget now allows one disruption at a time: both are evicted in turn.
async fn evicted_in_turn_once_allowed(
    scene: &Scene,
    pdbs: &Api<PodDisruptionBudget>,
    agent: &Agent,
    original: &[String],
) -> anyhow::Result<()> {
    pdbs.patch(
        "guarded",
        &PatchParams::default(),
        &Patch::Merge(json!({ "spec": { "minAvailable": 1 } })),
    )
    .await?;
    poll_until(
        "both guarded pods evicted and replaced",
        Duration::from_secs(150),
        || async {
            let pods = scene.app_pods("guarded").await?;
            let originals = pods
                .iter()
                .filter(|p| original.contains(&p.name_any()))
                .count();
            let fresh = pods
                .iter()
                .filter(|p| !original.contains(&p.name_any()) && running(p))
                .count();
            anyhow::Ok((originals == 0 && fresh == 2).then_some(()))
        },
    )
    .await
    .with_context(|| format!("--- agent log ---\n{}", tail(&agent.log(), 60)))?;
    assert_eq!(metric(agent, EVICTED).await, 2.0);
    scene.wait_events(original, "Evict", "evicted").await?;
    Ok(())
}

#[tokio::test]
async fn dry_run_evicts_nothing_reports_and_reinspects_on_verdict_and_sandbox_changes()
-> anyhow::Result<()> {
    let scene = Scene::new("pods-dry").await?;
    let mut plan = Plan::new()?;
    plan.add("web", 2, Rules::None)?;
    let _kubelet = cp().await.run_pods(&scene.node, plan.ip_source());
    scene
        .create_rs(&replica_set("web", &scene.node, 2, false)?)
        .await?;
    let agent = scene.start_agent(&["--dry-run"])?;

    wait_metric(&agent, &skipped("dry_run"), |v| v >= 2.0).await?;
    let pods = scene.app_pods("web").await?;
    let names: Vec<String> = pods.iter().map(ResourceExt::name_any).collect();
    scene.wait_events(&names, "DryRun", "dry-run").await?;
    assert_eq!(metric(&agent, MISSING).await, 2.0);

    // The node's verdict changes (the mesh plugin is dropped from the chain): every pod is
    // inspected again; still nothing evicted, and no duplicate Event.
    scene
        .dirs
        .config("10-calico.conflist", &golden("calico.conflist")?)?;
    wait_metric(&agent, MISSING, |v| v >= 4.0).await?;

    // One pod's sandbox changes (its containers restarted): that pod alone again.
    let status = json!({ "status": { "containerStatuses": [{
        "name": "app", "image": "registry.k8s.io/pause:3.10", "imageID": "",
        "ready": true, "restartCount": 1, "started": true,
        "state": { "running": { "startedAt": "2026-01-01T00:00:00Z" } }
    }] } });
    scene
        .pods()
        .patch_status(
            &names[0],
            &PatchParams::default(),
            &Patch::Strategic(status),
        )
        .await?;
    wait_metric(&agent, MISSING, |v| v >= 5.0).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(metric(&agent, MISSING).await, 5.0, "{}", agent.log());
    assert_eq!(metric(&agent, &skipped("dry_run")).await, 5.0);
    assert_eq!(metric(&agent, EVICTED).await, 0.0);

    let pods = scene.app_pods("web").await?;
    assert_eq!(pods.len(), 2);
    assert!(
        pods.iter()
            .all(|p| running(p) && names.contains(&p.name_any())),
        "dry-run evicts nothing"
    );
    let events = scene.events().await?;
    // One Event per sandbox: the restarted pod got a second one for its new sandbox (the
    // Recorder folds it into the first Event's series).
    let observed = |pod: &str| {
        events
            .get(pod)
            .map_or(0, |es| es.iter().map(|e| e.2).sum::<i32>())
    };
    assert_eq!(observed(&names[0]), 2, "{events:?}");
    assert_eq!(observed(&names[1]), 1, "{events:?}");
    Ok(())
}

#[tokio::test]
async fn the_rate_limit_holds() -> anyhow::Result<()> {
    let scene = Scene::new("pods-rate").await?;
    let mut plan = Plan::new()?;
    plan.add("web", 4, Rules::None)?;
    plan.add("web", 4, Rules::Linkerd("iptables-nft"))?;
    let _kubelet = cp().await.run_pods(&scene.node, plan.ip_source());
    scene
        .create_rs(&replica_set("web", &scene.node, 4, false)?)
        .await?;
    let original = scene.running_names("web", 4).await?;

    let agent = scene.start_agent(&["--max-evictions-per-minute", "2"])?;
    let started = Instant::now();
    wait_metric(&agent, EVICTED, |v| v >= 2.0).await?;
    wait_metric(&agent, &skipped("rate_limit"), |v| v >= 2.0).await?;
    // Give a third eviction every chance to happen (well within the minute).
    tokio::time::sleep(Duration::from_secs(5)).await;
    let pods = scene.app_pods("web").await?;
    let left: Vec<&Pod> = pods
        .iter()
        .filter(|p| original.contains(&p.name_any()))
        .collect();
    let untouched = left.iter().filter(|p| !terminating(p)).count();
    ensure!(
        started.elapsed() < Duration::from_secs(55),
        "the test outlived the rate-limit window; its result would say nothing"
    );
    assert_eq!(metric(&agent, EVICTED).await, 2.0, "{}", agent.log());
    assert_eq!(
        untouched, 2,
        "exactly 2 of the 4 pods evicted within a minute"
    );
    let deferred: Vec<String> = left
        .iter()
        .filter(|p| !terminating(p))
        .map(|p| p.name_any())
        .collect();
    scene
        .wait_events(&deferred, "EvictDeferred", "rate limit (2 per minute)")
        .await?;
    Ok(())
}

#[tokio::test]
async fn a_restarted_agent_does_not_evict_again() -> anyhow::Result<()> {
    let scene = Scene::new("pods-restart").await?;
    let mut plan = Plan::new()?;
    let bad = plan.add("web", 2, Rules::None)?;
    let good = plan.add("good", 1, Rules::Linkerd("iptables-legacy"))?;
    // No kubelet stand-in: pods are moved to Running by hand, and evicted pods stay
    // terminating (nothing finalizes them), as on a node whose kubelet is slow.
    scene
        .create_rs(&replica_set("web", &scene.node, 2, false)?)
        .await?;
    let web: Vec<String> = poll_until("2 web pods", WAIT, || async {
        let pods = scene.app_pods("web").await?;
        let names: Vec<String> = pods.iter().map(ResourceExt::name_any).collect();
        anyhow::Ok((names.len() == 2).then_some(names))
    })
    .await?;
    for (name, ip) in web.iter().zip(&bad) {
        meshgate_e2e::mark_pod_running(&scene.client, &scene.ns, name, *ip).await?;
    }
    scene
        .create_pod(&bare_pod("good", &scene.node, true))
        .await?;
    meshgate_e2e::mark_pod_running(&scene.client, &scene.ns, "good", good[0]).await?;

    let mut agent = scene.start_agent(&[])?;
    wait_metric(&agent, EVICTED, |v| v >= 2.0).await?;
    let uids: Vec<String> = scene
        .pods()
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .filter(|p| web.contains(&p.name_any()))
        .inspect(|p| assert!(terminating(p), "{} is being evicted", p.name_any()))
        .filter_map(ResourceExt::uid)
        .collect();
    assert_eq!(uids.len(), 2);
    let state = std::fs::read_to_string(scene.dirs.scratch().join("state/state.json"))?;
    for uid in &uids {
        assert!(
            state.contains(uid.as_str()),
            "eviction of {uid} recorded: {state}"
        );
    }

    agent.kill9();
    agent.restart()?;
    // The new process inspected what is inspectable (the good pod) ...
    wait_metric(&agent, REDIRECTED, |v| v >= 1.0).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    // ... and evicted nothing, published nothing new.
    assert_eq!(metric(&agent, EVICTED).await, 0.0, "{}", agent.log());
    assert_eq!(
        metric(&agent, MISSING).await,
        0.0,
        "terminating pods are not inspected"
    );
    let events = scene.events().await?;
    for pod in &web {
        let seen: i32 = events.get(pod).map_or(0, |es| es.iter().map(|e| e.2).sum());
        assert_eq!(
            seen, 1,
            "one eviction Event for {pod}, none after the restart: {events:?}"
        );
    }
    assert!(
        plain(&agent.log())
            .lines()
            .any(|l| l.contains("agent{node=")
                && l.contains("state restored")
                && l.contains("evictions=2")),
        "the history was restored from the state file:\n{}",
        tail(&agent.log(), 40)
    );
    Ok(())
}
