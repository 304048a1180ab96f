//! The fault and abuse suite: the real agent and webhook processes against the real
//! apiserver, real network namespaces and real netfilter rules, while things go wrong.
//!
//! - The agent is SIGKILLed at random moments during verification and eviction: the node
//!   converges within 2 s of each restart, is never seen untainted while its config is
//!   invalid (a Node watch checks continuously), and no pod is evicted twice (the apiserver's
//!   audit log times the agent's eviction requests against the pods' termination).
//! - The CNI config is rewritten 1,000 times a minute (atomically and in place, valid,
//!   invalid and truncated): the agent neither crashes nor burns CPU, and ends right.
//! - Hostile entries in the config dir and the bin dir (a sparse 8 GiB file, symlink loops,
//!   a symlink to /dev/zero, a FIFO, a directory, thousands of files, plugins that flood
//!   stdout or leave a child holding the pipe) against the running daemon.
//! - Pod network namespaces that vanish while the agent inspects, and pods whose IP matches
//!   no namespace: never evicted, never a crash.
//! - The webhook under a sustained open-loop load, then SIGTERM while requests whose API
//!   lookups are stalled are in flight: it keeps answering, unready, for its shutdown delay,
//!   then drains, and every one of them is answered.
//!
//! The apiserver outage (30 s, during transitions) lives with the other agent tests in
//! `agent.rs`. `MESHGATE_SOAK=1` (`make soak`) runs the long variants; `MESHGATE_FAULT_SEED`
//! repeats a run's random choices (every test prints the seed it used).

use crate::{WAIT, cp};
use anyhow::{Context, bail, ensure};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, PostParams};
use kube::{Client, ResourceExt};
use meshgate_e2e::harness::audit::AuditedIdentity;
use meshgate_e2e::harness::wait::API_TIMEOUT;
use meshgate_e2e::load::review;
use meshgate_e2e::load::review::{Outcome, Review, WebhookProcess};
use meshgate_e2e::load::stats::quantile as percentile;
use meshgate_e2e::sim::netns::{PodNetns, Rules, private_subnet, require_privileges};
use meshgate_e2e::sim::node::{Agent, CniDirs, GOOD_PLUGIN, gate_condition, golden, tail, tainted};
use meshgate_e2e::sim::pod;
use meshgate_e2e::sim::pod::MESH_LABEL;
use meshgate_e2e::{ControlPlane, NodeSpec, unique_name};
use serde_json::json;
use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

mod flapping;
mod hostile;
mod netns;
mod sigkill;
mod webhook_drain;

const VALID: &str = "calico-linkerd.conflist";
const INVALID: &str = "calico.conflist";

/// `make soak`: the long variants.
fn soak() -> bool {
    std::env::var("MESHGATE_SOAK").is_ok_and(|v| !v.is_empty() && v != "0")
}

/// splitmix64, seeded from `MESHGATE_FAULT_SEED` or the clock; the seed is printed so a
/// failing run's random choices can be repeated.
struct Rng(u64);

impl Rng {
    fn new(test: &str) -> Self {
        let seed = std::env::var("MESHGATE_FAULT_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                SystemTime::now()
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(1)
            });
        eprintln!("[faults] {test}: MESHGATE_FAULT_SEED={seed}");
        Self(seed)
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// User and system CPU time of a process, in seconds, from /proc/<pid>/stat.
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may contain spaces) start after the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // state is field 3 overall, so utime (14) and stime (15) are at 11 and 12 here.
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    Some(ticks as f64 / hz.max(1) as f64)
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| s.rfind(')').and_then(|i| s.get(i + 2..i + 3)) != Some("Z"))
}

/// A Node's meshgate state as a watch saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Seen {
    at: Instant,
    tainted: bool,
    reason: Option<String>,
}

/// Every state of one Node, as a watch reports it, from now on.
struct NodeLog {
    seen: Arc<Mutex<Vec<Seen>>>,
    task: tokio::task::JoinHandle<()>,
}

impl NodeLog {
    fn start(client: &Client, node: &str) -> Self {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (api, name, log) = (
            Api::<Node>::all(client.clone()),
            node.to_string(),
            seen.clone(),
        );
        let task = tokio::spawn(async move {
            let mut watch = std::pin::pin!(kube::runtime::watcher::watch_object(api, &name));
            while let Some(item) = watch.next().await {
                if let Ok(Some(n)) = item {
                    let s = Seen {
                        at: Instant::now(),
                        tainted: tainted(&n),
                        reason: gate_condition(&n).map(|c| c.1),
                    };
                    log.lock().unwrap_or_else(|p| p.into_inner()).push(s);
                }
            }
        });
        Self { seen, task }
    }

    fn last(&self) -> Option<Seen> {
        self.seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .last()
            .cloned()
    }

    fn all(&self) -> Vec<Seen> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Waits until the last state satisfies `ok`; returns when it did.
    async fn wait(
        &self,
        what: &str,
        timeout: Duration,
        ok: impl Fn(&Seen) -> bool,
    ) -> anyhow::Result<Instant> {
        let end = Instant::now() + timeout;
        loop {
            if let Some(s) = self.last()
                && ok(&s)
            {
                return Ok(s.at);
            }
            if Instant::now() > end {
                bail!(
                    "node not {what} within {timeout:?}; last seen {:?}",
                    self.last()
                );
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

impl Drop for NodeLog {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn verified(s: &Seen) -> bool {
    !s.tainted && s.reason.as_deref() == Some("Verified")
}

fn gated(reason: &'static str) -> impl Fn(&Seen) -> bool {
    move |s| s.tainted && s.reason.as_deref() == Some(reason)
}

/// A registered Node whose CNI dirs hold a valid config, and its running agent.
struct Rig {
    node: String,
    dirs: CniDirs,
    agent: Agent,
}

impl Rig {
    /// Registers a Node named after `prefix`, writes a valid config and starts the agent with
    /// `start` (which picks the flags and the identity).
    async fn start(
        client: &Client,
        prefix: &str,
        start: impl FnOnce(&str, &CniDirs) -> std::io::Result<Agent>,
    ) -> anyhow::Result<Self> {
        let node = unique_name(prefix);
        cp().await
            .register_node(client, &NodeSpec::new(&node))
            .await?;
        let dirs = CniDirs::new()?;
        dirs.config("10-calico.conflist", &golden(VALID)?)?;
        let agent = start(&node, &dirs)?;
        Ok(Self { node, dirs, agent })
    }

    /// Starts a watch on the Node and waits until it shows the Node verified.
    async fn watch_verified(&self, client: &Client) -> anyhow::Result<NodeLog> {
        let log = NodeLog::start(client, &self.node);
        log.wait("verified at start", WAIT, verified)
            .await
            .with_context(|| tail(&self.agent.log(), 40))?;
        Ok(log)
    }
}

/// A bare meshed pause pod bound to `node`.
fn meshed_pod(name: &str, node: &str) -> anyhow::Result<Pod> {
    Ok(pod::meshed_pod(name, node, &[], Some(1)))
}

fn ip_of(subnet: [u8; 3], host: u8) -> Ipv4Addr {
    Ipv4Addr::new(subnet[0], subnet[1], subnet[2], host)
}
