//! Shutdown signal: resolves on the first SIGTERM (kubelet stopping the pod) or SIGINT.

/// Installs the SIGTERM and SIGINT handlers now and returns a future that resolves on the
/// first of them. Installing at call time, not at the first poll, matters: a signal that
/// arrives before the daemon first waits for one must not take the default action (an exit
/// that skips saving the state).
///
/// # Errors
/// When a handler cannot be installed (must be called inside a Tokio runtime).
pub fn signal() -> std::io::Result<impl Future<Output = ()> + Send + 'static> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received, shutting down"),
            _ = int.recv() => tracing::info!("SIGINT received, shutting down"),
        }
    })
}
