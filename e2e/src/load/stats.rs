//! Quantiles of measured durations, for the benchmarks, the load generator and the fault suite.
//!
//! In: durations sorted ascending. Out: the sample at index round(p·(n−1)), the nearest
//! sample to the linearly interpolated quantile (no interpolation); nothing else.

use std::time::Duration;

/// The `p` quantile (0..=1) of `sorted` (ascending): the sample at index `round(p·(n−1))`
/// (`p` outside 0..=1 is clamped to the first or last); zero when empty.
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
    fn quantile_is_the_sample_at_the_rounded_index() {
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
