//! The Node's condition and Events, written off the taint's path.
//!
//! In: one [`Job`] per reconcile whose taint part is done: the verdict, the mode, the Node as
//! the taint write left it (or as the watch had it) and what that write applied. Out: the
//! condition written and the transition's Event published ([`NodeGate::write_status`]), one
//! job after the other in the order they were sent, and each job's outcome back to the verdict
//! loop ([`StatusWriter::done`]).
//!
//! Why a task of its own: the condition PATCH and the Event each take about as long as the
//! taint PATCH. Written inline, they held the verdict loop, so a config change arriving just
//! after an untaint (a primary CNI rewriting the conflist right after the mesh's installer)
//! waited for them before its re-taint. The taint is still written first; a later pass's taint
//! may now land before an earlier pass's condition, for as long as that write takes.
//!
//! Order and freshness: one job at a time, in order, so Events keep the transitions' order and
//! none is dropped (the queue is bounded: when it is full, the loop waits). A job's Node may
//! predate the condition an earlier job wrote. The agent is its condition's only writer, so
//! the Node the last condition write returned says what the condition is; when it and the
//! job's Node disagree, the Node is read again before planning.

use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use meshgate_core::cni::{ChainVerdict, Reason};
use meshgate_core::gate;
use meshgate_core::mode::Mode;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::node::{Applied, GateError, NodeGate, Seen};

/// Jobs waiting for the writer; the loop waits when this many are queued.
const QUEUE: usize = 16;

/// One reconcile's condition and Event to write.
pub(super) struct Job {
    /// The verdict the taint was written for.
    pub verdict: ChainVerdict,
    /// The mode it was written in.
    pub mode: Mode,
    /// The Node as the taint write left it, or as read for it.
    pub seen: Seen,
    /// What the taint write applied (the untaint latency goes into the Event's note).
    pub applied: Applied,
}

/// A job's outcome: what it applied in all (`condition` and `event` filled in), or why it
/// failed (the loop retries the whole reconcile).
pub(super) struct Done {
    /// The mode of the job.
    pub mode: Mode,
    /// The reason of the job's verdict.
    pub reason: Reason,
    /// The outcome.
    pub result: Result<Applied, GateError>,
}

/// The writer task's handle, held by the verdict loop.
pub(super) struct StatusWriter {
    jobs: Option<mpsc::Sender<Job>>,
    done: mpsc::UnboundedReceiver<Done>,
    task: JoinHandle<()>,
    /// Bounds [`StatusWriter::stop`]: each queued job's calls are bounded by the API timeout.
    stop_within: Duration,
}

impl StatusWriter {
    /// Starts the writer on `gate`; each API call is bounded by `api_timeout`.
    pub(super) fn start(gate: NodeGate, api_timeout: Duration) -> Self {
        let (jobs, rx) = mpsc::channel(QUEUE);
        let (done_tx, done) = mpsc::unbounded_channel();
        let task = tokio::spawn(run(gate, rx, done_tx));
        // A job makes at most a GET, the condition PATCH (with the GET its planning may need)
        // and the Event.
        let stop_within = api_timeout.saturating_mul(4 * (QUEUE as u32 + 1));
        Self {
            jobs: Some(jobs),
            done,
            task,
            stop_within,
        }
    }

    /// Queues `job`, waiting while the queue is full. `Err(job)` if the writer is gone.
    pub(super) async fn send(&self, job: Job) -> Result<(), Job> {
        match &self.jobs {
            Some(tx) => tx.send(job).await.map_err(|e| e.0),
            None => Err(job),
        }
    }

    /// The next job's outcome. Pending for ever once the writer is gone.
    pub(super) async fn done(&mut self) -> Done {
        match self.done.recv().await {
            Some(d) => d,
            None => std::future::pending().await,
        }
    }

    /// Writes what is queued, then ends the writer (bounded: see `stop_within`).
    pub(super) async fn stop(mut self) {
        self.jobs = None;
        if tokio::time::timeout(self.stop_within, &mut self.task)
            .await
            .is_err()
        {
            tracing::warn!("the Node's condition writer did not finish in time; stopped");
            self.task.abort();
        }
    }
}

/// The writer: jobs in order until the loop drops its sender.
async fn run(gate: NodeGate, mut jobs: mpsc::Receiver<Job>, done: mpsc::UnboundedSender<Done>) {
    // The Node as the last condition write (or fresh read) left it.
    let mut last: Option<Node> = None;
    while let Some(job) = jobs.recv().await {
        let (mode, reason) = (job.mode, job.verdict.reason);
        let result = write(&gate, job, &mut last).await;
        if done
            .send(Done {
                mode,
                reason,
                result,
            })
            .is_err()
        {
            break;
        }
    }
}

/// Writes one job's condition and Event, planning from the freshest Node it knows.
async fn write(gate: &NodeGate, job: Job, last: &mut Option<Node>) -> Result<Applied, GateError> {
    let Job {
        verdict,
        mode,
        mut seen,
        mut applied,
    } = job;
    let disagree = last
        .as_ref()
        .is_some_and(|l| gate::condition_of(l) != gate::condition_of(&seen.node));
    if disagree {
        seen = Seen {
            node: gate.get().await?,
            fresh: true,
        };
    }
    let fresh = seen.fresh.then(|| seen.node.clone());
    match gate
        .write_status(seen, &verdict, mode, &mut applied)
        .await?
    {
        Some(written) => *last = Some(written),
        None => {
            if let Some(node) = fresh {
                *last = Some(node);
            }
        }
    }
    Ok(applied)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::node::tests::requests::{body_json, gate_for_n1, node, respond};
    use crate::daemon::node::tests::verdict;
    use http::{Method, Request, Response};
    use k8s_openapi::jiff::Timestamp;
    use kube::client::Body;
    use meshgate_core::event_reason;
    use serde_json::{Value, json};
    use std::pin::pin;
    use tower_test::mock;

    /// Node `n1` at `rv` whose meshgate condition is `condition`.
    fn with_condition(rv: &str, condition: &k8s_openapi::api::core::v1::NodeCondition) -> Value {
        let mut n = node(rv, json!([]));
        n["status"] = json!({"conditions": [condition]});
        n
    }

    /// Answers the condition PATCH and the Event of one job; returns the condition's status.
    async fn answer_status(
        handle: &mut std::pin::Pin<&mut mock::Handle<Request<Body>, Response<Body>>>,
        answer: &Value,
    ) -> Value {
        let (req, send) = handle.next_request().await.unwrap();
        assert_eq!(req.uri().path(), "/api/v1/nodes/n1/status");
        let status = body_json(req).await["status"]["conditions"][0]["status"].clone();
        send.send_response(respond(200, answer));
        let (req, send) = handle.next_request().await.unwrap();
        assert_eq!(req.method(), Method::POST);
        let ev = body_json(req).await;
        send.send_response(respond(201, &ev));
        status
    }

    /// A job whose Node predates the condition an earlier job wrote must not plan from it: the
    /// node flapped Unverified → Verified → Unverified, and the second job's Node (read before
    /// the first job's condition write) still says Unverified. Planned from it, the flap back
    /// would write nothing and leave the condition saying Verified.
    #[tokio::test]
    async fn a_job_older_than_the_last_condition_write_reads_the_node_again() {
        let unverified = verdict(Reason::ChainedPluginMissing, "no linkerd-cni");
        let verified = verdict(Reason::Verified, "chained");
        let c0 = gate::plan_condition(None, &unverified, Timestamp::now()).unwrap();
        let c1 = gate::plan_condition(Some(&c0), &verified, Timestamp::now()).unwrap();
        let stale: Node = serde_json::from_value(with_condition("1", &c0)).unwrap();
        let (svc, handle) = mock::pair::<Request<Body>, Response<Body>>();
        let server = tokio::spawn({
            let (after_first, c1) = (with_condition("2", &c1), c1.clone());
            async move {
                let mut handle = pin!(handle);
                // Job 1: Verified, written from its Node.
                assert_eq!(answer_status(&mut handle, &after_first).await, "True");
                // Job 2: its Node disagrees with what job 1 wrote: read again, then written.
                let (req, send) = handle.next_request().await.unwrap();
                assert_eq!(req.method(), Method::GET);
                send.send_response(respond(200, &with_condition("2", &c1)));
                assert_eq!(
                    answer_status(&mut handle, &node("3", json!([]))).await,
                    "False"
                );
            }
        });
        let mut writer = StatusWriter::start(gate_for_n1(svc, None), Duration::from_secs(5));
        for verdict in [verified, unverified] {
            let seen = Seen {
                node: stale.clone(),
                fresh: true,
            };
            let (mode, applied) = (Mode::Enforce, Applied::default());
            let job = Job {
                verdict,
                mode,
                seen,
                applied,
            };
            assert!(writer.send(job).await.is_ok());
        }
        let events: Vec<_> = [writer.done().await, writer.done().await]
            .into_iter()
            .map(|d| d.result.expect("written").event)
            .collect();
        assert_eq!(
            events,
            [
                Some(event_reason::CHAIN_VERIFIED),
                Some(event_reason::CHAIN_UNVERIFIED)
            ]
        );
        server.await.unwrap();
        writer.stop().await;
    }
}
