//! Bounds on the API lookups a binding review may cost.
//!
//! A Binding names its pod but carries none of its labels, so the webhook looks up a pod its
//! cache does not hold. Anyone who can reach the webhook, or create Bindings, can name pods
//! that do not exist; unbounded, every such review would cost the apiserver a GET. This gate
//! bounds them: a pod the API just said does not exist is remembered for a few seconds (a
//! small, bounded negative cache), and lookups past a rate (a token bucket: `per_second`
//! tokens, refilled continuously, at most one second's worth saved up) are not made at all.
//! Either way the caller answers without a lookup, and the binding fails closed on an
//! unverified node (a verified node never needs one).
//!
//! In: the pod's key (`namespace/name`), the time (a `Duration` since any fixed origin, so
//! tests control the clock) and what each lookup found. Out: [`Admit`]: look it up, known
//! missing, or rate-limited. Pure: the caller makes the GET (and caps how many run at once).

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

/// Default `--pod-lookups-per-second`.
pub const DEFAULT_PER_SECOND: u32 = 20;
/// How long "this pod does not exist" is remembered: as long as the webhook's reason cache,
/// short enough that a pod created just after a refused binding is found at the scheduler's
/// retry (its backoff starts at 1 s and the cache holds it by then anyway).
pub const NOT_FOUND_TTL: Duration = Duration::from_secs(5);
/// Most pods remembered as missing; the oldest is forgotten first.
pub const NOT_FOUND_CAPACITY: usize = 4096;

/// The gate's bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Lookups allowed per second, sustained; also the most allowed at once after a quiet
    /// second. 0 allows none (every binding to an unverified node of a pod the cache does not
    /// hold is refused).
    pub per_second: u32,
    /// How long a pod the API did not find is remembered.
    pub not_found_ttl: Duration,
    /// Most pods remembered as missing.
    pub not_found_capacity: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            per_second: DEFAULT_PER_SECOND,
            not_found_ttl: NOT_FOUND_TTL,
            not_found_capacity: NOT_FOUND_CAPACITY,
        }
    }
}

/// What to do about one pod the cache does not hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admit {
    /// Look it up (a token was taken).
    Lookup,
    /// The API said it does not exist a moment ago: answer so without asking again.
    KnownMissing,
    /// Over the rate: do not look it up.
    RateLimited,
}

/// Pods the API recently did not find, oldest first, at most `capacity` of them.
#[derive(Debug, Default)]
struct Missing {
    until: HashMap<String, Duration>,
    order: VecDeque<(String, Duration)>,
}

impl Missing {
    fn contains(&self, key: &str, now: Duration) -> bool {
        self.until.get(key).is_some_and(|until| now < *until)
    }

    /// Forgets the front entry, and its key unless a later entry renewed it.
    fn pop_front(&mut self) {
        if let Some((key, until)) = self.order.pop_front()
            && self.until.get(&key) == Some(&until)
        {
            self.until.remove(&key);
        }
    }

    fn insert(&mut self, key: String, until: Duration, now: Duration, capacity: usize) {
        while self.order.front().is_some_and(|(_, u)| *u <= now) {
            self.pop_front();
        }
        if capacity == 0 {
            return;
        }
        // `order` holds at least one entry per key, so bounding it bounds both.
        while self.order.len() >= capacity {
            self.pop_front();
        }
        self.until.insert(key.clone(), until);
        self.order.push_back((key, until));
    }

    fn remove(&mut self, key: &str) {
        self.until.remove(key);
    }

    fn len(&self) -> usize {
        self.until.len()
    }
}

/// The negative cache and the rate limit, for one webhook process.
#[derive(Debug)]
pub struct Gate {
    limits: Limits,
    /// Tokens saved up, at most `per_second`.
    tokens: f64,
    /// When `tokens` was last refilled; `None` before the first request (the bucket starts
    /// full).
    refilled: Option<Duration>,
    missing: Missing,
}

impl Gate {
    /// A gate with a full bucket and nothing remembered.
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            tokens: f64::from(limits.per_second),
            refilled: None,
            missing: Missing::default(),
        }
    }

    /// The gate's bounds.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    fn refill(&mut self, now: Duration) {
        let rate = f64::from(self.limits.per_second);
        if let Some(last) = self.refilled {
            let gained = now.saturating_sub(last).as_secs_f64() * rate;
            self.tokens = (self.tokens + gained).min(rate);
        }
        self.refilled = Some(self.refilled.map_or(now, |last| last.max(now)));
    }

    /// Decides about the pod `key` (`namespace/name`) at `now`.
    pub fn admit(&mut self, key: &str, now: Duration) -> Admit {
        if self.missing.contains(key, now) {
            return Admit::KnownMissing;
        }
        self.refill(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            Admit::Lookup
        } else {
            Admit::RateLimited
        }
    }

    /// The lookup of `key` at `now` found nothing: remembered for the TTL.
    pub fn not_found(&mut self, key: &str, now: Duration) {
        let until = now.saturating_add(self.limits.not_found_ttl);
        self.missing
            .insert(key.to_owned(), until, now, self.limits.not_found_capacity);
    }

    /// The lookup of `key` found the pod: it is no longer remembered as missing.
    pub fn found(&mut self, key: &str) {
        self.missing.remove(key);
    }

    /// How many pods are remembered as missing (tests, logs).
    pub fn remembered(&self) -> usize {
        self.missing.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn gate(per_second: u32) -> Gate {
        Gate::new(Limits {
            per_second,
            ..Limits::default()
        })
    }

    /// A burst of one second's worth is let through, then one lookup per 1/rate seconds:
    /// a flood of made-up names costs at most `per_second` GETs a second, never more.
    #[test]
    fn lookups_are_limited_to_the_rate_after_a_burst_of_one_seconds_worth() {
        let mut g = gate(20);
        let admitted = (0..100)
            .filter(|i| g.admit(&format!("shop/forged-{i}"), ms(0)) == Admit::Lookup)
            .count();
        assert_eq!(admitted, 20, "the burst");
        assert_eq!(g.admit("shop/another", ms(10)), Admit::RateLimited);
        // 60 ms in, one token is back (20/s), not two.
        assert_eq!(g.admit("shop/a", ms(60)), Admit::Lookup);
        assert_eq!(g.admit("shop/b", ms(60)), Admit::RateLimited);
        // Over 10 s of a constant flood, 20 per second get through.
        let mut admitted = 0;
        for t in (70..10_070).step_by(5) {
            if g.admit(&format!("shop/f-{t}"), ms(t)) == Admit::Lookup {
                admitted += 1;
            }
        }
        assert!((199..=201).contains(&admitted), "{admitted}");
        // A quiet minute saves up one second's worth only.
        let later = ms(70_000);
        let burst = (0..100)
            .filter(|i| g.admit(&format!("shop/q-{i}"), later) == Admit::Lookup)
            .count();
        assert_eq!(burst, 20);
    }

    #[test]
    fn a_rate_of_zero_allows_no_lookup() {
        let mut g = gate(0);
        assert_eq!(g.admit("shop/p", ms(0)), Admit::RateLimited);
        assert_eq!(g.admit("shop/p", ms(60_000)), Admit::RateLimited);
    }

    /// A pod the API did not find is answered from memory for the TTL, costing no token;
    /// then it is looked up again. A pod found since is forgotten at once.
    #[test]
    fn a_missing_pod_is_remembered_for_the_ttl_without_spending_tokens() {
        let mut g = gate(1);
        assert_eq!(g.admit("shop/ghost", ms(0)), Admit::Lookup);
        g.not_found("shop/ghost", ms(3));
        for t in [4, 1000, 5002] {
            assert_eq!(
                g.admit("shop/ghost", ms(t)),
                Admit::KnownMissing,
                "at {t} ms"
            );
        }
        // Another name in the same namespace is not affected.
        assert_eq!(g.admit("shop/ghost-2", ms(5002)), Admit::Lookup);
        assert_eq!(g.admit("other/ghost", ms(5002)), Admit::RateLimited);
        // Past the TTL (5 s after the answer): looked up again.
        assert_eq!(g.admit("shop/ghost", ms(6100)), Admit::Lookup);
        g.not_found("shop/ghost", ms(6100));
        assert_eq!(g.admit("shop/ghost", ms(6200)), Admit::KnownMissing);
        g.found("shop/ghost");
        assert_eq!(g.admit("shop/ghost", ms(7200)), Admit::Lookup);
    }

    /// The negative cache never holds more than its capacity: the oldest names go first,
    /// and expired ones are dropped as new ones arrive.
    #[test]
    fn the_negative_cache_is_bounded_oldest_first() {
        let limits = Limits {
            per_second: 1_000_000,
            not_found_ttl: Duration::from_secs(5),
            not_found_capacity: 3,
        };
        let mut g = Gate::new(limits);
        for (i, t) in [(0, 0), (1, 1), (2, 2), (3, 3)] {
            g.not_found(&format!("ns/p{i}"), ms(t));
        }
        assert_eq!(g.remembered(), 3);
        assert_eq!(
            g.admit("ns/p0", ms(4)),
            Admit::Lookup,
            "the oldest was dropped"
        );
        assert_eq!(g.admit("ns/p3", ms(4)), Admit::KnownMissing);
        // Inserting drops everything expired first.
        g.not_found("ns/p4", ms(5_002));
        assert_eq!(g.remembered(), 2, "p3 and p4");
        g.not_found("ns/p5", ms(20_000));
        assert_eq!(g.remembered(), 1);

        // A renewed name outlives its first entry's expiry.
        let mut g = Gate::new(Limits {
            not_found_capacity: 4,
            ..limits
        });
        g.not_found("ns/a", ms(0));
        g.not_found("ns/b", ms(1));
        g.not_found("ns/a", ms(2));
        g.not_found("ns/c", ms(5_001));
        assert_eq!(g.admit("ns/a", ms(5_001)), Admit::KnownMissing);
        assert_eq!(g.admit("ns/b", ms(5_001)), Admit::Lookup);
        assert_eq!(g.remembered(), 2, "a (renewed) and c");

        // Capacity 0 remembers nothing.
        let mut none = Gate::new(Limits {
            not_found_capacity: 0,
            ..Limits::default()
        });
        none.not_found("ns/p", ms(0));
        assert_eq!(none.admit("ns/p", ms(1)), Admit::Lookup);
    }

    /// A clock reading earlier than the last one (two callers racing to the lock) neither
    /// panics nor mints tokens.
    #[test]
    fn an_earlier_clock_reading_mints_no_tokens() {
        let mut g = gate(2);
        assert_eq!(g.admit("a/1", ms(1000)), Admit::Lookup);
        assert_eq!(g.admit("a/2", ms(1000)), Admit::Lookup);
        assert_eq!(g.admit("a/3", ms(500)), Admit::RateLimited);
        assert_eq!(g.admit("a/4", ms(1000)), Admit::RateLimited);
        assert_eq!(g.admit("a/5", ms(1500)), Admit::Lookup);
    }
}
