//! A real Prometheus (`/usr/bin/prometheus`, the Debian package `e2e/install-deps.sh`
//! installs) on loopback, for tests that check queries against what meshgate really exposes.
//!
//! In: scrape targets ([`Target`]: an address, its labels, optionally HTTPS with a client
//! certificate), a scrape interval. Out: a running server with its own temporary storage,
//! instant and range queries through its HTTP API (`/api/v1/query`, `/api/v1/query_range`),
//! a reload with other targets, and its log. The process runs under `timeout`, so it ends
//! within [`LIFETIME`] even if the test process is killed; it is stopped on drop.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use serde_json::Value;

use crate::sim::node::{free_port, http_get};

/// The Prometheus binary the e2e dependencies install.
pub const BINARY: &str = "/usr/bin/prometheus";
/// The longest a test's Prometheus lives, whatever happens to the test.
pub const LIFETIME: Duration = Duration::from_secs(900);

/// One scrape target: `job` and every other label are set on its series as given.
#[derive(Clone, Debug)]
pub struct Target {
    /// `host:port`; empty: the job with no target. Prometheus marks the series of a target
    /// gone from its job stale at once, but not those of a job gone from the configuration
    /// (it stops the job's scrapes without staleness markers), so remove targets this way.
    pub address: String,
    /// The `job` label (and scrape job name).
    pub job: String,
    /// Further target labels (`node`, `namespace`, `pod`).
    pub labels: Vec<(String, String)>,
    /// HTTPS with (CA, client certificate, client key), for the apiserver.
    pub tls: Option<(PathBuf, PathBuf, PathBuf)>,
}

/// One series of a query's answer: its labels and its value (instant) or values (range).
#[derive(Clone, Debug)]
pub struct Series {
    /// Every label of the series.
    pub labels: serde_json::Map<String, Value>,
    /// (Unix seconds, value) points; one for an instant query.
    pub points: Vec<(f64, f64)>,
}

impl Series {
    /// A label's value, `""` when absent.
    pub fn label(&self, name: &str) -> &str {
        self.labels.get(name).and_then(Value::as_str).unwrap_or("")
    }

    /// The last point's value.
    pub fn value(&self) -> f64 {
        self.points.last().map_or(f64::NAN, |p| p.1)
    }
}

/// A running Prometheus; stopped on drop.
pub struct Prometheus {
    child: Option<Child>,
    /// Its web address.
    pub addr: SocketAddr,
    dir: tempfile::TempDir,
    interval: Duration,
}

impl Prometheus {
    /// Starts Prometheus scraping `targets` every `interval`, and waits until it is ready.
    pub async fn start(targets: &[Target], interval: Duration) -> anyhow::Result<Self> {
        ensure!(
            Path::new(BINARY).exists(),
            "{BINARY} is missing: e2e/install-deps.sh installs Debian's prometheus package"
        );
        let dir = tempfile::tempdir().context("Prometheus' directory")?;
        let addr = SocketAddr::from(([127, 0, 0, 1], free_port()?));
        let mut p = Self {
            child: None,
            addr,
            dir,
            interval,
        };
        p.write_config(targets)?;
        let log = std::fs::File::create(p.log_path()).context("Prometheus' log")?;
        let child = Command::new("timeout")
            .arg(LIFETIME.as_secs().to_string())
            .arg(BINARY)
            .arg(format!("--config.file={}", p.config_path().display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                p.dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .arg("--web.enable-lifecycle")
            .arg("--storage.tsdb.retention.time=1h")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting prometheus")?;
        p.child = Some(child);
        p.until_ready().await?;
        Ok(p)
    }

    fn config_path(&self) -> PathBuf {
        self.dir.path().join("prometheus.yml")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("prometheus.log")
    }

    /// Prometheus' log so far (for assertion messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// The scrape interval.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// Writes the configuration: one scrape job per target (JSON is YAML).
    fn write_config(&self, targets: &[Target]) -> anyhow::Result<()> {
        let secs = format!("{}ms", self.interval.as_millis());
        let jobs: Vec<Value> = targets
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let mut labels = serde_json::Map::new();
                for (k, v) in &t.labels {
                    labels.insert(k.clone(), Value::String(v.clone()));
                }
                let mut job = serde_json::json!({
                    "job_name": format!("{}-{i}", t.job),
                    "scrape_interval": secs,
                    "scrape_timeout": secs,
                    "honor_labels": true,
                    "static_configs": [{"targets": addresses(&t.address), "labels": labels}],
                    "relabel_configs": [{"target_label": "job", "replacement": t.job}],
                });
                if let Some((ca, cert, key)) = &t.tls {
                    job["scheme"] = "https".into();
                    job["tls_config"] = serde_json::json!({
                        "ca_file": ca, "cert_file": cert, "key_file": key,
                    });
                }
                job
            })
            .collect();
        let config = serde_json::json!({
            "global": {"scrape_interval": secs, "evaluation_interval": secs},
            "scrape_configs": jobs,
        });
        std::fs::write(self.config_path(), serde_json::to_vec_pretty(&config)?)
            .context("writing prometheus.yml")
    }

    /// Waits up to 30 s for `/-/ready`; fails at once if the process ended.
    async fn until_ready(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some((200, _)) = http_get(self.addr, "/-/ready").await {
                return Ok(());
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                bail!("prometheus exited ({status}):\n{}", self.log());
            }
            ensure!(
                Instant::now() < deadline,
                "prometheus not ready within 30 s:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Replaces the targets and reloads the configuration (`POST /-/reload`).
    pub async fn reload(&self, targets: &[Target]) -> anyhow::Result<()> {
        self.write_config(targets)?;
        let code = post(self.addr, "/-/reload").await?;
        ensure!(code == 200, "reload answered {code}:\n{}", self.log());
        Ok(())
    }

    /// An instant query at the current time: its series (an error for a query Prometheus
    /// refuses, with its message).
    pub async fn query(&self, expr: &str) -> anyhow::Result<Vec<Series>> {
        let path = format!("/api/v1/query?query={}", encode(expr));
        self.api(&path, expr).await
    }

    /// A range query over the last `range`, one point per `step`.
    pub async fn query_range(
        &self,
        expr: &str,
        range: Duration,
        step: Duration,
    ) -> anyhow::Result<Vec<Series>> {
        let end = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs_f64();
        let path = format!(
            "/api/v1/query_range?query={}&start={:.3}&end={end:.3}&step={:.3}",
            encode(expr),
            end - range.as_secs_f64(),
            step.as_secs_f64()
        );
        self.api(&path, expr).await
    }

    async fn api(&self, path: &str, expr: &str) -> anyhow::Result<Vec<Series>> {
        let (code, body) = http_get(self.addr, path)
            .await
            .with_context(|| format!("no answer from prometheus for {expr}"))?;
        let v: Value = serde_json::from_str(&body)
            .with_context(|| format!("prometheus answered {code}: {body}"))?;
        ensure!(
            v["status"] == "success",
            "prometheus refused {expr}: {}",
            v["error"]
        );
        let result = v["data"]["result"].as_array().cloned().unwrap_or_default();
        Ok(result.iter().map(series).collect())
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SIGTERM to `timeout`, which passes it on to Prometheus.
            let pid = nix::unistd::Pid::from_raw(c.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The static targets of one job: `address`, or none when it is empty.
fn addresses(address: &str) -> Vec<&str> {
    if address.is_empty() {
        Vec::new()
    } else {
        vec![address]
    }
}

/// One result of the API: a vector's `value` or a matrix's `values`.
fn series(r: &Value) -> Series {
    let point = |p: &Value| -> (f64, f64) {
        let t = p[0].as_f64().unwrap_or(f64::NAN);
        let v = p[1]
            .as_str()
            .and_then(|s| s.parse().ok())
            .unwrap_or(f64::NAN);
        (t, v)
    };
    let points = match (r.get("value"), r.get("values")) {
        (Some(v), _) => vec![point(v)],
        (None, Some(Value::Array(vs))) => vs.iter().map(point).collect(),
        _ => Vec::new(),
    };
    Series {
        labels: r["metric"].as_object().cloned().unwrap_or_default(),
        points,
    }
}

/// Percent-encodes a query parameter (everything but the unreserved characters).
fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// An empty HTTP/1.0 POST, each step bounded by 5 s: the status code.
async fn post(addr: SocketAddr, path: &str) -> anyhow::Result<u16> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let step = Duration::from_secs(5);
    let mut s = tokio::time::timeout(step, tokio::net::TcpStream::connect(addr)).await??;
    let request = format!("POST {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Length: 0\r\n\r\n");
    s.write_all(request.as_bytes()).await?;
    let mut buf = Vec::new();
    tokio::time::timeout(step, s.read_to_end(&mut buf)).await??;
    let text = String::from_utf8_lossy(&buf);
    text.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("no status in {text}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_query_is_percent_encoded() {
        assert_eq!(
            encode("sum by (le) (x{a=~\"b|c\"}[1m]) > 0"),
            "sum%20by%20%28le%29%20%28x%7Ba%3D~%22b%7Cc%22%7D%5B1m%5D%29%20%3E%200"
        );
    }
}
