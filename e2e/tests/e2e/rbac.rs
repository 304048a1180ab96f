//! The install manifests on a real apiserver, and least privilege proven with the components'
//! real ServiceAccount tokens.
//!
//! In: `manifests/` (copied, with TLS material made by `manifests/tls/generate.sh`), a
//! dedicated control plane, the built `meshgate-agent` and `meshgate-webhook`. Out: pass/fail:
//! - `kubectl apply -k manifests/` passes server-side validation, the DaemonSet and Deployment
//!   get their pods, the caBundles carry the generated CA, the policies type-check, and the
//!   cert-manager overlay's built-in objects pass a server-side dry run;
//! - the agent, run with the DaemonSet's own command line and environment and a token bound to
//!   its DaemonSet pod, gates and ungates its own Node; the same token may not modify another
//!   Node, nor evict a pod on another node, nor read Secrets; a token that names no node may
//!   write nothing at all;
//! - on its own Node, the agent's real writes (`NodeGate`: taint, label, condition, Events)
//!   pass the policies, and every other change (other taints, cordoning, other labels,
//!   annotations, finalizers, other status fields) is refused with the policy's message, as
//!   are Events not in its own name or about another node;
//! - the opt-in webhook NetworkPolicy component applies, selects the webhook pods and opens
//!   exactly their named ports;
//! - the webhook, run with the Deployment's command line and its own token, gets ready (its
//!   caches list under its RBAC) and serves the generated certificate for the Service's DNS
//!   name; its token can write nothing;
//! - the alert rules pass `promtool check rules` and `promtool test rules`.
//!
//! Why a dedicated control plane: the base registers a fail-closed pod webhook for a Service
//! that nothing serves here, a DaemonSet that would put pods on every test's nodes, and a
//! mutating webhook on every Node creation. Applied to the shared control plane, they would
//! change what the other modules' tests see. This one starts in about 5 s and is stopped when
//! the test binary exits.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, OnceLock};

use anyhow::{Context as _, bail, ensure};
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingAdmissionPolicy, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{
    ConfigMap, Namespace, Node, Pod, PodSpec, Secret, Service, ServiceAccount,
};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{
    Api, DeleteParams, EvictParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams,
};
use kube::{Client, ResourceExt};
use meshgate_core::{CONDITION_TYPE, TAINT_KEY, VERIFIED_LABEL};
use meshgate_e2e::harness::paths::{copy_tree, repo_root};
use meshgate_e2e::harness::wait::poll_until;
use meshgate_e2e::sim::node::{CniDirs, free_port, golden, workspace_bin};
use meshgate_e2e::sim::node::{gate_condition, tainted, verified_label as label};
use meshgate_e2e::{ControlPlane, NodeSpec, Options, TokenOptions, unique_name};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use serde_json::json;

use crate::WAIT;
use crate::support::{
    AGENT, NS, bound_token, describe, dry_run_eviction, effective_rules, label_verified_dry_run,
    refused_by_policy, refused_by_rbac, status_of, triples, verdict,
};

const WEBHOOK: &str = "meshgate-webhook";
/// The name the apiserver verifies the webhook's certificate against (Service DNS name).
const SERVICE_DNS: &str = "meshgate-webhook.meshgate-system.svc";
/// The user extra a Pod-bound token carries, which the policies key on.
const NODE_EXTRA: &str = "authentication.kubernetes.io/node-name";
/// Another controller's taint on node C, which the agent must leave alone.
const FOREIGN_TAINT: &str = "example.com/maintenance";
/// A label only the node's kubelet may set (NodeRestriction), which the agent must leave alone.
const RESTRICTED_LABEL: &str = "node-restriction.kubernetes.io/pool";

/// What every test of this module shares: the control plane with the base applied, two
/// registered nodes, and the two components' tokens.
struct Fixture {
    cp: &'static ControlPlane,
    /// The copy of `manifests/` that was applied (inside the control plane's directory).
    manifests: PathBuf,
    /// The node the agent's token is bound to (through its DaemonSet pod there).
    node_a: String,
    /// Another node.
    node_b: String,
    /// A third node, with an agent token of its own, for the tests that write to the node
    /// (the agent run of another test owns node A meanwhile).
    node_c: String,
    /// meshgate-agent's token, bound to its DaemonSet pod on `node_c`.
    agent_token_c: String,
    /// meshgate-agent's token, bound to its DaemonSet pod on `node_a`.
    agent_token: String,
    /// meshgate-webhook's token, bound to one of its Deployment's pods.
    webhook_token: String,
}

static FIXTURE: tokio::sync::OnceCell<Result<Fixture, String>> = tokio::sync::OnceCell::const_new();
static DEDICATED: OnceLock<&'static ControlPlane> = OnceLock::new();

extern "C" fn stop_dedicated_at_exit() {
    if let Some(cp) = DEDICATED.get() {
        cp.stop();
    }
}

/// The fixture, set up by the first test that asks; a failed setup fails every test with its
/// reason (and is not retried, so no second control plane is started).
async fn fixture() -> &'static Fixture {
    let f = FIXTURE
        .get_or_init(|| async { setup().await.map_err(|e| format!("{e:#}")) })
        .await;
    match f {
        Ok(f) => f,
        Err(e) => panic!("rbac fixture setup failed: {e}"),
    }
}

async fn setup() -> anyhow::Result<Fixture> {
    let cp = ControlPlane::start(Options::default())
        .await
        .context("starting a dedicated control plane")?;
    let cp: &'static ControlPlane = Box::leak(Box::new(cp));
    if DEDICATED.set(cp).is_ok() {
        // SAFETY: registers a plain extern "C" fn without arguments, run once during exit().
        let rc = unsafe { libc::atexit(stop_dedicated_at_exit) };
        ensure!(rc == 0, "atexit registration failed");
    }
    let client = cp.client()?;

    // The operator's steps: generate the TLS material, then apply the kustomization.
    let manifests = cp.dir().join("manifests");
    copy_tree(&repo_root().join("manifests"), &manifests)?;
    let out = Command::new("bash")
        .arg(manifests.join("tls/generate.sh"))
        .output()
        .context("running manifests/tls/generate.sh")?;
    ensure!(
        out.status.success(),
        "generate.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The opt-in NetworkPolicy component, enabled as its kustomization.yaml tells operators.
    let kustomization = manifests.join("kustomization.yaml");
    let mut text = std::fs::read_to_string(&kustomization).context("kustomization.yaml")?;
    text.push_str("components:\n  - components/webhook-network-policy\n");
    std::fs::write(&kustomization, text).context("enabling the NetworkPolicy component")?;
    let path = manifests.to_str().context("manifests path")?;
    let applied = cp
        .kubectl(&["apply", "-k", path])
        .await
        .context("kubectl apply -k manifests/")?;
    tracing::info!(%applied, "applied the kustomize base");

    // Nodes register tainted, as with kubelet --register-with-taints (no webhook serves the
    // mutating registration here; it fails open, as designed).
    let node_a = unique_name("rbac-a");
    let node_b = unique_name("rbac-b");
    let node_c = unique_name("rbac-c");
    for n in [&node_a, &node_b, &node_c] {
        // Node C also carries what a real node has beside meshgate's parts: another
        // controller's taint and a node-restriction label (kubelet --node-labels).
        let mut spec = NodeSpec::new(n).taint(TAINT_KEY, "NoSchedule");
        if n == &node_c {
            spec = spec
                .taint(FOREIGN_TAINT, "NoSchedule")
                .label(RESTRICTED_LABEL, "a");
        }
        cp.register_node(&client, &spec).await?;
    }

    // The DaemonSet controller and the scheduler place an agent pod on each node; the tokens
    // are bound to real pods of the workloads, as the kubelet's projected tokens are.
    let agent_a = scheduled_pod(&client, AGENT, Some(&node_a)).await?;
    let agent_b = scheduled_pod(&client, AGENT, Some(&node_b)).await?;
    let webhook_pod = scheduled_pod(&client, WEBHOOK, None).await?;
    let agent_c = scheduled_pod(&client, AGENT, Some(&node_c)).await?;
    let agent_token = bound_token(&client, AGENT, agent_a).await?;
    let agent_token_c = bound_token(&client, AGENT, agent_c).await?;
    let webhook_token = bound_token(&client, WEBHOOK, webhook_pod).await?;

    // Policies and bindings reach the apiserver's admission through informers: wait until
    // both refuse (dry-run probes, so nothing changes if they do not yet).
    let agent = cp.client_for_token(&agent_token)?;
    let nodes: Api<Node> = Api::all(agent.clone());
    poll_until(
        "the node policy to refuse the agent another Node",
        WAIT,
        || async {
            let r = nodes
                .patch(
                    &node_b,
                    &PatchParams::default().dry_run(),
                    &Patch::Merge(json!({"metadata": {"labels": {"probe": "x"}}})),
                )
                .await;
            anyhow::Ok(refused_by_policy(&r, "meshgate-agent-own-node").then_some(()))
        },
    )
    .await?;
    let pods: Api<Pod> = Api::namespaced(agent, NS);
    poll_until(
        "the eviction policy to refuse the agent a pod on another node",
        WAIT,
        || async {
            let r = pods.evict(&agent_b.name_any(), &dry_run_eviction()).await;
            anyhow::Ok(refused_by_policy(&r, "meshgate-agent-own-node-evictions").then_some(()))
        },
    )
    .await?;

    Ok(Fixture {
        cp,
        manifests,
        node_a,
        node_b,
        node_c,
        agent_token,
        agent_token_c,
        webhook_token,
    })
}

/// A pod of the workload `app` (its `app.kubernetes.io/name`) bound to `node` (any node when
/// `None`).
async fn scheduled_pod(client: &Client, app: &str, node: Option<&str>) -> anyhow::Result<Pod> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let lp = ListParams::default().labels(&format!("app.kubernetes.io/name={app}"));
    let what = format!("a {app} pod scheduled on {}", node.unwrap_or("any node"));
    Ok(poll_until(&what, WAIT, || async {
        let list = pods.list(&lp).await?;
        anyhow::Ok(list.items.into_iter().find(|p| {
            let bound = p.spec.as_ref().and_then(|s| s.node_name.as_deref());
            bound.is_some() && (node.is_none() || bound == node)
        }))
    })
    .await?)
}

/// The condition's (status, reason).
fn condition(n: &Node) -> Option<(String, String)> {
    gate_condition(n).map(|(status, reason, _)| (status, reason))
}

/// A namespace exempt from the (unserved, fail-closed) pod webhook, with `pods` created in it:
/// (name, node). Creation is retried until the namespace label and its default
/// ServiceAccount have reached admission.
async fn exempt_namespace_with_pods(
    client: &Client,
    prefix: &str,
    pods: &[(&str, &str)],
) -> anyhow::Result<String> {
    let name = unique_name(prefix);
    let ns = Namespace {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            labels: Some(BTreeMap::from([(
                "meshgate.io/ignore".to_owned(),
                "true".to_owned(),
            )])),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await?;
    let api: Api<Pod> = Api::namespaced(client.clone(), &name);
    for (pod, node) in pods {
        let p: Pod = serde_json::from_value(json!({
            "metadata": { "name": pod },
            "spec": {
                "nodeName": node,
                "containers": [{ "name": "app", "image": "registry.k8s.io/pause:3.10" }]
            }
        }))?;
        poll_until(&format!("creating pod {name}/{pod}"), WAIT, || async {
            api.create(&PostParams::default(), &p).await.map(Some)
        })
        .await?;
    }
    Ok(name)
}

// ---------------------------------------------------------------------------------------
// Running a workload's container as a local process

/// A container of a workload, run as a local process with the workload's own command line
/// and environment; killed on drop.
struct Workload {
    child: Child,
    log: PathBuf,
    /// Local addresses substituted for `--admin-addr` and `--listen`.
    addrs: BTreeMap<String, SocketAddr>,
    /// Local directories standing in for each volume mount (mountPath → dir).
    mounts: BTreeMap<String, PathBuf>,
}

impl Workload {
    /// Starts the first container of `spec` (as the apiserver stored it) on behalf of `node`:
    /// - each volume mount becomes a local directory holding what the volume would: a hostPath
    ///   from `host_dirs` (else an empty scratch dir), a ConfigMap's or Secret's keys as files;
    /// - the binary is the workspace build of the command's file name;
    /// - every absolute path in the arguments must lie under a volume mount and is mapped to
    ///   its local directory (a path no volume provides is a manifest bug and fails here);
    /// - `--admin-addr` and `--listen` get free loopback ports; `--kubeconfig` is added;
    /// - the environment is exactly the container's `env` (the Downward API's spec.nodeName
    ///   is `node`) and `envFrom` ConfigMaps.
    async fn start(
        admin: &Client,
        spec: &PodSpec,
        node: &str,
        kubeconfig: &Path,
        host_dirs: &BTreeMap<&str, PathBuf>,
        scratch: &Path,
    ) -> anyhow::Result<Self> {
        let container = spec.containers.first().context("no container")?;
        let configmaps: Api<ConfigMap> = Api::namespaced(admin.clone(), NS);
        let secrets: Api<Secret> = Api::namespaced(admin.clone(), NS);

        let mut mounts = BTreeMap::new();
        for vm in container.volume_mounts.iter().flatten() {
            let vol = spec
                .volumes
                .iter()
                .flatten()
                .find(|v| v.name == vm.name)
                .with_context(|| format!("volumeMount {} has no volume", vm.name))?;
            let local = scratch.join("volumes").join(&vol.name);
            let dir = if let Some(hp) = &vol.host_path {
                match host_dirs.get(hp.path.as_str()) {
                    Some(d) => d.clone(),
                    None => {
                        std::fs::create_dir_all(&local)?;
                        local
                    }
                }
            } else if let Some(cm) = &vol.config_map {
                let data = configmaps.get(&cm.name).await?.data.unwrap_or_default();
                std::fs::create_dir_all(&local)?;
                for (k, v) in data {
                    std::fs::write(local.join(k), v)?;
                }
                local
            } else if let Some(s) = &vol.secret {
                let name = s
                    .secret_name
                    .as_deref()
                    .context("secret volume without name")?;
                let data = secrets.get(name).await?.data.unwrap_or_default();
                std::fs::create_dir_all(&local)?;
                for (k, v) in data {
                    std::fs::write(local.join(k), v.0)?;
                }
                local
            } else {
                bail!("volume {} is of a kind this test does not map", vol.name);
            };
            mounts.insert(vm.mount_path.clone(), dir);
        }

        let mut argv: Vec<String> = container.command.clone().unwrap_or_default();
        argv.extend(container.args.clone().unwrap_or_default());
        ensure!(!argv.is_empty(), "the container names no command");
        let bin_name = Path::new(&argv[0])
            .file_name()
            .and_then(|n| n.to_str())
            .context("command")?
            .to_owned();
        let mut cmd = Command::new(workspace_bin(&bin_name)?);
        let mut addrs = BTreeMap::new();
        for arg in &argv[1..] {
            let Some((flag, value)) = arg.split_once('=') else {
                cmd.arg(arg);
                continue;
            };
            if flag == "--admin-addr" || flag == "--listen" {
                let addr = SocketAddr::from(([127, 0, 0, 1], free_port()?));
                addrs.insert(flag.to_owned(), addr);
                cmd.arg(format!("{flag}={addr}"));
            } else if value.starts_with('/') {
                let (mount, dir) = mounts
                    .iter()
                    .filter(|(m, _)| value == m.as_str() || value.starts_with(&format!("{}/", m)))
                    .max_by_key(|(m, _)| m.len())
                    .with_context(|| format!("{arg}: no volume is mounted at that path"))?;
                let rest = value[mount.len()..].trim_start_matches('/');
                let local = if rest.is_empty() {
                    dir.clone()
                } else {
                    dir.join(rest)
                };
                cmd.arg(format!("{flag}={}", local.display()));
            } else {
                cmd.arg(arg);
            }
        }
        cmd.arg(format!("--kubeconfig={}", kubeconfig.display()));

        cmd.env_clear();
        cmd.env("RUST_LOG", "info");
        for e in container.env.iter().flatten() {
            if let Some(v) = &e.value {
                cmd.env(&e.name, v);
            } else if let Some(src) = &e.value_from {
                match src.field_ref.as_ref().map(|f| f.field_path.as_str()) {
                    Some("spec.nodeName") => {
                        cmd.env(&e.name, node);
                    }
                    other => bail!("env {} from {other:?} is not mapped", e.name),
                }
            }
        }
        for from in container.env_from.iter().flatten() {
            let cm = from
                .config_map_ref
                .as_ref()
                .context("envFrom other than a ConfigMap")?;
            for (k, v) in configmaps.get(&cm.name).await?.data.unwrap_or_default() {
                cmd.env(k, v);
            }
        }

        let log = scratch.join(format!("{bin_name}.log"));
        let file = std::fs::File::create(&log)?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .spawn()
            .with_context(|| format!("starting {bin_name}"))?;
        Ok(Self {
            child,
            log,
            addrs,
            mounts,
        })
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A plain HTTP/1.0 GET: the status code, or `None` while nothing answers.
async fn http_status(addr: SocketAddr, path: &str) -> Option<u16> {
    meshgate_e2e::sim::node::http_get(addr, path)
        .await
        .map(|(code, _)| code)
}

// ---------------------------------------------------------------------------------------
// Tests

#[tokio::test]
async fn install_manifests_apply_and_are_wired() -> anyhow::Result<()> {
    let f = fixture().await;
    let client = f.cp.client()?;

    // The DaemonSet wants a pod on every node, and got them; the priority class resolved.
    let ds: Api<DaemonSet> = Api::namespaced(client.clone(), NS);
    let desired = poll_until("the DaemonSet to count the 3 nodes", WAIT, || async {
        let s = ds.get(AGENT).await?.status.unwrap_or_default();
        anyhow::Ok((s.desired_number_scheduled == 3).then_some(s.desired_number_scheduled))
    })
    .await?;
    assert_eq!(desired, 3);
    for node in [&f.node_a, &f.node_b, &f.node_c] {
        let pod = scheduled_pod(&client, AGENT, Some(node)).await?;
        let spec = pod.spec.context("spec")?;
        assert_eq!(
            spec.priority,
            Some(2_000_001_000),
            "system-node-critical resolved"
        );
        assert_eq!(
            spec.service_account_name.as_deref(),
            Some(AGENT),
            "the agent runs as its own ServiceAccount"
        );
    }

    // The webhook Deployment's two replicas exist and were scheduled despite the node taint.
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let lp = ListParams::default().labels(&format!("app.kubernetes.io/name={WEBHOOK}"));
    poll_until("2 webhook pods scheduled", WAIT, || async {
        let list = pods.list(&lp).await?.items;
        let bound = list
            .iter()
            .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some())
            .count();
        anyhow::Ok((bound == 2).then_some(()))
    })
    .await?;
    let pdb = Api::<PodDisruptionBudget>::namespaced(client.clone(), NS)
        .get(WEBHOOK)
        .await?;
    assert!(pdb.spec.and_then(|s| s.min_available).is_some());
    let svc = Api::<Service>::namespaced(client.clone(), NS)
        .get(WEBHOOK)
        .await?;
    let port = svc
        .spec
        .and_then(|s| s.ports)
        .and_then(|p| p.into_iter().next())
        .context("service port")?;
    assert_eq!(port.port, 443);

    // Every webhook trusts exactly the CA generate.sh made.
    let ca = std::fs::read(f.manifests.join("tls/ca.crt"))?;
    let vwc = Api::<ValidatingWebhookConfiguration>::all(client.clone())
        .get("meshgate")
        .await?;
    let validating = vwc.webhooks.unwrap_or_default();
    let names: Vec<&str> = validating.iter().map(|w| w.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "pods.validate.meshgate.io",
            "ambient-pods.validate.meshgate.io",
            "unmarked-pods.validate.meshgate.io",
            "bindings.validate.meshgate.io"
        ]
    );
    let mwc = Api::<MutatingWebhookConfiguration>::all(client.clone())
        .get("meshgate")
        .await?;
    let mutating = mwc.webhooks.unwrap_or_default();
    assert_eq!(mutating.len(), 1);
    let bundles: Vec<(&str, Option<&Vec<u8>>)> = validating
        .iter()
        .map(|w| {
            (
                w.name.as_str(),
                w.client_config.ca_bundle.as_ref().map(|b| &b.0),
            )
        })
        .chain(mutating.iter().map(|w| {
            (
                w.name.as_str(),
                w.client_config.ca_bundle.as_ref().map(|b| &b.0),
            )
        }))
        .collect();
    for (name, bundle) in bundles {
        assert_eq!(bundle, Some(&ca), "caBundle of {name}");
    }

    // The NetworkPolicy selects the webhook's pods, and the ports it opens are the
    // container's named ports: the webhook port (from the control plane) and the admin port.
    let np = Api::<k8s_openapi::api::networking::v1::NetworkPolicy>::namespaced(client.clone(), NS)
        .get(WEBHOOK)
        .await?;
    let np_spec = np.spec.context("NetworkPolicy spec")?;
    let webhook_pod = scheduled_pod(&client, WEBHOOK, None).await?;
    let pod_labels = webhook_pod.metadata.labels.clone().unwrap_or_default();
    let selector = np_spec
        .pod_selector
        .as_ref()
        .and_then(|s| s.match_labels.clone())
        .unwrap_or_default();
    assert!(
        !selector.is_empty() && selector.iter().all(|(k, v)| pod_labels.get(k) == Some(v)),
        "the NetworkPolicy selects the webhook pods: {selector:?} vs {pod_labels:?}"
    );
    assert_eq!(np_spec.policy_types, Some(vec!["Ingress".to_owned()]));
    let container_ports: BTreeSet<String> = webhook_pod
        .spec
        .iter()
        .flat_map(|s| s.containers.iter())
        .flat_map(|c| c.ports.iter().flatten())
        .filter_map(|p| p.name.clone())
        .collect();
    let opened: BTreeSet<String> = np_spec
        .ingress
        .iter()
        .flatten()
        .flat_map(|r| r.ports.iter().flatten())
        .filter_map(|p| match &p.port {
            Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(n)) => {
                Some(n.clone())
            }
            _ => None,
        })
        .collect();
    assert_eq!(
        opened,
        BTreeSet::from(["admin".to_owned(), "https".to_owned()]),
        "the NetworkPolicy opens the webhook and admin ports by name"
    );
    assert!(
        opened.is_subset(&container_ports),
        "{opened:?} vs {container_ports:?}"
    );

    // The policies' CEL type-checks against the real schemas.
    for name in [
        "meshgate-agent-own-node",
        "meshgate-agent-own-node-evictions",
        "meshgate-agent-own-events",
        "meshgate-agent-own-pod-events",
    ] {
        let vap = Api::<ValidatingAdmissionPolicy>::all(client.clone())
            .get(name)
            .await?;
        let status = vap.status.context("policy status")?;
        let warnings = status
            .type_checking
            .and_then(|t| t.expression_warnings)
            .unwrap_or_default();
        assert!(warnings.is_empty(), "{name}: {warnings:?}");
    }

    // The cert-manager overlay: its built-in objects pass the server's validation (a dry run);
    // cert-manager's own kinds cannot (no CRDs here), so they are checked by content only.
    let overlay = f.manifests.join("cert-manager");
    let built =
        f.cp.kubectl(&["kustomize", overlay.to_str().context("path")?])
            .await?;
    let (cm_docs, builtin_docs): (Vec<&str>, Vec<&str>) = built
        .split("\n---\n")
        .partition(|d| d.contains("apiVersion: cert-manager.io/"));
    assert_eq!(cm_docs.len(), 4, "2 Issuers, 2 Certificates");
    assert!(
        cm_docs
            .iter()
            .any(|d| d.contains("secretName: meshgate-webhook-tls\n")
                && d.contains(&format!("- {SERVICE_DNS}\n"))),
        "a Certificate for the Service name into the Secret the Deployment mounts"
    );
    let injected = builtin_docs
        .iter()
        .filter(|d| d.contains("cert-manager.io/inject-ca-from: meshgate-system/meshgate-webhook"))
        .count();
    assert_eq!(
        injected, 2,
        "both webhook configurations get the CA injected"
    );
    let path = f.cp.dir().join("cert-manager-builtin.yaml");
    std::fs::write(&path, builtin_docs.join("\n---\n"))?;
    let dry =
        f.cp.kubectl(&[
            "apply",
            "--dry-run=server",
            "-f",
            path.to_str().context("path")?,
        ])
        .await?;
    assert!(dry.contains("daemonset.apps/meshgate-agent"), "{dry}");
    Ok(())
}

#[tokio::test]
async fn agent_runs_with_its_token_and_gates_only_its_own_node() -> anyhow::Result<()> {
    let f = fixture().await;
    let admin = f.cp.client()?;
    let nodes: Api<Node> = Api::all(admin.clone());

    // The agent exactly as the DaemonSet runs it, with the token bound to its pod on node A.
    let ds = Api::<DaemonSet>::namespaced(admin.clone(), NS)
        .get(AGENT)
        .await?;
    let spec = ds
        .spec
        .and_then(|s| s.template.spec)
        .context("pod template")?;
    let dirs = CniDirs::new()?;
    let scratch = tempfile::tempdir()?;
    let host_dirs = BTreeMap::from([
        ("/etc/cni/net.d", dirs.conf.clone()),
        ("/opt/cni/bin", dirs.bin.clone()),
    ]);
    let kubeconfig = f.cp.write_token_kubeconfig("rbac-agent", &f.agent_token)?;
    let mut agent = Workload::start(
        &admin,
        &spec,
        &f.node_a,
        &kubeconfig,
        &host_dirs,
        scratch.path(),
    )
    .await?;
    ensure!(
        agent.mounts.contains_key("/var/run/meshgate"),
        "the state dir is a volume"
    );

    // No config yet: the node stays gated, and the condition says why.
    let gated = poll_until("node A gated with reason NoConfig", WAIT, || async {
        let n = nodes.get(&f.node_a).await?;
        let ok = tainted(&n)
            && label(&n) == Some("false")
            && condition(&n) == Some(("False".into(), "NoConfig".into()));
        anyhow::Ok(ok.then_some(()))
    })
    .await;
    if let Err(e) = gated {
        bail!(
            "{e}; exit: {:?}; agent log:\n{}",
            agent.exited(),
            agent.log()
        );
    }

    // The mesh plugin is chained: the agent's own token untaints its own node.
    dirs.config(
        "10-calico-linkerd.conflist",
        &golden("calico-linkerd.conflist")?,
    )?;
    let open = poll_until("node A untainted and verified", WAIT, || async {
        let n = nodes.get(&f.node_a).await?;
        let ok = !tainted(&n)
            && label(&n) == Some("true")
            && condition(&n) == Some(("True".into(), "Verified".into()));
        anyhow::Ok(ok.then_some(()))
    })
    .await;
    if let Err(e) = open {
        bail!("{e}; agent log:\n{}", agent.log());
    }
    let ready = agent.addrs.get("--admin-addr").copied().context("admin")?;
    assert_eq!(http_status(ready, "/ready").await, Some(200));

    // Its Events were accepted (events.k8s.io create under its RBAC).
    let events: Api<Event> = Api::namespaced(admin.clone(), "default");
    let verified_event = poll_until("the CNIChainVerified Event", WAIT, || async {
        let list = events.list(&ListParams::default()).await?;
        anyhow::Ok(list.items.into_iter().find(|e| {
            e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(f.node_a.as_str())
                && e.reason.as_deref() == Some("CNIChainVerified")
        }))
    })
    .await?;
    assert_eq!(
        verified_event.reporting_controller.as_deref(),
        Some("meshgate-agent")
    );

    // The same token is refused node B: the taint, the label, and the condition.
    let as_agent: Api<Node> = Api::all(f.cp.client_for_token(&f.agent_token)?);
    let untaint_b = as_agent
        .patch(
            &f.node_b,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"taints": null}})),
        )
        .await;
    assert!(
        refused_by_policy(&untaint_b, "meshgate-agent-own-node"),
        "{}",
        describe(&untaint_b)
    );
    let msg = status_of(&untaint_b)
        .map(|(_, m)| m.to_owned())
        .unwrap_or_default();
    assert!(
        msg.contains(&format!(
            "on node {} may not modify Node {}",
            f.node_a, f.node_b
        )),
        "{msg}"
    );
    let label_b = as_agent
        .patch(
            &f.node_b,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {VERIFIED_LABEL: "true"}}})),
        )
        .await;
    assert!(
        refused_by_policy(&label_b, "meshgate-agent-own-node"),
        "{}",
        describe(&label_b)
    );
    let status_b = as_agent
        .patch_status(
            &f.node_b,
            &PatchParams::default(),
            &Patch::Strategic(json!({"status": {"conditions": [{
                "type": CONDITION_TYPE, "status": "True", "reason": "Verified", "message": "forged"
            }]}})),
        )
        .await;
    assert!(
        refused_by_policy(&status_b, "meshgate-agent-own-node"),
        "{}",
        describe(&status_b)
    );
    let b = nodes.get(&f.node_b).await?;
    assert!(tainted(&b), "node B keeps its taint");
    assert_eq!(label(&b), None);
    assert_eq!(condition(&b), None);

    // A hand-made write to its own node passes the policy (dry run): the refusals above are
    // about the node, not the kind of write.
    let own = label_verified_dry_run(&as_agent, &f.node_a).await;
    assert!(own.is_ok(), "{}", describe(&own));
    Ok(())
}

/// The Node parts the agent must never change, as one comparable value.
fn foreign_parts(n: &Node) -> serde_json::Value {
    let mut labels = n.metadata.labels.clone().unwrap_or_default();
    labels.remove(VERIFIED_LABEL);
    let spec = n.spec.clone().unwrap_or_default();
    let taints: Vec<_> = spec
        .taints
        .iter()
        .flatten()
        .filter(|t| t.key != TAINT_KEY)
        .cloned()
        .collect();
    let status = n.status.clone().unwrap_or_default();
    let conditions: Vec<_> = status
        .conditions
        .iter()
        .flatten()
        .filter(|c| c.type_ != CONDITION_TYPE)
        .map(|c| (c.type_.clone(), c.status.clone()))
        .collect();
    json!({
        "labels": labels,
        "annotations": n.metadata.annotations,
        "finalizers": n.metadata.finalizers,
        "taints": taints,
        "unschedulable": spec.unschedulable,
        "capacity": status.capacity,
        "addresses": status.addresses,
        "images": status.images.as_ref().map(Vec::len),
        "conditions": conditions,
    })
}

#[tokio::test]
async fn agent_token_changes_only_meshgates_taint_label_and_condition() -> anyhow::Result<()> {
    use kube::runtime::events::{Event as Note, EventType, Recorder, Reporter};
    use meshgate_agent::daemon::node::{NodeGate, TaintEffect};

    let f = fixture().await;
    let admin = f.cp.client()?;
    let nodes: Api<Node> = Api::all(admin.clone());
    let agent = f.cp.client_for_token(&f.agent_token_c)?;
    let as_agent: Api<Node> = Api::all(agent.clone());
    let c = f.node_c.as_str();
    // A Node as big as a real one: the kubelet reports up to 50 images, cloud nodes carry
    // dozens of labels. The policy compares all of it on every write of the agent, within
    // the apiserver's CEL cost limit.
    let images: Vec<_> = (0..50)
        .map(|i| {
            json!({
                "names": [
                    format!("registry.example.com/team-{i}/app@sha256:{i:064x}"),
                    format!("registry.example.com/team-{i}/app:v{i}"),
                ],
                "sizeBytes": 100_000_000 + i,
            })
        })
        .collect();
    nodes
        .patch_status(
            c,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"images": images}})),
        )
        .await?;
    let many: serde_json::Map<String, serde_json::Value> = (0..40)
        .map(|i| {
            (
                format!("example.com/label-{i}"),
                json!(format!("value-{i}")),
            )
        })
        .collect();
    nodes
        .patch(
            c,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": many}})),
        )
        .await?;
    let before = nodes.get(c).await?;
    let foreign = foreign_parts(&before);
    assert!(
        foreign.to_string().contains(FOREIGN_TAINT)
            && foreign.to_string().contains(RESTRICTED_LABEL),
        "node C carries another taint and a restricted label: {foreign}"
    );

    // 1. Everything the real agent writes passes: NodeGate (the taint and label JSON patch
    //    guarded by a resourceVersion test, the condition by strategic merge on nodes/status,
    //    the Event) with the agent's real token, through unverified → verified → unverified:
    //    label and condition written, taint removed, taint added back.
    let reporter = Reporter {
        controller: "meshgate-agent".into(),
        instance: Some(c.to_owned()),
    };
    let gate = NodeGate::new(
        agent.clone(),
        c.to_owned(),
        TaintEffect::NoSchedule,
        std::time::Duration::from_secs(5),
        Recorder::new(agent.clone(), reporter.clone()),
    );
    for (verified, want_taint, reason) in [
        (false, true, "ChainedPluginMissing"),
        (true, false, "Verified"),
        (false, true, "ChainedPluginMissing"),
    ] {
        let applied = gate
            .reconcile(None, &verdict(verified)?)
            .await
            .with_context(|| format!("the agent's own writes (verified={verified})"))?;
        let n = nodes.get(c).await?;
        assert_eq!(tainted(&n), want_taint, "{applied:?}");
        assert_eq!(label(&n), Some(if verified { "true" } else { "false" }));
        assert_eq!(
            condition(&n),
            Some((
                if verified { "True" } else { "False" }.into(),
                reason.into()
            ))
        );
        assert_eq!(
            foreign_parts(&n),
            foreign,
            "the agent's writes kept the rest"
        );
    }
    // Its Events (created, then patched as a series repeats), about its Node and about a Pod.
    let events: Api<Event> = Api::namespaced(admin.clone(), "default");
    poll_until(
        "the agent's CNIChainVerified Event on node C",
        WAIT,
        || async {
            let list = events.list(&ListParams::default()).await?;
            anyhow::Ok(list.items.into_iter().find(|e| {
                e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(c)
                    && e.reason.as_deref() == Some("CNIChainVerified")
            }))
        },
    )
    .await?;
    let recorder = Recorder::new(agent.clone(), reporter);
    let note = Note {
        type_: EventType::Warning,
        reason: "PolicyProbe".into(),
        note: Some("the same Event twice: created, then patched as a series".into()),
        action: "Probe".into(),
        secondary: None,
    };
    let node_ref = kube::Resource::object_ref(&before, &());
    for _ in 0..2 {
        recorder
            .publish(&note, &node_ref)
            .await
            .context("the agent's Event about its own Node")?;
    }
    let pod_ref = k8s_openapi::api::core::v1::ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        namespace: Some("default".into()),
        name: Some("meshed-web".into()),
        uid: Some("00000000-0000-0000-0000-000000000001".into()),
        ..Default::default()
    };
    recorder
        .publish(&note, &pod_ref)
        .await
        .context("the agent's Event about a Pod")?;

    // 2. Every other change to its own Node is refused, each with the policy's message.
    let own = "meshgate-agent-own-node";
    let n = nodes.get(c).await?;
    let rv = n.resource_version().unwrap_or_default();
    let taints = n
        .spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default();
    let ours_only: Vec<_> = taints
        .iter()
        .filter(|t| t.key == TAINT_KEY)
        .cloned()
        .collect();
    let mut plus_evil = taints.clone();
    plus_evil.push(k8s_openapi::api::core::v1::Taint {
        key: "example.com/evil".into(),
        effect: "NoExecute".into(),
        ..Default::default()
    });
    let harden = |mut t: Vec<k8s_openapi::api::core::v1::Taint>| {
        for x in t.iter_mut().filter(|x| x.key == FOREIGN_TAINT) {
            x.effect = "NoExecute".into();
        }
        t
    };
    // The agent's own patch shape (resourceVersion test, then the taint list), with another
    // taint removed, added or changed.
    let rv_patch = |taints: &[k8s_openapi::api::core::v1::Taint]| -> anyhow::Result<Patch<()>> {
        Ok(Patch::Json(serde_json::from_value(json!([
            {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
            {"op": "add", "path": "/spec/taints", "value": taints},
        ]))?))
    };
    let spec_msg = format!("may change only the taint {TAINT_KEY} in the spec of Node {c}");
    let label_msg = format!("may change only the label {VERIFIED_LABEL} of Node {c}");
    let meta_msg = format!("may not change the metadata of Node {c}");
    let status_msg =
        format!("may change only the condition {CONDITION_TYPE} in the status of Node {c}");
    let pp = PatchParams::default();
    let mut tried: Vec<(&str, String, &str)> = Vec::new();
    let mut attempt = |what: &'static str, r: Result<Node, kube::Error>, msg: &str| {
        tried.push((
            what,
            r.as_ref()
                .map(|_| "allowed".to_owned())
                .unwrap_or_else(|e| e.to_string()),
            if refused_by_policy(&r, own) && status_of(&r).is_some_and(|(_, m)| m.contains(msg)) {
                ""
            } else {
                "NOT REFUSED AS EXPECTED"
            },
        ));
    };
    attempt(
        "remove another taint",
        as_agent.patch(c, &pp, &rv_patch(&ours_only)?).await,
        &spec_msg,
    );
    attempt(
        "add another taint",
        as_agent.patch(c, &pp, &rv_patch(&plus_evil)?).await,
        &spec_msg,
    );
    attempt(
        "change another taint's effect",
        as_agent
            .patch(c, &pp, &rv_patch(&harden(taints.clone()))?)
            .await,
        &spec_msg,
    );
    attempt(
        "cordon (spec.unschedulable)",
        as_agent
            .patch(
                c,
                &pp,
                &Patch::Merge(json!({"spec": {"unschedulable": true}})),
            )
            .await,
        &spec_msg,
    );
    attempt(
        "set spec.providerID",
        as_agent
            .patch(
                c,
                &pp,
                &Patch::Merge(json!({"spec": {"providerID": "evil://x"}})),
            )
            .await,
        &spec_msg,
    );
    attempt(
        "change a node-restriction.kubernetes.io label",
        as_agent
            .patch(
                c,
                &pp,
                &Patch::Merge(json!({"metadata": {"labels": {RESTRICTED_LABEL: "b"}}})),
            )
            .await,
        &label_msg,
    );
    attempt(
        "add a node-restriction.kubernetes.io label",
        as_agent.patch(c, &pp, &Patch::Merge(json!({"metadata": {"labels": {"node-restriction.kubernetes.io/secure": "true"}}}))).await,
        &label_msg,
    );
    attempt(
        "remove another label",
        as_agent
            .patch(
                c,
                &pp,
                &Patch::Merge(json!({"metadata": {"labels": {"kubernetes.io/hostname": null}}})),
            )
            .await,
        &label_msg,
    );
    attempt(
        "add an annotation",
        as_agent
            .patch(
                c,
                &pp,
                &Patch::Merge(json!({"metadata": {"annotations": {"example.com/x": "y"}}})),
            )
            .await,
        &meta_msg,
    );
    attempt(
        "add a finalizer",
        as_agent
            .patch(
                c,
                &pp,
                &Patch::Merge(json!({"metadata": {"finalizers": ["example.com/hold"]}})),
            )
            .await,
        &meta_msg,
    );
    attempt(
        "set the Ready condition False (nodes/status)",
        as_agent
            .patch_status(
                c,
                &pp,
                &Patch::Strategic(json!({"status": {"conditions": [{
                    "type": "Ready", "status": "False", "reason": "Forged", "message": "forged"
                }]}})),
            )
            .await,
        &status_msg,
    );
    attempt(
        "change the capacity (nodes/status)",
        as_agent
            .patch_status(
                c,
                &pp,
                &Patch::Merge(json!({"status": {"capacity": {"pods": "1000"}}})),
            )
            .await,
        &status_msg,
    );
    attempt(
        "change the addresses (nodes/status)",
        as_agent
            .patch_status(c, &pp, &Patch::Merge(json!({"status": {"addresses": [{"type": "InternalIP", "address": "10.9.9.9"}]}})))
            .await,
        &status_msg,
    );
    attempt(
        "its condition plus a label (nodes/status)",
        as_agent
            .patch_status(c, &pp, &Patch::Strategic(json!({
                "metadata": {"labels": {RESTRICTED_LABEL: "b"}},
                "status": {"conditions": [{"type": CONDITION_TYPE, "status": "True", "reason": "Verified", "message": "forged"}]}
            })))
            .await,
        &label_msg,
    );
    let wrong: Vec<_> = tried.iter().filter(|(_, _, bad)| !bad.is_empty()).collect();
    assert!(
        wrong.is_empty(),
        "changes not refused by the policy with its message: {wrong:#?}"
    );

    // A spec change sent to nodes/status is dropped by the apiserver (the status strategy
    // keeps the old spec) whatever the policy says: the node stays schedulable.
    let _ = as_agent
        .patch_status(
            c,
            &pp,
            &Patch::Merge(json!({"spec": {"unschedulable": true}})),
        )
        .await;
    let after = nodes.get(c).await?;
    assert_eq!(
        foreign_parts(&after),
        foreign,
        "nothing but meshgate's parts changed"
    );
    assert!(tainted(&after) && label(&after) == Some("false"));

    // 3. Its Events must name it and concern its own Node or a Pod.
    let agent_events: Api<Event> = Api::namespaced(agent.clone(), "default");
    let forged =
        |controller: &str, instance: &str, kind: &str, name: &str| -> anyhow::Result<Event> {
            Ok(serde_json::from_value(json!({
                "metadata": {"generateName": "forged-"},
                "eventTime": "2026-01-01T00:00:00.000000Z",
                "reportingController": controller, "reportingInstance": instance,
                "action": "Probe", "reason": "Forged", "type": "Warning", "note": "forged",
                "regarding": {"apiVersion": "v1", "kind": kind, "name": name},
            }))?)
        };
    let events_policy = "meshgate-agent-own-events";
    for (what, ev, msg) in [
        (
            "as the kubelet",
            forged("kubelet", c, "Node", c)?,
            "only as reportingController meshgate-agent",
        ),
        (
            "as the agent of node B",
            forged(AGENT, &f.node_b, "Node", &f.node_b)?,
            "only as reportingController meshgate-agent",
        ),
        (
            "about node B",
            forged(AGENT, c, "Node", &f.node_b)?,
            "only about its own Node or a Pod",
        ),
        (
            "about a Secret",
            forged(AGENT, c, "Secret", "x")?,
            "only about its own Node or a Pod",
        ),
    ] {
        let r = agent_events.create(&PostParams::default(), &ev).await;
        assert!(
            refused_by_policy(&r, events_policy)
                && status_of(&r).is_some_and(|(_, m)| m.contains(msg)),
            "an Event {what}: {}",
            describe(&r)
        );
    }
    let ok = agent_events
        .create(&PostParams::default(), &forged(AGENT, c, "Node", c)?)
        .await;
    assert!(
        ok.is_ok(),
        "a hand-made Event about its own Node: {}",
        describe(&ok)
    );
    Ok(())
}

#[tokio::test]
async fn agent_token_cannot_evict_a_pod_on_another_node() -> anyhow::Result<()> {
    let f = fixture().await;
    let admin = f.cp.client()?;
    let ns = exempt_namespace_with_pods(
        &admin,
        "rbac-evict",
        &[("on-a", &f.node_a), ("on-b", &f.node_b)],
    )
    .await?;
    let as_agent: Api<Pod> = Api::namespaced(f.cp.client_for_token(&f.agent_token)?, &ns);
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &ns);

    let foreign = as_agent.evict("on-b", &EvictParams::default()).await;
    assert!(
        refused_by_policy(&foreign, "meshgate-agent-own-node-evictions"),
        "{}",
        describe(&foreign)
    );
    let msg = status_of(&foreign)
        .map(|(_, m)| m.to_owned())
        .unwrap_or_default();
    assert!(
        msg.contains(&format!(
            "may not evict pod {ns}/on-b, which is on node {}",
            f.node_b
        )),
        "{msg}"
    );
    assert!(
        pods.get("on-b")
            .await?
            .metadata
            .deletion_timestamp
            .is_none(),
        "a refused eviction deletes nothing"
    );

    // Its own node's pod: RBAC and the policy both allow it, and the pod is being deleted.
    as_agent
        .evict("on-a", &EvictParams::default())
        .await
        .context("evicting a pod on the agent's own node")?;
    let gone = pods.get_opt("on-a").await?;
    assert!(
        gone.is_none_or(|p| p.metadata.deletion_timestamp.is_some()),
        "the evicted pod is terminating"
    );
    Ok(())
}

#[tokio::test]
async fn agent_token_without_a_node_may_write_nothing() -> anyhow::Result<()> {
    let f = fixture().await;
    let admin = f.cp.client()?;
    let ns = exempt_namespace_with_pods(&admin, "rbac-nonode", &[("on-a", &f.node_a)]).await?;

    // A token of the same ServiceAccount not bound to a pod (like a legacy Secret token).
    let token =
        meshgate_e2e::service_account_token(&admin, NS, AGENT, &TokenOptions::default()).await?;
    let client = f.cp.client_for_token(&token)?;
    let review =
        Api::<k8s_openapi::api::authentication::v1::SelfSubjectReview>::all(client.clone())
            .create(&PostParams::default(), &Default::default())
            .await?;
    let extra = review
        .status
        .and_then(|s| s.user_info)
        .and_then(|u| u.extra)
        .unwrap_or_default();
    assert!(!extra.contains_key(NODE_EXTRA), "{extra:?}");

    let nodes: Api<Node> = Api::all(client.clone());
    let patch = label_verified_dry_run(&nodes, &f.node_a).await;
    assert!(
        refused_by_policy(&patch, "meshgate-agent-own-node"),
        "{}",
        describe(&patch)
    );
    let evict = Api::<Pod>::namespaced(client.clone(), &ns)
        .evict("on-a", &dry_run_eviction())
        .await;
    assert!(
        refused_by_policy(&evict, "meshgate-agent-own-node-evictions"),
        "{}",
        describe(&evict)
    );
    // Not even an Event about node A as the agent of node A.
    let event: Event = serde_json::from_value(json!({
        "metadata": {"generateName": "unbound-"},
        "eventTime": "2026-01-01T00:00:00.000000Z",
        "reportingController": AGENT, "reportingInstance": f.node_a,
        "action": "Probe", "reason": "Probe", "type": "Normal",
        "regarding": {"apiVersion": "v1", "kind": "Node", "name": f.node_a},
    }))?;
    let publish = Api::<Event>::namespaced(client, "default")
        .create(
            &PostParams {
                dry_run: true,
                ..Default::default()
            },
            &event,
        )
        .await;
    assert!(
        refused_by_policy(&publish, "meshgate-agent-own-events"),
        "{}",
        describe(&publish)
    );
    Ok(())
}

#[tokio::test]
async fn agent_token_cannot_read_secrets_and_has_exactly_its_rules() -> anyhow::Result<()> {
    let f = fixture().await;
    let admin = f.cp.client()?;
    let agent = f.cp.client_for_token(&f.agent_token)?;

    let tls_secret = Api::<Secret>::namespaced(admin.clone(), NS)
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .map(|s| s.name_any())
        .find(|n| n.starts_with("meshgate-webhook-tls"))
        .context("the webhook's TLS Secret")?;
    let get = Api::<Secret>::namespaced(agent.clone(), NS)
        .get(&tls_secret)
        .await;
    assert!(refused_by_rbac(&get), "{}", describe(&get));
    let list = Api::<Secret>::all(agent.clone())
        .list(&ListParams::default())
        .await;
    assert!(refused_by_rbac(&list), "{}", describe(&list));
    let sa_token = Api::<ServiceAccount>::namespaced(agent.clone(), NS)
        .create_subresource::<
            k8s_openapi::api::authentication::v1::TokenRequest,
            k8s_openapi::api::authentication::v1::TokenRequest,
        >(
            "token",
            WEBHOOK,
            &PostParams::default(),
            &Default::default(),
        )
        .await;
    assert!(refused_by_rbac(&sa_token), "{}", describe(&sa_token));
    // Namespaces are read (their labels select pods), never written, never read one by one.
    let namespaces = Api::<k8s_openapi::api::core::v1::Namespace>::all(agent.clone());
    let listed = namespaces
        .list_metadata(&ListParams::default().limit(1))
        .await;
    assert!(listed.is_ok(), "{}", describe(&listed));
    let relabel = namespaces
        .patch(
            "default",
            &PatchParams::default().dry_run(),
            &Patch::Merge(json!({"metadata": {"labels": {"istio.io/dataplane-mode": "ambient"}}})),
        )
        .await;
    assert!(refused_by_rbac(&relabel), "{}", describe(&relabel));

    let want = triples(&[
        ("", &["nodes"], &["get", "list", "watch", "patch"]),
        ("", &["nodes/status"], &["patch"]),
        ("", &["pods"], &["list", "watch"]),
        ("", &["namespaces"], &["list", "watch"]),
        ("", &["pods/eviction"], &["create"]),
        ("events.k8s.io", &["events"], &["create", "patch"]),
    ]);
    for ns in [NS, "default", "kube-system"] {
        let have = effective_rules(&agent, ns).await?;
        assert_eq!(have, want, "the agent's rules in namespace {ns}");
    }
    Ok(())
}

#[tokio::test]
async fn webhook_token_reads_what_it_caches_and_writes_nothing() -> anyhow::Result<()> {
    let f = fixture().await;
    let admin = f.cp.client()?;
    let webhook = f.cp.client_for_token(&f.webhook_token)?;

    let want = triples(&[
        ("", &["nodes", "pods"], &["get", "list", "watch"]),
        ("", &["namespaces"], &["list", "watch"]),
    ]);
    for ns in [NS, "default", "kube-system"] {
        let have = effective_rules(&webhook, ns).await?;
        assert_eq!(have, want, "the webhook's rules in namespace {ns}");
    }

    // Every kind of write it might be tempted to make is refused by RBAC (dry runs, so a
    // wrongly granted write would change nothing and still fail the test).
    let dry = PatchParams::default().dry_run();
    let dry_post = PostParams {
        dry_run: true,
        ..Default::default()
    };
    let nodes: Api<Node> = Api::all(webhook.clone());
    let pods: Api<Pod> = Api::namespaced(webhook.clone(), NS);
    let victim = scheduled_pod(&admin, AGENT, Some(&f.node_a))
        .await?
        .name_any();
    let mut attempts: Vec<(&str, String, bool)> = Vec::new();
    let r = nodes
        .patch(
            &f.node_a,
            &dry,
            &Patch::Merge(json!({"metadata": {"labels": {VERIFIED_LABEL: "true"}}})),
        )
        .await;
    attempts.push(("patch node", describe(&r), refused_by_rbac(&r)));
    let r = nodes
        .patch_status(
            &f.node_a,
            &dry,
            &Patch::Merge(json!({"status": {"conditions": []}})),
        )
        .await;
    attempts.push(("patch node status", describe(&r), refused_by_rbac(&r)));
    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": "forged" },
        "spec": { "containers": [{ "name": "c", "image": "registry.k8s.io/pause:3.10" }] }
    }))?;
    let r = pods.create(&dry_post, &pod).await;
    attempts.push(("create pod", describe(&r), refused_by_rbac(&r)));
    let r = pods
        .delete(
            &victim,
            &DeleteParams {
                dry_run: true,
                ..Default::default()
            },
        )
        .await;
    attempts.push(("delete pod", describe(&r), refused_by_rbac(&r)));
    let r = pods.evict(&victim, &dry_run_eviction()).await;
    attempts.push(("evict pod", describe(&r), refused_by_rbac(&r)));
    let r = Api::<Secret>::namespaced(webhook.clone(), NS)
        .create(&dry_post, &Secret::default())
        .await;
    attempts.push(("create secret", describe(&r), refused_by_rbac(&r)));
    let event: Event = serde_json::from_value(json!({
        "metadata": { "name": "forged" },
        "eventTime": "2026-01-01T00:00:00.000000Z",
        "reportingController": "meshgate-webhook", "reportingInstance": "x", "action": "x",
        "reason": "x", "type": "Normal"
    }))?;
    let r = Api::<Event>::namespaced(webhook.clone(), NS)
        .create(&dry_post, &event)
        .await;
    attempts.push(("create event", describe(&r), refused_by_rbac(&r)));
    let cm = Api::<ConfigMap>::namespaced(admin.clone(), NS)
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .map(|c| c.name_any())
        .find(|n| n.starts_with("meshgate-profiles"))
        .context("the profiles ConfigMap")?;
    let r = Api::<ConfigMap>::namespaced(webhook.clone(), NS)
        .patch(&cm, &dry, &Patch::Merge(json!({"data": {"x": "y"}})))
        .await;
    attempts.push(("patch configmap", describe(&r), refused_by_rbac(&r)));
    let allowed: Vec<_> = attempts.iter().filter(|(_, _, refused)| !refused).collect();
    assert!(
        allowed.is_empty(),
        "writes not refused by RBAC: {allowed:#?}"
    );

    // Enough to work: the webhook as the Deployment runs it, with this token, gets ready
    // (both metadata caches listed under its RBAC) and serves the Secret's certificate for
    // the Service's DNS name, trusted through the caBundle the apiserver uses.
    let deployment = Api::<Deployment>::namespaced(admin.clone(), NS)
        .get(WEBHOOK)
        .await?;
    let spec = deployment
        .spec
        .and_then(|s| s.template.spec)
        .context("pod template")?;
    let scratch = tempfile::tempdir()?;
    let kubeconfig =
        f.cp.write_token_kubeconfig("rbac-webhook", &f.webhook_token)?;
    let mut server = Workload::start(
        &admin,
        &spec,
        &f.node_a,
        &kubeconfig,
        &BTreeMap::new(),
        scratch.path(),
    )
    .await?;
    let admin_addr = server.addrs.get("--admin-addr").copied().context("admin")?;
    let ready = poll_until("the webhook to be ready", WAIT, || async {
        anyhow::Ok((http_status(admin_addr, "/ready").await == Some(200)).then_some(()))
    })
    .await;
    if let Err(e) = ready {
        bail!(
            "{e}; exit: {:?}; webhook log:\n{}",
            server.exited(),
            server.log()
        );
    }

    let vwc = Api::<ValidatingWebhookConfiguration>::all(admin.clone())
        .get("meshgate")
        .await?;
    let bundle = vwc
        .webhooks
        .unwrap_or_default()
        .into_iter()
        .next()
        .and_then(|w| w.client_config.ca_bundle)
        .context("caBundle")?;
    let mut roots = rustls::RootCertStore::empty();
    for der in CertificateDer::pem_slice_iter(&bundle.0) {
        roots.add(der?)?;
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let listen = server.addrs.get("--listen").copied().context("listen")?;
    let tcp = tokio::net::TcpStream::connect(listen).await?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(rustls::pki_types::ServerName::try_from(SERVICE_DNS)?, tcp)
        .await
        .context("TLS handshake as the apiserver makes it")?;
    let presented = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .context("no certificate presented")?
        .to_vec();
    let mounted = std::fs::read(f.manifests.join("tls/tls.crt"))?;
    let expected = CertificateDer::pem_slice_iter(&mounted)
        .next()
        .context("tls.crt")??;
    assert_eq!(
        presented,
        expected.to_vec(),
        "the generated serving certificate"
    );
    Ok(())
}

#[test]
fn alert_rules_pass_promtool() -> anyhow::Result<()> {
    let script = repo_root().join("manifests/monitoring/test.sh");
    let out = Command::new("bash")
        .arg(&script)
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.success(),
        "{} failed ({}):\n{stdout}\n{stderr}",
        script.display(),
        out.status
    );
    assert!(stdout.contains("SUCCESS"), "{stdout}");
    Ok(())
}
