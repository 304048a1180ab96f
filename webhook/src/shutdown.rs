//! The webhook's stop sequence: keep serving for a grace period, then drain.
//!
//! In: stop requests (SIGTERM/SIGINT, or an embedder's future) on a channel, and the
//! `--shutdown-delay`. Out: a [`Phase`] watch that three readers follow:
//! - the admin `/ready` ([`Readiness`]: 503 from the first request on, so the kubelet's
//!   readiness probe takes the pod out of the Service's endpoints);
//! - the TLS server's responses (`Connection: close` from the first request on, so clients
//!   move their keep-alive connections elsewhere while this replica still answers);
//! - the TLS server's accept loop (the listener closes and the drain starts at
//!   [`Phase::Draining`]).
//!
//! Why a delay at all: the apiserver keeps sending reviews to a terminating replica until the
//! endpoint removal has reached it (EndpointSlice controller, then kube-proxy or the
//! apiserver's own endpoint resolver). A replica that closed its listener on the signal would
//! fail those calls, and with `failurePolicy: Fail` the pod creations behind them.

use std::future::Future;
use std::time::Duration;

use tokio::sync::{mpsc, watch};

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
/// request) starts the drain. A closed channel means "no more requests", never "stop": an
/// embedder that dropped its sender does not cut the delay short.
pub async fn sequence(
    mut requests: mpsc::Receiver<()>,
    delay: Duration,
    phase: watch::Sender<Phase>,
) {
    if requests.recv().await.is_none() {
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
        Some(()) = requests.recv() => {
            tracing::info!("second stop request: ending the shutdown delay early");
        }
    }
    phase.send_replace(Phase::Draining);
}

/// A stop-request channel fed by one future (embedders and tests); no second request ever.
pub fn once(
    stop: impl Future<Output = ()> + Send + 'static,
) -> (mpsc::Receiver<()>, tokio::task::JoinHandle<()>) {
    let (tx, rx) = mpsc::channel(1);
    let task = tokio::spawn(async move {
        stop.await;
        let _ = tx.send(()).await;
        // Keep the sender: a closed channel would read as "no more requests" anyway, but
        // holding it keeps the two cases apart in the logs and in tests.
        std::future::pending::<()>().await;
    });
    (rx, task)
}

/// A stop-request channel fed by every SIGTERM and SIGINT the process receives, from now on.
///
/// Once the drain has started, [`sequence`] has returned and dropped the receiver: a signal
/// then (the third, or the second after a full delay) is not swallowed but ends the process
/// at once with exit code 1, cutting the drain short. Only for the binary: embedders stop
/// through [`once`].
///
/// # Errors
/// When a signal handler cannot be installed: then the kubelet's SIGTERM would kill the
/// process at once, without the delay or the drain, so the webhook refuses to start.
pub fn signals() -> std::io::Result<(mpsc::Receiver<()>, tokio::task::JoinHandle<()>)> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let names = futures::stream::select(
        futures::stream::poll_fn(move |cx| term.poll_recv(cx).map(|s| s.map(|()| "SIGTERM"))),
        futures::stream::poll_fn(move |cx| int.poll_recv(cx).map(|s| s.map(|()| "SIGINT"))),
    );
    let (tx, rx) = mpsc::channel(4);
    let task = tokio::spawn(forward(names, tx, |name| {
        tracing::warn!(
            signal = name,
            "stop signal received while draining: exiting now, requests in flight are cut"
        );
        std::process::exit(meshgate_shell::entry::Exit::Failed as i32)
    }));
    Ok((rx, task))
}

/// Turns each signal of `names` into a stop request on `tx`; the first signal that finds the
/// receiver gone (the drain already started) goes to `gone` instead, and forwarding ends.
async fn forward(
    mut names: impl futures::Stream<Item = &'static str> + Unpin,
    tx: mpsc::Sender<()>,
    gone: impl FnOnce(&'static str),
) {
    use futures::StreamExt as _;
    while let Some(name) = names.next().await {
        tracing::info!(signal = name, "stop signal received");
        if tx.send(()).await.is_err() {
            gone(name);
            return;
        }
    }
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
        let (tx, rx) = mpsc::channel(4);
        let (phase_tx, phase) = phase_channel();
        let seq = tokio::spawn(sequence(rx, Duration::from_millis(400), phase_tx));
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(*phase.borrow(), Phase::Serving, "no request yet");
        tx.send(()).await.unwrap();
        runs_the_whole_delay(&phase).await;
        seq.await.unwrap();
    }

    #[tokio::test]
    async fn a_second_request_ends_the_delay_early() {
        let (tx, rx) = mpsc::channel(4);
        let (phase_tx, phase) = phase_channel();
        let seq = tokio::spawn(sequence(rx, Duration::from_secs(60), phase_tx));
        tx.send(()).await.unwrap();
        reaches(&phase, Phase::Delaying, Duration::from_secs(1)).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(*phase.borrow(), Phase::Delaying);
        tx.send(()).await.unwrap();
        reaches(&phase, Phase::Draining, Duration::from_secs(1)).await;
        seq.await.unwrap();
    }

    #[tokio::test]
    async fn a_closed_channel_neither_stops_nor_cuts_the_delay() {
        let (phase_tx, phase) = phase_channel();
        let (tx, rx) = mpsc::channel(4);
        drop(tx);
        let seq = tokio::spawn(sequence(rx, Duration::from_millis(100), phase_tx));
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(*phase.borrow(), Phase::Serving);
        assert!(!seq.is_finished());
        seq.abort();

        // One request, then the sender is dropped: the channel is closed during the whole
        // delay, and the full delay runs.
        let (phase_tx, phase) = phase_channel();
        let (tx, rx) = mpsc::channel(4);
        tx.send(()).await.unwrap();
        drop(tx);
        let seq = tokio::spawn(sequence(rx, Duration::from_millis(400), phase_tx));
        runs_the_whole_delay(&phase).await;
        seq.await.unwrap();
    }

    /// Signals become stop requests while `sequence` listens; the first one after it returned
    /// (its receiver dropped when the drain started) goes to the exit path, not nowhere.
    #[tokio::test]
    async fn a_signal_after_the_drain_started_takes_the_exit_path() {
        let (names_tx, names) = futures::channel::mpsc::unbounded();
        let (tx, mut rx) = mpsc::channel(4);
        let (gone_tx, mut gone) = tokio::sync::oneshot::channel();
        let fwd = tokio::spawn(forward(names, tx, move |name| {
            let _ = gone_tx.send(name);
        }));
        names_tx.unbounded_send("SIGTERM").unwrap();
        names_tx.unbounded_send("SIGINT").unwrap();
        for _ in 0..2 {
            let got = tokio::time::timeout(Duration::from_secs(1), rx.recv()).await;
            assert_eq!(got, Ok(Some(())), "forwarded as a stop request");
        }
        assert!(gone.try_recv().is_err(), "not while the receiver listens");
        drop(rx);
        names_tx.unbounded_send("SIGTERM").unwrap();
        let exited = tokio::time::timeout(Duration::from_secs(1), gone).await;
        assert_eq!(
            exited,
            Ok(Ok("SIGTERM")),
            "the third signal is not swallowed"
        );
        tokio::time::timeout(Duration::from_secs(1), fwd)
            .await
            .expect("forwarding ends after the exit path")
            .unwrap();
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
