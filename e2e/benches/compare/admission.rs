//! Admission: what meshgate's webhook adds to pod CREATE and `pods/binding` through the real
//! kube-apiserver, beside the same requests that no webhook reviews, in the same run.
//!
//! The shipped registrations (the chart's, rendered as the e2e tests render them) point at
//! the release `meshgate-webhook` over TLS, with one label added to their namespace
//! selectors: the namespace carrying it ("hooked") is reviewed, its twin ("plain") is not,
//! so the plain side is the same requests with no matching webhook. The two sides run in
//! alternating phases at the same rate, in the order A B B A A B ..., so drift and the other
//! engineers' load on the machine fall on both alike; running them concurrently instead
//! would double the apiserver's load past the rate the goal names. Each phase's pods are
//! deleted (grace period 0) before the next phase, unmeasured, so etcd holds the same few
//! thousand pods for both sides and nothing is left for later sections.

use super::*;
use meshgate_e2e::load::api;
use meshgate_e2e::load::histogram::Histogram;
use meshgate_e2e::load::review::Report;
use meshgate_e2e::sim::webhook::{self as registration, Scope};

/// The namespace label the registrations require here, on the hooked namespace only.
const SCOPE_KEY: &str = "bench.meshgate.io/admission";
/// The registrations' name (`meshgate-<TAG>`) and their webhooks' infix, so the apiserver's
/// per-webhook metrics count this section's calls alone.
const TAG: &str = "adm";
/// Verified Nodes the pods are spread over.
const NODES: usize = 50;
/// A baseline p50 above this means the apiserver itself queued the requests (an unloaded
/// pod create takes a few ms): the comparison then measures the overload, not the webhook,
/// and the goal is not judged.
const SATURATED: Duration = Duration::from_millis(50);
/// Requests in flight at most (the open loop's wait for room still counts).
const IN_FLIGHT: usize = 512;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Create,
    Bind,
}

impl Kind {
    fn what(self) -> &'static str {
        match self {
            Kind::Create => "pod CREATE",
            Kind::Bind => "pods/binding",
        }
    }

    /// The webhook of the shipped registration that reviews this request.
    fn hook(self) -> String {
        match self {
            Kind::Create => format!("pods.validate.{TAG}.meshgate.io"),
            Kind::Bind => format!("bindings.validate.{TAG}.meshgate.io"),
        }
    }
}

struct Side {
    hooked: bool,
    pods: Api<Pod>,
}

/// Both sides' samples of one kind, and the server-side histograms between its scrapes.
struct Measured {
    kind: Kind,
    with: Report,
    without: Report,
    apiserver: Histogram,
    apiserver_other: f64,
    webhook: Histogram,
    lookups: f64,
    /// The most connections the apiserver held to the webhook at once, and how many it kept
    /// once the load was over.
    connections: (usize, usize),
}

/// Samples the connections the webhook holds every 20 ms; the peak when `stop` fires.
fn connection_peak(
    port: u16,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<usize>,
) {
    let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let mut peak = 0;
        while stopped.try_recv().is_err() {
            peak = peak.max(api::established(port));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        peak
    });
    (stop, task)
}

/// Quantiles of one side's samples (phases apart, so no throughput).
fn summary(r: &Report) -> String {
    let (lat, svc) = (r.latencies(), r.service_times());
    format!(
        "{} requests, {} errors; latency p50 {} p99 {} max {}; service p50 {} p99 {}",
        r.samples.len(),
        r.errors().len(),
        human(quantile(&lat, 0.5)),
        human(quantile(&lat, 0.99)),
        human(quantile(&lat, 1.0)),
        human(quantile(&svc, 0.5)),
        human(quantile(&svc, 0.99)),
    )
}

fn node(k: usize) -> String {
    format!("{TAG}-v-{}", k % NODES)
}

fn settings() -> (f64, usize, usize) {
    let rate = env_num("MESHGATE_BENCH_ADMISSION_RATE", 2000) as f64;
    let phase = env_num("MESHGATE_BENCH_ADMISSION_PHASE", 1000).max(1) as usize;
    let rounds = env_num("MESHGATE_BENCH_ADMISSION_ROUNDS", 6).max(1) as usize;
    (rate, phase, rounds)
}

pub(super) async fn run(
    cp: &ControlPlane,
    client: &Client,
    table: &mut Table,
) -> anyhow::Result<()> {
    let (rate, phase, rounds) = settings();
    eprintln!(
        "admission: pod CREATE and pods/binding through the apiserver at {rate:.0}/s, webhook registered and not, {rounds} rounds of {phase} requests per side ..."
    );
    review::create_nodes(client, TAG, NODES, 1, 16).await?;
    let hooked = cp.create_namespace(client, "admw").await?;
    let plain = cp.create_namespace(client, "admn").await?;
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    namespaces
        .patch(
            &hooked,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {SCOPE_KEY: "yes"}}})),
        )
        .await?;
    // SAFETY of set_var: see agent_log.
    unsafe { std::env::set_var("MESHGATE_WEBHOOK_LOG", "warn") };
    let mut hook = WebhookProcess::start(cp.admin_kubeconfig_path(), &[])?;
    hook.wait_ready(Duration::from_secs(120)).await?;
    let scope = Scope {
        label: Some((SCOPE_KEY.into(), "yes".into())),
        hook_infix: Some(TAG.into()),
    };
    registration::register(cp, client, TAG, hook.listen.port(), &hook.ca_pem, &scope).await?;
    // The controller manager has no part in admission; frozen so that its pod and node
    // lifecycle work on thousands of pods does not share the CPUs with the measurement.
    cp.freeze_component("kube-controller-manager", true)?;
    let sides = [
        Side {
            hooked: true,
            pods: Api::namespaced(client.clone(), &hooked),
        },
        Side {
            hooked: false,
            pods: Api::namespaced(client.clone(), &plain),
        },
    ];
    let measured = measure_all(client, &hook, &sides).await;
    cp.freeze_component("kube-controller-manager", false)?;
    registration::unregister(client, TAG).await;
    for s in &sides {
        let _ = api::delete_all_pods(&s.pods, Duration::from_secs(60)).await;
    }
    let measured = measured.map_err(|e| e.context(hook.log()))?;
    drop(hook);
    for ns in [&hooked, &plain] {
        let _ = namespaces.delete(ns, &DeleteParams::default()).await;
    }
    // Best effort: the webhook section's cache then holds its own Nodes alone.
    let nodes: Api<Node> = Api::all(client.clone());
    let names = (0..NODES).map(node).chain([format!("{TAG}-u-0")]);
    for name in names {
        let _ = tokio::time::timeout(
            Duration::from_secs(10),
            nodes.delete(&name, &DeleteParams::default()),
        )
        .await;
    }
    report(table, rate, phase, rounds, &measured);
    Ok(())
}

async fn measure_all(
    client: &Client,
    hook: &WebhookProcess,
    sides: &[Side; 2],
) -> anyhow::Result<Vec<Measured>> {
    wait_registered(&sides[0].pods, &sides[1].pods).await?;
    let mut out = Vec::new();
    for kind in [Kind::Create, Kind::Bind] {
        out.push(measure(client, hook, sides, kind).await?);
    }
    Ok(out)
}

/// Waits until the apiserver applies the registration: a meshed pod onto the unverified
/// node is refused in the hooked namespace (dry run) and admitted in the plain one.
async fn wait_registered(hooked: &Api<Pod>, plain: &Api<Pod>) -> anyhow::Result<()> {
    let pod = meshed_pod("probe", &format!("{TAG}-u-0"), &[], Some(0));
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        match hooked.create(&dry, &pod).await {
            Err(kube::Error::Api(s)) if s.message.contains("denied") => break,
            _ if Instant::now() > end => bail!("the registration was not applied within 30 s"),
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    plain
        .create(&dry, &pod)
        .await
        .context("the plain namespace must not be reviewed")?;
    Ok(())
}

/// One phase: `n` requests of `kind` at `rate` on `side` (the pods to bind created first,
/// unmeasured), then every pod of the side deleted, unmeasured.
async fn phase(side: &Side, kind: Kind, rate: f64, n: usize, tag: &str) -> anyhow::Result<Report> {
    let pods = side.pods.clone();
    let name = move |k: usize| format!("{tag}-{k}");
    let report = match kind {
        Kind::Create => {
            api::open_loop(rate, n, IN_FLIGHT, STEP, |k| {
                api::create_pod(pods.clone(), meshed_pod(&name(k), &node(k), &[], Some(0)))
            })
            .await?
        }
        Kind::Bind => {
            let created: Vec<Result<(), String>> = futures::stream::iter(0..n)
                .map(|k| api::create_pod(pods.clone(), pending_meshed_pod(&name(k))))
                .buffer_unordered(64)
                .collect()
                .await;
            if let Some(Err(e)) = created.into_iter().find(Result::is_err) {
                bail!("creating the pods to bind: {e}");
            }
            // Time for the webhook's pending-pod watch to hold them, on both sides alike.
            tokio::time::sleep(Duration::from_millis(300)).await;
            api::open_loop(rate, n, IN_FLIGHT, STEP, |k| {
                api::bind(pods.clone(), name(k), node(k))
            })
            .await?
        }
    };
    api::delete_all_pods(&side.pods, Duration::from_secs(120)).await?;
    if let Some(e) = report.errors().first() {
        bail!(
            "{} {} errors on the {} side, first: {:?}",
            report.errors().len(),
            kind.what(),
            if side.hooked { "hooked" } else { "plain" },
            e.outcome
        );
    }
    Ok(report)
}

/// Bound on one API request.
const STEP: Duration = Duration::from_secs(10);

async fn scrape(
    client: &Client,
    hook: &WebhookProcess,
    kind: Kind,
) -> anyhow::Result<(Histogram, f64, Histogram, f64)> {
    let text = api::apiserver_metrics(client).await?;
    if std::env::var_os("ADM_DEBUG").is_some() {
        for l in text
            .lines()
            .filter(|l| l.contains(".adm.meshgate.io") && !l.contains("_bucket"))
        {
            eprintln!("DBG {l}");
        }
    }
    let name = "apiserver_admission_webhook_admission_duration_seconds";
    let ours = Histogram::parse(
        &text,
        name,
        &[("name", &kind.hook()), ("type", "validating")],
    );
    // Every other webhook call of this registration: none may come from the plain side.
    let all = Histogram::parse(&text, name, &[("type", "validating")]);
    let (_, own) = hook
        .admin_get("/metrics")
        .await
        .context("webhook /metrics")?;
    let lookups: f64 = own
        .lines()
        .filter(|l| l.starts_with("meshgate_pod_lookups_total{"))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum();
    Ok((
        ours,
        all.count,
        Histogram::parse(&own, "meshgate_admission_duration_seconds", &[]),
        lookups,
    ))
}

async fn measure(
    client: &Client,
    hook: &WebhookProcess,
    sides: &[Side; 2],
    kind: Kind,
) -> anyhow::Result<Measured> {
    let (rate, n, rounds) = settings();
    let k = match kind {
        Kind::Create => "c",
        Kind::Bind => "b",
    };
    // Warm-up, discarded: the client's and the apiserver's connections, the caches.
    for s in sides {
        phase(s, kind, rate, n.min(500), &format!("{k}-warm")).await?;
    }
    let before = scrape(client, hook, kind).await?;
    let (stop, peak) = connection_peak(hook.listen.port());
    let (mut with, mut without) = (Report::default(), Report::default());
    for r in 0..rounds {
        // A B, B A, A B, ...: neither side always goes first.
        let order = if r % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let report = phase(&sides[i], kind, rate, n, &format!("{k}-{r}")).await?;
            let into = if sides[i].hooked {
                &mut with
            } else {
                &mut without
            };
            into.samples.extend(report.samples);
        }
    }
    let after = scrape(client, hook, kind).await?;
    let _ = stop.send(());
    let peak = peak.await.unwrap_or(0);
    let m = Measured {
        connections: (peak, api::established(hook.listen.port())),
        kind,
        apiserver: after.0.since(&before.0),
        apiserver_other: after.1 - before.1 - (after.0.count - before.0.count),
        webhook: after.2.since(&before.2),
        lookups: after.3 - before.3,
        with,
        without,
    };
    eprintln!(
        "  {}: with the webhook {}; without {}; apiserver's calls to {}: {}, mean {}; other webhook calls {}; webhook handling: {}, mean {}; connections to the webhook: peak {}, kept {}",
        kind.what(),
        summary(&m.with),
        summary(&m.without),
        kind.hook(),
        m.apiserver.count,
        mean(&m.apiserver),
        m.apiserver_other,
        m.webhook.count,
        mean(&m.webhook),
        m.connections.0,
        m.connections.1,
    );
    Ok(m)
}

fn mean(h: &Histogram) -> String {
    h.mean()
        .map_or("—".into(), |m| human(Duration::from_secs_f64(m)))
}

fn bucket(h: &Histogram, p: f64) -> String {
    match h.quantile_bound(p) {
        Some(b) if b.is_finite() => format!("≤ {}", human(Duration::from_secs_f64(b))),
        Some(_) => "> the largest bucket".into(),
        None => "—".into(),
    }
}

/// `a − b`, signed, for the table.
fn added(a: Duration, b: Duration) -> String {
    if a >= b {
        format!("+{}", human(a - b))
    } else {
        format!("−{}", human(b - a))
    }
}

fn report(table: &mut Table, rate: f64, phase: usize, rounds: usize, measured: &[Measured]) {
    for m in measured {
        let what = m.kind.what();
        let (w50, w99) = (m.with.latency(0.5), m.with.latency(0.99));
        let (o50, o99) = (m.without.latency(0.5), m.without.latency(0.99));
        table.row(
            &format!("{what} through the apiserver at {rate:.0}/s, p50 / p99, meshgate's webhook registered"),
            format!("{} / {}", human(w50), human(w99)),
            "same requests, no webhook (namespace not selected), same run",
            format!("{} / {}", human(o50), human(o99)),
            format!("{} / {}", ratio(w50, o50), ratio(w99, o99)),
            "",
            None,
        );
        let reviewed =
            m.apiserver.count as usize == m.with.samples.len() && m.apiserver_other == 0.0;
        let saturated = o50 > SATURATED;
        table.row(
            &format!("webhook's added latency, {what}, p50 / p99"),
            format!(
                "{} / {}{}",
                added(w50, o50),
                added(w99, o99),
                if saturated {
                    " (apiserver saturated: not judged)"
                } else {
                    ""
                }
            ),
            "—",
            "—".into(),
            "—".into(),
            "≤ 1 ms at p99, 2,000/s",
            (!saturated).then_some(reviewed && w99 <= o99 + Duration::from_millis(1)),
        );
        table.note(format!(
            "Admission, {what}: with the webhook {}; without {}. Server side over the measured phases: the apiserver called {} {} times (expected {}; calls to any other webhook: {}), mean {} (p99 bucket {}; the apiserver's buckets are 5 ms, 25 ms, ...); the webhook answered {} reviews, handling p50 {}, p99 {}, mean {}; pods a binding named that its cache did not hold: {}. The apiserver held up to {} connections to the webhook at once (HTTP/1.1: one per review in flight) and kept {} after the load.",
            summary(&m.with),
            summary(&m.without),
            m.kind.hook(),
            m.apiserver.count,
            m.with.samples.len(),
            m.apiserver_other,
            mean(&m.apiserver),
            bucket(&m.apiserver, 0.99),
            m.webhook.count,
            bucket(&m.webhook, 0.5),
            bucket(&m.webhook, 0.99),
            mean(&m.webhook),
            m.lookups,
            m.connections.0,
            m.connections.1,
        ));
    }
    table.note(format!(
        "Admission: the chart's ValidatingWebhookConfiguration (rendered with helm template, as the e2e tests do) points at the release meshgate-webhook over TLS on loopback, with a namespace label added to its selectors: one namespace carries it, its twin does not, so the baseline is the same requests with no matching webhook. Pod CREATEs are meshed (linkerd) pods with spec.nodeName on {NODES} verified Nodes; bindings bind pending meshed pods (created unmeasured before each phase) to them. Open loop at {rate:.0}/s from this process (kube client, HTTP/1.1 keep-alive pool), latency from each request's due time; {rounds} rounds of {phase} requests per side, sides alternating A B B A ... after a discarded warm-up, each phase's pods deleted (grace period 0) before the next. A baseline p50 above {} means the apiserver itself could not keep up with the rate: the difference then measures the overload, and the goal is not judged. The webhook's own histogram times its decision after the body was read: TLS, the connection, the body and the review memory budget are outside it. The load generator, the webhook, the apiserver and etcd share the CPUs; the controller manager was frozen for the section. Ratios: with / without the webhook.",
        human(SATURATED)
    ));
}
