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

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use kube::api::{Api, PostParams};
use kube::config::Kubeconfig;
use kube::{Client, Config};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::Error;
use crate::harness::hostnet;
use crate::harness::paths::{self, Binaries};
use crate::harness::pki::{self, Pki};
use crate::harness::process::{self, Mode, Proc};
use crate::harness::wait::{self, API_TIMEOUT};
use crate::sim::kubelet::{self, NodeSpec, PodRunner};

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

/// Entries a control plane creates in its directory; `down` removes exactly these.
const LAYOUT: &[&str] = &[
    "pki",
    "etcd",
    "logs",
    "admin.kubeconfig",
    "controller-manager.kubeconfig",
    "scheduler.kubeconfig",
    "tokens",
    STATE_FILE,
];

/// kube-apiserver's audit log, in the control plane's `logs/` directory.
pub const AUDIT_LOG: &str = "audit.log";

/// Audit policy: metadata of every request made by an identity under test. The harness's
/// admin (`system:masters`), the control-plane components, kube-system's controllers and
/// health probes are left out, so the log stays small and holds only what tests count.
const AUDIT_POLICY: &str = r#"apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
- level: None
  userGroups: ["system:masters", "system:nodes", "system:serviceaccounts:kube-system"]
- level: None
  users: ["system:kube-controller-manager", "system:kube-scheduler", "system:apiserver", "system:anonymous"]
- level: None
  nonResourceURLs: ["/healthz*", "/readyz*", "/livez*", "/version", "/openapi*", "/api", "/apis"]
- level: Metadata
"#;

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
        let (dir, temp) = match &options.dir {
            Some(dir) => {
                prepare_dir(dir)?;
                (dir.clone(), None)
            }
            None => {
                let base = tmp_base();
                sweep_stale(&base);
                let temp = tempfile::Builder::new()
                    .prefix(TMP_PREFIX)
                    .tempdir_in(&base)
                    .map_err(|e| {
                        Error::io(
                            format!("creating a temporary directory in {}", base.display()),
                            e,
                        )
                    })?;
                write_owner(temp.path())?;
                (temp.path().to_owned(), Some(temp))
            }
        };

        // The routable address first: the serving certificate names it.
        // Until the ControlPlane owns it, the link is deleted by the guard on any early
        // return or panic: a temporary dir goes with it, and with the dir the owner file the
        // next run's sweep would have found the link by.
        let (address, link) = if options.routable {
            let name = link_name(&dir);
            let link = LinkGuard(Some(name.clone()));
            (add_dummy(&dir, &name)?, link)
        } else {
            (Ipv4Addr::LOCALHOST, LinkGuard(None))
        };
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
        if options.detached {
            cp.write_state()?;
        } else {
            cp.background.handle.spawn(kubelet::lease_loop(
                cp.admin_kubeconfig.clone(),
                cp.nodes.clone(),
            ));
        }
        let pids: Vec<String> = cp
            .procs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|p| format!("{}={}", p.name, p.pid))
            .collect();
        tracing::info!(
            dir = %cp.dir.display(),
            pids = %pids.join(","),
            elapsed_ms = cp.started_in.as_millis() as u64,
            "control plane healthy"
        );
        Ok(cp)
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

    /// Stops every process (SIGTERM, then SIGKILL), reaps them, and removes a temporary
    /// directory. Idempotent; blocks for up to a few seconds per component.
    pub fn stop(&self) {
        let procs = std::mem::take(&mut *self.procs.lock().unwrap_or_else(|p| p.into_inner()));
        if !procs.is_empty() {
            tracing::debug!(dir = %self.dir.display(), "stopping the control plane");
        }
        process::stop_all(&procs, STOP_GRACE);
        self.background.shutdown();
        if let Some(link) = &self.link {
            hostnet::delete_link(link);
        }
        if self.remove_dir.swap(false, Ordering::SeqCst) {
            keep_logs(&self.dir);
            if let Err(e) = std::fs::remove_dir_all(&self.dir) {
                tracing::warn!(dir = %self.dir.display(), error = %e, "cannot remove the control plane directory");
            }
        }
    }

    /// Freezes (`true`) or thaws (`false`) kube-apiserver with SIGSTOP / SIGCONT, to play an
    /// API server that stops answering: connections hang instead of being refused, which is
    /// the harder case for a client. Signals the recorded pid only, after checking it is
    /// still the process the harness started.
    pub fn freeze_apiserver(&self, frozen: bool) -> Result<(), Error> {
        self.freeze_component("kube-apiserver", frozen)
    }

    /// Freezes (`true`) or thaws (`false`) one component (`etcd`, `kube-apiserver`,
    /// `kube-controller-manager`, `kube-scheduler`) with SIGSTOP / SIGCONT. The benchmarks
    /// freeze the controller manager while they measure something it has no part in, so its
    /// work on thousands of kubelet-less Nodes does not share the CPUs with the measurement.
    pub fn freeze_component(&self, component: &str, frozen: bool) -> Result<(), Error> {
        let procs = self.procs.lock().unwrap_or_else(|p| p.into_inner());
        let proc_ = procs
            .iter()
            .find(|p| p.name == component && p.alive())
            .ok_or_else(|| {
                Error::io(
                    format!("signalling {component}"),
                    std::io::Error::other("not running"),
                )
            })?;
        let signal = if frozen {
            nix::sys::signal::Signal::SIGSTOP
        } else {
            nix::sys::signal::Signal::SIGCONT
        };
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(proc_.pid), signal)
            .map_err(|e| Error::io(format!("signalling {component}"), std::io::Error::from(e)))
    }

    /// Stops kube-apiserver (SIGTERM, then SIGKILL), leaving etcd and the other components
    /// running: clients then get "connection refused", as during an apiserver restart.
    pub fn stop_apiserver(&self) {
        let stopped: Vec<Proc> = {
            let mut procs = self.procs.lock().unwrap_or_else(|p| p.into_inner());
            let (apiserver, rest): (Vec<Proc>, Vec<Proc>) = std::mem::take(&mut *procs)
                .into_iter()
                .partition(|p| p.name == "kube-apiserver");
            *procs = rest;
            apiserver
        };
        process::stop_all(&stopped, STOP_GRACE);
    }

    /// Starts kube-apiserver again with the same flags and port, and returns once `/readyz`
    /// answers. The process is spawned from the background thread, like the first one.
    pub async fn start_apiserver(&self) -> Result<(), Error> {
        let (bin, args, mode) = (
            self.binaries.kube_apiserver.clone(),
            self.apiserver_args.clone(),
            self.mode,
        );
        let log = self.dir.join("logs").join("kube-apiserver.log");
        let proc_ = self
            .background
            .handle
            .spawn(async move { process::spawn("kube-apiserver", &bin, &args, &log, mode) })
            .await
            .map_err(|_| Error::StartPanicked)??;
        self.procs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(proc_.clone());
        let admin = client_from(self.admin_kubeconfig.clone(), "admin")?;
        wait_healthy(&proc_, Instant::now() + Duration::from_secs(60), || {
            get_text(&admin, "/readyz")
        })
        .await
    }

    /// Leaves the processes running (for `up`): this handle forgets them, and its drop will
    /// neither stop them nor remove the directory.
    pub fn detach(self) {
        self.procs.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.remove_dir.store(false, Ordering::SeqCst);
    }

    /// Stops the control plane that `up` started in `dir` (pids from its state file) and
    /// removes everything `up` created there.
    pub fn down(dir: &Path) -> Result<(), Error> {
        let state_path = dir.join(STATE_FILE);
        let text = match std::fs::read_to_string(&state_path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Error::NotStateDir {
                    dir: dir.to_owned(),
                });
            }
            Err(e) => return Err(Error::io(format!("reading {}", state_path.display()), e)),
        };
        let state: State = serde_json::from_str(&text).map_err(|source| Error::State {
            path: state_path,
            source,
        })?;
        process::stop_all(&state.procs, STOP_GRACE);
        remove_layout(dir);
        // Removes the directory only if `up` left nothing else there (it may be the user's).
        let _ = std::fs::remove_dir(dir);
        Ok(())
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

    fn write_state(&self) -> Result<(), Error> {
        let state = State {
            procs: self.procs.lock().unwrap_or_else(|p| p.into_inner()).clone(),
            ports: self.ports,
            kubeconfig: self.admin_kubeconfig_path.clone(),
        };
        let path = self.dir.join(STATE_FILE);
        let text = serde_json::to_string_pretty(&state).map_err(|source| Error::State {
            path: path.clone(),
            source,
        })?;
        write_private(&path, &text)
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

/// A thread running a current-thread tokio runtime: the parent of the control-plane processes
/// and the home of long-lived kubelet stand-in tasks.
struct Background {
    handle: tokio::runtime::Handle,
    stop: Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Background {
    fn start() -> Result<Self, Error> {
        let (handle_tx, handle_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("meshgate-e2e-bg".into())
            .spawn(move || {
                match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => {
                        let _ = handle_tx.send(Ok(rt.handle().clone()));
                        // Drives every spawned task on this very thread until told to stop.
                        rt.block_on(async {
                            let _ = stop_rx.await;
                        });
                    }
                    Err(e) => {
                        let _ = handle_tx.send(Err(e));
                    }
                }
            })
            .map_err(|e| Error::io("spawning the control plane's background thread", e))?;
        let handle = handle_rx
            .recv()
            .map_err(|_| Error::StartPanicked)?
            .map_err(|e| Error::io("building the background tokio runtime", e))?;
        Ok(Self {
            handle,
            stop: Mutex::new(Some(stop_tx)),
            thread: Mutex::new(Some(thread)),
        })
    }

    fn shutdown(&self) {
        if let Some(stop) = self.stop.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = stop.send(());
        }
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = thread
            && t.thread().id() != std::thread::current().id()
        {
            let _ = t.join();
        }
    }
}

/// What the boot sequence produced.
struct Booted {
    procs: Vec<Proc>,
    /// kube-apiserver's command line, to start it again after [`ControlPlane::stop_apiserver`].
    apiserver_args: Vec<String>,
    ports: Ports,
    pki: Pki,
    admin_kubeconfig_path: PathBuf,
    admin_kubeconfig: Kubeconfig,
}

/// The boot sequence; runs on the background thread.
struct Boot {
    dir: PathBuf,
    binaries: Binaries,
    mode: Mode,
    timeout: Duration,
    address: Ipv4Addr,
    /// [`Options::apiserver_flags`].
    apiserver_flags: Vec<String>,
}

/// Processes started so far; stopped on drop unless the boot succeeded.
struct Started(Vec<Proc>);

impl Drop for Started {
    fn drop(&mut self) {
        process::stop_all(&self.0, STOP_GRACE);
    }
}

impl Boot {
    async fn run(self) -> Result<Booted, Error> {
        let deadline = Instant::now() + self.timeout;
        let logs = self.dir.join("logs");
        std::fs::create_dir_all(&logs)
            .map_err(|e| Error::io(format!("creating {}", logs.display()), e))?;
        let routable = !self.address.is_loopback();
        let extra_ips: Vec<IpAddr> = if routable {
            vec![IpAddr::V4(self.address)]
        } else {
            Vec::new()
        };
        let pki = Pki::generate(&self.dir.join("pki"), &extra_ips)?;
        let ports = free_ports()?;
        let server = format!("https://{}:{}", self.address, ports.apiserver);

        let admin_kubeconfig_path = self.dir.join("admin.kubeconfig");
        let kcm_kubeconfig = self.dir.join("controller-manager.kubeconfig");
        let sched_kubeconfig = self.dir.join("scheduler.kubeconfig");
        write_private(
            &admin_kubeconfig_path,
            &cert_kubeconfig_yaml(&server, &pki.ca_cert, &pki.admin),
        )?;
        write_private(
            &kcm_kubeconfig,
            &cert_kubeconfig_yaml(&server, &pki.ca_cert, &pki.controller_manager),
        )?;
        write_private(
            &sched_kubeconfig,
            &cert_kubeconfig_yaml(&server, &pki.ca_cert, &pki.scheduler),
        )?;
        let admin_kubeconfig =
            Kubeconfig::read_from(&admin_kubeconfig_path).map_err(|source| Error::Kubeconfig {
                what: admin_kubeconfig_path.display().to_string(),
                source,
            })?;

        let mut started = Started(Vec::new());
        let s = |p: &Path| p.display().to_string();

        // etcd: loopback only; its data lives in the control plane's directory.
        let etcd_url = format!("http://127.0.0.1:{}", ports.etcd_client);
        let peer_url = format!("http://127.0.0.1:{}", ports.etcd_peer);
        let etcd = self.spawn(
            "etcd",
            &self.binaries.etcd,
            vec![
                "--name=meshgate-e2e".into(),
                format!("--data-dir={}", s(&self.dir.join("etcd"))),
                format!("--listen-client-urls={etcd_url}"),
                format!("--advertise-client-urls={etcd_url}"),
                format!("--listen-peer-urls={peer_url}"),
                format!("--initial-advertise-peer-urls={peer_url}"),
                format!("--initial-cluster=meshgate-e2e={peer_url}"),
                "--initial-cluster-state=new".into(),
                "--logger=zap".into(),
                "--log-outputs=stderr".into(),
            ],
        )?;
        started.0.push(etcd.clone());
        wait_healthy(&etcd, deadline, || etcd_health(ports.etcd_client)).await?;

        let audit_policy = logs.join("audit-policy.yaml");
        write_private(&audit_policy, AUDIT_POLICY)?;
        let mut apiserver_args: Vec<String> = vec![
            format!("--etcd-servers={etcd_url}"),
            format!("--bind-address={}", self.address),
            format!("--advertise-address={}", self.address),
            format!("--secure-port={}", ports.apiserver),
            format!("--tls-cert-file={}", s(&pki.apiserver.cert)),
            format!("--tls-private-key-file={}", s(&pki.apiserver.key)),
            format!("--client-ca-file={}", s(&pki.ca_cert)),
            format!("--requestheader-client-ca-file={}", s(&pki.front_proxy_ca)),
            format!("--requestheader-allowed-names={}", pki::FRONT_PROXY_CLIENT),
            "--requestheader-username-headers=X-Remote-User".into(),
            "--requestheader-group-headers=X-Remote-Group".into(),
            "--requestheader-extra-headers-prefix=X-Remote-Extra-".into(),
            format!(
                "--proxy-client-cert-file={}",
                s(&pki.front_proxy_client.cert)
            ),
            format!("--proxy-client-key-file={}", s(&pki.front_proxy_client.key)),
            "--authorization-mode=Node,RBAC".into(),
            "--enable-admission-plugins=NodeRestriction".into(),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
            format!("--service-account-key-file={}", s(&pki.service_account_pub)),
            format!(
                "--service-account-signing-key-file={}",
                s(&pki.service_account_key)
            ),
            format!("--service-cluster-ip-range={}", pki::SERVICE_CIDR),
            "--allow-privileged=true".into(),
            format!("--cert-dir={}", s(&self.dir.join("pki"))),
            "--profiling=false".into(),
            // Requests by identities under test (ServiceAccounts outside kube-system),
            // for the fault suite and the benchmarks: see [`ControlPlane::audit_log`].
            format!("--audit-policy-file={}", s(&audit_policy)),
            format!("--audit-log-path={}", s(&logs.join(AUDIT_LOG))),
            "--audit-log-format=json".into(),
        ];
        if routable {
            apiserver_args.extend([
                // kube-proxy on the real nodes sends the `kubernetes` Service to the
                // endpoints the apiserver reconciles: its own routable address.
                "--endpoint-reconciler-type=lease".into(),
                // No kube-proxy in the apiserver's namespace: dial a webhook Service's
                // endpoints (the webhook pods' IPs, routed to their node), not its ClusterIP.
                "--enable-aggregator-routing=true".into(),
            ]);
        } else {
            // No kube-proxy and a loopback advertise address: the `kubernetes` Service's
            // endpoints would be invalid (loopback), so do not reconcile them.
            apiserver_args.push("--endpoint-reconciler-type=none".into());
        }
        apiserver_args.extend(self.apiserver_flags.iter().cloned());
        let apiserver = self.spawn(
            "kube-apiserver",
            &self.binaries.kube_apiserver,
            apiserver_args.clone(),
        )?;
        started.0.push(apiserver.clone());
        let admin = client_from(admin_kubeconfig.clone(), "admin")?;
        wait_healthy(&apiserver, deadline, || get_text(&admin, "/readyz")).await?;

        let common = |port: u16, kubeconfig: &Path, serving: &pki::CertFiles| {
            vec![
                format!("--kubeconfig={}", s(kubeconfig)),
                format!("--authentication-kubeconfig={}", s(kubeconfig)),
                format!("--authorization-kubeconfig={}", s(kubeconfig)),
                "--bind-address=127.0.0.1".into(),
                format!("--secure-port={port}"),
                format!("--tls-cert-file={}", s(&serving.cert)),
                format!("--tls-private-key-file={}", s(&serving.key)),
                "--leader-elect=false".into(),
                "--profiling=false".into(),
            ]
        };
        let mut kcm_args = common(
            ports.controller_manager,
            &kcm_kubeconfig,
            &pki.controller_manager_serving,
        );
        kcm_args.extend([
            format!(
                "--service-account-private-key-file={}",
                s(&pki.service_account_key)
            ),
            format!("--root-ca-file={}", s(&pki.ca_cert)),
            "--use-service-account-credentials=true".into(),
            // Client-side rate limits sized for one busy test binary rather than a shared
            // production apiserver: controllers start (and react) without queueing behind the
            // default 20 QPS.
            "--kube-api-qps=200".into(),
            "--kube-api-burst=400".into(),
            // Every default controller: deployment, replicaset, disruption, garbage collector,
            // serviceaccount(-token), namespace, nodelifecycle (kept on: the kubelet stand-in
            // renews Leases, and the controller lifts the not-ready taint admission adds to new
            // Nodes, as in a real cluster), taint-eviction, podgc, root-ca-cert-publisher, ...
            "--controllers=*".into(),
        ]);
        let kcm = self.spawn(
            "kube-controller-manager",
            &self.binaries.kube_controller_manager,
            kcm_args,
        )?;
        started.0.push(kcm.clone());
        let scheduler = self.spawn(
            "kube-scheduler",
            &self.binaries.kube_scheduler,
            common(ports.scheduler, &sched_kubeconfig, &pki.scheduler_serving),
        )?;
        started.0.push(scheduler.clone());

        let kcm_health = health_client(ports.controller_manager, &pki)?;
        let sched_health = health_client(ports.scheduler, &pki)?;
        wait_healthy(&kcm, deadline, || get_text(&kcm_health, "/healthz")).await?;
        wait_healthy(&scheduler, deadline, || get_text(&sched_health, "/healthz")).await?;

        // The controllers are healthy only in a shallow sense until they act: wait for the
        // serviceaccount controller to create `default/default`.
        let sas: Api<ServiceAccount> = Api::namespaced(admin.clone(), "default");
        let remaining = deadline.saturating_duration_since(Instant::now());
        wait::poll_until(
            "the controller manager to create ServiceAccount default/default",
            remaining,
            || async { sas.get_opt("default").await.map(|sa| sa.map(|_| ())) },
        )
        .await?;

        let procs = std::mem::take(&mut started.0);
        Ok(Booted {
            procs,
            apiserver_args,
            ports,
            pki,
            admin_kubeconfig_path,
            admin_kubeconfig,
        })
    }

    fn spawn(&self, name: &str, bin: &Path, args: Vec<String>) -> Result<Proc, Error> {
        let log = self.dir.join("logs").join(format!("{name}.log"));
        process::spawn(name, bin, &args, &log, self.mode)
    }
}

/// Polls `check` until it answers `ok`, failing fast if the process exits.
async fn wait_healthy<F, Fut>(proc_: &Proc, deadline: Instant, check: F) -> Result<(), Error>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<String, String>>,
{
    let begun = Instant::now();
    let mut last: String;
    loop {
        if let Some(status) = proc_.exit_status() {
            return Err(Error::Exited {
                component: proc_.name.clone(),
                status,
                log: proc_.log.clone(),
                tail: proc_.log_tail(30),
            });
        }
        match tokio::time::timeout(Duration::from_secs(5), check()).await {
            Ok(Ok(body)) if body.trim() == "ok" || body.contains("\"health\":\"true\"") => {
                tracing::debug!(component = %proc_.name, elapsed_ms = begun.elapsed().as_millis() as u64, "healthy");
                return Ok(());
            }
            Ok(Ok(body)) => last = body.chars().take(400).collect(),
            Ok(Err(e)) => last = e,
            Err(_) => last = "health check timed out".into(),
        }
        if Instant::now() >= deadline {
            return Err(Error::Unhealthy {
                component: proc_.name.clone(),
                timeout: begun.elapsed(),
                last,
                log: proc_.log.clone(),
            });
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn get_text(client: &Client, path: &str) -> Result<String, String> {
    let req = http::Request::get(path)
        .body(Vec::new())
        .map_err(|e| e.to_string())?;
    client.request_text(req).await.map_err(|e| e.to_string())
}

/// etcd's `/health` over plain HTTP/1.0; a hand-written request keeps an HTTP client crate out.
async fn etcd_health(port: u16) -> Result<String, String> {
    let mut stream = tokio::net::TcpStream::connect((Ipv4Addr::LOCALHOST, port))
        .await
        .map_err(|e| e.to_string())?;
    stream
        .write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .await
        .map_err(|e| e.to_string())?;
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .await
        .map_err(|e| e.to_string())?;
    Ok(response
        .split("\r\n\r\n")
        .nth(1)
        .unwrap_or_default()
        .to_owned())
}

/// An anonymous client for a component's secure port, trusting the harness CA (the component
/// serves a certificate it signed); `/healthz` is in every component's always-allowed paths.
fn health_client(port: u16, pki: &Pki) -> Result<Client, Error> {
    let url = format!("https://127.0.0.1:{port}")
        .parse()
        .map_err(|e: http::uri::InvalidUri| {
            Error::io(
                format!("health URL for port {port}"),
                std::io::Error::new(std::io::ErrorKind::InvalidInput, e),
            )
        })?;
    let mut config = Config::new(url);
    config.root_cert = Some(vec![pki.ca_der.clone()]);
    config.default_retry = false;
    Client::try_from(config).map_err(|e| Error::kube("building a health-check client", e))
}

pub(crate) fn client_from(kubeconfig: Kubeconfig, what: &str) -> Result<Client, Error> {
    let mut config = Config::try_from(kubeconfig).map_err(|source| Error::Kubeconfig {
        what: what.to_owned(),
        source,
    })?;
    config.default_retry = false;
    Client::try_from(config).map_err(|e| Error::kube(format!("building the {what} client"), e))
}

/// Picks five distinct free loopback ports, below the ephemeral range so a component
/// restarted on its port (`start_apiserver`) finds it free (see `node_sim::free_port`).
fn free_ports() -> Result<Ports, Error> {
    let ports = (0..5)
        .map(|_| crate::sim::node::free_port())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| Error::io("reserving loopback ports", e))?;
    Ok(Ports {
        etcd_client: ports[0],
        etcd_peer: ports[1],
        apiserver: ports[2],
        controller_manager: ports[3],
        scheduler: ports[4],
    })
}

/// JSON strings are valid YAML scalars, so paths and tokens are quoted with serde_json.
fn quote(s: &str) -> String {
    serde_json::Value::String(s.to_owned()).to_string()
}

fn kubeconfig_yaml(server: &str, ca: &Path, user: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: meshgate-e2e\n  cluster:\n    server: {}\n    certificate-authority: {}\n\
         users:\n- name: user\n  user:\n{user}contexts:\n- name: meshgate-e2e\n  context:\n    cluster: meshgate-e2e\n    user: user\n\
         current-context: meshgate-e2e\n",
        quote(server),
        quote(&ca.display().to_string()),
    )
}

pub(crate) fn cert_kubeconfig_yaml(server: &str, ca: &Path, cert: &pki::CertFiles) -> String {
    let user = format!(
        "    client-certificate: {}\n    client-key: {}\n",
        quote(&cert.cert.display().to_string()),
        quote(&cert.key.display().to_string())
    );
    kubeconfig_yaml(server, ca, &user)
}

fn token_kubeconfig_yaml(server: &str, ca: &Path, token: &str) -> String {
    kubeconfig_yaml(server, ca, &format!("    token: {}\n", quote(token)))
}

pub(crate) fn write_private(path: &Path, text: &str) -> Result<(), Error> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| Error::io(format!("creating {}", path.display()), e))?;
    f.write_all(text.as_bytes())
        .map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

/// The dummy link of a routable control plane in `dir` (IFNAMSIZ leaves 15 characters).
fn link_name(dir: &Path) -> String {
    format!("mgcp{:08x}", hostnet::seed(dir))
}

/// A routable control plane's link while it starts: deleted on drop unless handed over to
/// the [`ControlPlane`], which deletes it on stop.
struct LinkGuard(Option<String>);

impl LinkGuard {
    fn hand_over(mut self) -> Option<String> {
        self.0.take()
    }
}

impl Drop for LinkGuard {
    fn drop(&mut self) {
        if let Some(link) = self.0.take() {
            hostnet::delete_link(&link);
        }
    }
}

/// Creates the link `link` (a port-less bridge) with an unused /32 in 10.203.0.0/16 (no other
/// fixture uses that range: pods get 10.200.x, the netns fixtures 10.100-199.x, real nodes'
/// links 10.202.x).
fn add_dummy(dir: &Path, link: &str) -> Result<Ipv4Addr, Error> {
    const PART: &str = "the control plane's address";
    let address = hostnet::unused_net(hostnet::seed(dir), 32, |n| {
        Ipv4Addr::new(10, 203, (n >> 8) as u8, (n as u8).clamp(1, 254))
    })?;
    // A bridge without ports serves as the dummy: this machine kind's kernel has no `dummy`
    // link type ("Unknown device type"), and an address on an up bridge is local all the same.
    hostnet::ip(PART, &["link", "add", link, "type", "bridge"])?;
    hostnet::ip(
        PART,
        &["addr", "add", &format!("{address}/32"), "dev", link],
    )?;
    hostnet::ip(PART, &["link", "set", link, "up"])?;
    Ok(address)
}

/// Base of temporary control-plane directories: `$MESHGATE_E2E_TMPDIR`, else `/dev/shm` (a
/// tmpfs: etcd's fsyncs cost nothing there, and Debian's etcd 3.4 has no `--unsafe-no-fsync`),
/// else the system temp dir.
pub(crate) fn tmp_base() -> PathBuf {
    if let Some(dir) = std::env::var_os(TMPDIR_ENV).filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    let shm = Path::new("/dev/shm");
    if shm.is_dir() && nix::unistd::access(shm, nix::unistd::AccessFlags::W_OK).is_ok() {
        return shm.to_owned();
    }
    std::env::temp_dir()
}

/// Records this process (pid and start time) as the owner of a temporary directory.
pub(crate) fn write_owner(dir: &Path) -> Result<(), Error> {
    let pid = std::process::id() as i32;
    let start = process::start_time(pid).unwrap_or(0);
    write_private(&dir.join(OWNER_FILE), &format!("{pid} {start}\n"))
}

/// Removes temporary control-plane directories whose owner process is gone. A test binary
/// killed outright (SIGKILL, or SIGINT, which skips atexit) loses its components to
/// PDEATHSIG but cannot remove its directory; the next run does. Directories of live owners,
/// and anything without an owner file, are left alone.
fn sweep_stale(base: &Path) {
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let is_ours = entry
            .file_name()
            .to_str()
            .is_some_and(|n| n.starts_with(TMP_PREFIX));
        let Ok(owner) = std::fs::read_to_string(path.join(OWNER_FILE)) else {
            continue;
        };
        let mut fields = owner.split_whitespace().map(str::parse::<u64>);
        let (Some(Ok(pid)), Some(Ok(start))) = (fields.next(), fields.next()) else {
            continue;
        };
        let Ok(pid) = i32::try_from(pid) else {
            continue;
        };
        let owner = Proc {
            name: "owner".into(),
            pid,
            start_time: start,
            log: PathBuf::new(),
        };
        if is_ours && !owner.alive() {
            tracing::info!(dir = %path.display(), "removing the directory of a dead test run");
            hostnet::delete_link(&link_name(&path));
            if let Err(e) = std::fs::remove_dir_all(&path) {
                tracing::warn!(dir = %path.display(), error = %e, "cannot remove a stale directory");
            }
        }
    }
}

/// For `up`: refuses a directory that already holds a control plane, and clears leftovers of
/// a crashed `up` (only the entries the harness itself creates).
fn prepare_dir(dir: &Path) -> Result<(), Error> {
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    if dir.join(STATE_FILE).exists() {
        return Err(Error::AlreadyUp {
            dir: dir.to_owned(),
        });
    }
    remove_layout(dir);
    Ok(())
}

fn remove_layout(dir: &Path) {
    for entry in LAYOUT {
        let path = dir.join(entry);
        let result = if path.is_dir() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        match result {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(path = %path.display(), error = %e, "cannot remove"),
        }
    }
}

fn keep_logs(dir: &Path) {
    let Some(target) = std::env::var_os(KEEP_LOGS_ENV).filter(|d| !d.is_empty()) else {
        return;
    };
    let target = Path::new(&target).join(dir.file_name().unwrap_or_default());
    let Ok(entries) = std::fs::read_dir(dir.join("logs")) else {
        return;
    };
    if std::fs::create_dir_all(&target).is_err() {
        return;
    }
    for entry in entries.flatten() {
        let _ = std::fs::copy(entry.path(), target.join(entry.file_name()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A start that fails after the link was added deletes it (the guard), and a started
    /// control plane keeps it (handed over).
    #[test]
    fn a_failed_starts_link_is_deleted_and_a_handed_over_one_kept() {
        crate::harness::paths::require_root().expect("the link guard test needs root");
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let name = link_name(dir.path());
        let failed = || -> Result<(), Error> {
            let _link = LinkGuard(Some(name.clone()));
            add_dummy(dir.path(), &name)?;
            assert!(hostnet::link_exists(&name));
            Err(Error::StartPanicked)
        };
        assert!(failed().is_err());
        assert!(
            !hostnet::link_exists(&name),
            "{name} outlived a failed start"
        );

        let link = LinkGuard(Some(name.clone()));
        add_dummy(dir.path(), &name).unwrap();
        let kept = link.hand_over();
        assert!(
            hostnet::link_exists(&name),
            "{name} deleted though handed over"
        );
        hostnet::delete_link(kept.as_deref().unwrap());
        assert!(!hostnet::link_exists(&name));
    }

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

    #[test]
    fn kubeconfigs_parse_and_carry_their_credentials() {
        let certs = pki::CertFiles {
            cert: PathBuf::from("/d/pki/admin.crt"),
            key: PathBuf::from("/d/pki/a \"b\".key"),
        };
        let kc = Kubeconfig::from_yaml(&cert_kubeconfig_yaml(
            "https://127.0.0.1:6443",
            Path::new("/d/ca.crt"),
            &certs,
        ))
        .unwrap();
        let user = kc.auth_infos[0].auth_info.as_ref().unwrap();
        assert_eq!(user.client_key.as_deref(), Some("/d/pki/a \"b\".key"));
        assert_eq!(
            kc.clusters[0].cluster.as_ref().unwrap().server.as_deref(),
            Some("https://127.0.0.1:6443")
        );
        assert_eq!(kc.current_context.as_deref(), Some("meshgate-e2e"));

        let kc = Kubeconfig::from_yaml(&token_kubeconfig_yaml(
            "https://x:1",
            Path::new("/ca"),
            "ey.J:x",
        ))
        .unwrap();
        let user = kc.auth_infos[0].auth_info.as_ref().unwrap();
        assert!(user.token.is_some());
    }

    #[test]
    fn free_ports_are_distinct() {
        let p = free_ports().unwrap();
        let all = BTreeSet::from([
            p.etcd_client,
            p.etcd_peer,
            p.apiserver,
            p.controller_manager,
            p.scheduler,
        ]);
        assert_eq!(all.len(), 5);
    }

    #[test]
    fn down_refuses_a_directory_up_did_not_create() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("keep.txt"), "user data").unwrap();
        assert!(matches!(
            ControlPlane::down(dir.path()),
            Err(Error::NotStateDir { .. })
        ));
        assert!(dir.path().join("keep.txt").exists());
    }

    #[test]
    fn sweep_removes_only_directories_of_dead_owners() {
        let base = tempfile::tempdir().unwrap();
        let dead = base.path().join("meshgate-e2e-dead");
        let live = base.path().join("meshgate-e2e-live");
        let foreign = base.path().join("other-dead");
        let ownerless = base.path().join("meshgate-e2e-noowner");
        for d in [&dead, &live, &foreign, &ownerless] {
            std::fs::create_dir(d).unwrap();
        }
        // pid 1 with an impossible start time stands for a process that is gone.
        std::fs::write(dead.join(OWNER_FILE), "1 18446744073709551615\n").unwrap();
        std::fs::write(foreign.join(OWNER_FILE), "1 18446744073709551615\n").unwrap();
        write_owner(&live).unwrap();
        sweep_stale(base.path());
        assert!(!dead.exists());
        assert!(live.exists() && foreign.exists() && ownerless.exists());
    }

    /// A routable control plane killed outright leaves its link on the host: the next run's
    /// sweep removes it with the directory. Needs root, like the real-node sweep test.
    #[test]
    fn a_dead_routable_runs_link_is_swept() {
        crate::harness::paths::require_root().expect("the link sweep test needs root");
        let base = tempfile::tempdir_in("/dev/shm").unwrap();
        let dead = base.path().join("meshgate-e2e-deadlink");
        std::fs::create_dir(&dead).unwrap();
        std::fs::write(dead.join(OWNER_FILE), "1 18446744073709551615\n").unwrap();
        let link = link_name(&dead);
        let address = add_dummy(&dead, &link).unwrap();
        assert!(address.octets()[..2] == [10, 203], "{address}");
        assert!(hostnet::link_exists(&link));
        sweep_stale(base.path());
        assert!(!dead.exists());
        assert!(!hostnet::link_exists(&link), "{link} left behind");
    }

    #[test]
    fn remove_layout_leaves_foreign_files() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("etcd/member")).unwrap();
        std::fs::write(dir.path().join("admin.kubeconfig"), "x").unwrap();
        std::fs::write(dir.path().join("notes.txt"), "mine").unwrap();
        remove_layout(dir.path());
        assert!(!dir.path().join("etcd").exists());
        assert!(!dir.path().join("admin.kubeconfig").exists());
        assert!(dir.path().join("notes.txt").exists());
    }
}
