//! A registration storm during normal scheduling: Nodes register through the Node webhook at
//! 1,000 a minute while meshed pods are created and bound at `MESHGATE_BENCH_STORM_RATE`
//! (100/s) each, through meshgate's webhook and, in alternating rounds, through a webhook that
//! admits everything (`load::allow_all`) registered with the same shipped configurations.
//!
//! Both registrations are the chart's, rendered as the e2e tests render them, scoped by one
//! label with a value per side (namespaces for pods and bindings, the Nodes' own label for the
//! Node webhook), so each side's requests reach its webhook alone. A third side, a second
//! admit-all webhook of its own, is the control: its ratio to the first admit-all is what the
//! harness itself reads between two identical webhooks. Out: per kind (Node registration, pod
//! CREATE, binding), p50 / p99 on each side and the ratios (goal at p99: ≤ 1.1), and on
//! meshgate's side every new Linux Node gated (label and taint) and no review refused or
//! timed out.

use super::*;
use meshgate_e2e::load::allow_all::AllowAll;
use meshgate_e2e::load::api;
use meshgate_e2e::load::review::Report;
use meshgate_e2e::sim::webhook::{self as registration, Scope, TestCa};

/// The label both sides are scoped by; its value names the side.
const KEY: &str = "bench.meshgate.io/storm";
/// 1,000 Nodes a minute.
const NODES_PER_SECOND: f64 = 1000.0 / 60.0;
const STEP: Duration = Duration::from_secs(10);

#[derive(Clone, Copy, PartialEq, Eq)]
enum Hook {
    Meshgate,
    AllowAll,
    /// A second admit-all webhook: the control.
    Control,
}

/// Every side, in the order their samples are returned.
const HOOKS: [Hook; 3] = [Hook::Meshgate, Hook::AllowAll, Hook::Control];

impl Hook {
    fn value(self) -> &'static str {
        match self {
            Hook::Meshgate => "meshgate",
            Hook::AllowAll => "allowall",
            Hook::Control => "control",
        }
    }
}

/// One side: its namespace's pods, the Node its pods are bound to.
struct Side {
    hook: Hook,
    pods: Api<Pod>,
    verified: String,
}

/// A side's samples over every round: registrations, creates, bindings.
#[derive(Default)]
struct Samples {
    kinds: [Report; 3],
    misgated: usize,
}

const KINDS: [&str; 3] = ["Node registration", "pod CREATE", "pods/binding"];

fn settings() -> (f64, Duration, usize) {
    let rate = env_num("MESHGATE_BENCH_STORM_RATE", 100).max(1) as f64;
    let secs = Duration::from_secs(env_num("MESHGATE_BENCH_STORM_SECONDS", 20).max(1));
    let rounds = env_num("MESHGATE_BENCH_STORM_ROUNDS", 4).max(1) as usize;
    (rate, secs, rounds)
}

/// A side's registration scope: its label value, and webhooks named after it.
fn scope(h: Hook) -> Scope {
    Scope {
        label: Some((KEY.into(), h.value().into())),
        hook_infix: Some(format!("stm{}", h.value())),
    }
}

pub(super) async fn run(
    cp: &ControlPlane,
    client: &Client,
    table: &mut Table,
) -> anyhow::Result<()> {
    let (rate, secs, rounds) = settings();
    eprintln!(
        "storm: Nodes at 1,000/min with pod CREATE and binding at {rate}/s, {rounds} rounds of {secs:?} per side ..."
    );
    // The agent DaemonSet whose placement decides which new Nodes meshgate's webhook gates:
    // the shipped one, its nodeSelector scoped to meshgate's side.
    let agent_ns = cp.create_namespace(client, "stm-agent").await?;
    let ds = registration::agent_daemonset(cp, &agent_ns, &scope(Hook::Meshgate)).await?;
    Api::<k8s_openapi::api::apps::v1::DaemonSet>::namespaced(client.clone(), &agent_ns)
        .create(&PostParams::default(), &ds)
        .await?;
    // SAFETY of set_var: see agent_log.
    unsafe { std::env::set_var("MESHGATE_WEBHOOK_LOG", "warn") };
    let agent = format!("{agent_ns}/meshgate-agent");
    let mut hook =
        WebhookProcess::start(cp.admin_kubeconfig_path(), &["--agent-daemonset", &agent])?;
    hook.wait_ready(Duration::from_secs(120)).await?;
    let dir = tempfile::tempdir()?;
    let ca = TestCa::new()?;
    let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    ca.issue(&cert, &key)?;
    // Each admit-all webhook on a runtime thread of its own, as meshgate's is a process.
    let (allow, control) = (AllowAll::start(&cert, &key)?, AllowAll::start(&cert, &key)?);
    let tag = |h: Hook| format!("stm-{}", h.value());
    for (h, port, ca_pem) in [
        (Hook::Meshgate, hook.listen.port(), hook.ca_pem.as_str()),
        (Hook::AllowAll, allow.addr.port(), ca.pem()),
        (Hook::Control, control.addr.port(), ca.pem()),
    ] {
        registration::register(cp, client, &tag(h), port, ca_pem, &scope(h)).await?;
    }
    let mut sides = Vec::new();
    for h in HOOKS {
        sides.push(side(cp, client, h).await?);
    }
    // Time for the webhook's caches to hold the verified Nodes.
    tokio::time::sleep(Duration::from_secs(1)).await;
    cp.freeze_component("kube-controller-manager", true)?;
    let measured = measure(client, &sides, rate, secs, rounds).await;
    cp.freeze_component("kube-controller-manager", false)?;
    for h in HOOKS {
        registration::unregister(client, &tag(h)).await;
    }
    for s in &sides {
        let _ = api::delete_all_pods(&s.pods, Duration::from_secs(120)).await;
    }
    delete_nodes(client).await;
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    let _ = namespaces.delete(&agent_ns, &DeleteParams::default()).await;
    let [ours, theirs, control] = measured.map_err(|e| e.context(hook.log()))?;
    report(table, [&ours, &theirs, &control], rate);
    Ok(())
}

/// A side's namespace (labelled for its webhook) and its verified Node.
async fn side(cp: &ControlPlane, client: &Client, hook: Hook) -> anyhow::Result<Side> {
    let ns = cp.create_namespace(client, "stm").await?;
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    let patch = Patch::Merge(json!({"metadata": {"labels": {KEY: hook.value()}}}));
    namespaces
        .patch(&ns, &PatchParams::default(), &patch)
        .await?;
    let verified = format!("stm-{}-verified", hook.value());
    let nodes: Api<Node> = Api::all(client.clone());
    let node: Node = serde_json::from_value(json!({"metadata": {"name": verified,
        "labels": {KEY: hook.value(), "kubernetes.io/os": "linux"}}}))?;
    nodes.create(&PostParams::default(), &node).await?;
    let verify = json!({"metadata": {"labels": {"meshgate.io/cni-verified": "true"}}, "spec": {"taints": []}});
    nodes
        .patch(&verified, &PatchParams::default(), &Patch::Merge(verify))
        .await?;
    Ok(Side {
        hook,
        pods: Api::namespaced(client.clone(), &ns),
        verified,
    })
}

/// Rounds rotating the sides' order; the samples of each side, in [`HOOKS`]' order.
async fn measure(
    client: &Client,
    sides: &[Side],
    rate: f64,
    secs: Duration,
    rounds: usize,
) -> anyhow::Result<[Samples; 3]> {
    let mut out: [Samples; 3] = Default::default();
    for r in 0..rounds {
        for i in (0..sides.len()).map(|k| (k + r) % sides.len()) {
            let round = round(client, &sides[i], rate, secs, r).await?;
            let into = &mut out[i];
            for (k, rep) in round.kinds.into_iter().enumerate() {
                into.kinds[k].samples.extend(rep.samples);
            }
            into.misgated += round.misgated;
        }
    }
    Ok(out)
}

/// One side's storm: registrations, creates and bindings at once.
async fn round(
    client: &Client,
    s: &Side,
    rate: f64,
    secs: Duration,
    r: usize,
) -> anyhow::Result<Samples> {
    let nodes = (secs.as_secs_f64() * NODES_PER_SECOND).ceil() as usize;
    let pods = (secs.as_secs_f64() * rate).ceil() as usize;
    let misgated = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let api_nodes: Api<Node> = Api::all(client.clone());
    let prefix = format!("stm-{}-{r}", s.hook.value());
    let registered = api::open_loop(NODES_PER_SECOND, nodes, 256, STEP, |k| {
        register(
            api_nodes.clone(),
            format!("{prefix}-n{k}"),
            s.hook,
            misgated.clone(),
        )
    });
    let created = api::open_loop(rate, pods, 512, STEP, |k| {
        api::create_pod(
            s.pods.clone(),
            pending_meshed_pod(&format!("{prefix}-p{k}")),
        )
    });
    let bound = async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        api::open_loop(rate, pods, 512, STEP, |k| {
            api::bind(s.pods.clone(), format!("{prefix}-p{k}"), s.verified.clone())
        })
        .await
    };
    let (registered, created, bound) = tokio::join!(registered, created, bound);
    let kinds = [registered?, created?, bound?];
    for (what, rep) in KINDS.iter().zip(&kinds) {
        if let Some(e) = rep.errors().first() {
            bail!(
                "{} {what} errors on the {} side, first: {:?}",
                rep.errors().len(),
                s.hook.value(),
                e.outcome
            );
        }
    }
    api::delete_all_pods(&s.pods, Duration::from_secs(120)).await?;
    Ok(Samples {
        kinds,
        misgated: misgated.load(std::sync::atomic::Ordering::Relaxed),
    })
}

/// Registers a Linux Node in `hook`'s scope; counts it in `misgated` unless meshgate's side
/// gated it (label `false` and taint) and the other side left it alone.
async fn register(
    api: Api<Node>,
    name: String,
    hook: Hook,
    misgated: Arc<std::sync::atomic::AtomicUsize>,
) -> Result<(), String> {
    let node: Node = serde_json::from_value(json!({"metadata": {"name": name,
        "labels": {KEY: hook.value(), "kubernetes.io/os": "linux"}}}))
    .map_err(|e| e.to_string())?;
    let created = api
        .create(&PostParams::default(), &node)
        .await
        .map_err(|e| e.to_string())?;
    let label = created.labels().get("meshgate.io/cni-verified").cloned();
    let gated = label.as_deref() == Some("false") && meshgate_e2e::sim::node::tainted(&created);
    if gated != (hook == Hook::Meshgate) {
        misgated.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    Ok(())
}

/// Deletes this section's Nodes (best effort).
async fn delete_nodes(client: &Client) {
    let nodes: Api<Node> = Api::all(client.clone());
    for h in HOOKS {
        let lp = ListParams::default().labels(&format!("{KEY}={}", h.value()));
        let _ = nodes.delete_collection(&DeleteParams::default(), &lp).await;
    }
}

fn report(table: &mut Table, [ours, theirs, control]: [&Samples; 3], rate: f64) {
    let p = |r: &Report| (r.latency(0.5), r.latency(0.99));
    for (k, what) in KINDS.iter().enumerate() {
        let (t50, t99) = p(&theirs.kinds[k]);
        // The goal is on the scheduling path; a registration through meshgate's webhook also
        // carries its JSON Patch, which the apiserver applies and the other side has none of.
        let judged = k > 0;
        let sides = [
            (ours, "meshgate's webhook", judged),
            (
                control,
                "a second webhook that admits everything (the control)",
                false,
            ),
        ];
        for (side, who, judged) in sides {
            let (s50, s99) = p(&side.kinds[k]);
            table.row(
                &format!("{what} during a registration storm (1,000 Nodes/min, pods {rate}/s), p50 / p99, {who}"),
                format!("{} / {}", human(s50), human(s99)),
                "the same, through a webhook that admits everything, same run",
                format!("{} / {}", human(t50), human(t99)),
                // Two decimals at p99: the goal's edge is within the first.
                format!(
                    "{} / {:.2}×",
                    ratio(s50, t50),
                    s99.as_secs_f64() / t99.as_secs_f64().max(1e-9)
                ),
                if judged { "p99 ≤ 1.1×" } else { "" },
                judged.then_some(s99.as_secs_f64() <= 1.1 * t99.as_secs_f64()),
            );
        }
    }
    table.row(
        "new Linux Nodes gated by meshgate's webhook during the storm (label and taint)",
        format!(
            "{} of {} not as expected",
            ours.misgated,
            ours.kinds[0].samples.len()
        ),
        "the webhooks that admit everything: none gated",
        format!(
            "{} of {} gated",
            theirs.misgated + control.misgated,
            theirs.kinds[0].samples.len() + control.kinds[0].samples.len()
        ),
        String::new(),
        "0 wrong",
        Some(ours.misgated == 0 && theirs.misgated == 0 && control.misgated == 0),
    );
    table.note("Storm: both webhooks registered with the chart's configurations (rendered as the e2e tests render them), each scoped by one label (namespaces, and the Nodes' own label), so each side's Node registrations, pod CREATEs and bindings reach its webhook alone; rounds rotate the sides' order; open loop from this process; the controller manager frozen. The webhook that admits everything (`load::allow_all`) answers each review with allowed: true over the same TLS on loopback: the ratio is what meshgate's decisions and caches add to the apiserver's round trip. A second admit-all webhook (the control) is measured the same way: its ratio to the first is the spread between two identical webhooks in this harness.".into());
}
