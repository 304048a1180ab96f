//! Fleet: the webhook and the apiserver among 1,000, 10,000 and 65,000 Node objects
//! (`MESHGATE_BENCH_FLEET_NODES`, comma-separated), each figure beside the same at 50 Nodes
//! in the same run.
//!
//! In: a control plane of its own (so the count of Nodes is exactly what this section
//! registered), the release `meshgate-webhook`. Out: rows, a scale table and notes for the
//! table, and an SVG of RSS against Nodes (`MESHGATE_BENCH_FLEET_SVG`, default
//! `target/bench/fleet-rss.svg` under the workspace).
//!
//! One pass over the sizes, 50 first, the Nodes of each size added to the last's (objects
//! only, no kubelet: a GKE node's labels, taints, conditions, addresses, capacity and images,
//! [`cloud_node`], about 15 KB each). At each size, with the controller manager frozen:
//! - the apiserver ([`apiserver`]): its RSS without the placement policy, then with it (the
//!   difference is what the policy's params cost), and dry-run pod CREATEs with and without;
//! - the webhook, after the apiserver (whose memory its LIST would inflate): a cold start,
//!   the time until `/ready` (every cache listed) with the count of Nodes its log says it
//!   cached, its RSS once synced, and the typical mix of the `webhook` section at
//!   `MESHGATE_BENCH_FLEET_RATE` (2,000/s) for `MESHGATE_BENCH_LOAD_SECS`, reviews naming
//!   Nodes across the whole fleet.
//!
//! Then, on a second control plane of its own, the same webhook among as many Nodes twice as
//! large (more images) as at `MESHGATE_BENCH_FLEET_DOUBLE_AT` (10,000; 0 skips): what the
//! webhook keeps per Node should not grow with the objects.

mod apiserver;
mod report;

use super::*;
use meshgate_e2e::load::cloud_node;
use meshgate_e2e::load::review::{Report, WebhookProcess};

/// The baseline's size, measured first.
const BASELINE: usize = 50;
/// Nodes gated for the placement policy (unverified, labelled [`apiserver::KEY`]): the
/// policy's params.
const GATED: usize = 10;
/// Concurrent Node creates.
const PARALLEL: usize = 32;
/// Below this much available memory (MiB) no larger size is started.
const MIN_AVAILABLE_MIB: u64 = 4096;

fn sizes() -> Vec<usize> {
    let mut v: Vec<usize> = std::env::var("MESHGATE_BENCH_FLEET_NODES")
        .ok()
        .map(|v| v.split(',').filter_map(|n| n.trim().parse().ok()).collect())
        .filter(|v: &Vec<usize>| !v.is_empty())
        .unwrap_or_else(|| vec![1_000, 10_000, 65_000]);
    v.retain(|n| *n > BASELINE);
    v.push(BASELINE);
    v.sort_unstable();
    v.dedup();
    v
}

/// Node `i`'s name: as long as a GKE node's, a node pool's id changing every 500 Nodes.
fn node_name(prefix: &str, i: usize) -> String {
    format!(
        "gke-{prefix}-default-pool-{:08x}-{i:05}",
        0x3f2a_9c00 + i / 500
    )
}

/// The first [`GATED`] Nodes and every tenth are unverified; the rest verified.
fn verified(i: usize) -> bool {
    i >= GATED && !i.is_multiple_of(10)
}

/// What one Node registration pass did.
#[derive(Clone, Copy, Debug, Default)]
struct Creation {
    created: usize,
    took: Duration,
}

impl Creation {
    fn rate(&self) -> f64 {
        self.created as f64 / self.took.as_secs_f64().max(1e-9)
    }
}

/// Registers Nodes `have..n` named by `prefix`, with `images` images each.
async fn create(
    client: &Client,
    prefix: &str,
    (have, n): (usize, usize),
    images: usize,
) -> anyhow::Result<Creation> {
    let began = Instant::now();
    let nodes = (have..n).map(|i| {
        let mut node = cloud_node::registered(&node_name(prefix, i), verified(i), images)?;
        if i < GATED {
            node.labels_mut()
                .insert(apiserver::KEY.into(), "yes".into());
        }
        Ok(node)
    });
    review::create_node_objects(client, nodes, PARALLEL).await?;
    Ok(Creation {
        created: n.saturating_sub(have),
        took: began.elapsed(),
    })
}

/// The webhook from a cold start among the Nodes present.
struct WebhookReading {
    synced_in: Duration,
    cached: usize,
    rss_kib: u64,
    hwm_kib: u64,
    reviews: Report,
    server: String,
}

/// One size's readings.
struct Step {
    nodes: usize,
    creation: Creation,
    object_bytes: usize,
    available_mib: u64,
    apiserver: apiserver::Reading,
    webhook: WebhookReading,
}

/// `MemAvailable` of the machine, MiB.
fn available_mib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines().find_map(|l| {
                l.strip_prefix("MemAvailable:")?
                    .trim()
                    .strip_suffix("kB")?
                    .trim()
                    .parse::<u64>()
                    .ok()
            })
        })
        .map_or(0, |kib| kib / 1024)
}

/// The size of Node `name` as the apiserver serves it (JSON, managed fields included).
async fn served_size(client: &Client, name: &str) -> anyhow::Result<usize> {
    let api: Api<Node> = Api::all(client.clone());
    let node = tokio::time::timeout(meshgate_e2e::harness::wait::API_TIMEOUT, api.get(name))
        .await
        .with_context(|| format!("reading {name}: no answer"))??;
    let images = node
        .status
        .as_ref()
        .and_then(|s| s.images.as_ref())
        .map_or(0, Vec::len);
    anyhow::ensure!(
        images > 0,
        "{name} was stored without its status.images: the apiserver dropped the status on create"
    );
    Ok(serde_json::to_vec(&node)?.len())
}

pub(super) async fn run(table: &mut Table) -> anyhow::Result<()> {
    eprintln!("fleet: starting a control plane of its own ...");
    let cp = ControlPlane::start(Options::default()).await?;
    let client = cp.client()?;
    let steps = pass(&cp, &client).await;
    let _ = cp.freeze_component("kube-controller-manager", false);
    cp.stop();
    drop(cp);
    let steps = steps?;
    let double = match env_num("MESHGATE_BENCH_FLEET_DOUBLE_AT", 10_000) as usize {
        0 => None,
        at => {
            let at = steps
                .iter()
                .map(|s| s.nodes)
                .find(|n| *n == at)
                .or_else(|| steps.get(1).map(|s| s.nodes));
            match at {
                Some(at) => Some(double(at).await.context("Nodes twice as large")?),
                None => None,
            }
        }
    };
    report::report(table, &steps, double.as_ref())
}

/// The pass over the sizes on `cp`; stops early (with what it has) when memory runs short.
async fn pass(cp: &ControlPlane, client: &Client) -> anyhow::Result<Vec<Step>> {
    let scene = apiserver::Scene::set_up(cp, client).await?;
    let ns = reviewed(cp, client).await?;
    // After the namespaces' ServiceAccounts, which its controllers create.
    cp.freeze_component("kube-controller-manager", true)?;
    let mut steps = Vec::new();
    let mut have = 0;
    for n in sizes() {
        let available = available_mib();
        if have > 0 && available < MIN_AVAILABLE_MIB {
            eprintln!(
                "fleet: stopping before {n} Nodes: {available} MiB available, under {MIN_AVAILABLE_MIB} MiB"
            );
            break;
        }
        eprintln!("fleet: registering Nodes {have}..{n} ({available} MiB available) ...");
        let creation = create(client, "fleet", (have, n), cloud_node::TYPICAL_IMAGES).await?;
        eprintln!(
            "  {} Nodes in {:.1} s: {:.0}/s",
            creation.created,
            creation.took.as_secs_f64(),
            creation.rate()
        );
        have = n;
        let object_bytes = served_size(client, &node_name("fleet", GATED + 1)).await?;
        let apiserver = scene.measure(cp, client, n).await?;
        let webhook = cold_start(cp, n, &fleet_mix(n, &ns)).await?;
        steps.push(Step {
            nodes: n,
            creation,
            object_bytes,
            available_mib: available_mib(),
            apiserver,
            webhook,
        });
    }
    scene.tear_down(client).await;
    Ok(steps)
}

/// What the reviews name besides Nodes: the pod reviews' namespace, and the pending meshed pod
/// the bindings bind, in a namespace of its own (returned).
async fn reviewed(cp: &ControlPlane, client: &Client) -> anyhow::Result<String> {
    review::create_namespace(client).await?;
    let ns = cp.create_namespace(client, "fleetp").await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    tokio::time::timeout(
        meshgate_e2e::harness::wait::API_TIMEOUT,
        pods.create(&PostParams::default(), &pending_meshed_pod("pending")),
    )
    .await
    .context("creating the pending pod: no answer")??;
    Ok(ns)
}

/// The `webhook` section's typical mix, 4,000 reviews naming Nodes across all `n`: 60% meshed
/// pods on verified Nodes, 30% plain pods on unverified ones, 10% bindings to verified ones
/// of the pending meshed pod.
fn fleet_mix(n: usize, ns: &str) -> Vec<Review> {
    let (good, bad): (Vec<usize>, Vec<usize>) = (0..n).partition(|i| verified(*i));
    (0..4000)
        .map(|i| {
            let uid = format!("fleet-{i}");
            // A stride coprime with most sizes spreads consecutive reviews across the fleet.
            let v = node_name("fleet", good[(i * 7919) % good.len()]);
            let u = node_name("fleet", bad[(i * 7919) % bad.len()]);
            match i % 10 {
                0..=5 => review::pod_review(&uid, &v, true, true),
                6..=8 => review::pod_review(&uid, &u, false, true),
                _ => review::binding_review(&uid, ns, "pending", &v, true),
            }
        })
        .collect()
}

/// A cold start of the webhook among `n` Nodes: time to sync, RSS, and `mix` at the rate.
async fn cold_start(cp: &ControlPlane, n: usize, mix: &[Review]) -> anyhow::Result<WebhookReading> {
    eprintln!("  webhook: cold start among {n} Nodes ...");
    // SAFETY of set_var: see agent_log.
    unsafe { std::env::set_var("MESHGATE_WEBHOOK_LOG", "warn,meshgate_webhook=info") };
    let mut hook = WebhookProcess::start(cp.admin_kubeconfig_path(), &[])?;
    let synced_in = hook.wait_ready(Duration::from_secs(300)).await?;
    let cached = hook
        .cached_nodes()
        .with_context(|| format!("no \"caches synced\" line with nodes=:\n{}", hook.log()))?;
    anyhow::ensure!(
        cached == n,
        "the webhook reported {cached} Nodes cached at /ready, not {n}"
    );
    // Let the list's buffers go and the allocator settle, as the webhook section does.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (rss_kib, hwm_kib) = hook.rss_kib().context("the webhook's memory")?;
    let (reviews, server) = load(&hook, mix).await?;
    eprintln!(
        "  synced in {:.2} s, {:.1} MiB (peak {:.1}); {}; {server}",
        synced_in.as_secs_f64(),
        rss_kib as f64 / 1024.0,
        hwm_kib as f64 / 1024.0,
        reviews.summary()
    );
    Ok(WebhookReading {
        synced_in,
        cached,
        rss_kib,
        hwm_kib,
        reviews,
        server,
    })
}

/// A warm-up, then `mix` at `MESHGATE_BENCH_FLEET_RATE` for `MESHGATE_BENCH_LOAD_SECS`;
/// every answer must be right. Also the webhook's own handling time from its histogram.
async fn load(hook: &WebhookProcess, mix: &[Review]) -> anyhow::Result<(Report, String)> {
    let connector = review::tls_connector(&hook.ca_der)?;
    let reviews = Arc::new(mix.to_vec());
    let spec = |rate: f64, secs: f64| review::Spec {
        addr: hook.listen,
        path: "/validate".into(),
        connector: connector.clone(),
        reviews: reviews.clone(),
        rate,
        duration: Duration::from_secs_f64(secs),
        connections: 16,
    };
    let warm = review::run(spec(500.0, 2.0)).await?;
    let scrape = || async {
        webhook::histogram(
            &hook
                .admin_get("/metrics")
                .await
                .map(|r| r.1)
                .unwrap_or_default(),
        )
    };
    let before = scrape().await;
    let rate = env_num("MESHGATE_BENCH_FLEET_RATE", 2000) as f64;
    let secs = env_num("MESHGATE_BENCH_LOAD_SECS", 10) as f64;
    let measured = review::run(spec(rate, secs)).await?;
    let after = scrape().await;
    if let Some(e) = warm.errors().first().or(measured.errors().first()) {
        bail!(
            "{} wrong or failed answers, first: {:?}\n{}",
            warm.errors().len() + measured.errors().len(),
            e.outcome,
            hook.log()
        );
    }
    let server = format!(
        "server-side handling p50 {}, p99 {}",
        webhook::server_quantile(&before, &after, 0.5),
        webhook::server_quantile(&before, &after, 0.99)
    );
    Ok((measured, server))
}

/// The webhook among `n` Nodes twice as large, on a control plane of their own.
struct Double {
    nodes: usize,
    object_bytes: usize,
    creation: Creation,
    webhook: WebhookReading,
}

async fn double(n: usize) -> anyhow::Result<Double> {
    eprintln!("fleet: {n} Nodes twice as large, on a control plane of their own ...");
    let cp = ControlPlane::start(Options::default()).await?;
    let client = cp.client()?;
    let measured = async {
        let ns = reviewed(&cp, &client).await?;
        cp.freeze_component("kube-controller-manager", true)?;
        let creation = create(&client, "fleet", (0, n), cloud_node::LARGE_IMAGES).await?;
        let object_bytes = served_size(&client, &node_name("fleet", GATED + 1)).await?;
        let webhook = cold_start(&cp, n, &fleet_mix(n, &ns)).await?;
        anyhow::Ok(Double {
            nodes: n,
            object_bytes,
            creation,
            webhook,
        })
    }
    .await;
    cp.stop();
    measured
}
