//! `meshgate-e2e demo`: the main job end to end, on a local control plane and one simulated
//! node, told as a timeline a newcomer can follow without reading code.
//!
//! In: the built `meshgate-agent` and `meshgate-webhook` binaries and the Kubernetes binaries.
//! Out: a timeline on stdout, `kubectl describe node` excerpts, metric lines, a one-line
//! summary, and an exit code (0 when every step behaved as meshgate promises). Everything it
//! starts (control plane, webhook, agent, network namespaces) is torn down at the end, on an
//! error, and on Ctrl-C.
//!
//! The story (scenarios of docs/architecture.md):
//! 1. A node runs Calico; the linkerd-cni installer has not appended its plugin yet (S3). A
//!    meshed pod starts there: it gets an IP and no redirect rules.
//! 2. meshgate is installed: the webhook taints new nodes at registration, the agent gates
//!    the node, and the webhook refuses a second meshed pod sent straight to it.
//! 3. linkerd-cni is appended (S1): the node is untainted, the pod without rules is found and
//!    evicted, and its replacement (created with the plugin in place) passes inspection.
//! 4. Calico rewrites its conflist and drops the plugin (S4): the node is re-tainted.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams, PostParams};
use kube::{Client, ResourceExt};
use meshgate_core::{CONDITION_TYPE, TAINT_KEY};
use serde_json::json;

use crate::netns_sim::{PodNetns, Rules, private_subnet, require_privileges};
use crate::node_sim::{
    Agent, CniDirs, free_port, gate_condition as condition, golden, tainted, workspace_bin,
};
use crate::webhook_sim::{Scope, TestCa, register};
use crate::{ControlPlane, NodeSpec, Options};

const NODE: &str = "demo-node";
const NAMESPACE: &str = "demo";
const MESH_LABEL: &str = "linkerd.io/control-plane-ns";

/// Prints timeline lines with the time since the demo started.
struct Timeline(Instant);

impl Timeline {
    fn say(&self, what: impl AsRef<str>) {
        println!(
            "[{:>7.3}s] {}",
            self.0.elapsed().as_secs_f64(),
            what.as_ref()
        );
    }
    fn detail(&self, what: impl AsRef<str>) {
        for line in what.as_ref().lines() {
            println!("            {line}");
        }
    }
}

/// The webhook as a real process; killed on drop.
struct WebhookProcess(Child);

impl Drop for WebhookProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs the demo; returns the summary line on success.
pub async fn run() -> anyhow::Result<String> {
    require_privileges()?;
    let t = Timeline(Instant::now());
    println!("meshgate demo: one simulated node, a real kube-apiserver, real network namespaces\n");

    t.say("starting etcd, kube-apiserver, kube-controller-manager and kube-scheduler on loopback");
    let cp = ControlPlane::start(Options::default()).await?;
    let client = cp.client()?;
    t.say(format!(
        "control plane healthy in {:.1}s (Kubernetes {})",
        cp.started_in().as_secs_f64(),
        cp.version()
    ));

    // --- 1. before meshgate: S3 -------------------------------------------------------------
    let dirs = CniDirs::new()?;
    dirs.config("10-calico.conflist", &golden("calico.conflist")?)?;
    cp.register_node(&client, &NodeSpec::new(NODE)).await?;
    t.say(format!("node {NODE} registered; /etc/cni/net.d/10-calico.conflist chains calico → portmap → bandwidth"));
    t.say("the linkerd-cni installer has NOT appended its plugin yet (scenario S3)");

    // The kubelet stand-in gives each pod a network namespace, as the CNI chain on disk
    // would: with linkerd's redirect rules only once linkerd-cni is chained.
    let chained = Arc::new(AtomicBool::new(false));
    let netns: Arc<Mutex<Vec<PodNetns>>> = Arc::default();
    let subnet = private_subnet();
    let next_host = Arc::new(AtomicU8::new(10));
    let ips: Arc<Mutex<std::collections::HashMap<String, IpAddr>>> = Arc::default();
    let _runner = {
        let (chained, netns, ips) = (chained.clone(), netns.clone(), ips.clone());
        cp.run_pods(NODE, move |pod: &Pod| {
            let uid = pod.uid()?;
            let mut ips = ips.lock().ok()?;
            if let Some(ip) = ips.get(&uid) {
                return Some(*ip);
            }
            let ip = Ipv4Addr::new(
                subnet[0],
                subnet[1],
                subnet[2],
                next_host.fetch_add(1, Ordering::Relaxed),
            );
            let rules = if chained.load(Ordering::Acquire) {
                Rules::Linkerd("iptables-legacy")
            } else {
                Rules::None
            };
            let ns = PodNetns::new(ip, rules).ok()?;
            netns.lock().ok()?.push(ns);
            ips.insert(uid, IpAddr::V4(ip));
            Some(IpAddr::V4(ip))
        })
    };
    create_namespace(&client).await?;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NAMESPACE);
    deployments
        .create(
            &PostParams::default(),
            &serde_json::from_value(web_deployment())?,
        )
        .await?;
    let first = wait_running_web(&client, None).await?;
    t.say(format!(
        "meshed pod {}/{} is Running on {NODE} with IP {} — its network namespace has NO redirect rules: it talks plaintext",
        NAMESPACE,
        first.name_any(),
        pod_ip(&first).unwrap_or_default()
    ));

    // --- 2. meshgate is installed -------------------------------------------------------------
    t.say("installing meshgate: the webhook (TLS on loopback) and the agent for this node");
    let ca = TestCa::new()?;
    let tls = tempfile::tempdir()?;
    let (cert, key) = (tls.path().join("tls.crt"), tls.path().join("tls.key"));
    ca.issue(&cert, &key)?;
    let (listen, admin) = (free_port()?, free_port()?);
    let _webhook = start_webhook(&cp, listen, admin, &cert, &key)?;
    wait_http_ok(SocketAddr::from(([127, 0, 0, 1], admin)), "/ready")
        .await
        .context("the webhook never became ready")?;
    register(&client, "demo", listen, ca.pem(), &Scope::default()).await?;

    let agent = Agent::start(&cp, NODE, &dirs, &[])?;
    let gated = wait_node(&client, NODE, |n| {
        tainted(n) && condition(n).is_some_and(|c| c.0 == "False")
    })
    .await?;
    let reason = condition(&gated).map(|c| c.1).unwrap_or_default();
    t.say(format!(
        "agent: {NODE} gated — taint {TAINT_KEY}:NoSchedule, {CONDITION_TYPE}=False ({reason})"
    ));
    t.detail(describe_excerpt(&cp).await?);

    let second = NodeSpec::new("demo-node-2");
    let created = crate::kubelet::create_node(&client, &second, cp.version()).await?;
    t.say(format!(
        "a new node demo-node-2 registers: the webhook tainted it at creation (taint present: {}), before any agent runs there",
        tainted(&created)
    ));

    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let direct: Pod = serde_json::from_value(json!({
        "metadata": {"name": "direct-to-node", "labels": {MESH_LABEL: "linkerd"}},
        "spec": {"nodeName": NODE, "tolerations": [{"operator": "Exists"}],
                 "containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10"},
                                {"name": crate::pod_sim::LINKERD_PROXY, "image": "registry.k8s.io/pause:3.10"}]}
    }))?;
    let refused = match pods.create(&PostParams::default(), &direct).await {
        Ok(_) => bail!("the webhook admitted a meshed pod on an unverified node"),
        Err(kube::Error::Api(s)) => s.message,
        Err(e) => return Err(e.into()),
    };
    t.say("a second meshed pod sent straight to the node (spec.nodeName, tolerates every taint) is REFUSED:");
    t.detail(&refused);

    // --- 3. linkerd-cni is appended: S1 ---------------------------------------------------------
    t.say("the linkerd-cni installer appends its plugin to 10-calico.conflist (scenario S1)");
    chained.store(true, Ordering::Release);
    let written = Instant::now();
    dirs.config("10-calico.conflist", &golden("calico-linkerd.conflist")?)?;
    wait_node(&client, NODE, |n| !tainted(n)).await?;
    let untaint = written.elapsed();
    t.say(format!(
        "agent: {NODE} untainted {} ms after the write — {CONDITION_TYPE}=True (Verified)",
        untaint.as_millis()
    ));
    t.detail(describe_excerpt(&cp).await?);

    let replacement = wait_running_web(&client, Some(&first.name_any())).await?;
    t.say(format!(
        "agent: pod {} had no redirect rules → evicted through the Eviction API (Event MeshRedirectMissing)",
        first.name_any()
    ));
    t.say(format!(
        "its ReplicaSet recreated {} (IP {}); its namespace has linkerd's rules, and inspection says: redirected",
        replacement.name_any(),
        pod_ip(&replacement).unwrap_or_default()
    ));
    wait_metric(
        &agent,
        "meshgate_pod_inspections_total{profile=\"linkerd\",verdict=\"redirected\"}",
    )
    .await?;

    // --- 4. drift: S4 ----------------------------------------------------------------------------
    t.say("Calico restarts and rewrites its conflist without linkerd-cni (scenario S4)");
    chained.store(false, Ordering::Release);
    let written = Instant::now();
    dirs.config("10-calico.conflist", &golden("calico.conflist")?)?;
    wait_node(&client, NODE, tainted).await?;
    let retaint = written.elapsed();
    t.say(format!("agent: {NODE} re-tainted {} ms after the drift — {CONDITION_TYPE}=False (ChainedPluginMissing), Event CNIChainUnverified", retaint.as_millis()));
    t.detail(describe_excerpt(&cp).await?);

    let (_, metrics) = agent.admin_get("/metrics").await.context("agent metrics")?;
    t.say("agent metrics (/metrics on its admin port):");
    t.detail(
        metrics
            .lines()
            .filter(|l| l.starts_with("meshgate_") && !l.contains("_bucket{") && !l.ends_with(" 0"))
            .collect::<Vec<_>>()
            .join("\n"),
    );
    let evicted = metrics
        .lines()
        .find_map(|l| l.strip_prefix("meshgate_pods_evicted_total{profile=\"linkerd\"} "))
        .unwrap_or("0")
        .trim()
        .to_string();
    Ok(format!(
        "demo OK: node gated until verified, untainted in {} ms, re-tainted on drift in {} ms, {evicted} un-redirected pod evicted, 1 meshed pod refused",
        untaint.as_millis(),
        retaint.as_millis()
    ))
}

fn web_deployment() -> serde_json::Value {
    json!({
        "metadata": {"name": "web"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web", MESH_LABEL: "linkerd"}},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": NODE},
                    "terminationGracePeriodSeconds": 0,
                    "containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10"},
                                   {"name": crate::pod_sim::LINKERD_PROXY, "image": "registry.k8s.io/pause:3.10"}]
                }
            }
        }
    })
}

async fn create_namespace(client: &Client) -> anyhow::Result<()> {
    let nss: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    nss.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": NAMESPACE}}))?,
    )
    .await?;
    Ok(())
}

fn start_webhook(
    cp: &ControlPlane,
    listen: u16,
    admin: u16,
    cert: &std::path::Path,
    key: &std::path::Path,
) -> anyhow::Result<WebhookProcess> {
    let log = cp.dir().join("logs").join("meshgate-webhook.log");
    let out = std::fs::File::create(&log)?;
    let child = Command::new(workspace_bin("meshgate-webhook")?)
        .arg("--listen")
        .arg(format!("127.0.0.1:{listen}"))
        .arg("--admin-addr")
        .arg(format!("127.0.0.1:{admin}"))
        .arg("--tls-cert")
        .arg(cert)
        .arg("--tls-key")
        .arg(key)
        .arg("--kubeconfig")
        .arg(cp.admin_kubeconfig_path())
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .spawn()
        .context("starting meshgate-webhook")?;
    Ok(WebhookProcess(child))
}

async fn wait_http_ok(addr: SocketAddr, path: &str) -> anyhow::Result<()> {
    for _ in 0..150 {
        if crate::node_sim::http_get(addr, path)
            .await
            .is_some_and(|(code, _)| code == 200)
        {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("{addr}{path} did not answer 200 within 15 s")
}

fn pod_ip(p: &Pod) -> Option<String> {
    p.status.as_ref()?.pod_ip.clone()
}

async fn wait_node(
    client: &Client,
    name: &str,
    pred: impl Fn(&Node) -> bool,
) -> anyhow::Result<Node> {
    let nodes: Api<Node> = Api::all(client.clone());
    for _ in 0..600 {
        let n = nodes.get(name).await?;
        if pred(&n) {
            return Ok(n);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    bail!("node {name} did not reach the expected state")
}

/// Waits for a Running `web` pod other than `not`.
async fn wait_running_web(client: &Client, not: Option<&str>) -> anyhow::Result<Pod> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    for _ in 0..300 {
        let list = pods.list(&ListParams::default().labels("app=web")).await?;
        if let Some(p) = list.items.into_iter().find(|p| {
            Some(p.name_any().as_str()) != not
                && p.metadata.deletion_timestamp.is_none()
                && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
                && pod_ip(p).is_some()
        }) {
            return Ok(p);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("no new Running web pod within 30 s")
}

async fn wait_metric(agent: &Agent, sample: &str) -> anyhow::Result<()> {
    for _ in 0..100 {
        if agent.metric(sample).await.unwrap_or(0.0) > 0.0 {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("{sample} never became positive")
}

/// The `kubectl describe node` lines an operator looks at: taints, our label, our condition.
async fn describe_excerpt(cp: &ControlPlane) -> anyhow::Result<String> {
    let text = cp.kubectl(&["describe", "node", NODE]).await?;
    Ok(text
        .lines()
        .filter(|l| {
            l.starts_with("Taints:")
                || l.contains(CONDITION_TYPE)
                || l.contains("meshgate.io/cni-verified")
        })
        .map(|l| format!("kubectl describe node │ {}", l.trim_end()))
        .collect::<Vec<_>>()
        .join("\n"))
}
