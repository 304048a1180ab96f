//! The webhook's stop sequence: keep serving for a grace period, then drain.
//!
//! In: the process's stop requests (`meshgate_shell::shutdown::Shutdown`: SIGTERM/SIGINT, or
//! an embedder's future) and the `--shutdown-delay`. Out: a [`Phase`] watch that three
//! readers follow:
//! - the admin `/ready` ([`Readiness`]: 503 from the first request on, so the kubelet's
//!   readiness probe takes the pod out of the Service's endpoints);
//! - the TLS server's responses (`Connection: close` from the first request on, so clients
//!   move their keep-alive connections elsewhere while this replica still answers);
//! - the TLS server's accept loop (the listener closes and the drain starts at
//!   [`Phase::Draining`]);
//!
//! and, for a request that comes once the drain has begun, [`Aborted`]: the caller cuts the
//! drain and the process ends with exit code 1 (`meshgate_shell::entry`).
//!
//! Why a delay at all: the apiserver keeps sending reviews to a terminating replica until the
//! endpoint removal has reached it (EndpointSlice controller, then kube-proxy or the
//! apiserver's own endpoint resolver). A replica that closed its listener on the signal would
//! fail those calls, and with `failurePolicy: Fail` the pod creations behind them.

use std::time::Duration;

pub use meshgate_shell::shutdown::Aborted;
use meshgate_shell::shutdown::Shutdown;
use tokio::sync::watch;

/// Where the webhook is in its life: [`Phase::Serving`], [`Phase::Delaying`] (stop requested:
/// not ready, still accepting and answering for `--shutdown-delay`), [`Phase::Draining`]
/// (listener closed; requests in flight finish within `--shutdown-timeout`). The server that
/// follows it is `meshgate_shell::server`, shared with the admin ports.
pub use meshgate_shell::server::Phase;

/// A phase channel starting at [`Phase::Serving`].
pub fn phase_channel() -> (watch::Sender<Phase>, watch::Receiver<Phase>) {
    watch::channel(Phase::Serving)
}

/// Admin readiness: caches synced and no stop requested.
#[derive(Clone, Debug)]
pub struct Readiness {
    synced: watch::Receiver<bool>,
    phase: watch::Receiver<Phase>,
}

impl Readiness {
    /// Ready while `synced` says true and `phase` is still [`Phase::Serving`].
    pub fn new(synced: watch::Receiver<bool>, phase: watch::Receiver<Phase>) -> Self {
        Self { synced, phase }
    }
}

impl meshgate_shell::admin::Readiness for Readiness {
    fn is_ready(&self) -> bool {
        *self.synced.borrow() && *self.phase.borrow() == Phase::Serving
    }
}

/// Drives `phase`: the first stop request starts the delay, the end of the delay (or a second
/// request) starts the drain; returns `shutdown` then. No more requests (the senders gone)
/// means "no more requests", never "stop": an embedder that dropped its sender does not cut
/// the delay short.
pub async fn sequence(
    mut shutdown: Shutdown,
    delay: Duration,
    phase: watch::Sender<Phase>,
) -> Shutdown {
    if next(&mut shutdown).await.is_none() {
        // Never asked to stop.
        std::future::pending::<()>().await;
    }
    phase.send_replace(Phase::Delaying);
    tracing::info!(
        ?delay,
        "stop requested: /ready answers 503; still serving until the shutdown delay ends"
    );
    tokio::select! {
        () = tokio::time::sleep(delay) => {}
        Some(_) = next(&mut shutdown) => {
            tracing::info!("second stop request: ending the shutdown delay early");
        }
    }
    phase.send_replace(Phase::Draining);
    shutdown
}

/// Once the drain has begun: resolves on the next stop request, which cuts it (the third
/// signal, or the second after a full delay); never when no more can come.
pub async fn while_draining(mut shutdown: Shutdown) -> Aborted {
    match next(&mut shutdown).await {
        Some(signal) => {
            tracing::warn!(
                signal,
                "stop signal received while draining: exiting now, requests in flight are cut"
            );
            Aborted { signal }
        }
        None => std::future::pending().await,
    }
}

/// The next stop request, logged as it comes.
async fn next(shutdown: &mut Shutdown) -> Option<&'static str> {
    let signal = shutdown.next().await?;
    tracing::info!(signal, "stop signal received");
    Some(signal)
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshgate_shell::admin::Readiness as _;

    /// Waits up to `within` for `phase` to reach `want`; how long it took.
    async fn reaches(rx: &watch::Receiver<Phase>, want: Phase, within: Duration) -> Duration {
        let begun = std::time::Instant::now();
        let mut waiter = rx.clone();
        let reached = tokio::time::timeout(within, waiter.wait_for(|p| *p == want))
            .await
            .map(|r| r.is_ok());
        assert_eq!(
            reached,
            Ok(true),
            "not {want:?} within {within:?}: {:?}",
            *rx.borrow()
        );
        begun.elapsed()
    }

    /// `phase` goes to Delaying, then stays there for (nearly) the 400 ms delay the tests use.
    async fn runs_the_whole_delay(phase: &watch::Receiver<Phase>) {
        reaches(phase, Phase::Delaying, Duration::from_secs(1)).await;
        let took = reaches(phase, Phase::Draining, Duration::from_secs(5)).await;
        assert!(
            took >= Duration::from_millis(350),
            "delay cut short: {took:?}"
        );
    }

    #[tokio::test]
    async fn the_first_request_delays_then_the_drain_starts() {
        let (tx, rx) = Shutdown::channel(4);
        let (phase_tx, phase) = phase_channel();
        let seq = tokio::spawn(sequence(rx, Duration::from_millis(400), phase_tx));
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(*phase.borrow(), Phase::Serving, "no request yet");
        tx.send("SIGTERM").await.unwrap();
        runs_the_whole_delay(&phase).await;
        let _ = seq.await.unwrap();
    }

    #[tokio::test]
    async fn a_second_request_ends_the_delay_early() {
        let (tx, rx) = Shutdown::channel(4);
        let (phase_tx, phase) = phase_channel();
        let seq = tokio::spawn(sequence(rx, Duration::from_secs(60), phase_tx));
        tx.send("SIGTERM").await.unwrap();
        reaches(&phase, Phase::Delaying, Duration::from_secs(1)).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(*phase.borrow(), Phase::Delaying);
        tx.send("SIGTERM").await.unwrap();
        reaches(&phase, Phase::Draining, Duration::from_secs(1)).await;
        let _ = seq.await.unwrap();
    }

    #[tokio::test]
    async fn a_closed_channel_neither_stops_nor_cuts_the_delay() {
        let (phase_tx, phase) = phase_channel();
        let (tx, rx) = Shutdown::channel(4);
        drop(tx);
        let seq = tokio::spawn(sequence(rx, Duration::from_millis(100), phase_tx));
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(*phase.borrow(), Phase::Serving);
        assert!(!seq.is_finished());
        seq.abort();

        // One request, then the sender is dropped: the channel is closed during the whole
        // delay, and the full delay runs.
        let (phase_tx, phase) = phase_channel();
        let (tx, rx) = Shutdown::channel(4);
        tx.send("SIGTERM").await.unwrap();
        drop(tx);
        let seq = tokio::spawn(sequence(rx, Duration::from_millis(400), phase_tx));
        runs_the_whole_delay(&phase).await;
        let _ = seq.await.unwrap();
    }

    /// Requests go to `sequence` while it runs; once the drain has started, the next one
    /// (the third here) is not swallowed: `while_draining` reports it as `Aborted`.
    #[tokio::test]
    async fn a_request_after_the_drain_started_aborts() {
        let (tx, rx) = Shutdown::channel(4);
        let (phase_tx, phase) = phase_channel();
        let seq = tokio::spawn(sequence(rx, Duration::from_secs(60), phase_tx));
        tx.send("SIGTERM").await.unwrap();
        tx.send("SIGINT").await.unwrap();
        reaches(&phase, Phase::Draining, Duration::from_secs(1)).await;
        let shutdown = seq.await.unwrap();
        let cut = tokio::spawn(while_draining(shutdown));
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!cut.is_finished(), "not before a request");
        tx.send("SIGTERM").await.unwrap();
        let aborted = tokio::time::timeout(Duration::from_secs(1), cut).await;
        assert_eq!(
            aborted.map(Result::ok),
            Ok(Some(Aborted { signal: "SIGTERM" })),
            "the third signal is not swallowed"
        );
        // With no more requests possible, the drain is never cut.
        let (tx, rx) = Shutdown::channel(1);
        drop(tx);
        let never = tokio::time::timeout(Duration::from_millis(100), while_draining(rx)).await;
        assert!(never.is_err());
    }

    #[test]
    fn ready_needs_synced_caches_and_no_stop_request() {
        let (synced_tx, synced) = watch::channel(false);
        let (phase_tx, phase) = phase_channel();
        let r = Readiness::new(synced, phase);
        assert!(!r.is_ready(), "caches not synced");
        synced_tx.send_replace(true);
        assert!(r.is_ready());
        phase_tx.send_replace(Phase::Delaying);
        assert!(!r.is_ready(), "stopping");
        phase_tx.send_replace(Phase::Draining);
        assert!(!r.is_ready(), "draining");
    }
}
