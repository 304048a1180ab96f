//! `kubectl meshgate status` against the real control plane: its JSON and table name the
//! gated node, its reason and since when, the verified node's last untaint latency from its
//! Event, the pods without redirects and the evictions, the mode from the ConfigMap, and the
//! webhook reachable while it runs and unreachable once it stopped; and the latency the real
//! agent published on untainting its node.

use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::{Api, PostParams};
use meshgate_core::gate::DEFAULT_TAINT_KEY as TAINT_KEY;
use meshgate_e2e::{NodeSpec, unique_name};
use serde_json::{Value, json};

use super::{Ran, agent_event, condition, gated_node, run};
use crate::cp;
use crate::support::{Agent, CniDirs, golden, wait_node};
use crate::webhook::{Fixture, Start};
use meshgate_e2e::harness::wait::poll_until;
use meshgate_e2e::sim::node::tainted;

/// The entry of `list` whose `key` is `value`.
fn find<'a>(list: &'a Value, key: &str, value: &str) -> anyhow::Result<&'a Value> {
    list.as_array()
        .and_then(|a| a.iter().find(|v| v[key] == value))
        .ok_or_else(|| anyhow::anyhow!("no {key}={value} in {list}"))
}

#[tokio::test]
async fn status_reports_nodes_pods_evictions_mode_and_the_webhook() -> anyhow::Result<()> {
    let cp = cp().await;
    let start = Start {
        kubeconfig: cp.admin_kubeconfig_path().to_path_buf(),
        profile_file: None,
        tag_hooks: false,
        taint_key: Default::default(),
        mode: Default::default(),
    };
    let mut hook = Fixture::start_with(cp, "status", start).await?;
    let result = scenario(&mut hook).await;
    hook.teardown().await;
    result
}

/// What [`seed`] made: node names, the governed namespace of the pods and the probe,
/// meshgate's namespace (with the mode ConfigMap), the webhook configuration's name.
struct Seeded {
    gated: String,
    verified: String,
    ns: String,
    home: String,
    configuration: String,
}

async fn scenario(hook: &mut Fixture) -> anyhow::Result<()> {
    let seeded = seed(hook).await?;
    check_json(&seeded).await?;
    check_table(&seeded).await?;
    check_absent_and_stopped(hook, &seeded).await
}

/// Nodes, Events as the agent writes them, pods, the mode ConfigMap.
async fn seed(hook: &Fixture) -> anyhow::Result<Seeded> {
    let cp = cp().await;
    let client = &hook.client;
    let (gated, verified) = (unique_name("st-gated"), unique_name("st-ok"));
    gated_node(cp, client, &gated, TAINT_KEY, "ChainedPluginMissing").await?;
    let spec = NodeSpec::new(&verified).label(meshgate_core::gate::VERIFIED_LABEL, "true");
    cp.register_node(client, &spec).await?;
    condition(client, &verified, "True", "Verified", "chains linkerd-cni").await?;
    let node_ref = json!({"apiVersion": "v1", "kind": "Node", "name": verified, "uid": verified});
    let note = "Verified: chains linkerd-cni [untaint latency: 183 ms]";
    agent_event(
        client,
        "default",
        node_ref,
        "CNIChainVerified",
        "Untaint",
        note,
        &verified,
    )
    .await?;

    // Pods the agent judged: one evicted, one blocked by a PDB, in a governed namespace.
    let ns = hook.namespace(&[]).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    for (name, action, note) in [
        (
            "web-evicted",
            "Evict",
            "linkerd redirects missing; evicted, so that its controller recreates it on a verified node",
        ),
        (
            "web-blocked",
            "EvictBlocked",
            "linkerd redirects missing; not evicted: blocked by a PodDisruptionBudget; retrying with backoff",
        ),
    ] {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"nodeName": verified, "containers": [{"name": "app", "image": "registry.invalid/app:1"}]},
        }))?;
        let pod = pods.create(&PostParams::default(), &pod).await?;
        let pod_ref = json!({"apiVersion": "v1", "kind": "Pod", "namespace": ns, "name": name, "uid": pod.metadata.uid});
        agent_event(
            client,
            &ns,
            pod_ref,
            "MeshRedirectMissing",
            action,
            note,
            &verified,
        )
        .await?;
    }

    // meshgate's namespace (for the mode): a namespace of this test.
    let home = cp.create_namespace(client, "st-home").await?;
    let cm: ConfigMap = serde_json::from_value(
        json!({"metadata": {"name": "meshgate-mode"}, "data": {"mode": "report"}}),
    )?;
    Api::<ConfigMap>::namespaced(client.clone(), &home)
        .create(&PostParams::default(), &cm)
        .await?;
    let configuration = format!("meshgate-{}", hook.tag);
    Ok(Seeded {
        gated,
        verified,
        ns,
        home,
        configuration,
    })
}

/// Runs `status -o OUTPUT EXTRA...` on the seeded namespaces and configuration.
async fn status_with(s: &Seeded, output: &str, home: &str, extra: &[&str]) -> anyhow::Result<Ran> {
    let mut args = vec![
        "status",
        "-o",
        output,
        "-n",
        home,
        "--webhook-configuration",
        &s.configuration,
        "--probe-namespace",
        &s.ns,
    ];
    args.extend_from_slice(extra);
    run(cp().await.admin_kubeconfig_path(), &args).await
}

/// Runs `status -o OUTPUT` on the seeded namespaces and configuration.
async fn status(s: &Seeded, output: &str, home: &str) -> anyhow::Result<Ran> {
    status_with(s, output, home, &[]).await
}

/// The report of a `-o json` run.
fn parsed(ran: &Ran) -> anyhow::Result<Value> {
    serde_json::from_str(&ran.stdout).map_err(|e| anyhow::anyhow!("{e}: {ran}"))
}

async fn check_json(s: &Seeded) -> anyhow::Result<()> {
    let ran = status(s, "json", &s.home).await?;
    // A node is gated (this test's, and others' of the shared control plane): exit 1.
    anyhow::ensure!(ran.code == Some(1), "{ran}");
    // --webhook-only (the chart's helm test) judges the reachable webhook alone: exit 0.
    let webhook_only = status_with(s, "json", &s.home, &["--webhook-only"]).await?;
    anyhow::ensure!(webhook_only.code == Some(0), "{webhook_only}");
    let report = parsed(&ran)?;
    anyhow::ensure!(report["schema"] == "meshgate.io/status/v1", "{ran}");
    let g = find(&report["nodes"], "name", &s.gated)?;
    anyhow::ensure!(
        g["gated"] == true && g["taint"] == "NoSchedule" && g["label"] == "false",
        "{g}"
    );
    anyhow::ensure!(
        g["reason"] == "ChainedPluginMissing" && g["message"] == "does not chain linkerd-cni",
        "{g}"
    );
    anyhow::ensure!(g["since"].is_string() && g["last_untaint"].is_null(), "{g}");
    let v = find(&report["nodes"], "name", &s.verified)?;
    anyhow::ensure!(
        v["gated"] == false && v["condition"] == "True" && v["reason"] == "Verified",
        "{v}"
    );
    anyhow::ensure!(v["last_untaint"]["latency_ms"] == 183, "{v}");
    let evicted = find(&report["missing_pods"], "name", "web-evicted")?;
    let (ns, node) = (s.ns.as_str(), s.verified.as_str());
    anyhow::ensure!(
        evicted["namespace"] == ns && evicted["action"] == "Evict" && evicted["node"] == node,
        "{evicted}"
    );
    let blocked = find(&report["missing_pods"], "name", "web-blocked")?;
    anyhow::ensure!(blocked["action"] == "EvictBlocked", "{blocked}");
    let evictions = &report["evictions"];
    anyhow::ensure!(evictions["window_seconds"] == 3600, "{evictions}");
    let pods = evictions["pods"].as_array().into_iter().flatten();
    let ours: Vec<&Value> = pods.filter(|p| p["namespace"] == ns).collect();
    anyhow::ensure!(
        ours.len() == 1 && ours[0]["name"] == "web-evicted",
        "{evictions}"
    );
    anyhow::ensure!(
        report["mode"] == json!({"mode": "report", "source": "configmap"}),
        "{ran}"
    );
    anyhow::ensure!(report["webhook"]["state"] == "reachable", "{ran}");
    Ok(())
}

async fn check_table(s: &Seeded) -> anyhow::Result<()> {
    let ran = status(s, "table", &s.home).await?;
    anyhow::ensure!(ran.code == Some(1), "{ran}");
    let row = |name: &str| {
        let line = ran
            .stdout
            .lines()
            .find(|l| l.starts_with(&format!("{name} ")));
        line.map(|l| l.split_whitespace().collect::<Vec<_>>())
            .ok_or_else(|| anyhow::anyhow!("no row for {name}: {ran}"))
    };
    let g = row(&s.gated)?;
    anyhow::ensure!(
        g[1..5] == ["yes", "NoSchedule", "false", "ChainedPluginMissing"],
        "{ran}"
    );
    let v = row(&s.verified)?;
    anyhow::ensure!(
        v[1..5] == ["no", "-", "true", "Verified"] && v[6] == "183ms",
        "{ran}"
    );
    let pod_row =
        ran.stdout.contains(&format!("\n{} ", s.ns)) && ran.stdout.contains("web-evicted");
    anyhow::ensure!(pod_row, "{ran}");
    anyhow::ensure!(ran.stdout.contains("\nWEBHOOK: reachable ("), "{ran}");
    anyhow::ensure!(ran.stdout.contains("\nMODE: report (configmap)\n"), "{ran}");
    Ok(())
}

/// No such configuration: not installed. The webhook stops: the apiserver cannot call it,
/// and status says so; without the ConfigMap (another namespace), the mode is the default.
async fn check_absent_and_stopped(hook: &mut Fixture, s: &Seeded) -> anyhow::Result<()> {
    let kubeconfig = cp().await.admin_kubeconfig_path();
    let absent = format!("{}-absent", s.configuration);
    let ran = run(
        kubeconfig,
        &["status", "-o", "json", "--webhook-configuration", &absent],
    )
    .await?;
    anyhow::ensure!(
        parsed(&ran)?["webhook"]["state"] == "not-installed",
        "{ran}"
    );

    hook.stop_webhook().await?;
    let ran = status(s, "json", &s.ns).await?;
    anyhow::ensure!(ran.code == Some(1), "{ran}");
    let webhook_only = status_with(s, "json", &s.ns, &["--webhook-only"]).await?;
    anyhow::ensure!(webhook_only.code == Some(1), "{webhook_only}");
    let report = parsed(&ran)?;
    let webhook = &report["webhook"];
    anyhow::ensure!(webhook["state"] == "unreachable", "{ran}");
    // The shipped entries fail open: the probe was admitted, and the apiserver counted it.
    let detail = webhook["detail"].as_str().unwrap_or_default();
    anyhow::ensure!(detail.contains("fail_open_count rose"), "{ran}");
    anyhow::ensure!(
        report["mode"] == json!({"mode": "enforce", "source": "default"}),
        "{ran}"
    );
    Ok(())
}

/// The real agent untaints its node; its `CNIChainVerified` Event carries the latency its
/// histogram observed, and `status` reads it back from the API.
#[tokio::test]
async fn status_shows_the_untaint_latency_the_agent_published() -> anyhow::Result<()> {
    let cp = cp().await;
    let client = cp.client()?;
    let node = unique_name("st-agent");
    cp.register_node(&client, &NodeSpec::new(&node)).await?;
    let dirs = CniDirs::new()?;
    dirs.config("10-calico.conflist", &golden("calico.conflist")?)?;
    let agent = Agent::start(cp, &node, &dirs, &[])?;
    wait_node(&client, &node, "tainted", tainted).await?;
    dirs.config("10-calico.conflist", &golden("calico-linkerd.conflist")?)?;
    wait_node(&client, &node, "untainted", |n| !tainted(n)).await?;

    let kubeconfig = cp.admin_kubeconfig_path();
    let args = ["status", "-o", "json", "--no-webhook-probe"];
    let untaint = poll_until("the untaint in status", crate::WAIT, || async {
        let ran = run(kubeconfig, &args).await?;
        let report: Value =
            serde_json::from_str(&ran.stdout).map_err(|e| anyhow::anyhow!("{e}: {ran}"))?;
        anyhow::ensure!(report["webhook"].is_null(), "{ran}");
        let n = find(&report["nodes"], "name", &node)?;
        anyhow::Ok((!n["last_untaint"].is_null()).then(|| n["last_untaint"].clone()))
    })
    .await?;
    let observed = agent
        .metric("meshgate_untaint_latency_seconds_sum")
        .await
        .ok_or_else(|| anyhow::anyhow!("no untaint latency on /metrics: {}", agent.log()))?;
    let shown = untaint["latency_ms"].as_f64().unwrap_or(-1.0);
    // The note holds whole milliseconds of the histogram's one observation.
    anyhow::ensure!(
        (observed * 1000.0 - shown) >= 0.0 && (observed * 1000.0 - shown) < 1.0,
        "status shows {untaint}, the histogram observed {observed} s"
    );
    Ok(())
}
