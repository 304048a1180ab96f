//! The real node: untaint and re-taint on a real kubelet and containerd node, with Istio's
//! real CNI plugin and meshgate installed from its Helm chart, stage by stage, beside the
//! stand-in node's figures of the same run.
//!
//! In: root inside a private mount namespace, the node binaries and images, helm, meshgate's
//! image (`make`'s IMAGE line), and the gating section's figures when it ran. Out: rows of the
//! table (p50 and p99 of untaint and re-taint), rows of the stage table, and notes. The node
//! runs its own control plane ([`RealCluster`]), torn down at the end.
//!
//! Each transition is one write, stamped on the writer's clocks just before it, and ends when
//! the bench's Node watch sees the taint change; the next write waits for that, so each of the
//! agent's `verify stages` lines (read from its container log) belongs to one transition.
//! - S1, as Istio's installer does on each install: istio-cni's binary copied in (a new
//!   file, `copyBinaries`; `MESHGATE_BENCH_REALNODE_COPY=0` skips it, so the probe cache
//!   answers), its kubeconfig, then its entry appended to the conflist (stamped here).
//! - S4: the primary CNI rewrites its conflist without istio-cni.

use super::*;
use meshgate_e2e::real::cluster::{RealCluster, SYSTEM_NAMESPACE};
use meshgate_e2e::real::node::RealNode;
use meshgate_e2e::real::story::istio_cni_kubeconfig;

use gating::{StandIn, until, watch_taint};
use stages::{Transition, stamp};

/// The agent's `verify stages` lines on `node`: its container logs, from the kubelet's
/// pod-logs dir (`<ns>_<pod>_<uid>/agent/<n>.log`, CRI lines ending in the JSON the agent
/// wrote).
fn agent_log(node: &RealNode) -> String {
    let prefix = format!("{SYSTEM_NAMESPACE}_meshgate-agent-");
    let pods = std::fs::read_dir(node.dir().join("kubelet/pod-logs"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|p| p.file_name().to_string_lossy().starts_with(&prefix));
    let mut out = String::new();
    for pod in pods {
        for log in std::fs::read_dir(pod.path().join("agent"))
            .into_iter()
            .flatten()
            .flatten()
        {
            out.push_str(&std::fs::read_to_string(log.path()).unwrap_or_default());
        }
    }
    out
}

/// Transitions and their stages on one real node.
async fn measure(
    n: usize,
    copy: bool,
) -> anyhow::Result<(Vec<Transition>, Vec<stages::Breakdown>)> {
    eprintln!(
        "realnode: starting a control plane and a real node, installing meshgate with helm ..."
    );
    let cluster = RealCluster::start().await?;
    let cp = cluster.control_plane();
    let client = cp.client()?;
    let node = cluster.add_node().await?;
    let ns = cp.create_namespace(&client, "bench-istio").await?;
    let kubeconfig = istio_cni_kubeconfig(cp, &client, &ns).await?;
    cluster.install_meshgate().await?;
    let (mut rx, w) = watch_taint(&client, node.name(), meshgate_core::gate::DEFAULT_TAINT_KEY);
    until(&mut rx, true)
        .await
        .context("the real node gated after the install")?;
    let skip = stages::count(&stages::settle(1, || agent_log(&node)).await);
    eprintln!("realnode: {n} S1 → S4 transitions (istio-cni binary copied each time: {copy}) ...");
    let mut transitions = Vec::with_capacity(2 * n);
    for _ in 0..n {
        for tainted in [false, true] {
            if !tainted && copy {
                node.copy_istio_cni_binary()?;
            }
            // Node updates from before the write (the kubelet's status, our condition) are
            // not the transition's.
            while rx.try_recv().is_ok() {}
            let (wall, at) = stamp();
            if tainted {
                node.remove_istio_cni()?;
            } else {
                node.install_istio_cni(&kubeconfig, false)?;
            }
            let seen = until(&mut rx, tainted).await?;
            transitions.push(Transition {
                tainted,
                wall,
                at,
                seen,
            });
        }
    }
    w.abort();
    let log = stages::settle(skip + 2 * n, || agent_log(&node)).await;
    let joined = stages::join(&transitions, &log, skip).context("the real node's stages")?;
    drop(cluster);
    Ok((transitions, joined))
}

pub(super) async fn run(table: &mut Table, standin: Option<&StandIn>) -> anyhow::Result<()> {
    let n = env_num("MESHGATE_BENCH_REALNODE_TRANSITIONS", 50) as usize;
    let copy = env_num("MESHGATE_BENCH_REALNODE_COPY", 1) != 0;
    let (transitions, joined) = measure(n, copy).await?;
    for (what, tainted, goal) in [
        (
            "untaint on a real node (istio-cni, chart install)",
            false,
            50,
        ),
        ("re-taint on a real node (S4)", true, 30),
    ] {
        let mut totals: Vec<Duration> = transitions
            .iter()
            .filter(|t| t.tainted == tainted)
            .map(|t| t.seen - t.at)
            .collect();
        totals.sort();
        let theirs = standin.map(|s| if tainted { &s.retaint } else { &s.untaint });
        for (q, label) in [(0.5, "p50"), (0.99, "p99")] {
            let ours = quantile(&totals, q);
            let beside = theirs.map(|s| quantile(s, q));
            table.row(
                &format!("{what}, {label}"),
                human(ours),
                "stand-in node, same run",
                beside.map_or("not run".into(), human),
                beside.map_or("—".into(), |b| {
                    format!(
                        "{:.1}× the stand-in",
                        ours.as_secs_f64() / b.as_secs_f64().max(1e-9)
                    )
                }),
                if label == "p99" {
                    if tainted {
                        "p99 ≤ 30 ms"
                    } else {
                        "p99 ≤ 50 ms"
                    }
                } else {
                    ""
                },
                (label == "p99").then_some(ours <= Duration::from_millis(goal)),
            );
        }
    }
    stages::rows(table, "real node", &transitions, &joined);
    table.note(format!(
        "Real node: {n} S1 → S4 transitions on one kubelet + containerd node with Istio's real istio-cni, meshgate from its chart (the agent with no CPU limit, as the chart sets it); S1 = {}, S4 = the conflist rewritten without it. Measured from the conflist write to the bench's Node watch seeing the taint change.",
        if copy {
            "istio-cni's binary copied in as a new file (Istio's `copyBinaries`), then its entry appended to the conflist (written to a temporary file and renamed over it, as `file.AtomicWrite`)"
        } else {
            "istio-cni's entry appended to the conflist (temporary file renamed over it), its binary copied only before the first (MESHGATE_BENCH_REALNODE_COPY=0: the agent's probe cache answers from the second on)"
        }
    ));
    Ok(())
}
