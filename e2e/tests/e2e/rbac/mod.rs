//! The chart installed on a real apiserver, and least privilege proven with the components'
//! real ServiceAccount tokens.
//!
//! In: `manifests/charts/meshgate` (installed with `helm install`, its self-signed TLS and the
//! opt-in NetworkPolicy on), a dedicated control plane, the built `meshgate-agent` and
//! `meshgate-webhook`. Out: pass/fail:
//! - `helm install` passes the apiserver's validation, the DaemonSet and Deployment get their
//!   pods, the caBundles carry the chart's CA (the one in the Secret the webhook mounts), the
//!   policies type-check; the chart rendered with every option on passes a server-side dry
//!   run (chart.rs);
//! - the agent, run with the DaemonSet's own command line and environment and a token bound to
//!   its DaemonSet pod, gates and ungates its own Node; the same token may not modify another
//!   Node, nor evict a pod on another node, nor read Secrets; a token that names no node may
//!   write nothing at all;
//! - on its own Node, the agent's real writes (`NodeGate`: taint, label, condition, Events)
//!   pass the policies, and every other change (other taints, cordoning, other labels,
//!   annotations, finalizers, other status fields) is refused with the policy's message, as
//!   are Events not in its own name or about another node;
//! - the opt-in webhook NetworkPolicy applies, selects the webhook pods and opens exactly their
//!   named ports;
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

use crate::WAIT;
use crate::support::{
    AGENT, NS, bound_token, describe, dry_run_eviction, effective_rules, eviction_budget_rules,
    expect_only_the_mode_configmap, expect_rules, label_verified_dry_run, mode_reader_rules,
    refused_by_policy, refused_by_rbac, status_of, triples, verdict,
};
use anyhow::{Context as _, bail, ensure};
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingAdmissionPolicy, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, Namespace, Node, Pod, PodSpec, Secret, Service, ServiceAccount,
};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{
    Api, DeleteParams, EvictParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams,
};
use kube::{Client, ResourceExt};
use meshgate_core::gate::{CONDITION_TYPE, DEFAULT_TAINT_KEY as TAINT_KEY, VERIFIED_LABEL};
use meshgate_e2e::harness::helm;
use meshgate_e2e::harness::paths::repo_root;
use meshgate_e2e::harness::wait::poll_until;
use meshgate_e2e::sim::node::{
    CniDirs, free_port, gate_condition, golden, tainted, verified_label as label, workspace_bin,
};
use meshgate_e2e::{ControlPlane, NodeSpec, Options, TokenOptions, unique_name};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use serde_json::json;
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, OnceLock};

mod agent;
mod chart;
mod install;
mod own_node;
mod webhook;

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
    /// The webhook's TLS material as the chart made it (the Secret meshgate-webhook-tls).
    tls: Tls,
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

    // The operator's step: helm install, with the opt-in NetworkPolicy and placement policy
    // turned on.
    let set = [
        "--set",
        "webhook.networkPolicy.enabled=true,placementPolicy.enabled=true",
    ];
    let installed = helm::release(cp, "install", &set, WAIT)
        .await
        .context("helm install")?;
    tracing::info!(%installed, "installed the chart");
    let tls = Tls::read(&client).await?;

    let (node_a, node_b, node_c) = register_nodes(cp, &client).await?;

    // The DaemonSet controller and the scheduler place an agent pod on each node; the tokens
    // are bound to real pods of the workloads, as the kubelet's projected tokens are.
    let agent_a = scheduled_pod(&client, AGENT, Some(&node_a)).await?;
    let agent_b = scheduled_pod(&client, AGENT, Some(&node_b)).await?;
    let webhook_pod = scheduled_pod(&client, WEBHOOK, None).await?;
    let agent_c = scheduled_pod(&client, AGENT, Some(&node_c)).await?;
    let agent_token = bound_token(&client, AGENT, agent_a).await?;
    let agent_token_c = bound_token(&client, AGENT, agent_c).await?;
    let webhook_token = bound_token(&client, WEBHOOK, webhook_pod).await?;

    policies_refuse_the_agent(cp, &agent_token, &node_b, &agent_b).await?;

    Ok(Fixture {
        cp,
        tls,
        node_a,
        node_b,
        node_c,
        agent_token,
        agent_token_c,
        webhook_token,
    })
}

/// Nodes register tainted, as with kubelet --register-with-taints (no webhook serves the
/// mutating registration here; it fails open, as designed). Returns nodes A, B and C.
async fn register_nodes(
    cp: &ControlPlane,
    client: &Client,
) -> anyhow::Result<(String, String, String)> {
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
        cp.register_node(client, &spec).await?;
    }
    Ok((node_a, node_b, node_c))
}

/// Policies and bindings reach the apiserver's admission through informers: wait until
/// both refuse (dry-run probes, so nothing changes if they do not yet). The probes use the
/// agent's token, on node B and on its pod there, `agent_b`.
async fn policies_refuse_the_agent(
    cp: &ControlPlane,
    agent_token: &str,
    node_b: &str,
    agent_b: &Pod,
) -> anyhow::Result<()> {
    let agent = cp.client_for_token(agent_token)?;
    let nodes: Api<Node> = Api::all(agent.clone());
    poll_until(
        "the node policy to refuse the agent another Node",
        WAIT,
        || async {
            let r = nodes
                .patch(
                    node_b,
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
    Ok(())
}

/// The webhook's TLS material the chart made, read back from the Secret the webhook mounts.
struct Tls {
    /// `ca.crt`: the CA the chart generated (PEM).
    ca_pem: Vec<u8>,
    /// `tls.crt`: the serving certificate it signed (PEM).
    cert_pem: Vec<u8>,
}

impl Tls {
    async fn read(client: &Client) -> anyhow::Result<Self> {
        let secret = Api::<Secret>::namespaced(client.clone(), NS)
            .get("meshgate-webhook-tls")
            .await
            .context("the chart's Secret meshgate-webhook-tls")?;
        let data = secret.data.unwrap_or_default();
        let key = |k: &str| {
            data.get(k)
                .map(|b| b.0.clone())
                .with_context(|| format!("{k} in meshgate-webhook-tls"))
        };
        Ok(Self {
            ca_pem: key("ca.crt")?,
            cert_pem: key("tls.crt")?,
        })
    }
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

        let mounts =
            local_volumes(spec, container, &configmaps, &secrets, host_dirs, scratch).await?;
        let mut argv: Vec<String> = container.command.clone().unwrap_or_default();
        argv.extend(container.args.clone().unwrap_or_default());
        ensure!(!argv.is_empty(), "the container names no command");
        let bin_name = Path::new(&argv[0])
            .file_name()
            .and_then(|n| n.to_str())
            .context("command")?
            .to_owned();
        let mut cmd = Command::new(workspace_bin(&bin_name)?);
        let addrs = map_args(&mut cmd, &argv[1..], &mounts)?;
        cmd.arg(format!("--kubeconfig={}", kubeconfig.display()));

        set_env(&mut cmd, container, &configmaps, node).await?;
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

/// A local directory for each volume mount of `container` (mountPath → dir), holding what the
/// volume would: a hostPath from `host_dirs` (else an empty dir under `scratch`), a
/// ConfigMap's or Secret's keys as files.
async fn local_volumes(
    spec: &PodSpec,
    container: &Container,
    configmaps: &Api<ConfigMap>,
    secrets: &Api<Secret>,
    host_dirs: &BTreeMap<&str, PathBuf>,
    scratch: &Path,
) -> anyhow::Result<BTreeMap<String, PathBuf>> {
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
    Ok(mounts)
}

/// Adds `args` to `cmd`: `--admin-addr` and `--listen` get free loopback ports (returned by
/// flag), and every absolute path must lie under a volume mount and is mapped to its local
/// directory (a path no volume provides is a manifest bug and fails here).
fn map_args(
    cmd: &mut Command,
    args: &[String],
    mounts: &BTreeMap<String, PathBuf>,
) -> anyhow::Result<BTreeMap<String, SocketAddr>> {
    let mut addrs = BTreeMap::new();
    for arg in args {
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
    Ok(addrs)
}

/// The environment is exactly the container's `env` (the Downward API's spec.nodeName is
/// `node`) and `envFrom` ConfigMaps.
async fn set_env(
    cmd: &mut Command,
    container: &Container,
    configmaps: &Api<ConfigMap>,
    node: &str,
) -> anyhow::Result<()> {
    cmd.env_clear();
    cmd.env("RUST_LOG", "info");
    for e in container.env.iter().flatten() {
        if let Some(v) = &e.value {
            cmd.env(&e.name, v);
        } else if let Some(src) = &e.value_from {
            match src.field_ref.as_ref().map(|f| f.field_path.as_str()) {
                Some("metadata.namespace") => {
                    cmd.env(&e.name, NS);
                }
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
    Ok(())
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
