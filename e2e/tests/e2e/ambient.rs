//! Istio ambient: the agent (a real process against the real apiserver) verifies a node only
//! when ztunnel on it is ready — a pod with ztunnel's labels bound to the node and Ready,
//! istio-cni's node agent listening on the socket, and ztunnel connected to it — and gates
//! it again when any of them goes away.
//!
//! What is stood in: ztunnel and istio-cni's node agent (neither runs on a simulated node).
//! ztunnel's pod is a pod object with ztunnel's label (`app: ztunnel`) bound to a simulated
//! node, whose `Ready` condition the test writes through `pods/status` as the kubelet would.
//! The socket is a real `unixpacket` listener the test binds as istio-cni's node agent does
//! (`net.ListenUnix("unixpacket", ...)`), and ztunnel's connection is a real connection the
//! test makes to it and accepts. The watch, the socket and connection checks (unix
//! sock_diag, never a connection of the agent's own) and the verdict are the agent's.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::time::Duration;

use futures::StreamExt;

use anyhow::Context;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Client;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use meshgate_e2e::sim::node::{
    gate_condition as condition, plain, tail, tainted, verified_label as label,
};
use meshgate_e2e::sim::pod::bare_pod;
use meshgate_e2e::{ControlPlane, NodeSpec, mark_pod_running, unique_name};

use crate::cp;
use crate::support::{Agent, CniDirs, golden, wait_node};

/// Gated with NodeProxyNotReady, the message naming `needle`.
async fn wait_not_ready(
    agent: &Agent,
    client: &Client,
    node: &str,
    needle: &str,
) -> anyhow::Result<()> {
    let what = format!("NodeProxyNotReady naming {needle:?}");
    let waited = wait_node(client, node, &what, |n: &Node| {
        tainted(n)
            && label(n) == Some("false")
            && condition(n).is_some_and(|(s, r, m)| {
                s == "False" && r == "NodeProxyNotReady" && m.contains(needle)
            })
    })
    .await;
    with_agent_log(waited, agent)
}

/// Verified, the message naming the ready ztunnel pod.
async fn wait_verified(
    agent: &Agent,
    client: &Client,
    node: &str,
    pod: &str,
) -> anyhow::Result<()> {
    let needle = "ztunnel ready: pod ";
    let waited = wait_node(client, node, "Verified with ztunnel ready", |n: &Node| {
        !tainted(n)
            && label(n) == Some("true")
            && condition(n).is_some_and(|(s, r, m)| {
                s == "True" && r == "Verified" && m.contains(needle) && m.contains(pod)
            })
    })
    .await;
    with_agent_log(waited, agent)
}

/// A wait's failure with the agent's last log lines, which say what it saw instead.
fn with_agent_log<T, E: Into<anyhow::Error>>(
    waited: Result<T, E>,
    agent: &Agent,
) -> anyhow::Result<()> {
    waited.map(|_| ()).map_err(Into::into).with_context(|| {
        format!(
            "the agent's log ends with:\n{}",
            tail(&plain(&agent.log()), 40)
        )
    })
}

/// Writes the pod's `Ready` condition as the kubelet does when its readiness probe fails.
async fn mark_not_ready(pods: &Api<Pod>, name: &str) -> anyhow::Result<()> {
    let patch = serde_json::json!({"status": {"conditions": [
        {"type": "Ready", "status": "False", "reason": "ContainersNotReady"},
        {"type": "ContainersReady", "status": "False", "reason": "ContainersNotReady"},
    ]}});
    pods.patch_status(name, &PatchParams::default(), &Patch::Strategic(patch))
        .await?;
    Ok(())
}

/// Whether the Node was tainted at any moment within `window`.
async fn ever_tainted(client: Client, node: String, window: Duration) -> anyhow::Result<bool> {
    let nodes: Api<Node> = Api::all(client);
    let mut watch = std::pin::pin!(kube::runtime::watcher::watch_object(nodes, &node));
    let end = tokio::time::Instant::now() + window;
    while let Ok(item) = tokio::time::timeout_at(end, watch.next()).await {
        match item {
            Some(Ok(Some(n))) if tainted(&n) => return Ok(true),
            Some(Ok(_)) => {}
            Some(Err(e)) => return Err(e.into()),
            None => break,
        }
    }
    Ok(false)
}

fn seqpacket() -> anyhow::Result<OwnedFd> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, socket};
    Ok(socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?)
}

/// istio-cni's node agent in ambient mode: a `unixpacket` listener on the socket path.
fn node_agent(path: &Path) -> anyhow::Result<OwnedFd> {
    use nix::sys::socket::{Backlog, UnixAddr, bind, listen};
    let fd = seqpacket()?;
    bind(fd.as_raw_fd(), &UnixAddr::new(path)?)?;
    listen(&fd, Backlog::new(8)?)?;
    Ok(fd)
}

/// ztunnel connecting to the node agent's socket, and the node agent accepting: both ends.
fn ztunnel_connects(agent: &OwnedFd, path: &Path) -> anyhow::Result<(OwnedFd, OwnedFd)> {
    use nix::sys::socket::{SockFlag, UnixAddr, accept4, connect};
    let ztunnel = seqpacket()?;
    connect(ztunnel.as_raw_fd(), &UnixAddr::new(path)?)?;
    // Close-on-exec: an agent the test (re)starts must not inherit the node agent's end and
    // keep the connection open after the test closed it.
    let fd = accept4(agent.as_raw_fd(), SockFlag::SOCK_CLOEXEC)?;
    // SAFETY: accept(2) just returned this descriptor; nothing else owns it.
    let accepted = unsafe { OwnedFd::from_raw_fd(fd) };
    Ok((ztunnel, accepted))
}

#[tokio::test]
async fn ambient_node_is_verified_only_while_ztunnel_is_ready_and_connected() -> anyhow::Result<()>
{
    let cp = cp().await;
    let client = cp.client()?;
    let ns = cp.create_namespace(&client, "ztunnel").await?;
    let node = unique_name("agent-ambient");
    cp.register_node(&client, &NodeSpec::new(&node)).await?;
    let dirs = CniDirs::new()?;
    dirs.config("10-calico.conflist", &golden("calico-linkerd.conflist")?)?;
    let sock_dir = dirs.scratch().join("ztunnel");
    std::fs::create_dir(&sock_dir)?;
    let sock = sock_dir.join("ztunnel.sock");
    let sock_flag = sock.display().to_string();
    let mut agent = start_agent(cp, &node, &dirs, &ns, &sock_flag)?;
    // The chain alone is verified; no ztunnel yet.
    wait_not_ready(
        &agent,
        &client,
        &node,
        &format!("no pod app=ztunnel in {ns} on this node"),
    )
    .await?;

    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let name = unique_name("ztunnel");
    pods.create(
        &PostParams::default(),
        &bare_pod(&name, Some(&node), &[("app", "ztunnel")], Some(0)),
    )
    .await?;
    let not_ready = format!("pod {ns}/{name} is not Ready");
    wait_not_ready(&agent, &client, &node, &not_ready).await?;
    mark_pod_running(&client, &ns, &name, "10.0.0.2".parse()?).await?;
    let missing = format!("its socket {sock_flag} is missing: the CNI node agent");
    wait_not_ready(&agent, &client, &node, &missing).await?;

    // istio-cni's node agent listens; ztunnel is not connected yet: still gated.
    let not_connected = format!("ztunnel is not connected to {sock_flag}");
    let listener = node_agent(&sock)?;
    wait_not_ready(&agent, &client, &node, &not_connected).await?;
    let conn = ztunnel_connects(&listener, &sock)?;
    wait_verified(&agent, &client, &node, &name).await?;

    restart_never_gates_a_ready_node(&mut agent, &client, &node).await?;
    readiness_failure_gates_again(&agent, &client, &node, &ns, &name, &not_ready).await?;

    // ztunnel's connection closes (ztunnel exited; no file changes): gated again, by the
    // connection poll.
    drop(conn);
    wait_not_ready(&agent, &client, &node, &not_connected).await?;
    let conn = ztunnel_connects(&listener, &sock)?;
    wait_verified(&agent, &client, &node, &name).await?;

    // istio-cni's node agent exits, its socket removed: gated again.
    drop((conn, listener));
    std::fs::remove_file(&sock)?;
    wait_not_ready(&agent, &client, &node, &missing).await?;
    let listener = node_agent(&sock)?;
    let _conn = ztunnel_connects(&listener, &sock)?;
    wait_verified(&agent, &client, &node, &name).await?;

    // ztunnel's pod is deleted: gated again.
    pods.delete(&name, &DeleteParams::default().grace_period(0))
        .await?;
    wait_not_ready(
        &agent,
        &client,
        &node,
        &format!("no pod app=ztunnel in {ns} on this node"),
    )
    .await?;
    Ok(())
}

/// The agent with the istio-ambient profile, ztunnel's namespace and socket. A resync of an
/// hour: every change the test makes must reach the verdict through the pod watch, the socket
/// directory's inotify watch or the connection poll, not a periodic pass.
fn start_agent(
    cp: &ControlPlane,
    node: &str,
    dirs: &CniDirs,
    ns: &str,
    sock_flag: &str,
) -> anyhow::Result<Agent> {
    Ok(Agent::start(
        cp,
        node,
        dirs,
        &[
            "--profile",
            "istio-ambient",
            "--node-proxy-namespace",
            ns,
            "--node-proxy-socket",
            sock_flag,
            "--resync-interval",
            "1h",
        ],
    )?)
}

/// The agent restarts (SIGKILL) on a node whose ztunnel is ready: it waits for its pod
/// watch's first list before its first verdict, so the node is never gated meanwhile.
async fn restart_never_gates_a_ready_node(
    agent: &mut Agent,
    client: &Client,
    node: &str,
) -> anyhow::Result<()> {
    let watching = tokio::spawn(ever_tainted(
        client.clone(),
        node.to_owned(),
        Duration::from_secs(5),
    ));
    agent.kill9();
    agent.restart()?;
    agent.wait_ready(crate::WAIT).await?;
    assert!(
        !watching.await??,
        "the restarted agent gated a node whose ztunnel is ready"
    );
    Ok(())
}

/// ztunnel's readiness probe fails: gated again. Verified once it is Ready again.
async fn readiness_failure_gates_again(
    agent: &Agent,
    client: &Client,
    node: &str,
    ns: &str,
    name: &str,
    not_ready: &str,
) -> anyhow::Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    mark_not_ready(&pods, name).await?;
    wait_not_ready(agent, client, node, not_ready).await?;
    mark_pod_running(client, ns, name, "10.0.0.2".parse()?).await?;
    wait_verified(agent, client, node, name).await?;
    Ok(())
}

/// Without `--profile istio-ambient` (the default: every built-in profile), a node is
/// verified on its chain alone: a Linkerd or sidecar-Istio cluster is never gated on a
/// ztunnel it does not run.
#[tokio::test]
async fn without_the_ambient_profile_named_no_ztunnel_is_required() -> anyhow::Result<()> {
    let cp = cp().await;
    let client = cp.client()?;
    let node = unique_name("agent-no-ambient");
    cp.register_node(&client, &NodeSpec::new(&node)).await?;
    let dirs = CniDirs::new()?;
    dirs.config("10-calico.conflist", &golden("calico-linkerd.conflist")?)?;
    let _agent = Agent::start(cp, &node, &dirs, &["--resync-interval", "1h"])?;
    let n = wait_node(&client, &node, "Verified", |n: &Node| {
        !tainted(n) && condition(n).is_some_and(|(s, r, _)| s == "True" && r == "Verified")
    })
    .await?;
    let (_, _, message) = condition(&n).unwrap_or_default();
    assert!(!message.contains("ztunnel"), "{message}");
    Ok(())
}
