//! Istio ambient on a real node: meshgate installed from its chart with the `istio-ambient`
//! profile, Istio's real istio-cni node agent (built from the pinned istio module, deployed as
//! Istio's chart deploys it, `meshgate_e2e::real::ambient`) installing its plugin and serving
//! ztunnel's ZDS socket, and a stand-in ztunnel pod (`e2e/ztunnel-standin`) with ztunnel's
//! labels, readiness probe and socket directory, which speaks ZDS with the node agent and
//! opens ztunnel's listeners in each pod's netns. docs/testing.md, "Istio ambient's ztunnel",
//! says what is real and what is stood in.
//!
//! The steps are in two groups. The first holds with the node-level check of pod Ready and
//! socket present; the second (after the line in [`ambient_steps`]) asserts the node
//! proxy contract's "connected" check and pod-level listener rule (COMMON contract of issue
//! 21: reason `NodeProxyNotReady`, a pod Redirected only with ztunnel's listeners in its netns,
//! never evicted for missing listeners while the node proxy is not ready).
//!
//! In: root, the node binaries and images `e2e/install-deps.sh` caches (the ambient images
//! among them), meshgate's image. Out: pass/fail, and the timeline with its latencies.

use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::{Client, ResourceExt};
use meshgate_e2e::harness::wait::{self, poll_until};
use meshgate_e2e::real::ambient::{
    self, ISTIO_CNI_DAEMONSET, ISTIO_NAMESPACE, StandinMode, ZTUNNEL_DAEMONSET, ZTUNNEL_SOCKET,
};
use meshgate_e2e::real::cluster::{RealCluster, is_ready};
use meshgate_e2e::real::node::{BUSYBOX_IMAGE, RealNode};
use meshgate_e2e::real::story::{all_running, app_pid, container_pid, in_netns};
use meshgate_e2e::sim::node::{gate_condition, http_get, metric_sample, tainted};
use serde_json::json;

use crate::real_node::ONE_NODE;

/// The ambient profile's values, over the real node's (docs/operations.md's snippet).
const AMBIENT_VALUES: &str = "e2e/chart/real-node-ambient-values.yaml";
/// The namespace enrolled into ambient.
const APP_NS: &str = "ambient-app";
/// A pod start, an install or an agent's reaction gets this long.
const STEP: Duration = Duration::from_secs(90);
/// ztunnel's in-pod listeners.
const ZTUNNEL_PORTS: [u16; 3] = [15008, 15006, 15001];
const REDIRECTED: &str =
    "meshgate_pod_inspections_total{profile=\"istio-ambient\",verdict=\"redirected\"}";
const MISSING: &str =
    "meshgate_pod_inspections_total{profile=\"istio-ambient\",verdict=\"missing\"}";
const EVICTED: &str = "meshgate_pods_evicted_total{profile=\"istio-ambient\"}";

#[tokio::test]
async fn ambient_on_a_real_kubelet_is_gated_on_ztunnel_with_the_real_istio_cni()
-> anyhow::Result<()> {
    let _one = ONE_NODE.lock().await;
    let cluster = RealCluster::start().await?;
    let outcome = ambient_steps(&cluster).await;
    if let Err(e) = outcome {
        let a = cluster.meshgate_logs();
        bail!("{e:#}\n\n{a}");
    }
    // The residue means something only once the node stopped.
    drop(cluster);
    let left = meshgate_e2e::real::node::host_residue();
    ensure!(left.is_empty(), "left behind: {left:?}");
    Ok(())
}

async fn ambient_steps(cluster: &RealCluster) -> anyhow::Result<()> {
    let client = cluster.control_plane().client()?;
    let a = cluster.add_node().await?;
    a.import_ambient_images().await?;
    a.make_node_proc().await?;
    let t = Instant::now();
    let say = |line: &str| eprintln!("[{:>7.3}s] {line}", t.elapsed().as_secs_f64());
    let fail_with_logs = |e: anyhow::Error| {
        anyhow::anyhow!(
            "{e:#}\nistio-system's logs:\n{}",
            a.pod_logs(ISTIO_NAMESPACE)
        )
    };

    // 1. meshgate with the ambient profile: gated, istio-cni is not chained yet.
    cluster.install_meshgate_with(&[AMBIENT_VALUES]).await?;
    let (_, reason, _) = gated(&client, &a, None).await?;
    say(&format!(
        "meshgate installed with istio-ambient: {} gated ({reason})",
        a.name()
    ));

    // 2. istio-cni's node agent, for real: it chains its plugin and listens on ztunnel's socket;
    //    with no ztunnel the node stays gated, now for the node proxy.
    create_namespace(&client, ISTIO_NAMESPACE, false).await?;
    ambient::create(&client, &ambient::istio_cni_objects()).await?;
    let began = Instant::now();
    ready_pod(&client, &format!("k8s-app={ISTIO_CNI_DAEMONSET}"))
        .await
        .map_err(fail_with_logs)?;
    say(&format!(
        "istio-cni-node Ready in {:.1}s",
        began.elapsed().as_secs_f64()
    ));
    let conf: serde_json::Value = serde_json::from_slice(&std::fs::read(a.conflist_path())?)?;
    let entry = conf["plugins"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["type"] == "istio-cni"))
        .with_context(|| format!("the node agent did not chain istio-cni: {conf}"))?;
    ensure!(
        entry["ambient_enabled"] == true,
        "istio-cni's entry is not ambient: {entry}"
    );
    let socks = a.unix_sockets(ZTUNNEL_SOCKET).await?;
    ensure!(
        socks.iter().any(|s| s.state == "LISTEN"),
        "the node agent does not listen on {ZTUNNEL_SOCKET} in the node's netns: {socks:?}"
    );
    let (_, reason, message) = gated(&client, &a, Some("NodeProxyNotReady")).await?;
    say(&format!(
        "istio-cni chained (ambient_enabled) and listening on {ZTUNNEL_SOCKET}; no ztunnel: gated, NodeProxyNotReady: {message}"
    ));
    ensure!(reason == "NodeProxyNotReady");

    // 3. The stand-in ztunnel: Ready once connected; the node is verified then.
    let began = Instant::now();
    ambient::create(
        &client,
        &[ambient::ztunnel_daemonset(StandinMode::Connected)],
    )
    .await?;
    let zt = ready_pod(&client, "app=ztunnel")
        .await
        .map_err(fail_with_logs)?;
    let ready_after = began.elapsed();
    verified(&client, &a).await?;
    say(&format!(
        "ztunnel stand-in {} Ready {:.1}s after its DaemonSet, node verified {:.1}s after it",
        zt.name_any(),
        ready_after.as_secs_f64(),
        began.elapsed().as_secs_f64()
    ));
    // Where ztunnel's connection shows: the kernel creates the accepted end of a unix
    // connection in the CONNECTING socket's network namespace (af_unix `unix_stream_connect`),
    // with the listener's address. ztunnel runs in a netns of its own, so both ends are in its
    // pod's netns, and the node's (where the hostNetwork node agent listens) shows only the
    // listener.
    let in_node = a.unix_sockets(ZTUNNEL_SOCKET).await?;
    let zt_pid = container_pid(&a, &zt, "istio-proxy").await?;
    let in_ztunnel: Vec<String> = in_netns(zt_pid, &["ss", "-xaH"])
        .await?
        .lines()
        .filter(|l| l.contains(ZTUNNEL_SOCKET))
        .map(str::to_owned)
        .collect();
    ensure!(
        in_ztunnel.iter().any(|l| l.contains("ESTAB")),
        "ztunnel's connection is not an ESTABLISHED socket on {ZTUNNEL_SOCKET} in ztunnel's netns: {in_ztunnel:?}"
    );
    say(&format!(
        "ztunnel's connection: in ztunnel's pod netns {in_ztunnel:?}; in the node's netns {in_node:?}"
    ));

    // 4. An ambient pod: istio-cni writes its in-pod redirection, the stand-in its listeners,
    //    and the agent judges it Redirected.
    let agent = cluster.agent_admin(&a);
    create_namespace(&client, APP_NS, true).await?;
    let pod = run_pod(&client, &a, "ambient-1", json!({}))
        .await
        .map_err(fail_with_logs)?;
    let pid = app_pid(&a, &pod).await?;
    let rules = in_netns(pid, &["iptables-save"]).await?;
    ensure!(
        rules.contains("ISTIO_PRERT") && rules.contains("ISTIO_OUTPUT"),
        "istio-cni's in-pod rules are not in the pod's netns:\n{rules}"
    );
    listeners_within(pid, true).await?;
    let pod = wait_annotation(&client, &pod.name_any(), "enabled").await?;
    wait_metric(agent, REDIRECTED, 1.0).await?;
    say(&format!(
        "ambient pod {} (pid {pid}): istio-cni's ISTIO_PRERT/ISTIO_OUTPUT in its netns, the stand-in listens on {ZTUNNEL_PORTS:?} there, ambient.istio.io/redirection=enabled; the agent judged it redirected",
        pod.name_any()
    ));

    // 4b. A pod that opts out of inbound capture: istio-cni's node agent writes its outbound
    //     redirect only; the agent judges it redirected and never evicts it.
    bypass_inbound_pod(&client, &a, agent)
        .await
        .map_err(fail_with_logs)?;
    say(
        "an ambient pod with ambient.istio.io/bypass-inbound-capture=true: istio-cni wrote outbound only; judged redirected, never missing, not evicted",
    );

    // 5. ztunnel's pod deleted: the node is gated at once, and verified again once its
    //    replacement (the DaemonSet's) is Ready and connected; the pod is never evicted.
    let pods: Api<Pod> = Api::namespaced(client.clone(), ISTIO_NAMESPACE);
    let deleted = Instant::now();
    wait::api(
        "deleting ztunnel's pod",
        pods.delete(&zt.name_any(), &DeleteParams::default()),
    )
    .await?;
    let (_, reason, message) = gated(&client, &a, Some("NodeProxyNotReady")).await?;
    let regated = deleted.elapsed();
    verified(&client, &a).await?;
    let back = deleted.elapsed();
    say(&format!(
        "ztunnel's pod deleted: gated after {} ms ({reason}: {message}); verified again {:.1}s after the delete",
        regated.as_millis(),
        back.as_secs_f64()
    ));
    ensure!(
        regated < Duration::from_secs(10),
        "re-gated only after {regated:?}"
    );
    listeners_within(pid, true).await?;
    still_running(&client, &pod).await?;
    wait_metric(agent, EVICTED, 0.0).await?;
    ensure!(
        metric(agent, EVICTED).await? == 0.0,
        "the agent evicted an ambient pod while ztunnel restarted"
    );
    say(
        "the new stand-in got the pod again in the node agent's snapshot: its listeners are back, the pod was never evicted",
    );

    // ---- Below: the node proxy contract's "connected" check and pod-level listener rule. ----
    // 6. A ztunnel whose pod is Ready but that never connected: the node is gated
    //    (NodeProxyNotReady, the message naming the connection), the pod lost its listeners and
    //    is reported missing, but not evicted while the node proxy is not ready.
    let missing_before = metric(agent, MISSING).await?;
    replace_standin(&client, StandinMode::ReadyUnconnected).await?;
    ready_pod(&client, "app=ztunnel").await?;
    listeners_within(pid, false).await?;
    let (_, reason, message) = gated(&client, &a, Some("NodeProxyNotReady")).await?;
    ensure!(
        message.to_lowercase().contains("connect"),
        "the NodeProxyNotReady message does not say ztunnel is not connected: {message:?}"
    );
    hold_gated(&client, &a, Duration::from_secs(3)).await?;
    wait_metric(agent, MISSING, missing_before + 1.0).await?;
    still_running(&client, &pod).await?;
    ensure!(
        metric(agent, EVICTED).await? == 0.0,
        "evicted while ztunnel was not connected"
    );
    say(&format!(
        "a Ready but unconnected ztunnel keeps the node gated ({reason}: {message}); the pod without listeners is reported missing, not evicted"
    ));
    Ok(())
}

/// An ambient pod annotated `ambient.istio.io/bypass-inbound-capture: "true"` on `node`: the
/// real node agent's rules in its netns redirect outbound to 15001 and nothing inbound, and
/// the agent judges it redirected (its missing count stays, nothing is evicted) over a hold.
async fn bypass_inbound_pod(
    client: &Client,
    node: &RealNode,
    agent: std::net::SocketAddr,
) -> anyhow::Result<()> {
    let (missing, redirected) = (
        metric(agent, MISSING).await?,
        metric(agent, REDIRECTED).await?,
    );
    let key = meshgate_core::meshes::istio_ambient::AMBIENT_BYPASS_INBOUND;
    let bypass =
        serde_json::Value::Object([(key.to_string(), json!("true"))].into_iter().collect());
    let pod = run_pod(client, node, "ambient-ingress", bypass).await?;
    let pid = app_pid(node, &pod).await?;
    let nat = in_netns(pid, &["iptables-save", "-t", "nat"]).await?;
    ensure!(
        nat.contains("-j ISTIO_PRERT")
            && nat.contains("--to-ports 15001")
            && !nat.contains("--to-ports 15006"),
        "istio-cni's in-pod rules for an inbound bypass are not outbound-only:\n{nat}"
    );
    listeners_within(pid, true).await?;
    wait_annotation(client, &pod.name_any(), "enabled").await?;
    wait_metric(agent, REDIRECTED, redirected + 1.0).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    still_running(client, &pod).await?;
    ensure!(
        metric(agent, MISSING).await? == missing && metric(agent, EVICTED).await? == 0.0,
        "the agent judged the inbound-bypass pod missing or evicted a pod"
    );
    Ok(())
}

/// Waits until the node is gated (tainted, condition False), with `reason` when given.
async fn gated(
    client: &Client,
    node: &RealNode,
    reason: Option<&str>,
) -> anyhow::Result<(String, String, String)> {
    let nodes: Api<Node> = Api::all(client.clone());
    let what = format!("{} gated ({})", node.name(), reason.unwrap_or("any reason"));
    Ok(poll_until(&what, STEP, || async {
        let n = nodes.get(node.name()).await?;
        let c = gate_condition(&n);
        let hit = tainted(&n)
            && c.as_ref()
                .is_some_and(|c| c.0 == "False" && reason.is_none_or(|r| c.1 == r));
        anyhow::Ok(if hit { c } else { None })
    })
    .await?)
}

/// The node stays gated for `span`.
async fn hold_gated(client: &Client, node: &RealNode, span: Duration) -> anyhow::Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    let began = Instant::now();
    while began.elapsed() < span {
        let n = wait::api("reading the node", nodes.get(node.name())).await?;
        ensure!(
            tainted(&n),
            "{} was untainted: {:?}",
            node.name(),
            gate_condition(&n)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

async fn verified(client: &Client, node: &RealNode) -> anyhow::Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    poll_until(&format!("{} verified", node.name()), STEP, || async {
        let n = nodes.get(node.name()).await?;
        let ok = !tainted(&n) && gate_condition(&n).is_some_and(|c| c.0 == "True");
        anyhow::Ok(ok.then_some(()))
    })
    .await?;
    Ok(())
}

async fn create_namespace(client: &Client, name: &str, ambient: bool) -> anyhow::Result<()> {
    let nss: Api<Namespace> = Api::all(client.clone());
    let labels = if ambient {
        json!({"istio.io/dataplane-mode": "ambient"})
    } else {
        json!({})
    };
    let ns: Namespace =
        serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}}))?;
    wait::api(
        "creating a namespace",
        nss.create(&PostParams::default(), &ns),
    )
    .await?;
    Ok(())
}

/// The one Ready, not deleting pod of `istio-system` with `labels`.
async fn ready_pod(client: &Client, labels: &str) -> anyhow::Result<Pod> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ISTIO_NAMESPACE);
    let lp = ListParams::default().labels(labels);
    Ok(
        poll_until(&format!("a Ready {labels} pod"), STEP, || async {
            let list = pods.list(&lp).await?;
            anyhow::Ok(
                list.items
                    .into_iter()
                    .find(|p| is_ready(p) && p.metadata.deletion_timestamp.is_none()),
            )
        })
        .await?,
    )
}

/// Replaces the stand-in's DaemonSet with one in `mode`, once the old pods are gone.
async fn replace_standin(client: &Client, mode: StandinMode) -> anyhow::Result<()> {
    let dss: Api<DaemonSet> = Api::namespaced(client.clone(), ISTIO_NAMESPACE);
    let dp = DeleteParams::foreground();
    wait::api(
        "deleting ztunnel's DaemonSet",
        dss.delete(ZTUNNEL_DAEMONSET, &dp),
    )
    .await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ISTIO_NAMESPACE);
    poll_until("ztunnel's pods gone", STEP, || async {
        let gone = pods
            .list(&ListParams::default().labels("app=ztunnel"))
            .await?
            .items
            .is_empty()
            && dss.get_opt(ZTUNNEL_DAEMONSET).await?.is_none();
        anyhow::Ok(gone.then_some(()))
    })
    .await?;
    ambient::create(client, &[ambient::ztunnel_daemonset(mode)]).await?;
    Ok(())
}

/// A busybox pod in the ambient namespace, bound to `node`, running.
async fn run_pod(
    client: &Client,
    node: &RealNode,
    name: &str,
    annotations: serde_json::Value,
) -> anyhow::Result<Pod> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), APP_NS);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"app": name}, "annotations": annotations},
        "spec": {
            "nodeName": node.name(),
            "automountServiceAccountToken": false,
            "enableServiceLinks": false,
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "app", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
                            "command": ["/bin/sleep", "3600"]}]
        }
    }))?;
    wait::api(
        "creating the ambient pod",
        pods.create(&PostParams::default(), &pod),
    )
    .await?;
    let got = poll_until(&format!("pod {APP_NS}/{name} running"), STEP, || async {
        let p = pods.get(name).await?;
        anyhow::Ok(all_running(&p).then_some(p))
    })
    .await;
    match got {
        Ok(p) => Ok(p),
        Err(e) => {
            let last = pods.get(name).await.ok().and_then(|p| p.status);
            bail!(
                "{e}\nlast status: {last:?}\nkubelet:\n{}",
                node.log_tail("kubelet", 20)
            )
        }
    }
}

/// Waits until istio-cni's node agent annotated the pod `ambient.istio.io/redirection=value`.
async fn wait_annotation(client: &Client, name: &str, value: &str) -> anyhow::Result<Pod> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), APP_NS);
    Ok(poll_until(
        &format!("{name} annotated redirection={value}"),
        STEP,
        || async {
            let p = pods.get(name).await?;
            let v = p.annotations().get("ambient.istio.io/redirection").cloned();
            anyhow::Ok((v.as_deref() == Some(value)).then_some(p))
        },
    )
    .await?)
}

/// Waits until ztunnel's listeners are all there (`present`) or all gone in the netns of `pid`.
async fn listeners_within(pid: i32, present: bool) -> anyhow::Result<()> {
    let what = format!(
        "ztunnel's listeners {}",
        if present { "open" } else { "closed" }
    );
    poll_until(&what, STEP, || async {
        let out = in_netns(pid, &["ss", "-ltnH"]).await?;
        let open: Vec<u16> = ZTUNNEL_PORTS
            .into_iter()
            .filter(|p| out.contains(&format!(":{p} ")))
            .collect();
        let done = if present {
            open.len() == ZTUNNEL_PORTS.len()
        } else {
            open.is_empty()
        };
        if done {
            anyhow::Ok(Some(()))
        } else {
            bail!("listening: {out}")
        }
    })
    .await?;
    Ok(())
}

async fn still_running(client: &Client, pod: &Pod) -> anyhow::Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), APP_NS);
    let now = wait::api("reading the ambient pod", pods.get_opt(&pod.name_any())).await?;
    ensure!(
        now.is_some_and(|p| p.uid() == pod.uid() && p.metadata.deletion_timestamp.is_none()),
        "the ambient pod {} was evicted or deleted",
        pod.name_any()
    );
    Ok(())
}

async fn metric(agent: std::net::SocketAddr, name: &str) -> anyhow::Result<f64> {
    let (_, body) = http_get(agent, "/metrics")
        .await
        .context("the agent's /metrics")?;
    Ok(metric_sample(&body, name).unwrap_or(0.0))
}

async fn wait_metric(agent: std::net::SocketAddr, name: &str, at_least: f64) -> anyhow::Result<()> {
    poll_until(&format!("{name} ≥ {at_least}"), STEP, || async {
        let v = metric(agent, name).await?;
        anyhow::Ok((v >= at_least).then_some(()))
    })
    .await?;
    Ok(())
}
