//! The one timer both daemon loops (the verdict loop and the pods loop) wait on beside their
//! streams. In: an optional deadline. Out: a future that resolves at it, or never.

/// Sleeps until `at`, or for ever when there is nothing to wait for.
pub(crate) async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
