//! Shutdown signal: resolves on the first SIGTERM (kubelet stopping the pod) or SIGINT.

/// Waits for SIGTERM or SIGINT. If the handlers cannot be installed, it never resolves, and
/// the process still stops on the default signal action.
pub async fn signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received, shutting down"),
        _ = int.recv() => tracing::info!("SIGINT received, shutting down"),
    }
}
