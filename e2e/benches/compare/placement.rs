//! The placement policy at fleet size: what the apiserver pays for it with 1,000, 10,000 and
//! 65,000 Node objects (`MESHGATE_BENCH_PLACEMENT_NODES`, comma-separated).
//!
//! At each size the section registers the missing Nodes (objects only: the labels, taints
//! and provider id of a cloud node, no kubelet), 10 of them gated for the policy, then reads
//! the kube-apiserver's resident memory without the policy, registers the shipped policy
//! (scoped by a label on one namespace and on the gated Nodes), reads it again once the policy
//! is enforced, and times pod CREATEs (dry run) on the policy's namespace beside the same on a
//! namespace it does not select, alternating. Out: one row per size; the memory difference is
//! what the policy's params cost, the latency difference what selecting and evaluating them
//! costs a request among that many Nodes.

use super::*;
use meshgate_e2e::load::api;
use meshgate_e2e::load::http_abuse::memory_kib;
use meshgate_e2e::load::review::Report;
use meshgate_e2e::sim::policy as placement;
use meshgate_e2e::sim::webhook::Scope;

const TAG: &str = "plc";
/// The label of the policy's namespace and of its params.
const KEY: &str = "bench.meshgate.io/placement-scale";
/// Gated Nodes among them, carrying [`KEY`].
const GATED: usize = 10;

fn sizes() -> Vec<usize> {
    std::env::var("MESHGATE_BENCH_PLACEMENT_NODES")
        .ok()
        .map(|v| v.split(',').filter_map(|n| n.trim().parse().ok()).collect())
        .filter(|v: &Vec<usize>| !v.is_empty())
        .unwrap_or_else(|| vec![1_000, 10_000, 65_000])
}

/// One size's readings.
struct Reading {
    nodes: usize,
    created_in: Duration,
    rss_without_kib: u64,
    rss_with_kib: u64,
    policy: Report,
    none: Report,
}

pub(super) async fn run(
    cp: &ControlPlane,
    client: &Client,
    table: &mut Table,
) -> anyhow::Result<()> {
    let pid = cp
        .component_pid("kube-apiserver")
        .context("kube-apiserver's pid")?;
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    let (with, without) = (
        cp.create_namespace(client, "plcw").await?,
        cp.create_namespace(client, "plcn").await?,
    );
    let label = Patch::Merge(json!({"metadata": {"labels": {KEY: "yes"}}}));
    namespaces
        .patch(&with, &PatchParams::default(), &label)
        .await?;
    cp.freeze_component("kube-controller-manager", true)?;
    let mut readings = Vec::new();
    let mut have = 0;
    let result: anyhow::Result<()> = async {
        for n in sizes() {
            eprintln!("placement: {n} Nodes ...");
            let began = Instant::now();
            create(client, have, n).await?;
            have = have.max(n);
            readings.push(measure(cp, client, pid, (&with, &without), n, began.elapsed()).await?);
        }
        Ok(())
    }
    .await;
    cp.freeze_component("kube-controller-manager", false)?;
    result?;
    for ns in [&with, &without] {
        let _ = namespaces.delete(ns, &DeleteParams::default()).await;
    }
    report(table, &readings);
    Ok(())
}

/// Registers Nodes `have..n` (`plc-<i>`), the first [`GATED`] gated and labelled [`KEY`].
async fn create(client: &Client, have: usize, n: usize) -> anyhow::Result<()> {
    let nodes = (have..n).map(|i| {
        let mut node = review::cloud_node(&format!("{TAG}-{i}"), i >= GATED)?;
        if i < GATED {
            node.labels_mut().insert(KEY.into(), "yes".into());
        }
        Ok(node)
    });
    review::create_node_objects(client, nodes, 32).await
}

/// The apiserver's resident memory once it has settled (KiB).
async fn settled_rss(pid: i32) -> anyhow::Result<u64> {
    tokio::time::sleep(Duration::from_secs(10)).await;
    memory_kib(pid as u32)
        .map(|(rss, _)| rss)
        .context("kube-apiserver's memory")
}

async fn measure(
    cp: &ControlPlane,
    client: &Client,
    pid: i32,
    (with, without): (&str, &str),
    nodes: usize,
    created_in: Duration,
) -> anyhow::Result<Reading> {
    let rss_without_kib = settled_rss(pid).await?;
    let scope = Scope {
        label: Some((KEY.into(), "yes".into())),
        hook_infix: None,
    };
    placement::register(cp, client, TAG, &scope).await?;
    let sides = [
        Api::<Pod>::namespaced(client.clone(), with),
        Api::<Pod>::namespaced(client.clone(), without),
    ];
    let measured = async {
        enforced(&sides[0]).await?;
        let rss_with_kib = settled_rss(pid).await?;
        let (mut policy, mut none) = (Report::default(), Report::default());
        for r in 0..4 {
            for i in if r % 2 == 0 { [0, 1] } else { [1, 0] } {
                let report = dry_runs(&sides[i], nodes).await?;
                let into = if i == 0 { &mut policy } else { &mut none };
                into.samples.extend(report.samples);
            }
        }
        anyhow::Ok(Reading {
            nodes,
            created_in,
            rss_without_kib,
            rss_with_kib,
            policy,
            none,
        })
    }
    .await;
    placement::unregister(client, TAG).await;
    measured
}

/// Waits until the policy refuses a meshed pod on the first gated Node.
async fn enforced(pods: &Api<Pod>) -> anyhow::Result<()> {
    let pod = meshed_pod("probe", &format!("{TAG}-0"), &[], Some(0));
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let end = Instant::now() + Duration::from_secs(60);
    while pods.create(&dry, &pod).await.is_ok() {
        ensure_before(end)?;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

fn ensure_before(end: Instant) -> anyhow::Result<()> {
    if Instant::now() > end {
        bail!("the placement policy was not enforced within 60 s");
    }
    Ok(())
}

/// 500 dry-run CREATEs of meshed pods bound for verified Nodes, at 100/s.
async fn dry_runs(pods: &Api<Pod>, nodes: usize) -> anyhow::Result<Report> {
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let report = api::open_loop(100.0, 500, 64, Duration::from_secs(10), |k| {
        let (pods, dry) = (pods.clone(), dry.clone());
        let pod = meshed_pod(
            &format!("plc-{k}"),
            &format!("{TAG}-{}", GATED + k % (nodes - GATED).max(1)),
            &[],
            Some(0),
        );
        async move {
            pods.create(&dry, &pod)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        }
    })
    .await?;
    if let Some(e) = report.errors().first() {
        bail!(
            "{} dry-run errors, first: {:?}",
            report.errors().len(),
            e.outcome
        );
    }
    Ok(report)
}

fn report(table: &mut Table, readings: &[Reading]) {
    for r in readings {
        let (p50, p99) = (r.policy.latency(0.5), r.policy.latency(0.99));
        let (n50, n99) = (r.none.latency(0.5), r.none.latency(0.99));
        let delta = r.rss_with_kib as f64 - r.rss_without_kib as f64;
        table.row(
            &format!("pod CREATE (dry run) at 100/s among {} Nodes, {GATED} gated, p50 / p99, with the placement policy", r.nodes),
            format!("{} / {}", human(p50), human(p99)),
            "same requests, a namespace the policy does not select, same run",
            format!("{} / {}", human(n50), human(n99)),
            format!("{} / {}", ratio(p50, n50), ratio(p99, n99)),
            "",
            None,
        );
        table.row(
            &format!(
                "kube-apiserver RSS with {} Nodes: with the placement policy / without",
                r.nodes
            ),
            format!("{:.0} MiB", r.rss_with_kib as f64 / 1024.0),
            "the same apiserver before the policy was registered",
            format!("{:.0} MiB", r.rss_without_kib as f64 / 1024.0),
            format!("{:+.1} MiB", delta / 1024.0),
            "",
            None,
        );
        table.note(format!(
            "Placement at {} Nodes (registered in {:.0} s, 32 creates at a time): policy side {} requests, none side {}; RSS read 10 s after the last change, as VmRSS.",
            r.nodes,
            r.created_in.as_secs_f64(),
            r.policy.samples.len(),
            r.none.samples.len(),
        ));
    }
}
