//! Which inspected pods to evict: the safety rules around the Eviction API.
//!
//! In: one pod's inspection [`RedirectVerdict`], whether it runs its mesh's proxy container, whether
//! it has a controlling owner, its identity
//! ([`SandboxKey`]: pod UID + sandbox identity), the [`History`] of sandboxes already evicted,
//! the node's [`RateLimiter`], the operator's [`Flags`] and the current time (a monotonic
//! reading passed in, so tests control the clock). Out: a [`Decision`]: evict, nothing to do,
//! or skip with a [`SkipWhy`] that maps onto the contract's `meshgate_evictions_skipped_total`
//! label where one exists.
//!
//! The order of the checks is the order of their importance: never act on `unknown`, never
//! evict a pod that runs no proxy of its mesh (it is not the mesh's: its label was copied or
//! its injection skipped, and a recreated pod would be the same), never evict the same
//! sandbox twice, respect ownership, then the operator's report-only flags and the live
//! [`Mode`] (`report` evicts nothing: it says "would evict"), and only then spend a
//! rate-limit token. A PodDisruptionBudget refusal (HTTP 429) is only
//! known after the API call; the caller then [`RateLimiter::refund`]s the token and reports
//! [`SkipWhy::Pdb`].

use std::collections::{BTreeSet, VecDeque};
use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::mode::Mode;
use crate::rules::RedirectVerdict;

/// Default `--max-evictions-per-minute`.
pub const DEFAULT_MAX_PER_MINUTE: u32 = 10;

/// The rate limiter's window.
pub const WINDOW: Duration = Duration::from_secs(60);

/// One pod sandbox: a pod recreated by its controller gets a new UID, and a pod whose sandbox
/// was recreated in place (new IP, restart) gets a new `sandbox` string, so each is inspected
/// (and possibly evicted) once.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct SandboxKey {
    /// `metadata.uid`.
    pub pod_uid: String,
    /// Caller-defined sandbox identity, e.g. the pod IPs and sandbox restart marker.
    pub sandbox: String,
}

/// Sandboxes already evicted. Serializable, so it lives in the agent's state file and a
/// restart does not evict again.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct History {
    evicted: BTreeSet<SandboxKey>,
}

impl History {
    /// True when this sandbox was already evicted.
    pub fn contains(&self, key: &SandboxKey) -> bool {
        self.evicted.contains(key)
    }

    /// Records a successful eviction.
    pub fn record(&mut self, key: SandboxKey) {
        self.evicted.insert(key);
    }

    /// Forgets pods that no longer exist, so the history stays bounded.
    pub fn retain_pods(&mut self, live_pod_uids: &BTreeSet<String>) {
        self.evicted.retain(|k| live_pod_uids.contains(&k.pod_uid));
    }

    /// Number of remembered sandboxes.
    pub fn len(&self) -> usize {
        self.evicted.len()
    }

    /// True when nothing was evicted.
    pub fn is_empty(&self) -> bool {
        self.evicted.is_empty()
    }
}

/// Per-node sliding-window limiter: at most `per_minute` evictions in any 60 s window.
/// `now` is any monotonic clock reading (time since an arbitrary origin).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RateLimiter {
    per_minute: u32,
    recent: VecDeque<Duration>,
}

impl RateLimiter {
    /// A limiter allowing `per_minute` evictions per window; 0 allows none.
    pub fn new(per_minute: u32) -> Self {
        Self {
            per_minute,
            recent: VecDeque::new(),
        }
    }

    fn expire(&mut self, now: Duration) {
        while let Some(&t) = self.recent.front() {
            if now.saturating_sub(t) >= WINDOW {
                self.recent.pop_front();
            } else {
                break;
            }
        }
    }

    /// Takes a token if one is free at `now`.
    pub fn try_acquire(&mut self, now: Duration) -> bool {
        self.expire(now);
        if self.recent.len() < self.per_minute as usize {
            self.recent.push_back(now);
            true
        } else {
            false
        }
    }

    /// Gives back the token taken at `taken_at` (the eviction was refused, e.g. by a PDB).
    pub fn refund(&mut self, taken_at: Duration) {
        if let Some(i) = self.recent.iter().rposition(|&t| t == taken_at) {
            self.recent.remove(i);
        }
    }

    /// When the next token frees up, if none is free at `now`: for the caller's requeue.
    pub fn next_free(&mut self, now: Duration) -> Option<Duration> {
        self.expire(now);
        if self.recent.len() < self.per_minute as usize {
            return None;
        }
        // With per_minute == 0 no token ever frees up; report a full window.
        Some(self.recent.front().map_or(now + WINDOW, |&t| t + WINDOW))
    }
}

impl Default for RateLimiter {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_PER_MINUTE)
    }
}

/// The operator's flags.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Flags {
    /// `--dry-run`: decide and report, never call the Eviction API.
    pub dry_run: bool,
    /// `--no-evict`: report only.
    pub no_evict: bool,
    /// `--evict-unowned`: also evict pods without a controlling owner.
    pub evict_unowned: bool,
    /// The live mode (ConfigMap `meshgate-mode`): one that may not evict
    /// ([`Mode::may_evict`]) reports what enforce would have done.
    pub mode: Mode,
}

/// Why a pod with missing redirects was not evicted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SkipWhy {
    /// A PodDisruptionBudget forbids it now (set by the caller after a 429).
    Pdb,
    /// The node's eviction rate limit is exhausted.
    RateLimit,
    /// `--dry-run`.
    DryRun,
    /// No controlling owner would recreate the pod, and `--evict-unowned` is off.
    Unowned,
    /// `--no-evict`.
    NoEvict,
    /// This sandbox was evicted before (the eviction is still in progress or was undone).
    AlreadyEvicted,
    /// The verdict is `unknown`: never evict on uncertainty.
    Unknown,
    /// The pod carries the mesh's label but runs none of its proxy containers: not the
    /// mesh's to evict. Reported once per sandbox, never retried.
    NoProxy,
    /// The missing part is the node proxy's listeners, and the node proxy is not ready on
    /// the node (a restart closes them in every pod at once): reported, never evicted; the
    /// pod is inspected again when the node's verdict changes.
    NodeProxyNotReady,
    /// The mode is `report`: enforce would evict it now (counted in
    /// `meshgate_report_only_actions_total{action="evict"}`, not as a skip).
    Report,
    /// The cluster-wide eviction budget ([`crate::cluster_budget`]) is spent, or its ledger
    /// could not be read or written (set by the caller, after the node's own decision).
    ClusterBudget,
}

impl SkipWhy {
    /// The `why` label of `meshgate_evictions_skipped_total`, for the reasons the contract
    /// counts there; `None` for the others.
    pub fn metric_label(self) -> Option<&'static str> {
        match self {
            SkipWhy::Pdb => Some("pdb"),
            SkipWhy::RateLimit => Some("rate_limit"),
            SkipWhy::DryRun => Some("dry_run"),
            SkipWhy::Unowned => Some("unowned"),
            // Not in the contract's list: recorded as drift in docs/architecture.md.
            SkipWhy::NoProxy => Some("no_proxy"),
            SkipWhy::NodeProxyNotReady => Some("node_proxy_not_ready"),
            SkipWhy::ClusterBudget => Some("cluster_budget"),
            SkipWhy::NoEvict | SkipWhy::AlreadyEvicted | SkipWhy::Unknown | SkipWhy::Report => None,
        }
    }

    /// Short text for Event notes and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            SkipWhy::Pdb => "blocked by a PodDisruptionBudget",
            SkipWhy::RateLimit => "rate limited",
            SkipWhy::DryRun => "dry-run",
            SkipWhy::Unowned => "skipped: no controlling owner",
            SkipWhy::NoEvict => "report only (--no-evict)",
            SkipWhy::AlreadyEvicted => "already evicted",
            SkipWhy::Unknown => "verdict unknown",
            SkipWhy::NoProxy => "skipped: no proxy container of its mesh",
            SkipWhy::NodeProxyNotReady => "not evicted while the node proxy is not ready",
            SkipWhy::Report => "report mode: would evict",
            SkipWhy::ClusterBudget => "deferred by the cluster-wide eviction budget",
        }
    }
}

impl fmt::Display for SkipWhy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What to do with one inspected pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// The redirects are in place.
    NotNeeded,
    /// Call the Eviction API now; a rate-limit token was taken at the given time.
    Evict {
        /// Pass to [`RateLimiter::refund`] if the API refuses.
        token: Duration,
    },
    /// Redirects are missing (or unknown) but the pod stays.
    Skip(SkipWhy),
}

/// The facts about one pod that the decision needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate<'a> {
    /// The inspection verdict.
    pub verdict: RedirectVerdict,
    /// True when the pod runs its mesh's proxy container (or the mesh has none):
    /// [`crate::profile::MeshProfile::proxy_present`].
    pub has_proxy: bool,
    /// True when an ownerReference has `controller: true`.
    pub owned: bool,
    /// True when what is missing is the node proxy's listeners while the node proxy is not
    /// ready ([`crate::node_proxy::pod::judge`]): never evicted.
    pub node_proxy_hold: bool,
    /// Pod UID + sandbox identity.
    pub key: &'a SandboxKey,
}

/// Decides for one pod. Takes a rate-limit token only when the answer is [`Decision::Evict`].
pub fn decide(
    pod: &Candidate<'_>,
    history: &History,
    limiter: &mut RateLimiter,
    flags: Flags,
    now: Duration,
) -> Decision {
    match pod.verdict {
        RedirectVerdict::Redirected => return Decision::NotNeeded,
        RedirectVerdict::Unknown => return Decision::Skip(SkipWhy::Unknown),
        RedirectVerdict::Missing => {}
    }
    if !pod.has_proxy {
        return Decision::Skip(SkipWhy::NoProxy);
    }
    if pod.node_proxy_hold {
        return Decision::Skip(SkipWhy::NodeProxyNotReady);
    }
    if history.contains(pod.key) {
        return Decision::Skip(SkipWhy::AlreadyEvicted);
    }
    if !pod.owned && !flags.evict_unowned {
        return Decision::Skip(SkipWhy::Unowned);
    }
    if flags.no_evict {
        return Decision::Skip(SkipWhy::NoEvict);
    }
    if flags.dry_run {
        return Decision::Skip(SkipWhy::DryRun);
    }
    if !flags.mode.may_evict() {
        return Decision::Skip(SkipWhy::Report);
    }
    if limiter.try_acquire(now) {
        Decision::Evict { token: now }
    } else {
        Decision::Skip(SkipWhy::RateLimit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(uid: &str, sandbox: &str) -> SandboxKey {
        SandboxKey {
            pod_uid: uid.into(),
            sandbox: sandbox.into(),
        }
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    fn missing(k: &SandboxKey, owned: bool) -> Candidate<'_> {
        Candidate {
            verdict: RedirectVerdict::Missing,
            has_proxy: true,
            owned,
            node_proxy_hold: false,
            key: k,
        }
    }

    #[test]
    fn only_missing_verdicts_evict() {
        let k = key("u1", "10.0.0.1");
        let mut lim = RateLimiter::default();
        let h = History::default();
        let f = Flags::default();
        for (verdict, want) in [
            (RedirectVerdict::Redirected, Decision::NotNeeded),
            (RedirectVerdict::Unknown, Decision::Skip(SkipWhy::Unknown)),
            (RedirectVerdict::Missing, Decision::Evict { token: secs(5) }),
        ] {
            let c = Candidate {
                verdict,
                has_proxy: true,
                owned: true,
                node_proxy_hold: false,
                key: &k,
            };
            assert_eq!(decide(&c, &h, &mut lim, f, secs(5)), want, "{verdict:?}");
        }
        // Unknown never evicts, whatever the flags.
        let c = Candidate {
            verdict: RedirectVerdict::Unknown,
            has_proxy: true,
            owned: false,
            node_proxy_hold: false,
            key: &k,
        };
        let all = Flags {
            evict_unowned: true,
            ..Flags::default()
        };
        assert_eq!(
            decide(&c, &h, &mut lim, all, secs(5)),
            Decision::Skip(SkipWhy::Unknown)
        );
    }

    #[test]
    fn never_twice_for_the_same_sandbox() {
        let k = key("u1", "10.0.0.1");
        let mut h = History::default();
        h.record(k.clone());
        let mut lim = RateLimiter::default();
        assert_eq!(
            decide(&missing(&k, true), &h, &mut lim, Flags::default(), secs(1)),
            Decision::Skip(SkipWhy::AlreadyEvicted)
        );
        // A new sandbox of the same pod, or a recreated pod, is a new candidate.
        let k2 = key("u1", "10.0.0.2");
        assert!(matches!(
            decide(&missing(&k2, true), &h, &mut lim, Flags::default(), secs(1)),
            Decision::Evict { .. }
        ));
        // The history survives a round trip through the state file.
        let text = serde_json::to_string(&h).expect("ser");
        let back: History = serde_json::from_str(&text).expect("de");
        assert!(back.contains(&k));
    }

    #[test]
    fn unowned_needs_opt_in_and_flags_report_only() {
        let k = key("u1", "s");
        let h = History::default();
        let mut lim = RateLimiter::default();
        assert_eq!(
            decide(&missing(&k, false), &h, &mut lim, Flags::default(), secs(0)),
            Decision::Skip(SkipWhy::Unowned)
        );
        let opt_in = Flags {
            evict_unowned: true,
            ..Flags::default()
        };
        assert!(matches!(
            decide(&missing(&k, false), &h, &mut lim, opt_in, secs(0)),
            Decision::Evict { .. }
        ));
        let dry = Flags {
            dry_run: true,
            ..Flags::default()
        };
        let mut fresh = RateLimiter::new(1);
        assert_eq!(
            decide(&missing(&k, true), &h, &mut fresh, dry, secs(0)),
            Decision::Skip(SkipWhy::DryRun)
        );
        let no = Flags {
            no_evict: true,
            dry_run: true,
            ..Flags::default()
        };
        assert_eq!(
            decide(&missing(&k, true), &h, &mut fresh, no, secs(0)),
            Decision::Skip(SkipWhy::NoEvict)
        );
        // Report-only decisions spent no token.
        assert!(fresh.try_acquire(secs(0)));
    }

    #[test]
    fn report_mode_never_evicts_and_the_other_modes_do() {
        let k = key("u1", "s");
        let h = History::default();
        for mode in Mode::ALL {
            let mut lim = RateLimiter::new(1);
            let flags = Flags {
                mode,
                ..Flags::default()
            };
            let got = decide(&missing(&k, true), &h, &mut lim, flags, secs(0));
            if mode == Mode::Report {
                assert_eq!(got, Decision::Skip(SkipWhy::Report));
                assert!(lim.try_acquire(secs(0)), "report mode spent no token");
            } else {
                assert_eq!(got, Decision::Evict { token: secs(0) }, "{mode}");
            }
        }
        // What enforce would not do either is not reported as "would evict".
        let unowned = Flags {
            mode: Mode::Report,
            ..Flags::default()
        };
        assert_eq!(
            decide(
                &missing(&k, false),
                &h,
                &mut RateLimiter::new(1),
                unowned,
                secs(0)
            ),
            Decision::Skip(SkipWhy::Unowned)
        );
        assert_eq!(SkipWhy::Report.metric_label(), None);
    }

    #[test]
    fn rate_limit_is_a_sliding_minute() {
        let h = History::default();
        let mut lim = RateLimiter::default();
        let keys: Vec<SandboxKey> = (0..12).map(|i| key(&format!("u{i}"), "s")).collect();
        let mut evicted = 0;
        for (i, k) in keys.iter().enumerate() {
            match decide(
                &missing(k, true),
                &h,
                &mut lim,
                Flags::default(),
                secs(i as u64),
            ) {
                Decision::Evict { .. } => evicted += 1,
                Decision::Skip(SkipWhy::RateLimit) => {}
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(evicted, DEFAULT_MAX_PER_MINUTE);
        // The first token (taken at 0 s) frees up at 60 s, not before.
        assert_eq!(lim.next_free(secs(59)), Some(secs(60)));
        assert!(!lim.try_acquire(secs(59)));
        assert!(lim.try_acquire(secs(60)));
        assert!(!lim.try_acquire(secs(60)));
    }

    #[test]
    fn refund_returns_a_token_after_a_pdb_refusal() {
        let h = History::default();
        let mut lim = RateLimiter::new(1);
        let k = key("u", "s");
        let Decision::Evict { token } =
            decide(&missing(&k, true), &h, &mut lim, Flags::default(), secs(3))
        else {
            panic!("expected an eviction");
        };
        assert_eq!(
            decide(&missing(&k, true), &h, &mut lim, Flags::default(), secs(4)),
            Decision::Skip(SkipWhy::RateLimit)
        );
        lim.refund(token);
        assert!(matches!(
            decide(&missing(&k, true), &h, &mut lim, Flags::default(), secs(4)),
            Decision::Evict { .. }
        ));
    }

    #[test]
    fn zero_per_minute_never_evicts() {
        let mut lim = RateLimiter::new(0);
        assert!(!lim.try_acquire(secs(0)));
        assert_eq!(lim.next_free(secs(0)), Some(secs(60)));
    }

    #[test]
    fn metric_labels_follow_the_contract() {
        let labels: Vec<_> = [
            SkipWhy::Pdb,
            SkipWhy::RateLimit,
            SkipWhy::DryRun,
            SkipWhy::Unowned,
            SkipWhy::NoEvict,
            SkipWhy::AlreadyEvicted,
            SkipWhy::Unknown,
            SkipWhy::NoProxy,
        ]
        .iter()
        .filter_map(|w| w.metric_label())
        .collect();
        assert_eq!(
            labels,
            ["pdb", "rate_limit", "dry_run", "unowned", "no_proxy"]
        );
    }

    #[test]
    fn a_pod_without_its_proxy_is_never_evicted_whatever_the_flags() {
        let k = key("u1", "10.0.0.1#0");
        let h = History::default();
        let mut lim = RateLimiter::new(1);
        let everything = Flags {
            evict_unowned: true,
            ..Flags::default()
        };
        for owned in [true, false] {
            let c = Candidate {
                verdict: RedirectVerdict::Missing,
                has_proxy: false,
                owned,
                node_proxy_hold: false,
                key: &k,
            };
            assert_eq!(
                decide(&c, &h, &mut lim, everything, secs(0)),
                Decision::Skip(SkipWhy::NoProxy)
            );
        }
        // No token was spent on it.
        assert!(lim.try_acquire(secs(0)));
        // Its redirects in place: nothing to report either way.
        let c = Candidate {
            verdict: RedirectVerdict::Redirected,
            has_proxy: false,
            owned: true,
            node_proxy_hold: false,
            key: &k,
        };
        assert_eq!(
            decide(&c, &h, &mut lim, everything, secs(0)),
            Decision::NotNeeded
        );
    }

    #[test]
    fn history_forgets_gone_pods() {
        let mut h = History::default();
        h.record(key("a", "1"));
        h.record(key("b", "1"));
        h.retain_pods(&["b".to_string()].into_iter().collect());
        assert_eq!(h.len(), 1);
        assert!(h.contains(&key("b", "1")));
    }

    /// Listeners of a node proxy that is not ready: reported, never evicted, whatever the
    /// flags, and without taking a rate-limit token.
    #[test]
    fn missing_listeners_while_the_node_proxy_is_not_ready_never_evict() {
        let k = SandboxKey {
            pod_uid: "u".into(),
            sandbox: "s".into(),
        };
        let h = History::default();
        let mut lim = RateLimiter::new(1);
        let c = Candidate {
            verdict: RedirectVerdict::Missing,
            has_proxy: true,
            owned: true,
            node_proxy_hold: true,
            key: &k,
        };
        assert_eq!(
            decide(&c, &h, &mut lim, Flags::default(), Duration::ZERO),
            Decision::Skip(SkipWhy::NodeProxyNotReady)
        );
        let released = Candidate {
            node_proxy_hold: false,
            ..c
        };
        assert!(matches!(
            decide(&released, &h, &mut lim, Flags::default(), Duration::ZERO),
            Decision::Evict { .. }
        ));
    }
}
