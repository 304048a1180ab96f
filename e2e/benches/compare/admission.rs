//! Admission: what meshgate adds to pod CREATE and `pods/binding` through the real
//! kube-apiserver, three ways in the same run: no admission at all, the apiserver's own
//! placement policy (the chart's ValidatingAdmissionPolicy), and meshgate's webhook.
//!
//! The shipped registrations and policy (the chart's, rendered as the e2e tests render them)
//! are scoped by namespace label: the namespace carrying the webhook's label ("webhook") is
//! reviewed by the release `meshgate-webhook` over TLS, the one carrying the policy's label
//! ("policy") by the policy, whose params are the gated Nodes carrying that label too, and a
//! third ("none") by neither, so each side is the same requests. The sides run in alternating
//! phases at the same rate, in rotating order, so drift and the other engineers' load on the
//! machine fall on all alike; running them concurrently instead would triple the apiserver's
//! load. Each phase's pods are deleted (grace period 0) before the next phase, unmeasured.
//! Then the policy side alone against the none side with 1, 100 and 1,000 gated Nodes, one
//! request at a time (closed loop: an open loop would measure the queue once the apiserver
//! saturates): the latency and the kube-apiserver's CPU time per request (`/proc`), for a
//! meshed pod created with `spec.nodeName` (the policy evaluates it) and one created for the
//! scheduler (its match conditions refuse it): what each gated Node costs a request.

use super::*;
use meshgate_e2e::load::api;
use meshgate_e2e::load::histogram::Histogram;
use meshgate_e2e::load::review::Report;
use meshgate_e2e::sim::policy as placement;
use meshgate_e2e::sim::webhook::{self as registration, Scope};

/// The namespace label the webhook registrations require here, on the webhook side only.
const SCOPE_KEY: &str = "bench.meshgate.io/admission";
/// The label the policy's binding requires, on the policy side's namespace and on the gated
/// Nodes that are its params.
const POLICY_KEY: &str = "bench.meshgate.io/placement";
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

/// What reviews one side's requests.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Guard {
    None,
    Policy,
    Webhook,
}

impl Guard {
    /// The sides, in the order of [`Measured::reports`].
    const ALL: [Guard; 3] = [Guard::None, Guard::Policy, Guard::Webhook];

    fn what(self) -> &'static str {
        match self {
            Guard::None => "no admission",
            Guard::Policy => "the placement policy",
            Guard::Webhook => "meshgate's webhook",
        }
    }
}

struct Side {
    guard: Guard,
    pods: Api<Pod>,
}

/// The three sides' samples of one kind, and the server-side histograms between its scrapes.
struct Measured {
    kind: Kind,
    rate: f64,
    /// One per [`Guard::ALL`].
    reports: [Report; 3],
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

/// Requests per phase and rounds, and the rates (`MESHGATE_BENCH_ADMISSION_RATES`, per
/// second, comma-separated).
fn settings() -> (Vec<f64>, usize, usize) {
    let rates = std::env::var("MESHGATE_BENCH_ADMISSION_RATES")
        .ok()
        .map(|v| v.split(',').filter_map(|r| r.trim().parse().ok()).collect())
        .filter(|r: &Vec<f64>| !r.is_empty())
        .unwrap_or_else(|| vec![100.0, 300.0]);
    let phase = env_num("MESHGATE_BENCH_ADMISSION_PHASE", 600).max(1) as usize;
    let rounds = env_num("MESHGATE_BENCH_ADMISSION_ROUNDS", 4).max(1) as usize;
    (rates, phase, rounds)
}

/// Gated Nodes the policy's params hold in the CEL-cost rounds.
const GATED: [usize; 3] = [1, 100, 1000];

/// Makes `n` Nodes gated for the policy side: `<TAG>-u-0` and `<TAG>-g-<i>`, labelled
/// `cni-verified=false` and [`POLICY_KEY`].
async fn gate_nodes(client: &Client, n: usize) -> anyhow::Result<()> {
    let api: Api<Node> = Api::all(client.clone());
    let label = Patch::Merge(json!({"metadata": {"labels": {POLICY_KEY: "yes"}}}));
    api.patch(&format!("{TAG}-u-0"), &PatchParams::default(), &label)
        .await?;
    let nodes = (1..n).map(|i| {
        let mut node = review::cloud_node(&format!("{TAG}-g-{i}"), false)?;
        node.labels_mut().insert(POLICY_KEY.into(), "yes".into());
        Ok(node)
    });
    review::create_node_objects(client, nodes, 16).await
}

pub(super) async fn run(
    cp: &ControlPlane,
    client: &Client,
    table: &mut Table,
) -> anyhow::Result<()> {
    let (rates, phase, rounds) = settings();
    eprintln!(
        "admission: pod CREATE and pods/binding through the apiserver at {rates:?}/s, with no admission, the placement policy and the webhook, {rounds} rounds of {phase} requests per side ..."
    );
    review::create_nodes(client, TAG, NODES, 1, 16).await?;
    gate_nodes(client, 1).await?;
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    let mut sides = Vec::new();
    for guard in Guard::ALL {
        let ns = cp.create_namespace(client, "adm").await?;
        let label = match guard {
            Guard::None => None,
            Guard::Policy => Some(POLICY_KEY),
            Guard::Webhook => Some(SCOPE_KEY),
        };
        if let Some(key) = label {
            let patch = Patch::Merge(json!({"metadata": {"labels": {key: "yes"}}}));
            namespaces
                .patch(&ns, &PatchParams::default(), &patch)
                .await?;
        }
        let pods = Api::namespaced(client.clone(), &ns);
        sides.push((ns, Side { guard, pods }));
    }
    // SAFETY of set_var: see agent_log.
    unsafe { std::env::set_var("MESHGATE_WEBHOOK_LOG", "warn") };
    let mut hook = WebhookProcess::start(cp.admin_kubeconfig_path(), &[])?;
    hook.wait_ready(Duration::from_secs(120)).await?;
    let scope = |key: &str, infix: Option<&str>| Scope {
        label: Some((key.into(), "yes".into())),
        hook_infix: infix.map(str::to_owned),
    };
    let port = hook.listen.port();
    let webhook_scope = scope(SCOPE_KEY, Some(TAG));
    registration::register(cp, client, TAG, port, &hook.ca_pem, &webhook_scope).await?;
    placement::register(cp, client, TAG, &scope(POLICY_KEY, None)).await?;
    // The controller manager has no part in admission; frozen so that its pod and node
    // lifecycle work on thousands of pods does not share the CPUs with the measurement.
    cp.freeze_component("kube-controller-manager", true)?;
    let (names, sides): (Vec<String>, Vec<Side>) = sides.into_iter().unzip();
    let apiserver = cp
        .component_pid("kube-apiserver")
        .context("no kube-apiserver pid")?;
    let measured = measure_all(client, &hook, &sides, apiserver).await;
    cp.freeze_component("kube-controller-manager", false)?;
    placement::unregister(client, TAG).await;
    registration::unregister(client, TAG).await;
    for (s, ns) in sides.iter().zip(&names) {
        let _ = api::delete_all_pods(&s.pods, Duration::from_secs(60)).await;
        let _ = namespaces.delete(ns, &DeleteParams::default()).await;
    }
    let (measured, cost) = measured.map_err(|e| e.context(hook.log()))?;
    drop(hook);
    delete_nodes(client).await;
    report(table, phase, rounds, &measured);
    report_cost(table, &cost);
    Ok(())
}

/// Best effort: the webhook section's cache then holds its own Nodes alone.
async fn delete_nodes(client: &Client) {
    let nodes: Api<Node> = Api::all(client.clone());
    let gated = GATED.iter().max().copied().unwrap_or(1);
    let names = (0..NODES)
        .map(node)
        .chain([format!("{TAG}-u-0")])
        .chain((1..gated).map(|i| format!("{TAG}-g-{i}")));
    let deletes = futures::stream::iter(names)
        .map(|name| {
            let nodes = nodes.clone();
            async move {
                let _ = tokio::time::timeout(
                    Duration::from_secs(10),
                    nodes.delete(&name, &DeleteParams::default()),
                )
                .await;
            }
        })
        .buffer_unordered(16);
    deletes.collect::<Vec<()>>().await;
}

/// The three-way comparison at each rate, then the policy's cost by gated Nodes.
async fn measure_all(
    client: &Client,
    hook: &WebhookProcess,
    sides: &[Side],
    apiserver: i32,
) -> anyhow::Result<(Vec<Measured>, Vec<Cost>)> {
    wait_registered(sides).await?;
    let (rates, _, _) = settings();
    let mut out = Vec::new();
    for rate in rates {
        for kind in [Kind::Create, Kind::Bind] {
            out.push(measure(client, hook, sides, kind, rate).await?);
        }
    }
    let mut cost = Vec::new();
    for gated in GATED {
        gate_nodes(client, gated).await?;
        // The apiserver loads new params asynchronously.
        tokio::time::sleep(Duration::from_secs(5)).await;
        for bound in [true, false] {
            cost.push(policy_cost(apiserver, sides, gated, bound).await?);
        }
    }
    Ok((out, cost))
}

/// Waits until the apiserver applies the registration and the policy: a meshed pod onto the
/// gated Node is refused on the webhook and policy sides (dry run) and admitted on the none
/// side.
async fn wait_registered(sides: &[Side]) -> anyhow::Result<()> {
    let pod = meshed_pod("probe", &format!("{TAG}-u-0"), &[], Some(0));
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let end = Instant::now() + Duration::from_secs(30);
    for side in sides.iter().filter(|s| s.guard != Guard::None) {
        loop {
            match side.pods.create(&dry, &pod).await {
                Err(kube::Error::Api(s)) if s.message.contains("denied") => break,
                _ if Instant::now() > end => {
                    bail!("{} was not applied within 30 s", side.guard.what())
                }
                _ => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }
    let none = sides
        .iter()
        .find(|s| s.guard == Guard::None)
        .context("the none side")?;
    none.pods
        .create(&dry, &pod)
        .await
        .context("the none side must not be reviewed")?;
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
            side.guard.what(),
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
    sides: &[Side],
    kind: Kind,
    rate: f64,
) -> anyhow::Result<Measured> {
    let (_, n, rounds) = settings();
    let k = match kind {
        Kind::Create => "c",
        Kind::Bind => "b",
    };
    // Warm-up, discarded: the client's and the apiserver's connections, the caches.
    for s in sides {
        phase(s, kind, rate, n.min(300), &format!("{k}-warm")).await?;
    }
    let before = scrape(client, hook, kind).await?;
    let (stop, peak) = connection_peak(hook.listen.port());
    let mut reports: [Report; 3] = Default::default();
    for r in 0..rounds {
        // Rotating order: no side always goes first.
        for j in 0..sides.len() {
            let side = &sides[(r + j) % sides.len()];
            let report = phase(side, kind, rate, n, &format!("{k}-{r}")).await?;
            let at = Guard::ALL
                .iter()
                .position(|g| *g == side.guard)
                .unwrap_or(0);
            reports[at].samples.extend(report.samples);
        }
    }
    let after = scrape(client, hook, kind).await?;
    let _ = stop.send(());
    let peak = peak.await.unwrap_or(0);
    let m = Measured {
        connections: (peak, api::established(hook.listen.port())),
        kind,
        rate,
        apiserver: after.0.since(&before.0),
        apiserver_other: after.1 - before.1 - (after.0.count - before.0.count),
        webhook: after.2.since(&before.2),
        lookups: after.3 - before.3,
        reports,
    };
    eprintln!("  {}", server_side(&m));
    Ok(m)
}

/// Pod CREATE on the policy side and on the none side, alternating, one at a time, with
/// `gated` gated Nodes: latencies and the apiserver's CPU time per request.
struct Cost {
    gated: usize,
    /// Pods created with `spec.nodeName` (the policy evaluates them), or for the scheduler.
    bound: bool,
    policy: Report,
    none: Report,
    policy_cpu: Duration,
    none_cpu: Duration,
}

/// Requests per side and round in the cost rounds (`MESHGATE_BENCH_ADMISSION_COST_REQUESTS`).
fn cost_requests() -> usize {
    env_num("MESHGATE_BENCH_ADMISSION_COST_REQUESTS", 100).max(1) as usize
}

/// One [`Cost`]: rounds alternating the sides, dry-run creates one after another.
async fn policy_cost(
    apiserver: i32,
    sides: &[Side],
    gated: usize,
    bound: bool,
) -> anyhow::Result<Cost> {
    let (_, _, rounds) = settings();
    let n = cost_requests();
    let side = |g: Guard| sides.iter().find(|s| s.guard == g).context("side");
    let (policy, none) = (side(Guard::Policy)?, side(Guard::None)?);
    let mut c = Cost {
        gated,
        bound,
        policy: Report::default(),
        none: Report::default(),
        policy_cpu: Duration::ZERO,
        none_cpu: Duration::ZERO,
    };
    for r in 0..rounds {
        let order = if r % 2 == 0 {
            [policy, none]
        } else {
            [none, policy]
        };
        for s in order {
            let cpu = cpu_time(apiserver)?;
            let report = sequential(s, n, bound).await?;
            let spent = cpu_time(apiserver)?.saturating_sub(cpu);
            let (into, spent_into) = if s.guard == Guard::Policy {
                (&mut c.policy, &mut c.policy_cpu)
            } else {
                (&mut c.none, &mut c.none_cpu)
            };
            into.samples.extend(report.samples);
            *spent_into += spent;
        }
    }
    let per = |d: Duration| d / (n * rounds) as u32;
    eprintln!(
        "  policy with {gated} gated Nodes, {}: {} and {} apiserver CPU per request; none: {} and {}",
        if bound {
            "spec.nodeName"
        } else {
            "for the scheduler"
        },
        summary(&c.policy),
        human(per(c.policy_cpu)),
        summary(&c.none),
        human(per(c.none_cpu)),
    );
    Ok(c)
}

/// `n` dry-run creates of a meshed pod, one after another, bound at creation or not.
async fn sequential(side: &Side, n: usize, bound: bool) -> anyhow::Result<Report> {
    let pp = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let mut report = Report::default();
    for k in 0..n {
        let pod = if bound {
            meshed_pod(&format!("cost-{k}"), &node(k), &[], Some(0))
        } else {
            pending_meshed_pod(&format!("cost-{k}"))
        };
        let due = Instant::now();
        let result = tokio::time::timeout(STEP, side.pods.create(&pp, &pod)).await;
        let done = Instant::now();
        report.start.get_or_insert(due);
        let outcome = match result {
            Ok(Ok(_)) => review::Outcome::Right,
            Ok(Err(e)) => bail!("cost round on the {} side: {e}", side.guard.what()),
            Err(_) => review::Outcome::Failed(format!("no answer within {STEP:?}")),
        };
        report.samples.push(review::Sample {
            due,
            sent: due,
            done,
            outcome,
            connection: 0,
        });
    }
    Ok(report)
}

/// A process's user + system CPU time (`/proc/PID/stat` fields 14 and 15).
fn cpu_time(pid: i32) -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .context("malformed stat")?
        .1
        .split_whitespace()
        .collect();
    let ticks =
        |i: usize| -> anyhow::Result<u64> { Ok(fields.get(i).context("short stat")?.parse()?) };
    // SAFETY: sysconf only reads a constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    let t = ticks(11)? + ticks(12)?;
    Ok(Duration::from_micros(t * 1_000_000 / hz))
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

fn report(table: &mut Table, phase: usize, rounds: usize, measured: &[Measured]) {
    for m in measured {
        let (what, rate) = (m.kind.what(), m.rate);
        let q = |r: &Report| (r.latency(0.5), r.latency(0.99));
        let [none, policy, webhook] = &m.reports;
        let ((n50, n99), (p50, p99), (w50, w99)) = (q(none), q(policy), q(webhook));
        for (guard, (x50, x99)) in [(Guard::Policy, (p50, p99)), (Guard::Webhook, (w50, w99))] {
            table.row(
                &format!(
                    "{what} through the apiserver at {rate:.0}/s, p50 / p99, {}",
                    guard.what()
                ),
                format!("{} / {}", human(x50), human(x99)),
                "same requests, no admission (namespace not selected), same run",
                format!("{} / {}", human(n50), human(n99)),
                format!("{} / {}", ratio(x50, n50), ratio(x99, n99)),
                "",
                None,
            );
        }
        let saturated = n50 > SATURATED;
        let (pa, wa) = (p99.saturating_sub(n99), w99.saturating_sub(n99));
        table.row(
            &format!("added at p99, {what} at {rate:.0}/s: the placement policy / the webhook"),
            format!("{} / {}", added(p99, n99), added(w99, n99)),
            "—",
            "—".into(),
            "—".into(),
            "the policy adds less than the webhook",
            (!saturated && m.kind == Kind::Create).then_some(pa <= wa),
        );
        table.note(server_side(m));
    }
    table.note(format!(
        "Admission: the chart's ValidatingWebhookConfiguration and ValidatingAdmissionPolicy (rendered with helm template, as the e2e tests do), each scoped by a namespace label: the webhook's points at the release meshgate-webhook over TLS on loopback; the policy's params are the gated Nodes carrying its label. A third namespace carries neither: the baseline is the same requests with no admission. Pod CREATEs are meshed (linkerd) pods with spec.nodeName on {NODES} verified Nodes; bindings bind pending meshed pods (created unmeasured before each phase) to them (the policy does not match bindings: its side measures the same as none). Open loop from this process (kube client, HTTP/1.1 keep-alive pool), latency from each request's due time; {rounds} rounds of {phase} requests per side, sides in rotating order after a discarded warm-up, each phase's pods deleted (grace period 0) before the next. A baseline p50 above {} means the apiserver itself could not keep up with the rate: the goal is then not judged. The load generator, the webhook, the apiserver and etcd share the CPUs; the controller manager was frozen for the section. Ratios: with / without.",
        human(SATURATED)
    ));
}

/// One measurement's sides and server-side figures, in words.
fn server_side(m: &Measured) -> String {
    let sides: Vec<String> = Guard::ALL
        .iter()
        .zip(&m.reports)
        .map(|(g, r)| format!("{}: {}", g.what(), summary(r)))
        .collect();
    format!(
        "Admission, {} at {:.0}/s: {}. Server side over the measured phases: the apiserver called {} {} times (expected {}; calls to any other webhook: {}), mean {} (p99 bucket {}); the webhook answered {} reviews, handling p50 {}, p99 {}, mean {}; pods a binding named that its cache did not hold: {}. The apiserver held up to {} connections to the webhook at once and kept {} after the load.",
        m.kind.what(),
        m.rate,
        sides.join("; "),
        m.kind.hook(),
        m.apiserver.count,
        m.reports[2].samples.len(),
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
    )
}

/// The policy's cost by gated Nodes: one row each.
fn report_cost(table: &mut Table, cost: &[Cost]) {
    let n = cost_requests() * settings().2;
    for c in cost {
        let (p50, p99) = (c.policy.latency(0.5), c.policy.latency(0.99));
        let (n50, n99) = (c.none.latency(0.5), c.none.latency(0.99));
        let (pc, nc) = (c.policy_cpu / n as u32, c.none_cpu / n as u32);
        let what = if c.bound {
            "with spec.nodeName"
        } else {
            "for the scheduler (no spec.nodeName)"
        };
        table.row(
            &format!(
                "meshed pod CREATE {what}, the placement policy with {} gated Nodes (params): p50 / p99, apiserver CPU per request",
                c.gated
            ),
            format!("{} / {}, {}", human(p50), human(p99), human(pc)),
            "same requests, no admission, same run",
            format!("{} / {}, {}", human(n50), human(n99), human(nc)),
            format!("{} / {}, CPU {}", ratio(p50, n50), ratio(p99, n99), ratio(pc, nc)),
            "",
            None,
        );
    }
    table.note(format!("Placement policy cost: one request at a time ({n} per side, sides alternating, dry run), so the figures are each request's own cost, not a queue's; apiserver CPU is kube-apiserver's user + system time over each side's requests, divided by their count (other work of the apiserver in that span included, on both sides alike). The apiserver evaluates the policy once per param (gated Node), match conditions included: a pod its conditions refuse pays per gated Node too."));
}
