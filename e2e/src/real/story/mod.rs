//! meshgate's main job on real nodes, told once for `make demo` and for the e2e suite: S3 → S1
//! → S4 and an agent restart, on a real kubelet and containerd, with Istio's real CNI plugin
//! and meshgate installed from its own Helm chart.
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
//! 2. meshgate is installed with `helm install` from its chart (the real node's values: the
//!    local image, istio-cni required). The agent gates A and evicts the pod without rules; its replacement tolerates meshgate's taint,
//!    so the scheduler picks A, but the webhook refuses the binding and it waits, unbound. Node B
//!    registers, is tainted at CREATE by the webhook, and its own agent keeps it gated for the
//!    missing istio-cni. A meshed pod sent straight to A is refused.
//! 3. istio-cni is chained as Istio's installer does it (S1): A is untainted, the replacement
//!    gets its rules from istio-cni itself (iptables mode; istio-cni's log names it) and is
//!    judged `redirected`; then the same in `native_nftables` mode.
//! 4. The primary's conflist loses istio-cni (S4): A is re-tainted.
//! 5. A's agent pod is deleted and its DaemonSet recreates it: A stays tainted, nothing is
//!    evicted twice.

use crate::harness::wait;
use crate::harness::wait::poll_until;
use crate::real::cluster::{RealCluster, SYSTEM_NAMESPACE, is_ready};
use crate::real::node::{BUSYBOX_IMAGE, RealNode};
use crate::sim::node::{gate_condition, metric_sample, tainted};
use crate::{TokenOptions, service_account_token};
use anyhow::{Context, bail, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, ServiceAccount};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, PostParams};
use kube::{Client, ResourceExt};
use meshgate_core::gate::{CONDITION_TYPE, DEFAULT_TAINT_KEY as TAINT_KEY};
use serde_json::json;
use std::time::{Duration, Instant};
use steps::Story;

mod observe;
mod steps;
mod workload;

pub use observe::{all_running, istio_cni_log};
pub use workload::{
    app_pid, container_pid, in_netns, inspect_pid, istio_cni_kubeconfig, sidecar_pod_template,
};

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
    let a = cluster.add_node().await?;
    let story = Story {
        cluster,
        client: client.clone(),
        n,
        a: &a,
    };
    // --- 1. before meshgate: S3 ---------------------------------------------------------------
    let first = story.before_meshgate().await?;
    let first_uid = first.uid().unwrap_or_default();
    // --- 2. meshgate is installed -------------------------------------------------------------
    story.install().await?;
    story.evict_and_refuse_binding(&first).await?;
    story.node_b_tainted_at_create().await?;
    let refused = story.direct_pod_refused().await?;
    // --- 3. istio-cni is appended: S1 ---------------------------------------------------------
    let kubeconfig = istio_cni_kubeconfig(cp, &client, NAMESPACE).await?;
    let (untaint, replacement) = story.istio_cni_appended(&kubeconfig, &first_uid).await?;
    let nft = story
        .native_nftables(&kubeconfig, &first_uid, &replacement)
        .await?;
    // --- 4. drift: S4 -------------------------------------------------------------------------
    let (retaint, evicted) = story.drift().await?;
    // --- 5. the agent restarts ----------------------------------------------------------------
    story.agent_restarts(&nft).await?;
    Ok(Outcome {
        untaint_after_write: untaint,
        retaint_after_drift: retaint,
        evicted,
        refused,
        node: a.name().to_owned(),
    })
}
