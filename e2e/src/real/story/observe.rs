//! What the story watches and shows: Nodes until they reach a state, the agent's metrics,
//! Events about pods, pods of the web Deployment, and excerpts of `kubectl` for the timeline.
//!
//! In: a client, the cluster, the agent's admin address. Out: the objects, samples and lines,
//! every wait bounded by the story's step time.

use super::*;

/// The node's start, for the timeline.
pub(super) fn say_node(n: &dyn Narrator, node: &RealNode) {
    let t = node.times();
    n.say(&format!(
        "node {} registered and Ready: a real kubelet, containerd with runc (containerd up in {:.1}s, kubelet → Node {:.1}s, → Ready {:.1}s)",
        node.name(),
        t.containerd.as_secs_f64(),
        t.registered.as_secs_f64(),
        t.ready_after_registration.as_secs_f64()
    ));
}

pub(super) fn pod_ip(p: &Pod) -> String {
    p.status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .unwrap_or_default()
}

/// One sample of the agent's `/metrics`; a series not printed yet is 0 (prometheus-client
/// prints a labelled series only once it was touched).
pub(super) async fn metric(agent: std::net::SocketAddr, name: &str) -> anyhow::Result<f64> {
    let (_, body) = crate::sim::node::http_get(agent, "/metrics")
        .await
        .context("the agent's /metrics did not answer")?;
    Ok(metric_sample(&body, name).unwrap_or(0.0))
}

/// When the Node's `MeshCNIVerified` condition last transitioned, and to what.
pub(super) fn condition_since(node: &Node) -> Option<(String, String)> {
    let c = node
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == CONDITION_TYPE)?;
    Some((c.status.clone(), format!("{:?}", c.last_transition_time)))
}

pub(super) async fn wait_metric(
    agent: std::net::SocketAddr,
    name: &str,
    at_least: f64,
) -> anyhow::Result<()> {
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
pub(super) async fn wait_verdict(
    client: &Client,
    node: &str,
    verified: bool,
) -> anyhow::Result<Node> {
    let want = if verified { "True" } else { "False" };
    wait_node(client, node, &format!("{CONDITION_TYPE}={want}"), |n| {
        gate_condition(n).is_some_and(|c| c.0 == want)
    })
    .await
}

/// One bounded read of a Node.
pub(super) async fn read_node(nodes: &Api<Node>, name: &str) -> anyhow::Result<Node> {
    Ok(wait::api(&format!("reading Node {name}"), nodes.get(name)).await?)
}

pub(super) async fn wait_node(
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
pub(super) async fn running_web(client: &Client, not: &[&str]) -> anyhow::Result<Pod> {
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
pub(super) struct Said {
    pub(super) pod: String,
    pub(super) reason: String,
    pub(super) action: String,
    pub(super) note: String,
}

/// The Events about pods in the story's namespace.
pub(super) async fn events(client: &Client) -> anyhow::Result<Vec<Said>> {
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
pub(super) async fn pod_events(client: &Client, reason: &str) -> anyhow::Result<Vec<Said>> {
    let mut all = events(client).await?;
    all.retain(|e| e.reason == reason);
    Ok(all)
}

/// The Events about `pod`.
pub(super) async fn events_about(client: &Client, pod: &str) -> anyhow::Result<Vec<Said>> {
    let mut all = events(client).await?;
    all.retain(|e| e.pod == pod);
    Ok(all)
}

/// Waits for the `reason` Event about `pod` with `action`; its note.
pub(super) async fn pod_event(
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

pub(super) fn node_of(p: &Pod) -> Option<&str> {
    p.spec.as_ref().and_then(|s| s.node_name.as_deref())
}

/// istio-cni's own log on the node (the plugin writes it under its run directory).
pub fn istio_cni_log(node: &RealNode) -> String {
    std::fs::read_to_string(node.istio_cni_run_dir().join("istio-cni.log"))
        .unwrap_or_else(|e| format!("(no istio-cni.log: {e})"))
}

pub(super) async fn create_namespace(client: &Client) -> anyhow::Result<()> {
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
pub(super) async fn system_pods(cluster: &RealCluster) -> anyhow::Result<String> {
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
pub(super) async fn describe_excerpt(cluster: &RealCluster, node: &str) -> anyhow::Result<String> {
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

pub(super) fn prefixed(what: &str, text: &str, keep: impl Fn(&str) -> bool) -> String {
    text.lines()
        .filter(|l| keep(l))
        .map(|l| format!("{what} │ {}", l.trim_end()))
        .collect::<Vec<_>>()
        .join("\n")
}
