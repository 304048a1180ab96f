//! A fleet-wide event on a [`Fleet`]: every node's conflist rewritten without the mesh plugin
//! at once (a DaemonSet rollout of the primary CNI), then written back.
//!
//! In: the fleet, its audited identity and the two configs. Out: a [`FleetEvent`]: how long
//! until every Node was re-tainted, then re-verified after the write-back, the agents'
//! requests over the event (per second, by kind) and the eviction requests among them.
//!
//! The rewrite is one loop over the fleet's directories, microseconds apart, as a rollout
//! on one host would not be: it is the worst case of a fleet-wide event. The Nodes are
//! listed by the admin (not counted) every [`CHECK_EVERY`] until every one shows the state.

use std::time::{Duration, Instant, SystemTime};

use anyhow::bail;
use kube::Client;

use super::{CONFLIST, Fleet, tally};
use crate::ControlPlane;
use crate::harness::audit::{AuditedIdentity, Request};

/// How often the Nodes are listed while waiting.
const CHECK_EVERY: Duration = Duration::from_millis(200);

/// How long the whole fleet may take for each half.
const EVENT_TIMEOUT: Duration = Duration::from_secs(300);

/// One fleet-wide event.
pub struct FleetEvent {
    /// From the first rewrite until every Node was tainted (label false).
    pub gated_in: Duration,
    /// From the first write-back until every Node was verified again.
    pub verified_in: Duration,
    /// The agents' requests from the first rewrite until `tail` after the last re-verify.
    pub requests: Vec<Request>,
    /// Those per second.
    pub per_second: Vec<usize>,
    /// Eviction requests among them.
    pub evictions: usize,
}

impl FleetEvent {
    /// Breaks every member's chain with `invalid`, waits for every taint, mends it with
    /// `valid`, waits for every untaint, and counts the agents' requests up to `tail` after.
    pub async fn run(
        cp: &ControlPlane,
        client: &Client,
        id: &AuditedIdentity,
        fleet: &Fleet,
        (invalid, valid): (&[u8], &[u8]),
        tail: Duration,
    ) -> anyhow::Result<Self> {
        let n = fleet.members.len();
        let since = SystemTime::now();
        let gated_in = rewrite_and_wait(client, fleet, invalid, Gate::Tainted(n)).await?;
        let verified_in = rewrite_and_wait(client, fleet, valid, Gate::Verified(n)).await?;
        tokio::time::sleep(tail).await;
        let requests = id.requests(cp, since)?;
        let seconds = since.elapsed().unwrap_or_default().as_secs() as usize + 1;
        let per_second = tally::per_second(&requests, since, seconds);
        let evictions = requests
            .iter()
            .filter(|r| r.subresource == "eviction")
            .count();
        Ok(Self {
            gated_in,
            verified_in,
            requests,
            per_second,
            evictions,
        })
    }

    /// The agents' busiest second of the event.
    pub fn peak(&self) -> usize {
        tally::peak(&self.per_second)
    }
}

/// What every Node must show.
#[derive(Clone, Copy, Debug)]
enum Gate {
    Tainted(usize),
    Verified(usize),
}

/// Writes `conf` into every member's config dir, then waits until `want`; how long from the
/// first write.
async fn rewrite_and_wait(
    client: &Client,
    fleet: &Fleet,
    conf: &[u8],
    want: Gate,
) -> anyhow::Result<Duration> {
    let began = Instant::now();
    for m in &fleet.members {
        m.dirs.config(CONFLIST, conf)?;
    }
    loop {
        let (tainted, verified) = fleet.gates(client).await?;
        let (done, have, of) = match want {
            Gate::Tainted(n) => (tainted >= n, tainted, n),
            Gate::Verified(n) => (verified >= n, verified, n),
        };
        if done {
            return Ok(began.elapsed());
        }
        if began.elapsed() > EVENT_TIMEOUT {
            bail!("{want:?}: {have} of {of} Nodes within {EVENT_TIMEOUT:?}");
        }
        tokio::time::sleep(CHECK_EVERY).await;
    }
}
