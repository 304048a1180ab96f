//! Stage breakdowns of untaint and re-taint: the agent's `verify stages` log lines (one per
//! pass that changed the taint) joined to the transitions the bench wrote and watched.
//!
//! In: [`Transition`]s (the write stamped on the writer's clocks, the Node watch's sighting)
//! and the agent's JSON log lines. Out: one [`Breakdown`] per transition, and rows of the
//! stage table. With one transition in flight at a time, the agent's taint changes follow the
//! transitions one for one, in order.

use super::*;
use serde::Deserialize;

/// Slack for the µs rounding of the agent's wall-clock stamps.
const SLACK_US: i64 = 1_000;

/// One transition as the bench saw it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Transition {
    /// The taint state it ends in.
    pub(super) tainted: bool,
    /// The write, on the wall clock (to join the agent's stamps) and the monotonic one.
    pub(super) wall: SystemTime,
    pub(super) at: Instant,
    /// The Node watch saw the taint change.
    pub(super) seen: Instant,
}

/// Both clocks, read together just before a write.
pub(super) fn stamp() -> (SystemTime, Instant) {
    (SystemTime::now(), Instant::now())
}

/// The agent's `verify stages` line (`agent/src/daemon/stages.rs`).
#[derive(Debug, Deserialize)]
struct Line {
    message: String,
    tainted: bool,
    pass_start_unix_us: i64,
    patched_unix_us: i64,
    read_us: Option<i64>,
    probe_us: Option<i64>,
    patch_us: i64,
}

/// Where one transition's time went, in µs.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Breakdown {
    pub(super) total: i64,
    /// The write → the pass began (inotify wake and coalescing).
    pub(super) event: i64,
    /// Config read and parse (the verification minus its plugin runs).
    pub(super) read: i64,
    /// Plugin VERSION runs (cached answers included).
    pub(super) probe: i64,
    /// The reconcile's start → the API accepted the taint change.
    pub(super) patch: i64,
    /// The API accepted it → the bench's Node watch saw it.
    pub(super) watch: i64,
}

impl Breakdown {
    /// What the stages leave out of the total: the pass's bookkeeping between the
    /// verification and the reconcile, and clock rounding (may be slightly negative).
    pub(super) fn other(&self) -> i64 {
        self.total - (self.event + self.read + self.probe + self.patch + self.watch)
    }
}

fn unix_us(t: SystemTime) -> i64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// The `verify stages` lines among `lines` (JSON, possibly after a CRI log prefix).
fn parse(lines: &str) -> Vec<Line> {
    lines
        .lines()
        .filter_map(|l| l.find('{').map(|i| &l[i..]))
        .filter_map(|l| serde_json::from_str::<Line>(l).ok())
        .filter(|l| l.message == "verify stages")
        .collect()
}

/// How many `verify stages` lines `log` holds.
pub(super) fn count(log: &str) -> usize {
    parse(log).len()
}

/// Reads the agent's log until it holds at least `want` `verify stages` lines (the line of a
/// taint change is written once the PATCH answer is back, which may be after the bench's
/// watch saw the change), for up to 10 s; returns the log as last read.
pub(super) async fn settle(want: usize, read: impl Fn() -> String) -> String {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let log = read();
        if count(&log) >= want || Instant::now() > end {
            return log;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Joins each transition to its `verify stages` line. With one transition in flight at a
/// time, the agent changes the taint once per transition, in order: the lines after the
/// first `skip` (those from before the first write) must match the transitions one for one,
/// and each must answer its PATCH after its write. Errors otherwise: the figures would be
/// someone else's.
pub(super) fn join(
    transitions: &[Transition],
    log: &str,
    skip: usize,
) -> anyhow::Result<Vec<Breakdown>> {
    let lines: Vec<Line> = parse(log).into_iter().skip(skip).collect();
    if lines.len() != transitions.len() {
        bail!(
            "{} transitions but {} taint changes in the agent's `verify stages` lines",
            transitions.len(),
            lines.len()
        );
    }
    transitions
        .iter()
        .zip(&lines)
        .enumerate()
        .map(|(i, (t, l))| {
            let total = i64::try_from((t.seen - t.at).as_micros())?;
            let written = unix_us(t.wall);
            let seen = written + total;
            if l.tainted != t.tainted || l.patched_unix_us < written - SLACK_US {
                bail!(
                    "transition {i} (tainted={}) met a line with tainted={} answered {} µs after its write",
                    t.tainted,
                    l.tainted,
                    l.patched_unix_us - written
                );
            }
            Ok(Breakdown {
                total,
                event: l.pass_start_unix_us - written,
                read: l.read_us.unwrap_or(0),
                probe: l.probe_us.unwrap_or(0),
                patch: l.patch_us,
                // Negative when the watch event reached the bench before the PATCH answer
                // reached the agent: the apiserver sends both once etcd has the write.
                watch: seen - l.patched_unix_us,
            })
        })
        .collect()
}

fn ms(us: i64) -> String {
    format!("{:.1} ms", us as f64 / 1e3)
}

/// Quantile `p` of one stage over the transitions.
fn q(all: &[Breakdown], p: f64, stage: impl Fn(&Breakdown) -> i64) -> i64 {
    let mut v: Vec<i64> = all.iter().map(stage).collect();
    v.sort_unstable();
    if v.is_empty() {
        return 0;
    }
    // The index `quantile` takes, so the total column matches the table's figures.
    let i = ((v.len() - 1) as f64 * p).round() as usize;
    v[i.min(v.len() - 1)]
}

/// Adds the p50 and p99 rows of untaint and of re-taint on `node` to the stage table
/// (`joined` is [`join`]'s answer for `transitions`).
pub(super) fn rows(
    table: &mut Table,
    node: &str,
    transitions: &[Transition],
    joined: &[Breakdown],
) {
    for (what, tainted) in [("untaint", false), ("re-taint", true)] {
        let of: Vec<Breakdown> = joined
            .iter()
            .zip(transitions)
            .filter(|(_, t)| t.tainted == tainted)
            .map(|(b, _)| *b)
            .collect();
        kind_rows(table, what, node, &of);
    }
}

/// The p50 and p99 rows of `what` on `node`, and a note on how well the stages add up.
fn kind_rows(table: &mut Table, what: &str, node: &str, all: &[Breakdown]) {
    for (p, label) in [(0.5, "p50"), (0.99, "p99")] {
        table.stages.push([
            format!("{what}, {label}"),
            node.into(),
            ms(q(all, p, |b| b.total)),
            ms(q(all, p, |b| b.event)),
            ms(q(all, p, |b| b.read)),
            ms(q(all, p, |b| b.probe)),
            ms(q(all, p, |b| b.patch)),
            ms(q(all, p, |b| b.watch)),
            ms(q(all, p, Breakdown::other)),
        ]);
    }
    let worst = all.iter().map(|b| b.other().abs()).max().unwrap_or(0);
    table.note(format!(
        "Stages of {what} on the {node}: {} transitions joined to the agent's `verify stages` lines; per transition the five stages add up to the total within {} (the `other` column: the pass's bookkeeping between verification and reconcile, and clock rounding).",
        all.len(),
        ms(worst)
    ));
}
