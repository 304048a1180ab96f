//! Quantiles of measured durations, for the benchmarks, the load generator and the fault suite.
//!
//! In: durations sorted ascending. Out: the nearest-rank quantile; nothing else.

use std::time::Duration;

/// The `p` quantile (0..=1) of `sorted` (ascending), by nearest rank; zero when empty.
pub fn quantile(sorted: &[Duration], p: f64) -> Duration {
    let Some(last) = sorted.len().checked_sub(1) else {
        return Duration::ZERO;
    };
    let i = (last as f64 * p).round() as usize;
    sorted[i.min(last)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_quantiles() {
        let ms = |n: u64| Duration::from_millis(n);
        let v: Vec<Duration> = (1..=101).map(ms).collect();
        assert_eq!(quantile(&v, 0.0), ms(1));
        assert_eq!(quantile(&v, 0.5), ms(51));
        assert_eq!(quantile(&v, 0.99), ms(100));
        assert_eq!(quantile(&v, 1.0), ms(101));
        assert_eq!(quantile(&v, 2.0), ms(101), "clamped to the last");
        assert_eq!(quantile(&[], 0.5), Duration::ZERO);
    }
}
