//! Logging setup: `tracing` to stderr, filtered by `RUST_LOG` (default `info`).
//!
//! In: the `--log-format` flag. Out: a global subscriber (or, for tests, one that keeps what
//! it prints: [`capture`]). JSON lines suit log pipelines; text suits people at a terminal.
//! The daemons put what a run of lines shares on a span (the agent's node, a verdict pass, a
//! pod; a webhook review), not on each line, so both formats print the spans an event is in
//! with their fields: text as `agent{node=n1}:pass{wake=files}:` before the message, JSON
//! under `span` (the innermost) and `spans` (outermost first).

use std::io::Write;
use std::sync::{Arc, Mutex};

use tracing::Subscriber;
use tracing::subscriber::DefaultGuard;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::util::SubscriberInitExt;

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
    let _ = subscriber(format, filter, std::io::stderr).try_init();
}

/// The subscriber [`init`] installs, writing to `writer`. A JSON line holds the event's own
/// fields at the top level, and the fields of the spans it is in under `span` and `spans`.
fn subscriber<W>(
    format: LogFormat,
    filter: EnvFilter,
    writer: W,
) -> Box<dyn Subscriber + Send + Sync + 'static>
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer);
    match format {
        LogFormat::Text => Box::new(builder.finish()),
        LogFormat::Json => Box::new(
            builder
                .json()
                .flatten_event(true)
                .with_current_span(true)
                .with_span_list(true)
                .finish(),
        ),
    }
}

/// A subscriber's output, kept in memory: see [`capture`].
#[derive(Clone, Default)]
pub struct Captured(Arc<Mutex<Vec<u8>>>);

impl Captured {
    /// Everything printed so far.
    pub fn text(&self) -> String {
        let bytes = self.0.lock().map(|b| b.clone()).unwrap_or_default();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Every line printed so far that is a JSON object (with [`LogFormat::Json`]: all).
    pub fn json_lines(&self) -> Vec<serde_json::Value> {
        self.text()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }
}

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Ok(mut b) = self.0.lock() {
            b.extend_from_slice(buf);
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'w> MakeWriter<'w> for Captured {
    type Writer = Captured;
    fn make_writer(&'w self) -> Self::Writer {
        self.clone()
    }
}

/// What [`init`]'s subscriber of `format` prints, filtered by `directives` (`RUST_LOG`'s
/// syntax), captured on this thread while the guard lives: for tests that check what a
/// component logs (a `#[tokio::test]` runs on one thread, so its tasks log here too).
pub fn capture(format: LogFormat, directives: &str) -> (Captured, DefaultGuard) {
    let out = Captured::default();
    let guard = tracing::subscriber::set_default(subscriber(
        format,
        EnvFilter::new(directives),
        out.clone(),
    ));
    (out, guard)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `format` prints for one event inside an `agent{node}` and a `pass{wake}` span.
    fn printed(format: LogFormat) -> String {
        let (out, _guard) = capture(format, "info");
        let agent = tracing::info_span!("agent", node = "node-a");
        let _agent = agent.enter();
        let pass = tracing::info_span!("pass", wake = "resync");
        let _pass = pass.enter();
        tracing::info!(reason = "Verified", "verdict");
        out.text()
    }

    #[test]
    fn a_json_line_carries_the_fields_of_the_spans_it_is_in() {
        let text = printed(LogFormat::Json);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 1, "{text}");
        let line: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
        assert_eq!(line["message"], "verdict");
        assert_eq!(line["reason"], "Verified");
        assert_eq!(line["span"]["name"], "pass");
        assert_eq!(line["span"]["wake"], "resync");
        assert_eq!(line["spans"][0]["name"], "agent");
        assert_eq!(line["spans"][0]["node"], "node-a");
        assert_eq!(line["spans"][1]["wake"], "resync");
        assert!(line.get("node").is_none(), "the node is the span's: {line}");
    }

    /// `text` without its terminal colours (`ESC [ ... m`).
    fn plain(text: &str) -> String {
        let mut out = String::new();
        let mut chars = text.chars();
        while let Some(c) = chars.next() {
            if c == '\x1b' {
                chars.by_ref().find(|&c| c == 'm');
            } else {
                out.push(c);
            }
        }
        out
    }

    #[test]
    fn a_text_line_names_the_spans_it_is_in() {
        let text = plain(&printed(LogFormat::Text));
        assert!(
            text.contains("agent{node=\"node-a\"}:pass{wake=\"resync\"}"),
            "{text}"
        );
        assert!(text.contains("verdict reason=\"Verified\""), "{text}");
    }
}
