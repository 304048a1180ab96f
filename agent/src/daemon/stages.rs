//! Where the time of a pass that changed the taint went, stage by stage.
//!
//! In: instants the verdict loop records as a pass goes (the burst of file events that woke
//! it, the verification and how much of it ran plugin binaries, the reconcile and when the
//! API accepted the taint change). Out: for each pass that added or removed the taint, one
//! `verify stages` log line (durations in µs, and the instants as Unix-epoch µs so a writer on
//! the same host can join them to its own clock) and observations of
//! `meshgate_verify_stage_seconds{stage}`. Nothing here decides anything.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::metrics::AgentMetrics;
use super::node::Applied;

/// The instants of the pass under way; reset by each wake-up.
#[derive(Debug, Default)]
pub(super) struct PassClock {
    /// The first file event of the burst that woke this pass, if files woke it.
    first_event: Option<Instant>,
    /// When the pass began (for a file wake, the end of the coalescing).
    started: Option<Instant>,
    /// The verification: its whole time and the part spent running plugin binaries.
    verify: Option<(Duration, Duration)>,
    /// When the reconcile of the Node began.
    reconcile: Option<Instant>,
}

/// Microseconds, saturated.
fn us(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

impl PassClock {
    /// A wake-up: `first_event` is the burst's first file event when files woke the loop.
    pub(super) fn woke(&mut self, first_event: Option<Instant>) {
        *self = Self {
            first_event,
            ..Self::default()
        };
    }

    /// The pass begins now.
    pub(super) fn pass_started(&mut self) {
        self.started = Some(Instant::now());
        self.verify = None;
        self.reconcile = None;
    }

    /// The verification took `total`, of which `probing` ran plugin binaries.
    pub(super) fn verified(&mut self, total: Duration, probing: Duration) {
        self.verify = Some((total, probing));
    }

    /// The Node's reconcile begins now.
    pub(super) fn reconcile_started(&mut self) {
        self.reconcile = Some(Instant::now());
    }

    /// Logs and records the stages of a pass whose reconcile changed the taint.
    pub(super) fn report(&self, applied: &Applied, metrics: &AgentMetrics) {
        let (Some(tainted), Some(patched), Some(started), Some(reconcile)) = (
            applied.taint,
            applied.taint_at,
            self.started,
            self.reconcile,
        ) else {
            return;
        };
        // Instants as wall-clock µs: one reading of both clocks, so the offsets are exact.
        let (now, wall) = (Instant::now(), SystemTime::now());
        let unix = |t: Instant| {
            wall.checked_sub(now.saturating_duration_since(t))
                .and_then(|w| w.duration_since(UNIX_EPOCH).ok())
                .map_or(0, us)
        };
        let event = self
            .first_event
            .map(|f| started.saturating_duration_since(f));
        let (read, probe) = match self.verify {
            Some((total, probing)) => (Some(total.saturating_sub(probing)), Some(probing)),
            None => (None, None),
        };
        let patch = patched.saturating_duration_since(reconcile);
        // Drift: the files that broke the chain, to the taint the API accepted.
        if let (true, Some(first)) = (tainted, self.first_event) {
            let latency = patched.saturating_duration_since(first);
            metrics.retaint_latency.observe(latency.as_secs_f64());
        }
        for (stage, d) in [
            ("event", event),
            ("read", read),
            ("probe", probe),
            ("patch", Some(patch)),
        ] {
            if let Some(d) = d {
                metrics.stage(stage, d);
            }
        }
        let verified_at = self.verify.map(|(total, _)| started + total);
        tracing::info!(
            tainted,
            first_event_unix_us = self.first_event.map(unix),
            pass_start_unix_us = unix(started),
            patched_unix_us = unix(patched),
            event_us = event.map(us),
            read_us = read.map(us),
            probe_us = probe.map(us),
            between_us = verified_at.map(|v| us(reconcile.saturating_duration_since(v))),
            patch_us = us(patch),
            "verify stages"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::registry::Registry;

    /// Reports a pass that went `clock` and applied a taint change (`tainted`), or nothing
    /// (`None`) too; returns the metrics exposition.
    fn reported(clock: &PassClock, tainted: Option<bool>) -> String {
        let mut registry = Registry::default();
        let metrics = AgentMetrics::register(&mut registry);
        clock.report(&Applied::default(), &metrics);
        if let Some(tainted) = tainted {
            let applied = Applied {
                taint: Some(tainted),
                taint_at: Some(Instant::now()),
                ..Applied::default()
            };
            clock.report(&applied, &metrics);
        }
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        text
    }

    /// A pass that removed the taint is recorded stage by stage; one that changed nothing
    /// (no `taint` in what it applied) records nothing.
    #[test]
    fn a_taint_change_records_each_stage_once() {
        let mut clock = PassClock::default();
        clock.woke(Some(Instant::now()));
        clock.pass_started();
        clock.verified(Duration::from_millis(30), Duration::from_millis(20));
        clock.reconcile_started();
        assert!(!reported(&clock, None).contains("stage="));
        let text = reported(&clock, Some(false));
        for stage in ["event", "read", "probe", "patch"] {
            let count = format!("meshgate_verify_stage_seconds_count{{stage=\"{stage}\"}} 1");
            assert!(text.lines().any(|l| l == count), "{count} in\n{text}");
        }
        let probe = "meshgate_verify_stage_seconds_sum{stage=\"probe\"} 0.02";
        assert!(text.lines().any(|l| l == probe), "{probe} in\n{text}");
    }

    /// Drift: a pass woken by files that added the taint observes the re-taint latency; one
    /// that removed it, or was not woken by files, does not.
    #[test]
    fn only_a_taint_added_after_file_events_is_a_retaint() {
        let mut clock = PassClock::default();
        clock.woke(Some(Instant::now()));
        clock.pass_started();
        clock.reconcile_started();
        let count = |n: u32| format!("meshgate_retaint_latency_seconds_count {n}");
        let text = reported(&clock, Some(true));
        assert!(text.lines().any(|l| l == count(1)), "{text}");
        let text = reported(&clock, Some(false));
        assert!(text.lines().any(|l| l == count(0)), "{text}");
        clock.woke(None);
        clock.pass_started();
        clock.reconcile_started();
        let text = reported(&clock, Some(true));
        assert!(text.lines().any(|l| l == count(0)), "{text}");
    }

    /// A pass not woken by files (a resync, a Node change) has no event stage.
    #[test]
    fn no_event_stage_without_file_events() {
        let mut clock = PassClock::default();
        clock.woke(None);
        clock.pass_started();
        clock.reconcile_started();
        let text = reported(&clock, Some(true));
        let patch = "meshgate_verify_stage_seconds_count{stage=\"patch\"} 1";
        assert!(text.lines().any(|l| l == patch), "{text}");
        assert!(!text.contains("stage=\"event\""), "{text}");
        assert!(!text.contains("stage=\"probe\""), "{text}");
    }
}
