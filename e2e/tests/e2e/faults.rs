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

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, bail, ensure};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, PostParams};
use kube::{Client, ResourceExt};
use meshgate_e2e::harness::audit::AuditedIdentity;
use meshgate_e2e::harness::wait::API_TIMEOUT;
use meshgate_e2e::load::review::{self, Outcome, Review, WebhookProcess};
use meshgate_e2e::load::stats::quantile as percentile;
use meshgate_e2e::sim::netns::{PodNetns, Rules, private_subnet, require_privileges};
use meshgate_e2e::sim::node::{Agent, CniDirs, GOOD_PLUGIN, gate_condition, golden, tail, tainted};
use meshgate_e2e::sim::pod::{self, MESH_LABEL};
use meshgate_e2e::{ControlPlane, NodeSpec, unique_name};
use serde_json::json;

use crate::{WAIT, cp};

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

/// A plugin that answers like a healthy one after 50 ms, so verification takes long enough
/// for kills to land inside it.
const SLOW_GOOD_PLUGIN: &str = "#!/bin/sh\nsleep 0.05\ncat >/dev/null\necho '{\"cniVersion\":\"1.0.0\",\"supportedVersions\":[\"0.3.0\",\"0.3.1\",\"0.4.0\",\"1.0.0\"]}'\n";

// ---------------------------------------------------------------------------------------
// Agent SIGKILL
// ---------------------------------------------------------------------------------------

/// The agent is SIGKILLed 50 times (200 in soak) at a random moment 0-250 ms after a config
/// flip and/or the creation of pods without redirect rules, so kills land before, inside and
/// after verification (plugins take 50 ms to answer VERSION), inside reconciles and inside
/// inspections and evictions. After each restart the node must be right and the agent ready
/// within 2 s; a continuous Node watch must never show the node untainted while the config on
/// disk has been invalid for longer than the verify-to-patch race allows; every pod without
/// rules must end up evicted, no pod with rules may get an eviction request, and no eviction
/// request may reach the apiserver (its audit log) after the pod was already terminating
/// (this test's pod watch): an agent acting on stale knowledge of its own eviction.
#[tokio::test]
async fn agent_sigkill_at_random_moments_converges_and_never_untaints_unverified()
-> anyhow::Result<()> {
    require_privileges()?;
    let cp = cp().await;
    let client = cp.client()?;
    let mut rng = Rng::new("sigkill");
    let ns = cp.create_namespace(&client, "faults-kill").await?;
    let node = unique_name("faults-kill");
    cp.register_node(&client, &NodeSpec::new(&node)).await?;
    let id = AuditedIdentity::new(cp, &client, &ns, "meshgate-agent").await?;
    let dirs = CniDirs::new()?;
    for p in ["calico", "linkerd-cni"] {
        dirs.plugin(p, SLOW_GOOD_PLUGIN)?;
    }
    let (valid, invalid) = (golden(VALID)?, golden(INVALID)?);
    dirs.config("10-calico.conflist", &invalid)?;

    let subnet = private_subnet();
    let ips: Arc<Mutex<HashMap<String, IpAddr>>> = Arc::default();
    let source = ips.clone();
    let _kubelet = cp.run_pods(&node, move |p: &Pod| {
        source
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&p.name_any())
            .copied()
    });
    let started = SystemTime::now();
    // When each pod was first seen terminating (or gone), by a watch of the test's own; and a
    // clock pair to compare those instants with the audit log's wall-clock times.
    let clock = (Instant::now(), SystemTime::now());
    let terminating: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    // Watch errors: after one the watcher relists, and a pod deleted in the gap is never
    // seen terminating; the check below then fails, naming these.
    let watch_errors: Arc<Mutex<Vec<String>>> = Arc::default();
    let term_watch = {
        let (api, seen, errors) = (
            Api::<Pod>::namespaced(client.clone(), &ns),
            terminating.clone(),
            watch_errors.clone(),
        );
        tokio::spawn(async move {
            let mut s = std::pin::pin!(kube::runtime::watcher(api, Default::default()));
            while let Some(ev) = s.next().await {
                let p = match ev {
                    Err(e) => {
                        errors
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .push(e.to_string());
                        continue;
                    }
                    Ok(
                        kube::runtime::watcher::Event::Apply(p)
                        | kube::runtime::watcher::Event::InitApply(p),
                    ) => {
                        if p.metadata.deletion_timestamp.is_none() {
                            continue;
                        }
                        p
                    }
                    Ok(kube::runtime::watcher::Event::Delete(p)) => p,
                    _ => continue,
                };
                seen.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .entry(p.name_any())
                    .or_insert_with(Instant::now);
            }
        })
    };
    let mut agent = Agent::start_with_kubeconfig(
        &id.kubeconfig,
        &node,
        &dirs,
        &[
            "--profile",
            "linkerd",
            "--evict-unowned",
            "--max-evictions-per-minute",
            "100000",
        ],
    )?;
    let log = NodeLog::start(&client, &node);
    log.wait("gated at start", WAIT, gated("ChainedPluginMissing"))
        .await
        .with_context(|| tail(&agent.log(), 40))?;

    let rounds = if soak() { 200 } else { 50 };
    // Config validity over time, for the continuous check.
    let mut timeline: Vec<(Instant, bool)> = vec![(Instant::now(), false)];
    let mut valid_now = false;
    let mut netns: Vec<PodNetns> = Vec::new();
    // pod name -> has redirect rules
    let mut pods: BTreeMap<String, bool> = BTreeMap::new();
    let mut converge: Vec<Duration> = Vec::new();
    let mut slow_rounds: Vec<String> = Vec::new();
    let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let mut host = 1u8;
    let mut port_collisions = 0u32;
    for round in 0..rounds {
        let flip = round == 0 || rng.below(10) < 6;
        let new_pods = if host < 240 && rng.below(2) == 0 {
            1 + rng.below(2)
        } else {
            0
        };
        if flip {
            valid_now = !valid_now;
            dirs.config(
                "10-calico.conflist",
                if valid_now { &valid } else { &invalid },
            )?;
            timeline.push((Instant::now(), valid_now));
        }
        for _ in 0..new_pods {
            let redirected = rng.below(4) == 0;
            let ip = ip_of(subnet, host);
            host += 1;
            let rules = if redirected {
                Rules::Linkerd("iptables-legacy")
            } else {
                Rules::None
            };
            netns.push(PodNetns::new(ip, rules)?);
            let name = format!("p{round}-{host}");
            ips.lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(name.clone(), IpAddr::V4(ip));
            api.create(&PostParams::default(), &meshed_pod(&name, &node)?)
                .await?;
            pods.insert(name, redirected);
        }
        let delay = Duration::from_millis(rng.below(250));
        tokio::time::sleep(delay).await;
        agent.kill9();
        let restarted = Instant::now();
        agent.restart()?;
        // Converged: the node shows the verdict of the config on disk, and the new process
        // reports ready (it is ready once its verdict is on the Node).
        let want_verified = valid_now;
        let deadline = restarted + Duration::from_secs(10);
        let took = loop {
            let right = log.last().is_some_and(|s| {
                if want_verified {
                    verified(&s)
                } else {
                    gated("ChainedPluginMissing")(&s)
                }
            });
            if right && agent.admin_get("/ready").await.is_some_and(|r| r.0 == 200) {
                break restarted.elapsed();
            }
            // The admin port can be taken by another process on the machine in the instant
            // between kill and restart (its own free-port probe or listener). That is the rig,
            // not the property under test: start again, and say so.
            if agent.pid().is_some_and(|pid| !alive(pid))
                && tail(&agent.log(), 3).contains("Address already in use")
            {
                eprintln!(
                    "[faults] sigkill: round {round}: the admin port was taken by another process at restart; restarting"
                );
                port_collisions += 1;
                agent.restart()?;
            }
            if Instant::now() > deadline {
                bail!(
                    "round {round}: not converged 10 s after the restart (want verified={want_verified}, last {:?})\n{}",
                    log.last(),
                    tail(&agent.log(), 60)
                );
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        if took > Duration::from_secs(2) {
            slow_rounds.push(format!(
                "round {round}: {took:?} (flip {flip}, pods {new_pods}, kill after {delay:?})"
            ));
        }
        converge.push(took);
    }

    // Every pod without rules is evicted in the end; then count evictions in the audit log.
    let bad: Vec<&String> = pods.iter().filter(|(_, r)| !**r).map(|(n, _)| n).collect();
    meshgate_e2e::harness::wait::poll_until("every pod without rules evicted", WAIT, || async {
        let live = api.list(&Default::default()).await?.items;
        let left: Vec<String> = live
            .iter()
            .filter(|p| bad.contains(&&p.name_any()) && p.metadata.deletion_timestamp.is_none())
            .map(ResourceExt::name_any)
            .collect();
        anyhow::Ok(left.is_empty().then_some(()))
    })
    .await
    .with_context(|| tail(&agent.log(), 60))?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    term_watch.abort();
    // Evictions, by the apiserver's audit log. A request the agent abandoned because it was
    // killed shows as 504 (context canceled) and may or may not have been applied, so whether
    // a pod was evicted is read from the pod itself (above), and "evicted twice" means: an
    // eviction request received after the pod was already terminating (as this test's watch
    // saw it, with a margin for the watch's delivery delay) — the agent acting on stale
    // knowledge of its own eviction.
    const MARGIN: Duration = Duration::from_millis(200);
    let requests = id.requests(cp, started)?;
    let terminating = terminating
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let wall = |t: Instant| clock.1 + t.saturating_duration_since(clock.0);
    let mut by_pod: BTreeMap<String, Vec<(SystemTime, Option<u16>)>> = BTreeMap::new();
    let mut codes: BTreeMap<Option<u16>, usize> = BTreeMap::new();
    for r in requests
        .iter()
        .filter(|r| r.subresource == "eviction" && r.verb == "create")
    {
        *codes.entry(r.code).or_default() += 1;
        by_pod
            .entry(r.name.clone())
            .or_default()
            .push((r.received, r.code));
    }
    // Every evicted pod must have been seen terminating, or the re-eviction check below
    // could not judge it.
    let unwatched: Vec<&String> = by_pod
        .keys()
        .filter(|p| bad.contains(p) && !terminating.contains_key(*p))
        .collect();
    let watch_errors = watch_errors
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let twice: Vec<String> = by_pod
        .iter()
        .filter_map(|(pod, reqs)| {
            let t = wall(*terminating.get(pod)?);
            let late: Vec<_> = reqs.iter().filter(|(at, _)| *at > t + MARGIN).collect();
            (!late.is_empty()).then(|| {
                format!("{pod}: requests {reqs:?}, terminating since {t:?}, late {late:?}")
            })
        })
        .collect();
    let wrongly: Vec<_> = by_pod
        .keys()
        .filter(|n| pods.get(*n) == Some(&true))
        .collect();
    let unrequested: Vec<_> = bad.iter().filter(|n| !by_pod.contains_key(**n)).collect();

    // The continuous check: an untainted state seen while the config has been invalid for
    // longer than GRACE (one verify-to-patch race plus watch delivery) is a wrong untaint.
    const GRACE: Duration = Duration::from_millis(300);
    let seen = log.all();
    let mut wrong = Vec::new();
    for s in seen.iter().filter(|s| !s.tainted) {
        let Some(&(since, valid)) = timeline.iter().rev().find(|(t, _)| *t <= s.at) else {
            continue;
        };
        if !valid && s.at.duration_since(since) > GRACE {
            wrong.push(format!(
                "untainted {:?} after the config turned invalid",
                s.at.duration_since(since)
            ));
        }
    }

    converge.sort();
    let attempts: usize = by_pod.values().map(Vec::len).sum();
    eprintln!(
        "[faults] sigkill: {rounds} kills; converged after restart p50 {:.0} ms p90 {:.0} ms max {:.0} ms; \
         {} node states watched, {} config flips; {} pods ({} without rules, all evicted), {attempts} eviction \
         requests for {} pods; answers by HTTP code {codes:?}; admin port taken at restart {port_collisions} times",
        ms(percentile(&converge, 0.5)),
        ms(percentile(&converge, 0.9)),
        ms(percentile(&converge, 1.0)),
        seen.len(),
        timeline.len() - 1,
        pods.len(),
        bad.len(),
        by_pod.len(),
    );
    ensure!(
        wrong.is_empty(),
        "wrong untaints: {wrong:?}\n{}",
        tail(&agent.log(), 80)
    );
    ensure!(
        slow_rounds.is_empty(),
        "converged later than 2 s after restart: {slow_rounds:?}"
    );
    ensure!(
        unwatched.is_empty(),
        "evicted pods never seen terminating by the test's watch, so whether they were \
         evicted again cannot be judged: {unwatched:?} (watch errors: {watch_errors:?})"
    );
    ensure!(
        twice.is_empty(),
        "pods evicted again after they were terminating: {twice:?}\n{}",
        tail(&agent.log(), 60)
    );
    ensure!(
        wrongly.is_empty(),
        "pods with redirect rules evicted: {wrongly:?}"
    );
    ensure!(
        unrequested.is_empty(),
        "pods evicted without an eviction request by the agent: {unrequested:?}"
    );
    drop(netns);
    id.remove(&client).await;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Config flapping
// ---------------------------------------------------------------------------------------

/// The config is rewritten every 60 ms (1,000 times a minute) for 20 s (60 s in soak): valid
/// and invalid, atomically (rename) and in place (truncate and write, so the agent can read a
/// half-written file), with an invalid file appearing before it and going away. The agent
/// must stay up, use bounded CPU and memory, keep its API writes bounded by the number of
/// real changes, and end in the right state within a second of the last write.
#[tokio::test]
async fn config_flapping_keeps_cpu_bounded_and_ends_right() -> anyhow::Result<()> {
    let cp = cp().await;
    let client = cp.client()?;
    let mut rng = Rng::new("flapping");
    let ns = cp.create_namespace(&client, "faults-flap").await?;
    let id = AuditedIdentity::new(cp, &client, &ns, "meshgate-agent").await?;
    let rig = Rig::start(&client, "faults-flap", |node, dirs| {
        Agent::start_with_kubeconfig(&id.kubeconfig, node, dirs, &[])
    })
    .await?;
    let log = rig.watch_verified(&client).await?;
    let Rig { dirs, agent, .. } = rig;
    let (valid, invalid) = (golden(VALID)?, golden(INVALID)?);
    let pid = agent.pid().context("agent pid")?;
    tokio::time::sleep(Duration::from_secs(1)).await;

    let duration = Duration::from_secs(if soak() { 60 } else { 20 });
    let period = Duration::from_millis(60);
    let (cpu0, rss0) = (
        cpu_seconds(pid).context("cpu")?,
        agent.rss_kib().unwrap_or(0),
    );
    let from = SystemTime::now();
    let begun = Instant::now();
    let live = dirs.conf.join("10-calico.conflist");
    let (mut writes, mut extra) = (0u32, false);
    let mut rss_max = rss0;
    while begun.elapsed() < duration {
        match rng.below(6) {
            0 | 1 => dirs.config("10-calico.conflist", &valid)?,
            2 => dirs.config("10-calico.conflist", &invalid)?,
            // In place: the agent may read an empty or half-written file.
            3 => std::fs::write(&live, &valid[..valid.len() / 2])?,
            4 => std::fs::write(&live, &valid)?,
            _ => {
                if extra {
                    dirs.remove_config("05-extra.conflist")?;
                } else {
                    dirs.config("05-extra.conflist", &invalid)?;
                }
                extra = !extra;
            }
        }
        writes += 1;
        if writes % 50 == 0 {
            rss_max = rss_max.max(agent.rss_kib().unwrap_or(0));
        }
        tokio::time::sleep_until((begun + period * writes).into()).await;
    }
    let flapped = begun.elapsed();
    let cpu = cpu_seconds(pid).context("cpu after")? - cpu0;
    // The final state: the extra file gone, the config valid.
    if extra {
        dirs.remove_config("05-extra.conflist")?;
    }
    dirs.config("10-calico.conflist", &valid)?;
    let last_write = Instant::now();
    let settled = log
        .wait(
            "verified after the last write",
            Duration::from_secs(10),
            verified,
        )
        .await
        .with_context(|| tail(&agent.log(), 40))?;
    let settle = settled.saturating_duration_since(last_write);
    // Stays verified (no late write from the flapping lands after the final one).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let last = log.last().context("node state")?;
    let requests = id.requests(cp, from)?;
    let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
    for r in &requests {
        *kinds.entry(r.kind()).or_default() += 1;
    }
    let writes_api: usize = requests
        .iter()
        .filter(|r| matches!(r.verb.as_str(), "patch" | "update" | "create"))
        .count();
    let transitions = log
        .all()
        .windows(2)
        .filter(|w| w[0].tainted != w[1].tainted)
        .count();
    let rss1 = agent.rss_kib().unwrap_or(0);
    let cpu_share = cpu / flapped.as_secs_f64();
    eprintln!(
        "[faults] flapping: {writes} rewrites in {:.1} s ({:.0}/min); agent CPU {:.2} s = {:.1}% of one core; \
         RSS {rss0} KiB -> max {rss_max} KiB -> {rss1} KiB; {transitions} taint transitions seen; \
         {} API requests ({writes_api} writes): {kinds:?}; final state {:.0} ms after the last write",
        flapped.as_secs_f64(),
        f64::from(writes) * 60.0 / flapped.as_secs_f64(),
        cpu,
        cpu_share * 100.0,
        requests.len(),
        ms(settle),
    );
    ensure!(
        alive(pid) && agent.pid() == Some(pid),
        "the agent died:\n{}",
        tail(&agent.log(), 60)
    );
    ensure!(
        !agent.log().contains("panicked"),
        "the agent panicked:\n{}",
        agent.log()
    );
    ensure!(verified(&last), "final state {last:?}");
    ensure!(
        settle < Duration::from_secs(1),
        "final state only {settle:?} after the last write"
    );
    // Bounds with a wide margin over what was measured (docs/reliability.md): a debug build,
    // a 2-core machine shared with the control plane and the other tests.
    ensure!(
        cpu_share < 0.5,
        "the agent used {:.0}% of a core while flapping",
        cpu_share * 100.0
    );
    ensure!(
        rss1 < rss0 + 16 * 1024,
        "RSS grew from {rss0} KiB to {rss1} KiB"
    );
    ensure!(
        writes_api <= 3 * writes as usize,
        "{writes_api} API writes for {writes} rewrites: writes are not bounded by changes"
    );
    id.remove(&client).await;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Hostile config and bin dir entries
// ---------------------------------------------------------------------------------------

/// One hostile input the agent has answered: what it was, the verdict it showed, and how long
/// that took to show on the Node.
struct Hostile<'a> {
    what: &'a str,
    want: &'a str,
    took: Duration,
}

impl Hostile<'_> {
    /// Undoes the input with `repair`, waits for the Node to say Verified again, records both
    /// times in `report` and the agent's RSS in `rss_max`, and requires the agent's process
    /// `pid` (the one started before the first input) alive.
    async fn repair(
        &self,
        log: &NodeLog,
        agent: &Agent,
        pid: u32,
        repair: impl FnOnce() -> std::io::Result<()>,
        rss_max: &mut u64,
        report: &mut Vec<String>,
    ) -> anyhow::Result<()> {
        let what = self.what;
        *rss_max = (*rss_max).max(agent.rss_kib().unwrap_or(0));
        repair()?;
        let t1 = Instant::now();
        log.wait(
            &format!("verified after removing {what}"),
            Duration::from_secs(10),
            verified,
        )
        .await
        .with_context(|| tail(&agent.log(), 40))?;
        report.push(format!(
            "{what}: {} in {:.0} ms, repaired in {:.0} ms",
            self.want,
            ms(self.took),
            ms(t1.elapsed())
        ));
        ensure!(
            alive(pid),
            "the agent died on {what}:\n{}",
            tail(&agent.log(), 60)
        );
        Ok(())
    }
}

/// Hostile entries against the running daemon, one after the other, each followed by the
/// repair: the node must show the expected reason quickly, return to Verified once the entry
/// is gone, and the agent must stay up with bounded memory.
#[tokio::test]
async fn hostile_entries_in_the_cni_dirs_never_hang_or_bloat_the_daemon() -> anyhow::Result<()> {
    let cp = cp().await;
    let client = cp.client()?;
    let rig = Rig::start(&client, "faults-hostile", |node, dirs| {
        Agent::start(cp, node, dirs, &["--probe-timeout", "500ms"])
    })
    .await?;
    let log = rig.watch_verified(&client).await?;
    let Rig { dirs, agent, .. } = rig;
    let pid = agent.pid().context("pid")?;
    let rss0 = agent.rss_kib().unwrap_or(0);
    let conf = dirs.conf.clone();
    let mut report = Vec::new();
    let mut rss_max = rss0;

    // (name, set up, expected reason while present, remove)
    type Action = Box<dyn Fn(&Path) -> std::io::Result<()>>;
    type Step = (&'static str, Action, &'static str, Action);
    let rm = |name: &'static str| -> Action {
        Box::new(move |d: &Path| std::fs::remove_file(d.join(name)))
    };
    let steps: Vec<Step> = vec![
        (
            "a sparse 8 GiB file sorting first",
            Box::new(|d: &Path| {
                std::fs::File::create(d.join("00-huge.conflist"))?.set_len(8 << 30)
            }),
            "ConfigInvalid",
            rm("00-huge.conflist"),
        ),
        (
            "a sparse 8 GiB file sorting last",
            Box::new(|d: &Path| {
                std::fs::File::create(d.join("99-huge.conflist"))?.set_len(8 << 30)
            }),
            "Verified",
            rm("99-huge.conflist"),
        ),
        (
            "a symlink loop sorting first",
            Box::new(|d: &Path| {
                std::os::unix::fs::symlink("00-loop.conflist", d.join("00-loop.conflist"))
            }),
            "ConfigInvalid",
            rm("00-loop.conflist"),
        ),
        (
            "a symlink to /dev/zero sorting first",
            Box::new(|d: &Path| {
                std::os::unix::fs::symlink("/dev/zero", d.join("00-zero.conflist"))
            }),
            "ConfigInvalid",
            rm("00-zero.conflist"),
        ),
        (
            "a FIFO sorting first",
            Box::new(|d: &Path| {
                nix::unistd::mkfifo(
                    &d.join("00-fifo.conflist"),
                    nix::sys::stat::Mode::from_bits_truncate(0o644),
                )
                .map_err(std::io::Error::from)
            }),
            "ConfigInvalid",
            rm("00-fifo.conflist"),
        ),
        (
            "a directory named like a config, sorting first",
            Box::new(|d: &Path| std::fs::create_dir(d.join("00-dir.conflist"))),
            "Verified",
            Box::new(|d: &Path| std::fs::remove_dir(d.join("00-dir.conflist"))),
        ),
        (
            // readdir order is arbitrary: among 20,000 entries, a reader that caps the raw
            // listing would miss the lone mesh-only file the runtime loads first.
            "20,000 other files plus a mesh-only config sorting first",
            Box::new(|d: &Path| {
                for i in 0..20_000 {
                    std::fs::write(d.join(format!("zz-{i:05}.bak")), b"{}")?;
                }
                std::fs::write(d.join("00-linkerd-cni.conf"), golden("linkerd-only.conf")?)
            }),
            "PrimaryPluginMissing",
            Box::new(|d: &Path| {
                std::fs::remove_file(d.join("00-linkerd-cni.conf"))?;
                for i in 0..20_000 {
                    std::fs::remove_file(d.join(format!("zz-{i:05}.bak")))?;
                }
                Ok(())
            }),
        ),
    ];
    for (what, setup, reason, remove) in &steps {
        setup(&conf)?;
        let t0 = Instant::now();
        let want = *reason;
        let took = if want == "Verified" {
            // Nothing changes: give the agent time to look, then check it still says so.
            tokio::time::sleep(Duration::from_secs(1)).await;
            log.wait(what, Duration::from_secs(5), verified)
                .await
                .with_context(|| tail(&agent.log(), 40))?;
            Duration::ZERO
        } else {
            log.wait(what, Duration::from_secs(10), move |s: &Seen| {
                s.tainted && s.reason.as_deref() == Some(want)
            })
            .await
            .with_context(|| tail(&agent.log(), 40))?;
            t0.elapsed()
        };
        let hostile = Hostile { what, want, took };
        hostile
            .repair(
                &log,
                &agent,
                pid,
                || remove(&conf),
                &mut rss_max,
                &mut report,
            )
            .await?;
    }

    // Plugins: one floods stdout forever, one floods stderr and exits 1, one exits at once
    // but leaves a child holding its stdout open.
    let plugins = [
        (
            "floods stdout forever",
            "#!/bin/sh\nexec yes 0123456789abcdef0123456789abcdef\n",
        ),
        (
            "floods stderr, then fails",
            "#!/bin/sh\nhead -c 50000000 /dev/zero | tr '\\0' x >&2\nexit 1\n",
        ),
        (
            "leaves a child holding stdout",
            "#!/bin/sh\nsleep 60 &\necho '{\"cniVersion\":\"1.0.0\",\"supportedVersions\":[\"0.3.1\"]}'\nexit 0\n",
        ),
    ];
    for (what, script) in plugins {
        let t0 = Instant::now();
        dirs.plugin("linkerd-cni", script)?;
        log.wait(what, Duration::from_secs(10), gated("PluginBinaryBroken"))
            .await
            .with_context(|| format!("plugin that {what}\n{}", tail(&agent.log(), 40)))?;
        let what = format!("a plugin that {what}");
        let hostile = Hostile {
            what: &what,
            want: "PluginBinaryBroken",
            took: t0.elapsed(),
        };
        let fix = || dirs.plugin("linkerd-cni", GOOD_PLUGIN).map(drop);
        hostile
            .repair(&log, &agent, pid, fix, &mut rss_max, &mut report)
            .await?;
    }
    eprintln!(
        "[faults] hostile entries (agent RSS {rss0} KiB at start, max {rss_max} KiB):\n  {}",
        report.join("\n  ")
    );
    ensure!(
        rss_max < rss0 + 32 * 1024,
        "the agent's RSS grew from {rss0} KiB to {rss_max} KiB"
    );
    ensure!(!agent.log().contains("panicked"), "{}", agent.log());
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Vanishing namespaces, unmatched IPs
// ---------------------------------------------------------------------------------------

/// Pods whose namespace is deleted around the moment they start (before, during or after
/// the agent's inspection), and pods whose IP no namespace holds: none is evicted unless its
/// namespace was seen without rules, nothing crashes, and the agent keeps working (control
/// pods in the same run are inspected and evicted as usual).
#[tokio::test]
async fn vanishing_netns_and_unmatched_ips_are_never_evicted_blindly() -> anyhow::Result<()> {
    require_privileges()?;
    let cp = cp().await;
    let client = cp.client()?;
    let mut rng = Rng::new("vanishing");
    let ns = cp.create_namespace(&client, "faults-netns").await?;
    // `_dirs` keeps the CNI dirs (and so the valid config) for the whole test.
    let Rig {
        node,
        agent,
        dirs: _dirs,
    } = Rig::start(&client, "faults-netns", |node, dirs| {
        let flags = [
            "--profile",
            "linkerd",
            "--evict-unowned",
            "--max-evictions-per-minute",
            "100000",
        ];
        Agent::start(cp, node, dirs, &flags)
    })
    .await?;
    agent.wait_ready(WAIT).await?;
    let pid = agent.pid().context("pid")?;
    let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let subnet = private_subnet();
    // An IP range no namespace holds: the next private /24, never populated.
    let ghost = private_subnet();

    let (n_vanish, n_ghost) = if soak() { (60, 40) } else { (24, 12) };
    let mut vanishing: Vec<(String, Ipv4Addr, Option<PodNetns>)> = Vec::new();
    for i in 0..n_vanish {
        let ip = ip_of(subnet, (i + 1) as u8);
        vanishing.push((
            format!("vanish-{i}"),
            ip,
            Some(PodNetns::new(ip, Rules::None)?),
        ));
    }
    let control_missing = PodNetns::new(ip_of(subnet, 200), Rules::None)?;
    let control_ok = PodNetns::new(ip_of(subnet, 201), Rules::Linkerd("iptables-nft"))?;
    for (name, _, _) in &vanishing {
        api.create(&PostParams::default(), &meshed_pod(name, &node)?)
            .await?;
    }
    for i in 0..n_ghost {
        api.create(
            &PostParams::default(),
            &meshed_pod(&format!("ghost-{i}"), &node)?,
        )
        .await?;
    }
    for name in ["control-missing", "control-ok"] {
        api.create(&PostParams::default(), &meshed_pod(name, &node)?)
            .await?;
    }
    let cpu0 = cpu_seconds(pid).context("cpu")?;
    let begun = Instant::now();

    // Start the pods one after the other while their namespaces disappear at random moments
    // over the same span: some before their pod is Running, some while the agent inspects
    // the burst, some after.
    let mut schedule: Vec<(usize, Duration, PodNetns)> = Vec::new();
    for (i, v) in vanishing.iter_mut().enumerate() {
        if let Some(netns) = v.2.take() {
            schedule.push((
                i,
                Duration::from_millis(rng.below(20 * n_vanish as u64)),
                netns,
            ));
        }
    }
    schedule.sort_by_key(|(_, at, _)| *at);
    let t0 = Instant::now();
    let deleter = tokio::task::spawn_blocking(move || {
        let mut deleted = HashMap::new();
        for (i, at, netns) in schedule {
            std::thread::sleep((t0 + at).saturating_duration_since(Instant::now()));
            drop(netns); // `ip netns del`
            deleted.insert(i, Instant::now());
        }
        deleted
    });
    let mut marked: HashMap<usize, Instant> = HashMap::new();
    for (i, (name, ip, _)) in vanishing.iter().enumerate() {
        marked.insert(i, Instant::now());
        meshgate_e2e::mark_pod_running(&client, &ns, name, IpAddr::V4(*ip)).await?;
    }
    let deleted = deleter.await?;
    let gone_before_running: Vec<String> = vanishing
        .iter()
        .enumerate()
        .filter(|(i, _)| deleted[i] < marked[i])
        .map(|(_, v)| v.0.clone())
        .collect();
    for i in 0..n_ghost {
        meshgate_e2e::mark_pod_running(
            &client,
            &ns,
            &format!("ghost-{i}"),
            IpAddr::V4(ip_of(ghost, (i + 1) as u8)),
        )
        .await?;
    }
    meshgate_e2e::mark_pod_running(
        &client,
        &ns,
        "control-missing",
        IpAddr::V4(control_missing.ip),
    )
    .await?;
    meshgate_e2e::mark_pod_running(&client, &ns, "control-ok", IpAddr::V4(control_ok.ip)).await?;

    // The control pod without rules is evicted: the agent is working.
    meshgate_e2e::harness::wait::poll_until("control-missing evicted", WAIT, || async {
        let p = api.get("control-missing").await?;
        anyhow::Ok(p.metadata.deletion_timestamp.is_some().then_some(()))
    })
    .await
    .with_context(|| tail(&agent.log(), 60))?;
    // Unknown pods are retried with backoff: watch a while for an eviction or a busy loop.
    tokio::time::sleep(Duration::from_secs(if soak() { 30 } else { 8 })).await;
    let elapsed = begun.elapsed();
    let cpu = cpu_seconds(pid).context("cpu after")? - cpu0;

    let all = api.list(&Default::default()).await?.items;
    let evicted: Vec<String> = all
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_some())
        .map(ResourceExt::name_any)
        .collect();
    let unknown = agent
        .metric("meshgate_pod_inspections_total{profile=\"linkerd\",verdict=\"unknown\"}")
        .await
        .unwrap_or(0.0);
    let evicted_vanished = evicted.iter().filter(|n| n.starts_with("vanish-")).count();
    eprintln!(
        "[faults] vanishing netns: {n_vanish} pods whose namespace was deleted around their start \
         ({} before Running), {n_ghost} pods with no namespace; evicted: {evicted_vanished} of the vanishing ones \
         (whose namespace still existed when the agent read it), none of the rest; {unknown} unknown \
         inspections; agent CPU {:.2} s over {:.1} s",
        gone_before_running.len(),
        cpu,
        elapsed.as_secs_f64()
    );
    ensure!(alive(pid), "the agent died:\n{}", tail(&agent.log(), 60));
    ensure!(!agent.log().contains("panicked"), "{}", agent.log());
    let blind: Vec<&String> = evicted
        .iter()
        .filter(|n| {
            n.starts_with("ghost-") || gone_before_running.contains(n) || *n == "control-ok"
        })
        .collect();
    ensure!(
        blind.is_empty(),
        "evicted without having read a namespace without rules: {blind:?}\n{}",
        tail(&agent.log(), 60)
    );
    ensure!(
        unknown >= n_ghost as f64,
        "ghost pods are reported unknown ({unknown})"
    );
    // Backoff, not a busy loop: well under a tenth of a core on average.
    ensure!(
        cpu / elapsed.as_secs_f64() < 0.1,
        "agent CPU {cpu:.2} s in {elapsed:?}: a retry loop?"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Webhook load and drain
// ---------------------------------------------------------------------------------------

/// A TCP proxy between the webhook and the apiserver that can stall every byte on demand, so
/// the webhook's API lookups hang (an apiserver that stops answering) while the apiserver
/// itself keeps serving the rest of the suite.
struct StallingProxy {
    addr: SocketAddr,
    stalled: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl StallingProxy {
    async fn start(upstream: SocketAddr) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (stalled, rx) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(async move {
            while let Ok((down, _)) = listener.accept().await {
                let rx = rx.clone();
                tokio::spawn(async move {
                    let Ok(up) = tokio::net::TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (dr, dw) = down.into_split();
                    let (ur, uw) = up.into_split();
                    tokio::join!(pump(dr, uw, rx.clone()), pump(ur, dw, rx));
                });
            }
        });
        Ok(Self {
            addr,
            stalled,
            task,
        })
    }

    fn stall(&self, on: bool) {
        let _ = self.stalled.send(on);
    }
}

impl Drop for StallingProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut stalled: tokio::sync::watch::Receiver<bool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if stalled.wait_for(|s| !*s).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// The admin kubeconfig, pointed at `server` instead of the apiserver (JSON is YAML).
fn kubeconfig_via(cp: &ControlPlane, server: SocketAddr, dir: &Path) -> anyhow::Result<PathBuf> {
    let mut kc = cp.admin_kubeconfig().clone();
    for c in &mut kc.clusters {
        if let Some(cluster) = c.cluster.as_mut() {
            cluster.server = Some(format!("https://{server}"));
        }
    }
    let path = dir.join("via-proxy.kubeconfig");
    std::fs::write(&path, serde_json::to_vec(&kc)?)?;
    Ok(path)
}

fn admission_total(metrics: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("meshgate_admission_reviews_total{"))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// 5,000 reviews/s (release build; 1,000/s in the debug build) for 10 s (60 s in soak), open
/// loop, over 32 keep-alive TLS connections: zero errors, every answer right, served at the
/// offered rate without a queue building up. Then the webhook's API lookups are stalled, 40
/// reviews that need a lookup are sent (each now waits for its bounded lookups), and the
/// webhook (`--shutdown-delay 500ms`) gets SIGTERM while they and a background load are in
/// flight: `/ready` answers 503 at once while the background reviews are still answered for
/// the delay; every background review sent up to the drain (SIGTERM + delay, less a small
/// margin) is answered right; the stalled reviews, still in flight when the drain starts, are
/// answered right; and the process exits 0 once they are answered (within 1.5 s of the last),
/// its log saying the drain completed rather than timed out.
#[tokio::test]
async fn webhook_sustains_load_then_drains_in_flight_reviews_on_sigterm() -> anyhow::Result<()> {
    let cp = cp().await;
    let client = cp.client()?;
    let ns = cp.create_namespace(&client, "faults-load").await?;
    let tag = unique_name("load");
    let nodes: Api<Node> = Api::all(client.clone());
    // The names `review::create_nodes` gives: known up front, so the cleanup below deletes
    // whichever of them were created, even when a step fails half-way.
    let good: Vec<String> = (0..20).map(|i| format!("{tag}-v-{i}")).collect();
    let bad: Vec<String> = (0..20).map(|i| format!("{tag}-u-{i}")).collect();
    // Short, so the test stays short; long enough to see `/ready` turn and reviews answered.
    let delay = Duration::from_millis(500);
    let cleanup = async {
        for n in good.iter().chain(&bad) {
            let _ =
                tokio::time::timeout(API_TIMEOUT, nodes.delete(n, &DeleteParams::default())).await;
        }
    };
    let result = async {
        review::create_nodes(&client, &tag, good.len(), bad.len(), 8).await?;
        // A pending meshed pod: bindings of it are answered from the webhook's pod cache.
        let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
        let pending: Pod = serde_json::from_value(json!({
            "metadata": {"name": "pending", "labels": {MESH_LABEL: "linkerd"}},
            "spec": {"schedulerName": "nobody", "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]}
        }))?;
        meshgate_e2e::harness::wait::api("creating the pending pod", pods.create(&PostParams::default(), &pending)).await?;

        let dir = tempfile::tempdir()?;
        let apiserver: SocketAddr = cp.apiserver_url().trim_start_matches("https://").parse()?;
        let proxy = StallingProxy::start(apiserver).await?;
        let kubeconfig = kubeconfig_via(cp, proxy.addr, dir.path())?;
        // Each stalled review waits for a bounded lookup: 2 s (not the default 1 s) so they
        // are still in flight, with a second to spare, when the drain starts at SIGTERM +
        // delay. The request deadline stays above two lookups (a refusal may look up the node
        // too). The pod lookup limits are raised so that all 40 lookups are made (the
        // defaults, 20 a second and 8 at once, would refuse most of them at once: that is
        // `abuse_pods::forged_binding_reviews_cost_the_apiserver_at_most_the_lookup_rate`).
        let mut webhook = WebhookProcess::start(
            &kubeconfig,
            &[
                "--shutdown-delay", "500ms", "--lookup-timeout", "2s", "--request-timeout", "6s",
                "--pod-lookups-per-second", "1000", "--max-pod-lookups-in-flight", "64",
            ],
        )?;
        webhook.wait_ready(Duration::from_secs(60)).await?;
        // The cache has every node once its labels answer as expected.
        let connector = review::tls_connector(&webhook.ca_der)?;
        let mut reviews: Vec<Review> = Vec::new();
        for i in 0..400 {
            let (g, b) = (&good[i % good.len()], &bad[i % bad.len()]);
            let uid = format!("{tag}-{i}");
            reviews.push(match i % 10 {
                0..=3 => review::pod_review(&uid, g, true, true),
                4..=6 => review::pod_review(&uid, b, true, false),
                7 | 8 => review::pod_review(&uid, b, false, true),
                _ => review::binding_review(&uid, &ns, "pending", b, false),
            });
        }
        let reviews = Arc::new(reviews);
        // Warm up until the caches answer every kind right.
        meshgate_e2e::harness::wait::poll_until("the webhook's caches to hold the test's nodes and pod", WAIT, || async {
            let r = review::run(review::Spec {
                addr: webhook.listen,
                path: "/validate".into(),
                connector: connector.clone(),
                reviews: reviews.clone(),
                rate: 400.0,
                duration: Duration::from_millis(250),
                connections: 4,
            })
            .await?;
            anyhow::Ok((r.errors().is_empty() && !r.samples.is_empty()).then_some(()))
        })
        .await?;

        let before = admission_total(&webhook.admin_get("/metrics").await.context("metrics")?.1);
        // 5,000/s is the goal for the release build (`make soak` and `make bench` use it). The
        // debug build `make test` runs is several times slower on both ends of the
        // connection, so it is offered what it can serve: the same no-error criteria hold.
        let rate: f64 = std::env::var("MESHGATE_WEBHOOK_LOAD_RATE")
            .ok()
            .and_then(|r| r.parse().ok())
            .unwrap_or(if cfg!(debug_assertions) { 1000.0 } else { 5000.0 });
        let duration = Duration::from_secs(if soak() { 60 } else { 10 });
        let report = review::run(review::Spec {
            addr: webhook.listen,
            path: "/validate".into(),
            connector: connector.clone(),
            reviews: reviews.clone(),
            rate,
            duration,
            connections: 32,
        })
        .await?;
        let after = admission_total(&webhook.admin_get("/metrics").await.context("metrics")?.1);
        let (rss, hwm) = webhook.rss_kib().unwrap_or((0, 0));
        eprintln!(
            "[faults] webhook load: offered {rate:.0}/s for {duration:?}: {}; server counted {} reviews; RSS {rss} KiB (peak {hwm} KiB)",
            report.summary(),
            after - before,
        );
        let errors = report.errors();
        ensure!(
            errors.is_empty(),
            "{} of {} requests failed or were answered wrong; first: {:?}",
            errors.len(),
            report.samples.len(),
            errors.first()
        );
        let expected = rate * duration.as_secs_f64();
        ensure!(
            report.samples.len() as f64 >= expected * 0.99,
            "only {} of {expected} requests were sent: the generator could not keep up",
            report.samples.len()
        );
        ensure!(after - before == report.samples.len() as f64, "the webhook counted {} reviews for {} requests", after - before, report.samples.len());
        // Kept up: answered at the offered rate, without a queue building up. That is a
        // speed claim, so it is asserted in the soak run (release build, nothing else on the
        // machine); in `make test` the rest of the e2e suite shares the 2 cores, and the
        // figure above is reported, not asserted (speed is measured by `make bench`).
        if soak() {
            ensure!(
                report.throughput() >= rate * 0.95,
                "served {:.0}/s of the {rate:.0}/s offered: {}",
                report.throughput(),
                report.summary()
            );
            ensure!(
                report.latency(0.99) < Duration::from_millis(500),
                "a queue built up at {rate:.0}/s: {}",
                report.summary()
            );
        }

        // Drain: stall the API, send reviews that need lookups, SIGTERM while they wait.
        proxy.stall(true);
        let mut slow = Vec::new();
        for i in 0..40 {
            let uid = format!("{tag}-slow-{i}");
            // A binding of a pod the cache does not hold, to an unverified node: the pod is
            // looked up (stalled, bounded by --lookup-timeout 2 s), then refused.
            slow.push(review::binding_review(&uid, &ns, &format!("absent-{i}"), &bad[i % bad.len()], false));
        }
        let slow_load = tokio::spawn(review::run(review::Spec {
            addr: webhook.listen,
            path: "/validate".into(),
            connector: connector.clone(),
            reviews: Arc::new(slow),
            rate: 400.0,
            duration: Duration::from_millis(100),
            connections: 40,
        }));
        // Allowed reviews only: a refusal looks up the node's condition reason (its message
        // names it), which now stalls for the 2 s lookup timeout and would hold a background
        // connection through most of the delay.
        let allowed: Vec<Review> = reviews.iter().filter(|r| r.allowed).cloned().collect();
        let background = tokio::spawn(review::run(review::Spec {
            addr: webhook.listen,
            path: "/validate".into(),
            connector: connector.clone(),
            reviews: Arc::new(allowed),
            rate: 1000.0,
            duration: Duration::from_secs(3),
            connections: 8,
        }));
        tokio::time::sleep(Duration::from_millis(400)).await;
        let term = webhook.sigterm().context("SIGTERM")?;
        // The kubelet's readiness probe, polled right after the signal: 503 within the delay,
        // while the process still lives (`/live`).
        let mut unready = None;
        while unready.is_none() && term.elapsed() < delay {
            if let Some((503, _)) = webhook.admin_get("/ready").await {
                unready = Some(Instant::now());
            } else {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        let live_in_delay = webhook.admin_get("/live").await.map(|(code, _)| code);
        let live_checked = term.elapsed();
        // The exit is awaited while the loads still run in their own tasks (the background
        // one outlasts the drain), so `exited` is the process's exit, polled every 10 ms.
        let exit = webhook.wait_exit(Duration::from_secs(30)).await;
        let exited = term.elapsed();
        let slow = slow_load.await??;
        let background = background.await??;
        proxy.stall(false);
        let log = webhook.log();

        // The drain starts at SIGTERM + delay (a little later, counting the signal's delivery).
        let drain = term + delay;
        let in_flight: Vec<_> = slow.samples.iter().filter(|s| s.sent < term).collect();
        let slow_wrong: Vec<_> = in_flight.iter().filter(|s| s.outcome != Outcome::Right).collect();
        let slowest = in_flight.iter().map(|s| s.done.saturating_duration_since(s.sent)).max().unwrap_or_default();
        // Answered 500 ms or more after the drain began: they were in flight when it did.
        // Each waits for the 2 s lookup timeout from when it was sent, ≥ 400 ms before
        // SIGTERM, so they are answered ~1 s after the drain began.
        let answered_in_drain = in_flight.iter().filter(|s| s.done > drain + Duration::from_millis(500)).count();
        let first_slow_answer = in_flight.iter().map(|s| s.done.saturating_duration_since(drain)).min().unwrap_or_default();
        let last_slow_answer = in_flight.iter().map(|s| s.done.saturating_duration_since(drain)).max().unwrap_or_default();
        // The process exits once the drain is done: when the last in-flight review is answered
        // (after the delay), plus its shutdown, within a margin for a loaded machine. A drain
        // that waited for its 20 s timeout instead fails this (and the log check below).
        let exit_bound = delay + last_slow_answer + Duration::from_millis(1500);
        // Background requests sent at least `margin` before the drain reached the server
        // before the listener closed (the client still has to connect, since every answer
        // during the delay closes its connection); later ones race the close and are
        // reported, not judged.
        let margin = Duration::from_millis(20);
        let bg_judged: Vec<_> = background.samples.iter().filter(|s| s.sent + margin < drain).collect();
        let bg_judged_wrong: Vec<_> = bg_judged.iter().filter(|s| s.outcome != Outcome::Right).collect();
        let bg_in_delay = bg_judged.iter().filter(|s| s.sent >= term).count();
        let bg_while_unready = unready.map_or(0, |u| {
            bg_judged.iter().filter(|s| s.sent >= u && s.outcome == Outcome::Right).count()
        });
        let bg_after: Vec<_> = background.samples.iter().filter(|s| s.sent >= drain).collect();
        let bg_after_failed = bg_after.iter().filter(|s| matches!(s.outcome, Outcome::Failed(_))).count();
        let signed_ms = |t: Instant| if t >= drain { ms(t - drain) } else { -ms(drain - t) };
        let last_right = background.samples.iter().filter(|s| s.outcome == Outcome::Right).map(|s| s.sent).max();
        let first_failed = background.samples.iter().filter(|s| s.outcome != Outcome::Right).map(|s| s.sent).min();
        eprintln!(
            "[faults] webhook drain (--shutdown-delay {delay:?}): /ready 503 {} after SIGTERM, /live {live_in_delay:?} at {:.0} ms; \
             {} reviews waiting on stalled lookups at SIGTERM, each answered up to {:.0} ms after it was sent (the first {:.0} ms and the last {:.0} ms after the drain began, {} of them ≥ 500 ms after), {} wrong; \
             background: {} sent before the drain less {margin:?} ({} wrong; {} of them during the delay, {} answered right after /ready turned 503), \
             last answered one sent {} ms from the drain, first failure sent {} ms from it; {} sent after the drain ({} refused by the closed listener); \
             exit {:?} {:.0} ms after SIGTERM (bound {:.0} ms), log drained: {}, drain timed out: {}",
            unready.map_or("never".to_string(), |u| format!("{:.0} ms", ms(u - term))),
            ms(live_checked),
            in_flight.len(),
            ms(slowest),
            ms(first_slow_answer),
            ms(last_slow_answer),
            answered_in_drain,
            slow_wrong.len(),
            bg_judged.len(),
            bg_judged_wrong.len(),
            bg_in_delay,
            bg_while_unready,
            last_right.map_or("-".to_string(), |t| format!("{:+.0}", signed_ms(t))),
            first_failed.map_or("-".to_string(), |t| format!("{:+.0}", signed_ms(t))),
            bg_after.len(),
            bg_after_failed,
            exit,
            ms(exited),
            ms(exit_bound),
            log.contains("drained"),
            log.contains("drain timed out"),
        );
        ensure!(unready.is_some(), "/ready did not answer 503 within the {delay:?} delay\n{}", tail(&webhook.log(), 30));
        ensure!(live_in_delay == Some(200), "/live answered {live_in_delay:?} during the delay");
        ensure!(live_checked < delay, "/live was checked {:.0} ms after SIGTERM, after the {delay:?} delay ended", ms(live_checked));
        ensure!(bg_while_unready > 0, "no review was answered while /ready said 503: the webhook stopped serving at the signal");
        ensure!(in_flight.len() == 40, "all 40 slow reviews were sent before SIGTERM: {}", in_flight.len());
        ensure!(slow_wrong.is_empty(), "in-flight reviews failed during the drain: {slow_wrong:?}\n{}", tail(&webhook.log(), 30));
        ensure!(answered_in_drain == 40, "only {answered_in_drain} of 40 stalled reviews were answered ≥ 500 ms after the drain began");
        ensure!(bg_judged_wrong.is_empty(), "{} of {} reviews sent before the drain failed; first: {:?}", bg_judged_wrong.len(), bg_judged.len(), bg_judged_wrong.first());
        ensure!(exit == Some(0), "webhook exit status {exit:?}\n{}", tail(&log, 30));
        ensure!(
            exited <= exit_bound,
            "exited {:.0} ms after SIGTERM, later than the delay + the last stalled answer + 1.5 s ({:.0} ms)\n{}",
            ms(exited),
            ms(exit_bound),
            tail(&log, 30)
        );
        ensure!(log.contains("drained") && !log.contains("drain timed out"), "the drain did not complete\n{}", tail(&log, 30));
        anyhow::Ok(())
    }
    .await;
    cleanup.await;
    result
}
