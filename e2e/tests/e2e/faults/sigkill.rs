//! The agent SIGKILLed at random moments during verification, reconciles, inspections and
//! evictions converges after each restart and never untaints an unverified node.

use super::*;

/// A plugin that answers like a healthy one after 50 ms, so verification takes long enough
/// for kills to land inside it.
const SLOW_GOOD_PLUGIN: &str = "#!/bin/sh\nsleep 0.05\ncat >/dev/null\necho '{\"cniVersion\":\"1.0.0\",\"supportedVersions\":[\"0.3.0\",\"0.3.1\",\"0.4.0\",\"1.0.0\"]}'\n";

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
    let (ips, _kubelet) = run_pods(cp, &node);
    let started = SystemTime::now();
    // When each pod was first seen terminating (or gone), by a watch of the test's own; and a
    // clock pair to compare those instants with the audit log's wall-clock times.
    let clock = (Instant::now(), SystemTime::now());
    let (term_watch, terminating, watch_errors) = watch_terminating(&client, &ns);
    let mut agent = start_agent(&id, &node, &dirs)?;
    let log = NodeLog::start(&client, &node);
    log.wait("gated at start", WAIT, gated("ChainedPluginMissing"))
        .await
        .with_context(|| tail(&agent.log(), 40))?;

    let rounds = if soak() { 200 } else { 50 };
    let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let world = World {
        dirs: &dirs,
        configs: [&invalid, &valid],
        subnet,
        ips: &ips,
        api: &api,
        node: &node,
        log: &log,
    };
    let kills = Kills::run(&world, &mut agent, &mut rng, rounds).await?;

    // Every pod without rules is evicted in the end; then count evictions in the audit log.
    let bad: Vec<&String> = kills
        .pods
        .iter()
        .filter(|(_, r)| !**r)
        .map(|(n, _)| n)
        .collect();
    every_pod_without_rules_evicted(&api, &bad, &agent).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    term_watch.abort();
    let requests = id.requests(cp, started)?;
    let terminating = snapshot(&terminating);
    let evictions = Evictions::of(&requests);
    let watch_errors = snapshot(&watch_errors);
    let judged = evictions.judge(&kills.pods, &bad, &terminating, clock);
    let seen = log.all();
    let wrong = wrong_untaints(&seen, &kills.timeline);
    kills.report(rounds, seen.len(), &bad, &evictions);
    ensure!(
        wrong.is_empty(),
        "wrong untaints: {wrong:?}\n{}",
        tail(&agent.log(), 80)
    );
    let slow_rounds = &kills.slow_rounds;
    ensure!(
        slow_rounds.is_empty(),
        "converged later than 2 s after restart: {slow_rounds:?}"
    );
    judged.check(&agent, &watch_errors)?;
    drop(kills);
    id.remove(&client).await;
    Ok(())
}

/// The kubelet stand-in for `node`, reporting each pod's IP from the returned map.
fn run_pods(
    cp: &ControlPlane,
    node: &str,
) -> (Arc<Mutex<HashMap<String, IpAddr>>>, meshgate_e2e::PodRunner) {
    let ips: Arc<Mutex<HashMap<String, IpAddr>>> = Arc::default();
    let source = ips.clone();
    let kubelet = cp.run_pods(node, move |p: &Pod| {
        source
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&p.name_any())
            .copied()
    });
    (ips, kubelet)
}

/// The agent, as its ServiceAccount, evicting unowned pods without a rate limit.
fn start_agent(id: &AuditedIdentity, node: &str, dirs: &CniDirs) -> anyhow::Result<Agent> {
    Ok(Agent::start_with_kubeconfig(
        &id.kubeconfig,
        node,
        dirs,
        &[
            "--profile",
            "linkerd",
            "--evict-unowned",
            "--max-evictions-per-minute",
            "100000",
        ],
    )?)
}

/// A copy of what the watch task has gathered so far.
fn snapshot<T: Clone>(shared: &Mutex<T>) -> T {
    shared.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// What the kill rounds act on.
struct World<'a> {
    dirs: &'a CniDirs,
    /// The config: [invalid, valid].
    configs: [&'a [u8]; 2],
    subnet: [u8; 3],
    /// The pods' IPs, as the kubelet stand-in reports them.
    ips: &'a Mutex<HashMap<String, IpAddr>>,
    api: &'a Api<Pod>,
    node: &'a str,
    log: &'a NodeLog,
}

/// What the kill rounds did.
struct Kills {
    /// Config validity over time, for the continuous check.
    timeline: Vec<(Instant, bool)>,
    valid_now: bool,
    netns: Vec<PodNetns>,
    /// pod name -> has redirect rules
    pods: BTreeMap<String, bool>,
    converge: Vec<Duration>,
    slow_rounds: Vec<String>,
    host: u8,
    port_collisions: u32,
}

impl Kills {
    async fn run(
        world: &World<'_>,
        agent: &mut Agent,
        rng: &mut Rng,
        rounds: u64,
    ) -> anyhow::Result<Self> {
        let mut kills = Self {
            timeline: vec![(Instant::now(), false)],
            valid_now: false,
            netns: Vec::new(),
            pods: BTreeMap::new(),
            converge: Vec::new(),
            slow_rounds: Vec::new(),
            host: 1,
            port_collisions: 0,
        };
        for round in 0..rounds {
            kills.round(world, agent, rng, round).await?;
        }
        // Sorted for the percentiles.
        kills.converge.sort();
        Ok(kills)
    }

    /// Maybe flips the config, maybe adds a pod or two, then kills the agent at a random
    /// moment 0-250 ms later and waits for the restarted one to converge.
    async fn round(
        &mut self,
        world: &World<'_>,
        agent: &mut Agent,
        rng: &mut Rng,
        round: u64,
    ) -> anyhow::Result<()> {
        let flip = round == 0 || rng.below(10) < 6;
        let new_pods = if self.host < 240 && rng.below(2) == 0 {
            1 + rng.below(2)
        } else {
            0
        };
        if flip {
            self.valid_now = !self.valid_now;
            world.dirs.config(
                "10-calico.conflist",
                world.configs[usize::from(self.valid_now)],
            )?;
            self.timeline.push((Instant::now(), self.valid_now));
        }
        for _ in 0..new_pods {
            let redirected = rng.below(4) == 0;
            self.add_pod(world, round, redirected).await?;
        }
        let delay = Duration::from_millis(rng.below(250));
        tokio::time::sleep(delay).await;
        agent.kill9();
        let restarted = Instant::now();
        agent.restart()?;
        let took = converged(
            world.log,
            agent,
            self.valid_now,
            round,
            restarted,
            &mut self.port_collisions,
        )
        .await?;
        if took > Duration::from_secs(2) {
            self.slow_rounds.push(format!(
                "round {round}: {took:?} (flip {flip}, pods {new_pods}, kill after {delay:?})"
            ));
        }
        self.converge.push(took);
        Ok(())
    }

    /// A meshed pod in a network namespace of its own, with linkerd's rules or none.
    async fn add_pod(
        &mut self,
        world: &World<'_>,
        round: u64,
        redirected: bool,
    ) -> anyhow::Result<()> {
        let ip = ip_of(world.subnet, self.host);
        self.host += 1;
        let rules = if redirected {
            Rules::Linkerd("iptables-legacy")
        } else {
            Rules::None
        };
        self.netns.push(PodNetns::new(ip, rules)?);
        let name = format!("p{round}-{}", self.host);
        world
            .ips
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.clone(), IpAddr::V4(ip));
        world
            .api
            .create(&PostParams::default(), &meshed_pod(&name, world.node)?)
            .await?;
        self.pods.insert(name, redirected);
        Ok(())
    }

    /// Prints the run's figures, before any of them is judged.
    fn report(&self, rounds: u64, states: usize, bad: &[&String], evictions: &Evictions) {
        let Evictions { by_pod, codes } = evictions;
        let (converge, port_collisions) = (&self.converge, self.port_collisions);
        let attempts: usize = by_pod.values().map(Vec::len).sum();
        eprintln!(
            "[faults] sigkill: {rounds} kills; converged after restart p50 {:.0} ms p90 {:.0} ms max {:.0} ms; \
             {} node states watched, {} config flips; {} pods ({} without rules, all evicted), {attempts} eviction \
             requests for {} pods; answers by HTTP code {codes:?}; admin port taken at restart {port_collisions} times",
            ms(percentile(converge, 0.5)),
            ms(percentile(converge, 0.9)),
            ms(percentile(converge, 1.0)),
            states,
            self.timeline.len() - 1,
            self.pods.len(),
            bad.len(),
            by_pod.len(),
        );
    }
}

/// Every pod without rules ends up evicted (terminating or gone).
async fn every_pod_without_rules_evicted(
    api: &Api<Pod>,
    bad: &[&String],
    agent: &Agent,
) -> anyhow::Result<()> {
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
    .with_context(|| tail(&agent.log(), 60))
}

/// The agent's eviction requests, by the apiserver's audit log.
struct Evictions {
    /// Per pod: when each request was received, and its answer's HTTP code.
    by_pod: BTreeMap<String, Vec<(SystemTime, Option<u16>)>>,
    /// How many requests got each HTTP code.
    codes: BTreeMap<Option<u16>, usize>,
}

/// The eviction requests that break a promise.
struct Judged<'a> {
    /// Evicted pods the test's watch never saw terminating.
    unwatched: Vec<&'a String>,
    /// Pods evicted again after they were terminating.
    twice: Vec<String>,
    /// Pods with redirect rules that got an eviction request.
    wrongly: Vec<&'a String>,
    /// Pods without rules that got none.
    unrequested: Vec<&'a &'a String>,
}

impl Evictions {
    fn of(requests: &[meshgate_e2e::harness::audit::Request]) -> Self {
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
        Self { by_pod, codes }
    }

    /// A request the agent abandoned because it was killed shows as 504 (context canceled) and
    /// may or may not have been applied, so whether a pod was evicted is read from the pod
    /// itself, and "evicted twice" means: an eviction request received after the pod was
    /// already terminating (as the test's watch saw it, with a margin for the watch's delivery
    /// delay) — the agent acting on stale knowledge of its own eviction.
    fn judge<'a>(
        &'a self,
        pods: &BTreeMap<String, bool>,
        bad: &'a [&'a String],
        terminating: &HashMap<String, Instant>,
        clock: (Instant, SystemTime),
    ) -> Judged<'a> {
        const MARGIN: Duration = Duration::from_millis(200);
        let by_pod = &self.by_pod;
        let wall = |t: Instant| clock.1 + t.saturating_duration_since(clock.0);
        // Every evicted pod must have been seen terminating, or the re-eviction check below
        // could not judge it.
        let unwatched: Vec<&String> = by_pod
            .keys()
            .filter(|p| bad.contains(p) && !terminating.contains_key(*p))
            .collect();
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
        Judged {
            unwatched,
            twice,
            wrongly,
            unrequested,
        }
    }
}

impl Judged<'_> {
    /// Every evicted pod was watched, none was evicted twice, none with rules was evicted,
    /// and every one without rules was asked to be.
    fn check(&self, agent: &Agent, watch_errors: &[String]) -> anyhow::Result<()> {
        let Self {
            unwatched,
            twice,
            wrongly,
            unrequested,
        } = self;
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
        Ok(())
    }
}

/// When each pod of `ns` was first seen terminating (or gone), by a watch of the test's own,
/// and the watch's errors: after one the watcher relists, and a pod deleted in the gap is never
/// seen terminating; the test then fails, naming these.
#[allow(clippy::type_complexity)]
fn watch_terminating(
    client: &Client,
    ns: &str,
) -> (
    tokio::task::JoinHandle<()>,
    Arc<Mutex<HashMap<String, Instant>>>,
    Arc<Mutex<Vec<String>>>,
) {
    let terminating: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let watch_errors: Arc<Mutex<Vec<String>>> = Arc::default();
    let term_watch = {
        let (api, seen, errors) = (
            Api::<Pod>::namespaced(client.clone(), ns),
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
    (term_watch, terminating, watch_errors)
}

/// The continuous check: an untainted state seen while the config has been invalid for
/// longer than GRACE (one verify-to-patch race plus watch delivery) is a wrong untaint.
fn wrong_untaints(seen: &[Seen], timeline: &[(Instant, bool)]) -> Vec<String> {
    const GRACE: Duration = Duration::from_millis(300);
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
    wrong
}

/// Waits until the restarted agent converged: the node shows the verdict of the config on
/// disk (`want_verified`) and the new process reports ready (it is ready once its verdict is
/// on the Node); the time since `restarted`. Fails after 10 s.
async fn converged(
    log: &NodeLog,
    agent: &mut Agent,
    want_verified: bool,
    round: u64,
    restarted: Instant,
    port_collisions: &mut u32,
) -> anyhow::Result<Duration> {
    let deadline = restarted + Duration::from_secs(10);
    loop {
        let right = log.last().is_some_and(|s| {
            if want_verified {
                verified(&s)
            } else {
                gated("ChainedPluginMissing")(&s)
            }
        });
        if right && agent.admin_get("/ready").await.is_some_and(|r| r.0 == 200) {
            return Ok(restarted.elapsed());
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
            *port_collisions += 1;
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
    }
}
