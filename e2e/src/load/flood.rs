//! A closed-loop flood of API requests from one identity, and a one-at-a-time probe of another
//! client's latency beside it: what the API Priority and Fairness test drives the real
//! apiserver with.
//!
//! In: a `kube::Client` (its identity is the flood's or the probe's), a request builder, how
//! many workers loop at once, and a bound on each request. Out: a [`Tally`] of the flood's
//! answers by status (429s apart: the apiserver's "too many requests" is what APF answers when a
//! level's queues are full or a request waited too long), and the probe's latencies with the
//! statuses it saw. Bodies are drained and dropped, never decoded, so the flood costs the test
//! process little CPU beside the apiserver's.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use http_body_util::BodyExt as _;
use kube::Client;

/// Builds one request of a flood or a probe (a fresh one for each send).
pub type MakeRequest = Arc<dyn Fn() -> http::Request<Vec<u8>> + Send + Sync>;

/// A flood's answers.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Tally {
    /// 2xx answers.
    pub ok: u64,
    /// 429 answers (APF's rejections).
    pub throttled: u64,
    /// Any other status, a transport error or no answer within the step.
    pub failed: u64,
}

impl Tally {
    fn add(&mut self, other: Tally) {
        self.ok += other.ok;
        self.throttled += other.throttled;
        self.failed += other.failed;
    }

    fn count(&mut self, answer: &Answer) {
        match answer {
            Answer::Status(s) if (200..300).contains(s) => self.ok += 1,
            Answer::Status(429) => self.throttled += 1,
            _ => self.failed += 1,
        }
    }
}

/// What one request got back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// The HTTP status, the body drained.
    Status(u16),
    /// A transport error, or no answer within the step.
    Failed(String),
}

/// Sends `req` through `client` (its authentication and connection pool), drains the body,
/// and returns the status; bounded by `step`.
pub async fn send(client: &Client, req: http::Request<Vec<u8>>, step: Duration) -> Answer {
    let exchange = async {
        let res = client
            .send(req.map(kube::client::Body::from))
            .await
            .map_err(|e| e.to_string())?;
        let status = res.status().as_u16();
        res.into_body().collect().await.map_err(|e| e.to_string())?;
        Ok::<u16, String>(status)
    };
    match tokio::time::timeout(step, exchange).await {
        Ok(Ok(status)) => Answer::Status(status),
        Ok(Err(e)) => Answer::Failed(e),
        Err(_) => Answer::Failed(format!("no answer within {step:?}")),
    }
}

/// A running flood: `workers` tasks each sending one request after another until
/// [`Flood::stop`].
pub struct Flood {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<Tally>>,
}

impl Flood {
    /// Starts `workers` closed loops of `make()`'s requests through `client`, each bounded by
    /// `step`.
    pub fn start(client: &Client, workers: usize, step: Duration, make: MakeRequest) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = (0..workers)
            .map(|_| {
                let (client, make, stop) = (client.clone(), make.clone(), stop.clone());
                tokio::spawn(async move {
                    let mut tally = Tally::default();
                    while !stop.load(Ordering::Relaxed) {
                        tally.count(&send(&client, make(), step).await);
                    }
                    tally
                })
            })
            .collect();
        Self { stop, tasks }
    }

    /// Stops every worker after its request in flight and adds up their answers.
    pub async fn stop(self) -> Tally {
        self.stop.store(true, Ordering::Relaxed);
        let mut total = Tally::default();
        for task in self.tasks {
            match task.await {
                Ok(t) => total.add(t),
                Err(_) => total.failed += 1,
            }
        }
        total
    }
}

/// A probe's run: each request's latency (ascending) and every answer that was not a 2xx.
#[derive(Debug, Default, Clone)]
pub struct Probe {
    /// Latencies of every request, answered or not, sorted ascending.
    pub latencies: Vec<Duration>,
    /// The answers that were not a 2xx, in order.
    pub errors: Vec<Answer>,
}

impl Probe {
    /// The `p` quantile of the latencies ([`crate::load::stats::quantile`]).
    pub fn quantile(&self, p: f64) -> Duration {
        crate::load::stats::quantile(&self.latencies, p)
    }

    /// How many answers were 429s.
    pub fn throttled(&self) -> usize {
        self.errors
            .iter()
            .filter(|a| **a == Answer::Status(429))
            .count()
    }
}

/// Sends `count` requests of `make(k)` through `client` one after another, `pause` apart, each
/// bounded by `step`, and times each.
pub async fn probe(
    client: &Client,
    count: usize,
    pause: Duration,
    step: Duration,
    make: impl Fn(usize) -> http::Request<Vec<u8>>,
) -> Probe {
    let mut run = Probe::default();
    for k in 0..count {
        let begun = Instant::now();
        let answer = send(client, make(k), step).await;
        run.latencies.push(begun.elapsed());
        if !matches!(answer, Answer::Status(s) if (200..300).contains(&s)) {
            run.errors.push(answer);
        }
        tokio::time::sleep(pause).await;
    }
    run.latencies.sort();
    run
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_tallied_by_status() {
        let mut t = Tally::default();
        for a in [
            Answer::Status(200),
            Answer::Status(201),
            Answer::Status(429),
            Answer::Status(500),
            Answer::Failed("x".into()),
        ] {
            t.count(&a);
        }
        assert_eq!(
            t,
            Tally {
                ok: 2,
                throttled: 1,
                failed: 2
            }
        );
    }
}
