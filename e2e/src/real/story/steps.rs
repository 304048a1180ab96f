//! The story's steps, one method each, in the order [`super::run`] takes them.
//!
//! In: the cluster, node A and what earlier steps produced. Out: what later steps and the
//! [`super::Outcome`] need; every step asserts what it shows and narrates it.

use super::observe::*;
use super::workload::*;
use super::*;

/// The agent's counter of pods it judged redirected.
const REDIRECTED: &str = "meshgate_pod_inspections_total{profile=\"istio\",verdict=\"redirected\"}";

/// What every step works with: the cluster, a client, the narrator and node A.
pub(super) struct Story<'a> {
    pub(super) cluster: &'a RealCluster,
    pub(super) client: Client,
    pub(super) n: &'a dyn Narrator,
    pub(super) a: &'a RealNode,
}

impl Story<'_> {
    /// S3, before meshgate: the meshed Deployment's pod runs on A without redirect rules.
    pub(super) async fn before_meshgate(&self) -> anyhow::Result<Pod> {
        let Story { client, a, .. } = self;
        let n = self.n;
        say_node(n, a);
        n.say(&format!(
            "{}: a bridge network (bridge → portmap); Istio's CNI plugin is NOT appended yet (scenario S3)",
            a.conflist_path().display()
        ));
        create_namespace(client).await?;
        let deployments: Api<Deployment> = Api::namespaced(client.clone(), NAMESPACE);
        let web: Deployment = serde_json::from_value(web_deployment(a.name()))?;
        wait::api(
            "creating the web Deployment",
            deployments.create(&PostParams::default(), &web),
        )
        .await?;
        let first = running_web(client, &[]).await?;
        let verdict = inspect_pod(a, &first).await?;
        ensure!(
            verdict == "missing",
            "the web pod started before istio-cni was chained must have no redirect rules; `meshgate-agent inspect` says {verdict}"
        );
        n.say(&format!(
            "meshed pod {NAMESPACE}/{} Running on {} with IP {} (istio-proxy sidecar); `meshgate-agent inspect` on its network namespace: {verdict} — no redirect rules, it talks plaintext",
            first.name_any(),
            a.name(),
            pod_ip(&first)
        ));
        Ok(first)
    }

    /// meshgate installed from its chart: A's agent gates A.
    pub(super) async fn install(&self) -> anyhow::Result<()> {
        let Story {
            cluster, client, a, ..
        } = self;
        let n = self.n;
        n.say("installing meshgate as an operator does: helm install from its chart (e2e/chart/real-node-values.yaml: local image, istio-cni required)");
        let installed = Instant::now();
        cluster.install_meshgate().await?;
        n.say(&format!(
            "meshgate installed in {:.1}s: the webhook Deployment is Ready behind its Service, the agent DaemonSet pod runs on {}",
            installed.elapsed().as_secs_f64(),
            a.name()
        ));
        n.detail(&system_pods(cluster).await?);
        let gated = wait_node(client, a.name(), "gated", |n| {
            tainted(n) && gate_condition(n).is_some_and(|c| c.0 == "False")
        })
        .await?;
        let reason = gate_condition(&gated).map(|c| c.1).unwrap_or_default();
        n.say(&format!(
            "agent: {} gated — taint {TAINT_KEY}:NoSchedule, {CONDITION_TYPE}=False ({reason})",
            a.name()
        ));
        n.detail(&describe_excerpt(cluster, a.name()).await?);
        Ok(())
    }

    /// The pod without rules is evicted, and its replacement's binding to A is refused.
    pub(super) async fn evict_and_refuse_binding(&self, first: &Pod) -> anyhow::Result<()> {
        let Story { client, a, .. } = self;
        let n = self.n;
        let first_uid = first.uid().unwrap_or_default();
        let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
        poll_until("the agent to evict the pod without rules", STEP, || async {
            let gone = match pods.get_opt(&first.name_any()).await? {
                None => true,
                Some(p) => {
                    p.uid() != Some(first_uid.clone()) || p.metadata.deletion_timestamp.is_some()
                }
            };
            anyhow::Ok(gone.then_some(()))
        })
        .await?;
        let event = pod_event(client, &first.name_any(), "MeshRedirectMissing", "Evict").await?;
        n.say(&format!(
            "agent: pod {} has no redirect rules → evicted through the Eviction API; Event MeshRedirectMissing:",
            first.name_any()
        ));
        n.detail(&event);
        let pending = poll_until("the web ReplicaSet's replacement pod", STEP, || async {
            let list = pods.list(&ListParams::default().labels("app=web")).await?;
            anyhow::Ok(list.items.into_iter().find(|p| {
                p.uid() != Some(first_uid.clone()) && p.metadata.deletion_timestamp.is_none()
            }))
        })
        .await?;
        // It tolerates meshgate's taint: only the webhook keeps it off A, by refusing the binding
        // kube-scheduler posts. The scheduler reports that refusal in an Event about the pod, and
        // retries with a backoff. Its first attempts may meet no webhook endpoint yet (failure
        // policy Fail, a refusal too, but not the verdict): wait for the webhook's own denial.
        let verdict = format!("node {} is not verified for the mesh CNI chain", a.name());
        let refusal = poll_until(
            &format!(
                "an Event with the webhook's refusal to bind {}",
                pending.name_any()
            ),
            STEP,
            || async {
                let about = events_about(client, &pending.name_any()).await?;
                anyhow::Ok(about.into_iter().find(|e| e.note.contains(&verdict)))
            },
        )
        .await?;
        let still = wait::api("reading the replacement", pods.get(&pending.name_any())).await?;
        ensure!(
            still.uid() == pending.uid() && node_of(&still).is_none(),
            "the replacement was bound to {:?} while {} is unverified",
            node_of(&still),
            a.name()
        );
        n.say(&format!(
            "its ReplicaSet created {}; it tolerates meshgate's taint, so kube-scheduler picks {}, but the webhook refuses the binding (Event {}):",
            pending.name_any(),
            a.name(),
            refusal.reason
        ));
        n.detail(&refusal.note);
        Ok(())
    }

    /// Node B, registering now, is tainted by the webhook at CREATE and gated by its agent.
    pub(super) async fn node_b_tainted_at_create(&self) -> anyhow::Result<()> {
        let Story {
            cluster, client, ..
        } = self;
        let n = self.n;
        // A node registering now is tainted by the webhook at CREATE: the Node's first version.
        let (b, created) = cluster.add_node_seen_at_create().await?;
        ensure!(
            tainted(&created),
            "node {} was created without meshgate's taint: the webhook did not taint it at registration",
            b.name()
        );
        say_node(n, &b);
        n.say(&format!(
            "the webhook tainted {} at CREATE: the Node's first version already carries {TAINT_KEY}:NoSchedule, before any agent runs there",
            b.name()
        ));
        let agent_b = cluster.ready_pods("meshgate-agent", Some(&b), 1).await?;
        ensure!(
            agent_b.len() == 1,
            "node {} has {} agent pods",
            b.name(),
            agent_b.len()
        );
        let gated_b = wait_verdict(client, b.name(), false).await?;
        ensure!(
            tainted(&gated_b),
            "node {} lost its taint while its conflist lacks istio-cni",
            b.name()
        );
        let message = gate_condition(&gated_b).map(|c| c.2).unwrap_or_default();
        ensure!(
            message.contains("istio-cni"),
            "{}'s {CONDITION_TYPE} message does not name the missing plugin: {message:?}",
            b.name()
        );
        n.say(&format!(
            "{}'s own agent Ready ({}): it keeps {} gated — {CONDITION_TYPE}=False: {message}",
            b.name(),
            agent_b[0].name_any(),
            b.name()
        ));
        Ok(())
    }

    /// A meshed pod sent straight to A is refused; returns the webhook's words.
    pub(super) async fn direct_pod_refused(&self) -> anyhow::Result<String> {
        let Story { client, a, .. } = self;
        let n = self.n;
        let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
        let direct: Pod = serde_json::from_value(direct_pod(a.name()))?;
        let pp = PostParams::default();
        let create = pods.create(&pp, &direct);
        let refused = match tokio::time::timeout(wait::API_TIMEOUT, create).await {
            Ok(Ok(_)) => bail!("the webhook admitted a meshed pod on an unverified node"),
            Ok(Err(kube::Error::Api(s))) => s.message,
            Ok(Err(e)) => return Err(e.into()),
            Err(_) => bail!(
                "creating the direct pod: no answer within {:?}",
                wait::API_TIMEOUT
            ),
        };
        n.say(&format!(
            "a meshed pod sent straight to {} (spec.nodeName, tolerates every taint) is REFUSED:",
            a.name()
        ));
        n.detail(&refused);
        Ok(refused)
    }

    /// S1: istio-cni appended untaints A, and the replacement binds and is redirected;
    /// returns the time to untaint and the replacement.
    pub(super) async fn istio_cni_appended(
        &self,
        kubeconfig: &str,
        first_uid: &str,
    ) -> anyhow::Result<(Duration, Pod)> {
        let Story {
            cluster, client, a, ..
        } = self;
        let n = self.n;
        n.say("Istio's installer appends istio-cni to the bridge conflist, with its kubeconfig (scenario S1)");
        let written = Instant::now();
        a.install_istio_cni(kubeconfig, false)?;
        wait_node(client, a.name(), "untainted", |n| !tainted(n)).await?;
        let untaint = written.elapsed();
        wait_verdict(client, a.name(), true).await?;
        n.say(&format!(
            "agent: {} untainted {} ms after the write — {CONDITION_TYPE}=True (Verified)",
            a.name(),
            untaint.as_millis()
        ));
        n.detail(&describe_excerpt(cluster, a.name()).await?);

        let replacement = running_web(client, &[first_uid]).await?;
        let rules = netfilter_dump(a, &replacement, false).await?;
        ensure!(
            rules.contains("ISTIO_OUTPUT") && rules.contains("ISTIO_REDIRECT"),
            "istio-cni's iptables chains are not in the replacement's namespace:\n{rules}"
        );
        let verdict = inspect_pod(a, &replacement).await?;
        ensure!(
            verdict == "redirected",
            "the replacement istio-cni set up must be judged redirected; `inspect` says {verdict}; istio-cni's log:\n{}",
            istio_cni_log(a)
        );
        ensure!(
            istio_cni_log(a).contains(&replacement.name_any()),
            "istio-cni's log does not name the replacement {}",
            replacement.name_any()
        );
        let agent = cluster.agent_admin(a);
        wait_metric(
            agent,
            "meshgate_pod_inspections_total{profile=\"istio\",verdict=\"redirected\"}",
            1.0,
        )
        .await?;
        n.say(&format!(
            "{} scheduled on {} (IP {}): istio-cni itself wrote ISTIO_OUTPUT/ISTIO_REDIRECT into its namespace; the agent judged it: redirected",
            replacement.name_any(),
            a.name(),
            pod_ip(&replacement)
        ));
        Ok((untaint, replacement))
    }

    /// istio-cni switched to native nftables: A does not flap, and the next pod is judged
    /// redirected too; returns that pod.
    pub(super) async fn native_nftables(
        &self,
        kubeconfig: &str,
        first_uid: &str,
        replacement: &Pod,
    ) -> anyhow::Result<Pod> {
        let Story {
            cluster, client, a, ..
        } = self;
        let n = self.n;
        let nodes: Api<Node> = Api::all(client.clone());
        let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
        let agent = cluster.agent_admin(a);
        // The same plugin in native nftables mode, for the next pod of the Deployment. The
        // installer's rewrite keeps the chain verified: the node must not flap, so it is watched
        // for a while (many times the agent's coalescing window) and its condition must not
        // have transitioned.
        let before = condition_since(&read_node(&nodes, a.name()).await?);
        a.install_istio_cni(kubeconfig, true)?;
        let watched = Instant::now();
        while watched.elapsed() < Duration::from_millis(1500) {
            ensure!(
                !tainted(&read_node(&nodes, a.name()).await?),
                "rewriting istio-cni's entry (native_nftables) tainted {}",
                a.name()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let after = condition_since(&read_node(&nodes, a.name()).await?);
        ensure!(
            before.is_some() && before == after,
            "{}'s {CONDITION_TYPE} transitioned while istio-cni's entry was rewritten: {before:?} → {after:?}",
            a.name()
        );
        // The agent's counters before the next pod, so its verdict on that very pod is what moves.
        let redirected = REDIRECTED;
        let others = [
            "meshgate_pod_inspections_total{profile=\"istio\",verdict=\"missing\"}",
            "meshgate_pod_inspections_total{profile=\"istio\",verdict=\"unknown\"}",
        ];
        let base = metric(agent, redirected).await?;
        let mut others_base = Vec::new();
        for name in others {
            others_base.push(metric(agent, name).await?);
        }
        wait::api(
            "deleting the replacement",
            pods.delete(
                &replacement.name_any(),
                &DeleteParams::default().grace_period(1),
            ),
        )
        .await?;
        let replacement_uid = replacement.uid().unwrap_or_default();
        let nft = running_web(client, &[first_uid, &replacement_uid]).await?;
        let ruleset = netfilter_dump(a, &nft, true).await?;
        ensure!(
            ruleset.contains("istio"),
            "istio-cni's nftables tables are not in the pod's namespace:\n{ruleset}"
        );
        let verdict = inspect_pod(a, &nft).await?;
        ensure!(
            verdict == "redirected",
            "a pod istio-cni set up in native_nftables mode must be judged redirected; `inspect` says {verdict}"
        );
        wait_metric(agent, redirected, base + 1.0).await?;
        for (name, was) in others.iter().zip(others_base) {
            let now = metric(agent, name).await?;
            ensure!(
                now == was,
                "the agent's {name} moved from {was} to {now} around the native_nftables pod"
            );
        }
        n.say(&format!(
            "istio-cni switched to native_nftables; the next pod {} has Istio's nftables tables and is judged redirected too",
            nft.name_any()
        ));
        Ok(nft)
    }

    /// S4: the conflist loses istio-cni and A is re-tainted; returns the time to re-taint and
    /// the agent's eviction count.
    pub(super) async fn drift(&self) -> anyhow::Result<(Duration, u64)> {
        let Story {
            cluster, client, a, ..
        } = self;
        let n = self.n;
        let agent = cluster.agent_admin(a);
        n.say("the primary CNI rewrites its conflist without istio-cni (scenario S4)");
        let written = Instant::now();
        a.remove_istio_cni()?;
        wait_node(client, a.name(), "re-tainted", tainted).await?;
        let retaint = written.elapsed();
        wait_verdict(client, a.name(), false).await?;
        n.say(&format!(
            "agent: {} re-tainted {} ms after the drift — {CONDITION_TYPE}=False (ChainedPluginMissing), Event CNIChainUnverified",
            a.name(),
            retaint.as_millis()
        ));
        n.detail(&describe_excerpt(cluster, a.name()).await?);

        let metrics = crate::sim::node::http_get(agent, "/metrics")
            .await
            .map(|(_, body)| body)
            .context("the agent's /metrics did not answer")?;
        n.say("agent metrics (/metrics on its admin port, the node's address:9990):");
        n.detail(
            &metrics
                .lines()
                .filter(|l| {
                    l.starts_with("meshgate_") && !l.contains("_bucket{") && !l.ends_with(" 0")
                })
                .collect::<Vec<_>>()
                .join("\n"),
        );
        let evicted = metric_sample(&metrics, "meshgate_pods_evicted_total{profile=\"istio\"}")
            .unwrap_or(0.0) as u64;
        ensure!(
            evicted == 1,
            "the agent evicted {evicted} pods; exactly the one without rules was expected"
        );
        Ok((retaint, evicted))
    }

    /// The agent pod is recreated: A stays tainted, the redirected pod is kept, still one
    /// eviction.
    pub(super) async fn agent_restarts(&self, nft: &Pod) -> anyhow::Result<()> {
        let Story {
            cluster, client, a, ..
        } = self;
        let n = self.n;
        let nodes: Api<Node> = Api::all(client.clone());
        let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
        let agent = cluster.agent_admin(a);
        let redirected = REDIRECTED;
        let agent_pod = cluster.agent_pod(a).await?;
        n.say(&format!(
            "the agent pod {} is deleted; its DaemonSet recreates it",
            agent_pod.name_any()
        ));
        let system: Api<Pod> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
        wait::api(
            "deleting the agent pod",
            system.delete(&agent_pod.name_any(), &DeleteParams::default()),
        )
        .await?;
        let old_uid = agent_pod.uid().unwrap_or_default();
        let restart = Instant::now();
        let new_agent = loop {
            ensure!(
                tainted(&read_node(&nodes, a.name()).await?),
                "{} lost its taint while its agent restarted, with istio-cni still missing",
                a.name()
            );
            if let Ok(p) = cluster.agent_pod(a).await
                && p.uid() != Some(old_uid.clone())
                && is_ready(&p)
            {
                break p;
            }
            ensure!(
                restart.elapsed() < STEP,
                "the DaemonSet did not bring a new agent to Ready within {STEP:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        // The new agent inspects the pods it finds: the redirected pod once more, never evicted.
        wait_metric(agent, redirected, 1.0).await?;
        let evicted_again = metric(agent, "meshgate_pods_evicted_total{profile=\"istio\"}").await?;
        ensure!(
            evicted_again == 0.0,
            "the restarted agent evicted {evicted_again} pod(s)"
        );
        ensure!(
            tainted(&read_node(&nodes, a.name()).await?),
            "{} was untainted after its agent restarted",
            a.name()
        );
        ensure!(
            wait::api("reading the redirected pod", pods.get_opt(&nft.name_any()))
                .await?
                .is_some_and(|p| p.uid() == nft.uid() && p.metadata.deletion_timestamp.is_none()),
            "the redirected pod {} was evicted after the agent restarted",
            nft.name_any()
        );
        let evictions = pod_events(client, "MeshRedirectMissing").await?;
        ensure!(
            evictions.len() == 1 && evictions.iter().all(|e| e.action == "Evict"),
            "MeshRedirectMissing Events after the restart: {evictions:?}; exactly one, an Evict, was expected"
        );
        n.say(&format!(
            "new agent {} Ready after {:.1}s: {} stayed tainted throughout, the redirected pod was inspected again and kept, still exactly 1 eviction",
            new_agent.name_any(),
            restart.elapsed().as_secs_f64(),
            a.name()
        ));
        Ok(())
    }
}
