//! The live mode and the pod inspector: report mode evicts nothing and says "would evict";
//! a switch to condition-only, without a restart, evicts as enforce does.

use super::*;

const WOULD_EVICT: &str = "meshgate_report_only_actions_total{action=\"evict\"}";

#[tokio::test]
async fn report_mode_evicts_nothing_and_condition_only_evicts_after_a_live_switch()
-> anyhow::Result<()> {
    let scene = Scene::new("pods-mode").await?;
    crate::modes::set_mode(&scene.client, &scene.ns, "report").await?;
    let mut plan = Plan::new()?;
    plan.add("web", 1, Rules::None)?;
    // The replacement lands in a namespace the chained plugin set up.
    plan.add("web", 1, Rules::Linkerd("iptables-nft"))?;
    let _kubelet = cp().await.run_pods(&scene.node, plan.ip_source());
    let agent = scene.start_agent(&["--namespace", &scene.ns])?;
    scene
        .create_rs(&replica_set("web", &scene.node, 1, false)?)
        .await?;

    wait_metric(&agent, WOULD_EVICT, |v| v >= 1.0).await?;
    let pods = scene.app_pods("web").await?;
    let names: Vec<String> = pods.iter().map(ResourceExt::name_any).collect();
    scene
        .wait_events(&names, "WouldEvict", "would evict")
        .await?;
    assert_eq!(metric(&agent, EVICTED).await, 0.0);
    assert_eq!(metric(&agent, &skipped("dry_run")).await, 0.0);
    let pods = scene.app_pods("web").await?;
    assert!(
        pods.len() == 1 && running(&pods[0]) && names.contains(&pods[0].name_any()),
        "report mode evicted: {names:?}"
    );

    // Live switch: the same agent evicts the pod it only reported.
    let pid = agent.pid();
    crate::modes::set_mode(&scene.client, &scene.ns, "condition-only").await?;
    wait_metric(&agent, EVICTED, |v| v >= 1.0).await?;
    scene.wait_events(&names, "Evict", "evicted").await?;
    assert_eq!(agent.pid(), pid);
    assert_eq!(metric(&agent, WOULD_EVICT).await, 1.0);
    Ok(())
}
