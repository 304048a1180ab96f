//! The fault and abuse suite, floods: a client other than the apiserver sending slow chunked
//! review bodies while the real apiserver's reviews go on, and large reviews one after another
//! on a webhook with many worker threads and glibc's arenas of a many-core node.
//!
//! Each runs the real webhook binary (`MESHGATE_BIN_DIR` points it at another build, for the
//! figures before a change) and prints its figures (`--nocapture`); docs/reliability.md and
//! docs/webhook.md keep them. Knobs: `MESHGATE_FLOOD_RATE` (50 requests/s) and
//! `MESHGATE_FLOOD_SECONDS` (20 s) for the flood, `MESHGATE_FLOOD_REVIEWS` (twice the worker
//! threads) for the large reviews.

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, Patch, PatchParams, PostParams};
use meshgate_e2e::load::api;
use meshgate_e2e::load::http_abuse::{
    PeakRss, SlowChunked, Transport, Trickle, label_flood_review, post_all, slow_chunked,
};
use meshgate_e2e::load::review::{self, Report, WebhookProcess};
use meshgate_e2e::load::stats::quantile;
use meshgate_e2e::sim::pod::meshed_pod;
use meshgate_e2e::sim::webhook::{self as registration, Scope};
use meshgate_e2e::unique_name;
use serde_json::json;

use crate::abuse::{BODY, WEBHOOK_BAR_KIB};
use crate::{WAIT, cp};

/// The namespace label this file's registrations require.
const SCOPE_KEY: &str = "e2e.meshgate.io/flood";
/// The attacker's address: another client than the apiserver (127.0.0.1) on loopback.
const ATTACKER: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
/// Legitimate pod CREATEs through the apiserver, per second.
const LEGIT_RATE: f64 = 20.0;
/// How long the baseline without the flood runs.
const BASELINE: Duration = Duration::from_secs(10);

fn env_or(name: &str, default: f64) -> f64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// A webhook registered with the apiserver for one namespace, and a verified node to admit
/// meshed pods onto.
struct Registered {
    wh: WebhookProcess,
    pods: Api<Pod>,
    node: String,
    tag: String,
}

async fn registered() -> anyhow::Result<Registered> {
    let cp = cp().await;
    let client = cp.client()?;
    let tag = unique_name("flood");
    review::create_nodes(&client, &tag, 1, 0, 1).await?;
    let ns = cp.create_namespace(&client, "flood").await?;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let labels = json!({"metadata": {"labels": {SCOPE_KEY: &tag}}});
    namespaces
        .patch(&ns, &PatchParams::default(), &Patch::Merge(labels))
        .await?;
    let mut wh = WebhookProcess::start(cp.admin_kubeconfig_path(), &[])?;
    wh.wait_ready(WAIT).await?;
    let scope = Scope {
        label: Some((SCOPE_KEY.into(), tag.clone())),
        hook_infix: None,
    };
    registration::register(cp, &client, &tag, wh.listen.port(), &wh.ca_pem, &scope).await?;
    let pods: Api<Pod> = Api::namespaced(client, &ns);
    // Applied once a meshed pod onto a node the webhook does not know is refused.
    let probe = meshed_pod("probe", "nowhere", &[], Some(0));
    let begun = Instant::now();
    loop {
        match pods.create(&dry_run(), &probe).await {
            Err(kube::Error::Api(s)) if s.message.contains("denied") => break,
            _ if begun.elapsed() > WAIT => anyhow::bail!("registration not applied"),
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    let node = format!("{tag}-v-0");
    Ok(Registered {
        wh,
        pods,
        node,
        tag,
    })
}

fn dry_run() -> PostParams {
    PostParams {
        dry_run: true,
        ..PostParams::default()
    }
}

/// One dry-run CREATE of a meshed pod onto the verified node, reviewed by the webhook.
async fn create(pods: Api<Pod>, node: String, name: String) -> Result<(), String> {
    let pod = meshed_pod(&name, &node, &[], Some(0));
    pods.create(&dry_run(), &pod)
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// Legitimate reviews through the apiserver for `span`, at [`LEGIT_RATE`].
async fn legit(r: &Registered, span: Duration, phase: &str) -> anyhow::Result<Report> {
    let n = (LEGIT_RATE * span.as_secs_f64()).ceil() as usize;
    let report = api::open_loop(LEGIT_RATE, n, 64, Duration::from_secs(10), |k| {
        let name = format!("{}-{phase}-{k}", r.tag);
        create(r.pods.clone(), r.node.clone(), name)
    })
    .await?;
    Ok(report)
}

/// Time from `stopped` until a review through the apiserver is answered within `fast` again.
async fn recovers(r: &Registered, stopped: Instant, fast: Duration) -> anyhow::Result<Duration> {
    let begun = Instant::now();
    for k in 0.. {
        let sent = Instant::now();
        let ok = create(r.pods.clone(), r.node.clone(), format!("{}-r-{k}", r.tag)).await;
        if ok.is_ok() && sent.elapsed() <= fast {
            return Ok(Instant::now().saturating_duration_since(stopped));
        }
        anyhow::ensure!(begun.elapsed() < WAIT, "not recovered within {WAIT:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    unreachable!("the loop returns or fails")
}

fn print_flood(base: &Report, during: &Report, flood: &SlowChunked, peak: &PeakRss) {
    let held = {
        let mut h = flood.held.clone();
        h.sort();
        h
    };
    eprintln!("[flood] baseline: {}", base.summary());
    eprintln!("[flood] during:   {}", during.summary());
    eprintln!(
        "[flood] attack: {} sent, {} not connected, outcomes {:?}, still open {}; held p50 {:.0} ms p99 {:.0} ms max {:.0} ms",
        flood.sent,
        flood.not_connected,
        flood.outcomes,
        flood.still_open,
        ms(quantile(&held, 0.5)),
        ms(quantile(&held, 0.99)),
        ms(quantile(&held, 1.0)),
    );
    eprintln!(
        "[flood] RSS before {:.1} MiB, peak {:.1} MiB",
        peak.before_mib(),
        peak.peak_mib()
    );
}

/// Another client (127.0.0.2) sends `MESHGATE_FLOOD_RATE` reviews a second for
/// `MESHGATE_FLOOD_SECONDS`, each a body sent chunked that trickles 13 one-byte chunks 0.5 s
/// apart, while the apiserver sends its reviews. Every legitimate review is admitted, their
/// p99 stays within three times the baseline's plus 100 ms (the flood's own CPU on two
/// cores), every slow body is cut within 2 s, and the peak stays under 128 MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slow_chunked_bodies_leave_the_apiservers_reviews_alone() -> anyhow::Result<()> {
    let r = registered().await?;
    let base = legit(&r, BASELINE, "b").await?;
    let (rate, span) = (
        env_or("MESHGATE_FLOOD_RATE", 50.0),
        Duration::from_secs_f64(env_or("MESHGATE_FLOOD_SECONDS", 20.0)),
    );
    let trickle = Trickle {
        chunks: 13,
        gap: Duration::from_millis(500),
        hold: Duration::from_secs(10),
    };
    let pid = r.wh.pid().expect("running");
    let peak = PeakRss::start(pid).expect("its memory");
    let tls = Transport::Tls(review::tls_connector(&r.wh.ca_der)?);
    let addr = r.wh.listen;
    let stopped = Instant::now() + span;
    let flood = tokio::spawn(async move {
        slow_chunked(addr, &tls, ATTACKER, "/validate", (rate, span), trickle).await
    });
    let during = legit(&r, span, "f").await?;
    let base_p99 = base.latency(0.99);
    let fast = (base_p99 * 2).max(Duration::from_millis(50));
    let recovered = recovers(&r, stopped, fast).await?;
    let flood = flood.await?;
    let peak = peak.finish(pid).expect("alive after the flood");
    eprintln!(
        "[flood] {rate}/s slow chunked bodies for {span:?} from {ATTACKER}; recovered {:.0} ms after",
        ms(recovered)
    );
    print_flood(&base, &during, &flood, &peak);
    registration::unregister(&cp().await.client()?, &r.tag).await;
    for (what, report) in [("baseline", &base), ("flood", &during)] {
        let errors = report.errors();
        anyhow::ensure!(
            errors.is_empty(),
            "{what}: {} legitimate reviews failed, first: {:?}",
            errors.len(),
            errors.first().map(|s| &s.outcome)
        );
    }
    let bound = base_p99 * 3 + Duration::from_millis(100);
    anyhow::ensure!(
        during.latency(0.99) <= bound,
        "p99 {:.1} ms during the flood, over {:.1} ms (baseline p99 {:.1} ms)",
        ms(during.latency(0.99)),
        ms(bound),
        ms(base_p99)
    );
    let slowest = flood.held.iter().max().copied().unwrap_or_default();
    anyhow::ensure!(
        flood.still_open == 0 && slowest < Duration::from_secs(2),
        "slow bodies held up to {slowest:?}, {} past the hold",
        flood.still_open
    );
    anyhow::ensure!(
        peak.peak_kib < WEBHOOK_BAR_KIB,
        "peak RSS {:.1} MiB, the bar is half the 256Mi limit",
        peak.peak_mib()
    );
    Ok(())
}

/// Label-flood reviews just under 3 MiB, one after another, on a webhook with `threads`
/// worker threads and glibc's default arena count for a node of as many cores (8 per core,
/// `GLIBC_TUNABLES`): its peak and its resident memory once idle again.
async fn one_after_another(threads: usize) -> anyhow::Result<(PeakRss, u64, Duration)> {
    let cp = cp().await;
    let (threads_env, arenas) = (
        threads.to_string(),
        format!("glibc.malloc.arena_max={}", 8 * threads),
    );
    let env = [
        ("TOKIO_WORKER_THREADS", threads_env.as_str()),
        ("GLIBC_TUNABLES", arenas.as_str()),
    ];
    let mut wh = WebhookProcess::start_with_env(cp.admin_kubeconfig_path(), &[], &env)?;
    wh.wait_ready(WAIT).await?;
    let tls = Transport::Tls(review::tls_connector(&wh.ca_der)?);
    let pid = wh.pid().expect("running");
    let peak = PeakRss::start(pid).expect("its memory");
    let n = env_or("MESHGATE_FLOOD_REVIEWS", 2.0 * threads as f64) as usize;
    let begun = Instant::now();
    for i in 0..n {
        let body = label_flood_review(&format!("seq-{i}"), BODY);
        let got = post_all(wh.listen, &tls, "/validate", &[body], WAIT).await;
        anyhow::ensure!(
            matches!(got.first(), Some(Ok(200))),
            "review {i} answered {got:?}"
        );
    }
    let took = begun.elapsed();
    let peak = peak.finish(pid).expect("alive");
    // Idle: what it keeps once the reviews are over.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let idle = wh.rss_kib().expect("alive").0;
    eprintln!(
        "[abuse] {n} label floods of {BODY} B one after another, {threads} worker threads, {arenas}: \
         answered in {} ms; RSS before {:.1} MiB, peak {:.1} MiB, idle after {:.1} MiB",
        took.as_millis(),
        peak.before_mib(),
        peak.peak_mib(),
        idle as f64 / 1024.0
    );
    Ok((peak, idle, took))
}

/// With 16 and with 32 worker threads, and glibc's default arenas for that many cores, the
/// webhook's peak and idle memory after large reviews one after another stay under 128 MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn large_reviews_stay_within_the_bar_at_any_core_count() -> anyhow::Result<()> {
    let mut over = Vec::new();
    for threads in [16, 32] {
        let (peak, idle, _) = one_after_another(threads).await?;
        if peak.peak_kib >= WEBHOOK_BAR_KIB || idle >= WEBHOOK_BAR_KIB {
            over.push(format!(
                "{threads} threads: peak {:.1} MiB, idle {:.1} MiB",
                peak.peak_mib(),
                idle as f64 / 1024.0
            ));
        }
    }
    anyhow::ensure!(over.is_empty(), "over half the 256Mi limit: {over:?}");
    Ok(())
}
