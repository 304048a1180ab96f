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

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

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
use meshgate_e2e::sim::pod::{self, LINKERD_PROXY, MESH_LABEL, meshed_pod};
use meshgate_e2e::{ControlPlane, NodeSpec, unique_name};
use serde_json::json;

use crate::support::{Agent, CniDirs, golden};
use crate::{WAIT, cp};

// ---------------------------------------------------------------------------------------
// Network namespaces
// ---------------------------------------------------------------------------------------

/// The namespaces of one test, and which pod gets which one.
struct Plan {
    subnet: [u8; 3],
    next_host: u8,
    netns: Vec<PodNetns>,
    /// Per pod group (the `app` label, or the pod name for bare pods): IPs handed out in
    /// order, so a ReplicaSet's first pods land in one kind of namespace and its
    /// replacements in another.
    queues: HashMap<String, VecDeque<IpAddr>>,
}

impl Plan {
    fn new() -> anyhow::Result<Self> {
        require_privileges()?;
        Ok(Self {
            subnet: private_subnet(),
            next_host: 1,
            netns: Vec::new(),
            queues: HashMap::new(),
        })
    }

    /// Creates `count` namespaces with `rules` and queues their IPs for `group`.
    fn add(&mut self, group: &str, count: usize, rules: Rules) -> anyhow::Result<Vec<IpAddr>> {
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
    fn ip_source(&mut self) -> impl Fn(&Pod) -> Option<IpAddr> + Send + Sync + 'static {
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
fn replica_set(
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

// ---------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn only_pods_without_redirects_are_evicted_and_their_replicaset_replaces_them()
-> anyhow::Result<()> {
    let scene = Scene::new("pods-evict").await?;
    let mut plan = Plan::new()?;
    plan.add("web", 2, Rules::None)?;
    // The replacements land in namespaces the (now chained) CNI plugin set up.
    let fixed = plan.add("web", 2, Rules::Linkerd("iptables-nft"))?;
    plan.add("ok", 1, Rules::Linkerd("iptables-nft"))?;
    plan.add("ok", 1, Rules::Linkerd("iptables-legacy"))?;
    plan.add("bare", 1, Rules::None)?;
    plan.add("plain", 1, Rules::None)?;
    plan.add("hostnet", 1, Rules::None)?;
    let _kubelet = cp().await.run_pods(&scene.node, plan.ip_source());

    // The agent watches first, so the latency measured below is detection, not start-up.
    let agent = scene.start_agent(&[])?;
    agent.wait_ready(WAIT).await?;

    let started = Instant::now();
    scene
        .create_rs(&replica_set("web", &scene.node, 2, false)?)
        .await?;
    scene
        .create_rs(&replica_set("ok", &scene.node, 2, false)?)
        .await?;
    // Selected by no profile, and sharing the node's netns: never inspected.
    scene
        .create_pod(&bare_pod("plain", &scene.node, false))
        .await?;
    scene
        .create_rs(&replica_set("hostnet", &scene.node, 1, true)?)
        .await?;
    scene
        .create_pod(&bare_pod("bare", &scene.node, true))
        .await?;

    // Both web pods are evicted and replaced by Running pods in namespaces with rules.
    // Polled every 20 ms to time each pod from Running to evicted as the API shows it.
    let mut latency = Latency::default();
    let mut original_web: Vec<String> = Vec::new();
    let deadline = Instant::now() + WAIT;
    let replaced = loop {
        let pods = scene.app_pods("web").await?;
        latency.observe(&pods);
        if original_web.is_empty() && pods.len() == 2 {
            original_web = pods.iter().map(ResourceExt::name_any).collect();
        }
        let fresh: Vec<String> = pods
            .iter()
            .filter(|p| !original_web.contains(&p.name_any()) && running(p))
            .map(ResourceExt::name_any)
            .collect();
        let originals_left = pods
            .iter()
            .filter(|p| original_web.contains(&p.name_any()))
            .count();
        if !original_web.is_empty() && originals_left == 0 && fresh.len() == 2 {
            break fresh;
        }
        if Instant::now() > deadline {
            bail!(
                "the web pods were not evicted and replaced: {:?}\n--- agent log ---\n{}",
                pods.iter()
                    .map(|p| (p.name_any(), running(p), terminating(p)))
                    .collect::<Vec<_>>(),
                tail(&agent.log(), 60)
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let evict_seconds = started.elapsed();

    // Every selected pod with its own namespace was inspected exactly once: 2 web + 1 bare
    // missing; 2 ok + 2 replacements redirected. plain and hostnet never.
    wait_metric(&agent, REDIRECTED, |v| v >= 4.0).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(metric(&agent, REDIRECTED).await, 4.0, "{}", agent.log());
    assert_eq!(metric(&agent, MISSING).await, 3.0, "{}", agent.log());
    assert_eq!(metric(&agent, UNKNOWN).await, 0.0, "{}", agent.log());
    assert_eq!(metric(&agent, EVICTED).await, 2.0);
    assert_eq!(metric(&agent, &skipped("unowned")).await, 1.0);
    assert!(
        agent
            .metric("meshgate_pod_inspection_seconds_count")
            .await
            .is_some_and(|c| c == 7.0),
        "one histogram sample per inspected pod"
    );

    // The replacements, the ok pods and the bare pod are still there and running.
    let pods = scene.pods().list(&ListParams::default()).await?.items;
    let alive = |name: &str| pods.iter().any(|p| p.name_any() == name && running(p));
    for name in &replaced {
        assert!(alive(name), "replacement {name} must not be evicted");
        let ip = pods.iter().find(|p| &p.name_any() == name).and_then(pod_ip);
        assert!(
            ip.is_some_and(|ip| fixed.contains(&ip)),
            "{name} runs in a namespace with rules: {ip:?}"
        );
    }
    let ok: Vec<String> = scene
        .app_pods("ok")
        .await?
        .iter()
        .map(ResourceExt::name_any)
        .collect();
    assert_eq!(ok.len(), 2);
    for name in ok
        .iter()
        .chain(["bare".to_string(), "plain".to_string()].iter())
    {
        assert!(alive(name), "{name} must not be evicted");
    }
    let hostnet = scene.app_pods("hostnet").await?;
    assert!(hostnet.len() == 1 && !terminating(&hostnet[0]));

    // Events: evicted for the web pods, skipped as unowned for the bare pod, none else.
    scene.wait_events(&original_web, "Evict", "evicted").await?;
    scene
        .wait_events(&["bare".into()], "ReportUnowned", "skipped as unowned")
        .await?;
    let events = scene.events().await?;
    let mut about: Vec<&String> = events.keys().collect();
    about.sort();
    let mut want: Vec<&String> = original_web.iter().collect();
    let bare = "bare".to_string();
    want.push(&bare);
    want.sort();
    assert_eq!(
        about, want,
        "Events only about the pods without rules: {events:?}"
    );
    for (pod, es) in &events {
        assert_eq!(es.len(), 1, "one Event per pod: {pod}: {es:?}");
        assert!(
            es[0].1.contains("4143"),
            "the note says what is missing: {es:?}"
        );
    }

    let rss = agent.rss_kib();
    let mut detect: Vec<u128> = latency.evicted.values().map(Duration::as_millis).collect();
    detect.sort();
    eprintln!(
        "[pods] evicted 2 of 7 meshed pods {:.1}s after their creation; pod Running -> evicted (API view): {detect:?} ms; agent RSS {rss:?} KiB; netns {:?}",
        evict_seconds.as_secs_f64(),
        plan.names()
    );
    let log = plain(&agent.log());
    let detect_lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("pod evicted"))
        .filter_map(|l| l.split("detect_ms=").nth(1)?.split_whitespace().next())
        .collect();
    eprintln!(
        "[pods] agent-side detection latency (Running seen -> eviction requested): {detect_lines:?} ms"
    );
    let sum = metric(&agent, "meshgate_pod_inspection_seconds_sum").await;
    let count = metric(&agent, "meshgate_pod_inspection_seconds_count").await;
    eprintln!(
        "[pods] mean inspection time per pod (locate + read rules + match): {:.0} µs over {count} pods",
        sum / count.max(1.0) * 1e6
    );
    drop(plan);
    Ok(())
}

#[tokio::test]
async fn a_pdb_that_forbids_disruption_blocks_the_eviction_until_it_allows_it() -> anyhow::Result<()>
{
    let scene = Scene::new("pods-pdb").await?;
    let mut plan = Plan::new()?;
    plan.add("guarded", 2, Rules::None)?;
    plan.add("guarded", 2, Rules::Linkerd("iptables-nft"))?;
    let _kubelet = cp().await.run_pods(&scene.node, plan.ip_source());

    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(scene.client.clone(), &scene.ns);
    let pdb: PodDisruptionBudget = serde_json::from_value(json!({
        "metadata": { "name": "guarded" },
        "spec": { "minAvailable": 2, "selector": { "matchLabels": { "app": "guarded" } } }
    }))?;
    pdbs.create(&PostParams::default(), &pdb).await?;
    scene
        .create_rs(&replica_set("guarded", &scene.node, 2, false)?)
        .await?;
    let original: Vec<String> = poll_until("2 guarded pods running", WAIT, || async {
        let pods = scene.app_pods("guarded").await?;
        let names: Vec<String> = pods
            .iter()
            .filter(|p| running(p))
            .map(ResourceExt::name_any)
            .collect();
        anyhow::Ok((names.len() == 2).then_some(names))
    })
    .await?;

    let agent = scene.start_agent(&[])?;
    // Refused, and retried: at least two refusals per pod.
    wait_metric(&agent, &skipped("pdb"), |v| v >= 4.0).await?;
    let pods = scene.app_pods("guarded").await?;
    assert_eq!(pods.len(), 2, "nothing evicted while the PDB forbids it");
    assert!(
        pods.iter()
            .all(|p| running(p) && original.contains(&p.name_any()))
    );
    assert_eq!(metric(&agent, EVICTED).await, 0.0);
    scene
        .wait_events(
            &original,
            "EvictBlocked",
            "blocked by a PodDisruptionBudget",
        )
        .await?;
    let events = scene.events().await?;
    for pod in &original {
        assert_eq!(
            events.get(pod).map(Vec::len),
            Some(1),
            "one Warning Event per pod, however often the PDB refuses: {events:?}"
        );
    }

    // The budget now allows one disruption at a time: both are evicted in turn.
    pdbs.patch(
        "guarded",
        &PatchParams::default(),
        &Patch::Merge(json!({ "spec": { "minAvailable": 1 } })),
    )
    .await?;
    poll_until(
        "both guarded pods evicted and replaced",
        Duration::from_secs(150),
        || async {
            let pods = scene.app_pods("guarded").await?;
            let originals = pods
                .iter()
                .filter(|p| original.contains(&p.name_any()))
                .count();
            let fresh = pods
                .iter()
                .filter(|p| !original.contains(&p.name_any()) && running(p))
                .count();
            anyhow::Ok((originals == 0 && fresh == 2).then_some(()))
        },
    )
    .await
    .with_context(|| format!("--- agent log ---\n{}", tail(&agent.log(), 60)))?;
    assert_eq!(metric(&agent, EVICTED).await, 2.0);
    scene.wait_events(&original, "Evict", "evicted").await?;
    Ok(())
}

#[tokio::test]
async fn dry_run_evicts_nothing_reports_and_reinspects_on_verdict_and_sandbox_changes()
-> anyhow::Result<()> {
    let scene = Scene::new("pods-dry").await?;
    let mut plan = Plan::new()?;
    plan.add("web", 2, Rules::None)?;
    let _kubelet = cp().await.run_pods(&scene.node, plan.ip_source());
    scene
        .create_rs(&replica_set("web", &scene.node, 2, false)?)
        .await?;
    let agent = scene.start_agent(&["--dry-run"])?;

    wait_metric(&agent, &skipped("dry_run"), |v| v >= 2.0).await?;
    let pods = scene.app_pods("web").await?;
    let names: Vec<String> = pods.iter().map(ResourceExt::name_any).collect();
    scene.wait_events(&names, "DryRun", "dry-run").await?;
    assert_eq!(metric(&agent, MISSING).await, 2.0);

    // The node's verdict changes (the mesh plugin is dropped from the chain): every pod is
    // inspected again; still nothing evicted, and no duplicate Event.
    scene
        .dirs
        .config("10-calico.conflist", &golden("calico.conflist")?)?;
    wait_metric(&agent, MISSING, |v| v >= 4.0).await?;

    // One pod's sandbox changes (its containers restarted): that pod alone again.
    let status = json!({ "status": { "containerStatuses": [{
        "name": "app", "image": "registry.k8s.io/pause:3.10", "imageID": "",
        "ready": true, "restartCount": 1, "started": true,
        "state": { "running": { "startedAt": "2026-01-01T00:00:00Z" } }
    }] } });
    scene
        .pods()
        .patch_status(
            &names[0],
            &PatchParams::default(),
            &Patch::Strategic(status),
        )
        .await?;
    wait_metric(&agent, MISSING, |v| v >= 5.0).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(metric(&agent, MISSING).await, 5.0, "{}", agent.log());
    assert_eq!(metric(&agent, &skipped("dry_run")).await, 5.0);
    assert_eq!(metric(&agent, EVICTED).await, 0.0);

    let pods = scene.app_pods("web").await?;
    assert_eq!(pods.len(), 2);
    assert!(
        pods.iter()
            .all(|p| running(p) && names.contains(&p.name_any())),
        "dry-run evicts nothing"
    );
    let events = scene.events().await?;
    // One Event per sandbox: the restarted pod got a second one for its new sandbox (the
    // Recorder folds it into the first Event's series).
    let observed = |pod: &str| {
        events
            .get(pod)
            .map_or(0, |es| es.iter().map(|e| e.2).sum::<i32>())
    };
    assert_eq!(observed(&names[0]), 2, "{events:?}");
    assert_eq!(observed(&names[1]), 1, "{events:?}");
    Ok(())
}

#[tokio::test]
async fn the_rate_limit_holds() -> anyhow::Result<()> {
    let scene = Scene::new("pods-rate").await?;
    let mut plan = Plan::new()?;
    plan.add("web", 4, Rules::None)?;
    plan.add("web", 4, Rules::Linkerd("iptables-nft"))?;
    let _kubelet = cp().await.run_pods(&scene.node, plan.ip_source());
    scene
        .create_rs(&replica_set("web", &scene.node, 4, false)?)
        .await?;
    let original: Vec<String> = poll_until("4 web pods running", WAIT, || async {
        let pods = scene.app_pods("web").await?;
        let names: Vec<String> = pods
            .iter()
            .filter(|p| running(p))
            .map(ResourceExt::name_any)
            .collect();
        anyhow::Ok((names.len() == 4).then_some(names))
    })
    .await?;

    let agent = scene.start_agent(&["--max-evictions-per-minute", "2"])?;
    let started = Instant::now();
    wait_metric(&agent, EVICTED, |v| v >= 2.0).await?;
    wait_metric(&agent, &skipped("rate_limit"), |v| v >= 2.0).await?;
    // Give a third eviction every chance to happen (well within the minute).
    tokio::time::sleep(Duration::from_secs(5)).await;
    let pods = scene.app_pods("web").await?;
    let left: Vec<&Pod> = pods
        .iter()
        .filter(|p| original.contains(&p.name_any()))
        .collect();
    let untouched = left.iter().filter(|p| !terminating(p)).count();
    ensure!(
        started.elapsed() < Duration::from_secs(55),
        "the test outlived the rate-limit window; its result would say nothing"
    );
    assert_eq!(metric(&agent, EVICTED).await, 2.0, "{}", agent.log());
    assert_eq!(
        untouched, 2,
        "exactly 2 of the 4 pods evicted within a minute"
    );
    let deferred: Vec<String> = left
        .iter()
        .filter(|p| !terminating(p))
        .map(|p| p.name_any())
        .collect();
    scene
        .wait_events(&deferred, "EvictDeferred", "rate limit (2 per minute)")
        .await?;
    Ok(())
}

#[tokio::test]
async fn a_restarted_agent_does_not_evict_again() -> anyhow::Result<()> {
    let scene = Scene::new("pods-restart").await?;
    let mut plan = Plan::new()?;
    let bad = plan.add("web", 2, Rules::None)?;
    let good = plan.add("good", 1, Rules::Linkerd("iptables-legacy"))?;
    // No kubelet stand-in: pods are moved to Running by hand, and evicted pods stay
    // terminating (nothing finalizes them), as on a node whose kubelet is slow.
    scene
        .create_rs(&replica_set("web", &scene.node, 2, false)?)
        .await?;
    let web: Vec<String> = poll_until("2 web pods", WAIT, || async {
        let pods = scene.app_pods("web").await?;
        let names: Vec<String> = pods.iter().map(ResourceExt::name_any).collect();
        anyhow::Ok((names.len() == 2).then_some(names))
    })
    .await?;
    for (name, ip) in web.iter().zip(&bad) {
        meshgate_e2e::mark_pod_running(&scene.client, &scene.ns, name, *ip).await?;
    }
    scene
        .create_pod(&bare_pod("good", &scene.node, true))
        .await?;
    meshgate_e2e::mark_pod_running(&scene.client, &scene.ns, "good", good[0]).await?;

    let mut agent = scene.start_agent(&[])?;
    wait_metric(&agent, EVICTED, |v| v >= 2.0).await?;
    let uids: Vec<String> = scene
        .pods()
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .filter(|p| web.contains(&p.name_any()))
        .inspect(|p| assert!(terminating(p), "{} is being evicted", p.name_any()))
        .filter_map(ResourceExt::uid)
        .collect();
    assert_eq!(uids.len(), 2);
    let state = std::fs::read_to_string(scene.dirs.scratch().join("state/state.json"))?;
    for uid in &uids {
        assert!(
            state.contains(uid.as_str()),
            "eviction of {uid} recorded: {state}"
        );
    }

    agent.kill9();
    agent.restart()?;
    // The new process inspected what is inspectable (the good pod) ...
    wait_metric(&agent, REDIRECTED, |v| v >= 1.0).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    // ... and evicted nothing, published nothing new.
    assert_eq!(metric(&agent, EVICTED).await, 0.0, "{}", agent.log());
    assert_eq!(
        metric(&agent, MISSING).await,
        0.0,
        "terminating pods are not inspected"
    );
    let events = scene.events().await?;
    for pod in &web {
        let seen: i32 = events.get(pod).map_or(0, |es| es.iter().map(|e| e.2).sum());
        assert_eq!(
            seen, 1,
            "one eviction Event for {pod}, none after the restart: {events:?}"
        );
    }
    assert!(
        plain(&agent.log()).contains("state restored node=")
            && plain(&agent.log()).contains("evictions=2"),
        "the history was restored from the state file:\n{}",
        tail(&agent.log(), 40)
    );
    Ok(())
}

#[tokio::test]
async fn no_evict_reports_every_pod_of_a_busy_node() -> anyhow::Result<()> {
    const PODS: usize = 60;
    let scene = Scene::new("pods-busy").await?;
    let mut plan = Plan::new()?;
    let missing = plan.add("busy", PODS / 2, Rules::None)?;
    plan.add("busy", PODS / 4, Rules::Linkerd("iptables-nft"))?;
    plan.add("busy", PODS / 4, Rules::Linkerd("iptables-legacy"))?;
    let agent = scene.start_agent(&["--no-evict"])?;
    let idle_rss = poll_until("the agent to be ready", WAIT, || async {
        anyhow::Ok(
            agent
                .admin_get("/ready")
                .await
                .filter(|r| r.0 == 200)
                .map(|_| agent.rss_kib()),
        )
    })
    .await?;
    let _kubelet = cp().await.run_pods(&scene.node, plan.ip_source());
    let started = Instant::now();
    scene
        .create_rs(&replica_set("busy", &scene.node, PODS as i32, false)?)
        .await?;

    let half = (PODS / 2) as f64;
    wait_metric(&agent, MISSING, |v| v >= half).await?;
    wait_metric(&agent, REDIRECTED, |v| v >= half).await?;
    let all_seen = started.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(metric(&agent, MISSING).await, half, "{}", agent.log());
    assert_eq!(metric(&agent, REDIRECTED).await, half);
    assert_eq!(metric(&agent, UNKNOWN).await, 0.0);
    assert_eq!(
        metric(&agent, EVICTED).await,
        0.0,
        "--no-evict evicts nothing"
    );
    for why in ["pdb", "rate_limit", "dry_run", "unowned"] {
        assert_eq!(
            metric(&agent, &skipped(why)).await,
            0.0,
            "report-only is no skip: {why}"
        );
    }
    let pods = scene.app_pods("busy").await?;
    assert_eq!(pods.len(), PODS);
    assert!(pods.iter().all(running), "nothing evicted");
    let reported: Vec<String> = pods
        .iter()
        .filter(|p| pod_ip(p).is_some_and(|ip| missing.contains(&ip)))
        .map(ResourceExt::name_any)
        .collect();
    assert_eq!(reported.len(), PODS / 2);
    scene
        .wait_events(&reported, "ReportOnly", "report only")
        .await?;
    assert_eq!(
        scene.events().await?.len(),
        PODS / 2,
        "Events only about the pods without rules"
    );

    let rss = agent.rss_kib();
    let sum = metric(&agent, "meshgate_pod_inspection_seconds_sum").await;
    let log = plain(&agent.log());
    let surveys: Vec<u64> = log
        .lines()
        .filter(|l| l.contains("inspection batch"))
        .filter_map(|l| {
            l.split("survey_us=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect();
    eprintln!(
        "[pods] busy node: {PODS} meshed pods inspected within {:.1}s of the ReplicaSet's creation; \
         mean inspection {:.0} µs per pod; {} batches, namespace survey per batch p50 {} µs max {} µs; \
         agent RSS idle {idle_rss:?} KiB -> loaded {rss:?} KiB",
        all_seen.as_secs_f64(),
        sum / PODS as f64 * 1e6,
        surveys.len(),
        {
            let mut s = surveys.clone();
            s.sort_unstable();
            s.get(s.len() / 2).copied().unwrap_or(0)
        },
        surveys.iter().max().copied().unwrap_or(0),
    );
    drop(plan);
    Ok(())
}

#[tokio::test]
async fn several_pdbs_on_one_pod_are_reported_and_nothing_is_evicted() -> anyhow::Result<()> {
    let scene = Scene::new("pods-pdbs").await?;
    let mut plan = Plan::new()?;
    plan.add("double", 1, Rules::None)?;
    let _kubelet = cp().await.run_pods(&scene.node, plan.ip_source());
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(scene.client.clone(), &scene.ns);
    for name in ["first", "second"] {
        // Each alone would allow the eviction; together the Eviction API refuses (500).
        let pdb: PodDisruptionBudget = serde_json::from_value(json!({
            "metadata": { "name": name },
            "spec": { "maxUnavailable": 1, "selector": { "matchLabels": { "app": "double" } } }
        }))?;
        pdbs.create(&PostParams::default(), &pdb).await?;
    }
    scene
        .create_rs(&replica_set("double", &scene.node, 1, false)?)
        .await?;
    let agent = scene.start_agent(&[])?;
    wait_metric(&agent, &skipped("pdb"), |v| v >= 1.0).await?;
    let pods = scene.app_pods("double").await?;
    let names: Vec<String> = pods.iter().map(ResourceExt::name_any).collect();
    assert!(
        pods.len() == 1 && running(&pods[0]),
        "not evicted: {names:?}"
    );
    scene
        .wait_events(&names, "EvictBlocked", "more than one PodDisruptionBudget")
        .await?;
    assert_eq!(metric(&agent, EVICTED).await, 0.0);
    assert!(
        plain(&agent.log()).contains("several PodDisruptionBudgets match the pod"),
        "{}",
        agent.log()
    );
    Ok(())
}

/// A pod labelled for linkerd whose injection never happened (no `linkerd-proxy`
/// container): linkerd-cni skips such a pod too, so its rules are missing, and a recreated
/// pod would be the same. It is reported once (Event, `no_proxy` skip), never evicted, and
/// never inspected again for the same sandbox; a pod of the same node that does run the
/// proxy is still evicted.
#[tokio::test]
async fn a_pod_with_the_mesh_label_but_no_proxy_is_reported_never_evicted() -> anyhow::Result<()> {
    let scene = Scene::new("pods-noproxy").await?;
    let mut plan = Plan::new()?;
    plan.add("labelled", 2, Rules::None)?;
    plan.add("web", 1, Rules::None)?;
    plan.add("web", 1, Rules::Linkerd("iptables-nft"))?;
    let _kubelet = cp().await.run_pods(&scene.node, plan.ip_source());
    scene
        .create_rs(&bare_replica_set("labelled", &scene.node, 2, false)?)
        .await?;
    scene
        .create_rs(&replica_set("web", &scene.node, 1, false)?)
        .await?;
    let agent = scene.start_agent(&[])?;

    wait_metric(&agent, &skipped("no_proxy"), |v| v >= 2.0).await?;
    wait_metric(&agent, EVICTED, |v| v >= 1.0).await?;
    let labelled: Vec<String> = scene
        .app_pods("labelled")
        .await?
        .iter()
        .map(ResourceExt::name_any)
        .collect();
    assert_eq!(labelled.len(), 2);
    scene
        .wait_events(&labelled, "ReportNoProxy", "no linkerd-proxy container")
        .await?;

    // No loop: nothing more happens to them, whatever the time.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        metric(&agent, &skipped("no_proxy")).await,
        2.0,
        "{}",
        agent.log()
    );
    assert_eq!(metric(&agent, EVICTED).await, 1.0, "{}", agent.log());
    // 2 labelled + 1 web missing, inspected once each; the web replacement redirected.
    assert_eq!(metric(&agent, MISSING).await, 3.0, "{}", agent.log());
    let now: Vec<Pod> = scene.app_pods("labelled").await?;
    assert!(
        now.iter()
            .all(|p| running(p) && labelled.contains(&p.name_any())),
        "the labelled pods were left alone: {:?}",
        now.iter().map(ResourceExt::name_any).collect::<Vec<_>>()
    );
    let events = scene.events().await?;
    for p in &labelled {
        let observed: i32 = events.get(p).map_or(0, |es| es.iter().map(|e| e.2).sum());
        assert_eq!(observed, 1, "one Event per sandbox for {p}: {events:?}");
    }
    Ok(())
}

const AMBIENT_MISSING: &str =
    "meshgate_pod_inspections_total{profile=\"istio-ambient\",verdict=\"missing\"}";

/// A ReplicaSet of pause pods as Istio ambient leaves them: no mesh label or sidecar of
/// their own, `extra` pod labels.
fn plain_replica_set(name: &str, node: &str, extra: &[(&str, &str)]) -> anyhow::Result<ReplicaSet> {
    let mut labels = serde_json::Map::new();
    labels.insert("app".into(), json!(name));
    for (k, v) in extra {
        labels.insert((*k).into(), json!(v));
    }
    Ok(serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": {
            "replicas": 1,
            "selector": { "matchLabels": { "app": name } },
            "template": {
                "metadata": { "labels": labels },
                "spec": {
                    "nodeName": node,
                    "terminationGracePeriodSeconds": 30,
                    "containers": [{ "name": "app", "image": "registry.k8s.io/pause:3.10" }]
                }
            }
        }
    }))?)
}

/// `istio-ambient` selects as Istio enrolls: pods of a namespace labelled
/// `istio.io/dataplane-mode=ambient` (read by the agent's namespace watch, before any
/// istio-cni annotation exists), except a pod labelled `istio.io/dataplane-mode=none`; and a
/// namespace labelled later brings its running pods in at once.
#[tokio::test]
async fn ambient_pods_are_selected_by_their_namespace_label_and_the_opt_out_holds()
-> anyhow::Result<()> {
    let scene = Scene::new("pods-ambient").await?;
    // The node chains istio-cni, as an ambient install leaves it.
    scene.dirs.plugin("istio-cni", GOOD_PLUGIN)?;
    scene
        .dirs
        .config("10-calico.conflist", &golden("istio-cni.conflist")?)?;
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(scene.client.clone());
    let label_ambient = |ns: String| {
        let namespaces = namespaces.clone();
        async move {
            namespaces
                .patch(
                    &ns,
                    &PatchParams::default(),
                    &Patch::Merge(
                        json!({"metadata": {"labels": {"istio.io/dataplane-mode": "ambient"}}}),
                    ),
                )
                .await
        }
    };
    label_ambient(scene.ns.clone()).await?;
    let late_ns = scene
        .cp
        .create_namespace(&scene.client, "pods-ambient-late")
        .await?;

    let mut plan = Plan::new()?;
    plan.add("amb", 1, Rules::None)?;
    plan.add("optout", 1, Rules::None)?;
    plan.add("late", 1, Rules::None)?;
    let _kubelet = cp().await.run_pods(&scene.node, plan.ip_source());
    scene
        .create_rs(&plain_replica_set("amb", &scene.node, &[])?)
        .await?;
    scene
        .create_rs(&plain_replica_set(
            "optout",
            &scene.node,
            &[("istio.io/dataplane-mode", "none")],
        )?)
        .await?;
    let late_pods: Api<Pod> = Api::namespaced(scene.client.clone(), &late_ns);
    Api::<ReplicaSet>::namespaced(scene.client.clone(), &late_ns)
        .create(
            &PostParams::default(),
            &plain_replica_set("late", &scene.node, &[])?,
        )
        .await?;
    poll_until("every pod running", WAIT, || async {
        let here = scene.pods().list(&ListParams::default()).await?.items;
        let there = late_pods.list(&ListParams::default()).await?.items;
        anyhow::Ok(
            (here.iter().filter(|p| running(p)).count() == 2
                && there.iter().filter(|p| running(p)).count() == 1)
                .then_some(()),
        )
    })
    .await?;

    let agent = scene.start_agent_with(&["--profile", "istio-ambient", "--dry-run"])?;
    wait_metric(&agent, AMBIENT_MISSING, |v| v >= 1.0).await?;
    let amb: Vec<String> = scene
        .app_pods("amb")
        .await?
        .iter()
        .map(ResourceExt::name_any)
        .collect();
    scene
        .wait_events(&amb, "DryRun", "istio-ambient redirects missing")
        .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        metric(&agent, AMBIENT_MISSING).await,
        1.0,
        "only the ambient namespace's pod, not its opted-out one nor the unlabelled namespace's:\n{}",
        agent.log()
    );

    // The other namespace joins ambient: its running pod is inspected without any pod
    // event, but only once Istio has had ENROLL_GRACE to enroll it (it adds running pods
    // asynchronously): not at once, where it would be judged (and evicted) as missing.
    label_ambient(late_ns.clone()).await?;
    let labelled = Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        metric(&agent, AMBIENT_MISSING).await,
        1.0,
        "a running pod was inspected right after its namespace joined the mesh:\n{}",
        agent.log()
    );
    wait_metric(&agent, AMBIENT_MISSING, |v| v >= 2.0).await?;
    assert!(
        labelled.elapsed() >= meshgate_agent::daemon::pods::tracker::ENROLL_GRACE,
        "inspected {:?} after the label, before the enrollment grace",
        labelled.elapsed()
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        metric(&agent, AMBIENT_MISSING).await,
        2.0,
        "{}",
        agent.log()
    );
    assert_eq!(metric(&agent, &skipped("dry_run")).await, 2.0);
    let events = scene.events().await?;
    let optout: Vec<String> = scene
        .app_pods("optout")
        .await?
        .iter()
        .map(ResourceExt::name_any)
        .collect();
    assert!(
        optout.iter().all(|p| !events.contains_key(p)),
        "the opted-out pod is never reported: {events:?}"
    );
    Ok(())
}
