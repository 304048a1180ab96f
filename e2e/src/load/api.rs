//! Open-loop API writes through the real kube-apiserver: what the benchmark of the
//! webhook's added latency (pod CREATE and `pods/binding` with and without meshgate's
//! registration) drives the apiserver with.
//!
//! In: a rate, a number of requests, a bound on requests in flight and a function that sends
//! request `k` (a pod create, a binding) and says whether it was answered right. Out: a
//! [`Report`] of [`crate::load::review`], one sample per request, so the quantiles and the
//! summary read as the webhook load's do. Beside it: binding a pod, deleting a namespace's
//! pods and waiting until they are gone, and the apiserver's `/metrics` text.
//!
//! Open loop, as [`crate::load::review`]: request `k` is due at `start + k / rate` whatever
//! happened to earlier ones, and its latency runs from when it was due, so a stall shows as
//! the queueing it causes (coordinated omission). Each request runs in a task of its own
//! (the client's connection pool spreads them); at most `max_in_flight` run at once, and a
//! request waiting for room still counts its wait. Each request is bounded by `step`.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;

use crate::harness::wait::API_TIMEOUT;
use crate::load::review::{Outcome, Report, Sample, SpecError, gather};

/// Sends `count` requests at `rate` per second, request `k` by `send(k)`, at most
/// `max_in_flight` at once, each bounded by `step`; refuses a rate that is not a usable
/// positive finite number, no requests, or no room in flight.
pub async fn open_loop<F, Fut>(
    rate: f64,
    count: usize,
    max_in_flight: usize,
    step: Duration,
    send: F,
) -> Result<Report, SpecError>
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Result<(), String>> + Send + 'static,
{
    if max_in_flight == 0 {
        return Err(SpecError::NoConnections);
    }
    if count == 0 {
        return Err(SpecError::NoReviews);
    }
    let interval = Duration::try_from_secs_f64(1.0 / rate)
        .ok()
        .filter(|_| rate.is_finite() && rate > 0.0)
        .ok_or(SpecError::InvalidRate(rate))?;
    let room = Arc::new(tokio::sync::Semaphore::new(max_in_flight));
    // A little head start so the first request is due after the loop began.
    let start = Instant::now() + Duration::from_millis(20);
    let mut tasks = Vec::with_capacity(count);
    for k in 0..count {
        let Some(due) = u32::try_from(k)
            .ok()
            .and_then(|k| interval.checked_mul(k))
            .and_then(|d| start.checked_add(d))
        else {
            break;
        };
        if due > Instant::now() {
            tokio::time::sleep_until(due.into()).await;
        }
        let request = send(k);
        let room = room.clone();
        tasks.push(tokio::spawn(async move {
            let permit = room.acquire_owned().await;
            let sent = Instant::now();
            let outcome = match (permit, tokio::time::timeout(step, request).await) {
                (Err(e), _) => Outcome::Failed(e.to_string()),
                (Ok(_), Ok(Ok(()))) => Outcome::Right,
                (Ok(_), Ok(Err(e))) => Outcome::Wrong(e),
                (Ok(_), Err(_)) => Outcome::Failed(format!("timeout: no answer within {step:?}")),
            };
            Some(Sample {
                due,
                sent,
                done: Instant::now(),
                outcome,
                connection: 0,
            })
        }));
    }
    gather(tasks, start).await
}

/// Creates `pod` (unbounded: [`open_loop`] bounds it); an error's text otherwise.
pub async fn create_pod(api: Api<Pod>, pod: Pod) -> Result<(), String> {
    api.create(&PostParams::default(), &pod)
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// Binds pod `name` to `node` through `pods/binding`, as kube-scheduler does (unbounded:
/// [`open_loop`] bounds it).
pub async fn bind(api: Api<Pod>, name: String, node: String) -> Result<(), String> {
    let binding = json!({
        "apiVersion": "v1", "kind": "Binding",
        "metadata": {"name": name},
        "target": {"apiVersion": "v1", "kind": "Node", "name": node},
    });
    api.create_subresource::<_, serde_json::Value>(
        "binding",
        &name,
        &PostParams::default(),
        &binding,
    )
    .await
    .map(|_| ())
    .map_err(|e| e.to_string())
}

/// Deletes every pod of `api`'s namespace at once (grace period 0: no kubelet has to
/// confirm) and waits until none is left, within `timeout`; returns how many were deleted.
pub async fn delete_all_pods(api: &Api<Pod>, timeout: Duration) -> anyhow::Result<usize> {
    let begun = Instant::now();
    let mut deleted = 0;
    loop {
        let left = tokio::time::timeout(API_TIMEOUT, api.list_metadata(&ListParams::default()))
            .await
            .map_err(|_| anyhow::anyhow!("listing pods: no answer within {API_TIMEOUT:?}"))??;
        if left.items.is_empty() {
            return Ok(deleted);
        }
        deleted = deleted.max(left.items.len());
        anyhow::ensure!(
            begun.elapsed() < timeout,
            "{} pods still there after {timeout:?}",
            left.items.len()
        );
        let dp = DeleteParams::default().grace_period(0);
        match tokio::time::timeout(timeout, api.delete_collection(&dp, &ListParams::default()))
            .await
        {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(anyhow::Error::new(e).context("deleting pods")),
            Err(_) => anyhow::bail!("deleting pods: no answer within {timeout:?}"),
        }
    }
}

/// Established TCP connections (IPv4 and IPv6) of this network namespace whose local port is
/// `port`: how many connections a server on that port holds (the apiserver's to a webhook).
/// Read from `/proc/net/tcp{,6}`; a file that cannot be read counts nothing.
pub fn established(port: u16) -> usize {
    let local = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|f| std::fs::read_to_string(f).ok())
        .map(|text| {
            text.lines()
                .skip(1)
                .filter(|l| {
                    let mut fields = l.split_whitespace();
                    let addr = fields.nth(1).unwrap_or_default();
                    // `st` is the fourth field; 01 is ESTABLISHED.
                    addr.ends_with(&local) && fields.nth(1) == Some("01")
                })
                .count()
        })
        .sum()
}

/// The apiserver's `/metrics` text, within [`API_TIMEOUT`].
pub async fn apiserver_metrics(client: &Client) -> anyhow::Result<String> {
    let req = http::Request::get("/metrics").body(Vec::new())?;
    tokio::time::timeout(API_TIMEOUT, client.request_text(req))
        .await
        .map_err(|_| anyhow::anyhow!("apiserver /metrics: no answer within {API_TIMEOUT:?}"))?
        .map_err(|e| anyhow::Error::new(e).context("apiserver /metrics"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn requests_are_due_at_the_rate_and_counted_from_when_they_were_due() {
        // 200/s, 20 requests, one at a time, each taking 12 ms: the server can do only ~83/s,
        // so the queue grows and the last one's latency (from its due time) is far above its
        // service time, as an open loop must show it.
        let report = open_loop(200.0, 20, 1, Duration::from_secs(1), |k| async move {
            tokio::time::sleep(Duration::from_millis(12)).await;
            if k == 3 { Err("no".into()) } else { Ok(()) }
        })
        .await
        .unwrap();
        assert_eq!(report.samples.len(), 20);
        assert_eq!(report.right(), 19);
        let mut dues: Vec<Instant> = report.samples.iter().map(|s| s.due).collect();
        dues.sort();
        assert_eq!(dues[19] - dues[0], Duration::from_millis(95));
        let (lat, svc) = (report.latency(1.0), report.service_times()[18]);
        assert!(svc < Duration::from_millis(40), "service {svc:?}");
        assert!(lat > Duration::from_millis(120), "latency {lat:?}");
    }

    #[tokio::test]
    async fn a_stalled_request_is_a_bounded_failure() {
        let report = open_loop(100.0, 2, 4, Duration::from_millis(50), |_| async {
            std::future::pending::<()>().await;
            Ok(())
        })
        .await
        .unwrap();
        assert_eq!(report.errors().len(), 2);
        assert!(
            report
                .samples
                .iter()
                .all(|s| matches!(&s.outcome, Outcome::Failed(e) if e.contains("timeout")))
        );
    }

    #[tokio::test]
    async fn established_counts_the_connections_a_listener_holds() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        assert_eq!(established(port), 0);
        let mut held = Vec::new();
        for _ in 0..3 {
            let client = tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .unwrap();
            held.push((client, listener.accept().await.unwrap().0));
        }
        assert_eq!(established(port), 3);
        drop(held);
    }

    #[tokio::test]
    async fn unusable_specs_are_refused() {
        let ok = |_| async { Ok(()) };
        for rate in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e-300] {
            assert!(matches!(
                open_loop(rate, 1, 1, API_TIMEOUT, ok).await,
                Err(SpecError::InvalidRate(_))
            ));
        }
        assert!(matches!(
            open_loop(10.0, 0, 1, API_TIMEOUT, ok).await,
            Err(SpecError::NoReviews)
        ));
        assert!(matches!(
            open_loop(10.0, 1, 0, API_TIMEOUT, ok).await,
            Err(SpecError::NoConnections)
        ));
    }
}
