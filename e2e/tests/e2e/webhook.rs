//! meshgate-webhook against the real control plane.
//!
//! In: the shared control plane, an in-process webhook on a loopback port with a test CA and
//! serving certificate (rcgen), and the shipped webhook configurations pointing at it by URL
//! (`meshgate_e2e::sim::webhook`). Out: the apiserver's real answers: refusals shown to the
//! client, admissions, node taints from the mutating webhook, survival of a certificate
//! rotation. What an outage blocks is `outage.rs`, on this module's [`Fixture`].
//!
//! Webhook configurations are cluster-scoped, and other tests share this control plane. Each
//! test therefore scopes its configurations with a label unique to it: a namespace label for
//! the validating webhooks, a Node label for the mutating one. Only that test's namespaces
//! and nodes (and kube-system, labelled by the outage test only) ever reach its webhook, and
//! the configurations are deleted at the end even when the test fails.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use meshgate_core::gate::{DEFAULT_TAINT_KEY as TAINT_KEY, VERIFIED_LABEL};
use meshgate_e2e::sim::webhook::{self, Scope, TestCa};
use meshgate_e2e::{ControlPlane, NodeSpec, unique_name};
use serde_json::{Value, json};
use tokio::sync::oneshot;

use crate::cp;

/// Label key that scopes this module's webhook configurations to one test's objects.
pub(crate) const SCOPE_KEY: &str = "e2e.meshgate.io/webhook";
/// Bound on one API call made by the test itself.
pub(crate) const CALL: Duration = Duration::from_secs(20);

/// The certificate the server at `addr` presents to a client trusting `ca`.
async fn presented(ca: &TestCa, addr: SocketAddr) -> anyhow::Result<Vec<u8>> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(rustls::pki_types::CertificateDer::from(ca.der().to_vec()))?;
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1")?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await?;
    let certs = tls
        .get_ref()
        .1
        .peer_certificates()
        .context("no peer certificate")?;
    Ok(certs[0].to_vec())
}

/// A free loopback port the webhook can bind again after a restart.
fn free_port() -> anyhow::Result<SocketAddr> {
    Ok(SocketAddr::from((
        [127, 0, 0, 1],
        meshgate_e2e::sim::node::free_port()?,
    )))
}

/// A plain HTTP/1.0 GET on the admin port: (status code, body).
async fn http_get(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    meshgate_e2e::sim::node::http_get(addr, path)
        .await
        .with_context(|| format!("no answer from {addr}{path}"))
}

/// How [`Fixture::start_with`] runs the webhook and registers it.
pub(crate) struct Start {
    /// The webhook's API identity.
    pub kubeconfig: PathBuf,
    /// `--profile-file` (custom mesh profiles), if any.
    pub profile_file: Option<PathBuf>,
    /// Name the webhooks `<x>.<tag>.meshgate.io` ([`Scope::hook_infix`]).
    pub tag_hooks: bool,
    /// Where the webhook reads its mode (the namespace of the `meshgate-mode` ConfigMap).
    pub mode: meshgate_shell::mode::ModeSource,
    /// `--taint-key`.
    pub taint_key: meshgate_core::gate::TaintKey,
}

/// One webhook instance, its configurations and their scope label, and the agent DaemonSet
/// it reads (the shipped one's placement, scoped to this test's nodes).
pub(crate) struct Fixture {
    pub(crate) client: Client,
    /// Value of [`SCOPE_KEY`] that selects this test's objects.
    pub(crate) tag: String,
    /// The namespace of the agent DaemonSet `meshgate-agent` the webhook reads.
    pub(crate) agent_namespace: String,
    /// The key the webhook taints new Nodes with (`--taint-key`).
    pub(crate) taint_key: String,
    tag_hooks: bool,
    ca: TestCa,
    dir: tempfile::TempDir,
    listen: SocketAddr,
    admin: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl Fixture {
    fn cert_paths(&self) -> (PathBuf, PathBuf) {
        (
            self.dir.path().join("tls.crt"),
            self.dir.path().join("tls.key"),
        )
    }

    /// Starts the webhook in-process, waits for `/ready`, and registers the configurations.
    pub(crate) async fn start(cp: &ControlPlane, prefix: &str) -> anyhow::Result<Self> {
        Self::start_as(cp, prefix, cp.admin_kubeconfig_path().to_path_buf()).await
    }

    /// [`Self::start`] with the webhook's API client on `kubeconfig` (an identity whose
    /// requests the audit log records; the admin's are left out of it).
    async fn start_as(
        cp: &ControlPlane,
        prefix: &str,
        kubeconfig: PathBuf,
    ) -> anyhow::Result<Self> {
        let start = Start {
            kubeconfig,
            profile_file: None,
            tag_hooks: false,
            mode: Default::default(),
            taint_key: Default::default(),
        };
        Self::start_with(cp, prefix, start).await
    }

    /// Starts the webhook as `start` says, waits for `/ready`, and registers it.
    pub(crate) async fn start_with(
        cp: &ControlPlane,
        prefix: &str,
        start: Start,
    ) -> anyhow::Result<Self> {
        let client = cp.client()?;
        let tag = unique_name(prefix);
        // The agent DaemonSet exists before the webhook starts: its readiness waits for it.
        let agent_namespace = cp.create_namespace(&client, "whds").await?;
        let scope = Scope {
            label: Some((SCOPE_KEY.to_string(), tag.clone())),
            hook_infix: None,
        };
        let ds = webhook::agent_daemonset(cp, &agent_namespace, &scope).await?;
        let daemonsets: Api<DaemonSet> = Api::namespaced(client.clone(), &agent_namespace);
        tokio::time::timeout(CALL, daemonsets.create(&PostParams::default(), &ds)).await??;
        let ca = TestCa::new()?;
        let dir = tempfile::tempdir()?;
        let (listen, admin) = (free_port()?, free_port()?);
        let mut f = Self {
            client,
            tag,
            agent_namespace,
            taint_key: start.taint_key.as_str().to_owned(),
            tag_hooks: start.tag_hooks,
            ca,
            dir,
            listen,
            admin,
            stop: None,
            server: None,
        };
        let (cert, key) = f.cert_paths();
        f.ca.issue(&cert, &key)?;

        let args = f.args(start, cert, key)?;
        let listener = tokio::net::TcpListener::bind(listen).await?;
        let (stop_tx, stop_rx) = oneshot::channel();
        f.stop = Some(stop_tx);
        f.server = Some(tokio::spawn(meshgate_webhook::run_on(
            args,
            listener,
            async move {
                let _ = stop_rx.await;
            },
        )));

        f.until_ready().await?;
        f.register(cp).await?;
        // Readiness does not wait for the agent DaemonSet's watch: wait until new Nodes are
        // gated (a Linux node in scope, as the shipped placement selects).
        crate::placement::until_gated(&f, json!({"kubernetes.io/os": "linux"}), true).await?;
        Ok(f)
    }

    /// The webhook's arguments: as `start` says, with this fixture's ports and certificate,
    /// and short timeouts.
    fn args(
        &self,
        start: Start,
        cert: PathBuf,
        key: PathBuf,
    ) -> anyhow::Result<meshgate_webhook::Args> {
        Ok(meshgate_webhook::Args {
            listen: self.listen,
            tls_cert: cert,
            tls_key: key,
            common: meshgate_shell::cli::Common {
                kubeconfig: Some(start.kubeconfig),
                admin_addr: Some(self.admin),
                profiles: Vec::new(),
                profile_file: start.profile_file,
                log_format: meshgate_shell::logging::LogFormat::Text,
                taint_key: start.taint_key,
                taint_effect: Default::default(),
                mode: start.mode,
            },
            request_timeout: Duration::from_secs(3),
            lookup_timeout: Duration::from_secs(1),
            max_body_bytes: 3 * 1024 * 1024,
            max_connections: 1024,
            review_memory_bytes: meshgate_webhook::budget::DEFAULT_REVIEW_MEMORY_BYTES,
            // Stopped by the test, not by a kubelet: no endpoint removal to wait for.
            shutdown_delay: Duration::ZERO,
            shutdown_timeout: Duration::from_secs(5),
            pods: meshgate_webhook::pods::PodLimits::default(),
            agent_daemonset: format!("{}/meshgate-agent", self.agent_namespace)
                .parse()
                .map_err(anyhow::Error::msg)?,
        })
    }

    /// Waits up to 30 s for `/ready`; fails at once if the server task ended.
    async fn until_ready(&self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok((200, _)) = http_get(self.admin, "/ready").await {
                break;
            }
            if self.server.as_ref().is_some_and(|s| s.is_finished()) {
                bail!("webhook exited during startup");
            }
            ensure!(Instant::now() < deadline, "webhook not ready after 30 s");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(())
    }

    /// This test's scope: its namespaces and nodes carry `SCOPE_KEY=<tag>`.
    pub(crate) fn scope(&self) -> Scope {
        Scope {
            label: Some((SCOPE_KEY.to_string(), self.tag.clone())),
            hook_infix: self.tag_hooks.then(|| self.tag.clone()),
        }
    }

    async fn register(&self, cp: &ControlPlane) -> anyhow::Result<()> {
        webhook::register(
            cp,
            &self.client,
            &self.tag,
            self.listen.port(),
            self.ca.pem(),
            &self.scope(),
        )
        .await
    }

    /// Creates a namespace in this test's scope, with extra labels.
    pub(crate) async fn namespace(&self, extra: &[(&str, &str)]) -> anyhow::Result<String> {
        let cp = cp().await;
        let ns = cp.create_namespace(&self.client, "wh").await?;
        let mut labels = serde_json::Map::new();
        labels.insert(SCOPE_KEY.into(), json!(self.tag));
        for (k, v) in extra {
            labels.insert((*k).into(), json!(v));
        }
        let api: Api<Namespace> = Api::all(self.client.clone());
        tokio::time::timeout(
            CALL,
            api.patch(
                &ns,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": labels}})),
            ),
        )
        .await??;
        Ok(ns)
    }

    /// The webhook's admin address (`/metrics`, `/ready`).
    pub(crate) fn admin(&self) -> SocketAddr {
        self.admin
    }

    /// The webhook's `/metrics` text.
    pub(crate) async fn metrics(&self) -> anyhow::Result<String> {
        let (code, text) = http_get(self.admin, "/metrics").await?;
        ensure!(code == 200, "/metrics answered {code}");
        Ok(text)
    }

    /// One sample of the webhook's `/metrics`, if it is there.
    pub(crate) async fn metric(&self, sample: &str) -> Option<f64> {
        meshgate_e2e::sim::node::metric_sample(&self.metrics().await.ok()?, sample)
    }

    /// Stops the webhook (graceful shutdown) and waits for it.
    pub(crate) async fn stop_webhook(&mut self) -> anyhow::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(server) = self.server.take() {
            tokio::time::timeout(Duration::from_secs(15), server)
                .await
                .context("webhook did not stop")???;
        }
        Ok(())
    }

    /// Deletes the configurations, stops the webhook and deletes the agent DaemonSet's
    /// namespace; run whatever the test's outcome.
    pub(crate) async fn teardown(mut self) {
        webhook::unregister(&self.client, &self.tag).await;
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        let _ = tokio::time::timeout(
            CALL,
            namespaces.delete(&self.agent_namespace, &DeleteParams::default()),
        )
        .await;
        if let Err(e) = self.stop_webhook().await {
            tracing::warn!(error = %e, "stopping the webhook");
        }
    }
}

pub(crate) fn pod(name: &str, node: Option<&str>, meshed: bool, scheduler: Option<&str>) -> Pod {
    let mut labels = json!({"app": name});
    if meshed {
        labels["linkerd.io/control-plane-ns"] = json!("linkerd");
    }
    let mut spec = json!({
        "containers": [{"name": "app", "image": "registry.invalid/app:1"}],
        "terminationGracePeriodSeconds": 0,
    });
    if let Some(n) = node {
        spec["nodeName"] = json!(n);
    }
    if let Some(s) = scheduler {
        spec["schedulerName"] = json!(s);
    }
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": spec,
    }))
    .expect("static pod shape")
}

/// Creates a pod; `Err(message)` is the apiserver's refusal as a client sees it.
pub(crate) async fn create_pod(
    client: &Client,
    ns: &str,
    p: &Pod,
    dry_run: bool,
) -> anyhow::Result<Result<Pod, String>> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let pp = PostParams {
        dry_run,
        ..PostParams::default()
    };
    match tokio::time::timeout(CALL, api.create(&pp, p)).await? {
        Ok(p) => Ok(Ok(p)),
        Err(kube::Error::Api(s)) => Ok(Err(format!("{} ({})", s.message, s.code))),
        Err(e) => Err(e.into()),
    }
}

/// Binds a pod the way kube-scheduler does: `POST pods/{name}/binding`.
pub(crate) async fn bind(
    client: &Client,
    ns: &str,
    pod: &str,
    node: &str,
) -> anyhow::Result<Result<(), String>> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let binding = json!({
        "apiVersion": "v1", "kind": "Binding",
        "metadata": {"name": pod, "namespace": ns},
        "target": {"apiVersion": "v1", "kind": "Node", "name": node},
    });
    let res = tokio::time::timeout(
        CALL,
        api.create_subresource::<Value, Value>("binding", pod, &PostParams::default(), &binding),
    )
    .await?;
    match res {
        Ok(_) => Ok(Ok(())),
        Err(kube::Error::Api(s)) => Ok(Err(format!("{} ({})", s.message, s.code))),
        Err(e) => Err(e.into()),
    }
}

pub(crate) async fn force_delete_pods(client: &Client, ns: &str, names: &[&str]) {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let dp = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::default()
    };
    for n in names {
        let _ = tokio::time::timeout(CALL, api.delete(n, &dp)).await;
    }
}

pub(crate) fn taint_count(node: &Node) -> usize {
    taint_count_of(node, TAINT_KEY)
}

/// How many taints under `key` the Node carries.
pub(crate) fn taint_count_of(node: &Node, key: &str) -> usize {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .map(|ts| ts.iter().filter(|t| t.key == key).count())
        .unwrap_or(0)
}

/// Retries `create` for up to 10 s while it is refused: the webhook's node cache follows the
/// apiserver through a watch, a few milliseconds behind a label change.
async fn admitted_eventually(client: &Client, ns: &str, p: &Pod) -> anyhow::Result<Pod> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match create_pod(client, ns, p, false).await? {
            Ok(p) => return Ok(p),
            Err(m) if Instant::now() >= deadline => bail!("still refused after 10 s: {m}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_gates_mesh_pods_bindings_and_new_nodes() {
    let cp = cp().await;
    let f = Fixture::start(cp, "whg").await.expect("webhook starts");
    let result = gates(cp, &f).await;
    f.teardown().await;
    result.expect("webhook e2e");
}

async fn gates(cp: &ControlPlane, f: &Fixture) -> anyhow::Result<()> {
    let c = &f.client;
    let nodes: Api<Node> = Api::all(c.clone());
    let (unverified, verified, pretainted) = new_nodes_are_tainted_once(cp, f, &nodes).await?;
    play_the_agent(&nodes, &unverified, &verified).await?;
    let ns = f.namespace(&[]).await?;
    pods_are_gated_by_their_node(c, &ns, &unverified, &verified).await?;
    bindings_are_gated_by_their_node(c, &ns, &unverified, &verified).await?;
    certificate_rotates_under_load(f, &ns, &verified).await?;
    metrics_count_the_reviews(f).await?;

    force_delete_pods(c, &ns, &["meshed", "plain", "pending"]).await;
    let dp = DeleteParams::default();
    for n in [&unverified, &verified, &pretainted] {
        let _ = tokio::time::timeout(CALL, nodes.delete(n, &dp)).await;
    }
    Ok(())
}

/// Nodes: the mutating webhook gates them from creation on (taint and `verified=false`), and
/// a node created with meshgate's taint keeps one. Returns the (unverified, verified,
/// pretainted) node names.
async fn new_nodes_are_tainted_once(
    cp: &ControlPlane,
    f: &Fixture,
    nodes: &Api<Node>,
) -> anyhow::Result<(String, String, String)> {
    let c = &f.client;
    // --- Nodes: the mutating webhook gates them from creation on.
    let unverified = unique_name("whg-unv");
    let verified = unique_name("whg-ver");
    let pretainted = unique_name("whg-pre");
    for n in [&unverified, &verified] {
        cp.register_node(
            c,
            &NodeSpec::new(n.as_str()).label(SCOPE_KEY, f.tag.as_str()),
        )
        .await?;
    }
    cp.register_node(
        c,
        &NodeSpec::new(pretainted.as_str())
            .label(SCOPE_KEY, f.tag.as_str())
            .taint(TAINT_KEY, "NoSchedule"),
    )
    .await?;
    for n in [&unverified, &verified] {
        let node = tokio::time::timeout(CALL, nodes.get(n)).await??;
        ensure!(
            taint_count(&node) == 1,
            "new node {n} lacks the taint: {:?}",
            node.spec
        );
        ensure!(
            node.labels().get(VERIFIED_LABEL).map(String::as_str) == Some("false"),
            "new node {n} lacks {VERIFIED_LABEL}=false: {:?}",
            node.labels()
        );
    }
    let node = tokio::time::timeout(CALL, nodes.get(&pretainted)).await??;
    ensure!(
        taint_count(&node) == 1,
        "taint duplicated on {pretainted}: {:?}",
        node.spec
    );
    Ok((unverified, verified, pretainted))
}

/// The agent's part, played by the test: the unverified node gets its condition, the verified
/// one its label.
async fn play_the_agent(nodes: &Api<Node>, unverified: &str, verified: &str) -> anyhow::Result<()> {
    tokio::time::timeout(
        CALL,
        nodes.patch_status(
            unverified,
            &PatchParams::default(),
            &Patch::Strategic(json!({"status": {"conditions": [{
                "type": "MeshCNIVerified", "status": "False", "reason": "ChainedPluginMissing",
                "message": "/etc/cni/net.d/10-calico.conflist lacks linkerd-cni",
            }]}})),
        ),
    )
    .await??;
    tokio::time::timeout(
        CALL,
        nodes.patch(
            verified,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {VERIFIED_LABEL: "true"}}})),
        ),
    )
    .await??;
    Ok(())
}

/// Pods created with spec.nodeName: a mesh pod is refused on the unverified node with a
/// message naming the webhook, the node, the reason, a remedy and the plugin; it is admitted on
/// the verified one, and a non-mesh pod anywhere.
async fn pods_are_gated_by_their_node(
    c: &Client,
    ns: &str,
    unverified: &str,
    verified: &str,
) -> anyhow::Result<()> {
    // --- Pods created with spec.nodeName.
    let refused = create_pod(c, ns, &pod("meshed", Some(unverified), true, None), false).await?;
    let message = match refused {
        Ok(_) => bail!("mesh pod admitted on unverified node {unverified}"),
        Err(m) => m,
    };
    for needle in [
        "pods.validate.meshgate.io",
        unverified,
        "ChainedPluginMissing",
        "Remedy",
        "linkerd-cni",
    ] {
        ensure!(
            message.contains(needle),
            "refusal lacks {needle:?}: {message}"
        );
    }
    tracing::info!(%message, "refusal as the client sees it");

    admitted_eventually(c, ns, &pod("meshed", Some(verified), true, None)).await?;
    create_pod(c, ns, &pod("plain", Some(unverified), false, None), false)
        .await?
        .map_err(|m| anyhow::anyhow!("non-mesh pod refused: {m}"))?;
    Ok(())
}

/// Bindings, as the scheduler creates them: a mesh pod's binding to the unverified node is
/// refused, to the verified one admitted.
async fn bindings_are_gated_by_their_node(
    c: &Client,
    ns: &str,
    unverified: &str,
    verified: &str,
) -> anyhow::Result<()> {
    // The pods name a scheduler that does not run, so only the test binds them.
    create_pod(
        c,
        ns,
        &pod("pending", None, true, Some("meshgate-e2e-nobody")),
        false,
    )
    .await?
    .map_err(|m| anyhow::anyhow!("unbound mesh pod refused: {m}"))?;
    match bind(c, ns, "pending", unverified).await? {
        Ok(()) => bail!("binding of a mesh pod to {unverified} admitted"),
        Err(m) => {
            ensure!(
                m.contains("bindings.validate.meshgate.io")
                    && m.contains(unverified)
                    && m.contains("tolerate"),
                "binding refusal: {m}"
            );
        }
    }
    bind(c, ns, "pending", verified)
        .await?
        .map_err(|m| anyhow::anyhow!("binding to the verified node refused: {m}"))?;
    let pods: Api<Pod> = Api::namespaced(c.clone(), ns);
    let bound = tokio::time::timeout(CALL, pods.get("pending")).await??;
    ensure!(bound.spec.and_then(|s| s.node_name).as_deref() == Some(verified));
    Ok(())
}

/// Rotation: the certificate changes on disk while requests keep flowing; a new connection
/// gets the new one without a restart, and no request fails.
async fn certificate_rotates_under_load(
    f: &Fixture,
    ns: &str,
    verified: &str,
) -> anyhow::Result<()> {
    let c = &f.client;
    // --- Rotation: the certificate changes on disk while requests keep flowing.
    let (cert, key) = f.cert_paths();
    let before = presented(&f.ca, f.listen).await?;
    let load = {
        let (c, ns, verified) = (c.clone(), ns.to_owned(), verified.to_owned());
        tokio::spawn(async move {
            let p = pod("rotating", Some(&verified), true, None);
            let (mut ok, mut failed) = (0u32, Vec::new());
            let until = Instant::now() + Duration::from_secs(4);
            while Instant::now() < until {
                match create_pod(&c, &ns, &p, true).await {
                    Ok(Ok(_)) => ok += 1,
                    Ok(Err(m)) => failed.push(m),
                    Err(e) => failed.push(e.to_string()),
                }
            }
            (ok, failed)
        })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rotated = f.ca.issue(&cert, &key)?;
    ensure!(
        rotated != before,
        "the test issued the same certificate twice"
    );
    // A new connection now gets the new certificate, without a restart.
    let after = presented(&f.ca, f.listen).await?;
    ensure!(
        after == rotated,
        "webhook still serves the old certificate after rotation"
    );
    let (ok, failed) = load.await?;
    ensure!(
        failed.is_empty(),
        "requests failed across the rotation: {failed:?}"
    );
    ensure!(ok > 10, "too few requests across the rotation: {ok}");
    Ok(())
}

/// Metrics on the admin port count the reviews by resource and answer.
async fn metrics_count_the_reviews(f: &Fixture) -> anyhow::Result<()> {
    // --- Metrics on the admin port.
    let (code, metrics) = http_get(f.admin, "/metrics").await?;
    ensure!(code == 200, "/metrics answered {code}");
    for needle in [
        "meshgate_admission_reviews_total{resource=\"pods\",allowed=\"false\"}",
        "meshgate_admission_reviews_total{resource=\"pods_binding\",allowed=\"false\"}",
        "meshgate_admission_reviews_total{resource=\"pods_binding\",allowed=\"true\"}",
        "meshgate_admission_duration_seconds_bucket",
    ] {
        ensure!(
            metrics.contains(needle),
            "metrics lack {needle}:\n{metrics}"
        );
    }
    Ok(())
}

/// `istio-ambient` pods carry no mesh label of their own: the namespace's
/// `istio.io/dataplane-mode=ambient` label, read from the webhook's Namespace cache, makes
/// them meshed, and the pod label `istio.io/dataplane-mode=none` opts one out, as in Istio.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_gates_the_pods_of_an_ambient_namespace_by_its_label() {
    let cp = cp().await;
    let f = Fixture::start(cp, "wha").await.expect("webhook starts");
    let result = ambient(cp, &f).await;
    f.teardown().await;
    result.expect("webhook ambient e2e");
}

async fn ambient(cp: &ControlPlane, f: &Fixture) -> anyhow::Result<()> {
    let c = &f.client;
    let unverified = unique_name("wha-unv");
    cp.register_node(
        c,
        &NodeSpec::new(unverified.as_str()).label(SCOPE_KEY, f.tag.as_str()),
    )
    .await?;
    let ambient_ns = f
        .namespace(&[("istio.io/dataplane-mode", "ambient")])
        .await?;
    let plain_ns = f.namespace(&[]).await?;

    // Dry-run creates: nothing is left behind. The webhook's caches may lag the new node
    // and namespace by a moment, so the refusal is awaited.
    let web = pod("web", Some(&unverified), false, None);
    let deadline = Instant::now() + Duration::from_secs(30);
    let refusal = loop {
        match create_pod(c, &ambient_ns, &web, true).await? {
            Err(m) if m.contains("mesh profile istio-ambient") => break m,
            other => {
                ensure!(
                    Instant::now() < deadline,
                    "a pod of an ambient namespace was not refused on {unverified}: {other:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    ensure!(refusal.contains("chains istio-cni"), "{refusal}");
    ensure!(refusal.contains("(403)"), "{refusal}");

    let mut opted_out = pod("batch", Some(&unverified), false, None);
    opted_out
        .labels_mut()
        .insert("istio.io/dataplane-mode".into(), "none".into());
    let r = create_pod(c, &ambient_ns, &opted_out, true).await?;
    ensure!(r.is_ok(), "the opted-out pod was refused: {r:?}");
    let r = create_pod(c, &plain_ns, &web, true).await?;
    ensure!(r.is_ok(), "a pod of a plain namespace was refused: {r:?}");

    let nodes: Api<Node> = Api::all(c.clone());
    let _ = tokio::time::timeout(CALL, nodes.delete(&unverified, &DeleteParams::default())).await;
    Ok(())
}

/// Binds a pod through the legacy `bindings` resource: `POST /api/v1/namespaces/{ns}/bindings`
/// with a core/v1 Binding named after the pod.
pub(crate) async fn bind_legacy(
    client: &Client,
    ns: &str,
    pod: &str,
    node: &str,
) -> anyhow::Result<Result<(), String>> {
    let binding = json!({
        "apiVersion": "v1", "kind": "Binding",
        "metadata": {"name": pod, "namespace": ns},
        "target": {"apiVersion": "v1", "kind": "Node", "name": node},
    });
    // It answers with a Status, not the Binding, so the request is made by hand.
    let req = http::Request::post(format!("/api/v1/namespaces/{ns}/bindings"))
        .header("content-type", "application/json")
        .body(serde_json::to_vec(&binding)?)?;
    match tokio::time::timeout(CALL, client.request::<Value>(req)).await? {
        Ok(_) => Ok(Ok(())),
        Err(kube::Error::Api(s)) => Ok(Err(format!("{} ({})", s.message, s.code))),
        Err(e) => Err(e.into()),
    }
}

/// The legacy `bindings` resource is gated like `pods/binding`, and reviews naming nodes the
/// webhook's cache does not know cost the apiserver no request: the webhook runs under a
/// ServiceAccount of its own, whose requests the audit log records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn legacy_bindings_are_gated_and_unknown_nodes_cost_no_request() {
    let cp = cp().await;
    let admin = cp.client().expect("client");
    let home = cp
        .create_namespace(&admin, "wh-id")
        .await
        .expect("identity namespace");
    let identity =
        meshgate_e2e::harness::audit::AuditedIdentity::new(cp, &admin, &home, "meshgate-webhook")
            .await
            .expect("an audited identity for the webhook");
    let f = Fixture::start_as(cp, "whl", identity.kubeconfig.clone())
        .await
        .expect("webhook starts");
    let result = legacy_and_unknown(cp, &f, &identity).await;
    f.teardown().await;
    identity.remove(&admin).await;
    result.expect("legacy bindings and unknown nodes");
}

async fn legacy_and_unknown(
    cp: &ControlPlane,
    f: &Fixture,
    identity: &meshgate_e2e::harness::audit::AuditedIdentity,
) -> anyhow::Result<()> {
    let c = &f.client;
    let nodes: Api<Node> = Api::all(c.clone());
    let unverified = unique_name("whl-unv");
    let verified = unique_name("whl-ver");
    for n in [&unverified, &verified] {
        cp.register_node(
            c,
            &NodeSpec::new(n.as_str()).label(SCOPE_KEY, f.tag.as_str()),
        )
        .await?;
    }
    tokio::time::timeout(
        CALL,
        nodes.patch(
            &verified,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {VERIFIED_LABEL: "true"}}})),
        ),
    )
    .await??;
    let ns = f.namespace(&[]).await?;

    // Requests the webhook makes from here on are counted at the end.
    let from = std::time::SystemTime::now();

    legacy_bindings_are_gated(f, &ns, &unverified, &verified).await?;
    unknown_nodes_cost_no_request(cp, f, identity, from, &ns, &unverified).await?;

    force_delete_pods(c, &ns, &["legacy"]).await;
    let dp = DeleteParams::default();
    for n in [&unverified, &verified] {
        let _ = tokio::time::timeout(CALL, nodes.delete(n, &dp)).await;
    }
    Ok(())
}

/// The legacy bindings resource: a mesh pod is refused the unverified node, with the same
/// message as a pods/binding, and bound to the verified one; the refusal counts as a
/// pods_binding review.
async fn legacy_bindings_are_gated(
    f: &Fixture,
    ns: &str,
    unverified: &str,
    verified: &str,
) -> anyhow::Result<()> {
    let c = &f.client;
    create_pod(
        c,
        ns,
        &pod("legacy", None, true, Some("meshgate-e2e-nobody")),
        false,
    )
    .await?
    .map_err(|m| anyhow::anyhow!("unbound mesh pod refused: {m}"))?;
    match bind_legacy(c, ns, "legacy", unverified).await? {
        Ok(()) => bail!("legacy binding of a mesh pod to {unverified} admitted"),
        Err(m) => ensure!(
            m.contains("bindings.validate.meshgate.io")
                && m.contains(&format!("pod {ns}/legacy"))
                && m.contains(unverified)
                && m.contains("tolerate"),
            "legacy binding refusal: {m}"
        ),
    }
    let pods: Api<Pod> = Api::namespaced(c.clone(), ns);
    let still = tokio::time::timeout(CALL, pods.get("legacy")).await??;
    ensure!(
        still
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_ref())
            .is_none(),
        "the refused binding bound the pod"
    );
    // The webhook's node cache follows the label a few milliseconds behind.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match bind_legacy(c, ns, "legacy", verified).await? {
            Ok(()) => break,
            Err(m) if Instant::now() >= deadline => bail!("legacy binding to {verified}: {m}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    let bound = tokio::time::timeout(CALL, pods.get("legacy")).await??;
    ensure!(bound.spec.and_then(|s| s.node_name).as_deref() == Some(verified));
    let (_, metrics) = http_get(f.admin, "/metrics").await?;
    ensure!(
        metrics.contains(
            "meshgate_admission_reviews_total{resource=\"pods_binding\",allowed=\"false\"} 1"
        ),
        "the legacy binding counts as pods_binding:\n{metrics}"
    );
    Ok(())
}

/// A flood of reviews naming made-up nodes: each refused from the cache, none costs the
/// apiserver a request (counted by the audit log since `from`). Refusals on the known
/// unverified node, for comparison, cost a GET to word the reason (remembered for 5 s, so
/// usually one for all of them).
async fn unknown_nodes_cost_no_request(
    cp: &ControlPlane,
    f: &Fixture,
    identity: &meshgate_e2e::harness::audit::AuditedIdentity,
    from: std::time::SystemTime,
    ns: &str,
    unverified: &str,
) -> anyhow::Result<()> {
    let c = &f.client;
    const FLOOD: usize = 40;
    for i in 0..FLOOD {
        let node = unique_name(&format!("whl-made-up-{i}"));
        match create_pod(c, ns, &pod("flood", Some(&node), true, None), true).await? {
            Ok(_) => bail!("mesh pod admitted on made-up node {node}"),
            Err(m) => ensure!(m.contains("not known"), "refusal for {node}: {m}"),
        }
    }
    match create_pod(c, ns, &pod("known", Some(unverified), true, None), true).await? {
        Ok(_) => bail!("mesh pod admitted on {unverified}"),
        Err(m) => ensure!(m.contains(unverified), "{m}"),
    }
    // The audit log may lag a little behind: wait for the GET of the known node.
    let deadline = Instant::now() + Duration::from_secs(10);
    let gets = loop {
        let gets: Vec<String> = identity
            .requests(cp, from)?
            .into_iter()
            .filter(|r| r.verb == "get" && r.resource == "nodes")
            .map(|r| r.name)
            .collect();
        if gets.iter().any(|g| g == unverified) || Instant::now() >= deadline {
            break gets;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    ensure!(
        !gets.is_empty() && gets.iter().all(|g| g == unverified),
        "node GETs by the webhook during {FLOOD} reviews of made-up nodes and two refusals on \
         {unverified}: {gets:?}"
    );
    Ok(())
}
