//! The webhook throughout the fleet-wide event: the release webhook, started among the
//! fleet's Nodes, answers a steady review load before the event and while it runs, so its
//! p99 during the event (its Node cache taking every Node's taint and untaint) reads against
//! its p99 just before, in the same run.
//!
//! In: the control plane and the fleet's Node names. Out: the two [`Report`]s. The reviews'
//! answers do not depend on the event: meshed pods on a Node of their own that stays
//! verified (each a Node cache lookup, beside the event's writes) and plain pods naming the
//! fleet's Nodes.

use super::*;
use meshgate_e2e::load::review::{self, Report, Review, WebhookProcess};
use std::sync::atomic::{AtomicBool, Ordering};

/// Reviews a second: the `webhook` section's typical rate is 2,000/s on an idle machine;
/// here 1,000 agent processes share the 2 CPUs.
fn rate() -> f64 {
    env_num("MESHGATE_BENCH_AGENTS_REVIEW_RATE", 200).max(1) as f64
}

/// Each load is run in slices this long, so the load during the event ends with it.
const SLICE: Duration = Duration::from_secs(1);
/// The load before the event.
const BEFORE: Duration = Duration::from_secs(5);

/// The webhook and its reviews.
pub(super) struct Hook {
    process: WebhookProcess,
    reviews: Arc<Vec<Review>>,
}

/// The p99s before and during the event.
pub(super) struct Readings {
    pub before: Report,
    pub during: Report,
}

impl Hook {
    /// Starts the webhook among the Nodes present, with a verified Node of its own, named
    /// after `prefix`, for the meshed reviews; `fleet` names the stand-in Nodes.
    pub(super) async fn start(
        cp: &ControlPlane,
        client: &Client,
        prefix: &str,
        fleet: &[String],
    ) -> anyhow::Result<Self> {
        let stable = format!("{prefix}-webhook-verified");
        review::create_namespace(client).await?;
        review::create_node_objects(
            client,
            std::iter::once(review::cloud_node(&stable, true)),
            1,
        )
        .await?;
        let mut process = WebhookProcess::start(cp.admin_kubeconfig_path(), &[])?;
        process.wait_ready(Duration::from_secs(120)).await?;
        let reviews = (0..1000)
            .map(|i| {
                let uid = format!("event-{i}");
                match fleet.get(i % fleet.len().max(1)) {
                    Some(node) if i % 2 == 1 => review::pod_review(&uid, node, false, true),
                    _ => review::pod_review(&uid, &stable, true, true),
                }
            })
            .collect();
        Ok(Self {
            process,
            reviews: Arc::new(reviews),
        })
    }

    fn spec(&self, duration: Duration) -> anyhow::Result<review::Spec> {
        Ok(review::Spec {
            addr: self.process.listen,
            path: "/validate".into(),
            connector: review::tls_connector(&self.process.ca_der)?,
            reviews: self.reviews.clone(),
            rate: rate(),
            duration,
            connections: 8,
        })
    }

    /// The load for [`BEFORE`], then during `event` (slice by slice until it is done).
    pub(super) async fn around<T>(
        &self,
        event: impl Future<Output = anyhow::Result<T>>,
    ) -> anyhow::Result<(T, Readings)> {
        let before = review::run(self.spec(BEFORE)?).await?;
        let done = AtomicBool::new(false);
        let event = async {
            let out = event.await;
            done.store(true, Ordering::Relaxed);
            out
        };
        let load = async {
            let mut during = Report::default();
            while !done.load(Ordering::Relaxed) {
                let slice = review::run(self.spec(SLICE)?).await?;
                during.start = during.start.or(slice.start);
                during.samples.extend(slice.samples);
            }
            anyhow::Ok(during)
        };
        let (out, during) = tokio::join!(event, load);
        let readings = Readings {
            before,
            during: during?,
        };
        for r in [&readings.before, &readings.during] {
            if let Some(e) = r.errors().first() {
                bail!(
                    "{} wrong or failed answers around the event, first: {:?}\n{}",
                    r.errors().len(),
                    e.outcome,
                    self.process.log()
                );
            }
        }
        Ok((out?, readings))
    }
}
