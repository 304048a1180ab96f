//! Prometheus histograms read from `/metrics` text, for the benchmarks that scrape a server
//! before and after a load to separate its own share of the latency.
//!
//! In: the text exposition format (the apiserver's, the webhook's) and a metric name with
//! the labels a series must carry. Out: the cumulative buckets, sum and count summed over the
//! matching series, their difference between two scrapes, and the mean and the bucket that
//! holds a quantile; a counter summed the same way ([`counter`]). Nothing is fetched here.

/// One histogram, summed over the series that matched.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Histogram {
    /// (upper bound, cumulative count), ascending; `+Inf` last.
    pub buckets: Vec<(f64, f64)>,
    /// `_sum`: seconds, for a duration.
    pub sum: f64,
    /// `_count`.
    pub count: f64,
}

/// Splits `name{labels} value` into the label text and the value; `None` for another metric.
fn sample<'a>(line: &'a str, name: &str) -> Option<(&'a str, f64)> {
    let rest = line.strip_prefix(name)?;
    let (labels, value) = match rest.strip_prefix('{') {
        Some(r) => r.split_once("} ")?,
        None => ("", rest.strip_prefix(' ')?),
    };
    Some((labels, value.trim().parse().ok()?))
}

/// The value of label `key` in `k="v",k2="v2"` (values without escaped quotes, as the
/// metrics read here have).
fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    labels.split("\",").find_map(|kv| {
        let (k, v) = kv.split_once("=\"")?;
        (k.trim_start_matches(',') == key).then(|| v.trim_end_matches('"'))
    })
}

/// The counter `name` summed over the series whose labels include every `(key, value)` of
/// `want`; zero when `text` has no such series.
pub fn counter(text: &str, name: &str, want: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter_map(|line| sample(line, name))
        .filter(|(labels, _)| want.iter().all(|(k, v)| label(labels, k) == Some(*v)))
        .map(|(_, v)| v)
        .sum()
}

impl Histogram {
    /// The histogram `name` summed over the series whose labels include every `(key, value)`
    /// of `want` (an empty `want` sums them all); empty when `text` has no such series.
    pub fn parse(text: &str, name: &str, want: &[(&str, &str)]) -> Self {
        let matches = |labels: &str| want.iter().all(|(k, v)| label(labels, k) == Some(*v));
        let mut h = Self::default();
        let (bucket, sum, count) = (
            format!("{name}_bucket"),
            format!("{name}_sum"),
            format!("{name}_count"),
        );
        for line in text.lines() {
            if let Some((labels, v)) = sample(line, &bucket) {
                if !matches(labels) {
                    continue;
                }
                let le = match label(labels, "le") {
                    Some("+Inf") => f64::INFINITY,
                    Some(le) => match le.parse() {
                        Ok(le) => le,
                        Err(_) => continue,
                    },
                    None => continue,
                };
                match h.buckets.iter_mut().find(|(l, _)| *l == le) {
                    Some(b) => b.1 += v,
                    None => h.buckets.push((le, v)),
                }
            } else if let Some((labels, v)) = sample(line, &sum) {
                h.sum += if matches(labels) { v } else { 0.0 };
            } else if let Some((labels, v)) = sample(line, &count) {
                h.count += if matches(labels) { v } else { 0.0 };
            }
        }
        h.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        h
    }

    /// The observations made between `before` and `self` (a counter reset reads as zero).
    pub fn since(&self, before: &Self) -> Self {
        let was = |le: f64| {
            before
                .buckets
                .iter()
                .find(|(l, _)| *l == le)
                .map_or(0.0, |b| b.1)
        };
        Self {
            buckets: self
                .buckets
                .iter()
                .map(|(le, n)| (*le, (n - was(*le)).max(0.0)))
                .collect(),
            sum: (self.sum - before.sum).max(0.0),
            count: (self.count - before.count).max(0.0),
        }
    }

    /// The mean observation (`sum / count`); `None` without observations.
    pub fn mean(&self) -> Option<f64> {
        (self.count > 0.0).then(|| self.sum / self.count)
    }

    /// The upper bound of the bucket holding quantile `p`: `None` without observations,
    /// infinity when it lies past the largest finite bucket.
    pub fn quantile_bound(&self, p: f64) -> Option<f64> {
        let total = self.buckets.last()?.1;
        if total <= 0.0 {
            return None;
        }
        self.buckets
            .iter()
            .find(|(_, n)| *n >= p * total)
            .map(|(le, _)| *le)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP x_seconds a histogram
# TYPE x_seconds histogram
x_seconds_bucket{name="a",op="CREATE",le="0.005"} 3
x_seconds_bucket{name="a",op="CREATE",le="0.025"} 4
x_seconds_bucket{name="a",op="CREATE",le="+Inf"} 4
x_seconds_sum{name="a",op="CREATE"} 0.02
x_seconds_count{name="a",op="CREATE"} 4
x_seconds_bucket{name="b",op="CREATE",le="0.005"} 10
x_seconds_bucket{name="b",op="CREATE",le="0.025"} 10
x_seconds_bucket{name="b",op="CREATE",le="+Inf"} 10
x_seconds_sum{name="b",op="CREATE"} 0.01
x_seconds_count{name="b",op="CREATE"} 10
x_seconds_other 7
y_bucket{le="1"} 1
"#;

    #[test]
    fn series_are_selected_by_their_labels_and_summed() {
        let a = Histogram::parse(TEXT, "x_seconds", &[("name", "a")]);
        assert_eq!(
            a.buckets,
            vec![(0.005, 3.0), (0.025, 4.0), (f64::INFINITY, 4.0)]
        );
        assert_eq!((a.sum, a.count), (0.02, 4.0));
        let all = Histogram::parse(TEXT, "x_seconds", &[("op", "CREATE")]);
        assert_eq!(all.count, 14.0);
        assert_eq!(all.buckets[0], (0.005, 13.0));
        assert_eq!(
            Histogram::parse(TEXT, "x_seconds", &[("name", "c")]),
            Histogram::default()
        );
        let unlabelled = "m_bucket{le=\"1\"} 2\nm_bucket{le=\"+Inf\"} 2\nm_sum 0.5\nm_count 2\n";
        let m = Histogram::parse(unlabelled, "m", &[]);
        assert_eq!((m.count, m.mean()), (2.0, Some(0.25)));
    }

    #[test]
    fn a_counter_is_summed_over_the_series_with_the_labels() {
        let text = "c_total{a=\"x\",b=\"y\"} 3\nc_total{a=\"x\",b=\"z\"} 4\n\
                    c_total{a=\"w\",b=\"y\"} 5\nc_total_other{a=\"x\"} 9\n";
        assert_eq!(counter(text, "c_total", &[("a", "x")]), 7.0);
        assert_eq!(counter(text, "c_total", &[("b", "y"), ("a", "x")]), 3.0);
        assert_eq!(counter(text, "c_total", &[]), 12.0);
        assert_eq!(counter(text, "c_total", &[("a", "v")]), 0.0);
    }

    #[test]
    fn the_difference_gives_the_mean_and_quantile_buckets_of_the_new_observations() {
        let before = Histogram::parse(TEXT, "x_seconds", &[("name", "a")]);
        let after_text = TEXT
            .replace("le=\"0.005\"} 3", "le=\"0.005\"} 5")
            .replace("le=\"0.025\"} 4", "le=\"0.025\"} 104")
            .replace("le=\"+Inf\"} 4", "le=\"+Inf\"} 105")
            .replace(
                "x_seconds_sum{name=\"a\",op=\"CREATE\"} 0.02",
                "x_seconds_sum{name=\"a\",op=\"CREATE\"} 2.02",
            )
            .replace(
                "x_seconds_count{name=\"a\",op=\"CREATE\"} 4",
                "x_seconds_count{name=\"a\",op=\"CREATE\"} 105",
            );
        let new = Histogram::parse(&after_text, "x_seconds", &[("name", "a")]).since(&before);
        assert_eq!(new.count, 101.0);
        assert!((new.mean().unwrap() - 2.0 / 101.0).abs() < 1e-12);
        assert_eq!(new.quantile_bound(0.01), Some(0.005));
        assert_eq!(new.quantile_bound(0.5), Some(0.025));
        assert_eq!(new.quantile_bound(1.0), Some(f64::INFINITY));
        assert_eq!(Histogram::default().quantile_bound(0.5), None);
        assert_eq!(Histogram::default().mean(), None);
    }
}
