//! A real Kubernetes node beside the control plane: containerd (with runc and the reference CNI
//! plugins) and a kubelet built from the pinned Kubernetes module, registered against a
//! [`ControlPlane`]'s kube-apiserver under its own node identity.
//!
//! In: the binaries and images `e2e/install-deps.sh` put in the cache ([`NodeBinaries`]), a
//! running [`ControlPlane`], root. Out: a [`RealNode`] whose Node is `Ready`, the paths a test
//! needs (CNI conf and bin dirs, containerd's socket), the pid of a pod's container, the CNI
//! config containerd really loaded ([`RealNode::cri_cni_status`]), the config list a pod
//! sandbox really ran (libcni's result cache, [`RealNode::pod_attachments`] and
//! [`CachedAttachment`]), Istio's CNI installed and removed the way its installer does it
//! ([`RealNode::install_istio_cni`]), and a teardown that leaves nothing behind
//! ([`RealNode::stop`], also on drop, so a failing test cleans up as well).
//!
//! Like a kind node, each real node has network and mount namespaces of its own. Its network
//! namespace (pinned in the run dir) is joined to the host by a veth pair on an unused /30 in
//! 10.202.0.0/16, and the host routes the node's pod /24 to it; containerd, the kubelet and
//! kube-proxy (nftables mode) run inside, so their rules, bridge and ports never touch the
//! host's, and two nodes' hostNetwork pods do not collide. The control plane must be routable
//! ([`start_control_plane`]). containerd starts in a mount namespace of the node's own
//! ([`crate::real::mounts`]): shared inside, as on a systemd host, whatever the host's
//! propagation; overlays over `/etc`, `/opt`, `/var/lib`, `/var/log` and `/run` with their upper
//! layers in the run dir; the standard node paths bound to the run dir's; the host-wide sysctls
//! the kubelet sets covered by files of the run dir. The kubelet and kube-proxy join it. So the
//! manifests' hostPaths resolve to the run's files, and nothing touches the host's `/etc`,
//! `/opt`, `/var`, `/run` or mounts. What the node still needs of the host is checked before it
//! starts ([`crate::harness::host_check`]). Facts of this machine kind,
//! each found by trying (see docs/testing.md): cgroup v1 in hybrid mode (so the kubelet runs
//! with `failCgroupV1: false` and the `cgroupfs` driver), a VM that refuses a negative
//! `oom_score_adj` (so containerd runs with `restrict_oom_score_adj`), runc rather than crun
//! (crun refuses hybrid cgroups), and no systemd (so the harness starts and supervises both
//! daemons itself, as it does the control plane).

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, ListParams};

use crate::harness::control_plane::{
    ControlPlane, cert_kubeconfig_yaml, client_from, tmp_base, unique_name, write_owner,
    write_private,
};
use crate::real::mounts::{self, KERNEL_TUNABLES, host_sysctl};
use crate::harness::paths::{self, env_var, find_on_path, is_executable};
use crate::harness::process::{self, Mode, Proc};
use crate::Error;
use crate::harness::{hostnet, wait};

/// The pause image containerd runs every pod sandbox with (see `e2e/images/pause.c`).
pub const PAUSE_IMAGE: &str = "localhost/meshgate-e2e/pause:1";
/// The workload image: Debian's static busybox.
pub const BUSYBOX_IMAGE: &str = "localhost/meshgate-e2e/busybox:1";
/// meshgate's own image, release binaries (`e2e/images/build-meshgate-image.sh`; the e2e
/// overlay points the manifests at it).
pub const MESHGATE_IMAGE: &str = "localhost/meshgate/meshgate:e2e";
/// Env var naming meshgate's image tarball (default: `<target>/meshgate-image/meshgate.tar`,
/// beside the profile dir the tests run from, where `make` writes it).
pub const MESHGATE_IMAGE_ENV: &str = "MESHGATE_IMAGE_TAR";
/// Prefix of real-node run directories.
const DIR_PREFIX: &str = "meshgate-node-";
/// The containerd namespace the CRI plugin keeps Kubernetes' images and containers in.
const K8S_NS: &str = "k8s.io";
/// How long a daemon gets between SIGTERM and SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(10);
/// Upper bound for the Node to register and go Ready.
const READY_TIMEOUT: Duration = Duration::from_secs(120);
/// Name of the primary CNI config, as a CNI provider's installer would write it.
pub const CONFLIST: &str = "10-meshgate-e2e-bridge.conflist";
/// The node's binaries and images, as `e2e/install-deps.sh` caches them.
#[derive(Debug, Clone)]
pub struct NodeBinaries {
    /// kubelet, built from the pinned `k8s.io/kubernetes` module (beside kube-apiserver).
    pub kubelet: PathBuf,
    /// containerd, built from `github.com/containerd/containerd/v2` at `containerd-version`.
    pub containerd: PathBuf,
    /// ctr, from the same build (image import, task listing, teardown).
    pub ctr: PathBuf,
    /// Directory holding `containerd-shim-runc-v2`, put first on containerd's `PATH`.
    pub shim_dir: PathBuf,
    /// runc (Debian's).
    pub runc: PathBuf,
    /// Directory of the reference CNI plugins (Debian's `containernetworking-plugins`).
    pub cni_plugins: PathBuf,
    /// istio-cni, built from `istio.io/istio` at `istio-cni-version`.
    pub istio_cni: PathBuf,
    /// Directory of the OCI image-layout tarballs (`pause.tar`, `busybox.tar`).
    pub images: PathBuf,
    /// meshgate's image tarball ([`MESHGATE_IMAGE`]), built from this tree by `make`.
    pub meshgate_image: PathBuf,
    /// `cri-status` (e2e/cri-status/main.go): the runtime's verbose CRI status, CNI part.
    pub cri_status: PathBuf,
    /// kube-proxy, built from the pinned `k8s.io/kubernetes` module (beside the kubelet).
    pub kube_proxy: PathBuf,
    /// util-linux's nsenter and unshare: the node's daemons run in its own network and mount
    /// namespaces.
    pub nsenter: PathBuf,
    /// See `nsenter`.
    pub unshare: PathBuf,
}

/// Env var naming the directory of the reference CNI plugins (default `/usr/lib/cni`).
pub const CNI_PLUGINS_ENV: &str = "MESHGATE_CNI_PLUGINS_DIR";

impl NodeBinaries {
    /// Finds every binary and image; the error names the first missing part and the script
    /// that installs it.
    pub fn locate() -> Result<Self, Error> {
        let cache = paths::cache_dir()?;
        let containerd_dir = cache
            .join("containerd")
            .join(paths::pinned_version("containerd-version")?)
            .join("bin");
        let istio_dir = cache
            .join("istio-cni")
            .join(paths::pinned_version("istio-cni-version")?)
            .join("bin");
        let cni_plugins = env_var(CNI_PLUGINS_ENV)
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/usr/lib/cni"));
        let images = cache.join("images");
        let need = |part: &'static str, path: PathBuf| {
            if is_executable(&path) {
                Ok(path)
            } else {
                Err(missing(part, &path))
            }
        };
        for plugin in ["bridge", "host-local", "portmap", "loopback"] {
            need("the reference CNI plugins", cni_plugins.join(plugin))?;
        }
        for image in ["pause.tar", "busybox.tar"] {
            let path = images.join(image);
            if !path.is_file() {
                return Err(missing("the node images", &path));
            }
        }
        let tool = |name: &'static str| {
            find_on_path(name)
                .or_else(|| Some(Path::new("/usr/bin").join(name)).filter(|p| is_executable(p)))
                .ok_or_else(|| missing(name, &Path::new("$PATH").join(name)))
        };
        let meshgate_image = match env_var(MESHGATE_IMAGE_ENV) {
            Some(path) => PathBuf::from(path),
            None => crate::sim::node::workspace_bin_dir()
                .map_err(|e| Error::io("finding the workspace's target dir", e))?
                .parent()
                .map(|target| target.join("meshgate-image/meshgate.tar"))
                .unwrap_or_default(),
        };
        if !meshgate_image.is_file() {
            return Err(Error::RealNode {
                part: "meshgate's image",
                detail: format!(
                    "{} is missing: build it with `e2e/images/build-meshgate-image.sh target/release {0}` \
                     after `cargo build --release -p meshgate-agent -p meshgate-webhook` (make test does)",
                    meshgate_image.display()
                ),
            });
        }
        Ok(Self {
            meshgate_image,
            kubelet: need("kubelet", paths::k8s_bin_dir()?.join("kubelet"))?,
            kube_proxy: need("kube-proxy", paths::k8s_bin_dir()?.join("kube-proxy"))?,
            nsenter: tool("nsenter")?,
            unshare: tool("unshare")?,
            containerd: need("containerd", containerd_dir.join("containerd"))?,
            ctr: need("ctr", containerd_dir.join("ctr"))?,
            shim_dir: need(
                "containerd-shim-runc-v2",
                containerd_dir.join("containerd-shim-runc-v2"),
            )
            .map(|_| containerd_dir.clone())?,
            runc: find_on_path("runc")
                .or_else(|| Some(PathBuf::from("/usr/sbin/runc")).filter(|p| is_executable(p)))
                .ok_or_else(|| missing("runc", Path::new("$PATH/runc")))?,
            cni_plugins,
            istio_cni: need("istio-cni", istio_dir.join("istio-cni"))?,
            images,
            cri_status: need(
                "cri-status",
                cache
                    .join("cri-status")
                    .join(paths::kubernetes_version()?)
                    .join("bin/cri-status"),
            )?,
        })
    }
}

fn missing(part: &'static str, path: &Path) -> Error {
    Error::RealNode {
        part,
        detail: format!(
            "{} is missing: run `e2e/install-deps.sh` (make test does)",
            path.display()
        ),
    }
}

/// How long the node took to come up, for docs/testing.md.
#[derive(Debug, Clone, Copy)]
pub struct NodeTimes {
    /// containerd spawned → its socket answered.
    pub containerd: Duration,
    /// Images imported into containerd.
    pub images: Duration,
    /// kubelet spawned → Node object created (registration).
    pub registered: Duration,
    /// Node created → `Ready=True`.
    pub ready_after_registration: Duration,
    /// `Ready=True` → kube-proxy's rules send the `kubernetes` Service to the apiserver.
    pub kube_proxy_after_ready: Duration,
}

/// A running real node. Stopped (pods, containers, shims, mounts, bridge, cgroups, Node
/// object, directory) by [`RealNode::stop`] or on drop.
pub struct RealNode {
    name: String,
    dir: PathBuf,
    bins: NodeBinaries,
    fp: Footprint,
    admin: kube::config::Kubeconfig,
    net: NodeNet,
    procs: Mutex<Vec<Proc>>,
    spawner: Mutex<Option<Spawner>>,
    times: NodeTimes,
    stopped: Mutex<bool>,
}

impl std::fmt::Debug for RealNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RealNode")
            .field("name", &self.name)
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

impl RealNode {
    /// Starts containerd and the kubelet for a new node of `cp` and returns once the Node is
    /// `Ready`. Any part that does not come up fails the start with [`Error::RealNode`] naming
    /// it; whatever was started is torn down first. Before it starts anything, it cleans up
    /// after real-node runs whose test binary died without a teardown (their [`Footprint`]).
    pub async fn start(cp: &ControlPlane) -> Result<Self, Error> {
        paths::require_root()?;
        crate::harness::host_check::check()?;
        let bins = NodeBinaries::locate()?;
        let base = tmp_base();
        sweep_stale(&base);
        let dir = tempfile::Builder::new()
            .prefix(DIR_PREFIX)
            .tempdir_in(&base)
            .map_err(|e| Error::io(format!("creating a directory in {}", base.display()), e))?
            .keep();
        write_owner(&dir)?;
        let name = unique_name("real-node");
        let fp = Footprint::of(&dir);
        let apiserver = std::net::SocketAddr::from((cp.address(), cp.ports().apiserver));
        let net = match cp_reachable(cp)
            .and_then(|()| fp.add_network())
            .and_then(|net| {
                hostnet::reaches_from("the node's network namespace", &fp.netns_pin, apiserver)
                    .map(|()| net)
            }) {
            Ok(net) => net,
            Err(e) => {
                fp.clean();
                return Err(e);
            }
        };
        // The network is up: a failed start must take it down (and the dir) now, as a later
        // sweep would only find it once this process is gone.
        let spawner = match Spawner::start() {
            Ok(spawner) => spawner,
            Err(e) => {
                fp.clean();
                return Err(e);
            }
        };
        host_paths_acquire();
        // On a failed boot `node` is dropped, which tears down whatever was started.
        let mut node = RealNode {
            fp,
            net,
            name,
            dir,
            bins,
            admin: cp.admin_kubeconfig().clone(),
            procs: Mutex::new(Vec::new()),
            spawner: Mutex::new(Some(spawner)),
            times: NodeTimes {
                containerd: Duration::ZERO,
                images: Duration::ZERO,
                registered: Duration::ZERO,
                ready_after_registration: Duration::ZERO,
                kube_proxy_after_ready: Duration::ZERO,
            },
            stopped: Mutex::new(false),
        };
        node.times = node.boot(cp).await?;
        tracing::info!(
            node = %node.name,
            dir = %node.dir.display(),
            node_ip = %node.net.node_ip,
            gateway = %node.net.host_ip,
            pod_net = %node.net.pod_net,
            containerd_ms = node.times.containerd.as_millis() as u64,
            images_ms = node.times.images.as_millis() as u64,
            registered_ms = node.times.registered.as_millis() as u64,
            ready_ms = node.times.ready_after_registration.as_millis() as u64,
            "real node Ready"
        );
        Ok(node)
    }

    async fn boot(&self, cp: &ControlPlane) -> Result<NodeTimes, Error> {
        for sub in [
            "containerd/root",
            "containerd/state",
            "cni/ipam",
            "istio-cni",
            "kubelet/pki",
            "logs",
            "kube-proxy",
        ] {
            let path = self.dir.join(sub);
            std::fs::create_dir_all(&path)
                .map_err(|e| Error::io(format!("creating {}", path.display()), e))?;
        }
        // What the node's mount namespace binds from (the CNI conf and bin dirs among them),
        // its copies of the host-wide sysctls the kubelet sets, and its resolver config.
        mounts::prepare(&self.dir)?;
        // The node's CNI bin dir: the reference plugins, copied in as a CNI provider's
        // installer does (not linked: the agent's container runs them for their VERSION
        // through its /opt/cni/bin mount, where a link to a host path would dangle). istio-cni
        // joins later, in install_istio_cni.
        for plugin in ["bridge", "host-local", "portmap", "loopback"] {
            let to = self.cni_bin_dir().join(plugin);
            std::fs::copy(self.bins.cni_plugins.join(plugin), &to)
                .map_err(|e| Error::io(format!("copying {}", to.display()), e))?;
        }
        write_file(&self.conflist_path(), &self.bridge_conflist())?;

        // containerd
        let config = self.dir.join("containerd/config.toml");
        write_file(&config, &self.containerd_config())?;
        let begun = Instant::now();
        let path_env = format!(
            "{}:{}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            self.bins.shim_dir.display(),
            self.bins
                .runc
                .parent()
                .map(|p| p.display().to_string())
                .unwrap_or_default()
        );
        let containerd = self.spawn(
            "containerd",
            Ns::NewMount,
            &self.bins.containerd,
            vec!["--config".into(), config.display().to_string()],
            vec![("PATH".into(), path_env)],
        )?;
        let joined = Ns::Join(containerd.pid);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if self.ctr(&["version"]).await.is_ok() {
                break;
            }
            fail_if_exited(&containerd, "containerd")?;
            if Instant::now() >= deadline {
                return Err(Error::RealNode {
                    part: "containerd",
                    detail: format!(
                        "its socket did not answer within 30 s; the end of {}:\n{}",
                        containerd.log.display(),
                        containerd.log_tail(20)
                    ),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let containerd_time = begun.elapsed();

        // Images: no registry, so import the OCI layouts install-deps.sh built.
        let begun = Instant::now();
        let images = [
            self.bins.images.join("pause.tar"),
            self.bins.images.join("busybox.tar"),
            self.bins.meshgate_image.clone(),
        ];
        for image in images {
            let path = image.display().to_string();
            self.ctr(&["-n", K8S_NS, "images", "import", &path])
                .await
                .map_err(|detail| Error::RealNode {
                    part: "the node images",
                    detail,
                })?;
        }
        let images_time = begun.elapsed();

        // kubelet, as system:node:<name> in system:nodes (Node authorizer, NodeRestriction).
        let pki_dir = self.dir.join("kubelet/pki");
        let cert = cp.pki().issue_client(
            &pki_dir,
            "kubelet-client",
            &format!("system:node:{}", self.name),
            Some("system:nodes"),
        )?;
        let kubeconfig = self.dir.join("kubelet/kubeconfig");
        write_private(
            &kubeconfig,
            &cert_kubeconfig_yaml(&cp.apiserver_url(), cp.ca_path(), &cert),
        )?;
        self.create_cgroup_root()?;
        let ports = (0..2)
            .map(|_| crate::sim::node::free_port())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| Error::io("reserving the kubelet's ports", e))?;
        let kubelet_config = self.dir.join("kubelet/config.yaml");
        write_file(
            &kubelet_config,
            &self.kubelet_config(cp.ca_path(), ports[0], ports[1]),
        )?;
        let begun = Instant::now();
        let kubelet = self.spawn(
            "kubelet",
            joined,
            &self.bins.kubelet,
            vec![
                format!("--config={}", kubelet_config.display()),
                format!("--kubeconfig={}", kubeconfig.display()),
                format!("--hostname-override={}", self.name),
                format!("--root-dir={}", self.dir.join("kubelet/root").display()),
                format!("--cert-dir={}", pki_dir.display()),
                format!("--node-ip={}", self.net.node_ip),
                "--v=2".into(),
            ],
            Vec::new(),
        )?;
        let kube_proxy = self.start_kube_proxy(cp, joined).await?;
        let client = cp.client()?;
        let nodes: Api<Node> = Api::all(client);
        let deadline = Instant::now() + READY_TIMEOUT;
        let mut registered: Option<Duration> = None;
        loop {
            fail_if_exited(&containerd, "containerd")?;
            fail_if_exited(&kubelet, "kubelet")?;
            fail_if_exited(&kube_proxy, "kube-proxy")?;
            if let Ok(Ok(Some(n))) =
                tokio::time::timeout(wait::API_TIMEOUT, nodes.get_opt(&self.name)).await
            {
                let at = *registered.get_or_insert_with(|| begun.elapsed());
                if is_ready(&n) {
                    let ready = begun.elapsed();
                    self.wait_kube_proxy(&kube_proxy).await?;
                    return Ok(NodeTimes {
                        containerd: containerd_time,
                        images: images_time,
                        registered: at,
                        ready_after_registration: ready.saturating_sub(at),
                        kube_proxy_after_ready: begun.elapsed().saturating_sub(ready),
                    });
                }
            }
            if Instant::now() >= deadline {
                let what = if registered.is_some() {
                    "the Node registered but was not Ready"
                } else {
                    "the Node did not register"
                };
                return Err(Error::RealNode {
                    part: "kubelet",
                    detail: format!(
                        "{what} within {READY_TIMEOUT:?}; the end of {}:\n{}",
                        kubelet.log.display(),
                        kubelet.log_tail(30)
                    ),
                });
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The Node's name (also the kubelet's `system:node:<name>` identity).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The run directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// How long the node took to start.
    pub fn times(&self) -> NodeTimes {
        self.times
    }

    /// containerd's CNI conf dir (the node's `/etc/cni/net.d`).
    pub fn cni_conf_dir(&self) -> PathBuf {
        self.dir.join("cni/conf")
    }

    /// containerd's CNI bin dir (the node's `/opt/cni/bin`).
    pub fn cni_bin_dir(&self) -> PathBuf {
        self.dir.join("cni/bin")
    }

    /// The primary conflist, the one containerd loads.
    pub fn conflist_path(&self) -> PathBuf {
        self.cni_conf_dir().join(CONFLIST)
    }

    /// istio-cni's run dir (Istio's `/var/run/istio-cni`): its kubeconfig and log.
    pub fn istio_cni_run_dir(&self) -> PathBuf {
        self.dir.join("istio-cni")
    }

    /// libcni's result cache: containerd's CRI (through go-cni, which sets no cache dir of its
    /// own) has libcni keep one result per attachment in libcni's default `/var/lib/cni`,
    /// which in the node's mount namespace is this run-dir path.
    pub fn cni_cache_dir(&self) -> PathBuf {
        self.dir.join("cni/cache")
    }

    /// The node's address (its veth's, inside its network namespace): the Node's InternalIP.
    pub fn node_ip(&self) -> Ipv4Addr {
        self.net.node_ip
    }

    /// The node's network namespace, pinned in the run dir (for `nsenter --net=`).
    pub fn netns_pin(&self) -> &Path {
        &self.fp.netns_pin
    }

    /// The ends of the container logs of `ns`'s pods on this node, from the kubelet's pod-logs
    /// dir (the apiserver cannot reach the kubelet's port in the node's namespace), for failure
    /// messages.
    pub fn pod_logs(&self, ns: &str) -> String {
        let mut out = String::new();
        let Ok(pods) = std::fs::read_dir(self.dir.join("kubelet/pod-logs")) else {
            return out;
        };
        let prefix = format!("{ns}_");
        for pod in pods.flatten() {
            if !pod.file_name().to_string_lossy().starts_with(&prefix) {
                continue;
            }
            let containers = std::fs::read_dir(pod.path())
                .into_iter()
                .flatten()
                .flatten();
            for container in containers {
                for log in std::fs::read_dir(container.path())
                    .into_iter()
                    .flatten()
                    .flatten()
                {
                    let text = std::fs::read_to_string(log.path()).unwrap_or_default();
                    let lines: Vec<&str> = text.lines().collect();
                    out.push_str(&format!(
                        "--- {}\n{}\n",
                        log.path().display(),
                        lines[lines.len().saturating_sub(15)..].join("\n")
                    ));
                }
            }
        }
        out
    }

    /// containerd's socket.
    pub fn containerd_socket(&self) -> PathBuf {
        self.dir.join("containerd.sock")
    }

    /// The attachments libcni cached for the pod with `pod_uid` (`metadata.uid`): one per
    /// network the pod sandbox joined (containerd's `cni-loopback` on `lo`, the pod network on
    /// `eth0`), each with the config list that really ran. Found by the `K8S_POD_UID` CNI arg
    /// containerd passes; the sandbox id is their `container_id`. Sorted by file name, as
    /// libcni's `GetCachedAttachments` lists them. Like it, a file that is not a `cniCacheV1`
    /// entry is skipped (another runtime's, or one being written); none at all is an empty list.
    pub fn pod_attachments(&self, pod_uid: &str) -> Result<Vec<CachedAttachment>, Error> {
        attachments_of(&self.cni_cache_dir(), pod_uid)
    }

    /// Installs istio-cni the way Istio's installer (`cni/pkg/install`) does: the plugin binary
    /// into the CNI bin dir, its kubeconfig (`kubeconfig_yaml`, normally the istio-cni
    /// ServiceAccount's token) into its run dir as `istio-cni-kubeconfig`, and its entry
    /// appended to the primary conflist's plugins, with the fields its `plugin.Config` writes.
    pub fn install_istio_cni(
        &self,
        kubeconfig_yaml: &str,
        native_nftables: bool,
    ) -> Result<(), Error> {
        let bin = self.cni_bin_dir().join("istio-cni");
        if !bin.exists() {
            // Copied, as Istio's installer does (see the reference plugins in boot).
            std::fs::copy(&self.bins.istio_cni, &bin)
                .map_err(|e| Error::io(format!("copying {}", bin.display()), e))?;
        }
        write_private(
            &self.istio_cni_run_dir().join("istio-cni-kubeconfig"),
            kubeconfig_yaml,
        )?;
        let entry = istio_cni_entry(&self.istio_cni_run_dir(), native_nftables);
        // Like insertCNIConfig: an existing istio-cni entry is replaced, not duplicated.
        self.edit_plugins(|plugins| {
            plugins.retain(|p| p.get("type").and_then(|t| t.as_str()) != Some("istio-cni"));
            plugins.push(entry);
        })
    }

    /// Removes istio-cni's entry from the primary conflist, as Istio's uninstall does (the
    /// binary and kubeconfig stay, which only matters to a later install).
    pub fn remove_istio_cni(&self) -> Result<(), Error> {
        self.edit_plugins(|plugins| {
            plugins.retain(|p| p.get("type").and_then(|t| t.as_str()) != Some("istio-cni"));
        })
    }

    fn edit_plugins(&self, edit: impl FnOnce(&mut Vec<serde_json::Value>)) -> Result<(), Error> {
        let path = self.conflist_path();
        let text = std::fs::read_to_string(&path)
            .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
        let mut conf: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| Error::RealNode {
                part: "the CNI config",
                detail: format!("{} is not JSON: {e}", path.display()),
            })?;
        let Some(plugins) = conf
            .get_mut("plugins")
            .and_then(serde_json::Value::as_array_mut)
        else {
            return Err(Error::RealNode {
                part: "the CNI config",
                detail: format!("{} has no plugins array", path.display()),
            });
        };
        edit(plugins);
        let text = serde_json::to_string_pretty(&conf).map_err(|e| Error::RealNode {
            part: "the CNI config",
            detail: e.to_string(),
        })?;
        // Written in place, as Istio's installer does (containerd re-reads on the change).
        write_file(&path, &text)
    }

    /// The CNI part of containerd's verbose CRI status (`Status` with `verbose`):
    /// `{"cniconfig": {...the loaded networks...}, "lastCNILoadStatus": "OK" | error}`.
    pub async fn cri_cni_status(&self) -> Result<serde_json::Value, Error> {
        let mut cmd = tokio::process::Command::new(&self.bins.cri_status);
        cmd.arg(self.containerd_socket());
        let out = wait::command_output("cri-status", Duration::from_secs(15), &mut cmd).await?;
        if !out.status.success() {
            return Err(Error::RealNode {
                part: "containerd",
                detail: format!(
                    "its CRI Status failed: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            });
        }
        serde_json::from_slice(&out.stdout).map_err(|e| Error::RealNode {
            part: "containerd",
            detail: format!("cri-status printed no JSON: {e}"),
        })
    }

    /// The pid of the init process of a container (`containerd://<id>` or `<id>`, as in a
    /// pod's `containerStatuses[].containerID`), from containerd's task list.
    pub async fn container_pid(&self, container_id: &str) -> Result<i32, Error> {
        let id = container_id
            .strip_prefix("containerd://")
            .unwrap_or(container_id);
        let out = self
            .ctr(&["-n", K8S_NS, "tasks", "ls"])
            .await
            .map_err(|detail| Error::RealNode {
                part: "containerd",
                detail,
            })?;
        parse_task_pid(&out, id).ok_or_else(|| Error::RealNode {
            part: "containerd",
            detail: format!("no running task {id} in `ctr tasks ls`:\n{out}"),
        })
    }

    /// The end of a component's log (`containerd`, `kubelet`), for failure messages.
    pub fn log_tail(&self, component: &str, lines: usize) -> String {
        self.procs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|p| p.name == component)
            .map(|p| p.log_tail(lines))
            .unwrap_or_default()
    }

    /// Tears the node down: pods first (through the kubelet, so the CNI DEL runs), then the
    /// kubelet, any containers and tasks left, containerd and its shims, the mounts under the
    /// run dir, the bridge, the cgroups, the Node object and the directory. Idempotent;
    /// blocking (it runs its API calls on a runtime of its own, so it also works in drop).
    pub fn stop(&self) {
        {
            let mut stopped = self.stopped.lock().unwrap_or_else(|p| p.into_inner());
            if *stopped {
                return;
            }
            *stopped = true;
        }
        let admin = self.admin.clone();
        let name = self.name.clone();
        let kubelet_alive = self
            .procs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .any(|p| p.name == "kubelet" && p.alive());
        // 1. Pods, through the kubelet, which stops them and runs the CNI DEL.
        if kubelet_alive {
            run_blocking(drain_pods(admin.clone(), name.clone()));
        }
        // 2. The kubelet and kube-proxy.
        self.stop_component("kubelet");
        self.stop_component("kube-proxy");
        // 3. Containers and tasks the kubelet left (a failed drain), while containerd runs.
        if self
            .procs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .any(|p| p.name == "containerd" && p.alive())
        {
            run_blocking(remove_containers(
                self.bins.ctr.clone(),
                self.containerd_socket(),
            ));
        }
        // 4. containerd; 5.-9. whatever is left on the host (processes in the node's
        // cgroups, shims, mounts, the bridge, the cgroups, the directory).
        self.stop_component("containerd");
        self.fp.clean();
        // 10. The Node object.
        run_blocking(delete_node(admin, name));
        if let Some(spawner) = self
            .spawner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            spawner.shutdown();
        }
        // 11. Host paths the daemons create whatever their configuration says.
        host_paths_release();
    }

    /// What this node left on the host, described; empty after [`RealNode::stop`].
    pub fn footprint(&self) -> &Footprint {
        &self.fp
    }

    fn stop_component(&self, name: &str) {
        let procs: Vec<Proc> = {
            let mut all = self.procs.lock().unwrap_or_else(|p| p.into_inner());
            let (these, rest) = std::mem::take(&mut *all)
                .into_iter()
                .partition(|p| p.name == name);
            *all = rest;
            these
        };
        process::stop_all(&procs, STOP_GRACE);
    }

    /// Runs ctr against this node's containerd (30 s bound); stdout, or stderr as the error.
    async fn ctr(&self, args: &[&str]) -> Result<String, String> {
        ctr_at(&self.bins.ctr, &self.containerd_socket(), args).await
    }

    /// Spawns a daemon from the spawner thread (its parent for PDEATHSIG) and records it.
    fn spawn(
        &self,
        name: &'static str,
        ns: Ns,
        bin: &Path,
        args: Vec<String>,
        env: Vec<(String, String)>,
    ) -> Result<Proc, Error> {
        let log = self.dir.join("logs").join(format!("{name}.log"));
        // nsenter, unshare and sh all exec, so the pid recorded is the daemon's, and the
        // death signal set before the first exec stays with it.
        let mut argv = vec![format!("--net={}", self.fp.netns_pin.display())];
        if let Ns::Join(pid) = ns {
            argv.push(format!("--mount=/proc/{pid}/ns/mnt"));
        }
        argv.push("--".into());
        if ns == Ns::NewMount {
            argv.extend([
                self.bins.unshare.display().to_string(),
                "--mount".into(),
                "--propagation=slave".into(),
                "--".into(),
                "/bin/sh".into(),
                "-ec".into(),
                mounts::script(&self.dir)?,
                "node-mounts".into(),
            ]);
        }
        argv.push(bin.display().to_string());
        argv.extend(args);
        let (bin, args) = (self.bins.nsenter.clone(), argv);
        let spawner = self.spawner.lock().unwrap_or_else(|p| p.into_inner());
        let spawner = spawner.as_ref().ok_or_else(spawner_gone)?;
        let proc_ = spawner
            .run(move || process::spawn_env(name, &bin, &args, &env, &log, Mode::Attached))??;
        self.procs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(proc_.clone());
        Ok(proc_)
    }

    fn containerd_config(&self) -> String {
        let d = |sub: &str| toml_str(&self.dir.join(sub).display().to_string());
        let runc = toml_str(&self.bins.runc.display().to_string());
        format!(
            r#"# The real node's containerd: everything under one run directory (see real_node.rs).
version = 3
root = {root}
state = {state}

[plugins.'io.containerd.server.v1.grpc']
  address = {socket}

[plugins.'io.containerd.server.v1.ttrpc']
  address = {ttrpc}

[plugins.'io.containerd.internal.v1.opt']
  path = {opt}

[plugins.'io.containerd.nri.v1.nri']
  disable = true

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{pause}"

[plugins.'io.containerd.cri.v1.runtime']
  # This VM refuses a negative oom_score_adj; without this runc fails with
  # "can't get final child's PID from pipe".
  restrict_oom_score_adj = true
  # Pod namespaces are pinned under /var/run/netns, the run dir's netns/ in the node's mount
  # namespace: where the agent's manifest mounts them from (HostToContainer).
  netns_mounts_under_state_dir = false
  enable_cdi = false
  # On a host with AppArmor, containerd would load its default profile into the kernel, for
  # the whole machine: the node keeps to its namespaces instead.
  disable_apparmor = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = {runc}
        Root = {runc_root}
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = [{cni_bin}]
    conf_dir = {cni_conf}
    max_conf_num = 1

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"#,
            root = d("containerd/root"),
            state = d("containerd/state"),
            socket = d("containerd.sock"),
            ttrpc = d("containerd.sock.ttrpc"),
            opt = d("containerd/opt"),
            pause = PAUSE_IMAGE,
            runc = runc,
            runc_root = d("containerd/state/runc"),
            cni_bin = d("cni/bin"),
            cni_conf = d("cni/conf"),
        )
    }

    fn bridge_conflist(&self) -> String {
        // A bridge network as a simple CNI provider writes it. ipMasq is off so the host's
        // nat table is never touched; host-local keeps its leases in the run dir.
        serde_json::json!({
            "cniVersion": "1.0.0",
            "name": "meshgate-e2e",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": self.fp.bridge,
                    "isGateway": true,
                    "ipMasq": false,
                    "hairpinMode": true,
                    "ipam": {
                        "type": "host-local",
                        "dataDir": self.dir.join("cni/ipam"),
                        "ranges": [[{ "subnet": self.pod_subnet() }]],
                        "routes": [{ "dst": "0.0.0.0/0" }]
                    }
                },
                { "type": "portmap", "capabilities": { "portMappings": true } }
            ]
        })
        .to_string()
    }

    /// The node's pod network: a /24 in 10.200.0.0/16 no other network on the host uses.
    fn pod_subnet(&self) -> String {
        format!("{}/24", self.net.pod_net)
    }

    fn kubelet_config(&self, ca: &Path, port: u16, healthz: u16) -> String {
        let q = |s: &str| serde_json::Value::String(s.to_owned()).to_string();
        format!(
            r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 127.0.0.1
port: {port}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: {healthz}
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: true
  x509:
    clientCAFile: {ca}
authorization:
  mode: Webhook
containerRuntimeEndpoint: {endpoint}
# This machine kind runs cgroup v1 in hybrid mode and has no systemd.
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: {cgroup_root}
failSwapOn: false
podLogsDir: {pod_logs}
# The disk may be fuller than the default eviction thresholds allow, and an evicted or
# garbage-collected image cannot be pulled again here.
evictionHard:
  memory.available: "50Mi"
  nodefs.available: "1%"
  imagefs.available: "1%"
  nodefs.inodesFree: "1%"
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
nodeStatusUpdateFrequency: 2s
syncFrequency: 5s
serializeImagePulls: false
clusterDomain: cluster.local
resolvConf: {resolv_conf}
"#,
            ca = q(&ca.display().to_string()),
            endpoint = q(&format!("unix://{}", self.containerd_socket().display())),
            cgroup_root = q(&self.fp.cgroup_root),
            pod_logs = q(&self.dir.join("kubelet/pod-logs").display().to_string()),
            resolv_conf = q(&self
                .dir
                .join(mounts::RESOLV_CONF)
                .display()
                .to_string()),
        )
    }

    /// kube-proxy in the node's namespaces, nftables mode, as `system:kube-proxy` (bound to
    /// the `system:node-proxier` ClusterRole, as kubeadm does), so pods and hostNetwork pods
    /// reach the apiserver at `KUBERNETES_SERVICE_HOST` (10.0.0.1:443) as in a cluster. It
    /// writes its `kube-proxy` nftables tables into the node's namespace only; conntrack
    /// `maxPerCore: 0` keeps it from writing the host-wide conntrack sysctls.
    async fn start_kube_proxy(&self, cp: &ControlPlane, ns: Ns) -> Result<Proc, Error> {
        let dir = self.dir.join("kube-proxy");
        let cert = cp
            .pki()
            .issue_client(&dir, "kube-proxy", "system:kube-proxy", None)?;
        let kubeconfig = dir.join("kubeconfig");
        write_private(
            &kubeconfig,
            &cert_kubeconfig_yaml(&cp.apiserver_url(), cp.ca_path(), &cert),
        )?;
        bind_node_proxier(cp).await?;
        let q = |s: &str| serde_json::Value::String(s.to_owned()).to_string();
        let config = dir.join("config.yaml");
        write_file(
            &config,
            &format!(
                r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection:
  kubeconfig: {kubeconfig}
hostnameOverride: {node}
mode: nftables
clusterCIDR: 10.200.0.0/16
# Both in the node's network namespace.
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
conntrack:
  # nf_conntrack_max is host-wide: never write it.
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
"#,
                kubeconfig = q(&kubeconfig.display().to_string()),
                node = q(&self.name),
            ),
        )?;
        self.spawn(
            "kube-proxy",
            ns,
            &self.bins.kube_proxy,
            vec![format!("--config={}", config.display()), "--v=2".into()],
            Vec::new(),
        )
    }

    /// Waits until kube-proxy's rules in the node's namespace send the `kubernetes` Service
    /// (10.0.0.1) somewhere: its first full sync after the Node and the Service's endpoints.
    async fn wait_kube_proxy(&self, kube_proxy: &Proc) -> Result<(), Error> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let pin = format!("--net={}", self.fp.netns_pin.display());
        loop {
            fail_if_exited(kube_proxy, "kube-proxy")?;
            let mut nft = tokio::process::Command::new(&self.bins.nsenter);
            nft.args([
                pin.as_str(),
                "--",
                "nft",
                "list",
                "table",
                "ip",
                "kube-proxy",
            ]);
            let listed =
                wait::command_output("kube-proxy's table", Duration::from_secs(10), &mut nft);
            if let Ok(out) = listed.await
                && String::from_utf8_lossy(&out.stdout).contains("10.0.0.1")
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Error::RealNode {
                    part: "kube-proxy",
                    detail: format!(
                        "no rule for the kubernetes Service (10.0.0.1) in the node's nftables within 60 s; the end of {}:\n{}",
                        kube_proxy.log.display(),
                        kube_proxy.log_tail(30)
                    ),
                });
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The kubelet requires its cgroup root to exist in every hierarchy it uses.
    fn create_cgroup_root(&self) -> Result<(), Error> {
        for hierarchy in cgroup_hierarchies() {
            let path = hierarchy.join(self.fp.cgroup_root.trim_start_matches('/'));
            std::fs::create_dir_all(&path)
                .map_err(|e| Error::io(format!("creating cgroup {}", path.display()), e))?;
        }
        Ok(())
    }
}

/// Where a daemon of the node runs: containerd in a new mount namespace, the others in
/// containerd's (by its pid); all in the node's network namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ns {
    NewMount,
    Join(i32),
}

/// The node's addresses: a veth pair between the host and the node's network namespace, and
/// the pod network behind it, routed from the host.
#[derive(Debug, Clone, Copy)]
struct NodeNet {
    /// The host side of the veth (the node's default gateway).
    host_ip: Ipv4Addr,
    /// The node side (`eth0` in its namespace): the kubelet's `--node-ip`.
    node_ip: Ipv4Addr,
    /// Base of the node's pod /24 (the bridge's), routed from the host via `node_ip`.
    pod_net: Ipv4Addr,
}

/// The real node reaches the apiserver from its own network namespace: loopback will not do.
fn cp_reachable(cp: &ControlPlane) -> Result<(), Error> {
    if cp.address().is_loopback() {
        return Err(Error::RealNode {
            part: "the control plane",
            detail: "its apiserver listens on loopback, which the node's network namespace cannot \
                     reach: start it with `Options { routable: true, .. }` (see start_control_plane)"
                .into(),
        });
    }
    Ok(())
}

/// A control plane real nodes can join: its apiserver on a routable address of its own
/// ([`crate::Options::routable`]). Each real-node test starts one and drops it after its nodes.
pub async fn start_control_plane() -> Result<ControlPlane, Error> {
    ControlPlane::start(crate::Options {
        routable: true,
        ..crate::Options::default()
    })
    .await
}

impl Drop for RealNode {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Binds `system:kube-proxy` to the bootstrap `system:node-proxier` ClusterRole (once per
/// control plane; an existing binding is kept).
async fn bind_node_proxier(cp: &ControlPlane) -> Result<(), Error> {
    use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, RoleRef, Subject};
    let api: Api<ClusterRoleBinding> = Api::all(cp.client()?);
    let binding = ClusterRoleBinding {
        metadata: kube::api::ObjectMeta {
            name: Some("meshgate-e2e:kube-proxy".into()),
            ..Default::default()
        },
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".into(),
            kind: "ClusterRole".into(),
            name: "system:node-proxier".into(),
        },
        subjects: Some(vec![Subject {
            kind: "User".into(),
            name: "system:kube-proxy".into(),
            api_group: Some("rbac.authorization.k8s.io".into()),
            ..Default::default()
        }]),
    };
    match wait::bounded(
        "creating kube-proxy's ClusterRoleBinding",
        wait::API_TIMEOUT,
        async {
            Ok::<_, Error>(
                api.create(&kube::api::PostParams::default(), &binding)
                    .await,
            )
        },
    )
    .await?
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(Error::kube("creating kube-proxy's ClusterRoleBinding", e)),
    }
}

/// istio-cni's entry as Istio's installer writes it: `plugin.Config` marshalled, with
/// `cniVersion` dropped (the conflist's applies). Sidecar mode, so ambient is off.
pub fn istio_cni_entry(run_dir: &Path, native_nftables: bool) -> serde_json::Value {
    serde_json::json!({
        "name": "istio-cni",
        "type": "istio-cni",
        "ipam": {},
        "dns": {},
        "plugin_log_level": "debug",
        "cni_agent_run_dir": run_dir,
        "ambient_enabled": false,
        "enablement_selectors": [],
        "exclude_namespaces": ["istio-system", "kube-system"],
        "pod_namespace": "istio-system",
        "native_nftables": native_nftables,
        "enable_ambient_detection_retry": false
    })
}

/// One attachment from libcni's result cache: what libcni's `cacheAdd` writes after every
/// plugin of a config list returned from ADD (`{"kind": "cniCacheV1", "containerId",
/// "config", "ifName", "networkName", "netns", "cniArgs", "capabilityArgs", "result"}`). The
/// `config` is the bytes of the config list that ran (`NetworkConfigList.Bytes`), so its
/// plugins are the chain the runtime executed, independent of what the runtime reports, with
/// one gap: libcni keeps `Bytes` as the file it read, so CNI 1.1 drop-ins
/// (`<conf dir>/<network>/*.conf`), which it appends to the list's plugins, ran after them
/// but are not in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedAttachment {
    /// The network (the config list's `name`).
    pub network_name: String,
    /// The container the runtime attached: for CRI, the pod sandbox id.
    pub container_id: String,
    /// The interface inside the pod (`eth0` for the pod network, `lo` for loopback).
    pub if_name: String,
    /// The CNI args the runtime passed (`K8S_POD_NAMESPACE`, `K8S_POD_NAME`, `K8S_POD_UID`, ...).
    pub cni_args: Vec<(String, String)>,
    /// The plugin `type`s of `config`, in the order they ran (drop-ins not included).
    pub plugins: Vec<String>,
    /// The config list that ran, as libcni held it.
    pub config: Vec<u8>,
    /// The addresses (`10.200.3.2/24`) of the chain's final result, which the last plugin
    /// returned: what the sandbox's interface was given.
    pub ips: Vec<String>,
}

impl CachedAttachment {
    /// Parses one cache file; any field libcni always writes that is missing or of the wrong
    /// shape is an error naming it.
    pub fn parse(bytes: &[u8]) -> Result<Self, Error> {
        Self::parse_inner(bytes).map_err(|detail| Error::CniCache {
            what: "an entry".into(),
            detail,
        })
    }

    fn parse_inner(bytes: &[u8]) -> Result<Self, String> {
        use base64::Engine as _;
        let v: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| format!("not JSON: {e}"))?;
        if v["kind"] != "cniCacheV1" {
            return Err(format!("kind is {}, not \"cniCacheV1\"", v["kind"]));
        }
        let text = |field: &str| {
            v[field]
                .as_str()
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .ok_or_else(|| format!("no {field}"))
        };
        // Go marshals a []byte as standard, padded base64.
        let config = base64::engine::general_purpose::STANDARD
            .decode(text("config")?)
            .map_err(|e| format!("config is not base64: {e}"))?;
        let list: serde_json::Value = serde_json::from_slice(&config)
            .map_err(|e| format!("config is not a JSON config: {e}"))?;
        // A list (`AddNetworkList`, all containerd does) or a single network (`AddNetwork`).
        let plugins = match list.get("plugins") {
            Some(ps) => ps
                .as_array()
                .ok_or("config's plugins is not a list")?
                .iter()
                .map(|p| p["type"].as_str().map(str::to_owned))
                .collect::<Option<Vec<_>>>()
                .ok_or("a plugin of config has no type")?,
            None => vec![
                list["type"]
                    .as_str()
                    .ok_or("config has neither plugins nor a type")?
                    .to_owned(),
            ],
        };
        let cni_args = match &v["cniArgs"] {
            serde_json::Value::Null => Vec::new(),
            args => args
                .as_array()
                .ok_or("cniArgs is not a list")?
                .iter()
                .map(|kv| match kv.as_array().map(Vec::as_slice) {
                    Some([k, v]) => Some((k.as_str()?.to_owned(), v.as_str()?.to_owned())),
                    _ => None,
                })
                .collect::<Option<Vec<_>>>()
                .ok_or("a cniArgs entry is not a [key, value] pair")?,
        };
        // The result is a CNI result of the list's version (0.3.0 and later: `ips[].address`).
        let ips = v["result"]["ips"]
            .as_array()
            .map(|ips| {
                ips.iter()
                    .filter_map(|ip| ip["address"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        Ok(Self {
            network_name: text("networkName")?,
            container_id: text("containerId")?,
            if_name: text("ifName")?,
            cni_args,
            plugins,
            config,
            ips,
        })
    }

    /// The value of one CNI arg, if the runtime passed it.
    pub fn cni_arg(&self, key: &str) -> Option<&str> {
        self.cni_args
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// The name libcni gives this attachment's file under `<cache dir>/results`.
    pub fn file_name(&self) -> String {
        format!(
            "{}-{}-{}",
            self.network_name, self.container_id, self.if_name
        )
    }
}

/// The `cniCacheV1` entries under `<cache_dir>/results` whose `K8S_POD_UID` is `pod_uid`, in
/// file-name order (see [`RealNode::pod_attachments`]).
fn attachments_of(cache_dir: &Path, pod_uid: &str) -> Result<Vec<CachedAttachment>, Error> {
    let dir = cache_dir.join("results");
    let mut paths: Vec<PathBuf> = match std::fs::read_dir(&dir) {
        Ok(entries) => entries.flatten().map(|e| e.path()).collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io(format!("listing {}", dir.display()), e)),
    };
    paths.sort();
    Ok(paths
        .iter()
        .filter_map(|path| {
            let att = CachedAttachment::parse(&std::fs::read(path).ok()?).ok()?;
            // libcni names the file `<network>-<container id>-<ifname>`; a file whose name
            // and content disagree is not the entry libcni wrote for this attachment.
            let name = path.file_name()?.to_str()?;
            (name == att.file_name() && att.cni_arg("K8S_POD_UID") == Some(pod_uid)).then_some(att)
        })
        .collect())
}

/// `ctr tasks ls` prints `TASK PID STATUS` rows.
fn parse_task_pid(out: &str, id: &str) -> Option<i32> {
    out.lines().skip(1).find_map(|line| {
        let mut f = line.split_whitespace();
        (f.next()? == id).then_some(())?;
        f.next()?.parse().ok().filter(|pid| *pid > 0)
    })
}

fn is_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn fail_if_exited(p: &Proc, part: &'static str) -> Result<(), Error> {
    match p.exit_status() {
        None => Ok(()),
        Some(status) => Err(Error::RealNode {
            part,
            detail: format!(
                "it exited ({status}); the end of {}:\n{}",
                p.log.display(),
                p.log_tail(30)
            ),
        }),
    }
}

fn write_file(path: &Path, text: &str) -> Result<(), Error> {
    std::fs::write(path, text).map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

fn toml_str(s: &str) -> String {
    // TOML basic strings share JSON's escapes for everything a path can hold.
    serde_json::Value::String(s.to_owned()).to_string()
}

/// Kills and removes every task and container containerd still holds in the CRI namespace.
async fn remove_containers(ctr: PathBuf, socket: PathBuf) {
    let run = |args: Vec<&'static str>, id: Option<String>| {
        let (ctr, socket) = (ctr.clone(), socket.clone());
        async move {
            let mut all: Vec<&str> = args;
            if let Some(id) = id.as_deref() {
                all.push(id);
            }
            ctr_at(&ctr, &socket, &all).await
        }
    };
    if let Ok(tasks) = run(vec!["-n", K8S_NS, "tasks", "ls", "-q"], None).await {
        for id in tasks.lines().map(str::trim).filter(|l| !l.is_empty()) {
            let id = Some(id.to_owned());
            let _ = run(
                vec!["-n", K8S_NS, "tasks", "kill", "-s", "SIGKILL"],
                id.clone(),
            )
            .await;
            let _ = run(vec!["-n", K8S_NS, "tasks", "delete", "-f"], id).await;
        }
    }
    if let Ok(containers) = run(vec!["-n", K8S_NS, "containers", "ls", "-q"], None).await {
        for id in containers.lines().map(str::trim).filter(|l| !l.is_empty()) {
            let _ = run(vec!["-n", K8S_NS, "containers", "rm"], Some(id.to_owned())).await;
        }
    }
}

/// Runs `ctr --address socket args...` (30 s bound); stdout, or stderr as the error.
async fn ctr_at(ctr: &Path, socket: &Path, args: &[&str]) -> Result<String, String> {
    let mut cmd = tokio::process::Command::new(ctr);
    cmd.arg("--address").arg(socket).args(args);
    let what = format!("ctr {}", args.join(" "));
    match wait::command_output(&what, Duration::from_secs(30), &mut cmd).await {
        Err(e) => Err(e.to_string()),
        Ok(out) if out.status.success() => Ok(String::from_utf8_lossy(&out.stdout).into_owned()),
        Ok(out) => Err(format!(
            "{what}: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )),
    }
}

/// Drains `node` as `kubectl drain` would: cordons it (so a Deployment's replacements land
/// elsewhere), deletes every pod bound to it, and waits (bounded) until the kubelet has
/// stopped those pods and the apiserver has removed them. Only the pods present at the start
/// are waited for: a DaemonSet's controller recreates its pod at once (it tolerates the
/// cordon), and the containerd cleanup after the kubelet stops takes that one.
async fn drain_pods(admin: kube::config::Kubeconfig, node: String) {
    let Ok(client) = client_from(admin, "admin") else {
        return;
    };
    let nodes: Api<Node> = Api::all(client.clone());
    let cordon = serde_json::json!({"spec": {"unschedulable": true}});
    let _ = tokio::time::timeout(
        wait::API_TIMEOUT,
        nodes.patch(
            &node,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&cordon),
        ),
    )
    .await;
    let pods: Api<Pod> = Api::all(client.clone());
    let selector = ListParams::default().fields(&format!("spec.nodeName={node}"));
    let Ok(Ok(list)) = tokio::time::timeout(wait::API_TIMEOUT, pods.list(&selector)).await else {
        return;
    };
    let uids: Vec<String> = list
        .items
        .iter()
        .filter_map(|p| p.metadata.uid.clone())
        .collect();
    for pod in &list.items {
        let (Some(ns), Some(name)) = (&pod.metadata.namespace, &pod.metadata.name) else {
            continue;
        };
        let api: Api<Pod> = Api::namespaced(client.clone(), ns);
        let _ = tokio::time::timeout(
            wait::API_TIMEOUT,
            api.delete(name, &DeleteParams::default().grace_period(1)),
        )
        .await;
    }
    let _ = wait::poll_until(
        &format!("pods of {node} gone"),
        Duration::from_secs(60),
        || async {
            let left = pods.list(&selector).await?;
            let any_left = left
                .items
                .iter()
                .any(|p| p.metadata.uid.as_ref().is_some_and(|u| uids.contains(u)));
            Ok::<_, kube::Error>((!any_left).then_some(()))
        },
    )
    .await;
}

async fn delete_node(admin: kube::config::Kubeconfig, node: String) {
    let Ok(client) = client_from(admin, "admin") else {
        return;
    };
    let nodes: Api<Node> = Api::all(client);
    let _ = tokio::time::timeout(
        wait::API_TIMEOUT,
        nodes.delete(&node, &DeleteParams::default()),
    )
    .await;
}

/// Runs `fut` to completion on a fresh runtime in a thread of its own, so teardown works from
/// inside a test's runtime and from drop.
fn run_blocking<F>(fut: F)
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    let _ = std::thread::Builder::new()
        .name("meshgate-node-stop".into())
        .spawn(move || {
            if let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                rt.block_on(fut);
            }
        })
        .map(|t| t.join());
}

/// Pids of the shims serving containerd at `socket`: the socket path is unique to the run and
/// is on every such shim's command line (`-address <socket>`).
fn shim_pids(socket: &Path) -> Vec<i32> {
    let socket = socket.display().to_string();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids = Vec::new();
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        let is_shim = args
            .first()
            .is_some_and(|a| a.ends_with(b"containerd-shim-runc-v2"));
        let serves_us = args
            .windows(2)
            .any(|w| w[0] == b"-address" && w[1] == socket.as_bytes());
        if is_shim && serves_us {
            pids.push(pid);
        }
    }
    pids
}

/// Kills, by pid, the shims serving containerd at `socket` (see [`shim_pids`]).
fn kill_shims(socket: &Path) {
    for pid in shim_pids(socket) {
        tracing::warn!(pid, "killing a containerd shim left behind");
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

/// Mount points at or under `dir`, deepest first.
fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let Ok(text) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    let mut mounts: Vec<PathBuf> = text
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape_mount_path)
        .filter(|p| p.starts_with(dir))
        .collect();
    mounts.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
    mounts.dedup();
    mounts
}

/// mountinfo escapes space, tab, newline and backslash as octal.
fn unescape_mount_path(s: &str) -> PathBuf {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            let code: String = chars.by_ref().take(3).collect();
            match u8::from_str_radix(&code, 8) {
                Ok(b) => out.push(b as char),
                Err(_) => {
                    out.push('\\');
                    out.push_str(&code);
                }
            }
        } else {
            out.push(c);
        }
    }
    PathBuf::from(out)
}

fn unmount_under(dir: &Path) {
    // Stacked mounts show up once per layer; a few rounds take them all.
    for _ in 0..5 {
        let mounts = mounts_under(dir);
        if mounts.is_empty() {
            return;
        }
        for m in mounts {
            if let Err(e) = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH) {
                tracing::debug!(mount = %m.display(), error = %e, "umount");
            }
        }
    }
}

/// The cgroup hierarchies the kubelet creates cgroups in: on cgroup v1 and hybrid machines
/// (this one) every controller mount under `/sys/fs/cgroup` and the `unified` one; on a pure
/// v2 machine `/sys/fs/cgroup` itself, whose subdirectories are cgroups, not hierarchies.
fn cgroup_hierarchies() -> Vec<PathBuf> {
    let root = Path::new("/sys/fs/cgroup");
    if root.join("cgroup.controllers").exists() {
        return vec![root.to_owned()];
    }
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("cgroup.procs").exists())
        .collect();
    out.sort();
    out
}

/// Removes a cgroup directory tree bottom-up (cgroupfs allows rmdir of empty cgroups only).
fn remove_cgroup_tree(path: &Path) {
    if let Ok(entries) = std::fs::read_dir(path) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_cgroup_tree(&e.path());
            }
        }
    }
    if path.exists()
        && let Err(e) = std::fs::remove_dir(path)
    {
        tracing::warn!(cgroup = %path.display(), error = %e, "cannot remove a cgroup");
    }
}

/// Removes real-node directories of dead test runs that hold no mounts. A SIGKILLed test
/// binary loses containerd and the kubelet to PDEATHSIG but cannot clean up after them.
fn sweep_stale(base: &Path) {
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if !entry
            .file_name()
            .to_str()
            .is_some_and(|n| n.starts_with(DIR_PREFIX))
        {
            continue;
        }
        let Ok(owner) = std::fs::read_to_string(path.join("owner")) else {
            continue;
        };
        let mut fields = owner.split_whitespace().map(str::parse::<u64>);
        let (Some(Ok(pid)), Some(Ok(start))) = (fields.next(), fields.next()) else {
            continue;
        };
        let alive = i32::try_from(pid)
            .ok()
            .and_then(process::start_time)
            .is_some_and(|t| t == start);
        if alive {
            continue;
        }
        tracing::info!(dir = %path.display(), "cleaning up after a dead real-node run");
        Footprint::of(&path).clean();
    }
}

/// What a real node puts on the host besides API objects, derived from its run directory's
/// name alone, so a later run can clean up after a killed one (see `RealNode::start`).
#[derive(Debug, Clone)]
pub struct Footprint {
    /// The run directory.
    pub dir: PathBuf,
    /// The CNI bridge (`mg` + the directory's suffix; IFNAMSIZ is 16).
    pub bridge: String,
    /// The kubelet's `cgroupRoot`, present in every cgroup hierarchy.
    pub cgroup_root: String,
    /// The host side of the node's veth pair (`mgv` + the run dir's hash: the suffix's case,
    /// which the bridge's name loses, cannot make two runs' names collide). Deleting it
    /// deletes the pair, its address and the route to the node's pods.
    pub veth: String,
    /// The node's network namespace, bind-mounted on a file in the run dir.
    pub netns_pin: PathBuf,
}

impl Footprint {
    fn of(dir: &Path) -> Self {
        let suffix = dir
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix(DIR_PREFIX))
            .unwrap_or("0")
            .to_ascii_lowercase();
        Self {
            dir: dir.to_owned(),
            bridge: format!("mg{}", &suffix[..suffix.len().min(10)]),
            cgroup_root: format!("/{DIR_PREFIX}{suffix}"),
            veth: format!("mgv{:08x}", hostnet::seed(dir)),
            netns_pin: dir.join("netns.pin"),
        }
    }

    /// The node's network: a namespace pinned in the run dir, a veth pair (`eth0` inside, the
    /// node's address; [`Footprint::veth`] outside, its gateway) on an unused /30 in
    /// 10.202.0.0/16, `lo` up, forwarding on inside (the bridge's pods reach the apiserver
    /// through it), and a host route to the node's pod /24 via the node, so the apiserver
    /// reaches webhook pods (nodes reaching each other's pods also needs the host's forwarding).
    fn add_network(&self) -> Result<NodeNet, Error> {
        const PART: &str = "the node's network namespace";
        let seed = hostnet::seed(&self.dir);
        std::fs::write(&self.netns_pin, "")
            .map_err(|e| Error::io(format!("creating {}", self.netns_pin.display()), e))?;
        let pin = format!("--net={}", self.netns_pin.display());
        hostnet::run(PART, &self.unshare_bin(), &[&pin, "true"])?;
        let link = hostnet::unused_net(seed, 30, |n| {
            Ipv4Addr::new(10, 202, (n >> 6) as u8, ((n & 63) << 2) as u8)
        })?;
        let host_ip = Ipv4Addr::from(u32::from(link) + 1);
        let node_ip = Ipv4Addr::from(u32::from(link) + 2);
        let pod_net =
            hostnet::unused_net(seed, 24, |n| Ipv4Addr::new(10, 200, (n % 250) as u8, 0))?;
        let ours = std::process::id().to_string();
        let pin = &self.netns_pin;
        hostnet::ip_in(
            PART,
            pin,
            &[
                "link", "add", "eth0", "type", "veth", "peer", "name", &self.veth, "netns", &ours,
            ],
        )?;
        hostnet::ip(
            PART,
            &["addr", "add", &format!("{host_ip}/30"), "dev", &self.veth],
        )?;
        hostnet::ip(PART, &["link", "set", &self.veth, "up"])?;
        hostnet::ip_in(
            PART,
            pin,
            &["addr", "add", &format!("{node_ip}/30"), "dev", "eth0"],
        )?;
        hostnet::ip_in(PART, pin, &["link", "set", "eth0", "up"])?;
        hostnet::ip_in(PART, pin, &["link", "set", "lo", "up"])?;
        hostnet::ip_in(
            PART,
            pin,
            &["route", "add", "default", "via", &host_ip.to_string()],
        )?;
        let net_arg = format!("--net={}", pin.display());
        hostnet::run(
            PART,
            "nsenter",
            &[&net_arg, "--", "sysctl", "-qw", "net.ipv4.ip_forward=1"],
        )?;
        hostnet::ip(
            PART,
            &[
                "route",
                "add",
                &format!("{pod_net}/24"),
                "via",
                &node_ip.to_string(),
                "dev",
                &self.veth,
            ],
        )?;
        Ok(NodeNet {
            host_ip,
            node_ip,
            pod_net,
        })
    }

    fn unshare_bin(&self) -> String {
        find_on_path("unshare")
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| "unshare".into())
    }

    fn socket(&self) -> PathBuf {
        self.dir.join("containerd.sock")
    }

    fn cgroups(&self) -> Vec<PathBuf> {
        cgroup_hierarchies()
            .into_iter()
            .map(|h| h.join(self.cgroup_root.trim_start_matches('/')))
            .filter(|p| p.exists())
            .collect()
    }

    /// Kills what still runs in the node's cgroups and the shims serving its containerd, then
    /// removes the mounts under the run dir, the bridge, the cgroups and the run dir.
    fn clean(&self) {
        for cg in self.cgroups() {
            kill_cgroup_tree(&cg);
        }
        kill_shims(&self.socket());
        // The killed processes exit asynchronously; a cgroup can be removed once empty.
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.cgroups().iter().any(|cg| cgroup_tree_busy(cg)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        // The pin's unmount frees the node's network namespace once its processes are gone
        // (its bridge and pod veths go with it); the veth's host side goes explicitly.
        unmount_under(&self.dir);
        hostnet::delete_link(&self.veth);
        // Runs from before the node had a namespace of its own put the bridge on the host.
        hostnet::delete_link(&self.bridge);
        for cg in self.cgroups() {
            remove_cgroup_tree(&cg);
        }
        // Never delete through a mount that could not be removed.
        if mounts_under(&self.dir).is_empty() {
            if let Err(e) = std::fs::remove_dir_all(&self.dir)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(dir = %self.dir.display(), error = %e, "cannot remove the real node's directory");
            }
        } else {
            tracing::warn!(dir = %self.dir.display(), "mounts remain; leaving the directory");
        }
    }

    /// What is still on the host: one line per leftover, empty when clean.
    pub fn residue(&self) -> Vec<String> {
        let mut left = Vec::new();
        if self.dir.exists() {
            left.push(format!("directory {}", self.dir.display()));
        }
        for m in mounts_under(&self.dir) {
            left.push(format!("mount {}", m.display()));
        }
        if hostnet::link_exists(&self.bridge) {
            left.push(format!("bridge {}", self.bridge));
        }
        if hostnet::link_exists(&self.veth) {
            left.push(format!("veth {}", self.veth));
        }
        for cg in self.cgroups() {
            left.push(format!("cgroup {}", cg.display()));
        }
        for pid in shim_pids(&self.socket()) {
            left.push(format!("containerd shim pid {pid}"));
        }
        left
    }
}

/// SIGKILLs every process in a cgroup tree (the node's pods: pause, workloads).
fn kill_cgroup_tree(path: &Path) {
    if let Ok(entries) = std::fs::read_dir(path) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                kill_cgroup_tree(&e.path());
            }
        }
    }
    let procs = std::fs::read_to_string(path.join("cgroup.procs")).unwrap_or_default();
    for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
        tracing::warn!(pid, cgroup = %path.display(), "killing a process left in the real node's cgroups");
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

fn cgroup_tree_busy(path: &Path) -> bool {
    let here =
        std::fs::read_to_string(path.join("cgroup.procs")).is_ok_and(|p| !p.trim().is_empty());
    here || std::fs::read_dir(path).is_ok_and(|entries| {
        entries
            .flatten()
            .any(|e| e.file_type().is_ok_and(|t| t.is_dir()) && cgroup_tree_busy(&e.path()))
    })
}

/// Standard node paths a kubelet, containerd, libcni or a CNI plugin writes whatever its
/// configuration says (the kubelet's device-plugin dir and `/var/log/containers` links,
/// libcni's cache, the shims' sockets) or the manifests mount as hostPaths. The node's mount
/// namespace covers them all with overlays and binds to the run dir, so none may appear on
/// the host: [`host_residue`] checks.
const HOST_PATHS: &[&str] = &[
    "/var/lib/kubelet",
    "/var/log/containers",
    "/var/log/pods",
    "/var/lib/cni",
    "/run/containerd",
    "/etc/cni",
    "/opt/cni",
    "/run/meshgate",
];

/// What the host held before the first real node of this process started.
struct HostBefore {
    /// The [`HOST_PATHS`] that existed (a host's own kubelet or containerd may have them).
    paths: Vec<PathBuf>,
    /// Its kube-proxy nftables tables (a host that is itself a node may have them).
    tables: Vec<String>,
    /// Its values of the [`KERNEL_TUNABLES`] (`None`: no such entry on this kernel).
    sysctls: Vec<(&'static str, Option<String>)>,
}

/// The host's values of the [`KERNEL_TUNABLES`], in their order.
fn host_sysctls() -> Vec<(&'static str, Option<String>)> {
    KERNEL_TUNABLES
        .iter()
        .map(|name| (*name, host_sysctl(name)))
        .collect()
}

/// Real nodes alive in this process, and what the host held before the first of them.
static HOST: Mutex<(usize, Option<HostBefore>)> = Mutex::new((0, None));

fn host_paths_acquire() {
    let mut host = HOST.lock().unwrap_or_else(|p| p.into_inner());
    if host.1.is_none() {
        host.1 = Some(HostBefore {
            paths: HOST_PATHS
                .iter()
                .map(PathBuf::from)
                .filter(|p| p.exists())
                .collect(),
            tables: host_kube_proxy_tables(),
            sysctls: host_sysctls(),
        });
    }
    host.0 += 1;
}

fn host_paths_release() {
    let mut host = HOST.lock().unwrap_or_else(|p| p.into_inner());
    host.0 = host.0.saturating_sub(1);
}

/// The host's nftables tables named `kube-proxy` (`table ip kube-proxy`, `table ip6
/// kube-proxy`): kube-proxy's nftables mode writes only those, so a kube-proxy that escaped
/// its node's network namespace would show here.
fn host_kube_proxy_tables() -> Vec<String> {
    std::process::Command::new("nft")
        .args(["list", "tables"])
        .output()
        .map(|out| {
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter(|l| l.trim_end().ends_with(" kube-proxy"))
                .map(|l| l.trim().to_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Standard node paths and kube-proxy tables that appeared on the host, and host-wide sysctls
/// the kubelet sets ([`KERNEL_TUNABLES`]) that changed, since the first real node of this
/// process started; empty when the nodes kept to their namespaces. While a real
/// node runs, that is reported as the first line: the check means something only once every
/// node stopped.
pub fn host_residue() -> Vec<String> {
    let host = HOST.lock().unwrap_or_else(|p| p.into_inner());
    if host.0 > 0 {
        return vec![format!(
            "{} real node(s) still running in this process",
            host.0
        )];
    }
    let Some(before) = host.1.as_ref() else {
        return Vec::new();
    };
    let mut left: Vec<String> = HOST_PATHS
        .iter()
        .map(PathBuf::from)
        .filter(|p| p.exists() && !before.paths.contains(p))
        .map(|p| format!("host path {}", p.display()))
        .collect();
    left.extend(
        host_kube_proxy_tables()
            .into_iter()
            .filter(|t| !before.tables.contains(t))
            .map(|t| format!("host nftables {t}")),
    );
    let show = |v: &Option<String>| v.clone().unwrap_or_else(|| "(none)".into());
    left.extend(
        before
            .sysctls
            .iter()
            .zip(host_sysctls())
            .filter(|((_, was), (_, now))| was != now)
            .map(|((name, was), (_, now))| {
                format!("sysctl {name}: {} → {}", show(was), show(&now))
            }),
    );
    left
}

type Job = Box<dyn FnOnce() + Send>;

fn spawner_gone() -> Error {
    Error::RealNode {
        part: "the node's spawner thread",
        detail: "it is gone (the node was stopped, or the thread panicked)".into(),
    }
}

/// A thread that lives as long as the node and spawns its daemons: PDEATHSIG fires when the
/// *thread* that forked a child exits, so the daemons must not be forked from a test's
/// short-lived runtime thread.
struct Spawner {
    tx: mpsc::Sender<Job>,
    thread: std::thread::JoinHandle<()>,
}

impl Spawner {
    fn start() -> Result<Self, Error> {
        let (tx, rx) = mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name("meshgate-node".into())
            .spawn(move || {
                for job in rx {
                    job();
                }
            })
            .map_err(|e| Error::io("spawning the real node's thread", e))?;
        Ok(Self { tx, thread })
    }

    fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> Result<T, Error> {
        let (rtx, rrx) = mpsc::channel();
        self.tx
            .send(Box::new(move || {
                let _ = rtx.send(f());
            }))
            .map_err(|_| spawner_gone())?;
        rrx.recv().map_err(|_| spawner_gone())
    }

    fn shutdown(self) {
        drop(self.tx);
        let _ = self.thread.join();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn task_pid_is_read_from_ctr_tasks_ls() {
        let out = "TASK                                                                PID      STATUS    \n\
                   4f1c2d0e9b                                                          12345    RUNNING\n\
                   9a8b7c                                                              0        STOPPED\n";
        assert_eq!(parse_task_pid(out, "4f1c2d0e9b"), Some(12345));
        assert_eq!(parse_task_pid(out, "9a8b7c"), None);
        assert_eq!(parse_task_pid(out, "4f1c"), None);
    }

    /// What a SIGKILLed test run leaves (its daemons died by PDEATHSIG, its pods and mounts
    /// did not) is removed by the next run's sweep: the process in the node's cgroups, the
    /// mount, the bridge, the node's network namespace and veth, the cgroups and the
    /// directory. Needs root, like every real-node test.
    #[test]
    fn a_dead_runs_leftovers_are_swept() {
        crate::harness::paths::require_root().expect("the real-node sweep test needs root");
        let base = tempfile::tempdir_in("/dev/shm").unwrap();
        let dir = tempfile::Builder::new()
            .prefix(DIR_PREFIX)
            .tempdir_in(base.path())
            .unwrap()
            .keep();
        // The owner: a process that has exited, recorded with its start time while it lived.
        let mut owner = std::process::Command::new("/bin/sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let owner_pid = owner.id() as i32;
        let owner_start = process::start_time(owner_pid).unwrap();
        owner.kill().unwrap();
        owner.wait().unwrap();
        std::fs::write(dir.join("owner"), format!("{owner_pid} {owner_start}\n")).unwrap();

        let fp = Footprint::of(&dir);
        // A pod's process in the node's cgroups (one hierarchy is enough), reaped by a thread.
        let hierarchies = cgroup_hierarchies();
        let hierarchy = hierarchies
            .iter()
            .find(|h| h.ends_with("pids"))
            .or(hierarchies.first())
            .expect("a cgroup hierarchy")
            .clone();
        let cg = hierarchy
            .join(fp.cgroup_root.trim_start_matches('/'))
            .join("kubepods");
        std::fs::create_dir_all(&cg).unwrap();
        let mut pod = std::process::Command::new("/bin/sleep")
            .arg("300")
            .spawn()
            .unwrap();
        std::fs::write(cg.join("cgroup.procs"), pod.id().to_string()).unwrap();
        let reaper = std::thread::spawn(move || pod.wait());
        // A mount (a rootfs or netns left mounted) and the bridge.
        let mnt = dir.join("containerd/state/mnt");
        std::fs::create_dir_all(&mnt).unwrap();
        nix::mount::mount(
            Some("tmpfs"),
            &mnt,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )
        .unwrap();
        let added = std::process::Command::new("ip")
            .args(["link", "add", &fp.bridge, "type", "bridge"])
            .status()
            .unwrap();
        assert!(added.success());
        // The node's network: its namespace pinned in the run dir, the veth and the route.
        let net = fp.add_network().unwrap();
        let pod_route = || {
            let out = std::process::Command::new("ip")
                .args(["route", "show", &format!("{}/24", net.pod_net)])
                .output()
                .unwrap();
            String::from_utf8_lossy(&out.stdout).trim().to_owned()
        };
        // Each kind of leftover is there before the sweep, so its absence after it counts.
        assert!(
            pod_route().contains(&fp.veth),
            "no pod route: {:?}",
            pod_route()
        );
        let before = fp.residue();
        for want in [
            format!("directory {}", dir.display()),
            format!("mount {}", mnt.display()),
            format!("mount {}", fp.netns_pin.display()),
            format!("bridge {}", fp.bridge),
            format!("veth {}", fp.veth),
            format!(
                "cgroup {}",
                hierarchy
                    .join(fp.cgroup_root.trim_start_matches('/'))
                    .display()
            ),
        ] {
            assert!(before.contains(&want), "{want} missing from {before:?}");
        }

        sweep_stale(base.path());

        assert_eq!(fp.residue(), Vec::<String>::new());
        assert_eq!(pod_route(), "", "the pod route outlived its veth");
        let status = reaper.join().unwrap().unwrap();
        assert!(
            !status.success(),
            "the pod's process was killed: {status:?}"
        );
    }

    #[test]
    fn mount_paths_are_unescaped() {
        assert_eq!(unescape_mount_path("/a\\040b/c"), PathBuf::from("/a b/c"));
    }

    /// Real entries, captured from `/var/lib/cni/results` while the real-node test ran pods
    /// through containerd 2.4.2: the primary conflist with istio-cni chained, a lone `.conf`
    /// (libcni wraps it in a list), and containerd's loopback network.
    const CACHED_CHAIN: &str =
        "meshgate-e2e-0322db0f69645918e80030007968ab5cb4f3cfd60def221d91622f6e47b38f60-eth0";
    const CACHED_LONE: &str =
        "lone-41dd11e953eae272521ffcb4835d2fec046790da37dc1dd9aead70f07eddad77-eth0";
    const CACHED_LO: &str =
        "cni-loopback-41dd11e953eae272521ffcb4835d2fec046790da37dc1dd9aead70f07eddad77-lo";

    fn testdata(name: &str) -> Vec<u8> {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("testdata/cni-cache")
            .join(name);
        std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    #[test]
    fn a_cached_attachment_names_the_chain_that_ran() {
        let a = CachedAttachment::parse(&testdata(CACHED_CHAIN)).unwrap();
        assert_eq!(a.network_name, "meshgate-e2e");
        assert_eq!(
            a.container_id,
            "0322db0f69645918e80030007968ab5cb4f3cfd60def221d91622f6e47b38f60"
        );
        assert_eq!(a.if_name, "eth0");
        assert_eq!(a.plugins, ["bridge", "portmap", "istio-cni"]);
        assert_eq!(a.file_name(), CACHED_CHAIN);
        assert_eq!(a.cni_arg("K8S_POD_NAME"), Some("chain-1"));
        assert_eq!(
            a.cni_arg("K8S_POD_UID"),
            Some("488be5de-7edb-4e9e-b522-6b99564a4eb9")
        );
        assert_eq!(
            a.cni_arg("K8S_POD_INFRA_CONTAINER_ID"),
            Some(a.container_id.as_str())
        );
        assert_eq!(a.cni_arg("K8S_POD_IP"), None);
        assert_eq!(a.ips, ["10.200.82.3/24"]);
        // The config is the conflist's bytes as written (pretty-printed by edit_plugins).
        assert!(a.config.starts_with(b"{\n  \"cniVersion\": \"1.0.0\""));
        let conf: serde_json::Value = serde_json::from_slice(&a.config).unwrap();
        assert_eq!(conf["plugins"][2]["native_nftables"], false);

        let lone = CachedAttachment::parse(&testdata(CACHED_LONE)).unwrap();
        assert_eq!(
            (lone.network_name.as_str(), lone.plugins.as_slice()),
            ("lone", &["bridge".to_owned()][..])
        );
        let conf: serde_json::Value = serde_json::from_slice(&lone.config).unwrap();
        assert_eq!(
            conf["plugins"][0]["name"], "lone",
            "the .conf itself, wrapped"
        );

        let lo = CachedAttachment::parse(&testdata(CACHED_LO)).unwrap();
        assert_eq!(
            (lo.network_name.as_str(), lo.if_name.as_str()),
            ("cni-loopback", "lo")
        );
        assert_eq!(lo.plugins, ["loopback"]);
        assert_eq!(lo.ips, ["127.0.0.1/8", "::1/128"]);
    }

    #[test]
    fn what_libcni_does_not_write_is_refused() {
        let good: serde_json::Value = serde_json::from_slice(&testdata(CACHED_CHAIN)).unwrap();
        let with = |edit: &dyn Fn(&mut serde_json::Value)| {
            let mut v = good.clone();
            edit(&mut v);
            CachedAttachment::parse(v.to_string().as_bytes())
                .map(|a| a.plugins)
                .map_err(|e| e.to_string())
        };
        assert!(with(&|_| ()).is_ok());
        let b64 = |s: &str| {
            use base64::Engine as _;
            base64::engine::general_purpose::STANDARD.encode(s)
        };
        // A single network (`AddNetwork`) is its own one-plugin chain.
        assert_eq!(
            with(&|v| v["config"] = b64(r#"{"name":"n","type":"ptp"}"#).into()),
            Ok(vec!["ptp".to_owned()])
        );
        for (what, edit, err) in [
            (
                "legacy kind",
                Box::new(|v: &mut serde_json::Value| v["kind"] = "".into())
                    as Box<dyn Fn(&mut serde_json::Value)>,
                "kind",
            ),
            (
                "no network",
                Box::new(|v| v["networkName"] = serde_json::Value::Null),
                "networkName",
            ),
            (
                "no container",
                Box::new(|v| v["containerId"] = "".into()),
                "containerId",
            ),
            (
                "no ifname",
                Box::new(|v| v["ifName"] = serde_json::Value::Null),
                "ifName",
            ),
            (
                "not base64",
                Box::new(|v| v["config"] = "not base64!".into()),
                "base64",
            ),
            (
                "not JSON config",
                Box::new(|v| v["config"] = b64("{").into()),
                "not a JSON config",
            ),
            (
                "a plugin without type",
                Box::new(|v| v["config"] = b64(r#"{"plugins":[{"type":"bridge"},{}]}"#).into()),
                "no type",
            ),
            (
                "neither",
                Box::new(|v| v["config"] = b64(r#"{"name":"n"}"#).into()),
                "neither",
            ),
            (
                "bad args",
                Box::new(|v| v["cniArgs"] = serde_json::json!([["K8S_POD_UID"]])),
                "cniArgs",
            ),
        ] {
            let got = with(&*edit);
            assert!(
                got.as_ref().is_err_and(|e| e.contains(err)),
                "{what}: {got:?}"
            );
        }
        assert!(CachedAttachment::parse(b"not json").is_err());
    }

    #[test]
    fn a_pods_attachments_are_found_by_its_uid() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            attachments_of(dir.path(), "x").unwrap(),
            vec![],
            "no results dir yet"
        );
        let results = dir.path().join("results");
        std::fs::create_dir(&results).unwrap();
        for name in [CACHED_CHAIN, CACHED_LONE, CACHED_LO] {
            std::fs::write(results.join(name), testdata(name)).unwrap();
        }
        // Entries libcni would not have written for an attachment are skipped: garbage, and
        // an entry under another attachment's name.
        std::fs::write(results.join("junk-1-eth0"), "{").unwrap();
        std::fs::write(results.join("other-1-eth0"), testdata(CACHED_CHAIN)).unwrap();
        let chain1 = attachments_of(dir.path(), "488be5de-7edb-4e9e-b522-6b99564a4eb9").unwrap();
        assert_eq!(
            chain1.iter().map(|a| a.file_name()).collect::<Vec<_>>(),
            [CACHED_CHAIN]
        );
        let lone = CachedAttachment::parse(&testdata(CACHED_LONE)).unwrap();
        let uid = lone.cni_arg("K8S_POD_UID").unwrap();
        let both = attachments_of(dir.path(), uid).unwrap();
        assert_eq!(
            both.iter().map(|a| a.file_name()).collect::<Vec<_>>(),
            [CACHED_LO, CACHED_LONE],
            "loopback and eth0 of one sandbox, in file-name order"
        );
        assert_eq!(attachments_of(dir.path(), "no-such-pod").unwrap(), vec![]);
    }

    #[test]
    fn istio_cni_entry_has_the_installer_fields() {
        let e = istio_cni_entry(Path::new("/run/istio-cni"), true);
        assert_eq!(e["type"], "istio-cni");
        assert_eq!(e["cni_agent_run_dir"], "/run/istio-cni");
        assert_eq!(e["native_nftables"], true);
        assert_eq!(e["ambient_enabled"], false);
        assert!(e.get("cniVersion").is_none());
    }
}
