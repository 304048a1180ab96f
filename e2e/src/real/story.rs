//! meshgate's main job on real nodes, told once for `make demo` and for the e2e suite: S3 → S1
//! → S4 and an agent restart, on a real kubelet and containerd, with Istio's real CNI plugin
//! and meshgate installed from its own manifests.
//!
//! In: root, the binaries and images `e2e/install-deps.sh` caches, meshgate's image (`make`
//! builds it), and a [`Narrator`] that receives the timeline. Out: an [`Outcome`] with the
//! figures an operator cares about, or an error naming the step that did not behave as meshgate
//! promises (a part of the node that cannot start is an [`crate::Error::RealNode`] naming it;
//! there is no fallback to a stand-in). Everything it starts is torn down when it returns, on
//! an error, and when its future is dropped (Ctrl-C in the demo).
//!
//! The story:
//! 1. Node A runs a bridge network as its primary CNI; Istio's CNI plugin is not appended yet
//!    (S3). A meshed Deployment's pod starts there through containerd: an IP, no redirect rules.
//! 2. meshgate is installed with `kubectl apply -k` on the e2e overlay of its manifests. The
//!    agent gates A and evicts the pod without rules; its replacement tolerates meshgate's taint,
//!    so the scheduler picks A, but the webhook refuses the binding and it waits, unbound. Node B
//!    registers, is tainted at CREATE by the webhook, and its own agent keeps it gated for the
//!    missing istio-cni. A meshed pod sent straight to A is refused.
//! 3. istio-cni is chained as Istio's installer does it (S1): A is untainted, the replacement
//!    gets its rules from istio-cni itself (iptables mode; istio-cni's log names it) and is
//!    judged `redirected`; then the same in `native_nftables` mode.
//! 4. The primary's conflist loses istio-cni (S4): A is re-tainted.
//! 5. A's agent pod is deleted and its DaemonSet recreates it: A stays tainted, nothing is
//!    evicted twice.

use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, ServiceAccount};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, PostParams};
use kube::{Client, ResourceExt};
use meshgate_core::{CONDITION_TYPE, TAINT_KEY};
use serde_json::json;

use crate::harness::wait::{self, poll_until};
use crate::real::cluster::{RealCluster, SYSTEM_NAMESPACE, is_ready};
use crate::real::node::{BUSYBOX_IMAGE, RealNode};
use crate::sim::node::{gate_condition, metric_sample, tainted};
use crate::{TokenOptions, service_account_token};

/// The namespace the story's workload runs in.
pub const NAMESPACE: &str = "demo";
/// The meshed Deployment.
const WEB: &str = "web";
/// A step that involves a pod start or an agent's reaction gets this long.
const STEP: Duration = Duration::from_secs(90);

/// Receives the story as it happens.
pub trait Narrator: Send + Sync {
    /// One timeline line.
    fn say(&self, line: &str);
    /// Indented detail under the last line (a refusal message, `kubectl describe` excerpts).
    fn detail(&self, text: &str);
}

/// A [`Narrator`] that keeps the timeline (the e2e test prints it, whole, on a failure too).
#[derive(Debug)]
pub struct Transcript {
    started: Instant,
    text: std::sync::Mutex<String>,
}

impl Default for Transcript {
    fn default() -> Self {
        Self {
            started: Instant::now(),
            text: std::sync::Mutex::default(),
        }
    }
}

impl Transcript {
    /// The timeline so far.
    pub fn text(&self) -> String {
        self.text.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn push(&self, line: String) {
        let mut text = self.text.lock().unwrap_or_else(|p| p.into_inner());
        text.push_str(&line);
        text.push('\n');
    }
}

impl Narrator for Transcript {
    fn say(&self, line: &str) {
        self.push(format!(
            "[{:>7.3}s] {line}",
            self.started.elapsed().as_secs_f64()
        ));
    }
    fn detail(&self, text: &str) {
        for line in text.lines() {
            self.push(format!("            {line}"));
        }
    }
}

/// The figures of one run.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// istio-cni appended to the conflist → node A's taint removed.
    pub untaint_after_write: Duration,
    /// istio-cni dropped from the conflist → node A tainted again.
    pub retaint_after_drift: Duration,
    /// Pods the agent evicted for missing redirect rules (`meshgate_pods_evicted_total`).
    pub evicted: u64,
    /// The webhook's answer to the meshed pod sent straight to the unverified node.
    pub refused: String,
    /// Node A, the one the story gates, verifies and gates again.
    pub node: String,
}

/// Runs the story.
pub async fn run(n: &dyn Narrator) -> anyhow::Result<Outcome> {
    crate::harness::paths::require_root()?;
    n.say("starting etcd, kube-apiserver, kube-controller-manager and kube-scheduler");
    let cluster = RealCluster::start().await?;
    match steps(&cluster, n).await {
        Ok(outcome) => Ok(outcome),
        // What meshgate itself logged explains most failures: keep it before the teardown,
        // after the failure itself.
        Err(e) => match cluster.meshgate_logs() {
            logs if logs.trim().is_empty() => Err(e),
            logs => Err(anyhow::anyhow!("{e:#}\n\n{logs}")),
        },
    }
}

async fn steps(cluster: &RealCluster, n: &dyn Narrator) -> anyhow::Result<Outcome> {
    let cp = cluster.control_plane();
    let client = cp.client()?;
    n.say(&format!(
        "control plane healthy in {:.1}s (Kubernetes {})",
        cp.started_in().as_secs_f64(),
        cp.version()
    ));

    // --- 1. before meshgate: S3 ---------------------------------------------------------------
    let a = cluster.add_node().await?;
    say_node(n, &a);
    n.say(&format!(
        "{}: a bridge network (bridge → portmap); Istio's CNI plugin is NOT appended yet (scenario S3)",
        a.conflist_path().display()
    ));
    create_namespace(&client).await?;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NAMESPACE);
    let web: Deployment = serde_json::from_value(web_deployment(a.name()))?;
    wait::api(
        "creating the web Deployment",
        deployments.create(&PostParams::default(), &web),
    )
    .await?;
    let first = running_web(&client, &[]).await?;
    let verdict = inspect_pod(&a, &first).await?;
    ensure!(
        verdict == "missing",
        "the web pod started before istio-cni was chained must have no redirect rules; `meshgate-agent inspect` says {verdict}"
    );
    n.say(&format!(
        "meshed pod {NAMESPACE}/{} Running on {} with IP {} (istio-proxy sidecar); `meshgate-agent inspect` on its network namespace: {verdict} — no redirect rules, it talks plaintext",
        first.name_any(),
        a.name(),
        pod_ip(&first)
    ));

    // --- 2. meshgate is installed -------------------------------------------------------------
    n.say("installing meshgate as an operator does: kubectl apply -k on its manifests (e2e/overlay: local image, istio-cni required)");
    let installed = Instant::now();
    cluster.install_meshgate().await?;
    n.say(&format!(
        "meshgate installed in {:.1}s: the webhook Deployment is Ready behind its Service, the agent DaemonSet pod runs on {}",
        installed.elapsed().as_secs_f64(),
        a.name()
    ));
    n.detail(&system_pods(cluster).await?);
    let gated = wait_node(&client, a.name(), "gated", |n| {
        tainted(n) && gate_condition(n).is_some_and(|c| c.0 == "False")
    })
    .await?;
    let reason = gate_condition(&gated).map(|c| c.1).unwrap_or_default();
    n.say(&format!(
        "agent: {} gated — taint {TAINT_KEY}:NoSchedule, {CONDITION_TYPE}=False ({reason})",
        a.name()
    ));
    n.detail(&describe_excerpt(cluster, a.name()).await?);

    let first_uid = first.uid().unwrap_or_default();
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    poll_until("the agent to evict the pod without rules", STEP, || async {
        let gone = match pods.get_opt(&first.name_any()).await? {
            None => true,
            Some(p) => {
                p.uid() != Some(first_uid.clone()) || p.metadata.deletion_timestamp.is_some()
            }
        };
        anyhow::Ok(gone.then_some(()))
    })
    .await?;
    let event = pod_event(&client, &first.name_any(), "MeshRedirectMissing", "Evict").await?;
    n.say(&format!(
        "agent: pod {} has no redirect rules → evicted through the Eviction API; Event MeshRedirectMissing:",
        first.name_any()
    ));
    n.detail(&event);
    let pending = poll_until("the web ReplicaSet's replacement pod", STEP, || async {
        let list = pods.list(&ListParams::default().labels("app=web")).await?;
        anyhow::Ok(list.items.into_iter().find(|p| {
            p.uid() != Some(first_uid.clone()) && p.metadata.deletion_timestamp.is_none()
        }))
    })
    .await?;
    // It tolerates meshgate's taint: only the webhook keeps it off A, by refusing the binding
    // kube-scheduler posts. The scheduler reports that refusal in an Event about the pod, and
    // retries with a backoff. Its first attempts may meet no webhook endpoint yet (failure
    // policy Fail, a refusal too, but not the verdict): wait for the webhook's own denial.
    let verdict = format!("node {} is not verified for the mesh CNI chain", a.name());
    let refusal = poll_until(
        &format!(
            "an Event with the webhook's refusal to bind {}",
            pending.name_any()
        ),
        STEP,
        || async {
            let about = events_about(&client, &pending.name_any()).await?;
            anyhow::Ok(about.into_iter().find(|e| e.note.contains(&verdict)))
        },
    )
    .await?;
    let still = wait::api("reading the replacement", pods.get(&pending.name_any())).await?;
    ensure!(
        still.uid() == pending.uid() && node_of(&still).is_none(),
        "the replacement was bound to {:?} while {} is unverified",
        node_of(&still),
        a.name()
    );
    n.say(&format!(
        "its ReplicaSet created {}; it tolerates meshgate's taint, so kube-scheduler picks {}, but the webhook refuses the binding (Event {}):",
        pending.name_any(),
        a.name(),
        refusal.reason
    ));
    n.detail(&refusal.note);

    // A node registering now is tainted by the webhook at CREATE: the Node's first version.
    let (b, created) = cluster.add_node_seen_at_create().await?;
    let nodes: Api<Node> = Api::all(client.clone());
    ensure!(
        tainted(&created),
        "node {} was created without meshgate's taint: the webhook did not taint it at registration",
        b.name()
    );
    say_node(n, &b);
    n.say(&format!(
        "the webhook tainted {} at CREATE: the Node's first version already carries {TAINT_KEY}:NoSchedule, before any agent runs there",
        b.name()
    ));
    let agent_b = cluster.ready_pods("meshgate-agent", Some(&b), 1).await?;
    ensure!(
        agent_b.len() == 1,
        "node {} has {} agent pods",
        b.name(),
        agent_b.len()
    );
    let gated_b = wait_verdict(&client, b.name(), false).await?;
    ensure!(
        tainted(&gated_b),
        "node {} lost its taint while its conflist lacks istio-cni",
        b.name()
    );
    let message = gate_condition(&gated_b).map(|c| c.2).unwrap_or_default();
    ensure!(
        message.contains("istio-cni"),
        "{}'s {CONDITION_TYPE} message does not name the missing plugin: {message:?}",
        b.name()
    );
    n.say(&format!(
        "{}'s own agent Ready ({}): it keeps {} gated — {CONDITION_TYPE}=False: {message}",
        b.name(),
        agent_b[0].name_any(),
        b.name()
    ));

    let direct: Pod = serde_json::from_value(direct_pod(a.name()))?;
    let pp = PostParams::default();
    let create = pods.create(&pp, &direct);
    let refused = match tokio::time::timeout(wait::API_TIMEOUT, create).await {
        Ok(Ok(_)) => bail!("the webhook admitted a meshed pod on an unverified node"),
        Ok(Err(kube::Error::Api(s))) => s.message,
        Ok(Err(e)) => return Err(e.into()),
        Err(_) => bail!(
            "creating the direct pod: no answer within {:?}",
            wait::API_TIMEOUT
        ),
    };
    n.say(&format!(
        "a meshed pod sent straight to {} (spec.nodeName, tolerates every taint) is REFUSED:",
        a.name()
    ));
    n.detail(&refused);

    // --- 3. istio-cni is appended: S1 ---------------------------------------------------------
    let kubeconfig = istio_cni_kubeconfig(cp, &client, NAMESPACE).await?;
    n.say("Istio's installer appends istio-cni to the bridge conflist, with its kubeconfig (scenario S1)");
    let written = Instant::now();
    a.install_istio_cni(&kubeconfig, false)?;
    wait_node(&client, a.name(), "untainted", |n| !tainted(n)).await?;
    let untaint = written.elapsed();
    wait_verdict(&client, a.name(), true).await?;
    n.say(&format!(
        "agent: {} untainted {} ms after the write — {CONDITION_TYPE}=True (Verified)",
        a.name(),
        untaint.as_millis()
    ));
    n.detail(&describe_excerpt(cluster, a.name()).await?);

    let replacement = running_web(&client, &[&first_uid]).await?;
    let rules = netfilter_dump(&a, &replacement, false).await?;
    ensure!(
        rules.contains("ISTIO_OUTPUT") && rules.contains("ISTIO_REDIRECT"),
        "istio-cni's iptables chains are not in the replacement's namespace:\n{rules}"
    );
    let verdict = inspect_pod(&a, &replacement).await?;
    ensure!(
        verdict == "redirected",
        "the replacement istio-cni set up must be judged redirected; `inspect` says {verdict}; istio-cni's log:\n{}",
        istio_cni_log(&a)
    );
    ensure!(
        istio_cni_log(&a).contains(&replacement.name_any()),
        "istio-cni's log does not name the replacement {}",
        replacement.name_any()
    );
    let agent = cluster.agent_admin(&a);
    wait_metric(
        agent,
        "meshgate_pod_inspections_total{profile=\"istio\",verdict=\"redirected\"}",
        1.0,
    )
    .await?;
    n.say(&format!(
        "{} scheduled on {} (IP {}): istio-cni itself wrote ISTIO_OUTPUT/ISTIO_REDIRECT into its namespace; the agent judged it: redirected",
        replacement.name_any(),
        a.name(),
        pod_ip(&replacement)
    ));

    // The same plugin in native nftables mode, for the next pod of the Deployment. The
    // installer's rewrite keeps the chain verified: the node must not flap, so it is watched
    // for a while (many times the agent's coalescing window) and its condition must not
    // have transitioned.
    let before = condition_since(&read_node(&nodes, a.name()).await?);
    a.install_istio_cni(&kubeconfig, true)?;
    let watched = Instant::now();
    while watched.elapsed() < Duration::from_millis(1500) {
        ensure!(
            !tainted(&read_node(&nodes, a.name()).await?),
            "rewriting istio-cni's entry (native_nftables) tainted {}",
            a.name()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let after = condition_since(&read_node(&nodes, a.name()).await?);
    ensure!(
        before.is_some() && before == after,
        "{}'s {CONDITION_TYPE} transitioned while istio-cni's entry was rewritten: {before:?} → {after:?}",
        a.name()
    );
    // The agent's counters before the next pod, so its verdict on that very pod is what moves.
    let redirected = "meshgate_pod_inspections_total{profile=\"istio\",verdict=\"redirected\"}";
    let others = [
        "meshgate_pod_inspections_total{profile=\"istio\",verdict=\"missing\"}",
        "meshgate_pod_inspections_total{profile=\"istio\",verdict=\"unknown\"}",
    ];
    let base = metric(agent, redirected).await?;
    let mut others_base = Vec::new();
    for name in others {
        others_base.push(metric(agent, name).await?);
    }
    wait::api(
        "deleting the replacement",
        pods.delete(
            &replacement.name_any(),
            &DeleteParams::default().grace_period(1),
        ),
    )
    .await?;
    let replacement_uid = replacement.uid().unwrap_or_default();
    let nft = running_web(&client, &[&first_uid, &replacement_uid]).await?;
    let ruleset = netfilter_dump(&a, &nft, true).await?;
    ensure!(
        ruleset.contains("istio"),
        "istio-cni's nftables tables are not in the pod's namespace:\n{ruleset}"
    );
    let verdict = inspect_pod(&a, &nft).await?;
    ensure!(
        verdict == "redirected",
        "a pod istio-cni set up in native_nftables mode must be judged redirected; `inspect` says {verdict}"
    );
    wait_metric(agent, redirected, base + 1.0).await?;
    for (name, was) in others.iter().zip(others_base) {
        let now = metric(agent, name).await?;
        ensure!(
            now == was,
            "the agent's {name} moved from {was} to {now} around the native_nftables pod"
        );
    }
    n.say(&format!(
        "istio-cni switched to native_nftables; the next pod {} has Istio's nftables tables and is judged redirected too",
        nft.name_any()
    ));

    // --- 4. drift: S4 -------------------------------------------------------------------------
    n.say("the primary CNI rewrites its conflist without istio-cni (scenario S4)");
    let written = Instant::now();
    a.remove_istio_cni()?;
    wait_node(&client, a.name(), "re-tainted", tainted).await?;
    let retaint = written.elapsed();
    wait_verdict(&client, a.name(), false).await?;
    n.say(&format!(
        "agent: {} re-tainted {} ms after the drift — {CONDITION_TYPE}=False (ChainedPluginMissing), Event CNIChainUnverified",
        a.name(),
        retaint.as_millis()
    ));
    n.detail(&describe_excerpt(cluster, a.name()).await?);

    let metrics = crate::sim::node::http_get(agent, "/metrics")
        .await
        .map(|(_, body)| body)
        .context("the agent's /metrics did not answer")?;
    n.say("agent metrics (/metrics on its admin port, the node's address:9990):");
    n.detail(
        &metrics
            .lines()
            .filter(|l| l.starts_with("meshgate_") && !l.contains("_bucket{") && !l.ends_with(" 0"))
            .collect::<Vec<_>>()
            .join("\n"),
    );
    let evicted = metric_sample(&metrics, "meshgate_pods_evicted_total{profile=\"istio\"}")
        .unwrap_or(0.0) as u64;
    ensure!(
        evicted == 1,
        "the agent evicted {evicted} pods; exactly the one without rules was expected"
    );

    // --- 5. the agent restarts ----------------------------------------------------------------
    let agent_pod = cluster.agent_pod(&a).await?;
    n.say(&format!(
        "the agent pod {} is deleted; its DaemonSet recreates it",
        agent_pod.name_any()
    ));
    let system: Api<Pod> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    wait::api(
        "deleting the agent pod",
        system.delete(&agent_pod.name_any(), &DeleteParams::default()),
    )
    .await?;
    let old_uid = agent_pod.uid().unwrap_or_default();
    let restart = Instant::now();
    let new_agent = loop {
        ensure!(
            tainted(&read_node(&nodes, a.name()).await?),
            "{} lost its taint while its agent restarted, with istio-cni still missing",
            a.name()
        );
        if let Ok(p) = cluster.agent_pod(&a).await
            && p.uid() != Some(old_uid.clone())
            && is_ready(&p)
        {
            break p;
        }
        ensure!(
            restart.elapsed() < STEP,
            "the DaemonSet did not bring a new agent to Ready within {STEP:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // The new agent inspects the pods it finds: the redirected pod once more, never evicted.
    wait_metric(agent, redirected, 1.0).await?;
    let evicted_again = metric(agent, "meshgate_pods_evicted_total{profile=\"istio\"}").await?;
    ensure!(
        evicted_again == 0.0,
        "the restarted agent evicted {evicted_again} pod(s)"
    );
    ensure!(
        tainted(&read_node(&nodes, a.name()).await?),
        "{} was untainted after its agent restarted",
        a.name()
    );
    ensure!(
        wait::api("reading the redirected pod", pods.get_opt(&nft.name_any()))
            .await?
            .is_some_and(|p| p.uid() == nft.uid() && p.metadata.deletion_timestamp.is_none()),
        "the redirected pod {} was evicted after the agent restarted",
        nft.name_any()
    );
    let evictions = pod_events(&client, "MeshRedirectMissing").await?;
    ensure!(
        evictions.len() == 1 && evictions.iter().all(|e| e.action == "Evict"),
        "MeshRedirectMissing Events after the restart: {evictions:?}; exactly one, an Evict, was expected"
    );
    n.say(&format!(
        "new agent {} Ready after {:.1}s: {} stayed tainted throughout, the redirected pod was inspected again and kept, still exactly 1 eviction",
        new_agent.name_any(),
        restart.elapsed().as_secs_f64(),
        a.name()
    ));

    Ok(Outcome {
        untaint_after_write: untaint,
        retaint_after_drift: retaint,
        evicted,
        refused,
        node: a.name().to_owned(),
    })
}

/// The node's start, for the timeline.
fn say_node(n: &dyn Narrator, node: &RealNode) {
    let t = node.times();
    n.say(&format!(
        "node {} registered and Ready: a real kubelet, containerd with runc (containerd up in {:.1}s, kubelet → Node {:.1}s, → Ready {:.1}s)",
        node.name(),
        t.containerd.as_secs_f64(),
        t.registered.as_secs_f64(),
        t.ready_after_registration.as_secs_f64()
    ));
}

fn pod_ip(p: &Pod) -> String {
    p.status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .unwrap_or_default()
}

/// One sample of the agent's `/metrics`; a series not printed yet is 0 (prometheus-client
/// prints a labelled series only once it was touched).
async fn metric(agent: std::net::SocketAddr, name: &str) -> anyhow::Result<f64> {
    let (_, body) = crate::sim::node::http_get(agent, "/metrics")
        .await
        .context("the agent's /metrics did not answer")?;
    Ok(metric_sample(&body, name).unwrap_or(0.0))
}

/// When the Node's `MeshCNIVerified` condition last transitioned, and to what.
fn condition_since(node: &Node) -> Option<(String, String)> {
    let c = node
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == CONDITION_TYPE)?;
    Some((c.status.clone(), format!("{:?}", c.last_transition_time)))
}

async fn wait_metric(agent: std::net::SocketAddr, name: &str, at_least: f64) -> anyhow::Result<()> {
    poll_until(&format!("{name} ≥ {at_least}"), STEP, || async {
        let (_, body) = crate::sim::node::http_get(agent, "/metrics")
            .await
            .context("the agent's /metrics did not answer")?;
        match metric_sample(&body, name) {
            Some(v) if v >= at_least => Ok(Some(())),
            // Not yet: what the agent reports about pods, for the timeout message.
            value => bail!(
                "{name} is {value:?}; {}",
                body.lines()
                    .filter(|l| l.starts_with("meshgate_pod") && !l.contains("_bucket{"))
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
        }
    })
    .await?;
    Ok(())
}

/// Waits until the agent has written its verdict on `node`: `MeshCNIVerified` = `verified`.
pub async fn wait_verdict(client: &Client, node: &str, verified: bool) -> anyhow::Result<Node> {
    let want = if verified { "True" } else { "False" };
    wait_node(client, node, &format!("{CONDITION_TYPE}={want}"), |n| {
        gate_condition(n).is_some_and(|c| c.0 == want)
    })
    .await
}

/// One bounded read of a Node.
async fn read_node(nodes: &Api<Node>, name: &str) -> anyhow::Result<Node> {
    Ok(wait::api(&format!("reading Node {name}"), nodes.get(name)).await?)
}

async fn wait_node(
    client: &Client,
    name: &str,
    what: &str,
    pred: impl Fn(&Node) -> bool,
) -> anyhow::Result<Node> {
    let nodes: Api<Node> = Api::all(client.clone());
    // Tight polling (not support's 200 ms poll_until): the timeline reports these latencies
    // in milliseconds.
    let deadline = Instant::now() + STEP;
    loop {
        let n = read_node(&nodes, name).await?;
        if pred(&n) {
            return Ok(n);
        }
        ensure!(
            Instant::now() < deadline,
            "node {name} was not {what} within {STEP:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Whether the pod has container statuses and every one of its containers runs.
pub fn all_running(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .is_some_and(|cs| {
            !cs.is_empty()
                && cs
                    .iter()
                    .all(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()))
        })
}

/// Waits for a Running `web` pod whose UID is none of `not`.
async fn running_web(client: &Client, not: &[&str]) -> anyhow::Result<Pod> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    Ok(poll_until("a Running web pod", STEP, || async {
        let list = pods.list(&ListParams::default().labels("app=web")).await?;
        anyhow::Ok(list.items.into_iter().find(|p| {
            !p.uid().is_some_and(|u| not.contains(&u.as_str()))
                && p.metadata.deletion_timestamp.is_none()
                && all_running(p)
        }))
    })
    .await?)
}

/// What the story reads of an Event (events.k8s.io/v1).
#[derive(Debug)]
struct Said {
    pod: String,
    reason: String,
    action: String,
    note: String,
}

/// The Events about pods in the story's namespace.
async fn events(client: &Client) -> anyhow::Result<Vec<Said>> {
    let events: Api<Event> = Api::namespaced(client.clone(), NAMESPACE);
    let list = wait::api(
        "listing the story's Events",
        events.list(&ListParams::default()),
    )
    .await?;
    Ok(list
        .items
        .into_iter()
        .map(|e| Said {
            pod: e.regarding.and_then(|r| r.name).unwrap_or_default(),
            reason: e.reason.unwrap_or_default(),
            action: e.action.unwrap_or_default(),
            note: e.note.unwrap_or_default(),
        })
        .collect())
}

/// The `reason` Events about pods in the story's namespace.
async fn pod_events(client: &Client, reason: &str) -> anyhow::Result<Vec<Said>> {
    let mut all = events(client).await?;
    all.retain(|e| e.reason == reason);
    Ok(all)
}

/// The Events about `pod`.
async fn events_about(client: &Client, pod: &str) -> anyhow::Result<Vec<Said>> {
    let mut all = events(client).await?;
    all.retain(|e| e.pod == pod);
    Ok(all)
}

/// Waits for the `reason` Event about `pod` with `action`; its note.
async fn pod_event(
    client: &Client,
    pod: &str,
    reason: &str,
    action: &str,
) -> anyhow::Result<String> {
    let said = poll_until(
        &format!("Event {reason} ({action}) for pod {pod}"),
        STEP,
        || async {
            let all = pod_events(client, reason).await?;
            anyhow::Ok(all.into_iter().find(|e| e.pod == pod && e.action == action))
        },
    )
    .await?;
    Ok(said.note)
}

fn node_of(p: &Pod) -> Option<&str> {
    p.spec.as_ref().and_then(|s| s.node_name.as_deref())
}

/// istio-cni's own log on the node (the plugin writes it under its run directory).
pub fn istio_cni_log(node: &RealNode) -> String {
    std::fs::read_to_string(node.istio_cni_run_dir().join("istio-cni.log"))
        .unwrap_or_else(|e| format!("(no istio-cni.log: {e})"))
}

async fn create_namespace(client: &Client) -> anyhow::Result<()> {
    let nss: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": NAMESPACE}}))?;
    wait::api(
        "creating the story's namespace",
        nss.create(&PostParams::default(), &ns),
    )
    .await?;
    Ok(())
}

/// meshgate's pods, as `kubectl get pods -o wide` shows them.
async fn system_pods(cluster: &RealCluster) -> anyhow::Result<String> {
    let text = cluster
        .control_plane()
        .kubectl(&["get", "pods", "-n", SYSTEM_NAMESPACE, "-o", "wide"])
        .await?;
    Ok(prefixed(
        "kubectl get pods -n meshgate-system",
        &text,
        |l| !l.trim().is_empty(),
    ))
}

/// The `kubectl describe node` lines an operator looks at: taints, our label, our condition.
async fn describe_excerpt(cluster: &RealCluster, node: &str) -> anyhow::Result<String> {
    let text = cluster
        .control_plane()
        .kubectl(&["describe", "node", node])
        .await?;
    Ok(prefixed("kubectl describe node", &text, |l| {
        l.starts_with("Taints:")
            || l.contains(CONDITION_TYPE)
            || l.contains("meshgate.io/cni-verified")
    }))
}

fn prefixed(what: &str, text: &str, keep: impl Fn(&str) -> bool) -> String {
    text.lines()
        .filter(|l| keep(l))
        .map(|l| format!("{what} │ {}", l.trim_end()))
        .collect::<Vec<_>>()
        .join("\n")
}

/// A pod as Istio's sidecar injector leaves it in CNI mode: an `istio-proxy` container running
/// as 1337, the `sidecar.istio.io/status` annotation istio-cni checks before it programs the
/// redirect, and the `security.istio.io/tlsMode=istio` label meshgate's istio profile selects.
pub fn sidecar_pod_template(app: &str) -> serde_json::Value {
    let container = |name: &str, uid: Option<i64>| {
        json!({
            "name": name,
            "image": BUSYBOX_IMAGE,
            "imagePullPolicy": "Never",
            "command": ["/bin/sleep", "3600"],
            "securityContext": uid.map(|u| json!({"runAsUser": u, "runAsGroup": u})),
        })
    };
    json!({
        "metadata": {
            "labels": {
                "app": app,
                "security.istio.io/tlsMode": "istio",
                "service.istio.io/canonical-name": app,
            },
            "annotations": {
                "sidecar.istio.io/status": "{\"initContainers\":[\"istio-validation\"],\"containers\":[\"istio-proxy\"],\"volumes\":[],\"imagePullSecrets\":null,\"revision\":\"default\"}",
                "kubectl.kubernetes.io/default-container": "app",
            },
        },
        "spec": {
            "automountServiceAccountToken": false,
            "enableServiceLinks": false,
            "terminationGracePeriodSeconds": 1,
            "containers": [container("app", None), container("istio-proxy", Some(1337))],
        }
    })
}

/// The meshed Deployment, held to `node` by its hostname label. It tolerates meshgate's taint,
/// as a workload may: then only the webhook, refusing the binding, keeps it off the unverified
/// node, which is what the story shows.
fn web_deployment(node: &str) -> serde_json::Value {
    let mut template = sidecar_pod_template(WEB);
    template["spec"]["nodeSelector"] = json!({"kubernetes.io/hostname": node});
    template["spec"]["tolerations"] = json!([{"key": TAINT_KEY, "operator": "Exists"}]);
    json!({
        "metadata": {"name": WEB},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": WEB}},
            "template": template,
        }
    })
}

fn direct_pod(node: &str) -> serde_json::Value {
    let mut pod = sidecar_pod_template("direct-to-node");
    pod["metadata"]["name"] = json!("direct-to-node");
    pod["spec"]["nodeName"] = json!(node);
    pod["spec"]["tolerations"] = json!([{"operator": "Exists"}]);
    pod
}

/// A ServiceAccount `istio-cni` allowed to read pods (all the plugin reads in sidecar mode),
/// and a token kubeconfig for it, as Istio's installer writes one for the plugin.
pub async fn istio_cni_kubeconfig(
    cp: &crate::ControlPlane,
    client: &Client,
    ns: &str,
) -> anyhow::Result<String> {
    let meta = |name: &str| ObjectMeta {
        name: Some(name.into()),
        namespace: Some(ns.into()),
        ..Default::default()
    };
    let pp = PostParams::default();
    let sa = ServiceAccount {
        metadata: meta("istio-cni"),
        ..Default::default()
    };
    let role = Role {
        metadata: meta("istio-cni"),
        rules: Some(vec![PolicyRule {
            api_groups: Some(vec![String::new()]),
            resources: Some(vec!["pods".into()]),
            verbs: vec!["get".into()],
            ..Default::default()
        }]),
    };
    let binding = RoleBinding {
        metadata: meta("istio-cni"),
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".into(),
            kind: "Role".into(),
            name: "istio-cni".into(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: "istio-cni".into(),
            namespace: Some(ns.into()),
            ..Default::default()
        }]),
    };
    let (sas, roles, bindings) = (
        Api::<ServiceAccount>::namespaced(client.clone(), ns),
        Api::<Role>::namespaced(client.clone(), ns),
        Api::<RoleBinding>::namespaced(client.clone(), ns),
    );
    wait::api("creating istio-cni's ServiceAccount", sas.create(&pp, &sa)).await?;
    wait::api("creating istio-cni's Role", roles.create(&pp, &role)).await?;
    wait::api(
        "creating istio-cni's RoleBinding",
        bindings.create(&pp, &binding),
    )
    .await?;
    let token = service_account_token(client, ns, "istio-cni", &TokenOptions::default()).await?;
    let path = cp.write_token_kubeconfig(&format!("istio-cni-{ns}"), &token)?;
    Ok(std::fs::read_to_string(path)?)
}

/// The host pid of the pod's `app` container, from containerd's task list.
pub async fn app_pid(node: &RealNode, pod: &Pod) -> anyhow::Result<i32> {
    container_pid(node, pod, "app").await
}

/// The host pid of the pod's container `name`, from containerd's task list.
pub async fn container_pid(node: &RealNode, pod: &Pod, name: &str) -> anyhow::Result<i32> {
    let id = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.name == name))
        .and_then(|c| c.container_id.clone())
        .with_context(|| format!("the {name} container has no containerID"))?;
    Ok(node.container_pid(&id).await?)
}

/// `meshgate-agent inspect --pid <pid> --profile istio --output json`, run from the host as an
/// operator would: its exit code, and the verdict it printed (or, when it printed none, what
/// it printed instead, so an assertion on the verdict shows it).
pub async fn inspect_pid(pid: i32) -> anyhow::Result<(Option<i32>, String)> {
    let bin = crate::sim::node::workspace_bin("meshgate-agent")?;
    let mut cmd = tokio::process::Command::new(bin);
    cmd.args(["inspect", "--pid", &pid.to_string(), "--profile", "istio"])
        .args(["--output", "json"]);
    let out =
        wait::command_output("meshgate-agent inspect", Duration::from_secs(30), &mut cmd).await?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let verdict = serde_json::from_str::<serde_json::Value>(&stdout)
        .ok()
        .and_then(|v| v.get("verdict")?.as_str().map(str::to_owned))
        .unwrap_or_else(|| {
            format!(
                "no verdict; stdout {stdout:?}, stderr {:?}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    Ok((out.status.code(), verdict))
}

/// [`inspect_pid`] on the pod's `app` container: the verdict, which must be one and agree
/// with the exit code (0 redirected, 1 missing, 2 unknown, for scripts).
pub async fn inspect_pod(node: &RealNode, pod: &Pod) -> anyhow::Result<String> {
    let (exit, verdict) = inspect_pid(app_pid(node, pod).await?).await?;
    let code = match verdict.as_str() {
        "redirected" => 0,
        "missing" => 1,
        "unknown" => 2,
        _ => bail!("`meshgate-agent inspect` printed {verdict}"),
    };
    ensure!(
        exit == Some(code),
        "`meshgate-agent inspect` printed {verdict} but exited {exit:?}, not {code}"
    );
    Ok(verdict)
}

/// The pod's netfilter rules as the host's tools print them inside its network namespace:
/// `nft list ruleset` with `nft`, else `iptables-save`.
pub async fn netfilter_dump(node: &RealNode, pod: &Pod, nft: bool) -> anyhow::Result<String> {
    let tool: &[&str] = if nft {
        &["nft", "list", "ruleset"]
    } else {
        &["iptables-save"]
    };
    in_netns(app_pid(node, pod).await?, tool).await
}

/// Runs one of the host's tools (`iptables-save`, `ip addr`, ...) in the network namespace of
/// `pid`; its stdout.
pub async fn in_netns(pid: i32, tool: &[&str]) -> anyhow::Result<String> {
    let mut cmd = tokio::process::Command::new("nsenter");
    cmd.arg(format!("--net=/proc/{pid}/ns/net")).args(tool);
    let what = format!("nsenter {tool:?} in the netns of pid {pid}");
    let out = wait::command_output(&what, Duration::from_secs(30), &mut cmd).await?;
    ensure!(
        out.status.success(),
        "{tool:?} in the network namespace of pid {pid}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
