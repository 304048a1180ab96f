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
//!
//! Then a steady window (`MESHGATE_BENCH_REALNODE_STEADY_SECS`, 60) with nothing changing:
//! the node's kubelet's requests and the agent's, from the control plane's audit log, side
//! by side (the kubelet is the reference for what one node may cost the apiserver).

use super::*;
use meshgate_e2e::harness::audit::{self, Request};
use meshgate_e2e::load::agent_cost::tally;
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

/// One identity's requests in the steady window, and its watches open at its end.
struct Steady {
    requests: Vec<Request>,
    open_watches: usize,
}

/// The kubelet's and the agent's requests on `node` over `secs` of nothing changing.
async fn steady(cp: &ControlPlane, node: &str, secs: u64) -> anyhow::Result<[Steady; 2]> {
    eprintln!("realnode: {secs} s steady, counting the kubelet's and the agent's requests ...");
    let from = std::time::SystemTime::now();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let to = std::time::SystemTime::now();
    let all = audit::read(&cp.audit_log()).context("reading the audit log")?;
    let kubelet = format!("system:node:{node}");
    let agent = audit::service_account_user(SYSTEM_NAMESPACE, "meshgate-agent");
    Ok([kubelet, agent].map(|user| {
        let mine: Vec<Request> = all
            .iter()
            .filter(|r| {
                r.user == user
                    && r.impersonated_user
                        .as_deref()
                        .is_none_or(|i| i == format!("system:node:{node}"))
            })
            .cloned()
            .collect();
        Steady {
            open_watches: tally::open_watches(&mine).values().sum(),
            requests: mine
                .into_iter()
                .filter(|r| r.received >= from && r.received < to)
                .collect(),
        }
    }))
}

/// Transitions and their stages on one real node, and its steady window.
async fn measure(
    n: usize,
    copy: bool,
    steady_secs: u64,
) -> anyhow::Result<(Vec<Transition>, Vec<stages::Breakdown>, [Steady; 2])> {
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
    let steady = steady(cp, node.name(), steady_secs).await?;
    drop(cluster);
    Ok((transitions, joined, steady))
}

pub(super) async fn run(table: &mut Table, standin: Option<&StandIn>) -> anyhow::Result<()> {
    let n = env_num("MESHGATE_BENCH_REALNODE_TRANSITIONS", 50) as usize;
    let copy = env_num("MESHGATE_BENCH_REALNODE_COPY", 1) != 0;
    let steady_secs = env_num("MESHGATE_BENCH_REALNODE_STEADY_SECS", 60).max(1);
    let (transitions, joined, steady) = measure(n, copy, steady_secs).await?;
    steady_rows(table, &steady, steady_secs);
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

/// The agent's steady requests beside the kubelet's on the same node.
fn steady_rows(table: &mut Table, [kubelet, agent]: &[Steady; 2], secs: u64) {
    let per_min = |s: &Steady| s.requests.len() as f64 * 60.0 / secs as f64;
    let (k, a) = (per_min(kubelet), per_min(agent));
    table.row(
        "API requests per minute on a real node, steady (nothing changing): the agent / its open watches",
        format!("{a:.1}/min, {} LIST / {}", tally::lists(&agent.requests), agent.open_watches),
        "the same node's kubelet, same window",
        format!(
            "{k:.1}/min, {} LIST / {}",
            tally::lists(&kubelet.requests),
            kubelet.open_watches
        ),
        format!("{:.2}×", a / k.max(1e-9)),
        "0 LIST",
        Some(tally::lists(&agent.requests) == 0),
    );
    let kinds = |s: &Steady| {
        tally::by_kind(&s.requests)
            .into_iter()
            .map(|(kind, n)| format!("{kind} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    table.note(format!(
        "Real node, steady {secs} s, from the audit log: the kubelet (`system:node:<node>`): {}; the agent (its ServiceAccount, impersonating the node or not): {}.",
        kinds(kubelet),
        if agent.requests.is_empty() { "none".into() } else { kinds(agent) },
    ));
}
