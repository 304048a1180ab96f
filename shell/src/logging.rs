//! Logging setup: `tracing` to stderr, filtered by `RUST_LOG` (default `info`).
//!
//! In: the `--log-format` flag. Out: a global subscriber. JSON lines suit log pipelines;
//! text suits people at a terminal.

use tracing_subscriber::EnvFilter;

/// `--log-format` values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Installs the global subscriber. Calling it twice is harmless (the second call is ignored).
pub fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}
