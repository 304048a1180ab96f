//! Bounded waiting: every API call and every "until" loop in the harness and its tests ends.
//!
//! In: a description, a bound, and a future, a probe closure or a command. Out: the value
//! (a command's output, whatever its exit status), or
//! [`Error::Timeout`] naming what was awaited and the last thing seen, so a failing e2e test
//! says why it waited in vain rather than hanging.

use std::fmt::Display;
use std::time::{Duration, Instant};

use crate::Error;

/// Default bound on one harness API call.
pub const API_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs `fut` for at most `timeout`.
pub async fn bounded<T, F>(what: &str, timeout: Duration, fut: F) -> Result<T, Error>
where
    F: Future<Output = Result<T, Error>>,
{
    match tokio::time::timeout(timeout, fut).await {
        Ok(result) => result,
        Err(_) => Err(Error::Timeout {
            what: what.to_owned(),
            timeout,
            last: "no answer".into(),
        }),
    }
}

/// Runs one kube API call for at most [`API_TIMEOUT`], wrapping its error with `what`.
pub async fn api<T, F>(what: &str, fut: F) -> Result<T, Error>
where
    F: Future<Output = Result<T, kube::Error>>,
{
    bounded(what, API_TIMEOUT, async {
        fut.await.map_err(|e| Error::kube(what, e))
    })
    .await
}

/// Runs `cmd` to completion for at most `timeout` (killed if it outlives it) and returns its
/// output, whatever its exit status: the caller decides what a failure means.
pub async fn command_output(
    what: &str,
    timeout: Duration,
    cmd: &mut tokio::process::Command,
) -> Result<std::process::Output, Error> {
    cmd.kill_on_drop(true);
    bounded(what, timeout, async {
        cmd.output()
            .await
            .map_err(|e| Error::io(format!("running {what}"), e))
    })
    .await
}

/// Calls `probe` every 200 ms until it returns `Ok(Some(value))`, for at most `timeout`.
///
/// `Ok(None)` means "not yet"; `Err` is treated as transient (the apiserver may be busy) and
/// remembered for the timeout message. Each probe is itself bounded by the remaining time.
pub async fn poll_until<T, E, F, Fut>(
    what: &str,
    timeout: Duration,
    mut probe: F,
) -> Result<T, Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>, E>>,
    E: Display,
{
    let deadline = Instant::now() + timeout;
    let mut last = String::from("not observed");
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(remaining.max(Duration::from_millis(1)), probe()).await {
            Ok(Ok(Some(value))) => return Ok(value),
            Ok(Ok(None)) => last = "condition not met".into(),
            Ok(Err(e)) => last = e.to_string(),
            // A probe cut off by the deadline says less than the previous answer: keep that.
            Err(_) if Instant::now() >= deadline => {}
            Err(_) => last = "probe timed out".into(),
        }
        if Instant::now() >= deadline {
            return Err(Error::Timeout {
                what: what.to_owned(),
                timeout,
                last,
            });
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn poll_until_returns_the_first_ready_value() {
        let mut n = 0;
        let v = poll_until("n to reach 3", Duration::from_secs(5), || {
            n += 1;
            let n = n;
            async move { Ok::<_, String>((n >= 3).then_some(n)) }
        })
        .await
        .unwrap();
        assert_eq!(v, 3);
    }

    #[tokio::test]
    async fn poll_until_times_out_with_the_last_error() {
        let err = poll_until("never", Duration::from_millis(300), || async {
            Err::<Option<()>, _>("boom")
        })
        .await
        .unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("never") && msg.contains("boom"), "{msg}");
    }

    #[tokio::test]
    async fn bounded_cuts_off_a_slow_future() {
        let err = bounded("sleep", Duration::from_millis(50), async {
            tokio::time::sleep(Duration::from_secs(5)).await;
            Ok::<_, Error>(())
        })
        .await
        .unwrap_err();
        assert!(matches!(err, Error::Timeout { .. }));
    }
}
