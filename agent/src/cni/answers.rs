//! The prober's memory: answers by binary, probes in flight, and the slots that bound how
//! many plugins run at once.
//!
//! In: a binary's [`Key`] (its path and what `stat` says of it) and a deadline. Out: a
//! [`Claim`]: the cached answer, the answer of the probe of that same key that was in flight
//! (waited for, up to the deadline, rather than run a second time), or a [`Ticket`] to run it
//! now, holding one of [`MAX_RUNS`] slots. A ticket hands its answer back with
//! [`Ticket::finish`]; dropping it (a panic included) frees the key and the slot for waiters.
//!
//! Strictness: an answer is found only under the exact key it was probed under, so a binary
//! rewritten, replaced or chmod'ed since is probed again.

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Instant;

use meshgate_core::cni::ProbeOutcome;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

/// Plugin binaries running at once, whoever asked (verifications and pre-probes together):
/// each is a process in the agent's cgroup (Go plugins take 10-30 MiB while they run).
pub const MAX_RUNS: usize = 3;
/// Answers kept: far more binaries than a bin dir holds; past it, the oldest-looking is
/// dropped (any one: a dropped answer only costs a probe).
pub const MAX_CACHED: usize = 512;

/// A binary as `stat` saw it: any rewrite, replace or chmod changes it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Key {
    path: PathBuf,
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
    ctime_ns: i128,
    mode: u32,
}

impl Key {
    /// The key of `path` with the metadata `meta` read from it.
    pub fn of(path: &Path, meta: &std::fs::Metadata) -> Self {
        Self {
            path: path.to_path_buf(),
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.len(),
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
            ctime_ns: i128::from(meta.ctime()) * 1_000_000_000 + i128::from(meta.ctime_nsec()),
            mode: meta.mode(),
        }
    }

    /// The key `path` has now (following symlinks, as the lookup does); `None` if it is gone.
    pub fn now(path: &Path) -> Option<Self> {
        std::fs::metadata(path).ok().map(|m| Self::of(path, &m))
    }
}

#[derive(Default)]
struct State {
    cached: HashMap<Key, ProbeOutcome>,
    running: HashSet<Key>,
    runs: usize,
}

/// Cached answers, probes in flight and run slots, shared by every caller of one prober.
#[derive(Default)]
pub struct Answers {
    state: Mutex<State>,
    changed: Condvar,
}

impl std::fmt::Debug for Answers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Answers")
            .field("cached", &self.cached())
            .finish()
    }
}

/// What a caller gets for a key.
pub enum Claim<'a> {
    /// The answer for this very key; `waited` when it came from a probe that was in flight.
    Cached {
        /// The answer.
        outcome: ProbeOutcome,
        /// It was in flight when asked: the caller waited for it instead of running it.
        waited: bool,
    },
    /// The caller runs the binary now.
    Run(Ticket<'a>),
    /// The deadline passed while waiting for the probe in flight or for a run slot.
    Expired,
}

/// The right (and duty) to run one key: it holds the key "in flight" and one run slot.
pub struct Ticket<'a> {
    answers: &'a Answers,
    key: Key,
}

impl Answers {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves plain data behind: keep using it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How many answers are cached.
    pub fn cached(&self) -> usize {
        self.lock().cached.len()
    }

    /// Whether an answer for `key` is cached.
    pub fn has(&self, key: &Key) -> bool {
        self.lock().cached.contains_key(key)
    }

    /// The cached answer for `key`, or the answer of its probe in flight (waited for), or a
    /// ticket to run it once a slot is free; [`Claim::Expired`] at `deadline`.
    pub fn claim(&self, key: &Key, deadline: Instant) -> Claim<'_> {
        let mut state = self.lock();
        let mut waited = false;
        loop {
            if let Some(outcome) = state.cached.get(key) {
                return Claim::Cached {
                    outcome: outcome.clone(),
                    waited,
                };
            }
            let in_flight = state.running.contains(key);
            if !in_flight && state.runs < MAX_RUNS {
                state.running.insert(key.clone());
                state.runs += 1;
                return Claim::Run(Ticket {
                    answers: self,
                    key: key.clone(),
                });
            }
            waited |= in_flight;
            let now = Instant::now();
            if now >= deadline {
                return Claim::Expired;
            }
            state = match self.changed.wait_timeout(state, deadline - now) {
                Ok((s, _)) => s,
                Err(e) => e.into_inner().0,
            };
        }
    }
}

impl Ticket<'_> {
    /// Ends the run; `answer` (when it may be kept) is cached under the ticket's key, and
    /// waiters for that key take it. A waiter finding nothing cached runs the key itself.
    pub fn finish(self, answer: Option<ProbeOutcome>) {
        if let Some(outcome) = answer {
            let mut state = self.answers.lock();
            // Older versions of the same file are dead weight: the cache stays bounded by
            // the number of binaries rather than by their rewrites.
            state.cached.retain(|k, _| k.path != self.key.path);
            if state.cached.len() >= MAX_CACHED
                && let Some(victim) = state.cached.keys().next().cloned()
            {
                state.cached.remove(&victim);
            }
            state.cached.insert(self.key.clone(), outcome);
        }
        // Drop frees the key and the slot.
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        let mut state = self.answers.lock();
        state.running.remove(&self.key);
        state.runs = state.runs.saturating_sub(1);
        drop(state);
        self.answers.changed.notify_all();
    }
}

/// `result` label of the probe counters.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    /// What happened (see docs/operations.md).
    pub result: &'static str,
}

/// What the prober counts; the daemon registers these (unregistered, they just count).
#[derive(Clone, Debug, Default)]
pub struct ProbeCounters {
    /// `meshgate_probe_cache_lookups_total{result}`: at verification, per binary asked about:
    /// `hit` (cached), `inflight` (a probe of that very binary was running: waited for it),
    /// `miss` (run during the verification).
    pub lookups: Family<ResultLabel, Counter>,
    /// `meshgate_preprobes_total{result}`: binaries that appeared or changed in a bin dir:
    /// `ran` (probed ahead), `cached` (already answered), `dropped` (queue full).
    pub preprobes: Family<ResultLabel, Counter>,
}

impl ProbeCounters {
    /// Counts one verification lookup.
    pub fn lookup(&self, result: &'static str) {
        self.lookups.get_or_create(&ResultLabel { result }).inc();
    }

    /// Counts one pre-probe.
    pub fn preprobe(&self, result: &'static str) {
        self.preprobes.get_or_create(&ResultLabel { result }).inc();
    }

    /// The count for `result` in `family` (tests and logs).
    pub fn count(family: &Family<ResultLabel, Counter>, result: &'static str) -> u64 {
        family.get_or_create(&ResultLabel { result }).get()
    }
}

#[cfg(test)]
mod tests;
