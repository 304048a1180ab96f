//! The fleet's apiserver side: what kube-apiserver pays for the Nodes and for meshgate's
//! placement policy among them.
//!
//! In: the fleet's control plane at one size. Out: a [`Reading`]: the apiserver's resident
//! memory without the policy, then with the shipped policy registered (scoped by a label on
//! one namespace and on the gated Nodes) and enforced, the difference being what the policy's
//! params cost; and dry-run pod CREATEs on the policy's namespace beside the same on a
//! namespace it does not select, alternating, 4 rounds of 500 at 100/s per side.

use super::super::*;
use meshgate_e2e::load::api;
use meshgate_e2e::load::http_abuse::memory_kib;
use meshgate_e2e::load::review::Report;
use meshgate_e2e::sim::policy;
use meshgate_e2e::sim::webhook::Scope;

/// The label of the policy's namespace and of its params (the gated Nodes).
pub(super) const KEY: &str = "bench.meshgate.io/fleet-gated";
/// The policy's name (`meshgate-<TAG>`).
const TAG: &str = "fleet";

/// One size's readings.
pub(super) struct Reading {
    pub(super) rss_without_kib: u64,
    pub(super) rss_with_kib: u64,
    pub(super) etcd_rss_kib: u64,
    pub(super) policy: Report,
    pub(super) none: Report,
}

/// The namespaces the dry runs go to, one the policy selects and one it does not.
pub(super) struct Scene {
    pid: i32,
    with: String,
    without: String,
}

impl Scene {
    pub(super) async fn set_up(cp: &ControlPlane, client: &Client) -> anyhow::Result<Self> {
        let pid = cp
            .component_pid("kube-apiserver")
            .context("kube-apiserver's pid")?;
        let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
        let (with, without) = (
            cp.create_namespace(client, "fleetw").await?,
            cp.create_namespace(client, "fleetn").await?,
        );
        let label = Patch::Merge(json!({"metadata": {"labels": {KEY: "yes"}}}));
        tokio::time::timeout(
            meshgate_e2e::harness::wait::API_TIMEOUT,
            namespaces.patch(&with, &PatchParams::default(), &label),
        )
        .await
        .context("labelling the policy's namespace: no answer")??;
        Ok(Self { pid, with, without })
    }

    pub(super) async fn tear_down(&self, client: &Client) {
        let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
        for ns in [&self.with, &self.without] {
            let _ = tokio::time::timeout(
                meshgate_e2e::harness::wait::API_TIMEOUT,
                namespaces.delete(ns, &DeleteParams::default()),
            )
            .await;
        }
    }

    /// The readings among `nodes` Nodes.
    pub(super) async fn measure(
        &self,
        cp: &ControlPlane,
        client: &Client,
        nodes: usize,
    ) -> anyhow::Result<Reading> {
        eprintln!("  apiserver: RSS without and with the placement policy, dry runs ...");
        let rss_without_kib = settled_rss(self.pid).await?;
        let scope = Scope {
            label: Some((KEY.into(), "yes".into())),
            hook_infix: None,
        };
        policy::register(cp, client, TAG, &scope).await?;
        let sides = [
            Api::<Pod>::namespaced(client.clone(), &self.with),
            Api::<Pod>::namespaced(client.clone(), &self.without),
        ];
        let measured = async {
            enforced(&sides[0]).await?;
            let rss_with_kib = settled_rss(self.pid).await?;
            let (mut with, mut none) = (Report::default(), Report::default());
            for r in 0..4 {
                for i in if r % 2 == 0 { [0, 1] } else { [1, 0] } {
                    let report = dry_runs(&sides[i], nodes).await?;
                    let into = if i == 0 { &mut with } else { &mut none };
                    into.samples.extend(report.samples);
                }
            }
            let etcd_rss_kib = cp
                .component_pid("etcd")
                .and_then(|p| memory_kib(p as u32))
                .map_or(0, |m| m.0);
            anyhow::Ok(Reading {
                rss_without_kib,
                rss_with_kib,
                etcd_rss_kib,
                policy: with,
                none,
            })
        }
        .await;
        policy::unregister(client, TAG).await;
        measured
    }
}

/// The apiserver's resident memory once it has settled (KiB).
async fn settled_rss(pid: i32) -> anyhow::Result<u64> {
    tokio::time::sleep(Duration::from_secs(10)).await;
    memory_kib(pid as u32)
        .map(|(rss, _)| rss)
        .context("kube-apiserver's memory")
}

/// Waits until the policy refuses a meshed pod on the first gated Node.
async fn enforced(pods: &Api<Pod>) -> anyhow::Result<()> {
    let pod = meshed_pod("probe", &super::node_name("fleet", 0), &[], Some(0));
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        let answer = tokio::time::timeout(
            meshgate_e2e::harness::wait::API_TIMEOUT,
            pods.create(&dry, &pod),
        )
        .await;
        if matches!(answer, Ok(Err(kube::Error::Api(s))) if s.code == 403 || s.code == 422) {
            return Ok(());
        }
        if Instant::now() > end {
            bail!("the placement policy was not enforced within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// 500 dry-run CREATEs of meshed pods bound for verified Nodes across the fleet, at 100/s.
async fn dry_runs(pods: &Api<Pod>, nodes: usize) -> anyhow::Result<Report> {
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let targets: Vec<String> = (0..nodes)
        .filter(|i| super::verified(*i))
        .map(|i| super::node_name("fleet", i))
        .collect();
    let report = api::open_loop(100.0, 500, 64, Duration::from_secs(10), |k| {
        let (pods, dry) = (pods.clone(), dry.clone());
        let pod = meshed_pod(
            &format!("fleet-{k}"),
            &targets[(k * 7919) % targets.len()],
            &[],
            Some(0),
        );
        async move {
            pods.create(&dry, &pod)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        }
    })
    .await?;
    if let Some(e) = report.errors().first() {
        bail!(
            "{} dry-run errors, first: {:?}",
            report.errors().len(),
            e.outcome
        );
    }
    Ok(report)
}
