//! Pod inspection and eviction by the real agent process against the real apiserver, with
//! real network namespaces and real netfilter rules on this machine.
//!
//! Every pod's IP is the address of a network namespace the test created (`ip netns add`, a
//! /32 on its loopback from a private /24 of the test's own); some namespaces hold linkerd's
//! redirect rules (written by `iptables-nft` or `iptables-legacy`), others hold none. Pods are
//! bound to the test's Node with `spec.nodeName` and moved to Running as the kubelet would.
//! The agent runs for that Node with a verified CNI config and must: evict only the pods
//! whose rules are missing (their ReplicaSet recreates them, into namespaces with rules),
//! respect PodDisruptionBudgets, report bare pods without evicting them, evict nothing in
//! dry-run, hold its rate limit, and never evict again after a restart.
//!
//! Needs root and `ip`, `iptables-nft`, `iptables-legacy` (e2e/install-deps.sh installs them).

use crate::support::{Agent, CniDirs, golden};
use crate::{WAIT, cp};
use anyhow::{Context, bail, ensure};
use k8s_openapi::api::apps::v1::ReplicaSet;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use meshgate_e2e::harness::wait::poll_until;
use meshgate_e2e::sim::netns::{PodNetns, Rules, private_subnet, require_privileges};
use meshgate_e2e::sim::node::{GOOD_PLUGIN, plain, tail};
use meshgate_e2e::sim::pod;
use meshgate_e2e::sim::pod::{LINKERD_PROXY, MESH_LABEL, meshed_pod};
use meshgate_e2e::{ControlPlane, NodeSpec, unique_name};
use serde_json::json;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

mod eviction;
mod fleet_budget;
mod fleet_event;
mod mode;
mod report;

// ---------------------------------------------------------------------------------------
// Network namespaces
// ---------------------------------------------------------------------------------------

/// The namespaces of one test, and which pod gets which one.
pub(crate) struct Plan {
    subnet: [u8; 3],
    next_host: u8,
    netns: Vec<PodNetns>,
    /// Per pod group (the `app` label, or the pod name for bare pods): IPs handed out in
    /// order, so a ReplicaSet's first pods land in one kind of namespace and its
    /// replacements in another.
    queues: HashMap<String, VecDeque<IpAddr>>,
}

impl Plan {
    pub(crate) fn new() -> anyhow::Result<Self> {
        require_privileges()?;
        Ok(Self {
            subnet: private_subnet(),
            next_host: 1,
            netns: Vec::new(),
            queues: HashMap::new(),
        })
    }

    /// Creates `count` namespaces with `rules` and queues their IPs for `group`.
    pub(crate) fn add(
        &mut self,
        group: &str,
        count: usize,
        rules: Rules,
    ) -> anyhow::Result<Vec<IpAddr>> {
        let mut ips = Vec::new();
        for _ in 0..count {
            let [a, b, c] = self.subnet;
            let ip = Ipv4Addr::new(a, b, c, self.next_host);
            self.next_host += 1;
            self.netns.push(PodNetns::new(ip, rules)?);
            ips.push(IpAddr::V4(ip));
        }
        self.queues
            .entry(group.to_owned())
            .or_default()
            .extend(ips.iter().copied());
        Ok(ips)
    }

    /// The kubelet stand-in's IP source: each pod gets the next IP of its group, once (a
    /// pod seen twice before it runs keeps its IP).
    pub(crate) fn ip_source(&mut self) -> impl Fn(&Pod) -> Option<IpAddr> + Send + Sync + 'static {
        let queues = Mutex::new(std::mem::take(&mut self.queues));
        let given: Mutex<HashMap<String, IpAddr>> = Mutex::new(HashMap::new());
        move |pod: &Pod| {
            let uid = pod.uid()?;
            let mut given = given.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(ip) = given.get(&uid) {
                return Some(*ip);
            }
            let group = pod
                .labels()
                .get("app")
                .cloned()
                .unwrap_or_else(|| pod.name_any());
            let ip = queues
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_mut(&group)?
                .pop_front()?;
            given.insert(uid, ip);
            Some(ip)
        }
    }

    fn names(&self) -> Vec<String> {
        self.netns
            .iter()
            .map(|n| format!("{}={}", n.name, n.ip))
            .collect()
    }
}

// ---------------------------------------------------------------------------------------
// Cluster objects
// ---------------------------------------------------------------------------------------

/// A ReplicaSet of `replicas` meshed pause pods bound to `node`.
pub(crate) fn replica_set(
    name: &str,
    node: &str,
    replicas: i32,
    host_network: bool,
) -> anyhow::Result<ReplicaSet> {
    let mut rs = bare_replica_set(name, node, replicas, host_network)?;
    // As linkerd's injector leaves the pod: the mesh label and the proxy container.
    if let Some(spec) = rs
        .spec
        .as_mut()
        .and_then(|s| s.template.as_mut())
        .and_then(|t| t.spec.as_mut())
    {
        spec.containers.push(serde_json::from_value(
            json!({ "name": LINKERD_PROXY, "image": "registry.k8s.io/pause:3.10" }),
        )?);
    }
    Ok(rs)
}

/// A ReplicaSet of `replicas` pause pods labelled for linkerd but without its proxy: the
/// label copied by hand, or injection skipped.
fn bare_replica_set(
    name: &str,
    node: &str,
    replicas: i32,
    host_network: bool,
) -> anyhow::Result<ReplicaSet> {
    Ok(serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": {
            "replicas": replicas,
            "selector": { "matchLabels": { "app": name } },
            "template": {
                "metadata": { "labels": { "app": name, MESH_LABEL: "linkerd" } },
                "spec": {
                    "nodeName": node,
                    "hostNetwork": host_network,
                    "terminationGracePeriodSeconds": 30,
                    "containers": [{ "name": "app", "image": "registry.k8s.io/pause:3.10" }]
                }
            }
        }
    }))?)
}

/// A bare pod (no owner) bound to `node`, meshed or not.
fn bare_pod(name: &str, node: &str, meshed: bool) -> Pod {
    if meshed {
        meshed_pod(name, node, &[], None)
    } else {
        pod::bare_pod(name, Some(node), &[("role", "plain")], None)
    }
}

struct Scene {
    cp: &'static ControlPlane,
    client: Client,
    ns: String,
    node: String,
    dirs: CniDirs,
}

impl Scene {
    async fn new(prefix: &str) -> anyhow::Result<Self> {
        let cp = cp().await;
        let client = cp.client()?;
        let ns = cp.create_namespace(&client, prefix).await?;
        let node = unique_name(prefix);
        cp.register_node(&client, &NodeSpec::new(&node)).await?;
        let dirs = CniDirs::new()?;
        dirs.config("10-calico.conflist", &golden("calico-linkerd.conflist")?)?;
        Ok(Self {
            cp,
            client,
            ns,
            node,
            dirs,
        })
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    async fn create_rs(&self, rs: &ReplicaSet) -> anyhow::Result<()> {
        Api::<ReplicaSet>::namespaced(self.client.clone(), &self.ns)
            .create(&PostParams::default(), rs)
            .await?;
        Ok(())
    }

    async fn create_pod(&self, pod: &Pod) -> anyhow::Result<()> {
        self.pods().create(&PostParams::default(), pod).await?;
        Ok(())
    }

    /// Waits until `n` pods of `app` run; their names.
    async fn running_names(&self, app: &str, n: usize) -> anyhow::Result<Vec<String>> {
        let names = poll_until(&format!("{n} {app} pods running"), WAIT, || async {
            let pods = self.app_pods(app).await?;
            let names: Vec<String> = pods
                .iter()
                .filter(|p| running(p))
                .map(ResourceExt::name_any)
                .collect();
            anyhow::Ok((names.len() == n).then_some(names))
        })
        .await?;
        Ok(names)
    }

    async fn app_pods(&self, app: &str) -> anyhow::Result<Vec<Pod>> {
        Ok(self
            .pods()
            .list(&ListParams::default().labels(&format!("app={app}")))
            .await?
            .items)
    }

    fn start_agent(&self, extra: &[&str]) -> anyhow::Result<Agent> {
        let mut args = vec!["--profile", "linkerd"];
        args.extend_from_slice(extra);
        self.start_agent_with(&args)
    }

    /// The agent with exactly `args` (its profile included).
    fn start_agent_with(&self, args: &[&str]) -> anyhow::Result<Agent> {
        Ok(Agent::start(self.cp, &self.node, &self.dirs, args)?)
    }

    /// The `MeshRedirectMissing` Events about each pod: (action, note, times observed).
    async fn events(&self) -> anyhow::Result<BTreeMap<String, Vec<(String, String, i32)>>> {
        let events: Api<Event> = Api::namespaced(self.client.clone(), &self.ns);
        let mut by_pod: BTreeMap<String, Vec<(String, String, i32)>> = BTreeMap::new();
        for e in events.list(&ListParams::default()).await?.items {
            if e.reason.as_deref() != Some("MeshRedirectMissing")
                || e.reporting_controller.as_deref() != Some("meshgate-agent")
            {
                continue;
            }
            ensure!(
                e.type_.as_deref() == Some("Warning"),
                "MeshRedirectMissing must be a Warning: {e:?}"
            );
            let pod = e
                .regarding
                .as_ref()
                .and_then(|r| r.name.clone())
                .unwrap_or_default();
            by_pod.entry(pod).or_default().push((
                e.action.unwrap_or_default(),
                e.note.unwrap_or_default(),
                e.series.map_or(1, |s| s.count),
            ));
        }
        Ok(by_pod)
    }

    /// Waits until every pod in `pods` has an Event with `action` whose note contains `word`.
    async fn wait_events(&self, pods: &[String], action: &str, word: &str) -> anyhow::Result<()> {
        poll_until(&format!("{action} Events for {pods:?}"), WAIT, || async {
            let events = self.events().await?;
            let all = pods.iter().all(|p| {
                events.get(p).is_some_and(|es| {
                    es.iter()
                        .any(|(a, note, _)| a == action && note.contains(word))
                })
            });
            anyhow::Ok(all.then_some(()))
        })
        .await?;
        Ok(())
    }
}

fn terminating(p: &Pod) -> bool {
    p.metadata.deletion_timestamp.is_some()
}

fn running(p: &Pod) -> bool {
    p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running") && !terminating(p)
}

fn pod_ip(p: &Pod) -> Option<IpAddr> {
    p.status.as_ref()?.pod_ip.as_deref()?.parse().ok()
}

/// Waits until the agent's metric `sample` satisfies `ok`; fails with the agent's log.
async fn wait_metric(agent: &Agent, sample: &str, ok: impl Fn(f64) -> bool) -> anyhow::Result<f64> {
    let got = poll_until(&format!("metric {sample}"), WAIT, || async {
        let v = agent.metric(sample).await.unwrap_or(0.0);
        anyhow::Ok(ok(v).then_some(v))
    })
    .await;
    match got {
        Ok(v) => Ok(v),
        Err(e) => bail!("{e}\n--- agent log ---\n{}", tail(&agent.log(), 60)),
    }
}

async fn metric(agent: &Agent, sample: &str) -> f64 {
    agent.metric(sample).await.unwrap_or(0.0)
}

const EVICTED: &str = "meshgate_pods_evicted_total{profile=\"linkerd\"}";
const MISSING: &str = "meshgate_pod_inspections_total{profile=\"linkerd\",verdict=\"missing\"}";
const REDIRECTED: &str =
    "meshgate_pod_inspections_total{profile=\"linkerd\",verdict=\"redirected\"}";
const UNKNOWN: &str = "meshgate_pod_inspections_total{profile=\"linkerd\",verdict=\"unknown\"}";

fn skipped(why: &str) -> String {
    format!("meshgate_evictions_skipped_total{{why=\"{why}\"}}")
}

/// Pod Running (as a watcher of the API sees it) → pod being deleted, per pod name.
#[derive(Default)]
struct Latency {
    running: HashMap<String, Instant>,
    evicted: HashMap<String, Duration>,
}

impl Latency {
    fn observe(&mut self, pods: &[Pod]) {
        for p in pods {
            let name = p.name_any();
            if running(p) {
                self.running
                    .entry(name.clone())
                    .or_insert_with(Instant::now);
            }
            if terminating(p)
                && !self.evicted.contains_key(&name)
                && let Some(t) = self.running.get(&name)
            {
                self.evicted.insert(name, t.elapsed());
            }
        }
    }
}
