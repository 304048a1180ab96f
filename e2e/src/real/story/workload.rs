//! The story's workloads and probes: the meshed pod shapes, istio-cni's kubeconfig, and what
//! is read inside a pod's network namespace (`meshgate-agent inspect`, iptables and nft).
//!
//! In: a real node and its pods. Out: pod specs, a kubeconfig path, pids, verdicts and rule
//! dumps, each command bounded in time.

use super::*;

/// A pod as Istio's sidecar injector leaves it in CNI mode: an `istio-proxy` container running
/// as 1337, the `sidecar.istio.io/status` annotation istio-cni checks before it programs the
/// redirect, and the `security.istio.io/tlsMode=istio` label meshgate's istio profile selects.
pub fn sidecar_pod_template(app: &str) -> serde_json::Value {
    let container = |name: &str, uid: Option<i64>| {
        json!({
            "name": name,
            "image": BUSYBOX_IMAGE,
            "imagePullPolicy": "Never",
            "command": ["/bin/sleep", "3600"],
            "securityContext": uid.map(|u| json!({"runAsUser": u, "runAsGroup": u})),
        })
    };
    json!({
        "metadata": {
            "labels": {
                "app": app,
                "security.istio.io/tlsMode": "istio",
                "service.istio.io/canonical-name": app,
            },
            "annotations": {
                "sidecar.istio.io/status": "{\"initContainers\":[\"istio-validation\"],\"containers\":[\"istio-proxy\"],\"volumes\":[],\"imagePullSecrets\":null,\"revision\":\"default\"}",
                "kubectl.kubernetes.io/default-container": "app",
            },
        },
        "spec": {
            "automountServiceAccountToken": false,
            "enableServiceLinks": false,
            "terminationGracePeriodSeconds": 1,
            "containers": [container("app", None), container("istio-proxy", Some(1337))],
        }
    })
}

/// The meshed Deployment, held to `node` by its hostname label. It tolerates meshgate's taint,
/// as a workload may: then only the webhook, refusing the binding, keeps it off the unverified
/// node, which is what the story shows.
pub(super) fn web_deployment(node: &str) -> serde_json::Value {
    let mut template = sidecar_pod_template(WEB);
    template["spec"]["nodeSelector"] = json!({"kubernetes.io/hostname": node});
    template["spec"]["tolerations"] = json!([{"key": TAINT_KEY, "operator": "Exists"}]);
    json!({
        "metadata": {"name": WEB},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": WEB}},
            "template": template,
        }
    })
}

pub(super) fn direct_pod(node: &str) -> serde_json::Value {
    let mut pod = sidecar_pod_template("direct-to-node");
    pod["metadata"]["name"] = json!("direct-to-node");
    pod["spec"]["nodeName"] = json!(node);
    pod["spec"]["tolerations"] = json!([{"operator": "Exists"}]);
    pod
}

/// A ServiceAccount `istio-cni` allowed to read pods (all the plugin reads in sidecar mode),
/// and a token kubeconfig for it, as Istio's installer writes one for the plugin.
pub async fn istio_cni_kubeconfig(
    cp: &crate::ControlPlane,
    client: &Client,
    ns: &str,
) -> anyhow::Result<String> {
    let meta = |name: &str| ObjectMeta {
        name: Some(name.into()),
        namespace: Some(ns.into()),
        ..Default::default()
    };
    let pp = PostParams::default();
    let sa = ServiceAccount {
        metadata: meta("istio-cni"),
        ..Default::default()
    };
    let role = Role {
        metadata: meta("istio-cni"),
        rules: Some(vec![PolicyRule {
            api_groups: Some(vec![String::new()]),
            resources: Some(vec!["pods".into()]),
            verbs: vec!["get".into()],
            ..Default::default()
        }]),
    };
    let binding = RoleBinding {
        metadata: meta("istio-cni"),
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".into(),
            kind: "Role".into(),
            name: "istio-cni".into(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: "istio-cni".into(),
            namespace: Some(ns.into()),
            ..Default::default()
        }]),
    };
    let (sas, roles, bindings) = (
        Api::<ServiceAccount>::namespaced(client.clone(), ns),
        Api::<Role>::namespaced(client.clone(), ns),
        Api::<RoleBinding>::namespaced(client.clone(), ns),
    );
    wait::api("creating istio-cni's ServiceAccount", sas.create(&pp, &sa)).await?;
    wait::api("creating istio-cni's Role", roles.create(&pp, &role)).await?;
    wait::api(
        "creating istio-cni's RoleBinding",
        bindings.create(&pp, &binding),
    )
    .await?;
    let token = service_account_token(client, ns, "istio-cni", &TokenOptions::default()).await?;
    let path = cp.write_token_kubeconfig(&format!("istio-cni-{ns}"), &token)?;
    Ok(std::fs::read_to_string(path)?)
}

/// The host pid of the pod's `app` container, from containerd's task list.
pub async fn app_pid(node: &RealNode, pod: &Pod) -> anyhow::Result<i32> {
    container_pid(node, pod, "app").await
}

/// The host pid of the pod's container `name`, from containerd's task list.
pub async fn container_pid(node: &RealNode, pod: &Pod, name: &str) -> anyhow::Result<i32> {
    let id = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.name == name))
        .and_then(|c| c.container_id.clone())
        .with_context(|| format!("the {name} container has no containerID"))?;
    Ok(node.container_pid(&id).await?)
}

/// `meshgate-agent inspect --pid <pid> --profile istio --output json`, run from the host as an
/// operator would: its exit code, and the verdict it printed (or, when it printed none, what
/// it printed instead, so an assertion on the verdict shows it).
pub async fn inspect_pid(pid: i32) -> anyhow::Result<(Option<i32>, String)> {
    let bin = crate::sim::node::workspace_bin("meshgate-agent")?;
    let mut cmd = tokio::process::Command::new(bin);
    cmd.args(["inspect", "--pid", &pid.to_string(), "--profile", "istio"])
        .args(["--output", "json"]);
    let out =
        wait::command_output("meshgate-agent inspect", Duration::from_secs(30), &mut cmd).await?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let verdict = serde_json::from_str::<serde_json::Value>(&stdout)
        .ok()
        .and_then(|v| v.get("verdict")?.as_str().map(str::to_owned))
        .unwrap_or_else(|| {
            format!(
                "no verdict; stdout {stdout:?}, stderr {:?}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    Ok((out.status.code(), verdict))
}

/// [`inspect_pid`] on the pod's `app` container: the verdict, which must be one and agree
/// with the exit code (0 redirected, 1 missing, 2 unknown, for scripts).
pub(super) async fn inspect_pod(node: &RealNode, pod: &Pod) -> anyhow::Result<String> {
    let (exit, verdict) = inspect_pid(app_pid(node, pod).await?).await?;
    let code = match verdict.as_str() {
        "redirected" => 0,
        "missing" => 1,
        "unknown" => 2,
        _ => bail!("`meshgate-agent inspect` printed {verdict}"),
    };
    ensure!(
        exit == Some(code),
        "`meshgate-agent inspect` printed {verdict} but exited {exit:?}, not {code}"
    );
    Ok(verdict)
}

/// The pod's netfilter rules as the host's tools print them inside its network namespace:
/// `nft list ruleset` with `nft`, else `iptables-save`.
pub(super) async fn netfilter_dump(
    node: &RealNode,
    pod: &Pod,
    nft: bool,
) -> anyhow::Result<String> {
    let tool: &[&str] = if nft {
        &["nft", "list", "ruleset"]
    } else {
        &["iptables-save"]
    };
    in_netns(app_pid(node, pod).await?, tool).await
}

/// Runs one of the host's tools (`iptables-save`, `ip addr`, ...) in the network namespace of
/// `pid`; its stdout.
pub async fn in_netns(pid: i32, tool: &[&str]) -> anyhow::Result<String> {
    let mut cmd = tokio::process::Command::new("nsenter");
    cmd.arg(format!("--net=/proc/{pid}/ns/net")).args(tool);
    let what = format!("nsenter {tool:?} in the netns of pid {pid}");
    let out = wait::command_output(&what, Duration::from_secs(30), &mut cmd).await?;
    ensure!(
        out.status.success(),
        "{tool:?} in the network namespace of pid {pid}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
