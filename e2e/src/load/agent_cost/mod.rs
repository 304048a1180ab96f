//! What a fleet of real agents costs the apiserver: N stand-in Nodes, each with its own CNI
//! dirs and a real `meshgate-agent run` process, all under one audited identity, and the
//! apiserver's record of their requests cut into windows.
//!
//! In: a [`ControlPlane`], the kubeconfig of an [`AuditedIdentity`] every agent runs as, N,
//! and the host's room ([`Room`]: memory, inotify instances). Out: a verified [`Fleet`]
//! (as many agents as fit, and why it stopped short if it did); its cost in a steady window
//! ([`Steady`]: requests by kind, open watches per agent, bytes received), per transition of
//! one node ([`Transition`]) and after an apiserver restart ([`Reconnect`]: requests per
//! second, when every watch was back, when the burst ended), and a fleet-wide event
//! ([`event::FleetEvent`]: every chain broken and mended at once). Shared by `make bench`'s
//! `agents` section and the e2e test `agents_cost`.
//!
//! What the simulation shares that real nodes would not: one host and its CPUs (N agents
//! and the control plane compete for them), one loopback apiserver (no network latency, no
//! load balancer), one clock (agents started in the same second stay in phase), and the
//! kubelet stand-in's Lease renewals, which run as the admin and are not counted.

pub mod event;
pub mod socket;
pub mod tally;

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, bail};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::api::{Api, ListParams};

use crate::ControlPlane;
use crate::harness::audit::{AuditedIdentity, Request};
use crate::sim::kubelet::NodeSpec;
use crate::sim::node::{Agent, CniDirs, tainted, verified_label};

/// The label that marks a fleet's Nodes, valued with its prefix.
pub const FLEET_LABEL: &str = "e2e.meshgate.io/fleet";

/// The config file every fleet node's CNI chain is in.
pub const CONFLIST: &str = "10-calico.conflist";

/// How long a batch of agents may take to verify their Nodes.
const VERIFY_TIMEOUT: Duration = Duration::from_secs(180);

/// The host's room for agents: what must stay free while they start.
#[derive(Clone, Copy, Debug)]
pub struct Room {
    /// Memory left to everything else (the control plane, other work on the host), KiB.
    pub reserve_kib: u64,
    /// Agents started, and verified, at a time.
    pub batch: usize,
    /// Whether each agent takes an inotify instance (not with `--fs-watch=poll`), so the
    /// host user's `fs.inotify.max_user_instances` bounds how many start.
    pub inotify: bool,
}

/// One simulated node: its name, CNI dirs and agent process.
pub struct Member {
    /// The Node's name.
    pub name: String,
    /// Its CNI dirs (a valid chain with linkerd-cni while verified).
    pub dirs: CniDirs,
    /// Its agent.
    pub agent: Agent,
}

/// N stand-in Nodes, each verified by its own agent process.
pub struct Fleet {
    /// The nodes, in start order.
    pub members: Vec<Member>,
    /// Why fewer than asked were started, if so.
    pub short: Option<String>,
    /// When the first agent was started.
    pub since: SystemTime,
    /// How long starting and verifying them all took.
    pub started_in: Duration,
    prefix: String,
}

impl Fleet {
    /// Registers up to `n` Nodes named `<prefix>-<index>` and starts an agent for each with
    /// `kubeconfig` and `extra` flags, `room.batch` at a time, each batch verified before the
    /// next; stops early when the next batch would not fit in `room`.
    pub async fn start(
        cp: &ControlPlane,
        client: &Client,
        kubeconfig: &Path,
        prefix: &str,
        n: usize,
        room: Room,
        extra: &[&str],
    ) -> anyhow::Result<Self> {
        let valid = crate::sim::node::golden("calico-linkerd.conflist")?;
        let (since, began) = (SystemTime::now(), Instant::now());
        let mut fleet = Self {
            members: Vec::with_capacity(n),
            short: None,
            since,
            started_in: Duration::ZERO,
            prefix: prefix.to_owned(),
        };
        while fleet.members.len() < n {
            let batch = room.batch.min(n - fleet.members.len());
            if let Some(why) = fleet.no_room(room, batch) {
                fleet.short = Some(why);
                break;
            }
            let first = fleet.members.len();
            let names: Vec<String> = (first..first + batch)
                .map(|i| format!("{prefix}-{i:05}"))
                .collect();
            register(cp, client, prefix, &names).await?;
            for name in names {
                let dirs = CniDirs::new()?;
                dirs.config(CONFLIST, &valid)?;
                let agent = Agent::start_with_kubeconfig(kubeconfig, &name, &dirs, extra)
                    .with_context(|| format!("starting the agent of {name}"))?;
                fleet.members.push(Member { name, dirs, agent });
            }
            fleet.wait_verified(client, fleet.members.len()).await?;
        }
        fleet.started_in = began.elapsed();
        Ok(fleet)
    }

    /// Why `batch` more agents would not fit, if they would not: memory (each needs the
    /// largest RSS seen so far, 20 MiB before any) or inotify instances (per user, when the
    /// agents use inotify).
    fn no_room(&self, room: Room, batch: usize) -> Option<String> {
        let per_agent = self.rss_kib().into_iter().max().unwrap_or(20 * 1024);
        let available = host::mem_available_kib().unwrap_or(0);
        let need = per_agent * batch as u64 + room.reserve_kib;
        if available < need {
            return Some(format!(
                "memory: {} MiB available, {batch} more agents of {} MiB each and {} MiB kept free need {} MiB",
                available / 1024,
                per_agent / 1024,
                room.reserve_kib / 1024,
                need / 1024
            ));
        }
        if !room.inotify {
            return None;
        }
        let per_agent = self
            .members
            .first()
            .and_then(|m| m.agent.pid())
            .map_or(1, host::inotify_instances)
            .max(1);
        let (used, max) = (host::inotify_in_use(), host::inotify_max());
        (used + per_agent * batch > max).then(|| {
            format!(
                "inotify: fs.inotify.max_user_instances is {max}, {used} in use, each agent takes {per_agent}"
            )
        })
    }

    /// Waits until `count` of the fleet's Nodes are verified (label true, no taint).
    pub async fn wait_verified(&self, client: &Client, count: usize) -> anyhow::Result<()> {
        let end = Instant::now() + VERIFY_TIMEOUT;
        loop {
            let verified = self.verified(client).await?;
            if verified >= count {
                return Ok(());
            }
            if Instant::now() > end {
                let log = self
                    .members
                    .last()
                    .map(|m| m.agent.log())
                    .unwrap_or_default();
                bail!(
                    "{verified} of {count} Nodes verified within {VERIFY_TIMEOUT:?}; the last agent's log:\n{}",
                    crate::sim::node::tail(&log, 30)
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// How many of the fleet's Nodes are verified now.
    pub async fn verified(&self, client: &Client) -> anyhow::Result<usize> {
        Ok(self.gates(client).await?.1)
    }

    /// How many of the fleet's Nodes are gated (tainted, label false) and verified now.
    pub async fn gates(&self, client: &Client) -> anyhow::Result<(usize, usize)> {
        let nodes = self.nodes(client).await?;
        let count = |gated: bool| {
            let label = if gated { "false" } else { "true" };
            nodes
                .iter()
                .filter(|n| tainted(n) == gated && verified_label(n) == Some(label))
                .count()
        };
        Ok((count(true), count(false)))
    }

    async fn nodes(&self, client: &Client) -> anyhow::Result<Vec<Node>> {
        let nodes: Api<Node> = Api::all(client.clone());
        let lp = ListParams::default().labels(&format!("{FLEET_LABEL}={}", self.prefix));
        let list = crate::harness::wait::api("listing the fleet's Nodes", nodes.list(&lp)).await?;
        Ok(list.items)
    }

    /// The Nodes' names.
    pub fn names(&self) -> Vec<String> {
        self.members.iter().map(|m| m.name.clone()).collect()
    }

    /// The agents' process ids.
    pub fn pids(&self) -> HashSet<u32> {
        self.members.iter().filter_map(|m| m.agent.pid()).collect()
    }

    /// The CPU time all agents have used so far (user and system).
    pub fn cpu(&self) -> Duration {
        self.members
            .iter()
            .filter_map(|m| host::cpu(m.agent.pid()?))
            .sum()
    }

    /// Each agent's resident set size, KiB.
    pub fn rss_kib(&self) -> Vec<u64> {
        self.members
            .iter()
            .filter_map(|m| m.agent.rss_kib())
            .collect()
    }
}

/// Registers the Nodes (labelled with the fleet's prefix), a few at a time.
async fn register(
    cp: &ControlPlane,
    client: &Client,
    prefix: &str,
    names: &[String],
) -> anyhow::Result<()> {
    let done: Vec<Result<Node, crate::Error>> = futures::stream::iter(names)
        .map(|name| async move {
            let spec = NodeSpec::new(name).label(FLEET_LABEL, prefix);
            cp.register_node(client, &spec).await
        })
        .buffer_unordered(8)
        .collect()
        .await;
    for d in done {
        d.context("registering a fleet Node")?;
    }
    Ok(())
}

/// The fleet's requests in a window with nothing changing.
pub struct Steady {
    /// When the window began.
    pub from: SystemTime,
    /// The window's length.
    pub span: Duration,
    /// The agents' requests received in it.
    pub requests: Vec<Request>,
    /// The agents' watches open at its end, by kind.
    pub open: BTreeMap<String, usize>,
    /// Each node's open watches that name it (by resource).
    pub open_by_node: BTreeMap<String, Vec<String>>,
    /// Bytes the agents received over their connections to the apiserver in it.
    pub bytes: u64,
}

impl Steady {
    /// Counts the agents' requests over `span` from now.
    pub async fn measure(
        cp: &ControlPlane,
        id: &AuditedIdentity,
        fleet: &Fleet,
        span: Duration,
    ) -> anyhow::Result<Self> {
        let (port, pids) = (cp.ports().apiserver, fleet.pids());
        let before = socket::read(port, &pids).await?;
        let from = SystemTime::now();
        tokio::time::sleep(span).await;
        let to = SystemTime::now();
        let after = socket::read(port, &pids).await?;
        let all = id.requests(cp, fleet.since)?;
        let requests: Vec<Request> = all
            .iter()
            .filter(|r| r.received >= from && r.received < to)
            .cloned()
            .collect();
        let open_now: Vec<Request> = all.into_iter().filter(|r| r.received < to).collect();
        Ok(Self {
            from,
            span,
            requests,
            open: tally::open_watches(&open_now),
            open_by_node: tally::open_watches_by_node(&open_now, &fleet.names()),
            bytes: socket::received_between(&before, &after),
        })
    }

    /// `count` per minute per agent, over the window.
    pub fn per_agent_per_min(&self, agents: usize, count: f64) -> f64 {
        count * 60.0 / self.span.as_secs_f64() / agents.max(1) as f64
    }

    /// The busiest second of the window: a reconnect's burst is over once no second is
    /// busier.
    pub fn busiest_second(&self) -> usize {
        let secs = self.span.as_secs().max(1) as usize;
        let buckets = tally::per_second(&self.requests, self.from, secs);
        buckets.into_iter().max().unwrap_or(0)
    }
}

/// One node's round trip: its chain loses the mesh plugin (re-taint), then gets it back
/// (untaint); the agents' requests during each half.
pub struct Transition {
    /// Requests from the write of the broken chain until `tail` after the taint was seen.
    pub retaint: Vec<Request>,
    /// Requests from the write of the good chain until `tail` after the untaint was seen.
    pub untaint: Vec<Request>,
}

impl Transition {
    /// Breaks and mends `member`'s chain with `(invalid, valid)` configs; counts requests up
    /// to `tail` after each Node change is seen (the Events and writes that follow it).
    pub async fn run(
        cp: &ControlPlane,
        client: &Client,
        id: &AuditedIdentity,
        member: &Member,
        (invalid, valid): (&[u8], &[u8]),
        tail: Duration,
    ) -> anyhow::Result<Self> {
        let t0 = SystemTime::now();
        member.dirs.config(CONFLIST, invalid)?;
        until_tainted(client, &member.name, true).await?;
        tokio::time::sleep(tail).await;
        let t1 = SystemTime::now();
        member.dirs.config(CONFLIST, valid)?;
        until_tainted(client, &member.name, false).await?;
        tokio::time::sleep(tail).await;
        let t2 = SystemTime::now();
        let all = id.requests(cp, t0)?;
        let between = |a: SystemTime, b: SystemTime| -> Vec<Request> {
            all.iter()
                .filter(|r| r.received >= a && r.received < b)
                .cloned()
                .collect()
        };
        Ok(Self {
            retaint: between(t0, t1),
            untaint: between(t1, t2),
        })
    }
}

/// Polls the Node (as the admin, not counted) until its taint is `want`, up to 30 s.
async fn until_tainted(client: &Client, node: &str, want: bool) -> anyhow::Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        let n = crate::harness::wait::api("reading a fleet Node", nodes.get(node)).await?;
        if tainted(&n) == want && verified_label(&n) == Some(if want { "false" } else { "true" }) {
            return Ok(());
        }
        if Instant::now() > end {
            bail!("{node}: taint not {want} within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The fleet's reconnect after the apiserver was stopped and started again.
pub struct Reconnect {
    /// How long the apiserver was down.
    pub down: Duration,
    /// The agents' requests from its return (ready) on, over the observed window.
    pub requests: Vec<Request>,
    /// Those requests per second from its return.
    pub per_second: Vec<usize>,
    /// When the agents had as many watches open as before the restart, from its return.
    pub rewatched: Option<Duration>,
    /// The end of the last second above the steady rate, from its return.
    pub settled: Duration,
}

impl Reconnect {
    /// Stops the apiserver for `down`, starts it again, and follows the agents for `observe`:
    /// `watches` is how many they had open before, `steady` the requests per second above
    /// which a second counts as part of the burst.
    pub async fn run(
        cp: &ControlPlane,
        id: &AuditedIdentity,
        watches: usize,
        (down, observe): (Duration, Duration),
        steady: usize,
    ) -> anyhow::Result<Self> {
        cp.stop_apiserver();
        tokio::time::sleep(down).await;
        cp.start_apiserver()
            .await
            .context("starting the apiserver again")?;
        let (back, began) = (SystemTime::now(), Instant::now());
        let mut rewatched = None;
        while began.elapsed() < observe {
            tokio::time::sleep(Duration::from_millis(500)).await;
            if rewatched.is_none() {
                let since = id.requests(cp, back)?;
                let open: usize = tally::open_watches(&since).values().sum();
                if open >= watches {
                    rewatched = Some(began.elapsed());
                }
            }
        }
        let requests = id.requests(cp, back)?;
        let per_second = tally::per_second(&requests, back, observe.as_secs() as usize);
        let settled = tally::settled(&per_second, steady);
        Ok(Self {
            down,
            requests,
            per_second,
            rewatched,
            settled,
        })
    }

    /// The largest number of requests in one second.
    pub fn peak(&self) -> usize {
        tally::peak(&self.per_second)
    }
}

/// The host's limits on how many agents fit.
pub mod host {
    /// `MemAvailable` from /proc/meminfo, KiB.
    pub fn mem_available_kib() -> Option<u64> {
        let text = std::fs::read_to_string("/proc/meminfo").ok()?;
        text.lines().find_map(|l| {
            l.strip_prefix("MemAvailable:")?
                .trim()
                .strip_suffix("kB")?
                .trim()
                .parse()
                .ok()
        })
    }

    /// The CPU time process `pid` has used (utime + stime of /proc/<pid>/stat).
    pub fn cpu(pid: u32) -> Option<std::time::Duration> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // After the command's closing parenthesis: field 3 (state) onwards; utime and stime
        // are fields 14 and 15.
        let rest = stat.rsplit_once(')')?.1;
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let ticks: u64 =
            fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
        let per_second = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
            .ok()
            .flatten()
            .filter(|&t| t > 0)? as u64;
        Some(std::time::Duration::from_millis(ticks * 1000 / per_second))
    }

    /// `fs.inotify.max_user_instances` (128 when unreadable, the kernel's default).
    pub fn inotify_max() -> usize {
        std::fs::read_to_string("/proc/sys/fs/inotify/max_user_instances")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(128)
    }

    /// The inotify instances process `pid` holds.
    pub fn inotify_instances(pid: u32) -> usize {
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            return 0;
        };
        fds.flatten()
            .filter(|fd| {
                std::fs::read_link(fd.path()).is_ok_and(|l| l.as_os_str() == "anon_inode:inotify")
            })
            .count()
    }

    /// The inotify instances held by this user's processes (all of them: the limit is per
    /// user).
    pub fn inotify_in_use() -> usize {
        let me = nix::unistd::geteuid().as_raw();
        let Ok(procs) = std::fs::read_dir("/proc") else {
            return 0;
        };
        procs
            .flatten()
            .filter_map(|p| p.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| {
                use std::os::unix::fs::MetadataExt;
                std::fs::metadata(format!("/proc/{pid}")).is_ok_and(|m| m.uid() == me)
            })
            .map(inotify_instances)
            .sum()
    }
}
