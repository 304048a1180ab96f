//! Stop requests: SIGTERM (the kubelet stopping the pod) and SIGINT, or an embedder's future,
//! read as one sequence.
//!
//! In: the process's signals, whose handlers [`Shutdown::signals`] installs when it is called
//! (not at the first poll: a signal that arrives before the daemon first waits for one must
//! not take the default action, an exit that skips the stop sequence and the state save), or
//! a future ([`Shutdown::on`]), or a channel ([`Shutdown::channel`], for tests). Out:
//! [`Shutdown::next`], each request by name, and [`Shutdown::first`], the first. What a
//! further request means is the daemon's: the agent stops at the first; the webhook's first
//! starts its delay, its second the drain, and one while draining cuts it, which it reports
//! as [`Aborted`] so the process ends through `entry::run` with `Exit::Failed`.

use std::future::Future;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// How [`Shutdown::on`]'s request is named.
pub const STOP_REQUEST: &str = "stop request";

/// The process's stop requests, in the order they came.
#[derive(Debug)]
pub struct Shutdown {
    requests: mpsc::Receiver<&'static str>,
    /// The task that feeds `requests`; aborted with it.
    feeder: Option<JoinHandle<()>>,
}

impl Shutdown {
    /// Every SIGTERM and SIGINT the process receives from now on, named `"SIGTERM"` or
    /// `"SIGINT"`.
    ///
    /// # Errors
    /// When a handler cannot be installed (it must be called inside a Tokio runtime): the
    /// kubelet's SIGTERM would then kill the process at once, so a daemon refuses to start.
    pub fn signals() -> std::io::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        let (tx, requests) = mpsc::channel(4);
        let feeder = tokio::spawn(async move {
            loop {
                let name = tokio::select! {
                    Some(()) = term.recv() => "SIGTERM",
                    Some(()) = int.recv() => "SIGINT",
                    else => return,
                };
                if tx.send(name).await.is_err() {
                    return;
                }
            }
        });
        Ok(Self {
            requests,
            feeder: Some(feeder),
        })
    }

    /// One request ([`STOP_REQUEST`]) when `stop` resolves, and never a second: for
    /// embedders and tests, which must not take over the process's signals.
    pub fn on(stop: impl Future<Output = ()> + Send + 'static) -> Self {
        let (tx, requests) = mpsc::channel(1);
        let feeder = tokio::spawn(async move {
            stop.await;
            let _ = tx.send(STOP_REQUEST).await;
            // Keeps the sender: a closed channel reads as "no more requests", which is true,
            // but holding it keeps "asked once" and "never asked" apart for the reader.
            std::future::pending::<()>().await;
        });
        Self {
            requests,
            feeder: Some(feeder),
        }
    }

    /// Requests sent on the returned sender, named as sent (tests that ask more than once).
    pub fn channel(capacity: usize) -> (mpsc::Sender<&'static str>, Self) {
        let (tx, requests) = mpsc::channel(capacity);
        (
            tx,
            Self {
                requests,
                feeder: None,
            },
        )
    }

    /// The next stop request's name; `None` once no more can come. Cancel-safe.
    pub async fn next(&mut self) -> Option<&'static str> {
        self.requests.recv().await
    }

    /// Resolves on the next request, and logs it; never when no more can come. Cancel-safe.
    pub async fn first(&mut self) {
        match self.next().await {
            Some(name) => tracing::info!("{name} received, shutting down"),
            None => std::future::pending().await,
        }
    }
}

impl Drop for Shutdown {
    fn drop(&mut self) {
        if let Some(feeder) = &self.feeder {
            feeder.abort();
        }
    }
}

/// A stop request came while the daemon was draining: the drain was cut, and the daemon
/// ends with an error (exit code 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{signal} received while draining: requests in flight were cut")]
pub struct Aborted {
    /// The request's name ([`Shutdown::next`]).
    pub signal: &'static str,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_future_is_one_request_and_never_a_second() {
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let mut shutdown = Shutdown::on(async move {
            let _ = rx.await;
        });
        let early = tokio::time::timeout(Duration::from_millis(50), shutdown.next()).await;
        assert!(early.is_err(), "nothing requested yet");
        tx.send(()).unwrap();
        let got = tokio::time::timeout(Duration::from_secs(1), shutdown.next()).await;
        assert_eq!(got, Ok(Some(STOP_REQUEST)));
        let second = tokio::time::timeout(Duration::from_millis(50), shutdown.next()).await;
        assert!(second.is_err(), "no second request, and not closed either");
    }

    #[tokio::test]
    async fn first_waits_for_a_request_and_a_closed_channel_never_stops() {
        let (tx, mut shutdown) = Shutdown::channel(2);
        tx.send("SIGTERM").await.unwrap();
        tokio::time::timeout(Duration::from_secs(1), shutdown.first())
            .await
            .expect("the request resolves it");
        drop(tx);
        let closed = tokio::time::timeout(Duration::from_millis(50), shutdown.first()).await;
        assert!(closed.is_err(), "a closed channel is not a stop request");
        assert_eq!(shutdown.next().await, None);
    }

    /// Installing the handlers is done by the call: a SIGINT sent right after it is a request,
    /// not the default exit, and every later one is one too.
    #[tokio::test]
    async fn signals_are_requests_from_the_call_on() {
        let mut shutdown = Shutdown::signals().unwrap();
        for _ in 0..2 {
            interrupt_self();
            let got = tokio::time::timeout(Duration::from_secs(2), shutdown.next()).await;
            assert_eq!(got, Ok(Some("SIGINT")));
        }
    }

    /// Sends this process a SIGINT, as `kill -INT` would.
    fn interrupt_self() {
        let status = std::process::Command::new("kill")
            .args(["-s", "INT", &std::process::id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    #[test]
    fn aborted_names_the_signal() {
        let e = Aborted { signal: "SIGTERM" };
        assert_eq!(
            e.to_string(),
            "SIGTERM received while draining: requests in flight were cut"
        );
    }
}
