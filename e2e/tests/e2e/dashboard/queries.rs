//! The queries under test and how they are checked.
//!
//! In: the chart's dashboard JSON (`manifests/charts/meshgate/dashboards/meshgate.json`), the
//! rendered PrometheusRule (`manifests/charts/monitoring/test.sh --extract`, as `make alerts`
//! extracts it), a running [`Prometheus`]. Out: every panel query (keyed `"title / refId"`)
//! and alert expression (keyed `"alert Name"`), with Grafana's variables given concrete
//! values; a [`Checker`] that polls a query until its answer is what a step of the story
//! expects, and remembers which queries were seen answering with series.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use anyhow::{Context as _, bail, ensure};
use meshgate_e2e::harness::helm;
use meshgate_e2e::harness::paths::repo_root;
use meshgate_e2e::harness::prometheus::{Prometheus, Series};
use meshgate_e2e::harness::wait::poll_until;
use serde_json::Value;

use crate::WAIT;

/// `$__rate_interval` in the test: Grafana makes it at least four scrape intervals; with the
/// test's 1 s scrapes, a minute covers every step of the story with samples to spare.
pub(super) const RATE_INTERVAL: &str = "1m";

/// The dashboard's queries with Grafana's variables replaced: `$__rate_interval` by
/// [`RATE_INTERVAL`], `$node` (All) by `.*`.
pub(super) fn substitute(expr: &str) -> String {
    expr.replace("$__rate_interval", RATE_INTERVAL)
        .replace("$node", ".*")
}

/// The shipped dashboard.
pub(super) fn dashboard() -> anyhow::Result<Value> {
    let path = repo_root().join("manifests/charts/meshgate/dashboards/meshgate.json");
    let text = std::fs::read_to_string(&path).with_context(|| format!("{}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))
}

/// Every panel query: `"title / refId"` → the expression, substituted.
pub(super) fn panel_queries() -> anyhow::Result<BTreeMap<String, String>> {
    let dash = dashboard()?;
    let mut out = BTreeMap::new();
    for panel in dash["panels"].as_array().context("no panels")? {
        let title = panel["title"].as_str().context("a panel without a title")?;
        for target in panel["targets"]
            .as_array()
            .context("a panel without targets")?
        {
            let r = target["refId"].as_str().context("a target without refId")?;
            let expr = target["expr"].as_str().context("a target without expr")?;
            out.insert(format!("{title} / {r}"), substitute(expr));
        }
    }
    ensure!(!out.is_empty(), "the dashboard has no queries");
    Ok(out)
}

/// Every alert of the rendered PrometheusRule: `"alert Name"` → its expression.
pub(super) fn alert_queries() -> anyhow::Result<BTreeMap<String, String>> {
    let script = repo_root().join("manifests/charts/monitoring/test.sh");
    let out = Command::new("bash")
        .arg(&script)
        .arg("--extract")
        .env("HELM", helm::binary()?)
        .output()
        .with_context(|| format!("running {} --extract", script.display()))?;
    ensure!(
        out.status.success(),
        "{} --extract: {}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let rules: Value = serde_saphyr::from_str(&String::from_utf8(out.stdout)?)?;
    let mut alerts = BTreeMap::new();
    for group in rules["groups"].as_array().context("no rule groups")? {
        for rule in group["rules"].as_array().context("a group without rules")? {
            let name = rule["alert"].as_str().context("a rule without alert")?;
            let expr = rule["expr"].as_str().context("a rule without expr")?;
            alerts.insert(format!("alert {name}"), expr.trim().to_owned());
        }
    }
    Ok(alerts)
}

/// A series whose labels include every `(name, value)` of `labels`.
pub(super) fn with<'a>(series: &'a [Series], labels: &[(&str, &str)]) -> Option<&'a Series> {
    series
        .iter()
        .find(|s| labels.iter().all(|(k, v)| s.label(k) == *v))
}

/// Checks queries against Prometheus, remembering which were seen with series.
pub(super) struct Checker<'a> {
    prom: &'a Prometheus,
    queries: BTreeMap<String, String>,
    proven: BTreeSet<String>,
}

impl<'a> Checker<'a> {
    /// Every query of the dashboard and the alerts; fails if Prometheus refuses one (a
    /// query that does not parse).
    pub(super) async fn new(prom: &'a Prometheus) -> anyhow::Result<Self> {
        let mut queries = panel_queries()?;
        queries.extend(alert_queries()?);
        for (key, expr) in &queries {
            prom.query(expr).await.with_context(|| key.clone())?;
        }
        Ok(Self {
            prom,
            queries,
            proven: BTreeSet::new(),
        })
    }

    /// The expression of `key`.
    pub(super) fn expr(&self, key: &str) -> anyhow::Result<&str> {
        match self.queries.get(key) {
            Some(e) => Ok(e),
            None => bail!("no query {key:?}; there are {:?}", self.queries.keys()),
        }
    }

    /// Polls `key` until `ok` holds for its series (`what` says what that means); returns
    /// them. A query seen answering with a series that `ok` accepts counts as proven.
    pub(super) async fn expect(
        &mut self,
        key: &str,
        what: &str,
        ok: impl Fn(&[Series]) -> bool,
    ) -> anyhow::Result<Vec<Series>> {
        let expr = self.expr(key)?.to_owned();
        let prom = self.prom;
        let got = poll_until(&format!("{key}: {what}"), WAIT, || async {
            let series = prom.query(&expr).await?;
            anyhow::Ok(ok(&series).then_some(series))
        })
        .await;
        let series = match got {
            Ok(s) => s,
            Err(e) => {
                let last = prom.query(&expr).await.map(|s| format!("{s:?}"));
                bail!("{e}\nquery: {expr}\nlast answer: {last:?}")
            }
        };
        if !series.is_empty() {
            self.proven.insert(key.to_owned());
        }
        Ok(series)
    }

    /// Polls `key` until it answers with a series carrying `labels` whose value `ok` accepts.
    pub(super) async fn series(
        &mut self,
        key: &str,
        labels: &[(&str, &str)],
        ok: impl Fn(f64) -> bool,
    ) -> anyhow::Result<Series> {
        let what = format!("a series with {labels:?} and the value wanted");
        let got = self
            .expect(key, &what, |s| {
                with(s, labels).is_some_and(|s| ok(s.value()))
            })
            .await?;
        with(&got, labels).cloned().context("checked above")
    }

    /// Polls `key` until it answers with no series.
    pub(super) async fn empty(&mut self, key: &str) -> anyhow::Result<()> {
        self.expect(key, "no series", <[Series]>::is_empty).await?;
        Ok(())
    }

    /// The queries never seen answering with a series, but those in `except`.
    pub(super) fn unproven(&self, except: &[&str]) -> Vec<String> {
        self.queries
            .keys()
            .filter(|k| !self.proven.contains(*k) && !except.contains(&k.as_str()))
            .cloned()
            .collect()
    }
}
