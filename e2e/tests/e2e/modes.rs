//! The live mode (ConfigMap `meshgate-mode`) against the real apiserver: the agent as a host
//! process for a simulated node, the webhook in-process behind the shipped configurations.
//!
//! Each test keeps its mode ConfigMap in a namespace of its own (`--namespace`), so tests
//! sharing the control plane never see each other's mode. What `pods/mode.rs` adds: report
//! mode evicts nothing, and condition-only evicts.

use std::time::{Duration, SystemTime};

use anyhow::{Context as _, ensure};
use k8s_openapi::api::core::v1::{ConfigMap, Node};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::rbac::v1::RoleBinding;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use meshgate_core::gate::{CONDITION_TYPE, DEFAULT_TAINT_KEY as TAINT_KEY, VERIFIED_LABEL};
use meshgate_core::mode::{self, Mode};
use meshgate_e2e::harness::audit;
use meshgate_e2e::harness::wait::poll_until;
use meshgate_e2e::sim::node::{gate_condition as condition, tainted, verified_label as label};
use meshgate_e2e::{NodeSpec, TokenOptions, unique_name};
use serde_json::{Value, json};

use crate::support::{Agent, CniDirs, golden, wait_node};
use crate::webhook::{Fixture, SCOPE_KEY, Start, create_pod, pod};
use crate::{WAIT, cp};

/// Creates or replaces the mode ConfigMap in `namespace` with `mode` (any text: an invalid
/// value is a case of its own).
pub async fn set_mode(client: &Client, namespace: &str, mode: &str) -> anyhow::Result<()> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let cm = json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": mode::CONFIGMAP},
        "data": {mode::KEY: mode},
    });
    api.patch(
        mode::CONFIGMAP,
        &PatchParams::apply("meshgate-e2e").force(),
        &Patch::Apply(cm),
    )
    .await
    .with_context(|| format!("setting the mode to {mode:?} in {namespace}"))?;
    Ok(())
}

/// A node with the unverified golden config (calico without linkerd-cni) and its agent,
/// reading its mode from `mode_ns`.
async fn start(
    client: &Client,
    prefix: &str,
    mode_ns: &str,
    spec: impl FnOnce(NodeSpec) -> NodeSpec,
) -> anyhow::Result<(String, CniDirs, Agent)> {
    let cp = cp().await;
    let node = unique_name(prefix);
    cp.register_node(client, &spec(NodeSpec::new(&node)))
        .await?;
    let dirs = CniDirs::new()?;
    dirs.config("10-calico.conflist", &golden("calico.conflist")?)?;
    let agent = Agent::start(cp, &node, &dirs, &["--namespace", mode_ns])?;
    Ok((node, dirs, agent))
}

/// The condition says `status` (and the label agrees): the agent's reconcile wrote the taint
/// part of its plan before it (one pass: taint and label, then the condition).
fn says(status: &'static str) -> impl Fn(&Node) -> bool {
    move |n| {
        let want_label = if status == "True" { "true" } else { "false" };
        condition(n).is_some_and(|(s, _, _)| s == status) && label(n) == Some(want_label)
    }
}

/// meshgate's taints on the node (every taint under its key), as (value, effect).
fn our_taints(n: &Node) -> Vec<(Option<String>, String)> {
    let taints = n.spec.as_ref().and_then(|s| s.taints.as_deref());
    taints
        .unwrap_or_default()
        .iter()
        .filter(|t| t.key == TAINT_KEY)
        .map(|t| (t.value.clone(), t.effect.clone()))
        .collect()
}

/// The (reason, action, note) of the agent's Events about `node`.
async fn node_events(client: &Client, node: &str) -> anyhow::Result<Vec<(String, String, String)>> {
    let events: Api<Event> = Api::namespaced(client.clone(), "default");
    Ok(events
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|e| {
            e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(node)
                && e.reporting_controller.as_deref() == Some("meshgate-agent")
        })
        .map(|e| {
            (
                e.reason.unwrap_or_default(),
                e.action.unwrap_or_default(),
                e.note.unwrap_or_default(),
            )
        })
        .collect())
}

/// Sets the mode and returns how long after the patch the Node first satisfied `pred`, read
/// every 10 ms (a measurement printed by the test, not a bound).
async fn switch_until(
    client: &Client,
    mode_ns: &str,
    mode: &str,
    node: &str,
    pred: impl Fn(&Node) -> bool,
) -> anyhow::Result<Duration> {
    let nodes: Api<Node> = Api::all(client.clone());
    let start = std::time::Instant::now();
    set_mode(client, mode_ns, mode).await?;
    while start.elapsed() < WAIT {
        if pred(&nodes.get(node).await?) {
            return Ok(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    anyhow::bail!("node {node} did not follow the switch to {mode} within {WAIT:?}")
}

#[tokio::test]
async fn report_mode_never_taints_and_a_live_switch_to_enforce_and_back_takes_effect()
-> anyhow::Result<()> {
    let cp = cp().await;
    let client = cp.client()?;
    let mode_ns = cp.create_namespace(&client, "mode-report").await?;
    set_mode(&client, &mode_ns, "report").await?;
    let (node, _dirs, agent) = start(&client, "mode-report", &mode_ns, |s| s).await?;

    // The condition, label and Event say what enforce would do; no taint.
    let n = wait_node(
        &client,
        &node,
        "condition False in report mode",
        says("False"),
    )
    .await?;
    assert!(!tainted(&n), "report mode tainted the node: {:?}", n.spec);
    poll_until("the would-taint Event", WAIT, || async {
        let events = node_events(&client, &node).await?;
        anyhow::Ok(events.into_iter().find(|(reason, action, note)| {
            reason == "CNIChainUnverified"
                && action == "WouldTaint"
                && note.starts_with("report mode, would taint: ChainedPluginMissing")
        }))
    })
    .await?;
    assert_eq!(
        agent.metric("meshgate_mode{mode=\"report\"}").await,
        Some(1.0)
    );
    assert_eq!(
        agent.metric("meshgate_mode{mode=\"enforce\"}").await,
        Some(0.0)
    );
    let would_taint = "meshgate_report_only_actions_total{action=\"taint\"}";
    assert_eq!(agent.metric(would_taint).await, Some(1.0));
    assert_eq!(
        agent
            .metric("meshgate_taint_transitions_total{action=\"added\"}")
            .await,
        None
    );

    // Switched to enforce: tainted by the same process, no restart.
    let pid = agent.pid();
    let took = switch_until(&client, &mode_ns, "enforce", &node, |n| {
        tainted(n) && says("False")(n)
    })
    .await?;
    eprintln!("report → enforce: the node was tainted {took:?} after the ConfigMap patch");
    // And back to report: meshgate's taint goes, the verdict stays.
    let took = switch_until(&client, &mode_ns, "report", &node, |n| {
        !tainted(n) && says("False")(n)
    })
    .await?;
    eprintln!("enforce → report: the taint was removed {took:?} after the ConfigMap patch");
    let n = Api::<Node>::all(client.clone()).get(&node).await?;
    assert_eq!(agent.pid(), pid, "the same agent process throughout");
    assert_eq!(agent.admin_get("/ready").await.map(|r| r.0), Some(200));
    let (status, reason, _) = condition(&n).unwrap_or_default();
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "ChainedPluginMissing")
    );

    // An unknown value: enforce (fail closed), flagged.
    set_mode(&client, &mode_ns, "reprot").await?;
    wait_node(&client, &node, "tainted under an invalid mode", tainted).await?;
    assert_eq!(
        agent.metric("meshgate_mode_config_invalid").await,
        Some(1.0)
    );
    Ok(())
}

#[tokio::test]
async fn condition_only_never_touches_a_taint_under_meshgates_key() -> anyhow::Result<()> {
    let cp = cp().await;
    let client = cp.client()?;
    let mode_ns = cp.create_namespace(&client, "mode-cond").await?;
    set_mode(&client, &mode_ns, "condition-only").await?;
    // Another controller (the node-readiness-controller) owns a taint under meshgate's key,
    // with a value meshgate never writes: any rewrite by meshgate would show.
    let (node, dirs, _agent) = start(&client, "mode-cond", &mode_ns, |s| s).await?;
    let nodes: Api<Node> = Api::all(client.clone());
    let theirs = json!([{"key": TAINT_KEY, "value": "nrc", "effect": "NoSchedule"}]);
    nodes
        .patch(
            &node,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"taints": theirs}})),
        )
        .await?;
    let owned = vec![(Some("nrc".to_owned()), "NoSchedule".to_owned())];

    let n = wait_node(&client, &node, "condition False", says("False")).await?;
    assert_eq!(our_taints(&n), owned);
    dirs.config("10-calico.conflist", &golden("calico-linkerd.conflist")?)?;
    let n = wait_node(&client, &node, "condition True", says("True")).await?;
    assert_eq!(
        our_taints(&n),
        owned,
        "verified: the other controller's taint stays"
    );

    // The other controller lifts it; the chain breaks again: meshgate adds none.
    nodes
        .patch(
            &node,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"taints": []}})),
        )
        .await?;
    dirs.config("10-calico.conflist", &golden("calico.conflist")?)?;
    let n = wait_node(&client, &node, "condition False again", says("False")).await?;
    assert_eq!(our_taints(&n), Vec::new(), "condition-only added a taint");
    let events = node_events(&client, &node).await?;
    ensure!(
        !events.is_empty() && events.iter().all(|(_, action, _)| action == "SetCondition"),
        "{events:?}"
    );
    Ok(())
}

/// The hand-over from a NodeReadinessRule back to meshgate (docs/operations.md, "With the
/// node-readiness-controller"): the mode switched to enforce while the rule's taint (same key,
/// no value) is on an unverified node leaves it as it is; when the rule's deletion takes it
/// off (the controller's finalizer untaints every Node), the agent puts its own back.
#[tokio::test]
async fn an_enforcing_agent_re_taints_its_node_when_the_rules_taint_is_removed()
-> anyhow::Result<()> {
    let cp = cp().await;
    let client = cp.client()?;
    let mode_ns = cp.create_namespace(&client, "mode-handover").await?;
    set_mode(&client, &mode_ns, "condition-only").await?;
    let (node, _dirs, agent) = start(&client, "mode-handover", &mode_ns, |s| s).await?;
    let nodes: Api<Node> = Api::all(client.clone());
    let set_taints = |taints: Value| {
        let nodes = nodes.clone();
        let node = node.clone();
        async move {
            let patch = Patch::Merge(json!({"spec": {"taints": taints}}));
            nodes.patch(&node, &PatchParams::default(), &patch).await
        }
    };
    set_taints(json!([{"key": TAINT_KEY, "effect": "NoSchedule"}])).await?;
    wait_node(&client, &node, "condition False", says("False")).await?;
    let rv = nodes.get(&node).await?.resource_version();
    // What the operator checks before dropping the rule: every agent's gauge says enforce.
    set_mode(&client, &mode_ns, "enforce").await?;
    let enforcing = "meshgate_mode{mode=\"enforce\"}";
    poll_until("the agent to enforce", WAIT, || async {
        anyhow::Ok((agent.metric(enforcing).await == Some(1.0)).then_some(()))
    })
    .await?;
    let n = nodes.get(&node).await?;
    assert_eq!(n.resource_version(), rv, "enforce rewrote the rule's taint");
    // Read every 10 ms: the time printed is a measurement, not a bound.
    let removed = std::time::Instant::now();
    set_taints(json!([])).await?;
    let n = loop {
        let n = nodes.get(&node).await?;
        if !our_taints(&n).is_empty() {
            break n;
        }
        ensure!(removed.elapsed() < WAIT, "not re-tainted within {WAIT:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    eprintln!(
        "meshgate's taint back {:?} after the rule's was removed",
        removed.elapsed()
    );
    assert_eq!(our_taints(&n), vec![(None, "NoSchedule".to_owned())]);
    Ok(())
}

/// A client acting as `namespace`'s default ServiceAccount, which may edit the namespace: its
/// requests are in the audit log (the admin's are left out).
async fn audited_client(client: &Client, namespace: &str) -> anyhow::Result<(Client, String)> {
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "e2e-edit"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
        "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": namespace}],
    }))?;
    Api::<RoleBinding>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &binding)
        .await?;
    let token =
        meshgate_e2e::service_account_token(client, namespace, "default", &TokenOptions::default())
            .await?;
    let user = audit::service_account_user(namespace, "default");
    Ok((cp().await.client_for_token(&token)?, user))
}

/// POSTs `pod` as `client` and returns the HTTP status and the `Warning` headers.
async fn post_pod(client: &Client, ns: &str, pod: &Value) -> anyhow::Result<(u16, Vec<String>)> {
    let req = http::Request::post(format!("/api/v1/namespaces/{ns}/pods"))
        .header("content-type", "application/json")
        .body(serde_json::to_vec(pod)?.into())?;
    let resp = tokio::time::timeout(Duration::from_secs(20), client.send(req)).await??;
    let warnings = resp
        .headers()
        .get_all("warning")
        .iter()
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .collect();
    Ok((resp.status().as_u16(), warnings))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_webhook_in_report_mode_admits_with_a_warning_and_an_audit_annotation() {
    let cp = cp().await;
    let admin = cp.client().expect("client");
    let mode_ns = cp.create_namespace(&admin, "wh-mode").await.expect("ns");
    // Started in enforce: the fixture waits until the webhook gates a new Node.
    set_mode(&admin, &mode_ns, "enforce").await.expect("mode");
    let start = Start {
        kubeconfig: cp.admin_kubeconfig_path().to_path_buf(),
        profile_file: None,
        tag_hooks: false,
        taint_key: Default::default(),
        mode: meshgate_shell::mode::ModeSource {
            namespace: mode_ns.clone(),
            ..Default::default()
        },
    };
    let f = Fixture::start_with(cp, "whmode", start)
        .await
        .expect("webhook");
    let result = report_then_enforce(&f, &admin, &mode_ns).await;
    f.teardown().await;
    result.expect("report, then enforce");
}

/// Switches the mode and waits until the webhook acts in it (its `meshgate_mode` gauge).
async fn switch_webhook(
    f: &Fixture,
    admin: &Client,
    mode_ns: &str,
    mode: Mode,
) -> anyhow::Result<()> {
    set_mode(admin, mode_ns, mode.as_str()).await?;
    let sample = format!("meshgate_mode{{mode=\"{mode}\"}}");
    poll_until(&format!("the webhook in {mode}"), WAIT, || async {
        anyhow::Ok((f.metric(&sample).await == Some(1.0)).then_some(()))
    })
    .await?;
    Ok(())
}

/// Registers a Node in the webhook's scope: whether the Node-CREATE mutation tainted it (it
/// must label it unverified in every mode).
async fn registered_tainted(f: &Fixture, admin: &Client) -> anyhow::Result<bool> {
    let name = unique_name("wh-reg");
    let spec = NodeSpec::new(&name).label(SCOPE_KEY, &f.tag);
    let n = cp().await.register_node(admin, &spec).await?;
    ensure!(
        label(&n) == Some("false"),
        "not labelled unverified: {:?}",
        n.metadata.labels
    );
    Ok(tainted(&n))
}

async fn report_then_enforce(f: &Fixture, admin: &Client, mode_ns: &str) -> anyhow::Result<()> {
    let cp = cp().await;
    switch_webhook(f, admin, mode_ns, Mode::Report).await?;
    ensure!(
        !registered_tainted(f, admin).await?,
        "tainted at CREATE in report mode"
    );
    let ns = f.namespace(&[]).await?;
    let node = unique_name("wh-mode");
    cp.register_node(admin, &NodeSpec::new(&node).label(VERIFIED_LABEL, "false"))
        .await?;
    let (client, user) = audited_client(admin, &ns).await?;

    // Report: created (201), the refusal as a warning to the client.
    let sent = SystemTime::now();
    let meshed = serde_json::to_value(pod("web", Some(&node), true, None))?;
    let (status, warnings) = post_pod(&client, &ns, &meshed).await?;
    assert_eq!(status, 201, "{warnings:?}");
    assert!(
        warnings.iter().any(
            |w| w.contains("meshgate report mode: enforce would refuse this")
                && w.contains(&format!("node {node}"))
        ),
        "{warnings:?}"
    );
    // ... and in the apiserver's audit log, under the webhook's name.
    let key = format!(
        "pods.validate.meshgate.io/{}",
        meshgate_webhook::review::WOULD_REFUSE
    );
    let log = cp.audit_log();
    let annotated = poll_until("the audit annotation", WAIT, || async {
        let all = audit::read(&log)?;
        let found = audit::by_user(
            &all,
            &user,
            sent - Duration::from_secs(1),
            SystemTime::now(),
        )
        .into_iter()
        .find(|r| r.verb == "create" && r.resource == "pods" && r.name == "web")
        .and_then(|r| r.annotations.get(&key).cloned());
        anyhow::Ok(found)
    })
    .await?;
    assert!(
        annotated.contains(&format!("node {node} is not verified")),
        "{annotated}"
    );

    // Enforce, then condition-only, live: the same placement is refused in both; only
    // enforce taints a new Node.
    for (mode, taints) in [(Mode::Enforce, true), (Mode::ConditionOnly, false)] {
        switch_webhook(f, admin, mode_ns, mode).await?;
        let again = pod("web-2", Some(&node), true, None);
        let refused = create_pod(&client, &ns, &again, true).await?.err();
        let refused = refused.with_context(|| format!("admitted in {mode}"))?;
        assert!(
            refused.contains("not verified") && refused.contains("(403)"),
            "{refused}"
        );
        assert_eq!(registered_tainted(f, admin).await?, taints, "{mode}");
    }
    assert_eq!(
        f.metric("meshgate_report_only_actions_total{action=\"refuse\"}")
            .await,
        Some(1.0)
    );
    Ok(())
}

/// The chart's opt-in NodeReadinessRule, rendered by `helm template`: it requires meshgate's
/// condition and manages the chart's taint key, and comes only with the mode condition-only.
/// (The node-readiness-controller and its CRD are not installed here: what the controller does
/// with the rule is not exercised; see docs/testing.md.)
#[tokio::test]
async fn the_node_readiness_rule_gates_on_meshgates_condition_and_taint() -> anyhow::Result<()> {
    use meshgate_e2e::harness::helm;
    async fn render(args: &[&str]) -> anyhow::Result<Vec<Value>> {
        Ok(serde_saphyr::from_multiple(&helm::template(args).await?)?)
    }
    let mode_of = |docs: &[Value]| -> anyhow::Result<Result<Mode, _>> {
        let cm = docs
            .iter()
            .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == mode::CONFIGMAP)
            .context("no mode ConfigMap")?;
        Ok(Mode::from_config(cm["data"][mode::KEY].as_str()))
    };
    let on = [
        "--set",
        "mode=condition-only",
        "--set",
        "nodeReadinessRule.enabled=true",
    ];
    for key in [TAINT_KEY, "readiness.k8s.io/example-mesh-cni"] {
        let set = format!("taintKey={key}");
        let docs = render(&[&on[..], &["--set", &set]].concat()).await?;
        let rule = docs
            .iter()
            .find(|d| d["kind"] == "NodeReadinessRule")
            .context("no NodeReadinessRule")?;
        assert_eq!(rule["apiVersion"], "readiness.node.x-k8s.io/v1alpha1");
        let spec = &rule["spec"];
        assert_eq!(
            spec["conditions"],
            json!([{"type": CONDITION_TYPE, "requiredStatus": "True"}])
        );
        assert_eq!(spec["taint"]["key"], key);
        assert_eq!(spec["taint"]["effect"], "NoSchedule");
        assert_eq!(spec["enforcementMode"], "continuous");
        assert_eq!(spec["dryRun"], false);
        assert_eq!(mode_of(&docs)?, Ok(Mode::ConditionOnly));
    }
    // The default values: no rule, and enforce.
    let docs = render(&[]).await?;
    ensure!(!docs.iter().any(|d| d["kind"] == "NodeReadinessRule"));
    assert_eq!(mode_of(&docs)?, Ok(Mode::Enforce));
    // The rule with a mode in which meshgate manages the taint, or with a key the controller
    // refuses: the chart refuses to render.
    for wrong in [
        &["--set", "nodeReadinessRule.enabled=true"][..],
        &[&on[..], &["--set", "taintKey=meshgate.io/cni-unverified"]].concat(),
    ] {
        let refused = helm::template(wrong).await;
        let err = format!("{:#}", refused.err().context("rendered")?);
        ensure!(err.contains("nodeReadinessRule.enabled needs"), "{err}");
    }
    Ok(())
}
