//! What is reported and never evicted: a busy node under no-evict, several PDBs, the mesh
//! label without a proxy, and ambient pods by their namespace's label.

use super::*;
use k8s_openapi::api::core::v1::Namespace;

/// The pods of the busy node.
const PODS: usize = 60;

#[tokio::test]
async fn no_evict_reports_every_pod_of_a_busy_node() -> anyhow::Result<()> {
    let scene = Scene::new("pods-busy").await?;
    let mut plan = Plan::new()?;
    let missing = plan.add("busy", PODS / 2, Rules::None)?;
    plan.add("busy", PODS / 4, Rules::Linkerd("iptables-nft"))?;
    plan.add("busy", PODS / 4, Rules::Linkerd("iptables-legacy"))?;
    let agent = scene.start_agent(&["--no-evict"])?;
    let idle_rss = poll_until("the agent to be ready", WAIT, || async {
        anyhow::Ok(
            agent
                .admin_get("/ready")
                .await
                .filter(|r| r.0 == 200)
                .map(|_| agent.rss_kib()),
        )
    })
    .await?;
    let _kubelet = cp().await.run_pods(&scene.node, plan.ip_source());
    let started = Instant::now();
    scene
        .create_rs(&replica_set("busy", &scene.node, PODS as i32, false)?)
        .await?;

    let half = (PODS / 2) as f64;
    wait_metric(&agent, MISSING, |v| v >= half).await?;
    wait_metric(&agent, REDIRECTED, |v| v >= half).await?;
    let all_seen = started.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    reported_without_a_skip(&agent).await;
    every_pod_runs_and_those_without_rules_are_reported(&scene, &missing).await?;
    report_busy(&agent, all_seen, idle_rss).await;
    drop(plan);
    Ok(())
}

/// Half the pods missing, half redirected, none unknown; nothing evicted, and report-only is
/// no skip.
async fn reported_without_a_skip(agent: &Agent) {
    let half = (PODS / 2) as f64;
    assert_eq!(metric(agent, MISSING).await, half, "{}", agent.log());
    assert_eq!(metric(agent, REDIRECTED).await, half);
    assert_eq!(metric(agent, UNKNOWN).await, 0.0);
    assert_eq!(
        metric(agent, EVICTED).await,
        0.0,
        "--no-evict evicts nothing"
    );
    for why in ["pdb", "rate_limit", "dry_run", "unowned"] {
        assert_eq!(
            metric(agent, &skipped(why)).await,
            0.0,
            "report-only is no skip: {why}"
        );
    }
}

/// Every pod still runs, and each without rules got one report-only Event, the others none.
async fn every_pod_runs_and_those_without_rules_are_reported(
    scene: &Scene,
    missing: &[IpAddr],
) -> anyhow::Result<()> {
    let pods = scene.app_pods("busy").await?;
    assert_eq!(pods.len(), PODS);
    assert!(pods.iter().all(running), "nothing evicted");
    let reported: Vec<String> = pods
        .iter()
        .filter(|p| pod_ip(p).is_some_and(|ip| missing.contains(&ip)))
        .map(ResourceExt::name_any)
        .collect();
    assert_eq!(reported.len(), PODS / 2);
    scene
        .wait_events(&reported, "ReportOnly", "report only")
        .await?;
    assert_eq!(
        scene.events().await?.len(),
        PODS / 2,
        "Events only about the pods without rules"
    );
    Ok(())
}

/// Prints the inspection and survey times and the agent's RSS, idle and loaded.
async fn report_busy(agent: &Agent, all_seen: Duration, idle_rss: Option<u64>) {
    let rss = agent.rss_kib();
    let sum = metric(agent, "meshgate_pod_inspection_seconds_sum").await;
    let log = plain(&agent.log());
    let surveys: Vec<u64> = log
        .lines()
        .filter(|l| l.contains("inspection batch"))
        .filter_map(|l| {
            l.split("survey_us=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect();
    eprintln!(
        "[pods] busy node: {PODS} meshed pods inspected within {:.1}s of the ReplicaSet's creation; \
         mean inspection {:.0} µs per pod; {} batches, namespace survey per batch p50 {} µs max {} µs; \
         agent RSS idle {idle_rss:?} KiB -> loaded {rss:?} KiB",
        all_seen.as_secs_f64(),
        sum / PODS as f64 * 1e6,
        surveys.len(),
        {
            let mut s = surveys.clone();
            s.sort_unstable();
            s.get(s.len() / 2).copied().unwrap_or(0)
        },
        surveys.iter().max().copied().unwrap_or(0),
    );
}

#[tokio::test]
async fn several_pdbs_on_one_pod_are_reported_and_nothing_is_evicted() -> anyhow::Result<()> {
    let scene = Scene::new("pods-pdbs").await?;
    let mut plan = Plan::new()?;
    plan.add("double", 1, Rules::None)?;
    let _kubelet = cp().await.run_pods(&scene.node, plan.ip_source());
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(scene.client.clone(), &scene.ns);
    for name in ["first", "second"] {
        // Each alone would allow the eviction; together the Eviction API refuses (500).
        let pdb: PodDisruptionBudget = serde_json::from_value(json!({
            "metadata": { "name": name },
            "spec": { "maxUnavailable": 1, "selector": { "matchLabels": { "app": "double" } } }
        }))?;
        pdbs.create(&PostParams::default(), &pdb).await?;
    }
    scene
        .create_rs(&replica_set("double", &scene.node, 1, false)?)
        .await?;
    let agent = scene.start_agent(&[])?;
    wait_metric(&agent, &skipped("pdb"), |v| v >= 1.0).await?;
    let pods = scene.app_pods("double").await?;
    let names: Vec<String> = pods.iter().map(ResourceExt::name_any).collect();
    assert!(
        pods.len() == 1 && running(&pods[0]),
        "not evicted: {names:?}"
    );
    scene
        .wait_events(&names, "EvictBlocked", "more than one PodDisruptionBudget")
        .await?;
    assert_eq!(metric(&agent, EVICTED).await, 0.0);
    assert!(
        plain(&agent.log()).contains("several PodDisruptionBudgets match the pod"),
        "{}",
        agent.log()
    );
    Ok(())
}

/// A pod labelled for linkerd whose injection never happened (no `linkerd-proxy`
/// container): linkerd-cni skips such a pod too, so its rules are missing, and a recreated
/// pod would be the same. It is reported once (Event, `no_proxy` skip), never evicted, and
/// never inspected again for the same sandbox; a pod of the same node that does run the
/// proxy is still evicted.
#[tokio::test]
async fn a_pod_with_the_mesh_label_but_no_proxy_is_reported_never_evicted() -> anyhow::Result<()> {
    let scene = Scene::new("pods-noproxy").await?;
    let mut plan = Plan::new()?;
    plan.add("labelled", 2, Rules::None)?;
    plan.add("web", 1, Rules::None)?;
    plan.add("web", 1, Rules::Linkerd("iptables-nft"))?;
    let _kubelet = cp().await.run_pods(&scene.node, plan.ip_source());
    scene
        .create_rs(&bare_replica_set("labelled", &scene.node, 2, false)?)
        .await?;
    scene
        .create_rs(&replica_set("web", &scene.node, 1, false)?)
        .await?;
    let agent = scene.start_agent(&[])?;

    wait_metric(&agent, &skipped("no_proxy"), |v| v >= 2.0).await?;
    wait_metric(&agent, EVICTED, |v| v >= 1.0).await?;
    let labelled: Vec<String> = scene
        .app_pods("labelled")
        .await?
        .iter()
        .map(ResourceExt::name_any)
        .collect();
    assert_eq!(labelled.len(), 2);
    scene
        .wait_events(&labelled, "ReportNoProxy", "no linkerd-proxy container")
        .await?;

    // No loop: nothing more happens to them, whatever the time.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        metric(&agent, &skipped("no_proxy")).await,
        2.0,
        "{}",
        agent.log()
    );
    assert_eq!(metric(&agent, EVICTED).await, 1.0, "{}", agent.log());
    // 2 labelled + 1 web missing, inspected once each; the web replacement redirected.
    assert_eq!(metric(&agent, MISSING).await, 3.0, "{}", agent.log());
    let now: Vec<Pod> = scene.app_pods("labelled").await?;
    assert!(
        now.iter()
            .all(|p| running(p) && labelled.contains(&p.name_any())),
        "the labelled pods were left alone: {:?}",
        now.iter().map(ResourceExt::name_any).collect::<Vec<_>>()
    );
    let events = scene.events().await?;
    for p in &labelled {
        let observed: i32 = events.get(p).map_or(0, |es| es.iter().map(|e| e.2).sum());
        assert_eq!(observed, 1, "one Event per sandbox for {p}: {events:?}");
    }
    Ok(())
}

const AMBIENT_MISSING: &str =
    "meshgate_pod_inspections_total{profile=\"istio-ambient\",verdict=\"missing\"}";

/// A ReplicaSet of pause pods as Istio ambient leaves them: no mesh label or sidecar of
/// their own, `extra` pod labels.
fn plain_replica_set(name: &str, node: &str, extra: &[(&str, &str)]) -> anyhow::Result<ReplicaSet> {
    let mut labels = serde_json::Map::new();
    labels.insert("app".into(), json!(name));
    for (k, v) in extra {
        labels.insert((*k).into(), json!(v));
    }
    Ok(serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": {
            "replicas": 1,
            "selector": { "matchLabels": { "app": name } },
            "template": {
                "metadata": { "labels": labels },
                "spec": {
                    "nodeName": node,
                    "terminationGracePeriodSeconds": 30,
                    "containers": [{ "name": "app", "image": "registry.k8s.io/pause:3.10" }]
                }
            }
        }
    }))?)
}

/// `istio-ambient` selects as Istio enrolls: pods of a namespace labelled
/// `istio.io/dataplane-mode=ambient` (read by the agent's namespace watch, before any
/// istio-cni annotation exists), except a pod labelled `istio.io/dataplane-mode=none`; and a
/// namespace labelled later brings its running pods in at once.
#[tokio::test]
async fn ambient_pods_are_selected_by_their_namespace_label_and_the_opt_out_holds()
-> anyhow::Result<()> {
    let scene = Scene::new("pods-ambient").await?;
    // The node chains istio-cni, as an ambient install leaves it.
    scene.dirs.plugin("istio-cni", GOOD_PLUGIN)?;
    scene
        .dirs
        .config("10-calico.conflist", &golden("istio-cni.conflist")?)?;
    let namespaces: Api<Namespace> = Api::all(scene.client.clone());
    label_ambient(&namespaces, &scene.ns).await?;
    let late_ns = scene
        .cp
        .create_namespace(&scene.client, "pods-ambient-late")
        .await?;

    let mut plan = Plan::new()?;
    plan.add("amb", 1, Rules::None)?;
    plan.add("optout", 1, Rules::None)?;
    plan.add("late", 1, Rules::None)?;
    let _kubelet = cp().await.run_pods(&scene.node, plan.ip_source());
    three_pods_run(&scene, &late_ns).await?;
    let agent = scene.start_agent_with(&["--profile", "istio-ambient", "--dry-run"])?;
    only_the_enrolled_pod_is_judged(&scene, &agent).await?;
    late_namespace_is_judged_after_the_grace(&scene, &agent, &namespaces, &late_ns).await
}

/// Labels namespace `ns` into ambient.
async fn label_ambient(namespaces: &Api<Namespace>, ns: &str) -> kube::Result<Namespace> {
    namespaces
        .patch(
            ns,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"istio.io/dataplane-mode": "ambient"}}})),
        )
        .await
}

/// In the ambient namespace a pod and an opted-out pod, in `late_ns` (not yet ambient) a
/// third; all running.
async fn three_pods_run(scene: &Scene, late_ns: &str) -> anyhow::Result<()> {
    scene
        .create_rs(&plain_replica_set("amb", &scene.node, &[])?)
        .await?;
    scene
        .create_rs(&plain_replica_set(
            "optout",
            &scene.node,
            &[("istio.io/dataplane-mode", "none")],
        )?)
        .await?;
    let late_pods: Api<Pod> = Api::namespaced(scene.client.clone(), late_ns);
    Api::<ReplicaSet>::namespaced(scene.client.clone(), late_ns)
        .create(
            &PostParams::default(),
            &plain_replica_set("late", &scene.node, &[])?,
        )
        .await?;
    poll_until("every pod running", WAIT, || async {
        let here = scene.pods().list(&ListParams::default()).await?.items;
        let there = late_pods.list(&ListParams::default()).await?.items;
        anyhow::Ok(
            (here.iter().filter(|p| running(p)).count() == 2
                && there.iter().filter(|p| running(p)).count() == 1)
                .then_some(()),
        )
    })
    .await?;
    Ok(())
}

/// Only the ambient namespace's pod is judged (missing, reported in dry run), not its
/// opted-out one nor the unlabelled namespace's.
async fn only_the_enrolled_pod_is_judged(scene: &Scene, agent: &Agent) -> anyhow::Result<()> {
    wait_metric(agent, AMBIENT_MISSING, |v| v >= 1.0).await?;
    let amb: Vec<String> = scene
        .app_pods("amb")
        .await?
        .iter()
        .map(ResourceExt::name_any)
        .collect();
    scene
        .wait_events(&amb, "DryRun", "istio-ambient redirects missing")
        .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        metric(agent, AMBIENT_MISSING).await,
        1.0,
        "only the ambient namespace's pod, not its opted-out one nor the unlabelled namespace's:\n{}",
        agent.log()
    );
    Ok(())
}

/// The other namespace joins ambient: its running pod is inspected without any pod
/// event, but only once Istio has had ENROLL_GRACE to enroll it (it adds running pods
/// asynchronously): not at once, where it would be judged (and evicted) as missing.
/// Its pod is judged then; the opted-out pod is never reported.
async fn late_namespace_is_judged_after_the_grace(
    scene: &Scene,
    agent: &Agent,
    namespaces: &Api<Namespace>,
    late_ns: &str,
) -> anyhow::Result<()> {
    label_ambient(namespaces, late_ns).await?;
    let labelled = Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        metric(agent, AMBIENT_MISSING).await,
        1.0,
        "a running pod was inspected right after its namespace joined the mesh:\n{}",
        agent.log()
    );
    wait_metric(agent, AMBIENT_MISSING, |v| v >= 2.0).await?;
    assert!(
        labelled.elapsed() >= meshgate_agent::daemon::pods::tracker::ENROLL_GRACE,
        "inspected {:?} after the label, before the enrollment grace",
        labelled.elapsed()
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(metric(agent, AMBIENT_MISSING).await, 2.0, "{}", agent.log());
    assert_eq!(metric(agent, &skipped("dry_run")).await, 2.0);
    let events = scene.events().await?;
    let optout: Vec<String> = scene
        .app_pods("optout")
        .await?
        .iter()
        .map(ResourceExt::name_any)
        .collect();
    assert!(
        optout.iter().all(|p| !events.contains_key(p)),
        "the opted-out pod is never reported: {events:?}"
    );
    Ok(())
}
