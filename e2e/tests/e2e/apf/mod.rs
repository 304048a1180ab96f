//! API Priority and Fairness: the chart's FlowSchemas and PriorityLevelConfigurations
//! (`templates/flowcontrol.yaml`) on the real apiserver. A flood from the agents'
//! ServiceAccount must leave another client's latency near its baseline, and the agents'
//! Node writes must get through a flood of their own reads or of another client's, with no
//! 429; the same floods without the objects are the control. The apiserver's
//! `apiserver_flowcontrol_dispatched_requests_total` says which schema classified each
//! flood, and each answer's `X-Kubernetes-PF-FlowSchema-UID` which schema classified the
//! agent's calls made as its node (Constrained Impersonation).
//!
//! In: a control plane of its own whose apiserver runs with a small concurrency limit
//! ([`INFLIGHT`], so that 2 cores can saturate it) and the ConstrainedImpersonation gate; the
//! chart's base (authz::seed: namespace, ServiceAccounts, RBAC, policies, two nodes, the
//! agent's token bound to a pod on node A); [`BULK_PODS`] pods with large annotations, which
//! make a cluster-wide pod LIST heavy; a bystander ServiceAccount of the test's. Out: pass/fail
//! and the figures printed (`apf: ...`), which docs/operations.md, "API Priority and
//! Fairness", quotes.

mod measure;

use std::time::Duration;

use anyhow::{Context as _, ensure};
use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::flowcontrol::v1::FlowSchema;
use kube::api::{Api, ListParams, PostParams};
use kube::{Client, ResourceExt as _};
use meshgate_core::gate::VERIFIED_LABEL;
use meshgate_e2e::harness::helm;
use meshgate_e2e::harness::wait::poll_until;
use meshgate_e2e::load::api::apiserver_metrics;
use meshgate_e2e::load::histogram::counter;
use meshgate_e2e::{ControlPlane, Options, TokenOptions, unique_name};
use serde_json::json;

use crate::WAIT;
use crate::authz::{self, Fixture, GATE};
use measure::Lab;

/// The apiserver's concurrency limit: 15 seats in all, so the suggested `workload-low` gets
/// 6 and each of meshgate's levels 1 (the test prints them).
const INFLIGHT: [&str; 2] = [
    "--max-requests-inflight=10",
    "--max-mutating-requests-inflight=5",
];
/// Pods whose cluster-wide LIST the floods send (about 2 MB of JSON each time).
const BULK_PODS: usize = 400;
/// Bytes of annotation on each bulk pod.
const BULK_BYTES: usize = 4096;
/// Bound on one request: above APF's longest queue wait (a quarter of the 60 s request
/// timeout).
const STEP: Duration = Duration::from_secs(30);
/// The bystander's ServiceAccount: any other workload, classified by `service-accounts`.
const BYSTANDER: &str = "bystander";
/// The suggested schema every ServiceAccount falls to without meshgate's.
const SERVICE_ACCOUNTS: &str = "service-accounts";
/// The kubelets' suggested schemas.
const NODE_HIGH: &str = "system-node-high";
const SYSTEM_NODES: &str = "system-nodes";
/// meshgate's schemas (and their levels, of the same names).
const WRITES: &str = "meshgate-node-writes";
const READS: &str = "meshgate";
/// The chart's precedences for them.
const PRECEDENCES: [i32; 2] = [850, 860];

#[tokio::test]
async fn the_fleet_neither_starves_other_clients_nor_is_starved() -> anyhow::Result<()> {
    crate::init_logging();
    let flags = [&[GATE], &INFLIGHT[..]].concat();
    let cp = ControlPlane::start(Options {
        apiserver_flags: flags.iter().map(|f| (*f).to_owned()).collect(),
        ..Options::default()
    })
    .await
    .context("starting a control plane with a small concurrency limit")?;
    let f = authz::seed(cp, "apf").await?;
    suggested_schemas(&f.admin).await?;
    fill(&f).await?;
    let lab = Lab {
        admin: f.admin.clone(),
        agent: f.agent(&f.node_a).await?.own,
        bystander: bystander(&f).await?,
        node_a: f.node_a.clone(),
        app: f.app.clone(),
    };

    let off = lab
        .measure("without meshgate's schemas (the control)")
        .await?;
    // Without them the bystander's and the agent's probes are ServiceAccounts' calls too.
    let probes = [&off.bystander_flooded, &off.writes_flooded];
    off.expect_classified(SERVICE_ACCOUNTS, "workload-low", &probes)?;
    for (what, flooded, alone) in [
        (
            "the bystander",
            &off.bystander_flooded,
            &off.bystander_alone,
        ),
        ("the agent's writes", &off.writes_flooded, &off.writes_alone),
    ] {
        ensure!(
            flooded.quantile(0.99) > off.bound(alone),
            "the control: without the schemas the agents' flood should slow {what} past \
             {:?} (p99 {:?}); the setup no longer saturates the apiserver",
            off.bound(alone),
            flooded.quantile(0.99)
        );
    }

    apply_schemas(&f, &lab).await?;
    let on = lab.measure("with meshgate's schemas").await?;
    on.expect_classified(READS, READS, &[])?;
    on.expect_bystander_within_baseline()?;
    on.expect_writes_through()?;
    print_levels(&f.admin).await?;

    acting_as_its_node(&f).await
}

/// The apiserver's own FlowSchemas (mandatory and suggested), printed by precedence;
/// meshgate's precedences (as the chart renders them) must sit between the last that names a
/// system identity and `kube-system-service-accounts`, and `service-accounts`, which takes
/// every other ServiceAccount, must tell flows apart by user.
async fn suggested_schemas(admin: &Client) -> anyhow::Result<()> {
    let mut all = Api::<FlowSchema>::all(admin.clone())
        .list(&ListParams::default())
        .await?
        .items;
    all.sort_by_key(precedence);
    let line: Vec<String> = all
        .iter()
        .map(|s| format!("{} {}", s.name_any(), precedence(s)))
        .collect();
    println!("apf: the apiserver's schemas: {}", line.join(", "));
    let of = |name: &str| all.iter().find(|s| s.name_any() == name).map(precedence);
    let [writes, reads] = PRECEDENCES;
    // After every schema that names a system identity, before any that takes ServiceAccounts
    // by namespace or all of them (matched before any schema of a larger number).
    let kube_system = of("kube-system-service-accounts").context("no kube-system schema")?;
    let last_system = all
        .iter()
        .map(precedence)
        .filter(|p| *p < kube_system)
        .max();
    ensure!(
        last_system < Some(writes)
            && writes < reads
            && reads < kube_system
            && of(SERVICE_ACCOUNTS) > Some(kube_system),
        "meshgate's precedences {PRECEDENCES:?} are out of place among {line:?}"
    );
    // One flow per user: every agent, being one ServiceAccount, is one flow there.
    let by = |name: &str| {
        all.iter()
            .find(|s| s.name_any() == name)
            .and_then(|s| s.spec.as_ref()?.distinguisher_method.as_ref())
            .map(|d| d.type_.clone())
    };
    ensure!(
        by(SERVICE_ACCOUNTS).as_deref() == Some("ByUser"),
        "{SERVICE_ACCOUNTS} no longer distinguishes flows by user"
    );
    let rendered = helm::template(&["--show-only", "templates/flowcontrol.yaml"]).await?;
    for p in [writes, reads] {
        ensure!(
            rendered.contains(&format!("matchingPrecedence: {p}\n")),
            "the chart's precedences are no longer {writes} and {reads}"
        );
    }
    Ok(())
}

fn precedence(s: &FlowSchema) -> i32 {
    s.spec
        .as_ref()
        .and_then(|s| s.matching_precedence)
        .unwrap_or_default()
}

/// [`BULK_PODS`] pods on node B (no kubelet runs them), each with [`BULK_BYTES`] of
/// annotation.
async fn fill(f: &Fixture) -> anyhow::Result<()> {
    let ns = f.cp.create_namespace(&f.admin, "apf-bulk").await?;
    let api: Api<Pod> = Api::namespaced(f.admin.clone(), &ns);
    let filler = "x".repeat(BULK_BYTES);
    futures::stream::iter(0..BULK_PODS)
        .map(|k| {
            let pod = serde_json::from_value::<Pod>(json!({
                "metadata": {"name": format!("bulk-{k}"),
                             "annotations": {"e2e.meshgate.io/filler": filler}},
                "spec": {"nodeName": f.node_b,
                         "containers": [{"name": "app", "image": "registry.invalid/app:1"}]},
            }));
            let api = api.clone();
            async move {
                let pod = pod?;
                tokio::time::timeout(STEP, api.create(&PostParams::default(), &pod))
                    .await
                    .context("creating a bulk pod")??;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(8)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

/// A request of `method` to `uri` (a path the test wrote) with `body`.
fn request(method: http::Method, uri: &str, body: Vec<u8>) -> http::Request<Vec<u8>> {
    let mut req = http::Request::new(body);
    *req.method_mut() = method;
    *req.uri_mut() = uri.parse().expect("the test's own URI");
    req
}

/// A GET of `uri`.
fn get(uri: &str) -> http::Request<Vec<u8>> {
    request(http::Method::GET, uri, Vec::new())
}

/// A merge patch of meshgate's verified label to `value` on the Node at `uri`.
fn label_patch(uri: &str, value: &str) -> http::Request<Vec<u8>> {
    let patch = json!({"metadata": {"labels": {VERIFIED_LABEL: value}}});
    let mut req = request(http::Method::PATCH, uri, patch.to_string().into_bytes());
    req.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/merge-patch+json"),
    );
    req
}

/// A ServiceAccount of the test's in the application namespace, allowed to list pods
/// cluster-wide, and a client with its token.
async fn bystander(f: &Fixture) -> anyhow::Result<Client> {
    let name = unique_name(BYSTANDER);
    let yaml = format!(
        "apiVersion: v1\nkind: ServiceAccount\nmetadata: {{name: {BYSTANDER}, namespace: {app}}}\n\
         ---\napiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\nmetadata: {{name: {name}}}\n\
         rules: [{{apiGroups: [\"\"], resources: [pods], verbs: [list]}}]\n\
         ---\napiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\n\
         metadata: {{name: {name}}}\n\
         roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: {name}}}\n\
         subjects: [{{kind: ServiceAccount, name: {BYSTANDER}, namespace: {app}}}]\n",
        app = f.app
    );
    apply(&f.cp, &yaml, "bystander").await?;
    let token =
        meshgate_e2e::service_account_token(&f.admin, &f.app, BYSTANDER, &TokenOptions::default())
            .await?;
    let client = f.cp.client_for_token(&token)?;
    let api: Api<Pod> = Api::namespaced(client.clone(), &f.app);
    poll_until("the bystander's grant", WAIT, || async {
        anyhow::Ok(api.list(&ListParams::default()).await.ok().map(|_| ()))
    })
    .await?;
    Ok(client)
}

/// `kubectl apply` of `yaml`, written into the control plane's directory as `name`.
async fn apply(cp: &ControlPlane, yaml: &str, name: &str) -> anyhow::Result<()> {
    let path = cp.dir().join(format!("{}.yaml", unique_name(name)));
    std::fs::write(&path, yaml)?;
    cp.kubectl(&["apply", "-f", &path.display().to_string()])
        .await?;
    Ok(())
}

/// The chart's `templates/flowcontrol.yaml` (default values) applied; returns once the
/// apiserver classifies the agent's reads by meshgate's schema.
async fn apply_schemas(f: &Fixture, lab: &Lab) -> anyhow::Result<()> {
    let rendered = helm::template(&["--show-only", "templates/flowcontrol.yaml"]).await?;
    apply(&f.cp, &rendered, "flowcontrol").await?;
    let reads = schema_uid(&f.admin, READS).await?;
    poll_until(
        "the apiserver classifying by meshgate's schema",
        WAIT,
        || {
            let reads = reads.clone();
            async move {
                let fs = classified_by(&lab.agent, get("/api/v1/pods?limit=1")).await?;
                anyhow::Ok((fs == reads).then_some(()))
            }
        },
    )
    .await?;
    Ok(())
}

/// The uid of FlowSchema `name`.
async fn schema_uid(admin: &Client, name: &str) -> anyhow::Result<String> {
    Api::<FlowSchema>::all(admin.clone())
        .get(name)
        .await?
        .uid()
        .with_context(|| format!("FlowSchema {name} has no uid"))
}

/// The FlowSchema uid the apiserver's answer to `req` names (`X-Kubernetes-PF-FlowSchema-UID`).
async fn classified_by(client: &Client, req: http::Request<Vec<u8>>) -> anyhow::Result<String> {
    let res = tokio::time::timeout(STEP, client.send(req.map(kube::client::Body::from)))
        .await
        .context("no answer")??;
    ensure!(res.status().is_success(), "status {}", res.status());
    res.headers()
        .get("X-Kubernetes-PF-FlowSchema-UID")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .context("no X-Kubernetes-PF-FlowSchema-UID header")
}

/// Each level's nominal seats as the apiserver computed them, printed.
async fn print_levels(admin: &Client) -> anyhow::Result<()> {
    let text = apiserver_metrics(admin).await?;
    let seats: Vec<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("apiserver_flowcontrol_nominal_limit_seats{"))
        .map(|l| l.replace("priority_level=", "").replace(['"', '}'], ""))
        .collect();
    println!("apf: nominal seats: {}", seats.join(", "));
    Ok(())
}

/// With the impersonation ClusterRole (reads and evictions as `system:node:<node>`): which
/// schema classifies each call made as the node, the ServiceAccount's own write, and, for
/// comparison, the admin acting (plain impersonation) as the agent and as a node (a kubelet's
/// identity: group `system:nodes`). Printed, and each schema's dispatched count must grow by
/// at least the calls it classified.
async fn acting_as_its_node(f: &Fixture) -> anyhow::Result<()> {
    crate::reach::confine(f).await?;
    let clients = meshgate_agent::daemon::clients::Clients::build(
        Some(&f.agent_kubeconfig),
        &f.node_a,
        true,
        false,
    )
    .await?;
    let (node, own) = (&clients.node, &clients.own);
    let node_uri = format!("/api/v1/nodes/{}", f.node_a);
    let pods_uri = format!("/api/v1/pods?fieldSelector=spec.nodeName%3D{}", f.node_a);
    let evict_uri = format!("/api/v1/namespaces/{}/pods/on-a/eviction?dryRun=All", f.app);
    let eviction = json!({"apiVersion": "policy/v1", "kind": "Eviction",
                          "metadata": {"name": "on-a", "namespace": f.app}});
    let mut evict = request(
        http::Method::POST,
        &evict_uri,
        eviction.to_string().into_bytes(),
    );
    evict.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    let agent_user = format!(
        "system:serviceaccount:{}:meshgate-agent",
        crate::support::NS
    );
    let kubelet_user = format!("system:node:{}", f.node_a);
    let calls: Vec<(&str, &Client, http::Request<Vec<u8>>, &str)> = vec![
        (
            "agent as its node: GET its Node",
            node,
            get(&node_uri),
            NODE_HIGH,
        ),
        (
            "agent as its node: LIST its pods",
            node,
            get(&pods_uri),
            SYSTEM_NODES,
        ),
        (
            "agent as its node: evict (dry run)",
            node,
            evict,
            SYSTEM_NODES,
        ),
        (
            "agent as itself: PATCH its Node",
            own,
            label_patch(&node_uri, "true"),
            WRITES,
        ),
        (
            "admin acting as the agent: LIST Namespaces",
            &f.admin,
            impersonating(
                get("/api/v1/namespaces?limit=1"),
                &agent_user,
                &["system:serviceaccounts"],
            ),
            READS,
        ),
        (
            "admin acting as node A's kubelet: GET its Node",
            &f.admin,
            impersonating(get(&node_uri), &kubelet_user, &["system:nodes"]),
            NODE_HIGH,
        ),
    ];
    let names = schema_names(&f.admin).await?;
    let metric = "apiserver_flowcontrol_dispatched_requests_total";
    let dispatched = |text: &str, schema: &str| counter(text, metric, &[("flow_schema", schema)]);
    let before = apiserver_metrics(&f.admin).await?;
    let mut wrong = Vec::new();
    for (what, client, req, want) in calls.iter().map(|(w, c, r, s)| (*w, *c, clone(r), *s)) {
        let uid = classified_by(client, req).await.context(what)?;
        let got = names.get(&uid).map_or("an unknown schema", String::as_str);
        println!("apf: {what}: classified by {got}");
        if got != want {
            wrong.push(format!("{what}: {got}, want {want}"));
        }
    }
    let after = apiserver_metrics(&f.admin).await?;
    ensure!(wrong.is_empty(), "classified otherwise: {wrong:?}");
    for schema in [READS, WRITES, SYSTEM_NODES, NODE_HIGH] {
        let want = calls.iter().filter(|c| c.3 == schema).count() as f64;
        let grew = dispatched(&after, schema) - dispatched(&before, schema);
        ensure!(
            grew >= want,
            "{schema} dispatched {grew} of the {want} calls it classified"
        );
    }
    Ok(())
}

/// `req` with the admin's impersonation headers for `user` in `groups`.
fn impersonating(
    mut req: http::Request<Vec<u8>>,
    user: &str,
    groups: &[&str],
) -> http::Request<Vec<u8>> {
    let h = req.headers_mut();
    h.insert("Impersonate-User", user.parse().expect("a header value"));
    for g in groups.iter().chain(&["system:authenticated"]) {
        h.append("Impersonate-Group", g.parse().expect("a header value"));
    }
    req
}

/// A copy of `req` (http's requests are not `Clone`).
fn clone(req: &http::Request<Vec<u8>>) -> http::Request<Vec<u8>> {
    let mut copy = request(
        req.method().clone(),
        &req.uri().to_string(),
        req.body().clone(),
    );
    *copy.headers_mut() = req.headers().clone();
    copy
}

/// Every FlowSchema's name by its uid.
async fn schema_names(admin: &Client) -> anyhow::Result<std::collections::HashMap<String, String>> {
    Ok(Api::<FlowSchema>::all(admin.clone())
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .filter_map(|s| Some((s.uid()?, s.name_any())))
        .collect())
}
