//! The story the dashboard is checked on, step by step, and what each step must show.
//!
//! In: the shared control plane, a webhook [`Fixture`] reading its mode from the story's
//! namespace, a [`Checker`]. Out: the cluster and the components driven through each state
//! the dashboard and the alerts show; each step returns once every query it checks answered
//! as it must (or fails with the query, what was wanted and the last answer).

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, ensure};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::Client;
use kube::api::{Api, PostParams};
use meshgate_e2e::harness::paths::repo_root;
use meshgate_e2e::sim::kubelet::PodRunner;
use meshgate_e2e::sim::netns::Rules;
use meshgate_e2e::sim::node::{gate_condition, tail, tainted, verified_label};
use meshgate_e2e::{ControlPlane, NodeSpec, unique_name};
use serde_json::json;

use super::figure;
use super::queries::Checker;
use crate::modes::set_mode;
use crate::pods::{Plan, replica_set};
use crate::support::{Agent, CniDirs, golden, wait_node};
use crate::webhook::{Fixture, Start, create_pod, pod};

/// Every value is 1 / absent: the answer of a query whose series are all `1` or none.
fn ones(v: f64) -> bool {
    v == 1.0
}

/// The webhook, in enforce, reading its mode from a new namespace; its webhooks' names carry
/// its tag, so the apiserver's per-webhook metrics count this test's calls alone.
pub(super) async fn webhook(cp: &'static ControlPlane) -> anyhow::Result<(String, Fixture)> {
    let admin = cp.client()?;
    let mode_ns = cp.create_namespace(&admin, "dash-mode").await?;
    set_mode(&admin, &mode_ns, "enforce").await?;
    let start = Start {
        kubeconfig: cp.admin_kubeconfig_path().to_path_buf(),
        profile_file: None,
        tag_hooks: true,
        taint_key: Default::default(),
        mode: meshgate_shell::mode::ModeSource {
            namespace: mode_ns.clone(),
            ..Default::default()
        },
    };
    Ok((mode_ns, Fixture::start_with(cp, "dash", start).await?))
}

/// The simulated node, its agent, and the objects the story made.
pub(super) struct Story {
    pub(super) cp: &'static ControlPlane,
    admin: Client,
    pub(super) mode_ns: String,
    pub(super) node: String,
    pub(super) agent: Agent,
    dirs: CniDirs,
    began: Instant,
    /// A namespace in the webhook's scope (meshed pods there are reviewed).
    scoped_ns: Option<String>,
    /// The pods' network namespaces and the kubelet stand-in running them.
    pods: Option<(Plan, PodRunner)>,
}

impl Story {
    /// The agent for a node that does not exist yet, with an unverified chain (calico
    /// without linkerd-cni), mode from `mode_ns`.
    pub(super) fn new(cp: &'static ControlPlane, mode_ns: String) -> anyhow::Result<Self> {
        let node = unique_name("dash");
        let dirs = CniDirs::new()?;
        dirs.config("10-calico.conflist", &golden("calico.conflist")?)?;
        let args = ["--profile", "linkerd", "--namespace", &mode_ns];
        let agent = Agent::start(cp, &node, &dirs, &args)?;
        Ok(Self {
            cp,
            admin: cp.client()?,
            mode_ns,
            node,
            agent,
            dirs,
            began: Instant::now(),
            scoped_ns: None,
            pods: None,
        })
    }

    /// Seconds since the story began.
    pub(super) fn elapsed(&self) -> f64 {
        self.began.elapsed().as_secs_f64()
    }

    fn node_is(&self) -> (&str, &str) {
        ("node", &self.node)
    }

    /// Writes the chain: `complete` chains linkerd-cni, else calico alone.
    async fn chain(&self, complete: bool, what: &str, ok: fn(&Node) -> bool) -> anyhow::Result<()> {
        let golden_name = if complete {
            "calico-linkerd.conflist"
        } else {
            "calico.conflist"
        };
        self.dirs
            .config("10-calico.conflist", &golden(golden_name)?)?;
        wait_node(&self.admin, &self.node, what, ok).await?;
        Ok(())
    }

    /// No Node yet: the agent's reconciles fail, counted as API errors of call `node`.
    pub(super) async fn node_missing(&mut self, c: &mut Checker<'_>) -> anyhow::Result<()> {
        let errors = [self.node_is(), ("call", "node")];
        c.series("Agents' API errors / A", &errors, |v| v >= 1.0)
            .await
            .with_context(|| tail(&self.agent.log(), 60))?;
        for quiet in [
            "alert MeshgateAgentDown",
            "alert MeshgateAgentAbsent",
            "alert MeshgateWebhookDown",
            "alert MeshgateWebhookUnavailable",
            "alert MeshgateModeInvalid",
            "alert MeshgatePodsEvicted",
            "alert MeshgateEvictionsBlockedByPDB",
        ] {
            c.empty(quiet).await?;
        }
        Ok(())
    }

    /// The Node registers; its agent gates it (ChainedPluginMissing).
    pub(super) async fn gated(&mut self, c: &mut Checker<'_>) -> anyhow::Result<()> {
        let registered = Instant::now();
        self.cp
            .register_node(&self.admin, &NodeSpec::new(&self.node))
            .await?;
        wait_node(&self.admin, &self.node, "gated", |n| {
            tainted(n) && verified_label(n) == Some("false")
        })
        .await?;
        let node = [self.node_is()];
        c.series("Nodes gated now / A", &[], ones).await?;
        let reason = [("reason", "ChainedPluginMissing")];
        c.series("Gated nodes by reason / A", &reason, ones).await?;
        let bound = registered.elapsed().as_secs_f64() + 2.0;
        let gated_for = c
            .series("Time gated per node / A", &node, |v| {
                (0.0..=bound).contains(&v)
            })
            .await?;
        println!("time gated per node: {:.1} s", gated_for.value());
        let added = [self.node_is(), ("action", "added")];
        c.series("Taint changes / A", &added, |v| v >= 1.0).await?;
        c.series("alert MeshgateNodeUnverified", &node, |v| v == 0.0)
            .await?;
        for job in ["meshgate-agent", "meshgate-webhook"] {
            let mode = [("job", job), ("mode", "enforce")];
            c.series("Mode / A", &mode, ones).await?;
            c.series("Mode / B", &[("job", job)], |v| v == 0.0).await?;
            c.series("Targets up / A", &[("job", job)], ones).await?;
        }
        Ok(())
    }

    /// The webhook refuses meshed pods on the gated Node, one at a time.
    pub(super) async fn refusals(
        &mut self,
        c: &mut Checker<'_>,
        f: &Fixture,
    ) -> anyhow::Result<()> {
        let ns = f.namespace(&[]).await?;
        for i in 0..3 {
            let meshed = pod(&format!("web-{i}"), Some(&self.node), true, None);
            let refused = create_pod(&self.admin, &ns, &meshed, false).await?.err();
            let refused = refused.context("a meshed pod admitted on a gated node")?;
            ensure!(refused.contains("not verified"), "{refused}");
            // Apart by more than a scrape, so the refusals' counter has a rate.
            tokio::time::sleep(Duration::from_millis(1200)).await;
        }
        self.scoped_ns = Some(ns);
        let refused = [("resource", "pods"), ("allowed", "false")];
        c.series("Webhook decisions / A", &refused, |v| v > 0.0)
            .await?;
        c.series("Webhook refusals / A", &[("resource", "pods")], |v| {
            v >= 1.0
        })
        .await?;
        for key in ["Webhook latency / A", "Webhook latency / B"] {
            c.expect(key, "one finite quantile", |s| {
                s.len() == 1 && s[0].value().is_finite() && s[0].value() > 0.0
            })
            .await?;
        }
        Ok(())
    }

    /// The chain is completed: the taint goes, with an untaint latency.
    pub(super) async fn verified(&mut self, c: &mut Checker<'_>) -> anyhow::Result<()> {
        self.chain(true, "verified", |n| {
            !tainted(n) && verified_label(n) == Some("true")
        })
        .await?;
        c.series("Nodes gated now / A", &[], |v| v == 0.0).await?;
        c.empty("Gated nodes by reason / A").await?;
        c.empty("Time gated per node / A").await?;
        c.empty("alert MeshgateNodeUnverified").await?;
        let removed = [self.node_is(), ("action", "removed")];
        c.series("Taint changes / A", &removed, |v| v >= 1.0)
            .await?;
        for key in [
            "Untaint and re-taint latency / A",
            "Untaint and re-taint latency / B",
        ] {
            // Within the histogram's buckets (1 ms .. ~16 s).
            c.series(key, &[], |v| v > 0.0 && v < 17.0).await?;
        }
        Ok(())
    }

    /// Drift: the chain broken again re-taints, with a re-taint latency; then fixed.
    pub(super) async fn drift(&mut self, c: &mut Checker<'_>) -> anyhow::Result<()> {
        let broken = Instant::now();
        self.chain(false, "re-tainted", tainted).await?;
        for key in [
            "Untaint and re-taint latency / C",
            "Untaint and re-taint latency / D",
        ] {
            c.series(key, &[], |v| v > 0.0 && v < 17.0).await?;
        }
        let reason = [("reason", "ChainedPluginMissing")];
        c.series("Gated nodes by reason / A", &reason, ones).await?;
        // Gated anew: the time restarts from the drift, not from the first gating.
        let bound = broken.elapsed().as_secs_f64() + 2.0;
        c.series("Time gated per node / A", &[self.node_is()], |v| {
            (0.0..=bound).contains(&v)
        })
        .await?;
        self.chain(true, "verified again", |n| !tainted(n)).await?;
        c.series("Nodes gated now / A", &[], |v| v == 0.0).await?;
        Ok(())
    }

    /// A pod without redirects is evicted (its replacement has them); another is held by its
    /// PodDisruptionBudget.
    pub(super) async fn pods(&mut self, c: &mut Checker<'_>) -> anyhow::Result<()> {
        let ns = self.cp.create_namespace(&self.admin, "dash-pods").await?;
        let mut plan = Plan::new()?;
        plan.add("web", 1, Rules::None)?;
        plan.add("web", 1, Rules::Linkerd("iptables-nft"))?;
        plan.add("guarded", 1, Rules::None)?;
        let kubelet = self.cp.run_pods(&self.node, plan.ip_source());
        self.pods = Some((plan, kubelet));
        let pdb: PodDisruptionBudget = serde_json::from_value(json!({
            "metadata": {"name": "guarded"},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "guarded"}}}
        }))?;
        let pdbs: Api<PodDisruptionBudget> = Api::namespaced(self.admin.clone(), &ns);
        pdbs.create(&PostParams::default(), &pdb).await?;
        let sets = Api::namespaced(self.admin.clone(), &ns);
        for app in ["web", "guarded"] {
            let rs = replica_set(app, &self.node, 1, false)?;
            sets.create(&PostParams::default(), &rs).await?;
        }
        let (node, linkerd) = (self.node_is(), ("profile", "linkerd"));
        c.series("Pods found without redirects / A", &[node, linkerd], |v| {
            v >= 1.0
        })
        .await
        .with_context(|| tail(&self.agent.log(), 60))?;
        c.series("Evictions / A", &[node, linkerd], |v| v >= 1.0)
            .await?;
        c.series("Evictions / B", &[node, ("why", "pdb")], |v| v >= 1.0)
            .await?;
        c.series("alert MeshgatePodsEvicted", &[node, linkerd], |v| v > 0.0)
            .await?;
        c.series("alert MeshgateEvictionsBlockedByPDB", &[node], |v| v > 0.0)
            .await?;
        Ok(())
    }

    /// Report mode: the chain broken is only reported (no taint), a meshed pod on the
    /// unverified node is admitted with a warning; then the chain is fixed again.
    pub(super) async fn report_mode(&mut self, c: &mut Checker<'_>) -> anyhow::Result<()> {
        set_mode(&self.admin, &self.mode_ns, "report").await?;
        for job in ["meshgate-agent", "meshgate-webhook"] {
            let mode = [("job", job), ("mode", "report")];
            c.series("Mode / A", &mode, ones).await?;
        }
        self.chain(false, "unverified, untainted", |n| {
            !tainted(n) && gate_condition(n).is_some_and(|(s, _, _)| s == "False")
        })
        .await?;
        let would = [self.node_is(), ("action", "taint")];
        c.series("Report mode: what enforce would do / A", &would, |v| {
            v >= 1.0
        })
        .await?;
        let ns = self.scoped_ns.clone().context("no scoped namespace")?;
        let meshed = pod("report-0", Some(&self.node), true, None);
        let admitted = create_pod(&self.admin, &ns, &meshed, false).await?;
        ensure!(admitted.is_ok(), "refused in report mode: {admitted:?}");
        c.series("Webhook refusals / B", &[("action", "refuse")], |v| {
            v >= 1.0
        })
        .await?;
        self.chain(true, "verified in report mode", |n| {
            verified_label(n) == Some("true")
        })
        .await?;
        Ok(())
    }

    /// A mode value meshgate does not know: both components enforce and say so; then enforce.
    pub(super) async fn invalid_mode(&mut self, c: &mut Checker<'_>) -> anyhow::Result<()> {
        set_mode(&self.admin, &self.mode_ns, "reprot").await?;
        let ns = self.mode_ns.clone();
        for job in ["meshgate-agent", "meshgate-webhook"] {
            let invalid = [("job", job), ("namespace", ns.as_str())];
            c.series("alert MeshgateModeInvalid", &invalid, ones)
                .await?;
            c.series("Mode / B", &[("job", job)], ones).await?;
            let mode = [("job", job), ("mode", "enforce")];
            c.series("Mode / A", &mode, ones).await?;
        }
        set_mode(&self.admin, &self.mode_ns, "enforce").await?;
        c.empty("alert MeshgateModeInvalid").await?;
        Ok(())
    }

    /// The webhook stops: its target is down, and the apiserver fails open on its entries
    /// while meshed pods are created (one every 500 ms, by a task stopped afterwards).
    pub(super) async fn webhook_down(
        &mut self,
        c: &mut Checker<'_>,
        f: &mut Fixture,
    ) -> anyhow::Result<()> {
        f.stop_webhook().await?;
        let job = [("job", "meshgate-webhook")];
        c.series("alert MeshgateWebhookDown", &job, |v| v == 0.0)
            .await?;
        // absent() of a comparison: one series without labels.
        c.series("alert MeshgateWebhookUnavailable", &[], ones)
            .await?;
        c.series("Targets up / A", &job, |v| v == 0.0).await?;
        let (admin, node) = (self.admin.clone(), self.node.clone());
        let ns = self.scoped_ns.clone().context("no scoped namespace")?;
        let creator = tokio::spawn(async move {
            for i in 0..240 {
                let meshed = pod(&format!("open-{i}"), Some(&node), true, None);
                let _ = create_pod(&admin, &ns, &meshed, false).await;
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        });
        let tag = f.tag.clone();
        let failing = c
            .expect(
                "alert MeshgateWebhookFailingOpen",
                "this test's webhook failing open",
                |s| {
                    s.iter()
                        .any(|x| x.label("name").contains(&tag) && x.value() > 0.0)
                },
            )
            .await;
        creator.abort();
        failing?;
        Ok(())
    }

    /// The agent is killed: its target is down.
    pub(super) async fn agent_down(&mut self, c: &mut Checker<'_>) -> anyhow::Result<()> {
        self.agent.kill9();
        c.series("alert MeshgateAgentDown", &[self.node_is()], |v| v == 0.0)
            .await?;
        c.series("Targets up / A", &[("job", "meshgate-agent")], |v| v == 0.0)
            .await?;
        Ok(())
    }
}

/// The range query of gated nodes by reason over the story (from `start` to `end`, seconds
/// of the story): it must show the gated spans; written as the docs' figure when asked.
pub(super) async fn figure(
    s: &Story,
    c: &Checker<'_>,
    prom: &meshgate_e2e::harness::prometheus::Prometheus,
    (start, end): (f64, f64),
    steps: &[(f64, &str)],
) -> anyhow::Result<()> {
    let expr = c.expr("Gated nodes by reason / A")?;
    let now = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs_f64();
    let back = s.elapsed() - start;
    let series = prom
        .query_range(
            expr,
            Duration::from_secs_f64(back),
            Duration::from_secs_f64(figure::STEP),
        )
        .await?;
    let gated = series
        .iter()
        .find(|x| x.label("reason") == "ChainedPluginMissing")
        .context("no gated span in the range query")?;
    ensure!(gated.points.iter().all(|p| p.1 == 1.0), "{gated:?}");
    if std::env::var_os(figure::ENV).is_some() {
        let (t0, t1) = (now - back, now - (s.elapsed() - end));
        let rel: Vec<(f64, &str)> = steps.iter().map(|(t, n)| (t - start, *n)).collect();
        let path = repo_root().join(figure::PATH);
        std::fs::create_dir_all(path.parent().context("figure dir")?)?;
        std::fs::write(&path, figure::svg(&series, t0, t1, &rel))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
