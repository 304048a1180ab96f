//! The cluster-wide eviction budget: at most `evictions` evictions by all agents together in
//! any `window`. Each agent's own rate limit bounds one node; this bounds the fleet, so a mesh
//! upgrade or a bug that makes every pod look un-redirected cannot evict the cluster's meshed
//! workload node by node within minutes.
//!
//! In: the ledger's text (key [`KEY`] of the ConfigMap [`CONFIGMAP`] in meshgate's
//! namespace: the times of the evictions taken, in ms since the Unix epoch, comma-separated;
//! absent or empty when none), the [`Budget`] and the clock. Out: the ledger to write back with
//! one more eviction, or why not ([`Refused`]). Fails safe: a ledger that cannot be read
//! refuses, so nothing is evicted until it is fixed.
//!
//! Pure: the agent reads the ConfigMap and writes the new ledger back with an
//! optimistic-concurrency update, so two agents never both take the last eviction.

use std::fmt;
use std::time::Duration;

/// The ConfigMap, in meshgate's namespace, that holds the ledger.
pub const CONFIGMAP: &str = "meshgate-eviction-budget";
/// Its key.
pub const KEY: &str = "evictions";
/// The largest budget accepted: the ledger keeps one entry per eviction in the window, and a
/// ConfigMap holds at most 1 MiB.
pub const MAX_EVICTIONS: u32 = 10_000;

/// How many evictions all agents together may make in any window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget {
    /// Evictions per window; 0 turns the budget off.
    pub evictions: u32,
    /// The sliding window.
    pub window: Duration,
}

/// A budget over [`MAX_EVICTIONS`], or with an empty window.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "cluster eviction budget {evictions} per {window:?}: use 0 (off) to {MAX_EVICTIONS} per a window of at least 1s"
)]
pub struct InvalidBudget {
    /// The evictions asked for.
    pub evictions: u32,
    /// The window asked for.
    pub window: Duration,
}

impl Budget {
    /// A budget of `evictions` per `window`.
    pub fn new(evictions: u32, window: Duration) -> Result<Self, InvalidBudget> {
        if evictions > MAX_EVICTIONS || (evictions > 0 && window < Duration::from_secs(1)) {
            return Err(InvalidBudget { evictions, window });
        }
        Ok(Self { evictions, window })
    }

    /// True when the budget applies.
    pub fn is_on(&self) -> bool {
        self.evictions > 0
    }
}

/// Why no eviction may be taken now.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// Every eviction of the window is taken.
    #[error("the cluster-wide eviction budget is spent: {taken} evictions in the last {}; the next is free in {}", Human(*.window), Human(*.free_in))]
    Exhausted {
        /// Evictions in the window.
        taken: usize,
        /// The window.
        window: Duration,
        /// When the oldest of them leaves the window.
        free_in: Duration,
    },
    /// The ledger is not a list of times, or is longer than any budget allows.
    #[error(
        "the cluster-wide eviction ledger (ConfigMap {CONFIGMAP}, key {KEY}) is unreadable: {0}"
    )]
    Unreadable(String),
}

/// A duration in whole seconds, for messages.
struct Human(Duration);

impl fmt::Display for Human {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}s", self.0.as_secs_f64().ceil() as u64)
    }
}

/// Takes one eviction at `now_ms` if the window has room: the ledger to write back (the
/// entries still in the window, and this one).
pub fn take(ledger: Option<&str>, budget: Budget, now_ms: u64) -> Result<String, Refused> {
    let window_ms = budget.window.as_millis() as u64;
    let mut kept = parse(ledger.unwrap_or(""))?;
    // An entry from a clock ahead of this one stays until it leaves the window here too:
    // skew only ever makes the budget stricter.
    kept.retain(|t| t.saturating_add(window_ms) > now_ms);
    kept.sort_unstable();
    if kept.len() >= budget.evictions as usize {
        let oldest = kept.first().copied().unwrap_or(now_ms);
        return Err(Refused::Exhausted {
            taken: kept.len(),
            window: budget.window,
            free_in: Duration::from_millis(oldest.saturating_add(window_ms).saturating_sub(now_ms)),
        });
    }
    kept.push(now_ms);
    Ok(kept
        .iter()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join(","))
}

fn parse(text: &str) -> Result<Vec<u64>, Refused> {
    let text = text.trim();
    if text.is_empty() {
        return Ok(Vec::new());
    }
    let entries: Vec<&str> = text.split(',').collect();
    if entries.len() > MAX_EVICTIONS as usize {
        return Err(Refused::Unreadable(format!(
            "{} entries, more than any budget ({MAX_EVICTIONS})",
            entries.len()
        )));
    }
    entries
        .iter()
        .map(|e| {
            e.trim()
                .parse::<u64>()
                .map_err(|_| Refused::Unreadable(format!("{:?} is not a time in ms", truncate(e))))
        })
        .collect()
}

/// At most 32 characters of an entry, for the message.
fn truncate(s: &str) -> String {
    s.chars().take(32).collect()
}

#[cfg(test)]
mod tests;
