//! When each mesh profile that selects a running pod may judge it: the enrollment grace.
//!
//! In: a pod's selecting profiles before and after a label change, and the clock (a
//! `Duration` since an arbitrary origin). Out: the profiles that may be judged now
//! ([`Enrollment::judgeable`]) and when the next grace ends ([`Enrollment::next_end`]).
//!
//! A mesh enrolls running pods asynchronously (Istio's node agent adds their redirects one
//! by one after a namespace or pod label puts them in ambient mode), so a profile that a
//! label change adds to a running pod is judged only after [`ENROLL_GRACE`]. The grace is
//! per (pod, profile): a profile that already selected the pod keeps its clock, so toggling
//! a label that gains some other profile postpones nothing but that profile, and removing
//! and adding it again postpones only it (which removing it alone would do for good).

use std::collections::BTreeMap;
use std::time::Duration;

/// How long a profile that a label change just added to a running pod waits before it
/// judges the pod. A new sandbox gets no grace: its CNI chain ran before it started.
pub const ENROLL_GRACE: Duration = Duration::from_secs(30);

/// The graces of one pod's sandbox: profile name → when it may judge the pod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Enrollment {
    until: BTreeMap<String, Duration>,
}

impl Enrollment {
    /// The pod's selection went from `before` to `after` at `now`. With `grace` (a label
    /// change the agent saw happen, on the same sandbox) each profile in `after` but not in
    /// `before` waits [`ENROLL_GRACE`]; profiles no longer selecting forget their grace;
    /// every other profile keeps its own.
    pub fn reselected(&mut self, before: &[String], after: &[String], grace: bool, now: Duration) {
        self.until.retain(|p, _| after.contains(p));
        if grace {
            for p in after.iter().filter(|p| !before.contains(p)) {
                self.until.insert(p.clone(), now + ENROLL_GRACE);
            }
        }
    }

    /// A new sandbox: no profile waits.
    pub fn clear(&mut self) {
        self.until.clear();
    }

    /// The profiles of `selected` whose grace is over (or never began) at `now`, in order.
    pub fn judgeable(&self, selected: &[String], now: Duration) -> Vec<String> {
        selected
            .iter()
            .filter(|p| self.until.get(*p).is_none_or(|t| *t <= now))
            .cloned()
            .collect()
    }

    /// The earliest grace that ends after `now`: when the pod is next due for a profile.
    pub fn next_end(&self, now: Duration) -> Option<Duration> {
        self.until.values().filter(|t| **t > now).min().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: &[&str]) -> Vec<String> {
        n.iter().map(|s| s.to_string()).collect()
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn only_the_gained_profile_waits() {
        let mut e = Enrollment::default();
        let (a, ab) = (names(&["linkerd"]), names(&["linkerd", "istio-ambient"]));
        e.reselected(&a, &ab, true, secs(10));
        assert_eq!(e.judgeable(&ab, secs(10)), a, "linkerd is judged at once");
        assert_eq!(e.next_end(secs(10)), Some(secs(10) + ENROLL_GRACE));
        assert_eq!(e.judgeable(&ab, secs(10) + ENROLL_GRACE), ab);
        assert_eq!(
            e.next_end(secs(10) + ENROLL_GRACE),
            None,
            "an ended grace wakes nobody"
        );
    }

    /// Toggling a label every few seconds keeps only the toggled profile waiting; the
    /// profile that selected the pod all along is judged throughout.
    #[test]
    fn toggling_a_label_cannot_postpone_another_profile() {
        let mut e = Enrollment::default();
        let (a, ab) = (names(&["linkerd"]), names(&["linkerd", "istio-ambient"]));
        for t in (0..600).step_by(20) {
            e.reselected(&a, &ab, true, secs(t));
            assert_eq!(e.judgeable(&ab, secs(t + 1)), a, "at {t} s");
            e.reselected(&ab, &a, true, secs(t + 10));
            assert_eq!(e.judgeable(&a, secs(t + 11)), a, "at {t} s");
        }
    }

    /// A profile still in its grace keeps its clock when another is gained, lost or gained
    /// again; a profile gained without grace (labels learnt at start) is judged at once.
    #[test]
    fn each_profile_keeps_its_own_clock() {
        let mut e = Enrollment::default();
        let (none, b, bc) = (names(&[]), names(&["b"]), names(&["b", "c"]));
        e.reselected(&none, &b, true, secs(0));
        e.reselected(&b, &bc, true, secs(20));
        assert_eq!(e.judgeable(&bc, ENROLL_GRACE), b);
        assert_eq!(e.next_end(ENROLL_GRACE), Some(secs(20) + ENROLL_GRACE));
        e.reselected(&bc, &b, true, secs(25));
        assert_eq!(e.judgeable(&b, secs(25)), none, "b's grace still runs");
        e.reselected(&b, &bc, false, secs(26));
        assert_eq!(e.judgeable(&bc, secs(26)), names(&["c"]));
        e.clear();
        assert_eq!(e.judgeable(&bc, secs(26)), bc);
    }
}
