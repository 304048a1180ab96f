//! The fault and abuse suite, pods part: what anyone who can create pods, or reach the
//! webhook's port, can make the real webhook and agent processes hold or cost, against the
//! real apiserver.
//!
//! - 1,000 unscheduled pods (500 outside soak) with 256 KiB of annotations each: the
//!   webhook's peak RSS (`VmHWM`) while they arrive through its watch and while a restart
//!   lists them all (what every relist does) stays under half its manifest's limit, and it
//!   still answers bindings of them right, from its cache.
//! - A hundred pods of about 1.25 MiB each (256 KiB of annotations, a 1 MiB environment
//!   variable) on one node: the agent's peak RSS through the list of its node's pods stays
//!   under half its limit, and it still tracks the meshed ones.
//! - Forged binding reviews naming made-up pods, sent straight to the webhook's port: the
//!   webhook's pod GETs, counted in the apiserver's audit log, stay within its lookup rate,
//!   a name the API just did not find is answered from memory, and every review is refused on
//!   the unverified node, saying why.
//!
//! Every figure is printed (`--nocapture`); docs/reliability.md records them.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, ensure};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Client;
use kube::api::{Api, DeleteParams, PostParams};
use meshgate_e2e::harness::audit::AuditedIdentity;
use meshgate_e2e::harness::wait::{API_TIMEOUT, poll_until};
use meshgate_e2e::load::review::{self, Review, WebhookProcess};
use meshgate_e2e::sim::node::{Agent, CniDirs, golden, metric_sample, plain, tail};
use meshgate_e2e::sim::pod::{self, ANNOTATION_LIMIT, Fat};
use meshgate_e2e::{ControlPlane, NodeSpec, unique_name};

use crate::{WAIT, cp};

/// Half the webhook's memory limit in `manifests/charts/meshgate/templates/webhook.yaml` (256Mi).
const WEBHOOK_BOUND_KIB: u64 = 128 * 1024;
/// Half the agent's memory limit in `manifests/charts/meshgate/templates/agent.yaml` (160Mi).
const AGENT_BOUND_KIB: u64 = 80 * 1024;

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// `make soak`: the full count of fat pods.
fn soak() -> bool {
    std::env::var("MESHGATE_SOAK").is_ok_and(|v| !v.is_empty() && v != "0")
}

/// The number in the environment variable `var`, else `default`.
fn knob(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Creates `pods` in `ns`, 8 at a time; returns how long it took.
async fn create_all(client: &Client, ns: &str, pods: Vec<Pod>) -> anyhow::Result<Duration> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let started = Instant::now();
    let failed: Vec<String> = futures::stream::iter(pods)
        .map(|p| {
            let api = api.clone();
            async move {
                let name = p.metadata.name.clone().unwrap_or_default();
                match tokio::time::timeout(API_TIMEOUT, api.create(&PostParams::default(), &p))
                    .await
                {
                    Ok(Ok(_)) => None,
                    Ok(Err(e)) => Some(format!("{name}: {e}")),
                    Err(_) => Some(format!("{name}: no answer within {API_TIMEOUT:?}")),
                }
            }
        })
        .buffer_unordered(8)
        .filter_map(futures::future::ready)
        .collect()
        .await;
    ensure!(
        failed.is_empty(),
        "{} pod creates failed, first: {}",
        failed.len(),
        failed[0]
    );
    Ok(started.elapsed())
}

/// Deletes the named pods at once (grace 0), 8 at a time; best effort.
async fn delete_all(client: &Client, ns: &str, names: &[String]) {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let dp = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::default()
    };
    futures::stream::iter(names)
        .for_each_concurrent(8, |n| {
            let (api, dp) = (api.clone(), dp.clone());
            async move {
                let _ = tokio::time::timeout(API_TIMEOUT, api.delete(n, &dp)).await;
            }
        })
        .await;
}

/// Deletes the named Nodes (best effort).
async fn delete_nodes(client: &Client, names: &[&str]) {
    let nodes: Api<Node> = Api::all(client.clone());
    for n in names {
        let _ = tokio::time::timeout(API_TIMEOUT, nodes.delete(n, &DeleteParams::default())).await;
    }
}

/// A sample of `/metrics`, 0 when absent.
async fn metric(webhook: &WebhookProcess, sample: &str) -> anyhow::Result<f64> {
    let (_, body) = webhook.admin_get("/metrics").await.context("/metrics")?;
    Ok(metric_sample(&body, sample).unwrap_or(0.0))
}

fn spec(
    webhook: &WebhookProcess,
    reviews: Vec<Review>,
    rate: f64,
    duration: Duration,
    connections: usize,
) -> anyhow::Result<review::Spec> {
    Ok(review::Spec {
        addr: webhook.listen,
        path: "/validate".into(),
        connector: review::tls_connector(&webhook.ca_der)?,
        reviews: Arc::new(reviews),
        rate,
        duration,
        connections,
    })
}

/// How long to offer `n` reviews at `rate` so that exactly `n` are sent: half a request
/// short of `n / rate`, so that no request falls due exactly at the end.
fn paced(n: usize, rate: f64) -> Duration {
    Duration::from_secs_f64((n as f64 - 0.5) / rate)
}

const FOUND: &str = "meshgate_pod_lookups_total{outcome=\"found\"}";

/// Waits until the webhook's cache holds `pod` (a binding of it to `node` is refused
/// without a lookup): its watch has delivered every pod created before it.
async fn wait_cached(
    webhook: &WebhookProcess,
    ns: &str,
    pod: &str,
    node: &str,
) -> anyhow::Result<()> {
    let review = review::binding_review("marker", ns, pod, node, false);
    let s = spec(
        webhook,
        vec![review.clone()],
        1.0,
        Duration::from_millis(1),
        1,
    )?;
    poll_until(
        "the webhook's cache to hold the marker pod",
        WAIT,
        || async {
            let before = metric(webhook, FOUND).await?;
            let answer = review::answer(&s, &review).await?;
            ensure!(
                answer["allowed"] == false,
                "the marker was admitted: {answer}"
            );
            anyhow::Ok((metric(webhook, FOUND).await? == before).then_some(()))
        },
    )
    .await?;
    Ok(())
}

/// Issue 18, item 5: unscheduled pods with 256 KiB of annotations each (and
/// `MESHGATE_FAT_LABEL_BYTES` of labels, none by default), half of them meshed: 1,000 in soak,
/// 500 in `make test` (`MESHGATE_FAT_PODS`). The webhook's peak RSS stays under 128 MiB while
/// they arrive through its watch, and in a second process started once they are all there
/// (its list is what every relist does); that process becomes ready and answers bindings of
/// the fat pods right (meshed refused, plain allowed, verified node allowed) from its cache,
/// without a single pod lookup.
#[tokio::test]
async fn fat_unscheduled_pods_keep_the_webhook_under_half_its_memory_limit() -> anyhow::Result<()> {
    let cp = cp().await;
    let client = cp.client()?;
    let ns = cp.create_namespace(&client, "abuse-fat").await?;
    let tag = unique_name("fat");
    let (verified, unverified) = (format!("{tag}-v-0"), format!("{tag}-u-0"));
    // 500 in `make test` (they already fill one of the old webhook's list pages with 125 MiB),
    // the 1,000 in soak.
    let count = knob("MESHGATE_FAT_PODS", if soak() { 1000 } else { 500 });
    let fat = Fat {
        annotations: ANNOTATION_LIMIT,
        labels: knob("MESHGATE_FAT_LABEL_BYTES", 0),
        env: 0,
    };
    let names: Vec<String> = (0..count).map(|i| format!("fat-{i}")).collect();
    let result = async {
        review::create_nodes(&client, &tag, 1, 1, 2).await?;
        let mut watching = WebhookProcess::start(cp.admin_kubeconfig_path(), &[])?;
        watching.wait_ready(WAIT).await?;
        let pods = names
            .iter()
            .enumerate()
            .map(|(i, n)| pod::fat_pod(n, None, i % 2 == 0, fat))
            .collect();
        let took = create_all(&client, &ns, pods).await?;
        // Created after every fat pod: once it is cached, they all went through the watch.
        create_all(&client, &ns, vec![pod::pending_meshed_pod("marker")]).await?;
        wait_cached(&watching, &ns, "marker", &unverified).await?;
        let watched = watching.rss_kib().context("the watching webhook's RSS")?;
        drop(watching);
        let listing =
            a_listing_webhook_stays_under_the_bound(cp, count, fat, took, watched).await?;
        bindings_are_answered_from_the_cache(&listing, &ns, &names, &verified, &unverified).await?;
        anyhow::Ok(())
    }
    .await;
    let mut all = names.clone();
    all.push("marker".into());
    delete_all(&client, &ns, &all).await;
    delete_nodes(&client, &[&verified, &unverified]).await;
    result
}

/// A webhook started once the fat pods are all there (its list is what every relist does)
/// gets ready; it and the one that watched them arrive (`watched`: RSS, peak) stay under the
/// bound. Returns the listing webhook.
async fn a_listing_webhook_stays_under_the_bound(
    cp: &ControlPlane,
    count: usize,
    fat: Fat,
    took: Duration,
    (rss_watch, hwm_watch): (u64, u64),
) -> anyhow::Result<WebhookProcess> {
    let started = Instant::now();
    let mut listing = WebhookProcess::start(cp.admin_kubeconfig_path(), &[])?;
    let ready = listing.wait_ready(WAIT).await?;
    let (rss_list, hwm_list) = listing.rss_kib().context("the listing webhook's RSS")?;
    eprintln!(
        "[abuse-pods] {count} unscheduled pods × {ANNOTATION_LIMIT} B of annotations \
         (and {} B of labels) created in {took:?}; webhook watching them: RSS {:.1} MiB, \
         peak {:.1} MiB; a new webhook listing them: ready after {:?} (start to /ready \
         {:?}), RSS {:.1} MiB, peak {:.1} MiB (bound {:.0} MiB)",
        fat.labels,
        mib(rss_watch),
        mib(hwm_watch),
        ready,
        started.elapsed(),
        mib(rss_list),
        mib(hwm_list),
        mib(WEBHOOK_BOUND_KIB),
    );
    ensure!(
        hwm_watch < WEBHOOK_BOUND_KIB,
        "the webhook watching {count} fat pods peaked at {:.1} MiB",
        mib(hwm_watch)
    );
    ensure!(
        hwm_list < WEBHOOK_BOUND_KIB,
        "the webhook listing {count} fat pods peaked at {:.1} MiB",
        mib(hwm_list)
    );
    Ok(listing)
}

/// Answered from the cache: every meshed fat pod refused on the unverified node, every
/// plain one allowed there, any of them allowed on the verified node.
async fn bindings_are_answered_from_the_cache(
    listing: &WebhookProcess,
    ns: &str,
    names: &[String],
    verified: &str,
    unverified: &str,
) -> anyhow::Result<()> {
    let reviews: Vec<Review> = names
        .iter()
        .enumerate()
        .flat_map(|(i, n)| {
            [
                review::binding_review(&format!("u-{n}"), ns, n, unverified, i % 2 != 0),
                review::binding_review(&format!("v-{n}"), ns, n, verified, true),
            ]
        })
        .collect();
    let sent = reviews.len();
    let report = review::run(spec(listing, reviews, 1000.0, paced(sent, 1000.0), 4)?).await?;
    let errors = report.errors();
    ensure!(
        errors.is_empty() && report.samples.len() == sent,
        "{} of {} bindings answered wrong, first: {:?}",
        errors.len(),
        report.samples.len(),
        errors.first()
    );
    let meshed = review::binding_review("msg", ns, &names[0], unverified, false);
    let answer = review::answer(&spec(listing, vec![], 1.0, Duration::ZERO, 1)?, &meshed).await?;
    let message = answer["status"]["message"].as_str().unwrap_or_default();
    ensure!(
        message.contains("belongs to mesh profile linkerd"),
        "{message}"
    );
    let (_, body) = listing.admin_get("/metrics").await.context("/metrics")?;
    ensure!(
        !body.contains("meshgate_pod_lookups_total{"),
        "bindings of cached pods were looked up:\n{body}"
    );
    ensure!(
        listing.pid().is_some(),
        "the webhook exited:\n{}",
        tail(&listing.log(), 20)
    );
    Ok(())
}

/// Issue 18, item 5, the agent's side: 100 (`MESHGATE_FAT_PODS`) pods of about 1.25 MiB
/// each on the agent's node, half of them meshed. Started once they are there, the agent
/// lists them all (what a relist does) with its peak RSS under 80 MiB, and tracks exactly
/// the meshed ones.
#[tokio::test]
async fn fat_pods_on_its_node_keep_the_agent_under_half_its_memory_limit() -> anyhow::Result<()> {
    let cp = cp().await;
    let client = cp.client()?;
    let ns = cp.create_namespace(&client, "abuse-agent").await?;
    let node = unique_name("abuse-agent");
    let count = knob("MESHGATE_FAT_PODS", 100);
    let fat = Fat {
        annotations: ANNOTATION_LIMIT,
        labels: 0,
        env: 1024 * 1024,
    };
    let names: Vec<String> = (0..count).map(|i| format!("fat-{i}")).collect();
    let result = async {
        cp.register_node(
            &client,
            &NodeSpec::new(&node).label("e2e.meshgate.io/test", &ns),
        )
        .await?;
        let pods = names
            .iter()
            .enumerate()
            .map(|(i, n)| pod::fat_pod(n, Some(&node), i % 2 == 0, fat))
            .collect();
        let took = create_all(&client, &ns, pods).await?;
        let dirs = CniDirs::new()?;
        dirs.config(
            "10-calico-linkerd.conflist",
            &golden("calico-linkerd.conflist")?,
        )?;
        let started = Instant::now();
        let agent = Agent::start(cp, &node, &dirs, &[])?;
        agent.wait_ready(WAIT).await?;
        let listed = poll_until("the agent to list its node's pods", WAIT, || async {
            anyhow::Ok(
                agent
                    .log()
                    .contains("pod list complete")
                    .then(|| started.elapsed()),
            )
        })
        .await?;
        let rss = agent.rss_kib().context("the agent's RSS")?;
        let hwm = agent.peak_rss_kib().context("the agent's peak RSS")?;
        let log = plain(&agent.log());
        eprintln!(
            "[abuse-pods] {count} pods of {:.2} MiB on one node created in {took:?}; agent: \
             pod list complete {listed:?} after start, RSS {:.1} MiB, peak {:.1} MiB \
             (bound {:.0} MiB)",
            (fat.annotations + fat.env) as f64 / 1048576.0,
            mib(rss),
            mib(hwm),
            mib(AGENT_BOUND_KIB),
        );
        ensure!(
            hwm < AGENT_BOUND_KIB,
            "the agent listing {count} fat pods peaked at {:.1} MiB",
            mib(hwm)
        );
        let meshed = count.div_ceil(2);
        ensure!(
            // The node is a field of the agent's span, which prefixes every line.
            log.lines()
                .any(|l| l.contains(&format!("agent{{node={node}}}"))
                    && l.contains(&format!("pod list complete pods={meshed}"))),
            "the agent does not track the {meshed} meshed pods:\n{}",
            tail(&log, 30)
        );
        anyhow::Ok(())
    }
    .await;
    delete_all(&client, &ns, &names).await;
    delete_nodes(&client, &[&node]).await;
    result
}

/// How many forged binding reviews the flood sends.
const FORGED: usize = 3000;

/// The flood: [`FORGED`] bindings of made-up pods to the unverified node (every tenth names
/// the same made-up pod, `ghost`), with a binding of the real pending pod to each node every
/// hundred.
fn forged_reviews(ns: &str, verified: &str, unverified: &str) -> Vec<Review> {
    let mut reviews: Vec<Review> = (0..FORGED)
        .map(|i| {
            let pod = if i % 10 == 0 {
                "ghost".to_string()
            } else {
                unique_name("forged")
            };
            review::binding_review(&format!("f-{i}"), ns, &pod, unverified, false)
        })
        .collect();
    for i in 0..FORGED / 100 {
        reviews.insert(
            i * 100,
            review::binding_review(&format!("p-{i}"), ns, "pending", unverified, false),
        );
        reviews.insert(
            i * 100 + 1,
            review::binding_review(&format!("v-{i}"), ns, "pending", verified, true),
        );
    }
    reviews
}

/// The webhook's pod GETs in the audit log since `from`, once the log stops growing.
async fn settled_pod_gets(
    cp: &ControlPlane,
    identity: &AuditedIdentity,
    from: SystemTime,
) -> anyhow::Result<Vec<String>> {
    // The audit log lags the requests a little.
    let mut gets = Vec::new();
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now: Vec<String> = identity
            .requests(cp, from)?
            .into_iter()
            .filter(|r| r.verb == "get" && r.resource == "pods")
            .map(|r| r.name)
            .collect();
        if now.len() == gets.len() && !now.is_empty() {
            break;
        }
        gets = now;
    }
    Ok(gets)
}

/// What the flood of forged reviews cost.
struct Flood {
    /// Reviews sent, forged and real.
    sent: usize,
    report: review::Report,
    elapsed: Duration,
    /// The webhook's pod GETs, by pod name.
    gets: Vec<String>,
    /// The webhook's `/metrics` after the flood.
    metrics: String,
    /// A forged binding's refusal, sent after the flood.
    message: String,
}

impl Flood {
    /// Every review answered right; pod GETs within the lookup rate, the repeated name looked
    /// up at most 8 times per 5 s; lookups refused; the refusal says why.
    fn lookups_stayed_within_the_rate(&self) -> anyhow::Result<()> {
        let Self {
            sent,
            report,
            elapsed,
            gets,
            metrics: body,
            message,
        } = self;
        let (sent, elapsed) = (*sent, *elapsed);
        let ghost = gets.iter().filter(|n| *n == "ghost").count();
        let outcome = |o: &str| {
            metric_sample(
                body,
                &format!("meshgate_pod_lookups_total{{outcome=\"{o}\"}}"),
            )
            .unwrap_or(0.0)
        };
        // One second's worth at once, then 20 a second (the defaults), over the flood and the
        // single review after it.
        let bound = 20 + (20.0 * (elapsed.as_secs_f64() + 1.0)).ceil() as usize;
        eprintln!(
            "[abuse-pods] {} binding reviews ({FORGED} forged) at 1,000/s over {elapsed:?}: \
             {}; webhook pod GETs in the audit log: {} (bound {bound}), of them for the \
             repeated name: {ghost}; lookups by outcome: found {}, not_found {}, known_missing \
             {}, rate_limited {}, in_flight_limit {}, failed {}; a forged binding's refusal: \
             {message}",
            sent,
            report.summary(),
            gets.len(),
            outcome("found"),
            outcome("not_found"),
            outcome("known_missing"),
            outcome("rate_limited"),
            outcome("in_flight_limit"),
            outcome("failed"),
        );
        let errors: Vec<_> = report.errors();
        ensure!(
            errors.is_empty() && report.samples.len() == sent,
            "{} of {} reviews answered wrong, first: {:?}",
            errors.len(),
            report.samples.len(),
            errors.first()
        );
        ensure!(
            !gets.is_empty() && gets.len() <= bound,
            "{} pod GETs for {FORGED} forged reviews in {elapsed:?} (bound {bound})",
            gets.len()
        );
        // Once the API said it does not exist, the name is answered from memory for 5 s;
        // only reviews of it that arrive while that first GET is in flight look it up too,
        // and at most 8 lookups run at once.
        let windows = 1 + (elapsed.as_secs() / 5) as usize;
        ensure!(
            ghost <= 8 * windows,
            "the repeated made-up name cost {ghost} GETs"
        );
        ensure!(
            outcome("rate_limited") > 0.0 && outcome("known_missing") > 0.0,
            "no lookup was refused:\n{body}"
        );
        ensure!(
            message.contains("was not looked up") || message.contains("was not found"),
            "a forged binding's refusal does not say why: {message}"
        );
        Ok(())
    }
}

/// Issue 18, item 6: 3,000 binding reviews naming made-up pods, sent straight to the
/// webhook's port at 1,000/s (every tenth names the same made-up pod), mixed with bindings
/// of a real pending meshed pod. The webhook (defaults: 20 lookups a second, 8 at once)
/// answers every one right, and its pod GETs in the audit log stay within its rate: at most
/// one second's worth plus 20 a second. Reviews of the repeated name are answered from
/// memory once the API said it does not exist (`known_missing`).
#[tokio::test]
async fn forged_binding_reviews_cost_the_apiserver_at_most_the_lookup_rate() -> anyhow::Result<()> {
    let cp = cp().await;
    let admin = cp.client()?;
    let home = cp.create_namespace(&admin, "abuse-id").await?;
    let identity = AuditedIdentity::new(cp, &admin, &home, "meshgate-webhook").await?;
    let ns = cp.create_namespace(&admin, "abuse-forged").await?;
    let tag = unique_name("forged");
    let (verified, unverified) = (format!("{tag}-v-0"), format!("{tag}-u-0"));
    let result = async {
        review::create_nodes(&admin, &tag, 1, 1, 2).await?;
        create_all(&admin, &ns, vec![pod::pending_meshed_pod("pending")]).await?;
        let mut webhook = WebhookProcess::start(&identity.kubeconfig, &[])?;
        webhook.wait_ready(WAIT).await?;
        wait_cached(&webhook, &ns, "pending", &unverified).await?;

        let reviews = forged_reviews(&ns, &verified, &unverified);
        let from = SystemTime::now();
        let report = review::run(spec(
            &webhook,
            reviews.clone(),
            1000.0,
            paced(reviews.len(), 1000.0),
            8,
        )?)
        .await?;
        let elapsed = from.elapsed().unwrap_or_default();
        let forged =
            review::binding_review("one-more", &ns, &unique_name("forged"), &unverified, false);
        let answer =
            review::answer(&spec(&webhook, vec![], 1.0, Duration::ZERO, 1)?, &forged).await?;
        let message = answer["status"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string();

        let gets = settled_pod_gets(cp, &identity, from).await?;
        let (_, metrics) = webhook.admin_get("/metrics").await.context("/metrics")?;
        let flood = Flood {
            sent: reviews.len(),
            report,
            elapsed,
            gets,
            metrics,
            message,
        };
        flood.lookups_stayed_within_the_rate()
    }
    .await;
    delete_all(&admin, &ns, &["pending".to_string()]).await;
    delete_nodes(&admin, &[&verified, &unverified]).await;
    identity.remove(&admin).await;
    result
}
