//! A real local control plane: etcd, kube-apiserver, kube-controller-manager, kube-scheduler.
//!
//! In: the binaries ([`Binaries`]), a directory (or a fresh temporary one), free loopback ports.
//! Out: a running control plane whose every component answered its health endpoint, an admin
//! kubeconfig on disk, fresh `kube::Client`s on demand, and a clean stop (by pid, data removed).
//!
//! Two lifetimes are supported:
//! - **Tests** ([`ControlPlane::shared`] or [`ControlPlane::start`] with a temporary dir): the
//!   processes are children of a background thread that lives as long as the control plane and
//!   carry `PR_SET_PDEATHSIG`, so even a `SIGKILL`ed test binary leaves nothing running; the
//!   shared one is stopped by an `atexit` handler when the test binary exits.
//! - **`meshgate-e2e up`** ([`Options::detached`]): the processes get their own session and
//!   outlive the command; their pids (with start times) go to a state file that `down` reads.
//!
//! The background thread also runs the kubelet stand-in's long-lived tasks (Lease renewal, pod
//! runners). A `kube::Client` is bound to the tokio runtime it was built on, and every
//! `#[tokio::test]` has its own runtime, so long-lived tasks cannot borrow a test's client, and
//! tests get a new client per call from [`ControlPlane::client`].

mod boot;
mod files;
mod lifecycle;

use crate::Error;
use crate::harness::paths::Binaries;
use crate::harness::pki::Pki;
use crate::harness::process::{Mode, Proc};
use crate::harness::wait::API_TIMEOUT;
use crate::harness::{hostnet, paths, pki, process, wait};
use crate::sim::kubelet;
use crate::sim::kubelet::{NodeSpec, PodRunner};
pub(crate) use boot::client_from;
use boot::*;
use files::*;
pub(crate) use files::{cert_kubeconfig_yaml, tmp_base, write_owner, write_private};
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use kube::api::{Api, PostParams};
use kube::config::Kubeconfig;
use kube::{Client, Config};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Name of the state file `up` writes into its directory and `down` reads.
pub const STATE_FILE: &str = "meshgate-e2e.json";
/// Env var: base directory for temporary control planes (default `/dev/shm`, else `$TMPDIR`).
pub const TMPDIR_ENV: &str = "MESHGATE_E2E_TMPDIR";
/// Env var: when set to a directory, component logs are copied there before a temporary
/// control plane's directory is removed (for debugging failed runs).
pub const KEEP_LOGS_ENV: &str = "MESHGATE_E2E_KEEP_LOGS";

/// Prefix of temporary control-plane directories.
const TMP_PREFIX: &str = "meshgate-e2e-";
/// File in a temporary control-plane directory naming the process that owns it.
const OWNER_FILE: &str = "owner";

/// How long a component gets to exit after SIGTERM before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// How to start a control plane.
#[derive(Debug, Clone)]
pub struct Options {
    /// Directory for data, certificates, kubeconfigs and logs. `None`: a fresh temporary
    /// directory, removed on stop.
    pub dir: Option<PathBuf>,
    /// Detach the processes (new session, no death signal) so they outlive this process, and
    /// write the state file `down` reads. For `meshgate-e2e up`.
    pub detached: bool,
    /// The binaries; `None`: [`Binaries::locate`].
    pub binaries: Option<Binaries>,
    /// Upper bound on the whole startup.
    pub startup_timeout: Duration,
    /// Bind and advertise kube-apiserver on an address of its own instead of loopback: a /32
    /// on a link of its own (a port-less bridge) in the host's network namespace, created
    /// before the apiserver and removed on stop (or by the next run's sweep). Real nodes in
    /// their own network namespaces, kube-proxy's `kubernetes` Service and pods reach it
    /// there; the apiserver reconciles the Service's endpoints to it
    /// (`--endpoint-reconciler-type=lease`) and dials webhook Services at their endpoints
    /// (`--enable-aggregator-routing`), since its own namespace has no kube-proxy. For the
    /// real-node tier.
    pub routable: bool,
    /// Extra kube-apiserver flags, appended after the harness's own (a later flag wins), e.g.
    /// `--feature-gates=ConstrainedImpersonation=true` for a test of an alpha feature. Kept
    /// for a restart by [`ControlPlane::start_apiserver`].
    pub apiserver_flags: Vec<String>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            dir: None,
            detached: false,
            binaries: None,
            startup_timeout: Duration::from_secs(180),
            routable: false,
            apiserver_flags: Vec::new(),
        }
    }
}

/// Loopback ports the components listen on, chosen free at startup.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Ports {
    /// etcd client port (plain HTTP on 127.0.0.1).
    pub etcd_client: u16,
    /// etcd peer port.
    pub etcd_peer: u16,
    /// kube-apiserver secure port.
    pub apiserver: u16,
    /// kube-controller-manager secure port (/healthz).
    pub controller_manager: u16,
    /// kube-scheduler secure port (/healthz).
    pub scheduler: u16,
}

/// What `up` leaves behind for `down` (and for humans).
#[derive(Debug, Serialize, Deserialize)]
struct State {
    procs: Vec<Proc>,
    ports: Ports,
    kubeconfig: PathBuf,
}

/// A running control plane. Dropping it stops every process it started and, for a temporary
/// directory, removes the directory (unless it was detached for `up`).
pub struct ControlPlane {
    dir: PathBuf,
    remove_dir: AtomicBool,
    version: String,
    binaries: Binaries,
    ports: Ports,
    pki: Pki,
    admin_kubeconfig_path: PathBuf,
    admin_kubeconfig: Kubeconfig,
    procs: Mutex<Vec<Proc>>,
    nodes: Arc<Mutex<BTreeSet<String>>>,
    background: Background,
    started_in: Duration,
    apiserver_args: Vec<String>,
    mode: Mode,
    /// The apiserver's address: loopback, or the dummy link's with [`Options::routable`].
    address: Ipv4Addr,
    /// The dummy link carrying `address`, deleted on stop.
    link: Option<String>,
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlPlane")
            .field("dir", &self.dir)
            .field("version", &self.version)
            .field("ports", &self.ports)
            .finish_non_exhaustive()
    }
}

impl ControlPlane {
    /// Starts etcd, kube-apiserver, kube-controller-manager and kube-scheduler and returns once
    /// every one is healthy and the controller manager has created the `default` namespace's
    /// ServiceAccount (proof that its controllers run with their own credentials).
    pub async fn start(options: Options) -> Result<Self, Error> {
        paths::require_root()?;
        let binaries = match options.binaries {
            Some(b) => b,
            None => Binaries::locate()?,
        };
        let version = paths::kubernetes_version()?.to_owned();
        let begun = Instant::now();

        // A temporary dir stays a TempDir (removed on drop) until the control plane is up.
        let (dir, temp) = run_dir(options.dir.as_ref())?;

        // The routable address first: the serving certificate names it.
        let (address, link) = apiserver_address(options.routable, &dir)?;
        let background = Background::start()?;
        let mode = if options.detached {
            Mode::Detached
        } else {
            Mode::Attached
        };
        let boot = Boot {
            dir: dir.clone(),
            binaries: binaries.clone(),
            mode,
            timeout: options.startup_timeout,
            address,
            apiserver_flags: options.apiserver_flags.clone(),
        };
        // Boot on the background thread, so that thread is the children's parent (PDEATHSIG).
        let booted = background
            .handle
            .spawn(boot.run())
            .await
            .map_err(|_| Error::StartPanicked)?;
        let booted = match booted {
            Ok(b) => b,
            Err(e) => {
                drop(link);
                if temp.is_none() {
                    remove_layout(&dir);
                }
                return Err(e);
            }
        };

        let remove_dir = match temp {
            Some(temp) => {
                let _ = temp.keep();
                true
            }
            None => false,
        };
        let cp = ControlPlane {
            dir,
            remove_dir: AtomicBool::new(remove_dir),
            version,
            binaries,
            ports: booted.ports,
            pki: booted.pki,
            admin_kubeconfig_path: booted.admin_kubeconfig_path,
            admin_kubeconfig: booted.admin_kubeconfig,
            procs: Mutex::new(booted.procs),
            apiserver_args: booted.apiserver_args,
            mode,
            nodes: Arc::new(Mutex::new(BTreeSet::new())),
            background,
            started_in: begun.elapsed(),
            address,
            link: link.hand_over(),
        };
        cp.settle(options.detached)
    }

    /// Leaves a detached control plane's state for `down`, or keeps an attached one's node
    /// leases renewed; then logs it healthy.
    fn settle(self, detached: bool) -> Result<Self, Error> {
        if detached {
            self.write_state()?;
        } else {
            self.background.handle.spawn(kubelet::lease_loop(
                self.admin_kubeconfig.clone(),
                self.nodes.clone(),
            ));
        }
        self.log_healthy();
        Ok(self)
    }

    fn log_healthy(&self) {
        let pids: Vec<String> = self
            .procs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|p| format!("{}={}", p.name, p.pid))
            .collect();
        tracing::info!(
            dir = %self.dir.display(),
            pids = %pids.join(","),
            elapsed_ms = self.started_in.as_millis() as u64,
            "control plane healthy"
        );
    }

    /// The control plane shared by every test in this process: started by the first caller,
    /// stopped (processes killed, directory removed) when the process exits.
    ///
    /// If the first start failed, every caller gets that error.
    pub async fn shared() -> Result<&'static ControlPlane, Error> {
        type Slot = Option<Result<&'static ControlPlane, Arc<Error>>>;
        static SHARED: OnceLock<tokio::sync::watch::Receiver<Slot>> = OnceLock::new();
        let mut rx = SHARED
            .get_or_init(|| {
                let (tx, rx) = tokio::sync::watch::channel(None);
                // A thread of its own, so the start does not depend on the first test's runtime
                // surviving (each #[tokio::test] drops its runtime when it ends).
                let spawned = std::thread::Builder::new()
                    .name("meshgate-e2e-start".into())
                    .spawn(move || {
                        let result = tokio::runtime::Builder::new_current_thread()
                            .enable_all()
                            .build()
                            .map_err(|e| Error::io("building a tokio runtime", e))
                            .and_then(|rt| rt.block_on(ControlPlane::start(Options::default())));
                        let slot = match result {
                            Ok(cp) => {
                                let cp: &'static ControlPlane = Box::leak(Box::new(cp));
                                register_atexit(cp);
                                Ok(cp)
                            }
                            Err(e) => Err(Arc::new(e)),
                        };
                        let _ = tx.send(Some(slot));
                    });
                if let Err(e) = spawned {
                    tracing::error!(error = %e, "cannot spawn the control-plane start thread");
                }
                rx
            })
            .clone();
        let slot = rx
            .wait_for(Option::is_some)
            .await
            .map_err(|_| Error::StartPanicked)?;
        match slot.as_ref() {
            Some(Ok(cp)) => Ok(*cp),
            Some(Err(e)) => Err(Error::Shared(e.clone())),
            None => Err(Error::StartPanicked),
        }
    }

    /// A new admin client (`system:masters`), bound to the caller's tokio runtime.
    ///
    /// kube's default retry of 429/503/504 is off, so eviction refusals by a
    /// PodDisruptionBudget (429) reach the caller instead of being retried for minutes.
    pub fn client(&self) -> Result<Client, Error> {
        client_from(self.admin_kubeconfig.clone(), "admin")
    }

    /// The admin kubeconfig (client certificate for `admin`, group `system:masters`).
    pub fn admin_kubeconfig(&self) -> &Kubeconfig {
        &self.admin_kubeconfig
    }

    /// Path of the admin kubeconfig file.
    pub fn admin_kubeconfig_path(&self) -> &Path {
        &self.admin_kubeconfig_path
    }

    /// `https://127.0.0.1:PORT`, or the routable address with [`Options::routable`].
    pub fn apiserver_url(&self) -> String {
        format!("https://{}:{}", self.address, self.ports.apiserver)
    }

    /// The address kube-apiserver binds and advertises (see [`Options::routable`]).
    pub fn address(&self) -> Ipv4Addr {
        self.address
    }

    /// The CA certificate (PEM) that signed the apiserver's serving certificate; webhooks
    /// and token kubeconfigs use it.
    pub fn ca_pem(&self) -> &str {
        &self.pki.ca_pem
    }

    /// The control plane's keys and certificates (the real node issues its kubelet's
    /// identity from the CA).
    pub fn pki(&self) -> &Pki {
        &self.pki
    }

    /// Path of the CA certificate.
    pub fn ca_path(&self) -> &Path {
        &self.pki.ca_cert
    }

    /// The pinned Kubernetes version the binaries were built as (e.g. `v1.35.4`).
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The binaries in use (kubectl is the one built with the control plane).
    pub fn binaries(&self) -> &Binaries {
        &self.binaries
    }

    /// The control plane's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// kube-apiserver's audit log (JSON lines; see [`crate::harness::audit`]): the metadata of every
    /// request by a ServiceAccount outside kube-system, so a component run under its own
    /// token can be counted and timed.
    pub fn audit_log(&self) -> PathBuf {
        self.dir.join("logs").join(AUDIT_LOG)
    }

    /// The ports the components listen on.
    pub fn ports(&self) -> Ports {
        self.ports
    }

    /// How long [`ControlPlane::start`] took, from binary lookup to healthy.
    pub fn started_in(&self) -> Duration {
        self.started_in
    }

    /// Runs the built kubectl against this control plane as admin (60 s bound) and returns
    /// its stdout, or an error carrying its stderr.
    pub async fn kubectl(&self, args: &[&str]) -> Result<String, Error> {
        let mut cmd = tokio::process::Command::new(&self.binaries.kubectl);
        cmd.arg("--kubeconfig")
            .arg(&self.admin_kubeconfig_path)
            .args(args);
        let what = format!("kubectl {}", args.join(" "));
        let out = wait::command_output(&what, Duration::from_secs(60), &mut cmd).await?;
        if !out.status.success() {
            return Err(Error::Kubectl {
                args: args.join(" "),
                status: out.status.to_string(),
                stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Creates a namespace named `<prefix>-<unique suffix>` and waits until the controller
    /// manager has given it its `default` ServiceAccount (pods cannot be created before).
    pub async fn create_namespace(&self, client: &Client, prefix: &str) -> Result<String, Error> {
        let name = unique_name(prefix);
        let ns = Namespace {
            metadata: kube::api::ObjectMeta {
                name: Some(name.clone()),
                labels: Some([("e2e.meshgate.io/test".to_owned(), "true".to_owned())].into()),
                ..Default::default()
            },
            ..Default::default()
        };
        let api: Api<Namespace> = Api::all(client.clone());
        wait::api(
            &format!("creating namespace {name}"),
            api.create(&PostParams::default(), &ns),
        )
        .await?;
        let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), &name);
        wait::poll_until(
            &format!("ServiceAccount {name}/default"),
            API_TIMEOUT,
            || async { sas.get_opt("default").await.map(|sa| sa.map(|_| ())) },
        )
        .await?;
        Ok(name)
    }

    /// Registers a Node the way a kubelet does (see [`kubelet`]), renews its Lease from the
    /// background thread for as long as the control plane runs, and waits until the node
    /// lifecycle controller has lifted the `node.kubernetes.io/not-ready` taint that admission
    /// puts on every new Node.
    pub async fn register_node(
        &self,
        client: &Client,
        spec: &NodeSpec,
    ) -> Result<k8s_openapi::api::core::v1::Node, Error> {
        let node = kubelet::create_node(client, spec, &self.version).await?;
        self.nodes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(spec.name.clone());
        kubelet::wait_schedulable(client, &spec.name).await?;
        Ok(node)
    }

    /// Starts the kubelet stand-in's pod loop for `node` on the background thread: every pod
    /// bound to it is moved to Running (and Ready) with the IP `pod_ip` returns (`None`: leave
    /// the pod alone for now), and pods being deleted are finalized as a kubelet would once
    /// their containers stopped. Stops when the returned [`PodRunner`] is dropped.
    pub fn run_pods<F>(&self, node: &str, pod_ip: F) -> PodRunner
    where
        F: Fn(&k8s_openapi::api::core::v1::Pod) -> Option<std::net::IpAddr> + Send + Sync + 'static,
    {
        let task = self.background.handle.spawn(kubelet::pod_loop(
            self.admin_kubeconfig.clone(),
            node.to_owned(),
            Arc::new(pod_ip),
        ));
        PodRunner::new(task.abort_handle())
    }

    /// A client authenticating with `token` (for example a ServiceAccount token from
    /// [`crate::harness::identity::service_account_token`]); 429 retries are off as in [`Self::client`].
    pub fn client_for_token(&self, token: &str) -> Result<Client, Error> {
        let kc = Kubeconfig::from_yaml(&token_kubeconfig_yaml(
            &self.apiserver_url(),
            &self.pki.ca_cert,
            token,
        ))
        .map_err(|source| Error::Kubeconfig {
            what: "for a token".into(),
            source,
        })?;
        client_from(kc, "token")
    }

    /// Writes a kubeconfig for `token` into the control plane's `tokens/` directory (so it is
    /// removed with the control plane) and returns its path, for processes under test.
    pub fn write_token_kubeconfig(&self, name: &str, token: &str) -> Result<PathBuf, Error> {
        let dir = self.dir.join("tokens");
        std::fs::create_dir_all(&dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
        let path = dir.join(format!("{name}.kubeconfig"));
        write_private(
            &path,
            &token_kubeconfig_yaml(&self.apiserver_url(), &self.pki.ca_cert, token),
        )?;
        Ok(path)
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A name no other test in this run (or a recent run) uses: `<prefix>-<n>-<random hex>`.
/// Kubernetes names must be DNS labels, so `prefix` should be short, lowercase and dashed.
pub fn unique_name(prefix: &str) -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let salt = (nanos ^ std::process::id().rotate_left(16)) & 0xf_ffff;
    format!("{prefix}-{n}-{salt:05x}")
}

static ATEXIT_TARGET: OnceLock<&'static ControlPlane> = OnceLock::new();

extern "C" fn stop_shared_at_exit() {
    if let Some(cp) = ATEXIT_TARGET.get() {
        cp.stop();
    }
}

fn register_atexit(cp: &'static ControlPlane) {
    if ATEXIT_TARGET.set(cp).is_ok() {
        // SAFETY: registers a plain extern "C" fn with no arguments; it runs once, during
        // exit(), after the test harness's main returns or calls process::exit.
        let rc = unsafe { libc::atexit(stop_shared_at_exit) };
        if rc != 0 {
            tracing::error!(
                "atexit registration failed: the shared control plane relies on PDEATHSIG alone"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_names_are_distinct_dns_labels() {
        let a = unique_name("taints");
        let b = unique_name("taints");
        assert_ne!(a, b);
        for n in [&a, &b] {
            assert!(
                n.len() <= 63
                    && n.chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
                "{n}"
            );
        }
    }
}
