//! A dedicated cluster of real nodes, with meshgate installed as a user installs it.
//!
//! In: root, the node binaries, images and helm (`e2e/install-deps.sh`), meshgate's image
//! (`make` builds it), and this repository's chart `manifests/charts/meshgate` with the real
//! node's values `e2e/chart/real-node-values.yaml`. Out: a [`RealCluster`]: a control plane the
//! nodes' network namespaces can reach ([`start_control_plane`]), real nodes added one by one
//! ([`RealCluster::add_node`]), meshgate installed with `helm install`
//! ([`RealCluster::install_meshgate`]) and removed with `helm uninstall`
//! ([`RealCluster::uninstall_meshgate`]), and the agent pod and admin address of a node. Dropping it stops every node (pods, kubelet, containerd, namespaces) and then the
//! control plane.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams, WatchEvent, WatchParams};

use crate::harness::helm;
use crate::harness::wait::{self, poll_until};
use crate::real::node::{RealNode, start_control_plane};
use crate::{ControlPlane, Error};

/// meshgate's namespace (the chart's `namespace` value).
pub const SYSTEM_NAMESPACE: &str = "meshgate-system";
/// The agent's admin port (`--admin-addr` in the chart's templates/agent.yaml), on the node's
/// address since the agent runs in the node's network namespace.
pub const AGENT_ADMIN_PORT: u16 = 9990;
/// The webhook Deployment's replicas (the chart's `webhook.replicas`).
const WEBHOOK_REPLICAS: usize = 2;
/// meshgate's pods start within this once applied (images are local).
const INSTALL_TIMEOUT: Duration = Duration::from_secs(120);
/// The real node's values for the chart.
pub const REAL_NODE_VALUES: &str = "e2e/chart/real-node-values.yaml";
/// `helm uninstall`: the objects' deletion, then the cleanup hook's wait for the agents to go
/// (their 30 s grace period) and its Node patches, within helm's own --timeout.
const UNINSTALL_TIMEOUT: Duration = Duration::from_secs(240);

/// A control plane of its own and the real nodes that joined it.
pub struct RealCluster {
    // Declared first so the nodes stop before the control plane does.
    nodes: Mutex<Vec<Arc<RealNode>>>,
    cp: ControlPlane,
}

impl std::fmt::Debug for RealCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RealCluster")
            .field("apiserver", &self.cp.apiserver_url())
            .finish_non_exhaustive()
    }
}

impl RealCluster {
    /// Starts the control plane (no node yet).
    pub async fn start() -> Result<Self, Error> {
        Ok(Self {
            nodes: Mutex::new(Vec::new()),
            cp: start_control_plane().await?,
        })
    }

    /// The control plane.
    pub fn control_plane(&self) -> &ControlPlane {
        &self.cp
    }

    /// Starts a real node and waits until it is `Ready`.
    pub async fn add_node(&self) -> Result<Arc<RealNode>, Error> {
        let node = Arc::new(RealNode::start(&self.cp).await?);
        self.nodes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(node.clone());
        Ok(node)
    }

    /// [`RealCluster::add_node`], and the Node as the apiserver first stored it (after the
    /// mutating admission webhooks ran at CREATE): a Node watch is opened before the kubelet
    /// starts, so its first `ADDED` event for the new node is that version.
    pub async fn add_node_seen_at_create(&self) -> Result<(Arc<RealNode>, Node), Error> {
        let nodes: Api<Node> = Api::all(self.cp.client()?);
        let rv = wait::api(
            "listing Nodes",
            nodes.list_metadata(&ListParams::default().limit(1)),
        )
        .await?
        .metadata
        .resource_version
        .unwrap_or_default();
        let mut stream = wait::api(
            "watching Nodes",
            nodes.watch(&WatchParams::default().timeout(290), &rv),
        )
        .await?
        .boxed();
        let node = self.add_node().await?;
        // The node is Ready by now: its ADDED event is already in the stream.
        let first = wait::bounded(
            "the new Node's ADDED event",
            Duration::from_secs(30),
            async {
                while let Some(ev) = stream
                    .try_next()
                    .await
                    .map_err(|e| Error::kube("watching Nodes", e))?
                {
                    if let WatchEvent::Added(n) = ev
                        && n.metadata.name.as_deref() == Some(node.name())
                    {
                        return Ok(n);
                    }
                }
                Err(Error::RealNode {
                    part: "kube-apiserver",
                    detail: format!("the Node watch ended before {} was added", node.name()),
                })
            },
        )
        .await?;
        Ok((node, first))
    }

    /// `helm install` of the chart with the real node's values, as an operator runs it
    /// (the chart makes its own TLS material). Returns once the webhook's replicas and an
    /// agent on every node are Ready; the error carries their statuses and logs otherwise.
    pub async fn install_meshgate(&self) -> Result<(), Error> {
        self.install_meshgate_with(&[]).await
    }

    /// [`RealCluster::install_meshgate`] with more values files (repository-relative paths),
    /// layered over the real node's in order.
    pub async fn install_meshgate_with(&self, more_values: &[&str]) -> Result<(), Error> {
        let root = crate::harness::paths::repo_root();
        let mut args = Vec::new();
        for file in std::iter::once(REAL_NODE_VALUES).chain(more_values.iter().copied()) {
            args.push("--values".to_owned());
            args.push(root.join(file).to_string_lossy().into_owned());
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        helm::release(&self.cp, "install", &args, INSTALL_TIMEOUT).await?;
        self.ready_pods("meshgate-webhook", None, WEBHOOK_REPLICAS)
            .await?;
        let nodes = self.nodes.lock().unwrap_or_else(|p| p.into_inner()).clone();
        for node in &nodes {
            self.ready_pods("meshgate-agent", Some(node), 1).await?;
        }
        Ok(())
    }

    /// `helm uninstall` as an operator runs it: one command, bounded; helm's output.
    pub async fn uninstall_meshgate(&self) -> Result<String, Error> {
        let timeout = format!("{}s", UNINSTALL_TIMEOUT.as_secs());
        let args = [
            "uninstall",
            helm::RELEASE,
            "--namespace",
            helm::RELEASE_NAMESPACE,
            "--timeout",
            &timeout,
        ];
        helm::run(&self.cp, &args, UNINSTALL_TIMEOUT + Duration::from_secs(30)).await
    }

    /// The agent pod on `node` (not one being deleted).
    pub async fn agent_pod(&self, node: &RealNode) -> Result<Pod, Error> {
        let pods = self.agent_pods(node).await?;
        pods.into_iter()
            .find(|p| p.metadata.deletion_timestamp.is_none())
            .ok_or_else(|| Error::RealNode {
                part: "meshgate-agent",
                detail: format!("no agent pod on {}", node.name()),
            })
    }

    /// Where the agent on `node` serves `/metrics`, `/ready` and `/live`, seen from the host.
    pub fn agent_admin(&self, node: &RealNode) -> SocketAddr {
        SocketAddr::from((node.node_ip(), AGENT_ADMIN_PORT))
    }

    /// Waits until `count` pods of meshgate's workload `app` (on `node`, when given) are Ready.
    pub async fn ready_pods(
        &self,
        app: &str,
        node: Option<&RealNode>,
        count: usize,
    ) -> Result<Vec<Pod>, Error> {
        let pods: Api<Pod> = Api::namespaced(self.cp.client()?, SYSTEM_NAMESPACE);
        let lp = pods_of(app, node);
        let got = poll_until(
            &format!("{count} Ready {app} pod(s)"),
            INSTALL_TIMEOUT,
            || async {
                let list = pods.list(&lp).await?;
                let ready: Vec<Pod> = list.items.into_iter().filter(is_ready).collect();
                Ok::<_, kube::Error>((ready.len() >= count).then_some(ready))
            },
        )
        .await;
        match got {
            Ok(ready) => Ok(ready),
            Err(e) => {
                let statuses: Vec<String> = wait::api("listing meshgate's pods", pods.list(&lp))
                    .await
                    .map(|l| {
                        l.items
                            .iter()
                            .map(|p| format!("{:?}: {:?}", p.metadata.name, p.status))
                            .collect()
                    })
                    .unwrap_or_default();
                let nodes = self.nodes.lock().unwrap_or_else(|p| p.into_inner()).clone();
                let logs: Vec<String> = nodes
                    .iter()
                    .map(|n| {
                        format!(
                            "{}'s meshgate logs:\n{}\nits kubelet:\n{}",
                            n.name(),
                            n.pod_logs(SYSTEM_NAMESPACE),
                            n.log_tail("kubelet", 30)
                        )
                    })
                    .collect();
                Err(Error::RealNode {
                    part: "meshgate's pods",
                    detail: format!("{e}\npods: {statuses:#?}\n{}", logs.join("\n")),
                })
            }
        }
    }

    /// The ends of meshgate's container logs on every node, for failure messages.
    pub fn meshgate_logs(&self) -> String {
        let nodes = self.nodes.lock().unwrap_or_else(|p| p.into_inner()).clone();
        nodes
            .iter()
            .map(|n| (n.name(), n.pod_logs(SYSTEM_NAMESPACE)))
            .filter(|(_, logs)| !logs.is_empty())
            .map(|(name, logs)| format!("meshgate's logs on {name}:\n{logs}"))
            .collect::<Vec<_>>()
            .join("\n")
    }

    async fn agent_pods(&self, node: &RealNode) -> Result<Vec<Pod>, Error> {
        let pods: Api<Pod> = Api::namespaced(self.cp.client()?, SYSTEM_NAMESPACE);
        let lp = pods_of("meshgate-agent", Some(node));
        Ok(wait::api("listing the agent's pods", pods.list(&lp))
            .await?
            .items)
    }
}

impl Drop for RealCluster {
    fn drop(&mut self) {
        // Nodes before the control plane: their teardown deletes pods through the apiserver.
        let nodes = std::mem::take(&mut *self.nodes.lock().unwrap_or_else(|p| p.into_inner()));
        for node in nodes.iter().rev() {
            node.stop();
        }
    }
}

fn pods_of(app: &str, node: Option<&RealNode>) -> ListParams {
    let lp = ListParams::default().labels(&format!("app.kubernetes.io/name={app}"));
    match node {
        Some(n) => lp.fields(&format!("spec.nodeName={}", n.name())),
        None => lp,
    }
}

/// Whether the pod's `Ready` condition is true.
pub fn is_ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}
