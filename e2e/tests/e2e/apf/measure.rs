//! The figures of one state (with or without meshgate's schemas): a bystander's reads and the
//! agent's Node writes, alone and beside the agents' flood of reads, and the writes beside the
//! bystander's own flood; the apiserver's metrics around each flood.
//!
//! In: the agent's client (its token bound to its pod on node A) and the bystander's. Out: a
//! [`Measured`] with every probe's latencies, the floods' answers and the scrapes, printed
//! (`apf: ...`), and the checks on them.

use std::sync::Arc;
use std::time::Duration;

use anyhow::ensure;
use kube::Client;
use meshgate_e2e::load::api::apiserver_metrics;
use meshgate_e2e::load::flood::{self, Flood, MakeRequest, Probe, Tally};
use meshgate_e2e::load::histogram::{Histogram, counter};

use super::{STEP, WRITES, get, label_patch};

/// Concurrent requests of a flood.
const FLOOD_WORKERS: usize = 32;
/// How long a flood runs before its probe starts, so its queues are full.
const WARM_UP: Duration = Duration::from_secs(2);
/// Requests of each probe, one at a time, [`PAUSE`] apart.
const PROBES: usize = 150;
const PAUSE: Duration = Duration::from_millis(10);
/// A probe's bound beside the agents' flood: twice its p99 alone, plus one flood request's
/// time alone (its p99 over [`ONE_LIST`] requests, in the same state). With the schemas the
/// flood's level has one seat, so one of its 2 MB LISTs runs at a time and a probe shares
/// the CPU with that one at most; without them `workload-low` runs six or more at once.
/// Measured in the same run, the yardstick follows the machine's load (the tests share two
/// cores with builds).
const TIMES: u32 = 2;
/// Flood requests timed alone, one at a time.
const ONE_LIST: usize = 30;
/// The writes' bound beside another client's flood, which has its own level's seats and so
/// both cores: the writes wait for CPU there, never for a seat (checked apart), and APF
/// does not share out CPU.
const WRITES_BESIDE_OTHERS: Duration = Duration::from_secs(2);
/// The writes' longest APF queue wait with the schemas: the lowest bucket of
/// `apiserver_flowcontrol_request_wait_duration_seconds` above zero.
const NO_QUEUE: f64 = 0.005;

/// The clients and requests of the measurements.
pub(super) struct Lab {
    pub(super) admin: Client,
    /// The agent's ServiceAccount (its token bound to its pod on node A), without retry.
    pub(super) agent: Client,
    /// Another workload's ServiceAccount, allowed to list pods.
    pub(super) bystander: Client,
    pub(super) node_a: String,
    pub(super) app: String,
}

/// The flood's request: every pod in the cluster (the bulk pods make it heavy).
fn every_pod() -> MakeRequest {
    Arc::new(|| get("/api/v1/pods"))
}

/// A flood of [`every_pod`] through `client`, running for [`WARM_UP`] already.
async fn flooding(client: &Client) -> Flood {
    let flood = Flood::start(client, FLOOD_WORKERS, STEP, every_pod());
    tokio::time::sleep(WARM_UP).await;
    flood
}

impl Lab {
    /// Every figure of one state, printed under `state`.
    pub(super) async fn measure(&self, state: &str) -> anyhow::Result<Measured> {
        let one_list = flood::probe(&self.agent, ONE_LIST, PAUSE, STEP, |_| every_pod()()).await;
        let bystander_alone = self.bystander_probe().await;
        let writes_alone = self.writes_probe().await;
        let at_start = apiserver_metrics(&self.admin).await?;
        let flood = flooding(&self.agent).await;
        let bystander_flooded = self.bystander_probe().await;
        let writes_flooded = self.writes_probe().await;
        let agent_flood = flood.stop().await;
        let after_agents = apiserver_metrics(&self.admin).await?;
        let flood = flooding(&self.bystander).await;
        let writes_beside_others = self.writes_probe().await;
        let other_flood = flood.stop().await;
        let after_others = apiserver_metrics(&self.admin).await?;
        let m = Measured {
            one_list,
            bystander_alone,
            bystander_flooded,
            writes_alone,
            writes_flooded,
            writes_beside_others,
            agent_flood,
            other_flood,
            at_start,
            after_agents,
            after_others,
        };
        m.print(state);
        Ok(m)
    }

    /// The bystander lists the two pods of the application namespace, [`PROBES`] times.
    async fn bystander_probe(&self) -> Probe {
        let uri = format!("/api/v1/namespaces/{}/pods", self.app);
        flood::probe(&self.bystander, PROBES, PAUSE, STEP, |_| get(&uri)).await
    }

    /// The agent toggles meshgate's label on its own Node (what its taint-and-label patch
    /// is; the own-node policy admits it), [`PROBES`] times.
    async fn writes_probe(&self) -> Probe {
        let uri = format!("/api/v1/nodes/{}", self.node_a);
        flood::probe(&self.agent, PROBES, PAUSE, STEP, |k| {
            label_patch(&uri, if k % 2 == 0 { "true" } else { "false" })
        })
        .await
    }
}

/// The figures of one state.
pub(super) struct Measured {
    /// The flood's request alone: the yardstick of [`Measured::bound`].
    one_list: Probe,
    pub(super) bystander_alone: Probe,
    pub(super) bystander_flooded: Probe,
    pub(super) writes_alone: Probe,
    pub(super) writes_flooded: Probe,
    pub(super) writes_beside_others: Probe,
    agent_flood: Tally,
    other_flood: Tally,
    /// The apiserver's metrics before the agents' flood, after it, and after the other's.
    at_start: String,
    after_agents: String,
    after_others: String,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn figures(p: &Probe) -> String {
    format!(
        "p50 {:.1} ms p99 {:.1} ms ({} of {} failed, {} 429)",
        ms(p.quantile(0.5)),
        ms(p.quantile(0.99)),
        p.errors.len(),
        p.latencies.len(),
        p.throttled()
    )
}

impl Measured {
    /// A probe's bound beside the agents' flood, from its figures `alone`: [`TIMES`] its
    /// p99, plus the p99 of one flood request alone.
    pub(super) fn bound(&self, alone: &Probe) -> Duration {
        alone.quantile(0.99) * TIMES + self.one_list.quantile(0.99)
    }

    fn print(&self, state: &str) {
        println!("apf: {state}:");
        for (what, p) in [
            ("agents' flood request alone", &self.one_list),
            ("bystander LIST alone", &self.bystander_alone),
            ("bystander LIST, agents' flood", &self.bystander_flooded),
            ("agent Node PATCH alone", &self.writes_alone),
            ("agent Node PATCH, agents' flood", &self.writes_flooded),
            (
                "agent Node PATCH, other's flood",
                &self.writes_beside_others,
            ),
        ] {
            println!("apf:   {what:<33} {}", figures(p));
        }
        println!("apf:   agents' flood answers: {:?}", self.agent_flood);
        println!("apf:   other's flood answers: {:?}", self.other_flood);
    }

    /// `name` summed over `schema`/`level`'s series, between two scrapes.
    fn delta(before: &str, after: &str, name: &str, schema: &str, level: &str) -> f64 {
        let labels = [("flow_schema", schema), ("priority_level", level)];
        counter(after, name, &labels) - counter(before, name, &labels)
    }

    /// Requests `schema`/`level` dispatched while the agents' flood ran (the flood, and the
    /// bystander's and the agent's probes beside it), printed with its rejections.
    fn dispatched(&self, schema: &str, level: &str) -> f64 {
        let (a, b) = (&self.at_start, &self.after_agents);
        let dispatched = Self::delta(
            a,
            b,
            "apiserver_flowcontrol_dispatched_requests_total",
            schema,
            level,
        );
        let rejected = Self::delta(
            a,
            b,
            "apiserver_flowcontrol_rejected_requests_total",
            schema,
            level,
        );
        println!(
            "apf:   {schema}/{level} during the agents' flood: {dispatched} dispatched, {rejected} rejected"
        );
        dispatched
    }

    /// The agents' flood, and the probes in `with`, were dispatched by `schema`/`level`: at
    /// least as many requests as they got 2xx answers for.
    pub(super) fn expect_classified(
        &self,
        schema: &str,
        level: &str,
        with: &[&Probe],
    ) -> anyhow::Result<()> {
        let answered: usize = with
            .iter()
            .map(|p| p.latencies.len() - p.errors.len())
            .sum();
        let want = self.agent_flood.ok as f64 + answered as f64;
        let dispatched = self.dispatched(schema, level);
        ensure!(
            self.agent_flood.ok > 0 && dispatched >= want,
            "{schema}/{level} dispatched {dispatched} requests, fewer than the {want} answered"
        );
        Ok(())
    }

    /// The bystander's p99 beside the agents' flood within [`Measured::bound`] of its own, no error.
    pub(super) fn expect_bystander_within_baseline(&self) -> anyhow::Result<()> {
        let (p99, bound) = (
            self.bystander_flooded.quantile(0.99),
            self.bound(&self.bystander_alone),
        );
        ensure!(
            self.bystander_flooded.errors.is_empty() && p99 <= bound,
            "the bystander beside the agents' flood: p99 {p99:?} above {bound:?}, errors {:?}",
            self.bystander_flooded.errors
        );
        Ok(())
    }

    /// Every Node PATCH of the agent answered 2xx (no 429) beside either flood, dispatched by
    /// meshgate's writes level without queuing, within [`Measured::bound`] of its own p99 beside the
    /// agents' flood and within [`WRITES_BESIDE_OTHERS`] beside the other's.
    pub(super) fn expect_writes_through(&self) -> anyhow::Result<()> {
        let wait = "apiserver_flowcontrol_request_wait_duration_seconds";
        let labels = [("flow_schema", WRITES), ("priority_level", WRITES)];
        let scrapes = [
            (&self.at_start, &self.after_agents),
            (&self.after_agents, &self.after_others),
        ];
        let cases = [
            (
                "its own reads' flood",
                &self.writes_flooded,
                self.bound(&self.writes_alone),
            ),
            (
                "another client's flood",
                &self.writes_beside_others,
                WRITES_BESIDE_OTHERS,
            ),
        ];
        for ((what, p, bound), (before, after)) in cases.into_iter().zip(scrapes) {
            let waited = Histogram::parse(after, wait, &labels)
                .since(&Histogram::parse(before, wait, &labels));
            let p99_wait = waited.quantile_bound(0.99).unwrap_or(f64::INFINITY);
            println!(
                "apf:   {WRITES} queue wait beside {what}: {} requests, p99 within {p99_wait} s",
                waited.count
            );
            ensure!(
                p.errors.is_empty(),
                "the agent's Node PATCHes beside {what}: {:?}",
                p.errors
            );
            ensure!(
                waited.count >= p.latencies.len() as f64 && p99_wait <= NO_QUEUE,
                "the agent's Node PATCHes beside {what} queued: p99 wait within {p99_wait} s"
            );
            ensure!(
                p.quantile(0.99) <= bound,
                "the agent's Node PATCHes beside {what}: p99 {:?} above {bound:?}",
                p.quantile(0.99)
            );
        }
        Ok(())
    }
}
