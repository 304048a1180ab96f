//! Test-side helpers shared by the e2e modules; the simulated node itself lives in the
//! library (`meshgate_e2e::sim::node`) so the demo and benchmarks use the same code.

use std::collections::BTreeSet;

use anyhow::{Context, ensure};
use k8s_openapi::api::authorization::v1::{SelfSubjectRulesReview, SelfSubjectRulesReviewSpec};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Client;
use kube::api::{Api, EvictParams, Patch, PatchParams, PostParams};
use meshgate_core::gate::VERIFIED_LABEL;
use meshgate_e2e::TokenOptions;
use meshgate_e2e::harness::wait::poll_until;
use serde_json::json;

pub use meshgate_e2e::sim::node::{Agent, CniDirs, GOOD_PLUGIN, golden};

/// Waits until the Node satisfies `pred`; the error says what the Node looked like last.
pub async fn wait_node(
    client: &Client,
    name: &str,
    what: &str,
    pred: impl Fn(&Node) -> bool,
) -> anyhow::Result<Node> {
    let nodes: Api<Node> = Api::all(client.clone());
    poll_until(what, crate::WAIT, || {
        let nodes = nodes.clone();
        let pred = &pred;
        async move {
            let n = nodes.get(name).await?;
            anyhow::Ok(pred(&n).then_some(n))
        }
    })
    .await
    .with_context(|| format!("waiting for node {name}: {what}"))
}

/// `kubectl apply` of the chart's templates `files`, rendered by `helm template` with `sets`
/// (`--set` pairs) and written into `cp`'s directory.
pub async fn apply_base_files(
    cp: &meshgate_e2e::ControlPlane,
    files: &[&str],
    sets: &[&str],
) -> anyhow::Result<String> {
    let mut args = Vec::new();
    for f in files {
        args.extend(["--show-only".to_owned(), format!("templates/{f}")]);
    }
    for s in sets {
        args.extend(["--set".to_owned(), (*s).to_owned()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let rendered = meshgate_e2e::harness::helm::template(&args).await?;
    let path = cp
        .dir()
        .join(format!("{}.yaml", meshgate_e2e::unique_name("chart")));
    std::fs::write(&path, rendered)?;
    Ok(cp
        .kubectl(&["apply", "-f", &path.display().to_string()])
        .await?)
}

/// The chart's templates that confine the agent: its namespace, ServiceAccounts, RBAC and
/// policies.
pub const BASE_CONFINEMENT: [&str; 4] = [
    "namespace.yaml",
    "serviceaccounts.yaml",
    "rbac.yaml",
    "admission-policy.yaml",
];

// Answers of the apiserver to the components' own tokens (rbac.rs, authz.rs).

/// meshgate's namespace.
pub const NS: &str = "meshgate-system";
/// The agent's ServiceAccount (and DaemonSet).
pub const AGENT: &str = "meshgate-agent";

/// A token of `NS/sa` bound to `pod`: it names the pod's node, as the kubelet's projected
/// tokens do.
pub async fn bound_token(client: &Client, sa: &str, pod: Pod) -> anyhow::Result<String> {
    let options = TokenOptions {
        bound_pod: Some(pod),
        ..Default::default()
    };
    Ok(meshgate_e2e::service_account_token(client, NS, sa, &options).await?)
}

/// A dry-run patch of meshgate's verified label onto `node` through `nodes` (a write the
/// policy admits on the token's own node only).
pub async fn label_verified_dry_run(nodes: &Api<Node>, node: &str) -> Result<Node, kube::Error> {
    let patch = Patch::Merge(json!({"metadata": {"labels": {VERIFIED_LABEL: "true"}}}));
    nodes
        .patch(node, &PatchParams::default().dry_run(), &patch)
        .await
}

/// `Ok` when `r` is a 403 whose message contains `needle`, else an error saying what it was.
pub fn expect_forbidden<T: std::fmt::Debug>(
    r: &Result<T, kube::Error>,
    needle: &str,
) -> anyhow::Result<()> {
    let refused = status_of(r).is_some_and(|(code, msg)| code == 403 && msg.contains(needle));
    ensure!(refused, "want a 403 saying {needle:?}: {}", describe(r));
    Ok(())
}

/// `Ok` when `r` is a 403 from the named ValidatingAdmissionPolicy.
pub fn expect_policy<T: std::fmt::Debug>(
    r: &Result<T, kube::Error>,
    policy: &str,
) -> anyhow::Result<()> {
    expect_forbidden(r, &format!("ValidatingAdmissionPolicy '{policy}'"))
}

/// Eviction parameters for a dry run (admission runs, nothing is evicted).
pub fn dry_run_eviction() -> EvictParams {
    EvictParams {
        post_options: PostParams {
            dry_run: true,
            ..Default::default()
        },
        ..Default::default()
    }
}

/// The status code and message of an API refusal.
pub fn status_of<T>(r: &Result<T, kube::Error>) -> Option<(u16, &str)> {
    match r {
        Err(kube::Error::Api(s)) => Some((s.code, s.message.as_str())),
        _ => None,
    }
}

/// True when `r` is a 403 from the named ValidatingAdmissionPolicy (not from RBAC).
pub fn refused_by_policy<T>(r: &Result<T, kube::Error>, policy: &str) -> bool {
    status_of(r).is_some_and(|(code, msg)| {
        code == 403 && msg.contains(&format!("ValidatingAdmissionPolicy '{policy}'"))
    })
}

/// True when `r` is a 403 from RBAC.
pub fn refused_by_rbac<T>(r: &Result<T, kube::Error>) -> bool {
    status_of(r).is_some_and(|(code, msg)| code == 403 && msg.contains("cannot "))
}

/// An API answer, for assertion messages.
pub fn describe<T: std::fmt::Debug>(r: &Result<T, kube::Error>) -> String {
    match r {
        Ok(v) => format!("allowed: {v:?}"),
        Err(e) => e.to_string(),
    }
}

/// The (apiGroup, resource, verb) triples the apiserver resolves for `client` in `namespace`,
/// minus the self-review rules every authenticated user has (system:basic-user). A rule
/// limited to named objects gives `resource[name]` for each name.
pub async fn effective_rules(
    client: &Client,
    namespace: &str,
) -> anyhow::Result<BTreeSet<(String, String, String)>> {
    let review = SelfSubjectRulesReview {
        spec: SelfSubjectRulesReviewSpec {
            namespace: Some(namespace.to_owned()),
        },
        ..Default::default()
    };
    let answer = Api::<SelfSubjectRulesReview>::all(client.clone())
        .create(&PostParams::default(), &review)
        .await?;
    let status = answer
        .status
        .context("no status in SelfSubjectRulesReview")?;
    ensure!(
        !status.incomplete,
        "rules review incomplete: {:?}",
        status.evaluation_error
    );
    let mut out = BTreeSet::new();
    for rule in status.resource_rules {
        let names = rule.resource_names.clone().unwrap_or_default();
        let resources: Vec<String> = rule
            .resources
            .iter()
            .flatten()
            .flat_map(|r| {
                if names.is_empty() {
                    vec![r.clone()]
                } else {
                    names.iter().map(|n| format!("{r}[{n}]")).collect()
                }
            })
            .collect();
        for g in rule.api_groups.iter().flatten() {
            for r in &resources {
                let self_review = (g == "authorization.k8s.io" || g == "authentication.k8s.io")
                    && r.starts_with("selfsubject");
                if self_review {
                    continue;
                }
                for v in &rule.verbs {
                    out.insert((g.clone(), r.clone(), v.clone()));
                }
            }
        }
    }
    Ok(out)
}

/// The rules both ServiceAccounts have in meshgate's namespace alone: the one ConfigMap that
/// holds the mode (Role `meshgate-mode-reader`).
pub fn mode_reader_rules() -> BTreeSet<(String, String, String)> {
    triples(&[(
        "",
        &["configmaps[meshgate-mode]"],
        &["get", "list", "watch"],
    )])
}

/// The mode ConfigMap is readable as meshgate's daemons read it (a list with the field
/// selector `metadata.name=meshgate-mode`, and a get), and no other ConfigMap is: a list
/// without the selector is refused.
pub async fn expect_only_the_mode_configmap(client: &Client) -> anyhow::Result<()> {
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::ListParams;
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), NS);
    let name = meshgate_core::mode::CONFIGMAP;
    let by_name = ListParams::default().fields(&format!("metadata.name={name}"));
    let listed = api
        .list(&by_name)
        .await
        .context("the mode ConfigMap by name")?;
    ensure!(
        listed.items.len() == 1,
        "{} mode ConfigMaps listed",
        listed.items.len()
    );
    api.get(name).await.context("get the mode ConfigMap")?;
    let all = api.list(&ListParams::default()).await;
    ensure!(
        refused_by_rbac(&all),
        "every ConfigMap listed: {}",
        describe(&all)
    );
    Ok(())
}

/// The agent's rules in meshgate's namespace besides the mode's: the cluster-wide eviction
/// budget's ledger (Role `meshgate-eviction-budget`), read and written back by name.
pub fn eviction_budget_rules() -> BTreeSet<(String, String, String)> {
    triples(&[(
        "",
        &["configmaps[meshgate-eviction-budget]"],
        &["get", "update"],
    )])
}

/// Checks `client`'s rules: `want` in other namespaces; `want`, the mode ConfigMap's and
/// `own_namespace` in meshgate's own.
pub async fn expect_rules(
    client: &Client,
    want: &BTreeSet<(String, String, String)>,
    own_namespace: &BTreeSet<(String, String, String)>,
    who: &str,
) -> anyhow::Result<()> {
    for ns in ["default", "kube-system"] {
        let have = effective_rules(client, ns).await?;
        ensure!(
            &have == want,
            "{who}'s rules in namespace {ns}: {have:?}, want {want:?}"
        );
    }
    let mut own = want.clone();
    own.extend(mode_reader_rules());
    own.extend(own_namespace.iter().cloned());
    let have = effective_rules(client, NS).await?;
    ensure!(have == own, "{who}'s rules in {NS}: {have:?}, want {own:?}");
    Ok(())
}

/// (apiGroup, resource, verb) triples from rules written as in a ClusterRole.
pub fn triples(rules: &[(&str, &[&str], &[&str])]) -> BTreeSet<(String, String, String)> {
    let mut out = BTreeSet::new();
    for (group, resources, verbs) in rules {
        for r in *resources {
            for v in *verbs {
                out.insert((group.to_string(), r.to_string(), v.to_string()));
            }
        }
    }
    out
}

/// A verdict as the agent's verification loop hands it to [`NodeGate::reconcile`].
pub fn verdict(verified: bool) -> anyhow::Result<meshgate_core::cni::ChainVerdict> {
    let (reason, message) = if verified {
        (
            "Verified",
            "linkerd-cni is chained in /etc/cni/net.d/10-calico.conflist",
        )
    } else {
        (
            "ChainedPluginMissing",
            "linkerd-cni is not in /etc/cni/net.d/10-calico.conflist",
        )
    };
    Ok(serde_json::from_value(json!({
        "verified": verified, "reason": reason, "message": message,
        "config_file": "/etc/cni/net.d/10-calico.conflist",
        "plugins": ["calico"], "runtime": "containerd",
    }))?)
}
